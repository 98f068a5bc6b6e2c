"""One simulated run: the real shards, W simulated workers and the evaluator on one
virtual clock, in this process.

    s = Simulation(cfg, compute_s=0.004)
    summary = s.run(out="DIR")          # DIR/summary.json, DIR/events/*.jsonl

The shards are `psgd.shard.Shard`s, fed the same validated wire messages as the
daemon feeds them; membership changes (a worker that finished) reach them through
`Shard.set_live`, as from the coordinator. The evaluator scores the mode's global model
(`Mode.global_model`, read straight from the shards, at no cost on the network) on the
test set at 0, every `eval.every_seconds` of virtual time while a worker is live, and
once more when all are done. Times in summary.json and in the event logs are virtual
seconds from the start of training.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .. import wire
from ..config import Config, ConfigError
from ..consistency import get as get_mode
from ..data import Dataset, StreamingDataset, check_partitions, load_dataset, permutation, worker_part
from ..metrics import json_line, summarize, write_json_atomic, written
from ..models import build_model
from ..optim import flush_denormals
from ..replica import Replica, pick_device
from ..workers.client import ParameterClient
from .engine import Loop, Network, Node, few_collections
from .messages import Packet, SimShard, packet, packets, received
from .timing import TimingReplica, TimingShard
from .worker import CountingClient, SimWorker

PROGRESS_EVERY_S = 2.0
SPILL_LINES = 1 << 16   # event-log lines the workers hold before they are written (`Simulation.spill`)
CALIBRATION_STEPS = 20


class Deadlock(RuntimeError):
    pass


def in_memory(cfg: Config, split: float = 0.0) -> Dataset:
    """The job's dataset, which a simulation that trains (`sim.train`), or whose mode
    holds out a share of each partition (`split`), needs in memory (not streamed)."""
    ds = load_dataset(cfg.data, cfg.job.seed)
    if not isinstance(ds, Dataset):
        hint = ("use sim.train = false for a timing-only study" if cfg.sim.train else
                f"mode {cfg.mode.name} holds out {split:g} of each worker's partition, even timing only")
        raise ConfigError(f"psgd simulate needs an in-memory dataset; data.name = {cfg.data.name!r} is streamed "
                          f"({hint})")
    return ds


def calibrate(cfg: Config, device: str, cache: dict) -> float:
    """Seconds of one forward + backward of the job's model on one batch, here, on one
    thread (as each worker process runs): the median of CALIBRATION_STEPS after warm-up,
    once per (model, data, batch, device) in `cache`. The batch is worker 0's: at many
    workers a partition can be smaller than train.batch_size. A streamed dataset's batches
    are read in this process (`data.loader_workers` = 0); reading them is not timed, as
    taking an in-memory dataset's is not."""
    ds = load_dataset(cfg.data, cfg.job.seed)
    if isinstance(ds, StreamingDataset):
        ds = dataclasses.replace(ds, loader_workers=0)
    part, _ = worker_part(ds.train_size, 0, max(1, cfg.cluster.workers), cfg.job.seed,
                          get_mode(cfg.mode.name).schedule(cfg).data_split)
    batches = ds.train_batches(part, cfg.train.batch_size, cfg.job.seed, 0)
    key = (cfg.model.name, repr(cfg.model.hidden), cfg.data.name, repr(cfg.data), batches.batch_size, device)
    if key not in cache:  # rounded as compare-context.json reports it: the runs use exactly that value
        cache[key] = max(1e-9, round(_timed_steps(cfg, ds, batches, device), 9))
    return cache[key]


