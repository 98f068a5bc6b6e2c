"""Job membership as a user's jobs meet it: a worker dropped (stopped with SIGSTOP, cut
off) that comes back after the job's training ended, and what the coordinator takes
from it then."""
from __future__ import annotations

import json
import time

import pytest

from psgd.config import Config
from tests.conftest import ask, closed_after, free_port_block, hand_served


def _training(tmp_path, workers: int):
    """A coordinator of `workers` workers (1 shard, no evaluator), all joined, training;
    its config (a coordinator made again with it resumes from its state file)."""
    from tests.test_coordinator_state import coordinator
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": workers, "cluster.servers": 1,
                              "cluster.evaluator": False, "cluster.timeout_s": 60.0})
    first = coordinator(cfg, str(tmp_path))
    for r in range(workers):
        first.members.join(time.monotonic(), r, f"n{r}")
    first._start_training()
    return cfg, first


def step_lines(out, rank: int) -> list[dict]:
    with open(out / "events" / f"worker-{rank}.jsonl") as f:
        return [json.loads(x) for x in f if '"staleness"' in x]


@pytest.mark.inprocess
@pytest.mark.timeout(120)
def test_a_worker_back_after_training_ended_stops_and_does_not_step_into_the_final_model(tmp_path):
    """A hunt: an async worker stopped (SIGSTOP) mid-run is dropped; the others finish,
    and the coordinator waits for the final evaluation. Continued then, the worker
    trained on: 278 pushes into the model that the evaluator was scoring, after the
    shards' end-of-training checkpoint, then a `finish` that counted those steps in
    summary.json (workers_gone 0, samples over a wall time without them), and exit 0,
    "finished 300 steps". It stops at once, unfinished, exit 1, saying why."""
    from psgd.inprocess import InProcessCluster
    from tests.conftest import train_on_threads
    cfg = Config().replace(**{"cluster.port": free_port_block(2), "cluster.workers": 2, "cluster.servers": 1,
                              "mode.name": "async", "train.steps": 60, "cluster.heartbeat_s": 0.1,
                              "cluster.heartbeat_timeout_s": 0.6, "cluster.timeout_s": 6,
                              # the job has an evaluator (none runs here): the final evaluation waits
                              "cluster.evaluator": True})
    resumed_at: list[float] = []

    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        def stop_rank_1(w):
            if w.want_rank != 1:
                return
            compute = w.compute

            def stopped_once() -> float:
                if w.clock == 5 and not resumed_at:   # the process is stopped: heartbeats too
                    w.link.stop()
                    deadline = time.monotonic() + 60
                    while cluster.coordinator.phase != "final_eval" and time.monotonic() < deadline:
                        time.sleep(0.02)
                    resumed_at.append(time.time())   # ... and continued (SIGCONT)
                    w.link._stop.clear()
                    w.link.start()
                return compute()
            w.compute = stopped_once
        codes = train_on_threads(cfg, str(tmp_path), cluster, stop_rank_1)
        coordinator = cluster.coordinator
        deadline = time.monotonic() + 30   # the summary, without a final score, after cluster.timeout_s
        while coordinator.phase != "done" and time.monotonic() < deadline:
            time.sleep(0.05)
    assert resumed_at, "rank 1 never paused"
    late = [e for e in step_lines(tmp_path, 1) if e["t"] > resumed_at[0]]
    assert len(late) <= 2, f"rank 1 stepped {len(late)} times after the job's training ended"
    assert codes == {0: 0, 1: 1}, codes
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["failures"]["workers_lost"] == 1 and s["failures"]["workers_gone"] == 1, s["failures"]
    assert coordinator.members.members[1].state == "lost"
    assert s["samples"] <= 32 * (60 + len(step_lines(tmp_path, 1)) - len(late)), s["samples"]


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_the_finish_of_a_dropped_worker_after_training_ended_is_refused_and_changes_nothing(tmp_path):
    """A hunt: a worker dropped for missed heartbeats whose finish came after the others
    had finished (the final evaluation under way) was taken: its rank became finished
    (workers_gone 0) and its counters, steps taken after training ended, went into
    summary.json's samples. Refused, saying why; the summary counts the rank as gone."""
    with closed_after(hand_served(workers=2, out=str(tmp_path),
                                  **{"cluster.evaluator": True, "cluster.heartbeat_timeout_s": 1.0})) as c:
        assert ask(c, "finish", rank=0, nonce="n0", clock=10, stats={"samples": 320}).op == "reply"
        c.members.members[1].last_seen -= 100   # rank 1 went silent (stopped)
        c._tick(time.monotonic())
        assert c.members.members[1].state == "lost" and c.phase == "final_eval"
        got = ask(c, "finish", rank=1, nonce="n1", clock=10, stats={"samples": 9999})
        assert got.op == "error" and "was dropped" in got.get("reason"), got
        assert c.members.members[1].state == "lost"
        ask(c, "eval", accuracy=0.9, loss=0.3, final=True, age_s=0.0)
        assert c.summary is not None or c.phase == "settling"
        end = time.monotonic() + 10
        while c.summary is None and time.monotonic() < end:
            c._tick(time.monotonic())
            time.sleep(0.02)
        s = c.summary
        assert s["failures"]["workers_gone"] == 1 and s["samples"] == 320, (s["failures"], s["samples"])


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_restarted_coordinator_does_not_wait_for_a_rank_lost_before_its_restart(tmp_path):
    """A hunt: worker 2 killed (lost, dropped by the coordinator), then the coordinator
    killed and restarted (psgd run, Compose). When the other workers finished, the job
    sat silent until cluster.timeout_s after the restart (the restarted coordinator's
    wait for workers stopped with it) before its final evaluation, waiting for a rank the
    coordinator before it had already dropped. It waits only for ranks missed since
    its restart."""
    from psgd.servers.coordinator import Coordinator
    from tests.test_coordinator_state import coordinator
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 3, "cluster.servers": 1,
                              "cluster.evaluator": False, "cluster.timeout_s": 60.0})
    first: Coordinator = coordinator(cfg, str(tmp_path))
    for r in range(3):
        first.members.join(time.monotonic(), r, f"n{r}")
    first._start_training()
    first.members.members[2].last_seen -= 100          # worker 2 killed: dropped
    first._checked = -1e9
    first._tick(time.monotonic())
    assert first.members.members[2].state == "lost"
    first._save_state(time.monotonic() + 10)           # ... then the coordinator, restarted
    c = coordinator(cfg, str(tmp_path))
    assert c.restarts == 1
    now = time.monotonic()
    for r in (0, 1):
        c.members.finish(r, now, {"samples": 640}, 20)
    c._checked = -1e9
    c._tick(now)
    assert c.phase == "done" and not c.abort, (c.phase, c.abort)
    assert c.summary["failures"]["workers_gone"] == 1


