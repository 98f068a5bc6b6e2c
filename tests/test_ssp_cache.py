"""SSP with Bösen's client cache (`mode.cache = true`): the bound still holds.

The invariant, for a worker r that computes its gradient of clock c (it has finished
clocks 0..c-1), with s = `mode.staleness`:

  (a) its model holds every update U(q, k) with k <= c - s - 1 of every worker q that
      was live when r decided to compute on that model (when its pull was answered, or
      when its cache was found fresh), whenever q pushes U(q, k), before or after;
  (b) its model holds every update of its own pushed so far (read-my-writes).

A pure cluster drives the real pieces with no sockets: one `SspRule` (its decisions
carried out on a model that is a set of updates (rank, clock)), and per worker the
schedule's cache logic (`ClientCache`, `guaranteed`, the join-then-gated-pull of
`SspSchedule.rejoin`), under interleavings of steps, leaves and rejoins drawn by
hypothesis. `SspSchedule` itself is then run with a fake trainer and client.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psgd import wire
from psgd.config import Config
from psgd.consistency.clock import live_key
from psgd.consistency.rule import Answer, Apply, Push, Read
from psgd.consistency.ssp import ClientCache, SspRule, SspSchedule, guaranteed
from psgd.shard import Shard
from psgd.workers.client import ParameterClient
from tests.loopback import FakeTrainer as LoopbackTrainer
from tests.test_async_knobs import FakeTrainer, Tables, pulls, pushes

pytestmark = pytest.mark.unit

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EVENTS = st.lists(st.tuples(st.integers(0, 9), st.integers(0, 63)), max_size=120)


@dataclass
class Worker:
    rank: int
    bound: int
    clock: int = 0
    state: str = "fresh"       # fresh (join due) | decide | ready (compute due) | parked | dead
    life: int = 0
    model: frozenset = frozenset()
    decided_live: frozenset = frozenset()
    cache: ClientCache = field(init=False)

    def __post_init__(self):
        self.cache = ClientCache(self.bound)


class Cluster:
    """One shard's `SspRule` and n workers running the cache logic of `SspSchedule`."""

    def __init__(self, n: int, bound: int, live_check: bool = True):
        cfg = Config().replace(**{"mode.name": "ssp", "mode.staleness": bound, "mode.cache": True,
                                  "cluster.workers": n})
        self.s = bound
        self.rule = SspRule(cfg.mode, n, Tables())
        self.applied: set[tuple[int, int]] = set()
        self.pushed: list[tuple[int, int]] = []           # every push, in order
        self.live = set(range(n))
        self.workers = {r: Worker(r, bound) for r in range(n)}
        self.records: list[tuple[int, int, frozenset, frozenset, frozenset]] = []
        self.hits = self.pulls = 0
        self.live_check = live_check

    # the shard
    def carry_out(self, decisions) -> None:
        for d in decisions:
            if isinstance(d, Apply):
                self.applied.add(d.grad)
            elif isinstance(d, Answer) and d.token[0] == "read":
                self.answered(d.token, frozenset(self.applied), d.fields)

    def answered(self, token, model: frozenset, fields: dict) -> None:
        _, rank, life, clock, join = token
        w = self.workers[rank]
        if w.life != life or w.state == "dead":
            return                                          # a read of an earlier life
        w.model = model
        w.cache.fill(guaranteed([fields]), self.live)
        if join:                                            # SspSchedule.rejoin
            w.clock = max(w.clock, int(fields["finished"]))
            if not w.cache.fresh(w.clock, self.live):
                self.read(w, w.clock)
                return
        else:
            w.clock = clock
        w.state, w.decided_live = "ready", frozenset(self.live)

    def read(self, w: Worker, clock: int, join: bool = False) -> None:
        w.state = "parked"
        self.pulls += 1
        self.carry_out(self.rule.read(Read(("read", w.rank, w.life, clock, join), w.rank, clock, join)))

    def membership(self) -> None:
        self.carry_out(self.rule.membership({r: self.workers[r].clock for r in sorted(self.live)}))

    # the workers
    def step(self, rank: int) -> None:
        w = self.workers[rank]
        if w.state == "fresh":
            self.read(w, w.clock, join=True)
        elif w.state == "decide":                            # SspSchedule.cached, then compute at once
            fresh = (w.cache.fresh(w.clock, self.live) if self.live_check
                     else w.cache.fresh(w.clock, w.cache.live))
            if fresh:
                self.hits += 1
                w.decided_live = frozenset(self.live)
                self.compute(w)
            else:
                self.read(w, w.clock)
        elif w.state == "ready":
            self.compute(w)

    def compute(self, w: Worker) -> None:
        own = frozenset(u for u in self.pushed if u[0] == w.rank)
        self.records.append((w.rank, w.clock, w.model, w.decided_live, own))
        u = (w.rank, w.clock)
        self.pushed.append(u)
        self.carry_out(self.rule.push(Push(("push", *u), w.rank, w.clock, 0, u, None)))
        w.model = w.model | {u}                              # read-my-writes
        w.clock, w.state = w.clock + 1, "decide"

    def leave(self, rank: int) -> None:
        self.live.discard(rank)
        self.workers[rank].state = "dead"
        self.membership()

    def rejoin(self, rank: int) -> None:
        w = self.workers[rank]                               # at its own clock, as the coordinator says
        w.state, w.life = "fresh", w.life + 1
        self.live.add(rank)
        self.membership()

    def violations(self) -> list[str]:
        out = []
        for rank, c, model, live, own in self.records:
            missing = [u for u in self.pushed if u[0] in live and u[1] <= c - self.s - 1 and u not in model]
            if missing:
                out.append(f"worker {rank} computed clock {c} without {missing} (live {sorted(live)})")
            if not own <= model:
                out.append(f"worker {rank} computed clock {c} without its own {sorted(own - model)}")
        return out


