"""Test helpers: a worker schedule driven against `psgd.shard.Shard` objects in this
thread, with real wire messages and no sockets.

`Loopback` is the part of `ParameterClient` that the schedules use (join, pull,
push_pull, push, elastic, tables); every request must be answered at once (one worker, or
rounds that close on it), else it raises. `FakeTrainer` is the schedule's `Trainer`
with a known gradient function in place of a data set.
"""
from __future__ import annotations

import itertools
import time
import types
from collections.abc import Callable

import torch
import zmq

from psgd import wire
from psgd.config import Config
from psgd.consistency.staleness import Histogram
from psgd.data import describe
from psgd.models import build_model
from psgd.replica import Replica
from psgd.shard import Shard
from psgd.workers.client import ParameterClient

_ids = itertools.count(1)


class PartwiseSocket:
    """A fake socket's `send` of one part at a time, as `transport.send_frames` sends a
    message: the message goes as a whole, to the class's `send_multipart`, with its last part."""

    def send(self, frame, flags: int = 0, copy: bool = True) -> None:
        parts = self.__dict__.setdefault("parts", [])
        parts.append(frame)
        if not flags & zmq.SNDMORE:
            self.parts = []
            self.send_multipart(parts, copy=copy)

    def send_multipart(self, frames: list, copy: bool = True) -> None:
        raise NotImplementedError


class Loopback:
    tables = staticmethod(ParameterClient.tables)

    def __init__(self, shards: list[Shard], rank: int):
        self.shards, self.rank = shards, rank
        self.wait_s = 0.0

    def request(self, reqs: list[tuple[int, str, dict]]) -> list[wire.Message]:
        out = []
        for i, op, fields in reqs:
            token = ("loopback", next(_ids))
            frames = wire.encode(op, id=next(_ids), rank=self.rank, **fields)
            req = wire.decode([bytes(f) for f in frames])
            replies = dict(self.shards[i].handle(token, req))
            if token not in replies:
                raise AssertionError(f"shard {i} parked the {op} of rank {self.rank}; a loopback cannot wait")
            out.append(wire.raise_if_error(wire.decode([bytes(f) for f in replies[token]]), f"shard {i}"))
        return out

    def join(self, clock: int) -> list[wire.Message]:
        return self.request([(i, "pull", {"clock": clock, "join": True}) for i in range(len(self.shards))])

    def pull(self, clock: int) -> list[wire.Message]:
        return self.request([(i, "pull", {"clock": clock}) for i in range(len(self.shards))])

    def push_pull(self, clock, grads, buffers, read_versions):
        return self.finish_push_pull(self.begin_push_pull(clock, grads, buffers, read_versions))

    def push(self, clock, grads, buffers, read_versions):
        """The pushes alone (the shards' acknowledgements), as `ParameterClient.push`."""
        return self.finish_push_pull(self.begin_push_pull(clock, grads, buffers, read_versions, pull=False))[0]

    def begin_push_pull(self, clock, grads, buffers, read_versions, pull: bool = True):
        """The pushes (and the pull) carried out at once: `finish_push_pull` gives their
        answers; `.reqs`, the pushes, as the real client's `InFlight`."""
        reqs = [(i, "push", {"clock": clock, "read_version": read_versions[i], "arrays": [grads[i], buffers[i]]})
                for i in range(len(self.shards))]
        pushed = self.request(reqs)
        return types.SimpleNamespace(reqs=reqs, answers=(pushed, self.pull(clock + 1) if pull else []))

    @staticmethod
    def finish_push_pull(f):
        return f.answers

    def elastic(self, round_, xs, bs, clock):
        return self.request([(i, "elastic", {"round": round_, "clock": clock, "arrays": [xs[i], bs[i]]})
                             for i in range(len(self.shards))])


class TournamentOps:
    """The client's tournament ops (deposits, fetches, the index) for a loopback over
    `self.shards` (mixed in before it)."""
    put_model = ParameterClient.put_model
    get_model = ParameterClient.get_model
    index = ParameterClient.index

    @property
    def n(self) -> int:
        return len(self.shards)

class FakeTrainer:
    """A worker whose `compute` sets every parameter's gradient to `grad(p)`."""

    def __init__(self, cfg: Config, client, grad: Callable[[torch.Tensor], torch.Tensor], rank: int = 0):
        self.cfg, self.client, self.grad, self.rank = cfg, client, grad, rank
        shape, classes = describe(cfg.data)
        model = build_model(cfg.model.name, shape, classes, cfg.job.seed, cfg.model.hidden)
        self.replica = Replica(model, cfg.cluster.servers, torch.device("cpu"))
        self.clock = 0
        self.taken_back = False   # (a test sets it: a process restarted before it was missed)
        self.loss, self.samples = 0.0, 0
        self.t0 = time.monotonic()
        self.hist = Histogram()
        self.logged: list[tuple] = []

    def compute(self, slot: int = 0) -> float:
        for p in self.replica.model.parameters():
            p.grad = self.grad(p.detach())
        return 0.0

    def score(self) -> tuple[float, float]:
        return self.replica.score(*self.holdout, self.cfg.eval.batch_size)

    def log_step(self, staleness: int, wait_s: float, step=None, **extra) -> None:
        self.logged.append((self.clock, staleness, extra))

    def live(self) -> set[int]:
        return {self.rank}

    def event(self, **fields) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def now(self) -> float:
        return time.monotonic() - self.t0


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])
