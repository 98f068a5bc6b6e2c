"""ssp with two shards, each with its own view of the membership: the staleness bound
holds across a rejoin.

A shard learns the live set from the coordinator's heartbeat answers, each shard when
its own heartbeat is answered, and from the workers' requests. After a worker rejoined
far behind (the same process after a partition keeps its clock; a new process starts at
the coordinator's clock, a heartbeat old), one shard that had heard of the rejoin held
another worker's read until the rejoiner caught up, while the second, which had not,
answered it at once: that worker's push then reached the second shard some hundred
updates after its read there (tau ~ 100 with s = 1 in a real run, docs/modes.md), past
the (W - 1)(2s + 1) that SSP allows (`tests/test_invariants_real.check_run`).

Two real `Shard`s (no sockets) are driven here by a small cluster whose workers send
each shard its own requests, delivered in any order across shards and in order to one
shard, and whose coordinator's live set reaches each shard when that shard's view is
delivered. After every run: every applied push has tau <= (W - 1)(2s + 1), and no shard
applied an update of clock k after it answered a read of clock c > k + s (the read held
every update of clocks <= c - s - 1, Ho et al. 2013).
"""
from __future__ import annotations

import itertools
import os
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psgd import wire
from psgd.config import Config
from psgd.consistency.rule import Apply
from psgd.shard import Shard

