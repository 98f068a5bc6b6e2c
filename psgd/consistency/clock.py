"""Stale-synchronous parallel (Ho et al., NIPS 2013): the clock table.

`finished[r]` is the number of clocks worker r has completed (pushed). A worker that
has finished clock c may read only when every live worker has finished clock >= c - s;
otherwise its read is parked and released the moment that holds (on a push or a
membership change), never by polling. `bound=None` is async: reads never wait.
With no live worker the condition holds vacuously.

`max_gap` is the largest lead of an answered read's clock over the slowest live
worker's finished clock: the spread between the fastest worker's clock (the clock
it reads at) and the slowest's. A worker parked after pushing clock c is still at
clock c, so under SSP `max_gap <= s`.

`floor` is the clock that the reads answered so far took every worker to have
finished: the largest c - s over them (a read of c holds every update of clocks
<= c - s - 1). A worker counted live all along has finished it; one that (re)joins is
counted from its own join read on, at the floor or later (`join`), so that none of its
updates comes after a read that claimed to hold it. Each shard counts a rejoiner from
the join read it gets, not when the coordinator's live set reaches it (each shard's
heartbeat is answered at a time of its own): one shard no longer answers a read that
another holds until the rejoiner catches up, the first one's part then as old as the
catch-up when the reader's push arrives (tau ~ 100 with 2 shards, s = 1).

`key` names the live set (`live_key`) in O(1): a read's answer carries it, so that the
reader can tell whether the live set its `guaranteed` clock was counted over is the
one it sees (`ssp.gated_over`).
"""
from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping

MASK64 = (1 << 64) - 1


def rank_key(rank: int) -> int:
    """A rank's share of `live_key`: 62 pseudo-random bits (splitmix64's finalizer; the
    wire's ints are below 2^62)."""
    z = (rank + 1) * 0x9E3779B97F4A7C15 & MASK64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & MASK64
    return (z ^ (z >> 31)) >> 2


def live_key(ranks: Iterable[int]) -> int:
    """A live set's name, one int on the wire in place of its W ranks: its ranks'
    `rank_key`s XORed (kept up to date by the ranks that join or leave). Equal sets have
    equal keys; two different ones share a key with a chance of about 2^-62."""
    key = 0
    for r in ranks:
        key ^= rank_key(r)
    return key


