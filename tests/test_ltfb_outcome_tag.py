"""LTFB outcomes (`put_model` of round -r) read from every shard: every slice of one
deposit, never a mix of two.

A leader killed partway through depositing its round's outcome A (on shard 0, not on
shard 1: the puts go in parallel, and a SIGKILL drops what ZeroMQ had not sent) and
restarted at once plays the round again (`left_unplayed`) and may reach another
outcome, B, which replaces A. A follower that asked in between had A's slice from
shard 0 and B's from shard 1: its replica was its leader's no longer. Each outcome
deposit now carries a tag that names it; readers ask again where the slices' tags differ.
"""
from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from psgd import wire
from psgd.consistency.ltfb import LtfbSchedule, trainer_model
from psgd.shard import Shard
from tests.loopback import flat
from tests.test_ltfb import TourLoopback, WaitingLoopback, trainers_on
from tests.test_ltfb_waits import group_cfg

META = [0.0, -1.0, 0.5, math.nan]   # an outcome's values: kept its own model, no partner


class Partly(WaitingLoopback):
    """A leader's client killed partway through its requests: they reach only the shards
    in `reach`; the others' are kept in `lost` (what ZeroMQ had not sent yet)."""

    def __init__(self, shards: list[Shard], rank: int, reach: set[int]):
        super().__init__(shards, rank)
        self.reach, self.lost = reach, []

    def request(self, reqs, cancel=None):
        self.lost += [r for r in reqs if r[0] not in self.reach]
        return super().request([r for r in reqs if r[0] in self.reach], cancel)


def outcome(w, s: LtfbSchedule, reach: set[int]) -> tuple[list[torch.Tensor], Partly]:
    """The leader's replica moved on, deposited as round 1's outcome on the shards in
    `reach`: (its slices, the client that sent it)."""
    with torch.no_grad():
        for p in w.replica.model.parameters():
            p.add_(1.0)
    w.client = Partly(w.client.shards, w.rank, reach)
    s.deposit(w, -1, 0.5, META, True)
    return [t.clone() for t in w.replica.params()], w.client


def group():
    """Trainer 0's leader (rank 0) and follower (rank 1), on two shards."""
    shards, ts = trainers_on(group_cfg(), 4)
    (w0, s0), (w1, s1) = ts[0], ts[1]
    w1.client = WaitingLoopback(shards, 1)
    w1.notes = []
    w1.note = w1.notes.append
    return shards, (w0, s0), (w1, s1)


def following(shards: list[Shard], w1, s1) -> threading.Thread:
    """The follower's `follow` of round 1 on a thread of its own, once it is parked on shard 1."""
    t = threading.Thread(target=s1.follow, args=(w1, 1, 0), daemon=True)
    t.start()
    deadline = time.monotonic() + WaitingLoopback.GIVE_UP_S
    while not shards[1].rule.outcomes.parked and time.monotonic() < deadline:
        time.sleep(0.01)
    assert shards[1].rule.outcomes.parked, "the follower's request is not parked on shard 1"
    return t


def ended(t: threading.Thread) -> None:
    t.join(2 * WaitingLoopback.GIVE_UP_S)
    assert not t.is_alive(), "the follower still waits"


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_follower_takes_every_slice_of_the_outcome_deposited_again_never_a_mix():
    """Outcome A on shard 0 only (its leader killed partway), the follower answered A by
    shard 0 and parked on shard 1, then the restarted leader's outcome B on every shard:
    the follower ends with B's slices only, its leader's model."""
    shards, (w0, s0), (w1, s1) = group()
    a, _ = outcome(w0, s0, {0})
    t = following(shards, w1, s1)
    b, _ = outcome(w0, s0, {0, 1})
    ended(t)
    assert not torch.equal(a[0], b[0])
    got = [t.detach() for t in w1.replica.params()]
    assert torch.equal(got[1], b[1]), "not B's slice from shard 1"
    assert torch.equal(got[0], b[0]), "A's slice from shard 0 beside B's from shard 1: a mix of two outcomes"
    assert [e["round"] for e in w1.events] == [1]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_follower_whose_slices_stay_of_two_outcomes_keeps_its_model_in_bounded_time():
    """Outcome B reached shard 1 only (its leader killed again): shard 0 keeps A. The
    follower asks again a bounded number of times, then keeps its own model, as when its
    leader leaves before its outcome; it never takes the mix, nor waits for good."""
    shards, (w0, s0), (w1, s1) = group()
    before = flat(w1.replica.params())
    outcome(w0, s0, {0})
    t = following(shards, w1, s1)
    t0 = time.monotonic()
    outcome(w0, s0, {1})
    ended(t)
    assert time.monotonic() - t0 < WaitingLoopback.GIVE_UP_S
    assert torch.equal(flat(w1.replica.params()), before), "took a mix of two outcomes"
    assert not w1.events and any("different deposits" in n for n in w1.notes), w1.notes


