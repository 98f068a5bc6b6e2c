"""`ssp`: stale-synchronous parallel (Ho et al., NIPS 2013; Petuum Bösen).

Server rule: a gradient is applied on arrival at lr / W, so that W pushes move the
model as far as one synchronous step of W averaged gradients. A worker that finished
clock c may read only when every live worker has finished clock >= c - s (bound
`mode.staleness`); otherwise its read is parked until a push or a membership change
frees it (`clock.ClockTable`), never by polling. Every read's answer carries
`guaranteed`: the slowest live worker's finished clock when it was answered, so the
model it sends holds every update of clocks < guaranteed of every live worker, and
`live_key`, which live set that was (`clock.live_key`).

Worker schedule: push+pull every step; a joining worker continues at the clock the
shards have reached: its own there, or, back after it was away, the clock that the reads
answered meanwhile took every worker to have finished (`ClockTable.join`). With
`mode.cache = true`, Bösen's client cache (`ClientCache`): the worker keeps the model
it read with its `guaranteed` clock t, and its read for clock c is served from that
copy, without a pull, while t >= c - s (the copy then holds every update of clocks
<= c - s - 1, which is all that SSP promises a read at c) and no worker is live that the
shards did not count when they answered (`gated_over`). Its own updates go into the
copy as they are pushed (read-my-writes, `pushpull.own_update`), and every update is
still pushed. A read the cache cannot serve pulls, gated by the rule as without the
cache. With `mode.prefetch = true` (issue 10's overlap, within the bound) the worker
pulls every step but computes its next step on the copy it has while the push and pull
travel, whenever the same condition says that copy is within the bound; otherwise it
waits.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from .. import wire
from .clock import ClockTable, live_key
from .pushpull import PushPullSchedule, counted, finite_or_diverged, load, own_update, step_flags
from .rule import Answer, Apply, Decision, MixBuffers, Push, Read, ServerRule, Trainer

MAX_ABSENCES = 16   # a rank's absences `SspRule` tells apart; past it, the two oldest count as one


class SspRule(ServerRule):
    name = "ssp"
    serves = frozenset({"push", "pull"})

    def __init__(self, mode, world, tables):
        super().__init__(mode, world, tables)
        self.clocks = ClockTable(range(world), self.bound())
        # A worker that left the live set (`from_before_leaving`), by rank: `away`, from this shard
        # hearing the leave to the worker's next read here, the others' updates then (`others`);
        # `absences`, once it read, [the version when that read came, the others' updates at the
        # leave] of each absence in turn (a read older than the first was made before that leave).
        # (None is checkpointed, nor `applied`: a restored shard learns the live set anew from the
        # coordinator, and takes a rank away at its first membership as away since before any
        # update: `restarted`.)
        self.applied: dict[int, int] = {}   # rank -> its pushes applied here
        self.away: dict[int, int] = {}
        self.absences: dict[int, list[list[int]]] = {}
        self.left_unknown = False
        self.dropped = 0
        self.own: dict[int, list[int]] = {}   # `holds_own`: rank -> the versions its pushes since its read met

    def bound(self) -> int | None:
        return self.mode.staleness

    def lr_scale(self, tau: int) -> float:
        """The scale of a push's learning rate: 1 / W."""
        return 1.0 / self.world

    def steps_per_push(self) -> int:
        """Worker steps that one push carries: 1."""
        return 1

    def gradient(self, e: Push):
        return e.grad

    def holds_own(self) -> bool:
        """Does the model a worker computes on hold its own pushes since its read? With the
        client cache (`mode.cache`, `mode.prefetch`) it does: a step served from the copy
        steps it by its own gradient (`pushpull.own_update`), and a read replaces it."""
        return bool(self.mode.cache or self.mode.prefetch)

    def staleness(self, e: Push) -> int:
        """tau: the updates since the push's read, less the worker's own pushes applied
        since then where its copy holds them (`holds_own`): those are not stale (Zhang et
        al. 2016 and Zheng et al. 2017 count the updates the gradient's model lacks). So
        one worker's pushes have tau = 0 whatever it reads, and async's `lr_policy =
        "staleness"` scales a push by the other workers' updates only. (ssp's cache
        counted the worker's own pushes since its last pull: tau 0, 1, 2 for one worker.)"""
        if not self.holds_own():
            return e.tau
        read = self.tables.version - e.tau
        own = [v for v in self.own.get(e.rank, ()) if v >= read]
        self.own[e.rank] = own + [self.tables.version]
        return max(0, e.tau - len(own))

    def from_before_leaving(self, e: Push) -> bool:
        """Was this push computed on a read made before its worker left the live set (a
        worker stopped or cut off, dropped by the coordinator, whose in-flight gradient
        arrives once it runs again), and have the others' updates been applied here since
        the leave? Nobody waited for it then: the others ran on, so its gradient is as
        stale as they got (tau 233 with s = 1 after a 5 s SIGSTOP), past any bound. Under
        SSP it is dropped, as sync drops a late one; async (no bound) applies it. Where
        nothing but its own pushes was applied here since this shard heard it leave (where
        it left more than once, the leave of the first absence its read came before), its
        gradient is as fresh as if it had never left, and is applied (a real leave dropped
        even a push of tau 0 before).
        Such a push comes before the worker's next read here (its pushes and reads to a
        shard are in order: it reads only once the push is answered), or names a read
        older than that next read (prefetch: a gradient computed on the copy while the push
        before it travelled), judged by the first absence whose read is later than its own
        (`absences`). (Told by the version of its first read after it came back, not of its
        leaving: a read made at the version it left at, before it left, looked like one
        made after.)"""
        if self.bound() is None:
            return False
        others = self.others(e.rank)
        if e.rank in self.away and others > self.away[e.rank]:
            return True
        read = self.tables.version - e.tau
        return next((others > left for back, left in self.absences.get(e.rank, ()) if read < back), False)

    def others(self, rank: int) -> int:
        """The updates applied here that are not `rank`'s own (this shard's version counts
        them all); from the leave's count to now's, those a worker missed while away."""
        return self.tables.version - self.applied.get(rank, 0)

    def read(self, e: Read) -> list[Decision]:
        left = self.away.pop(e.rank, None)
        if left is not None:   # its pushes from here on are computed on reads since it came back
            absences = self.absences.setdefault(e.rank, [])
            absences.append([self.tables.version, left])
            if len(absences) > MAX_ABSENCES:   # (the two oldest as one: a read before the later is judged
                (_, left), (back, _) = absences.pop(0), absences[0]   # since the earlier leave, as before it)
                absences[0] = [back, left]
        if e.join and e.rank >= 0 and self.bound() is not None:
            return self.joined(e)
        return super().read(e)

    def joined(self, e: Read) -> list[Decision]:
        """A (re)joining worker's read, never gated: it is counted here from now on, at the
        clock every read answered here meanwhile took it to have finished, or its own if
        later (`ClockTable.join`); the answer's `finished` says which, and it continues
        there. So this shard answers no read past it before the coordinator's live set
        says it is back, nor holds one on the older clock that live set gives it while
        another shard answers. (Async, without a bound, keeps a rejoiner's own clock: its
        steps are its own budget.)"""
        freed = self.clocks.join(e.rank, e.clock)   # (first: the answer says where it continues)
        out: list[Decision] = [self.answer(e)]
        return out + [self.answer(r) for r in freed]  # type: ignore[arg-type]

    def push(self, e: Push) -> list[Decision]:
        # Dropped too, the worker's leave or not: a push computed on a read this shard answered
        # before it restarted (`Push.before_restart`): it may hold updates the shard lost, and
        # how stale it is cannot be told (async, without a bound, applies it)
        if (e.before_restart and self.bound() is not None) or self.from_before_leaving(e):
            self.dropped += 1
            dropped: list[Decision] = [Answer(e.token, {"dropped": True, "staleness": e.tau})]
            return dropped + [self.answer(r) for r in self.clocks.push(e.rank, e.clock)]  # type: ignore[arg-type]
        self.applied[e.rank] = self.applied.get(e.rank, 0) + 1
        progress = self.tables.version * self.steps_per_push() / self.world
        tau = self.staleness(e)
        out: list[Decision] = [Apply(self.gradient(e), self.lr_scale(tau), progress),
                               MixBuffers(e.buffers, 1.0 / self.world), Answer(e.token, {"staleness": tau})]
        self.hist.add(tau)
        return out + [self.answer(r) for r in self.clocks.push(e.rank, e.clock)]  # type: ignore[arg-type]

    def gated_read(self, e: Read) -> list[Decision]:
        return [self.answer(r) for r in self.clocks.read(e.rank, e.clock, e)]  # type: ignore[arg-type]

    def membership(self, live: dict[int, int]) -> list[Decision]:
        unknown, self.left_unknown = self.left_unknown, False
        for rank in self.clocks.live.difference(live):   # (a second leave before a read: the first counts)
            self.away.setdefault(rank, -1 if unknown else self.others(rank))   # (restored: before any update)
        return [self.answer(r) for r in self.clocks.set_live(live)]  # type: ignore[arg-type]

    def read_fields(self, rank: int) -> dict:
        """`finished`: the reader's clock here; `guaranteed`: the slowest live worker's
        finished clock now (the answer holds all their updates of clocks below it);
        `live_key`: the live set that was counted over (`gated_over`)."""
        return {"step": 0, "finished": self.clocks.finished.get(rank, 0), "guaranteed": self.clocks.slowest(),
                "live_key": self.clocks.key}

    def parked(self) -> int:
        return self.clocks.parked

    def stats(self) -> dict:
        return {**super().stats(), "max_clock_gap": self.clocks.max_gap, "dropped": self.dropped}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "finished": dict(self.clocks.finished), "max_gap": self.clocks.max_gap,
                "dropped": self.dropped, "floor": self.clocks.floor}

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.clocks.restore({int(k): int(v) for k, v in sd["finished"].items()}, int(sd.get("max_gap", 0)))
        self.dropped = int(sd.get("dropped", 0))
        self.clocks.floor = int(sd.get("floor", 0))   # (a rejoiner after the restore is bound by the reads before it)
        self.own = {}   # (of the tables before the restore)

    def restarted(self) -> None:
        """The shard restarted (from its checkpoint, or with nothing to restore): when a rank
        away at its first membership left, it cannot tell; since before any update. (Its
        ranks' pushes are counted from here: `others` from the restored version.)"""
        self.left_unknown, self.applied = True, {}

    def new_run(self) -> None:
        super().new_run()
        self.clocks.max_gap = self.dropped = 0


