"""One shard's state: its slice of every table, the optimizer, and the mode's rules.

No sockets here. `Shard.handle(token, msg)` takes a validated request and returns the
replies to send now, as (token, frames) pairs: the request's own, unless the mode parks
it, and any parked requests that it releases. `set_live` does the same for membership
changes. The daemon (servers/shard_server.py) only moves frames.

Tables: `params` (trainable parameters; for easgd the center variable x~) and
`buffers` (floating-point buffers such as BatchNorm running statistics), each one flat
float32 vector. Buffers are not optimized: every push carries the worker's buffers and
the shard keeps their running mean across workers (buf += (b - buf) / W). Frozen
parameters and integer buffers are never sent (every party builds them from the seed).
"""
from __future__ import annotations

import os
from typing import Any, Hashable

import torch

from . import wire
from .config import Config
from .consistency import barrier as bsp
from .consistency.barrier import StepBarrier
from .consistency.clock import ClockTable
from .consistency.elastic import elastic_round, elastic_step
from .consistency.staleness import Histogram, delay_compensate, lr_scale
from .consistency.tournament import Exchange
from .data import describe
from .models import build_model
from .optim import lr_at, make_optimizer, set_lr
from .sharding import ShardMap, as_tensor, model_tensors

Reply = tuple[Hashable, list]


