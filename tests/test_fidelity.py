"""easgd, diloco and ltfb against their papers, each written here as a few-line reference
independent of psgd's code, and driven through psgd's real schedules and shards (wire
messages, no sockets; a threaded loopback where a round waits for another worker):

- EASGD (Zhang, Choromanska, LeCun 2015), Algorithm 1, at worker i's step t:
      x = x_i;  if tau | t:  x_i <- x_i - alpha (x - c);  c <- c + alpha (x - c)
      x_i <- x_i - eta g_i(x)
  and the synchronous rounds (their eq. 5-6): c <- c + alpha sum_i (x_i - c), all from the
  round's old c. alpha = beta / p with beta = 0.9 by default.
- DiLoCo (Douillard et al. 2023), Algorithm 1: H inner steps from theta (AdamW in the
  paper), Delta = mean_i (theta - theta_i), outer Nesterov SGD on Delta.
- LTFB (Jacobs et al. 2017; LBANN's RandomPairwiseExchange): each trainer scores its own
  and its partner's model on its own tournament set, the partner's replaces it only if
  strictly better (the local model wins ties), with its optimizer state.
"""
from __future__ import annotations

import itertools
import threading

import pytest
import torch

from psgd import wire
from psgd.config import Config
from psgd.consistency.diloco import DilocoSchedule
from psgd.consistency.easgd import EasgdSchedule
from psgd.consistency.elastic import default_alpha
from psgd.consistency.ltfb import LtfbSchedule
from psgd.shard import Shard
from tests.loopback import FakeTrainer, Loopback, TournamentOps, flat

pytestmark = pytest.mark.unit
ETA = 0.1
_ids = itertools.count(1)


def grad_of(rank: int):
    """Worker `rank`'s known gradient (its own data): elementwise and nonlinear."""
    return lambda x: 0.5 * x + 0.3 * torch.tanh(3 * x) - 0.1 * (rank + 1)


def centre(shards) -> torch.Tensor:
    return flat([s.params for s in shards])


class Hub:
    """Shards shared by worker threads: one request at a time, replies by token, so a
    request that a shard parks is answered by another worker's later request."""

    def __init__(self, shards):
        self.shards, self.cond, self.replies = shards, threading.Condition(), {}


class Threaded(Loopback):
    def __init__(self, hub: Hub, rank: int):
        super().__init__(hub.shards, rank)
        self.hub = hub

    def request(self, reqs, cancel=None):
        hub, tokens = self.hub, []
        with hub.cond:
            for i, op, fields in reqs:
                token = (self.rank, next(_ids))
                req = wire.decode([bytes(f) for f in wire.encode(op, id=next(_ids), rank=self.rank, **fields)])
                for t, frames in self.shards[i].handle(token, req):
                    hub.replies[t] = frames
                tokens.append((i, token))
            hub.cond.notify_all()
            out = []
            for i, token in tokens:
                while token not in hub.replies:
                    assert hub.cond.wait(timeout=30), f"rank {self.rank}: shard {i} never answered"
                out.append(wire.raise_if_error(wire.decode([bytes(f) for f in hub.replies.pop(token)]),
                                               f"shard {i}"))
            return out


