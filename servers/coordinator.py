"""The coordinator daemon: rendezvous, liveness, the end of the job, summary.json.

    psgd coordinator [CONFIG] --out DIR [--set k=v ...]

One ROUTER socket on cluster.port, served by the daemons' one serve loop
(`psgd.transport.Service`); ops: register, heartbeat, finish, eval, status. Workers'
registrations are answered once all `cluster.workers` have registered, so training
starts together; the coordinator waits `cluster.timeout_s` for them, saying how many
it has. A worker that finishes with an error (it stopped after too many refused
steps) aborts the job with that reason. Heartbeats carry each daemon's cumulative counters and get
the live set back. When no worker is live any more, the evaluator is asked for a final
score; then summary.json is written, every daemon is told `done`, and it exits.

Start-up: `startup_s` in the `start` event and in summary.json is the time from
`launched_at` (a time.time() value) to the start of training, and `startup_from` says
what `launched_at` was: "launcher" when `psgd run` / `psgd compare` started this
coordinator (`--launched-at`: the moment it started the job; for `psgd run`, the
command's own start), "coordinator process" for a coordinator started by hand (its
process's start: the daemons started before it are not counted, and the wait for those
started after it is), "coordinator" for one built in a process that does other things
(the in-process cluster: from its construction). This module imports no torch.
"""
from __future__ import annotations

import time
from typing import Any

import zmq

from psgd import wire
from psgd.config import Config
from psgd.log import log
from psgd.membership import Membership
from psgd.metrics import EventLog, summarize, write_json_atomic
from psgd.transport import Reply, Service, bind_address, server_socket, stop_auth

PROGRESS_EVERY_S = 2.0
WAITING_EVERY_S = 5.0
MAX_FRAME = 16 << 20  # the coordinator's messages are headers only: config, counters


