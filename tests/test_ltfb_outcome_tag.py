"""LTFB deposits (`put_model` of round r: the model a trainer enters round r with, or its
final model; of round -r: its outcome) read from every shard: every slice of one
deposit, never a mix of two.

A leader killed partway through depositing (on shard 0, not on shard 1: the puts go in
parallel, and a SIGKILL drops what ZeroMQ had not sent) and restarted at once deposits
the round again (it plays the round again, `left_unplayed`, or, its first deposit on
no shard whole, trains again from an earlier model): B, which may differ from A,
replaces A. A reader that asked in between had A's slice from shard 0 and B's from
shard 1: a follower's replica was its leader's no longer, and a partner scored (and
could adopt) a model of no trainer. Each deposit carries a tag that names it; readers
ask again where the slices' tags differ.
"""
from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from psgd import wire
from psgd.consistency.ltfb import LtfbRule, LtfbSchedule, global_model, trainer_model
from psgd.consistency.rule import Deposit, Fetch
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


def deposited(w, s: LtfbSchedule, reach: set[int], rnd: int = -1) -> tuple[list[torch.Tensor], Partly]:
    """The leader's replica moved on, deposited as round `rnd` (by default round 1's
    outcome) on the shards in `reach`: (its slices, the client that sent it)."""
    with torch.no_grad():
        for p in w.replica.model.parameters():
            p.add_(1.0)
    w.client = Partly(w.client.shards, w.rank, reach)
    if rnd < 0:
        s.deposit(w, rnd, 0.5, META, True)
    else:
        s.deposit_model(w, rnd, 0.5)
    return [t.clone() for t in w.replica.params()], w.client


def slices_of(got: list, model: list[torch.Tensor]) -> list[bool]:
    """Which shards' answers hold `model`'s slice (a deposit's first array: its weights)."""
    return [torch.equal(wire.tensor(m, 0), model[i]) for i, m in enumerate(got)]


def reading(shards: list[Shard], w, rank: int) -> None:
    """Rank `rank`'s worker `w` reads as ParameterClient does (its requests wait where a
    shard parks them), and keeps its notes."""
    w.client = WaitingLoopback(shards, rank)
    w.notes = []
    w.note = w.notes.append


def group():
    """Trainer 0's leader (rank 0) and follower (rank 1), on two shards."""
    shards, ts = trainers_on(group_cfg(), 4)
    (w0, s0), (w1, s1) = ts[0], ts[1]
    reading(shards, w1, 1)
    return shards, (w0, s0), (w1, s1)


def parked_on_shard_1(shards: list[Shard], read, exchange: str = "outcomes") -> threading.Thread:
    """`read()` on a thread of its own, once its request is parked on shard 1 (in the
    rule's `outcomes`, or its `exchange` of tournament deposits)."""
    t = threading.Thread(target=read, daemon=True)
    t.start()
    deadline = time.monotonic() + WaitingLoopback.GIVE_UP_S
    while not getattr(shards[1].rule, exchange).parked and time.monotonic() < deadline:
        time.sleep(0.01)
    assert getattr(shards[1].rule, exchange).parked, "the reader's request is not parked on shard 1"
    return t


def following(shards: list[Shard], w1, s1) -> threading.Thread:
    """The follower's `follow` of round 1 on a thread of its own, once it is parked on shard 1."""
    return parked_on_shard_1(shards, lambda: s1.follow(w1, 1, 0))


