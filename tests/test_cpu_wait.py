"""summary.json's cpu_wait_fraction: how much of the time the workers' training threads
could run they spent waiting for a CPU. A job that shares its cores with other processes
says so, and `psgd run` warns that its times show that load."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from psgd.launcher import available_cores
from psgd.metrics import cpu_times


@pytest.mark.processes
@pytest.mark.timeout(180)
@pytest.mark.skipif(not any(cpu_times() or ()), reason="the kernel keeps no run and wait times per thread here")
@pytest.mark.skipif(available_cores() < 2, reason="a job that fits its cores needs two")
def test_a_job_beside_busy_processes_on_its_cpus_says_its_workers_waited(tmp_path):
    """A one-worker job on two CPUs (its worker and shard fit them: psgd run gives no
    warning of its own processes) beside two processes that only compute on those CPUs."""
    cpus = set(sorted(os.sched_getaffinity(0))[:2])
    pinned = lambda: os.sched_setaffinity(0, cpus)   # noqa: E731  (the child, and every process it starts)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pinned) for _ in cpus]
    try:
        r = subprocess.run([sys.executable, "-m", "psgd", "run", "--mode", "sync", "--workers", "1", "--servers", "1",
                            "--set", "cluster.evaluator=false", "--set", "train.steps=2000", "--out",
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
    assert (f"psgd run: warning: its workers waited for a CPU {100 * share:.0f}% of the time they could run "
            f"(summary.json's cpu_wait_fraction): processes other than its shards") in r.stderr, r.stderr


@pytest.mark.inprocess
def test_a_workers_cpu_times_are_its_training_threads_since_training_began(tmp_path, monkeypatch):
    """Counted from `start` on the thread that trains, read from any thread (the heartbeats'),
    kept once that thread has ended, carried over where a script's steps move to another
    thread, and never a step back (a thread id used again)."""
    import threading

    import psgd.metrics as module
    from psgd.metrics import ThreadCpu
    files = {}

    def stat(tid: int, ran: float, waited: float) -> None:
        path = files.setdefault(tid, tmp_path / f"schedstat-{len(files)}")
        path.write_text(f"{int(ran * 1e9)} {int(waited * 1e9)} 9\n")
    monkeypatch.setattr(module, "schedstat_of", lambda tid: str(files.get(tid, tmp_path / "none")))
    cpu = ThreadCpu()                                 # (a worker's: `Worker.cpu`, counted from `start`)
    assert cpu.read() == {}                           # (before training)
    me = threading.get_native_id()
    stat(me, 1.0, 0.5)
    cpu.count()
    stat(me, 3.0, 1.0)
    assert cpu.read() == {"cpu_run_s": 2.0, "cpu_wait_s": 0.5}
    got = []
    t = threading.Thread(target=lambda: got.append(cpu.read()))   # (the heartbeats' thread reads it)
    t.start(), t.join(10)
    assert got == [{"cpu_run_s": 2.0, "cpu_wait_s": 0.5}]
    stat(me, 0.5, 0.2)                                # below its start: another thread of the same id
    assert cpu.read() == {"cpu_run_s": 2.0, "cpu_wait_s": 0.5}
    stat(me, 4.0, 1.5)

    def steps_elsewhere() -> None:                    # a script's steps move to another thread
        other = threading.get_native_id()
        stat(other, 10.0, 10.0)
        cpu.follow()                                  # (its first step there)
        stat(other, 11.0, 10.5)
        cpu.follow()                                  # (and its next: counted on, not begun again)
    t = threading.Thread(target=steps_elsewhere)
    t.start(), t.join(10)
    assert cpu.read() == {"cpu_run_s": 4.0, "cpu_wait_s": 1.5}   # (3 and 1 before, 1 and 0.5 there)
    for path in files.values():                       # that thread has ended: its last read stays
        path.unlink()
    assert cpu.read() == {"cpu_run_s": 4.0, "cpu_wait_s": 1.5}
    assert cpu.share() == 0.2727                      # (summary.json's share: 1.5 of 5.5 s runnable)
