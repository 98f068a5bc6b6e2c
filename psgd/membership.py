"""Who is in the job: the coordinator's membership table, and every daemon's link to it.

`Membership` is a pure state machine (no sockets): workers join (a rank is handed
out, or given back to a worker that returns), beat, finish or expire; each change bumps
`version`. The live set — ranks that joined, have not finished and beat within the
timeout — is what barriers, staleness gates and tournaments count.

A rank's counters add up over its lives: a worker process that dies and is started
again (with its rank: `psgd run --restart-workers`, or by hand) counts from 0, so when a
rank is joined by a new process (another registration nonce) the counters of the one
before are kept (`Member.past`) and `stats()` gives each rank's totals. The same process
rejoining after it was dropped (a partition; its own nonce) keeps counting where it was.
A process dies between heartbeats: the new one sends what the rank's earlier processes
logged (their step lines' counts), which stands where the coordinator heard less
(`Member.credit`).
The process that held a rank before another took it over is `superseded`: its
heartbeats and finish (which carry its nonce) are not the rank's.

`CoordinatorLink` is the daemons' side: register (waiting, with a clear message, for a
coordinator that is not up yet), then a background thread that heartbeats every
`cluster.heartbeat_s` (a shard and the evaluator: every `SHARD_BEAT_S` at most) with the caller's
counters and keeps the latest answer (live set, phase, done).
"""
from __future__ import annotations

import bisect
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from . import wire
from .config import Config, is_number
from .log import log
from .metrics import LOGGED_STATS
from .transport import Peers, PeerTimeout, unreachable

REGISTER_RESEND_S = 3.0  # an unanswered request to the coordinator is sent again this often
# A shard learns the live set from its heartbeats' answers: a step that waits for a
# worker that finished (its time budget spent) or was dropped waits until the next
# one. Shards are few, so they beat this often (a time-budget sync run lost up to a
# heartbeat_s, 0.5 s, at its end: 14 % of a 3 s comparison run's samples/s). The
# evaluator too: it learns from them that training has begun (its first score came up
# to a heartbeat_s into training, whatever eval.every_seconds said) and that it ended.
SHARD_BEAT_S = 0.05
# The coordinator's phases after training (every worker done) and before `done`: the
# tables change no more, and the final evaluation reads them. A shard checkpoints as it
# learns of them; one restarted then without those tables says so (`lost_tables`).
AFTER_TRAINING = ("final_eval", "settling")
# During the rendezvous a registered worker waits, sending its registration again every
# REGISTER_RESEND_S: one not heard from for this long is gone, and its rank may be taken.
RENDEZVOUS_QUIET_S = 2 * REGISTER_RESEND_S + 1.0
# The refusal of a worker's registration while every rank is held by a live worker: a
# restarted worker without --rank (as Compose restarts one) waits for the coordinator to
# miss the one it replaces (cluster.heartbeat_timeout_s), up to cluster.timeout_s.
ALL_RANKS_LIVE = "worker ranks are taken and live"
LATEST_STATS = ("clock", "loss")  # a worker's counters that are not summed over its lives: the last life's
LARGEST_STATS = ("staleness_max",)  # ... and those that are the largest of its lives'
COUNTS_KEPT = 32  # a worker's counts kept for `SamplesAt`: about this many over the window
# The job a daemon belongs to: `psgd run` gives each job a token of its own, which its
# daemons send when they register and its coordinator checks, so that a daemon of
# another job (a script still retrying the same port) cannot join it. Unset: the job
# of daemons started by hand (Slurm, Compose), which carry none either.
JOB_TOKEN_ENV = "PSGD_JOB_TOKEN"


def job_token() -> str:
    """This process's job token ('' when none was given)."""
    return os.environ.get(JOB_TOKEN_ENV, "")


def beat_answer_s(cfg: Config) -> float:
    """How long a daemon waits for the answer to a heartbeat. Unanswered (its coordinator
    died with it, or is slow), the next goes a heartbeat period later, on a fresh
    connection: a restarted coordinator may hear nothing from a live daemon for that long
    (`Membership.load_state_dict`'s grace)."""
    return max(cfg.cluster.heartbeat_s * 4, 2.0)


