"""A shard killed with -9 and restarted: what its checkpoints hold and what it resumes."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from psgd.config import load
from psgd.shard import Shard
from tests.test_reliability import child, job, wait_for_steps


def kill_and_restart(j, name: str, after: tuple[int, int], sig: int = signal.SIGKILL) -> dict:
    """Run the job, kill -9 child `name` (or send it `sig`) once worker after[0] has done
    after[1] steps (psgd run restarts it: the supervision runs in `j.wait()`, on a thread
    here), and return the summary."""
    got: dict = {}

    def supervise():
        try:
            got["summary"] = j.wait()
        except Exception as e:  # noqa: BLE001 (said by the assertion below)
            got["error"] = e

    try:
        j.start()
        wait_for_steps(j, *after)
        supervisor = threading.Thread(target=supervise, daemon=True)
        supervisor.start()
        child(j, name).proc.send_signal(sig)
        supervisor.join(200)
        assert "summary" in got, got.get("error", "the job did not end")
        return got["summary"]
    finally:
        j.stop()


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_a_shard_killed_in_a_resumed_run_before_its_first_checkpoint_counts_this_runs_counters(tmp_path):
    """A run resumed from an interrupted job's checkpoints counts from zero (`new_run`),
    but a shard killed before it wrote a checkpoint of this run came back with the
    interrupted run's counters (here 77 bad messages and 55 dropped gradients), and
    summary.json reported them as this run's. A resumed shard now checkpoints at once."""
    cfg = load(None, ["cluster.servers=2"], env={})
    for i in range(2):
        earlier = Shard(cfg, i)
        earlier.counters["bad_messages"] = 77
        earlier.rule.barrier.dropped = 55
        earlier.save(str(tmp_path / "run" / "checkpoints" / f"shard-{i}.pt"))
    # checkpoint.every_s is 10 s (the default): the job is done before a periodic one
    j = job(tmp_path, "mode.name=sync", "train.steps=300", "faults.step_delay_s=0.004")
    s = kill_and_restart(j, "server-1", (0, 100))
    assert "resumed from" in open(os.path.join(j.out, "logs", "server-1.log")).read()
    assert s["failures"]["shard_restarts"] == 1, s["failures"]
    assert s["bad_messages"] == 0 and s["dropped_gradients"] == 0, s


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_a_shard_stopped_alone_by_sigterm_is_restarted_and_resumes_its_checkpoint(tmp_path):
    """A shard's SIGTERM (an administrator's kill, an OOM daemon's) checkpointed it and it
    exited 0, which said it had heard of the job's end: psgd run did not restart it, the
    workers waited cluster.timeout_s for it and the job aborted, and the next run into the
    same folder started afresh (the job had ended). It exits 143 now, as the other daemons
    do, and is restarted like one that died, from the checkpoint its SIGTERM wrote."""
    j = job(tmp_path, "mode.name=ssp", "train.steps=300", "faults.step_delay_s=0.004", "cluster.timeout_s=30")
    s = kill_and_restart(j, "server-0", (0, 100), signal.SIGTERM)
    said = open(os.path.join(j.out, "logs", "server-0.log")).read()
    assert "stopped (SIGTERM or Ctrl-C): checkpointing and exiting" in said and "resumed from" in said, said
    assert s["failures"]["shard_restarts"] == 1 and not s.get("aborted"), s
    assert s["final_accuracy"] >= 0.95, s


@pytest.mark.processes
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "easgd"])
def test_a_shard_restarted_without_a_checkpoint_counts_no_bad_message(tmp_path, mode):
    """A shard restarted with nothing to restore refuses every request but `init` with
    `not_ready` until a worker offers its copy (README, Reliability). Those are honest
    requests of the job's own workers and evaluator, but each was counted in
    `bad_messages` (summary.json said 6 for a job that got no bad input)."""
    j = job(tmp_path, f"mode.name={mode}", "train.steps=300", "checkpoint.every_s=0", "faults.step_delay_s=0.004")
    s = kill_and_restart(j, "server-1", (0, 100))
    said = open(os.path.join(j.out, "logs", "server-1.log")).read()
    assert "restarted with nothing to restore: taking the first worker's current copy" in said, said
    assert s["failures"]["shard_restarts"] == 1, s["failures"]
    assert s["rejected"] >= 1, s   # the steps the empty shard refused, as the workers count them
    assert s["bad_messages"] == 0, s
    assert s["final_accuracy"] >= 0.95, s


@pytest.mark.unit
def test_a_shard_that_starts_afresh_does_not_resume_the_earlier_jobs_checkpoint_when_restarted(tmp_path):
    """Under Compose or Slurm each shard checks the set (`_resume` with `whole_set`): with
    shard 0's checkpoint missing, shard 1 started afresh but left its earlier job's one
    in place, and restarted before its first checkpoint of this job (every 10 s) it
    resumed that one alone: a model of two jobs, and its clocks made this job's pushes
    duplicates. The earlier job's checkpoint is now moved aside, as `psgd run` does."""
    from servers.shard_server import ShardServer
    out = str(tmp_path)
    cfg = load(None, ["cluster.servers=2", "train.steps=500"], env={})
    earlier = Shard(cfg, 1)
    earlier.last_clock = {0: 300, 1: 300}
    path = cfg.checkpoint_file(out, 1)
    earlier.save(path)
    server = ShardServer(cfg, 1, out)
    assert not server._resume(Shard(cfg, 1), path, whole_set=True)   # the job starts: shard 0 has none
    restarted = Shard(cfg, 1)
    assert not server._resume(restarted, path)                       # killed, and restarted in this job
    assert restarted.last_clock == {}
    assert os.path.exists(path + ".earlier")
