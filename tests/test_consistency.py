"""Property tests of the consistency rules (psgd/consistency), driven directly.

Each state machine is run under random interleavings of pushes, reads, joins and
leaves (hypothesis draws the schedule) next to a small reference model that states
the rule from DESIGN.md; after every event the machine's answers must match it.
A last group drives `psgd.shard.Shard` with real wire messages (no sockets).
"""
from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from psgd import wire
from psgd.config import Config
from psgd.consistency import barrier as bsp
from psgd.consistency.asynchronous import READS
from psgd.consistency.barrier import StepBarrier
from psgd.consistency.clock import ClockTable
from psgd.consistency.elastic import elastic_delta, round_deltas
from psgd.consistency.staleness import BINS, Histogram, delay_compensate, lr_scale
from psgd.consistency.tournament import Exchange, adopt, pairings

pytestmark = pytest.mark.unit

PROPS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# An event is (kind, a, b): `kind` picks what happens, a and b pick whom and which clock.
EVENTS = st.lists(st.tuples(st.integers(0, 7), st.integers(0, 63), st.integers(0, 63)), max_size=90)


# ---------------------------------------------------------------- SSP / async: ClockTable

@dataclass
class SspWorker:
    """One worker process as the shard sees it: initial read, then push c / read c+1."""
    clock: int = 0
    state: str = "fresh"      # fresh (initial read due) | compute (push due) | pushed (read due) | parked | dead
    life: int = 0             # incarnation; a parked read of an old life may still be released


class SspModel:
    """The rule of Ho et al. 2013 as DESIGN.md states it, next to the real ClockTable."""

    def __init__(self, n: int, bound: int | None):
        self.n, self.bound = n, bound
        self.table = ClockTable(range(n), bound)
        self.finished = {r: 0 for r in range(n)}
        self.live = set(range(n))
        self.workers = {r: SspWorker() for r in range(n)}
        self.parked: dict[int, tuple[int, int, int]] = {}  # token -> (rank, clock, life)
        self.next_token = 0
        self.max_lead = 0

    def may_read(self, clock: int) -> bool:
        """Every live worker has finished clock >= c - s (vacuous with none live)."""
        return self.bound is None or all(self.finished[r] >= clock - self.bound for r in self.live)

    def answered(self, clock: int) -> None:
        if self.bound is not None:
            assert self.may_read(clock), f"read of clock {clock} answered while {self.finished} (live {self.live})"
        if self.live:
            self.max_lead = max(self.max_lead, clock - min(self.finished[r] for r in self.live))

    def released(self, tokens: list) -> None:
        assert len(tokens) == len(set(tokens)), "a parked read was released twice"
        for t in tokens:
            assert t in self.parked, f"released {t}, which was not parked"
            rank, clock, life = self.parked.pop(t)
            self.answered(clock)
            w = self.workers[rank]
            if w.life == life and w.state == "parked":
                w.clock, w.state = clock, "compute"

    def read(self, rank: int, clock: int) -> None:
        w = self.workers[rank]
        if rank in self.live:  # the read says: rank has finished `clock`
            self.finished[rank] = max(self.finished[rank], clock)
        token, self.next_token = self.next_token, self.next_token + 1
        expect = self.may_read(clock)
        tokens = self.table.read(rank, clock, token)
        got = bool(tokens) and tokens[0] == token
        assert got == expect, f"read(rank {rank}, clock {clock}) answered {got}, rule says {expect}"
        others = tokens[1:] if got else tokens
        if got:
            self.answered(clock)
            w.clock, w.state = clock, "compute"
        else:
            assert self.bound is not None, "async: a read was parked"
            self.parked[token] = (rank, clock, w.life)
            w.state = "parked"
        self.released(others)  # the reader's own progress may free others

    def step(self, rank: int) -> None:
        """The worker's next protocol action."""
        w = self.workers[rank]
        if w.state == "fresh":
            self.read(rank, w.clock)
        elif w.state == "compute":
            self.finished[rank] = max(self.finished[rank], w.clock + 1)
            w.state = "pushed"
            self.released(self.table.push(rank, w.clock))
        elif w.state == "pushed":
            self.read(rank, w.clock + 1)

    def membership(self) -> dict[int, int]:
        return {r: self.workers[r].clock for r in sorted(self.live)}

    def leave(self, rank: int, zombie: bool) -> None:
        """Dropped from the membership; a zombie goes on sending (it has not noticed)."""
        self.live.discard(rank)
        if not zombie:
            self.workers[rank].state = "dead"
        self.released(self.table.set_live(self.membership()))

    def join(self, rank: int, clock: int) -> None:
        """(Re)joins at `clock`; clocks already finished stay finished."""
        w = self.workers[rank]
        w.clock, w.state, w.life = clock, "fresh", w.life + 1
        self.finished[rank] = max(self.finished[rank], clock)
        self.live.add(rank)
        self.released(self.table.set_live(self.membership()))

    def check(self) -> None:
        # no read waits when it need not: whatever is still parked may not be read yet
        for t, (rank, clock, _) in self.parked.items():
            assert not self.may_read(clock), f"read {t} (rank {rank}, clock {clock}) still parked " \
                                             f"though every live worker finished >= clock - s: {self.finished}"
        assert self.table.parked == len(self.parked)
        assert self.table.max_gap == self.max_lead
        if self.bound is not None:
            assert self.table.max_gap <= self.bound


def run_ssp(n: int, bound: int | None, events) -> SspModel:
    m = SspModel(n, bound)
    for kind, a, b in events:
        rank = a % n
        if kind <= 4:  # mostly: somebody's next push or read
            m.step(rank)
        elif kind == 5 and rank in m.live:
            m.leave(rank, zombie=b % 2 == 0)
        elif kind == 6 and rank not in m.live:
            clocks = [m.workers[r].clock for r in m.live]
            top = max([w.clock for w in m.workers.values()] + [0])
            start = min(clocks) if clocks and b % 2 else b % (top + 3)  # where the coordinator says, or anywhere
            m.join(rank, start)
        elif kind == 7:  # a membership refresh that changes nothing releases nothing
            assert m.table.set_live(m.membership()) == []
        m.check()
    return m


@pytest.mark.timeout(120)
@PROPS
@given(n=st.integers(1, 4), bound=st.integers(0, 3), events=EVENTS)
def test_ssp_bound_never_violated_and_no_needless_wait(n, bound, events):
    run_ssp(n, bound, events)


@pytest.mark.timeout(120)
@FEW
@given(n=st.integers(1, 4), events=EVENTS)
def test_async_never_parks(n, events):
    m = run_ssp(n, None, events)
    assert m.table.parked == 0


@pytest.mark.timeout(60)
@FEW
@given(n=st.integers(2, 4), bound=st.integers(0, 3), rounds=st.integers(1, 10))
def test_ssp_straggler_fast_workers_run_exactly_s_ahead(n, bound, rounds):
    """Worker 0 is a straggler: the others run as far as the bound lets them (exactly s
    clocks ahead of it, no less) and no further; each push of the straggler lets them on."""
    m = SspModel(n, bound)
    for r in range(n):
        m.step(r)  # initial reads
    for _ in range(rounds):
        for _ in range(4 * (bound + 2)):
            for r in range(1, n):
                m.step(r)
                m.check()
        for r in range(1, n):
            assert m.workers[r].clock - m.workers[0].clock == bound
            assert m.workers[r].state == "parked"
        m.step(0)  # the straggler pushes its clock...
        m.check()
        assert all(m.workers[r].state == "compute" for r in range(1, n))  # ...which releases the others
        m.step(0)  # and reads the next one, at once
        assert m.workers[0].state == "compute"
        m.check()
    assert m.table.max_gap == bound