def add_stats(past: dict, current: dict) -> dict:
    """Two lives' counters as one: numbers (and lists of numbers, e.g. a histogram's
    counts, position by position) are summed, LARGEST_STATS the larger; LATEST_STATS and
    anything else are the current life's."""
    out = dict(past)
    for k, v in current.items():
        old = out.get(k)
        if k in LATEST_STATS or old is None:
            out[k] = v
        elif is_number(v) and is_number(old):
            out[k] = max(old, v) if k in LARGEST_STATS else old + v
        elif isinstance(v, list) and isinstance(old, list) and all(map(is_number, v + old)):
            n = max(len(v), len(old))
            out[k] = [(old[i] if i < len(old) else 0) + (v[i] if i < len(v) else 0) for i in range(n)]
        else:
            out[k] = v
    return out


class Counts:
    """A worker's samples (over all its lives) at its heartbeats of the last `window_s`
    seconds, as (time, samples) points, for `SamplesAt`: a score may arrive long after
    its read of the model (a slow evaluator on a busy machine), and the count at the
    read lies between two of these. Bounded: the points are at least window_s /
    COUNTS_KEPT apart but for the latest three, which are every heartbeat's (most
    scores are read within the last two periods; the point where a worker began
    stepping, `Worker.start`'s beat, was moved on to the next beat, and an early score
    was counted up to a period of samples the workers had not done), and only one is
    older than the window. O(1) amortized per heartbeat: the coordinator serves a
    thousand workers'."""

    def __init__(self, window_s: float = 0.0):
        self.window_s = window_s
        self.spacing = window_s / COUNTS_KEPT
        self.points: deque[tuple[float, int]] = deque()

    def add(self, t: float, samples: int) -> None:
        p = self.points
        p.append((t, samples))
        if len(p) >= 4 and p[-3][0] - p[-4][0] < self.spacing:
            del p[-3]   # thinned once it is no longer among the latest three
        while len(p) > 2 and p[1][0] <= t - self.window_s:
            p.popleft()

    @property
    def last(self) -> tuple[float, int]:
        return self.points[-1]

    def at(self, t: float) -> float:
        """The count at `t`, in proportion between the points around it (a worker's steps
        are about evenly spaced); before the first point its count, after the last the last."""
        p = self.points
        i = bisect.bisect_right(p, t, key=lambda x: x[0])
        if i == 0 or i == len(p):
            return p[0][1] if i == 0 else p[-1][1]
        (t0, s0), (t1, s1) = p[i - 1], p[i]
        return s0 + (s1 - s0) * (t - t0) / (t1 - t0)


@dataclass
class Member:
    rank: int
    last_seen: float
    clock: int = 0
    state: str = "live"          # live | finished | lost
    stats: dict = field(default_factory=dict)   # this life's counters (the process now holding the rank)
    joins: int = 1
    nonce: str = ""                              # that process's registration nonce
    past: dict = field(default_factory=dict)    # the counters of the rank's earlier processes, summed
    counts: Counts = field(default_factory=Counts)   # its samples at its recent heartbeats (and its join):
    #                                              last_seen also moves without new counts (a stall excused)
    left: str = ""                               # why that process said it stops unfinished (`Membership.leaving`)
    taken_back: bool = False                     # that process took the rank over while it was live (`join`)
    ended: float = 0.0                           # when its training ended (`finish`; 0.0: not in this life of
    #                                              the coordinator)

    def totals(self) -> dict:
        """The rank's counters over all its lives."""
        return add_stats(self.past, self.stats) if self.past else self.stats

    def samples(self) -> int:
        return int(self.totals().get("samples", 0))

    def heard(self, now: float, stats: dict | None, logged: dict | None) -> None:
        """A heartbeat's or a finish's counters (`stats`, and `logged`: `credit`)."""
        self.stats = stats or self.stats
        self.credit(logged or {})
        self.counts.add(now, self.samples())

    def credit_lives(self, logged: dict) -> None:
        """The counters of all the rank's lives as their step lines have them (`logged`:
        `metrics.earlier_lives`, read by the coordinator once the job is over and the rank
        lost, with no process to take it up and send them): where the coordinator heard
        less (its last process died before its first heartbeat, or between two), the step
        lines' count stands. Those lives are all past now."""
        self.past, self.stats = self.totals(), {}
        self.credit(logged)

    def credit(self, logged: dict) -> None:
        """The counters of the rank's earlier processes as their step lines have them
        (`metrics.earlier_lives`, sent by the process now holding the rank): where the
        coordinator heard less of one (it died between heartbeats, or with the coordinator
        after its last state save), the step lines' count stands."""
        for k, v in logged.items():
            if k in LOGGED_STATS and is_number(v) and v > self.past.get(k, 0):
                self.past[k] = v


