"""The coordinator's state file (servers/coordinator.py): what a restarted coordinator
resumes, and what it refuses to resume."""
from __future__ import annotations

import contextlib
import json
import os
import time

import pytest
import zmq

from psgd import metrics, wire
from psgd.config import Config
from psgd.membership import Membership
from psgd.servers.coordinator import CHECK_EVERY_S, SCORES_FILE, SETTLE_BEATS, STATE_FILE, Coordinator
from tests.conftest import closed_after, free_port_block


@pytest.mark.unit
def test_membership_round_trips_through_its_state_dict():
    m = Membership(3, timeout_s=5.0)
    for r in range(3):
        m.join(0.0, r)
    m.beat(0, 1.0, 7, {"samples": 10})
    m.finish(2, 2.0, {"samples": 3})
    m.expire(100.0)  # 0 and 1 are lost
    m.join(101.0, 1)  # 1 comes back
    again = Membership(3, timeout_s=5.0)
    again.load_state_dict(json.loads(json.dumps(m.state_dict())), now=200.0)
    assert again.live() == m.live() and again.stats() == m.stats()
    assert (again.lost, again.rejoined) == (m.lost, m.rejoined) and again.version > m.version
    assert all(again.members[r].last_seen == 200.0 for r in again.live())
    assert again.expire(204.0) == [] and again.expire(206.0) == [1]


@pytest.mark.unit
def test_a_rank_dropped_that_finishes_without_rejoining_is_counted_as_come_back():
    """A review: a worker that stalled past heartbeat_timeout_s at its last step, then
    finished before a heartbeat answer said rejoin, left workers_lost 1, workers_rejoined 0
    and workers_gone 0: it came back, and was not counted so."""
    m = Membership(2, timeout_s=5.0)
    for r in range(2):
        m.join(0.0, r)
    m.beat(0, 1.0, 7, {"samples": 10})
    m.finish(1, 1.0, {"samples": 3})
    assert m.expire(100.0) == [0] and m.lost == 1
    m.finish(0, 101.0, {"samples": 12})
    assert (m.lost, m.rejoined) == (1, 1) and m.members[0].state == "finished"


def coordinator(cfg: Config, out: str) -> Coordinator:
    """A coordinator whose state is all that matters: its socket is closed, and its own
    context terminated, so the port is free again when this returns (a closed socket's
    listener goes later, on ZeroMQ's I/O thread, and the next coordinator on the same
    address could find it in use)."""
    ctx = zmq.Context()
    c = Coordinator(cfg, out, ctx=ctx, quiet=True)
    c.service.close()
    ctx.term()
    c.events.close()
    return c


def in_training(c: Coordinator, ranks: tuple[int, ...] = (0,), for_s: float = 5.0) -> Coordinator:
    """`c`, `for_s` seconds into training, the workers of `ranks` joined at its start."""
    for rank in ranks:
        c.members.join(0.0, rank)
    c.phase, c.t0 = "training", time.monotonic() - for_s
    return c


def training_with_two_workers(out: str) -> tuple[Config, Coordinator]:
    """A coordinator 5 s into training two workers (no evaluator, one shard), and its config."""
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 2, "cluster.servers": 1,
                              "cluster.evaluator": False, "cluster.timeout_s": 60.0})
    return cfg, in_training(coordinator(cfg, out), (0, 1))


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_restarted_coordinator_resumes_only_its_own_recent_unfinished_job(tmp_path):
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 2, "cluster.timeout_s": 30.0})
    out = str(tmp_path)
    first = in_training(coordinator(cfg, out), (0, 1), for_s=12.0)
    first.nonces = {"abc": 1}
    first.evals = [{"t": 5.0, "samples": 100, "accuracy": 0.5, "loss": 1.0, "final": False}]
    first._save_state(time.monotonic())
    state = json.load(open(os.path.join(out, STATE_FILE)))

    second = coordinator(cfg, out)
    assert (second.phase, second.restarts, second.nonces, second.evals) == ("training", 1, {"abc": 1}, first.evals)
    assert set(second.members.live()) == {0, 1}
    assert 11.5 < time.monotonic() - second.t0 < 13.0   # the job's clock goes on

    for change, why in ((lambda st: st.update(config=Config().to_dict()), "another config's"),
                        (lambda st: st.update(saved_at=time.time() - 31), "older than cluster.timeout_s"),
                        (lambda st: st.update(phase="done", saved_at=time.time() - 31), "its job is done")):
        st = json.loads(json.dumps(state))
        change(st)
        json.dump(st, open(os.path.join(out, STATE_FILE), "w"))
        fresh = coordinator(cfg, out)
        assert (fresh.phase, fresh.restarts, fresh.members.members) == ("rendezvous", 0, {}), why

    # A job aborted moments ago: this is a restart of the coordinator that ended it (Compose
    # restarts one that exited 1). It ran an empty job over it. One that finished cleanly
    # exited 0, is not restarted, and a new `up` in its folder starts afresh.
    for abort, ends in (("worker 0: gradient has NaN or Inf values", True), ("", False)):
        st = json.loads(json.dumps(state))
        st.update(phase="done", abort=abort)
        json.dump(st, open(os.path.join(out, STATE_FILE), "w"))
        again = coordinator(cfg, out)
        assert again.ended is ends and again.phase == ("done" if ends else "rendezvous"), abort
        if ends:
            assert again.abort == abort and again.serve(deadline_s=5) == 1 and again.summary is None


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_repeated_registration_gets_the_same_rank_and_no_new_join():
    from psgd import wire
    from psgd.inprocess import InProcessCluster
    from psgd.transport import Peers
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 1, "cluster.servers": 1,
                              "cluster.timeout_s": 10.0})
    with InProcessCluster(cfg) as cluster:
        peers = Peers(cluster.ctx, [cfg.coordinator_address()], cfg.security)
        try:
            def register(nonce: str) -> wire.Message:
                return peers.call(0, "register", 5.0, role="worker", want_rank=-1, nonce=nonce)
            assert register("n1").get("assigned_rank") == 0
            assert register("n1").get("assigned_rank") == 0   # its answer was lost: asked again
            with pytest.raises(wire.Refused, match="all 1 worker ranks are taken"):
                register("n2")
        finally:
            peers.close()
        assert cluster.coordinator.members.members[0].joins == 1
        assert cluster.coordinator.members.rejoined == 0


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_worker_restarted_without_a_rank_waits_for_the_one_it_replaces_to_be_missed(capsys):
    """A review: a worker restarted without --rank (as Compose restarts one) was refused
    at once, with a traceback, while the coordinator had not yet missed the dead one."""
    import threading

    from psgd.inprocess import InProcessCluster
    from psgd.membership import CoordinatorLink
    from psgd.transport import Peers
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 2, "cluster.servers": 1,
                              "cluster.timeout_s": 20.0})
    with InProcessCluster(cfg) as cluster:
        peers = [Peers(cluster.ctx, [cfg.coordinator_address()], cfg.security) for _ in range(2)]
        try:
            rids = [p.send(0, "register", role="worker", want_rank=r, nonce=f"first{r}") for r, p in enumerate(peers)]
            for p, rid in zip(peers, rids, strict=True):
                p.wait({rid: 0}, 5.0, "register")
        finally:
            for p in peers:
                p.close()

        def dies() -> None:   # worker 1's heartbeats stop: after a while the coordinator misses it
            time.sleep(1.5)
            cluster.coordinator.members.members[1].last_seen -= 100.0
        t0 = time.monotonic()   # (before the thread's sleep starts: a busy machine may run this one later)
        threading.Thread(target=dies, daemon=True).start()
        link = CoordinatorLink(cfg, "worker", 0, cluster.ctx)
        try:
            assert link.register(-1).get("assigned_rank") == 1
            assert time.monotonic() - t0 >= 1.4
        finally:
            link.close()
    assert "all 2 worker ranks are taken and live: waiting for the coordinator to miss" in capsys.readouterr().err


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_dropped_worker_is_not_told_to_rejoin_once_the_job_is_finishing(tmp_path):
    """A worker whose heartbeats come back while the job evaluates its final model would
    be refused registration ("the job is finishing") and died on that refusal; it is not
    told to rejoin then (the job's end stops it), but it is while training."""
    from psgd import wire
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 2, "cluster.servers": 1})
    c = coordinator(cfg, str(tmp_path))
    beat = wire.Message("heartbeat", id=1, rank=1, clock=3, fields={"role": "worker"})
    for phase, told in (("training", True), ("final_eval", False), ("done", False)):
        c.phase = phase
        [(_, frames)] = c.on_heartbeat(b"w1", beat)   # rank 1 is not a live member (dropped, or never seen)
        assert wire.decode(frames).get("rejoin") is told, phase