def test_ssp_examples():
    t = ClockTable([0, 1], bound=1)
    assert t.read(0, 0, "a0") and t.read(1, 0, "b0")
    t.push(0, 0)
    assert t.read(0, 1, "a1")            # 1 - 1 <= 0: fine
    t.push(0, 1)
    assert not t.read(0, 2, "a2")        # worker 1 has finished 0 < 2 - 1
    assert t.push(1, 0) == ["a2"]        # ...until it finishes clock 0
    assert t.max_gap == 1
    assert t.set_live({0: 2}) == []      # worker 1 leaves: nothing parked
    t.push(0, 2)
    assert t.read(0, 3, "a3")            # only live workers count
    assert t.set_live({0: 3, 1: 0}) == []  # 1 rejoins at clock 0; the clock it finished stays
    assert t.finished[1] == 1
    t.push(0, 3)
    assert not t.read(0, 4, "a4")
    assert t.set_live({0: 4}) == ["a4"]  # 1 leaves again: released by the membership change
    assert ClockTable([0], None).read(0, 10 ** 6, "x")


def test_ssp_nobody_live_nobody_to_wait_for():
    t = ClockTable([0, 1], bound=0)
    t.push(0, 0)
    assert not t.read(0, 1, "a")          # waits for worker 1
    assert t.set_live({1: 0}) == []       # 0 is dropped (its read stays parked: 1 is at 0)
    assert t.set_live({}) == ["a"]        # 1 is gone too: nobody left to wait for
    assert t.read(0, 7, "b")              # a read from a dropped worker, nobody live


def test_ssp_read_that_raises_a_finished_clock_releases_others():
    t = ClockTable([0, 1], bound=0)
    assert t.read(0, 1, "a") == []         # 0 says it finished clock 1; 1 has finished 0
    assert t.read(1, 1, "b") == ["b", "a"]  # 1 says it finished clock 1: "a" need not wait any more
    assert t.parked == 0


# ---------------------------------------------------------------- sync: StepBarrier

class SyncModel:
    """BSP with b backup workers (Chen et al. 2016), next to the real StepBarrier, with
    the shard's driving logic: advance as soon as the step is complete."""

    def __init__(self, n: int, backup: int):
        self.n, self.backup = n, backup
        self.bar = StepBarrier(range(n), backup)
        self.live = set(range(n))
        self.step = 0
        self.offered: list[int] = []        # distinct ranks offered for the open step, in order
        self.applied: list[tuple[int, list[int]]] = []
        self.dropped = 0
        self.parked: dict[int, int] = {}    # token -> clock
        self.next_token = 0

    @property
    def need(self) -> int:
        return max(1, len(self.live) - self.backup)

    def live_offered(self) -> int:
        """The ranks in the open step that are still live: only they count towards closing it."""
        return len(set(self.offered) & self.live)

    def advance(self) -> None:
        done, released = self.bar.advance()
        assert done == self.offered, "a step was applied with other gradients than the ones offered"
        self.applied.append((self.step, done))
        self.step += 1
        self.offered = []
        expect = sorted(t for t, c in self.parked.items() if c <= self.step)
        assert sorted(released) == expect, "reads released are not exactly those with clock <= step"
        for t in released:
            del self.parked[t]

    def offer(self, rank: int, clock: int) -> None:
        verdict = self.bar.offer(rank, clock)
        if clock < self.step:
            assert verdict == bsp.LATE
            self.dropped += 1
        elif clock > self.step:
            assert verdict == bsp.EARLY
        elif rank in self.offered:
            assert verdict == bsp.DUPLICATE
        else:
            assert verdict == bsp.ACCEPT
            self.offered.append(rank)
            assert self.bar.complete() == (self.live_offered() >= self.need)
            if self.bar.complete():
                assert self.live_offered() == self.need, "exactly the first live - backup gradients"
                self.advance()

    def read(self, clock: int) -> None:
        token, self.next_token = self.next_token, self.next_token + 1
        got = self.bar.read(clock, token)
        assert got == (clock <= self.step)
        if not got:
            self.parked[token] = clock

    def set_live(self, live: set[int]) -> None:
        self.live = set(live)
        self.bar.set_live(self.live)
        if self.offered and self.bar.complete():
            assert self.live_offered() >= self.need
            self.advance()

    def check(self) -> None:
        assert self.bar.step == self.step
        assert self.bar.contributors == self.offered
        assert self.live_offered() < self.need or not self.offered, "a complete step was left open"
        assert self.bar.dropped == self.dropped
        assert self.bar.parked == len(self.parked)
        assert all(c > self.step for c in self.parked.values()), "a read waits though its step is applied"
        assert [s for s, _ in self.applied] == list(range(self.step)), "each step applied exactly once, in order"


@pytest.mark.timeout(120)
@PROPS
@given(n=st.integers(1, 5), backup=st.integers(0, 4), events=EVENTS)
def test_sync_each_step_applied_once_with_the_first_live_minus_backup(n, backup, events):
    backup = backup % n  # config: 0 <= backup_workers < workers
    m = SyncModel(n, backup)
    for kind, a, b in events:
        rank = a % n
        if kind <= 3:
            m.offer(rank, m.step + b % 4 - 2)       # late, late, on time, early
        elif kind == 4:
            m.offer(rank, m.step)                   # on time (the common case)
        elif kind == 5:
            m.read(m.step + b % 3 - 1)
        elif kind == 6 and len(m.live) > 1:
            m.set_live(m.live - {rank})             # leave
        elif kind == 7:
            m.set_live(m.live | {rank})             # join (or a no-op refresh)
        m.check()


@pytest.mark.timeout(60)
@FEW
@given(n=st.integers(2, 6), backup=st.integers(0, 5), steps=st.integers(1, 8), order=st.randoms(use_true_random=False))
def test_sync_backup_workers_drop_the_slowest(n, backup, steps, order):
    """All workers push every step in a random order: the first n - b count, the rest
    are late and counted; reads of the next clock wait for the step."""
    backup = backup % n
    bar = StepBarrier(range(n), backup)
    for s in range(steps):
        ranks = list(range(n))
        order.shuffle(ranks)
        assert not bar.read(s + 1, f"read-{s}")
        accepted = []
        for i, r in enumerate(ranks):
            v = bar.offer(r, s)
            if i < n - backup:
                assert v == bsp.ACCEPT
                accepted.append(r)
                if bar.complete():
                    assert i == n - backup - 1
                    done, released = bar.advance()
                    assert done == accepted and released == [f"read-{s}"]
            else:
                assert v == bsp.LATE
    assert bar.step == steps
    assert bar.dropped == steps * backup


# ---------------------------------------------------------------- EASGD

