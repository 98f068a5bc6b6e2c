"""The coordinator daemon: rendezvous, liveness, the end of the job, summary.json.

    psgd coordinator [CONFIG] --out DIR [--set k=v ...]

One ROUTER socket on cluster.port, served by the daemons' one serve loop
(`psgd.transport.Service`); ops: register, heartbeat, finish, release, eval, status,
layout. Workers register with their model's layout; the first is the job's, which the
shards of a learned model ask for (`layout`), and a worker whose model differs is
refused (psgd/layout.py). Workers'
registrations are answered once all `cluster.workers` have registered, so training
starts together; the coordinator waits `cluster.timeout_s` for them, saying how many
it has. A worker that finishes with an error (it stopped after too many refused
steps) aborts the job with that reason, and so does the loss of every worker with none
finished (they all crashed: a job that survives the loss of some workers fails when
nobody trained to the end; a restarted coordinator that has no live worker left waits
cluster.timeout_s from its start for new ones to take up the lost ranks; the reason names
what the lost workers said as they gave up, `leaving`: a shard they could not reach); so does the
loss of any worker with `faults.on_worker_loss = "abort"`, and a shard that says it was
restarted without its final tables (`lost_tables`) before the final score is in. An
aborted job's summary.json has `aborted` (the reason) and the coordinator exits 1.
A rendezvous that does not complete within cluster.timeout_s exits 1 without a summary.
Every change of the job's state goes to DIR/coordinator-state.json, from which a
restarted coordinator resumes the job (within cluster.timeout_s); the accuracy curve's
settled scores are appended once each to DIR/coordinator-scores.jsonl, which the state
file counts (`_save_state`). Heartbeats
carry each daemon's cumulative counters and get the live set back. When no worker is
live any more (each finished or lost; a training script's rank 0 holding the end has
released it or its hold ran out), the evaluator, if the job has one, is asked for a final
score (phase `final_eval`, waited for up to cluster.timeout_s, and no longer than
cluster.heartbeat_timeout_s after the evaluator's last heartbeat, unless its connection
closed: its process ended, and is started again); then summary.json is
written, every daemon is told `done` (its heartbeats are answered until each has heard it,
or `linger_s`), and it exits.

Start-up: `startup_s` in the `start` event and in summary.json is the time from
`launched_at` (a time.time() value; counted on the monotonic clock from when this
coordinator was built, so that a wall clock stepped meanwhile moves nothing), to the start
of training, and `startup_from` says
what `launched_at` was: "launcher" when `psgd run` / `psgd compare` started this
coordinator (`--launched-at`: the moment it started the job; for `psgd run`, the
command's own start), "coordinator process" for a coordinator started by hand (its
process's start: the daemons started before it are not counted, and the wait for those
started after it is), "coordinator" for one built in a process that does other things
(the in-process cluster: from its construction). This module imports no torch.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import time
from typing import Any

import zmq

from psgd import consistency, wire
from psgd import layout as layouts
from psgd.config import Config, anchored, is_number, written_by_psgd
from psgd.log import log
from psgd.membership import ALL_RANKS_LIVE, JOB_TOKEN_ENV, Membership, SamplesAt, beat_answer_s, job_token
from psgd.metrics import (
    LINE_PER_PUSH_MODES,
    MAX_CLOCK,
    EventLog,
    OutputError,
    credit_staleness,
    earlier_lives,
    json_line,
    output_error,
    summarize,
    write_json_atomic,
    write_text_atomic,
)
from psgd.transport import Reply, Service, bind_address, server_socket, stop_auth

STATUS_WORKER_STATS = ("samples", "elapsed_s", "wait_s", "staleness_hist", "staleness_sum", "staleness_max", "rejected",
                       "loss")
STATE_FILE = "coordinator-state.json"
SCORES_FILE = "coordinator-scores.jsonl"   # the settled scores the state file counts (`_save_state`)
STATE_EVERY_S = 1.0   # the state file is rewritten on every change, and this often for the counters
PROGRESS_EVERY_S = 2.0
WAITING_EVERY_S = 5.0
# How often the serve loop looks over every worker (missed heartbeats, the job's end): an
# O(W) scan, not after every message it serves (at 1,024 workers, 2,000 heartbeats a
# second, that scan took most of a core).
CHECK_EVERY_S = 0.05
# After every daemon was answered `done`, the coordinator serves on until its answers since
# the job's end have left the process (`Service.track_leaving`), for at most this long, before
# it closes its socket: closed at once (linger 0, `transport._base`), the socket discarded what
# was still queued for ZeroMQ's I/O thread. Under load (two busy processes on two cores) the
# shards' answers were lost so: they waited for a coordinator that was gone, were stopped by
# psgd run after its 10 s grace, and their final checkpoints said the job had not finished.
FLUSH_S = 1.0

# The phases after training: no worker joins or rejoins. `settling`: every worker is done
# (and the final score is in); the summary waits for each live shard's next heartbeat,
# whose counters then hold every push (drops, busy time, clock gap), for at most
# SETTLE_BEATS heartbeat periods.
FINISHING = ("final_eval", "settling", "done")
UNDER_WAY = ("training", "final_eval", "settling")   # begun and not ended (the launcher: a crash, not an end)
SETTLE_BEATS = 2
MAX_FRAME = 16 << 20  # the coordinator's messages are headers only: config, counters
MAX_STATS = 256       # fields in a daemon's counters (a worker's or a shard's stats() has about 20)
MAX_STAT_LIST = 1024  # numbers in one field (a staleness histogram's counts: 33)
MAX_STAT = 2 ** 53    # a counter's magnitude: sums over ranks and lives stay exact, and fit msgpack's 64 bits
LIST_STATS = ("staleness_hist",)   # the counters that are lists (a histogram's counts); every other is a number


def checked_stats(stats: Any) -> dict:
    """A daemon's counters (heartbeat, finish) as the coordinator keeps them, or
    BAD_FIELD. They are what workers and shards send (their `stats()`): str keys, each
    a finite number (not a bool) or a list of them (a histogram's counts); the loss may
    be null (a worker that has none yet). Kept
    unchecked, one bad value would stop the coordinator later, outside any request
    (the state file's JSON, the sums of `samples`). A `loss` that is not finite is
    kept as null: an honest worker's last loss may be inf (it refuses that step); a
    finite float one is kept whatever its size (it is no counter, summed nowhere: a diverging
    worker's 1e30, which float16 on the wire refuses before it turns inf, was refused,
    and the worker's heartbeats and its end with it)."""
    if not isinstance(stats, dict) or len(stats) > MAX_STATS:
        raise wire.WireError(wire.BAD_FIELD, f"stats must be a map of at most {MAX_STATS} counters")
    out = {}
    for k, v in stats.items():
        if not isinstance(k, str):
            raise wire.WireError(wire.BAD_FIELD, f"stats: a counter's name must be a string, not {k!r:.40}")
        if k == "loss" and isinstance(v, float) and not math.isfinite(v):
            v = None
        if isinstance(v, list) != (k in LIST_STATS):
            # a count where a histogram goes, or a list where a count does: the sums (samples,
            # summary.json's) raised TypeError outside any request, and the coordinator died
            raise wire.WireError(wire.BAD_FIELD, f"stats: {k} must be " + (
                "a list of numbers" if k in LIST_STATS else "a number, not a list") + f", got {v!r:.40}")
        if isinstance(v, list):
            if len(v) > MAX_STAT_LIST or not all(map(_stat_number, v)):
                raise wire.WireError(wire.BAD_FIELD, f"stats: {k} must be a list of at most {MAX_STAT_LIST} "
                                                     f"finite numbers")
        elif not (_stat_number(v) or (k == "loss" and (v is None or isinstance(v, float)))):
            # (a null count: the sums fail later)
            raise wire.WireError(wire.BAD_FIELD, f"stats: {k} = {v!r:.40} is not a finite number or a list of "
                                                 f"them" + (" (only the loss may be null)" if v is None else ""))
        out[k] = v
    return out


def _stat_number(x: Any) -> bool:
    return is_number(x) and abs(x) <= MAX_STAT  # NaN, inf: not <=


def linger_s(cfg: Config) -> float:
    """How long after `done` the coordinator answers the heartbeats of daemons that have not
    heard it yet: two heartbeats in a row unanswered (each waits beat_answer_s, the next
    goes a period later on a fresh connection), and 3 s. At 3 periods and 3 s a shard of a
    busy machine missed it, waited cluster.timeout_s and exited 1 "lost the coordinator"."""
    return 2 * (beat_answer_s(cfg) + cfg.cluster.heartbeat_s) + 3


# A lost rank's step lines read at the job's end (`_credit_gone`), in the serve loop: the
# last CREDIT_TAIL_BYTES of its file (about 5,000 lines: its last process's counters are
# whole there), and the ranks' reads given up after CREDIT_S in all (a day's file held
# nearly a million lines, 2.8 µs each: read whole, two lost ranks' stalled the coordinator
# past cluster.timeout_s, and its shards gave it up).
CREDIT_TAIL_BYTES = 1 << 20
CREDIT_S = 2.0

class Coordinator:
    def __init__(self, cfg: Config, out: str | None = None, ctx: zmq.Context | None = None,
                 quiet: bool = False, launched_at: float | None = None, launched_by: str = "coordinator"):
        self.cfg = cfg
        wall = time.time()
        self.launched_at = wall if launched_at is None else launched_at
        self.launched_by = launched_by
        self.by_psgd_run = launched_by == "launcher"   # (this process's: a resume restores `launched_by`)
        # launched_at on the monotonic clock, which startup_s is counted on: counted on the
        # wall clock, one stepped during start-up (NTP, a VM resumed) moved it by the step
        # (an hour back: startup_s -3600)
        self._launched_mono = time.monotonic() - (wall - self.launched_at)
        self.startup_s: float | None = None
        self.out = out
        self.quiet = quiet
        self.ctx = ctx or zmq.Context.instance()
        self.members = Membership(cfg.cluster.workers, cfg.cluster.heartbeat_timeout_s, cfg.cluster.timeout_s,
                                  consistency.shared_step(cfg))
        self.epoch = os.urandom(4).hex()  # this coordinator's life: with the membership version, the `live_id`
        self.address = bind_address(cfg.coordinator_address())
        self.sock = server_socket(self.ctx, self.address, cfg.security, MAX_FRAME)
        self.events = EventLog(out, "coordinator", 0)
        self._write_config()
        self.phase = "rendezvous"
        self.parked: list[tuple[Any, wire.Message, int]] = []  # registrations held until all are in
        self.servers: dict[int, dict] = {}
        self.idle_said = False   # (`_idle_shards`)
        self.afresh_said = False   # (`_shard_afresh`)
        self.server_joins: dict[int, int] = {}
        self.server_seen: dict[int, float] = {}   # shard -> its last heartbeat (monotonic): `shards` in the view
        self.evaluator_seen = 0.0
        self.evaluator_lost = False   # given up in final_eval, silent for cluster.heartbeat_timeout_s
        # The connection its last message came on closed: its process ended (killed, crashed),
        # and a supervisor (psgd run, the Slurm script) starts it again (`_heard_evaluator`)
        self.evaluator_closed = False
        self.evaluator_from: Any = None   # the routing identity of its last message
        self.evaluator_awaited = False   # the log said that final_eval waits for it to be started again
        # A script's job runs no evaluator (none can build the script's model), whatever
        # cluster.evaluator says: one started by hand need not set it to false.
        self.has_evaluator = cfg.cluster.evaluator and cfg.model.name != layouts.SCRIPT_MODEL
        self.evals: list[dict] = []
        self.t0 = 0.0
        self.t_end = 0.0
        self._done_at = 0.0   # when every worker was last seen done (finished or lost), while a hold lasts
        self.heard_end = 0.0  # when it was heard that training ended (t_end may be earlier: `_trained_until`)
        self.final_deadline = 0.0
        self.done_at = 0.0
        self.told_done: set = set()    # (role, its rank or index) of each process heard since `done`
        # When the poll before the one serving now ended (`serve`): a message read now came after it
        self._heard_since: float | None = None
        self.abort = ""
        self.counters = {"bad_messages": 0}
        self.nonces: dict[str, int] = {}   # a worker's registration nonce -> the rank it got
        self.job = job_token()             # psgd run's token for this job ('' for daemons started by hand)
        self.server_nonces: dict[str, int] = {}   # a shard server's registration nonce -> its index
        self.restarts = 0                  # times this job's coordinator came back (summary.json)
        self.rejoin_until = 0.0            # a restarted one waits until then for its workers to come back (_resume)
        self.awaited: set[int] = set()     # ... those live when it died (and still awaited), until heard from:
                                           # not a rank lost before, nor one lost again after it came back
        self.layout: list | None = None    # the model's layout, from the workers (psgd/layout.py)
        self.layout_rank = -1               # the worker it came from (-1: not known, as after a restart)
        self.held_until = 0.0              # a finished worker holds the job's end until then (on_finish)
        self.holder: int | None = None     # ... that worker's rank (it must hear an abort: _lingered)
        self.state_path = os.path.join(out, STATE_FILE) if out else ""
        self._saved: tuple = ()
        self._saved_at = 0.0
        self._unsaved_said_at = -math.inf   # when the log last said the state file could not be written for now
        self.scores_path = os.path.join(out, SCORES_FILE) if out else ""
        self._appended = 0                 # self.evals[:_appended] are in the scores file (`_save_state`)
        self.summary: dict | None = None
        self.ended = False                 # restarted after its job ended (`_resume`): nothing to run
        self.counting: list[tuple[dict, SamplesAt]] = []   # scores whose samples wait for the heartbeats after them
        self._last_progress = 0.0
        self._moved: dict[int, tuple[tuple, float]] = {}   # live rank -> ((clock, wait_s), since when): `_stalled`
        self.stop_requested = False  # set from another thread to end serve() (tests)
        self.scalars = None
        if cfg.eval.tensorboard and out:
            from psgd import scalars
            scalars.check(cfg)
            self.scalars = scalars.Scalars(os.path.join(out, "tb"))
        self._scalars_at = 0.0
        self._ticked = 0.0  # when _tick last ran: a longer gap than a heartbeat is this process's stall
        self._checked = -CHECK_EVERY_S   # when _tick last looked over every worker
        self.service = Service(self.sock, {"register": self.on_register, "heartbeat": self.on_heartbeat,
                                           "finish": self.on_finish, "eval": self.on_eval,
                                           "status": self.on_status, "layout": self.on_layout,
                                           "release": self.on_release},
                               "the coordinator", MAX_FRAME, self.counters, watching=self.has_evaluator)
        self._resume()
        if self.scores_path and not self.restarts and not self.ended:   # a job started afresh: an earlier
            with contextlib.suppress(FileNotFoundError):                # job's scores are not its own
                os.unlink(self.scores_path)

    def _write_config(self) -> None:
        """OUT/config.toml: the job's resolved config (its address and security settings),
        which `psgd status OUT` reads. `psgd run` writes it before it starts the daemons;
        a coordinator started by hand, by the Slurm scripts or by Compose writes it here,
        so that their folders answer `psgd status` too. Replaced atomically (the other
        daemons may be reading the one psgd run wrote), and only if it differs and is one
        psgd wrote: a file of the user's there (the job's own config, with comments) is
        left as it is."""
        if not self.out:
            return
        path, text = os.path.join(self.out, "config.toml"), anchored(self.cfg).to_toml()
        old = None
        with contextlib.suppress(OSError):
            with open(path, encoding="utf-8") as f:
                old = f.read()
        if old == text:
            return
        if old is not None and not written_by_psgd(old):
            log("coordinator", f"{path} is not a config psgd wrote: left as it is (psgd status {self.out} reads it)")
            return
        write_text_atomic(path, text)

    def _no_rank(self, want: int) -> str:
        """Why a worker's registration got no rank: every rank held by a live worker (one
        may soon be missed: the worker waits, `ALL_RANKS_LIVE`), or a rank that finished its
        share, which never frees up."""
        members = self.members.members
        if 0 <= want < self.cfg.cluster.workers and members.get(want) and members[want].state == "finished":
            return f"rank {want} has finished its share of the job"
        done = sum(1 for m in members.values() if m.state == "finished")
        if done:
            return (f"no worker rank is free: {done} of {self.cfg.cluster.workers} finished their share, the "
                    f"others are live")
        return f"all {self.cfg.cluster.workers} {ALL_RANKS_LIVE}"

    def _taken_over(self, rank: int) -> str:
        """Why a process whose rank another process took over must stop."""
        return (f"rank {rank} was taken over by another process (a worker started with its rank after the "
                f"coordinator dropped or missed this one); this one stops")

    def _view(self, known: str = "") -> dict:
        """The job as daemons see it. The live set (rank -> clock) goes only to a daemon
        whose `known` live set (`live_id`: this coordinator's and the membership's
        version) is not the current one: it is O(W), and a heartbeat is O(1) without it."""
        now = time.monotonic()
        shards = self.live_shards(now)
        view = {"phase": self.phase, "done": self.phase == "done", "version": self.members.version,
                "abort": self.abort, "live_shards": shards, "live_id": f"{self.epoch}:{self.members.version}"}
        if known != view["live_id"]:
            view["live"] = {str(k): v for k, v in self.members.live().items()}
        return view

    def live_shards(self, now: float) -> list[int]:
        """The shards heard from within a heartbeat timeout."""
        return sorted(i for i, t in self.server_seen.items() if now - t <= self.cfg.cluster.heartbeat_timeout_s)

    def samples(self) -> int:
        return sum(m.samples() for m in self.members.members.values())

    # ------------------------------------------------------------ handlers
    def on_register(self, ident, msg: wire.Message) -> list[Reply]:
        role, now = msg.get("role"), time.monotonic()
        self._ours(msg, role)
        if role == "worker":
            if self.phase in FINISHING:
                raise wire.WireError(wire.REFUSED, "the job is finishing; no new workers")
            layout = self._checked_layout(msg.get("layout"))
            nonce = msg.get("nonce") or ""
            again = self.nonces.get(nonce, -1)
            if again >= 0 and self.members.superseded(again, nonce):   # (a rejoin after another took its rank)
                raise wire.WireError(wire.REFUSED, self._taken_over(again))
            if again >= 0 and self.members.members.get(again) and self.members.members[again].state == "live":
                # A repeat (its answer was lost, or this coordinator restarted): same rank, no new join.
                self.members.seen(again, now)
                self.awaited.discard(again)
                if self.phase == "rendezvous":
                    self.parked = [p for p in self.parked if p[2] != again] + [(ident, msg, again)]
                    return self._start_training() if self.members.all_joined else []
                return [self._reply_register(ident, msg, again)]
            want = msg.get("want_rank", -1)
            if not -1 <= want < self.cfg.cluster.workers:   # -1: any free rank
                raise wire.WireError(wire.REFUSED, f"rank {want} is not in 0..{self.cfg.cluster.workers - 1} "
                                                   f"(cluster.workers = {self.cfg.cluster.workers})")
            if self.phase == "rendezvous" and self.members.taken(want, nonce, now):
                raise wire.WireError(wire.REFUSED, f"rank {want} is already taken by another process; is "
                                                   f"PSGD_RANK set the same for two workers?")
            rank = self.members.join(now, want, nonce)
            if rank < 0:
                raise wire.WireError(wire.REFUSED, self._no_rank(want))
            if self.phase == "rendezvous":   # a quiet holder's rank before training: a start, not a restart
                self.members.members[rank].taken_back = False
            self._keep_layout(layout, rank)
            self.events.write(event="join", rank=rank, joins=self.members.members[rank].joins)
            self.awaited.discard(rank)
            if nonce:
                self.nonces[nonce] = rank
            if self.phase == "rendezvous":
                self.parked.append((ident, msg, rank))
                log("coordinator", f"workers registered {len(self.members.members)}/{self.cfg.cluster.workers} "
                    f"(worker {rank})")
                return self._start_training() if self.members.all_joined else []
            log("coordinator", f"worker {rank} rejoined (last heard at clock {self.members.members[rank].clock})")
            return [self._reply_register(ident, msg, rank)]
        if role == "server":
            idx = self._shard_index(msg)
            nonce = msg.get("nonce") or ""
            if not nonce or self.server_nonces.get(nonce) != idx:  # not a repeat of a registration (its answer lost)
                self.server_joins[idx] = self.server_joins.get(idx, 0) + 1
                self.server_nonces[nonce] = idx
            if self.server_joins[idx] > 1:  # a restarted shard with nothing to restore takes any worker's copy
                log("coordinator", f"shard {idx} restarted")
                return [self._reply_register(ident, msg, -1, restarted=True, layout=self.layout)]
            if self.phase == "rendezvous":
                log("coordinator", f"shards registered {len(self.server_joins)}/{self.cfg.cluster.servers} "
                    f"(shard {idx})")
            self.servers.setdefault(idx, {})
            return [self._reply_register(ident, msg, -1, layout=self.layout)]
        if role == "evaluator":
            self._heard_evaluator(ident, now, lasting=False)
            return [self._reply_register(ident, msg, -1)]
        raise wire.WireError(wire.BAD_FIELD, f"unknown role {role!r}")

    def _ours(self, msg: wire.Message, role: Any) -> None:
        """Refuse a daemon's message whose job token is not this job's: a registration,
        and every message that changes the job (a heartbeat, a finish, a score, a
        release). A daemon of another job still dialing this port (its own coordinator
        gone, this one on the same port) had its scores taken: a time to target of 0.0 s,
        and its final score ended this job before this job's own evaluator scored."""
        if (msg.get("job") or "") != self.job:
            raise wire.WireError(wire.REFUSED, self._other_job(role))

    def _other_job(self, role: Any) -> str:
        """Why a daemon whose job token is not this job's is refused."""
        whose = "a job of its own psgd run" if self.job else "a job whose daemons were started by hand"
        return (f"this {role} belongs to another job: the coordinator at {self.cfg.coordinator_address()} runs "
                f"{whose} ({JOB_TOKEN_ENV} differs); is another job using its port?")

    def _reply_register(self, ident, msg, rank: int, **extra: Any) -> Reply:
        """The answer to a registration. A worker that joins a job in training (a
        restarted one) is told how long the job has trained (`trained_s`): its
        `train.seconds` budget is the job's, not a fresh one; and whether it took its rank
        over from a process the job still counted live (`taken_back`: restarted before it
        was missed, which its followers may still wait for: ltfb's `left_unplayed`)."""
        m = self.members.members[rank] if rank >= 0 else None
        trained = round(time.monotonic() - self.t0, 3) if self.t0 and self.phase == "training" else 0.0
        if m is not None and m.taken_back:
            extra["taken_back"] = True
        return ident, wire.reply(msg, assigned_rank=rank, config=self.cfg.to_dict(), start_clock=m.clock if m else 0,
                                 trained_s=trained, **extra, **self._view())

    def _shard_index(self, msg: wire.Message) -> int:
        """A shard server's `index`, refused unless it is one of the job's shards (its
        counters would count in summary.json, its `done` for the shards')."""
        idx = msg.get("index", 0)
        if not 0 <= idx < self.cfg.cluster.servers:
            raise wire.WireError(wire.REFUSED, f"shard {idx} is not in 0..{self.cfg.cluster.servers - 1} "
                                               f"(cluster.servers = {self.cfg.cluster.servers})")
        return idx

    def _checked_layout(self, given: Any) -> list | None:
        """A worker's model layout (psgd/layout.py), checked: refused if malformed, or if
        it differs from the job's. It becomes the job's only once its registration is
        accepted (`_keep_layout`): a refused worker's would refuse every honest one."""
        if given is None:
            return None
        try:
            given = layouts.checked(given)
        except ValueError as e:
            raise wire.WireError(wire.BAD_FIELD, f"layout: {e}") from None
        diff = layouts.difference(self.layout, given) if self.layout is not None else ""
        if diff:
            whose = f"worker {self.layout_rank}'s, the first to register: " if self.layout_rank >= 0 else ""
            raise wire.WireError(wire.REFUSED, f"this worker's model differs from the job's ({whose}{diff}); every "
                                               f"worker must build the same model")
        return given

    def _keep_layout(self, layout: list | None, rank: int) -> None:
        """The first accepted worker's layout (rank's) is the job's, which the shards of a
        learned model ask for."""
        if layout is not None and self.layout is None:
            self.layout, self.layout_rank = layout, rank
            log("coordinator", f"the model's layout: {len(layout)} tensors, {layouts.size(layout):,} values")

    def on_layout(self, ident, msg: wire.Message) -> list[Reply]:
        """The job's model layout, once a worker has registered it (else null)."""
        return [(ident, wire.reply(msg, layout=self.layout))]

    def on_release(self, ident, msg: wire.Message) -> list[Reply]:
        """The worker that held the end of the job (finish with hold) is done with it."""
        self._ours(msg, "worker")
        self.held_until, self.holder = 0.0, None
        return [(ident, wire.reply(msg, **self._view()))]

    def _start_training(self) -> list[Reply]:
        self.phase = "training"
        self.t0 = time.monotonic()
        for m in self.members.members.values():
            m.last_seen = self.t0
        self.startup_s = round(time.monotonic() - self._launched_mono, 3)
        self.events.write(event="start", workers=self.cfg.cluster.workers, startup_s=self.startup_s,
                          startup_from=self.launched_by)
        c = self.cfg.cluster
        log("coordinator", f"{'all ' * (c.workers != 1)}{c.workers} worker{'s' * (c.workers != 1)} registered; "
            f"training ({self.cfg.mode.name}, {c.servers} shard{'s' * (c.servers != 1)}) after "
            f"{self.startup_s:.1f} s of start-up (since the {self.launched_by} started)")
        replies = [self._reply_register(ident, msg, rank) for ident, msg, rank in self.parked]
        self.parked = []
        return replies

    def on_heartbeat(self, ident, msg: wire.Message) -> list[Reply]:
        role, now = msg.get("role"), time.monotonic()
        self._ours(msg, role)
        stats = checked_stats(msg.get("stats") or {})
        idx = self._shard_index(msg) if role == "server" else msg.get("index", 0)
        rejoin = False
        if role == "worker":
            if self.members.superseded(msg.rank, msg.get("nonce") or ""):
                # Not the rank's process (its counters are not the rank's): it is told to stop.
                return [(ident, wire.reply(msg, **{**self._view(msg.get("live_id", "")),
                                                   "abort": self._taken_over(msg.rank)}))]
            self._within_job(msg.clock)
            logged = checked_stats(msg.get("logged") or {})
            age = float(msg.get("age_s", 0.0))   # its counters' age (`beat_soon`): up to a beat's wait for its answer
            counted = now - min(age, beat_answer_s(self.cfg)) if age > 0 else now   # (NaN: not > 0)
            rejoin = not self.members.beat(msg.rank, now, msg.clock if msg.clock >= 0 else None, stats, logged,
                                           counted)
            if not rejoin:
                self._credit_staleness(msg.rank, logged)
                self.awaited.discard(msg.rank)   # heard since a restart: lost again, it was not stopped with it
            if self.counting and not rejoin:   # (its count's time: an older beat's is not taken, `Membership.beat`)
                self._count(msg.rank, self.members.members[msg.rank].counts.last[0])
            leaving = (msg.get("leaving") or "")[:1000]   # (a peer's text: bounded once, kept and logged so)
            if leaving and self.members.leaving(msg.rank, leaving):
                log("coordinator", f"worker {msg.rank} gave up, leaving its share unfinished: {self._left(msg.rank)}")
                self.events.write(event="leaving", rank=msg.rank, reason=leaving)
            if rejoin and self.members.members.get(msg.rank) and self.members.members[msg.rank].state == "finished":
                rejoin = False
            if self.phase in FINISHING:
                rejoin = False  # it would be refused ("the job is finishing"): the job's end stops it instead
        elif role == "server":
            self.servers[idx] = stats
            self.server_seen[idx] = now
            self._idle_shards()
            self._shard_afresh(idx, msg.get("afresh"))
            lost = msg.get("lost_tables")
            if lost and self.phase == "final_eval" and not self.abort:
                # Restarted after training without the tables it ended with: the final model
                # cannot be whole. A score and a model.pt of the other shards' final tables
                # and its older ones (or none) would pass for the job's.
                self.abort = f"shard {idx} {lost}: the final model is lost (no score, no model.pt)"
                log("coordinator", f"aborting the job: {self.abort}")
                self._finish_job()
        elif role == "evaluator":
            self._heard_evaluator(ident, now)
        else:
            raise wire.WireError(wire.BAD_FIELD, f"unknown role {role!r}")
        if self.phase == "done" and self._prompt():
            self.told_done.add((role, msg.rank if role == "worker" else idx))
        return [(ident, wire.reply(msg, rejoin=rejoin, **self._view(msg.get("live_id", ""))))]

    def _heard_evaluator(self, ident: Any, now: float, lasting: bool = True) -> None:
        """A message of the evaluator's came on `ident`'s connection, whose close `_tick`
        hears of (`Service.watch`; one read after its close is known says that it closed).
        Silent in the final evaluation with that connection open, the evaluator is stopped
        or cut off, and given up; silent since it closed, its process ended, and it is
        waited for to be started again. Only the connection of its last message counts,
        and not one it makes for a moment (`lasting=False`: its registration's, closed
        once answered); a socket it makes again (an answer overdue) closes one for the
        moment until its next message."""
        self.evaluator_seen = now
        if lasting:
            self.evaluator_from = ident
            self.evaluator_closed = not self.service.watch(ident)
            self.evaluator_awaited = self.evaluator_awaited and self.evaluator_closed

    def _prompt(self) -> bool:
        """Is the message being served read soon enough that its sender still waits for the
        answer? A daemon waits `beat_answer_s` for a heartbeat's, then sends the next on a
        fresh connection, and an answer to the old one is dropped. A heartbeat read after
        the serve loop was busy for three quarters of that or more (the job's end written
        on a loaded machine) may have waited too long: its `done` counted as heard, the
        coordinator exited, and the shard, which never got it, ran on until
        cluster.timeout_s and exited 1 "lost the coordinator" (CI, 2026-12-05). It is
        answered, and its daemon counts at its next heartbeat. Handlers called outside
        `serve` (tests) are prompt."""
        since = self._heard_since
        return since is None or time.monotonic() - since < 0.75 * beat_answer_s(self.cfg)

    def _credit_staleness(self, rank: int, logged: dict) -> None:
        """The staleness histogram of the rank's earlier processes as their step lines have
        it, where those show more pushes than the coordinator heard (one killed between
        heartbeats: `metrics.credit_staleness`), as their samples and bytes
        (`Member.credit`); in the modes whose step lines are one push each."""
        m = self.members.members.get(rank)
        if m is not None and logged and self.cfg.mode.name in LINE_PER_PUSH_MODES:
            credit_staleness(m.past, logged)

    def _within_job(self, clock: int) -> None:
        """A worker's clock past `train.steps` (and the one after it), or past MAX_CLOCK
        (the bound of a job without a step limit), which no honest worker of this job
        reaches: refused. Kept, it would become the live set's clock that the shards start a
        joining worker at, and a rejoining worker's start."""
        steps = self.cfg.train.steps
        if steps and clock > steps + 1:
            raise wire.WireError(wire.REFUSED, f"clock {clock} is past the job's last step (train.steps = {steps})")
        if clock > MAX_CLOCK:
            raise wire.WireError(wire.REFUSED, f"clock {clock} is past any worker's: {MAX_CLOCK:,} at most, 285 "
                                               f"years at a million steps a second (train.steps = {steps})")

    def on_finish(self, ident, msg: wire.Message) -> list[Reply]:
        """A worker is done. With `hold`, the job does not end when the last worker is
        done until that worker sends `release` (or cluster.timeout_s passes): a
        training script's rank 0 reads the final model meanwhile (psgd/connection.py).
        Refused, before anything is applied, from a rank that is not a member, or from a
        process whose rank another took over (its `error` would abort the job, its `hold`
        hold its end), or of another job. `idle_s`: seconds before this finish that were
        not training (a training script's, between its last step and its close(): its own
        scoring or saving), which wall_s leaves out: the worker's training ended that long
        before now (`Member.ended`)."""
        self._ours(msg, "worker")
        idle = float(msg.get("idle_s", 0.0))
        if not 0.0 <= idle < math.inf:
            raise wire.WireError(wire.BAD_FIELD, f"idle_s must be a finite number of seconds >= 0, got {idle}")
        if msg.rank not in self.members.members:
            raise wire.WireError(wire.REFUSED, f"rank {msg.rank} is not a member of this job")
        if self.members.superseded(msg.rank, msg.get("nonce") or ""):   # (its end is not the rank's)
            raise wire.WireError(wire.REFUSED, self._taken_over(msg.rank))
        if self.phase in FINISHING and self.members.members[msg.rank].state == "lost":
            # Dropped, and back after training ended (stopped with SIGSTOP, cut off): its
            # steps since are not the job's. Taken, its finish counted them in summary.json
            # (samples over a wall time that ended without them) and its rank as finished.
            raise wire.WireError(wire.REFUSED, f"the job's training ended while worker {msg.rank} was dropped (it "
                                               f"missed heartbeats); its finish is not taken")
        self._within_job(msg.clock)
        stats = msg.get("stats")
        now = time.monotonic()
        logged = checked_stats(msg.get("logged") or {})
        self.members.finish(msg.rank, now, None if stats is None else checked_stats(stats), msg.clock, logged,
                            ended=max(self.t0, now - idle) if self.t0 else now)
        self._credit_staleness(msg.rank, logged)
        self._count(msg.rank, now)
        if msg.get("hold"):
            self.held_until, self.holder = time.monotonic() + self.cfg.cluster.timeout_s, msg.rank
        error = msg.get("error")
        self.events.write(event="finish", rank=msg.rank, **({"error": error} if error else {}))
        if error and self.phase == "training" and not self.abort:
            self.abort = error
            log("coordinator", f"aborting the job: {error}")
        # In the state file before the worker hears the answer (it stops heartbeating, and
        # exits): a coordinator killed before its next save came back with the worker
        # live, and dropped it after the heartbeat timeout (workers_lost 1 for a worker
        # that finished).
        self._save_state(now)
        return [(ident, wire.reply(msg, **self._view()))]

    def on_eval(self, ident, msg: wire.Message) -> list[Reply]:
        """A score of the global model; its time is when the evaluator read the model
        (`age_s` before now: the scoring took that long), its samples the workers' count
        at that time: the heartbeats' count now in the answer and the event lines, the
        count at the read in summary.json once every live worker has heartbeated since
        (`SamplesAt`, from each worker's counts of the last cluster.timeout_s: a score may
        take longer than a heartbeat period), its TensorBoard points then. An accuracy
        outside [0, 1] (NaN too) is refused: no score is one. A loss that is not finite
        is kept (an evaluator's score of a diverged model); summary.json writes it as null
        (metrics.write_json_atomic). Another job's is refused."""
        self._ours(msg, "evaluator")
        self._heard_evaluator(ident, time.monotonic())
        accuracy, loss = float(msg.get("accuracy")), float(msg.get("loss"))
        if not 0.0 <= accuracy <= 1.0:
            raise wire.WireError(wire.BAD_FIELD, f"accuracy {accuracy} is not in [0, 1]")
        age = max(0.0, float(msg.get("age_s", 0.0)))
        read_at = time.monotonic() - age
        t = max(0.0, read_at - self.t0) if self.t0 else 0.0
        # t to the microsecond, as summary.json's wall_s (metrics.summarize): at 3 decimals a
        # score read just after training ended could round to before its end (AFTER_END)
        e = {"t": round(t, 6), "samples": self.samples(), "accuracy": accuracy, "loss": loss,
             "final": bool(msg.get("final", False))}
        if self.phase in ("training", "final_eval"):
            self.evals.append(e)  # t: seconds since training started (summary.json's curve)
            self.counting.append((e, SamplesAt(self.members.members, read_at)))
            self._count(-1, read_at)
            self.events.write(event="eval", elapsed_s=e["t"], **{k: v for k, v in e.items() if k != "t"})
        if e["final"]:
            if self.phase == "final_eval":
                self._settle(time.monotonic())
            # The evaluator ends once its final score is answered: it is not waited for after
            # `done` (it waited for a heartbeat saying so, and a late one after the linger
            # left it waiting cluster.timeout_s, then exiting "lost the coordinator": 2 runs in
            # 3 under Compose). In the state file first, as a worker's finish is (on_finish).
            self.told_done.add(("evaluator", 0))
            self._save_state(time.monotonic())
        return [(ident, wire.reply(msg, samples=e["samples"], t=e["t"]))]

    def _short_of_budget(self) -> str:
        """What to say of training scripts that all closed before the job's step budget, or
        '': a loop over one pass of a DataLoader ends there (README's loop, over the digits,
        at 23 of the 300 steps), and the job ended as if done (summary.json's `steps` the
        budget), without a word. psgd's own workers always run to it."""
        t = self.cfg.train
        clocks = [m.clock for m in self.members.members.values() if m.state == "finished"]
        if (self.cfg.model.name != layouts.SCRIPT_MODEL or not t.steps or t.seconds or not clocks
                or max(clocks) >= t.steps or len(clocks) < len(self.members.members)):
            return ""
        return (f"every worker closed before train.steps = {t.steps} (the furthest at step {max(clocks)}): a script "
                f"whose loop ran out of data ends there; loop over epochs until ps.step() returns False")

    def _idle_shards(self) -> None:
        """Once every shard has said what it holds (`values` in its heartbeats' counters):
        warn of those that hold no part of the model. Their processes serve nothing, which
        only their logs said ("serving 0 values"); `psgd shards` shows why."""
        S = self.cfg.cluster.servers
        if self.idle_said or len(self.servers) < S or not all("values" in st for st in self.servers.values()):
            return
        self.idle_said = True
        idle = sorted(i for i, st in self.servers.items() if not st["values"])
        if idle:
            log("coordinator", f"warning: {len(idle)} of the {S} shards hold no part of the model "
                f"({', '.join(map(str, idle))}): it is cut into fewer pieces than cluster.servers; "
                f"cluster.servers = {S - len(idle)} serves it with fewer processes (psgd shards shows the map)")

    def _shard_afresh(self, idx: int, why: str | None) -> None:
        """Once: a shard that did not resume a checkpoint of this job's training config
        at the job's start (`afresh` in its heartbeats: a script's or factory's model
        changed since, whose layout psgd run's "resuming" could not check), nor did any
        other then (`ShardServer._resume`). Only their logs said so."""
        if self.afresh_said or not why:
            return
        self.afresh_said = True
        log("coordinator", f"warning: shard {idx} did not resume from its checkpoint ({why[:300]}): the job starts "
            f"afresh (no shard resumes a part of the model alone), and its checkpoints replace the earlier ones")

    def on_status(self, ident, msg: wire.Message) -> list[Reply]:
        """What `psgd status` shows: the job, each worker and shard, the last score; and
        the job's output folder (`out`): `psgd status DIR` takes no other job's answer."""
        totals = self.members.stats()  # over each rank's lives
        workers = [{"rank": r, "state": m.state, "clock": m.clock, "joins": m.joins,
                    **{k: totals[r].get(k) for k in STATUS_WORKER_STATS}}
                   for r, m in sorted(self.members.members.items())]
        shards = [{"index": i, "version": st.get("version"), "restarts": max(0, self.server_joins.get(i, 1) - 1),
                   "bad_messages": st.get("bad_messages", 0), "busy_s": st.get("busy_s")}
                  for i, st in sorted(self.servers.items())]
        elapsed = time.monotonic() - self.t0 if self.t0 else 0.0
        return [(ident, wire.reply(msg, samples=self.samples(), servers=len(self.servers), evals=len(self.evals),
                                   mode=self.cfg.mode.name, mode_params=self.cfg.mode_params,
                                   workers_expected=self.cfg.cluster.workers, elapsed_s=round(elapsed, 3),
                                   steps=self.cfg.train.steps, workers=workers, shards=shards,
                                   last_eval=self.evals[-1] if self.evals else None,
                                   out=os.path.realpath(self.out) if self.out else "", **self._view()))]

    # ------------------------------------------------------------ phases
    def _tick(self, now: float) -> None:
        stalled = now - self._ticked if self._ticked else 0.0
        began = time.monotonic()
        self._save_state(now)
        # (the save's own time is no stall: heartbeats wait in the socket meanwhile. Counted
        # as one, a disk whose fsync took a second excused every gap, and no dead worker was
        # ever dropped: a sync job waited for it for good)
        self._ticked = now + (time.monotonic() - began)
        if self.evaluator_from in self.service.closed():   # (only the evaluator's connections are watched)
            self.evaluator_closed = True
        if stalled > self.cfg.cluster.heartbeat_s:
            # This loop did not run (the machine stalled, or this process was stopped): who
            # is alive is judged on heartbeats it could have read, not on the stall.
            self.members.excuse(stalled, now)
            self.server_seen = {i: min(t + stalled, now) for i, t in self.server_seen.items()}
            self.evaluator_seen = min(self.evaluator_seen + stalled, now) if self.evaluator_seen else 0.0
        if self.phase == "training" and now - self._checked >= CHECK_EVERY_S:
            self._checked = now
            aborted = self.abort
            lost = self.members.expire(now)
            for _, at in self.counting:   # no beat will come from them: the scores do not wait for them
                for r in lost:
                    at.gone(r)
            if lost:
                self._count(-1, now)
            for r in lost:
                gave_up = self._gave_up([r])
                log("coordinator", f"worker {r} missed heartbeats for {self.cfg.cluster.heartbeat_timeout_s:g} s: "
                    f"dropped from the membership" + (f" (it gave up: {self._left(r)})" if gave_up else ""))
                self.events.write(event="lost", rank=r)
                if self.cfg.faults.on_worker_loss == "abort":
                    self.abort = f"worker {r} was lost and faults.on_worker_loss = abort" + \
                        (f"; {gave_up}" if gave_up else "")
            # Restarted, and no worker live, some missed: they were stopped with it (`docker
            # compose stop` of the whole stack; new containers take a while to start), or have
            # not reached it yet. The job waits for new worker processes to take up the missed
            # ranks for as long as daemons keep trying to reach a restarted coordinator.
            # (Only ranks live at the restart: one its last life had dropped was not stopped with it,
            # and waiting for it held a finished job silent until rejoin_until, in its wall_s.)
            rejoining = (not self.abort and now < self.rejoin_until and self.members.all_done
                         and any(self.members.members[r].state == "lost" for r in self.awaited))
            if rejoining and lost:
                log("coordinator", f"no worker is live since this coordinator's restart; waiting up to "
                    f"{self.rejoin_until - now:.0f} s (cluster.timeout_s) for workers to take up the lost ranks")
            if not rejoining and not self.abort and self.members.all_done and self.members.all_lost:
                # Nobody trained to the end (they all crashed, or their machines went): the
                # job failed. Losing some workers while others finish is survived.
                n = self.cfg.cluster.workers
                gave_up = self._gave_up(sorted(self.members.members))   # (a shard they could not reach)
                self.abort = (f"{'all ' * (n > 1)}{n} worker{'s were' if n > 1 else ' was'} lost (stopped "
                              f"heartbeating) and none finished" + (f"; {gave_up}" if gave_up else ""))
            if self.abort and not aborted:   # (as every abort: the log says why the job ends, not only summary.json)
                log("coordinator", f"aborting the job: {self.abort}")
            done = not rejoining and self.members.all_done
            self._done_at = (self._done_at or now) if done else 0.0
            if not rejoining and (self.abort or (self.members.all_done and now >= self.held_until)):
                # Training ended when the last worker was done, not at the end of rank 0's hold
                # (a script's, reading the final model: it is not training, and wall_s said so)
                self.t_end = now if self.abort else self._trained_until() or self._done_at or now
                self.heard_end = now if self.abort else self._done_at or now
                short = "" if self.abort else self._short_of_budget()
                if short:
                    log("coordinator", f"warning: {short}")
                if self.has_evaluator and not self.abort:
                    self.phase = "final_eval"
                    self.final_deadline = now + self.cfg.cluster.timeout_s
                    log("coordinator", "all workers finished; waiting for the final evaluation")
                elif self.abort:
                    self._finish_job()
                else:
                    self._settle(now)
        elif self.phase == "final_eval" and now > self.final_deadline:
            log("coordinator", "no final evaluation arrived in time; writing the summary without it")
            self._settle(now)
        elif self.phase == "final_eval" and self.evaluator_seen and \
                now - self.evaluator_seen > self.cfg.cluster.heartbeat_timeout_s:
            if self.evaluator_closed:
                # Its process ended (a restart of the evaluator during training that had not
                # registered yet lost the job's final score, given up as a stopped one): a
                # supervisor starts it again, and its score is waited for, up to final_deadline.
                if not self.evaluator_awaited:
                    self.evaluator_awaited = True
                    log("coordinator", f"the evaluator's connection closed, {now - self.evaluator_seen:.1f} s "
                        f"without a heartbeat: its process ended; waiting up to {self.final_deadline - now:.0f} s "
                        f"(cluster.timeout_s) for it to be started again")
            else:
                # (as a worker is dropped: a stopped evaluator held the job's end for cluster.timeout_s)
                log("coordinator", f"the evaluator has not heartbeated for {now - self.evaluator_seen:.1f} s "
                    f"(cluster.heartbeat_timeout_s = {self.cfg.cluster.heartbeat_timeout_s:g}): stopped, or cut "
                    f"off from here; writing the summary without a final evaluation")
                self.evaluator_lost = True   # (nor is it waited for to hear `done`: `_lingered`)
                self._settle(now)
        elif self.phase == "settling":
            self._settle(now)
        if self.scalars and self.phase == "training" and now - self._scalars_at >= PROGRESS_EVERY_S:
            self._scalars_at = now
            self.scalars.workers(self.members.stats(), self.samples())
        if not self.quiet and self.phase == "training" and now - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = now
            self._progress(now)

    def _trained_until(self) -> float:
        """When the last worker's training ended, where every worker finished in this life
        of the coordinator (`Member.ended`: a training script's is its last step, not its
        close()); 0.0 otherwise (a lost worker's end is when it was dropped: `_done_at`)."""
        members = self.members.members.values()
        ended = [m.ended if m.state == "finished" else 0.0 for m in members]
        return max(ended) if ended and all(ended) else 0.0

    def _left(self, rank: int) -> str:
        """Why rank's process said it stops unfinished (`leaving`), without its "worker R: "."""
        left = self.members.members[rank].left
        return left[len(f"worker {rank}: "):] if left.startswith(f"worker {rank}: ") else left

    def _gave_up(self, ranks: list[int]) -> str:
        """What the processes of these (lost) ranks said as they stopped unfinished (a
        shard they could not reach: `leaving`), one reason with its ranks; '' when none
        said: a job that ends with its workers gone says why they went, where its
        workers know ("all 2 workers were lost" alone hid the silent shard)."""
        said: dict[str, list[int]] = {}
        for r in ranks:
            if self.members.members[r].left:
                said.setdefault(self._left(r), []).append(r)
        return "; ".join(f"worker{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} gave up: {why}"
                         for why, rs in said.items())

    def _progress(self, now: float) -> None:
        live = self.members.live()
        steps = self.cfg.train.steps
        # the slowest live worker's step; with none live (all finished or dropped), the furthest
        # any reached (was 0: "step 0/400 ... live 0/2" after the last live worker was dropped)
        clock = min(live.values()) if live else max((m.clock for m in self.members.members.values()), default=0)
        n, t = self.samples(), now - self.t0
        acc = f"  acc {self.evals[-1]['accuracy']:.3f}" if self.evals else ""
        total = f"/{steps}" if steps else ""
        # A shard that never started or stopped heartbeating: its workers are waiting on it.
        silent = sorted(set(range(self.cfg.cluster.servers)) - set(self.live_shards(now)))
        shards = f"  shards silent: {', '.join(map(str, silent))}" \
            if silent and t > self.cfg.cluster.heartbeat_timeout_s else ""
        stalled = "; ".join(f"worker {r}: no step for {s:.0f} s" for r, s in self._stalled(now))
        waiting = f"  waiting for {stalled}" if stalled else ""
        log("coordinator", f"{self.cfg.mode.name}  {t:6.1f} s  step {clock}{total}  samples {n:,}  "
            f"{n / t if t > 0 else 0:,.0f}/s{acc}  live {len(live)}/{self.cfg.cluster.workers}{shards}{waiting}")

    def _stalled(self, now: float) -> list[tuple[int, float]]:
        """Live workers whose heartbeats have said neither a step nor a wait on the shards
        (the same clock and wait_s) for cluster.timeout_s or more, with how long: still
        live, they are never dropped, and the others' steps may wait for them (a sync
        round) until `psgd run --timeout`. (Seen at each progress line.)"""
        seen, self._moved = self._moved, {}
        for r, m in self.members.members.items():
            if m.state == "live":
                mark = (m.clock, m.stats.get("wait_s"))
                was = seen.get(r)
                self._moved[r] = was if was is not None and was[0] == mark else (mark, now)
        return [(r, now - since) for r, (_, since) in sorted(self._moved.items())
                if now - since >= self.cfg.cluster.timeout_s]

    def _count(self, rank: int, now: float) -> None:
        """Rank's count at `now` to the scores that wait for it; a score's samples once
        every worker it waits for has been heard from (or the job ends: `_finish_job`)."""
        if rank >= 0:
            samples = self.members.members[rank].samples()
            for _, at in self.counting:
                at.beat(rank, now, samples)
        while self.counting and not self.counting[0][1].waiting:
            self._counted(*self.counting.pop(0))

    def _counted(self, e: dict, at: SamplesAt) -> None:
        """A score's samples settled (the count at its read): summary.json's, and the step
        of its TensorBoard points, written now (written at its arrival, at the heartbeats'
        count then, they stood thousands of samples off summary.json's curve)."""
        e["samples"] = at.value()
        if self.scalars:
            self.scalars.add({"job/accuracy": e["accuracy"], "job/loss": e["loss"]}, e["samples"])

    def _settle(self, now: float) -> None:
        """Write the summary once every live shard has heartbeated since training ended
        (a shard's counters as of its heartbeat before that miss the last pushes: with
        the evaluator off, a summary's dropped gradients were half the shards' own
        count), or SETTLE_BEATS heartbeat periods after the end."""
        # (from when the end was heard: a script's t_end is its last step, before the pushes its close() settles)
        since = self.heard_end or self.t_end
        settled = all(self.server_seen.get(i, 0.0) > since for i in self.live_shards(now))
        if settled or now > since + SETTLE_BEATS * self.cfg.cluster.heartbeat_s:
            self._finish_job()
        else:
            self.phase = "settling"

    def _finish_job(self) -> None:
        for waiting in self.counting:   # those never heard from again keep their counts before the score
            self._counted(*waiting)
        self.counting = []
        self._credit_gone()
        total = self.samples()
        for e in self.evals:   # read once every worker was done: the job's count, a lost rank's credited steps too
            if e["final"]:     # (it settled at its arrival, before they were credited: below summary.json's samples)
                e["samples"] = total
        wall = (self.t_end or time.monotonic()) - self.t0
        m = self.members
        failures = {"workers_lost": m.lost, "workers_rejoined": m.rejoined, "workers_restarted": m.restarted,
                    "workers_gone": sum(x.state == "lost" for x in m.members.values()),   # (lost, never back)
                    "shard_restarts": sum(max(0, n - 1) for n in self.server_joins.values()),
                    "coordinator_restarts": self.restarts}
        script = self.cfg.model.name == layouts.SCRIPT_MODEL  # a script job: its data and batches are its own
        extra = {"job": self.cfg.job.name, "seed": self.cfg.job.seed, "model": self.cfg.model.name,
                 "data": None if script else self.cfg.data.name,
                 "batch_size": None if script else self.cfg.train.batch_size,
                 "steps": self.cfg.train.steps, "faults": {k: v for k, v in vars(self.cfg.faults).items()},
                 "bad_messages_coordinator": self.counters["bad_messages"],
                 "startup_s": self.startup_s, "startup_from": self.launched_by}
        if self.abort:
            extra["aborted"] = self.abort
        self.summary = summarize(mode=self.cfg.mode.name, mode_params=self.cfg.mode_params,
                                 workers=self.cfg.cluster.workers, servers=self.cfg.cluster.servers,
                                 wall_s=wall, worker_stats=m.stats(), server_stats=self.servers,
                                 evals=[e for e in self.evals], target=self.cfg.eval.target_accuracy,
                                 failures=failures, extra=extra,
                                 # (a final score is missing, not merely never asked for, when the
                                 # job was aborted during the final evaluation: a shard lost its tables)
                                 final_expected=self.has_evaluator and (not self.abort or self.phase == "final_eval"))
        if self.out:
            write_json_atomic(f"{self.out}/summary.json", self.summary)
        if not self.quiet and not self.by_psgd_run:
            # Started by hand, by Compose or by Slurm: its log's last word is the job's result,
            # as psgd run prints it (it ended on "sync 0.0 s step 0/300 ...", the result unsaid).
            from psgd.launcher import format_summary
            log("coordinator", format_summary(self.summary) + (f"; summary: {self.out}/summary.json" if self.out
                                                               else ""))
        self.events.write(event="done", wall_s=round(wall, 6))   # (as summary.json's, and the scores' t)
        self.phase = "done"
        self.service.track_leaving()   # (its answers from now on: `_flush`)
        self.done_at = time.monotonic()
        self._save_state(self.done_at)

    def _credit_gone(self) -> None:
        """The ranks lost for good (no process took them up), counted as their step lines
        in DIR/events say where the coordinator heard less: a process that died before its
        first heartbeat (a training script killed in its first second) or between two had
        steps that the shards applied and summary.json missed. (A rank taken up has its
        new process send them: `Member.credit`.) Not the lines of steps after training
        ended: a process dropped and back then (stopped, cut off) stepped outside the job."""
        until = time.time() - (time.monotonic() - self.t_end) if self.t_end else math.inf
        lost = [r for r, member in self.members.members.items() if member.state == "lost"]
        given_up = time.monotonic() + CREDIT_S
        for k, r in enumerate(lost):
            if time.monotonic() > given_up:   # (the serve loop waits meanwhile: heartbeats go unanswered)
                log("coordinator", f"summary.json counts the {len(lost) - k} other ranks lost for good as they were "
                                   f"heard: their step lines took over {CREDIT_S:g} s to read")
                break
            logged = earlier_lives(self.out, r, self.launched_at, until, CREDIT_TAIL_BYTES)
            if logged:
                self.members.members[r].credit_lives(logged)
                self._credit_staleness(r, logged)

    def _flush(self, until: float) -> None:
        """Serve on while an answer sent since the job's end is still queued in ZeroMQ
        (those sent before this is called: every daemon has heard the end), until `until`
        at the latest (`FLUSH_S`)."""
        pending = self.service.leaving()
        while any(not t.done for t in pending) and time.monotonic() < until:
            self._heard_since = time.monotonic()   # (as `serve`'s loop: `_prompt`)
            self.service.poll(5)

    def _lingered(self, now: float) -> bool:
        """After `done`, keep answering heartbeats until every daemon has heard it: the
        job's shards, its evaluator (if any, and not given up for its silence), every worker
        still live (an aborted job's worker blocked at a barrier learns of the end only so;
        finished and lost ones need not), and a finished worker that holds the job's end
        (rank 0 of a script waiting to read the final model: an abort, which ends the job
        through its hold, reaches it only so)."""
        daemons = {("server", i) for i in range(self.cfg.cluster.servers)}
        if self.has_evaluator and not self.evaluator_lost:
            daemons.add(("evaluator", 0))
        workers = {who for role, who in self.told_done if role == "worker"}
        live = set(self.members.live()) | ({self.holder} if self.holder is not None else set())
        heard = daemons <= self.told_done and live <= workers
        return heard or now - self.done_at > linger_s(self.cfg)

    # ------------------------------------------------------------ the state file
    def _save_state(self, now: float) -> None:
        """Replace DIR/coordinator-state.json (atomically) when the job's state changed,
        and every STATE_EVERY_S for the counters and the scores: what a restarted
        coordinator resumes. The curve grows by two scores a second (7,200 an hour):
        encoded whole on every score and every second, an hour into a job each rewrite
        took 0.15-0.7 s of the serve loop, four hours in over a second, most of the
        coordinator's time. A score is encoded once its samples are settled (those still
        `counting` are the curve's last), and saved as it comes (it waited for the next
        second: a coordinator killed meanwhile lost up to a second of the curve, and
        summary.json's time_to_target_s moved from 1.09 s to 2.56). Encoded once, the
        whole curve was still written every second (and fsync'd): 6.8 MB at 8 hours, 20 MB
        a second a day into a job. A settled score is appended once to
        DIR/coordinator-scores.jsonl (fsync'd before the state file that counts it,
        `evals_settled`, replaces the old one); the state file holds the scores still
        counting (`evals`): its size stays that of a job's first seconds."""
        key = (self.members.version, self.phase, self.abort, len(self.server_joins), self.held_until, len(self.evals))
        if not self.state_path or (key == self._saved and now - self._saved_at < STATE_EVERY_S):
            return
        self._saved, self._saved_at = key, now
        settled = len(self.evals) - len(self.counting)   # (scores settle in order: `_count`)
        try:
            if settled > self._appended:
                self._append_scores(self.evals[self._appended:settled])
                self._appended = settled
            counting = "[" + ", ".join(json_line(e)[:-1] for e in self.evals[settled:]) + "]"
            self._write_state(time.time(), now, settled, counting)
        except OutputError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            # Out of file descriptors (connections held open to its port, or more peers than
            # `ulimit -n`): for now, not for good (a full disk is). It exited 73 and ended the
            # job; it tries again in a second (STATE_EVERY_S), or at the next change, and the
            # log says so once a minute.
            if now - self._unsaved_said_at >= 60.0:
                self._unsaved_said_at = now
                log("coordinator", f"{e}; trying again every {STATE_EVERY_S:g} s")

    def _write_state(self, wall: float, now: float, settled: int, counting: str) -> None:
        write_json_atomic(self.state_path, {
            "saved_at": wall, "config": self.cfg.to_dict(), "phase": self.phase, "abort": self.abort,
            "t0_wall": wall - (now - self.t0) if self.t0 else None,
            "t_end_wall": wall - (now - self.t_end) if self.t_end else None,
            # rank 0's hold on the job's end (a script reading the final model: on_finish)
            "held_until_wall": wall + (self.held_until - now) if self.held_until > now else None,
            "holder": self.holder if self.held_until > now else None,
            "membership": self.members.state_dict(), "nonces": self.nonces,
            "server_joins": self.server_joins, "server_nonces": self.server_nonces, "servers": self.servers,
            "startup_s": self.startup_s, "launched_at": self.launched_at, "launched_by": self.launched_by,
            "restarts": self.restarts, "counters": self.counters, "layout": self.layout,
            "awaited": sorted(self.awaited), "evals_settled": settled}, {"evals": counting})

    def _append_scores(self, scores: list[dict]) -> None:
        """Append settled scores to the scores file, one JSON line each, fsync'd."""
        try:
            with open(self.scores_path, "a", encoding="utf-8") as f:
                f.write("".join(json_line(e) for e in scores))
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise output_error(e, self.scores_path) from None

    def _read_scores(self, n: int, beyond: bool) -> list[dict]:
        """The scores of the scores file: its first `n` (those the state file counts), as many
        whole ones as it has (a file cut short or removed: said), and with `beyond` every
        whole line after them (scores appended and fsync'd by a coordinator killed before its
        state file's rewrite counted them: they were settled). The file is cut to them, so
        that appends go on after them."""
        scores: list[dict] = []
        size = 0
        try:
            with open(self.scores_path, "rb") as f:
                for line in f:
                    if (len(scores) == n and not beyond) or not line.endswith(b"\n"):
                        break
                    try:
                        e = json.loads(line)
                    except ValueError:
                        break
                    if not isinstance(e, dict):
                        break
                    scores.append(e)
                    size += len(line)
            os.truncate(self.scores_path, size)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise output_error(e, self.scores_path) from None
        if len(scores) < n:
            log("coordinator", f"{self.scores_path} holds {len(scores)} of the {n} scores that {self.state_path} "
                               f"counts: the job's accuracy curve goes on from those")
        return scores

    def _resume(self) -> None:
        """Continue a job whose coordinator died, from its state file: only a file of
        the same config, of a job not done, saved within cluster.timeout_s (the time
        the daemons keep trying to reach the coordinator); anything else starts afresh."""
        if not self.state_path or not os.path.exists(self.state_path):
            return
        try:
            with open(self.state_path) as f:
                st = json.load(f)
        except (OSError, ValueError) as e:
            log("coordinator", f"ignoring {self.state_path}: {e}")
            return
        age = time.time() - float(st.get("saved_at", 0))
        same = json.dumps(st.get("config"), sort_keys=True) == json.dumps(self.cfg.to_dict(), sort_keys=True)
        if st.get("phase") == "done" and st.get("abort") and same and age <= self.cfg.cluster.timeout_s:
            # Its job was aborted moments ago: this process is a restart of the coordinator
            # that ended it (Compose restarts one that exited 1). Starting afresh ran an empty
            # job over it, whose summary replaced the abort's reason. (A job that finished
            # exits 0 and is not restarted: a new `up` in its folder starts afresh.)
            self.phase, self.abort, self.ended = "done", st.get("abort") or "", True
            log("coordinator", f"the job in {self.state_path} ended {age:.0f} s ago"
                               + (f", aborted: {self.abort}" if self.abort else "") + "; nothing to do")
            return
        if st.get("phase") == "done" or not same or age > self.cfg.cluster.timeout_s:
            why = ("its job is done" if st.get("phase") == "done" else "it is another config's" if not same
                   else f"it is {age:.0f} s old, older than cluster.timeout_s")
            log("coordinator", f"starting afresh, not from {self.state_path}: {why}")
            return
        now, wall = time.monotonic(), time.time()
        self.phase, self.abort = st["phase"], st["abort"]
        self.t0 = now - (wall - st["t0_wall"]) if st["t0_wall"] else 0.0
        self.t_end = now - (wall - st["t_end_wall"]) if st["t_end_wall"] else 0.0
        self.held_until = now + (st["held_until_wall"] - wall) if st.get("held_until_wall") else 0.0
        holder = st.get("holder")   # (it must hear an abort: `_lingered`)
        self.holder = holder if self.held_until and type(holder) is int else None
        # A worker's heartbeat that this coordinator's last life read and never answered is
        # followed by its next only beat_answer_s and a period later.
        self.members.load_state_dict(st["membership"], now, beat_answer_s(self.cfg) + self.cfg.cluster.heartbeat_s)
        self.nonces = {k: int(v) for k, v in st["nonces"].items()}
        self.server_joins = {int(k): int(v) for k, v in st["server_joins"].items()}
        self.server_nonces = {str(k): int(v) for k, v in st.get("server_nonces", {}).items()}
        self.servers = {int(k): v for k, v in st["servers"].items()}
        # (a state file of an earlier psgd held the whole curve in `evals`, none in the scores
        # file: one there is not this job's, and is cut to nothing)
        counted = int(st.get("evals_settled", 0))
        settled = self._read_scores(counted, beyond="evals_settled" in st)
        self._appended = len(settled)
        # Scores settle in order: those appended beyond the count were the first of `evals`
        # (still counting at the rewrite before) or came after them.
        self.evals = settled + st["evals"][max(0, len(settled) - counted):]
        self.startup_s = st["startup_s"]
        self.launched_at, self.launched_by = st["launched_at"], st["launched_by"]
        self._launched_mono = now - (wall - self.launched_at)   # (another process's: only wall times compare)
        self.counters.update(st["counters"])
        self.layout = st.get("layout")
        self.restarts = int(st["restarts"]) + 1
        if self.phase == "final_eval":
            self.final_deadline = now + self.cfg.cluster.timeout_s
        self.rejoin_until = now + self.cfg.cluster.timeout_s
        # Awaited: the ranks live when it died, and those its last life awaited that are still
        # lost (restarted again before they came back: a stack stopped whole, twice); not a
        # rank dropped before (waiting for it held a finished job silent, in its wall_s).
        self.awaited = set(self.members.live()) | {int(r) for r in st.get("awaited", [])
                                                   if self.members.members[int(r)].state == "lost"}
        self.events.write(event="coordinator_restart", restarts=self.restarts, phase=self.phase)
        log("coordinator", f"resumed the job from {self.state_path} (saved {age:.1f} s ago): {self.phase}, "
            f"{len(self.members.live())} live workers; restart {self.restarts}")

    # ------------------------------------------------------------ loop
    def serve(self, deadline_s: float | None = None) -> int:
        if self.ended:   # a restart after its job ended (`_resume`): exit as that job did
            self.service.close()
            self.events.close()
            if self.cfg.security.curve:
                stop_auth(self.ctx)
            return 1 if self.abort else 0
        start = polled = time.monotonic()
        waited_note = start
        try:
            while True:
                self._heard_since = polled
                self.service.poll(50)
                now = polled = time.monotonic()
                self._tick(now)
                if self.phase == "done" and self._lingered(now):
                    self._flush(now + FLUSH_S)
                    return 1 if self.abort else 0
                if self.phase == "rendezvous":
                    left = self.cfg.cluster.timeout_s - (now - start)
                    have = f"{len(self.members.members)}/{self.cfg.cluster.workers} workers registered"
                    if left <= 0:
                        slow = ("; a script's work before psgd.connect counts: raise cluster.timeout_s if it takes "
                                "longer" if self.cfg.model.name == layouts.SCRIPT_MODEL else
                                "; where the job has more busy processes than the machine has cores, starting "
                                "them can take longer than that: raise cluster.timeout_s")
                        keys = (f"; with security.curve, a worker without this job's keys ({self.cfg.security.keys}) "
                                f"is never answered" if self.cfg.security.curve else "")
                        # The address they dial, not the one bound (tcp://*:PORT off loopback).
                        log("coordinator", f"{have} after cluster.timeout_s = {self.cfg.cluster.timeout_s:g} s; "
                            f"giving up (are all workers started, and do they reach "
                            f"{self.cfg.coordinator_address()}{slow}?{keys})")
                        # In the state file: a restart (Compose's on-failure) ends at once (`_resume`),
                        # where each waited cluster.timeout_s again, from a resumed rendezvous
                        self.phase = "done"
                        self.abort = f"{have} after cluster.timeout_s = {self.cfg.cluster.timeout_s:g} s"
                        self._save_state(now)
                        return 1
                    if now - waited_note >= WAITING_EVERY_S:
                        waited_note = now
                        log("coordinator", f"waiting: {have}, giving up in {left:.0f} s")
                if self.stop_requested or (deadline_s and now - start > deadline_s):
                    return 1
        finally:
            self.service.close()
            self.events.close()
            if self.scalars:
                for waiting in self.counting:   # (a job that ended without a summary: stopped)
                    self._counted(*waiting)
                self.scalars.workers(self.members.stats(), self.samples())
                self.scalars.close()
            stop_auth(self.ctx)
