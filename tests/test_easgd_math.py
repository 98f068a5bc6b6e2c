"""easgd is EASGD as Zhang, Choromanska & LeCun (2015) write it: one worker with a known
gradient, driven through the real schedule and shards (wire messages, no sockets),
follows the equations of Algorithm 1 step by step,
    at tau | t:  d = alpha (x - c);  c <- c + d;  x <- x - d - eta g(x)
    otherwise:   x <- x - eta g(x)
with g and d evaluated at the same x (the one before the step). With a Nesterov local
optimizer (EAMSGD) the local update is torch's: b <- mu b + g(x); x <- x - d - eta (g + mu b).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from psgd import wire
from psgd.config import Config, ConfigError, load
from psgd.consistency.easgd import EasgdSchedule
from psgd.shard import Shard
from tests.loopback import FakeTrainer, Loopback, flat

pytestmark = pytest.mark.unit

ETA, ALPHA, TAU, STEPS = 0.1, 0.3, 3, 12


def grad(x: torch.Tensor) -> torch.Tensor:
    """A known, nonlinear gradient (elementwise, so the same on any layout)."""
    return 0.5 * x + 0.3 * torch.tanh(3 * x) - 0.1


def centre(shards) -> torch.Tensor:
    return flat([s.params for s in shards])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("steps", [STEPS, STEPS - 1, TAU - 1])
@pytest.mark.parametrize("sync", [False, True])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_one_worker_follows_the_centre_trajectory_of_the_equations(sync, momentum, steps):
    """Also when the budget is not a multiple of tau (a review: the centre never got the
    last steps % tau local steps; with tau > train.steps, the global model stayed the
    initial one): the budget's end offers the replica once more."""
    cfg = Config().replace(**{"mode.name": "easgd", "cluster.workers": 1, "cluster.servers": 2,
                              "mode.tau": TAU, "mode.alpha": ALPHA, "mode.sync": sync, "train.steps": steps,
                              "optimizer.lr": ETA, "optimizer.momentum": momentum,
                              "optimizer.nesterov": momentum > 0})
    shards = [Shard(cfg, i) for i in range(cfg.cluster.servers)]
    w = FakeTrainer(cfg, Loopback(shards, 0), grad)
    schedule = EasgdSchedule(cfg)
    schedule.start(w)
    x, c = flat(w.replica.params()), centre(shards)
    torch.testing.assert_close(x, c)
    buf = torch.zeros_like(x)
    for t in range(steps):
        schedule.step(w)
        g = grad(x)
        if t % TAU == 0:
            d = ALPHA * (x - c)
            c = c + d
            x = x - d
        buf = momentum * buf + g
        x = x - ETA * (g + momentum * buf if momentum else g)
        torch.testing.assert_close(flat(w.replica.params()), x, rtol=1e-5, atol=1e-6, msg=f"x after step {t}")
        torch.testing.assert_close(centre(shards), c, rtol=1e-5, atol=1e-6, msg=f"centre after step {t}")
        assert w.clock == t + 1
    schedule.finish(w)   # the exchange of round ceil(steps / tau), without an update
    d = ALPHA * (x - c)
    torch.testing.assert_close(centre(shards), c + d, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flat(w.replica.params()), x - d, rtol=1e-5, atol=1e-6)
    assert shards[0].version == -(-steps // TAU) + 1   # one centre move per exchange: t = 0, 3, 6, 9 and the end
    assert (centre(shards) - flat([s.params for s in [Shard(cfg, i) for i in range(2)]])).abs().max() > 1e-3


@pytest.mark.timeout(60)
def test_the_exchange_uses_the_x_before_the_step_not_after():
    """One exchange at t = 0 from a centre that differs from x: the centre moves by
    alpha (x0 - c0), not by alpha (x0 - eta g(x0) - c0) (the order before the fix)."""
    cfg = Config().replace(**{"mode.name": "easgd", "cluster.workers": 1, "cluster.servers": 1,
                              "mode.tau": 2, "mode.alpha": ALPHA, "optimizer.lr": ETA,
                              "optimizer.momentum": 0.0})
    shard = Shard(cfg, 0)
    w = FakeTrainer(cfg, Loopback([shard], 0), grad)
    schedule = EasgdSchedule(cfg)
    schedule.start(w)
    with torch.no_grad():
        shard.params.mul_(0.5)   # the centre elsewhere than the replica
    x0, c0 = flat(w.replica.params()), centre([shard])
    schedule.step(w)
    moved = centre([shard]) - c0
    torch.testing.assert_close(moved, ALPHA * (x0 - c0), rtol=1e-5, atol=1e-6)
    after = ALPHA * (x0 - ETA * grad(x0) - c0)
    assert (moved - after).abs().max() > 1e-3
    torch.testing.assert_close(flat(w.replica.params()), x0 - ALPHA * (x0 - c0) - ETA * grad(x0), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.timeout(60)
def test_async_a_workers_staleness_counts_the_centres_moves_by_others_between_its_exchanges():
    """An exchange's staleness is the number of times other workers moved the centre
    since this worker's previous exchange: 0 for its first, and 2 after another worker
    exchanged twice in between (not counting its own move)."""
    cfg = Config().replace(**{"mode.name": "easgd", "mode.sync": False, "mode.tau": 1, "mode.alpha": ALPHA,
                              "cluster.workers": 2, "cluster.servers": 1, "optimizer.lr": ETA,
                              "optimizer.momentum": 0.0})
    shards = [Shard(cfg, 0)]
    workers = [FakeTrainer(cfg, Loopback(shards, r), grad, rank=r) for r in range(2)]
    schedules = [EasgdSchedule(cfg) for _ in range(2)]
    for s, w in zip(schedules, workers, strict=True):
        s.start(w)
    schedules[0].step(workers[0])
    schedules[0].step(workers[0])              # only its own moves since its last exchange
    for _ in range(2):
        schedules[1].step(workers[1])
    schedules[0].step(workers[0])
    assert [staleness for _, staleness, _ in workers[0].logged] == [0, 0, 2]
    assert [staleness for _, staleness, _ in workers[1].logged] == [2, 0]   # worker 0's two, then none


@pytest.mark.timeout(60)
def test_async_staleness_after_a_rejoin_counts_from_the_centre_it_loaded():
    """A worker dropped and rejoined loads the centre (its replica is replaced): its next
    exchange's staleness counts the moves since that load, not since its exchange before
    the drop (before the fix: 3, the other worker's moves that the loaded centre held)."""
    cfg = Config().replace(**{"mode.name": "easgd", "mode.sync": False, "mode.tau": 1, "mode.alpha": ALPHA,
                              "cluster.workers": 2, "cluster.servers": 2, "optimizer.lr": ETA,
                              "optimizer.momentum": 0.0})
    shards = [Shard(cfg, i) for i in range(2)]
    workers = [FakeTrainer(cfg, Loopback(shards, r), grad, rank=r) for r in range(2)]
    schedules = [EasgdSchedule(cfg) for _ in range(2)]
    for s, w in zip(schedules, workers, strict=True):
        s.start(w)
    schedules[0].step(workers[0])
    for _ in range(3):
        schedules[1].step(workers[1])
    schedules[0].rejoin(workers[0])
    torch.testing.assert_close(flat(workers[0].replica.params()), centre(shards))   # it holds the 3 moves
    schedules[0].step(workers[0])
    schedules[1].step(workers[1])
    schedules[0].step(workers[0])
    assert [staleness for _, staleness, _ in workers[0].logged] == [0, 0, 1]


def _offer(shard: Shard, rank: int, round_: int, x: torch.Tensor):
    return wire.decode(wire.encode("elastic", id=9 + rank, rank=rank, clock=round_, round=round_,
                                   arrays=[x.numpy(), np.zeros(shard.B, np.float32)]))


def test_async_a_resent_offer_is_answered_without_moving_the_centre_again():
    """The client resends an offer whose answer did not come within retry_s: the centre
    moved once, by alpha (x - c0); the resend gets alpha (x - c1) and the field
    `duplicate`, and the next round moves it again."""
    cfg = Config().replace(**{"mode.name": "easgd", "cluster.workers": 2, "cluster.servers": 1, "mode.alpha": ALPHA})
    shard = Shard(cfg, 0)
    c0 = shard.params.detach().clone()
    x = c0 + 1.0
    [(_, first)] = shard.handle("first", _offer(shard, 0, 0, x))
    c1 = shard.params.detach().clone()
    torch.testing.assert_close(c1, c0 + ALPHA * (x - c0))
    [(token, again)] = shard.handle("resend", _offer(shard, 0, 0, x))
    m = wire.decode(again)
    assert token == "resend" and m.op == "reply" and m.get("duplicate") is True
    torch.testing.assert_close(torch.from_numpy(m.arrays[0].copy()), ALPHA * (x - c1))
    assert shard.version == 1 and torch.equal(shard.params.detach(), c1)
    shard.handle("next", _offer(shard, 0, 1, x))
    assert shard.version == 2
    assert shard.rule.state_dict()["offered"] == {0: 1}


def test_sync_a_resent_offer_of_the_open_round_is_answered_when_the_round_closes():
    """Sync rounds: worker 0 resends its offer while the round waits for worker 1 (it
    waited longer than retry_s). The resend is not refused: the round's close answers
    it, and the centre moves by the round's two offers, each once."""
    cfg = Config().replace(**{"mode.name": "easgd", "mode.sync": True, "cluster.workers": 2, "cluster.servers": 1,
                              "mode.alpha": ALPHA})
    shard = Shard(cfg, 0)
    c0 = shard.params.detach().clone()
    x0, x1 = c0 + 1.0, c0 - 2.0
    assert shard.handle("first", _offer(shard, 0, 0, x0)) == []
    assert shard.handle("resend", _offer(shard, 0, 0, x0)) == []
    replies = shard.handle("worker 1", _offer(shard, 1, 0, x1))
    assert sorted(t for t, _ in replies) == ["resend", "worker 1"]
    assert all(wire.decode(f).op == "reply" for _, f in replies)
    torch.testing.assert_close(shard.params.detach(), c0 + ALPHA * (x0 - c0) + ALPHA * (x1 - c0))
    late = wire.decode(shard.handle("resend again", _offer(shard, 0, 0, x0))[0][1])  # after the close
    # a resend, not a late offer: not counted dropped (before, it was)
    assert late.op == "reply" and late.get("duplicate") is True and late.get("dropped") is None
    assert shard.version == 1 and shard.rule.stats()["dropped"] == 0


@pytest.mark.timeout(60)
def test_sync_a_resent_offer_waiting_for_a_later_round_is_not_refused_as_superseded():
    """A review: a shard restored from an older checkpoint meets a worker whose offer is
    for a later round, and the offer waits (sync's `early`). The client resent it after
    retry_s while the other worker had not yet shown it was past the open round: the
    original was refused ('step 3 was superseded by 3'), so the worker's exchange raised
    Refused and counted a rejected step (max_rejections of them abort the job). The
    resend now waits in its place, as a resend of the open round's offer does."""
    cfg = Config().replace(**{"mode.name": "easgd", "mode.sync": True, "cluster.workers": 2, "cluster.servers": 1,
                              "mode.alpha": ALPHA, "mode.tau": 4, "train.steps": 40})
    shard = Shard(cfg, 0)
    old = shard.state_dict()                       # a checkpoint at round 0
    c = shard.params.detach().clone()
    for rnd in range(3):                           # rounds 0..2 close on the shard's first life
        shard.handle(("a", rnd), _offer(shard, 0, rnd, c + 1.0))
        shard.handle(("b", rnd), _offer(shard, 1, rnd, c - 1.0))
    restored = Shard(cfg, 0)
    restored.load_state_dict(old)
    assert restored.handle("first", _offer(restored, 0, 3, c + 1.0)) == []   # waits: worker 1 may offer round 0
    assert restored.handle("resend", _offer(restored, 0, 3, c + 1.0)) == []  # the client's resend, same id
    replies = restored.handle("worker 1", _offer(restored, 1, 3, c - 1.0))   # rounds 0..2 skipped, 3 closes
    assert sorted(t for t, _ in replies) == ["resend", "worker 1"]
    assert all(wire.decode(f).op == "reply" for _, f in replies)
    assert restored.counters["bad_messages"] == 0 and restored.version == 1


@pytest.mark.timeout(60)
def test_sync_an_alpha_the_config_accepts_shrinks_the_gap_between_the_workers_and_the_centre():
    """A review: a synchronous round moves every worker by -alpha (x_i - c) and the
    centre by alpha W (mean - c), so mean - c changes by 1 - alpha (W + 1) a round. The
    config bounded alpha W < 2 only: W = 2, alpha = 0.9 was accepted, and with no
    gradient the exchange alone made the gap grow x1.7 a round. alpha (W + 1) < 2 is
    now the bound; the largest alpha it accepts, and the default 0.9 / W, shrink it."""
    sets = ["mode.name=easgd", "mode.sync=true", "cluster.workers=2", "cluster.servers=1"]
    with pytest.raises(ConfigError, match=r"mode.alpha < 0.667"):
        load(None, [*sets, "mode.alpha=0.9"], env={})
    for alpha, factor in ((0.66, 0.98), (0, 0.35)):   # |1 - alpha (W + 1)|, the default alpha = 0.45
        shard = Shard(load(None, [*sets, f"mode.alpha={alpha}"], env={}), 0)
        c0 = shard.params.detach().clone()
        xs = [c0 + 0.01, c0 + 0.03]                # two replicas near the centre, no gradient
        gaps = []
        for rnd in range(4):
            replies = [r for rank in (0, 1) for r in shard.handle(rank, _offer(shard, rank, rnd, xs[rank]))]
            ds = {t: torch.from_numpy(wire.decode(f).arrays[0].copy()) for t, f in replies}
            xs = [xs[r] - ds[r] for r in (0, 1)]
            gaps.append(float((torch.stack(xs).mean(0) - shard.params.detach()).abs().max()))
        np.testing.assert_allclose(np.array(gaps[1:]) / gaps[:-1], factor, rtol=1e-3)


@pytest.mark.timeout(60)
def test_an_async_worker_restarted_before_it_was_missed_resumes_after_its_rounds():
    """kill -9 of an async-EASGD worker, started again before the coordinator missed it:
    it resumed at the slowest other worker's clock, and its offers of rounds its earlier
    process had offered were answered as resends, moving it but never the centre. The
    join's answer says the rank's last round; the worker continues after it."""
    from psgd.membership import Membership
    tau = 2
    cfg = Config().replace(**{"mode.name": "easgd", "mode.sync": False, "mode.tau": tau, "mode.alpha": 0.3,
                              "cluster.workers": 2, "cluster.servers": 1, "optimizer.momentum": 0.0,
                              "train.steps": 100})
    shards = [Shard(cfg, 0)]
    shards[0].set_live({0: 0, 1: 0})
    members = Membership(2, 5.0)
    members.join(0.0, 0, "life-1")
    members.join(0.0, 1, "other")
    slow = FakeTrainer(cfg, Loopback(shards, 1), lambda x: 0.5 * x - 0.1, rank=1)
    EasgdSchedule(cfg).start(slow)
    slow.clock = 2
    fast = FakeTrainer(cfg, Loopback(shards, 0), lambda x: 0.5 * x - 0.1, rank=0)
    s = EasgdSchedule(cfg)
    s.start(fast)
    for _ in range(8):   # rounds 0..3
        s.step(fast)
    members.beat(0, 1.0, clock=fast.clock)
    members.beat(1, 1.0, clock=slow.clock)
    members.join(2.0, 0, "life-2")                     # the new process takes rank 0 back
    again = FakeTrainer(cfg, Loopback(shards, 0), lambda x: 0.5 * x - 0.1, rank=0)
    again.clock = members.members[0].clock             # the coordinator's start_clock: 2
    s = EasgdSchedule(cfg)
    s.start(again)
    assert again.clock == 8                            # after round 3, its earlier process's last
    s.step(again)                                      # round 4's exchange (x is the centre it loaded: d = 0)
    s.step(again)
    centre = flat([sh.params for sh in shards]).clone()
    s.step(again)                                      # round 5's, after two local steps: the centre moves
    assert float((flat([sh.params for sh in shards]) - centre).abs().max()) > 0
    assert shards[0].rule.offered[0] == 5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,sync,fields", [("easgd", False, {"offered": 2}), ("easgd", True, {"step": 3}),
                                              ("diloco", False, {"step": 3})])