@pytest.mark.unit
def test_a_ranks_counters_add_up_over_its_processes():
    """A worker process that dies and is started again with its rank counts from 0: the
    rank's totals are the earlier processes' counters plus the new one's; the same
    process rejoining after it was dropped (its own nonce) keeps its cumulative ones."""
    m = Membership(2, timeout_s=5.0)
    m.join(0.0, 0, nonce="a0")
    m.join(0.0, 1, nonce="a1")
    m.beat(0, 1.0, 100, {"samples": 3200, "elapsed_s": 10.0, "staleness_hist": [5, 1], "clock": 100, "loss": 0.5})
    m.beat(1, 1.0, 100, {"samples": 3200, "elapsed_s": 10.0, "staleness_hist": [4, 2], "clock": 100, "loss": 0.6,
                         "staleness_max": 40})
    m.expire(10.0)                        # both are missed
    m.join(11.0, 1, nonce="b1")           # rank 1: a new process, counting from 0
    m.join(11.0, 0, nonce="a0")           # rank 0: the same process, back after a partition
    m.beat(1, 12.0, 150, {"samples": 1600, "elapsed_s": 5.0, "staleness_hist": [1, 0, 3], "clock": 150,
                          "loss": 0.4, "staleness_max": 2})
    m.beat(0, 12.0, 150, {"samples": 4800, "elapsed_s": 15.0, "staleness_hist": [6, 1], "clock": 150, "loss": 0.3})
    st = m.stats()
    assert st[1] == {"samples": 4800, "elapsed_s": 15.0, "staleness_hist": [5, 2, 3], "clock": 150, "loss": 0.4,
                     "staleness_max": 40}   # the largest of its lives
    assert st[0]["samples"] == 4800 and st[0]["staleness_hist"] == [6, 1]   # not counted twice
    m.join(12.5, 1, nonce="c1")           # restarted again, before it was even missed: a third life
    m.finish(1, 13.0, {"samples": 320, "elapsed_s": 1.0, "clock": 160})
    assert m.stats()[1]["samples"] == 5120 and m.stats()[1]["elapsed_s"] == 16.0
    assert m.members[1].joins == 3
    assert (m.lost, m.rejoined, m.restarted) == (2, 3, 2)   # rank 1 twice a new process; rank 0 came back itself
    again = Membership(2, timeout_s=5.0)  # a restarted coordinator keeps the earlier lives
    again.load_state_dict(json.loads(json.dumps(m.state_dict())), now=20.0)
    assert again.stats() == m.stats() and again.restarted == 2
    again.join(21.0, 1, nonce="c1")       # not a new life (the same process) ... finished: refused anyway
    assert again.stats()[1]["samples"] == 5120


def three_workers_heard(mode: str, sync: bool = False) -> tuple:
    """A coordinator of 3 workers (mode `mode`, easgd's `mode.sync`), each registered (nonce
    n<rank>) and heard at clocks 84, 30 and 50; and a function that serves it a request."""
    cfg = Config().replace(**{"cluster.workers": 3, "cluster.servers": 1, "cluster.port": free_port_block(3),
                              "cluster.evaluator": False, "train.steps": 100, "mode.name": mode,
                              "mode.sync": sync})
    c = coordinator(cfg, "")

    def serve(op: str, **kw) -> wire.Message:
        return [wire.decode(f) for _, f in c.service._serve(b"x", wire.encode(op, id=1, **kw))][-1]

    for r in range(3):
        c.service._serve(b"x", wire.encode("register", id=1, role="worker", want_rank=r, nonce=f"n{r}"))
    for r, clock in ((0, 84), (1, 30), (2, 50)):
        serve("heartbeat", role="worker", index=r, rank=r, clock=clock, stats={"samples": 32 * clock}, live_id="")
    return c, serve


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["easgd", "ltfb"])
def test_a_worker_that_rejoins_after_a_partition_keeps_its_own_clock(mode):
    """A review: in easgd (async rounds) and ltfb each worker runs its own budget of
    train.steps. Worker 0, at clock 84, was cut off for longer than heartbeat_timeout_s,
    dropped, and rejoined (the same process, its own nonce): the coordinator answered
    start_clock = the slowest other live worker's clock (30), which
    `Worker.rejoin_if_dropped` wrote over its own, and neither schedule moved it back up
    (easgd: the shards forget its rounds on the membership change; ltfb only loads a
    model). It repeated 54 steps past its budget (a slow worker rejoining behind a fast
    one skipped steps instead). It keeps its clock; so does a new process taking up a
    rank in these modes (`test_a_new_process_for_a_rank_starts_at_its_clock_...`)."""
    import types

    import torch

    from psgd.consistency import get as get_mode
    from psgd.consistency import rule as R
    from psgd.consistency.pushpull import caught_up
    from psgd.workers.worker import Worker
    c, serve = three_workers_heard(mode)
    cfg = c.cfg
    c.members.members[0].last_seen -= 100        # the partition: its heartbeats stop coming
    c._tick(time.monotonic())
    assert c.members.members[0].state == "lost"
    assert serve("heartbeat", role="worker", index=0, rank=0, clock=84, stats={}, live_id="").get("rejoin")

    class Link:   # worker 0's, as `Worker.rejoin_if_dropped` uses it
        state = {"rejoin": True}

        def register(self, rank: int) -> wire.Message:
            self.answer = serve("register", role="worker", want_rank=rank, nonce="n0")
            return self.answer

    w = types.SimpleNamespace(cfg=cfg, rank=0, clock=84, name="worker-0", link=Link())
    assert Worker.rejoin_if_dropped(w)
    assert w.link.answer.get("start_clock") == 84
    if mode == "easgd":   # EasgdSchedule.join on the shard's answer after the membership change
        T = types.SimpleNamespace(version=0, params=torch.zeros(4), buffers=torch.zeros(0))
        rule = get_mode("easgd").rule(cfg.mode, 3, T)
        rule.elastic(R.ElasticOffer("o", 0, 84 // cfg.mode.tau, torch.zeros(4), torch.zeros(0)))
        rule.membership({1: 30, 2: 50})                     # the shard sees worker 0 leave ...
        rule.membership({0: w.clock, 1: 30, 2: 50})         # ... and come back
        [a] = [d for d in rule.read(R.Read("j", 0, w.clock, join=True)) if isinstance(d, R.Answer)]
        w.clock = caught_up(w, (a.fields["offered"] + 1) * cfg.mode.tau)
    # (ltfb's LtfbSchedule.rejoin loads the global model and leaves the clock as it is)
    assert w.clock == 84, f"{mode}: the worker at clock 84 continues at clock {w.clock} after rejoining"
    c.members.members[1].last_seen -= 100        # worker 1 dies; a new process takes up its rank
    c._tick(time.monotonic())
    assert serve("register", role="worker", want_rank=1, nonce="m1").get("start_clock") == 30


@pytest.mark.inprocess
@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode,sync,start", [("sync", False, 50), ("ssp", False, 50), ("diloco", False, 50),
                                             ("easgd", True, 50), ("easgd", False, 30), ("async", False, 30),
                                             ("ltfb", False, 30)])
def test_a_new_process_for_a_rank_starts_at_its_clock_where_the_shards_share_no_step(mode, sync, start):
    """Worker 1 (clock 30; the others at 84 and 50) dies, and a new process takes up its
    rank. Where the shards share a step it starts at the slowest live worker's clock (50:
    SSP's gate counts it from there; the schedule moves it up to the shards' step). In
    async, easgd's async rounds and ltfb each rank's clock is its budget of train.steps:
    it started at the slowest other's too, and skipped the steps between (an easgd rank
    killed with the coordinator trained 1,944 of its 3,000), or redid them behind a
    slower one. It continues at its own (30; the schedule moves it on to the rank's
    last step the shards have: async's finished clock, easgd's rounds, ltfb's deposits)."""
    c, serve = three_workers_heard(mode, sync)
    assert serve("register", role="worker", want_rank=1, nonce="m1").get("start_clock") == start   # not missed yet
    c.members.members[1].last_seen -= 100        # ... or missed: the same
    c._tick(time.monotonic())
    assert serve("register", role="worker", want_rank=1, nonce="m2").get("start_clock") == start


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_summary_samples_count_every_life_of_a_restarted_worker():
    """Through the coordinator's handlers: worker 1 dies after 3200 samples, is started
    again with its rank (a new nonce) and does 1600 more; summary.json counts 11200."""
    from psgd import wire
    cfg = Config().replace(**{"cluster.workers": 2, "cluster.port": free_port_block(3), "cluster.evaluator": False})
    c = coordinator(cfg, "")

    def serve(op: str, **kw) -> list[wire.Message]:
        return [wire.decode(f) for _, f in c.service._serve(b"x", wire.encode(op, id=1, **kw))]

    for r in range(2):
        serve("register", role="worker", want_rank=r, nonce=f"first{r}")
    for r in range(2):
        serve("heartbeat", rank=r, clock=100, role="worker", index=r, stats={"samples": 3200, "elapsed_s": 10},
              live_id="")
    c.members.members[1].last_seen -= 100   # worker 1's process died: it is missed
    c._tick(time.monotonic())
    assert serve("register", role="worker", want_rank=1, nonce="second1")[0].get("assigned_rank") == 1
    serve("heartbeat", rank=1, clock=150, role="worker", index=1, stats={"samples": 1600, "elapsed_s": 5}, live_id="")
    [status] = serve("status")
    assert status.get("samples") == 8000 and [w["samples"] for w in status.get("workers")] == [3200, 4800]
    serve("finish", rank=0, clock=200, stats={"samples": 6400, "elapsed_s": 20})
    serve("finish", rank=1, clock=200, stats={"samples": 1600, "elapsed_s": 5})
    c.t0 -= 20.0   # the job ran 20 s (samples/s)
    c._tick(time.monotonic() + CHECK_EVERY_S)   # the next look over every worker
    assert c.phase == "done" and c.summary is not None and not c.summary.get("aborted")
    assert c.summary["samples"] == 11200
    assert c.summary["samples_per_s"] == pytest.approx(11200 / c.summary["wall_s"], rel=0.01)
    assert c.summary["failures"]["workers_lost"] == 1 and c.summary["failures"]["workers_rejoined"] == 1