def codec_costs(cfg: Config, cache: dict, size: int | None = None) -> tuple[float, float]:
    """(encode, decode) ns a value of a compressed push (wire.compression): a worker's
    error-feedback encode, charged to its clock at each compressed push, and a shard's
    decode, charged to its serving (`Simulation.arrive`); (0, 0) without compression.
    `sim.encode_ns` and `sim.decode_ns`, each measured here where 0: one push of the
    model's whole gradient, on one thread, the median of CALIBRATION_STEPS after warm-up,
    once per (codec, topk_fraction, size) in `cache`, rounded to 0.001 ns. `size`: the
    model's values, counted on a model built here where not given. On a CPU they
    weigh as much as a small model's step (onebit: 0.28 ms to encode 13k values against
    the MLP's 0.23 ms forward and backward), and a simulation without them took
    compression for free: 1.17 times sync's samples/s where real runs took 0.3."""
    codec, s = cfg.wire.compression, cfg.sim
    if codec == "none":
        return 0.0, 0.0
    if s.encode_ns and s.decode_ns:
        return s.encode_ns, s.decode_ns
    if size is None:
        from ..data import describe
        size = sum(p.numel() for p in build_model(cfg.model.name, *describe(cfg.data), cfg.job.seed,
                                                  cfg.model.hidden).parameters())
    key = (codec, cfg.wire.topk_fraction if codec == "topk" else 0.0, size)
    if key not in cache:
        cache[key] = _timed_codec(codec, size, cfg.wire.topk_fraction)
    encode, decode = cache[key]
    return s.encode_ns or encode, s.decode_ns or decode


def _timed_codec(codec: str, size: int, topk_fraction: float) -> tuple[float, float]:
    from ..compression import ErrorFeedback, decode
    g = torch.Generator().manual_seed(0)
    feedback, out = ErrorFeedback(codec, size, topk_fraction, name="psgd simulate"), torch.empty(size)
    encodes, decodes = [], []
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(CALIBRATION_STEPS + 5):
            grad = torch.randn(size, generator=g)
            t0 = time.perf_counter()
            first, last = feedback.encode(grad)
            t1 = time.perf_counter()
            decode(codec, first, last, size, out=out)
            if i >= 5:
                encodes.append(t1 - t0)
                decodes.append(time.perf_counter() - t1)
    finally:
        torch.set_num_threads(old_threads)
    return (max(0.001, round(statistics.median(encodes) / size * 1e9, 3)),
            max(0.001, round(statistics.median(decodes) / size * 1e9, 3)))


def _timed_steps(cfg: Config, ds: Any, batches: Any, device: str) -> float:
    model = build_model(cfg.model.name, ds.input_shape, ds.num_classes, cfg.job.seed, cfg.model.hidden)
    dev = pick_device(device)
    model = model.to(dev).train()
    times = []
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(CALIBRATION_STEPS + 5):
            x, y = batches.next()
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i >= 5:
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(old_threads)
    return statistics.median(times)


class DirectClient(CountingClient):
    """A client whose requests the shards serve at once, off the network: the evaluator's
    (rank -1), and a worker's before the virtual clock starts (`offer_initial_values`).
    A read that a rule would park is a bug of the simulation's use (an evaluator's read
    is never gated) and raises. It cannot wait for a message on its way (`waits`): the
    loop does not move while it reads."""

    waits = False

    def __init__(self, sim: Simulation, rank: int = -1):
        super().__init__(sim.cfg, rank)
        self.sim = sim

    def request(self, reqs: Sequence[tuple[int, str, dict]],
                cancel: Callable[[], bool] | None = None) -> list[wire.Message]:
        out = []
        for k, (i, op, kw) in enumerate(reqs):
            mine = ("direct", self.rank, k)
            got = None
            sent = packet(op, id=k + 1, rank=self.rank, **kw)
            self._sent += sent.nbytes
            for token, msg in self.sim.serve(i, mine, sent):
                if token == mine:
                    self._recv += msg.nbytes
                    got = wire.raise_if_error(msg, f"shard {i} (simulated)")
                else:
                    self.sim.reply(i, token, msg)
            if got is None:
                who = "the evaluator" if self.rank < 0 else f"worker {self.rank} (before the clock starts)"
                raise RuntimeError(f"the {op} of {who} was parked by shard {i}; a request served off the network "
                                   f"is never gated (rule of mode {self.cfg.mode.name})")
            out.append(got)
        return out

    def close(self) -> None:
        pass