def test_a_worker_joining_near_the_end_catches_up_to_no_clock_past_the_last_step(monkeypatch, mode, sync, fields):
    """tau = H = 4, 10 steps: a worker joining after round 2 caught up to clock 12, which
    the coordinator refuses (past train.steps), so its heartbeats and its finish were
    refused. It stops at the job's last step."""
    import types

    import psgd.consistency.diloco as diloco
    import psgd.consistency.easgd as easgd
    from psgd.consistency.diloco import DilocoSchedule
    from tests.conftest import ask, closed_after, hand_served
    cfg = Config().replace(**{"mode.name": mode, "mode.tau": 4, "mode.local_steps": 4, "mode.sync": sync,
                              "train.steps": 10, "cluster.workers": 2})
    for module in (easgd, diloco):
        monkeypatch.setattr(module, "load", lambda w, answers: [3])

    class Client:
        def join(self, clock):
            return [wire.Message("reply", 1, fields={"version": 3, **fields})]
    w = types.SimpleNamespace(clock=9, client=Client(), cfg=cfg, replica=types.SimpleNamespace(params=lambda: []))
    if mode == "easgd":
        EasgdSchedule(cfg).join(w)
    else:
        DilocoSchedule(cfg).begin_round(w, w.client.join(9))
    assert w.clock == 10
    with closed_after(hand_served(workers=2, **{"train.steps": 10})) as c:
        assert ask(c, "heartbeat", role="worker", rank=1, index=1, clock=w.clock).op == "reply"
        assert ask(c, "finish", rank=1, clock=w.clock).op == "reply"


