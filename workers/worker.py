"""The worker daemon: a training loop over its data partition plus a parameter client.

    psgd worker [CONFIG] --out DIR [--device auto|cpu|cuda[:N]] [--rank R] [--set k=v ...]

Registers with the coordinator (rank, run config, starting clock), then runs the mode's
worker schedule (psgd/consistency/) step by step until the budget ends: this file is
the mechanism the schedule uses (compute a step, the parameter client, the replica,
the step log) and knows no mode.

A step that the shards refuse (or that diverges locally) is counted (`rejected`) and
tried again with the next batch; after `cluster.max_rejections` refusals in a row the
worker stops with one line naming the reason and tells the coordinator, which ends the
job. A worker that gives up on a shard it cannot reach tells the coordinator why
(`leaving`), without finishing its rank. Every step is a line in
DIR/events/worker-<rank>.jsonl. Cumulative counters ride on the heartbeats, so the
coordinator's summary survives a worker that dies; a new process for a rank of a job
under way reads the rank's step lines first, and its heartbeats carry what its earlier
processes did (`logged`: a process that died was heard up to its last heartbeat).
"""
from __future__ import annotations

import os
import random
import time
from typing import Any

import torch
import zmq
from torch import nn

from psgd import wire
from psgd.config import Config
from psgd.consistency import get as get_mode
from psgd.consistency.rule import Diverged, Schedule
from psgd.consistency.staleness import Histogram
from psgd.data import DataError, load_dataset, worker_part
from psgd.log import log
from psgd.membership import AFTER_TRAINING, CoordinatorLink
from psgd.metrics import EventLog, PidFile, ThreadCpu, earlier_lives
from psgd.models import build_model
from psgd.optim import denormals_flushed, make_optimizer
from psgd.replica import OverlapUnsafe, Replica, check_device
from psgd.sharding import model_layout
from psgd.workers.client import Cancelled, ParameterClient, ShardUnreachable

# The step lines of this job are those written since it started (`trained_s` ago; an
# earlier job's may be in the folder): this much earlier too, for the clocks of two hosts.
LINES_SLACK_S = 1.0
_ENDED = (*AFTER_TRAINING, "done")   # the coordinator's phases once the job's training is over (`left_behind`)


class Jitter:
    """Transient stragglers (`faults.jitter_prob` = p, `faults.jitter_s` = d): each step
    is delayed by d with probability p, independently, from a generator of its own seeded
    by (job.seed, rank), so that a run's delays are reproducible and no other random
    stream (batches, initialisation) shifts when jitter is turned on."""

    def __init__(self, prob: float, delay_s: float, seed: int, rank: int):
        self.prob, self.delay_s = prob, delay_s
        self.rng = random.Random(f"psgd-jitter-{seed}-{rank}")
        self._delayed: dict[int, bool] = {}   # clock -> was its compute delayed (until its step line)

    def draw(self, clock: int | None = None) -> float:
        """The delay of the compute at `clock` (remembered for its step line): d with
        probability p, else 0 (no draw when p = 0)."""
        if self.prob <= 0:
            return 0.0
        delay = self.delay_s if self.rng.random() < self.prob else 0.0
        if clock is not None:
            self._delayed[clock] = delay > 0
        return delay

    def delayed(self, clock: int) -> bool:
        """Was the compute at `clock` delayed? Asked by its step line, which may come after
        the next compute (prefetch); a refused step's leftovers are dropped."""
        was = self._delayed.pop(clock, False)
        for c in [c for c in self._delayed if c < clock - 8]:
            del self._delayed[c]
        return was


def slowed(faults, rank: int) -> bool:
    """Is any slowness injected into rank `rank`'s steps (`faults.*`: a slow link, a slow
    rank, jitter)? If not, a step takes no time for `Worker.slow_down` to scale."""
    return faults.step_delay_s > 0 or (faults.slow_rank == rank and faults.slow_factor > 1) or faults.jitter_prob > 0


def local_rank() -> int:
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