def partners(rnd_own: float = 0.4):
    """Trainer 0's leader (rank 0) and trainer 1's (rank 2, its round-1 model deposited,
    scored `rnd_own`), on two shards; rank 2 reads as ParameterClient does."""
    shards, ts = trainers_on(group_cfg(), 4)
    (w0, s0), (w2, s2) = ts[0], ts[2]
    reading(shards, w2, 2)
    s2.deposit_model(w2, 1, rnd_own)
    return shards, (w0, s0), (w2, s2)


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
    a, _ = deposited(w0, s0, {0})
    t = following(shards, w1, s1)
    b, _ = deposited(w0, s0, {0, 1})
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
    deposited(w0, s0, {0})
    t = following(shards, w1, s1)
    t0 = time.monotonic()
    deposited(w0, s0, {1})
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
    deposited(w0, s0, {0})
    b, sent = deposited(w0, s0, {1})
    got, rnd = trainer_model(Arriving(shards, 2, lambda: WaitingLoopback.request(sent, sent.lost)), 0)
    assert rnd == 1 and int(got[0].get("round")) == -1
    assert all(torch.equal(wire.tensor(m, 0), b[i]) for i, m in enumerate(got)), "slices of two outcomes"


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_the_deposits_tags_survive_a_checkpoint_and_an_older_checkpoint_loads(tmp_path):
    """A shard restored from its checkpoint answers with the tags that the round's
    deposit and its outcome were deposited with; a checkpoint from before deposit tags
    (none, or the outcomes' alone, kept by trainer) loads, and its untagged deposits are
    taken as one deposit when every shard's is untagged."""
    shards, (w0, s0), (w1, s1) = group()
    deposited(w0, s0, {0, 1}, 1)
    deposited(w0, s0, {0, 1})

    def tags() -> list:
        return [m.get("tag") for rnd in (1, -1) for m in w1.client.get_model(rnd, 0)]

    held = tags()
    assert None not in held and held[0] == held[1] != held[2] == held[3]
    for i, s in enumerate(shards):
        s.save(str(tmp_path / f"shard{i}.pt"))
        shards[i] = Shard(s.cfg, i)
        shards[i].load(str(tmp_path / f"shard{i}.pt"))
    assert tags() == held
    for s in shards:
        sd = s.state_dict()
        older = {k: v for k, v in sd["rule"].items() if k != "deposit_tags"}
        s.load_state_dict({**sd, "rule": {**older, "tags": [[0, held[2]]]}})   # (the outcomes', by trainer)
    assert tags() == [None] * 4
    assert int(global_model(w1.client)[0].get("round")) == 1
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


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_partners_fetch_takes_every_slice_of_the_round_deposited_again_never_a_mix():
    """Trainer 0's round-1 model A on shard 0 only (its leader killed partway), trainer
    1's leader fetching it answered A by shard 0 and parked on shard 1, then the
    restarted leader's round-1 deposit B on every shard: the fetch gives B's slices only,
    the model that trainer 0 entered the round with, not a mix that it never held."""
    shards, (w0, s0), (w2, s2) = partners()
    a, _ = deposited(w0, s0, {0}, 1)
    out: dict = {}
    t = parked_on_shard_1(shards, lambda: out.update(got=s2.fetch(w2, 1, 0, 0.4)), "exchange")
    b, _ = deposited(w0, s0, {0, 1}, 1)
    ended(t)
    assert not torch.equal(a[0], b[0])
    assert out["got"] is not None, w2.notes
    assert slices_of(out["got"], b) == [True, True], "A's slice from shard 0 beside B's from shard 1: a mix"


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_partners_fetch_whose_slices_stay_of_two_deposits_gives_none_in_bounded_time():
    """B reached shard 1 only (its leader killed again): shard 0 keeps A. The fetch asks
    again a bounded number of times, then gives nothing, as when the partner does not
    deliver: the trainer keeps its own model (`select`), never scores the mix."""
    shards, (w0, s0), (w2, s2) = partners()
    deposited(w0, s0, {0}, 1)
    out: dict = {}
    t = parked_on_shard_1(shards, lambda: out.update(got=s2.fetch(w2, 1, 0, 0.4)), "exchange")
    t0 = time.monotonic()
    deposited(w0, s0, {1}, 1)
    ended(t)
    assert time.monotonic() - t0 < WaitingLoopback.GIVE_UP_S
    assert out["got"] is None and any("did not deliver its model" in n for n in w2.notes), w2.notes


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_the_global_model_is_never_a_mix_of_two_deposits_of_its_round():
    """Trainer 0's round-1 model A on shard 0, B on shard 1 (on its way to shard 0):
    every shard's index holds (round 1, trainer 0), the best. While B does not come,
    `global_model` gives the shards' tables, as with no deposit on every shard; once it
    comes, B's slices only."""
    shards, (w0, s0), _ = group()
    deposited(w0, s0, {0}, 1)
    b, sent = deposited(w0, s0, {1}, 1)
    assert global_model(TourLoopback(shards, 2))[0].get("owner") is None, "took a mix of two deposits"
    got = global_model(Arriving(shards, 2, lambda: WaitingLoopback.request(sent, sent.lost)))
    assert int(got[0].get("round")) == 1 and slices_of(got, b) == [True, True], "slices of two deposits"


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_rejoiner_takes_one_deposit_of_the_round_while_another_replaces_it():
    """`trainer_model` with round 1's deposit A on shard 0 and B on shard 1 (B on its way
    to shard 0), no outcome yet: it reads again, and continues from B's slices only."""
    shards, (w0, s0), _ = group()
    deposited(w0, s0, {0}, 1)
    b, sent = deposited(w0, s0, {1}, 1)
    got, rnd = trainer_model(Arriving(shards, 2, lambda: WaitingLoopback.request(sent, sent.lost)), 0)
    assert rnd == 1 and int(got[0].get("round")) == 1
    assert slices_of(got, b) == [True, True], "slices of two deposits"


