"""A daemon's file descriptors against connections that never finish their handshake
(connect and send nothing, a partial greeting, a CurveZMQ greeting without the job's keys):
each holds one of the daemon's descriptors until the server drops it. Anyone who reaches
the port can open them; the daemon must outlive them, drop them soon, and say when it has
run out (the same thing a job with more peers than `ulimit -n` allows sees)."""
from __future__ import annotations

import resource
import socket
import subprocess
import sys
import time

import pytest
import zmq

from psgd import transport
from psgd.config import SecurityConfig
from tests.conftest import free_port_block, kill_all

# A ZMTP 3.0 greeting that asks for CurveZMQ: the HELLO that would follow never comes
CURVE_GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\0" * 32


def open_idle(port: int, n: int, greeting: bytes = b"", every: bool = True) -> list[socket.socket]:
    """n connections to the port (`every`: or as many as it takes before one fails)."""
    conns = []
    for _ in range(n):
        try:
            c = socket.create_connection(("127.0.0.1", port), timeout=2)
        except OSError:
            if every:
                raise
            break
        if greeting:
            c.sendall(greeting)
        conns.append(c)
    return conns


def closed_by_server(c: socket.socket) -> bool:
    """The server has closed the connection (EOF or reset; its greeting bytes read first)."""
    c.settimeout(0.0)
    try:
        while True:
            if c.recv(4096) == b"":
                return True
    except BlockingIOError:
        return False
    except OSError:   # reset
        return True


@pytest.mark.inprocess
@pytest.mark.timeout(60)
def test_unfinished_handshakes_are_dropped_within_the_handshake_interval(tmp_path):
    """An idle connection, a partial greeting and a CurveZMQ greeting without keys were each
    held for ZeroMQ's default 30 s (600 of them: a daemon at 217 descriptors instead of 17)."""
    from psgd.keys import make_keys
    keys = str(tmp_path / "keys")
    make_keys(keys)
    ctx = zmq.Context()
    port = free_port_block(1)
    sock = transport.server_socket(ctx, f"tcp://127.0.0.1:{port}", SecurityConfig(curve=True, keys=keys))
    conns: list[socket.socket] = []
    try:
        conns = (open_idle(port, 10) + open_idle(port, 10, CURVE_GREETING[:10])
                 + open_idle(port, 10, CURVE_GREETING))
        start = time.monotonic()
        while time.monotonic() - start < transport.SERVER_HANDSHAKE_S + 8:
            if all(closed_by_server(c) for c in conns):
                break
            time.sleep(0.5)
        open_ = sum(not closed_by_server(c) for c in conns)
        waited = time.monotonic() - start
        assert open_ == 0, f"{open_} of {len(conns)} unfinished handshakes still held after {waited:.0f} s"
        assert time.monotonic() - start < 20
    finally:
        for c in conns:
            c.close()
        sock.close(0)
        transport.stop_auth(ctx, every=True)
        ctx.term()


def _limit(soft: int, hard: int):
    def set_it() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return set_it


def _hard() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 1 << 30 if hard == resource.RLIM_INFINITY else hard


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_coordinator_outlives_idle_connections_past_its_soft_limit(tmp_path):
    """200 connections that send nothing, to a coordinator under a soft limit of 64 open files
    (a hard one far above): it ran out of descriptors, could not write its state file, and
    exited 73, ending the job. It raises its soft limit to the hard one at its start."""
    if _hard() < 1024:
        pytest.skip("needs a hard limit of 1,024 open files or more")
    port = free_port_block(2)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "psgd", "coordinator", "--out", str(out), "--set", f"cluster.port={port}",
         "--set", "cluster.workers=1", "--set", "cluster.timeout_s=50"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=_limit(64, min(_hard(), 4096)))
    conns: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while not (out / "coordinator-state.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        conns = open_idle(port, 200, every=False)
        time.sleep(4)   # its state file is written every second
        assert proc.poll() is None, f"exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"
        with open(f"/proc/{proc.pid}/limits") as f:
            soft = next(line.split()[3] for line in f if line.startswith("Max open files"))
        assert int(soft) == min(_hard(), 4096, transport.FD_LIMIT)
    finally:
        for c in conns:
            c.close()
        proc.terminate()
        try:
            proc.wait(timeout=20)
        finally:
            kill_all([proc])
            if proc.stderr:
                proc.stderr.close()


SERVE = """
import resource, sys, time, zmq
resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
from psgd import transport
from psgd.config import SecurityConfig
ctx = zmq.Context()
sock = transport.server_socket(ctx, "tcp://127.0.0.1:%d", SecurityConfig())
service = transport.Service(sock, {}, "the test daemon", role="daemon")
print("serving", flush=True)
until = time.monotonic() + float(sys.argv[1])
while time.monotonic() < until:
    service.poll(50)
sock.close(0)
ctx.term()
print("done", flush=True)
"""


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_daemon_out_of_descriptors_says_so(tmp_path):
    """A daemon that had run out of descriptors said nothing (the job's workers timed out:
    "shard at ... did not answer within cluster.timeout_s"): one line says so, and one
    that it has them again."""
    port = free_port_block(1)
    proc = subprocess.Popen([sys.executable, "-c", SERVE % port, "16"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    conns: list[socket.socket] = []
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "serving\n"
        conns = open_idle(port, 80, every=False)   # past its 48; the rest wait in the kernel's queue
        time.sleep(4)
        for c in conns:
            c.close()
        out, err = proc.communicate(timeout=40)
    finally:
        kill_all([proc])
    assert proc.returncode == 0 and out == "done\n", err
    lines = [line for line in err.splitlines() if "file descriptors" in line]
    assert len(lines) == 2, err
    assert "out of file descriptors" in lines[0] and "ulimit -n" in lines[0] and "48" in lines[0], lines[0]
    assert "again" in lines[1], lines[1]