@pytest.mark.unit
def test_earlier_lives_sums_each_earlier_process_from_its_step_lines(tmp_path):
    """A worker's step lines of this job (an earlier job's lines, older than `since`, are
    not), process by process: the first process (3 steps, cut off mid-line as it was
    killed), a second one whose lines interleave with a third's (the second's rank was
    taken over while it still stepped). Each process's last line counts once."""
    from psgd.metrics import earlier_lives
    os.makedirs(tmp_path / "events")

    def line(t, step, samples, clock, **kw):
        return json.dumps({"t": t, "role": "worker", "rank": 1, "step": step, "clock": clock, "samples": samples,
                           "bytes_sent": 10 * step, "bytes_recv": 20 * step, **kw}) + "\n"
    lines = [line(5.0, 7, 224, 7),                                      # an earlier job's
             line(11.0, 1, 32, 1), line(11.1, 2, 64, 2), line(11.2, 3, 96, 3),
             json.dumps({"t": 11.3, "role": "worker", "event": "tournament", "step": 9}) + "\n",
             line(12.0, 1, 32, 4), line(12.1, 2, 64, 5), line(12.2, 1, 32, 5), line(12.3, 3, 96, 6),
             line(12.4, 2, 64, 6), '{"t": 12.5, "role": "worker", "step": 4, "sam']
    # a line written otherwise (other separators, other order) is decoded: the fourth process's one step
    lines[-1:-1] = [json.dumps({"samples": 32, "step": 1, "t": 12.45, "rank": 1, "role": "worker"},
                               separators=(",", ":")) + "\n"]
    (tmp_path / "events" / "worker-1.jsonl").write_text("".join(lines))
    logged = earlier_lives(str(tmp_path), 1, since=10.0)
    assert logged == {"samples": 96 + 96 + 64 + 32, "steps": 3 + 3 + 2 + 1, "bytes_sent": 80, "bytes_recv": 160}
    assert earlier_lives(str(tmp_path), 0, since=10.0) == {} and earlier_lives(None, 1, 0.0) == {}
    # a review: bytes that are not UTF-8 raised at the new process's join, and it died
    with open(tmp_path / "events" / "worker-1.jsonl", "ab") as f:
        f.write(b"\xff\xfe garbled\n" + line(13.0, 4, 128, 7).encode())
    assert earlier_lives(str(tmp_path), 1, since=10.0)["samples"] == 96 + 128 + 64 + 32   # (the second goes on)


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_restarted_workers_earlier_processes_count_as_their_step_lines_say():
    """kill -9 of the coordinator and the workers together, the job resumed: the
    coordinator's state file had a worker's counters of up to a state save and a
    heartbeat before its death, and a new process for the rank counted from there
    (summary.json said 142,688 samples where the step lines had 191,936). The new
    process sends what its rank's earlier processes logged; the coordinator takes the
    larger of that and what it heard, and keeps it in its state file."""
    cfg = Config().replace(**{"cluster.workers": 2, "cluster.port": free_port_block(3), "cluster.evaluator": False})
    c = coordinator(cfg, "")

    def serve(op: str, **kw) -> wire.Message:
        return [wire.decode(f) for _, f in c.service._serve(b"x", wire.encode(op, id=1, **kw))][-1]

    for r in range(2):
        c.service._serve(b"x", wire.encode("register", id=1, role="worker", want_rank=r, nonce=f"first{r}"))
    for r in range(2):
        serve("heartbeat", rank=r, clock=100, role="worker", index=r, live_id="",
              stats={"samples": 3200, "steps": 100, "rejected": 1})
    assert serve("register", role="worker", want_rank=1, nonce="second1").get("assigned_rank") == 1
    logged = {"samples": 4800, "steps": 150, "bytes_sent": 1000, "bytes_recv": 2000}
    serve("heartbeat", rank=1, clock=160, role="worker", index=1, live_id="", logged=logged,
          stats={"samples": 320, "steps": 10, "rejected": 0})
    assert c.members.stats()[1] == {"samples": 5120, "steps": 160, "rejected": 1, "bytes_sent": 1000,
                                    "bytes_recv": 2000}
    serve("finish", rank=1, clock=200, stats={"samples": 1600, "steps": 50}, logged={"samples": 100})
    assert c.members.stats()[1]["samples"] == 6400    # (a smaller count than heard changes nothing)
    again = Membership(2, timeout_s=5.0)
    again.load_state_dict(json.loads(json.dumps(c.members.state_dict())), now=0.0)
    assert again.stats()[1]["samples"] == 6400
    with pytest.raises(wire.RemoteError, match="not a finite number"):
        wire.raise_if_error(serve("heartbeat", rank=1, clock=160, role="worker", index=1, live_id="",
                                  logged={"samples": "many"}), "coordinator")


@pytest.mark.inprocess
@pytest.mark.timeout(30)
@pytest.mark.parametrize("finished", [0, 1])
def test_a_job_whose_every_worker_was_lost_fails(tmp_path, capsys, finished):
    """Every worker lost and none finished (they all crashed): the job is aborted —
    summary.json has `aborted`, serve() exits 1, and the coordinator's log says so (it
    ended with the workers' drops: a coordinator started by hand, by Slurm or by Compose
    exited 1 without a word of why). One finished and the other lost: the loss is
    survived, the job is done."""
    cfg = Config().replace(**{"cluster.workers": 2, "cluster.port": free_port_block(3), "cluster.evaluator": False})
    c = coordinator(cfg, str(tmp_path))
    c.members.join(0.0, 0)
    c.members.join(0.0, 1)
    c._start_training()
    if finished:
        c.members.finish(0, 0.0, {"samples": 64})
    for m in c.members.members.values():
        m.last_seen -= 100
    c._tick(time.monotonic())
    assert c.phase == "done"
    s = json.load(open(tmp_path / "summary.json"))
    if finished:
        assert not c.abort and "aborted" not in s and s["failures"]["workers_lost"] == 1
    else:
        assert c.abort == s["aborted"] == "all 2 workers were lost (stopped heartbeating) and none finished"
        assert s["failures"]["workers_lost"] == 2
    err = capsys.readouterr().err
    assert ("[psgd coordinator] aborting the job: all 2 workers were lost" in err) == (not finished)


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_two_processes_asking_for_one_rank_in_the_rendezvous_the_second_is_refused():
    """The same PSGD_RANK given to two workers: while the first waits for the others (it
    sends its registration again every few seconds), the second is refused at once with
    the rank named, instead of both hanging until a misleading timeout. A process that
    takes a rank whose holder went quiet (died while waiting: restarted), or one after
    training began (a restart), still gets it."""
    from psgd import wire
    from psgd.membership import RENDEZVOUS_QUIET_S
    cfg = Config().replace(**{"cluster.workers": 2, "cluster.port": free_port_block(3), "cluster.evaluator": False})
    c = coordinator(cfg, "")

    def serve(op: str, **kw) -> list[wire.Message]:
        return [wire.decode(f) for _, f in c.service._serve(b"x", wire.encode(op, id=1, **kw))]

    assert serve("register", role="worker", want_rank=0, nonce="a") == []       # parked: waits for rank 1
    [refused] = serve("register", role="worker", want_rank=0, nonce="b")
    assert refused.op == "error" and refused.get("reason") == (
        "rank 0 is already taken by another process; is PSGD_RANK set the same for two workers?")
    assert serve("register", role="worker", want_rank=0, nonce="a") == []       # the holder's repeat: fine
    assert c.members.members[0].nonce == "a" and c.members.members[0].joins == 1
    c.members.members[0].last_seen -= RENDEZVOUS_QUIET_S + 1                   # the holder died while waiting
    assert serve("register", role="worker", want_rank=0, nonce="c") == []       # its restart takes the rank
    assert c.members.members[0].nonce == "c"
    answers = serve("register", role="worker", want_rank=1, nonce="d")         # all joined: training starts
    assert c.phase == "training" and {m.get("assigned_rank") for m in answers} >= {0, 1}
    [again] = serve("register", role="worker", want_rank=1, nonce="e")          # a restart while training
    assert again.get("assigned_rank") == 1 and c.members.members[1].nonce == "e"