@pytest.mark.unit
def test_the_shard_answers_each_deposit_with_its_tag_and_forgets_it_with_the_deposit():
    """The rule keeps a tag per stored model, as it keeps the player: a round's deposit
    and an outcome are answered with their own, and a deposit's goes when it is forgotten."""
    rule = LtfbRule(group_cfg().mode, 4, None)
    for rnd, tag in [(1, 11), (2, 12), (-2, 13)]:
        rule.deposit(Deposit(f"d{rnd}", 0, rnd, 0.5, [], tag))
    assert rule.fetch(Fetch("f", 0, 2, exact=True))[0].fields["tag"] == 12
    assert rule.fetch(Fetch("o", 0, -2, exact=True))[0].fields["tag"] == 13
    assert set(rule.tags) == {(2, 0), ("outcome", 0)}, "round 1's tag outlived its deposit"


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_deposit_made_again_for_a_shard_that_lost_it_keeps_its_tag():
    """`keep_deposit` makes the same deposit again (the replica still holds it): with a
    tag of its own, a partner parked on the shard that lost it had two tags, and read again."""
    shards, (w0, s0), (w2, s2) = partners()
    before = shards[1].state_dict()
    s0.deposit_model(w0, 1, 0.5)
    tags = [m.get("tag") for m in w2.client.get_model(1, 0)]
    shards[1].load_state_dict(before)                  # shard 1 restored without it
    s0.keep_deposit(w0, 1, 0.5)
    assert tags[0] is not None and [m.get("tag") for m in w2.client.get_model(1, 0)] == tags


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("rnd", [1, -1], ids=["deposit", "outcome"])
def test_a_shard_restored_between_two_deposits_of_a_round_is_given_the_second_again(tmp_path, rnd):
    """Shard 1 restored from a checkpoint taken between deposits A and B of the same round
    (a leader restarted partway through depositing it) holds A, the others B: no reader
    takes that round (`one_deposit`), and a shard's index said only the round, so the
    leader found nothing lost. `keep_deposit` (`keep_outcome`) now tells A from B by the
    index's tags, and makes B again on every shard."""
    shards, (w0, s0), (w1, s1) = group()
    deposited(w0, s0, {0, 1}, rnd)
    shards[1].save(str(tmp_path / "shard1.pt"))
    b, _ = deposited(w0, s0, {0, 1}, rnd)
    shards[1].load(str(tmp_path / "shard1.pt"))

    def tags() -> list:
        return [m.get("tag") for m in w1.client.get_model(rnd, 0)]

    def keep() -> None:
        if rnd < 0:
            s0.keep_outcome(w0, *s0.outcome)
        else:
            s0.keep_deposit(w0, rnd, 0.5)

    assert len(set(tags())) == 2
    w0.notes = []
    w0.note = w0.notes.append
    keep()
    assert len(set(tags())) == 1 and any("depositing it again" in n for n in w0.notes), w0.notes
    assert slices_of(w1.client.get_model(rnd, 0), b) == [True, True]
    keep()
    assert len(w0.notes) == 1, "deposited again where every shard held it"