def run_threads(fns):
    errors = []

    def guard(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=guard, args=(fn,)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def easgd_cfg(**sets) -> Config:
    return Config().replace(**{"mode.name": "easgd", "cluster.servers": 2, "optimizer.lr": ETA,
                               "optimizer.momentum": 0.0, **sets})


# ---------------------------------------------------------------- EASGD
@pytest.mark.timeout(60)
@pytest.mark.parametrize("tau", [1, 2, 3])
def test_easgd_async_two_interleaved_workers_and_a_late_joiner_follow_algorithm_1(tau):
    """Worker 0 takes 5 steps alone; worker 1 joins then (x_1 = the centre it loads, as
    Algorithm 1 initialises x^i = c), and they alternate unevenly. Each exchange is with
    the centre as the other worker's exchanges left it."""
    alpha = 0.3
    cfg = easgd_cfg(**{"cluster.workers": 2, "mode.tau": tau, "mode.alpha": alpha, "train.steps": 40})
    shards = [Shard(cfg, i) for i in range(cfg.cluster.servers)]
    ws = [FakeTrainer(cfg, Loopback(shards, r), grad_of(r), rank=r) for r in range(2)]
    ss = [EasgdSchedule(cfg) for _ in range(2)]
    c = centre(shards)
    xs, ts = {}, {0: 0, 1: 0}

    def ref_step(r):
        nonlocal c
        x = xs[r]
        if ts[r] % tau == 0:
            xs[r] = xs[r] - alpha * (x - c)
            c = c + alpha * (x - c)
        xs[r] = xs[r] - ETA * grad_of(r)(x)
        ts[r] += 1

    ss[0].start(ws[0])
    xs[0] = c.clone()
    order = [0] * 5 + ["join1"] + [1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 1]
    for who in order:
        if who == "join1":
            ss[1].start(ws[1])
            xs[1] = c.clone()
            continue
        ss[who].step(ws[who])
        ref_step(who)
        for r in xs:
            torch.testing.assert_close(flat(ws[r].replica.params()), xs[r], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(centre(shards), c, rtol=1e-5, atol=1e-6)


def two_in_threads(cfg, schedule, steps: int):
    """Workers 0 and 1 of `schedule` on fresh shards, each in a thread (a round waits for
    both): `steps` steps, then the end of the budget. (The shards, the workers, and the
    centre the shards started with.)"""
    shards = [Shard(cfg, i) for i in range(cfg.cluster.servers)]
    hub = Hub(shards)
    ws = [FakeTrainer(cfg, Threaded(hub, r), grad_of(r), rank=r) for r in range(2)]
    start = centre(shards)

    def worker(r):
        s = schedule(cfg)
        s.start(ws[r])
        for _ in range(steps):
            s.step(ws[r])
        s.finish(ws[r])
    run_threads([lambda r=r: worker(r) for r in range(2)])
    return shards, ws, start

@pytest.mark.timeout(60)
@pytest.mark.parametrize("tau", [1, 3])
def test_easgd_sync_rounds_of_two_workers_follow_the_synchronous_equations(tau):
    """Two workers in threads (a round waits for both): every tau steps
    c <- c + alpha sum_i (x_i - c) and x_i <- x_i - alpha (x_i - c), both from the old c
    and the x_i before the step's gradient; the budget's end makes one more round."""
    steps = 7
    cfg = easgd_cfg(**{"cluster.workers": 2, "mode.tau": tau, "mode.sync": True, "train.steps": steps})
    alpha = default_alpha(0.0, 2)
    assert alpha == pytest.approx(0.45)      # beta = p alpha = 0.9, the paper's
    shards, ws, c = two_in_threads(cfg, EasgdSchedule, steps)

    xs = [c.clone(), c.clone()]
    for t in range(steps + 1):
        if t % tau == 0 or t == steps:
            old = c
            c = c + sum(alpha * (x - old) for x in xs)
            xs_el = [x - alpha * (x - old) for x in xs]
        else:
            xs_el = xs
        if t < steps:
            xs = [xe - ETA * grad_of(r)(x) for r, (x, xe) in enumerate(zip(xs, xs_el, strict=True))]
        else:
            xs = xs_el
    for r in range(2):
        torch.testing.assert_close(flat(ws[r].replica.params()), xs[r], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(centre(shards), c, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_easgd_async_a_shard_restored_from_a_checkpoint_continues_from_its_centre():
    """A shard killed and restored from its checkpoint: the centre is the checkpoint's,
    the worker keeps its x_i, and Algorithm 1 continues from there (every later offer
    moves the restored centre)."""
    alpha, tau = 0.3, 2
    cfg = easgd_cfg(**{"cluster.workers": 1, "cluster.servers": 1, "mode.tau": tau, "mode.alpha": alpha,
                       "train.steps": 20})
    shard = Shard(cfg, 0)
    w = FakeTrainer(cfg, Loopback([shard], 0), grad_of(0))
    s = EasgdSchedule(cfg)
    s.start(w)
    x, c = flat(w.replica.params()), centre([shard])
    saved = None
    for t in range(10):
        if t == 4:
            saved = (shard.state_dict(), c.clone())
        if t == 7:
            shard.load_state_dict(saved[0])
            c = saved[1]
        s.step(w)
        g = grad_of(0)(x)
        if t % tau == 0:
            x, c = x - alpha * (x - c), c + alpha * (x - c)
        x = x - ETA * g
        torch.testing.assert_close(flat(w.replica.params()), x, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(centre([shard]), c, rtol=1e-5, atol=1e-6, msg=f"step {t}")


# ---------------------------------------------------------------- DiLoCo
def adamw_ref(x, g, m, v, t, lr, wd, b1=0.9, b2=0.999, eps=1e-8):
    """AdamW (Loshchilov & Hutter) as the paper's inner optimizer, written out."""
    x = x * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    mh, vh = m / (1 - b1 ** t), v / (1 - b2 ** t)
    return x - lr * mh / (vh.sqrt() + eps), m, v


def nesterov_ref(theta, mom, delta, lr, mu):
    """Outer Nesterov SGD on the outer gradient (PyTorch's, as DiLoCo's implementations use)."""
    mom = mu * mom + delta
    return theta - lr * (delta + mu * mom), mom


@pytest.mark.timeout(60)
@pytest.mark.parametrize("h", [1, 3])
def test_diloco_two_workers_with_inner_adamw_follow_algorithm_1(h):
    """The paper's setting: inner AdamW (its state and step count kept across rounds, per
    worker), outer Nesterov with the paper's eta = 0.7, mu = 0.9; H = 1 included. 7 steps:
    with H = 3 the last round is 1 step, pushed when the budget ends."""
    steps, lr, wd, eta, mu = 7, 0.01, 0.1, 0.7, 0.9
    cfg = Config().replace(**{"mode.name": "diloco", "cluster.workers": 2, "cluster.servers": 2,
                              "mode.local_steps": h, "mode.outer_lr": eta, "mode.outer_momentum": mu,
                              "optimizer.name": "adamw", "optimizer.lr": lr, "optimizer.weight_decay": wd,
                              "train.steps": steps})
    shards, ws, theta = two_in_threads(cfg, DilocoSchedule, steps)

    z = torch.zeros_like(theta)
    mom, xs, ms, vs, t = z.clone(), [theta.clone(), theta.clone()], [z.clone(), z.clone()], [z.clone(), z.clone()], 0
    while t < steps:
        n = min(h, steps - t)
        for _ in range(n):
            t += 1
            for r in range(2):
                xs[r], ms[r], vs[r] = adamw_ref(xs[r], grad_of(r)(xs[r]), ms[r], vs[r], t, lr, wd)
        delta = sum(theta - x for x in xs) / 2
        theta, mom = nesterov_ref(theta, mom, delta, eta, mu)
        xs = [theta.clone(), theta.clone()]
    torch.testing.assert_close(centre(shards), theta, rtol=1e-4, atol=1e-6)
    for r in range(2):
        torch.testing.assert_close(flat(ws[r].replica.params()), theta, rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(60)
def test_diloco_a_worker_joining_late_starts_from_the_global_model_of_the_open_round():
    """Worker 1 joins after worker 0's first two rounds (alone, 1 live worker): it starts
    from theta of the open round, at that round's step, with a fresh inner optimizer, and
    the round's Delta is the mean of both."""
    h, lr, eta, mu = 2, 0.05, 0.7, 0.9
    cfg = Config().replace(**{"mode.name": "diloco", "cluster.workers": 2, "cluster.servers": 1,
                              "mode.local_steps": h, "mode.outer_lr": eta, "mode.outer_momentum": mu,
                              "optimizer.lr": lr, "optimizer.momentum": 0.0, "train.steps": 8})
    shards = [Shard(cfg, 0)]
    shards[0].set_live({0: 0})
    hub = Hub(shards)
    ws = [FakeTrainer(cfg, Threaded(hub, r), grad_of(r), rank=r) for r in range(2)]
    s0 = DilocoSchedule(cfg)
    s0.start(ws[0])
    theta = centre(shards)
    mom = torch.zeros_like(theta)
    for _ in range(2 * h):
        s0.step(ws[0])
    for _rnd in range(2):
        x0 = theta.clone()
        for _ in range(h):
            x0 = x0 - lr * grad_of(0)(x0)
        theta, mom = nesterov_ref(theta, mom, theta - x0, eta, mu)
    torch.testing.assert_close(centre(shards), theta, rtol=1e-5, atol=1e-6)
    shards[0].set_live({0: 2 * h, 1: 0})
    s1 = DilocoSchedule(cfg)
    s1.start(ws[1])
    assert ws[1].clock == 2 * h
    torch.testing.assert_close(flat(ws[1].replica.params()), theta)

    def run(s, w):
        for _ in range(h):
            s.step(w)
    run_threads([lambda: run(s0, ws[0]), lambda: run(s1, ws[1])])
    xs = [theta.clone(), theta.clone()]
    for _ in range(h):
        xs = [x - lr * grad_of(r)(x) for r, x in enumerate(xs)]
    theta, mom = nesterov_ref(theta, mom, sum(theta - x for x in xs) / 2, eta, mu)
    torch.testing.assert_close(centre(shards), theta, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- LTFB
class TourThreaded(TournamentOps, Threaded):
    @staticmethod
    def _wire(kind, shard, t):
        return t


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tie", [False, True])
def test_ltfb_a_pairwise_round_the_better_model_replaces_the_worse_with_its_momentum(tie):
    """Two one-worker trainers, a round of 3 SGD-momentum steps each, then a pairwise
    tournament played by both at once. Scored on its own tournament set (here a score
    that prefers trainer 1's weights on both sides), trainer 0 takes trainer 1's weights
    and momentum and trainer 1 keeps its own; on a tie both keep their own. Between
    rounds, nothing passes between the trainers."""
    R, lr, mu = 3, 0.05, 0.9
    cfg = Config().replace(**{"mode.name": "ltfb", "cluster.workers": 2, "cluster.servers": 2,
                              "mode.round_steps": R, "train.steps": 2 * R, "optimizer.lr": lr,
                              "optimizer.momentum": mu})
    shards = [Shard(cfg, i) for i in range(cfg.cluster.servers)]
    hub = Hub(shards)
    ws, ss = [], []
    for r in range(2):
        w = FakeTrainer(cfg, TourThreaded(hub, r), grad_of(r), rank=r)
        w.holdout = (torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
        w.live = lambda: {0, 1}
        w.events = []
        w.event = lambda w=w, **f: w.events.append(f)
        ws.append(w)
        ss.append(LtfbSchedule(cfg))
    theta = flat(ws[0].replica.params())
    xs, bs = [theta.clone(), theta.clone()], [torch.zeros_like(theta), torch.zeros_like(theta)]
    for _ in range(R):   # the reference's local round (torch SGD: b <- mu b + g; x <- x - lr b)
        for r in range(2):
            bs[r] = mu * bs[r] + grad_of(r)(xs[r])
            xs[r] = xs[r] - lr * bs[r]
    best = xs[1]

    for w in ws:   # the score: 1 for trainer 1's model (0.5 for any on a tie), 0 otherwise
        w.replica.score = lambda *a, w=w, **k: (
            0.5 if tie else float(torch.allclose(flat(w.replica.params()), best, atol=1e-6)), 0.0)

    def trainer(r):
        ss[r].start(ws[r])
        for _ in range(R):
            ss[r].step(ws[r])
    run_threads([lambda r=r: trainer(r) for r in range(2)])

    winner = [0, 1] if tie else [1, 1]
    for r in range(2):
        (line,) = ws[r].events
        assert line["partner"] == 1 - r and line["adopted"] is (winner[r] != r)
        torch.testing.assert_close(flat(ws[r].replica.params()), xs[winner[r]], rtol=1e-5, atol=1e-6)
        state = {n: ss[r].opt.state[p]["momentum_buffer"] for n, p in ws[r].replica.model.named_parameters()}
        buf = flat([ws[r].replica.map.gather(state, i, "params") for i in range(ws[r].replica.n)])  # the layout
        torch.testing.assert_close(buf, bs[winner[r]], rtol=1e-5, atol=1e-6)