@pytest.mark.inprocess
@pytest.mark.timeout(30)
@pytest.mark.parametrize("token", ["job-a", ""])
def test_a_daemon_of_another_job_is_refused_and_changes_nothing(monkeypatch, token):
    """A daemon registers with its job token (PSGD_JOB_TOKEN, which `psgd run` gives its
    own daemons; none for daemons started by hand): a coordinator refuses every role of
    another job, or of none when it has one, before it takes a rank or a layout."""
    from psgd import wire
    monkeypatch.setenv("PSGD_JOB_TOKEN", token)
    cfg = Config().replace(**{"cluster.workers": 1, "cluster.port": free_port_block(3), "cluster.evaluator": False})
    c = coordinator(cfg, "")

    def serve(op: str, **kw) -> list[wire.Message]:
        return [wire.decode(f) for _, f in c.service._serve(b"x", wire.encode(op, id=1, **kw))]

    other = {"job": "job-b"} if token else {"job": "job-a"}
    for role, kw in [("worker", {"want_rank": 0, "layout": [["w", [2], "float32"]]}), ("server", {"index": 0}),
                     ("evaluator", {})]:
        for theirs in ([other, {}] if token else [other]):
            [refused] = serve("register", role=role, nonce="stray", **kw, **theirs)
            assert refused.op == "error" and refused.get("code") == wire.REFUSED
            assert refused.get("reason").startswith(f"this {role} belongs to another job"), refused.fields
    assert c.members.members == {} and c.layout is None and c.server_joins == {} and c.phase == "rendezvous"
    [joined] = serve("register", role="worker", want_rank=0, nonce="own", job=token)   # the job's own: trains
    assert joined.get("assigned_rank") == 0 and c.phase == "training"


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_job_in_training_takes_no_score_heartbeat_finish_or_release_of_another_job(monkeypatch):
    """A daemon of another job still dialing the port (its coordinator gone, this job's on
    the same port) was heard after registration: its score set time to target 0.0 s and
    its final score ended the job before its own evaluator scored. Every message that
    changes the job now carries the job token (CoordinatorLink) and another's is refused."""
    from psgd import wire
    from psgd.membership import CoordinatorLink
    monkeypatch.setenv("PSGD_JOB_TOKEN", "job-a")
    cfg = Config().replace(**{"cluster.workers": 1, "cluster.port": free_port_block(3), "cluster.evaluator": True})
    c = coordinator(cfg, "")

    def serve(op: str, **kw) -> wire.Message:
        return [wire.decode(f) for _, f in c.service._serve(b"x", wire.encode(op, id=1, **kw))][-1]

    assert serve("register", role="worker", want_rank=0, nonce="own", job="job-a").get("assigned_rank") == 0
    assert c.phase == "training"
    stray = {"job": "job-b"}
    for op, kw in [("eval", {"accuracy": 0.99, "loss": 0.01, "final": True}),
                   ("heartbeat", {"role": "worker", "rank": 0, "clock": 5, "stats": {"samples": 10 ** 6}}),
                   ("heartbeat", {"role": "evaluator"}),
                   ("finish", {"rank": 0, "clock": 5, "error": "stray", "hold": True}),
                   ("release", {})]:
        for theirs in (stray, {}):
            refused = serve(op, **kw, **theirs)
            assert refused.op == "error" and refused.get("code") == wire.REFUSED, (op, refused.fields)
            assert "belongs to another job" in refused.get("reason")
    assert c.evals == [] and c.phase == "training" and not c.abort and c.holder is None
    assert c.members.members[0].state == "live" and c.samples() == 0 and not c.evaluator_seen
    # the job's own daemons' messages carry its token: heartbeats, and every call
    link, sent = CoordinatorLink(cfg, "evaluator", 0), []

    class Calls:
        def call(self, i, op, timeout, **kw):
            sent.append((op, kw))
            return wire.Message("reply", id=1)

    link._calls = Calls()
    link.call("eval", accuracy=0.5, loss=1.0)
    assert link._beat()["job"] == "job-a" and sent == [("eval", {"accuracy": 0.5, "loss": 1.0, "job": "job-a"})]
    assert serve("eval", accuracy=0.5, loss=1.0, job="job-a").op == "reply" and len(c.evals) == 1
    assert serve("heartbeat", role="evaluator", job="job-a").op == "reply"


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_worker_that_joins_a_job_in_training_has_what_is_left_of_train_seconds(tmp_path):
    """A restarted worker was given a fresh `train.seconds` from its own start: the job
    ran on for up to that long after the others had stopped. Its budget is the job's."""
    from psgd import wire
    from psgd.workers.worker import Worker
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 2, "cluster.servers": 1,
                              "train.steps": 0, "train.seconds": 20.0})
    c = in_training(coordinator(cfg, str(tmp_path)), for_s=15.0)   # worker 1 died, and comes back 15 s in
    req = wire.Message("register", id=1, rank=1, clock=0, fields={"role": "worker", "want_rank": 1, "nonce": "n2"})
    [(_, frames)] = c.on_register(b"w1", req)
    answer = wire.decode(frames)
    assert answer.get("assigned_rank") == 1 and 14.9 < answer.get("trained_s") < 16.0

    w = Worker(cfg)
    w.cfg, w.clock, w.stopped = cfg, 0, lambda: False
    w.trained_s = float(answer.get("trained_s"))
    w.t_start = time.monotonic()
    assert w.more()                        # about 5 s are left
    w.t_start -= 5.5
    assert not w.more()                    # spent: 15 + 5.5 > 20, where its own clock says 5.5 of 20
    w.trained_s = 0.0
    assert w.more()                        # a worker of the first rendezvous starts at 0


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_the_coordinators_own_stall_loses_no_worker():
    """The coordinator's loop did not run for 10 s (the machine stalled): the workers'
    silence in that time is not held against them; silence after it is."""
    cfg = Config().replace(**{"cluster.workers": 2, "cluster.port": free_port_block(3), "cluster.evaluator": False})
    c = coordinator(cfg, "")
    c.members.join(0.0, 0)
    c.members.join(0.0, 1)
    c._start_training()
    t = time.monotonic()
    for m in c.members.members.values():
        m.last_seen = t
    c._tick(t)
    c._tick(t + 10.0)   # 10 s later, twice heartbeat_timeout_s
    assert c.members.live() == {0: 0, 1: 0} and c.phase == "training"
    now = t + 10.0
    while c.members.live() and now < t + 30.0:   # then nobody beats, and the loop runs
        now += 0.05
        c._tick(now)
    assert now == pytest.approx(t + 10.0 + cfg.cluster.heartbeat_timeout_s, abs=0.1)


def saved_scores(out: str) -> int:
    """The scores a restarted coordinator would resume: the scores file's (settled) and the
    state file's (still counting)."""
    state = json.load(open(os.path.join(out, STATE_FILE)))
    path = os.path.join(out, SCORES_FILE)
    with open(path) if os.path.exists(path) else contextlib.nullcontext([]) as f:
        return sum(1 for _ in f) + len(state["evals"])


@pytest.mark.inprocess
@pytest.mark.timeout(60)
def test_a_long_curve_is_encoded_once_a_score_and_each_score_saved_as_it_comes(tmp_path, monkeypatch):
    """A soak: the state file holds the whole evaluation curve (7,200 scores an hour),
    which was encoded whole on every score and every second; hours into a job each
    rewrite took a second of the serve loop, most of the coordinator's time. A score is
    encoded once. It is saved as it comes: it waited for the next periodic save, and a
    coordinator killed meanwhile lost it (a helper's kill -9 lost the first two scores
    of a job, and summary.json's time_to_target_s said 2.56 s for 1.09)."""
    cfg, c = training_with_two_workers(str(tmp_path))
    encoded, writes = [], []
    real_line, real_write = metrics.json_line, metrics.write_json_atomic

    def line(obj):
        encoded.append(obj)
        return real_line(obj)

    def write(path, obj, *more):
        writes.append(path)
        real_write(path, obj, *more)

    monkeypatch.setattr("psgd.servers.coordinator.json_line", line, raising=False)
    monkeypatch.setattr("psgd.servers.coordinator.write_json_atomic", write)
    now = time.monotonic()
    for i in range(1200):   # 60 s of the loop, a score every 0.5 s
        now += 0.05
        if i % 10 == 0:
            c.evals.append({"t": i * 0.05, "samples": i, "accuracy": 0.5, "loss": float("nan") if i == 0 else 1.0,
                            "final": False})
        c._save_state(now)
        if i % 10 == 0:   # saved: settled in the scores file, or counting in the state file
            assert saved_scores(str(tmp_path)) == len(c.evals)
    c._save_state(now + 1.0)           # (the last score's second)
    assert len(writes) <= 122          # once a score, and once a second between them
    assert len(encoded) == 120         # each score once (was: all of them at every rewrite)
    state = json.load(open(os.path.join(str(tmp_path), STATE_FILE)))
    with open(os.path.join(str(tmp_path), SCORES_FILE)) as f:   # the settled scores; the state file counts them
        curve = [json.loads(line) for line in f]
    assert state["evals_settled"] == len(curve) and curve + state["evals"] == [
        {**e, "loss": None if i == 0 else e["loss"]} for i, e in enumerate(c.evals)]
    assert state["phase"] == "training" and set(state["membership"]) == set(c.members.state_dict())


@pytest.mark.unit
def test_a_finished_worker_is_at_the_clock_it_finished_at():
    """A review: `psgd status` showed a finished worker at its last heartbeat's clock
    (2953/3000 after a 3000-step job): the clock sent with `finish` was not kept."""
    m = Membership(2, timeout_s=5.0)
    for r in range(2):
        m.join(0.0, r)
    m.beat(0, 1.0, 2953)
    m.finish(0, 1.0, {"samples": 96000}, 3000)
    m.finish(1, 1.0, {"samples": 0})
    assert m.members[0].clock == 3000 and m.members[1].clock == 0


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_the_loop_looks_over_every_worker_only_every_check_period(monkeypatch):
    """A review: the serve loop's O(W) scan (missed heartbeats, the job's end) ran after
    every poll, about once per heartbeat: at 1,024 workers a real coordinator used 89% of
    a core (36-40% now, bench.control's `live_share`)."""
    cfg = Config().replace(**{"cluster.workers": 2, "cluster.port": free_port_block(3), "cluster.evaluator": False})
    c = coordinator(cfg, "")
    c.members.join(0.0, 0)
    c.members.join(0.0, 1)
    c._start_training()
    scans = []
    monkeypatch.setattr(c.members, "expire", lambda now: scans.append(now) or [])
    now = time.monotonic()
    for k in range(100):   # a poll per heartbeat, 100 heartbeats within 10 ms
        c._tick(now + k * 1e-4)
    assert len(scans) == 1
    c._tick(now + CHECK_EVERY_S * 1.001)   # (now + CHECK_EVERY_S) - now can round to just below it
    assert len(scans) == 2


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_the_summary_waits_for_the_shards_counters_after_training(tmp_path):
    """A review: with the evaluator off the summary was written as the last worker
    finished, from the shards' heartbeats before that: 69 dropped gradients where both
    shards had dropped 139. Now it waits for each live shard's next heartbeat (at most
    SETTLE_BEATS periods)."""
    cfg = Config().replace(**{"cluster.workers": 1, "cluster.servers": 2, "cluster.port": free_port_block(4),
                              "cluster.evaluator": False})
    c = coordinator(cfg, str(tmp_path))

    def serve(op: str, **kw) -> None:
        c.service._serve(b"x", wire.encode(op, id=1, **kw))

    serve("register", role="worker", want_rank=0, nonce="w0")
    for i in range(2):
        serve("heartbeat", rank=-1, role="server", index=i, stats={"dropped": 3, "busy_s": 1.0}, live_id="")
    serve("finish", rank=0, clock=10, stats={"samples": 320, "elapsed_s": 1.0})
    t = time.monotonic()
    c._tick(t)
    assert c.phase == "settling" and c.summary is None
    serve("heartbeat", rank=-1, role="server", index=0, stats={"dropped": 7, "busy_s": 2.0}, live_id="")
    c._tick(t + CHECK_EVERY_S)
    assert c.phase == "settling"                       # shard 1 has not answered since
    serve("heartbeat", rank=-1, role="server", index=1, stats={"dropped": 9, "busy_s": 2.0}, live_id="")
    c._tick(t + 2 * CHECK_EVERY_S)
    assert c.phase == "done" and c.summary["dropped_gradients"] == 9
    # a shard that never answers again: the summary after SETTLE_BEATS heartbeat periods
    c2 = coordinator(cfg.replace(**{"cluster.port": free_port_block(4)}), str(tmp_path / "b"))
    c2.service._serve(b"x", wire.encode("register", id=1, role="worker", want_rank=0, nonce="w0"))
    c2.service._serve(b"x", wire.encode("heartbeat", id=1, rank=-1, role="server", index=0, stats={"dropped": 3},
                                        live_id=""))
    c2.service._serve(b"x", wire.encode("finish", id=1, rank=0, clock=10, stats={"samples": 320}))
    t = time.monotonic()
    c2._tick(t)
    assert c2.phase == "settling"
    c2._tick(t + SETTLE_BEATS * cfg.cluster.heartbeat_s + CHECK_EVERY_S)
    assert c2.phase == "done" and c2.summary["dropped_gradients"] == 3
    # a training script's finish, its training ended before (`idle_s`): the shards' heartbeats since that
    # end, before the finish, miss the pushes its close() settled; the wait counts from the finish
    c3 = coordinator(cfg.replace(**{"cluster.port": free_port_block(4)}), str(tmp_path / "c"))
    c3.service._serve(b"x", wire.encode("register", id=1, role="worker", want_rank=0, nonce="w0"))
    for i in range(2):
        c3.service._serve(b"x", wire.encode("heartbeat", id=1, rank=-1, role="server", index=i,
                                            stats={"dropped": 3}, live_id=""))
    c3.service._serve(b"x", wire.encode("finish", id=1, rank=0, clock=10, stats={"samples": 320}, idle_s=5.0))
    c3._tick(time.monotonic())
    assert c3.phase == "settling" and c3.t_end < c3.heard_end


