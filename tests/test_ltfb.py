"""LTFB as LBANN runs it, pinned exactly: adoption switches the weights (and with
weights+optimizer the optimizer's state) and a rejection restores them; truncation
takes the bottom k and gives them top-k models; exploration draws log-uniformly and
mutation multiplies by exactly 1 - m or 1 + m; a trainer group's step is the mean of
its workers' gradients, so its replicas stay identical; the config refuses a
trainer_size that does not divide the workers.
"""
from __future__ import annotations

import glob
import json
import math
import os
import threading
import time

import pytest
import torch

from psgd import wire
from psgd.config import Config, ConfigError, load
from psgd.consistency.ltfb import LtfbRule, LtfbSchedule, pack_meta, unpack_meta
from psgd.consistency.rule import FINAL_ROUND, Answer, AnswerModel, Deposit, Diverged, Fetch, Push, Read, Store
from psgd.consistency.tournament import (
    GroupSteps,
    Late,
    Scoreboard,
    adopt,
    draw_hyper,
    fitness,
    mutate,
    truncation,
)
from psgd.inprocess import InProcessCluster
from psgd.shard import Shard
from psgd.workers.client import Cancelled
from psgd.workers.worker import Worker
from tests.loopback import FakeTrainer, Loopback, TournamentOps, flat

unit, inprocess = pytest.mark.unit, pytest.mark.inprocess


# ---------------------------------------------------------------- pure rules
@unit
def test_truncation_bottom_k_take_a_top_k_model():
    scores = {0: 0.9, 1: 0.1, 2: 0.5, 3: 0.7, 4: 0.3, 5: 0.8}
    for rnd in range(30):
        assert truncation(7, rnd, scores, 1) == {1: 0}
        two = truncation(7, rnd, scores, 2)
        assert set(two) == {1, 4} and set(two.values()) <= {0, 5}
        assert two == truncation(7, rnd, dict(reversed(scores.items())), 2)   # same for every party
    # the winner is drawn per (seed, round, loser): both top trainers are drawn over the rounds
    assert {w for rnd in range(30) for w in truncation(7, rnd, scores, 2).values()} == {0, 5}
    assert truncation(0, 1, {0: 0.5, 1: 0.5, 2: 0.5, 3: 0.5}, 1) == {3: 0}   # ties: the lower trainer ranks higher
    assert set(truncation(0, 1, {0: 0.2, 1: 0.9, 2: 0.4}, 2)) == {0}           # 3 trainers, k 2: one loser
    assert truncation(0, 1, {0: 0.2}, 1) == {}
    assert truncation(0, 1, {0: -math.inf, 1: 0.0}, 1) == {0: 1}             # a diverged trainer loses


@unit
def test_fitness_higher_is_better_for_both_metrics():
    assert fitness("accuracy", 0.7, 2.0) == 0.7 and fitness("loss", 0.7, 2.0) == -2.0
    assert adopt(fitness("loss", 0, 0.9), fitness("loss", 0, 0.4))          # lower loss wins
    assert not adopt(fitness("loss", 0, 0.4), fitness("loss", 0, 0.9))
    assert fitness("loss", 0.7, math.nan) == -math.inf == fitness("accuracy", math.nan, 1.0)
    assert adopt(fitness("loss", 0, math.nan), fitness("loss", 0, 5.0))       # a diverged model is replaced


@unit
def test_explore_draws_log_uniformly_and_reproducibly():
    explore = {"optimizer.lr": [0.01, 0.5], "optimizer.momentum": [0.5, 0.99]}
    draws = [draw_hyper(explore, 3, t) for t in range(4000)]
    assert draws[5] == draw_hyper(explore, 3, 5) and draws[5] != draw_hyper(explore, 4, 5)
    for d in draws:
        assert 0.01 <= d["optimizer.lr"] <= 0.5 and 0.5 <= d["optimizer.momentum"] <= 0.99
    # log-uniform: half the draws below the geometric mean (uniform: 12% for lr)
    below = sum(d["optimizer.lr"] < math.sqrt(0.01 * 0.5) for d in draws) / len(draws)
    assert abs(below - 0.5) < 0.04, below
    logs = sorted(math.log(d["optimizer.lr"] / 0.01) / math.log(50) for d in draws)
    assert max(abs(v - (i + 0.5) / len(logs)) for i, v in enumerate(logs)) < 0.04   # Kolmogorov-Smirnov
    assert draw_hyper({"optimizer.lr": [0.1, 0.1]}, 0, 0) == {"optimizer.lr": 0.1}


@unit
def test_mutation_multiplies_by_exactly_one_minus_or_plus_m():
    explore = {"optimizer.lr": [1e-4, 10.0], "optimizer.momentum": [0.1, 0.99]}
    hyper = {"optimizer.lr": 0.3, "optimizer.momentum": 0.6}
    factors = set()
    for rnd in range(40):
        out = mutate(hyper, explore, 0.2, 1, rnd, 2)
        assert out == mutate(hyper, explore, 0.2, 1, rnd, 2)
        for key, v in out.items():
            assert v in (hyper[key] * 0.8, hyper[key] * 1.2), (key, v)
            factors.add(v / hyper[key] > 1)
    assert factors == {True, False}
    # kept within the exploration range
    assert all(mutate({"optimizer.momentum": 0.98}, explore, 0.2, 1, rnd, 0)["optimizer.momentum"] in (0.98 * 0.8, 0.99)
               for rnd in range(20))
    assert mutate(hyper, explore, 0.0, 1, 1, 2) == hyper


@unit
def test_meta_travels_bit_exactly():
    values = [1.0, 3.0, math.nan, 0.123456789012345678, 0.1 * 1.2, 1e-300]
    back = unpack_meta(pack_meta(values, 40), len(values))
    assert back[:2] == values[:2] and math.isnan(back[2]) and back[3:] == values[3:]
    with pytest.raises(ValueError, match="too few"):
        pack_meta(values, 5)


@unit
def test_group_steps_answer_every_worker_with_the_same_mean():
    g = GroupSteps(2, range(4))
    a, b, c = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0]), torch.tensor([9.0, 9.0])
    buf = torch.tensor([4.0])
    assert g.push(0, 0, a, buf) == (True, [])
    assert g.read(0, 1, "r0") is None                       # parked until rank 1 pushes
    assert g.push(2, 0, c, buf) == (True, [])                # trainer 1 is another group
    ok, ready = g.push(1, 0, b, 2 * buf)
    assert ok and [t for t, _ in ready] == ["r0"]
    mean = ready[0][1]
    assert torch.equal(mean.grad, torch.tensor([2.0, 4.0])) and torch.equal(mean.buffers, torch.tensor([6.0]))
    assert g.read(1, 1, "r1") is mean                        # the same arrays for both
    assert g.read(2, 1, "r2") is None and g.parked == 1      # trainer 1 still waits for rank 3
    assert not torch.equal(a, mean.grad)                     # the inputs were copied, not summed into
    # a resent read of a closed step is answered again; a late push is dropped, its read says where to go
    assert g.read(0, 1, "again") is mean
    assert g.push(0, 0, a, buf) == (False, []) and g.dropped == 1
    # rank 3 leaves: trainer 1's open step closes on rank 2 alone
    ready = g.set_live({0, 1, 2})
    assert [t for t, _ in ready] == ["r2"] and torch.equal(ready[0][1].grad, c) and ready[0][1].count == 1
    # a worker that fell behind (its group went on without it) is told the group's step
    g.push(0, 1, a, buf)
    g.push(1, 1, b, buf)
    assert g.read(0, 1, "old") == Late(2)
    # a push ahead of the group (the others lag) moves the group there, dropping the open step
    g.push(0, 2, a, buf)
    assert g.push(1, 5, b, buf) == (True, []) and g.dropped == 2
    assert g.read(0, 3, "x") == Late(5, dropped=True)   # rank 0's accepted push was left out
    assert g.read(1, 3, "y") == Late(5)                # rank 1 pushed no step 2: nothing of its left out
    # a worker that rejoined (the shard forgot its last clock) pushes the open step again:
    # dropped (its first gradient stays in the step) and counted, as its step line says
    assert g.push(1, 5, b, buf) == (False, []) and g.dropped == 3


@unit
def test_scoreboard_waits_for_every_live_trainer_and_freezes():
    s = Scoreboard(range(3))
    assert s.put(1, 0, 0.5) == []
    assert s.get(1, "t0") is None
    assert s.put(1, 2, 0.7) == []
    assert s.put(1, 1, 0.1) == [("t0", 1, {0: 0.5, 1: 0.1, 2: 0.7})]
    assert s.get(1, "t1") == {0: 0.5, 1: 0.1, 2: 0.7}
    s.put(2, 0, 0.9)
    assert s.get(2, "t2") is None
    assert s.set_live({0}) == [("t2", 2, {0: 0.9})]         # trainers 1 and 2 left
    s.put(2, 1, 0.3)                                         # a late one does not change a frozen board
    assert s.get(2, "t3") == {0: 0.9}


@unit
def test_a_final_model_leaves_the_rounds_boards_as_they_are():
    """A trainer whose `train.seconds` budget ends before a round deposits its final
    model (round FINAL): the round's board, waiting or frozen, keeps its scores (the
    final round counted as the newest and dropped every board)."""
    s = Scoreboard(range(4))
    for t, score in [(0, 0.9), (1, 0.5), (2, 0.1)]:
        assert s.put(1, t, score) == []
        assert s.get(1, ("ask", t)) is None                  # trainer 3 has not deposited round 1
    released = {tok: board for tok, _, board in s.put(FINAL_ROUND, 3, 0.7)}
    assert released == {("ask", t): {0: 0.9, 1: 0.5, 2: 0.1} for t in range(3)}
    assert truncation(0, 1, released[("ask", 2)], 1) == {2: 0}   # the worst takes the best's model
    assert s.get(1, "again") == {0: 0.9, 1: 0.5, 2: 0.1}         # frozen, the same for a resend
    s.put(FINAL_ROUND, 0, 0.95)
    assert s.get(1, "later") == {0: 0.9, 1: 0.5, 2: 0.1}