def arrays(shape):
    return hnp.arrays(np.float64, shape, elements=st.floats(-100, 100, allow_nan=False, allow_infinity=False))


@pytest.mark.timeout(60)
@FEW
@given(data=st.data(), shape=hnp.array_shapes(max_dims=2, max_side=5), alpha=st.floats(0, 0.99))
def test_easgd_elastic_step_is_algorithm_1(data, shape, alpha):
    """Zhang, Choromanska, LeCun 2015, Alg. 1: x_i <- x_i - a(x_i - x~); x~ <- x~ + a(x_i - x~)."""
    x = data.draw(arrays(shape))
    center0 = data.draw(arrays(shape))
    d = elastic_delta(x, center0, alpha)
    center = center0 + d                                                           # the shard's Move
    np.testing.assert_allclose(d, alpha * (x - center0))
    np.testing.assert_allclose(center, center0 + alpha * (x - center0))           # the shard's update
    np.testing.assert_allclose(x - d, x - alpha * (x - center0))                   # the worker's update
    np.testing.assert_allclose((x - d) + center, x + center0, atol=1e-9)          # the elastic force is symmetric


@pytest.mark.timeout(60)
@FEW
@given(data=st.data(), shape=hnp.array_shapes(max_dims=2, max_side=5), p=st.integers(1, 5),
       alpha=st.floats(0, 0.99))
def test_easgd_round_is_the_synchronous_update(data, shape, p, alpha):
    """Synchronous EASGD: x~ <- x~ + a * sum_i (x_i - x~) = (1 - p a) x~ + p a mean(x_i);
    worker i moves by -a (x_i - x~), all against the old center."""
    xs = [data.draw(arrays(shape)) for _ in range(p)]
    center0 = data.draw(arrays(shape))
    ds = round_deltas(xs, center0, alpha)
    center = center0 + sum(ds)                                                     # the shard's Move
    np.testing.assert_allclose(center, center0 + alpha * sum(x - center0 for x in xs), atol=1e-9)
    np.testing.assert_allclose(center, (1 - p * alpha) * center0 + p * alpha * np.mean(xs, axis=0), atol=1e-7)
    for x, d in zip(xs, ds, strict=True):
        np.testing.assert_allclose(d, alpha * (x - center0))


def test_easgd_on_tensors_changes_nothing_in_place():
    center, x = torch.zeros(4), torch.ones(4)
    d = elastic_delta(x, center, 0.25)
    assert torch.equal(d, torch.full((4,), 0.25)) and torch.equal(center, torch.zeros(4))
    center = center + d
    ds = round_deltas([torch.ones(4), -torch.ones(4), 3 * torch.ones(4)], center, 0.1)
    assert torch.allclose(sum(ds), torch.full((4,), 0.1 * (0.75 - 1.25 + 2.75)))
    assert torch.allclose(ds[1], torch.full((4,), 0.1 * -1.25))
    assert torch.equal(center, torch.full((4,), 0.25))


# ---------------------------------------------------------------- LTFB

RANKS = st.lists(st.integers(0, 40), max_size=12)


@pytest.mark.timeout(60)
@PROPS
@given(seed=st.integers(0, 2 ** 31), rnd=st.integers(0, 10 ** 6), ranks=RANKS,
       shuffle=st.randoms(use_true_random=False))
def test_ltfb_pairings_same_everywhere_nobody_twice_odd_one_sits_out(seed, rnd, ranks, shuffle):
    p = pairings(seed, rnd, ranks)
    # every party derives the same pairs: however it lists the ranks, however often it asks
    other = list(ranks) + list(ranks[:2])
    shuffle.shuffle(other)
    assert pairings(seed, rnd, other) == p == pairings(seed, rnd, tuple(reversed(ranks)))
    assert pairings(seed, rnd, set(ranks)) == p
    # everybody has exactly one entry, pairs are mutual and nobody is paired twice or with itself
    assert set(p) == set(ranks)
    partners = [q for q in p.values() if q is not None]
    assert len(partners) == len(set(partners))
    for r, q in p.items():
        assert q != r
        if q is not None:
            assert p[q] == r
    # an odd one sits out, and only then
    assert sum(q is None for q in p.values()) == len(set(ranks)) % 2


def test_ltfb_pairings_change_with_round():
    ranks = list(range(8))
    assert len({tuple(sorted(pairings(0, r, ranks).items())) for r in range(20)}) > 1


@pytest.mark.timeout(60)
@PROPS
@given(local=st.floats(allow_nan=False), partner=st.floats(allow_nan=False))
def test_ltfb_adopt_only_on_strict_improvement(local, partner):
    assert adopt(local, partner) == (partner > local)
    assert not adopt(local, local)


def test_ltfb_adopt_nan():
    assert not adopt(0.5, math.nan) and not adopt(math.nan, 0.5)


@pytest.mark.timeout(120)
@PROPS
@given(events=st.lists(st.tuples(st.booleans(), st.integers(0, 6), st.integers(0, 3)), max_size=60))
def test_ltfb_exchange_releases_parked_gets_exactly_on_put(events):
    """A get of (round r, owner o) is answered with o's latest model if o has deposited
    round r or later, else parked; a put of o's round r' releases exactly the parked
    gets of o for rounds <= r', with that model."""
    ex = Exchange()
    latest: dict[int, tuple[int, str]] = {}   # owner -> (round, model)
    waiting: dict[int, tuple[int, int]] = {}  # token -> (round, owner)
    for token, (is_put, rnd, owner) in enumerate(events):
        if is_put:
            model = f"m{rnd}.{owner}.{token}"
            released = ex.put(rnd, owner, model)
            if rnd >= latest.get(owner, (-1, None))[0]:
                latest[owner] = (rnd, model)
            expect = sorted(t for t, (r, o) in waiting.items() if o == owner and r <= rnd)
            assert sorted(t for t, _ in released) == expect
            assert all(m == model for _, m in released)
            for t in expect:
                del waiting[t]
        else:
            got = ex.get(rnd, owner, token)
            have = latest.get(owner)
            assert got == (have[1] if have and have[0] >= rnd else None)
            if got is None:
                waiting[token] = (rnd, owner)
        assert ex.parked == len(waiting)
        assert ex.keys() == {m for _, m in latest.values()}  # one model per trainer is kept
        for r, o in waiting.values():  # nobody waits for a model that is there
            assert latest.get(o, (-1, None))[0] < r


def test_ltfb_exchange_keeps_a_model_its_partner_still_needs():
    """A trainer that sits out does not wait and may run rounds ahead; the models that
    a straggler's partner deposited earlier must still be there for it."""
    ex = Exchange()
    ex.put(4, 0, "m4.0")                  # trainer 0 deposits round 4; its partner 1 is a straggler
    ex.put(4, 2, "m4.2")                  # trainer 2 sits out round 4 ...
    ex.put(5, 2, "m5.2")                  # ... and round 5 ...
    ex.put(6, 2, "m6.2")                  # ... and deposits round 6
    assert ex.get(4, 0, "t1") == "m4.0"   # the straggler reaches round 4: its partner's model is there
    assert ex.get(7, 2, "t0") is None     # a later round waits ...
    assert ex.put(7, 2, "m7.2") == [("t0", "m7.2")]  # ... until it is deposited
    assert ex.get(5, 2, "t3") == "m7.2"   # a partner that moved on answers with its latest


