"""A push is applied once across its worker's leave and return, whatever the order in
which the shard learns of the membership change (from its heartbeats, up to a beat
late) and meets the worker's join, its pushes and their resends (the client resends
after `retry_s` without an answer); and a returning worker's new pushes are applied.

A review: `Shard.set_live` forgot a rank's last clock when the membership said the rank
was back. Said after the returning worker's pushes were answered (the worker was quicker
than the shard's heartbeat), or after a leave and return that the shard heard only late,
it forgot those too: a resend of one (its answer lost with a connection) was applied a
second time in async and ssp, and counted in `pushes`, not `duplicates`; in sync, whose
step barrier keeps a step from taking a rank twice, it was answered and counted as a late
push dropped, though its worker's push had been applied. A returning worker never needs
the clocks forgotten: its join's answer puts it past them (`finished`, or sync's `step`)."""
from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest

from psgd import wire
from psgd.config import Config
from psgd.consistency import get as get_mode
from psgd.consistency.pushpull import PushPullSchedule
from psgd.shard import Shard

pytestmark = pytest.mark.unit

OLD = 3             # rank 0's last push of its earlier life (clocks 0..3): applied, its answer lost
SAME_PROCESS = 4    # the process that pushed clock 3 rejoins at its own clock
NEW_PROCESS = 2     # a new process for rank 0 registers at the coordinator's clock for it (a beat old)


def config(mode: str) -> Config:
    return Config().replace(**{"mode.name": mode, "cluster.workers": 2, "cluster.servers": 1, "train.steps": 20})


def push(shard: Shard, rank: int, clock: int, read_version: int | None = None, rid: int | None = None,
         **fields) -> wire.Message:
    """A push of ones (request id `rid`, default clock + 1), of a read of `read_version`
    (default the shard's current version)."""
    return wire.decode(wire.encode("push", id=clock + 1 if rid is None else rid, rank=rank, clock=clock,
                                   read_version=shard.version if read_version is None else read_version,
                                   arrays=[np.ones(shard.P, np.float32), np.zeros(shard.B, np.float32)], **fields))


def join(rank: int, clock: int) -> wire.Message:
    return wire.decode(wire.encode("pull", id=99, rank=rank, clock=clock, join=True))


def answer(replies: list, token: str) -> wire.Message:
    return wire.decode(dict(replies)[token])


class Worker:
    """Rank 0 of a two-worker job against one shard (rank 1 stays live, and pushes only
    where a test says): its pushes, resends, join, and the shard's membership news."""

    def __init__(self, mode: str):
        self.mode = mode
        self.shard = Shard(config(mode), 0)
        self.sent: dict[str, wire.Message] = {}   # each push by name, as first sent (a resend repeats it)
        self.applied: dict[str, int] = {}         # how many times each push moved the shard's version
        self.answers: dict[str, wire.Message] = {}
        self.clock = 0                             # where the worker pushes next (after its join)

    def push(self, name: str, clock: int, rank: int = 0) -> wire.Message:
        """Push (or resend, if `name` was sent before) the push `name` at `clock`."""
        msg = self.sent.setdefault(name, push(self.shard, rank, clock))
        before = self.shard.version
        m = answer(self.shard.handle(name, msg), name)
        self.applied[name] = self.applied.get(name, 0) + self.shard.version - before
        self.answers[name] = m
        return m

    def join(self, clock: int) -> None:
        """Rank 0's join read at `clock`; it continues where its schedule's rejoin puts it
        (`PushPullSchedule.rejoin`: the largest of its clock and the answers' resume clock)."""
        m = answer(self.shard.handle("join", join(0, clock)), "join")
        schedule = get_mode(self.mode).schedule(config(self.mode))
        assert isinstance(schedule, PushPullSchedule)
        self.clock = max(clock, schedule.resume_clock([m]))

    def news(self, event: str, clock: int) -> None:
        """The shard's heartbeat says rank 0 left, or is back (at the coordinator's clock for it)."""
        self.shard.set_live({1: 0} if event == "leave" else {0: clock, 1: 0})

    def counts(self) -> tuple[int, int, int]:
        s = self.shard.stats()
        return s["pushes"], s["duplicates"], s["dropped"]