@pytest.mark.inprocess
@pytest.mark.timeout(30)
@pytest.mark.parametrize("want_rank", [-1, 1])
def test_a_worker_without_a_rank_is_not_called_worker_0_before_it_has_one(capsys, want_rank):
    """`psgd worker` without --rank, with no coordinator answering, logged "[psgd worker-0]
    waiting for the coordinator" and ended "worker 0 could not register": the rank it
    asked for is none, and the coordinator could have given it any."""
    import zmq

    from psgd.membership import CoordinatorLink
    from psgd.transport import PeerTimeout
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.timeout_s": 1.5})
    link = CoordinatorLink(cfg, "worker", max(want_rank, 0), zmq.Context.instance())
    with pytest.raises(PeerTimeout) as e:
        link.register(want_rank)
    said = "worker 1" if want_rank == 1 else "worker"
    assert f"{said} could not register with the coordinator" in str(e.value)
    assert ("worker 0" not in str(e.value) and "worker-0" not in capsys.readouterr().err) if want_rank < 0 else True


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "sync", "easgd"])
def test_a_shard_refuses_updates_once_the_jobs_training_has_ended(mode):
    """A worker the coordinator had dropped (SIGSTOP) that came back during the final
    evaluation still had its in-flight push applied: the final model changed while the
    evaluator scored it, after the shards' end-of-training checkpoint. Once `trained`, a
    shard refuses pushes and elastic offers (answered, not counted as bad messages)."""
    import numpy as np

    from psgd import wire
    from psgd.shard import Shard
    shard = Shard(Config().replace(**{"mode.name": mode, "cluster.workers": 2, "cluster.servers": 1}), 0)
    shard.trained = True
    before = shard.params.detach().clone()
    op, arrays = (("elastic", [shard.params.detach().numpy() + 1]) if mode == "easgd" else
                  ("push", [np.ones(shard.P, np.float32), np.zeros(shard.B, np.float32)]))
    fields = {"round": 1} if op == "elastic" else {"read_version": 0}
    m = wire.decode(wire.encode(op, id=1, rank=1, clock=5, arrays=arrays, **fields))
    (_, reply), = shard.handle(("w", 1), m)
    answer = wire.decode(reply)
    assert answer.op == "error" and answer.get("code") == wire.REFUSED, answer.header
    assert "training has ended" in answer.get("reason")
    assert bool((shard.params == before).all()) and shard.counters["bad_messages"] == 0


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_training_script_left_behind_is_told_so_by_a_job_error(monkeypatch):
    """A review: a `psgd.connect` script dropped by the coordinator (stopped) that came back
    after training ended saw step() return False as for a spent budget, and close() send a
    finish the coordinator refused, then return: exit 0, no model.pt, no word. It is now a
    JobError saying why, and no finish is sent."""
    from types import SimpleNamespace

    from psgd.connection import Connection, JobError
    c = Connection.__new__(Connection)
    c.cfg, c.rank, c.clock, c.reported = Config(), 1, 40, False
    c.link = SimpleNamespace(state={"phase": "final_eval"})
    ended = []
    monkeypatch.setattr(c, "_end", lambda error, reported=False: ended.append((error, reported)))
    with pytest.raises(JobError, match="the job's training ended while the coordinator had this worker dropped"):
        c._raise_if_aborted()
    assert ended and ended[0][1] is True and "stopping with its share unfinished" in ended[0][0]


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_coordinator_restarted_twice_waits_for_the_workers_stopped_with_it(tmp_path):
    """A review: a coordinator restarted (the whole stack stopped, `compose stop`) waits
    for the ranks live when it died; restarted again within that wait (no worker back
    yet: all lost), it waited for none of them and aborted at once, "all workers were
    lost", where the next `compose start` resumes the job. With none live when it died,
    it waits for the lost ranks."""
    from tests.test_coordinator_state import coordinator
    cfg, first = _training(tmp_path, 2)
    first._save_state(time.monotonic())                # stopped with both workers
    again = coordinator(cfg, str(tmp_path))
    for r in range(2):
        again.members.members[r].last_seen -= 100       # none came back: dropped, waited for
    again._checked = -1e9
    again._tick(time.monotonic())
    assert not again.abort and [m.state for m in again.members.members.values()] == ["lost", "lost"]
    again._save_state(time.monotonic() + 10)           # ... stopped again
    c = coordinator(cfg, str(tmp_path))
    assert c.restarts == 2
    c._checked = -1e9
    c._tick(time.monotonic())
    assert not c.abort and c.phase == "training", (c.phase, c.abort)


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_reconnect_that_raises_does_not_end_the_heartbeats(monkeypatch, capsys):
    """helper K: an unanswered heartbeat reconnects, and a reconnect that raised anything
    but a ZMQError (a CurveZMQ key file cut short, read again) ended the heartbeat thread:
    the coordinator then dropped the live daemon for silence."""
    import zmq

    from psgd.membership import CoordinatorLink
    from psgd.transport import Peers
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.heartbeat_s": 0.1,
                              "cluster.heartbeat_timeout_s": 0.5, "cluster.timeout_s": 60.0})

    tried = []

    def broken(self, i):
        tried.append(i)
        raise ValueError("client.key_secret: cut short")
    monkeypatch.setattr(Peers, "reconnect", broken)
    link = CoordinatorLink(cfg, "worker", 0, zmq.Context.instance())
    link.start()
    try:
        # unanswered beats (an answer is awaited 2 s: `beat_answer_s`), each followed by a
        # reconnect that raises; a second one is the thread going on after the first
        deadline = time.monotonic() + 20
        while len(tried) < 2 and link._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(tried) >= 2 and link._thread.is_alive(), tried
    finally:
        link.stop()
    said = capsys.readouterr().err
    assert "reconnecting to the coordinator failed (ValueError: client.key_secret: cut short)" in said


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_coordinator_restarted_during_rank_0s_hold_does_not_wait_for_a_rank_lost_long_before(tmp_path):
    """A review: rank 2 dropped mid-job, ranks 0 and 1 finished, the coordinator killed while
    rank 0 held the job's end (saving model.pt): none live at the restart, so it waited for
    every lost rank, rank 2 too, and the finished job sat in `training` for cluster.timeout_s
    (in its wall_s). It waits for the ranks live when it died and those its last life awaited."""
    from tests.test_coordinator_state import coordinator
    cfg, first = _training(tmp_path, 3)
    first.members.members[2].last_seen -= 100          # worker 2 dropped long ago
    first._checked = -1e9
    first._tick(time.monotonic())
    assert first.members.members[2].state == "lost"
    now = time.monotonic()
    for r in (0, 1):
        first.members.finish(r, now, {"samples": 640}, 20)
    first.held_until, first.holder = now + 30, 0       # rank 0 saving model.pt
    first._save_state(time.monotonic() + 10)           # coordinator killed during the hold
    c = coordinator(cfg, str(tmp_path))
    assert c.awaited == set()
    c.held_until, c.holder = 0.0, None                 # rank 0 lets go
    c._checked = -1e9
    c._tick(time.monotonic())
    assert c.phase == "done" and not c.abort, (c.phase, c.abort)


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_restarted_coordinator_stops_awaiting_a_rank_once_it_is_heard(tmp_path):
    """Helper F: the coordinator restarted with both workers live (a shard and it killed);
    both beat to it, then worker 1 died and worker 0 finished: the job sat in `training`,
    "live 0/2", until cluster.timeout_s after the restart (wall_s 67.5 s against 30 s of
    training), though README says it waits only for ranks it missed. A rank heard after the
    restart is no longer awaited."""
    from psgd import wire
    from tests.test_coordinator_state import coordinator
    cfg, first = _training(tmp_path, 2)
    first._save_state(time.monotonic())                # killed with both workers live
    c = coordinator(cfg, str(tmp_path))
    assert c.awaited == {0, 1}
    for r in range(2):                                 # both reach the restarted coordinator
        c.on_heartbeat(f"w{r}".encode(), wire.Message("heartbeat", id=1, rank=r, clock=3,
                                                      fields={"role": "worker", "nonce": f"n{r}"}))
    assert c.awaited == set()
    c.members.members[1].last_seen -= 100              # worker 1 dies
    c.members.finish(0, time.monotonic(), {"samples": 640}, 20)
    c._checked = -1e9
    c._tick(time.monotonic())
    assert c.members.members[1].state == "lost"
    assert c.phase != "training" and not c.abort, (c.phase, c.abort)


