"""`psgd run`'s supervisor (psgd/launcher.py) with stand-in children: real processes that
do no training, so that restarts happen at once."""
from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from psgd.config import load
from psgd.launcher import MAX_RESTARTS, LaunchError, LocalJob
from psgd.transport import EXIT_ADDRESS_IN_USE
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


class StartedJob(LocalJob):
    """Every child touches its --started-file (the last argument) and waits to be stopped."""

    def _argv(self, role: str, *extra: str) -> list[str]:
        code = "import sys, time; open(sys.argv[-1], 'w').close(); time.sleep(60)"
        return [sys.executable, "-c", code, *extra]


@pytest.mark.timeout(60)
def test_start_up_progress_counts_the_children_that_have_started(tmp_path, capsys):
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=1"], env={})
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "worker-0.started").write_text("")  # an earlier job's: not counted
    job = StartedJob(cfg, str(tmp_path), quiet=False, timeout_s=50)
    try:
        job.start()
        deadline = time.monotonic() + 40
        while len(job.started) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
            job.show_started()
    finally:
        job.stop()
    err = capsys.readouterr().err
    assert "[psgd run] started 4/4 processes in" in err, err
    counts = [int(line.split("started ")[1].split("/")[0]) for line in err.splitlines() if "processes" in line]
    assert counts == sorted(counts) and counts[-1] == 4
    assert "--launched-at" in job.children[0].argv


def test_an_explicit_busy_port_is_refused_not_moved(tmp_path):
    base = free_port_block(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))   # the shard's port
        cfg = load(None, [f"cluster.port={base}", "cluster.servers=1", "cluster.workers=1"], env={})
        with pytest.raises(LaunchError, match=f"cluster.port = {base}: port {base + 1} on 127.0.0.1 is in use"):
            LocalJob(cfg, str(tmp_path), quiet=True, port_explicit=True)
        job = LocalJob(cfg, str(tmp_path), quiet=True)   # unset: the launcher chooses another block
        assert job.cfg.cluster.port != base
        assert f"port = {job.cfg.cluster.port}" in (tmp_path / "config.toml").read_text()


class BusyOnceJob(LocalJob):
    """The first coordinator finds its port taken (exit EXIT_ADDRESS_IN_USE), as when
    another job binds the block between the launcher's check and the daemon's bind; the
    second one runs."""

    def _argv(self, role: str, *extra: str) -> list[str]:
        if role == "coordinator" and self.moves == 0:
            return [sys.executable, "-c", f"import sys; print('port taken', file=sys.stderr); "
                                          f"sys.exit({EXIT_ADDRESS_IN_USE})"]
        return [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.mark.timeout(60)
def test_a_job_whose_chosen_ports_are_taken_moves_to_another_block(tmp_path, capsys):
    base = free_port_block(3)
    cfg = load(None, [f"cluster.port={base}", "cluster.servers=1", "cluster.workers=1"], env={})
    job = BusyOnceJob(cfg, str(tmp_path), quiet=False, timeout_s=2)
    try:
        job.start()
        with pytest.raises(LaunchError, match="did not finish within"):  # the stand-ins never end
            job.wait()
    finally:
        job.stop()
    assert job.moves == 1 and job.cfg.cluster.port != base
    assert f"moved the job to {job.cfg.cluster.port}" in capsys.readouterr().err
    assert f"port = {job.cfg.cluster.port}" in (tmp_path / "config.toml").read_text()
