"""Shared fixtures: free ports, and a check that no test leaves a process behind."""
from __future__ import annotations

import os
import signal
import socket
import time

import pytest


def children(pid: int) -> set[int]:
    """Direct children of pid, from /proc."""
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(name))
    return out


@pytest.fixture(autouse=True)
def no_leaked_processes():
    before = children(os.getpid())
    yield
    deadline = time.monotonic() + 10
    while True:
        leaked = children(os.getpid()) - before
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not leaked, f"test left processes running: {sorted(leaked)}"


def free_port_block(n: int) -> int:
    from psgd.launcher import pick_port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    return pick_port("127.0.0.1", base, n)


@pytest.fixture
def port_block():
    return free_port_block


def kill_all(procs) -> None:
    """Kill and reap every process still running (test clean-up)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