# ---------------------------------------------------------------- staleness

@pytest.mark.timeout(60)
@PROPS
@given(taus=st.lists(st.integers(-3, 80), max_size=60), more=st.lists(st.integers(0, 40), max_size=20))
def test_histogram(taus, more):
    # the bins clip at BINS - 1; the mean and max are exact however far past them tau goes
    h = Histogram()
    for t in taus:
        h.add(t)
    clipped = [min(max(t, 0), BINS - 1) for t in taus]
    exact = [max(t, 0) for t in taus]
    assert h.total == len(taus)
    assert h.counts == [clipped.count(i) for i in range(BINS)]
    assert h.mean == pytest.approx(sum(exact) / len(exact) if exact else 0.0)
    assert h.max == (max(exact) if exact else 0)
    assert h.as_dict() == {(f"{i}+" if i == BINS - 1 else str(i)): clipped.count(i)
                           for i in sorted(set(clipped))}
    g = Histogram.of(h.stats())        # through a process's counters (heartbeats, summary.json)
    other = Histogram()
    for t in more:
        other.add(t, 2)
    g.merge(other)
    h.merge(Histogram.of(other.stats()))
    assert g.counts == h.counts and g.total == len(taus) + 2 * len(more)
    everything = exact + [t for t in more for _ in range(2)]
    assert g.mean == pytest.approx(sum(everything) / len(everything) if everything else 0.0)
    assert g.max == h.max == (max(everything) if everything else 0)
    older = Histogram(h.counts)        # counters without the sum (an older process's): the bins'
    assert older.mean == pytest.approx(sum(i * c for i, c in enumerate(h.counts)) / h.total if h.total else 0.0)


@pytest.mark.timeout(60)
@PROPS
@given(tau=st.integers(-5, 10 ** 6))
def test_lr_scale(tau):
    assert lr_scale(tau, "staleness") == 1.0 / max(1, tau)   # Zhang et al. 2016
    assert lr_scale(tau, "constant") == 1.0


@pytest.mark.timeout(60)
@FEW
@given(data=st.data(), n=st.integers(1, 8), lam=st.floats(0, 2))
def test_delay_compensate_is_dc_asgd(data, n, lam):
    """Zheng et al. 2017: g + lambda * g (.) g (.) (w_now - w_read)."""
    g, w_now, w_read = (data.draw(arrays((n,))) for _ in range(3))
    out = delay_compensate(g, w_now, w_read, lam)
    np.testing.assert_allclose(out, g + lam * g * g * (w_now - w_read), rtol=1e-12)
    if lam == 0:
        np.testing.assert_array_equal(out, g)
    gt = torch.tensor(g)
    before = gt.clone()
    delay_compensate(gt, torch.tensor(w_now), torch.tensor(w_read), lam)
    assert torch.equal(gt, before), "delay_compensate must not change the gradient in place"


# ---------------------------------------------------------------- the shard, driven with wire messages

def shard_for(mode: str, workers: int, **sets):
    from psgd.shard import Shard
    cfg = Config().replace(**{"mode.name": mode, "cluster.workers": workers, "cluster.servers": 2,
                              "optimizer.momentum": 0.0, **sets})
    return Shard(cfg, 0), cfg


_ids = iter(range(1, 1 << 30))


def msg(op: str, rank: int, clock: int, arrays=(), **fields) -> wire.Message:
    return wire.decode(wire.encode(op, id=next(_ids), rank=rank, clock=clock, arrays=arrays, **fields))


def push(shard, rank, clock, g, read_version=0):
    return msg("push", rank, clock, [g, np.zeros(shard.B, np.float32)], read_version=read_version)


def answers(replies) -> dict:
    return {tok: wire.decode(frames) for tok, frames in replies}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,workers,sums", [("sync", 2, True), ("sync", 1, False), ("async", 1, False),
                                               ("ssp", 1, False)])
def test_a_shard_holds_a_gradient_table_only_in_a_mode_that_sums(mode, workers, sums):
    """Every shard held a zeroed table as large as its parameters for a sum's mean, which
    only sync writes: 50 MB a shard of a 100 MB model, in async or ssp too. (Sync with
    one worker steps on its gradient itself: the mean of one.)"""
    shard, _ = shard_for(mode, workers)
    assert shard.params.grad is None
    before = shard.params.detach().clone()
    g = np.full(shard.P, 0.5, np.float32)
    for rank in range(workers):
        shard.handle(("push", rank, 0), push(shard, rank, 0, g))
    assert not torch.equal(shard.params.detach(), before)   # the step was applied
    assert (shard.params.grad is not None) == sums
    if sums:   # the mean was written in the table the optimizer read
        assert torch.equal(shard.params.grad, torch.from_numpy(g))


@pytest.mark.timeout(120)
def test_shard_sync_backup_workers_drop_late_gradients():
    shard, cfg = shard_for("sync", 3, **{"mode.backup_workers": 1})
    lr = cfg.optimizer.lr
    p0 = shard.params.detach().clone().numpy()
    rng = np.random.default_rng(0)
    g = [rng.standard_normal(shard.P).astype(np.float32) for _ in range(3)]

    for r in range(3):  # everybody reads clock 0 at once
        assert len(shard.handle(("pull", r, 0), msg("pull", r, 0))) == 1
    out = answers(shard.handle(("push", 2, 0), push(shard, 2, 0, g[2])))
    assert not out[("push", 2, 0)].get("dropped")
    assert shard.handle(("pull", 2, 1), msg("pull", 2, 1)) == []            # parked: step 0 not applied
    out = answers(shard.handle(("push", 0, 0), push(shard, 0, 0, g[0])))
    # 3 workers, 1 backup: complete after 2; the parked read is answered with the new parameters
    assert set(out) == {("push", 0, 0), ("pull", 2, 1)}
    assert shard.rule.barrier.step == 1 and shard.version == 1
    expect = p0 - lr * (g[2] + g[0]) / 2
    np.testing.assert_allclose(shard.params.detach().numpy(), expect, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[("pull", 2, 1)].arrays[0], expect, rtol=1e-5, atol=1e-6)

    # the slowest one's gradient for step 0 is late: dropped, counted, not applied
    out = answers(shard.handle(("push", 1, 0), push(shard, 1, 0, g[1])))
    assert out[("push", 1, 0)].get("dropped") is True
    assert shard.stats()["dropped"] == 1 and shard.rule.barrier.dropped == 1
    np.testing.assert_allclose(shard.params.detach().numpy(), expect, rtol=1e-5, atol=1e-6)
    # a resend of the dropped push (a review: answered only `duplicate`, its worker counted it applied)
    out = answers(shard.handle(("push", 1, 0), push(shard, 1, 0, g[1])))
    assert out[("push", 1, 0)].get("duplicate") is True and out[("push", 1, 0)].get("dropped") is True
    assert shard.stats()["dropped"] == 1
    # its next read (clock 1) is answered at once: step 1 is open
    assert len(shard.handle(("pull", 1, 1), msg("pull", 1, 1))) == 1

    # step 1: ranks 1 and 2 in time, rank 0 late
    shard.handle(("push", 1, 1), push(shard, 1, 1, g[1], 1))
    shard.handle(("push", 2, 1), push(shard, 2, 1, g[2], 1))
    assert shard.rule.barrier.step == 2
    out = answers(shard.handle(("push", 0, 1), push(shard, 0, 1, g[0], 1)))
    assert out[("push", 0, 1)].get("dropped") is True
    assert shard.stats()["dropped"] == 2 and shard.version == 2
    # a resend of an applied push is a duplicate, not a second application
    out = answers(shard.handle(("push", 1, 1, "again"), push(shard, 1, 1, g[1], 1)))
    assert out[("push", 1, 1, "again")].get("duplicate") is True and shard.version == 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "diloco"])
