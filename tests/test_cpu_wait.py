"""summary.json's cpu_wait_fraction: how much of the time the workers' training threads
could run they spent waiting for a CPU. A job that shares its cores with other processes
says so, and `psgd run` warns that its times show that load."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from psgd.metrics import cpu_times

pytestmark = pytest.mark.processes


@pytest.mark.timeout(180)
@pytest.mark.skipif(not any(cpu_times() or ()), reason="the kernel keeps no run and wait times per thread here")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a job that fits its cores needs two")
def test_a_job_beside_busy_processes_on_its_cpus_says_its_workers_waited(tmp_path):
    """A one-worker job on two CPUs (its worker and shard fit them: psgd run gives no
    warning of its own processes) beside two processes that only compute on those CPUs."""
    cpus = set(sorted(os.sched_getaffinity(0))[:2])
    pinned = lambda: os.sched_setaffinity(0, cpus)   # noqa: E731  (the child, and every process it starts)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pinned) for _ in cpus]
    try:
        r = subprocess.run([sys.executable, "-m", "psgd", "run", "--mode", "sync", "--workers", "1", "--servers", "1",
                            "--set", "cluster.evaluator=false", "--set", "train.steps=200", "--out",
                            str(tmp_path / "out"), "--quiet"], capture_output=True, text=True, timeout=170,
                           preexec_fn=pinned)
    finally:
        for p in busy:
            p.kill()
            p.wait(10)
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "out" / "summary.json") as f:
        share = json.load(f)["cpu_wait_fraction"]
    assert 0.1 <= share <= 1, share
    assert "busy processes" not in r.stderr   # (the job's own fit its CPUs: no warning of them)
    assert (f"psgd run: warning: its workers waited for a CPU {100 * share:.0f} % of the time they could run "
            f"(summary.json's cpu_wait_fraction): other programs held the cores") in r.stderr, r.stderr
