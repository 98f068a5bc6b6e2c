"""easgd's resends across a worker's rejoin: an elastic offer moves the centre once,
whatever the order in which the shard learns of the membership change (from its
heartbeats, up to a beat late) and meets the worker's join, offers and resends; and the
offers of a returning worker's new life move it, also at rounds its earlier life offered.

A review: the rule forgot a rank's answered rounds when the membership said the rank
was back. Said after its offers had been answered (the worker was quicker than the
shard's heartbeat), it forgot them too: a resend of one (its answer lost with a
connection) moved the centre a second time, and was counted in `pushes`, not
`duplicates` (sync: in `dropped` too, answered as a late offer)."""
from __future__ import annotations

import itertools
import types

import numpy as np
import pytest
import torch

from psgd import wire
from psgd.config import Config
from psgd.consistency import rule as R
from psgd.consistency.easgd import EasgdRule
from psgd.shard import Shard

pytestmark = pytest.mark.unit

TAU, P = 2, 4
OLD = 5   # the last round of the earlier life: offered at step 10, its answer lost


def rule_of(sync: bool = False) -> EasgdRule:
    cfg = Config().replace(**{"mode.name": "easgd", "mode.sync": sync, "mode.tau": TAU, "mode.alpha": 0.3,
                              "cluster.workers": 2, "train.steps": 100})
    tables = types.SimpleNamespace(version=0, params=torch.zeros(P), buffers=torch.zeros(0))
    return EasgdRule(cfg.mode, 2, tables)


def offer(name: str, round_: int, x: float) -> R.ElasticOffer:
    return R.ElasticOffer(name, 0, round_, torch.full((P,), x), torch.zeros(0))


def joined(rule: EasgdRule, clock: int) -> int:
    """Rank 0's join at `clock`: the round its answer says to continue after (`offered`)."""
    [a] = [d for d in rule.read(R.Read("join", 0, clock, join=True)) if isinstance(d, R.Answer)]
    return int(a.fields["offered"])


def merges(worker: list, shard: list):
    """Every interleaving of the two sequences, each in its own order."""
    n = len(worker) + len(shard)
    for at in itertools.combinations(range(n), len(shard)):
        w, s = iter(worker), iter(shard)
        yield [next(s) if i in at else next(w) for i in range(n)]