@pytest.mark.unit
def test_a_scores_samples_are_the_workers_count_when_the_model_was_read():
    """A review: a score's samples were the heartbeats' count when the score arrived,
    up to a heartbeat period behind the model it scored (at 0.74 s into a run: 256 where
    the workers had done 896), which drew early scores of every distributed run too far
    left on the accuracy-vs-samples plot."""
    from psgd.membership import SamplesAt
    m = Membership(3, timeout_s=5.0)
    for r in range(3):
        m.join(0.0, r)
    for r in range(3):
        m.beat(r, 1.0, 10, {"samples": 100})
        m.beat(r, 2.0, 20, {"samples": 200})
    m.beat(2, 2.6, 26, {"samples": 260})        # worker 2 beat during the scoring: its two beats are around it
    at = SamplesAt(m.members, 2.5)
    assert set(at.waiting) == {0, 1}
    m.beat(0, 3.0, 30, {"samples": 300})
    at.beat(0, 3.0, 300)                         # 200 at 2.0, 300 at 3.0: 250 at 2.5
    m.finish(1, 2.8, {"samples": 280}, 28)
    at.beat(1, 2.8, 280)                         # 200 at 2.0, 280 at 2.8: 250 at 2.5
    assert not at.waiting and at.value() == 250 + 250 + 250
    m.excuse(10.0, 3.2)                            # a stall: last_seen moves, the counts do not
    assert set(SamplesAt(m.members, 3.1).waiting) == {0, 2}
    later = SamplesAt(m.members, 3.5)              # worker 0 then dies: no beat will come
    assert set(later.waiting) == {0, 2}
    later.gone(0)
    later.beat(2, 4.0, 400)                        # 260 at 2.6, 400 at 4.0: 350 at 3.5
    assert not later.waiting and later.value() == 300 + 280 + 350


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_registration_that_can_get_no_rank_says_why():
    """A review: a rank that finished its share never frees up, but the refusal said every
    rank was "taken and live", and a restarted worker waited cluster.timeout_s for it."""
    cfg = Config().replace(**{"cluster.workers": 2, "cluster.servers": 1, "cluster.port": free_port_block(3)})
    c = coordinator(cfg, "")

    def refusal(**kw) -> str:
        [got] = [wire.decode(f) for _, f in c.service._serve(b"x", wire.encode("register", id=1, role="worker", **kw))]
        return got.get("reason")

    c.members.join(0.0, 0, "a")
    c.members.join(0.0, 1, "b")
    c._start_training()
    assert refusal(want_rank=-1, nonce="c") == "all 2 worker ranks are taken and live"
    c.members.finish(0, 0.0, {"samples": 64})
    assert refusal(want_rank=0, nonce="c") == "rank 0 has finished its share of the job"
    assert refusal(want_rank=-1, nonce="c") == ("no worker rank is free: 1 of 2 finished their share, the others "
                                                "are live")


def on_a_test_clock(monkeypatch) -> tuple:
    """A coordinator of 2 workers whose clock the test moves (sleeps overshoot on a busy
    machine): (it, a function serving one request through its serve path, the clock)."""
    import types

    import psgd.servers.coordinator as module
    clock = [time.monotonic()]
    monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=lambda: clock[0], time=time.time))
    cfg = Config().replace(**{"cluster.workers": 2, "cluster.servers": 1, "cluster.port": free_port_block(3),
                              "cluster.evaluator": False})
    c = coordinator(cfg, "")

    def serve(op: str, **kw) -> list[wire.Message]:
        return [wire.decode(f) for _, f in c.service._serve(b"x", wire.encode(op, id=1, **kw))]
    return c, serve, clock


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_summary_scores_carry_the_samples_at_their_read(monkeypatch):
    c, serve, clock = on_a_test_clock(monkeypatch)
    for r in range(2):
        serve("register", role="worker", want_rank=r, nonce=f"w{r}")
        serve("heartbeat", rank=r, clock=10, role="worker", index=r, stats={"samples": 320}, live_id="")
    clock[0] += 0.2
    [said] = serve("eval", accuracy=0.5, loss=1.0, age_s=0.0)   # the model read half way between two beats
    assert said.get("samples") == 640 and c.evals[-1]["samples"] == 640      # the heartbeats' count so far
    clock[0] += 0.2
    for r in range(2):   # the next beats, 0.4 s after the last: 128 samples more each
        serve("heartbeat", rank=r, clock=14, role="worker", index=r, stats={"samples": 448}, live_id="")
    assert c.evals[-1]["samples"] == 2 * (320 + 64) and not c.counting


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_slow_scores_samples_are_the_count_at_its_read_not_at_its_arrival(monkeypatch):
    """A review: on 2 cores shared by 11 busy processes, the evaluator took ~30 s to score
    resnet20: summary.json then had {"t": 0.589, "samples": 2048} (the initial model,
    read before any step; 2048 was the count when the score arrived) and
    {"t": 30.258, "samples": 3072} (3072 = the job's final count; at 30 s it was ~2048):
    the coordinator kept each worker's last two heartbeats only, both after the read.
    README: `samples` is "the workers' count when the evaluator read the model"."""
    c, serve, clock = on_a_test_clock(monkeypatch)
    for r in range(2):
        serve("register", role="worker", want_rank=r, nonce=f"w{r}")
    # 20 s of training, a heartbeat every 0.5 s, 32 samples a worker per beat
    for beat in range(1, 41):
        clock[0] += 0.5
        for r in range(2):
            serve("heartbeat", rank=r, clock=beat, role="worker", index=r, stats={"samples": 32 * beat},
                  live_id="")
    # a score of the model read 18 s ago (at 2 s: 4 beats, 2 x 128 samples); scoring took 18 s
    serve("eval", accuracy=0.5, loss=1.0, age_s=18.0)
    for r in range(2):   # the next beats come; the summary's count is settled by them
        clock[0] += 0.5
        serve("heartbeat", rank=r, clock=41, role="worker", index=r, stats={"samples": 32 * 41}, live_id="")
    e = c.evals[-1]
    assert abs(e["t"] - 2.0) < 0.6                # the time is the read's (this held)
    assert e["samples"] <= 2 * 32 * 6, e          # ... and so is the count now: it was 2 x 1248 = 2496


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_beats_counters_read_before_it_was_sent_count_at_their_reading(monkeypatch):
    """A worker's beat as it begins stepping reads its counters then and is sent by the
    heartbeat thread (`beat_soon`), which on a busy machine comes to it late: the beat
    says how late (`age_s`), and its count is put at its reading, before a score's read
    if it was (the score waits on for a beat after its read), never past the last count
    or more than a beat's wait for its answer back."""
    c, serve, clock = on_a_test_clock(monkeypatch)
    serve("register", role="worker", want_rank=0, nonce="w0")
    serve("register", role="worker", want_rank=1, nonce="w1")
    t0 = clock[0]
    for r in range(2):
        serve("heartbeat", rank=r, clock=0, role="worker", index=r, stats={"samples": 0}, live_id="")
    clock[0] += 0.5
    serve("eval", accuracy=0.1, loss=2.0, age_s=0.0)              # the model read at 0.5 s
    clock[0] += 0.5
    for r in range(2):   # begun stepping at 0.2 s (0 samples), sent at 1.0 s
        serve("heartbeat", rank=r, clock=0, role="worker", index=r, stats={"samples": 0}, live_id="", age_s=0.8)
    assert c.counting and set(c.counting[0][1].waiting) == {0, 1}   # both counts are from before the read
    clock[0] += 1.0
    for r in range(2):   # 2.0 s: 320 samples each, 1.8 s after they began: 0.3 s of them by the read
        serve("heartbeat", rank=r, clock=10, role="worker", index=r, stats={"samples": 320}, live_id="")
    assert not c.counting and c.evals[-1]["samples"] == round(2 * 320 * 0.3 / 1.8)
    points = c.members.members[0].counts.points
    assert [(round(t - t0, 6), n) for t, n in points] == [(0.0, 0), (0.2, 0), (2.0, 320)]
    clock[0] += 1.0
    serve("heartbeat", rank=0, clock=15, role="worker", index=0, stats={"samples": 480}, live_id="", age_s=1e9)
    serve("heartbeat", rank=1, clock=15, role="worker", index=1, stats={"samples": 480}, live_id="",
          age_s=float("nan"))
    assert [round(t - t0, 6) for t, _ in c.members.members[0].counts.points][-1] == 2.0   # (not before the last)
    assert [round(t - t0, 6) for t, _ in c.members.members[1].counts.points][-1] == 3.0   # (NaN: now)