def test_a_rejoined_workers_second_push_for_the_open_step_is_a_duplicate(mode):
    """A worker pushes for step 0, is dropped by the coordinator, rejoins and pushes for
    step 0 again: its first gradient stays in the step, the second is answered
    `duplicate`, not applied, and counted in `duplicates`: the shard keeps a rank's last
    clock across its leave and return, since it cannot tell a new process's push from a
    resend of the first (its answer lost), which is applied (before 2026-12-06 it forgot
    the clock and answered `dropped`, and a resend heard after a late return was counted
    as a dropped gradient)."""
    shard, cfg = shard_for(mode, 2, **{"cluster.servers": 1})
    g0, g1 = np.ones(shard.P, np.float32), np.full(shard.P, 3.0, np.float32)
    p0 = shard.params.detach().clone().numpy()
    assert not answers(shard.handle("a", push(shard, 0, 0, g0)))["a"].get("dropped")
    shard.set_live({1: 0})                     # rank 0 lost (its gradient stays in step 0) ...
    shard.set_live({0: 0, 1: 0})               # ... and back
    out = answers(shard.handle("b", push(shard, 0, 0, 5 * g0)))
    assert out["b"].get("duplicate") is True and out["b"].get("dropped") is None
    assert shard.stats()["dropped"] == 0 and shard.stats()["duplicates"] == 1
    shard.handle("c", push(shard, 1, 0, g1))   # step 0 closes with the first gradient of rank 0
    assert shard.rule.barrier.step == 1 and shard.stats()["dropped"] == 0
    if mode == "sync":
        np.testing.assert_allclose(shard.params.detach().numpy(), p0 - cfg.optimizer.lr * (g0 + g1) / 2,
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_a_sync_worker_whose_push_was_dropped_catches_up_to_the_shards_step():
    """With a backup worker the fast one closes steps 0 and 1 alone; the slow worker's
    push for step 0 is dropped as late, and its read is answered at step 2: it continues
    at clock 2, not at clock 1, whose step is closed too (its next push would be dropped
    again, and every later one)."""
    from psgd.consistency.sync import SyncSchedule
    from psgd.shard import Shard
    from tests.loopback import FakeTrainer, Loopback
    cfg = Config().replace(**{"mode.name": "sync", "mode.backup_workers": 1, "cluster.workers": 2,
                              "cluster.servers": 1, "optimizer.momentum": 0.0, "train.steps": 10})
    shards = [Shard(cfg, 0)]
    fast, slow = (FakeTrainer(cfg, Loopback(shards, r), lambda x: 0.1 * x, rank=r) for r in range(2))
    schedules = [SyncSchedule(cfg), SyncSchedule(cfg)]
    schedules[0].start(fast)
    schedules[1].start(slow)
    for _ in range(2):
        schedules[0].step(fast)
    assert fast.clock == 2 and shards[0].rule.barrier.step == 2
    schedules[1].step(slow)
    assert slow.logged[-1][2]["dropped"] is True
    assert slow.clock == 2


@pytest.mark.timeout(120)
def test_shard_sync_membership_change_completes_a_step():
    shard, _ = shard_for("sync", 3)
    g = np.ones(shard.P, np.float32)
    shard.handle("p0", push(shard, 0, 0, g))
    shard.handle("p1", push(shard, 1, 0, g))
    assert shard.handle("r0", msg("pull", 0, 1)) == []
    assert shard.rule.barrier.step == 0                      # waits for rank 2...
    out = answers(shard.set_live({0: 1, 1: 1}))         # ...until it is dropped
    assert set(out) == {"r0"} and shard.rule.barrier.step == 1


@pytest.mark.timeout(120)
def test_shard_ssp_parks_a_pull_and_a_push_releases_it():
    shard, cfg = shard_for("ssp", 2, **{"mode.staleness": 0})
    lr, W = cfg.optimizer.lr, 2
    p0 = shard.params.detach().clone().numpy()
    rng = np.random.default_rng(1)
    g0, g1 = (rng.standard_normal(shard.P).astype(np.float32) for _ in range(2))
    for r in range(2):
        assert len(shard.handle(("pull", r, 0), msg("pull", r, 0))) == 1

    out = answers(shard.handle(("push", 0, 0), push(shard, 0, 0, g0)))
    assert out[("push", 0, 0)].get("staleness") == 0
    # applied on arrival, at lr / W
    np.testing.assert_allclose(shard.params.detach().numpy(), p0 - lr / W * g0, rtol=1e-5, atol=1e-6)
    # worker 0 finished clock 0 and reads clock 1: worker 1 has not finished clock 0 (s = 0)
    assert shard.handle(("pull", 0, 1), msg("pull", 0, 1)) == []
    assert shard.stats()["parked"] == 1
    out = answers(shard.handle(("push", 1, 0), push(shard, 1, 0, g1, read_version=0)))
    assert set(out) == {("push", 1, 0), ("pull", 0, 1)}
    assert out[("push", 1, 0)].get("staleness") == 1       # one update between its read and its push
    expect = p0 - lr / W * (g0 + g1)
    got = out[("pull", 0, 1)]
    assert got.get("version") == 2
    # it sees every update <= c - s - 1, and its own
    np.testing.assert_allclose(got.arrays[0], expect, rtol=1e-5, atol=1e-6)
    assert shard.stats()["parked"] == 0 and shard.stats()["max_clock_gap"] == 0
    # worker 1 reads clock 1 at once: both finished clock 0
    assert len(shard.handle(("pull", 1, 1), msg("pull", 1, 1))) == 1


@pytest.mark.timeout(120)
def test_shard_ssp_membership_change_releases_a_pull():
    shard, _ = shard_for("ssp", 3, **{"mode.staleness": 1})
    g = np.zeros(shard.P, np.float32)
    for c in range(2):
        shard.handle(("push", c), push(shard, 0, c, g))
    assert shard.handle("r", msg("pull", 0, 2)) == []           # 1 and 2 are at 0 < 2 - 1
    assert shard.set_live({0: 2, 1: 0, 2: 0}) == []             # nothing changed
    shard.handle("p1", push(shard, 1, 0, g))
    assert shard.handle("r2", msg("pull", 1, 1)) != []
    out = answers(shard.set_live({0: 2, 1: 1}))                 # rank 2 is lost
    assert set(out) == {"r"}


@pytest.mark.timeout(120)
def test_shard_async_never_parks_and_scales_by_staleness():
    shard, cfg = shard_for("async", 2, **{"mode.lr_policy": "staleness"})
    lr = cfg.optimizer.lr
    p0 = shard.params.detach().clone().numpy()
    g = np.ones(shard.P, np.float32)
    for c in range(5):
        shard.handle(("p", c), push(shard, 0, c, g, read_version=c))
        assert len(shard.handle(("r", c), msg("pull", 0, c + 1))) == 1
    # worker 0's pushes have tau = 0: lr each (the staleness policy replaces 1 / W); worker 1
    # read at version 0 and pushes after 5 updates: tau = 5, lr / 5 (in place of 1 / W)
    out = answers(shard.handle("late", push(shard, 1, 0, g, read_version=0)))
    assert out["late"].get("staleness") == 5
    np.testing.assert_allclose(shard.params.detach().numpy(), p0 - lr * (5 + 1 / 5) * g, rtol=1e-5, atol=1e-6)
    assert shard.stats()["staleness_hist"][5] == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["ssp", "async"])
