"""Heartbeats are O(1) in a steady job: the coordinator sends the live set (rank ->
clock of every live worker, O(W)) only to a daemon whose `live_id` is not the current
one, and the daemon's link keeps the live set it has when the answer has none."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from psgd import wire
from psgd.config import Config
from psgd.membership import CoordinatorLink
from psgd.servers.coordinator import Coordinator
from tests.conftest import ask, closed_after, free_port_block, hand_served

pytestmark = pytest.mark.inprocess


def beat(c: Coordinator, rank: int, live_id: str = "", clock: int = 5) -> wire.Message:
    return ask(c, "heartbeat", rank=rank, clock=clock, role="worker", index=rank, stats={"samples": 1},
               live_id=live_id)


@pytest.mark.timeout(30)
def test_the_live_set_goes_only_to_a_daemon_that_lacks_the_current_one():
    with closed_after(hand_served(3)) as c:
        first = beat(c, 0)
        assert first.get("live") == {"0": 5, "1": 0, "2": 0} and first.get("live_id")  # with its own clock
        current = first.get("live_id")
        steady = beat(c, 1, current)
        assert steady.get("live") is None and steady.get("live_id") == current
        assert steady.get("version") == first.get("version")
        c.service._serve(b"w2", wire.encode("finish", id=3, rank=2, clock=9, stats={"samples": 1}))
        changed = beat(c, 0, current, clock=7)      # membership changed: the new set, with the clocks now
        assert changed.get("live") == {"0": 7, "1": 5} and changed.get("live_id") != current
        assert beat(c, 1, "another coordinator's:3").get("live") is not None


@pytest.mark.timeout(30)
def test_the_link_keeps_its_live_set_when_the_answer_has_none():
    with closed_after(hand_served(2)) as c:
        link = CoordinatorLink(c.cfg, "worker", 0)
        link._apply(beat(c, 0))
        assert link.state["live"] == {0: 5, 1: 0}
        link._apply(beat(c, 0, link.state["live_id"], clock=6))
        assert link.state["live"] == {0: 5, 1: 0} and link.state["phase"] == "training"


@pytest.mark.timeout(60)
def test_a_link_that_lost_the_coordinator_finds_it_again_when_it_comes_back():
    # a coordinator silent for longer than cluster.timeout_s makes the link `lost`; one
    # that answers again (a restarted coordinator) makes it not lost any more
    import threading
    import time

    import zmq

    from psgd.transport import Service, server_socket
    cfg = Config().replace(**{"cluster.port": free_port_block(1), "cluster.timeout_s": 1.0,
                              "cluster.heartbeat_s": 0.1})
    ctx = zmq.Context()
    link = CoordinatorLink(cfg, "shard", 0, ctx)
    link.start()
    stop = threading.Event()
    sock, thread = None, None
    try:
        deadline = time.monotonic() + 20
        while not link.lost and time.monotonic() < deadline:
            time.sleep(0.1)
        assert link.lost
        sock = server_socket(ctx, cfg.coordinator_address(), cfg.security)
        service = Service(sock, {"heartbeat": lambda ident, msg: [(ident, wire.reply(msg, phase="training"))]},
                          "a coordinator")
        thread = threading.Thread(target=lambda: [service.poll(20) for _ in iter(stop.is_set, True)])
        thread.start()
        deadline = time.monotonic() + 20
        while link.lost and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not link.lost and link.state["phase"] == "training"
    finally:
        link.close()
        stop.set()
        if thread is not None:
            thread.join(timeout=5)
        if sock is not None:
            sock.close(0)
        ctx.term()


@contextmanager
def beating_to(heartbeat) -> Iterator[list]:
    """A shard's heartbeat link (a beat every 0.05 s) to a coordinator served on a thread,
    whose answer to a heartbeat is `heartbeat(ident, msg)`'s; the beats it got so far."""
    import threading

    import zmq

    from psgd.transport import Service, server_socket
    cfg = Config().replace(**{"cluster.port": free_port_block(1), "cluster.heartbeat_s": 0.05})
    ctx = zmq.Context()
    sock = server_socket(ctx, cfg.coordinator_address(), cfg.security)
    beats: list = []
    service = Service(sock, {"heartbeat": lambda ident, msg: beats.append(msg) or heartbeat(ident, msg)},
                      "a coordinator")
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [service.poll(20) for _ in iter(stop.is_set, True)])
    thread.start()
    link = CoordinatorLink(cfg, "shard", 0, ctx)
    link.start()
    try:
        yield beats
    finally:
        link.close()
        stop.set()
        thread.join(timeout=5)
        sock.close(0)
        ctx.term()


