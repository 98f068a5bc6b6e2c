"""`psgd run`'s supervisor (psgd/launcher.py) with stand-in children: real processes that
do no training, so that restarts happen at once."""
from __future__ import annotations

import os
import sys

import pytest

from psgd.config import load
from psgd.launcher import MAX_RESTARTS, LaunchError, LocalJob
from tests.conftest import free_port_block

pytestmark = pytest.mark.processes


class StandInJob(LocalJob):
    """The coordinator waits to be stopped; every other child says it started and dies."""

    def _argv(self, role: str, *extra: str) -> list[str]:
        if role == "coordinator":
            return [sys.executable, "-c", "import time; time.sleep(60)"]
        return [sys.executable, "-c", f"import sys; print('{role} up', file=sys.stderr); sys.exit(3)"]


def open_descriptors_on(paths: set[str]) -> list[str]:
    """This process's open file descriptors that point at one of paths."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target in paths:
            found.append(target)
    return found


@pytest.mark.timeout(60)
def test_restarts_append_to_one_log_and_leave_no_handle_open(tmp_path):
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=1"], env={})
    job = StandInJob(cfg, str(tmp_path), quiet=True, timeout_s=50)
    try:
        job.start()
        with pytest.raises(LaunchError, match="server-0 keeps dying"):
            job.wait()
        logs = {c.log_path for c in job.children}
        assert len(logs) == 4 and all(logs)  # coordinator, server, worker, evaluator
        # Before the fix every (re)start opened a handle that stayed open: 1 + MAX_RESTARTS
        # for the shard alone, until stop().
        assert open_descriptors_on(logs) == []
    finally:
        job.stop()
    server = next(c for c in job.children if c.role == "server")
    assert server.restarts == MAX_RESTARTS
    with open(server.log_path) as f:
        assert f.read().splitlines() == ["server up"] * (1 + MAX_RESTARTS)  # appended, not truncated