class Coordinator:
    def __init__(self, cfg: Config, out: str | None = None, ctx: zmq.Context | None = None,
                 quiet: bool = False, launched_at: float | None = None, launched_by: str = "coordinator"):
        self.cfg = cfg
        self.launched_at = time.time() if launched_at is None else launched_at
        self.launched_by = launched_by
        self.startup_s: float | None = None
        self.out = out
        self.quiet = quiet
        self.ctx = ctx or zmq.Context.instance()
        self.members = Membership(cfg.cluster.workers, cfg.cluster.heartbeat_timeout_s)
        self.address = bind_address(cfg.coordinator_address())
        self.sock = server_socket(self.ctx, self.address, cfg.security, MAX_FRAME)
        self.events = EventLog(out, "coordinator", 0)
        self.phase = "rendezvous"
        self.parked: list[tuple[Any, wire.Message, int]] = []  # registrations held until all are in
        self.servers: dict[int, dict] = {}
        self.server_joins: dict[int, int] = {}
        self.evaluator_seen = 0.0
        self.evals: list[dict] = []
        self.t0 = 0.0
        self.t_end = 0.0
        self.final_deadline = 0.0
        self.done_at = 0.0
        self.told_done: set = set()
        self.abort = ""
        self.counters = {"bad_messages": 0}
        self.summary: dict | None = None
        self._last_progress = 0.0
        self.stop_requested = False  # set from another thread to end serve() (tests)
        self.service = Service(self.sock, {"register": self.on_register, "heartbeat": self.on_heartbeat,
                                           "finish": self.on_finish, "eval": self.on_eval,
                                           "status": self.on_status},
                               "the coordinator", MAX_FRAME, self.counters)

    def _view(self) -> dict:
        live = {str(k): v for k, v in self.members.live().items()}
        return {"phase": self.phase, "done": self.phase == "done", "live": live, "version": self.members.version,
                "abort": self.abort}

    def samples(self) -> int:
        return sum(int(s.get("samples", 0)) for s in self.members.stats().values())

    # ------------------------------------------------------------ handlers
    def on_register(self, ident, msg: wire.Message) -> list[Reply]:
        role, now = msg.get("role"), time.monotonic()
        if role == "worker":
            if self.phase in ("final_eval", "done"):
                raise wire.WireError(wire.REFUSED, "the job is finishing; no new workers")
            rank = self.members.join(now, msg.get("want_rank", -1))
            if rank < 0:
                raise wire.WireError(wire.REFUSED, f"all {self.cfg.cluster.workers} worker ranks are taken and live")
            self.events.write(event="join", rank=rank, joins=self.members.members[rank].joins)
            if self.phase == "rendezvous":
                self.parked.append((ident, msg, rank))
                log("coordinator", f"workers registered {len(self.members.members)}/{self.cfg.cluster.workers} "
                    f"(worker {rank})")
                return self._start_training() if self.members.all_joined else []
            log("coordinator", f"worker {rank} rejoined at clock {self.members.members[rank].clock}")
            return [self._reply_register(ident, msg, rank)]
        if role == "server":
            idx = msg.get("index", 0)
            self.server_joins[idx] = self.server_joins.get(idx, 0) + 1
            if self.server_joins[idx] > 1:
                log("coordinator", f"shard {idx} restarted")
            elif self.phase == "rendezvous":
                log("coordinator", f"shards registered {len(self.server_joins)}/{self.cfg.cluster.servers} "
                    f"(shard {idx})")
            self.servers.setdefault(idx, {})
            return [self._reply_register(ident, msg, -1)]
        if role == "evaluator":
            self.evaluator_seen = now
            return [self._reply_register(ident, msg, -1)]
        raise wire.WireError(wire.BAD_FIELD, f"unknown role {role!r}")

    def _reply_register(self, ident, msg, rank: int) -> Reply:
        clock = self.members.members[rank].clock if rank >= 0 else 0
        return ident, wire.reply(msg, assigned_rank=rank, config=self.cfg.to_dict(), start_clock=clock, **self._view())

    def _start_training(self) -> list[Reply]:
        self.phase = "training"
        self.t0 = time.monotonic()
        for m in self.members.members.values():
            m.last_seen = self.t0
        self.startup_s = round(time.time() - self.launched_at, 3)
        self.events.write(event="start", workers=self.cfg.cluster.workers, startup_s=self.startup_s,
                          startup_from=self.launched_by)
        log("coordinator", f"all {self.cfg.cluster.workers} workers registered; training "
            f"({self.cfg.mode.name}, {self.cfg.cluster.servers} shards) after {self.startup_s:.1f} s of start-up "
            f"(since the {self.launched_by} started)")
        replies = [self._reply_register(ident, msg, rank) for ident, msg, rank in self.parked]
        self.parked = []
        return replies

    def on_heartbeat(self, ident, msg: wire.Message) -> list[Reply]:
        role, now = msg.get("role"), time.monotonic()
        stats = msg.get("stats") or {}
        rejoin = False
        if role == "worker":
            rejoin = not self.members.beat(msg.rank, now, msg.clock if msg.clock >= 0 else None, stats)
            if rejoin and self.members.members.get(msg.rank) and self.members.members[msg.rank].state == "finished":
                rejoin = False
        elif role == "server":
            self.servers[msg.get("index", 0)] = stats
        elif role == "evaluator":
            self.evaluator_seen = now
        if self.phase == "done":
            self.told_done.add((role, msg.get("index", 0), msg.rank))
        return [(ident, wire.reply(msg, rejoin=rejoin, **self._view()))]

    def on_finish(self, ident, msg: wire.Message) -> list[Reply]:
        self.members.finish(msg.rank, msg.get("stats"))
        error = msg.get("error")
        self.events.write(event="finish", rank=msg.rank, **({"error": error} if error else {}))
        if error and self.phase == "training" and not self.abort:
            self.abort = error
            log("coordinator", f"aborting the job: {error}")
        return [(ident, wire.reply(msg, **self._view()))]

    def on_eval(self, ident, msg: wire.Message) -> list[Reply]:
        t = time.monotonic() - self.t0 if self.t0 else 0.0
        e = {"t": round(t, 3), "samples": self.samples(), "accuracy": float(msg.get("accuracy")),
             "loss": float(msg.get("loss")), "final": bool(msg.get("final", False))}
        if self.phase in ("training", "final_eval"):
            self.evals.append(e)  # t: seconds since training started (summary.json's curve)
            self.events.write(event="eval", elapsed_s=e["t"], **{k: v for k, v in e.items() if k != "t"})
        if e["final"] and self.phase == "final_eval":
            self._finish_job()
        return [(ident, wire.reply(msg, samples=e["samples"], t=e["t"]))]

    def on_status(self, ident, msg: wire.Message) -> list[Reply]:
        return [(ident, wire.reply(msg, samples=self.samples(), servers=len(self.servers),
                                   evals=len(self.evals), **self._view()))]

    # ------------------------------------------------------------ phases
    def _tick(self, now: float) -> None:
        if self.phase == "training":
            lost = self.members.expire(now)
            for r in lost:
                log("coordinator", f"worker {r} missed heartbeats for {self.cfg.cluster.heartbeat_timeout_s:.0f} s: "
                    f"dropped from the membership")
                self.events.write(event="lost", rank=r)
                if self.cfg.faults.on_worker_loss == "abort":
                    self.abort = f"worker {r} was lost and faults.on_worker_loss = abort"
            if self.abort or self.members.all_done:
                self.t_end = now
                if self.cfg.cluster.evaluator and not self.abort:
                    self.phase = "final_eval"
                    self.final_deadline = now + self.cfg.cluster.timeout_s
                    log("coordinator", "all workers finished; waiting for the final evaluation")
                else:
                    self._finish_job()
        elif self.phase == "final_eval" and now > self.final_deadline:
            log("coordinator", "no final evaluation arrived in time; writing the summary without it")
            self._finish_job()
        if not self.quiet and self.phase == "training" and now - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = now
            self._progress(now)

    def _progress(self, now: float) -> None:
        live = self.members.live()
        steps = self.cfg.train.steps
        clock = min(live.values()) if live else 0
        n, t = self.samples(), now - self.t0
        acc = f"  acc {self.evals[-1]['accuracy']:.3f}" if self.evals else ""
        total = f"/{steps}" if steps else ""
        log("coordinator", f"{self.cfg.mode.name}  {t:6.1f} s  step {clock}{total}  samples {n:,}  "
            f"{n / t if t > 0 else 0:,.0f}/s{acc}  live {len(live)}/{self.cfg.cluster.workers}")

    def _finish_job(self) -> None:
        wall = (self.t_end or time.monotonic()) - self.t0
        m = self.members
        failures = {"workers_lost": m.lost, "workers_rejoined": m.rejoined,
                    "shard_restarts": sum(max(0, n - 1) for n in self.server_joins.values())}
        extra = {"job": self.cfg.job.name, "seed": self.cfg.job.seed, "model": self.cfg.model.name,
                 "data": self.cfg.data.name, "batch_size": self.cfg.train.batch_size,
                 "steps": self.cfg.train.steps, "faults": {k: v for k, v in vars(self.cfg.faults).items()},
                 "bad_messages_coordinator": self.counters["bad_messages"],
                 "startup_s": self.startup_s, "startup_from": self.launched_by}
        if self.abort:
            extra["aborted"] = self.abort
        self.summary = summarize(mode=self.cfg.mode.name, mode_params=self.cfg.mode_params,
                                 workers=self.cfg.cluster.workers, servers=self.cfg.cluster.servers,
                                 wall_s=wall, worker_stats=m.stats(), server_stats=self.servers,
                                 evals=[e for e in self.evals], target=self.cfg.eval.target_accuracy,
                                 failures=failures, extra=extra)
        if self.out:
            write_json_atomic(f"{self.out}/summary.json", self.summary)
        self.events.write(event="done", wall_s=round(wall, 3))
        self.phase = "done"
        self.done_at = time.monotonic()

    def _lingered(self, now: float) -> bool:
        """After `done`, keep answering heartbeats until every daemon has heard it."""
        expected = self.cfg.cluster.servers + (1 if self.cfg.cluster.evaluator else 0)
        heard = len({k for k in self.told_done if k[0] != "worker"})
        return heard >= expected or now - self.done_at > 3 * self.cfg.cluster.heartbeat_s + 3

    # ------------------------------------------------------------ loop
    def serve(self, deadline_s: float | None = None) -> int:
        start = time.monotonic()
        waited_note = start
        try:
            while True:
                self.service.poll(50)
                now = time.monotonic()
                self._tick(now)
                if self.phase == "done" and self._lingered(now):
                    return 1 if self.abort else 0
                if self.phase == "rendezvous":
                    left = self.cfg.cluster.timeout_s - (now - start)
                    have = f"{len(self.members.members)}/{self.cfg.cluster.workers} workers registered"
                    if left <= 0:
                        log("coordinator", f"{have} after cluster.timeout_s = {self.cfg.cluster.timeout_s:.0f} s; "
                            f"giving up (are all workers started, and do they reach {self.address}?)")
                        return 1
                    if now - waited_note >= WAITING_EVERY_S:
                        waited_note = now
                        log("coordinator", f"waiting: {have}, giving up in {left:.0f} s")
                if self.stop_requested or (deadline_s and now - start > deadline_s):
                    return 1
        finally:
            self.sock.close(0)
            self.events.close()
            stop_auth(self.ctx)