class Worker:
    slowed = True   # is a fault slowing this rank's steps (`attach` decides; until then each step is timed)
    own_model = True   # the model is psgd's own: its parameters may move into one block (`Replica`'s `flat`)

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
        self.rejected = 0          # steps refused by the shards (or diverged locally)
        self.in_a_row = 0          # of them, since the last step the shards answered
        self.t_start = time.monotonic()
        self.cpu = ThreadCpu()     # the training thread's CPU times, from `start` (summary.json's cpu_wait_fraction)
        self.trained_s = 0.0       # how long the job had trained when this process joined it
        self.taken_back = False    # it took its rank over from a process the job still counted live
        self.registration = ""     # the live_id of its latest registration: its join reads name it (`since`)
        self.logged: dict = {}     # the counters of the rank's earlier processes, from their step lines
        self.reported = False      # the coordinator has this process's finish (`_report_end`)

    # ------------------------------------------------------------ counters
    def stats(self) -> dict:
        c = getattr(self, "client", None)
        return {"samples": self.samples, "steps": self.steps, "clock": self.clock,
                "elapsed_s": round(time.monotonic() - self.t_start, 4),
                "wait_s": round(c.waited() if c else 0.0, 4), "bytes_sent": c.bytes_sent if c else 0,
                "bytes_recv": c.bytes_recv if c else 0, **self.hist.stats(),
                "loss": self.loss if self.loss == self.loss else None, "retries": c.retries if c else 0,
                "rejected": self.rejected, **self.cpu.read()}

    # ------------------------------------------------------------ set-up
    def run(self) -> int:
        # The device first: one torch cannot use here is one line before this worker joins
        # (after, the job waited cluster.timeout_s for it). Then load the data and build the
        # model before registering, so that the job's clock starts when every worker is
        # ready; redo it if the run's config differs.
        self.device = check_device(self.device_spec, local_rank())
        ds, model = self._build(self.cfg0)
        cfg = self.join(model)
        if (cfg.data, cfg.model, cfg.job) != (self.cfg0.data, self.cfg0.model, self.cfg0.job):
            ds, model = self._build(cfg)
        with PidFile(self.out, "worker", self.rank), denormals_flushed(cfg.train.flush_denormal):
            return self._train(cfg, ds, model)

    def join(self, model: nn.Module) -> Config:
        """Register with the coordinator (with the model's layout: the shards of a
        learned model take it from there); the run's config."""
        self.link = CoordinatorLink(self.cfg0, "worker", max(self.want_rank, 0), self.ctx)
        answer = self.link.register(self.want_rank, layout=model_layout(model))
        self.rank = int(answer.get("assigned_rank"))
        self.link.index = self.rank
        self.cfg = self.link.take_job_config(answer)
        self.clock = int(answer.get("start_clock", 0))
        self.trained_s = float(answer.get("trained_s", 0.0))  # a restarted worker's job has trained that long
        self.taken_back = bool(answer.get("taken_back", False))   # its rank's process before was still counted live
        self.registration = str(answer.get("live_id") or "")
        self.name = f"worker-{self.rank}"
        return self.cfg

    def attach(self, model: nn.Module, device: torch.device) -> Schedule:
        """The mechanism around the model: replica, parameter client, step log,
        heartbeats; the mode's schedule (not started). `device` (the model's: `psgd
        worker --device`, or where a script's model lies) becomes the current CUDA device:
        what asks the current one (a local Adam's step asks its stream) asks this one, not
        cuda:0, where each worker on another GPU would open a context of its own."""
        cfg = self.cfg
        self.device = device
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        self.jitter = Jitter(cfg.faults.jitter_prob, cfg.faults.jitter_s, cfg.job.seed, self.rank)
        self.slowed = slowed(cfg.faults, self.rank)
        self.replica = Replica(model, cfg.cluster.servers, device, flat=self.own_model, placement=cfg.placement)
        schedule = get_mode(cfg.mode.name).schedule(cfg)
        if schedule.gathers_grads:
            self.replica.bind_grads()
        if cfg.wire.overlap and self.own_model:   # (a script's backward runs before `step`: `Connection._check`)
            self.replica.hook_backward()
        self.client = ParameterClient(cfg, self.ctx, self.rank)
        self.client.cancel = self.stopped
        self.client.alive = lambda i: not self.link.lost and i in self.link.state.get("live_shards", ())
        self.client.since = lambda: self.registration
        self.events = EventLog(self.out, "worker", self.rank)
        self.link.clock_fn = lambda: self.clock
        self.link.stats_fn = self.stats
        self.link.fields_fn = lambda: {"logged": self.logged} if self.logged else {}
        self.link.start()
        if self.trained_s > 0:   # a new process for a rank of a job under way: what the rank's earlier ones did
            # (read with the heartbeats going: a long job's lines take seconds; the next beats carry it)
            self.logged = earlier_lives(self.out, self.rank, time.time() - self.trained_s - LINES_SLACK_S)
        return schedule

    def start(self, schedule: Schedule) -> None:
        """Give the shards their initial values (rank 0's; the others wait for them: a
        shard that built the model itself ignores them), then start the schedule."""
        self.client.init((self.replica.params(), self.replica.buffers()) if self.rank == 0 else None)
        self.t_start = time.monotonic()
        self.link.beat_soon()   # its count at its first step (`Counts`): not its beat before the initial values
        self.client.wait_s = 0.0  # wait_fraction is of the training time: the wait for the initial values is not
        self.cpu.count()   # (this thread trains: `stats` may run on another)
        clock = self.clock
        schedule.start(self)
        if self.clock and hasattr(self, "batches"):   # (a script's worker draws its own batches)
            self.batches.seek(self.clock)   # a rank's earlier process drew one batch a clock
        if self.clock != clock:   # (the log's first line said where it started: "starting at clock 0")
            log(self.name, f"continuing at clock {self.clock}, where the shards' answers put it")

    @staticmethod
    def _build(cfg: Config):
        ds = load_dataset(cfg.data, cfg.job.seed)
        # Whatever the first optimizer still imports (psgd.optim avoids torch._dynamo where
        # torch allows) is paid here, before the job's clock starts, not in a first step.
        make_optimizer([torch.zeros(1, requires_grad=True)], cfg.optimizer)
        return ds, build_model(cfg.model.name, ds.input_shape, ds.num_classes, cfg.job.seed, cfg.model.hidden,
                               check=True)

    def _train(self, cfg: Config, ds, model) -> int:
        torch.manual_seed(cfg.job.seed * 1000 + self.rank)
        schedule = self.attach(model, self.device)
        self.replica.model.train()   # psgd's own loop trains in training mode (a script's model keeps the script's)
        part, held = worker_part(ds.train_size, self.rank, cfg.cluster.workers, cfg.job.seed, schedule.data_split)
        error = ""
        try:
            if held is not None:   # (a streamed holdout's labels are checked: a DataError ends the job below)
                self.holdout = ds.take(held)
            self.batches = ds.train_batches(part, cfg.train.batch_size, cfg.job.seed, self.rank)
            log(self.name, f"{cfg.mode.name} on {self.device}: {len(part)} samples, batch "
                f"{self.batches.batch_size}, starting at clock {self.clock}")
            self.start(schedule)
            error = self._steps(schedule)
        except ShardUnreachable as e:  # the launcher or the coordinator decides what follows
            log(self.name, f"error: {e}")
            self._report_leaving(str(e))
            self._close(str(e))   # (the coordinator call socket too: `_report_leaving` opened it)
            return 1
        except Cancelled:
            pass  # the job ended while we waited
        except wire.RemoteError as e:   # e.g. the initial values will not come (psgd/shard.py FIRST_WORKER_GONE)
            error = f"worker {self.rank}: {e.reason}"
        except (DataError, OverlapUnsafe) as e:   # a streamed batch it read (a label out of range), a push
            error = f"worker {self.rank}: {e}"     # from backward's hooks that left too soon: the job ends, naming it
        finally:
            self.link.stop()
        behind = "" if error else self.left_behind()
        if behind:   # no finish: the rank is not done, and its steps since it was dropped are not the job's
            log(self.name, behind)
            self._close(behind)
            return 1
        if error:
            log(self.name, error)
        elif self.link.state.get("abort"):
            log(self.name, f"stopping: {self.link.state['abort']}")   # the job's abort, or this process's
        self._finish(error)
        return 1 if error or self.link.state.get("abort") else 0

    def _steps(self, schedule) -> str:
        """Run the schedule until the budget ends, then settle what is in flight; the
        reason if the worker must stop. While a request is on its way the worker draws its
        next batch (`between`). A refused settle moves the clock back to the refused push
        (`SspSchedule.refused`): its clock is trained again."""
        self.client.idle = self.between
        while True:
            while self.more():
                error = self._rejoin_and_step(schedule)
                if error:
                    return error
            error = "" if self.left_behind() else self._attempt(schedule.finish)
            if error or not self.more():
                return error

    def _rejoin_and_step(self, schedule) -> str:
        """One step (`_attempt`), after rejoining where the coordinator dropped this worker:
        a refusal as it rejoins (a shard restarted meanwhile, say) is a refused step's,
        counted, and the step goes on (raised, it ended the job)."""
        error = self._attempt(schedule.rejoin) if self.rejoin_if_dropped() else ""
        return error or self._attempt(schedule.step)

    def between(self) -> None:
        """What the worker does while a request is on its way (`ParameterClient.idle`)."""
        self.batches.ahead()

    def _attempt(self, step) -> str:
        """One step. A refused one is counted and the caller goes on, unless it is the
        `cluster.max_rejections`-th in a row: then the reason, in one line. A run of
        refusals ends with a step the shards answered: local steps between refused
        exchanges (diloco, easgd) do not end it."""
        answered = self.client.answered
        try:
            step(self)
            if self.client.answered != answered:   # (a local step, diloco's or easgd's, asks nothing)
                self.in_a_row = 0
            return ""
        except (wire.Refused, Diverged) as e:
            if isinstance(e, wire.Refused) and e.code == wire.NOT_READY:
                # A shard restarted with nothing to restore: it takes this worker's copy.
                self.note(f"{e.peer} lost its tables; offering this worker's copy of the model")
                self.client.init((self.replica.params(), self.replica.buffers()))
            self.rejected += 1
            self.in_a_row += 1
            if self.in_a_row < self.cfg.cluster.max_rejections:
                return ""
            reason = e.reason if isinstance(e, wire.Refused) else str(e)
            where = f" (shard {e.peer})" if isinstance(e, wire.Refused) else ""
            return (f"worker {self.rank}: {reason}{where}; stopping after {self.in_a_row} refused steps "
                    f"in a row (cluster.max_rejections)")

    def _finish(self, error: str) -> None:
        """Tell the coordinator (an error ends the job), then close everything."""
        try:
            self._report_end(error)
        finally:
            self._close(error)

    def _report_end(self, error: str, timeout: float | None = None, **fields: Any) -> bool:
        """Tell the coordinator this worker is done (an error ends the job); whether it
        heard. `timeout`: the longest wait for its answer (default cluster.timeout_s)."""
        if self.link.state.get("abort"):
            return False
        try:
            if error:
                fields["error"] = error
            self.link.call("finish", timeout=timeout, rank=self.rank, nonce=self.link.nonce, clock=self.clock,
                           stats=self.stats(), **self.link.fields_fn(), **fields)
            self.reported = True
            return True
        except Exception as e:  # the coordinator may be gone: nothing more to tell
            log(self.name, f"could not report the end to the coordinator: {e}")
            return False

    def _report_leaving(self, reason: str) -> None:
        """Tell the coordinator why this process stops without finishing (a shard it
        cannot reach), with its last counters: not a `finish` (the rank is not done, a
        restarted process may take it up, and the job goes on without it), but if every
        worker goes so, the job's reason names the shard (it said only "all workers were
        lost")."""
        if self.link.lost or self.link.state.get("abort"):
            return
        try:
            self.link.leave(reason)
        except Exception as e:  # the coordinator may be gone (or predate `leaving`): nothing more to tell
            log(self.name, f"could not tell the coordinator why this worker stops: {e}")

    def _close(self, error: str) -> None:
        self.link.close()
        self.client.close()
        self.events.close()
        if not error:
            log(self.name, f"finished {self.steps} steps, {self.samples} samples, {self.rejected} rejected")

    # ------------------------------------------------------------ budget and faults
    def stopped(self) -> bool:
        """The job ended (done or aborted), or its training ended without this process
        (`left_behind`): stop waiting and stop training."""
        return bool(self.link.done or self.link.state.get("abort") or self.left_behind())

    def left_behind(self) -> str:
        """Why this process stops with its share unfinished, or '': the job's training
        ended (the coordinator is past it: every worker finished or was lost) before this
        process said it finished. A live worker holds that end, so the coordinator had
        dropped this one (it missed heartbeats: stopped with SIGSTOP, or cut off), and
        it came back too late to rejoin. Its steps would go on into the final model
        while the evaluator scored it (an async job's dropped worker came back and pushed
        278 steps then), and its finish would count them in summary.json."""
        state = self.link.state
        if self.reported or state.get("abort") or state.get("phase") not in _ENDED:
            return ""
        return (f"worker {self.rank}: the job's training ended while the coordinator had this worker dropped (no "
                f"heartbeat for cluster.heartbeat_timeout_s = {self.cfg.cluster.heartbeat_timeout_s:g} s: was it "
                f"stopped, or cut off?); stopping with its share unfinished, at clock {self.clock}")

    def more(self) -> bool:
        t = self.cfg.train
        if self.stopped():
            return False
        if t.steps and self.clock >= t.steps:
            return False
        return not (t.seconds and self.now() >= t.seconds)

    def compute(self, slot: int = 0) -> float:
        """One forward/backward on the next batch (with injected slowness: a slow link, a
        slow rank, transient jitter), its gradients into slot `slot`'s tables where they
        are bound (`Replica.bind_grads`); the loss. The loss is read before the step's
        time is taken: on a GPU forward and backward only queue their kernels, and
        reading it waits for them."""
        slow = self.slowed
        t0 = time.perf_counter() if slow else 0.0
        x, y = self.batches.next()
        if not (x.is_cpu and y.is_cpu and self.device.type == "cpu"):   # (on the CPU, `.to` is two torch calls
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)   # that give them back)
        self.replica.clear_grads(slot)
        loss = nn.functional.cross_entropy(self.replica.model(x), y)
        loss.backward()
        self.loss = loss.item()   # (a Python float)
        if slow:
            self.slow_down(time.perf_counter() - t0)
        self.samples += len(y)
        return self.loss

    def slow_down(self, compute_s: float) -> None:
        """The injected slowness of this step (`faults.*`: a slow link, a slow rank,
        transient jitter), given how long its compute took."""
        f = self.cfg.faults
        extra = f.step_delay_s
        if f.slow_rank == self.rank and f.slow_factor > 1:
            extra += (f.slow_factor - 1) * compute_s
        if f.jitter_prob > 0:
            extra += self.jitter.draw(self.clock)
        if extra > 0:
            time.sleep(extra)

    def score(self) -> tuple[float, float]:
        """(accuracy, loss) on the partition's held-out part (ltfb's tournament data)."""
        x, y = self.holdout
        return self.replica.score(x, y, self.cfg.eval.batch_size)

    def log_step(self, staleness: int, wait_s: float, step: tuple[float, int] | None = None, **extra) -> None:
        """The step line of a step that went through (`clock` is the clock after it; with
        jitter on, `jitter` says whether its compute, at clock - 1, was delayed): the one
        just computed, or `step`, its (loss, samples) when it is settled after the next
        one computed (prefetch). Written at once, before the next request leaves: a worker
        killed once the shards took a request has the line of every step they hold but
        that one."""
        self.steps += 1
        self.cpu.follow()   # (a script's steps may move to another thread)
        loss, samples = step if step is not None else (self.loss, self.samples)
        if self.cfg.faults.jitter_prob > 0:
            extra["jitter"] = self.jitter.delayed(self.clock - 1)
        client = self.client
        self.events.step(self.rank, self.steps, self.clock, round(loss, 5), samples, staleness, round(wait_s, 5),
                         client.bytes_sent, client.bytes_recv, extra)

    def rejoin_if_dropped(self) -> bool:
        """After a partition the coordinator may have dropped us: rejoin with our rank,
        at our own clock (the budget of steps is this process's; the coordinator's
        `start_clock` is its last heartbeat's). The schedule's rejoin moves it up to the
        shards' step where they share one."""
        if not self.link.state.get("rejoin"):
            return False
        self.registration = str(self.link.register(self.rank).get("live_id") or "")
        log(self.name, f"rejoined the job at clock {self.clock}")
        return True

    # ------------------------------------------------------------ what a schedule may call
    def live(self) -> set[int]:
        return set(self.link.state["live"])

    def event(self, **fields) -> None:
        self.events.write(**fields)

    def note(self, text: str) -> None:
        log(self.name, text)

    def now(self) -> float:
        """How long the job has trained, by this worker's clock: what `train.seconds`
        counts (a worker restarted into the job starts at `trained_s`)."""
        return self.trained_s + time.monotonic() - self.t_start
