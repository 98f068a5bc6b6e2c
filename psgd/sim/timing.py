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
  right sizes and whose loads are skipped (one replica serves every worker), and whose
  model's `train()` returns at once when the model is in training mode already.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..replica import Replica
from .messages import SimShard


class TimingShard(SimShard):
    def __init__(self, cfg, index: int):
        super().__init__(cfg, index)
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
        setattr(self.model, "train", train_unless_set(self.model))  # noqa: B010  (mypy: a method is not assignable)
        self._zp = [torch.zeros(self.map.size(i, "params")) for i in range(self.n)]
        self._zb = [torch.zeros(self.map.size(i, "buffers")) for i in range(self.n)]

    def params(self) -> list[torch.Tensor]:
        return self._zp

    def grads(self, slot: int = 0) -> list[torch.Tensor]:
        return self._zp

    def buffers(self, slot: int = 0) -> list[torch.Tensor]:
        return self._zb

    def load(self, params: list[torch.Tensor] | None, buffers: list[torch.Tensor] | None = None) -> None:
        pass


def train_unless_set(model: nn.Module) -> Callable[[bool], nn.Module]:
    """`model.train(mode)` that does nothing when every module of the model is in that
    mode already. Every schedule's step calls `model.train()`; torch's walks every module
    and sets its flag through `Module.__setattr__` (25 us for the MLP, a tenth of a
    timing-only step), while the one model that all workers share here is in training
    mode nearly always."""
    modules = list(model.modules())
    train = model.train

    def train_if_needed(mode: bool = True) -> nn.Module:
        for m in modules:   # a loop, not `any` over a generator: asked every step of every worker
            if m.training != mode:
                train(mode)
                break
        return model
    return train_if_needed