def merges(worker: list, shard: list) -> Iterator[list]:
    """Every interleaving of the two sequences, each in its own order."""
    n = len(worker) + len(shard)
    for at in itertools.combinations(range(n), len(shard)):
        w, s = iter(worker), iter(shard)
        yield [next(s) if i in at else next(w) for i in range(n)]


def play(mode: str, events: list, join_clock: int) -> Worker:
    """Rank 0 pushed clocks 0..OLD (applied); then the events: the shard's news ("leave",
    "return"), rank 0's "join" at `join_clock`, and pushes (name, clock: None for the clock
    the join put it at)."""
    w = Worker(mode)
    for c in range(OLD + 1):
        w.push(f"old {c}", c)
    for ev in events:
        if ev in ("leave", "return"):
            w.news(ev, join_clock)
        elif ev == "join":
            w.join(join_clock)
        else:
            name, clock = ev
            w.push(name, w.clock if clock is None else clock, rank=1 if name == OTHER[0] else 0)
    return w


# The earlier life's resend comes before the join (a connection's order), and, from the
# same process, may come after it too: a copy queued in ZeroMQ while the join went on the
# same-host lane. A new process's pushes never repeat its earlier life's clock 3.
RESEND = (f"old {OLD}", OLD)
OTHER = ("rank 1's", 0)   # rank 1's push, applied while rank 0 is away
WORKER = {
    SAME_PROCESS: [[RESEND, "join", ("new", None), ("new", None)],
                   ["join", RESEND, ("new", None), ("new", None)]],
    NEW_PROCESS: [[RESEND, "join", ("new", None), ("new", None)]],
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("join_clock", [SAME_PROCESS, NEW_PROCESS], ids=["same process", "new process"])
def test_async_each_push_is_applied_once_in_any_order_of_rejoin_and_membership(join_clock):
    """Rank 0's push of clock 3 was applied, its answer lost; it was dropped and
    rejoined. Every order of the shard's news (leave, return) among the worker's resend of
    clock 3, its join, its next push and that push's resend: clock 3 applied once, the
    new push once, both resends answered `duplicate` and counted so."""
    cases = 0
    for worker in WORKER[join_clock]:
        for events in merges(worker, ["leave", "return"]):
            w = play("async", events, join_clock)
            assert w.clock == OLD + 1, events   # a new process too continues past its rank's clocks
            assert w.applied == {**{f"old {c}": 1 for c in range(OLD + 1)}, "new": 1}, events
            assert w.answers["new"].get("duplicate") is True and w.answers["new"].get("dropped") is None, events
            assert w.counts() == (OLD + 2, 2, 0), events
            cases += 1
    assert cases == 15 * len(WORKER[join_clock])   # 6 events, 2 of them the shard's news


@pytest.mark.timeout(60)
@pytest.mark.parametrize("others", [False, True], ids=["alone", "rank 1 pushes while it is away"])
@pytest.mark.parametrize("join_clock", [SAME_PROCESS, NEW_PROCESS], ids=["same process", "new process"])
def test_ssp_no_push_is_applied_twice_in_any_order_of_rejoin_and_membership(join_clock, others):
    """As in async. SSP also drops a push that its worker sent before its first read since
    the shard saw it leave, where an update was applied while it was away
    (`SspRule.from_before_leaving`): a leave heard between the join and the new push, and
    rank 1's push applied after the leave and before that new push, drop it (answered
    `dropped`, counted; its resend says so again); otherwise it is applied, once. Nothing
    applied while it was away (rank 0 alone), it is applied: its gradient is as fresh as
    if it had never left (a push of tau 0 was dropped before)."""
    news = ["leave", OTHER, "return"] if others else ["leave", "return"]
    drops = 0
    for worker in WORKER[join_clock]:
        for events in merges(worker, news):
            w = play("ssp", events, join_clock)
            new = events.index(("new", None))
            dropped = others and events.index("join") < events.index("leave") and events.index(OTHER) < new
            assert w.clock == OLD + 1, events
            assert w.applied == {**{f"old {c}": 1 for c in range(OLD + 1)}, "new": 0 if dropped else 1,
                                 **({OTHER[0]: 1} if others else {})}, events
            assert w.answers["new"].get("duplicate") is True, events
            assert w.answers["new"].get("dropped") is (True if dropped else None), events
            assert w.counts() == (OLD + 2 + others, 2, int(dropped)), events
            drops += dropped
    assert bool(drops) is others


@pytest.mark.timeout(60)
@pytest.mark.parametrize("other", [None, "before", "away"])
def test_ssp_a_push_computed_before_a_leave_and_sent_after_the_return_is_dropped_only_past_updates(other):
    """Rank 0's push computed on its copy before it left (prefetch) and sent after its join
    read: dropped where rank 1's push was applied while it was away (as stale as the others
    ran on), applied where nothing was (as fresh as if it had stayed), though rank 1's push
    applied before the leave, while rank 0 was still waited for, is not in its read (that
    one was dropped before)."""
    w = Worker("ssp")
    for c in range(OLD + 1):
        w.push(f"old {c}", c)
    w.sent["early"] = push(w.shard, 0, OLD + 1)   # (read_version: the shard's version now)
    if other == "before":
        w.push(*OTHER, rank=1)
    w.news("leave", SAME_PROCESS)
    if other == "away":
        w.push(*OTHER, rank=1)
    w.news("return", SAME_PROCESS)
    w.join(SAME_PROCESS)
    m = w.push("early", OLD + 1)
    dropped = other == "away"
    assert m.get("dropped") is (True if dropped else None) and w.applied["early"] == int(not dropped)
    assert w.counts() == (OLD + 2 + bool(other), 0, int(dropped))   # (a dropped push is counted in pushes too)


def pushed(shard: Shard, rank: int, clock: int, read_version: int) -> tuple[int, bool]:
    """A push of ones at `clock` computed on the read of `read_version`: (how far it moved the
    shard's version, whether its answer says dropped)."""
    before = shard.version
    m = answer(shard.handle("p", push(shard, rank, clock, read_version, 1000 + clock)), "p")
    return shard.version - before, m.get("dropped") is True


def reads(shard: Shard, rank: int, clock: int) -> bool:
    """A read at `clock`: whether it was answered (not parked)."""
    return bool(shard.handle("r", wire.decode(wire.encode("pull", id=5000 + clock, rank=rank, clock=clock))))


def ssp_shard(**keys) -> Shard:
    shard = Shard(config("ssp").replace(**keys), 0)
    for c in range(OLD + 1):
        pushed(shard, 0, c, shard.version)
    return shard


@pytest.mark.timeout(60)
@pytest.mark.parametrize("read_between", [False, True])
def test_ssp_a_second_leave_keeps_what_the_first_absence_missed(read_between):
    """Rank 0 left, rank 1 pushed meanwhile, rank 0 read again (its push from before was
    dropped), came back and left again with nothing applied since: a prefetched push computed
    before the first leave still lacks rank 1's update, and is dropped (a review: the second
    leave's version, or a second read, let it through)."""
    shard = ssp_shard()
    copy = shard.version                              # rank 0's read before it left
    shard.set_live({1: 0})                            # the first leave
    assert pushed(shard, 1, 0, shard.version) == (1, False)
    assert pushed(shard, 0, OLD + 1, copy) == (0, True)
    reads(shard, 0, OLD + 2)
    shard.set_live({0: OLD + 2, 1: 1})                # back
    shard.set_live({1: 1})                            # the second leave, nothing applied since
    if read_between:
        reads(shard, 0, OLD + 2)
    assert pushed(shard, 0, OLD + 2, copy) == (0, True)


@pytest.mark.timeout(60)
def test_ssp_a_later_absence_is_judged_on_its_own():
    """Rank 0 left once while rank 1 pushed, came back, and trained on; later it left again
    with nothing applied meanwhile: its prefetched push from before the second leave, sent
    after its read, missed nothing and is applied (a last read: judged since the first leave
    of the run, it was dropped). One from before the first leave is still dropped."""
    shard = ssp_shard(**{"mode.prefetch": True})
    first = shard.version
    shard.set_live({1: 0})
    assert pushed(shard, 1, 0, shard.version) == (1, False)
    reads(shard, 0, OLD + 1)
    shard.set_live({0: OLD + 1, 1: 1})
    for c in range(OLD + 1, OLD + 4):
        assert pushed(shard, 0, c, shard.version) == (1, False)
    second = shard.version - 1                     # (the read its next prefetched push is computed on)
    shard.set_live({1: 1})
    assert pushed(shard, 0, OLD + 4, shard.version) == (1, False)   # (in flight at the leave)
    reads(shard, 0, OLD + 5)
    assert pushed(shard, 0, OLD + 5, second) == (1, False)
    assert pushed(shard, 0, OLD + 6, first) == (0, True)


@pytest.mark.timeout(60)
def test_ssp_past_its_many_absences_a_worker_is_judged_no_less_strictly():
    """Past MAX_ABSENCES a rank's two oldest absences count as one: a push from before the
    first, which rank 1's update made while it was away, is still dropped."""
    from psgd.consistency.ssp import MAX_ABSENCES
    shard = ssp_shard()
    first = shard.version
    shard.set_live({1: 0})
    assert pushed(shard, 1, 0, shard.version) == (1, False)
    for k in range(MAX_ABSENCES + 2):
        reads(shard, 0, OLD + 1 + k)
        shard.set_live({0: OLD + 1, 1: 1})
        shard.set_live({1: 1})
    reads(shard, 0, OLD + 2)
    assert len(shard.rule.absences[0]) == MAX_ABSENCES
    assert pushed(shard, 0, OLD + 1, first) == (0, True)


@pytest.mark.timeout(60)
def test_ssp_the_first_leave_before_a_read_counts_not_a_second():
    """Left, rank 1 pushed, back and left again before any read of rank 0: its push from
    before the first leave missed rank 1's update and is dropped (the second leave's version,
    after that update, would have let it through)."""
    shard = ssp_shard()
    copy = shard.version
    shard.set_live({1: 0})
    assert pushed(shard, 1, 0, shard.version) == (1, False)
    shard.set_live({0: OLD + 1, 1: 1})
    shard.set_live({1: 1})
    assert pushed(shard, 0, OLD + 1, copy) == (0, True)


@pytest.mark.timeout(60)
def test_ssp_a_workers_own_pushes_while_away_are_not_updates_it_missed():
    """With prefetch: rank 0's push in flight at the leave is applied (nothing else was), and
    its next one, computed on the read before, missed only that own update: applied too (a
    review: it was dropped as from before a return)."""
    shard = ssp_shard(**{"mode.prefetch": True})
    before = shard.version - 1                        # the read its prefetched push was computed on
    shard.set_live({1: 0})
    assert pushed(shard, 0, OLD + 1, shard.version) == (1, False)
    reads(shard, 0, OLD + 2)
    assert pushed(shard, 0, OLD + 2, before) == (1, False)
    assert pushed(shard, 0, OLD + 3, shard.version) == (1, False)   # (a push of its own computed since)
    assert pushed(shard, 0, OLD + 4, before) == (1, False)   # (one from before: it missed only its own)
    assert pushed(shard, 1, 0, shard.version) == (1, False)
    assert pushed(shard, 0, OLD + 5, before) == (0, True)    # (now it missed rank 1's)


@pytest.mark.timeout(60)
def test_ssp_a_restored_shard_takes_a_rank_away_at_its_first_membership_as_away_since_before_any_version():
    """A shard restarted from its checkpoint does not know when a rank that is away left: a
    push from before the leave, 5 updates stale, is dropped, not applied as if nothing had
    happened since (a review: the restored version was taken for the leave's)."""
    shard = ssp_shard()
    copy = shard.version
    shard.set_live({1: 0})
    for c in range(5):
        pushed(shard, 1, c, shard.version)
    restored = Shard(config("ssp"), 0)
    restored.load_state_dict(shard.state_dict())
    restored.set_live({1: 5})
    assert pushed(restored, 0, OLD + 1, copy) == (0, True)
    reads(restored, 0, OLD + 2)
    assert pushed(restored, 0, OLD + 2, restored.version) == (1, False)   # (computed on a read since: applied)


def restored_past_its_checkpoint(mode: str, away: bool, caught_up: bool) -> tuple[Shard, int]:
    """Ranks 0 and 1 pushed clocks 0..OLD, the shard checkpointed, rank 1 pushed 3 more, and
    the shard restarted from its checkpoint (rank 0 away at the restart, or live); with
    `caught_up`, rank 1's 3 pushes again since. The restored shard, and the version rank 0
    last read before the restart (its push of that read is in flight: a resend, or
    prefetched)."""
    shard = Shard(config(mode), 0)
    for c in range(OLD + 1):
        pushed(shard, 0, c, shard.version)
        pushed(shard, 1, c, shard.version)
    checkpoint = shard.state_dict()
    for c in range(OLD + 1, OLD + 4):
        pushed(shard, 1, c, shard.version)
    restored = Shard(config(mode), 0)
    restored.load_state_dict(checkpoint)
    restored.set_live({1: OLD + 4} if away else {0: OLD + 1, 1: OLD + 4})
    if caught_up:
        for c in range(OLD + 1, OLD + 4):
            assert reads(restored, 1, c)
            assert pushed(restored, 1, c, restored.version) == (1, False)
        assert restored.version == shard.version
    return restored, shard.version


@pytest.mark.timeout(60)
@pytest.mark.parametrize("caught_up", [False, True], ids=["below it", "caught up"])
@pytest.mark.parametrize("away", [False, True], ids=["live", "away at the restart"])
@pytest.mark.parametrize("mode", ["ssp", "async"])
def test_a_push_of_a_read_from_before_a_restore_is_dropped_in_ssp_and_applied_in_async(mode, away, caught_up):
    """Rank 0 read the shard 3 updates past its checkpoint, and the shard restarted from it:
    rank 0's push of that read, resent, was computed on updates the restored shard lost, and
    how stale it is cannot be told: ssp drops it, live or away, and where rank 1's pushes
    since have brought the restored shard to that read's version (versions go on from the
    checkpoint's); it was applied as tau 0 before. async applies it. A push of a read
    answered since is applied."""
    restored, before = restored_past_its_checkpoint(mode, away, caught_up)
    assert pushed(restored, 0, OLD + 1, before) == ((0, True) if mode == "ssp" else (1, False))
    assert reads(restored, 0, OLD + 2)
    assert pushed(restored, 0, OLD + 2, restored.version) == (1, False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("caught_up", [False, True], ids=["at the checkpoint", "caught up"])
def test_ssp_a_push_of_a_read_the_checkpoint_holds_is_applied_after_a_restore(caught_up):
    """Rank 0's push in flight at the restart was computed on a read at the checkpoint's
    version: the history both lives share. Its staleness is counted as before any restart
    (the updates since that version), and it is applied; the restart's drops are for reads
    past the restored version (which the first version of this fix dropped too)."""
    restored, _ = restored_past_its_checkpoint("ssp", False, caught_up)
    checkpoint = OLD * 2 + 2
    tau = restored.version - checkpoint
    m = answer(restored.handle("p", push(restored, 0, OLD + 1, checkpoint)), "p")
    assert m.get("staleness") == tau and restored.version == checkpoint + tau + 1


@pytest.mark.timeout(60)
def test_ssp_resends_of_one_request_after_a_restore_do_not_push_out_the_read_its_worker_took():
    """After a restore, rank 0's push+read was answered, and its client resent that request
    four times (its answer late), each copy answered again at a later version (a review:
    the answers pushed the read the worker took out of the shard's record, and its next
    push, of that read, was dropped as of the lost life). It is applied."""
    restored, _ = restored_past_its_checkpoint("ssp", False, False)
    assert reads(restored, 0, OLD + 1)

    def push_and_read(read_version: int) -> int:
        msg = push(restored, 0, OLD + 1, read_version, 777, pull=True)
        return int(answer(restored.handle("pp", msg), "pp").get("version"))

    first = restored.version
    took = push_and_read(first)
    assert reads(restored, 1, OLD + 1)
    rank_1_read = restored.version
    for c in range(OLD + 4, OLD + 8):
        assert pushed(restored, 1, c, rank_1_read) == (1, False)
        push_and_read(first)   # (a resend: a duplicate, its read answered again)
    assert restored.version > took + 3
    assert pushed(restored, 0, OLD + 2, took) == (1, False)


@pytest.mark.timeout(60)
def test_ssp_a_prefetched_push_of_a_read_from_before_a_restore_is_dropped_after_a_read_since():
    """Prefetch: rank 0's push of clock 4 came to the restored shard and was dropped; rank 0
    read after one push of rank 1's, and rank 1's pushes then brought the shard to the
    version of rank 0's read from before the restart; rank 0's push of clock 5, computed on
    that read, came (tau 0 as the versions go): dropped, as it names no read this life
    answered rank 0. Its push of clock 6, of its read since (past the restored version;
    answered before its latest read), is applied."""
    restored, before = restored_past_its_checkpoint("ssp", False, False)
    restored_at = restored.version
    assert pushed(restored, 0, OLD + 1, before) == (0, True)

    def rank_1_pushes(clock: int) -> None:
        assert reads(restored, 1, clock)
        assert pushed(restored, 1, clock, restored.version) == (1, False)

    rank_1_pushes(OLD + 1)
    assert reads(restored, 0, OLD + 2)
    read = restored.version
    rank_1_pushes(OLD + 2)
    rank_1_pushes(OLD + 3)
    assert restored.version == before and restored_at < read < before
    assert pushed(restored, 0, OLD + 2, before) == (0, True)
    assert reads(restored, 0, OLD + 3)   # (prefetch: the next read is answered before the push of the one before)
    assert pushed(restored, 0, OLD + 3, read) == (1, False)


@pytest.mark.timeout(60)
def test_ssp_a_shard_restarted_with_nothing_to_restore_takes_a_rank_away_as_away_since_before_any_version():
    """Restarted without a checkpoint, the shard takes rank 1's current copy (which holds the
    updates rank 0 missed while away) at version 0: rank 0's push from before its leave is
    dropped, not applied as tau 0 (a review: the restart's version 0 was taken for the
    leave's)."""
    shard = Shard(config("ssp"), 0)
    shard.restarted_empty()
    shard.set_live({1: 5})
    copy = wire.decode(wire.encode("init", id=1, rank=1, clock=5, arrays=[np.ones(shard.P, np.float32),
                                                                          np.zeros(shard.B, np.float32)]))
    shard.handle("init", copy)
    assert shard.ready and pushed(shard, 0, OLD + 1, 0) == (0, True)


@pytest.mark.timeout(60)
def test_ssp_updates_after_its_first_read_while_still_away_count_against_a_push_from_before():
    """Rank 0 read once after its leave (nothing missed yet), then rank 1 pushed 5 times
    while rank 0 was still out of the live set: rank 0's prefetched push from before the
    leave missed them, and is dropped (a review: it was applied at tau 5 with s = 2)."""
    shard = ssp_shard(**{"mode.prefetch": True})
    copy = shard.version - 1
    shard.set_live({1: 0})
    reads(shard, 0, OLD + 1)
    for c in range(5):
        assert pushed(shard, 1, c, shard.version) == (1, False)
    assert pushed(shard, 0, OLD + 1, copy) == (0, True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_leave_and_return_heard_late_forgets_no_push(mode):
    """The shard hears rank 0 leave and come back only after its rejoin and its next push
    (or after a drop and a rejoin at the coordinator that the shard's heartbeats missed):
    a resend of that push, and of one before it, is answered `duplicate`, not applied."""
    w = play(mode, ["join", ("new", None), "leave", "return", ("new", None), RESEND], SAME_PROCESS)
    assert w.applied == {**{f"old {c}": 1 for c in range(OLD + 1)}, "new": 1}
    assert w.answers["new"].get("duplicate") is True and w.answers[RESEND[0]].get("duplicate") is True
    assert w.counts() == (OLD + 2, 2, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "ssp", "sync"])
def test_a_new_process_joining_below_its_ranks_clock_continues_past_it_and_is_applied(mode):
    """A new process for rank 0 registers at the coordinator's clock for it, 2, below the
    shard's last clock for the rank (3): its join's answer puts it at 4 (`finished`; sync:
    the open `step`), and its push there is applied and counted. (Sync: rank 1 pushes
    too, so that each step closes.)"""
    w = Worker(mode)
    for c in range(OLD + 1):
        w.push(f"old {c}", c)
        if mode == "sync":
            w.push(f"rank 1's {c}", c, rank=1)
    w.news("leave", NEW_PROCESS)
    w.news("return", NEW_PROCESS)
    w.join(NEW_PROCESS)
    assert w.clock == OLD + 1
    w.push("new", w.clock)
    if mode == "sync":
        w.push("rank 1's new", w.clock, rank=1)
    assert w.applied["new"] + w.applied.get("rank 1's new", 0) == 1 and w.answers["new"].get("duplicate") is None
    assert w.counts() == ((OLD + 2) * (2 if mode == "sync" else 1), 0, 0)


@pytest.mark.timeout(60)
def test_sync_a_resend_after_a_leave_and_return_is_a_duplicate_not_a_late_push():
    """Step 3 closed with both pushes; worker 0's answer was lost, the shard heard it leave
    and come back, and it resends: answered `duplicate` (its worker counts its push
    applied, as it was), counted in `duplicates`; not a late push in `pushes` and
    `dropped`, answered `dropped`, as the forgotten clock made it."""
    w = Worker("sync")
    for c in range(OLD + 1):
        w.push(f"old {c}", c)
        w.push(f"rank 1's {c}", c, rank=1)
    assert w.shard.version == OLD + 1 and w.counts() == (2 * (OLD + 1), 0, 0)
    w.news("leave", OLD + 1)
    w.news("return", OLD + 1)
    m = w.push(*RESEND)
    assert m.get("duplicate") is True and m.get("dropped") is None
    assert w.shard.version == OLD + 1 and w.counts() == (2 * (OLD + 1), 1, 0)


@pytest.mark.timeout(60)
def test_sync_a_resend_for_the_open_step_after_a_leave_and_return_is_a_duplicate():
    """Worker 0's push for step 0 waits for worker 1's; the shard hears worker 0 leave and
    come back, and its push comes again (a resend: the answer waits with the step): its
    gradient is in the step, so it is answered `duplicate` (its worker counts it applied),
    not `dropped`, and the step closes once, with it, when worker 1 pushes. (A new process
    for rank 0 repeating step 0 is answered the same: `duplicate` and not a resend of its
    own, its step line says another process's push, not applied.)"""
    w = Worker("sync")
    w.push("0", 0)
    w.news("leave", 0)
    w.news("return", 0)
    m = w.push("0", 0)
    assert m.get("duplicate") is True and m.get("dropped") is None
    w.push("rank 1's", 0, rank=1)
    assert w.shard.version == 1 and w.counts() == (2, 1, 0)