@pytest.mark.unit
def test_counters_read_before_a_count_already_heard_are_not_taken():
    """A review: a training script's own beat (`report`) may come before the heartbeat
    thread's beat with the counters read as it began (`beat_soon`): those older counters
    replaced the newer ones, and the counts went down."""
    m = Membership(1, timeout_s=5.0)
    m.join(0.0, 0)
    m.beat(0, 1.0, 4, {"samples": 128})                       # the script's beat
    assert m.beat(0, 1.2, 0, {"samples": 0}, counted=0.3)   # the older one: heard (live), not taken
    assert m.members[0].samples() == 128 and m.members[0].counts.points[-1] == (1.0, 128)
    m.beat(0, 1.5, 6, {"samples": 192}, counted=1.4)
    assert m.members[0].counts.points[-1] == (1.4, 192)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_workers_counts_cover_the_window_in_bounded_memory():
    """The counts kept for a score's samples (`Counts`) go back at least the window
    (cluster.timeout_s) and stay a few dozen points however long the job runs."""
    from psgd.membership import COUNTS_KEPT
    m = Membership(1, timeout_s=5.0, counts_s=60.0)
    m.join(0.0, 0)
    for beat in range(1, 20_001):                  # 10,000 s of heartbeats every 0.5 s, 32 samples each
        m.beat(0, beat / 2, beat, {"samples": 32 * beat})
    counts = m.members[0].counts
    assert len(counts.points) <= COUNTS_KEPT + 2 and counts.points[0][0] <= 10_000 - 60
    assert counts.at(10_000 - 59.3) == pytest.approx(64 * (10_000 - 59.3))


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_workers_clock_past_the_last_step_is_refused_and_changes_nothing():
    """As the shards refuse a clock past train.steps, so does the coordinator: kept, a
    heartbeat's clock of 2^62 - 1 went into the live set that every shard starts joiners
    at, and into a rejoining worker's start_clock."""
    from tests.conftest import ask, hand_served
    with closed_after(hand_served(workers=2, **{"train.steps": 10})) as c:
        m = ask(c, "heartbeat", role="worker", rank=1, clock=2 ** 62 - 1)
        assert (m.op, m.get("code")) == ("error", wire.REFUSED) and "train.steps = 10" in m.get("reason")
        f = ask(c, "finish", rank=1, clock=12)
        assert (f.op, f.get("code")) == ("error", wire.REFUSED)
        assert c.members.live() == {0: 0, 1: 0}
        assert ask(c, "heartbeat", role="worker", rank=1, clock=11).op == "reply"   # the one after the last step
        c.members.members[0].last_seen -= 3600            # worker 0 is lost ...
        c.members.expire(time.monotonic())
        again = ask(c, "register", role="worker", want_rank=0, nonce="n0")   # ... and rejoins
        assert again.get("start_clock") <= 11


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_restarted_coordinator_keeps_rank_0s_hold_on_the_jobs_end(tmp_path):
    """A review: a training script's rank 0 finishes with `hold` (psgd/connection.py)
    and waits for the others, to read the final model into DIR/model.pt; the coordinator
    holds the job's end meanwhile. Restarted from its state file, which did not carry the
    hold, the coordinator ended the job as soon as the last other worker finished, and the
    shards exited before rank 0 read the model. The hold is now in the state file."""
    cfg, first = training_with_two_workers(str(tmp_path))

    def serve(c, op: str, **kw) -> wire.Message:
        (_, frames), = c.service._serve(b"x", wire.encode(op, id=1, **kw))
        return wire.decode(frames)
    assert serve(first, "finish", rank=0, clock=10, stats={"samples": 64}, hold=True).op == "reply"
    first._save_state(time.monotonic())
    second = coordinator(cfg, str(tmp_path))                   # kill -9, restarted from the state file
    assert second.restarts == 1 and second.phase == "training"
    assert second.held_until - time.monotonic() > 50 and second.holder == 0   # (it must hear an abort)
    for c in (first, second):
        c.members.beat(1, time.monotonic(), 10, {})
        assert serve(c, "finish", rank=1, clock=10, stats={"samples": 64}).op == "reply"
        c._checked = -1e9
        c._tick(time.monotonic())
        assert c.phase == "training"                           # held: rank 0 reads the final model


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_finish_answered_is_in_the_state_file_before_the_coordinator_dies(tmp_path):
    """A worker that heard its finish answered stops heartbeating and exits. The state
    file took the finish only at the coordinator's next save (up to a drain of the socket
    later, 50 ms and more on a busy machine): killed in between, the coordinator came back
    with that worker live and dropped it after the heartbeat timeout (workers_lost 1, seen
    once in test_kill_9_the_coordinator_mid_run[easgd] on a loaded machine)."""
    cfg, first = training_with_two_workers(str(tmp_path))
    first._save_state(time.monotonic())
    (_, frames), = first.service._serve(b"x", wire.encode("finish", id=1, rank=0, clock=10, stats={"samples": 64}))
    assert wire.decode(frames).op == "reply"
    second = coordinator(cfg, str(tmp_path))                   # kill -9 before its loop's next save
    assert second.restarts == 1
    assert second.members.members[0].state == "finished", second.members.members[0]
    later = time.monotonic() + cfg.cluster.heartbeat_timeout_s + 60   # no beat comes from the finished worker
    second.members.beat(1, later, 10, {})
    second._checked = -1e9
    second._tick(later)
    assert second.members.lost == 0


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_summary_without_the_final_evaluation_says_so_not_a_score_from_training():
    """A review: when no final evaluation came (a shard restarted with nothing to
    restore, an evaluator that stayed dead), summary.json's final_accuracy was the last
    score during training, here at t = 0, with nothing to tell it from the final model's:
    psgd run printed it as the job's accuracy and compare ranked it."""
    from psgd.launcher import format_summary
    from tests.conftest import ask, hand_served
    with closed_after(hand_served(workers=1, **{"cluster.evaluator": True, "cluster.timeout_s": 0.3})) as c:
        assert ask(c, "eval", accuracy=0.25, loss=2.0, age_s=0.0).op == "reply"    # during training
        ask(c, "finish", rank=0, clock=10, stats={"samples": 320, "elapsed_s": 1.0, "wait_s": 0.1})
        end = time.monotonic() + 10
        while c.summary is None and time.monotonic() < end:
            c._tick(time.monotonic())
            time.sleep(0.02)
        s = c.summary
        assert s is not None and (s["final_accuracy"], s["final_loss"], s["final_eval_missing"]) == (None, None, True)
        assert [e["accuracy"] for e in s["evals"]] == [0.25]
        assert "no final evaluation (the last score, during training: accuracy 0.2500 at" in format_summary(s)


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("beating", [False, True])
def test_the_final_evaluation_is_not_waited_for_from_an_evaluator_that_stopped_heartbeating(beating):
    """A helper's review: an evaluator stopped (SIGSTOP) during training held the job's end
    for cluster.timeout_s, waiting for a final score it could not send (41 s in its run).
    Its heartbeats stopped with it: after cluster.heartbeat_timeout_s without one, the
    summary is written without the final score, as a silent worker is dropped. One that
    heartbeats (scoring a large model) is waited for, and a stall of the coordinator's own
    loop (its evaluator's beats waiting in the socket) is excused."""
    from tests.conftest import ask, hand_served
    with closed_after(hand_served(workers=1, **{"cluster.evaluator": True, "cluster.timeout_s": 60.0,
                                                "cluster.heartbeat_s": 0.5, "cluster.heartbeat_timeout_s": 2.0})) as c:
        assert ask(c, "register", role="evaluator").op == "reply"
        t = c.evaluator_seen
        ask(c, "finish", rank=0, clock=10, stats={"samples": 320, "elapsed_s": 1.0, "wait_s": 0.1})
        for i in range(1, 16):    # 3 s in ticks of 0.2 s
            if beating:
                c.evaluator_seen = t + i * 0.2
            c._tick(t + i * 0.2)
            assert (c.summary is None) == (beating or i * 0.2 <= 2.0), (i, c.phase)
        if beating:
            c._tick(t + 3.0 + 5.0)   # the loop stalled 5 s: excused
            assert c.summary is None and c.phase == "final_eval"
            for i in range(1, 12):   # then no beat for 2.2 s
                c._tick(t + 8.0 + i * 0.2)
            assert c.summary is not None
        assert c.summary["final_eval_missing"]


