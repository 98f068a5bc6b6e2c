"""Timing-only runs (`sim.train = false`): the mechanism without the arithmetic.

No gradient is computed, so the values in the tables mean nothing; what a timing study
needs is real: the rules' events and decisions (gates, barriers, parking, staleness,
versions), the shards' dedupe and refusals, the message sizes. These two classes skip
the tensor work that would otherwise dominate a run of thousands of workers:

- `TimingShard`: a `Shard` (answering with packets, `SimShard`) that does not read the
  vectors sent (its own tables stand in for a gradient or a replica), steps no
  optimizer (an update only bumps the version), accumulates nothing, and answers reads
  with one fixed snapshot of the right sizes.
- `TimingReplica`: a `Replica` whose gathered tables are fixed zero vectors of the
  right sizes and whose loads are skipped (one replica serves every worker).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..replica import Replica
from .messages import SimShard


class TimingShard(SimShard):
    def __init__(self, cfg, index: int, model: torch.nn.Module | None = None):
        super().__init__(cfg, index, model=model)
        self._fixed = [self.params.detach().to(self._wire_torch, copy=True), self.buffers.clone()]
        self._read = (self.params.detach(), self.buffers)   # what every push and offer "sends"

    def _vectors(self, msg, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._read

    def _step(self, g: torch.Tensor, scale: float, progress: float) -> None:
        self.version += 1

    def _accumulate(self, g: torch.Tensor, b: torch.Tensor, first: bool) -> None:
        if self.acc is None or self.bacc is None:
            self.acc, self.bacc = torch.zeros(self.P), torch.zeros(self.B)

    def _snapshot(self) -> list[torch.Tensor]:
        return self._fixed


class TimingReplica(Replica):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._zp = [torch.zeros(self.map.size(i, "params")) for i in range(self.n)]
        self._zb = [torch.zeros(self.map.size(i, "buffers")) for i in range(self.n)]

    def params(self) -> list[torch.Tensor]:
        return self._zp

    def grads(self, slot: int = 0, shards: Sequence[int] | None = None) -> list[torch.Tensor]:
        return self._zp if shards is None else [self._zp[i] for i in shards]

    def buffers(self, slot: int = 0, shards: Sequence[int] | None = None) -> list[torch.Tensor]:
        return self._zb if shards is None else [self._zb[i] for i in shards]

    def load(self, params: list[torch.Tensor] | None, buffers: list[torch.Tensor] | None = None) -> None:
        pass