class ClockTable:
    """Costs stay flat in the number of workers (a simulator drives thousands): the
    slowest live clock is kept with a count of live workers per clock, and parked reads
    in a heap by clock, released from its top."""

    def __init__(self, live: Mapping[int, int] | Iterable[int], bound: int | None):
        live = dict(live) if isinstance(live, Mapping) else {r: 0 for r in live}
        self.finished: dict[int, int] = dict(live)
        self.live: set[int] = set(live)
        self.key = live_key(self.live)
        self.bound = bound
        self.max_gap = 0                     # largest lead of a reader over the slowest, at any read
        self.floor = 0                       # the largest clock - bound of an answered read (bounded only)
        self._reads: list[tuple[int, int, Hashable]] = []   # heap of (clock, arrival, token)
        self._arrival = itertools.count()
        self._restored: set[int] = set()    # ranks whose clock is a checkpoint's, until the next `set_live`
        self._recount()

    def _recount(self) -> None:
        self._at = Counter(self.finished[r] for r in self.live)   # live workers per finished clock
        self._min = min(self._at, default=0)

    def _advance(self, rank: int, clock: int) -> None:
        """finished[rank] = max(finished[rank], clock), keeping the counts."""
        old = self.finished.get(rank)
        if old is not None and clock <= old:
            return
        self.finished[rank] = clock
        if rank not in self.live:
            return
        at = self._at   # (`_uncount` and Counter's += written out: this runs at every push)
        if old is not None:
            if at[old] == 1:
                at.pop(old)   # (dict's: Counter's `del` is a Python method that tolerates a missing key)
            else:
                at[old] -= 1
        at[clock] = at.get(clock, 0) + 1
        if old == self._min and old not in at:
            self._min = min(at)

    def slowest(self) -> int:
        return self._min

    def restore(self, finished: Mapping[int, int], max_gap: int = 0) -> None:
        """Finished clocks (and the largest gap seen) from a checkpoint."""
        self.finished.update(finished)
        self._restored = set(finished)
        self.max_gap = max(self.max_gap, max_gap)
        self._recount()

    def may_read(self, clock: int) -> bool:
        return self.bound is None or not self.live or self.slowest() >= clock - self.bound

    def answered(self, clock: int) -> None:
        """A read of `clock` is answered now: its lead over the slowest live worker, and
        the `floor` it sets (with nobody live too: a worker that joins later is bound by it)."""
        if self.live:
            self.max_gap = max(self.max_gap, clock - self.slowest())
        if self.bound is not None and clock - self.bound > self.floor:
            self.floor = clock - self.bound

    def read(self, rank: int, clock: int, token: Hashable) -> list[Hashable]:
        """A read by `rank` that has finished `clock`. Returns the reads that may be
        answered now: this one first if it may, then any parked read that the reader's
        own progress frees; otherwise this one is parked."""
        moved = rank in self.live and clock > self.finished.get(rank, 0)
        if rank in self.live:
            self._advance(rank, clock)
        out: list[Hashable] = []
        if self.may_read(clock):
            self.answered(clock)
            out.append(token)
        else:
            heapq.heappush(self._reads, (clock, next(self._arrival), token))
        return out + (self._release() if moved else [])

    def join(self, rank: int, clock: int) -> list[Hashable]:
        """`rank` (re)joins at `clock` (its join read): counted live from now on, at the
        `floor` if that is later (it continues there: its schedule takes the largest
        `finished` of the shards' answers). A rejoiner may come far behind: the same
        process after a partition keeps its clock, a new one starts at the coordinator's,
        a heartbeat old. Returns the parked reads that its clock frees (the coordinator's
        live set, when it came first, counted it at that older clock)."""
        at = max(clock, self.floor, self.finished.get(rank, 0))
        if rank in self.live:
            self._advance(rank, at)
        else:
            self.finished[rank] = at
            self.live.add(rank)
            self.key ^= rank_key(rank)
            self._at[at] += 1
            self._min = min(self._at)
        return self._release()

    def note(self, rank: int, clock: int) -> None:
        """`rank` has finished `clock` (its read says so), where something else than this
        table gates its read (sync's step barrier, which calls `answered` when it answers)."""
        if rank in self.live:
            self._advance(rank, clock)

    def push(self, rank: int, clock: int) -> list[Hashable]:
        """Worker `rank` finished `clock` (its push for clock c finishes c + 1)."""
        self._advance(rank, max(self.finished.get(rank, 0), clock + 1))
        return self._release()

    def set_live(self, live: Mapping[int, int]) -> list[Hashable]:
        """Membership changed: rank -> clock for every live worker (joiners start there).
        The counts change by the ranks that joined or left only (not a recount of every
        live worker: a simulated run's workers leave one by one).

        After a `restore`, the checkpoint's clocks are behind the workers by the pushes
        that the shard's lost life took, until each worker's next push or read here; the
        coordinator's clocks raise them. Only without a bound (async, and the rules that
        only measure the gap), where a read at its reader's clock was measured against the
        stale ones (`max_gap` 30 and more with checkpoints 0.3 s apart). Under SSP the
        stale clocks only gate more, and a coordinator's clock may count a push still on
        its way here (with the cache or prefetch the worker's clock moves as it sends it):
        counted, it would let a read past the bound."""
        joined, left = live.keys() - self.live, self.live.difference(live)
        for r in joined:
            c = live[r]
            self.finished[r] = max(c, self.finished.get(r, 0)) if r in self.finished else c
        self.live = set(live)
        for r in joined | left:
            self.key ^= rank_key(r)
        for r in left:
            self._uncount(self.finished[r])
        for r in joined:
            self._at[self.finished[r]] += 1
        self._min = min(self._at, default=0)
        if self.bound is None:
            for r in self._restored & self.live:
                self._advance(r, live[r])
        self._restored = set()
        return self._release()

    def _uncount(self, clock: int) -> None:
        self._at[clock] -= 1
        if not self._at[clock]:
            del self._at[clock]

    def _release(self) -> list[Hashable]:
        """The parked reads that may be answered now, lowest clock first (then arrival)."""
        ready: list[Hashable] = []
        while self._reads and self.may_read(self._reads[0][0]):
            c, _, t = heapq.heappop(self._reads)
            self.answered(c)
            ready.append(t)
        return ready

    @property
    def parked(self) -> int:
        return len(self._reads)
