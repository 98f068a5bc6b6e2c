"""async's knobs as the papers write them: the staleness-aware learning rate of Zhang et
al. 2016 (alpha0 / max(1, tau) in place of the 1 / W scaling), and Downpour's n_push /
n_fetch (Dean et al. 2012), the latter driven through `AsyncSchedule` with a fake
trainer and parameter client (no sockets): a one-shard "server" that applies each push
as plain SGD at lr / W and answers pulls with its parameters."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from psgd import wire
from psgd.config import Config
from psgd.consistency import get as get_mode
from psgd.consistency.clock import live_key
from psgd.consistency.rule import Apply, Push, Read
from psgd.consistency.staleness import Histogram, lr_scale
from psgd.replica import Replica

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- lr_policy = "staleness"

@dataclass
class Tables:
    params: Any = None
    buffers: Any = None
    version: int = 0


def rule(mode: str, world: int, **sets):
    cfg = Config().replace(**{"mode.name": mode, "cluster.workers": world, **sets})
    return get_mode(mode).rule(cfg.mode, world, Tables())


def applied_scale(r, tau: int) -> float:
    out = r.push(Push(("push", 0), 0, 0, tau, "g", "b"))
    (apply,) = [d for d in out if isinstance(d, Apply)]
    return apply.lr_scale


def test_staleness_policy_replaces_the_one_over_w_scaling():
    # Zhang et al. 2016: alpha0 / tau with alpha0 the synchronous rate; not alpha0 / (W tau)
    assert applied_scale(rule("async", 4, **{"mode.lr_policy": "staleness"}), 3) == pytest.approx(1 / 3)
    assert applied_scale(rule("async", 4, **{"mode.lr_policy": "staleness"}), 0) == 1.0   # max(1, tau)
    assert applied_scale(rule("async", 4, **{"mode.lr_policy": "constant"}), 3) == pytest.approx(1 / 4)
    assert applied_scale(rule("ssp", 4, **{"mode.lr_policy": "staleness"}), 3) == pytest.approx(1 / 4)
    assert lr_scale(3, "staleness", 4) == pytest.approx(1 / 3) and lr_scale(3, "constant", 4) == 0.25


@pytest.mark.timeout(120)
def test_staleness_policy_through_a_shard():
    from psgd.shard import Shard
    cfg = Config().replace(**{"mode.name": "async", "cluster.workers": 4, "cluster.servers": 1,
                              "optimizer.momentum": 0.0, "mode.lr_policy": "staleness"})
    shard, lr = Shard(cfg, 0), cfg.optimizer.lr
    p0 = shard.params.detach().clone().numpy()
    g = np.ones(shard.P, np.float32)
    ids = iter(range(1, 1000))

    def push(rank, clock, read_version):
        m = wire.decode(wire.encode("push", id=next(ids), rank=rank, clock=clock, read_version=read_version,
                                    arrays=[g, np.zeros(shard.B, np.float32)]))
        return wire.decode(shard.handle(("p", rank, clock), m)[0][1])

    for c in range(3):                      # fresh gradients: tau = 0, the full rate
        assert push(0, c, read_version=c).get("staleness") == 0
    assert push(1, 0, read_version=0).get("staleness") == 3
    np.testing.assert_allclose(shard.params.detach().numpy(), p0 - lr * (3 + 1 / 3) * g, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode, sets, taus", [
    ("ssp", {}, [0, 1, 2]),
    ("ssp", {"mode.cache": True}, [0, 0, 0]),
    ("ssp", {"mode.prefetch": True}, [0, 0, 0]),
    ("async", {}, [0, 1, 2]),
    ("async", {"mode.prefetch": True}, [0, 1, 2]),   # (its copy is not stepped by its own pushes)
    ("async", {"mode.n_fetch": 4}, [0, 0, 0]),
])
def test_a_workers_own_pushes_that_its_copy_holds_are_not_stale(mode, sets, taus):
    """A review: one worker of ssp with the client cache pushed three times on its read of
    version 0, its copy stepped by each push (read-my-writes), and the shard counted
    staleness 0, 1, 2: its own updates, which async with n_fetch already left out."""
    r = rule(mode, 1, **sets)
    got = []
    for k in range(3):
        r.tables.version = k   # (the shard's version: each push applied)
        got.append(r.push(Push(("push", 0), 0, k, k, "g", "b"))[-1].fields["staleness"])
    assert got == taus


def test_n_push_moves_the_lr_schedule_n_push_steps_per_push():
    # a push of Downpour's n_push is the sum of n_push steps: after W pushes of every
    # worker's, the schedule stands at n_push steps, as it would after W * n_push
    # single-step pushes (progress = version * n_push / W)
    def progress(r, pushes):
        r.tables.version = pushes
        (apply,) = [d for d in r.push(Push(("push", 0), 0, 0, 0, "g", "b")) if isinstance(d, Apply)]
        return apply.progress
    assert progress(rule("async", 2, **{"mode.n_push": 4}), 50) == 100.0
    assert progress(rule("async", 2), 50) == 25.0
    assert progress(rule("ssp", 2), 50) == 25.0


def test_dc_asgd_compensates_a_downpour_sum_as_its_gradients_not_as_one_gradient():
    """A review: with mode.n_push = n a push is the sum S of n gradients, and the shard
    compensated it as one gradient, S + lambda S S (w_now - w_read): n times as strongly
    as DC-ASGD (Zheng et al. 2017) compensates each of the n (n^2 g g against n g g for
    n equal gradients g). It is now compensated as n times their mean's."""
    lam, n = 0.5, 4
    for pushes in (1, n):
        r = rule("async", 2, **{"mode.dc_lambda": lam, "mode.n_push": pushes})
        r.tables.params, r.tables.buffers = torch.zeros(3), torch.zeros(0)
        r.read(Read(("pull", 0), 0, 0))                     # worker 0 reads version 0: w_read = 0
        r.tables.params, r.tables.version = torch.tensor([1.0, -2.0, 0.5]), 2   # two updates by others
        g = torch.tensor([0.5, 0.25, -1.0])
        out = r.push(Push(("push", 0), 0, pushes - 1, 2, pushes * g, torch.zeros(0)))   # of steps 0 .. n - 1
        (apply,) = [d for d in out if isinstance(d, Apply)]
        per_gradient = g + lam * g * g * (r.tables.params - 0)     # DC-ASGD of one gradient
        torch.testing.assert_close(apply.grad, pushes * per_gradient)