class SamplesAt:
    """The workers' samples at a moment `t` of the past (when the evaluator read the model
    it scored), from their heartbeats on either side of it: a worker's count at its last
    heartbeat before `t`, moved towards its count at its first one after, in proportion to
    the time between (its steps are about evenly spaced). The count at the score's arrival
    lagged the model by up to a heartbeat period, early in a run several times the true
    count. A worker heard from since `t` has its recent heartbeats (and its finish)
    around it (`Counts`: a score that took longer than a heartbeat period, too); a live
    one not heard from since is waited for; one that finished before `t` is final; one
    never heard from again (lost, or the job ends first) keeps its count before `t`."""

    def __init__(self, members: dict[int, Member], t: float):
        self.t = t
        self.known = 0.0
        self.waiting: dict[int, tuple[float, int]] = {}   # rank -> (time, samples) of its last beat before t
        for r, m in members.items():
            if m.state == "live" and m.counts.last[0] <= t:
                self.waiting[r] = m.counts.last
            else:
                self.known += m.counts.at(t)

    def beat(self, rank: int, now: float, samples: int) -> None:
        """Rank's count at `now`, its first heartbeat (or its finish) after `t`; a count
        from before `t` (a beat that carries an earlier one: `CoordinatorLink.beat_soon`)
        is its latest before `t`, and the wait goes on."""
        if rank in self.waiting:
            if now <= self.t:
                self.waiting[rank] = max(self.waiting[rank], (now, samples))
                return
            t0, s0 = self.waiting.pop(rank)
            self.known += s0 + (samples - s0) * min(1.0, (self.t - t0) / (now - t0)) if now > t0 else s0

    def gone(self, rank: int) -> None:
        """Rank was dropped (missed heartbeats): its count before `t` stands."""
        if rank in self.waiting:
            self.known += self.waiting.pop(rank)[1]

    def value(self) -> int:
        """The count at `t`, with the counts before `t` of those not heard from since."""
        return round(self.known + sum(s for _, s in self.waiting.values()))


class RegistrationCancelled(RuntimeError):
    """`CoordinatorLink.register` given up by its caller (a daemon told to stop)."""


