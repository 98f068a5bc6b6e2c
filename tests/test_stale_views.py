"""A coordinator's view from before a worker (re)registered, which a shard applies after
that worker's join read, does not remove the worker again.

A shard learns the live set from the answers to its heartbeats (servers/shard_server.py),
and a worker that (re)joins sends each shard a join read. An answer the coordinator made
before the worker re-registered may reach the shard's loop after the join read: the
rank, missing from that view, was removed again. Under ssp the shard then answered
reads past it and dropped its next push as one "from before leaving" (the staleness
bound broken: 18 violations in a review's run); under async easgd it noted the rank as
gone again after its join, and a later restart of the process, before the coordinator
missed it, was taken for a new life whose offers moved the centre a second time.

The join read carries the live_id of the worker's registration (`since`); a shard keeps
the rank in the live set of a view of that coordinator's life older than it, and takes
a view as it is once one of that version or later has come, or a view of another life.
"""
from __future__ import annotations

import time
import types

import numpy as np
import pytest
import torch

from psgd import wire
from psgd.config import Config
from psgd.shard import Shard
from psgd.workers import worker as process
from psgd.workers.client import ParameterClient
from tests.test_coordinator_state import three_workers_heard
from tests.test_easgd_rejoin_resend import answer, elastic, shard_of
from tests.test_ssp_rejoin_views import SHARDS, Cluster, Worker, run

pytestmark = pytest.mark.unit

EPOCH = "c0ffee01"


class Views(Cluster):
    """`Cluster`, with the coordinator's membership versioned as `Coordinator._view`
    names it (`live_id`: its life and the version), each view delivered with its id, and
    join reads that carry the live_id of the worker's registration (`since`)."""

    def __init__(self, workers: int, bound: int):
        self.epoch, self.version = EPOCH, 0
        self.registered: dict[int, str] = {}   # rank -> the live_id of its latest registration
        super().__init__(workers, bound)

    def live_id(self) -> str:
        return f"{self.epoch}:{self.version}"

    def snapshot(self) -> tuple[dict[int, int], str]:
        """The view as the coordinator answers a heartbeat now."""
        return dict(self.live), self.live_id()

    def apply(self, i: int, view: tuple[dict[int, int], str]) -> None:
        """Shard i's loop applies `view` (maybe one answered a while ago)."""
        self.replies(i, self.shards[i].set_live(*view))

    def view(self, i: int) -> None:
        self.apply(i, self.snapshot())

    def join(self, w: Worker) -> None:
        super().join(w)
        since = self.registered.get(w.rank)
        if since is None:   # (the job's first registrations, all before any view)
            return
        for i in range(SHARDS):
            token, m = w.sent[i][-1]
            w.sent[i][-1] = (token, wire.decode(wire.encode("pull", id=m.id, rank=m.rank, clock=m.clock,
                                                            join=True, since=since)))

    def stop(self, rank: int) -> None:
        if rank in self.live and len(self.live) > 1:
            self.version += 1
        super().stop(rank)

    def resume(self, rank: int, new_process: bool, lag: int) -> None:
        """It registers again (a new version), then joins with that registration's id."""
        w = self.workers[rank]
        if rank in self.live or (not new_process and w.waiting):
            return
        self.version += 1
        self.registered[rank] = self.live_id()
        super().resume(rank, new_process, lag)


def dropped(m: Cluster) -> list[int]:
    return [shard.stats()["dropped"] for shard in m.shards]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("new_process", [False, True], ids=["same process", "new process"])
def test_ssp_a_view_from_before_the_rejoin_applied_after_the_join_keeps_the_rejoiner(new_process):
    """Worker 2 is dropped (view v1) and comes back (v2), 30 clocks behind; shard 1 heard
    v1 in time, shard 0 gets 2's join read, then v1, then v2 ten rounds later. Shard 0
    kept 2 counted from its join read: no read past the bound, no push dropped. (It
    removed 2 again: its reads ran past it, its next push was dropped as from before
    leaving, and 2's later pushes broke the bound.)"""
    m = Views(3, 1)
    run(m, range(3), 3)
    m.stop(2)
    stale = m.snapshot()               # v1, answered to shard 0's heartbeat, applied late
    m.view(1)
    run(m, (0, 1), 30)
    m.resume(2, new_process, lag=30)
    for i in range(SHARDS):
        m.deliver(2, i)                # 2's join reads
    m.apply(0, stale)
    m.view(1)
    run(m, range(3), 10)
    m.view(0)                          # v2
    run(m, range(3), 40)
    assert m.violations() == []
    assert dropped(m) == [0, 0]
    assert min(w.clock for w in m.workers) > 40
    assert 2 in m.shards[0].live