@pytest.mark.inprocess
@pytest.mark.timeout(120)
def test_a_refusal_as_a_worker_rejoins_is_a_refused_step_not_the_jobs_end(tmp_path):
    """A review: a worker back from a partition rejoins (`schedule.rejoin`) outside the
    handling of a refused step: a shard's refusal there ended the worker with an error,
    and the job with it. It is
    counted as a refused step now, and training goes on."""
    from psgd import wire
    from psgd.inprocess import InProcessCluster
    from tests.conftest import train_on_threads
    cfg = Config().replace(**{"cluster.port": free_port_block(2), "cluster.workers": 2, "cluster.servers": 1,
                              "mode.name": "async", "train.steps": 20, "cluster.evaluator": False,
                              "cluster.timeout_s": 20})
    seen: dict = {}

    def refuse_one_rejoin(w) -> None:
        if w.want_rank != 0:
            return
        attach = w.attach

        def attached(*args, **kwargs):
            schedule = attach(*args, **kwargs)
            rejoin = schedule.rejoin

            def refused(worker) -> None:
                if worker.clock != 5:   # (the schedule's start rejoins too)
                    return rejoin(worker)
                raise wire.Refused(wire.REFUSED, "shard 0 is past this worker's clock", "tcp://shard")
            schedule.rejoin = refused
            return schedule
        w.attach = attached
        w.rejoin_if_dropped = lambda: w.clock == 5 and seen.setdefault("rejoins", []).append(1) is None \
            and len(seen["rejoins"]) == 1
        seen["worker"] = w
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        codes = train_on_threads(cfg, str(tmp_path), cluster, refuse_one_rejoin)
    assert codes == {0: 0, 1: 0}, codes
    assert seen["worker"].rejected == 1 and seen["worker"].clock == 20