SHARDS = 2
# PSGD_HUNT=N: more examples, to hunt
PROPS = settings(max_examples=int(os.environ.get("PSGD_HUNT", 120)), deadline=None,
                 suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Worker:
    rank: int
    clock: int = 0
    life: int = 0                   # a new process for the rank starts a new life
    stopped: bool = False           # stopped (SIGSTOP, a partition): it sends nothing
    joined: bool = False            # its join reads are answered: it may step
    versions: list[int] = field(default_factory=lambda: [0] * SHARDS)   # of the read it computes on
    waiting: dict[int, tuple] = field(default_factory=dict)   # shard -> the token of the read it waits for
    got: dict[int, wire.Message] = field(default_factory=dict)
    sent: list[deque] = field(default_factory=lambda: [deque() for _ in range(SHARDS)])   # not yet delivered


class Cluster:
    """W workers, two shards and the coordinator's live set (rank -> clock)."""

    def __init__(self, workers: int, bound: int):
        self.cfg = Config().replace(**{"mode.name": "ssp", "mode.staleness": bound, "cluster.workers": workers,
                                       "cluster.servers": SHARDS, "model.hidden": 2, "optimizer.momentum": 0.0,
                                       "train.steps": 10_000})
        self.s, self.W = bound, workers
        self.shards = [Shard(self.cfg, i) for i in range(SHARDS)]
        self.updates: list[list[tuple[int, int]]] = [[] for _ in range(SHARDS)]   # (rank, clock) per version
        self.taus: list[tuple[int, int, int, int]] = []         # (shard, rank, clock, tau) of every applied push
        self.reads: list[tuple[int, int, int, int]] = []        # (shard, rank, clock, version) of gated reads
        for i, shard in enumerate(self.shards):
            self._record(i, shard)
        self.workers = [Worker(r) for r in range(workers)]
        self.live = {r: 0 for r in range(workers)}
        self.ids = itertools.count(1)
        self.g = [np.full(shard.P, 1e-3, np.float32) for shard in self.shards]
        self.b = [np.zeros(shard.B, np.float32) for shard in self.shards]
        for w in self.workers:
            self.join(w)

    def _record(self, i: int, shard: Shard) -> None:
        push = shard.rule.push

        def recorded(e):
            out = push(e)
            if any(isinstance(d, Apply) for d in out):
                self.updates[i].append((e.rank, e.clock))
                self.taus.append((i, e.rank, e.clock, e.tau))
            return out
        shard.rule.push = recorded   # type: ignore[method-assign]

    # ------------------------------------------------------------ workers
    def join(self, w: Worker) -> None:
        """`PushPullSchedule.rejoin`: an ungated read of every shard."""
        w.joined, w.got = False, {}
        for i in range(SHARDS):
            token = ("join", w.rank, w.life, next(self.ids))
            w.waiting[i] = token
            m = wire.encode("pull", id=next(self.ids), rank=w.rank, clock=w.clock, join=True)
            w.sent[i].append((token, wire.decode(m)))

    def step(self, rank: int) -> None:
        """Compute on the read it has, then push it and pull for the next clock (one
        request a shard, the shard serving the push, then the read)."""
        w = self.workers[rank]
        if w.stopped or w.waiting or not w.joined:
            return
        w.got = {}
        for i in range(SHARDS):
            token = ("step", w.rank, w.life, next(self.ids))
            w.waiting[i] = token
            m = wire.encode("push", id=next(self.ids), rank=w.rank, clock=w.clock, arrays=[self.g[i], self.b[i]],
                            read_version=w.versions[i], pull=True)
            w.sent[i].append((token, wire.decode(m)))

    def deliver(self, rank: int, i: int) -> None:
        """The worker's oldest request to shard i reaches it (a stopped worker's too: it
        was on its way)."""
        w = self.workers[rank]
        if w.sent[i]:
            token, m = w.sent[i].popleft()
            self.replies(i, self.shards[i].handle(token, m))

    def replies(self, i: int, replies) -> None:
        for token, frames in replies:
            m = wire.decode(frames)
            assert m.op == "reply", m.fields
            kind, rank, life, _ = token
            if kind == "step":                                # (a join's read is not gated)
                self.reads.append((i, rank, m.clock, int(m.get("version"))))
            w = self.workers[rank]
            if life != w.life or w.waiting.get(i) != token:
                continue                                     # an earlier process's
            del w.waiting[i]
            w.got[i] = m
            if not w.waiting:
                self.answered(w)

    def answered(self, w: Worker) -> None:
        got = [w.got[i] for i in range(SHARDS)]
        w.versions = [int(m.get("version")) for m in got]
        if w.joined:
            w.clock += 1
        else:                                                 # SspSchedule.resume_clock
            w.clock, w.joined = max(w.clock, max(int(m.get("finished", 0)) for m in got)), True

    # ------------------------------------------------------------ the membership
    def view(self, i: int) -> None:
        """Shard i's heartbeat is answered: it learns the coordinator's live set."""
        self.replies(i, self.shards[i].set_live(dict(self.live)))

    def stop(self, rank: int) -> None:
        """Stopped past the heartbeat window: the coordinator drops it."""
        if rank in self.live and len(self.live) > 1:
            self.workers[rank].stopped = True
            del self.live[rank]

    def resume(self, rank: int, new_process: bool, lag: int) -> None:
        """It comes back: the same process (once its request in flight is answered) at its
        own clock, or a new one at the slowest live clock the coordinator heard, `lag`
        clocks behind the workers (heartbeats are half a second apart)."""
        w = self.workers[rank]
        if rank in self.live or (not new_process and w.waiting):
            return
        if new_process:
            w.life += 1
            w.waiting, w.sent = {}, [deque() for _ in range(SHARDS)]
            w.clock = max(0, min(self.workers[r].clock for r in self.live) - lag)
        w.stopped = False
        self.live[rank] = w.clock
        self.join(w)

    # ------------------------------------------------------------ checks
    def violations(self) -> list[str]:
        most = (self.W - 1) * (2 * self.s + 1)
        out = [f"shard {i}: worker {r}'s push of clock {c} was applied at tau {tau} > {most}"
               for i, r, c, tau in self.taus if tau > most]
        for i, r, c, v in self.reads:
            late = [u for u in self.updates[i][v:] if u[1] <= c - self.s - 1]
            if late:
                out.append(f"shard {i} answered worker {r}'s read of clock {c} at version {v}, then applied "
                           f"{late[:4]} (clocks <= c - s - 1)")
        return out


def run(m: Cluster, ranks, rounds: int) -> None:
    """`rounds` of: each of `ranks` steps, and every request in flight is delivered."""
    for _ in range(rounds):
        for r in ranks:
            m.step(r)
        for r in range(m.W):
            for i in range(SHARDS):
                while m.workers[r].sent[i] and not m.workers[r].stopped:
                    m.deliver(r, i)


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("new_process", [False, True])
@pytest.mark.parametrize("first", [0, 1])
def test_a_rejoin_far_behind_heard_by_one_shard_first_keeps_the_bound(new_process, first):
    """Worker 2 is stopped at clock 2 and dropped; 0 and 1 run on to clock 32; 2 comes
    back (at its own clock 2, or as a new process at the coordinator's clock, 30 behind)
    and shard `first` hears of it, the other shard 10 rounds later. Worker 0's read of
    clock 33 was answered by the other shard and held by `first` until 2 caught up: its
    push of clock 33 was applied there at tau 31 (> 6), and 120 pushes in all broke the
    bound."""
    m = Cluster(3, 1)
    run(m, range(3), 3)
    m.stop(2)
    for i in range(SHARDS):
        m.view(i)
    run(m, (0, 1), 30)
    m.resume(2, new_process, lag=30)
    m.view(first)
    run(m, range(3), 10)
    m.view(1 - first)
    run(m, range(3), 40)
    assert m.violations() == []
    assert min(w.clock for w in m.workers) > 40                    # nobody was held for good


@pytest.mark.unit
@pytest.mark.timeout(120)
@PROPS
@given(workers=st.integers(2, 3), bound=st.integers(0, 2),
       events=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 63), st.integers(0, 63)), max_size=150))
