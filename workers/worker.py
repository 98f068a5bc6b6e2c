"""The worker daemon: a training loop over its data partition plus a parameter client.

    psgd worker [CONFIG] --out DIR [--device auto|cpu|cuda[:N]] [--rank R] [--set k=v ...]

Registers with the coordinator (rank, run config, starting clock), then trains:

- sync, ssp, async: pull -> forward/backward -> push, with the push and the next pull in
  one round trip to all shards; the shards' rules decide when a pull is answered.
- easgd: local steps with a local optimizer; every `tau` steps an elastic exchange.
- ltfb: local steps; every `round_steps` a tournament against the partner that
  `pairings(seed, round, ranks)` names, through the shards.

Every step is a line in DIR/events/worker-<rank>.jsonl. Cumulative counters ride on the
heartbeats, so the coordinator's summary survives a worker that dies.
"""
from __future__ import annotations

import os
import time

import torch
from torch import nn

from psgd.config import Config
from psgd.consistency.staleness import Histogram
from psgd.consistency.tournament import adopt, pairings
from psgd.data import Batches, holdout, load_dataset, partition
from psgd.membership import CoordinatorLink, log
from psgd.metrics import EventLog, PidFile
from psgd.models import build_model
from psgd.optim import lr_at, make_optimizer, set_lr
from psgd.replica import Replica, pick_device
from psgd.sharding import as_tensor
from workers.client import Cancelled, ParameterClient, ShardUnreachable, tensors_of

import zmq


def local_rank() -> int:
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