def drive(n: int, bound: int, events, live_check: bool = True) -> Cluster:
    m = Cluster(n, bound, live_check)
    for kind, a in events:
        rank = a % n
        if kind <= 6:
            m.step(rank)
        elif kind == 7 and rank in m.live and len(m.live) > 1:
            m.leave(rank)
        elif kind >= 8 and rank not in m.live:
            m.rejoin(rank)
    return m


@pytest.mark.timeout(120)
@PROPS
@given(n=st.integers(1, 4), bound=st.integers(0, 3), events=EVENTS)
def test_the_bound_holds_with_the_cache(n, bound, events):
    m = drive(n, bound, events)
    assert m.violations() == []


def test_the_cache_serves_reads_and_saves_pulls():
    m = drive(3, 2, [(0, r) for _ in range(40) for r in range(3)])   # round robin
    assert m.violations() == []
    computes = len(m.records)
    assert m.hits > computes / 3 and m.pulls < computes              # a pull every few clocks, not every one
    assert max(c for _, c, *_ in m.records) >= 25


def test_a_rejoined_worker_invalidates_the_cache():
    # worker 1 leaves; worker 0 runs ahead alone, its cache guaranteeing its own clock;
    # worker 1 comes back at clock 0: without the live check worker 0 would compute on
    # a model that will never hold worker 1's clocks 0.. c - s - 1
    events = [(0, 0), (0, 1), (7, 1)] + [(0, 0)] * 12 + [(8, 1)] + [(0, 0)] * 4 + [(0, 1)] * 12 + [(0, 0)] * 4
    assert drive(2, 2, events).violations() == []
    assert drive(2, 2, events, live_check=False).violations() != []


def test_cache_condition_is_t_at_least_c_minus_s():
    cache = ClientCache(2)
    assert not cache.fresh(0, {0})                       # nothing read yet
    cache.fill(5, {0, 1})
    assert cache.fresh(7, {0, 1}) and cache.fresh(7, {1})
    assert not cache.fresh(8, {0, 1})                    # 5 < 8 - 2: missing clock 5 <= c - s - 1
    assert not cache.fresh(6, {0, 1, 2})                 # a worker joined since the read


def test_rule_answers_carry_the_guaranteed_clock():
    cfg = Config().replace(**{"mode.name": "ssp", "mode.staleness": 1, "cluster.workers": 2})
    r = SspRule(cfg.mode, 2, Tables())
    for c in range(2):
        r.push(Push(("p", c), 0, c, 0, "g", None))
    assert r.read(Read("t", 0, 2)) == []                 # worker 1 has finished 0 < 2 - 1: parked
    out = r.push(Push(("p", 9), 1, 0, 0, "g", None))      # it finishes clock 1: the read goes
    (a,) = [d for d in out if isinstance(d, Answer) and d.token == "t"]
    assert a.fields == {"step": 0, "finished": 2, "guaranteed": 1, "live_key": live_key({0, 1})} and a.snapshot
    (b,) = r.read(Read("u", 1, 1))
    assert b.fields["guaranteed"] == 1


# ---------------------------------------------------------------- SspSchedule with a fake client

def started(steps: int, drop: set[int] | None = None, **sets) -> tuple[FakeTrainer, SspSchedule]:
    """One ssp worker against the fake client, started; the client answers the pushes of
    the clocks in `drop` dropped."""
    cfg = Config().replace(**{"mode.name": "ssp", "cluster.workers": 1, "cluster.servers": 1,
                              "optimizer.momentum": 0.0, "train.steps": steps, **sets})
    w = FakeTrainer(cfg, real=True)
    w.client.drop |= drop or set()
    schedule = SspSchedule(cfg)
    schedule.start(w)
    return w, schedule