class Membership:
    def __init__(self, world: int, timeout_s: float, counts_s: float = 0.0, shared_step: bool = True):
        """`counts_s`: how far back each worker's counts are kept (`Counts`; the
        coordinator's cluster.timeout_s), at least the heartbeat timeout. `shared_step`:
        the job's shards keep a step every worker moves up to (`consistency.shared_step`):
        a new process taking up a rank starts at the slowest live worker's clock, else at
        the rank's own."""
        self.world = world
        self.shared_step = shared_step
        self.timeout_s = timeout_s
        self.counts_s = max(counts_s, timeout_s)
        self.members: dict[int, Member] = {}
        self.version = 0
        self.lost = 0        # workers dropped for missing heartbeats
        self.rejoined = 0    # workers that came back
        self.restarted = 0   # of them, ranks taken up by a new process (a worker that died and was started again)

    def join(self, now: float, want_rank: int = -1, nonce: str = "") -> int:
        """A worker registers: returns its rank, or -1 if every rank is taken and live.
        `nonce`: the registering process's; a rank taken back by another process than
        the one that held it starts a new life (its counters add to the earlier ones),
        where the shards share a step at the slowest live worker's clock (the schedule
        moves it up to theirs). The same process coming back (dropped in a partition),
        and a new one in the modes without a step the shards share (async, EASGD's async
        rounds, LTFB), keep the rank's clock: its budget of steps is its own, and nothing
        would move it back up from the slowest's (a new process at a faster worker's
        clock skipped the steps between: an easgd rank trained 1,944 of its 3,000)."""
        free = [r for r in range(self.world) if r not in self.members]
        gone = [r for r, m in self.members.items() if m.state == "lost"]
        if 0 <= want_rank < self.world and want_rank in self.members and self.members[want_rank].state == "finished":
            return -1   # its share is done: not another rank's instead (a restarted copy took up a lost one's)
        if 0 <= want_rank < self.world and want_rank in self.members and self.members[want_rank].state == "live":
            rank = want_rank  # a worker restarted before it was missed: it takes its rank back
        elif 0 <= want_rank < self.world and (want_rank in free or want_rank in gone):
            rank = want_rank
        elif free:
            rank = free[0]
        elif gone:
            rank = min(gone)
        else:
            return -1
        old = self.members.get(rank)
        if old is not None and old.state == "finished":
            return -1
        if old is not None:
            self.rejoined += 1
            old.taken_back = old.state == "live" and nonce != old.nonce   # (restarted before it was missed)
            old.state, old.last_seen, old.joins, old.left = "live", now, old.joins + 1, ""
            if nonce != old.nonce:  # a new process: it counts from 0 (at the slowest live worker's clock)
                if self.shared_step:
                    old.clock = self.current_clock(exclude=rank, default=old.clock)
                old.past, old.stats, old.nonce = old.totals(), {}, nonce
                self.restarted += 1
        else:
            self.members[rank] = Member(rank, now, nonce=nonce, counts=Counts(self.counts_s))
        m = self.members[rank]
        m.counts.add(now, m.samples())
        self.version += 1
        return rank

    def taken(self, want_rank: int, nonce: str, now: float) -> bool:
        """During the rendezvous: is `want_rank` held by another process (another nonce)
        that is still waiting for the others (heard from within RENDEZVOUS_QUIET_S)? Two
        processes asking for one rank (the same PSGD_RANK twice) are a mistake then, not a
        restart: the coordinator refuses the second. (`join` takes a quiet holder's rank
        back: a process restarted after the one before died.)"""
        m = self.members.get(want_rank)
        return m is not None and m.state == "live" and nonce != m.nonce and now - m.last_seen <= RENDEZVOUS_QUIET_S

    def seen(self, rank: int, now: float) -> None:
        """The rank's process was heard from (a repeated registration)."""
        m = self.members.get(rank)
        if m is not None:
            m.last_seen = max(m.last_seen, now)

    def superseded(self, rank: int, nonce: str) -> bool:
        """Is `nonce` a process that held `rank` before another process took it over (it
        was dropped, or missed, and a worker started with its rank joined)? Its
        heartbeats and its finish are not the rank's. (A message without a nonce is
        taken as the holder's.)"""
        m = self.members.get(rank)
        return bool(nonce) and m is not None and nonce != m.nonce

    def current_clock(self, exclude: int = -1, default: int = 0) -> int:
        """Where a new process taking up a rank continues where the shards share a step:
        the slowest live worker's clock."""
        clocks = [m.clock for r, m in self.members.items() if m.state == "live" and r != exclude]
        return min(clocks) if clocks else default

    def beat(self, rank: int, now: float, clock: int | None = None, stats: dict | None = None,
             logged: dict | None = None, counted: float | None = None) -> bool:
        """A heartbeat; False if the rank is unknown or was dropped (it must rejoin).
        `logged`: its earlier processes' counters from their step lines (`Member.credit`);
        `counted`: when its counters were read, if before `now` (`CoordinatorLink.beat_soon`)."""
        m = self.members.get(rank)
        if m is None or m.state == "lost":
            return False
        # (a beat sent before its finish, come after it, is older; so are counters read before a count heard)
        if (stats or logged) and m.state != "finished" and (counted is None or counted >= m.counts.last[0]):
            m.heard(now if counted is None else counted, stats, logged)
        m.last_seen = now
        if clock is not None:
            m.clock = max(m.clock, clock)
        return True

    def leaving(self, rank: int, reason: str) -> bool:
        """The live rank's process says it stops without finishing its share, and why (a
        shard it could not reach): the rank stays live until its heartbeats are missed
        (a new process may take it up), and `left` names the reason when it is dropped;
        False if the rank is not live."""
        m = self.members.get(rank)
        if m is None or m.state != "live":
            return False
        m.left = reason
        return True

    def finish(self, rank: int, now: float, stats: dict | None = None, clock: int | None = None,
               logged: dict | None = None, ended: float | None = None) -> None:
        """The worker is done; its training ended at `ended` (default `now`)."""
        m = self.members.get(rank)
        if m and m.state != "finished":
            if m.state == "lost":   # dropped (stalled at its last step), back to finish: it came back
                self.rejoined += 1
            m.state = "finished"
            m.ended = now if ended is None else ended
            if stats or logged:
                m.heard(now, stats, logged)
            if clock is not None:   # its last clock (the heartbeats' is up to a period old)
                m.clock = max(m.clock, clock)
            self.version += 1

    def expire(self, now: float) -> list[int]:
        """Drop live workers whose last heartbeat is older than the timeout."""
        dropped = [r for r, m in self.members.items()
                   if m.state == "live" and now - m.last_seen > self.timeout_s]
        for r in dropped:
            self.members[r].state = "lost"
            self.lost += 1
        if dropped:
            self.version += 1
        return dropped

    def excuse(self, seconds: float, now: float) -> None:
        """The watcher itself did not run for `seconds` (the machine stalled, or its
        process was stopped): a heartbeat that could not be read in that time is not a
        missed one, so every live member's silence is counted from `seconds` later (and
        never from earlier than it was: a restarted coordinator's grace stays)."""
        for m in self.members.values():
            if m.state == "live":
                m.last_seen = max(m.last_seen, min(m.last_seen + seconds, now))

    def live(self) -> dict[int, int]:
        return {r: m.clock for r, m in sorted(self.members.items()) if m.state == "live"}

    @property
    def all_joined(self) -> bool:
        return len(self.members) == self.world

    @property
    def all_done(self) -> bool:
        """Every rank has joined and none is still live (finished or lost). (Stops at the
        first live member: asked by the coordinator's loop, where one nearly always is.)"""
        return self.all_joined and not any(m.state == "live" for m in self.members.values())

    @property
    def all_lost(self) -> bool:
        """Every member was dropped and none finished (nobody trained to the end)."""
        return bool(self.members) and all(m.state == "lost" for m in self.members.values())

    def stats(self) -> dict[int, dict]:
        """Each rank's counters, summed over its lives."""
        return {r: m.totals() for r, m in self.members.items()}

    def state_dict(self) -> dict:
        """The table as JSON-able data (the coordinator's state file)."""
        return {"members": {str(r): {"clock": m.clock, "state": m.state, "stats": m.stats, "joins": m.joins,
                                     "nonce": m.nonce, "past": m.past, "left": m.left, "taken_back": m.taken_back}
                            for r, m in self.members.items()},
                "version": self.version, "lost": self.lost, "rejoined": self.rejoined, "restarted": self.restarted}

    def load_state_dict(self, sd: dict, now: float, grace: float = 0.0) -> None:
        """Restore the table; live members count as seen `grace` after `now`: they get a
        full heartbeat timeout to reach the restarted coordinator from the moment their
        next heartbeat is due (a restarted coordinator's `grace` is `beat_answer_s` and a
        period: a beat that died with the coordinator before it answered is followed by
        the next only then)."""
        self.members = {int(r): Member(int(r), now + grace, int(m["clock"]), m["state"], dict(m["stats"]),
                                       int(m["joins"]), str(m.get("nonce", "")), dict(m.get("past") or {}),
                                       left=str(m.get("left", "")), taken_back=bool(m.get("taken_back", False)))
                        for r, m in sd["members"].items()}
        for m in self.members.values():
            m.counts = Counts(self.counts_s)
            m.counts.add(now, m.samples())
        self.version, self.lost, self.rejoined = int(sd["version"]) + 1, int(sd["lost"]), int(sd["rejoined"])
        self.restarted = int(sd.get("restarted", 0))   # older state files do not say