class Worker:
    def __init__(self, cfg: Config, out: str | None = None, device: str = "auto", want_rank: int = -1,
                 ctx: zmq.Context | None = None):
        self.cfg0 = cfg
        self.out = out
        self.device_spec = device
        self.want_rank = want_rank
        self.ctx = ctx or zmq.Context.instance()
        self.clock = 0
        self.samples = 0
        self.steps = 0
        self.loss = float("nan")
        self.hist = Histogram()
        self.t_start = time.monotonic()

    # ------------------------------------------------------------ counters
    def stats(self) -> dict:
        c = getattr(self, "client", None)
        return {"samples": self.samples, "steps": self.steps, "clock": self.clock,
                "elapsed_s": round(time.monotonic() - self.t_start, 4),
                "wait_s": round(c.wait_s if c else 0.0, 4), "bytes_sent": c.bytes_sent if c else 0,
                "bytes_recv": c.bytes_recv if c else 0, "staleness_hist": self.hist.counts,
                "loss": self.loss if self.loss == self.loss else None, "retries": c.retries if c else 0}

    # ------------------------------------------------------------ set-up
    def run(self) -> int:
        # Load the data and build the model before registering, so that the job's clock
        # starts when every worker is ready; redo it if the run's config differs.
        ds, model = self._build(self.cfg0)
        self.link = CoordinatorLink(self.cfg0, "worker", max(self.want_rank, 0), self.ctx)
        answer = self.link.register(self.want_rank)
        self.rank = int(answer.get("assigned_rank"))
        self.link.index = self.rank
        cfg = self.cfg = self.cfg0.with_run(answer.get("config"))
        if (cfg.data, cfg.model, cfg.job) != (self.cfg0.data, self.cfg0.model, self.cfg0.job):
            ds, model = self._build(cfg)
        self.clock = int(answer.get("start_clock", 0))
        self.name = f"worker-{self.rank}"
        with PidFile(self.out, "worker", self.rank):
            return self._train(cfg, ds, model)

    @staticmethod
    def _build(cfg: Config):
        ds = load_dataset(cfg.data, cfg.job.seed)
        # The first torch optimizer imports torch._dynamo (seconds): pay that here, before
        # the job's clock starts, not in the first local step of easgd/ltfb.
        make_optimizer([torch.zeros(1, requires_grad=True)], cfg.optimizer)
        return ds, build_model(cfg.model.name, ds.input_shape, ds.num_classes, cfg.job.seed, cfg.model.hidden)

    def _train(self, cfg: Config, ds, model) -> int:
        self.device = pick_device(self.device_spec, local_rank())
        torch.manual_seed(cfg.job.seed * 1000 + self.rank)
        self.replica = Replica(model, cfg.cluster.servers, self.device)
        part = partition(len(ds.train_y), self.rank, cfg.cluster.workers, cfg.job.seed)
        if cfg.mode.name == "ltfb":
            part, self.tournament_idx = holdout(part, cfg.mode.tournament_fraction)
            self.tour_x, self.tour_y = ds.train_x[self.tournament_idx], ds.train_y[self.tournament_idx]
        self.batches = Batches(ds.train_x, ds.train_y, part, cfg.train.batch_size, cfg.job.seed, self.rank)
        self.client = ParameterClient(cfg, self.ctx, self.rank)
        self.events = EventLog(self.out, "worker", self.rank)
        self.link.clock_fn = lambda: self.clock
        self.link.stats_fn = self.stats
        self.link.start()
        log(self.name, f"{cfg.mode.name} on {self.device}: {len(part)} samples, batch {self.batches.batch_size}, "
            f"starting at clock {self.clock}")
        loop = {"sync": self.run_ps, "ssp": self.run_ps, "async": self.run_ps,
                "easgd": self.run_easgd, "ltfb": self.run_ltfb}[cfg.mode.name]
        self.t_start = time.monotonic()
        try:
            loop()
        except ShardUnreachable as e:
            log(self.name, f"error: {e}")
            return 1
        finally:
            self.link.stop()
        if self.link.state.get("abort"):
            log(self.name, f"job aborted: {self.link.state['abort']}")
            self.client.close()
            return 1
        self.link.call("finish", rank=self.rank, clock=self.clock, stats=self.stats())
        self.client.close()
        self.events.close()
        log(self.name, f"finished {self.steps} steps, {self.samples} samples")
        return 0

    # ------------------------------------------------------------ budget and faults
    def more(self) -> bool:
        t = self.cfg.train
        if self.link.done or self.link.state.get("abort"):
            return False
        if t.steps and self.clock >= t.steps:
            return False
        return not (t.seconds and time.monotonic() - self.t_start >= t.seconds)

    def compute(self) -> float:
        """One forward/backward on the next batch (with injected slowness); the loss."""
        t0 = time.perf_counter()
        x, y = self.batches.next()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        model = self.replica.model
        model.zero_grad(set_to_none=False)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        f = self.cfg.faults
        extra = f.step_delay_s
        if f.slow_rank == self.rank and f.slow_factor > 1:
            extra += (f.slow_factor - 1) * (time.perf_counter() - t0)
        if extra > 0:
            time.sleep(extra)
        self.loss = float(loss.item())
        self.samples += len(y)
        return self.loss

    def log_step(self, staleness: int, wait_s: float, **extra) -> None:
        self.steps += 1
        self.events.write(rank=self.rank, step=self.steps, clock=self.clock, loss=round(self.loss, 5),
                          samples=self.samples, staleness=staleness, wait_s=round(wait_s, 5),
                          bytes_sent=self.client.bytes_sent, bytes_recv=self.client.bytes_recv, **extra)

    def rejoin_if_dropped(self) -> bool:
        """After a partition the coordinator may have dropped us: rejoin with our rank."""
        if not self.link.state.get("rejoin"):
            return False
        answer = self.link.register(self.rank)
        self.clock = int(answer.get("start_clock", self.clock))
        log(self.name, f"rejoined the job at clock {self.clock}")
        return True

    # ------------------------------------------------------------ sync / ssp / async
    def _load(self, msgs) -> list[int]:
        self.replica.load(tensors_of(msgs, 0), tensors_of(msgs, 1))
        return [int(m.get("version", 0)) for m in msgs]

    def join(self) -> list[int]:
        """Pull the current model without waiting on any gate, and continue at the clock
        the shards have reached (after a rejoin, or a requeued job resumed from checkpoints)."""
        table = "best" if self.cfg.mode.name == "ltfb" else "params"
        msgs = self.client.request([(i, "pull", {"clock": self.clock, "join": True, "table": table})
                                    for i in range(self.client.n)])
        step = max(int(m.get("step", 0)) for m in msgs)
        mode = self.cfg.mode
        if mode.name == "sync":
            self.clock = max(self.clock, step)
        elif mode.name in ("ssp", "async"):
            self.clock = max(self.clock, max(int(m.get("finished", 0)) for m in msgs))
        elif mode.name == "easgd" and mode.sync:
            self.clock = max(self.clock, step * mode.tau)
        return self._load(msgs)

    def run_ps(self) -> None:
        versions = self.join()
        while self.more():
            if self.rejoin_if_dropped():
                versions = self.join()
            self.replica.model.train()
            self.compute()
            w0 = self.client.wait_s
            pushed, pulled = self.client.push_pull(self.clock, self.replica.grads(), self.replica.buffers(), versions)
            tau = max(int(m.get("staleness", 0)) for m in pushed)
            if not any(m.get("dropped") or m.get("duplicate") for m in pushed):
                self.hist.add(tau)
            self.clock += 1
            if self.cfg.mode.name == "sync":  # a late worker (push dropped: backup workers) catches up
                self.clock = max(self.clock, max(int(m.get("step", 0)) for m in pulled))
            versions = self._load(pulled)
            self.log_step(tau, self.client.wait_s - w0,
                          dropped=any(bool(m.get("dropped")) for m in pushed))

    # ------------------------------------------------------------ local-optimizer modes
    def _local_step(self, opt) -> None:
        set_lr(opt, lr_at(self.cfg.optimizer, self.clock, self.cfg.train.steps))
        self.compute()
        opt.step()
        self.clock += 1

    def run_easgd(self) -> None:
        last_version = self.join()[0]  # staleness counts center moves since our own last exchange
        model = self.replica.model
        model.train()
        opt = make_optimizer([p for p in model.parameters() if p.requires_grad], self.cfg.optimizer)
        tau = self.cfg.mode.tau
        while self.more():
            if self.rejoin_if_dropped():
                self.join()
            self._local_step(opt)
            staleness, wait = 0, 0.0
            if self.clock % tau == 0:
                w0 = self.client.wait_s
                replies = self.client.elastic(self.clock // tau - 1, self.replica.params(), self.replica.buffers(),
                                              self.clock)  # rounds count from 0
                wait = self.client.wait_s - w0
                version = int(replies[0].get("version", 0))
                staleness = max(0, version - last_version - 1)  # center moves by others since our last exchange
                last_version = version
                self.hist.add(staleness)
                new = [p - d for p, d in zip(self.replica.params(), tensors_of(replies, 0))]
                self.replica.load(new)
            self.log_step(staleness, wait)

    def _opt_state(self, opt) -> tuple[list[str], list[dict]]:
        """Optimizer state tensors shaped like the parameters (momentum, Adam moments)."""
        params = [p for p in self.replica.model.parameters() if p.requires_grad]
        names = {id(p): n for n, p in self.replica.model.named_parameters()}
        keys = sorted({k for p in params for k, v in opt.state.get(p, {}).items()
                       if torch.is_tensor(v) and v.shape == p.shape})
        tables = []
        for k in keys:
            tables.append({names[id(p)]: opt.state[p][k] if k in opt.state.get(p, {}) else torch.zeros_like(p)
                           for p in params})
        return keys, tables

    def run_ltfb(self) -> None:
        cfg = self.cfg
        self.join()
        model = self.replica.model
        model.train()
        opt = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optimizer)
        with_opt = cfg.mode.exchange == "weights+optimizer"
        while self.more():
            if self.rejoin_if_dropped():
                self.join()
            self._local_step(opt)
            if self.clock % cfg.mode.round_steps:
                self.log_step(0, 0.0)
                continue
            w0 = self.client.wait_s
            self.tournament(self.clock // cfg.mode.round_steps, opt, with_opt)
            self.log_step(0, self.client.wait_s - w0)

    def tournament(self, rnd: int, opt, with_opt: bool) -> None:
        cfg = self.cfg
        local_score, _ = self.replica.score(self.tour_x, self.tour_y, cfg.eval.batch_size)
        params, buffers = self.replica.params(), self.replica.buffers()
        keys, state = self._opt_state(opt) if with_opt else ([], [])
        arrays = [[params[i], buffers[i]] + [self.replica.map.gather(t, i, "params").cpu() for t in state]
                  for i in range(cfg.cluster.servers)]
        self.client.put_model(rnd, local_score, arrays, self.clock)
        # Trainers that finished or were lost deposit no more models: pair the live ones.
        live = set(self.link.state["live"]) | {self.rank}
        partner = pairings(cfg.job.seed, rnd, live).get(self.rank)
        partner_score, adopted = None, False
        if partner is not None:
            try:
                got = self.client.get_model(rnd, partner, cancel=lambda: partner not in self.link.state["live"])
            except (Cancelled, ShardUnreachable) as e:
                log(self.name, f"round {rnd}: partner {partner} did not deliver ({e}); sitting out")
                got = None
            if got is not None:
                mine = (params, buffers)
                self.replica.load(tensors_of(got, 0), tensors_of(got, 1))
                partner_score, _ = self.replica.score(self.tour_x, self.tour_y, cfg.eval.batch_size)
                adopted = adopt(local_score, partner_score)
                if not adopted:
                    self.replica.load(*mine)
                elif with_opt and len(got[0].arrays) == 2 + len(keys):
                    self._load_opt_state(opt, keys, got)
        self.events.write(event="tournament", round=rnd, rank=self.rank, partner=partner,
                          local_score=round(local_score, 5),
                          partner_score=None if partner_score is None else round(partner_score, 5),
                          adopted=adopted)

    def _load_opt_state(self, opt, keys, got) -> None:
        params = [p for p in self.replica.model.parameters() if p.requires_grad]
        names = {id(p): n for n, p in self.replica.model.named_parameters()}
        for j, k in enumerate(keys):
            target = {names[id(p)]: opt.state.setdefault(p, {}).setdefault(k, torch.zeros_like(p)) for p in params}
            for i, m in enumerate(got):
                self.replica.map.scatter(as_tensor(m.arrays[2 + j]), i, "params", target)