def run_ssp(steps: int, drop: set[int] | None = None, **sets) -> FakeTrainer:
    w, schedule = started(steps, drop, **sets)
    while w.clock < steps:
        schedule.step(w)
    schedule.finish(w)
    return w


def test_schedule_pulls_only_when_the_cache_is_stale_and_reads_its_own_writes():
    w = run_ssp(9, **{"mode.staleness": 2, "mode.cache": True})
    assert [c for c, _ in pushes(w)] == list(range(9))   # every update is pushed
    # one worker: its reads guarantee its own clock t, which serves clocks up to t + 2
    assert pulls(w) == [0, 3, 6, 9]
    assert [e.get("cached", False) for e in w.lines] == [True, True, False] * 3
    lr, p = w.cfg.optimizer.lr, w.computed_on[0].clone()
    for k, (_, g) in enumerate(pushes(w)):               # plain SGD: the own copy is the server's model
        torch.testing.assert_close(w.computed_on[k], p)
        p -= lr * g


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_dropped_push_empties_the_cache(prefetch):
    """The shard dropped the push of clock 0 (from before a leave, or read ahead of a
    restored shard): the worker's copy, stepped by that gradient (read-my-writes), holds an
    update the shard does not, and it reads at once, before it computes on that copy again
    (it computed on it up to the cache's next pull, at clock 3, before)."""
    w = run_ssp(6, {0}, **{"mode.staleness": 2, "mode.cache": True, "mode.prefetch": prefetch})
    assert [e.get("dropped", False) for e in w.lines] == [True, False, False, False, False, False]
    assert w.lines[0].get("cached", False) == prefetch   # (the next step computed on the copy: with prefetch only)
    applied = dict(pushes(w))
    assert sorted(applied) == [1, 2, 3, 4, 5]
    lr, p = w.cfg.optimizer.lr, w.computed_on[0].clone()
    for c in range(6):   # every compute saw the shard's model: the updates it applied
        if not (prefetch and c == 1):   # (with prefetch, step 1 computed while push 0 travelled)
            torch.testing.assert_close(w.computed_on[c], p)
        if c in applied:
            p -= lr * applied[c]


def test_a_dropped_last_push_is_not_read_anew_as_the_worker_stops():
    """Prefetch: the last push, settled as the worker finishes, was dropped: no read follows
    (nothing computes on the copy again)."""
    w, schedule = started(5, {4}, **{"mode.staleness": 2, "mode.cache": True, "mode.prefetch": True})
    while w.clock < 5:
        schedule.step(w)
    assert schedule.inflight is not None   # (the push of clock 4, prefetched: settled by finish)
    reads = pulls(w)
    schedule.finish(w)
    assert w.lines[-1]["dropped"] and pulls(w) == reads


def test_a_dropped_push_whose_read_anew_is_refused_still_logs_its_step_and_reads_with_the_next_push():
    """The read after a dropped push (`SspSchedule.settled`) refused: the dropped push's line
    is written (`cached`: the next step computes on the copy once more), the refusal is the
    worker's (a refused step, counted in `rejected`; the clock has moved on), and the cache
    is empty, so the next step's push reads (without, a review found the line lost and the
    next steps computed on the copy that held the dropped gradient)."""
    w, schedule = started(4, {0}, **{"mode.staleness": 2, "mode.cache": True})
    w.client.refuse_pulls.add(1)
    with pytest.raises(wire.Refused):
        schedule.step(w)
    assert [(e["clock"], e.get("dropped", False), e.get("cached", False)) for e in w.lines] == [(1, True, True)]
    schedule.step(w)
    assert [e[:2] for e in w.client.log] == [("pull", 0), ("push", 1), ("pull", 2)]   # (the push, with its read)


def test_schedule_without_the_cache_pulls_every_step():
    w = run_ssp(5, **{"mode.staleness": 2})
    assert pulls(w) == [0, 1, 2, 3, 4, 5] and all("cached" not in e for e in w.lines)


@pytest.mark.parametrize("cache", [False, True])
def test_schedule_prefetch_computes_ahead_within_the_bound(cache):
    w = run_ssp(9, **{"mode.staleness": 2, "mode.prefetch": True, "mode.cache": cache})
    assert [c for c, _ in pushes(w)] == list(range(9))
    assert pulls(w) == ([0, 3, 6, 9] if cache else list(range(10)))
    assert [e["clock"] for e in w.lines] == list(range(1, 10))     # one line a step, in order
    lr, p = w.cfg.optimizer.lr, w.computed_on[0].clone()
    for k, (_, g) in enumerate(pushes(w)):               # every compute saw all the updates before it
        torch.testing.assert_close(w.computed_on[k], p)
        p -= lr * g