@pytest.mark.inprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("ended", [True, False])
def test_an_evaluator_whose_process_ended_is_waited_for_to_be_started_again_not_given_up(ended, capfd):
    """Session 54's last run: a Slurm job's evaluator, killed 2 s into a 7 s job, was started
    again by the script 4 s later; before it registered, training ended, and the coordinator
    gave it up after cluster.heartbeat_timeout_s without a heartbeat, as one stopped: the
    job ended without its final score. An evaluator whose connection closed has ended (a
    stopped one keeps it open): its supervisor starts it again, and its score is waited for
    up to cluster.timeout_s. One whose connection stays open is given up as before (the
    close of the socket it registered on says nothing)."""
    from tests.conftest import ask, hand_served
    with closed_after(hand_served(workers=1, **{"cluster.evaluator": True, "cluster.timeout_s": 30.0,
                                                "cluster.heartbeat_s": 0.2, "cluster.heartbeat_timeout_s": 1.0})) as c:
        socks: list[zmq.Socket] = []

        def evaluator() -> zmq.Socket:   # an evaluator process's connection
            s = zmq.Context.instance().socket(zmq.DEALER)
            s.linger = 0
            s.connect(c.cfg.coordinator_address())
            socks.append(s)
            return s

        def serve_for(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                c.service.poll(20)
                c._tick(time.monotonic())

        def answer(s: zmq.Socket, op: str, **fields) -> wire.Message:
            s.send_multipart(wire.encode(op, id=1, **fields))
            end = time.monotonic() + 10
            while not s.poll(0):
                assert time.monotonic() < end, f"no answer to {op}"
                serve_for(0.02)
            return wire.decode(s.recv_multipart())

        try:
            registered = evaluator()   # (as the evaluator does: it registers, closes that socket, and beats)
            assert answer(registered, "register", role="evaluator").op == "reply"
            registered.close(0)
            beating = evaluator()
            assert answer(beating, "heartbeat", role="evaluator").op == "reply"
            ask(c, "finish", rank=0, clock=10, stats={"samples": 320, "elapsed_s": 1.0, "wait_s": 0.1})
            if ended:
                beating.close(0)   # killed: its kernel closes its connections
            serve_for(3.0)   # three heartbeat timeouts without a beat
            if not ended:   # stopped (SIGSTOP): given up
                assert c.summary is not None and c.summary["final_eval_missing"], c.phase
                return
            assert c.summary is None and c.phase == "final_eval"
            assert "its process ended; waiting up to" in capfd.readouterr().err
            again = evaluator()   # started again
            assert answer(again, "register", role="evaluator").op == "reply"
            assert answer(again, "eval", accuracy=0.875, loss=0.5, final=True).op == "reply"
            assert c.summary is not None and c.summary["final_accuracy"] == 0.875, c.summary
            assert not c.summary.get("final_eval_missing"), c.summary
        finally:
            for s in socks:
                s.close(0)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_status_shows_a_score_whose_loss_was_not_finite_after_a_coordinator_restart(tmp_path):
    """A review: a score's loss that was not finite (a diverged model, a script's
    report(loss=nan)) is null in the state file; a coordinator restarted from it answers
    `status` with that null, and `psgd status` died formatting it."""
    from psgd.status import table
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 1, "cluster.timeout_s": 30.0})
    first = in_training(coordinator(cfg, str(tmp_path)))
    first.evals = [{"t": 2.0, "samples": 64, "accuracy": 0.1, "loss": float("nan"), "final": False}]
    first._save_state(time.monotonic())
    second = coordinator(cfg, str(tmp_path))
    assert second.restarts == 1
    (_, frames), = second.service._serve(b"x", wire.encode("status", id=3))
    reply = wire.decode(frames)
    assert reply.get("last_eval")["loss"] is None
    assert "last evaluation: accuracy 0.1000  loss -  at 2.0 s" in table(reply)


@pytest.mark.inprocess
@pytest.mark.timeout(30)
@pytest.mark.parametrize("finished", [0, 1])
def test_a_restarted_coordinator_whose_workers_were_stopped_with_it_waits_for_new_ones(tmp_path, finished):
    """`docker compose stop` of the whole stack, then `start`: the coordinator resumed the
    job from its state file, missed the old workers (stopped with it) before the new
    containers had imported torch, and aborted the job ("all 2 workers were lost"), or,
    with one worker finished before the stop, ended it without the other's share. A
    restarted coordinator waits cluster.timeout_s for new workers to take up the lost
    ranks; past that, the job ends as before."""
    cfg, first = training_with_two_workers(str(tmp_path))
    for r in (0, 1):
        first.members.beat(r, time.monotonic(), 40, {"samples": 1280})
    if finished:
        first.members.finish(0, time.monotonic(), {"samples": 1280}, 40)
    first._save_state(time.monotonic())
    c = coordinator(cfg, str(tmp_path))
    assert (c.phase, c.restarts) == ("training", 1)

    def tick(now: float) -> None:
        c._checked = -1e9
        c._tick(now)
    later = time.monotonic() + cfg.cluster.heartbeat_timeout_s + 10   # no old worker beats again
    tick(later)
    assert c.members.lost == 2 - finished and (c.phase, c.abort) == ("training", "")
    for nonce in ("new-a", "new-b")[finished:]:   # the new worker containers, without a rank of their own
        [(_, frames)] = c.on_register(b"w", wire.Message("register", id=1, fields={
            "role": "worker", "want_rank": -1, "nonce": nonce}))
        assert wire.decode(frames).get("start_clock") == 40
    assert len(c.members.live()) == 2 - finished and c.members.restarted == 2 - finished
    for r in c.members.live():
        c.members.finish(r, later, {"samples": 640}, 60)
    tick(later)
    assert c.phase == "done" and not c.abort and c.summary["failures"]["workers_restarted"] == 2 - finished

    os.makedirs(tmp_path / "again")   # nobody takes the ranks up in time: the job ends as before
    first.state_path, first._saved = str(tmp_path / "again" / STATE_FILE), ()
    first._save_state(time.monotonic())
    c = coordinator(cfg, str(tmp_path / "again"))
    tick(time.monotonic() + cfg.cluster.timeout_s + 1)
    assert c.phase == "done" and c.members.lost == 2 - finished
    assert c.abort == ("" if finished else "all 2 workers were lost (stopped heartbeating) and none finished")


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("score_first", [False, True])
def test_a_shard_back_without_its_final_tables_aborts_the_final_evaluation(tmp_path, score_first):
    """A shard restarted after training without the tables it ended with says so in its
    heartbeats (`lost_tables`): before the final score, the job ends aborted with that
    reason and the final score missing (the evaluator scored and saved a model mixing
    that shard's older tables with the others' final ones); after it, the score stands."""
    cfg = Config().replace(**{"cluster.workers": 1, "cluster.servers": 2, "cluster.port": free_port_block(4)})
    c = coordinator(cfg, str(tmp_path))

    def serve(op: str, **kw) -> None:
        c.service._serve(b"x", wire.encode(op, id=1, **kw))

    serve("register", role="worker", want_rank=0, nonce="w0")
    serve("finish", rank=0, clock=10, stats={"samples": 320})
    c._tick(time.monotonic())
    assert c.phase == "final_eval"
    if score_first:
        serve("eval", accuracy=0.9, loss=0.3, final=True)
    lost = "was restarted after training ended without its final tables (its checkpoint is of version 7, ...)"
    serve("heartbeat", rank=-1, role="server", index=1, stats={"version": 7}, live_id="", lost_tables=lost)
    c._tick(time.monotonic() + 1.0)
    if score_first:
        assert not c.abort and c.summary["final_accuracy"] == 0.9
        return
    assert c.phase == "done" and c.abort.startswith(f"shard 1 {lost}: the final model is lost")
    assert c.summary["aborted"] == c.abort
    assert c.summary["final_accuracy"] is None and c.summary["final_eval_missing"] is True


@pytest.mark.unit
def test_the_count_where_a_worker_began_stepping_is_kept():
    """A review: the counts kept for a score's samples moved their last point on to each
    beat until it was window / COUNTS_KEPT (1.9 s) from the one before: the beat saying a
    worker had begun stepping (0 samples, after 0.5 s of waiting for the initial values)
    was replaced by the next one, and a score read before any step (the initial model's)
    was counted at 64 samples here (1,175 in a real 2-worker run)."""
    m = Membership(1, timeout_s=5.0, counts_s=60.0)
    m.join(0.0, 0)
    m.beat(0, 0.02, 0, {"samples": 0})     # the heartbeats' first, while the initial values come
    m.beat(0, 0.5, 0, {"samples": 0})      # Worker.start: it begins stepping now
    m.beat(0, 1.0, 5, {"samples": 160})
    assert m.members[0].counts.at(0.4) == 0
    assert m.members[0].counts.at(0.75) == 80


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_state_file_unwritable_for_want_of_descriptors_is_retried_not_the_end_of_the_job(tmp_path, monkeypatch,
                                                                                          capsys):
    """Helper K: a coordinator under `ulimit -n` sent more idle connections than that could
    not open its state file's temporary, exited 73 ("a restart would fail the same way")
    and ended the job. Out of descriptors is for now: it tries again; a full disk is not."""
    import errno

    from psgd.servers import coordinator as coord_module
    c = coordinator(Config().replace(**{"cluster.port": free_port_block(3)}), str(tmp_path))
    real = coord_module.write_json_atomic
    failing = {"errno": errno.EMFILE}

    def write(path, obj, encoded=None):
        if failing:
            raise metrics.OutputError(failing["errno"], os.strerror(failing["errno"]), path + ".tmp")
        real(path, obj, encoded)

    monkeypatch.setattr(coord_module, "write_json_atomic", write)
    now = time.monotonic()
    c._save_state(now)
    c._save_state(now + 1.5)                      # still none: said once
    assert capsys.readouterr().err.count("Too many open files") == 1
    assert not os.path.exists(c.state_path)
    failing.clear()
    c._save_state(now + 3.0)                      # descriptors again: written
    assert json.load(open(c.state_path))["phase"] == c.phase
    failing["errno"] = errno.ENOSPC
    with pytest.raises(metrics.OutputError):
        c._save_state(now + 4.5)


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_wall_s_ends_when_the_last_worker_is_done_not_at_the_end_of_rank_0s_hold(tmp_path):
    """A review: a training script's rank 0 holds the job's end while it reads the final
    model into DIR/model.pt (psgd/connection.py); wall_s ran to its release, and so
    counted the read, the save, and, where rank 0 died, up to cluster.timeout_s more,
    against the README's "the end of the last worker's budget"."""
    cfg, c = training_with_two_workers(str(tmp_path))

    def serve(op: str, **kw) -> wire.Message:
        (_, frames), = c.service._serve(b"x", wire.encode(op, id=1, **kw))
        return wire.decode(frames)
    with closed_after(c):
        assert serve("finish", rank=0, clock=10, stats={"samples": 64}, hold=True).op == "reply"
        assert serve("finish", rank=1, clock=10, stats={"samples": 64}).op == "reply"
        c._checked = -1e9
        c._tick(time.monotonic())
        done = time.monotonic() - c.t0
        assert c.phase == "training"   # held
        time.sleep(1.0)                # rank 0 reads and saves the final model
        assert serve("release", rank=0).op == "reply"
        c._checked = -1e9
        c._tick(time.monotonic())
        assert c.t_end and c.t_end - c.t0 <= done + 0.05