def test_shard_a_push_moves_the_buffers_one_workers_share_towards_its_own(mode):
    """ssp and async keep the buffers (BatchNorm's running statistics) as a running mean of
    the pushed ones: each push moves them 1 / W of the way towards the pusher's, not all
    the way (sync's mean of a step's buffers: test_diloco's batchnorm test)."""
    W = 4
    shard, _ = shard_for(mode, W, **{"model.name": "cnn"})
    assert shard.B > 0
    rng = np.random.default_rng(5)
    b0 = shard.buffers.clone().numpy()
    b = [rng.standard_normal(shard.B).astype(np.float32) for _ in range(2)]
    zero = np.zeros(shard.P, np.float32)
    shard.handle("p0", msg("push", 0, 0, [zero, b[0]], read_version=0))
    b1 = b0 + (b[0] - b0) / W
    np.testing.assert_allclose(shard.buffers.numpy(), b1, rtol=1e-5, atol=1e-6)
    shard.handle("p1", msg("push", 1, 0, [zero, b[1]], read_version=1))
    np.testing.assert_allclose(shard.buffers.numpy(), b1 + (b[1] - b1) / W, rtol=1e-5, atol=1e-6)


def test_sync_fast_forward_only_an_empty_step():
    bar = StepBarrier(range(2))
    assert not bar.read(3, "r3") and not bar.read(6, "r6")
    assert bar.fast_forward(2) == [] and bar.step == 2        # nothing to release yet
    assert bar.fast_forward(1) == [] and bar.step == 2        # never backwards
    assert bar.offer(0, 2) == bsp.ACCEPT
    assert bar.fast_forward(5) == [] and bar.step == 2        # a step with gradients is not skipped
    bar.offer(1, 2)
    assert bar.advance() == ([0, 1], ["r3"])
    assert bar.fast_forward(6) == ["r6"] and bar.step == 6


@pytest.mark.timeout(120)
def test_shard_ssp_join_pull_is_not_gated():
    shard, _ = shard_for("ssp", 2, **{"mode.staleness": 0})
    g = np.zeros(shard.P, np.float32)
    for c in range(3):
        shard.handle(("p", c), push(shard, 0, c, g))
    assert shard.handle("gated", msg("pull", 0, 3)) == []     # 1 is at 0
    out = answers(shard.handle("join", msg("pull", 1, 0, join=True)))
    assert out["join"].get("finished") == 0 and shard.stats()["parked"] == 1
    assert out["join"].get("version") == 3


@pytest.mark.timeout(120)
def test_shard_dc_asgd_compensates_with_the_workers_own_read_copy():
    """Zheng et al. 2017: a push is compensated with w_bak, the parameters that this
    worker read and computed its gradient on: g + lambda g (.) g (.) (w_now - w_bak).
    Not another worker's read, and not the worker's newer read (prefetch: it computes on
    the model it has while its next pull is in flight)."""
    lam = 0.5
    shard, cfg = shard_for("async", 2, **{"mode.dc_lambda": lam})
    lr, W = cfg.optimizer.lr, 2
    rng = np.random.default_rng(2)
    g0, g0b, g1 = (rng.standard_normal(shard.P).astype(np.float32) for _ in range(3))
    p0 = shard.params.detach().clone().numpy()
    assert len(shard.handle("r1-0", msg("pull", 1, 0, join=True))) == 1      # worker 1 reads P0 (version 0)
    assert len(shard.handle("r0-0", msg("pull", 0, 0, join=True))) == 1      # worker 0 reads P0
    shard.handle("p0-0", push(shard, 0, 0, g0, read_version=0))              # no delay: no compensation
    p1 = p0 - lr / W * g0
    np.testing.assert_allclose(shard.params.detach().numpy(), p1, rtol=1e-5, atol=1e-6)
    assert len(shard.handle("r1-1", msg("pull", 1, 1))) == 1                 # worker 1's next read: P1
    assert len(shard.handle("r0-1", msg("pull", 0, 1))) == 1                 # worker 0 reads P1 last
    shard.handle("p0-1", push(shard, 0, 1, g0b, read_version=1))
    p2 = p1 - lr / W * g0b
    # worker 1's gradient was computed on P0 (read_version 0), though it has read P1 since
    out = answers(shard.handle("p1-0", push(shard, 1, 0, g1, read_version=0)))
    assert out["p1-0"].get("staleness") == 2
    compensated = g1 + lam * g1 * g1 * (p2 - p0)
    np.testing.assert_allclose(shard.params.detach().numpy(), p2 - lr / W * compensated, rtol=1e-5, atol=1e-6)
    wrong = p2 - lr / W * (g1 + lam * g1 * g1 * (p2 - p1))                   # with its newer read
    assert np.abs(shard.params.detach().numpy() - wrong).max() > 1e-4


@pytest.mark.timeout(120)
def test_the_docs_count_the_copies_that_dc_asgd_keeps_per_worker():
    """A review: docs/modes.md said DC-ASGD costs one extra copy of the shard per worker,
    but the rule keeps each worker's last READS = 2 reads (with prefetch a gradient is
    computed on the older one while the newer is in flight): twice the memory the docs
    told a user to budget for."""
    shard, _ = shard_for("async", 2, **{"mode.dc_lambda": 0.1})
    g = np.zeros(shard.P, np.float32)
    for c in range(3):                                   # three reads of worker 0, each of a newer version
        shard.handle(("r", c), msg("pull", 0, c))
        shard.handle(("p", c), push(shard, 1, c, g))
    held = len(shard.rule.w_read[0])
    doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "modes.md").read_text()
    assert held == READS == 2 and "two copies of the shard per worker" in doc


# ---------------------------------------------------------------- DiLoCo: rounds of pseudo-gradients on a Shard