def test_schedule_prefetch_waits_outside_the_bound():
    # s = 0: no copy is ever fresh for the next clock, so every step waits for its pull
    w = run_ssp(4, **{"mode.staleness": 0, "mode.prefetch": True})
    assert pulls(w) == [0, 1, 2, 3, 4] and not any(e.get("cached") for e in w.lines)


# ---------------------------------------------------------------- SspSchedule against a real Shard

class Parked(Exception):
    """The worker would block here: its request is parked at the shard."""


class ShardClient:
    """`ParameterClient`'s begin/finish halves over one real `Shard`, in this thread: a
    request is served when it is sent (`begin`), so its answer is the shard's state then;
    `finish` only hands it over, or raises `Parked` if the shard parked it."""

    tables = staticmethod(ParameterClient.tables)

    def __init__(self, shard: Shard, rank: int):
        self.shard, self.rank = shard, rank
        self.wait_s = 0.0
        self.answered: dict = {}
        self.ids = itertools.count(1)

    def _send(self, op: str, **fields):
        token = ("c", self.rank, next(self.ids))
        req = wire.decode([bytes(f) for f in wire.encode(op, id=next(self.ids), rank=self.rank, **fields)])
        self.deliver(self.shard.handle(token, req))
        return token

    def deliver(self, replies) -> None:
        for token, frames in replies:
            self.answered[token] = wire.raise_if_error(wire.decode([bytes(f) for f in frames]), "shard")

    def begin_push_pull(self, clock, grads, buffers, read_versions, slot=0, pull=True):
        fields = {"clock": clock, "read_version": read_versions[0], "arrays": [grads[0].clone(), buffers[0].clone()]}
        return [("pushpull" if pull else "push", self._send("push", **fields, **({"pull": True} if pull else {})))]

    def finish_push_pull(self, f):
        pushed, pulled = [], []
        for kind, token in f:
            if token not in self.answered:
                raise Parked(f"worker {self.rank}'s {kind} is parked at the shard")
            m = self.answered.pop(token)
            if kind == "pushpull":
                pushed.append(wire.Message("reply", m.id, m.rank, m.clock, m.get("push")))
                pulled.append(m)
            elif kind == "push":
                pushed.append(m)
            else:
                pulled.append(m)
        return pushed, pulled

    def join(self, clock):
        return self.finish_push_pull([("pull", self._send("pull", clock=clock, join=True))])[1]

    def pull(self, clock):
        return self.finish_push_pull([("pull", self._send("pull", clock=clock))])[1]


class LiveTrainer(LoopbackTrainer):
    """A worker whose view of the live set (the coordinator's, `live()`) is settable, and
    which records the clock of every compute."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.view = {self.rank}
        self.computed: list[int] = []

    def live(self) -> set[int]:
        return set(self.view)

    def compute(self, slot: int = 0) -> float:
        self.computed.append(self.clock)
        return super().compute()


@pytest.mark.timeout(120)
def test_a_prefetched_answer_does_not_cover_a_worker_that_rejoined_before_it_was_loaded():
    """A review: with prefetch, the pull answered while worker 1 was out of the job is
    loaded one compute later, when the worker's view has worker 1 back (at clock 0). The
    cache took that view as the live set the answer's `guaranteed` was counted over, so
    worker 0 computed clock 6 on a copy lacking worker 1's clocks <= 4, which SSP with
    s = 1 requires there. The answer now names the shard's live set (`live_key`), the
    copy covers no one the shard did not count, and the gated pull of clock 6 (parked at
    the shard for worker 1) is waited for."""
    cfg = Config().replace(**{"mode.name": "ssp", "mode.staleness": 1, "mode.prefetch": True,
                              "cluster.workers": 2, "cluster.servers": 1, "optimizer.momentum": 0.0,
                              "train.steps": 20})
    shard = Shard(cfg, 0)
    shard.set_live({0: 0})                                    # worker 1 is out of the job
    w = LiveTrainer(cfg, ShardClient(shard, 0), lambda p: torch.full_like(p, 1e-3), rank=0)
    schedule = SspSchedule(cfg)
    schedule.start(w)
    for _ in range(5):                                        # worker 0 alone: clocks 0..4
        schedule.step(w)
    assert w.clock == 5 and schedule.inflight is not None     # step 4's push and pull are in flight
    w.client.deliver(shard.set_live({0: 5, 1: 0}))            # worker 1 is back at clock 0: both views learn it
    w.view = {0, 1}
    with pytest.raises(Parked):                               # step 5: its read of clock 6 waits for worker 1
        schedule.step(w)
        schedule.step(w)
    assert max(w.computed) == 5