@unit
def test_a_trainer_size_that_does_not_divide_the_workers_is_refused():
    with pytest.raises(ConfigError, match="trainer_size = 3 does not divide cluster.workers = 4"):
        load(None, ["mode.name=ltfb", "cluster.workers=4", "mode.trainer_size=3"], env={})
    with pytest.raises(ConfigError, match="truncation_k = 2 needs at least 4 trainers"):
        load(None, ["mode.name=ltfb", "cluster.workers=6", "mode.trainer_size=2", "mode.strategy=truncation",
                    "mode.truncation_k=2"], env={})
    assert load(None, ["mode.name=ltfb", "cluster.workers=4", "mode.trainer_size=2"], env={}).mode.trainer_size == 2


@unit
def test_exploring_an_epsilon_that_sgd_does_not_have_is_refused():
    """A review: mode.explore of optimizer.eps with the default optimizer.name = sgd ran,
    and every tournament line showed each trainer at its own eps, though SGD has none:
    the trainers differed in nothing but those lines."""
    explore = 'mode.explore={"optimizer.eps" = [1e-8, 1e-2]}'
    with pytest.raises(ConfigError, match="optimizer.eps is Adam's and AdamW's epsilon"):
        load(None, ["mode.name=ltfb", explore], env={})
    assert load(None, ["mode.name=ltfb", "optimizer.name=adam", explore], env={}).mode.explore


@unit
def test_rule_keeps_outcomes_apart_from_tournament_deposits():
    """A group's outcome (round -r) is never in the index's models, which choose the global
    model (the index tells each trainer's latest outcome's round apart, for a worker
    rejoining the trainer), and a request for it is parked until the leader deposits it."""
    cfg = Config().replace(**{"mode.name": "ltfb", "cluster.workers": 4, "mode.trainer_size": 2})
    rule = LtfbRule(cfg.mode, 4, None)
    assert rule.fetch(Fetch("f", 1, -1)) == []                      # trainer 1's outcome of round 1: parked
    out = rule.deposit(Deposit("d", 3, -1, 0.0, []))                 # rank 3 leads trainer 1
    assert [d for d in out if isinstance(d, AnswerModel)] == [AnswerModel("f", ("outcome", 1), {"round": -1,
                                                                                                "owner": 1})]
    rule.deposit(Deposit("d2", 2, 1, 0.4, []))                       # rank 2's tournament deposit is trainer 1's
    assert rule.index("i")[0].fields == {"models": [[1, 1, 0.4]], "outcomes": [[1, 1]],
                                         "tags": [[1, 1, None], [-1, 1, None]]}
    assert rule.fetch(Fetch("s", -1, 1)) == []                       # the board waits for trainer 0
    out = rule.deposit(Deposit("d3", 0, 1, 0.6, []))
    assert any(getattr(d, "fields", {}).get("scores") == [[0, 0.6], [1, 0.4]] for d in out)
    ready = rule.push(Push("p0", 0, 0, 0, torch.ones(3), torch.zeros(0)))
    assert [d.token for d in ready] == ["p0"]
    assert rule.read(Read("r0", 0, 1)) == []                         # waits for rank 1
    out = rule.membership({0: 1, 2: 0, 3: 0})                        # rank 1 left: the step closes on rank 0
    assert [d.token for d in out] == ["r0"] and torch.equal(out[0].arrays[0], torch.ones(3))


@unit
def test_a_late_resend_of_an_earlier_outcome_does_not_replace_the_newer_one():
    """A review: a leader's outcome of round 1 resent, arriving after its outcome of
    round 2, was stored under the trainer's one outcome key: a follower's fetch of round 2
    got round 1's model, labelled round 2."""
    cfg = Config().replace(**{"mode.name": "ltfb", "cluster.workers": 4, "mode.trainer_size": 2})
    rule = LtfbRule(cfg.mode, 4, None)
    assert any(isinstance(d, Store) for d in rule.deposit(Deposit("a", 3, -1, 0.0, ["round 1"])))
    assert any(isinstance(d, Store) for d in rule.deposit(Deposit("b", 3, -2, 0.0, ["round 2"])))
    assert rule.deposit(Deposit("c", 3, -1, 0.0, ["round 1"])) == [Answer("c")]   # answered, not stored
    assert any(isinstance(d, Store) for d in rule.deposit(Deposit("d", 3, -2, 0.0, ["round 2"])))  # (a resend)


# ---------------------------------------------------------------- through the shards
def _ask(shard: Shard, request: wire.Message) -> list[tuple]:
    """A request's replies, decoded: (token, op, fields, arrays as lists)."""
    out = []
    for token, frames in shard.handle(("t", request.id), request):
        m = wire.decode([bytes(f) for f in frames])
        out.append((token, m.op, m.fields, [a.tolist() for a in m.arrays]))
    return out


@unit
@pytest.mark.timeout(60)
def test_a_restored_shard_answers_every_ltfb_request_as_before(tmp_path):
    """A shard restarted from its checkpoint (kill -9) keeps the deposits, outcomes,
    scores, truncation boards and the groups' open and closed steps: the models index
    and every fetch, push and read get the answers the original gives. A checkpoint
    written before these were kept still loads, holding none of them."""
    cfg = Config().replace(**{"mode.name": "ltfb", "cluster.workers": 4, "mode.trainer_size": 2,
                              "cluster.servers": 1})
    a = Shard(cfg, 0)
    ids = iter(range(1, 1 << 20))

    def req(op, rank, clock, arrays=(), **fields) -> wire.Message:
        return wire.decode(wire.encode(op, id=next(ids), rank=rank, clock=clock, arrays=arrays, **fields))

    def model(x: float) -> list:
        return [torch.full((a.P,), x), torch.full((a.B,), -x), torch.full((a.P,), 2 * x)]

    def push(rank, clock, x: float, pull: bool = True) -> wire.Message:
        return req("push", rank, clock, [torch.full((a.P,), x), torch.full((a.B,), x)], read_version=0, pull=pull)

    for rank, rnd, score, x in ((0, 1, 0.7, 1.0), (2, 1, 0.9, 2.0), (0, -1, 0.7, 3.0), (2, 2, 0.4, 4.0)):
        _ask(a, req("put_model", rank, 50, model(x), round=rnd, score=score))
    assert len(_ask(a, req("get_model", 0, 0, round=1, owner=-1))) == 1     # round 1's board, frozen
    for rank in (2, 3):                                                      # trainer 1's step 0 closes
        _ask(a, push(rank, 0, float(rank)))
    _ask(a, push(0, 5, 1.0, pull=False))       # trainer 0's step 5 is open (a parked read would be resent)

    a.save(str(tmp_path / "shard-0.pt"))                                     # weights_only, as a restart loads it
    b = Shard(cfg, 0)
    b.load(str(tmp_path / "shard-0.pt"))
    assert b.stats() == a.stats()
    for r in [req("models", 0, 0), req("get_model", 0, 0, round=1, owner=0, exact=True),
              req("get_model", 0, 0, round=1, owner=1),                      # trainer 1 has moved on to round 2
              req("get_model", 1, 0, round=-1, owner=0),                     # trainer 0's outcome of round 1
              req("get_model", 0, 0, round=1, owner=-1),                     # the frozen board
              req("get_model", 0, 0, round=2, owner=-1),                     # parked on both: trainer 0 is behind
              req("pull", 3, 1),                                             # a resent read of a closed step
              push(1, 5, 3.0),                                               # closes trainer 0's step 5: the mean
              req("put_model", 0, 60, model(5.0), round=2, score=0.8),       # forgets round 1's, releases the board
              req("models", 0, 0)]:
        answers = _ask(a, r)
        assert _ask(b, r) == answers, r
        assert answers or r.op == "get_model"
    assert b.stats() == a.stats() and b.models.keys() == a.models.keys()

    old = a.state_dict()                                                     # as written before models were kept
    del old["models"]
    old["rule"] = {"hist": old["rule"]["hist"]}
    c = Shard(cfg, 0)
    c.load_state_dict(old)
    assert c.ready and c.models == {} and _ask(c, req("models", 0, 0))[0][2]["models"] == []


class TourLoopback(TournamentOps, Loopback):
    """A loopback with the tournament ops (deposits and fetches must be answerable at once)."""

    def request(self, reqs, cancel=None):
        try:
            return super().request(reqs)
        except wire.Refused:
            raise
        except AssertionError as e:   # parked: the partner has not deposited
            raise Cancelled(str(e)) from None

    @staticmethod
    def _wire(kind, shard, t):
        return t


def grad(x: torch.Tensor) -> torch.Tensor:
    return 0.3 * x + 0.05