# ---------------------------------------------------------------- a fake trainer and client

class Msg(dict):
    """An answer as the schedule reads it (`get`), with the arrays it carries."""


class FakeClient:
    """One shard, in the same process: a push applies plain SGD at lr / W to `params`
    and counts a version; a pull answers a copy, gated over the live set `live`. Every
    request is recorded."""

    def __init__(self, params: torch.Tensor, buffers: torch.Tensor, lr: float, world: int, live: set[int]):
        self.params, self.buffers, self.lr, self.world = params.clone(), buffers.clone(), lr, world
        self.live_key = live_key(live)
        self.version = 0
        self.finished = 0
        self.wait_s = 0.0
        self.log: list[tuple] = []          # ("push", clock, grad copy) / ("pull", clock)
        self.pushed_sum = torch.zeros_like(params)
        self.refuse: set[int] = set()       # clocks whose push is refused (once each), applying nothing
        self.drop: set[int] = set()         # clocks whose push is answered dropped, applying nothing
        self.refuse_pulls: set[int] = set()  # clocks whose pull (not a push's read) is refused, once each

    def _pull(self, clock: int) -> Msg:
        self.log.append(("pull", clock))
        return Msg(version=self.version, finished=self.finished, guaranteed=self.finished, step=0,
                   live_key=self.live_key, params=self.params.clone(), buffers=self.buffers.clone())

    def _push(self, clock: int, g: torch.Tensor, read_version: int) -> Msg:
        assert not any(e[0] == "push" and e[1] >= clock for e in self.log), "push clocks must grow"
        if clock in self.drop:
            self.finished = clock + 1
            return Msg(staleness=self.version - read_version, dropped=True)
        self.log.append(("push", clock, g.clone()))
        self.params -= self.lr / self.world * g
        self.pushed_sum += g
        tau, self.version = self.version - read_version, self.version + 1
        self.finished = clock + 1
        return Msg(staleness=tau)

    def join(self, clock: int) -> list:
        return [self._pull(clock)]

    def pull(self, clock: int) -> list:
        if clock in self.refuse_pulls:
            self.refuse_pulls.discard(clock)
            raise wire.Refused(wire.REFUSED, f"the read of clock {clock} refused", "shard 0")
        return [self._pull(clock)]

    def begin_push_pull(self, clock, grads, buffers, read_versions, slot=0, pull=True):
        if grads is not None and clock in self.refuse:
            self.refuse.discard(clock)
            return wire.Refused(wire.REFUSED, f"the push of clock {clock} refused", "shard 0")
        pushed = [self._push(clock, grads[0], read_versions[0])] if grads is not None else []
        return pushed, ([self._pull(clock + 1)] if pull else [])

    def finish_push_pull(self, f):
        if isinstance(f, wire.Refused):
            raise f
        return f

    def push_pull(self, clock, grads, buffers, read_versions):
        return self.finish_push_pull(self.begin_push_pull(clock, grads, buffers, read_versions))

    def push(self, clock, grads, buffers, read_versions):
        return self.finish_push_pull(self.begin_push_pull(clock, grads, buffers, read_versions, pull=False))[0]

    @staticmethod
    def tables(msgs):
        return [m["params"] for m in msgs], [m["buffers"] for m in msgs]


