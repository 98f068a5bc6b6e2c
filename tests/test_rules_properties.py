"""Property tests of the consistency rules as a shard carries them out (psgd/shard.py):
hypothesis drives one `Shard` per mode with random interleavings of pushes, reads,
joins, leaves, checkpoints and restores from the latest checkpoint (older than the
workers, who go on at their own clocks), and after every event checks what docs/modes.md
and the papers state:

- no event sequence raises anything but a documented refusal (`wire.WireError`), and
  every event returns (a rule that loops for good would hang the shard's daemon);
- a request is answered at most once;
- sync / diloco: each step applies the mean of exactly the gradients it counted
  (`Accumulate`d since the last `ApplySum`, the restored open step's included); sync's
  SGD step is params - lr * that mean; late and duplicate gradients are answered
  `dropped` and counted in `dropped`;
- ssp: a worker's gated read of clock c is answered only when every live worker has
  finished clock c - s (its `guaranteed`);
- async: reads never wait;
- easgd: the centre moves by exactly the d's its answers hand the workers (symmetric),
  each d = alpha (x_i - centre);
- ltfb: a fetch of (round r, trainer t) is answered with t's deposit of round r or
  later, with the arrays deposited under it; a trainer's step mean is the mean of its
  contributors' gradients;
- a rule's state survives a checkpoint round trip (`state_dict` after `load_state_dict`
  is the same).
"""
from __future__ import annotations

import io
import os
import signal
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psgd import wire
from psgd.config import Config
from psgd.consistency import rule as r
from psgd.shard import Shard

pytestmark = pytest.mark.unit