class DilocoModel:
    """DiLoCo's server side as the paper and DESIGN.md state it, next to a real Shard
    (mode diloco) driven with wire messages: a round closes when every live worker's
    pseudo-gradient arrived (sync's barrier, no backups; one that left keeps its
    pseudo-gradient in the mean); the global model then takes one
    outer Nesterov step on their mean (torch's convention); a push for a closed round is
    dropped; a read of round c + 1 waits until round c has closed. A push for a round its
    rank pushed already, in this life or an earlier one (the shard keeps a rank's last
    clock across its leave and return), is a duplicate: neither applied nor counted,
    answered `dropped` too where that push was."""

    def __init__(self, n: int):
        self.shard, cfg = shard_for("diloco", n, **{"cluster.servers": 1, "model.hidden": 4})
        self.eta, self.mu = cfg.mode.outer_lr, cfg.mode.outer_momentum
        self.theta = self.shard.params.detach().double().clone()
        self.m = torch.zeros_like(self.theta)
        self.step, self.dropped = 0, 0
        self.contributors: dict[int, torch.Tensor] = {}   # rank -> its pseudo-gradient, this round
        self.last: dict[int, int] = {}                     # rank -> the latest round it pushed, in any life
        self.dropped_at: dict[int, int] = {}               # rank -> the round of its latest dropped push
        self.live = set(range(n))
        self.workers = {r: {"round": 0, "state": "fresh", "life": 0} for r in range(n)}
        self.parked: dict[tuple, int] = {}                 # token -> clock
        self.tokens = 0

    def handle(self, op: str, rank: int, clock: int, arrays=(), **fields) -> tuple[tuple, dict]:
        self.tokens += 1
        token = (op, rank, clock, self.tokens)
        return token, answers(self.shard.handle(token, msg(op, rank, clock, arrays, **fields)))

    def released(self, got: dict) -> None:
        for token, reply in got.items():
            if token in self.parked:
                clock = self.parked.pop(token)
                assert clock <= self.step, f"a read of round {clock} answered at step {self.step}"
                self.answered(token[1], reply)

    def answered(self, rank: int, reply) -> None:
        np.testing.assert_allclose(reply.arrays[0], self.theta.numpy(), rtol=1e-5, atol=1e-5)
        w = self.workers[rank]
        if w["state"] in ("parked", "pushed", "fresh"):
            w["round"], w["state"] = int(reply.get("step")), "work"

    def close(self) -> None:
        delta = torch.stack(list(self.contributors.values())).mean(0)
        self.m = self.mu * self.m + delta
        self.theta = self.theta - self.eta * (delta + self.mu * self.m)
        self.contributors = {}
        self.step += 1

    def push(self, rank: int) -> None:
        w = self.workers[rank]
        r = w["round"]
        delta = torch.from_numpy(np.random.default_rng([rank, r, w["life"]]).standard_normal(self.shard.P)) * 0.01
        token, got = self.handle("push", rank, r, [delta.float().numpy(), np.zeros(self.shard.B, np.float32)],
                                 read_version=0)
        reply = got.pop(token)
        w["state"] = "pushed"
        if r <= self.last.get(rank, -1):   # (a new life's push of a round its rank pushed: the open one, rejoined)
            assert reply.get("duplicate") is True
            assert bool(reply.get("dropped")) == (self.dropped_at.get(rank) == r)
            self.released(got)
            return
        self.last[rank] = r
        if r < self.step:
            self.dropped += 1
            self.dropped_at[rank] = r
            assert reply.get("dropped") is True
        else:
            assert not reply.get("dropped")
            self.contributors[rank] = delta.float().double()
            if self.complete():
                self.close()
        self.released(got)

    def read(self, rank: int, join: bool = False) -> None:
        w = self.workers[rank]
        clock = w["round"] + 1 if not join else 0
        token, got = self.handle("pull", rank, clock, **({"join": True} if join else {}))
        if token in got:
            assert join or clock <= self.step, f"a read of round {clock} answered at step {self.step}"
            self.answered(rank, got.pop(token))
        else:
            assert not join and clock > self.step, f"a read of round {clock} parked at step {self.step}"
            self.parked[token] = clock
            w["state"] = "parked"
        self.released(got)

    def membership(self) -> None:
        got = answers(self.shard.set_live({r: self.workers[r]["round"] for r in sorted(self.live)}))
        if self.contributors and self.complete():
            self.close()
        self.released(got)

    def complete(self) -> bool:
        return len(self.contributors.keys() & self.live) >= max(1, len(self.live))

    def check(self) -> None:
        assert self.shard.rule.barrier.step == self.step
        assert sorted(self.shard.rule.barrier.contributors) == sorted(self.contributors)
        assert self.shard.rule.barrier.dropped == self.dropped
        assert self.shard.rule.barrier.parked == len(self.parked)
        assert all(c > self.step for c in self.parked.values()), "a read waits though its round closed"
        np.testing.assert_allclose(self.shard.params.detach().numpy(), self.theta.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(240)
@FEW
@given(n=st.integers(1, 4), events=EVENTS)
def test_diloco_rounds_close_once_with_the_outer_nesterov_step_of_their_mean(n, events):
    m = DilocoModel(n)
    for kind, a, b in events:
        rank = a % n
        w = m.workers[rank]
        if kind <= 4 and w["state"] != "dead":       # somebody's next action (a zombie, dropped, too)
            if w["state"] == "fresh":
                m.read(rank, join=True)
            elif w["state"] == "work":
                m.push(rank)
            elif w["state"] == "pushed":
                m.read(rank)
        elif kind == 5 and rank in m.live:            # leaves; a zombie goes on sending
            m.live.discard(rank)
            if b % 2:
                w["state"] = "dead"
            m.membership()
        elif kind == 6 and rank not in m.live:        # (re)joins, learning the open round from its join read
            m.live.add(rank)
            w["life"] += 1
            w["state"] = "fresh"
            m.membership()
        elif kind == 7:                               # a refresh that changes nothing
            m.membership()
        m.check()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_restored_rule_keeps_the_largest_clock_gap(mode):
    # summary.json's max_clock_gap is the largest of the job: a shard restored from its
    # checkpoint goes on from the gap it had seen, not from 0
    from psgd.consistency import get as get_mode
    from psgd.consistency.rule import Push, Read
    cfg = Config().replace(**{"mode.name": mode, "cluster.workers": 2, "mode.staleness": 3})

    def fresh():
        r = get_mode(mode).rule(cfg.mode, 2, type("Tables", (), {"version": 0})())
        r.membership({0: 0, 1: 0})
        return r
    r = fresh()
    if mode == "ssp":
        for c in range(3):   # rank 0 runs 3 clocks ahead of rank 1, within the bound
            r.push(Push(("p", c), 0, c, 0, None, None))
            r.gated_read(Read(("r", c), 0, c + 1))
    else:
        r.clocks.max_gap = 1
    gap = r.stats()["max_clock_gap"]
    assert gap > 0
    again = fresh()
    again.load_state_dict(r.state_dict())
    assert again.stats()["max_clock_gap"] == gap


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "diloco"])
def test_a_push_waiting_for_its_step_is_taken_again_after_a_restore(tmp_path, mode):
    """A review: rank 2 is ahead of this shard (it rejoined past the open step, or the
    shard was restored from an older checkpoint), so its push for step 1 waits at the
    shard (`SyncRule.early`), already in `last_clock`, in no sum and not in the
    checkpoint. Restored, the shard answered its resend as a duplicate and closed step 1
    without it. It now takes it, as a shard that never restarted does."""
    from psgd.shard import Shard
    cfg = Config().replace(**{"mode.name": mode, "cluster.workers": 3, "cluster.servers": 1,
                              "optimizer.name": "sgd", "optimizer.momentum": 0.0})
    a = Shard(cfg, 0)
    rng = np.random.default_rng(0)
    g = {(r, c): (0.1 * rng.standard_normal(a.P)).astype(np.float32) for r in range(3) for c in range(2)}

    def handle(shard, m):
        return answers(shard.handle(("t", m.id), m))

    def push_read(shard, rank, clock, read_version=0):
        return msg("push", rank, clock, [g[rank, clock], np.zeros(shard.B, np.float32)],
                   read_version=read_version, pull=True)
    early = push_read(a, 2, 1)
    assert handle(a, early) == {}                        # it waits: step 0 is open
    a.save(str(tmp_path / "shard-0.pt"))                 # stopped (SIGTERM: its final checkpoint)
    b = Shard(cfg, 0)
    assert b.resume(str(tmp_path / "shard-0.pt")) == ""
    assert handle(b, early) == {}                        # its worker sends it again: it waits again
    for s in (a, b):
        for c in range(2):
            for r in range(2):
                handle(s, push_read(s, r, c, read_version=c))
        assert s.rule.barrier.step == 2
    torch.testing.assert_close(b.params, a.params)       # rank 2's gradient is in step 1 on both
    assert b.rule.short_steps == a.rule.short_steps   # (step 0: without rank 2, which is past it)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "diloco"])