@dataclass
class FakeTrainer:
    """The worker as a schedule sees it; `compute` sets gradient k + 1 times a fixed
    direction at its k-th call (so sums are known), or a real gradient (`real`)."""
    cfg: Config
    real: bool = False
    rank: int = 0
    clock: int = 0
    loss: float = 0.0
    samples: int = 0
    hist: Histogram = field(default_factory=Histogram)
    lines: list = field(default_factory=list)
    computed_on: list = field(default_factory=list)   # the parameters each compute saw
    live_ranks: set = field(default_factory=lambda: {0})

    def __post_init__(self):
        torch.manual_seed(0)
        self.replica = Replica(nn.Linear(4, 3), 1, torch.device("cpu"))
        (p,), (b,) = self.replica.params(), self.replica.buffers()
        self.client = FakeClient(p, b, self.cfg.optimizer.lr, self.cfg.cluster.workers, self.live_ranks)
        self.direction = torch.randn(p.numel())
        self.x, self.y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        self.calls = 0

    def compute(self, slot: int = 0) -> float:
        self.computed_on.append(self.replica.params()[0].clone())
        model = self.replica.model
        model.zero_grad(set_to_none=True)
        if self.real:
            loss = nn.functional.cross_entropy(model(self.x), self.y)
            loss.backward()
        else:
            self.calls += 1
            g = self.direction * self.calls
            i = 0
            for p in model.parameters():
                p.grad = g[i:i + p.numel()].view_as(p).clone()
                i += p.numel()
            loss = torch.tensor(1.0)
        return float(loss.detach())

    def log_step(self, staleness: int, wait_s: float, step: Any = None, **extra: Any) -> None:
        self.lines.append({"clock": self.clock, "staleness": staleness, **extra})

    def live(self) -> set[int]:
        return set(self.live_ranks)

    def event(self, **fields: Any) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def now(self) -> float:
        return 0.0


def run(steps: int, real: bool = False, **sets) -> FakeTrainer:
    cfg = Config().replace(**{"mode.name": "async", "cluster.workers": 1, "cluster.servers": 1,
                              "optimizer.momentum": 0.0, "train.steps": steps, **sets})
    w = FakeTrainer(cfg, real)
    schedule = get_mode(cfg.mode.name).schedule(cfg)
    schedule.start(w)
    while w.clock < steps:
        schedule.step(w)
    schedule.finish(w)
    return w


def pushes(w: FakeTrainer) -> list[tuple[int, torch.Tensor]]:
    return [(e[1], e[2]) for e in w.client.log if e[0] == "push"]


def pulls(w: FakeTrainer) -> list[int]:
    return [e[1] for e in w.client.log if e[0] == "pull"]


# ---------------------------------------------------------------- Downpour's n_push / n_fetch

def test_defaults_push_and_pull_every_step():
    w = run(5)
    assert [c for c, _ in pushes(w)] == [0, 1, 2, 3, 4]
    assert pulls(w) == [0, 1, 2, 3, 4, 5]           # the join, then one per push
    assert len(w.lines) == 5 and all("pushed" not in e for e in w.lines)


@pytest.mark.parametrize("prefetch", [False, True])
def test_n_push_sends_the_sum_of_the_accrued_gradients(prefetch):
    w = run(7, **{"mode.n_push": 3, "mode.prefetch": prefetch})
    d = w.direction
    got = pushes(w)
    assert [c for c, _ in got] == [2, 5, 6]          # every 3 steps, and the rest at the end
    for (_, g), ks in zip(got, [(1, 2, 3), (4, 5, 6), (7,)], strict=True):
        torch.testing.assert_close(g, d * sum(ks))
    assert pulls(w) == list(range(8))                # n_fetch = 1: the join, then a pull every step
    assert len(w.lines) == 7 and [e.get("pushed", True) for e in w.lines] == [False, False, True] * 2 + [False]


