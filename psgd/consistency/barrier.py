"""Bulk-synchronous steps: each step is applied exactly once, with exactly the
gradients of the first `live - backup` distinct workers that push for it (a worker
that pushed and then left keeps its gradient in the step but no longer counts towards
closing it: the workers still live are waited for).

Chen et al. 2016 (backup workers): with b backups, a step completes after N - b
gradients; the late ones are dropped and counted. Reads of clock c wait until step c
has been applied (`step >= c`).
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable

ACCEPT, LATE, DUPLICATE, EARLY = "accept", "late", "duplicate", "early"


class StepBarrier:
    def __init__(self, live: Iterable[int], backup: int = 0, step: int = 0):
        self.live = set(live)
        self.backup = backup
        self.step = step                 # the step being collected (= steps applied so far)
        self.contributors = []           # ranks whose gradient is in the current step, in order
        self.dropped = 0                 # late gradients, counted
        self._reads: list[tuple[int, Hashable]] = []  # parked (clock, token)

    @property
    def contributors(self) -> list[int]:
        """The ranks whose gradient is in the current step, in the order they came (kept
        with a set of the same ranks: a push's duplicate check is one lookup, not a scan
        of up to W ranks). Read-only: `offer` adds to it, `advance` empties it."""
        return self._order

    @contributors.setter
    def contributors(self, ranks: Iterable[int]) -> None:
        self._order: list[int] = list(ranks)
        self._in: set[int] = set(self._order)
        self._live_in = len(self._in & self.live)   # the contributors still live

    @property
    def need(self) -> int:
        return max(1, len(self.live) - self.backup)

    def offer(self, rank: int, clock: int) -> str:
        """A push of `rank` for `clock`: ACCEPT (add it), LATE (drop it), DUPLICATE, EARLY."""
        if clock < self.step:
            self.dropped += 1
            return LATE
        if clock > self.step:
            return EARLY
        if rank in self._in:
            return DUPLICATE
        self._order.append(rank)
        self._in.add(rank)
        if rank in self.live:
            self._live_in += 1
        return ACCEPT

    def contributed(self, rank: int) -> bool:
        """Is `rank`'s gradient in the open step? (One set lookup.)"""
        return rank in self._in

    def passed(self, ahead: Iterable[int]) -> bool:
        """Has every live worker pushed for the open step, or for a later one (`ahead`)?
        Then no gradient for it is to come."""
        return self.live <= self._in.union(ahead)

    def fast_forward(self, clock: int) -> list[Hashable]:
        """Jump an empty step to `clock` (a shard restored from an older checkpoint meets
        workers that are ahead: the updates in between are lost, training goes on)."""
        if self.contributors or clock <= self.step:
            return []
        self.step = clock
        return self._release()

    def complete(self) -> bool:
        """Have `need` live workers pushed for the open step?"""
        return self._live_in >= self.need

    def advance(self) -> tuple[list[int], list[Hashable]]:
        """Close the current step: (its contributors, the parked reads now released).
        (The `contributors` setter's work for an empty list, written out.)"""
        done = self._order
        self._order, self._in, self._live_in = [], set(), 0
        self.step += 1
        return done, self._release()

    def read(self, clock: int, token: Hashable) -> bool:
        """May a read of `clock` be answered now? If not, it is parked under `token`."""
        if clock <= self.step:
            return True
        self._reads.append((clock, token))
        return False

    def set_live(self, live: Iterable[int]) -> None:
        """Membership changed; the caller then checks `complete()`."""
        self.live = set(live)
        self._live_in = len(self._in & self.live)

    def _release(self) -> list[Hashable]:
        if not self._reads:
            return []
        ready = [t for c, t in self._reads if c <= self.step]
        self._reads = [(c, t) for c, t in self._reads if c > self.step]
        return ready

    def waiting(self) -> list[tuple[int, Hashable]]:
        """The parked reads, (clock, token)."""
        return self._reads

    @property
    def parked(self) -> int:
        return len(self._reads)