@pytest.mark.timeout(60)
def test_ssp_a_rank_that_leaves_after_its_rejoin_leaves_at_the_next_view():
    """The kept rank is removed by the first view of its registration's version or later
    that lacks it: a real leave, never kept."""
    m = Views(3, 1)
    run(m, range(3), 3)
    m.stop(2)
    stale = m.snapshot()
    run(m, (0, 1), 5)
    m.resume(2, new_process=False, lag=0)
    for i in range(SHARDS):
        m.deliver(2, i)
    m.apply(0, stale)
    assert 2 in m.shards[0].rule.clocks.live
    run(m, range(3), 3)
    m.stop(2)                          # v3: 2 left again
    m.view(0)
    assert 2 not in m.shards[0].rule.clocks.live and 2 not in m.shards[0].live
    m.apply(0, stale)                  # (an older view, late: it lacks 2 too)
    assert 2 not in m.shards[0].rule.clocks.live


@pytest.mark.timeout(60)
def test_ssp_a_view_of_another_coordinator_life_is_taken_as_it_is():
    """A restarted coordinator (another epoch) counts its versions afresh: its view is
    not compared with a registration of the life before, and one that lacks the rank
    removes it."""
    m = Views(3, 1)
    run(m, range(3), 3)
    m.stop(2)
    run(m, (0, 1), 5)
    m.resume(2, new_process=False, lag=0)
    for i in range(SHARDS):
        m.deliver(2, i)
    m.apply(0, ({0: 5, 1: 5}, "another:0"))
    assert 2 not in m.shards[0].rule.clocks.live


@pytest.mark.timeout(60)
def test_ssp_a_join_read_without_since_is_served_and_a_view_taken_as_it_is():
    """An older worker's join read has no `since`: it is served as before, and a view
    that lacks its rank removes it (nothing tells the shard the view is older)."""
    m = Cluster(3, 1)
    run(m, range(3), 3)
    m.stop(2)
    stale = dict(m.live)
    run(m, (0, 1), 5)
    m.resume(2, new_process=False, lag=0)
    for i in range(SHARDS):
        m.deliver(2, i)
    assert m.workers[2].joined
    m.shards[0].set_live(stale, f"{EPOCH}:1")
    assert 2 not in m.shards[0].rule.clocks.live


@pytest.mark.timeout(60)
@pytest.mark.parametrize("since", ["", "c0ffee01", "c0ffee01:", ":3", "c0ffee01:-1", "c0ffee01:x", "c0ffee01:²",
                                   "c0ffee01:" + "9" * 5000], ids=lambda s: repr(s[:24]))
def test_a_join_reads_since_that_names_no_registration_is_refused(since):
    shard = shard_of(sync=False)
    m = wire.decode(wire.encode("pull", id=3, rank=0, clock=0, join=True, since=since))
    with pytest.raises(wire.WireError) as e:
        shard.handle("join", m)
    assert e.value.code == wire.BAD_FIELD


@pytest.mark.timeout(60)
def test_since_is_a_string_on_the_wire():
    with pytest.raises(wire.WireError):
        wire.decode(wire.encode("pull", id=3, rank=0, clock=0, join=True, since=7))


def join_since(rank: int, clock: int, since: str) -> wire.Message:
    return wire.decode(wire.encode("pull", id=3, rank=rank, clock=clock, join=True, since=since))


def offer_rounds(shard: Shard, rank: int, rounds, x: float) -> None:
    c0 = torch.zeros(shard.P)
    for rnd in rounds:
        m = answer(shard.handle(f"r{rnd}", elastic(shard, rank, rnd, c0 + x)), f"r{rnd}")
        assert m.op == "reply", m.fields


@pytest.mark.timeout(60)
def test_easgd_async_a_view_from_before_the_rejoin_does_not_begin_a_later_restart_anew():
    """Rank 0 offered rounds 0-2, was dropped (v1) and rejoined (v2) between two of the
    shard's beats: its join read (continues after round 2) came before v1. It offers
    rounds 3 and 4; its process is then restarted before the coordinator missed it (v3,
    rank 0 live throughout) and joins at the coordinator's clock for it, 4. The shard
    never saw rank 0 leave since its join: the new process continues after round 4, and
    every round moved the centre once. (v1, applied after the join, noted rank 0 as gone
    again: the restart was taken for a new life, which offered round 4 again and moved
    the centre twice.)"""
    shard = shard_of(sync=False)   # tau = 1: a round is a clock
    offer_rounds(shard, 0, range(3), 1.0)
    stale = ({1: 0}, f"{EPOCH}:1")
    assert answer(shard.handle("join", join_since(0, 3, f"{EPOCH}:2")), "join").get("offered") == 2
    shard.set_live(*stale)
    shard.set_live({0: 3, 1: 0}, f"{EPOCH}:2")
    offer_rounds(shard, 0, (3, 4), 2.0)
    skip = answer(shard.handle("join", join_since(0, 4, f"{EPOCH}:3")), "join").get("offered")
    offer_rounds(shard, 0, range(skip + 1 if skip >= 0 else 4, 7), 3.0)   # as `EasgdSchedule.join` goes on
    assert shard.counters["pushes"] == shard.version == 7 and shard.counters["duplicates"] == 0
    assert skip == 4