@pytest.mark.parametrize("prefetch", [False, True])
def test_n_fetch_steps_the_own_copy_in_between(prefetch):
    # one worker, plain SGD on the server: the copy it steps by its own gradients between
    # fetches is exactly the server's model after all its pushes, at every compute
    # (with prefetch too: the push is in flight, the own step is already taken)
    w = run(9, real=True, **{"mode.n_fetch": 3, "mode.prefetch": prefetch})
    assert [c for c, _ in pushes(w)] == list(range(9))
    assert pulls(w) == [0, 3, 6, 9]                  # the join, then every 3 steps
    lr, p = w.cfg.optimizer.lr, w.computed_on[0].clone()
    for k, (_, g) in enumerate(pushes(w)):
        torch.testing.assert_close(w.computed_on[k], p)
        p -= lr * g
    torch.testing.assert_close(w.client.params, p)
    assert len(w.lines) == 9 and w.hist.total == 9


@pytest.mark.parametrize("prefetch", [False, True])
def test_the_last_partial_push_of_n_push_is_counted_in_the_staleness_histogram(prefetch):
    """A review: with n_push = 3 and 7 steps, `finish` pushes what is still summed (step
    6) at clock 6, and the shards apply it as any push, but its answer was dropped: its
    staleness never reached the worker's histogram, so summary.json's `staleness`
    (counted per push) held one push fewer per worker than the shards applied."""
    w = run(7, **{"mode.n_push": 3, "mode.prefetch": prefetch})
    assert [c for c, _ in pushes(w)] == [2, 5, 6]
    assert w.hist.total == 3


def test_n_push_and_n_fetch_with_prefetch_settle_every_request_and_log_every_step():
    w = run(10, **{"mode.n_push": 2, "mode.n_fetch": 5, "mode.prefetch": True})
    d = w.direction
    assert [c for c, _ in pushes(w)] == [1, 3, 5, 7, 9]
    torch.testing.assert_close(w.client.pushed_sum, d * sum(range(1, 11)))   # every gradient, once
    assert pulls(w) == [0, 5, 10]
    assert [e["clock"] for e in w.lines] == list(range(1, 11))              # one line a step, in order
    assert w.hist.total == 5


def test_downpour_trains():
    w = run(60, real=True, **{"mode.n_push": 2, "mode.n_fetch": 3, "optimizer.lr": 0.5})
    model = w.replica.model
    w.replica.load([w.client.params], None)
    loss = nn.functional.cross_entropy(model(w.x), w.y).item()
    assert math.isfinite(loss) and loss < 0.5


def test_prefetch_pushes_say_which_read_they_were_computed_on():
    # one worker: each gradient but the first is computed before the previous push lands
    w = run(10, **{"mode.prefetch": True})
    assert [e["staleness"] for e in w.lines] == [0] + [1] * 9
    # fetches every 3: updates since that read (this fake server counts the worker's own too; a shard
    # does not: test_n_fetch_counts_only_the_other_workers_updates_as_staleness)
    w = run(9, **{"mode.prefetch": True, "mode.n_fetch": 3})
    assert [e["staleness"] for e in w.lines] == [0, 1, 2, 3, 1, 2, 3, 1, 2]


# ---------------------------------------------------------------- n_fetch > 1: own pushes are not stale

def downpour_shard(workers: int, **sets):
    from psgd.shard import Shard
    cfg = Config().replace(**{"mode.name": "async", "cluster.workers": workers, "cluster.servers": 1,
                              "optimizer.momentum": 0.0, **sets})
    return Shard(cfg, 0), cfg


def shard_push(shard, rank: int, clock: int, g, read_version: int):
    m = wire.decode(wire.encode("push", id=1000 * rank + clock + 1, rank=rank, clock=clock,
                                read_version=read_version, arrays=[g, np.zeros(shard.B, np.float32)]))
    return wire.decode(shard.handle(("p", rank, clock), m)[0][1])


