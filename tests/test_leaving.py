"""A worker that gives up on a shard it cannot reach says why (`leaving`), and a job that
ends with its workers gone names the shard."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import zmq

from psgd import wire
from psgd.config import Config, load
from psgd.launcher import LaunchError, LocalJob
from psgd.membership import Membership
from psgd.servers.coordinator import Coordinator
from tests.conftest import free_port_block
from tests.test_reliability import FAST_HB, child, wait_for_steps

UNREACHABLE = "shard at tcp://127.0.0.1:9 did not answer within cluster.timeout_s = 5 s"


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_job_whose_workers_gave_up_on_a_shard_names_it(tmp_path, capsys):
    """Both workers gave up on a shard that did not answer and exited: the job ended
    "all 2 workers were lost (stopped heartbeating) and none finished", the shard never
    named. A worker's last heartbeat now says why it stops (`leaving`), and the abort
    says it, once for the ranks that said the same."""
    cfg = Config().replace(**{"cluster.workers": 2, "cluster.port": free_port_block(3), "cluster.evaluator": False})
    ctx = zmq.Context()
    c = Coordinator(cfg, str(tmp_path), ctx=ctx, quiet=True)
    c.service.close()
    ctx.term()
    try:
        def serve(op: str, **kw) -> wire.Message:
            return [wire.decode(f) for _, f in c.service._serve(b"x", wire.encode(op, id=1, **kw))][-1]

        for r in range(2):
            c.service._serve(b"x", wire.encode("register", id=1, role="worker", want_rank=r, nonce=f"n{r}"))
        assert c.phase == "training"
        for r in range(2):
            serve("heartbeat", rank=r, clock=10, role="worker", index=r, nonce=f"n{r}", live_id="",
                  stats={"samples": 320, "wait_s": 5.0}, leaving=f"worker {r}: {UNREACHABLE}")
        assert c.members.members[1].left == f"worker 1: {UNREACHABLE}"
        assert c.members.stats()[1]["wait_s"] == 5.0   # its last counters came with it
        again = Membership(2, timeout_s=5.0)
        again.load_state_dict(json.loads(json.dumps(c.members.state_dict())), now=0.0)
        assert again.members[0].left == f"worker 0: {UNREACHABLE}"   # (a restarted coordinator keeps it)
        for m in c.members.members.values():
            m.last_seen -= 100
        c._tick(time.monotonic())
    finally:
        c.events.close()
    want = f"all 2 workers were lost (stopped heartbeating) and none finished; workers 0, 1 gave up: {UNREACHABLE}"
    assert c.phase == "done" and c.abort == want
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["aborted"] == want and summary["failures"]["workers_gone"] == 2
    assert f"worker 1 gave up, leaving its share unfinished: {UNREACHABLE}" in capsys.readouterr().err


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_new_process_for_the_rank_forgets_why_the_last_one_left():
    m = Membership(2, timeout_s=5.0)
    for r in range(2):
        m.join(0.0, r, nonce=f"n{r}")
    assert m.leaving(1, "worker 1: gone") and not m.leaving(5, "no such rank")
    m.expire(10.0)
    assert m.members[1].left == "worker 1: gone"
    m.join(11.0, 1, nonce="new")
    assert m.members[1].left == ""


def continue_after(coordinator, stopped) -> threading.Thread:
    """A thread that sends SIGCONT to the `stopped` process once the coordinator's process
    has exited (or, at the latest, after 150 s)."""
    def watch() -> None:
        deadline = time.monotonic() + 150
        while coordinator.proc.poll() is None and stopped.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if stopped.poll() is None:
            stopped.send_signal(signal.SIGCONT)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_a_job_whose_shard_stopped_answering_names_it(tmp_path):
    """A real job whose shard 1 is stopped (SIGSTOP: alive, silent) and not restarted:
    both workers give up on it after cluster.timeout_s and exit 1. The job ended "all 2
    workers were lost ... and none finished"; now its error and summary.json name the
    shard's address."""
    cfg = load(None, [f"cluster.port={free_port_block(8)}", "cluster.timeout_s=5", "train.steps=100000",
                      "faults.step_delay_s=0.002"] + FAST_HB, env={})
    j = LocalJob(cfg, str(tmp_path / "run"), quiet=True, timeout_s=200)
    shard, waking = None, None
    try:
        j.start()
        wait_for_steps(j, 0, 20)
        shard = child(j, "server-1").proc
        shard.send_signal(signal.SIGSTOP)
        # Once the coordinator has ended the job and exited, the shard goes on (and exits): j.wait()
        # would otherwise wait out the launcher's 10 s for the daemons after the coordinator's exit
        waking = continue_after(child(j, "coordinator-0"), shard)
        with pytest.raises(LaunchError) as e:
            j.wait()
    finally:
        if shard is not None:
            shard.send_signal(signal.SIGCONT)
        if waking is not None:
            waking.join(timeout=10)
        j.stop()
    said = f"shard at {cfg.shard_address(1)} did not answer within cluster.timeout_s = 5 s"
    assert said in str(e.value), str(e.value)
    s = json.load(open(os.path.join(j.out, "summary.json")))
    assert s["aborted"].startswith("all 2 workers were lost") and said in s["aborted"], s["aborted"]