@pytest.mark.unit
def test_a_worker_asking_for_a_finished_rank_is_refused_not_given_a_lost_one():
    """A review: rank 1 finished, its process exited non-zero and was started again with
    `--rank 1` (`--restart-workers`); rank 0 was lost. The new process was given rank 0,
    trained rank 0's share as its new process, and collided with rank 0's own restart."""
    from psgd.membership import Membership
    m = Membership(2, timeout_s=1.0)
    assert m.join(0.0, 0, "a") == 0 and m.join(0.0, 1, "b") == 1
    m.finish(1, 1.0)
    assert m.expire(10.0) == [0]          # rank 0 lost
    assert m.join(11.0, 1, "c") == -1     # rank 1's share is done: no rank
    assert m.join(11.0, -1, "d") == 0     # a worker asking for any rank takes the lost one


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_slow_state_file_is_no_stall_that_keeps_a_dead_worker_from_being_dropped(tmp_path, monkeypatch):
    """A review: every gap between two turns of the coordinator's loop longer than a
    heartbeat period is excused (the machine stalled); a state file whose fsync took a
    second (a loaded network disk) made every gap one, and a dead worker was never dropped."""
    cfg, c = training_with_two_workers(str(tmp_path))
    slow = c._save_state

    def save(now: float) -> None:
        slow(now)
        time.sleep(cfg.cluster.heartbeat_s * 1.5)
    monkeypatch.setattr(c, "_save_state", save)
    with closed_after(c):
        start = time.monotonic()
        c.members.beat(1, start, 3, {})   # rank 1's last heartbeat
        while c.members.members[1].state == "live" and time.monotonic() - start < 20:
            c.members.beat(0, time.monotonic(), 3, {})   # rank 0 heartbeats; rank 1 is dead
            c._tick(time.monotonic())
    assert c.members.members[1].state == "lost"


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_wall_s_ends_where_the_last_workers_training_ended_not_at_its_finish(tmp_path):
    """A review: a training script that scored for seconds after its loop, before its
    close() sent the finish, had that time in wall_s (5.7 s for 1.1 s of training in the
    cifar example), and samples/s fell by as much. A finish says how long ago its
    training ended (`idle_s`), and the job's training ends at the latest of those; one
    that is not a finite number >= 0 is refused before anything is applied."""
    cfg, c = training_with_two_workers(str(tmp_path))   # 5 s into training

    def finish(rank: int, **kw) -> wire.Message:
        msg = wire.encode("finish", id=1, rank=rank, clock=30, stats={"samples": 960}, **kw)
        return [wire.decode(f) for _, f in c.service._serve(b"w", msg)][-1]

    for bad in (-1.0, float("nan"), float("inf")):
        refused = finish(1, idle_s=bad)
        assert refused.op == "error" and refused.get("code") == wire.BAD_FIELD and "idle_s" in refused.get("reason")
    assert c.members.members[1].state == "live"
    assert finish(0).op == "reply"                  # psgd's own worker: its training ended now
    assert finish(1, idle_s=3.0).op == "reply"      # a script's: 3 s ago, at its last step
    c._tick(time.monotonic() + CHECK_EVERY_S * 1.001)
    wall = c.t_end - c.t0
    assert 4.9 < wall < 5.5, wall   # rank 0's end, the later one (the finishes' 3 s are not in it)
    cfg, c = training_with_two_workers(str(tmp_path / "again"))
    assert finish(0, idle_s=4.0).op == "reply" and finish(1, idle_s=100.0).op == "reply"   # before the start: at it
    c._tick(time.monotonic() + CHECK_EVERY_S * 1.001)
    assert 0.9 < c.t_end - c.t0 < 1.5, c.t_end - c.t0


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_one_worker_too_many_that_outlives_the_job_is_told_so():
    """A review (`docker compose up --scale worker=3` for a 2-worker job): the third worker,
    refused because every rank was taken and live, kept asking; once the job ended its
    coordinator was gone, and the worker gave up a cluster.timeout_s later saying the
    coordinator "answers when all 2 workers have registered", which was not the case."""
    import threading

    from psgd.membership import CoordinatorLink
    from psgd.transport import PeerTimeout
    port = free_port_block(3)
    cfg = Config().replace(**{"cluster.workers": 2, "cluster.servers": 1, "cluster.port": port,
                              "cluster.timeout_s": 2.0, "cluster.heartbeat_s": 0.2})
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")

    def coordinator_then_gone() -> None:   # one refusal, as the full job's coordinator answers; then it exits
        if sock.poll(5000):
            ident, *frames = sock.recv_multipart()
            sock.send_multipart([ident, *wire.error(wire.decode(frames).id, wire.REFUSED,
                                                    "all 2 worker ranks are taken and live")])
        sock.close(0)
    t = threading.Thread(target=coordinator_then_gone)
    t.start()
    try:
        with pytest.raises(PeerTimeout, match=r"when it last answered, all 2 ranks were taken by live workers "
                                              r"\(cluster.workers = 2: is this one worker too many\?\)"):
            CoordinatorLink(cfg, "worker", 0, ctx=ctx).register()
    finally:
        t.join()
        ctx.term()


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_the_coordinator_warns_once_of_shards_that_hold_nothing(tmp_path, capsys):
    """A helper's finding: `psgd run --servers 40` on the 29 pieces of the MLP started 11
    shards that served nothing, with no word but "serving 0 values" in their logs. Once
    every shard has said what it holds, the coordinator warns of those that hold none."""
    cfg = Config().replace(**{"cluster.workers": 1, "cluster.servers": 3, "cluster.port": free_port_block(4)})
    c = coordinator(cfg, str(tmp_path))
    for beat in range(2):
        for i, values in enumerate((900, 0, 0)):
            c.service._serve(b"x", wire.encode("heartbeat", id=1, rank=-1, role="server", index=i,
                                               stats={"values": values}, live_id=""))
            if beat == 0 and i < 2:   # (not all have said yet)
                assert "hold no part" not in capsys.readouterr().err
    said = [line for line in capsys.readouterr().err.splitlines() if "hold no part" in line]
    assert said == ["[psgd coordinator] warning: 2 of the 3 shards hold no part of the model (1, 2): it is cut into "
                    "fewer pieces than cluster.servers; cluster.servers = 1 serves it with fewer processes (psgd "
                    "shards shows the map)"], said


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("launched_by,says", [("coordinator process", True), ("launcher", False)])
def test_a_coordinator_started_by_hand_ends_its_log_with_the_jobs_result(tmp_path, capsys, launched_by, says):
    """A helper's finding: a coordinator started by hand (as on several hosts, or under
    Compose or Slurm, where its log is the job's) ended with "sync 0.0 s step 0/100 ...",
    exit 0, the result only in summary.json. It says psgd run's summary line; under psgd
    run, whose launcher prints that line, it does not say it twice. Its own start decides
    (a review: one started by hand that resumed psgd run's state took its `launched_by`)."""
    cfg = Config().replace(**{"cluster.workers": 1, "cluster.servers": 1, "cluster.port": free_port_block(2)})
    ctx = zmq.Context()
    c = Coordinator(cfg, str(tmp_path), ctx=ctx, launched_by=launched_by)
    c.service.close()
    ctx.term()
    c.launched_by = "coordinator process" if says else "launcher"   # (a resumed state's, not its own start)
    c._finish_job()
    said = [line for line in capsys.readouterr().err.splitlines() if "summary:" in line]
    assert len(said) == says, said
    assert all(line.startswith("[psgd coordinator] sync: no evaluation  0 samples/s  wall ")
               and line.endswith(f"; summary: {tmp_path}/summary.json") for line in said), said


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_the_coordinator_warns_once_of_a_shard_that_did_not_resume(tmp_path, capsys):
    """`psgd run` into an interrupted script job's --out with the script's model changed:
    the terminal said "resuming ... if the script's model's layout is the same", and only
    each shard's log said that it started afresh, its checkpoint to be replaced. A shard's
    heartbeats carry why (`afresh`), and the coordinator says it once."""
    cfg = Config().replace(**{"cluster.workers": 1, "cluster.servers": 2, "cluster.port": free_port_block(3)})
    c = coordinator(cfg, str(tmp_path))
    why = "it is of a model of another layout (…: the model changed)"
    for _ in range(2):
        for i in range(2):
            c.service._serve(b"x", wire.encode("heartbeat", id=1, rank=-1, role="server", index=i,
                                               stats={"values": 10}, live_id="", afresh=why))
    said = [line for line in capsys.readouterr().err.splitlines() if "did not resume" in line]
    assert said == [f"[psgd coordinator] warning: shard 0 did not resume from its checkpoint ({why}): the job starts "
                    "afresh (no shard resumes a part of the model alone), and its checkpoints replace the earlier "
                    "ones"], said


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_the_coordinator_warns_when_every_script_closed_before_the_step_budget(tmp_path):
    """A helper's finding: README's loop over one pass of a DataLoader closed each script
    at step 23 of train.steps = 300, and the job ended as if done, without a word."""
    cfg = Config().replace(**{"cluster.workers": 2, "cluster.port": free_port_block(4), "model.name": "script",
                              "train.steps": 300})
    c = coordinator(cfg, str(tmp_path))
    for rank, clock in ((0, 23), (1, 22)):
        c.members.join(0.0, rank)
        c.members.finish(rank, 1.0, {"samples": 32 * clock}, clock)
    assert c._short_of_budget() == ("every worker closed before train.steps = 300 (the furthest at step 23): a script "
                                    "whose loop ran out of data ends there; loop over epochs until ps.step() returns "
                                    "False")
    c.members.members[1].clock = 300   # one ran the budget: the others' data, or their choice
    assert c._short_of_budget() == ""
    own = coordinator(cfg.replace(**{"model.name": "mlp", "cluster.port": free_port_block(4)}), str(tmp_path / "o"))
    own.members.join(0.0, 0)
    own.members.finish(0, 1.0, {"samples": 32}, 1)
    assert own._short_of_budget() == ""   # (psgd's own workers run to the budget, or are lost)