@pytest.mark.timeout(120)
def test_n_fetch_counts_only_the_other_workers_updates_as_staleness():
    """A review: with n_fetch > 1 a worker steps its own copy by each of its gradients
    between fetches, but the shard counted its own pushes since its fetch as staleness:
    one worker reported tau = 0, 1, 2, 3, 0, ... (mean 1.5 with n_fetch = 4) and
    lr_policy = "staleness" applied its pushes at lr, lr, lr / 2, lr / 3. Its own pushes
    are in the model it computes on: only the other workers' updates are stale."""
    shard, cfg = downpour_shard(2, **{"mode.n_fetch": 4, "mode.lr_policy": "staleness"})
    lr, g = cfg.optimizer.lr, np.ones(shard.P, np.float32)
    p0 = shard.params.detach().clone().numpy()
    assert [shard_push(shard, 0, c, g, read_version=0).get("staleness") for c in range(4)] == [0, 0, 0, 0]
    np.testing.assert_allclose(shard.params.detach().numpy(), p0 - 4 * lr * g, rtol=1e-5, atol=1e-6)
    # worker 1 read version 0 too: worker 0's 4 updates are stale for it ...
    assert shard_push(shard, 1, 0, g, read_version=0).get("staleness") == 4
    # ... and worker 1's one update, not its own 4, for worker 0 (still on its read of version 0)
    assert shard_push(shard, 0, 4, g, read_version=0).get("staleness") == 1
    assert shard.stats()["staleness_max"] == 4 and shard.stats()["staleness_sum"] == 5
    # without n_fetch the next read brings a worker's own push: one made before it is stale
    shard, _ = downpour_shard(1)
    assert [shard_push(shard, 0, c, g, read_version=0).get("staleness") for c in range(3)] == [0, 1, 2]


@pytest.mark.timeout(120)
def test_n_fetch_dc_asgd_compensates_only_for_the_other_workers_updates():
    """A review: DC-ASGD compensated a Downpour push with w_now - w_read, w_read the
    worker's fetch, but between fetches the worker computes on that read stepped by its
    own gradients: with one worker every push after the first was compensated for its own
    earlier updates. w_bak is now the read stepped as the worker steps its copy."""
    shard, cfg = downpour_shard(1, **{"mode.n_fetch": 3, "mode.dc_lambda": 2.0})
    lr = cfg.optimizer.lr
    rng = np.random.default_rng(0)
    copy = shard.params.detach().clone()
    shard.handle("read", wire.decode(wire.encode("pull", id=999, rank=0, clock=0)))
    for c in range(3):
        g = rng.standard_normal(shard.P).astype(np.float32)
        before = shard.params.detach().clone()
        torch.testing.assert_close(before, copy)            # one worker: its copy is the shard's model
        shard_push(shard, 0, c, g, read_version=0)
        # w_now - w_bak = 0: plain SGD at lr / W by the raw gradient, as the worker's own step
        torch.testing.assert_close(shard.params.detach(), before - lr * torch.from_numpy(g))
        copy -= lr * torch.from_numpy(g)


def test_dc_asgd_compensates_the_last_partial_push_as_its_gradients():
    """A review: with n_push = n, the push of what is still summed when the budget ends
    (k < n steps, `AsyncSchedule.finish`) was compensated as n gradients' sum,
    S + lambda / n S S (...), k / n as strongly as its k gradients each would be. It is
    now compensated as k times their mean's."""
    lam, n = 0.5, 4
    r = rule("async", 2, **{"mode.dc_lambda": lam, "mode.n_push": n})
    r.tables.params, r.tables.buffers = torch.zeros(3), torch.zeros(0)
    g = torch.tensor([0.5, 0.25, -1.0])

    def compensated(clock: int, steps: int) -> torch.Tensor:
        r.read(Read(("pull", 0), 0, clock))                 # w_read = the parameters now
        r.tables.params, r.tables.version = r.tables.params + torch.tensor([1.0, -2.0, 0.5]), r.tables.version + 2
        out = r.push(Push(("push", 0), 0, clock, 2, steps * g, torch.zeros(0)))
        (apply,) = [d for d in out if isinstance(d, Apply)]
        return apply.grad

    per_gradient = g + lam * g * g * torch.tensor([1.0, -2.0, 0.5])
    torch.testing.assert_close(compensated(n - 1, n), n * per_gradient)          # steps 0..3
    torch.testing.assert_close(compensated(2 * n - 1, n), n * per_gradient)      # steps 4..7
    torch.testing.assert_close(compensated(2 * n + 1, 2), 2 * per_gradient)      # steps 8, 9: the last
    r = rule("async", 2, **{"mode.dc_lambda": lam, "mode.n_push": n})           # a budget under n steps
    r.tables.params, r.tables.buffers = torch.zeros(3), torch.zeros(0)
    torch.testing.assert_close(compensated(2, 3), 3 * per_gradient)


