"""Staleness: how many updates a shard applied between a worker's read and its push.

- `lr_scale`: the per-push learning-rate scale of ssp and async: 1 / W (W pushes move
  the model as far as one synchronous step), or, with the staleness-aware policy of
  Zhang et al. 2016, 1 / max(1, tau) in its place (their alpha0 / tau, alpha0 the
  synchronous learning rate), never both.
- `delay_compensate`: Zheng et al. 2017 (DC-ASGD), g + lambda * g * g * (w_now - w_read).
- `Histogram`: counts of tau, with the last bin collecting everything >= its index, and
  the exact sum and max of tau.
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
    """Counts of tau in BINS bins, the last collecting every tau >= its index, with the
    exact sum and largest tau beside them, so that the mean and the max are exact
    however far past the bins the delays go (async at 64 workers and more: tau ~ W).
    A histogram from counters without the sum (an older process's) takes the bins'
    (a lower bound when the last bin holds any)."""

    def __init__(self, counts: list[int] | None = None, tau_sum: int | None = None, top: int | None = None):
        self.counts = list(counts) if counts else [0] * BINS
        self.tau_sum = int(tau_sum) if tau_sum is not None else sum(i * c for i, c in enumerate(self.counts))
        self.top = int(top) if top is not None else max((i for i, c in enumerate(self.counts) if c), default=0)

    @classmethod
    def of(cls, stats: dict) -> Histogram:
        """The histogram in a process's counters (`stats()`'s fields)."""
        return cls(stats.get("staleness_hist") or [], stats.get("staleness_sum"), stats.get("staleness_max"))

    def stats(self) -> dict:
        """The counters' fields: the bins (a copy: a heartbeat thread sends them while the
        serving or training thread adds), the exact sum and the largest tau."""
        return {"staleness_hist": list(self.counts), "staleness_sum": self.tau_sum, "staleness_max": self.top}

    def add(self, tau: int, n: int = 1) -> None:
        if tau < 0:   # (comparisons, not max and min: a few per worker step)
            tau = 0
        self.counts[tau if tau < BINS else BINS - 1] += n
        self.tau_sum += tau * n
        if n and tau > self.top:
            self.top = tau

    def merge(self, other: Histogram | list[int]) -> None:
        other = other if isinstance(other, Histogram) else Histogram(other)
        for i, c in enumerate(other.counts[:BINS]):
            self.counts[i] += int(c)
        self.tau_sum += other.tau_sum
        self.top = max(self.top, other.top)

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def mean(self) -> float:
        return self.tau_sum / self.total if self.total else 0.0

    @property
    def max(self) -> int:
        return self.top if self.total else 0

    def as_dict(self) -> dict[str, int]:
        """{"0": n0, "1": n1, ..., "32+": n}: only non-empty bins."""
        return {(f"{i}+" if i == BINS - 1 else str(i)): c for i, c in enumerate(self.counts) if c}