class ClientCache:
    """Bösen's client cache, as clocks (pure: the model itself is the worker's replica).

    `fill(t, live)` records a read whose answers guaranteed clock t (the smallest
    `guaranteed` over the shards) with the live workers it covers (`gated_over`: the
    shards' live set when they answered, not the worker's when it loads the answer,
    which may have a rejoiner more). `fresh(c, live)`: the copy may serve the worker's
    read at clock c, i.e. t >= c - s (it holds every update of clocks <= c - s - 1 of
    every worker live at the read; SSP's condition, Ho et al. 2013) and no worker is
    live now that was not live at the read (a (re)joiner may still push clocks below t,
    which the copy lacks). Empty until the first fill."""

    def __init__(self, bound: int):
        self.bound = bound
        self.clock: int | None = None
        self.live: frozenset[int] = frozenset()

    def fill(self, guaranteed: int, live: Iterable[int]) -> None:
        self.clock, self.live = guaranteed, frozenset(live)

    def fresh(self, clock: int, live: Iterable[int]) -> bool:
        return self.clock is not None and self.clock >= clock - self.bound and self.live.issuperset(live)


def guaranteed(answers: list) -> int:
    """The clock a read's answers guarantee: the smallest over the shards."""
    return min(int(m.get("guaranteed", 0)) for m in answers)


