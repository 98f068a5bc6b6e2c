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
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping


class ClockTable:
    def __init__(self, live: Mapping[int, int] | Iterable[int], bound: int | None):
        live = dict(live) if isinstance(live, Mapping) else {r: 0 for r in live}
        self.finished: dict[int, int] = dict(live)
        self.live: set[int] = set(live)
        self.bound = bound
        self.max_gap = 0                     # largest lead of a reader over the slowest, at any read
        self._reads: list[tuple[int, Hashable]] = []

    def slowest(self) -> int:
        return min((self.finished[r] for r in self.live), default=0)

    def may_read(self, clock: int) -> bool:
        return self.bound is None or not self.live or self.slowest() >= clock - self.bound

    def _answered(self, clock: int) -> None:
        if self.live:
            self.max_gap = max(self.max_gap, clock - self.slowest())

    def read(self, rank: int, clock: int, token: Hashable) -> list[Hashable]:
        """A read by `rank` that has finished `clock`. Returns the reads that may be
        answered now: this one first if it may, then any parked read that the reader's
        own progress frees; otherwise this one is parked."""
        moved = rank in self.live and clock > self.finished.get(rank, 0)
        if rank in self.live:
            self.finished[rank] = max(self.finished.get(rank, 0), clock)
        out: list[Hashable] = []
        if self.may_read(clock):
            self._answered(clock)
            out.append(token)
        else:
            self._reads.append((clock, token))
        return out + (self._release() if moved else [])

    def push(self, rank: int, clock: int) -> list[Hashable]:
        """Worker `rank` finished `clock` (its push for clock c finishes c + 1)."""
        self.finished[rank] = max(self.finished.get(rank, 0), clock + 1)
        return self._release()

    def set_live(self, live: Mapping[int, int]) -> list[Hashable]:
        """Membership changed: rank -> clock for every live worker (joiners start there)."""
        for r, c in live.items():
            if r not in self.live:
                self.finished[r] = max(c, self.finished.get(r, 0)) if r in self.finished else c
        self.live = set(live)
        return self._release()

    def _release(self) -> list[Hashable]:
        ready: list[tuple[int, Hashable]] = []
        waiting: list[tuple[int, Hashable]] = []
        for c, t in self._reads:
            (ready if self.may_read(c) else waiting).append((c, t))
        self._reads = waiting
        for c, _ in ready:
            self._answered(c)
        return [t for _, t in ready]

    @property
    def parked(self) -> int:
        return len(self._reads)