def heard(beats: list, n: int) -> bool:
    """Did `beating_to`'s coordinator get n beats within 20 s?"""
    deadline = time.monotonic() + 20
    while len(beats) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(beats) >= n


@pytest.mark.timeout(60)
def test_a_refused_heartbeat_is_said_once_with_the_coordinators_reason(capsys):
    # a refusal was taken for a silence: the daemon later ended "lost the coordinator",
    # the coordinator's reason never said
    def refuse(ident, msg):
        raise wire.WireError(wire.BAD_FIELD, "stats: 'samples' must be a count")
    with beating_to(refuse) as beats:
        assert heard(beats, 4)
    said = [line for line in capsys.readouterr().err.splitlines() if "refused by the coordinator" in line]
    assert said == ["[psgd shard-0] a heartbeat was refused by the coordinator (bad_field: stats: 'samples' "
                    "must be a count); heartbeating on"]


@pytest.mark.timeout(30)
def test_a_score_is_timed_when_the_evaluator_read_the_model():
    # the evaluator reports how long ago it read the model it scored (`age_s`): the
    # curve's time is the read's, not the report's, which scoring the test set delays
    import time
    with closed_after(hand_served(2)) as c:
        time.sleep(0.6)   # training has run longer than the scoring took
        for age in (0.0, 0.4):
            before = time.monotonic()
            ask(c, "eval", accuracy=0.5, loss=1.0, age_s=age)
            after = time.monotonic()
            t = c.evals[-1]["t"]
            assert before - age - c.t0 - 0.002 <= t <= after - age - c.t0 + 0.002


@pytest.mark.timeout(30)
def test_the_progress_line_names_the_shards_not_heard_from(capsys):
    """A shard that never started (its port was taken) or went silent: its workers wait
    on it, and the progress line says which it is."""
    with closed_after(hand_served(2, servers=2)) as c:
        c.quiet = False
        c.t0 -= c.cfg.cluster.heartbeat_timeout_s + 1   # training for longer than a heartbeat timeout
        c._progress(time.monotonic())
        assert capsys.readouterr().err.rstrip().endswith("live 2/2  shards silent: 0, 1")
        ask(c, "heartbeat", role="server", index=1)
        c._progress(time.monotonic())
        assert capsys.readouterr().err.rstrip().endswith("live 2/2  shards silent: 0")
        ask(c, "heartbeat", role="server", index=0)
        c._progress(time.monotonic())
        assert capsys.readouterr().err.rstrip().endswith("live 2/2")


@pytest.mark.timeout(30)
def test_the_progress_line_keeps_the_step_when_no_worker_is_live(capsys):
    """Once the last live worker was dropped the line said "step 0/400 ... live 0/2": the
    step the job reached is the furthest worker's, live or not."""
    with closed_after(hand_served(2, servers=1)) as c:
        c.quiet = False
        for r, clock in ((0, 37), (1, 41)):
            c.members.members[r].clock, c.members.members[r].state = clock, "lost"
        c._progress(time.monotonic())
        assert " step 41" in capsys.readouterr().err and not c.members.live()


@pytest.mark.timeout(30)
def test_a_repeated_shard_registration_is_not_a_restart():
    # a shard re-sends its registration when the answer is slow (REGISTER_RESEND_S): the
    # same nonce is the same process, not a restarted shard; another nonce is one
    with closed_after(hand_served(2)) as c:
        def register(nonce: str) -> wire.Message:
            return ask(c, "register", role="server", index=0, nonce=nonce)
        assert not register("first").get("restarted")
        assert not register("first").get("restarted")
        assert c.server_joins[0] == 1
        assert register("second").get("restarted") and c.server_joins[0] == 2