class Simulation:
    """A whole job on the virtual clock (see the module docstring)."""

    def __init__(self, cfg: Config, compute_s: float, device: str = "cpu",
                 progress: Callable[[Simulation], None] | None = None, codec_ns: tuple[float, float] | None = None):
        """`codec_ns`: a compressed push's (encode, decode) ns a value (`codec_costs`,
        measured here if not given)."""
        if not cfg.train.steps and not cfg.train.seconds:
            raise ConfigError("psgd simulate needs a budget: train.steps or train.seconds (virtual seconds) > 0")
        self.cfg = cfg
        self.compute_s = compute_s
        self.progress = progress
        s = cfg.sim
        self.loop = Loop()
        self.ids = itertools.count(1)   # request ids (their msgpack size counts on the wire)
        self.net = Network(s.latency_s, s.bandwidth_gbps, s.apply_gbps)
        self.mode = get_mode(cfg.mode.name)
        torch.manual_seed(cfg.job.seed)   # outside the workers' bodies (each draws from its own: `TorchRandom`)
        shard_cls = SimShard if s.train else TimingShard   # timing only: the mechanism without the arithmetic
        model = build_model(cfg.model.name, *self._describe(), cfg.job.seed, cfg.model.hidden)  # once for all shards
        self.shards = [shard_cls(cfg, i, model=model) for i in range(cfg.cluster.servers)]
        self.nodes = [Node(f"shard-{i}") for i in range(cfg.cluster.servers)]
        self.codec_ns = codec_costs(cfg, {}, sum(shard.P for shard in self.shards)) if codec_ns is None else codec_ns
        # a compressed push's part for shard i: its worker's encode, the shard's decode (seconds)
        self.encode_s = [self.codec_ns[0] * 1e-9 * shard.P for shard in self.shards]
        self.decode_s = [self.codec_ns[1] * 1e-9 * shard.P for shard in self.shards]
        for shard, node in zip(self.shards, self.nodes, strict=True):
            shard.busy = node.busy   # its virtual serving time (summary.json's shard_busy_fraction)
        self.device = pick_device(device)
        W = cfg.cluster.workers
        schedules = [self.mode.schedule(cfg) for _ in range(W)]
        split = schedules[0].data_split if schedules else 0.0
        self.ds = in_memory(cfg, split) if s.train or split > 0 else None
        shape, classes = (self.ds.input_shape, self.ds.num_classes) if self.ds else self._describe()
        shared = None if s.train else self._replica(shape, classes, TimingReplica)   # timing only: one for all
        self.workers: list[SimWorker] = []
        n = self.ds.train_size if self.ds is not None else self._train_size()
        check_partitions(n, W, cfg.job.seed, split)
        perm = permutation(n, cfg.job.seed)   # (once: every worker's share is dealt from it)
        for r in range(W):
            batches, held = None, None
            part, h = worker_part(n, r, W, cfg.job.seed, split, perm)
            if h is not None and self.ds is not None:
                held = self.ds.take(h)
            if s.train:
                assert self.ds is not None
                batches = self.ds.train_batches(part, cfg.train.batch_size, cfg.job.seed, r)
            replica = shared if shared is not None else self._replica(shape, classes)
            # timing only: a step counts the samples a real worker's batch holds (its partition may be smaller)
            self.workers.append(SimWorker(self, r, schedules[r], replica, batches, held,
                                          min(cfg.train.batch_size, len(part))))
        self.live: dict[int, int] = {r: 0 for r in range(W)}
        self.cancellable: dict[int, SimWorker] = {}   # rank -> a worker whose wait has a cancel condition
        self.polls_pending = 0   # the asks of those conditions in the loop (`poll_cancel`): no other event is stuck
        self.evals: list[dict] = []
        self.log: list[dict] = []    # the coordinator's events
        self.events_dir = ""         # where the workers' event logs go while the run writes them (`spill`)
        self.held = 0                # the event-log lines the workers hold
        self.spill_at = sys.maxsize  # ... when they are written (`spill`; never in a run that writes none)
        self.ev_lines: list[dict] = []
        self.evaluator = self._replica(shape, classes) if s.train and cfg.cluster.evaluator else None
        self.direct = DirectClient(self)
        self.end_t = 0.0
        self.abort = ""
        self.changes = 0          # requests the shards served and membership changes: what a score may see move
        self.scored = -1          # `changes` at the last score
        self.moved_at = 0.0       # the virtual time of the last of them or of a delivery (a deadlock's, if any)

    def _describe(self) -> tuple[tuple, int]:
        from ..data import describe
        return describe(self.cfg.data)

    def _train_size(self) -> int:
        """The training set's size (a timing-only run's partitions), its data not kept."""
        return load_dataset(self.cfg.data, self.cfg.job.seed).train_size

    def _replica(self, shape: tuple, classes: int, kind: type[Replica] = Replica) -> Replica:
        c = self.cfg
        return kind(build_model(c.model.name, shape, classes, c.job.seed, c.model.hidden).train(), c.cluster.servers,
                    self.device)

    # ------------------------------------------------------------ the network and the shards
    # The network's arithmetic (`Network.depart`, `arrive`, `serve`) is written out in the
    # methods below, the same operations in the same order (a call per message and NIC
    # was a tenth of a timing-only worker step); `Network` is the reference, and
    # tests/test_simulate.py checks these against it.
    def send(self, w: SimWorker, items: list[tuple[int, Packet, Any]]) -> None:
        """A worker's requests leave it now, in order. Each is booked at the shard's NIC
        when its first byte leaves this worker's: one that waits behind this worker's
        earlier messages is booked then, by an event, so that a message another worker
        sends meanwhile, and that reaches the shard first, is taken in first."""
        loop, byte_s, node = self.loop, self.net.byte_s, w.node
        now = loop.now
        for i, msg, token in items:
            start = now if now > node.tx_free else node.tx_free   # Network.depart
            node.tx_free = start + msg.nbytes * byte_s
            if start > now:
                msg.leaves_at = start   # (until `withdraw`n)
                loop.push((start, next(loop.seq), self.leave, (i, token, msg, start)))   # (`loop.at`)
            else:
                self.arrive(i, token, msg, start)

    def leave(self, i: int, token: Any, msg: Packet, start: float) -> None:
        """A request that waited behind its worker's earlier ones leaves it now (`arrive`),
        unless its worker gave it up meanwhile (`withdraw`)."""
        if msg.leaves_at == start:
            self.arrive(i, token, msg, start)

    def withdraw(self, w: SimWorker, f: Any) -> None:
        """The requests of f, which w gave up (a refusal, a cancel), as the real client's
        `abandon` leaves them: those that had not begun to leave w's NIC never do (its fresh
        connections drop what waits in ZeroMQ's queue), and the NIC is free of them unless
        w sent more behind them; those on their way carry the values they left with
        (copies: w's next step rewrites the buffers they were sent from without copies).
        Until 2026-12-06 they all went on, with what w's next step wrote there: a shard
        applied the refused step's push with the next step's gradient, and the retry of
        its clock was a duplicate there."""
        now, node, byte_s = self.loop.now, w.node, self.net.byte_s
        waiting = [msg for _, msg, _ in f.items if msg.leaves_at > now]
        if waiting:
            if node.tx_free == waiting[-1].leaves_at + waiting[-1].nbytes * byte_s:   # (booked last)
                node.tx_free = waiting[0].leaves_at
            for msg in waiting:
                msg.leaves_at = -1.0
        for k, (_, msg, _) in enumerate(f.items):
            if f.out[k] is None and msg.leaves_at >= 0 and msg.tensors:
                msg.tensors, msg._arrays = [t.clone() for t in msg.tensors], None

    def arrive(self, i: int, token: Any, msg: Packet, start: float) -> None:
        """A request whose first byte left its worker at `start` (now): into shard i's
        NIC (`Network.arrive`), then served in the order it was taken in (`Network.serve`,
        for the bytes it makes the shard work through: `applied`)."""
        node, net = self.nodes[i], self.net
        arrived = start + net.latency_s
        if node.rx_free > arrived:
            arrived = node.rx_free
        node.rx_free = arrived = arrived + msg.nbytes * net.byte_s
        if msg.payload and (msg.op == "push" or msg.op == "elastic"):
            shard = self.shards[i]
            cost = 4 * (shard.P + shard.B) * net.apply_byte_s
            if "codec" in msg.fields:
                cost += self.decode_s[i]
        else:
            cost = msg.payload * net.apply_byte_s
        begin = arrived if arrived > node.cpu_free else node.cpu_free
        node.cpu_free = begin + cost
        node.busy_s += cost
        loop = self.loop   # (`loop.at`: cpu_free is not before now)
        loop.push((node.cpu_free, next(loop.seq), self.handle, (i, token, msg)))

    def applied(self, i: int, msg: Packet) -> int:
        """The bytes a request makes shard i work through (`sim.apply_gbps`): a push or an
        elastic offer, its float32 tables (a bfloat16 or compressed gradient is decoded
        into a dense one and applied to all of them: a compressed one's decoding costs
        `decode_s` more); any other request, its payload. (Written out in `arrive`.)"""
        if msg.op in ("push", "elastic") and msg.payload:
            shard = self.shards[i]
            return 4 * (shard.P + shard.B)
        return msg.payload

    def serve(self, i: int, token: Any, msg: wire.Message) -> list[tuple[Any, Packet]]:
        """Shard i serves one request now, as the daemon's serve loop does."""
        try:
            replies = self.shards[i].handle(token, msg)
        except Exception as e:
            replies = self.refused(i, token, msg, e)
        return packets(replies)

    def refused(self, i: int, token: Any, msg: wire.Message, e: Exception) -> list[tuple[Any, Any]]:
        """The error reply to a request whose handling raised, as the daemon's serve loop
        (transport.Service) answers it: a WireError's code, or, for a bug, `internal`
        (the shard serves on); counted as a bad message."""
        self.shards[i].counters["bad_messages"] += 1
        if isinstance(e, wire.WireError):
            return [(token, wire.error(msg.id, e.code, e.reason))]
        return [(token, wire.error(msg.id, wire.INTERNAL, f"{type(e).__name__}: {e}"))]

    def handle(self, i: int, token: Any, msg: Packet) -> None:
        """Shard i serves a request now (`serve`), and its replies leave it."""
        self.changes += 1
        self.moved_at = self.loop.now
        try:
            replies = self.shards[i].handle(token, msg)
        except Exception as e:
            replies = self.refused(i, token, msg, e)
        for tok, m in replies:
            self.reply(i, tok, m if isinstance(m, Packet) else received(m))

    def reply(self, i: int, token: Any, msg: Packet) -> None:
        """Shard i's answer leaves it now. A worker hears from every shard: with more
        than one, an answer that waits behind the shard's earlier ones is booked at the
        worker's NIC when it leaves (as in `send`); with one, the worker hears nothing
        else, and booking at once keeps the order its bytes arrive in."""
        loop, node, net = self.loop, self.nodes[i], self.net
        now = loop.now
        start = now if now > node.tx_free else node.tx_free   # Network.depart
        node.tx_free = start + msg.nbytes * net.byte_s
        if start > now and len(self.nodes) > 1:
            loop.push((start, next(loop.seq), self.answer, (i, token, msg, start)))   # (`loop.at`)
            return
        node = token[0].node   # `answer`, written out
        arrived = start + net.latency_s
        if node.rx_free > arrived:
            arrived = node.rx_free
        node.rx_free = arrived + msg.nbytes * net.byte_s
        loop.push((node.rx_free, next(loop.seq), self.deliver, (i, token, msg)))   # (`loop.at`: not before now)

    def answer(self, i: int, token: Any, msg: Packet, start: float) -> None:
        """An answer whose first byte left its shard at `start` (now) into its worker's
        NIC (`Network.arrive`)."""
        node, net = token[0].node, self.net
        arrived = start + net.latency_s
        if node.rx_free > arrived:
            arrived = node.rx_free
        node.rx_free = arrived + msg.nbytes * net.byte_s
        loop = self.loop   # (`loop.at`: rx_free is not before now)
        loop.push((node.rx_free, next(loop.seq), self.deliver, (i, token, msg)))

    def deliver(self, i: int, token: Any, msg: Packet) -> None:
        self.moved_at = self.loop.now
        w, f, k = token
        if f.closed:   # (the real client drops a given-up request's answers unread: its connection is made again)
            return
        w.client._recv += msg.nbytes
        if msg.op == "error":
            try:
                wire.raise_if_error(msg, f"shard {i} (simulated)")
            except wire.RemoteError as e:
                f.error = e
        else:
            f.out[k] = msg
            f.left -= 1
        if f.waiting and (f.left == 0 or f.error is not None):   # (`f.complete`)
            self.wake(w)

    # ------------------------------------------------------------ workers
    def wake(self, w: SimWorker) -> None:
        if w.t < self.loop.now:
            w.t = self.loop.now
        w.proc.resume()
        if w.proc.done and w.finished_at is None:
            w.finished_at = w.t
            self.loop.at(w.t, self.finished, w)

    def finished(self, w: SimWorker) -> None:
        """A worker's budget is spent (or it stopped): it leaves the live set."""
        self.live.pop(w.rank, None)
        self.end_t = max(self.end_t, self.loop.now)
        self.log.append({"t": written(self.loop.now), "role": "coordinator", "event": "finish", "rank": w.rank,
                         **({"error": w.error} if w.error else {})})
        if w.error and not self.abort:
            self.abort = w.error
            self.loop.stop()
        self.loop.at(self.loop.now + self.cfg.sim.latency_s, self.membership, dict(self.live))
        if not self.live and self.evaluator is not None:
            self.loop.at(self.loop.now, self.evaluate, True)

    def membership(self, live: dict[int, int]) -> None:
        self.changes += 1
        self.moved_at = self.loop.now
        for i, shard in enumerate(self.shards):
            for token, msg in packets(shard.set_live(live)):
                self.reply(i, token, msg)
        for rank in sorted(self.cancellable):  # in rank order: a waiter whose cancel condition turned true gives up
            w = self.workers[rank]
            f = w.blocked_on
            if f is not None and f.cancel is not None:
                if w.t < self.loop.now:   # (its condition asked at this moment, as once woken: a window of time)
                    w.t = self.loop.now
                if f.cancel():
                    self.wake(w)

    def poll_cancel(self, w: SimWorker, f: Any, n: int) -> None:
        """The n-th ask of a waiting worker's cancel condition (`SimClient.finish`): it
        wakes to ask it, unless its wait ended or was asked again since."""
        self.polls_pending -= 1
        if f.waiting and f.polls == n and w.blocked_on is f:
            self.wake(w)

    # ------------------------------------------------------------ the evaluator
    def evaluate(self, final: bool = False) -> None:
        if self.evaluator is None or self.abort:
            return
        assert self.ds is not None
        if not final and not self.live:
            return
        samples = sum(w.samples if final else w.samples_by(self.loop.now) for w in self.workers)
        # Nothing served since the last score (the shards' model cannot have moved): nothing
        # to score, and the next score waits for the next event (steps far longer than
        # eval.every_seconds made thousands of identical scores, or, with nothing due for
        # hours of virtual time, an endless run). Asking whether a worker logged a step
        # instead missed a model updated by a push whose reply was still on its way.
        unchanged = bool(self.evals) and self.changes == self.scored
        if final and unchanged and self.evals[-1]["t"] == written(self.loop.now):
            self.evals[-1]["final"] = True            # the last score was of this model, now: it is the final one
            self.ev_lines[-1]["final"] = True
            return
        if not unchanged or final:
            self.scored = self.changes
            self.evaluator.load(*ParameterClient.tables(self.mode.global_model(self.direct)))
            acc, loss = self.evaluator.score_batches(self.ds.test_batches(self.cfg.eval.batch_size))
            t = written(self.loop.now)
            self.evals.append({"t": t, "samples": samples, "accuracy": acc, "loss": loss, "final": final})
            self.ev_lines.append({"t": t, "role": "evaluator", "samples": samples, "accuracy": acc, "loss": loss,
                                  **({"final": True} if final else {})})
        if not final and len(self.loop) > self.polls_pending:  # nothing else to come: stuck; `run` says so
            due = self.loop.now + self.cfg.eval.every_seconds
            self.loop.at(max(due, self.loop.next_at() or due) if unchanged else due, self.evaluate, False)

    # ------------------------------------------------------------ the run
    def run(self, out: str | None = None) -> dict:
        """Run the job; with `out`, write its summary.json and events/ there (a run that
        fails or is interrupted leaves no event logs: those written while it ran go)."""
        if out:
            self.events_dir = os.path.join(out, "events")
            self.spill_at = SPILL_LINES
        try:
            summary = self._run()
            if out:
                self.write(out, summary)
        except BaseException:
            self.unspill()
            raise
        return summary

    def _run(self) -> dict:
        old_threads = torch.get_num_threads()
        torch.set_num_threads(1)
        flushed = flush_denormals(self.cfg.train.flush_denormal)   # as a real job's workers and shards
        try:
            self.log.append({"t": 0.0, "role": "coordinator", "event": "start", "workers": len(self.workers),
                             "simulated": True})
            self.loop.at(0.0, self.membership, dict(self.live))
            for w in self.workers:
                self.offer_initial_values(w)
                self.loop.at(0.0, self.wake, w)
            if self.evaluator is not None:
                self.loop.at(0.0, self.evaluate, False)
            self._loop()
            stuck = [w for w in self.workers if not w.proc.done]
            if stuck and not self.abort:
                raise Deadlock(self._deadlock(stuck))
        finally:
            for w in self.workers:
                w.proc.abandon()
            torch.set_num_threads(old_threads)
            flush_denormals(flushed)
        return self.summary()

    def spill(self) -> None:
        """Write the lines the workers hold to their event logs, but for those the
        evaluator may still ask about (`SimWorker.spill`): a line per step of every
        worker, held to the end, made a run's memory grow with workers x steps (about
        0.6 KB a worker step: 6 GB at 1,024 workers x 10,000 steps). Again once the
        workers hold `SPILL_LINES` more."""
        os.makedirs(self.events_dir, exist_ok=True)
        now = self.loop.now
        self.held = sum(w.spill(os.path.join(self.events_dir, f"worker-{w.rank}.jsonl"), now) for w in self.workers)
        self.spill_at = self.held + SPILL_LINES

    def unspill(self) -> None:
        """Remove the event logs `spill` began (the run failed or was interrupted)."""
        for w in self.workers:
            if w.spilled:
                w.spilled = False
                try:
                    os.remove(os.path.join(self.events_dir, f"worker-{w.rank}.jsonl"))
                except OSError:
                    pass
        try:
            os.rmdir(self.events_dir)   # if `spill` made it (and nothing else is in it)
        except OSError:
            pass

    def offer_initial_values(self, w: SimWorker) -> None:
        """What a real worker does before its training clock starts (`Worker.start`): rank 0
        offers the shards its initial values and every other rank asks for them. The shards,
        built from the seed, have them already (they answer at once and keep theirs), so
        here the messages only count, in the worker's bytes as in a real run's: served
        before virtual time 0, as a real worker's wait for them is not training time."""
        direct = DirectClient(self, w.rank)
        direct.init((w.replica.params(), w.replica.buffers()) if w.rank == 0 else None)
        w.client._sent += direct.bytes_sent
        w.client._recv += direct.bytes_recv

    def _loop(self) -> None:
        last = [time.monotonic()]

        def progress() -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S:
                last[0] = now
                assert self.progress is not None
                self.progress(self)
        with few_collections():
            self.loop.run(progress if self.progress is not None else None)

    def _deadlock(self, stuck: list[SimWorker]) -> str:
        names = ", ".join(f"{w.rank} (clock {w.clock})" for w in stuck[:8]) + (" ..." if len(stuck) > 8 else "")
        ops = sorted({op for w in stuck if w.blocked_on is not None for op in w.blocked_on.ops})
        return (f"simulation of {self.cfg.mode.name} deadlocked at virtual time {self.moved_at:.4f} s: "
                f"{len(stuck)} worker(s) wait for answers that no event will bring: {names}"
                + (f"; waiting on {', '.join(ops)}" if ops else ""))

    def fraction_done(self) -> tuple[float, str]:
        """The share of the budget done, and of which: the workers' steps of `train.steps`
        or the virtual seconds of `train.seconds`, whichever is further (the first reached
        ends the run)."""
        t = self.cfg.train
        shares = []
        if t.steps:
            shares.append((sum(min(w.clock, t.steps) for w in self.workers) / (t.steps * len(self.workers)),
                           "of the steps"))
        if t.seconds:
            shares.append((min(1.0, self.loop.now / t.seconds), f"of the {t.seconds:g} virtual seconds"))
        return max(shares)

    def summary(self) -> dict:
        c = self.cfg
        wall = self.end_t
        s = c.sim
        extra = {"job": c.job.name, "seed": c.job.seed, "model": c.model.name, "data": c.data.name,
                 "batch_size": c.train.batch_size, "steps": c.train.steps, "faults": dict(vars(c.faults)),
                 "bad_messages_coordinator": 0, "startup_s": 0.0, "startup_from": "simulation",
                 "simulated": True,
                 "sim": {"compute_s": self.compute_s, "compute_s_source": "config" if s.compute_s else "calibrated",
                         "compute_cv": s.compute_cv, "latency_s": s.latency_s, "bandwidth_gbps": s.bandwidth_gbps,
                         "apply_gbps": s.apply_gbps, "train": s.train, "events": self.loop.events,
                         **({"encode_ns": self.codec_ns[0], "decode_ns": self.codec_ns[1]}
                            if c.wire.compression != "none" else {})}}
        if self.abort:
            extra["aborted"] = self.abort
        return summarize(mode=c.mode.name, mode_params=c.mode_params, workers=c.cluster.workers,
                         servers=c.cluster.servers, wall_s=wall,
                         worker_stats={w.rank: w.stats() for w in self.workers},
                         server_stats={i: sh.stats() for i, sh in enumerate(self.shards)},
                         evals=self.evals, target=c.eval.target_accuracy,
                         failures={"workers_lost": 0, "workers_rejoined": 0, "workers_restarted": 0, "workers_gone": 0,
                                   "shard_restarts": 0, "coordinator_restarts": 0}, extra=extra)

    def write(self, out: str, summary: dict) -> None:
        events = os.path.join(out, "events")
        os.makedirs(events, exist_ok=True)

        def dump(name: str, text: Iterable[str], mode: str = "w") -> None:
            with open(os.path.join(events, name), mode) as f:
                f.writelines(text)
        for w in self.workers:   # after the lines written while it ran (`spill`)
            dump(f"worker-{w.rank}.jsonl", w.log_text(), "a" if w.spilled else "w")
        dump("evaluator-0.jsonl", map(json_line, self.ev_lines))
        done = {"t": written(self.end_t), "role": "coordinator", "event": "done", "wall_s": summary["wall_s"]}
        dump("coordinator-0.jsonl", map(json_line, self.log + [done]))   # (wall_s: summary's)
        write_json_atomic(os.path.join(out, "summary.json"), summary)


def progress_line(prefix: str, stream: Any = sys.stderr) -> Callable[[Simulation], None]:
    """A progress callback: virtual time, the share of the budget done (`fraction_done`)
    and the real time left, to stderr."""
    t0 = time.monotonic()

    def show(sim: Simulation) -> None:
        done, of = sim.fraction_done()
        spent = time.monotonic() - t0
        left = f", about {spent * (1 - done) / done:.0f} s left" if done > 0 else ""
        stream.write(f"{prefix}  virtual {sim.loop.now:.2f} s, {100 * done:.0f}% {of}{left}\n")
        stream.flush()
    return show