class Shard:
    def __init__(self, cfg: Config, index: int):
        self.cfg = cfg
        self.index = index
        self.mode = cfg.mode.name
        self.world = cfg.cluster.workers
        shape, classes = describe(cfg.data)
        model = build_model(cfg.model.name, shape, classes, cfg.job.seed, cfg.model.hidden)
        self.map = ShardMap.for_model(model, cfg.cluster.servers)
        tensors = model_tensors(model)
        with torch.no_grad():
            self.params = self.map.gather(tensors, index, "params").detach().clone()
            self.buffers = self.map.gather(tensors, index, "buffers").detach().clone()
        self.P, self.B = self.params.numel(), self.buffers.numel()
        self.params.grad = torch.zeros_like(self.params)
        self.opt = make_optimizer([self.params], cfg.optimizer)
        self.version = 0             # updates applied to params
        self.hist = Histogram()      # staleness of every applied push
        self.counters = {"pushes": 0, "dropped": 0, "duplicates": 0, "bad_messages": 0, "pulls": 0,
                         "fast_forwards": 0}
        self.last_clock: dict[int, int] = {}  # (rank, clock) dedupe
        live = {r: 0 for r in range(self.world)}
        self.barrier = StepBarrier(live, cfg.mode.backup_workers if self.mode == "sync" else 0)
        bound = cfg.mode.staleness if self.mode == "ssp" else None
        self.clocks = ClockTable(live, bound)
        self.acc = torch.zeros(self.P) if self.mode == "sync" else None
        self.bacc = torch.zeros(self.B) if self.mode == "sync" else None
        self.w_read: dict[int, torch.Tensor] = {}    # DC-ASGD: params at each worker's read
        self.round_x: dict[int, tuple[torch.Tensor, torch.Tensor, Hashable, Any]] = {}  # easgd sync
        self.exchange = Exchange()
        self.models: dict[tuple[int, int], tuple[float, list]] = {}  # ltfb: (round, rank) -> (score, arrays)
        self.handlers = {"pull": self.on_pull, "push": self.on_push, "elastic": self.on_elastic,
                         "put_model": self.on_put_model, "get_model": self.on_get_model,
                         "stats": self.on_stats}

    # ------------------------------------------------------------ entry points
    def handle(self, token: Hashable, msg: wire.Message) -> list[Reply]:
        """Serve one request. WireError (a bad request) becomes an error reply."""
        try:
            handler = self.handlers.get(msg.op)
            if handler is None:
                raise wire.WireError(wire.UNKNOWN_OP, f"a shard does not serve {msg.op!r}")
            return handler(token, msg)
        except wire.WireError as e:
            self.counters["bad_messages"] += 1
            return [(token, wire.error(msg.id, e.code, e.reason))]

    def set_live(self, live: dict[int, int]) -> list[Reply]:
        """Membership changed (rank -> clock of every live worker)."""
        for r in live:
            if r not in self.barrier.live and r not in self.clocks.live:
                self.last_clock.pop(r, None)  # a returning worker starts its clocks afresh
        out: list[Reply] = []
        released = self.clocks.set_live(live)
        out += [self._answer_pull(t) for t in released]
        self.barrier.set_live(live.keys())
        if self.mode == "sync" and self.barrier.contributors and self.barrier.complete():
            out += self._apply_sync()
        if self.mode == "easgd" and self.cfg.mode.sync and self.round_x and self.barrier.complete():
            out += self._apply_round()
        return out

    # ------------------------------------------------------------ pull
    def _check_rank(self, msg: wire.Message) -> None:
        if not 0 <= msg.rank < self.world:
            raise wire.WireError(wire.REFUSED, f"rank {msg.rank} is not in 0..{self.world - 1}")

    def on_pull(self, token, msg: wire.Message) -> list[Reply]:
        table = msg.get("table", "params")
        self.counters["pulls"] += 1
        if table == "best":
            return [(token, self._best_reply(msg))]
        if table != "params":
            raise wire.WireError(wire.BAD_FIELD, f"unknown table {table!r} (params or best)")
        if msg.rank >= 0 and msg.get("join"):  # a (re)joining worker: no gate; learns where to start
            self._check_rank(msg)
        elif msg.rank >= 0 and self.mode in ("sync", "ssp", "async"):
            self._check_rank(msg)
            mine = (token, msg)
            tokens = self.clocks.read(msg.rank, msg.clock, mine)  # never parks unless ssp
            ready = bool(tokens) and tokens[0] is mine
            others = [self._answer_pull(t) for t in (tokens[1:] if ready else tokens)]
            if ready and self.mode == "sync":
                ready = self.barrier.read(msg.clock, mine)
            return ([self._answer_pull(mine)] if ready else []) + others
        return [self._answer_pull((token, msg))]

    def _answer_pull(self, parked) -> Reply:
        token, msg = parked
        if self.mode == "async" and self.cfg.mode.dc_lambda > 0 and msg.rank >= 0:
            self.w_read[msg.rank] = self.params.detach().clone()
        return token, wire.reply(msg, arrays=self._snapshot(), version=self.version,
                                 step=self.barrier.step, finished=self.clocks.finished.get(msg.rank, 0))

    def _snapshot(self) -> list[torch.Tensor]:
        """Copies of the live tables: frames are sent without copying, after this
        returns, so a reply must not share memory that the next update changes."""
        return [self.params.detach().clone(), self.buffers.clone()]

    def _best_reply(self, msg: wire.Message) -> list:
        """ltfb's global model: among every trainer's latest deposit from the latest round,
        the best score (ties: the lower rank); the initial model before any round."""
        if not self.models:
            return wire.reply(msg, arrays=self._snapshot(), version=self.version, owner=-1)
        latest = max(rnd for rnd, _ in self.models)
        rnd, owner = max((k for k in self.models if k[0] == latest), key=lambda k: (self.models[k][0], -k[1]))
        score, arrays = self.models[(rnd, owner)]
        return wire.reply(msg, arrays=arrays[:2], version=self.version, owner=owner, score=score, round=rnd)

    # ------------------------------------------------------------ push
    def _vectors(self, msg: wire.Message) -> tuple[torch.Tensor, torch.Tensor]:
        g = as_tensor(wire.expect_array(msg, 0, "float32", (self.P,)))
        b = as_tensor(wire.expect_array(msg, 1, "float32", (self.B,)))
        return g, b

    def _duplicate(self, rank: int, clock: int) -> bool:
        if clock <= self.last_clock.get(rank, -1):
            self.counters["duplicates"] += 1
            return True
        self.last_clock[rank] = clock
        return False

    def on_push(self, token, msg: wire.Message) -> list[Reply]:
        if self.mode not in ("sync", "ssp", "async"):
            raise wire.WireError(wire.REFUSED, f"push is not used in mode {self.mode}")
        self._check_rank(msg)
        g, b = self._vectors(msg)
        if not torch.isfinite(g).all():
            raise wire.WireError(wire.REFUSED, "gradient has NaN or Inf values; not applied")
        if self._duplicate(msg.rank, msg.clock):
            return [(token, wire.reply(msg, duplicate=True, staleness=0, version=self.version))]
        self.counters["pushes"] += 1
        tau = max(0, self.version - int(msg.get("read_version")))
        if self.mode == "sync":
            verdict, released = self._offer(msg.rank, msg.clock)
            if verdict == bsp.EARLY:
                self.last_clock.pop(msg.rank, None)
                raise wire.WireError(wire.REFUSED, f"clock {msg.clock} is ahead of step {self.barrier.step}")
            if verdict != bsp.ACCEPT:
                self.counters["dropped"] = self.barrier.dropped
                return [(token, wire.reply(msg, dropped=True, staleness=tau, version=self.version))]
            self.acc.add_(g)
            self.bacc.add_(b)
            self.clocks.push(msg.rank, msg.clock)  # unbounded: only tracks the clock gap
            self.hist.add(tau)
            out = [(token, wire.reply(msg, staleness=tau, version=self.version))]
            out += [self._answer_pull(t) for t in released]
            if self.barrier.complete():
                out += self._apply_sync()
            return out
        # ssp / async: apply on arrival, at lr / W, so that W pushes move the model as far
        # as one sync step of W averaged gradients
        scale = (lr_scale(tau, self.cfg.mode.lr_policy) if self.mode == "async" else 1.0) / self.world
        if self.mode == "async" and self.cfg.mode.dc_lambda > 0 and msg.rank in self.w_read:
            g = delay_compensate(g, self.params.detach(), self.w_read[msg.rank], self.cfg.mode.dc_lambda)
        self._step(g, scale, self.version / self.world)
        self._mix_buffers(b)
        self.hist.add(tau)
        out = [(token, wire.reply(msg, staleness=tau, version=self.version))]
        return out + [self._answer_pull(t) for t in self.clocks.push(msg.rank, msg.clock)]

    def _offer(self, rank: int, clock: int) -> tuple[str, list]:
        """Offer a contribution to the open step (sync) or round (easgd sync). A shard
        restored from an older checkpoint meets workers that are ahead: an empty step
        fast-forwards to them (the updates in between are lost). Returns the verdict and
        the parked reads that the jump releases."""
        verdict = self.barrier.offer(rank, clock)
        if verdict != bsp.EARLY or self.barrier.contributors:
            return verdict, []
        released = self.barrier.fast_forward(clock)
        self.counters["fast_forwards"] += 1
        return self.barrier.offer(rank, clock), released

    def _step(self, g: torch.Tensor, scale: float, progress: float) -> None:
        set_lr(self.opt, scale * lr_at(self.cfg.optimizer, progress, self.cfg.train.steps))
        self.params.grad.copy_(g)
        self.opt.step()
        self.version += 1

    def _mix_buffers(self, b: torch.Tensor) -> None:
        if self.B:
            self.buffers.add_(b - self.buffers, alpha=1.0 / self.world)

    def _apply_sync(self) -> list[Reply]:
        n = len(self.barrier.contributors)
        self._step(self.acc / n, 1.0, self.barrier.step)
        if self.B:
            self.buffers.copy_(self.bacc / n)
        self.acc.zero_()
        self.bacc.zero_()
        _, released = self.barrier.advance()
        return [self._answer_pull(t) for t in released]

    # ------------------------------------------------------------ easgd
    def on_elastic(self, token, msg: wire.Message) -> list[Reply]:
        if self.mode != "easgd":
            raise wire.WireError(wire.REFUSED, f"elastic is not used in mode {self.mode}")
        self._check_rank(msg)
        x, b = self._vectors(msg)
        alpha = self.cfg.easgd_alpha
        self.counters["pushes"] += 1
        if not self.cfg.mode.sync:
            with torch.no_grad():
                d = elastic_step(x, self.params.data, alpha)
            self._mix_buffers(b)
            self.version += 1
            return [(token, wire.reply(msg, arrays=[d, self.buffers.clone()], version=self.version))]
        verdict, _ = self._offer(msg.rank, int(msg.get("round")))
        if verdict != bsp.ACCEPT:
            if verdict == bsp.LATE:  # the round closed without it: move towards the center
                d = alpha * (x - self.params.data)
                return [(token, wire.reply(msg, arrays=[d, self.buffers.clone()], dropped=True, version=self.version))]
            raise wire.WireError(wire.REFUSED, f"round {msg.get('round')} is not the open round {self.barrier.step}")
        self.round_x[msg.rank] = (x.clone(), b.clone(), token, msg)
        return self._apply_round() if self.barrier.complete() else []

    def _apply_round(self) -> list[Reply]:
        ranks = sorted(self.round_x)
        with torch.no_grad():
            ds = elastic_round([self.round_x[r][0] for r in ranks], self.params.data, self.cfg.easgd_alpha)
        if self.B:
            self.buffers.copy_(torch.stack([self.round_x[r][1] for r in ranks]).mean(0))
        self.version += 1
        self.barrier.advance()
        out = [(self.round_x[r][2], wire.reply(self.round_x[r][3], arrays=[d, self.buffers.clone()],
                                               version=self.version))
               for r, d in zip(ranks, ds)]
        self.round_x = {}
        return out

    # ------------------------------------------------------------ ltfb
    def on_put_model(self, token, msg: wire.Message) -> list[Reply]:
        if self.mode != "ltfb":
            raise wire.WireError(wire.REFUSED, f"put_model is not used in mode {self.mode}")
        self._check_rank(msg)
        wire.expect_array(msg, 0, "float32", (self.P,))
        wire.expect_array(msg, 1, "float32", (self.B,))
        for i in range(2, len(msg.arrays)):
            wire.expect_array(msg, i, "float32", (self.P,))
        arrays = [a.copy() for a in msg.arrays]
        rnd = int(msg.get("round"))
        key = (rnd, msg.rank)
        self.models[key] = (float(msg.get("score")), arrays)
        self.version += 1
        out = [(token, wire.reply(msg, version=self.version))]
        for (t, req), k in self.exchange.put(rnd, msg.rank, key):
            out.append((t, self._model_reply(req, k)))
        self.models = {k: v for k, v in self.models.items() if k in self.exchange.keys()}
        return out

    def on_get_model(self, token, msg: wire.Message) -> list[Reply]:
        if self.mode != "ltfb":
            raise wire.WireError(wire.REFUSED, f"get_model is not used in mode {self.mode}")
        key = self.exchange.get(int(msg.get("round")), int(msg.get("owner")), (token, msg))
        return [] if key is None else [(token, self._model_reply(msg, key))]

    def _model_reply(self, msg: wire.Message, key) -> list:
        return wire.reply(msg, arrays=self.models[key][1], owner=key[1], round=key[0])

    # ------------------------------------------------------------ stats, checkpoints
    def stats(self) -> dict:
        return {**self.counters, "version": self.version, "step": self.barrier.step,
                "max_clock_gap": self.clocks.max_gap, "dropped": self.barrier.dropped,
                "staleness_hist": self.hist.counts, "parked": self.barrier.parked + self.clocks.parked
                + self.exchange.parked}

    def on_stats(self, token, msg: wire.Message) -> list[Reply]:
        return [(token, wire.reply(msg, **self.stats()))]

    def state_dict(self) -> dict:
        return {"params": self.params.detach().clone(), "buffers": self.buffers.clone(),
                "opt": self.opt.state_dict(), "version": self.version, "step": self.barrier.step,
                "finished": dict(self.clocks.finished), "last_clock": dict(self.last_clock),
                "counters": dict(self.counters), "hist": list(self.hist.counts), "shard": self.index,
                "sizes": [self.P, self.B]}

    def load_state_dict(self, sd: dict) -> None:
        if list(sd["sizes"]) != [self.P, self.B] or sd["shard"] != self.index:
            raise ValueError(f"checkpoint is for shard {sd['shard']} with sizes {sd['sizes']}, "
                             f"not shard {self.index} with {[self.P, self.B]}")
        with torch.no_grad():
            self.params.copy_(sd["params"])
            self.buffers.copy_(sd["buffers"])
        self.opt.load_state_dict(sd["opt"])
        self.version = int(sd["version"])
        self.barrier.step = int(sd["step"])
        self.clocks.finished.update({int(k): int(v) for k, v in sd["finished"].items()})
        self.last_clock = {int(k): int(v) for k, v in sd["last_clock"].items()}
        self.counters.update(sd["counters"])
        self.hist = Histogram(sd["hist"])

    def save(self, path: str) -> None:
        """Atomic checkpoint: temp file, fsync, rename."""
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(self.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def load(self, path: str) -> None:
        self.load_state_dict(torch.load(path, weights_only=True))