@pytest.mark.timeout(30)
def test_a_heartbeat_thread_ends_quietly_when_its_context_is_terminated():
    """A daemon that ends while its heartbeat thread still waits for the coordinator (a
    busy machine: the join gives up) leaves the context's `term()` to end that wait; the
    thread died with ContextTerminated, and whoever keeps the traceback of a thread's
    exception (pytest does) can keep the link alive, and any socket it has not closed."""
    import threading
    import time

    import zmq
    cfg = Config().replace(**{"cluster.port": free_port_block(2), "cluster.heartbeat_s": 0.1})  # nobody answers
    ctx = zmq.Context()
    died: list = []
    hook, threading.excepthook = threading.excepthook, died.append
    try:
        link = CoordinatorLink(cfg, "server", 0, ctx)
        link.start()
        time.sleep(0.5)                                     # waiting for an answer now
        ended = threading.Thread(target=ctx.term, daemon=True)
        ended.start()
        ended.join(timeout=10)
        link._thread.join(timeout=10)
    finally:
        threading.excepthook = hook
    assert not ended.is_alive() and not link._thread.is_alive()
    assert died == []


@pytest.mark.timeout(60)
def test_a_heartbeat_socket_that_cannot_be_made_is_made_at_a_later_beat(monkeypatch, capsys):
    """The heartbeat thread made its socket before its loop's error handling: a process
    out of file descriptors (`ulimit -n 16`) ended the thread with ZeroMQ's traceback,
    the daemon heartbeated no more, and the coordinator dropped it. The failure is said
    once, and the socket is made again at the next beat."""
    import errno
    import threading

    import zmq

    from psgd import membership
    from psgd.transport import Peers
    made = []

    def out_of_descriptors_once(*args, **kwargs):
        made.append(len(made))
        if len(made) == 1:
            raise zmq.ZMQError(errno.EMFILE)
        return Peers(*args, **kwargs)
    monkeypatch.setattr(membership, "Peers", out_of_descriptors_once)
    died: list = []
    hook, threading.excepthook = threading.excepthook, died.append
    try:
        with beating_to(lambda ident, msg: [(ident, wire.reply(msg))]) as beats:
            assert heard(beats, 3) and died == []
    finally:
        threading.excepthook = hook
    said = [line for line in capsys.readouterr().err.splitlines() if "heartbeat" in line]
    assert said == ["[psgd shard-0] a heartbeat failed (ZMQError: Too many open files); heartbeating on"]


@pytest.mark.timeout(30)
def test_a_superseded_workers_heartbeats_are_not_taken_as_its_replacements():
    """A review: worker 1's machine is cut off; it is dropped, and a replacement is
    started with `--rank 1`. When the network healed, the first process (alive all along)
    heartbeated again: heartbeats carried no nonce and any beat for a live rank was
    taken, so two processes trained as rank 1 and rank 1's counters were whichever
    process beat last. The beat carries its registration's nonce: the superseded process
    is told to stop (`abort`, with the reason), its counters are not taken, and neither
    its finish nor a registration again is."""
    with closed_after(hand_served(2, **{"train.steps": 1000})) as c:
        old = CoordinatorLink(c.cfg, "worker", 1)          # what the first rank-1 process sends
        try:
            old.nonce = "n1"                                # (its registration's, in hand_served)
            old.rank, old.clock_fn, old.stats_fn = 1, lambda: 200, lambda: {"samples": 6400}
            ask(c, "heartbeat", **old._beat())
            c.members.members[1].last_seen -= 100        # cut off: dropped
            c._tick(time.monotonic())
            assert c.members.members[1].state == "lost"
            assert ask(c, "register", role="worker", want_rank=1, nonce="replacement").get("assigned_rank") == 1
            ask(c, "heartbeat", role="worker", index=1, rank=1, nonce="replacement", clock=150,
                stats={"samples": 320}, live_id="")
            assert c.members.stats()[1]["samples"] == 6400 + 320
            old.clock_fn, old.stats_fn = lambda: 210, lambda: {"samples": 6720}
            old._apply(ask(c, "heartbeat", **old._beat()))   # the network heals
            assert c.members.stats()[1]["samples"] == 6400 + 320, "the superseded process's counters replaced rank 1's"
            assert old.state["abort"].startswith("rank 1 was taken over by another process"), old.state
            for op, fields in (("finish", {"clock": 210, "stats": {"samples": 6720}, "error": "a failure"}),
                               ("register", {"role": "worker", "want_rank": 1})):
                refused = ask(c, op, rank=1, nonce="n1", **fields)
                assert refused.op == "error" and "taken over" in refused.get("reason"), op
            assert c.members.members[1].state == "live" and not c.abort
        finally:
            old.close()