def play(rule: EasgdRule, events: list, join_clock: int) -> dict:
    """Carry out the events on rank 0 (worker 1 stays live): membership changes, the
    join at `join_clock` (the worker then continues where `EasgdSchedule.join` puts it)
    and offers. The names of the offers that moved the centre, with how often; checks
    that the shard's count of each offer (`resent`: `duplicates`, else `pushes`) agrees."""
    moved: dict[str, int] = {}
    first_new = -1
    for ev in events:
        if ev == "leave":
            rule.membership({1: 40})
        elif ev == "return":
            rule.membership({0: join_clock, 1: 40})
        elif ev == "join":
            skip = joined(rule, join_clock)
            clock = join_clock if skip < 0 else max(join_clock, (skip + 1) * TAU)
            first_new = -(-clock // TAU)   # the round of its next exchange
        else:
            name, round_, x = ev
            e = offer(name, first_new if round_ is None else round_, x)
            resent = rule.resent(e)
            moves = [d for d in rule.elastic(e) if isinstance(d, R.Move)]
            assert resent == (not moves), f"{name} counted as {'a resend' if resent else 'an offer'}"
            moved[name] = moved.get(name, 0) + len(moves)
    return moved


SAME_PROCESS = 11   # the process that offered round 5 at step 10 rejoins at its own clock
NEW_PROCESS = 6     # a new process for rank 0 starts at the coordinator's clock for it (its last beat's)
WORKER = {
    # the earlier life's resend comes before the join (a connection's order), and, from
    # the same process, may come after it too: a copy queued in ZeroMQ while the join
    # went on the same-host lane; the process's clock is past its round
    SAME_PROCESS: [[("old resend", OLD, 1.0), "join", ("new", None, 2.0), ("new resend", None, 2.0)],
                   ["join", ("old resend", OLD, 1.0), ("new", None, 2.0), ("new resend", None, 2.0)]],
    NEW_PROCESS: [[("old resend", OLD, 1.0), "join", ("new", None, 2.0), ("new resend", None, 2.0)]],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("join_clock", [SAME_PROCESS, NEW_PROCESS], ids=["same process", "new process"])
def test_async_each_offer_moves_the_centre_once_in_any_order_of_rejoin_and_membership(join_clock):
    """Rank 0 offered round 5 (moved the centre), its answer lost; it was dropped and
    rejoined. Every order of the shard's membership news (leave, return) among the
    worker's resend of round 5, its join, its next offer and that offer's resend: round
    5 moved the centre once, the new offer once. A new process starts at clock 6 and,
    when the shard saw the rank leave before its join, offers round 3 again (a round the
    earlier life offered, its own: it moves the centre); else it continues after round 5."""
    cases = 0
    for worker in WORKER[join_clock]:
        for events in merges(worker, ["leave", "return"]):
            rule = rule_of()
            assert play(rule, [("old", r, 1.0) for r in range(OLD + 1)], join_clock) == {"old": OLD + 1}
            moved = play(rule, events, join_clock)
            assert moved == {"old resend": 0, "new": 1, "new resend": 0}, events
            cases += 1
    assert cases == 15 * len(WORKER[join_clock])   # 6 events, 2 of them the shard's news


@pytest.mark.timeout(60)
def test_async_a_new_process_offers_again_the_rounds_from_its_clock_on():
    """The shard saw rank 0 leave before the new process's join: the join's answer lets
    it start at its clock 6 (round 3), and its offers of rounds 3, 4, 5, which the
    earlier life offered too, move the centre; round 2's resend (the earlier life's: the
    new process never offers it) is still a resend."""
    rule = rule_of()
    play(rule, [("old", r, 1.0) for r in range(OLD + 1)], NEW_PROCESS)
    moved = play(rule, ["leave", "return", "join", ("3", 3, 2.0), ("old 2", 2, 1.0), ("4", 4, 2.0),
                        ("5", 5, 2.0), ("5 again", 5, 2.0), ("6", 6, 2.0)], NEW_PROCESS)
    assert moved == {"3": 1, "old 2": 0, "4": 1, "5": 1, "5 again": 0, "6": 1}


@pytest.mark.timeout(60)
def test_async_a_rank_the_shard_never_saw_leave_continues_after_its_rounds():
    """A rejoin (or a restart) between two of the shard's heartbeats: the shard never saw
    the rank leave, and the join's answer says its last round, which the worker continues
    after (a process restarted before it was missed), whatever the membership says later."""
    rule = rule_of()
    play(rule, [("old", r, 1.0) for r in range(OLD + 1)], NEW_PROCESS)
    assert joined(rule, NEW_PROCESS) == OLD
    assert play(rule, [("6", 6, 2.0), "leave", "return", ("6 again", 6, 2.0), ("5 again", 5, 1.0)],
                NEW_PROCESS) == {"6": 1, "6 again": 0, "5 again": 0}


def shard_of(sync: bool) -> Shard:
    return Shard(Config().replace(**{"mode.name": "easgd", "mode.sync": sync, "cluster.workers": 2,
                                     "cluster.servers": 1, "mode.alpha": 0.3, "mode.tau": 1}), 0)


def elastic(shard: Shard, rank: int, round_: int, x: torch.Tensor, id_: int = 9) -> wire.Message:
    return wire.decode(wire.encode("elastic", id=id_, rank=rank, clock=round_, round=round_,
                                   arrays=[x.numpy(), np.zeros(shard.B, np.float32)]))


def join(rank: int, clock: int) -> wire.Message:
    return wire.decode(wire.encode("pull", id=3, rank=rank, clock=clock, join=True))


def answer(replies: list, token) -> wire.Message:
    return wire.decode(dict(replies)[token])


def counts(shard: Shard) -> tuple[int, int, int, int]:
    return shard.counters["pushes"], shard.counters["duplicates"], shard.stats()["dropped"], shard.version


@pytest.mark.timeout(60)
def test_async_the_shards_counters_after_a_rejoin_the_membership_told_late():
    """Through the shard: rank 0's round 2, answered; its rejoin (at its clock 3), which
    the shard's membership reports only after the new round 3 was answered; the resend
    of round 3 and of round 2 are resends (`duplicates`), the centre unmoved; `dropped`
    counts none."""
    shard = shard_of(sync=False)
    c0 = shard.params.detach().clone()
    shard.handle("r2", elastic(shard, 0, 2, c0 + 1.0))
    assert counts(shard) == (1, 0, 0, 1)
    m = answer(shard.handle("join", join(0, 3)), "join")
    assert m.get("offered") == 2
    shard.handle("r3", elastic(shard, 0, 3, c0 + 2.0))
    assert counts(shard) == (2, 0, 0, 2)
    shard.set_live({1: 0})
    shard.set_live({0: 3, 1: 0})
    centre = shard.params.detach().clone()
    for token, round_, x in (("r3 again", 3, c0 + 2.0), ("r2 again", 2, c0 + 1.0)):
        m = answer(shard.handle(token, elastic(shard, 0, round_, x)), token)
        assert m.get("duplicate") is True, token
        torch.testing.assert_close(torch.from_numpy(m.arrays[0].copy()), 0.3 * (x - centre))
    assert counts(shard) == (2, 2, 0, 2) and torch.equal(shard.params.detach(), centre)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("back_at", [1, 2])
def test_async_a_returning_workers_new_offer_is_counted_and_moves_the_centre(back_at):
    """The shard saw rank 0 leave and return before its join at clock 1 (a new process,
    at the coordinator's clock for it): the join's answer lets it start there, and its
    offer of round 1, which its earlier life offered too, is a push that moves the centre.
    So at clock 2, the round its earlier life offered last (a mutation test: unpinned)."""
    shard = shard_of(sync=False)
    c0 = shard.params.detach().clone()
    for rnd in range(3):
        shard.handle(f"r{rnd}", elastic(shard, 0, rnd, c0 + 1.0))
    shard.set_live({1: 0})
    shard.set_live({0: back_at, 1: 0})
    assert answer(shard.handle("join", join(0, back_at)), "join").get("offered") == -1
    m = answer(shard.handle("again", elastic(shard, 0, back_at, c0 + 2.0)), "again")
    assert not m.get("duplicate") and counts(shard) == (4, 0, 0, 4)


@pytest.mark.timeout(60)
def test_sync_a_resend_after_a_leave_and_return_is_a_resend_not_a_late_offer():
    """Round 0 closed with both offers; worker 0's answer was lost, it left and came
    back, and resends: a resend (`duplicates`, answered `duplicate`), not a late offer
    counted in `pushes` and `dropped` as the forgotten round made it."""
    shard = shard_of(sync=True)
    c0 = shard.params.detach().clone()
    shard.handle("w0", elastic(shard, 0, 0, c0 + 1.0))
    shard.handle("w1", elastic(shard, 1, 0, c0 - 2.0, id_=10))
    assert counts(shard) == (2, 0, 0, 1)
    shard.set_live({1: 1})
    shard.set_live({0: 1, 1: 1})
    m = answer(shard.handle("resend", elastic(shard, 0, 0, c0 + 1.0)), "resend")
    assert m.get("duplicate") is True and m.get("dropped") is None
    assert counts(shard) == (2, 1, 0, 1)


@pytest.mark.timeout(60)
def test_async_a_restored_shard_remembers_the_ranks_that_left():
    """A shard checkpointed after rank 0 left and restored before its new process joins:
    the restored rule still begins the rank's new life at the join (its rounds from the
    join's clock on move the centre), as the rule that saw it leave would."""
    rule = rule_of()
    play(rule, [("old", r, 1.0) for r in range(OLD + 1)], NEW_PROCESS)
    play(rule, ["leave"], NEW_PROCESS)
    restored = rule_of()
    restored.load_state_dict(rule.state_dict())
    moved = play(restored, ["return", "join", ("3", 3, 2.0), ("old 2", 2, 1.0)], NEW_PROCESS)
    assert moved == {"3": 1, "old 2": 0}
