"""A worker's (or the evaluator's) copy of the model, seen through the shard map.

`Replica` moves between the model's tensors and the per-shard flat tables: `load`
writes what the shards sent into the model, `params`/`grads`/`buffers` gather what goes
back, into buffers allocated once and reused every step (a gathered table is valid
until the next gather of the same kind: the client sends it and waits for the answer
before the next step). On CUDA, tables are gathered on the device and copied to pinned
host buffers asynchronously. `score` evaluates on a labelled set without gradients.
"""
from __future__ import annotations

from collections.abc import Iterable

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
        self._bufs: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (device, host) per table

    def _buffers_for(self, tag: str, shard: int, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        key = (tag, shard)
        if key not in self._bufs:
            size = self.map.size(shard, table)
            dev = torch.empty(size, device=self.device)
            host = torch.empty(size, pin_memory=True) if self.device.type == "cuda" else dev
            self._bufs[key] = (dev, host)
        return self._bufs[key]

    def _tables(self, tensors: dict, table: str, tag: str) -> list[torch.Tensor]:
        out = []
        for i in range(self.n):
            dev, host = self._buffers_for(tag, i, table)
            self.map.gather(tensors, i, table, out=dev)
            if host is not dev:
                host.copy_(dev, non_blocking=True)
            out.append(host)
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        return out

    @torch.no_grad()
    def params(self) -> list[torch.Tensor]:
        return self._tables(self.tensors, "params", "p")

    @torch.no_grad()
    def buffers(self, slot: int = 0) -> list[torch.Tensor]:
        """`slot`: another set of buffers, for a second push in flight."""
        return self._tables(self.tensors, "buffers", f"b{slot}")

    @torch.no_grad()
    def grads(self, slot: int = 0) -> list[torch.Tensor]:
        return self._tables(model_grads(self.model), "params", f"g{slot}")

    @torch.no_grad()
    def load(self, params: list[torch.Tensor] | None, buffers: list[torch.Tensor] | None = None) -> None:
        for i in range(self.n):
            if params is not None:
                self.map.scatter(params[i].to(self.device, non_blocking=True), i, "params", self.tensors)
            if buffers is not None:
                self.map.scatter(buffers[i].to(self.device, non_blocking=True), i, "buffers", self.tensors)

    def score(self, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> tuple[float, float]:
        """(accuracy, mean cross-entropy) in eval mode; restores the previous mode."""
        return self.score_batches((x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, len(y), batch_size))

    @torch.no_grad()
    def score_batches(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
        """`score` over (x, y) batches as they come (a streamed test set)."""
        was = self.model.training
        self.model.eval()
        correct, loss, n = 0, 0.0, 0
        try:
            for xb, yb in batches:
                xb, yb = xb.to(self.device), yb.to(self.device)
                out = self.model(xb)
                loss += nn.functional.cross_entropy(out, yb, reduction="sum").item()
                correct += (out.argmax(1) == yb).sum().item()
                n += len(yb)
        finally:
            self.model.train(was)
        return correct / max(1, n), loss / max(1, n)