class Arriving(TourLoopback):
    """A reader's client: once it has fetched an outcome, `arrive()` runs (a deposit's
    request on its way to a shard reaches it)."""

    def __init__(self, shards: list[Shard], rank: int, arrive):
        super().__init__(shards, rank)
        self.arrive = arrive

    def get_model(self, *args, **kw):
        got = super().get_model(*args, **kw)
        self.arrive, arrive = (lambda: None), self.arrive
        arrive()
        return got


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_rejoiner_takes_one_outcome_while_another_replaces_it():
    """`trainer_model` with round 1's outcome A on shard 0 and B on shard 1 (B on its
    way to shard 0): it reads again, and continues from B's slices only."""
    shards, (w0, s0), _ = group()
    s0.deposit_model(w0, 1, 0.5)
    outcome(w0, s0, {0})
    b, sent = outcome(w0, s0, {1})
    got, rnd = trainer_model(Arriving(shards, 2, lambda: WaitingLoopback.request(sent, sent.lost)), 0)
    assert rnd == 1 and int(got[0].get("round")) == -1
    assert all(torch.equal(wire.tensor(m, 0), b[i]) for i, m in enumerate(got)), "slices of two outcomes"


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_the_outcomes_tag_survives_a_checkpoint_and_an_older_checkpoint_loads(tmp_path):
    """A shard restored from its checkpoint answers with the tag the outcome was
    deposited with; a checkpoint from before tags loads, and its untagged outcome is
    taken as one deposit when every shard's is untagged."""
    shards, (w0, s0), (w1, s1) = group()
    outcome(w0, s0, {0, 1})
    tags = [m.get("tag") for m in w1.client.get_model(-1, 0)]
    assert tags[0] is not None and tags[0] == tags[1]
    for i, s in enumerate(shards):
        s.save(str(tmp_path / f"shard{i}.pt"))
        shards[i] = Shard(s.cfg, i)
        shards[i].load(str(tmp_path / f"shard{i}.pt"))
    assert [m.get("tag") for m in w1.client.get_model(-1, 0)] == tags
    for s in shards:
        sd = s.state_dict()
        s.load_state_dict({**sd, "rule": {k: v for k, v in sd["rule"].items() if k != "tags"}})
    assert [m.get("tag") for m in w1.client.get_model(-1, 0)] == [None, None]
    s1.follow(w1, 1, 0)
    assert torch.equal(flat(w1.replica.params()), flat(w0.replica.params()))


@pytest.mark.unit
def test_a_round_is_played_again_only_where_every_shard_says_this_rank_deposited_it():
    """`left_unplayed` on a deposit whose slices name two players (another rank played
    the round too: it deposits the outcome) plays nothing again."""
    s = LtfbSchedule(group_cfg())
    s.trainer = 0
    w = type("W", (), {"rank": 0, "clock": 3})()
    mine = wire.Message("reply", 1, 0, 0, {"round": 1, "owner": 0, "player": 0})
    theirs = wire.Message("reply", 1, 0, 0, {"round": 1, "owner": 0, "player": 1})
    assert s.left_unplayed(w, [mine, mine], 1)
    assert not s.left_unplayed(w, [mine, theirs], 1)
