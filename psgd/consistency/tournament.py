"""The Livermore Tournament Fast Batch rules (Jacobs, Dryden, Pearce, Van Essen, MLHPC'17).

- `pairings(seed, round, ranks)`: every party derives the same pairs from (seed, round)
  and the live ranks with no communication; an odd trainer sits out (partner None).
- `adopt(local, partner)`: keep the partner's model only if its score is strictly better.
- `Exchange`: the server side of a round's model swap. A trainer deposits its model for
  (round, rank) and asks for its partner's; the request is parked until that model is
  deposited. Old rounds are forgotten.
"""
from __future__ import annotations

import random
from typing import Hashable, Iterable


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
    KEEP_ROUNDS = 2

    def __init__(self):
        self.models: dict[tuple[int, int], Hashable] = {}  # (round, owner) -> stored model key
        self._waiting: list[tuple[tuple[int, int], Hashable]] = []
        self.latest = -1

    def put(self, round_: int, owner: int, model: Hashable) -> list[Hashable]:
        """Deposit; returns the parked requests for this model that may now be answered."""
        self.models[(round_, owner)] = model
        if round_ > self.latest:
            self.latest = round_
            self.models = {k: v for k, v in self.models.items() if k[0] > round_ - self.KEEP_ROUNDS}
            self._waiting = [(k, t) for k, t in self._waiting if k[0] > round_ - self.KEEP_ROUNDS]
        ready = [t for k, t in self._waiting if k == (round_, owner)]
        self._waiting = [(k, t) for k, t in self._waiting if k != (round_, owner)]
        return ready

    def get(self, round_: int, owner: int, token: Hashable) -> Hashable | None:
        """The model if deposited; else the request is parked under `token` (None)."""
        key = (round_, owner)
        if key in self.models:
            return self.models[key]
        self._waiting.append((key, token))
        return None

    def forget(self, token: Hashable) -> None:
        self._waiting = [(k, t) for k, t in self._waiting if t != token]

    @property
    def parked(self) -> int:
        return len(self._waiting)