def test_the_bound_holds_whatever_each_shard_has_heard(workers, bound, events):
    m = Cluster(workers, bound)
    for kind, a, b in events:
        rank = a % workers
        if kind <= 1:
            m.step(rank)
        elif kind <= 4:
            m.deliver(rank, b % SHARDS)
        elif kind <= 6:
            m.view(b % SHARDS)
        elif kind == 7:
            m.stop(rank)
        elif kind == 8:
            m.resume(rank, bool(b % 2), b // 2 % 16)
        else:                                             # the live workers run a few clocks on
            run(m, [r for r in range(workers) if not m.workers[r].stopped], 1 + b % 8)
    assert m.violations() == []


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_join_counts_the_rejoiner_on_a_shard_that_had_dropped_it():
    """The smallest case (hypothesis's): worker 0 is dropped on shard 0 only, comes back
    at its clock 0, and joins; worker 1's read of clock 1 is answered by shard 0, which
    had not heard of the rejoin, before worker 0's push of clock 0 arrives (s = 0: the
    read was to hold it). Shard 0 now counts worker 0 from its join read on."""
    m = Cluster(2, 0)
    run(m, (0, 1), 1)                                               # the join reads
    m.stop(0)
    m.view(0)
    m.resume(0, new_process=False, lag=0)
    run(m, (0, 1), 2)
    assert m.violations() == []
    assert [w.clock for w in m.workers] == [1, 1]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_restored_shard_keeps_the_floor_its_answered_reads_set():
    """A shard restored from its checkpoint still counts a rejoiner at the clock its
    reads answered before had assumed (the floor was not in the checkpoint: a restored
    shard counted a rejoiner far behind at its own clock)."""
    from psgd.consistency import rule as r
    cfg = Config().replace(**{"mode.name": "ssp", "mode.staleness": 1, "cluster.workers": 2, "cluster.servers": 1,
                              "train.steps": 100})
    shard = Shard(cfg, 0)
    shard.rule.clocks.set_live({1: 10})
    shard.rule.read(r.Read("read", 1, 10, False))   # answered: every worker had finished clock 9
    assert shard.rule.clocks.floor == 9
    restored = Shard(cfg, 0)
    restored.rule.load_state_dict(shard.rule.state_dict())
    assert restored.rule.clocks.floor == 9
    restored.rule.read(r.Read("join", 0, 2, True))  # worker 0 back at its clock 2
    assert restored.rule.clocks.finished[0] == 9
