"""A simulated worker: the `Trainer` a mode's schedule drives, and its parameter client.

`SimWorker` is what workers/worker.py's `Worker` is to a schedule (compute, client,
replica, step log, live set), on the virtual clock: `compute()` runs the real forward
and backward (unless `sim.train = false`) and moves the worker's own clock `t` by the
cost model's step time; the step loop, the counting of refused steps and
`cluster.max_rejections` are the real worker's.

`SimClient` is the real `ParameterClient` with its transport replaced: every op the
schedules use (pull, join, push_pull and its begin/finish halves, elastic, put_model,
get_model, index, and any later one built on `begin`/`finish`) builds the same
messages, handed over in process (`messages.packet`), which the simulation delivers to
the real shards at virtual times. `finish`
blocks the worker's thread until the answers are delivered (or its `cancel` condition
turns true), and `wait_s` is the virtual time it blocked.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import wire
from ..consistency.rule import Diverged, Schedule
from ..consistency.staleness import Histogram
from ..metrics import json_line, step_text, written
from ..workers.client import Cancelled, ParameterClient
from ..workers.worker import Jitter
from .engine import Node, Process, TorchRandom
from .messages import Packet, make

if TYPE_CHECKING:
    from ..config import Config
    from ..data import Batches
    from ..replica import Replica
    from .run import Simulation


def lognormal_sigma(cv: float) -> float:
    """The sigma of a lognormal of coefficient of variation `cv` (`sim.compute_cv`):
    sqrt(log(1 + cv^2)), as 2 log(cv) where cv^2 would overflow (above 1e154 it did:
    every run failed with "OverflowError: (34, 'Numerical result out of range')")."""
    if cv <= 0:
        return 0.0
    return math.sqrt(math.log1p(cv ** 2) if cv < 1e150 else 2 * math.log(cv))


# How often a wait with a cancel condition asks it (virtual s): the real client's wait polls
# its sockets 0.2 s at a time while it has one (`transport.Peers.wait`).
CANCEL_POLL_S = 0.2


@dataclass
class Flight:
    """Requests sent by `SimClient.begin`, answered in the order they were made
    (`reqs` and `out` as in the real client's `InFlight`)."""
    reqs: list
    out: list
    left: int
    sent_at: float
    cancel: Callable[[], bool] | None
    items: list                  # (shard, packet, token) of each request, as sent (`Simulation.withdraw`)
    error: Exception | None = None
    waiting: bool = False        # the worker is blocked on it
    closed: bool = False         # the worker gave it up (an error, a cancel): later answers are dropped
    repeat: bool = False         # a push this process sent before (`InFlight.repeat`)
    resent: set = field(default_factory=set)   # (`InFlight.resent`: the simulator resends nothing)
    polls: int = 0               # the cancel condition's asks scheduled (`SimClient.finish`): the latest's number

    @property
    def ops(self) -> list[str]:
        """The requests' ops (for messages: made when asked, not for every step's requests)."""
        return [op for _, op, _ in self.reqs]

    @property
    def complete(self) -> bool:
        return self.left == 0 or self.error is not None


class CountingClient(ParameterClient):
    """The parameter client with the simulator for its transport: no sockets (the
    parent's `__init__`, which opens them, is not called); it counts the bytes a real
    client would have sent and received."""

    def __init__(self, cfg: Config, rank: int):
        self._setup(cfg, rank)
        self._sent = 0
        self._recv = 0

    @property
    def bytes_sent(self) -> int:
        return self._sent

    @property
    def bytes_recv(self) -> int:
        return self._recv


class SimClient(CountingClient):
    """The parameter client over the simulated network."""

    def __init__(self, cfg: Config, rank: int, worker: SimWorker):
        super().__init__(cfg, rank)
        self.worker = worker
        self.retry_s = 0.0

    def begin(self, reqs: Sequence[tuple[int, str, dict]], cancel: Callable[[], bool] | None = None) -> Any:
        w = self.worker
        for i, _op, kw in reqs:   # a compressed push was encoded first (`Simulation.encode_s`)
            if "codec" in kw:
                w.t += w.sim.encode_s[i]
        out: list = [None] * len(reqs)
        items: list = []
        f = Flight(list(reqs), out, len(reqs), w.t, cancel, items)
        ids = w.sim.ids   # (ids size headers: counted per run)
        for k, (i, op, kw) in enumerate(reqs):
            fields = {**kw}   # (the request's own dict stays as it is: `finish_push_pull` reads it)
            p = make(op, next(ids), self.rank, fields.pop("clock", -1), fields.pop("arrays", ()), fields)
            self._sent += p.nbytes
            items.append((i, p, (w, f, k)))
        loop = w.sim.loop   # (`loop.at`, without a call)
        loop.push((w.t if w.t >= loop.now else loop.now, next(loop.seq), w.sim.send, (w, items)))
        return f

    def finish(self, f: Any) -> list[wire.Message]:
        w = self.worker
        if f.sent_at < w.t:   # the worker computed since sending: answers may have come meanwhile
            w.sleep_until(w.t)
        t0 = w.t
        try:
            while f.left and f.error is None:   # (not `f.complete`: a call less, twice a step)
                if f.cancel is not None and f.cancel():
                    raise Cancelled(f"worker {self.rank}: gave up waiting for {', '.join(sorted(set(f.ops)))}")
                f.waiting = True
                w.blocked_on = f   # (`w.wait_on(f)`, written out)
                if f.cancel is not None:
                    w.sim.cancellable[w.rank] = w
                    # Asked again CANCEL_POLL_S later, as the real client's wait asks it: a condition
                    # of time (ltfb's `await_model`: a window on the worker's clock) turned true
                    # with no delivery nor membership change to wake the worker, which waited on.
                    # Not where nothing else is to come (only such asks): the run is stuck, and
                    # `Simulation.run` says so (asked on for good, it ran on at 3.1M events).
                    sim, loop = w.sim, w.sim.loop
                    if len(loop) > sim.polls_pending:
                        f.polls += 1
                        sim.polls_pending += 1
                        loop.push((max(w.t, loop.now) + CANCEL_POLL_S, next(loop.seq), sim.poll_cancel,
                                   (w, f, f.polls)))
                w.proc.suspend()
        finally:
            f.waiting = False
            if w.blocked_on is not None:
                w.wait_on(None)
            if f.left and f.error is None:   # (a cancel; a run abandoned)
                self.abandon(f)
            self.wait_s += w.t - t0
        if f.error is not None:
            self.abandon(f)
            raise f.error
        self.answered += 1
        return f.out

    def abandon(self, f: Any) -> None:
        """Give up f's requests unanswered, as the real client does (its fresh connections
        drop what still waits to leave): later answers are dropped, and the requests that
        had not begun to leave this worker go nowhere (`Simulation.withdraw`)."""
        f.closed = True
        self.worker.sim.withdraw(self.worker, f)

    @staticmethod
    def tables(msgs: Sequence[wire.Message]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`ParameterClient.tables` of the answers, which are packets here: their tensors."""
        answers: Sequence[Packet] = msgs   # type: ignore[assignment]   # (not `cast`: a call every step)
        return [m.tensors[0] for m in answers], [m.tensors[1] for m in answers]

    def close(self) -> None:
        pass


class SimWorker:
    """One virtual worker: the Trainer of its mode's schedule, run as a `Process` (a greenlet or a thread)."""

    def __init__(self, sim: Simulation, rank: int, schedule: Schedule, replica: Replica,
                 batches: Batches | None, holdout: tuple[Any, Any] | None, batch: int = 0):
        cfg = sim.cfg
        self.sim = sim
        self.cfg = cfg
        self.rank = rank
        self.schedule = schedule
        self.replica = replica
        self.batches = batches
        self.batch = batch            # samples a timing-only step counts (the real batch: a partition may be smaller)
        if holdout is not None:
            self.holdout = holdout
        self.clock = 0
        self.taken_back = False   # (a simulated worker is never restarted)
        self.t = 0.0                  # this worker's virtual time
        self.samples = 0
        self.steps = 0
        self.rejected = 0
        self.loss = float("nan")
        self.hist = Histogram()
        self.client = SimClient(cfg, rank, self)
        self.node = Node(f"worker-{rank}")
        self.lines: list[dict | tuple] = []   # the event log's lines not yet written (steps as tuples: `log_step`)
        self.spilled = False          # some of them are in its file already (`spill`)
        self.error = ""
        self.finished_at: float | None = None
        self.blocked_on: Flight | None = None   # the requests this worker waits for
        s, f = cfg.sim, cfg.faults
        self._rng = random.Random(f"psgd-sim:{cfg.job.seed}:{rank}")   # the compute spread
        self._jitter = Jitter(f.jitter_prob, f.jitter_s, cfg.job.seed, rank)  # the real worker's, on its own stream
        self._sigma = lognormal_sigma(s.compute_cv)
        self._slow = f.slow_factor if f.slow_rank == rank and f.slow_factor > 1 else 1.0
        rng = TorchRandom(cfg.job.seed * 1000 + rank, replica.device) if batches is not None else None
        self.proc = Process(f"sim-worker-{rank}", self.run, rng)   # a worker that trains draws as the real one

    # ------------------------------------------------------------ the step loop (its thread)
    def run(self) -> None:
        try:
            self.schedule.start(self)
            self.in_a_row = 0
            while True:   # (as the real worker's `_steps`: a refused settle moves the clock back)
                while self.more():
                    if self._attempt(self.schedule.step):
                        return
                if self._attempt(self.schedule.finish) or not self.more():
                    return
        except Cancelled:
            pass  # as the real worker: a wait given up ends the worker
        except wire.RemoteError as e:   # as the real worker's `_train`: the job ends, naming it (it failed the run)
            self.error = f"worker {self.rank}: {e.reason}"

    def _attempt(self, step: Callable[[Any], None]) -> bool:
        """One step, as the real worker counts it; True when the worker must stop."""
        answered = self.client.answered
        try:
            step(self)
            if self.client.answered != answered:   # as the real worker's: a local step does not end a run
                self.in_a_row = 0
            return False
        except (wire.Refused, Diverged) as e:
            self.rejected += 1
            self.in_a_row += 1
            if self.in_a_row < self.cfg.cluster.max_rejections:
                return False
            reason = e.reason if isinstance(e, wire.Refused) else str(e)
            self.error = (f"worker {self.rank}: {reason}; stopping after {self.in_a_row} refused steps in a row "
                          f"(cluster.max_rejections)")
            return True

    def more(self) -> bool:
        t = self.cfg.train
        if t.steps and self.clock >= t.steps:
            return False
        return not (t.seconds and self.t >= t.seconds)

    # ------------------------------------------------------------ virtual time
    def wait_on(self, f: Flight | None) -> None:
        """Block on the answers of f (None: on nothing); a wait that may be given up
        (`cancel`) is asked again at every membership change."""
        self.blocked_on = f
        if f is not None and f.cancel is not None:
            self.sim.cancellable[self.rank] = self
        else:
            self.sim.cancellable.pop(self.rank, None)

    def sleep_until(self, t: float) -> None:
        """Block this worker's thread until the loop reaches t."""
        loop = self.sim.loop   # (`loop.at`, without a call)
        loop.push((t if t >= loop.now else loop.now, next(loop.seq), self.sim.wake, (self,)))
        self.proc.suspend()

    def step_time(self) -> float:
        """The cost model's time for one forward + backward, with spread and faults."""
        f = self.cfg.faults
        d = self.sim.compute_s
        if self._sigma:
            d *= self._rng.lognormvariate(-self._sigma ** 2 / 2, self._sigma)  # mean 1
        return d * self._slow + f.step_delay_s + self._jitter.draw(self.clock)

    # ------------------------------------------------------------ what a schedule may call
    def compute(self, slot: int = 0) -> float:
        if self.batches is not None:
            x, y = self.batches.next()
            x, y = x.to(self.replica.device), y.to(self.replica.device)
            model = self.replica.model
            model.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            self.loss = float(loss.item())
            self.samples += len(y)
        else:   # timing only: no gradient, a finite loss, the samples of this worker's batch
            self.loss = 0.0
            self.samples += self.batch
        self.t += self.step_time()
        return self.loss

    def score(self) -> tuple[float, float]:
        return self.replica.score(*self.holdout, self.cfg.eval.batch_size)

    def log_step(self, staleness: int, wait_s: float, step: tuple[float, int] | None = None, **extra: Any) -> None:
        """A step's line (as the real worker's: `step`, the (loss, samples) of a step
        settled after the next one computed), kept as a tuple until the log is written
        (`log_lines`): a dict per step of every worker was most of a long run's memory,
        and slow to build. Written to the event log once the run's workers hold
        `SPILL_LINES` of them (`Simulation.spill`)."""
        self.steps += 1
        c = self.client
        loss, samples = step if step is not None else (self.loss, self.samples)
        if self._jitter.prob > 0:   # as the real worker's step line: was this step's compute (at clock - 1) delayed?
            extra = {**extra, "jitter": self._jitter.delayed(self.clock - 1)}
        self.lines.append((self.t, self.steps, self.clock, loss, samples, staleness, wait_s, c._sent,
                           c._recv, extra))
        sim = self.sim
        sim.held += 1
        if sim.held >= sim.spill_at:
            sim.spill()

    def samples_by(self, t: float) -> int:
        """The samples of the steps this worker had finished at virtual time t (its body
        runs ahead of the loop while it computes: a whole round ahead in ltfb or diloco)."""
        for x in reversed(self.lines):
            if type(x) is tuple and x[0] <= t:
                return x[4]
        return 0

    def log_lines(self, upto: int | None = None) -> list[dict]:
        """The event log's lines not yet written to its file (`spill`: all of them, in a
        run that writes no event logs), in order; the first `upto` of them."""
        return [self._step_line(x) if isinstance(x, tuple) else x for x in self.lines[:upto]]

    def log_text(self, upto: int | None = None) -> list[str]:
        """`log_lines` as the event log's text, `json_line` of each (a step's line written
        out, not built as a dict and encoded: that was about a tenth of a timing-only
        worker step)."""
        return [self._step_text(x) if isinstance(x, tuple) else json_line(x) for x in self.lines[:upto]]

    def spill(self, path: str, now: float) -> int:
        """Append the lines held to the event log at `path` (made anew by the first
        spill), but for those `samples_by` may still be asked about from virtual time
        `now` on: the last step finished by `now` and those after it (this worker's body
        runs ahead of the loop). How many lines are still held."""
        lines = self.lines
        keep = 0
        for k in range(len(lines) - 1, -1, -1):
            x = lines[k]
            if type(x) is tuple and x[0] <= now:
                keep = k
                break
        if keep:
            mode = "a" if self.spilled else "w"
            self.spilled = True   # (before the file is made: a first write that fails leaves it to `unspill`)
            with open(path, mode) as f:
                f.writelines(self.log_text(keep))
            del lines[:keep]
        return len(lines)

    def _step_text(self, step: tuple) -> str:
        """`json_line(self._step_line(step))`, the same text: the usual values (floats, ints,
        and bool, None or int extra fields of plain names) written out, any other line
        encoded as the dict."""
        t, n, clock, loss, samples, staleness, wait_s, sent, recv, extra = step
        line = step_text(written(t), '"worker"', self.rank, n, clock, round(loss, 5), samples, staleness,
                         written(wait_s), sent, recv, extra)
        return json_line(self._step_line(step)) if line is None else line

    def _step_line(self, step: tuple) -> dict:
        t, n, clock, loss, samples, staleness, wait_s, sent, recv, extra = step
        return {"t": written(t), "role": "worker", "rank": self.rank, "step": n, "clock": clock,
                "loss": round(loss, 5), "samples": samples, "staleness": staleness, "wait_s": written(wait_s),
                "bytes_sent": sent, "bytes_recv": recv, **extra}

    def live(self) -> set[int]:
        if self.t > self.sim.loop.now and self.proc.running():
            self.sleep_until(self.t)   # see the membership as it is at this worker's time
        return set(self.sim.live)

    def event(self, **fields: Any) -> None:
        self.lines.append({"t": written(self.t), "role": "worker", **fields})
        self.sim.held += 1

    def note(self, text: str) -> None:
        self.lines.append({"t": written(self.t), "role": "worker", "rank": self.rank, "note": text})
        self.sim.held += 1

    def now(self) -> float:
        return self.t   # virtual: a time budget (train.seconds) is of virtual seconds

    def stats(self) -> dict:
        return {"samples": self.samples, "steps": self.steps, "clock": self.clock,
                "elapsed_s": written(self.finished_at if self.finished_at is not None else self.t),
                "wait_s": written(self.client.wait_s), "bytes_sent": self.client.bytes_sent,
                "bytes_recv": self.client.bytes_recv, **self.hist.stats(),
                "loss": self.loss if self.loss == self.loss else None, "retries": 0, "rejected": self.rejected}
