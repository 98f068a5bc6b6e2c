"""The Livermore Tournament Fast Batch rules (Jacobs, Dryden, Pearce, Van Essen, MLHPC'17).

- `pairings(seed, round, ranks)`: every party derives the same pairs from (seed, round)
  and the live ranks with no communication; an odd trainer sits out (partner None).
- `adopt(local, partner)`: keep the partner's model only if its score is strictly better.
- `Exchange`: the server side of a round's model swap. A trainer deposits its model for
  (round, rank) and asks for its partner's; the request is parked until that model (or
  a later one of the same partner) is deposited.
"""
from __future__ import annotations

import random
from collections.abc import Hashable, Iterable


def pairings(seed: int, round_: int, ranks: Iterable[int]) -> dict[int, int | None]:
    order = sorted(set(ranks))
    random.Random(f"ltfb:{seed}:{round_}").shuffle(order)
    out: dict[int, int | None] = {}
    for i in range(0, len(order) - 1, 2):
        a, b = order[i], order[i + 1]
        out[a], out[b] = b, a
    if len(order) % 2:
        out[order[-1]] = None
    return out


def adopt(local_score: float, partner_score: float) -> bool:
    return partner_score > local_score


class Exchange:
    """Models deposited per (round, owner). A request for (round r, owner o) is answered
    with o's model from round r, or from o's latest later round if o has moved on
    (trainers drift apart when one sits out or straggles); otherwise it is parked until
    o deposits round r or later. Each owner's deposits older than its latest are
    forgotten, so memory stays at one model per trainer plus the parked requests."""

    def __init__(self):
        self.latest: dict[int, tuple[int, Hashable]] = {}  # owner -> (round, stored model key)
        self._waiting: list[tuple[tuple[int, int], Hashable]] = []

    def put(self, round_: int, owner: int, model: Hashable) -> list[tuple[Hashable, Hashable]]:
        """Deposit; returns (parked request, model) pairs that may now be answered."""
        if round_ >= self.latest.get(owner, (-1, None))[0]:
            self.latest[owner] = (round_, model)
        ready = [(t, model) for (r, o), t in self._waiting if o == owner and r <= round_]
        self._waiting = [((r, o), t) for (r, o), t in self._waiting if not (o == owner and r <= round_)]
        return ready

    def get(self, round_: int, owner: int, token: Hashable) -> Hashable | None:
        """The model if deposited for this round or later; else the request is parked
        under `token` (None)."""
        have = self.latest.get(owner)
        if have is not None and have[0] >= round_:
            return have[1]
        self._waiting.append(((round_, owner), token))
        return None

    def keys(self) -> set:
        """Stored model keys still reachable (the shard frees the others)."""
        return {m for _, m in self.latest.values()}

    @property
    def parked(self) -> int:
        return len(self._waiting)