# ---------------------------------------------------------------- a refused push


def trained_refusing(steps: int, refuse: set[int], real: bool = False, **sets) -> tuple[FakeTrainer, int]:
    """One worker's schedule (async unless `mode.name` is set) trained `steps` steps, the
    pushes of the clocks in `refuse` refused once each: the trainer and its refusals."""
    cfg = Config().replace(**{"mode.name": "async", "cluster.workers": 1, "cluster.servers": 1,
                              "optimizer.momentum": 0.0, "train.steps": steps, **sets})
    w = FakeTrainer(cfg, real=real)
    w.client.refuse = set(refuse)
    schedule = get_mode(cfg.mode.name).schedule(cfg)
    schedule.start(w)
    refused = 0
    while w.clock < steps:
        try:
            schedule.step(w)
        except wire.Refused:
            refused += 1
    schedule.finish(w)
    return w, refused


@pytest.mark.parametrize("mode, sets", [
    ("async", {}),
    ("async", {"mode.prefetch": True}),
    ("async", {"mode.n_fetch": 2}),
    ("async", {"mode.n_fetch": 2, "mode.prefetch": True}),
    ("ssp", {"mode.cache": True}),
    ("ssp", {"mode.prefetch": True}),
])
def test_a_refused_push_goes_again_at_its_clock_with_the_next_gradient(mode, sets):
    """A review: a step the shards refuse is tried again with the next batch at the same
    clock (the plain step's clock moves on only when the shards answer). Where the clock had
    moved on before the answer came (prefetch, Downpour's n_fetch, ssp's cache), the
    refused clock was skipped: a shard that had applied it (a refusal by another shard)
    kept the only update of that clock, and the step had no line."""
    steps = 8
    w, refused = trained_refusing(steps, {3}, **{"mode.name": mode, **sets})
    assert refused == 1
    assert [c for c, _ in pushes(w)] == list(range(steps))
    assert len(w.lines) == steps and w.hist.total == steps


@pytest.mark.parametrize("prefetch, lost", [(False, []), (True, [4])])
def test_a_refused_downpour_sum_goes_again_with_the_next_gradient_at_its_clock(prefetch, lost):
    """A review: a refused push of n_push = 3 moved the clock back to its last step, and the
    sum it carried (the window's three gradients) was dropped: two of them never reached a
    shard. It goes again with the next step's gradient; with prefetch the gradient of the
    step that the refusal interrupted is lost, as a single step's is."""
    steps = 9
    w, _ = trained_refusing(steps, {2}, **{"mode.n_push": 3, "mode.prefetch": prefetch})
    assert [c for c, _ in pushes(w)] == [2, 5, 8]
    computed = w.calls
    torch.testing.assert_close(w.client.pushed_sum, w.direction * (sum(range(1, computed + 1)) - sum(lost)))
    assert len(w.lines) == steps and w.hist.total == 3


def test_a_refused_compressed_downpour_sum_is_not_accrued_again():
    """A later review: with wire.compression the residual took the sum in as it was
    encoded; accrued again, the refused sum would go twice (what a refused compressed push
    carried is lost, as README says)."""
    w, _ = trained_refusing(9, {2}, **{"mode.n_push": 3, "wire.compression": "topk"})
    assert [c for c, _ in pushes(w)] == [4, 7, 8]
    torch.testing.assert_close(w.client.pushed_sum, w.direction * sum(range(4, w.calls + 1)))


def test_a_refused_push_with_n_fetch_fetches_before_the_next_compute():
    """A mutation test: n_fetch 3, the worker steps its own copy between fetches; a push
    the shards refused (clock 3) was never applied, so the copy stepped by it is fetched
    again at once (unpinned: without the forced fetch, every test passed)."""
    w, _ = trained_refusing(8, {3}, real=True, **{"mode.n_fetch": 3})
    assert [(e[0], e[1]) for e in w.client.log] == [
        ("pull", 0), ("push", 0), ("push", 1), ("push", 2), ("pull", 3), ("push", 3), ("pull", 4), ("push", 4),
        ("push", 5), ("push", 6), ("pull", 7), ("push", 7)]