@pytest.mark.timeout(60)
def test_async_the_clock_gap_is_the_lead_of_an_offer_over_the_slowest_workers_round():
    """A review: easgd's max_clock_gap was 0 whatever the workers did (psgd run --mode
    easgd --workers 3 --set faults.slow_rank=1 --set faults.slow_factor=4: 0, while the
    fast workers offered round 25 with the straggler at round 7), so psgd compare's
    table showed asynchronous easgd in lockstep. It counts rounds, as diloco's does; a
    (re)joining worker's clock, in steps, counts as its round."""
    cfg = Config().replace(**{"mode.name": "easgd", "cluster.workers": 2, "cluster.servers": 1, "mode.tau": 4})
    shard = Shard(cfg, 0)
    x = shard.params.detach().clone()
    shard.handle("slow", _offer(shard, 1, 0, x))
    for r in range(6):
        shard.handle(("fast", r), _offer(shard, 0, r, x))
    assert shard.stats()["max_clock_gap"] == 5
    shard.set_live({0: 20})
    shard.set_live({0: 20, 1: 16})          # worker 1 rejoins at step 16: round 4
    shard.handle("fast", _offer(shard, 0, 9, x))
    assert shard.stats()["max_clock_gap"] == 5   # 9 - 4
    shard.handle("fast", _offer(shard, 0, 10, x))
    assert shard.stats()["max_clock_gap"] == 6