# PSGD_HUNT=N: more examples, to hunt (the file runs in seconds at the default)
RUNS = settings(max_examples=int(os.environ.get("PSGD_HUNT", 40)), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
STEPS = 12
EVENTS = st.lists(st.tuples(st.integers(0, 11), st.integers(0, 63), st.integers(0, 63), st.integers(0, 63)),
                  max_size=60)
LR = 0.5
EVENT_S = 5   # an event that takes longer loops for good


@contextmanager
def returns_within(seconds: int):
    """An event that does not return (a rule looping for good) fails the example, which
    hypothesis then shrinks. (pytest-timeout's own alarm, if set, is put back.)"""
    def expired(*_):
        raise AssertionError(f"an event did not return within {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    start = time.monotonic()
    before = signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        if before:
            signal.alarm(max(1, before - int(time.monotonic() - start)))


def config(mode: str, n: int, **sets) -> Config:
    return Config().replace(**{"mode.name": mode, "cluster.workers": n, "cluster.servers": 1, "model.hidden": 2,
                               "optimizer.name": "sgd", "optimizer.momentum": 0.0, "optimizer.lr": LR,
                               "train.steps": STEPS, **sets})


class Recorder(Shard):
    """A shard whose decisions are checked as they are carried out."""

    def __init__(self, cfg: Config, harness: Harness):
        super().__init__(cfg, 0)
        self.h = harness
        for kind in list(self._carriers):
            self._carriers[kind] = self._checked(kind, self._carriers[kind])

    def _checked(self, kind, carry):
        def run(d):
            self.h.before(self, d)
            out = carry(d)
            self.h.after(self, d)
            return out
        return run


class Harness:
    """Drives a Recorder and keeps what the invariants need; `ckpt` is the latest
    checkpoint with the harness's own state at that moment."""

    def __init__(self, mode: str, n: int, **sets):
        self.cfg = config(mode, n, **sets)
        self.mode, self.n = mode, n
        self.live = {rank: 0 for rank in range(n)}
        self.shard = Recorder(self.cfg, self)
        self.answered: set = set()
        self.ids = iter(range(1, 1 << 30))
        self.pending: list[torch.Tensor] = []    # the open step's accumulated gradients (sync, diloco)
        self.drops = 0                           # answers `dropped` (sync, diloco)
        self.ckpt: tuple | None = None
        self.rng = np.random.default_rng(0)
        self.joins: set[int] = set()             # the ids of join reads (never gated)

    # -------------------------------------------------------------- events
    def message(self, op: str, rank: int, clock: int, arrays=(), **fields) -> wire.Message:
        return wire.decode(wire.encode(op, id=next(self.ids), rank=rank, clock=clock, arrays=arrays, **fields))

    def vector(self) -> np.ndarray:
        return self.rng.standard_normal(self.shard.P).astype(np.float32)

    def buffers(self) -> np.ndarray:
        return self.rng.standard_normal(self.shard.B).astype(np.float32)

    def send(self, m: wire.Message) -> dict:
        token = ("t", m.id)
        try:
            with returns_within(EVENT_S):
                replies = self.shard.handle(token, m)
        except wire.WireError:
            return {}
        return self.replies(replies)

    def replies(self, replies) -> dict:
        out = {}
        for tok, frames in replies:
            assert tok not in self.answered, f"{tok} answered twice"
            self.answered.add(tok)
            out[tok] = wire.decode(frames)
        return out

    def set_live(self, live: dict[int, int]) -> dict:
        self.live = dict(live)
        with returns_within(EVENT_S):
            return self.replies(self.shard.set_live(dict(live)))

    def save(self) -> None:
        buf = io.BytesIO()
        torch.save(self.shard.state_dict(), buf)
        self.ckpt = (buf.getvalue(), [p.clone() for p in self.pending], self.drops)

    def restore(self) -> None:
        """A shard restarted from its latest checkpoint (or afresh, without one); the
        daemon tells it the membership before it answers anything."""
        shard = Recorder(self.cfg, self)
        if self.ckpt is not None:
            data, pending, drops = self.ckpt[:3]
            sd = torch.load(io.BytesIO(data), weights_only=True)
            shard.load_state_dict(sd)
            again = shard.rule.state_dict()
            assert comparable(again) == comparable(sd["rule"]), "a rule's state changed in a checkpoint round trip"
            self.pending, self.drops = [p.clone() for p in pending], drops
        else:
            self.pending, self.drops = [], 0
        self.shard = shard
        with returns_within(EVENT_S):
            self.replies(shard.set_live(dict(self.live)))

    # -------------------------------------------------------------- checks around decisions
    def before(self, shard: Shard, d) -> None:
        if isinstance(d, r.ApplySum):
            assert d.count == len(self.pending) >= 1, (d.count, len(self.pending))
            self.mean = torch.stack(self.pending).mean(0)
            torch.testing.assert_close(shard.summed()[0] / d.count, self.mean)
            self.params = shard.params.detach().clone()
            state = shard.opt.state.get(shard.params, {}).get("momentum_buffer")
            self.momentum = None if state is None else state.clone()
        if (isinstance(d, r.Answer) and d.fields.get("dropped") and not d.fields.get("duplicate")
                and self.mode in ("sync", "diloco")):   # (a resend of a dropped push says so again: one drop)
            self.drops += 1

    def after(self, shard: Shard, d) -> None:
        if isinstance(d, r.Accumulate):
            if d.first:
                self.pending = []
            self.pending.append(d.grad.clone())
        elif isinstance(d, r.ApplySum):
            self.pending = []
            if self.mode == "sync":   # plain SGD at a constant rate: one step on the mean
                torch.testing.assert_close(shard.params.detach(), self.params - LR * self.mean)
            if self.mode == "diloco":   # the outer Nesterov step on the mean pseudo-gradient (docs/modes.md)
                mu, eta = self.cfg.mode.outer_momentum, self.cfg.mode.outer_lr
                m = self.mean if self.momentum is None else mu * self.momentum + self.mean
                torch.testing.assert_close(shard.params.detach(), self.params - eta * (self.mean + mu * m))


def comparable(x):
    """A state dict with its tensors as lists (== compares them by value)."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {k: comparable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [comparable(v) for v in x]
    return x


def membership_event(h: Harness, a: int, b: int) -> None:
    rank = a % h.n
    live = dict(h.live)
    if rank in live and (b % 3 or len(live) == 1):
        if len(live) > 1 or b % 2 == 0:
            del live[rank]                           # leaves (sometimes the last one)
    else:
        live[rank] = min(STEPS, b % (STEPS + 1))     # (re)joins at the coordinator's clock for it
    h.set_live(live)


# ---------------------------------------------------------------- sync, diloco, ssp, async

def push_pull_step(h: Harness, kind: int, a: int, b: int, c: int, near: int) -> None:
    """One event of the parameter-server modes; clocks near the shard's `near`."""
    rank = a % h.n
    clock = max(0, min(h.shard.last_exchange, near + b % 6 - 2))
    version = h.shard.version
    if kind <= 4:        # a push (with its read: pull=true, as the workers send it)
        m = h.message("push", rank, clock, [h.vector(), h.buffers()], read_version=max(0, version - c % 4),
                      pull=bool(kind % 4))
        h.send(m)
    elif kind <= 6:      # a read (a pull of the clock after its last push)
        h.send(h.message("pull", rank, clock + 1))
    elif kind == 7:      # a (re)joining worker's read
        m = h.message("pull", rank, clock, join=True)
        h.joins.add(m.id)
        h.send(m)
    elif kind == 8:      # the evaluator
        h.send(h.message("pull", -1, 0))
    elif kind == 9:
        membership_event(h, a, b)
    elif kind == 10:
        h.save()
    else:
        h.restore()


def sync_near(h: Harness) -> int:
    return h.shard.rule.barrier.step


@pytest.mark.timeout(120)
@RUNS
@given(n=st.integers(1, 4), backup=st.integers(0, 3), events=EVENTS)
def test_sync_steps_are_the_mean_of_exactly_the_counted_gradients(n, backup, events):
    h = Harness("sync", n, **{"mode.backup_workers": backup % n})
    for kind, a, b, c in events:
        push_pull_step(h, kind, a, b, c, sync_near(h))
        rule = h.shard.rule
        assert rule.barrier.dropped == h.drops, "a dropped gradient was not counted, or counted twice"
        assert len(rule.barrier.contributors) == len(set(rule.barrier.contributors)) == len(h.pending)


@pytest.mark.timeout(120)
@RUNS
@given(n=st.integers(1, 4), events=EVENTS)
def test_diloco_rounds_step_on_the_mean_pseudo_gradient(n, events):
    h = Harness("diloco", n, **{"mode.local_steps": 2})
    for kind, a, b, c in events:
        push_pull_step(h, kind, a, b, c, sync_near(h))
        rule = h.shard.rule
        assert rule.barrier.dropped == h.drops
        assert len(rule.barrier.contributors) == len(h.pending)


def ssp_check(h: Harness, got: dict, bound: int | None) -> None:
    for (_, _), m in got.items():
        if ("guaranteed" in m.fields and m.rank >= 0 and bound is not None and m.id not in h.joins
                and h.shard.rule.clocks.live):   # (with nobody live the bound holds vacuously)
            assert m.get("guaranteed") >= m.clock - bound, (m.clock, m.get("guaranteed"), bound)


@pytest.mark.timeout(120)
@RUNS
@given(n=st.integers(1, 4), bound=st.integers(0, 3), events=EVENTS)
def test_ssp_never_answers_a_read_beyond_the_bound(n, bound, events):
    h = Harness("ssp", n, **{"mode.staleness": bound})
    seen = {}
    orig = h.replies

    def replies(rs):
        got = orig(rs)
        seen.update(got)
        return got
    h.replies = replies
    for kind, a, b, c in events:
        seen.clear()
        near = min(h.shard.rule.clocks.finished.values(), default=0)
        push_pull_step(h, kind, a, b, c, near)
        ssp_check(h, seen, bound)


@pytest.mark.timeout(120)
@RUNS
@given(n=st.integers(1, 4), events=EVENTS, policy=st.sampled_from(["constant", "staleness"]),
       dc=st.sampled_from([0.0, 0.5]), n_push=st.integers(1, 3), n_fetch=st.integers(1, 3))
def test_async_reads_never_wait(n, events, policy, dc, n_push, n_fetch):
    h = Harness("async", n, **{"mode.lr_policy": policy, "mode.dc_lambda": dc, "mode.n_push": n_push,
                               "mode.n_fetch": n_fetch})
    for kind, a, b, c in events:
        near = max(h.shard.last_clock.values(), default=0)
        push_pull_step(h, kind, a, b, c, near)
        assert h.shard.rule.parked() == 0


# ---------------------------------------------------------------- easgd

class ElasticHarness(Harness):
    """Checks, per event, that the centre moved by exactly the d's handed to the workers
    whose offers moved it, each d = alpha (x - centre), and that every other offer's d
    (a resend, a late one) is alpha (x - centre) with the centre unmoved."""

    def begin(self) -> None:
        self.moved = torch.zeros(self.shard.P)
        self.handed = torch.zeros(self.shard.P)
        self.centre = self.shard.params.detach().clone()

    def x(self, rank: int, round_: int) -> np.ndarray:
        """A worker's replica at a round (a resend carries the same)."""
        g = np.random.default_rng(1000 * rank + round_)
        if not hasattr(self, "x0"):
            self.x0 = self.shard.params.detach().clone().numpy()
        return (self.x0 + g.standard_normal(self.shard.P)).astype(np.float32)

    def before(self, shard: Shard, d) -> None:
        super().before(shard, d)
        if isinstance(d, r.Move):
            self.at_move = shard.params.detach().clone()
            self.moved += d.delta
        if isinstance(d, r.Answer) and d.arrays:
            token, m = d.token
            x = torch.from_numpy(np.array(m.arrays[0]))
            alpha = shard.rule.alpha
            if m.get("duplicate") is None and not (d.fields.get("dropped") or d.fields.get("duplicate")):
                self.handed += d.arrays[0]
                torch.testing.assert_close(d.arrays[0], alpha * (x - self.at_move))
            else:
                torch.testing.assert_close(d.arrays[0], alpha * (x - shard.params.detach()))


def elastic_step(h: ElasticHarness, kind: int, a: int, b: int, c: int) -> None:
    rank = a % h.n
    rule = h.shard.rule
    near = rule.barrier.step if h.cfg.mode.sync else rule.offered.get(rank, -1) + 1
    round_ = max(0, min(h.shard.last_exchange, near + b % 5 - 2))
    h.begin()
    if kind <= 4:
        h.send(h.message("elastic", rank, round_ * h.cfg.mode.tau, [h.x(rank, round_), h.buffers()], round=round_))
    elif kind <= 6:
        h.send(h.message("pull", rank, round_ * h.cfg.mode.tau))
    elif kind == 7:
        h.send(h.message("pull", rank, round_ * h.cfg.mode.tau, join=True))
    elif kind == 8:
        h.send(h.message("pull", -1, 0))
    elif kind == 9:
        membership_event(h, a, b)
    elif kind == 10:
        h.save()
    else:
        h.restore()
        h.begin()
    torch.testing.assert_close(h.moved, h.handed)
    if kind <= 9:
        torch.testing.assert_close(h.shard.params.detach(), h.centre + h.moved)


@pytest.mark.timeout(120)
@RUNS
@given(n=st.integers(1, 4), sync=st.booleans(), tau=st.integers(1, 3), events=EVENTS)
def test_easgd_the_centre_moves_by_exactly_the_workers_elastic_terms(n, sync, tau, events):
    h = ElasticHarness("easgd", n, **{"mode.sync": sync, "mode.tau": tau})
    for kind, a, b, c in events:
        elastic_step(h, kind, a, b, c)


# ---------------------------------------------------------------- ltfb

class LtfbHarness(Harness):
    """Keeps every deposit's arrays by (round, trainer), and checks that a fetch's answer
    is its owner's deposit of the round asked or later, with the arrays deposited."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.deposits: dict[tuple[int, int], np.ndarray] = {}
        self.k = self.cfg.mode.trainer_size
        self.group: dict[tuple[int, int], list] = {}   # (trainer, step) -> gradients pushed for it

    def save(self) -> None:
        super().save()
        self.ckpt = (*self.ckpt, dict(self.deposits), {k: dict(v) for k, v in self.group.items()})

    def restore(self) -> None:
        super().restore()
        if self.ckpt is not None:
            self.deposits, group = dict(self.ckpt[3]), self.ckpt[4]
            self.group = {k: dict(v) for k, v in group.items()}
        else:
            self.deposits, self.group = {}, {}

    def before(self, shard: Shard, d) -> None:
        """A trainer's step: a push taken into it is kept; a step's answer is the mean of
        exactly the gradients taken into it."""
        super().before(shard, d)
        if not isinstance(d, r.Answer):
            return
        _, m = d.token
        if m.op == "push" and "staleness" in d.fields and not (d.fields.get("dropped") or d.fields.get("duplicate")):
            self.group.setdefault((m.rank // self.k, m.clock), {})[m.rank] = torch.from_numpy(np.array(m.arrays[0]))
        if "count" in d.fields:
            taken = self.group.get((m.rank // self.k, d.fields["step"] - 1), {})
            assert d.fields["count"] == len(taken), (d.fields, sorted(taken))
            torch.testing.assert_close(d.arrays[0], torch.stack(list(taken.values())).mean(0))

    def check_models(self, got: dict) -> None:
        for (_, mid), m in got.items():
            if m.op != "reply" or "owner" not in m.fields or m.get("round", 0) < 0:
                continue
            asked = self.asked.get(mid)
            if asked is None:
                continue
            round_, owner, exact = asked
            assert m.get("owner") == owner
            assert (m.get("round") == round_) if exact else (m.get("round") >= round_)
            want = self.deposits.get((m.get("round"), owner))
            if want is not None:   # (a restored shard may answer with a deposit the harness forgot: older)
                np.testing.assert_array_equal(np.array(m.arrays[0]), want)


def ltfb_step(h: LtfbHarness, kind: int, a: int, b: int, c: int) -> None:
    rank = a % h.n
    trainers = h.n // h.k
    round_ = 1 + b % 4
    owner = c % (trainers + 1) - 1           # -1: a round's scores
    got = {}
    if kind <= 2:    # a deposit (score from c; sometimes the final model)
        final = b % 7 == 0
        rnd = r.FINAL_ROUND if final else round_
        x = h.vector()
        got = h.send(h.message("put_model", rank, rnd * 2 if not final else 0, [x, h.buffers()], round=rnd,
                               score=float(c % 5)))
        h.deposits[(rnd, rank // h.k)] = x
    elif kind <= 4:  # a fetch of a trainer's model, or of a round's scores
        exact = kind == 4
        fields = {"round": round_, "owner": owner, "exact": exact}
        if owner == -1 and b % 2:
            fields["score"] = float(b % 3)
        m = h.message("get_model", rank, 0, **fields)
        h.asked[m.id] = (round_, owner, exact)
        got = h.send(m)
    elif kind == 5:  # an outcome (round -r) deposited, or asked for
        if b % 2:
            got = h.send(h.message("put_model", rank, 0, [h.vector(), h.buffers()], round=-round_, score=0.0))
        else:
            got = h.send(h.message("get_model", rank, 0, round=-round_, owner=rank // h.k))
    elif kind == 6:  # a trainer's step: push (with its read)
        clock = max(0, min(STEPS - 1, b % STEPS))
        got = h.send(h.message("push", rank, clock, [h.vector(), h.buffers()], read_version=0, pull=True))
    elif kind == 7:
        got = h.send(h.message("models", -1, 0))
    elif kind == 8:
        got = h.send(h.message("pull", -1, 0))
    elif kind == 9:
        membership_event(h, a, b)
    elif kind == 10:
        h.save()
    else:
        h.restore()
    h.check_models(got)


@pytest.mark.timeout(120)
@RUNS
@given(n=st.integers(1, 4), k=st.integers(1, 2), strategy=st.sampled_from(["pairwise", "truncation"]),
       events=EVENTS)
def test_ltfb_fetches_get_the_owners_deposit_and_nothing_raises(n, k, strategy, events):
    k = k if n % k == 0 else 1
    strategy = strategy if n // k >= 2 else "pairwise"
    h = LtfbHarness("ltfb", n, **{"mode.trainer_size": k, "mode.strategy": strategy, "mode.round_steps": 2,
                                  "mode.truncation_k": 1})
    h.asked = {}
    for kind, a, b, c in events:
        ltfb_step(h, kind, a, b, c)


def step_push(h: Harness, rank: int, clock: int) -> wire.Message:
    return h.message("push", rank, clock, [h.vector(), h.buffers()], read_version=0, pull=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("back", [{0: 5, 1: 5, 2: 3}, {2: 3}])
def test_a_waiting_push_whose_step_was_skipped_is_answered_late_not_kept_for_good(back):
    """Found by the sync property above. Rank 2 pushes for step 3 while step 0 is open
    (it waits, `SyncRule.early`), then leaves; ranks 0 and 1 read clock 5 without pushing
    here (the shard was restored from an older checkpoint): the empty step skips to 5,
    past rank 2's push, which stayed waiting below the open step and counted as `ahead`
    for good. With rank 2 back, every step closed without waiting for it (its gradients
    dropped as late), and with rank 2 the only live worker the shard's loop never ended:
    the daemon hung. Now the skipped push is answered late (dropped, counted)."""
    h = Harness("sync", 3)
    early = step_push(h, 2, 3)
    assert h.send(early) == {}                   # waits for step 3
    h.set_live({0: 0, 1: 0})                     # rank 2 leaves
    h.send(h.message("pull", 0, 5))
    got = h.send(h.message("pull", 1, 5))
    assert h.shard.rule.barrier.step == 5
    late = got[("t", early.id)]
    assert late.get("push")["dropped"]
    assert h.shard.rule.barrier.dropped == 1 and h.shard.rule.waiting_pushes() == {}
    h.set_live(back)                             # rank 2 back (alone: the loop never ended)
    if len(back) == 3:
        for rank in (0, 1):
            h.send(step_push(h, rank, 5))
        assert h.shard.rule.barrier.step == 5    # step 5 waits for rank 2's gradient
        h.send(step_push(h, 2, 5))
        assert h.shard.rule.barrier.step == 6 and h.shard.rule.short_steps == 0


@pytest.mark.timeout(60)
def test_rounds_closed_by_one_event_take_each_d_against_the_centre_the_earlier_rounds_moved():
    """Found by the easgd property above. Rank 1 offers round 0, then round 1 (it waits);
    rank 0's offer for round 1 shows that round 0 gets nothing more: round 0 closes with
    rank 1's offer, then round 1 with both, in one event. Round 1's d_i were taken
    against the centre before round 0's move (the shard carries the moves out after the
    rule decides), so the workers moved by alpha (x_i - a centre that was no longer the
    centre)."""
    h = ElasticHarness("easgd", 2, **{"mode.sync": True, "mode.tau": 1})
    h.begin()
    c0 = h.shard.params.detach().clone()
    alpha = h.shard.rule.alpha
    x = {(rank, rnd): h.x(rank, rnd) for rank in (0, 1) for rnd in (0, 1)}

    def offer(rank, rnd):
        return h.send(h.message("elastic", rank, rnd, [x[rank, rnd], h.buffers()], round=rnd))
    offer(1, 0)
    offer(1, 1)
    got = offer(0, 1)
    assert h.shard.rule.barrier.step == 2 and h.shard.rule.short_steps == 1
    d0 = alpha * (torch.from_numpy(x[1, 0]) - c0)
    c1 = c0 + d0
    ds = {m.rank: torch.from_numpy(np.array(m.arrays[0])) for m in got.values()}
    for rank in (0, 1):
        torch.testing.assert_close(ds[rank], alpha * (torch.from_numpy(x[rank, 1]) - c1))
    torch.testing.assert_close(h.shard.params.detach(), c1 + ds[0] + ds[1])


@pytest.mark.timeout(60)
def test_a_step_of_waiting_pushes_closes_with_the_first_n_minus_b_with_backup_workers():
    """E's note: with backup workers, the pushes that waited for a step (`early`: workers
    ahead of this shard, restored from an older checkpoint, say) were all taken when it
    opened, so the step closed with more than N - b gradients and fewer counted dropped
    than "the first N - b, the rest dropped" (Chen et al. 2016). It takes the first N - b
    of them in arrival order; the rest are late, dropped and counted."""
    h = Harness("sync", 5, **{"mode.backup_workers": 2})     # N - b = 3
    h.send(step_push(h, 0, 0))                                # step 0: rank 0's gradient
    early = [step_push(h, rank, 1) for rank in (0, 1, 2, 3)]  # four wait for step 1; rank 4 has not pushed
    for m in early:
        assert h.send(m) == {}
    got = h.send(step_push(h, 4, 0))                          # step 0 closes short; step 1 with 3 of the 4
    assert h.shard.rule.barrier.step == 2, h.shard.rule.barrier.step
    assert h.shard.rule.barrier.dropped == 1 and h.drops == 1
    assert got[("t", early[3].id)].get("push")["dropped"]      # the fourth to arrive: late