@pytest.mark.inprocess
@pytest.mark.timeout(120)
def test_a_sync_step_does_not_wait_a_heartbeat_for_a_worker_whose_time_budget_ended(tmp_path):
    """A review: with `train.seconds`, one sync worker stops while the other has pushed
    the next step, which waits until the shard hears that the first has finished: at the
    shard's next heartbeat, up to `cluster.heartbeat_s` (0.5 s of a 3 s comparison run,
    14 % of sync's samples/s). Shards beat every SHARD_BEAT_S at most."""
    import json

    from psgd.inprocess import InProcessCluster
    from tests.conftest import train_on_threads
    hb = 1.5
    cfg = Config().replace(**{"cluster.port": free_port_block(2), "cluster.workers": 2, "cluster.servers": 1,
                              "cluster.evaluator": False, "mode.name": "sync", "train.steps": 0,
                              "train.seconds": 2.0, "cluster.heartbeat_s": hb, "cluster.heartbeat_timeout_s": 6})
    def later(w):   # rank 1's clock started 50 ms after rank 0's, as separate processes' do
        if w.want_rank == 1:
            own = w.now
            w.now = lambda: own() - 0.05
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        codes = train_on_threads(cfg, str(tmp_path), cluster, later)
    assert codes == {0: 0, 1: 0}
    waits = {}
    for rank in range(2):
        lines = [json.loads(x) for x in open(tmp_path / "events" / f"worker-{rank}.jsonl")]
        waits[rank] = max((e["wait_s"], e["step"]) for e in lines if "staleness" in e)
    assert max(w for w, _ in waits.values()) < hb / 2, waits   # rank 1's last push waited for rank 0's finish


@pytest.mark.timeout(30)
def test_a_daemon_goes_on_with_the_jobs_heartbeat_period_and_says_what_it_replaced(capsys):
    """A review: a worker started by hand with `--set cluster.heartbeat_s=8` was told that
    the job's config replaced it ("cluster.heartbeat_s 8.0 → 0.5"), and went on beating
    every 8 s with its own (the coordinator dropped it every 5 s). Its link takes the
    job's config with the warning; the daemon's addresses and keys stay its own."""
    mine = Config().replace(**{"cluster.heartbeat_s": 8.0, "cluster.heartbeat_timeout_s": 20.0,
                               "cluster.port": 7000})
    job = Config().replace(**{"cluster.port": 8000})
    from psgd.membership import SHARD_BEAT_S
    for role, who in (("worker", "this worker"), ("server", "this shard"), ("evaluator", "the evaluator")):
        link = CoordinatorLink(mine, role, 0)
        assert link.period == (8.0 if role == "worker" else SHARD_BEAT_S)
        period = 0.5 if role == "worker" else SHARD_BEAT_S
        cfg = link.take_job_config(wire.Message("reply", fields={"config": job.to_dict()}))
        assert link.cfg is cfg and link.period == period and cfg.cluster.heartbeat_timeout_s == 5.0
        assert cfg.cluster.port == 7000 and link.address.endswith(":7000")
        said = capsys.readouterr().err
        assert said == (f"[psgd {role}-0] warning: the job's config (the coordinator's) replaces what {who} was "
                        f"given: cluster.heartbeat_s 8.0 → 0.5, cluster.heartbeat_timeout_s 20.0 → 5.0\n"), said
