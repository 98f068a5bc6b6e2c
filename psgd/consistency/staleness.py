"""Staleness: how many updates a shard applied between a worker's read and its push.

- `lr_scale`: the per-push learning-rate scale of ssp and async: 1 / W (W pushes move
  the model as far as one synchronous step), or, with the staleness-aware policy of
  Zhang et al. 2016, 1 / max(1, tau) in its place (their alpha0 / tau, alpha0 the
  synchronous learning rate), never both.
- `delay_compensate`: Zheng et al. 2017 (DC-ASGD), g + lambda * g * g * (w_now - w_read).
- `Histogram`: counts of tau, with the last bin collecting everything >= its index.
"""
from __future__ import annotations

BINS = 33  # tau = 0 .. 31, and ">= 32"


def lr_scale(tau: int, policy: str, world: int = 1) -> float:
    """The scale of a push's learning rate: 1 / max(1, tau) under `policy = "staleness"`,
    else 1 / `world` (W workers' pushes add up to one synchronous step)."""
    return 1.0 / max(1, tau) if policy == "staleness" else 1.0 / world


def delay_compensate(g, w_now, w_read, lam: float):
    """DC-ASGD's compensated gradient (works on tensors or arrays; returns a new one)."""
    return g + lam * g * g * (w_now - w_read)


class Histogram:
    def __init__(self, counts: list[int] | None = None):
        self.counts = list(counts) if counts else [0] * BINS

    def add(self, tau: int, n: int = 1) -> None:
        self.counts[min(max(tau, 0), BINS - 1)] += n

    def merge(self, other: Histogram | list[int]) -> None:
        other = other.counts if isinstance(other, Histogram) else other
        for i, c in enumerate(other[:BINS]):
            self.counts[i] += int(c)

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def mean(self) -> float:
        return sum(i * c for i, c in enumerate(self.counts)) / self.total if self.total else 0.0

    @property
    def max(self) -> int:
        nz = [i for i, c in enumerate(self.counts) if c]
        return nz[-1] if nz else 0

    def as_dict(self) -> dict[str, int]:
        """{"0": n0, "1": n1, ..., "32+": n}: only non-empty bins."""
        return {(f"{i}+" if i == BINS - 1 else str(i)): c for i, c in enumerate(self.counts) if c}