def gated_over(answers: list, live: set[int]) -> frozenset[int]:
    """The workers whose updates of clocks below `guaranteed(answers)` the answers
    hold, as far as the worker can tell: its view of the live set if every shard counted
    that same set (its `live_key`), else none. The views differ while a membership
    change travels; with prefetch an answer is loaded a compute after it was made, when
    a worker that rejoined in between may be in the reader's view but was not in the
    shard's: its updates are not in the answer."""
    view = frozenset(live)
    key = _view_key(view)
    return view if all(m.get("live_key") == key for m in answers) else frozenset()


# A view's key, kept for the few views of a run (every worker's, between membership
# changes, is the same set): a key is W ranks' hashes in Python, a load's at every step,
# while hashing the view is C (at 1,024 simulated workers with the cache, 2.7x the run).
_view_key = functools.lru_cache(maxsize=64)(live_key)


class SspSchedule(PushPullSchedule):
    """Push+pull every step, or, with `mode.cache` or `mode.prefetch`, the model the
    worker has (its own updates applied, `own_update`) serves its next step while the
    `ClientCache` says it is within the bound: with the cache the step then pushes
    only; with prefetch its push and pull travel while the next step computes, and the
    pulled model is loaded after that step's gradient is taken. Outside the bound the
    step pushes, pulls and waits, as without either."""

    caches = True   # async (no bound) has its own prefetch and no use for the cache
    inflight: Any = None   # (the request, the wait counter at its start, its step's (loss, samples)) (prefetch)
    slot = 0

    def __init__(self, cfg):
        super().__init__(cfg)
        m = cfg.mode
        self.cache = ClientCache(m.staleness) if self.caches and (m.cache or m.prefetch) else None
        self.pull_less, self.prefetch = m.cache, m.prefetch

    def resume_clock(self, answers: list) -> int:
        return max(int(m.get("finished", 0)) for m in answers)

    def rejoin(self, w: Trainer) -> None:
        """Join (an ungated read), then, with the cache, pull gated if the join's answer is
        outside the bound at the clock the worker continues at (a worker rejoining ahead
        of the slowest computes on nothing staler than SSP allows)."""
        self.settle(w, reread=False)
        super().rejoin(w)
        if self.cache is not None and not self.cache.fresh(w.clock, w.live()):
            self.loaded(w, w.client.pull(w.clock))

    def loaded(self, w: Trainer, answers: list) -> None:
        self.versions = load(w, answers)
        if self.cache is not None:
            self.cache.fill(guaranteed(answers), gated_over(answers, w.live()))

    def step(self, w: Trainer) -> None:
        if self.cache is None:
            return super().step(w)
        w.compute(self.slot)
        grads, buffers = w.replica.grads(self.slot), w.replica.buffers(self.slot)
        read = self.versions            # the read this gradient was computed on (settle may load a newer one)
        self.settle(w)
        w0, c = w.client.wait_s, w.clock
        serve = self.cache.fresh(c + 1, w.live())
        if serve:
            finite_or_diverged(w, grads)   # (the worker's own copy is stepped by it below)
        f = w.client.begin_push_pull(c, grads, buffers, read, self.slot, pull=not (serve and self.pull_less))
        if serve:  # read-my-writes, at clock c's lr as the shard applies it: the next step computes on this copy
            own_update(w)
        w.clock = c + 1
        if not serve:
            return self.settled(w, f, c, w0, cached=False)
        if not self.prefetch:
            return self.settled(w, f, c, w0, cached=True)
        self.inflight, self.slot = (f, c, w0, (w.loss, w.samples)), self.slot ^ 1
        return None

    def finish(self, w: Trainer) -> None:
        self.settle(w, reread=False)

    def refused(self, w: Trainer, clock: int) -> None:
        """The shards refused the push of `clock`, which the worker's clock has already
        passed (the answer was waited for after the step: prefetch, the cache). The clock
        goes back to it, so that the next gradient goes at that clock, as a plain step's
        does (its clock moves on only when the shards answer; a shard that took the
        refused request, which another refused, answers the next as this process's
        duplicate, applied). The copy the worker stepped by it (`own_update`) holds an
        update the shards did not all apply: the next step reads (the cache is emptied)."""
        w.clock = min(w.clock, clock)
        if self.cache is not None:
            self.cache.clock = None

    def settle(self, w: Trainer, reread: bool = True) -> None:
        """Wait for the request in flight (prefetch): load what it pulled, log its step.
        `reread=False`: a copy the shards' drop left stale is not read anew (`settled`):
        the worker stops, or its join reads."""
        if self.inflight is not None:
            (f, c, w0, step), self.inflight = self.inflight, None
            self.settled(w, f, c, w0, cached=True, step=step, reread=reread)

    def settled(self, w: Trainer, f: Any, clock: int, w0: float, cached: bool,
                step: tuple[float, int] | None = None, reread: bool = True) -> None:
        """The answers of the push of `clock` (and its read); `refused` if refused. A push
        a shard dropped (`SspRule.push`) where the step read nothing: the worker's copy,
        stepped by it (`own_update`), holds an update that shard did not apply; the cache
        is emptied and the copy read anew, gated, before the next step computes on it
        (before, it was computed on until the cache's next read). That read is in the
        step's wait; refused, the step's line is still written, and the next step computes
        once more on the copy and reads with its push."""
        try:
            pushed, pulled = w.client.finish_push_pull(f)
        except wire.Refused:
            self.refused(w, clock)
            raise
        tau, dropped, theirs = counted(w, pushed)
        stale = dropped and not pulled and self.cache is not None
        if stale:
            self.cache.clock = None   # type: ignore[union-attr]
        read_anew = False
        try:
            if stale and reread:
                pulled, read_anew = w.client.pull(w.clock), True
            if pulled:
                self.loaded(w, pulled)
        finally:   # (`cached`: the next step computes on the copy: prefetch's, `step`, already has)
            on_copy = cached and (step is not None or not read_anew)
            w.log_step(tau, w.client.wait_s - w0, step, dropped=dropped, **step_flags(theirs, on_copy))
