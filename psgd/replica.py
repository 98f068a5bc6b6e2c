"""A worker's (or the evaluator's) copy of the model, seen through the shard map.

`Replica` moves between the model's tensors and the per-shard flat tables: `load`
writes what the shards sent into the model, `params`/`grads`/`buffers` gather what goes
back. On CUDA, tables are staged through pinned host buffers and copied
asynchronously. `score` evaluates on a labelled set without gradients.
"""
from __future__ import annotations

import torch
from torch import nn

from .sharding import ShardMap, model_grads, model_tensors


def pick_device(spec: str, local_rank: int = 0) -> torch.device:
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {spec}: CUDA is not available on this machine")
    return dev


class Replica:
    def __init__(self, model: nn.Module, num_shards: int, device: torch.device):
        self.model = model.to(device)
        self.device = device
        self.map = ShardMap.for_model(self.model, num_shards)
        self.tensors = model_tensors(self.model)
        self.n = num_shards
        self._pinned: dict = {}

    def _host(self, key, flat: torch.Tensor) -> torch.Tensor:
        """Device tensor -> host tensor (pinned and asynchronous on CUDA)."""
        if self.device.type != "cuda":
            return flat
        buf = self._pinned.get(key)
        if buf is None or buf.numel() != flat.numel():
            buf = self._pinned[key] = torch.empty(flat.numel(), pin_memory=True)
        buf.copy_(flat, non_blocking=True)
        return buf

    def _tables(self, tensors: dict, table: str, tag: str) -> list[torch.Tensor]:
        out = [self._host((tag, i), self.map.gather(tensors, i, table)) for i in range(self.n)]
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return out

    @torch.no_grad()
    def params(self) -> list[torch.Tensor]:
        return self._tables(self.tensors, "params", "p")

    @torch.no_grad()
    def buffers(self) -> list[torch.Tensor]:
        return self._tables(self.tensors, "buffers", "b")

    @torch.no_grad()
    def grads(self) -> list[torch.Tensor]:
        return self._tables(model_grads(self.model), "params", "g")

    @torch.no_grad()
    def load(self, params: list[torch.Tensor] | None, buffers: list[torch.Tensor] | None = None) -> None:
        for i in range(self.n):
            if params is not None:
                self.map.scatter(params[i].to(self.device, non_blocking=True), i, "params", self.tensors)
            if buffers is not None:
                self.map.scatter(buffers[i].to(self.device, non_blocking=True), i, "buffers", self.tensors)

    @torch.no_grad()
    def score(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> tuple[float, float]:
        """(accuracy, mean cross-entropy) in eval mode; restores the previous mode."""
        was = self.model.training
        self.model.eval()
        correct, loss, n = 0, 0.0, len(y)
        for i in range(0, n, batch_size):
            xb, yb = x[i:i + batch_size].to(self.device), y[i:i + batch_size].to(self.device)
            out = self.model(xb)
            loss += nn.functional.cross_entropy(out, yb, reduction="sum").item()
            correct += (out.argmax(1) == yb).sum().item()
        self.model.train(was)
        return correct / max(1, n), loss / max(1, n)