def test_a_worker_that_pushed_and_left_does_not_close_the_step_for_those_still_live(mode):
    """docs/modes.md: workers that leave stop being waited for, and a step that the
    remaining workers have completed is applied at once; a contributor that leaves keeps
    its gradient in the step but does not stand in for a live worker's (the step closed
    on it, and the live worker's gradient, or diloco's H steps, were dropped as late)."""
    shard, _ = shard_for(mode, 3)
    p0 = shard.params.detach().clone()
    g = [np.full(shard.P, float(r + 1), np.float32) for r in range(3)]
    for r in (0, 1):
        answers(shard.handle(("push", r), push(shard, r, 0, g[r])))
    shard.set_live({1: 0, 2: 0})              # rank 0 leaves; rank 2 is live and still computing
    assert shard.rule.barrier.step == 0       # open: rank 2 is waited for
    out = answers(shard.handle(("push", 2), push(shard, 2, 0, g[2])))
    assert not out[("push", 2)].get("dropped") and shard.rule.barrier.step == 1
    assert shard.rule.barrier.dropped == 0
    assert not torch.equal(shard.params.detach(), p0)
    # and a step whose live workers have all pushed closes when the one it waits for leaves
    for r in (1, 2):
        answers(shard.handle(("push", r), push(shard, r, 1, g[r])))
    assert shard.rule.barrier.step == 2
    answers(shard.handle(("push", 1), push(shard, 1, 2, g[1])))
    shard.set_live({1: 0})
    assert shard.rule.barrier.step == 3


@pytest.mark.timeout(60)
def test_a_refused_pull_is_not_counted_as_a_pull():
    shard, cfg = shard_for("async", 2, **{"train.steps": 10})
    for bad in (msg("pull", 5, 0), msg("pull", 0, 50)):   # a rank not in the job; a clock past its end
        with pytest.raises(wire.WireError):
            shard.handle("t", bad)
    assert shard.counters["pulls"] == 0
    shard.handle("t", msg("pull", 0, 0))
    assert shard.counters["pulls"] == 1


@pytest.mark.timeout(30)
def test_the_global_model_is_read_again_while_its_shards_stand_at_different_steps(monkeypatch):
    """The evaluator read shard 0 after it closed step c and shard 1 before: a model of
    two steps' slices. It reads again until the shards agree (a few tries)."""
    from psgd.consistency import rule

    class Client:
        def __init__(self, steps):
            self.steps = steps
            self.reads = 0

        def pull(self, clock):
            self.reads += 1
            at = self.steps[min(self.reads, len(self.steps)) - 1]
            return [{"step": s} for s in at]
    monkeypatch.setattr(rule.time, "sleep", lambda s: None)
    c = Client([(4, 3), (4, 3), (4, 4)])
    assert rule.read_params(c) == [{"step": 4}, {"step": 4}] and c.reads == 3
    stuck = Client([(4, 3)])
    assert rule.read_params(stuck) == [{"step": 4}, {"step": 3}] and stuck.reads == rule.READ_TRIES
    stuck.waits, stuck.reads = False, 0
    assert rule.read_params(stuck) and stuck.reads == 1


@pytest.mark.parametrize("given,says", [(True, "lower the learning rate of the optimizer given to psgd.connect"),
                                        (False, "lower optimizer.lr")])
def test_a_local_optimizers_divergence_names_the_rate_that_steps_it(given, says):
    """A helper's review: a training script's own optimizer that diverged (easgd, diloco,
    ltfb) ended the job with "lower optimizer.lr", a key that does not reach that
    optimizer: the advice names the optimizer given to psgd.connect."""
    import math
    from types import SimpleNamespace

    import torch

    from psgd.config import Config
    from psgd.consistency.rule import Diverged, local_step
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e6)
    w = SimpleNamespace(cfg=Config(), clock=3, compute=lambda: math.nan, user_optimizer=opt if given else None)
    with pytest.raises(Diverged) as e:
        local_step(w, opt)
    assert str(e.value) == f"loss is nan at step 3; {says}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "ssp", "async", "diloco", "easgd"])
def test_a_new_worker_process_registered_behind_the_shards_continues_where_they_are(mode):
    """A whole job stopped and started (or its coordinator killed with its workers): a new
    worker process registers at the coordinator's last record of its rank's clock, which
    may be far behind the shards, restored from later checkpoints. Its schedule's start
    moves it up to where the shards are (the shards' step, or its rank's last finished
    clock there), as a rejoin does: no step is trained twice, so the job trains no more
    than train.steps (checked with kill -9 of the coordinator and workers in psgd run)."""
    from psgd.consistency import get as get_mode
    from psgd.shard import Shard
    from tests.loopback import FakeTrainer, Loopback
    cfg = Config().replace(**{"mode.name": mode, "cluster.workers": 1, "cluster.servers": 2,
                              "mode.local_steps": 2, "mode.tau": 2, "train.steps": 20})
    shards = [Shard(cfg, i) for i in range(2)]
    before = FakeTrainer(cfg, Loopback(shards, 0), lambda x: 0.1 * x)
    s = get_mode(mode).schedule(cfg)
    s.start(before)
    for _ in range(6):
        s.step(before)
    checkpoints = [sh.state_dict() for sh in shards]
    shards = [Shard(cfg, i) for i in range(2)]   # restarted, restored
    for sh, sd in zip(shards, checkpoints, strict=True):
        sh.load_state_dict(sd)
    after = FakeTrainer(cfg, Loopback(shards, 0), lambda x: 0.1 * x)
    after.clock = 2                              # the coordinator's last record
    s = get_mode(mode).schedule(cfg)
    s.start(after)
    assert after.clock == 6
    s.step(after)
    assert after.clock == 7 and not after.logged[-1][2].get("dropped")