def trainers_on(cfg: Config, n: int):
    """n one-worker trainers on the same shards, started, each with a holdout."""
    shards = [Shard(cfg, i) for i in range(cfg.cluster.servers)]
    out = []
    for rank in range(n):
        w = FakeTrainer(cfg, TourLoopback(shards, rank), grad, rank)
        w.holdout = (torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
        w.live = lambda n=n: set(range(n))
        w.events = []
        w.event = lambda w=w, **f: w.events.append(f)
        s = LtfbSchedule(cfg)
        s.start(w)
        out.append((w, s))
    return shards, out


def momentum(s: LtfbSchedule, w) -> torch.Tensor:
    return flat([s.opt.state[p]["momentum_buffer"] for p in w.replica.model.parameters()])


def ltfb_cfg(**sets) -> Config:
    return Config().replace(**{"mode.name": "ltfb", "cluster.workers": 2, "cluster.servers": 2,
                               "mode.round_steps": 3, "train.steps": 30, "optimizer.momentum": 0.9, **sets})


@unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("exchange", ["weights+optimizer", "weights"])
@pytest.mark.parametrize("wins", [True, False])
def test_adoption_switches_weights_and_optimizer_and_a_rejection_restores_them(exchange, wins):
    explore = {"optimizer.lr": [0.01, 0.5], "optimizer.momentum": [0.5, 0.95]}
    cfg = ltfb_cfg(**{"mode.exchange": exchange, "mode.explore": explore})
    _, [(w0, s0), (w1, s1)] = trainers_on(cfg, 2)
    for _ in range(2):                           # different weights and momenta: w1 moves further
        s0.step(w0)
    for _ in range(5):
        s1.opt.param_groups[0]["lr"] = 0.5
        w1.compute()
        s1.opt.step()
    assert s0.hyper != s1.hyper
    s1.deposit(w1, 1, 0.5, [0.0, -1.0, math.nan, math.nan], s1.with_opt)
    theirs, their_m, their_hyper = flat(w1.replica.params()), momentum(s1, w1), dict(s1.hyper)
    ours, our_m, our_hyper = flat(w0.replica.params()), momentum(s0, w0), dict(s0.hyper)
    assert not torch.equal(ours, theirs) and not torch.equal(our_m, their_m)
    # the tournament split prefers the partner's weights (wins) or ours
    target = theirs if wins else ours
    w0.replica.score = lambda *a, **k: (float(torch.equal(flat(w0.replica.params()), target)), 0.0)
    s0.lead(w0, 1)
    (line,) = w0.events
    assert line["partner"] == 1 and line["adopted"] is wins and line["trainer"] == 0
    if wins:
        assert torch.equal(flat(w0.replica.params()), theirs)
        assert torch.equal(momentum(s0, w0), their_m if exchange == "weights+optimizer" else our_m)
        assert s0.hyper == mutate(their_hyper, explore, cfg.mode.mutation, cfg.job.seed, 1, 0)
        assert all(s0.hyper[k] in (their_hyper[k] * 0.8, their_hyper[k] * 1.2) for k in explore)
        assert s0.opt_cfg.lr == s0.hyper["optimizer.lr"]
        assert s0.opt.param_groups[0]["momentum"] == s0.hyper["optimizer.momentum"]
    else:
        assert torch.equal(flat(w0.replica.params()), ours) and torch.equal(momentum(s0, w0), our_m)
        assert s0.hyper == our_hyper
    assert line["hyper"] == {k: float(f"{v:.6g}") for k, v in s0.hyper.items()}


@unit
@pytest.mark.timeout(60)
def test_truncation_loser_takes_the_winners_model_exactly_and_winners_keep_theirs():
    cfg = ltfb_cfg(**{"cluster.workers": 4, "mode.strategy": "truncation", "mode.truncation_k": 1,
                      "mode.metric": "loss", "mode.round_steps": 10})
    _, ts = trainers_on(cfg, 4)
    for i, (w, s) in enumerate(ts):
        for _ in range(i + 1):
            s.step(w)
    losses = {0: 0.9, 1: 0.2, 2: 0.5, 3: 0.7}              # trainer 1 is best (lowest loss), 0 worst
    models = {}
    for t in (1, 2, 3):
        w, s = ts[t]
        models[t] = (flat(w.replica.params()), momentum(s, w))
        s.deposit(w, 1, fitness("loss", 0, losses[t]), [0.0, -1.0, math.nan, math.nan], s.with_opt)
    w0, s0 = ts[0]
    w0.replica.score = lambda *a, **k: (0.0, losses[0])
    s0.lead(w0, 1)
    assert w0.events[0]["partner"] == 1 and w0.events[0]["adopted"] is True
    assert w0.events[0]["partner_score"] == 0.2 and w0.events[0]["local_score"] == 0.9
    assert torch.equal(flat(w0.replica.params()), models[1][0]) and torch.equal(momentum(s0, w0), models[1][1])
    w2, s2 = ts[2]
    before = flat(w2.replica.params())
    w2.replica.score = lambda *a, **k: (0.0, losses[2])
    s2.lead(w2, 1)                                         # the middle keeps its own
    assert w2.events[0]["adopted"] is False and torch.equal(flat(w2.replica.params()), before)


@unit
@pytest.mark.timeout(60)
def test_a_fetch_takes_every_slice_of_one_deposit_when_the_shards_hold_different_rounds():
    """A review: a shard restored from a checkpoint older than a trainer's deposit (or a
    deposit on its way to some shards) answered a fetch with an older round than the
    other shards: the asker scored, and could adopt, a model stitched from two rounds.
    The shards are asked again for the newest round; one that lacks it answers when it
    comes (here, in a loopback, it cannot: the partner's model is not delivered)."""
    cfg = ltfb_cfg()
    shards, [(w0, s0), (w1, s1)] = trainers_on(cfg, 2)
    meta = [0.0, -1.0, math.nan, math.nan]
    s1.deposit(w1, 1, 0.5, meta, s1.with_opt)
    assert {m.get("round") for m in s0.fetch(w0, 1, 1, 0.0)} == {1}
    before = shards[0].state_dict()                    # shard 0's periodic checkpoint
    s1.step(w1)
    s1.deposit(w1, 2, 0.6, meta, s1.with_opt)
    shards[0].load_state_dict(before)                  # kill -9: restored without round 2
    notes = []
    w0.note = notes.append
    assert s0.fetch(w0, 1, 1, 0.0) is None and "trainer 1 did not deliver its model" in notes[0]
    s1.deposit(w1, 3, 0.7, meta, s1.with_opt)          # trainer 1 moves on: every shard has round 3
    assert {m.get("round") for m in s0.fetch(w0, 1, 1, 0.0)} == {3}


@unit
@pytest.mark.timeout(60)
def test_the_last_round_is_local_no_tournament_at_the_end_of_the_budget():
    cfg = ltfb_cfg(**{"cluster.workers": 1, "train.steps": 9, "mode.round_steps": 3})
    _, [(w, s)] = trainers_on(cfg, 1)
    held = []
    w.replica.score = lambda *a, **k: (0.5, 1.0)
    s.lead = lambda w, rnd: held.append((w.clock, rnd))
    while w.clock < cfg.train.steps:
        s.step(w)
    assert held == [(3, 1), (6, 2)]                        # not at 9: the budget ends with a local round


# ---------------------------------------------------------------- a whole cluster of trainer groups
def run_workers(cfg: Config, out: str, port: int) -> list[Worker]:
    cfg = cfg.replace(**{"cluster.port": port})
    with InProcessCluster(cfg, out) as cluster:
        workers = [Worker(cfg, out, "cpu", r, cluster.ctx) for r in range(cfg.cluster.workers)]
        threads = [threading.Thread(target=w.run, name=f"w{i}") for i, w in enumerate(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=150)
        assert not any(t.is_alive() for t in threads)
    return workers


def tournament_lines(out: str) -> list[dict]:
    lines = []
    for path in sorted(glob.glob(os.path.join(out, "events", "worker-*.jsonl"))):
        with open(path) as f:
            lines += [e for e in map(json.loads, f) if e.get("event") == "tournament"]
    return lines


@inprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["pairwise", "truncation"])
def test_trainer_groups_keep_identical_replicas(tmp_path, port_block, strategy):
    """4 workers, trainer_size 2: after the run the two workers of each trainer have
    identical parameters, and every tournament line of a trainer agrees."""
    cfg = load(None, ["mode.name=ltfb", "cluster.workers=4", "mode.trainer_size=2", "cluster.servers=2",
                      "cluster.evaluator=false", "train.steps=24", "mode.round_steps=6", "train.batch_size=16",
                      f"mode.strategy={strategy}", "mode.explore={\"optimizer.lr\" = [0.02, 0.3]}",
                      "mode.mutation=0.2"], env={})
    workers = run_workers(cfg, str(tmp_path), port_block(3))
    params = [flat(list(w.replica.model.parameters())) for w in workers]
    assert all(w.clock == 24 for w in workers)
    assert torch.equal(params[0], params[1]) and torch.equal(params[2], params[3])
    assert not torch.equal(params[0], params[2])           # the final local round trains the two apart
    lines = tournament_lines(str(tmp_path))
    assert sorted({e["round"] for e in lines}) == [1, 2, 3]   # 24 steps of 6: no tournament at the end
    for rnd in (1, 2, 3):
        for t in (0, 1):
            mine = [e for e in lines if e["round"] == rnd and e["trainer"] == t]
            assert sorted(e["rank"] for e in mine) == [2 * t, 2 * t + 1]
            a, b = ({k: v for k, v in e.items() if k not in ("rank", "t")} for e in mine)
            assert a == b and a["leader"] == 2 * t and set(a["hyper"]) == {"optimizer.lr"}
            assert 0.02 <= a["hyper"]["optimizer.lr"] <= 0.3
    first = {e["trainer"]: e["hyper"]["optimizer.lr"] for e in lines if e["round"] == 1 and not e["adopted"]}
    drawn = {t: draw_hyper({"optimizer.lr": [0.02, 0.3]}, cfg.job.seed, t)["optimizer.lr"] for t in (0, 1)}
    assert all(abs(v - drawn[t]) <= 1e-5 * drawn[t] for t, v in first.items())


@unit
def test_the_global_model_waits_for_a_deposit_on_its_way_to_every_shard(monkeypatch):
    """Each shard keeps a trainer's latest deposit only: while the newest ones have
    reached shard 0 and not yet shard 1, no deposit is on both, and `global_model` gave
    the shards' tables (ltfb's: the initial model; a chance-level score). It waits for
    the deposit to arrive instead."""
    import psgd.consistency.ltfb as ltfb
    cfg = Config().replace(**{"mode.name": "ltfb", "cluster.workers": 2, "cluster.servers": 2, "train.steps": 100})
    shards = [Shard(cfg, i) for i in range(2)]
    initial = flat([s.params for s in shards]).clone()
    clients = [TourLoopback(shards, r) for r in range(2)]

    def deposit(rank, rnd, x, on):
        arrays = [[torch.full((s.P,), x), s.buffers.clone()] for s in shards]
        clients[rank].request([(i, "put_model", {"round": rnd, "score": x, "step": 10 * rnd, "arrays": arrays[i]})
                               for i in on])
    for rank in (0, 1):
        deposit(rank, 1, 1.0 + rank, on=(0, 1))
    assert flat(TourLoopback.tables(ltfb.global_model(clients[0]))[0]).max() == 2.0
    for rank in (0, 1):
        deposit(rank, 2, 3.0 + rank, on=(0,))            # on their way to shard 1
    waited = []

    def arrive(s):   # while the reader waits, the deposits reach shard 1
        waited.append(s)
        for rank in (0, 1):
            deposit(rank, 2, 3.0 + rank, on=(1,))
    from psgd.consistency import rule
    monkeypatch.setattr(rule.time, "sleep", arrive)
    got = flat(TourLoopback.tables(ltfb.global_model(clients[0]))[0])
    assert waited and not torch.equal(got, initial) and got.max() == 4.0


@unit
def test_a_restarted_worker_holds_no_tournament_without_a_local_round_after_it():
    """A worker restarted into a job with a `train.seconds` budget counted the budget from
    its own start: 1 s before the job's end it held a tournament with no local round
    after it (rounds take 3 s here). The budget is the job's (`Trainer.now`)."""
    cfg = ltfb_cfg(**{"cluster.workers": 1, "train.steps": 0, "train.seconds": 60.0, "mode.round_steps": 3})
    _, [(w, s)] = trainers_on(cfg, 1)
    now = [50.0]   # the job had trained 50 s when this worker (re)joined it
    w.now = lambda: now[0]
    s.start(w)
    held = []
    s.lead = lambda w, rnd: held.append((now[0], rnd))
    while now[0] < cfg.train.seconds:   # Worker.more()
        now[0] += 1.0
        s.step(w)
    assert held and not [(t, r) for t, r in held if cfg.train.seconds - t < 3.0], held


@unit
def test_truncations_board_completes_after_a_shard_restarts_from_an_older_checkpoint(tmp_path):
    """A shard restored from its periodic checkpoint has lost the deposits made after it,
    and nobody deposits again: trainers 0-2 wait on round 2's board, which waited for
    their round-2 deposits, for good. A board request carries the asker's own score:
    the resent requests put them back."""
    ids = iter(range(1, 1 << 20))

    def req(op, rank, clock, arrays=(), **fields):
        return wire.decode(wire.encode(op, id=next(ids), rank=rank, clock=clock, arrays=arrays, **fields))

    def answered(shard, request):
        return [t for t, _ in shard.handle(("t", request.id), request)]
    cfg = Config().replace(**{"mode.name": "ltfb", "cluster.workers": 4, "cluster.servers": 1,
                              "mode.strategy": "truncation", "train.steps": 100, "mode.round_steps": 10})
    a = Shard(cfg, 0)

    def model(x):
        return [torch.full((a.P,), float(x)), torch.zeros(a.B)]
    for t in range(4):
        answered(a, req("put_model", t, 10, model(t), round=1, score=0.1 * t))
    a.save(str(tmp_path / "shard-0.pt"))                      # the periodic checkpoint
    boards = {}
    for t in range(3):                                       # round 2: trainers 0-2 deposit, then wait for 3
        answered(a, req("put_model", t, 20, model(t), round=2, score=0.2 * t))
        boards[t] = req("get_model", t, 20, round=2, owner=-1, score=0.2 * t)
        assert answered(a, boards[t]) == []
    b = Shard(cfg, 0)                                        # kill -9, restarted from the checkpoint
    assert b.resume(str(tmp_path / "shard-0.pt")) == ""
    for t in range(3):                                       # the askers resend their requests
        assert answered(b, boards[t]) == []
    out = answered(b, req("put_model", 3, 20, model(3), round=2, score=0.6))   # the last trainer's deposit
    assert set(out) >= {("t", boards[t].id) for t in range(3)}                # releases the three boards
    scores = b.handle("x", req("get_model", 0, 20, round=2, owner=-1))
    assert wire.decode(scores[0][1]).get("scores") == [[0, 0.0], [1, 0.2], [2, 0.4], [3, 0.6]]


def ltfb_request(op: str, rank: int, **fields) -> wire.Message:
    return wire.decode(wire.encode(op, id=1, rank=rank, clock=0, **fields))


@unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [4, 7, 2 ** 40])
def test_a_score_fetch_from_a_rank_outside_the_job_does_not_join_the_truncation_board(rank):
    """A review: get_model of a round's scores (owner -1) carries the asker's own score,
    which the shard puts on the round's board, and its rank was not checked (put_model's
    is): a rank outside cluster.workers put a trainer that does not exist on the board
    that every trainer gets, ranked first, so a loser 'took' its model, which never came."""
    shard = Shard(Config().replace(**{"mode.name": "ltfb", "cluster.workers": 4, "mode.trainer_size": 2,
                                      "cluster.servers": 1, "train.steps": 100, "mode.strategy": "truncation"}), 0)
    with pytest.raises(wire.WireError) as e:
        shard.handle("x", ltfb_request("get_model", rank, round=1, owner=-1, score=0.99))
    assert e.value.code == wire.REFUSED
    model = [torch.zeros(shard.P), torch.zeros(shard.B)]
    for r, score in ((0, 0.5), (2, 0.25)):
        shard.handle(f"w{r}", ltfb_request("put_model", r, round=1, score=score, step=50, arrays=model))
    (_, op, fields, _), = _ask(shard, ltfb_request("get_model", 2, round=1, owner=-1, score=0.25))
    assert fields.get("scores") == [[0, 0.5], [1, 0.25]]


@unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("owner", [2, 99, -7])
def test_a_fetch_of_a_trainer_that_does_not_exist_is_refused_not_parked_for_good(owner):
    """A review: get_model of a trainer outside the job (owner >= workers / trainer_size,
    or below -1, the scores') can never be answered: it was parked until the job ended,
    its sender waiting without an error (and counted against max_parked). It is refused,
    a tournament's model and a group's outcome (round -r) alike."""
    shard = Shard(Config().replace(**{"mode.name": "ltfb", "cluster.workers": 4, "mode.trainer_size": 2,
                                      "cluster.servers": 1, "train.steps": 100}), 0)
    for rnd in (1, -1):
        (_, op, fields, _), = _ask(shard, ltfb_request("get_model", 0, round=rnd, owner=owner))
        assert (op, fields.get("code")) == ("error", wire.REFUSED), fields
    assert shard.rule.parked() == 0


@unit
@pytest.mark.timeout(60)
def test_an_exact_fetch_of_a_replaced_deposit_is_refused_but_not_counted_as_a_bad_message():
    """The global model's reader fetches exactly the deposit every shard's index named;
    a trainer's next deposit may replace it in between (each shard keeps a trainer's
    latest; with short rounds, often): refused, and the reader tries again. A clean
    run's summary.json said bad_messages 2 or 3 for these (round_steps 1, 3 workers)."""
    shard = Shard(Config().replace(**{"mode.name": "ltfb", "cluster.workers": 2, "cluster.servers": 1,
                                      "train.steps": 100}), 0)
    model = [torch.zeros(shard.P).numpy(), torch.zeros(shard.B).numpy()]
    for rnd in (1, 2):
        shard.handle(("d", rnd), ltfb_request("put_model", 0, round=rnd, score=0.5, step=rnd, arrays=model))
    (_, op, fields, _), = _ask(shard, ltfb_request("get_model", -1, round=1, owner=0, exact=True))
    assert (op, fields.get("code")) == ("error", wire.REFUSED), fields
    assert shard.stats()["bad_messages"] == 0
    (_, op, fields, _), = _ask(shard, ltfb_request("get_model", -1, round=2, owner=0, exact=True))
    assert op != "error" and fields["round"] == 2


class WaitingLoopback(TourLoopback):
    """A loopback that waits for parked requests, as ParameterClient does: every reply a
    shard gives goes to its token; an unanswered request is resent on the same token
    every RESEND_S (the real client's retry window) until `cancel()` turns true."""
    RESEND_S = 0.2
    GIVE_UP_S = 8.0
    lock = threading.RLock()   # (a test may hold it around requests of its own: `test_ltfb_waits`)
    replies: dict = {}

    def request(self, reqs, cancel=None):
        out = []
        for i, op, fields in reqs:
            token = ("wl", self.rank, time.monotonic_ns())
            frames = wire.encode(op, id=hash(token) & 0xFFFFFF, rank=self.rank, **fields)
            msg = wire.decode([bytes(f) for f in frames])
            t0, sent = time.monotonic(), -1.0
            while True:
                with self.lock:
                    if time.monotonic() - sent >= self.RESEND_S:
                        for tok, reply in self.shards[i].handle(token, msg):
                            self.replies[tok] = reply
                        sent = time.monotonic()
                    reply = self.replies.pop(token, None)
                if reply is not None:
                    break
                if cancel is not None and cancel():
                    raise Cancelled("cancelled")
                if time.monotonic() - t0 > self.GIVE_UP_S:
                    raise TimeoutError(f"rank {self.rank}: {op} {fields.get('round')}/{fields.get('owner')} on "
                                       f"shard {i} still parked after {self.GIVE_UP_S} s")
                time.sleep(0.01)
            out.append(wire.raise_if_error(wire.decode([bytes(f) for f in reply]), f"shard {i}"))
        return out