class CoordinatorLink:
    """A daemon's connection to the coordinator: register, heartbeat in the background."""

    def __init__(self, cfg: Config, role: str, index: int = 0, ctx: zmq.Context | None = None):
        self.cfg = cfg
        self.role = role
        self.index = index
        self.period = self._period()
        self.ctx = ctx or zmq.Context.instance()
        self.address = cfg.coordinator_address()
        self.stats_fn: Callable[[], dict] = dict
        self.clock_fn: Callable[[], int] = lambda: -1
        self.fields_fn: Callable[[], dict] = dict   # more of a heartbeat (a shard's `lost_tables`)
        self.state: dict[str, Any] = {"phase": "rendezvous", "done": False, "live": {}, "version": -1}
        self.lost = False
        self.rank = index
        self._stop = threading.Event()
        self._wake = threading.Event()   # a beat now, not at the next period (`beat_soon`)
        self._soon: tuple[float, dict] | None = None   # `beat_soon`'s fields and when they were read
        self._thread: threading.Thread | None = None
        self._calls: Peers | None = None  # one socket for `call`, opened on first use
        self.unanswered = ""              # the last `call`'s PeerTimeout, until one is answered
        self.nonce = os.urandom(8).hex()  # this daemon's registrations, to the coordinator
        self._registrations = 0           # answers to older ones are not applied over a newer one's
        self._applying = threading.Lock()

    def register(self, want_rank: int = -1, cancel: Callable[[], bool] | None = None, **fields: Any) -> wire.Message:
        """Register with the coordinator, waiting for it (and, for workers, for the
        rendezvous of all workers) up to cluster.timeout_s. Returns its answer.
        `fields`: more of the request (a worker's model `layout`). `cancel()` turning
        true (a daemon told to stop) gives up at once: RegistrationCancelled."""
        peers = Peers(self.ctx, [self.address], self.cfg.security)
        said_live = False
        unranked = self.role == "worker" and want_rank < 0   # (its rank is the coordinator's answer: not 0)
        tag, who = (self.role, self.role) if unranked else (f"{self.role}-{self.index}", f"{self.role} {self.index}")
        try:
            start = time.monotonic()
            while True:
                # Sent again after every wait: a coordinator restarted meanwhile lost the
                # request. The nonce lets it answer a repeat with the rank it gave before.
                rid = peers.send(0, "register", role=self.role, index=self.index, want_rank=want_rank,
                                 nonce=self.nonce, job=job_token(), **fields)
                try:
                    msg = peers.wait({rid: 0}, min(REGISTER_RESEND_S, self.cfg.cluster.timeout_s), "register",
                                     cancel)[rid]
                    break
                except wire.Refused as e:
                    waited = time.monotonic() - start
                    if ALL_RANKS_LIVE not in e.reason or waited >= self.cfg.cluster.timeout_s:
                        raise
                    if not said_live:
                        said_live = True
                        log(tag, f"{e.reason}: waiting for the coordinator to miss the worker "
                            f"this one replaces (cluster.heartbeat_timeout_s = "
                            f"{self.cfg.cluster.heartbeat_timeout_s:g} s), up to cluster.timeout_s")
                    if cancel is not None and cancel():
                        raise RegistrationCancelled(f"{who}: stopped while waiting for a free "
                                                    f"rank") from None
                    time.sleep(min(1.0, self.cfg.cluster.heartbeat_s))
                except PeerTimeout:
                    if cancel is not None and cancel():
                        raise RegistrationCancelled(f"{who}: stopped while waiting for the "
                                                    f"coordinator at {self.address}") from None
                    peers.reconnect(0)
                    waited = time.monotonic() - start
                    if waited >= self.cfg.cluster.timeout_s:
                        # (refused before for ranks all taken and live: one worker more than the job's,
                        # whose coordinator then stopped answering, its job ended: not a rendezvous)
                        hint = (f"when it last answered, all {self.cfg.cluster.workers} ranks were taken by live "
                                f"workers (cluster.workers = {self.cfg.cluster.workers}: is this one worker too "
                                f"many?); it may have stopped as its job ended" if said_live
                                else unreachable(self.address) or self._hint())
                        raise PeerTimeout(self.address, waited, f"{who} could not register "
                                          f"with the coordinator at {self.address}; {hint}") from None
                    log(tag, f"waiting for the coordinator at {self.address}"
                        f"{' and the other workers' if self.role == 'worker' else ''} "
                        f"({waited:.0f} s of cluster.timeout_s = {self.cfg.cluster.timeout_s:.0f} s)")
        finally:
            peers.close()
        self.rank = msg.get("assigned_rank", self.index)
        with self._applying:
            self._registrations += 1
            self._apply(msg)
        return msg

    def _period(self) -> float:
        """Its heartbeats' period: a shard's and the evaluator's at most SHARD_BEAT_S."""
        beat = self.cfg.cluster.heartbeat_s
        return min(beat, SHARD_BEAT_S) if self.role in ("server", "evaluator") else beat

    def take_job_config(self, answer: wire.Message) -> Config:
        """The job's config, from the registration's answer (`Config.with_run`), which this
        link goes on with too (its heartbeats' period and timeouts stayed its daemon's own
        while the warning below said the job's replaced them); with that warning, of the
        keys its daemon was given that the job's config replaces."""
        cfg = self.cfg.with_run(answer.get("config"))
        who = {"worker": "this worker", "server": "this shard"}.get(self.role, f"the {self.role}")
        said = self.cfg.replaced_by(cfg, who)
        if said:
            log(f"{self.role}-{self.index}", said)
        self.cfg = cfg
        self.period = self._period()
        return cfg

    def _apply_since(self, msg: wire.Message, registrations: int) -> None:
        """Apply a heartbeat's answer unless a registration was answered since it was
        sent: an answer from before a rejoin said `rejoin` still, and undid it."""
        with self._applying:
            if registrations == self._registrations:
                self._apply(msg)

    def _hint(self) -> str:
        keys = (f"; with security.curve, a client whose {self.cfg.security.keys}/server.key is not the "
                f"coordinator's public key (another job's keys) is never answered" if self.cfg.security.curve else "")
        if self.role == "worker":  # the coordinator answers workers once all have registered
            return (f"is it running there? (it answers when all {self.cfg.cluster.workers} workers have "
                    f"registered; its log says how many it has{keys})")
        return f"is it running there, and is that the address it listens on (cluster.host, cluster.port)?{keys}"

    def _apply(self, msg: wire.Message) -> None:
        """Take in the coordinator's view; a view without the live set (the one we have is
        current: `live_id`) keeps the live set we have."""
        live = msg.get("live")
        self.state = {"phase": msg.get("phase", "training"), "done": bool(msg.get("done", False)),
                      "live": self.state["live"] if live is None else {int(k): int(v) for k, v in live.items()},
                      "live_id": msg.get("live_id", "") if live is not None else self.state.get("live_id", ""),
                      "version": int(msg.get("version", -1)), "abort": msg.get("abort", ""),
                      "rejoin": bool(msg.get("rejoin", False)),
                      "live_shards": set(msg.get("live_shards") or ())}  # shards heartbeating to the coordinator

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.role}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        peers: Peers | None = None   # (made in the loop: one that cannot be made now, out of descriptors, is
        last_ok = time.monotonic()   # made at a later beat; made before it, it ended the heartbeats)
        failed = ""   # the last failure logged (one line per kind, not one per beat)
        try:
            while not self._stop.is_set():
                try:
                    if peers is None:
                        peers = Peers(self.ctx, [self.address], self.cfg.security)
                    sent = self._registrations
                    soon = self._soon
                    fields = self._beat() if soon is None else {**soon[1], "age_s": time.monotonic() - soon[0]}
                    self._apply_since(peers.call(0, "heartbeat", beat_answer_s(self.cfg), cancel=self._stop.is_set,
                                                 **fields), sent)   # (stop() ends the wait for its answer)
                    if soon is self._soon:   # (sent: else the next beat sends it, older)
                        self._soon = None
                    last_ok = time.monotonic()
                    self.lost, failed = False, ""   # a coordinator that comes back (restarted) is found again
                except (PeerTimeout, wire.RemoteError) as e:
                    if isinstance(e, wire.RemoteError):   # said once: else the daemon would end "lost the
                        why = f"refused by the coordinator ({e.code}: {e.reason})"   # coordinator", the why unsaid
                        if why != failed:
                            log(f"{self.role}-{self.index}", f"a heartbeat was {why}; heartbeating on")
                            failed = why
                    assert peers is not None   # (its call raised these)
                    try:
                        peers.reconnect(0)
                    except zmq.ZMQError:   # tried again at the next beat (a terminated context ends the loop there)
                        pass
                    except Exception as e:   # (a key file that cannot be read now): the heartbeats go on
                        why = f"reconnecting to the coordinator failed ({type(e).__name__}: {e})"
                        if why != failed:
                            log(f"{self.role}-{self.index}", f"{why}; heartbeating on")
                            failed = why
                except zmq.ContextTerminated:
                    raise
                except Exception as e:
                    # One beat that fails here (counters that cannot be sent, an answer that
                    # cannot be read) must not end the heartbeats: without them the coordinator
                    # drops this daemon and it never hears that the job is done.
                    why = f"{type(e).__name__}: {e}"
                    if why != failed:
                        log(f"{self.role}-{self.index}", f"a heartbeat failed ({why}); heartbeating on")
                        failed = why
                if time.monotonic() - last_ok > self.cfg.cluster.timeout_s:
                    self.lost = True
                self._wake.wait(self.period)
                self._wake.clear()
        except zmq.ContextTerminated:
            pass  # the process is closing its sockets' context (its daemon ended first): so must we
        finally:
            if peers is not None:
                peers.close()

    def _beat(self) -> dict:
        """A heartbeat's fields: who beats (its job's token; its registration's nonce: a
        process whose rank another took over is told so), with its clock and counters now."""
        return {"role": self.role, "index": self.index, "rank": self.rank if self.role == "worker" else -1,
                "nonce": self.nonce, "clock": self.clock_fn(), "stats": self.stats_fn(),
                "live_id": self.state.get("live_id", ""), "job": job_token(), **self.fields_fn()}

    def beat_soon(self) -> None:
        """A heartbeat now from the heartbeat thread, without waiting for it: a worker
        that begins stepping says so (its count then is where the evaluator's scores'
        samples are counted from, `SamplesAt`; the beat before may be a period earlier).
        Its counters are read now, and the beat says how long before its sending
        (`age_s`): a heartbeat thread that came to it after the first steps (a busy
        machine) carried their samples, and a score read before them counted some."""
        self._soon = (time.monotonic(), self._beat())
        self._wake.set()

    def leave(self, reason: str) -> None:
        """A worker process that stops without finishing its share (a shard it cannot
        reach: `ShardUnreachable`) tells the coordinator why, in a heartbeat now with its
        last counters (`leaving`): if the job ends because its workers are gone, the
        coordinator's reason names this one, not only "all workers were lost". Waits
        `beat_answer_s` at most (raises `PeerTimeout`, or `RemoteError` from a coordinator
        that predates the field)."""
        self.call("heartbeat", timeout=beat_answer_s(self.cfg), **self._beat(), leaving=reason[:1000])

    def beat(self, timeout: float | None = None) -> None:
        """A heartbeat now, from the caller's thread (the counters up to this moment);
        `timeout` as `call`'s."""
        sent = self._registrations
        self._apply_since(self.call("heartbeat", timeout=timeout, **self._beat()), sent)

    def call(self, op: str, timeout: float | None = None, **kw: Any) -> wire.Message:
        """A request (finish, eval), with this process's job token, from the caller's
        thread, on one socket kept open for all of them. Unanswered, it is sent again on a fresh connection every
        `REGISTER_RESEND_S` (a restarted coordinator lost it; finish is idempotent)
        until `timeout` (default cluster.timeout_s) runs out: then `PeerTimeout` says
        how long it waited in all, and `unanswered` keeps it until a call is answered."""
        if self._calls is None:
            self._calls = Peers(self.ctx, [self.address], self.cfg.security)
        kw.setdefault("job", job_token())   # (the coordinator takes no other job's: `Coordinator._ours`)
        start = time.monotonic()
        deadline = start + (timeout or self.cfg.cluster.timeout_s)
        while True:
            left = deadline - time.monotonic()
            try:
                answer = self._calls.call(0, op, max(0.01, min(REGISTER_RESEND_S, left)), **kw)
                self.unanswered = ""
                return answer
            except PeerTimeout:
                self._calls.reconnect(0)
                if left <= REGISTER_RESEND_S:
                    e = PeerTimeout(self.address, time.monotonic() - start, op)
                    self.unanswered = str(e)
                    raise e from None

    def close(self) -> None:
        """Stop heartbeating and close the call socket."""
        self.stop()
        if self._calls is not None:
            self._calls.close()
            self._calls = None

    def stop(self) -> None:
        """End the heartbeats: the thread ends within 0.2 s (the answer to a beat in flight
        is not waited for: a shard beats every 0.05 s, so one is mostly in flight)."""
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=5.0)

    @property
    def done(self) -> bool:
        return bool(self.state.get("done"))