@pytest.mark.timeout(60)
def test_easgd_async_a_rank_that_left_after_its_rejoin_begins_a_new_life():
    """A view of the registration's version or later that lacks the rank is a real leave:
    the next process's join begins a new life (its offers from its clock on move the
    centre)."""
    shard = shard_of(sync=False)
    offer_rounds(shard, 0, range(3), 1.0)
    shard.handle("join", join_since(0, 3, f"{EPOCH}:2"))
    shard.set_live({1: 0}, f"{EPOCH}:1")     # stale: kept
    shard.set_live({1: 0}, f"{EPOCH}:3")     # left again
    shard.set_live({0: 1, 1: 0}, f"{EPOCH}:4")
    assert answer(shard.handle("join", join_since(0, 1, f"{EPOCH}:4")), "join").get("offered") == -1
    offer_rounds(shard, 0, (1, 2), 2.0)
    assert shard.counters["pushes"] == shard.version == 5


@pytest.mark.timeout(60)
def test_a_join_read_with_since_is_answered_as_one_without():
    """`since` changes nothing of the join read's answer."""
    a, b = shard_of(sync=False), shard_of(sync=False)
    with_since = answer(a.handle("join", join_since(1, 0, f"{EPOCH}:2")), "join")
    without = answer(b.handle("join", wire.decode(wire.encode("pull", id=3, rank=1, clock=0, join=True))), "join")
    assert with_since.fields == without.fields
    np.testing.assert_array_equal(with_since.arrays[0], without.arrays[0])


@pytest.mark.timeout(60)
def test_a_worker_that_rejoins_names_its_registration_in_its_join_read():
    """Through the coordinator's own answers: worker 0 is dropped (a view without it),
    rejoins (`Worker.rejoin_if_dropped`), and its join read names the live_id of that
    registration; a shard that applies the view from before it after the join read keeps
    worker 0, and a view of the registration's version settles it."""
    c, serve = three_workers_heard("ssp")
    c.members.members[0].last_seen -= 100        # a partition: its heartbeats stop coming
    c._tick(time.monotonic())
    stale = c._view()
    assert "0" not in stale["live"]

    class Link:
        state = {"rejoin": True}

        def register(self, rank: int) -> wire.Message:
            return serve("register", role="worker", want_rank=rank, nonce="n0")

    w = types.SimpleNamespace(cfg=c.cfg, rank=0, clock=84, name="worker-0", link=Link(), registration="")
    assert process.Worker.rejoin_if_dropped(w)
    assert w.registration == c._view()["live_id"] != stale["live_id"]
    client = ParameterClient.__new__(ParameterClient)   # (no sockets: the requests are kept here)
    client._setup(c.cfg, 0)
    client.since = lambda: w.registration
    sent: list = []
    client.request = lambda reqs, cancel=None: sent.extend(reqs) or []   # type: ignore[method-assign]
    client.join(w.clock)
    [(_, op, fields)] = sent
    assert op == "pull" and fields["since"] == w.registration

    shard = Shard(c.cfg.replace(**{"model.hidden": 2}), 0)
    shard.handle("join", wire.decode(wire.encode(op, id=3, rank=0, **fields)))
    shard.set_live({int(r): v for r, v in stale["live"].items()}, stale["live_id"])
    assert 0 in shard.rule.clocks.live and 0 not in shard.rule.away
    now = c._view()
    shard.set_live({int(r): v for r, v in now["live"].items()}, now["live_id"])
    assert shard._joined == {}


@pytest.mark.timeout(60)
def test_a_client_whose_registration_named_no_view_sends_no_since():
    """(An older coordinator's answer has no live_id: the join read is an older worker's.)"""
    client = ParameterClient.__new__(ParameterClient)
    client._setup(Config().replace(**{"cluster.servers": 2}), 1)
    sent: list = []
    client.request = lambda reqs, cancel=None: sent.extend(reqs) or []   # type: ignore[method-assign]
    client.join(5)
    assert [f for _, _, f in sent] == [{"clock": 5, "join": True}] * 2


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_ssp_a_join_read_that_comes_after_the_view_that_removed_its_rank_does_not_count_it():
    """The other order (a second review's): rank 1 re-registered at version 3 and died;
    the view of version 4 that removed it reached the shard before its join read (the
    shard stalled). Joined, it was counted live at its clock 0 for good, and rank 0's
    reads more than s ahead of it parked for good; it is now served as a plain read."""
    cfg = Config().replace(**{"mode.name": "ssp", "mode.staleness": 1, "cluster.workers": 2,
                              "cluster.servers": 1, "model.hidden": 2, "optimizer.momentum": 0.0,
                              "train.steps": 10_000})
    shard = Shard(cfg, 0)
    g, b = np.full(shard.P, 1e-3, np.float32), np.zeros(shard.B, np.float32)
    shard.set_live({0: 0, 1: 0}, "e1:2")
    shard.set_live({0: 0}, "e1:4")
    assert shard.handle("join", join_since(1, 0, "e1:3"))   # answered
    assert sorted(shard.rule.clocks.live) == [0] and shard.live == {0}
    version = 0
    for clock in range(10):
        out = shard.handle(("push", clock), wire.decode(wire.encode(
            "push", id=100 + clock, rank=0, clock=clock, arrays=[g, b], read_version=version, pull=True)))
        assert out, f"rank 0's read of clock {clock + 1} parked"
        version = shard.version