@unit
@pytest.mark.timeout(60)
def test_pairwise_partners_do_not_wait_for_good_after_a_shard_restores_an_older_checkpoint():
    """A review: a shard killed after both partners of a pair deposited round r, and
    restored from its periodic checkpoint (written before those deposits), held
    neither deposit; each partner's fetch of the other's model was parked there until
    the other deposited round r or later, which it never did, waiting for this one: both
    trainers hung (the truncation board was fixed for this case, the pairwise swap was
    not). A deposit that a shard lacks is made again once the partner's model comes, or
    while it does not come."""
    cfg = ltfb_cfg(**{"cluster.servers": 1, "mode.round_steps": 3})
    shards, ts = trainers_on(cfg, 2)
    for w, _ in ts:
        w.client = WaitingLoopback(shards, w.rank)
    for w, s in ts:
        for _ in range(2):
            s.step(w)
    checkpoint = shards[0].state_dict()      # the shard's periodic checkpoint, before round 1

    def restore():                           # kill -9 after both deposits, restarted from it
        with WaitingLoopback.lock:
            shards[0].load_state_dict(checkpoint)
    both_deposited = threading.Barrier(2, action=restore)
    for _, s in ts:
        real = s.fetch

        def fetch(*args, real=real):
            both_deposited.wait()
            return real(*args)
        s.fetch = fetch
    errors = []

    def run(w, s):
        try:
            s.step(w)                        # clock 3: the tournament of round 1
        except BaseException as e:           # noqa: BLE001
            errors.append(repr(e))
    threads = [threading.Thread(target=run, args=t) for t in ts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for w, _ in ts:
        assert [e["partner"] for e in w.events] == [1 - w.rank]


@unit
@pytest.mark.timeout(60)
def test_a_diverged_trainer_loses_its_next_tournament_instead_of_ending_the_job():
    """A review: docs/modes.md says a diverged trainer loses its next tournament, but a
    NaN loss raised Diverged before the trainer's clock moved, so it never reached one:
    after cluster.max_rejections steps the whole job was aborted ('worker 3: loss is nan
    at step 7'), which is what mode.explore with a wide lr range produces. It now skips
    its updates until its tournament and takes its partner's model there; with no other
    trainer to take a model from, the job still ends."""
    cfg = ltfb_cfg(**{"mode.metric": "loss", "mode.round_steps": 3})
    _, [(w0, s0), (w1, s1)] = trainers_on(cfg, 2)
    for _ in range(3):                       # trainer 0 trains a round and deposits round 1
        s0.step(w0)
    theirs = flat(w0.replica.params())
    with torch.no_grad():                    # trainer 1 has diverged: NaN weights, NaN loss
        for p in w1.replica.model.parameters():
            p.fill_(math.nan)

    def nan_compute():
        for p in w1.replica.model.parameters():
            p.grad = torch.full_like(p, math.nan)
        return math.nan
    w1.compute = nan_compute
    for _ in range(3):                       # its next tournament (round 1, at clock 3)
        s1.step(w1)
    assert w1.clock == 3
    assert torch.equal(flat(w1.replica.params()), theirs)   # it lost: it holds trainer 0's model
    (line,) = w1.events
    assert line["adopted"] and line["partner"] == 0 and line["local_score"] is None
    _, [(alone, s)] = trainers_on(cfg, 1)    # a lone trainer: nothing can replace its model
    alone.compute = lambda: math.nan
    with pytest.raises(Diverged, match="loss is nan at step 0; lower optimizer.lr"):
        s.step(alone)
    for _ in range(3):                       # trainer 1 diverges again with the model it took: round 2 ...
        s0.step(w0)
        s1.step(w1)
    assert w1.clock == 6 and len(w1.events) == 2
    for _ in range(3):                       # ... and round 3: a learning rate too high for every model
        s0.step(w0)
    with pytest.raises(Diverged, match="in 3 rounds in a row of trainer 1"):
        for _ in range(3):
            s1.step(w1)


@unit
@pytest.mark.timeout(60)
def test_a_restarted_trainer_keeps_the_hyperparameters_of_the_model_it_resumes():
    """A review: mode.explore's values 'then change only by adoption and mutation', but a
    worker restarted into the job resumed the best deposit's weights with its trainer's
    initial draw: the explored, mutated values that travelled with that model were lost
    (and, for a restarted leader, its outcome handed them to its whole group)."""
    explore = {"optimizer.lr": [0.01, 0.5], "optimizer.momentum": [0.5, 0.95]}
    cfg = ltfb_cfg(**{"mode.explore": explore})
    _, [(w0, s0), (w1, s1)] = trainers_on(cfg, 2)
    for _ in range(2):                       # trainer 1's weights move away from trainer 0's
        s1.step(w1)
    s1.deposit(w1, 1, 0.9, [0.0, -1.0, math.nan, math.nan], s1.with_opt)
    theirs = flat(w1.replica.params())
    w0.replica.score = lambda *a, **k: (0.9 if torch.equal(flat(w0.replica.params()), theirs) else 0.1, 0.0)
    s0.lead(w0, 1)                           # trainer 0 adopts trainer 1's model: mutated hyperparameters
    mutated = dict(s0.hyper)
    assert mutated != draw_hyper(explore, cfg.job.seed, 0)
    for _ in range(3):
        s0.step(w0)
    s1.deposit(w1, 2, 0.0, [0.0, -1.0, math.nan, math.nan], s1.with_opt)
    w0.replica.score = lambda *a, **k: (1.0, 0.0)
    s0.deposit(w0, 2, 1.0, [0.0, -1.0, math.nan, math.nan], s0.with_opt)
    deposited = flat(w0.replica.params())
    again = LtfbSchedule(cfg)                # worker 0 is killed and restarted into the job
    again.start(w0)
    assert torch.equal(flat(w0.replica.params()), deposited)   # it resumes its own deposit (the best)
    assert again.hyper == mutated
    assert again.opt.param_groups[0]["momentum"] == mutated["optimizer.momentum"]


@unit
@pytest.mark.timeout(60)
def test_a_trainer_that_starts_after_another_has_deposited_keeps_its_own_draw_and_model():
    """A review: at the job's start each trainer resumed the best deposit if there was
    one, as a restarted worker does; on a busy machine one trainer played round 1 before
    the others had started, and they all began from its model with its hyperparameters
    (psgd run --mode ltfb --workers 4 --set mode.strategy=truncation --set mode.explore=
    ...: every tournament line showed trainer 1's lr and momentum): no population."""
    explore = {"optimizer.lr": [0.01, 0.5], "optimizer.momentum": [0.5, 0.95]}
    cfg = ltfb_cfg(**{"mode.explore": explore})
    shards = [Shard(cfg, i) for i in range(cfg.cluster.servers)]
    w1, s1 = FakeTrainer(cfg, TourLoopback(shards, 1), grad, 1), LtfbSchedule(cfg)
    w1.holdout = (torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    s1.start(w1)
    initial = flat(w1.replica.params())
    for _ in range(2):                       # trainer 1 trains and deposits round 1 ...
        s1.step(w1)
    s1.deposit(w1, 1, 0.9, [0.0, -1.0, math.nan, math.nan], s1.with_opt)
    w0 = FakeTrainer(cfg, TourLoopback(shards, 0), grad, 0)   # ... before trainer 0 starts
    s0 = LtfbSchedule(cfg)
    s0.start(w0)
    assert torch.equal(flat(w0.replica.params()), initial)
    assert s0.hyper == draw_hyper(explore, cfg.job.seed, 0) != s1.hyper


@unit
@pytest.mark.timeout(60)
def test_an_explored_learning_rate_reaches_a_training_scripts_optimizer():
    """A review: with psgd.connect(model, optimizer, score=fn) in ltfb, an explored lr went
    only into `opt_cfg`, which `schedule_lr` never applies to the script's own optimizer,
    while an explored momentum went into its param_groups: the lr exploration did
    nothing, yet every tournament line's `hyper` (and hyper_N.png) showed each trainer
    at its drawn, later mutated, lr."""
    explore = {"optimizer.lr": [0.01, 0.5], "optimizer.momentum": [0.5, 0.95]}
    cfg = ltfb_cfg(**{"mode.explore": explore})
    shards, [(w, _)] = trainers_on(cfg, 1)
    w.user_optimizer = torch.optim.SGD(w.replica.model.parameters(), lr=0.1, momentum=0.9)   # the script's
    s = LtfbSchedule(cfg)
    s.start(w)
    s.step(w)
    drawn = draw_hyper(explore, cfg.job.seed, 0)
    assert s.hyper == drawn                                   # what the tournament lines report
    assert s.opt.param_groups[0]["momentum"] == drawn["optimizer.momentum"]
    assert s.opt.param_groups[0]["lr"] == drawn["optimizer.lr"]


def quadratic(w):
    """A compute whose loss is sum(p^2) / 2 in float32 (inf once the weights blow up), its
    gradient p: too high a learning rate diverges as a network's does."""
    def compute() -> float:
        params = list(w.replica.model.parameters())
        for p in params:
            p.grad = p.detach().clone()
        return float(sum((p.detach() ** 2).sum() for p in params) / 2)
    return compute


@unit
@pytest.mark.timeout(120)
@pytest.mark.parametrize("exchange", ["weights", "weights+optimizer"])
def test_a_diverged_trainer_that_loses_does_not_keep_its_diverged_momentum(exchange):
    """A review: a diverged trainer that lost its tournament kept, with mode.exchange =
    weights, the momentum it built up while diverging, and the first step threw the model
    it took as far (it trained garbage, or diverged again and ended the job)."""
    cfg = ltfb_cfg(**{"mode.exchange": exchange, "mode.metric": "loss", "mode.round_steps": 20,
                      "train.steps": 300, "mode.explore": {"optimizer.lr": [0.01, 100.0]}})
    _, [(w0, s0), (w1, s1)] = trainers_on(cfg, 2)
    s0.set_hyper({"optimizer.lr": 0.05})
    s1.set_hyper({"optimizer.lr": 50.0})        # trainer 1 drew a rate far too high
    w0.compute, w1.compute = quadratic(w0), quadratic(w1)
    notes = []
    w1.note = notes.append
    for _ in range(20):                         # trainer 0's round 1: it deposits a good model
        s0.step(w0)
    for _ in range(20):                         # trainer 1 diverges within its round 1 ...
        s1.step(w1)
    assert any("diverged" in n for n in notes), notes
    (line,) = w1.events                         # ... and loses its tournament: trainer 0's model
    assert line["adopted"] and line["partner"] == 0
    assert torch.equal(flat(w1.replica.params()), flat(w0.replica.params()))
    assert s1.hyper["optimizer.lr"] < 0.1       # with trainer 0's rate, mutated
    start = flat(w1.replica.params()).abs().max().item()
    s1.step(w1)                                 # one step of plain SGD with a sane rate ...
    after = flat(w1.replica.params()).abs().max().item()
    assert math.isfinite(after) and after < 10 * start + 1, (start, after)   # ... moves the weights a little


@pytest.mark.inprocess
@pytest.mark.timeout(300)
def test_a_simulated_ltfb_run_does_not_depend_on_the_machines_time(monkeypatch):
    """A review: the wait for a partner's model was bounded by the machine's clock, in
    psgd simulate too: on a slow machine a fetch gave up, asked every shard's index and
    waited again (other messages, other virtual times: another compare.json for the same
    config and seed). It is bounded on the worker's clock, virtual there."""
    import itertools
    import types

    from psgd.consistency import ltfb
    from psgd.sim.run import Simulation
    keys = ["mode.name=ltfb", "mode.round_steps=4", "cluster.workers=4", "train.steps=24",
            "sim.compute_s=0.002", "sim.compute_cv=0.5", "faults.slow_rank=1", "faults.slow_factor=4"]

    def summary() -> dict:
        cfg = load(None, keys, env={})
        out = Simulation(cfg, cfg.sim.compute_s).run()
        return {k: v for k, v in out.items() if "real" not in k and k != "wall_s"}
    fast = summary()
    ticks = itertools.count()   # a slow (or busy) machine: each look at the clock finds 10 s more gone
    monkeypatch.setattr(ltfb, "time", types.SimpleNamespace(monotonic=lambda: 10.0 * next(ticks)), raising=False)
    assert summary() == fast


@unit
@pytest.mark.timeout(120)
def test_a_diverged_trainer_adopting_with_weights_and_optimizer_takes_the_partners_optimizer_state():
    """A review: with weights+optimizer a diverged trainer that cleared its state before
    taking its partner's model took no state with it (load_opt_state matched the
    deposit's kinds of state against ours, then none): it trained on with zero momentum."""
    cfg = ltfb_cfg(**{"mode.exchange": "weights+optimizer", "mode.metric": "loss", "mode.round_steps": 20,
                      "train.steps": 300, "mode.explore": {"optimizer.lr": [0.01, 100.0]}})
    _, [(w0, s0), (w1, s1)] = trainers_on(cfg, 2)
    s0.set_hyper({"optimizer.lr": 0.05})
    s1.set_hyper({"optimizer.lr": 50.0})
    w0.compute, w1.compute = quadratic(w0), quadratic(w1)
    w1.note = lambda *_: None
    for _ in range(20):
        s0.step(w0)
    partner_momentum = momentum(s0, w0).clone()
    assert partner_momentum.abs().max() > 0
    for _ in range(20):
        s1.step(w1)
    (line,) = w1.events
    assert line["adopted"] and line["partner"] == 0
    assert torch.equal(flat(w1.replica.params()), flat(w0.replica.params()))
    got = [s1.opt.state.get(p, {}).get("momentum_buffer") for p in w1.replica.model.parameters()]
    assert all(m is not None for m in got), "the adopted model came without its optimizer state"
    assert torch.allclose(flat(got), partner_momentum)


@unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("who", ["leader", "follower"])
def test_a_non_finite_loss_in_a_group_at_a_rounds_last_step_keeps_its_tournament(who):
    """A review: in a trainer of 2, a worker whose loss was non-finite at the last step
    of a round pushed nothing and went on to the round's tournament. A follower waited
    there for its leader's outcome while the leader waited for the follower's push: the
    job hung (until the clients' timeouts). A leader played the round, and its follower,
    told it was behind the group's step (the leader's next push), moved to that step
    without the round: it kept its model for a round while its leader took another, and
    wrote no line for it. The follower's request for the outcome now tells the shards
    that it will not push for that step (the step closes on the others, as for a
    worker that left), and a worker moved to its group's step at a round's end plays
    that round."""
    cfg = ltfb_cfg(**{"cluster.workers": 4, "mode.trainer_size": 2, "cluster.servers": 1, "mode.round_steps": 3})
    shards, ts = trainers_on(cfg, 4)
    for w, _ in ts:
        w.client = WaitingLoopback(shards, w.rank)
    w, _ = ts[0 if who == "leader" else 1]
    real = w.compute

    def nan_at_the_rounds_last_step(w=w, real=real):
        loss = real()
        return math.nan if w.clock == 2 else loss
    w.compute = nan_at_the_rounds_last_step
    notes: list[str] = []
    w.note = notes.append
    errors = []

    def run(w, s):
        try:
            while w.clock < 6:
                s.step(w)
        except BaseException as e:           # noqa: BLE001
            errors.append(f"rank {w.rank}: {e!r}")
    threads = [threading.Thread(target=run, args=t, daemon=True) for t in ts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert [w.clock for w, _ in ts] == [6] * 4
    (w0, _), (w1, _) = ts[0], ts[1]
    assert [e["round"] for e in w0.events] == [e["round"] for e in w1.events] == [1, 2]
    for a, b in zip(w0.events, w1.events, strict=True):
        assert {k: v for k, v in a.items() if k != "rank"} == {k: v for k, v in b.items() if k != "rank"}
    assert torch.equal(flat(w0.replica.params()), flat(w1.replica.params()))
    # the note says what happens (it said 'it skips its updates' until the tournament: the
    # later steps update it as usual)
    (said,) = [n for n in notes if "diverged" in n]
    assert "this step makes no update and the trainer loses its next tournament" in said


@unit
@pytest.mark.timeout(60)
def test_a_group_step_dropped_by_a_push_ahead_of_it_says_so_on_its_contributors_step_lines():
    """Found by reading: a push ahead of a trainer's open step (a worker that restarted
    into the job ahead of the others, or a shard that restored an older checkpoint)
    drops the open step and counts its contributors' gradients in `dropped` (summary.json's
    dropped_gradients), but their pushes had been answered `staleness: 0` and their step
    lines said nothing of it. The read of such a worker now says its gradient was left
    out, and its step line says `dropped`: the lines and the count agree."""
    cfg = ltfb_cfg(**{"cluster.workers": 2, "mode.trainer_size": 2, "cluster.servers": 1, "mode.round_steps": 10})
    shards, ts = trainers_on(cfg, 2)
    (w0, s0), (w1, s1) = ts
    for w, _ in ts:
        w.client = WaitingLoopback(shards, w.rank)
    groups = shards[0].rule.groups
    errors = []

    def run(w, s, steps):
        try:
            for _ in range(steps):
                s.step(w)
        except BaseException as e:           # noqa: BLE001
            errors.append(f"rank {w.rank}: {e!r}")
    a = threading.Thread(target=run, args=(w0, s0, 2), daemon=True)
    a.start()                                # rank 0 pushes step 0 (accepted) and waits for rank 1's
    deadline = time.monotonic() + 10
    while groups.groups.get(0) is None or groups.groups[0].contributors != {0}:
        assert time.monotonic() < deadline, "rank 0's push never reached the shard"
        time.sleep(0.01)
    w1.clock = 1                             # rank 1 is a step ahead: its push drops the open step 0
    b = threading.Thread(target=run, args=(w1, s1, 1), daemon=True)
    b.start()
    for t in (a, b):
        t.join(30)
    assert not errors, errors
    assert [w.clock for w, _ in ts] == [2, 2]
    lines = [extra for w, _ in ts for _, _, extra in w.logged]
    assert [extra for _, _, extra in w0.logged] == [{"dropped": True}, {"dropped": False}]
    assert [extra for _, _, extra in w1.logged] == [{"dropped": False}]
    assert shards[0].stats()["dropped"] == sum(e["dropped"] for e in lines) == 1


@unit
@pytest.mark.timeout(60)
def test_a_restarted_worker_continues_at_the_step_of_the_model_it_resumes():
    """Stopping the whole job and starting it again (a coordinator whose last record of
    a worker's clock is older than the trainers' deposits): the restarted worker resumed
    the latest round's best model at the coordinator's clock, so it redid the steps in
    between and its rank trained past train.steps (4867 step lines for 3000 steps after a
    kill -9 of the coordinator and workers). It now continues at the clock of its
    trainer's latest round; a worker ahead of it keeps its own clock, and the budget caps
    it. The shards may hold different rounds (restored from checkpoints of different
    times: no deposit on every shard, so the worker resumes the initial tables): the
    latest on any shard counts. Left behind, its tournaments asked for rounds its partner
    had played long before, and the two trainers waited for each other for good (a psgd
    run that hung)."""
    cfg = ltfb_cfg(**{"mode.round_steps": 3, "train.steps": 30})
    shards, [(w0, _), (w1, s1)] = trainers_on(cfg, 2)
    s1.deposit(w1, 3, 0.5, [0.0, -1.0, math.nan, math.nan], s1.with_opt)
    checkpoint = shards[0].state_dict()
    s1.deposit(w1, 4, 0.5, [0.0, -1.0, math.nan, math.nan], s1.with_opt)
    shards[0].load_state_dict(checkpoint)    # shard 0 holds round 3, shard 1 round 4
    for registered_at, continues_at in [(5, 12), (14, 14)]:
        w1.clock = registered_at
        LtfbSchedule(cfg).start(w1)
        assert w1.clock == continues_at
    w0.clock = 5                             # trainer 0 deposited nothing: where it was is unknown
    LtfbSchedule(cfg).start(w0)
    assert w0.clock == 5
    s1.deposit(w1, 11, 0.5, [0.0, -1.0, math.nan, math.nan], s1.with_opt)   # (a longer job's round)
    w1.clock = 5
    LtfbSchedule(cfg).start(w1)
    assert w1.clock == 30
    # killed after its final deposit (the coordinator had not heard its end): nothing left to train
    s1.deposit(w1, FINAL_ROUND, 0.5, [0.0, -1.0, math.nan, math.nan], s1.with_opt)
    w1.clock = 5
    LtfbSchedule(cfg).start(w1)
    assert w1.clock == 30


class _Tempered(torch.nn.Module):
    """A linear model with a learnable scalar temperature (a 0-dim parameter)."""

    def __init__(self, features: int, classes: int):
        super().__init__()
        self.lin, self.temp = torch.nn.Linear(features, classes), torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return self.lin(x.flatten(1)) * self.temp


def tempered(input_shape, num_classes):
    return _Tempered(math.prod(input_shape), num_classes)


@unit
@pytest.mark.timeout(60)
def test_adam_state_of_a_model_with_a_scalar_parameter_goes_with_its_deposit():
    """Helper C: a model with a 0-dim parameter under Adam aborted at its first tournament
    ("array 4: expected shape [640], got [1]"): Adam's 0-dim `step` has the scalar's shape,
    so it was taken for state shaped like the parameters, and every other parameter's
    `step` went into the deposit as its moment."""
    cfg = ltfb_cfg(**{"mode.exchange": "weights+optimizer", "optimizer.name": "adam",
                      "model.name": f"{__name__}:tempered"})
    _, [(w0, s0), (w1, s1)] = trainers_on(cfg, 2)
    for _ in range(2):
        s0.step(w0)
    for _ in range(3):   # a model apart from w0's
        s1.opt.param_groups[0]["lr"] = 0.5
        w1.compute()
        s1.opt.step()
    keys, _ = s1.opt_state(w1)
    assert keys == ["exp_avg", "exp_avg_sq"]
    s1.deposit(w1, 1, 0.5, [0.0, -1.0, math.nan, math.nan], s1.with_opt)
    theirs = flat(w1.replica.params())
    their_m = flat([s1.opt.state[p]["exp_avg"] for p in w1.replica.model.parameters()])
    w0.replica.score = lambda *a, **k: (float(torch.equal(flat(w0.replica.params()), theirs)), 0.0)
    s0.lead(w0, 1)
    (line,) = [e for e in w0.events if "adopted" in e]
    assert line["adopted"]
    assert torch.equal(flat(w0.replica.params()), theirs)
    assert torch.equal(flat([s0.opt.state[p]["exp_avg"] for p in w0.replica.model.parameters()]), their_m)


@unit
@pytest.mark.timeout(60)
def test_adams_step_count_is_never_taken_for_a_moment():
    """A review: a model of scalars only, or one whose scalar alone had state so far, still
    deposited Adam's `step` as a moment (and a trainer whose other parameters had state
    counted other kinds of state, so adoption skipped the optimizer's state silently)."""
    import types

    class Scalars(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.t, self.v = torch.nn.Parameter(torch.tensor(1.0)), torch.nn.Parameter(torch.ones(3))

    for used in ("both", "scalar only"):
        m = Scalars()
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        (m.t * (m.v.sum() if used == "both" else 2.0)).backward()
        opt.step()
        me = types.SimpleNamespace(opt=opt)
        me._trainable = lambda w, me=me: LtfbSchedule._trainable(me, w)
        keys, _ = LtfbSchedule.opt_state(me, types.SimpleNamespace(replica=types.SimpleNamespace(model=m)))
        assert keys == ["exp_avg", "exp_avg_sq"], used


@unit
@pytest.mark.timeout(60)
def test_an_adopted_adam_state_for_a_parameter_without_one_of_ours_steps_on():
    """A review: adopting a deposit's Adam moments for a parameter ours held no state for
    (no gradient there yet) gave it moments without a step count: Adam's next step on it
    raised KeyError 'step'."""
    cfg = ltfb_cfg(**{"mode.exchange": "weights+optimizer", "optimizer.name": "adam",
                      "model.name": f"{__name__}:tempered"})
    _, [(w0, s0), (w1, s1)] = trainers_on(cfg, 2)
    for _ in range(2):
        s0.step(w0)
    for _ in range(3):
        s1.opt.param_groups[0]["lr"] = 0.5
        w1.compute()
        s1.opt.step()
    temp = w0.replica.model.temp
    del s0.opt.state[temp]                       # ours never had a gradient for it
    s1.deposit(w1, 1, 0.5, [0.0, -1.0, math.nan, math.nan], s1.with_opt)
    theirs = flat(w1.replica.params())
    w0.replica.score = lambda *a, **k: (float(torch.equal(flat(w0.replica.params()), theirs)), 0.0)
    s0.lead(w0, 1)
    assert [e["adopted"] for e in w0.events if "adopted" in e] == [True]
    assert torch.equal(s0.opt.state[temp]["exp_avg"], s1.opt.state[w1.replica.model.temp]["exp_avg"])
    assert s0.opt.state[temp]["step"] == s0.opt.state[w0.replica.model.lin.weight]["step"]
    w0.compute()
    s0.opt.step()                                # no KeyError: 'step'


@unit
@pytest.mark.timeout(60)
def test_deposits_of_unlike_optimizer_state_on_the_shards_leave_the_adopters_state_alone():
    """Helper K: the optimizer state's arrays were counted on shard 0's deposit only: one
    shard holding fewer (deposits no honest trainer makes alike) gave the adopting worker an
    IndexError. Unlike deposits are not one trainer's state: it keeps its own."""
    import numpy as np
    cfg = ltfb_cfg(**{"mode.exchange": "weights+optimizer", "train.steps": 300})
    shards, [(w0, s0), (w1, s1)] = trainers_on(cfg, 2)
    for _ in range(5):
        s1.step(w1)
    own = momentum(s1, w1).clone()
    got = [wire.Message("model", arrays=[np.zeros(sh.P, np.float32), np.zeros(sh.B, np.float32)]
                        + [np.ones(sh.P, np.float32)] * (1 - i)) for i, sh in enumerate(shards)]
    s1.load_opt_state(w1, got)
    assert torch.equal(momentum(s1, w1), own)


def _restarted(cfg: Config, shards: list[Shard], rank: int, clock: int):
    """A new process for `rank` (of 4), registered at `clock`, started: (trainer, schedule)."""
    w = FakeTrainer(cfg, TourLoopback(shards, rank), grad, rank)
    w.holdout = (torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    w.live = lambda: {0, 1, 2, 3}
    w.clock = clock
    s = LtfbSchedule(cfg)
    s.start(w)
    return w, s


@unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [2, 3])
def test_a_worker_rejoining_a_trainer_group_continues_from_its_own_trainers_model(rank):
    """'An ltfb rejoin in group k > 1 loads the best trainer's model': a worker restarted
    into a trainer of 2 resumed the best trainer's deposit, weights and hyperparameters,
    while its group's other worker kept its own trainer's: their group steps averaged the
    gradients of two models, and a restarted leader (rank 2) handed the other trainer's
    model and values to its whole group at its next tournament (the population lost a
    trainer). It now continues from its trainer's latest outcome: the model and values
    that every worker of the trainer left that round with (here its own model, kept
    against a partner's that scored better on the partner's split); before its trainer's
    first round, from the initial model, where its group began."""
    explore = {"optimizer.lr": [0.01, 0.5]}
    cfg = ltfb_cfg(**{"cluster.workers": 4, "mode.trainer_size": 2, "mode.explore": explore})
    shards, ts = trainers_on(cfg, 4)
    initial = flat(ts[0][0].replica.params())
    (w0, s0), (w2, s2) = ts[0], ts[2]
    for w, s, steps in [(w0, s0, 2), (w2, s2, 5)]:   # each trainer's model moves its own way
        for _ in range(steps):
            w.compute()
            s.opt.step()
    s0.deposit_model(w0, 1, 0.9)                     # trainer 0: the best deposit of round 1
    w, s = _restarted(cfg, shards, rank, 2)          # trainer 1 has played no round yet
    assert torch.equal(flat(w.replica.params()), initial)
    assert s.hyper == draw_hyper(explore, cfg.job.seed, 1) and w.clock == 2
    s2.deposit_model(w2, 1, 0.5)                     # trainer 1 keeps its own model at round 1
    s2.deposit(w2, -1, 0.5, [0.0, 0.0, 0.5, 0.3], True)
    ours = flat(w2.replica.params())
    assert not torch.equal(ours, flat(w0.replica.params()))
    w, s = _restarted(cfg, shards, rank, 2)
    assert torch.equal(flat(w.replica.params()), ours)
    assert s.hyper == s2.hyper != s0.hyper and w.clock == 3


@unit
@pytest.mark.timeout(60)
def test_a_worker_taken_back_into_its_group_holds_what_its_other_workers_hold():
    """After a partition (the same process, its optimizer's state kept), a worker of a
    trainer of 2 takes its trainer's outcome: the partner's model that its leader adopted
    (not the model the trainer deposited for the round, nor the best trainer's values),
    with the mutated values and the leader's optimizer state, as `follow` takes it (with
    `mode.exchange = "weights"` too). Its leader gone before the next round's outcome
    (nobody else of its trainer live to deposit it), the model its trainer entered that
    round with; while that round's tournament is under way, it takes the round's outcome
    (`test_a_worker_rejoining_while_its_trainers_tournament_is_under_way_takes_its_outcome`)."""
    explore = {"optimizer.lr": [0.01, 0.5]}
    cfg = ltfb_cfg(**{"cluster.workers": 4, "mode.trainer_size": 2, "mode.explore": explore,
                      "mode.exchange": "weights"})
    _, ts = trainers_on(cfg, 4)
    (w0, s0), (w2, s2), (w3, s3) = ts[0], ts[2], ts[3]
    for w, s, steps in [(w0, s0, 2), (w2, s2, 5), (w3, s3, 1)]:
        for _ in range(steps):
            w.compute()
            s.opt.step()
    s0.deposit_model(w0, 1, 0.9)
    theirs = flat(w0.replica.params())
    w2.replica.score = lambda *a, **k: (0.9 if torch.equal(flat(w2.replica.params()), theirs) else 0.1, 0.0)
    s2.lead(w2, 1)                               # trainer 1 adopts trainer 0's model: its outcome of round 1
    assert [e["adopted"] for e in w2.events] == [True] and s2.hyper != s0.hyper
    hyper, m = dict(s2.hyper), momentum(s2, w2).clone()
    s3.rejoin(w3)
    assert torch.equal(flat(w3.replica.params()), theirs)
    assert s3.hyper == hyper and torch.equal(momentum(s3, w3), m) and w3.clock == 3
    for _ in range(3):                           # round 2: trainer 1's leader deposits, then leaves
        w2.compute()
        s2.opt.step()
    s2.deposit_model(w2, 2, 0.1)
    s0.deposit_model(w0, 2, 0.9)
    w3.live = lambda: {0, 1, 3}
    s3.rejoin(w3)
    assert torch.equal(flat(w3.replica.params()), flat(w2.replica.params()))
    assert s3.hyper == hyper and w3.clock == 6


@unit
def test_an_exact_fetch_of_an_outcome_is_that_rounds_or_refused_never_parked():
    """A worker rejoining its trainer asks for an outcome only of a round it saw in the
    index: the shard answers that round's outcome, or refuses (a race honest workers meet:
    not a bad message); parked, the worker would wait while its group's steps wait for
    its push."""
    from psgd.consistency.rule import Refuse
    cfg = Config().replace(**{"mode.name": "ltfb", "cluster.workers": 4, "mode.trainer_size": 2})
    rule = LtfbRule(cfg.mode, 4, None)
    [no] = rule.fetch(Fetch("a", 1, -1, True, 3))
    assert isinstance(no, Refuse) and not no.bad
    rule.deposit(Deposit("d", 2, -1, 0.0, []))
    assert rule.fetch(Fetch("b", 1, -1, True, 3)) == [AnswerModel("b", ("outcome", 1), {"round": -1, "owner": 1})]
    assert isinstance(rule.fetch(Fetch("c", 1, -2, True, 3))[0], Refuse)
    rule.deposit(Deposit("d2", 2, -2, 0.0, []))
    assert isinstance(rule.fetch(Fetch("e", 1, -1, True, 3))[0], Refuse)
    assert rule.parked() == 0


def _on_shard_0(w, deposit) -> None:
    """`deposit()` from worker `w` reaching shard 0 only (on its way to the others)."""
    shards = w.client.shards
    w.client.shards = shards[:1]
    try:
        deposit()
    finally:
        w.client.shards = shards


@unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("arrives", [False, True])
def test_a_rejoiner_takes_its_trainers_own_round_that_every_shard_holds_not_the_best_trainers(monkeypatch, arrives):
    """A review: with trainer 1's round-2 deposit on shard 0 and not (yet) on shard 1,
    `trainer_model` took its latest round over the union of the shards' indexes (2), whose
    exact fetches (outcome -2, deposit 2) shard 1 refused, and fell back to the best
    trainer's model (trainer 0's: the split group a057133 removed), although trainer 1's
    outcome of round 1 was on every shard. It waits briefly for the deposit to arrive
    (then continues from it, at its round's step); where it does not (shards restored from
    checkpoints of different rounds), from its trainer's own latest round on every shard,
    at that round's step (its group's step moves it on: `group_mean`)."""
    from psgd.consistency import rule
    explore = {"optimizer.lr": [0.01, 0.5]}
    cfg = ltfb_cfg(**{"cluster.workers": 4, "mode.trainer_size": 2, "mode.explore": explore})
    shards, ts = trainers_on(cfg, 4)
    (w0, s0), (w2, s2) = ts[0], ts[2]
    for w, s, steps in [(w0, s0, 2), (w2, s2, 5)]:
        for _ in range(steps):
            w.compute()
            s.opt.step()
    s0.deposit_model(w0, 1, 0.9)
    s2.deposit_model(w2, 1, 0.5)                     # trainer 1 keeps its own model at round 1
    s2.deposit(w2, -1, 0.5, [0.0, 0.0, 0.5, 0.3], True)
    outcome, hyper = flat(w2.replica.params()), dict(s2.hyper)
    for _ in range(3):
        w2.compute()
        s2.opt.step()
    s0.deposit_model(w0, 2, 0.9)                     # the best deposit of round 2, on every shard
    _on_shard_0(w2, lambda: s2.deposit_model(w2, 2, 0.5))
    entered = flat(w2.replica.params())
    waits = []

    def sleep(s):   # the rejoiner waits: the deposit reaches shard 1, or not (an older checkpoint's shard)
        waits.append(s)
        if arrives and len(waits) == 1:
            w2.client.request([(1, "put_model", {"round": 2, "score": 0.5, "step": 6, "tag": s2.deposit_tag,
                                                 "arrays": _deposit_arrays(s2, w2, 2)[1]})])
    monkeypatch.setattr(rule.time, "sleep", sleep)
    w, s = _restarted(cfg, shards, 3, 2)
    assert torch.equal(flat(w.replica.params()), entered if arrives else outcome)
    assert s.hyper == hyper != s0.hyper and w.clock == (6 if arrives else 3) and waits


def _deposit_arrays(s: LtfbSchedule, w, rnd: int) -> list:
    """The per-shard arrays of `s.deposit_model(w, rnd, ...)`, made again with its tag."""
    sent = []
    real = w.client.put_model
    w.client.put_model = lambda r, score, arrays, step, tag: sent.append(arrays)
    try:
        s.deposit_model(w, rnd, 0.5, s.deposit_tag)
    finally:
        w.client.put_model = real
    return sent[0]


@unit
@pytest.mark.timeout(60)
def test_a_rejoiner_under_a_time_budget_takes_its_trainers_last_outcome():
    """A review: under a time budget the leader's last round deposits only its outcome
    (no tournament held: no whole round after it), and no deposit of the round; the
    index's latest round of the trainer was the round before, whose exact outcome fetch
    the shards refused (they keep the newer one), and a rejoiner took the trainer's older
    deposit, a round behind its group. The index tells each trainer's latest outcome."""
    cfg = ltfb_cfg(**{"cluster.workers": 4, "mode.trainer_size": 2, "train.steps": 0, "train.seconds": 60.0})
    shards, ts = trainers_on(cfg, 4)
    w2, s2 = ts[2]
    for _ in range(3):
        w2.compute()
        s2.opt.step()
    s2.deposit_model(w2, 1, 0.5)
    s2.deposit(w2, -1, 0.5, [0.0, 0.0, 0.5, 0.3], True)
    for _ in range(3):
        w2.compute()
        s2.opt.step()
    w2.clock = 6
    w2.now, s2.round_s = lambda: 59.0, 5.0           # round 2: no whole round left before the budget's end
    s2.tournament(w2, 2)
    w, _ = _restarted(cfg, shards, 3, 4)
    assert torch.equal(flat(w.replica.params()), flat(w2.replica.params())) and w.clock == 6


@unit
@pytest.mark.timeout(60)
def test_a_rejoiners_clock_is_the_round_of_the_model_it_loaded():
    """A review: `trainer_model` and `catch_up` each read the shards' indexes: trainer 1's
    round-2 deposit landing between them, a rejoiner loaded the outcome of round 1 and
    jumped to round 2's step (6), a round ahead of the model it held (its group's step
    did not move it back). Its clock is now the round of what it loaded: at step 3 its
    group's step moves it on to round 2's, where it follows round 2's outcome."""
    cfg = ltfb_cfg(**{"cluster.workers": 4, "mode.trainer_size": 2})
    shards, ts = trainers_on(cfg, 4)
    (w2, s2), (w3, s3) = ts[2], ts[3]
    for _ in range(3):
        w2.compute()
        s2.opt.step()
    s2.deposit_model(w2, 1, 0.5)
    s2.deposit(w2, -1, 0.5, [0.0, 0.0, 0.5, 0.3], True)
    outcome = flat(w2.replica.params())
    real = w3.client.get_model

    def get_model(round_, owner, *args, **kw):
        got = real(round_, owner, *args, **kw)
        if round_ == -1:                             # round 2's deposit lands meanwhile
            w2.compute()
            s2.opt.step()
            s2.deposit_model(w2, 2, 0.5)
        return got
    w3.client.get_model = get_model
    w3.clock = 2
    s3.rejoin(w3)
    assert torch.equal(flat(w3.replica.params()), outcome) and w3.clock == 3
