"""One shard's state and mechanism: its slice of every table, the optimizer, the stored
models, the checkpoints. The mode's rule (psgd/consistency/) decides; this carries out.

No sockets here. Each handler takes a validated request (`token` is whatever the daemon
needs to answer it later) and returns the replies to send now, as (token, frames)
pairs: the request's own, unless the rule parks it, and any parked requests that the
event releases. `set_live` does the same for membership changes.

The optimizer is the one the rule names (`ServerRule.server_optimizer`): `[optimizer]`
with its lr schedule, or a mode's outer optimizer (stepped on pseudo-gradients).

A learned model (`layout`: psgd/layout.py) starts with empty tables and serves only
`init` and `stats` until a worker's initial values arrive (`on_init`); other requests
meanwhile get the error `not_ready`.

Tables: `params` (trainable parameters; for easgd the centre x~) and `buffers`
(floating-point buffers such as BatchNorm running statistics), each one flat float32
vector. Frozen parameters and integer buffers are never sent (every party builds them
from the seed).
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
import zipfile
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from . import compression, wire
from . import layout as layouts
from .config import Config
from .consistency import get as get_mode
from .consistency import rule as r
from .data import describe
from .metrics import MAX_CLOCK, output_error, write_file_atomic, written
from .models import build_model
from .optim import lr_at, make_optimizer, set_lr
from .sharding import ShardMap, model_tensors, shard_map

Reply = tuple[Hashable, Any]   # (token, frames; a packet in psgd.sim; a push's fields for `ThenRead`)
MAX_AWAITING_INIT = 4096   # init requests parked before a shard has its values: beyond, refused
FIRST_WORKER_GONE = "worker 0, which brings the initial values, left the job before sending them"
# Requests the rule may park (reads, pushes that read, ltfb's model fetches) are refused
# while this many wait already: at most MAX_PARKED_PER_WORKER per worker, and never fewer
# than MIN_MAX_PARKED (about 45 MB of parked requests). An honest worker has one request
# at a time per shard, plus its resends while it waits (a resend comes over a fresh
# connection, so it is parked beside the first); a flood of reads from a faulty client
# would otherwise grow the shard's memory until the OS kills it.
MAX_PARKED_PER_WORKER = 64
MIN_MAX_PARKED = 65536
READS_KEPT = 4     # a rank's read requests answered since a restart that its pushes may name (`_before_restart`)
ANSWERS_KEPT = 4   # ... and the versions kept of each request's answers (a resent one is answered again, maybe
                   # at a later version, and its worker takes the first that reaches it): the first and the latest


class ThenRead:
    """The token of a push whose request also reads (`pull: true`): one request, one
    reply. The push's answer is not sent; once the push's decisions are carried out the
    shard serves the read of clock + 1 as a pull (which the rule may park), and that
    read's answer carries the push's answer as its field `push`."""

    __slots__ = ("token", "msg")

    def __init__(self, token: Hashable, msg: wire.Message):
        self.token, self.msg = token, msg


class Shard:
    def __init__(self, cfg: Config, index: int, layout: list[list] | None = None,
                 model: torch.nn.Module | None = None):
        """`layout` (psgd/layout.py): a model learned from the workers; its tables start
        empty and the shard serves nothing but `init` until a worker's initial values
        arrive (`ready`). Without it the shard takes its slice of psgd's model: `model`,
        built from the seed already (the simulator builds it once for all its shards), or
        built here."""
        self.cfg = cfg
        self.index = index
        self.world = cfg.cluster.workers
        self.finished = False   # the job ended (the last checkpoint says so: no later job resumes from it)
        # The tables are the job's last: every worker had finished (the coordinator's final
        # phases) when they were checkpointed, so a shard restarted during the final
        # evaluation that restores them has the final model's share (shard_server).
        self.trained = False
        self.unready = ""   # why it has no values, when not for want of a worker's init (not_ready's reason)
        if layout is None:
            if model is None:
                shape, classes = describe(cfg.data)
                model = build_model(cfg.model.name, shape, classes, cfg.job.seed, cfg.model.hidden)
            self.map = ShardMap.for_model(model, cfg.cluster.servers, cfg.placement)
            tensors = model_tensors(model)
            with torch.no_grad():
                self.params = self.map.gather(tensors, index, "params").detach().clone()
                self.buffers = self.map.gather(tensors, index, "buffers").detach().clone()
        else:
            self.map = shard_map(tuple(layouts.entries(layout)), cfg.cluster.servers, cfg.placement)
            self.params = torch.zeros(self.map.size(index, "params"))
            self.buffers = torch.zeros(self.map.size(index, "buffers"))
        self.ready = layout is None       # has initial values (built, from a worker, or restored)
        self.inits_from_any = False       # a restart with nothing to restore: any worker's copy will do
        # init requests parked until the values come, by (sender, request id): a resend is the same request
        self._awaiting_init: dict[tuple[Hashable, int], tuple[Hashable, wire.Message]] = {}
        self.max_parked = max(MIN_MAX_PARKED, MAX_PARKED_PER_WORKER * self.world)
        self.P, self.B = self.params.numel(), self.buffers.numel()
        self.params.grad = None   # where a sum's mean goes (sync's ApplySum): made at the first sum
        self.wire_dtype = cfg.wire.dtype  # params-sized vectors on the wire; the tables stay float32
        self._wire_torch = getattr(torch, self.wire_dtype)
        self.codec = cfg.wire.compression
        converting = self.wire_dtype != "float32" or self.codec != "none"
        self._incoming = torch.empty(self.P if converting else 0)  # a conversion's or decoding's target
        rule = get_mode(cfg.mode.name).rule
        self.opt_cfg = rule.server_optimizer(cfg)  # [optimizer], or the mode's outer optimizer
        self.last_exchange = rule.last_exchange(cfg)   # a push's or an elastic offer's last clock (round)
        self.opt = make_optimizer([self.params], self.opt_cfg)
        self.version = 0             # updates applied to params
        # After a restart (`_restarted`), rank -> its last read requests answered since, by id
        # (READS_KEPT), -> the versions answered (ANSWERS_KEPT): the reads an honest push of
        # this life names; None before. `_restored_at`: the version restored then (-1: nothing
        # was), the history both lives share
        self._life_reads: dict[int, dict[int, list[int]]] | None = None
        self._restored_at = -1
        self._revision = 0           # changes of either table (params or buffers)
        self._shared: tuple[int, list[Any]] = (-1, [])  # the snapshot of one revision
        self._views: list[Any] | None = None   # the tables as numpy arrays, lent (`_table_views`)
        # A daemon that sends every reply as soon as it is made sets `in_flight` (and calls
        # `sent` after each event's replies): its snapshots lend the tables themselves, and
        # the tables move to a copy only if they change while a lent frame is unsent or still
        # being read (`_changing`). Without it (the simulator, tests) a snapshot is a copy.
        self.in_flight: Callable[[], bool] | None = None
        self.busy: Callable[[], float] = lambda: 0.0   # seconds spent serving (the daemon's, or the simulator's)
        self._lent = False            # a reply made since the last change holds the tables themselves
        self._unsent = False          # ... and may not have been handed to the transport yet
        self.counters = {"pushes": 0, "duplicates": 0, "bad_messages": 0, "pulls": 0}  # bad: error replies
        # This shard object's own id, in its answers to `stats` probes: a client whose request
        # is late tells a shard that still holds it (the same id as before the request left)
        # from one restarted since, which lost it (workers/client.py `finish`)
        self.incarnation = os.urandom(8).hex()
        # The job token (`membership.job_token`) of the daemon serving this shard: a request
        # that changes the tables (a push, an offer, a deposit, initial values) from a
        # worker of another job is refused (`_ours`). Empty where the daemons were started
        # by hand, and in the simulator: their workers send none.
        self.job = ""
        self.last_clock: dict[int, int] = {}  # (rank, clock) dedupe of pushes
        self.dropped_at: dict[int, int] = {}  # rank -> the clock of its latest push answered `dropped`
        self.acc: torch.Tensor | None = None   # the open step's gradient and buffer sums
        self.bacc: torch.Tensor | None = None
        # ... or its first contribution, not copied into them (`_accumulate`) while this event lasts,
        # and whether the step closed (`ApplySum`) with it
        self._first: tuple[torch.Tensor, torch.Tensor] | None = None
        self._first_closed = False
        self.models: dict[Hashable, list] = {}  # stored models (deposits) by the rule's key
        self.live = set(range(self.world))
        # rank -> (epoch, version) of the registration its latest join read named (`since`),
        # and that read's clock, until a view of that version or later (`_joined_since`)
        self._joined: dict[int, tuple[str, int, int]] = {}
        self._view: tuple[str, int] | None = None   # (epoch, version) of the latest view `set_live` applied
        self.rule = rule(cfg.mode, self.world, self)
        ruled = {"push": self.on_push, "elastic": self.on_elastic, "put_model": self.on_put_model,
                 "get_model": self.on_get_model, "models": self.on_models}
        until_trained = {"push", "elastic", "put_model"}   # refused once training ended (`_ended`)
        # refused from a worker of another job (`_ours`): the changes of the tables, and the
        # reads, which move the rule's clocks (ssp's finished clocks, sync's step, ltfb's scores)
        ours = until_trained | {"pull", "get_model"}
        served = {"pull": (self.on_pull, False), **{
            op: (fn, op in until_trained) if op in self.rule.serves else (self.not_in_mode, False)
            for op, fn in ruled.items()}}
        self.handlers = {"stats": self.on_stats, "init": self.on_init,
                         **{op: self._when_ready(fn, trained, op in ours) for op, (fn, trained) in served.items()}}
        self._carriers = Carriers({
            r.Apply: self._do_apply, r.Accumulate: self._do_accumulate, r.ApplySum: self._do_apply_sum,
            r.Move: self._do_move, r.MixBuffers: self._do_mix_buffers, r.SetBuffers: self._do_set_buffers,
            r.Answer: self._answer, r.Refuse: self._do_refuse, r.Store: self._do_store, r.Forget: self._do_forget,
            r.AnswerModel: self._do_answer_model})

    # ------------------------------------------------------------ entry points
    def handle(self, token: Hashable, msg: wire.Message) -> list[Reply]:
        """Serve one validated request (the daemon's serve loop dispatches through
        `handlers`; a WireError raised here becomes its error reply)."""
        handler = self.handlers.get(msg.op)
        if handler is None:
            raise wire.WireError(wire.UNKNOWN_OP, f"a shard does not serve {msg.op!r}")
        return handler(token, msg)

    def _when_ready(self, fn, until_trained: bool = False, ours: bool = False):
        """`fn`, served once the shard has values; before, the error `not_ready`, answered
        here, not raised: the daemon counts a raised error in `bad_messages`, and these are
        the honest requests of the job's own workers and evaluator (a learned model before
        its init, a shard restarted with nothing to restore, which a worker's copy mends).
        With `until_trained`, also only until the job's training ended (`_ended`):
        one wrapper, not two, around every push; those and, with `ours`, the others from
        this job's workers only (`_ours`)."""
        if until_trained:
            def guarded(token, msg: wire.Message) -> list[Reply]:
                self._ours(msg)
                if not self.ready:
                    return self._not_ready(token, msg)
                if self.trained:
                    return self._ended(token, msg)
                return fn(token, msg)
            return guarded

        def guarded_ready(token, msg: wire.Message) -> list[Reply]:
            if ours:
                self._ours(msg)
            if not self.ready:
                return self._not_ready(token, msg)
            return fn(token, msg)
        return guarded_ready

    def _ours(self, msg: wire.Message) -> None:
        """Refuse a request that would change the tables, or a read (which moves the rule's
        clocks), from a worker of another job (its job token differs): one still dialing
        this port after its own job ended (its shards gone, this job's on the same port)
        would have its pushes applied to this job's model, as the coordinator took another
        job's scores before it checked their token (`Coordinator._ours`)."""
        if msg.get("job", "") != self.job:
            raise wire.WireError(wire.REFUSED, f"shard {self.index}: this {msg.op} comes from a worker of another "
                                               f"job (PSGD_JOB_TOKEN differs); is another job using this port?")

    def _not_ready(self, token, msg: wire.Message) -> list[Reply]:
        return [(token, wire.error(msg.id, wire.NOT_READY, f"shard {self.index} " + (self.unready or (
            "has no initial values yet (a worker's init brings them)"))))]

    def _ended(self, token, msg: wire.Message) -> list[Reply]:
        """The answer to a push, offer or deposit once the job's training ended (`trained`:
        the coordinator is past it, every worker finished or was lost): the error
        `refused`, answered, not raised (not a bad message). Only a worker the coordinator
        had dropped (stopped, cut off) still sends one then: its push changed the final
        model while the evaluator scored it, and after the end-of-training checkpoint."""
        return [(token, wire.error(msg.id, wire.REFUSED, f"shard {self.index}: the job's training has "
                                                         f"ended (every worker finished or was lost)"))]

    def on_init(self, token, msg: wire.Message) -> list[Reply]:
        """A worker's initial values (arrays: params, buffers), or, with no arrays, a wait
        for them. Rank 0's are taken (any rank's after a restart with nothing restored);
        a ready shard answers at once and keeps what it has. Every waiter is answered
        when the values arrive."""
        self._check_rank(msg)
        self._ours(msg)
        if self.ready:
            return [(token, self._reply(msg, took=False, version=self.version))]
        if not msg.arrays or not (msg.rank == 0 or self.inits_from_any):
            if self._first_worker_gone():
                raise wire.WireError(wire.REFUSED, f"shard {self.index}: {FIRST_WORKER_GONE}")
            # Parked without its arrays (its answer needs only the request's id, rank and clock).
            key = (token, msg.id)
            if key not in self._awaiting_init and len(self._awaiting_init) >= MAX_AWAITING_INIT:
                raise wire.WireError(wire.REFUSED, f"{MAX_AWAITING_INIT} requests wait for the initial values already")
            self._awaiting_init[key] = (token, wire.Message(msg.op, msg.id, msg.rank, msg.clock))
            return []
        self._array_count(msg, 2)
        wire.expect_array(msg, 0, "float32", (self.P,))
        wire.expect_array(msg, 1, "float32", (self.B,))
        # (buffers too, as a push's: a restarted shard takes any worker's copy, and NaN statistics
        # would be served to every worker)
        p, b = (self._finite(wire.tensor(msg, 0), "initial values", msg.clock),
                self._finite(wire.tensor(msg, 1), "initial buffers", msg.clock))
        with torch.no_grad():
            self._changing()
            self.params.copy_(p)
            self.buffers.copy_(b)
        self.ready = True
        waiting, self._awaiting_init = self._awaiting_init, {}
        return [(token, self._reply(msg, took=True, version=self.version))] + [
            (t, self._reply(m, took=False, version=self.version)) for t, m in waiting.values()]

    def not_in_mode(self, token, msg: wire.Message) -> list[Reply]:
        raise wire.WireError(wire.REFUSED, f"{msg.op} is not used in mode {self.rule.name}")

    def set_live(self, live: dict[int, int], live_id: str = "") -> list[Reply]:
        """Membership changed (rank -> clock of every live worker), as the coordinator's
        view `live_id` says (`Coordinator._view`; '' where none names it: the simulator).
        A rank that comes back keeps its last clock (`on_push`'s duplicates): the shard
        hears of the return from its heartbeats, up to a beat late, maybe after the
        returning worker's pushes were answered, and forgotten then, a resend of one was
        applied again. Its new pushes need nothing forgotten: its join's answer puts it
        past its rank's clocks (`finished`; in sync and diloco the open step, which may
        hold its earlier life's push: the new one is answered `duplicate`, another
        process's, not applied). A view older than a rank's (re)registration does not
        remove it (`_joined_since`)."""
        if live_id:
            self._view = registration(live_id)
        if self._joined:
            live = self._joined_since(live, live_id)
        self.live = set(live)
        refused: list[Reply] = []
        if self._first_worker_gone():   # nothing will answer the waits for the initial values
            waiting, self._awaiting_init = self._awaiting_init, {}
            refused = [(t, wire.error(m.id, wire.REFUSED, f"shard {self.index}: {FIRST_WORKER_GONE}"))
                       for t, m in waiting.values()]
        return refused + self.carry_out(self.rule.membership(live))

    def _joined_since(self, live: dict[int, int], live_id: str) -> dict[int, int]:
        """`live`, with the ranks whose join read came from a registration the view
        predates: a view of the same coordinator's life and an older version. The
        heartbeat answer that the shard's loop applies may have been made before a
        worker's (re)registration and applied after its join read: missing from it, the
        rank was removed again (ssp answered reads past it and dropped its next push as
        one from before leaving; async easgd took a later restart of its process for a
        new life, whose offers moved the centre twice). Kept at its join read's clock.
        A view of that version or later settles it (the rank is forgotten here: a removal
        is real from then on); one of another life (a coordinator restarted) is taken as
        it is, so a rank that left is never kept for good."""
        view = registration(live_id)
        if view is None:
            return live
        kept = dict(live)
        for rank, (epoch, version, clock) in list(self._joined.items()):
            if epoch != view[0]:
                continue
            if view[1] >= version:
                del self._joined[rank]
            elif rank not in kept:
                kept[rank] = clock
        return kept

    def _first_worker_gone(self) -> bool:
        """No initial values, and none to come: worker 0 brings them (any worker's are
        taken only after a restart with nothing restored) and has left the live set."""
        return not self.ready and not self.inits_from_any and 0 not in self.live

    # ------------------------------------------------------------ requests
    def _check_rank(self, msg: wire.Message) -> None:
        if not 0 <= msg.rank < self.world:
            raise wire.WireError(wire.REFUSED, f"rank {msg.rank} is not in 0..{self.world - 1}")

    def _check_asker(self, msg: wire.Message) -> None:
        """A request that anyone may send (a read, a model fetch): a worker's rank must be
        the job's (-1: the evaluator or another reader that is none)."""
        if msg.rank >= 0:
            self._check_rank(msg)

    @staticmethod
    def _array_count(msg: wire.Message, n: int) -> None:
        """A request of `n` arrays (a push, an offer, initial values) with more is refused:
        no worker sends one, and the rest was ignored, the request applied."""
        if len(msg.arrays) > n:
            raise wire.WireError(wire.BAD_SHAPE, f"op {msg.op!r} carries {n} arrays, got {len(msg.arrays)}")

    def _vectors(self, msg: wire.Message, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's params-sized vector (in `wire.dtype`, as float32) and buffers."""
        self._array_count(msg, 2)
        wire.expect_array(msg, 0, self.wire_dtype, (self.P,))
        wire.expect_array(msg, 1, "float32", (self.B,))
        v = wire.tensor(msg, 0)
        if self.wire_dtype != "float32":  # into float32, for the float32 master weights
            v = self._incoming.copy_(v)
        if not self.B:   # (a model without buffers: its empty array, checked above, is not made a tensor)
            return self._finite(v, what, msg.clock), self.buffers
        return self._finite(v, what, msg.clock), self._finite(wire.tensor(msg, 1), f"{what}'s buffers", msg.clock)

    def _gradient(self, msg: wire.Message) -> tuple[torch.Tensor, torch.Tensor]:
        """A compressed push (`wire.compression`), decoded into a dense float32 vector."""
        if msg.get("codec") != self.codec:
            raise wire.WireError(wire.BAD_FIELD, f"push codec {msg.get('codec')!r}, this job uses {self.codec!r}")
        (dt0, n0), (dt1, n1) = compression.shapes(self.codec, self.P, self.cfg.wire.topk_fraction)
        self._array_count(msg, 3)
        wire.expect_array(msg, 0, dt0, (n0,))
        wire.expect_array(msg, 1, "float32", (self.B,))
        wire.expect_array(msg, 2, dt1, (n1,))
        first, last = wire.tensor(msg, 0), wire.tensor(msg, 2)
        if self.codec == "topk" and last.numel() and not (int(last.min()) >= 0 and int(last.max()) < self.P):
            raise wire.WireError(wire.BAD_FIELD, f"topk indices must be in 0..{self.P - 1}")
        if self.codec == "topk" and last.unique().numel() != last.numel():   # all but one value would be lost
            raise wire.WireError(wire.BAD_FIELD, "topk indices must be distinct")
        g = compression.decode(self.codec, first, last, self.P, out=self._incoming)
        return self._finite(g, "gradient", msg.clock), self._finite(wire.tensor(msg, 1), "buffers", msg.clock)

    @staticmethod
    def _finite(v: torch.Tensor, what: str, clock: int) -> torch.Tensor:
        if not wire.finite(v):
            raise wire.WireError(wire.REFUSED, f"{what} has NaN or Inf values at step {clock}; lower optimizer.lr")
        return v

    def _room_to_park(self) -> None:
        """Refuse a request that the rule may park while `max_parked` wait already."""
        if self.rule.parked() >= self.max_parked:
            raise wire.WireError(wire.REFUSED, f"{self.max_parked} requests wait at shard {self.index} already; "
                                               f"a client sends requests faster than they are answered")

    def on_pull(self, token, msg: wire.Message) -> list[Reply]:
        self._room_to_park()
        if "since" in msg.fields:   # (only a join read names one: the other reads pay no more than this)
            return self._serve_join(token, msg)
        return self._serve_read(token, msg)

    def _serve_join(self, token, msg: wire.Message) -> list[Reply]:
        """A join read that names its worker's registration (`since`: its live_id, which
        the coordinator's answer to the registration carried): the rank is kept live
        against the views older than it (`_joined_since`). A later join of the rank's
        replaces it, unless of an older registration of the same life (a copy of an
        earlier process's join read, come late). An older worker's join read has none.
        One that a later view (of the same life) has seen leave since (the read came late:
        the shard stalled, or the worker was dropped at once) is served as a plain read,
        the rank not counted: joined, a worker that had died held every read more than s
        ahead of its clock in ssp, for good."""
        since = registration(msg.fields["since"])
        if since is None:
            raise wire.WireError(wire.BAD_FIELD, f"since {msg.get('since')!r} is no coordinator's live_id "
                                                 f"(epoch:version)")
        view = self._view
        if view is not None and view[0] == since[0] and view[1] > since[1] and msg.rank not in self.live:
            plain = {k: v for k, v in msg.fields.items() if k != "join"}
            return self._serve_read(token, dataclasses.replace(msg, fields=plain))
        out = self._serve_read(token, msg)
        held = self._joined.get(msg.rank)
        if msg.get("join") and msg.rank >= 0 and not (held and held[0] == since[0] and held[1] > since[1]):
            self._joined[msg.rank] = (*since, msg.clock)
        return out

    def _serve_read(self, token, msg: wire.Message) -> list[Reply]:
        """Serve a read (a pull, or the read that follows a push, `ThenRead`)."""
        self._check_asker(msg)
        self._within_job("clock", msg.clock, self.cfg.train.steps + 1)   # a push's read is of the clock after it
        return self._serve_checked(token, msg)

    def _serve_checked(self, token, msg: wire.Message) -> list[Reply]:
        """Serve a read whose rank and clock are checked (a push's: `_acknowledged`)."""
        self.counters["pulls"] += 1
        join = bool(msg.fields.get("join"))
        return self.carry_out(self.rule.read(r.Read((token, msg), msg.rank, msg.clock, join)))

    def on_push(self, token, msg: wire.Message) -> list[Reply]:
        self._check_rank(msg)
        fields = msg.fields   # (`msg.get`, without a call per field: every push of every worker)
        read_version = int(msg.get("read_version"))
        self._check_push(msg, read_version)
        if self.codec == "none" and fields.get("codec", "none") != "none":   # (a compressed job's: `_gradient`)
            raise wire.WireError(wire.BAD_FIELD, f"push codec {msg.get('codec')!r}, this job uses 'none'")
        g, b = self._gradient(msg) if self.codec != "none" else self._vectors(msg, "gradient")
        if fields.get("pull"):
            self._room_to_park()
            token = ThenRead(token, msg)
        if msg.clock <= self.last_clock.get(msg.rank, -1):
            self.counters["duplicates"] += 1
            # (a resend of a push dropped as late says so again: answered only `duplicate`, its
            # worker counted it as applied, and the worker's and the shard's summaries disagreed)
            again = {"duplicate": True, "staleness": 0, **({"dropped": True} if self.dropped_at.get(msg.rank)
                                                           == msg.clock else {})}
            return self.carry_out([r.Answer((token, msg), again)])
        tau = self.version - read_version
        mine = (token, msg)
        decisions = self.rule.push(r.Push(mine, msg.rank, msg.clock, max(0, tau), g, b,
                                          tau < 0 or self._before_restart(msg.rank, read_version)))
        if not refuses(decisions, mine):
            self.last_clock[msg.rank] = msg.clock  # a refused push may come again
            self.counters["pushes"] += 1
        return self.carry_out(decisions)

    def _before_restart(self, rank: int, read_version: int) -> bool:
        """Was the read a push names answered before this shard restarted, past the version
        it restored (`Push.before_restart`)? A read up to that version is of the history the
        checkpoint holds, and tau counts what its gradient lacks, as before any restart. The
        restored shard's versions go on from its checkpoint's, so a read made later, before
        the restart, may name a version this life reached too (a resend that comes once the
        others' pushes have moved it there): a push of this life names one of its rank's
        reads answered since (`_life_reads`: its latest, or the one before with prefetch)."""
        return (self._life_reads is not None and read_version > self._restored_at
                and not any(read_version in v for v in self._life_reads.get(rank, {}).values()))

    def _read_since_restart(self, rank: int, rid: int) -> None:
        """Record a read answered to `rank` since the restart (`_life_reads`): by its request
        id, so that a resend's answers do not push out the reads its pushes name."""
        reads = self._life_reads.setdefault(rank, {})   # type: ignore[union-attr]
        versions = reads.pop(rid, []) + [self.version]   # (moved to the end: the latest request)
        reads[rid] = versions if len(versions) <= ANSWERS_KEPT else versions[:1] + versions[1 - ANSWERS_KEPT:]
        while len(reads) > READS_KEPT:
            del reads[next(iter(reads))]

    def _check_push(self, msg: wire.Message, read_version: int) -> None:
        """A push's read_version and clock, before anything is counted. A read_version
        is a version this shard answered, so never negative (tau would be up to 2**63,
        past what the counters can carry); one past the current version is not refused:
        a shard restored from an older checkpoint is behind its workers' reads (tau is 0,
        and the rule is told: `Push.before_restart`).
        A clock past the job's last push (`last_exchange`: its last step, or diloco's
        last round) is never an honest push's (a worker stops there; a late or rejoining
        one catches up to clocks the others reached) and would mark every later push of
        the rank a duplicate. A job with no step limit has only MAX_CLOCK: clocks jump on a
        catch-up, a rejoin, or a restore from an older checkpoint."""
        if read_version < 0:
            raise wire.WireError(wire.BAD_FIELD, f"read_version {msg.get('read_version')} is negative")
        self._within_job("clock", msg.clock, self.last_exchange)

    def _within_job(self, what: str, value: int, last: int, *allowed: int) -> None:
        """A clock or round (either sign) past `last`, which no honest request of a job of
        `train.steps` steps carries, other than `allowed`: refused. Kept, it would stay in
        the rule's state (a barrier moved past every honest step, a rank's last clock or
        round, a tournament round) for good. Without a step limit, one past MAX_CLOCK."""
        if value in allowed:
            return
        steps = self.cfg.train.steps
        if steps and abs(value) > last:
            raise wire.WireError(wire.REFUSED, f"{what} {value} is past the job's last step "
                                               f"(train.steps = {steps}: {what} {last} at most)")
        if abs(value) > MAX_CLOCK:
            raise wire.WireError(wire.REFUSED, f"{what} {value} is past any worker's: {MAX_CLOCK:,} at most "
                                               f"(train.steps = {steps})")

    def on_elastic(self, token, msg: wire.Message) -> list[Reply]:
        self._check_rank(msg)
        self._within_job("round", int(msg.get("round")), self.last_exchange)
        x, b = self._vectors(msg, "replica")
        offer = r.ElasticOffer((token, msg), msg.rank, int(msg.get("round")), x, b)
        # (before, counted in pushes before the rule's verdict: every resend too, as a push's is not)
        self.counters["duplicates" if self.rule.resent(offer) else "pushes"] += 1
        return self.carry_out(self.rule.elastic(offer))

    def on_put_model(self, token, msg: wire.Message) -> list[Reply]:
        """A deposited model (ltfb): float32 whatever `wire.dtype` (its weights, buffers
        and optimizer state), kept as it came and handed out as it is."""
        self._check_rank(msg)
        wire.expect_array(msg, 0, "float32", (self.P,))
        wire.expect_array(msg, 1, "float32", (self.B,))
        self._finite(wire.tensor(msg, 0), "model", msg.clock)
        self._finite(wire.tensor(msg, 1), "model's buffers", msg.clock)
        for i in range(2, len(msg.arrays)):  # the optimizer's state
            wire.expect_array(msg, i, "float32", (self.P,))
        self._within_job("round", int(msg.get("round")), self.cfg.train.steps + 1, r.FINAL_ROUND)
        # (the last array of an outcome, round < 0, or of any deposit with `mode.explore`: values as bit
        # patterns, `ltfb.pack_meta`; the others a NaN moment of which would be its adopters' and their steps')
        meta = int(int(msg.get("round")) < 0 or bool(self.cfg.mode.explore))
        for i in range(2, len(msg.arrays) - meta):
            self._finite(wire.tensor(msg, i), f"optimizer state {i - 2}", msg.clock)
        score = self._score(msg)
        arrays = [wire.tensor(msg, i).clone() for i in range(len(msg.arrays))]
        return self.carry_out(self.rule.deposit(   # (its tag names this deposit; the wire checked it an int)
            r.Deposit((token, msg), msg.rank, int(msg.get("round")), score, arrays, msg.get("tag"))))

    @staticmethod
    def _score(msg: wire.Message) -> float:
        """A request's tournament score (a deposit's, or the one a fetch of the scores puts
        on the board), refused if NaN or +inf: either would win or spoil every comparison."""
        score = float(msg.get("score"))
        if score != score or score == float("inf"):   # -inf is a score: a trainer that has none yet
            raise wire.WireError(wire.BAD_FIELD, f"score {score} is not a score (NaN or +inf)")
        return score

    def on_get_model(self, token, msg: wire.Message) -> list[Reply]:
        """A fetch of a trainer's model, or of a round's scores (which puts the asker's own
        score on the board: its rank must be the job's, its score a score: a NaN one froze
        a round's board with NaN for every trainer, the honest scores coming too late)."""
        self._check_asker(msg)
        self._within_job("round", int(msg.get("round")), self.cfg.train.steps + 1, r.FINAL_ROUND)
        score = None if msg.get("score") is None else self._score(msg)
        self._room_to_park()
        return self.carry_out(self.rule.fetch(
            r.Fetch((token, msg), int(msg.get("owner")), int(msg.get("round")), bool(msg.get("exact")), msg.rank,
                    score)))

    def on_models(self, token, msg: wire.Message) -> list[Reply]:
        return self.carry_out(self.rule.index((token, msg)))

    def on_stats(self, token, msg: wire.Message) -> list[Reply]:
        return [(token, self._reply(msg, **self.stats(), incarnation=self.incarnation))]

    # ------------------------------------------------------------ carrying out decisions
    def carry_out(self, decisions: list[r.Decision]) -> list[Reply]:
        """Carry out a rule's decisions in order; the replies they make."""
        out: list[Reply] = []
        reads: list[Reply] = []
        carriers = self._carriers
        try:
            for d in decisions:
                reply = carriers[type(d)](d)
                if reply is not None:
                    (reads if type(reply[0]) is ThenRead else out).append(reply)
        finally:   # (a decision that raised too: the frames of a held first gradient do not outlive the event)
            if self._first is not None:
                self._end_first()
        return out + self._acknowledged(reads) if reads else out

    def _acknowledged(self, pushes: list[Reply]) -> list[Reply]:
        """Serve the reads that follow these answered pushes (`ThenRead`), in order, now
        that every decision of the event that answered them is carried out."""
        out: list[Reply] = []
        for then, fields in pushes:
            assert isinstance(then, ThenRead)
            push = then.msg
            read = wire.Message("pull", id=push.id, rank=push.rank, clock=push.clock + 1, fields={"push": fields})
            out += self._serve_checked(then.token, read)
        return out

    def _do_apply(self, d: r.Apply) -> None:
        self._changing()
        self._step(d.grad, d.lr_scale, d.progress)

    def _do_accumulate(self, d: r.Accumulate) -> None:
        self._accumulate(d.grad, d.buffers, d.first)

    def _do_apply_sum(self, d: r.ApplySum) -> None:
        self._changing()
        summed = self.summed()[0]
        self._first_closed = self._first is not None
        if d.count == 1:   # the mean of one is itself (x / 1 is x): stepped where it lies
            self._step(summed, 1.0, d.progress)
            return
        if self.params.grad is None:   # the mean, written where the optimizer reads it: a table
            self.params.grad = torch.empty_like(self.params)   # only the modes that sum need
        self._step(torch.div(summed, d.count, out=self.params.grad), 1.0, d.progress)

    def _do_move(self, d: r.Move) -> None:
        self._changing()
        with torch.no_grad():
            self.params.add_(d.delta)
        self.version += 1

    def _do_mix_buffers(self, d: r.MixBuffers) -> None:
        if self.B:   # (no buffers: nothing changes)
            self._changing()
            self.buffers.add_(d.values - self.buffers, alpha=d.weight)

    def _do_set_buffers(self, d: r.SetBuffers) -> None:
        if not self.B:   # (no buffers: nothing changes)
            return
        self._changing()
        values = self.summed()[1] if d.values is None else d.values
        self.buffers.copy_(values)
        if d.count != 1:   # (x / 1 is x)
            self.buffers.div_(d.count)

    def _do_refuse(self, d: r.Refuse) -> Reply:
        if d.bad:
            self.counters["bad_messages"] += 1
        token, msg = d.token
        if type(token) is ThenRead:  # a refused push is the request's answer: no read follows
            token = token.token
        return token, wire.error(msg.id, d.code, d.reason)

    def _do_store(self, d: r.Store) -> None:
        self.models[d.key] = d.arrays
        self.version += 1

    def _do_forget(self, d: r.Forget) -> None:
        for k in d.keys:
            self.models.pop(k, None)

    def _do_answer_model(self, d: r.AnswerModel) -> Reply:
        token, msg = d.token
        return token, self._reply(msg, self.models[d.key], **d.fields)

    def _answer(self, d: r.Answer) -> Reply:
        token, msg = d.token
        if d.fields.get("dropped") is True and msg.op == "push":   # (its resend is answered so: `on_push`)
            self.dropped_at[msg.rank] = msg.clock
        if type(token) is ThenRead:  # a push whose read follows: `carry_out` serves it
            return token, {**d.fields, "version": self.version}
        try:
            if d.snapshot and msg.rank < 0 and self.wire_dtype != "float32":
                # the evaluator's read: it scores the float32 master weights the shard holds
                # (a model beyond float16's range too), not their rounded copy on the wire
                arrays = [self.params.detach().clone(), self.buffers.clone()]
            elif d.snapshot:
                arrays = self._snapshot()
                if self._life_reads is not None and msg.rank >= 0:
                    self._read_since_restart(msg.rank, msg.id)
            else:
                # the params-sized first array in wire.dtype; buffers travel as float32
                arrays = [self.buffers.clone() if a is r.BUFFERS else self._on_wire(a) if k == 0 else a
                          for k, a in enumerate(d.arrays)]
        except wire.WireError as e:   # (float16 cannot carry the tables: `_on_wire`)
            return token, wire.error(msg.id, e.code, e.reason)
        fields = {"version": self.version, **d.fields}   # (a dict made once: `_reply_with`)
        if "push" in msg.fields:  # the read of a push's request carries the push's answer
            fields["push"] = msg.fields["push"]
        return token, self._reply_with(msg, arrays, fields)

    def _reply(self, req: wire.Message, arrays: Sequence[Any] = (), **fields: Any) -> Any:
        """The reply to `req` (frames: `wire.reply`); every reply of the shard but the
        error replies is made here (psgd.sim's shard makes in-process messages instead)."""
        return self._reply_with(req, arrays, fields)

    def _reply_with(self, req: wire.Message, arrays: Sequence[Any], fields: dict) -> Any:
        """`_reply` with its fields as a dict, the caller's own (a read's answer, made for
        every read, is not spread into keywords and collected again)."""
        return wire.reply_with(req, arrays, fields)

    def _snapshot(self) -> list[Any]:
        """The tables as they are now, shared by every reply until they change: frames are
        sent without copying, after this returns, so a reply must not share memory that
        the next update changes. One copy per revision serves all readers; under a daemon
        that says when its frames are read (`in_flight`) no copy at all, but the tables
        themselves, lent until they change (`_changing`)."""
        if self._shared[0] != self._revision:
            if self.in_flight is not None and self.wire_dtype == "float32":
                self._shared = (self._revision, self._table_views())
                self._lent = True
            else:
                self._shared = (self._revision, [self._on_wire(self.params.detach(), copy=True),
                                                self.buffers.clone()])
        if self._lent:
            self._unsent = True
        return self._shared[1]

    def _table_views(self) -> list[Any]:
        """The tables as numpy arrays over their memory, as the wire sends a tensor (its
        `.numpy()`: the same frames), made once, not for every read (two `.numpy()` calls,
        each an op). `_changing` drops them when it moves the tables to a copy: the lent
        arrays keep the memory they were made over, and the reply its values."""
        if self._views is None:
            self._views = [self.params.detach().numpy(), self.buffers.numpy()]
        return self._views

    def _on_wire(self, t: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """A params-sized float32 vector in `wire.dtype` (itself if that is float32 and
        not `copy`). float16 carries values up to 65504, bfloat16 up to 3.39e38 (a little
        below float32's): one beyond it would reach the reader as Inf (its next gradient
        NaN, refused as if the learning rate were the cause), so the read is refused,
        naming why."""
        out = t.to(self._wire_torch, copy=copy)
        if self.wire_dtype != "float32" and not wire.finite(out):
            if not wire.finite(t):   # (not a range the wire cannot carry: a narrower dtype would not help)
                raise wire.WireError(wire.REFUSED, f"shard {self.index}'s parameters have NaN or Inf values at "
                                                   f"version {self.version}")
            limit = torch.finfo(self._wire_torch).max
            raise wire.WireError(wire.REFUSED, f"shard {self.index}'s parameters have values beyond "
                                               f"{self.wire_dtype}'s range ({limit:.6g}) at version {self.version}: "
                                               f"set wire.dtype = {wire.wider_than(self.wire_dtype)}")
        return out

    def sent(self) -> None:
        """The daemon has handed this event's replies to the transport."""
        self._unsent = False

    def _changing(self) -> None:
        """The tables are about to change. If replies lent them (`_snapshot`) and one of
        those is not yet sent or still being read, the tables move to a copy of themselves
        first, so that those replies keep the values they were made with."""
        self._revision += 1
        if self._lent:
            self._lent = False
            if self._unsent or (self.in_flight is not None and self.in_flight()):
                with torch.no_grad():
                    self.params.data = self.params.data.clone()
                    self.buffers.data = self.buffers.data.clone()
                self._views = None
                self._unsent = False

    def _accumulate(self, g: torch.Tensor, b: torch.Tensor, first: bool) -> None:
        """Add a contribution to the open step's sums. The first is held as it is (a
        request's frames), not copied: a step that closes in the same event with it
        alone (one worker: `_do_apply_sum` steps on it where it lies) costs no copy, and
        a second is added to it straight into the sums (one op: the same float sums as
        a copy and an add). A step still open when the event ends copies it then
        (`carry_out`: the frames, or the shard's conversion buffer, do not outlive it)."""
        if first:
            self._first, self._first_closed = (g, b), False
            return
        acc, bacc = self._sums()
        if self._first is not None:
            g0, b0 = self._first
            self._first = None
            torch.add(g0, g, out=acc)
            if self.B:
                torch.add(b0, b, out=bacc)
        else:
            acc.add_(g)
            if self.B:
                bacc.add_(b)

    def _sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.acc is None or self.bacc is None:
            self.acc, self.bacc = torch.empty(self.P), torch.empty(self.B)
        return self.acc, self.bacc

    def _end_first(self) -> None:
        """The event ends with a first contribution held (`_accumulate`): dropped if its
        step closed with it, else copied into the sums (the step stays open)."""
        assert self._first is not None
        (g, b), self._first = self._first, None
        if self._first_closed:
            return
        acc, bacc = self._sums()
        acc.copy_(g)
        if self.B:
            bacc.copy_(b)

    def summed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The open step's sums of gradients and of buffers (read-only)."""
        if self._first is not None:
            return self._first
        assert self.acc is not None and self.bacc is not None, "a sum read before any Accumulate"
        return self.acc, self.bacc

    def worker_lr(self, clock: int) -> float:
        """The rate at which a worker steps its own copy by its gradient at `clock`
        (`pushpull.own_update`: lr / W at that clock of `[optimizer]`'s schedule)."""
        return lr_at(self.cfg.optimizer, clock, self.cfg.train.steps) / self.world

    def _step(self, g: torch.Tensor, scale: float, progress: float) -> None:
        set_lr(self.opt, scale * lr_at(self.opt_cfg, progress, self.cfg.train.steps))
        own = self.params.grad
        if g is own:   # (ApplySum's mean is written there)
            self.opt.step()
        else:
            self.params.grad = g  # read where it lies (a request's frame, ApplySum's mean): no copy
            try:
                self.opt.step()
            finally:
                self.params.grad = own
        self.version += 1

    # ------------------------------------------------------------ stats, checkpoints
    def stats(self) -> dict:
        """Its counters, as its heartbeats carry them; `values`: the model's values it holds (0:
        none, which the coordinator warns of)."""
        return {**self.counters, "version": self.version, "step": 0, "busy_s": written(self.busy()),
                "values": self.P + self.B, **self.rule.stats()}

    def state_dict(self) -> dict:
        # A push that waits for a later step is in last_clock but in no sum: restored, the
        # shard takes it again when its worker resends it (the worker got no answer).
        waiting = self.rule.waiting_pushes()
        last_clock = {r: min(c, waiting[r] - 1) if r in waiting else c for r, c in self.last_clock.items()}
        return {"params": self.params.detach().clone(), "buffers": self.buffers.clone(),
                "opt": copied(self.opt.state_dict()), "version": self.version, "rule": self.rule.state_dict(),
                "last_clock": last_clock, "counters": dict(self.counters), "shard": self.index,
                "sizes": [self.P, self.B], "map": self.map.digest,
                # the open step's sums: its pushes are in last_clock, so they are not sent again
                "acc": None if self.acc is None else self.acc.clone(),
                "bacc": None if self.bacc is None else self.bacc.clone(),
                # the stored models (ltfb's deposits), which the rule's state names by key;
                # not copied: a stored model's arrays are never modified, only replaced
                "models": {k: list(arrays) for k, arrays in self.models.items()},
                "training": training_config(self.cfg), "finished": self.finished, "trained": self.trained,
                "busy_s": self.busy()}

    def resume(self, path: str) -> str:
        """Load the checkpoint at `path` if this shard may resume from it; '' if it did,
        else why not: it cannot be read, it is of a job that finished, of another training
        configuration, or of another shard."""
        try:
            sd = torch.load(path, weights_only=True)
        except Exception as e:  # unreadable, or not a checkpoint
            return f"it cannot be read ({type(e).__name__}: {e})"
        why = why_not_resume(sd, self.cfg, self.index)
        if why:
            return why
        other = self._other_shard(sd)
        if other:
            return f"it is {other}"
        self.load_state_dict(sd)
        return ""

    def restarted_empty(self) -> None:
        """Restarted during a run with nothing to restore: its tables as built (psgd's own
        model, from the seed) or zeros (a learned one) are not where the job is, so it takes
        any worker's current copy (`on_init`), and its rule knows nothing of the run before
        (`ServerRule.restarted`)."""
        self.ready, self.inits_from_any = False, True
        self._restarted(-1)

    def _restarted(self, restored_at: int) -> None:
        """From a checkpoint of version `restored_at`, or with nothing to restore (-1): what
        the rule does not checkpoint is unknown (`ServerRule.restarted`), and so is which
        reads its workers' pushes in flight were computed on (`_before_restart`)."""
        self.rule.restarted()
        self._life_reads, self._restored_at = {}, restored_at

    def new_run(self) -> None:
        """A new run of the job resumed from its checkpoints (not a shard restarted during
        a run): the run's counters (bad messages, pushes, pulls; the rule's dropped
        gradients, clock gap, staleness) start at zero, as its workers' and coordinator's
        do: summary.json is the run's. A shard restarted during a run keeps them, since
        the coordinator takes a shard's latest counters as the run's. (In place: the
        serve loop counts bad messages into the same dict.)"""
        for k in self.counters:
            self.counters[k] = 0
        self.trained = False   # the new run's end is yet to come (a run of train.seconds trains on)
        self.rule.new_run()

    def _other_shard(self, sd: dict) -> str:
        """'' if the checkpoint `sd` is this shard's (its index and table sizes), else whose."""
        if list(sd["sizes"]) != [self.P, self.B] or sd["shard"] != self.index:
            return f"for shard {sd['shard']} with sizes {sd['sizes']}, not shard {self.index} with {[self.P, self.B]}"
        return ""

    def load_state_dict(self, sd: dict) -> None:
        other = self._other_shard(sd)
        if other:
            raise ValueError(f"checkpoint is {other}")
        self._changing()
        with torch.no_grad():
            self.params.copy_(sd["params"])
            self.buffers.copy_(sd["buffers"])
        self.opt.load_state_dict(sd["opt"])
        self.version = int(sd["version"])
        self.rule.load_state_dict(sd["rule"])
        self._restarted(self.version)
        self.last_clock = {int(k): int(v) for k, v in sd["last_clock"].items()}
        self.counters.update(sd["counters"])
        busy = float(sd.get("busy_s", 0.0))   # (older checkpoints: none) a restarted shard's serving goes on from it
        self.busy = lambda: busy
        self._first = None
        if sd.get("acc") is not None:
            self.acc, self.bacc = sd["acc"].clone(), sd["bacc"].clone()
        self.models = {k: list(arrays) for k, arrays in sd.get("models", {}).items()}  # older: none kept
        self.trained = bool(sd.get("trained"))   # older checkpoints do not say: not the final tables
        self.ready = True

    def save(self, path: str) -> None:
        write_checkpoint(self.state_dict(), path)

    def load(self, path: str) -> None:
        self.load_state_dict(torch.load(path, weights_only=True))


class Carriers(dict):
    """Decision type -> the shard's method that carries it out (one per type in
    `r.Decision`): a dict lookup per decision instead of a chain of isinstance. A
    subclass of a listed type is found through its bases on first use, then kept."""

    def __missing__(self, kind: type) -> Callable[[Any], Reply | None]:
        base = next((b for b in kind.__mro__ if b in self), None)
        if base is None:
            raise TypeError(f"unknown decision type {kind.__name__}")
        self[kind] = self[base]
        return self[kind]


def refuses(decisions: list[r.Decision], token: Any) -> bool:
    """Is the request `token` refused by one of `decisions`? (A loop, not `any` over a
    generator: asked for every push.)"""
    for d in decisions:
        if isinstance(d, r.Refuse) and d.token is token:
            return True
    return False


# Keys of those sections added since checkpoints were first written, with their defaults: left
# out at the default, a checkpoint written before a key was added still resumes (its job ran so)
LATER_KEYS = {("wire", "overlap"): False}


def training_config(cfg: Config) -> str:
    """What a checkpoint's state means only under: the sections that define the training
    (not its budget, addresses, timeouts or evaluation), and the worker and shard counts."""
    d = cfg.to_dict()
    kept = {k: d[k] for k in ("job", "model", "data", "mode", "optimizer", "wire")}
    for (section, key), default in LATER_KEYS.items():
        if kept[section].get(key) == default:
            del kept[section][key]
    return _data_path_absolute(json.dumps({**kept, "workers": cfg.cluster.workers, "servers": cfg.cluster.servers},
                                          sort_keys=True))


def _data_path_absolute(training: Any) -> Any:
    """A `training_config` with its data.path absolute (a relative one: from this
    process's folder). psgd run makes the job's folders absolute (`config.anchored`); a
    checkpoint of a job run before that, or of a daemon given a relative one, names it
    relative: the same folder, not another training configuration."""
    try:
        d = json.loads(training)
        path = d["data"]["path"]
    except (TypeError, ValueError, KeyError):
        return training
    if not path or os.path.isabs(path):
        return training
    d["data"]["path"] = os.path.abspath(path)
    return json.dumps(d, sort_keys=True)


CLUSTER_KEYS = {"workers": "cluster.workers", "servers": "cluster.servers"}   # training_config's names


def config_changes(was: Any, now: str, most: int = 4) -> list[str]:
    """The keys in which two `training_config`s differ, each as 'optimizer.lr 0.1 → 0.05'
    (the first `most`, then how many more); [] when `was` cannot be read as one."""
    try:
        a, b = json.loads(was), json.loads(now)
    except (TypeError, ValueError):
        return []
    out: list[str] = []

    def walk(x: Any, y: Any, key: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                walk(x.get(k), y.get(k), f"{key}.{k}" if key else k)
        elif x != y:
            out.append(f"{CLUSTER_KEYS.get(key, key)} {json.dumps(x)[:40]} → {json.dumps(y)[:40]}")
    walk(a, b, "")
    return out[:most] + ([f"{len(out) - most} more"] if len(out) > most else [])


def why_not_resume(sd: dict, cfg: Config, index: int) -> str:
    """'' if shard `index` of a job of `cfg` may resume from a checkpoint's state `sd`
    (its table sizes aside, which its shard checks), else why not."""
    mine = training_config(cfg)
    if sd.get("finished"):
        return "its job finished"
    if _data_path_absolute(sd.get("training", mine)) != mine:   # older checkpoints do not say
        changed = config_changes(_data_path_absolute(sd["training"]), mine)
        return "it is of another training configuration (" + (
            ", ".join(changed) if changed else "job, model, data, mode, optimizer, wire or shards") + ")"
    if sd.get("shard", index) != index:
        return f"it is shard {sd.get('shard')}'s"
    done = max((int(c) for c in sd.get("last_clock", {}).values()), default=-1) + 1
    if cfg.train.steps and done > cfg.train.steps:   # its workers would resume past this job's last step
        return f"its workers had pushed for step {done - 1}, past this job's last (train.steps = {cfg.train.steps})"
    return ""


def why_not_resume_from(path: str, cfg: Config, index: int, whole: bool = True) -> str:
    """'' if shard `index` of a job of `cfg` may resume from the checkpoint at `path`,
    else why not (`why_not_resume`). (Read mapped: only its fields are looked at; and,
    `whole`, every byte for `checkpoint_fault`'s CRCs.)"""
    fault = checkpoint_fault(path, whole) if os.path.exists(path) else ""
    if fault:
        return fault
    try:
        sd = torch.load(path, weights_only=True, mmap=True)
    except Exception as e:  # unreadable, or not a checkpoint: nothing to resume
        return f"it cannot be read ({type(e).__name__}: {e})"
    return why_not_resume(sd, cfg, index) if isinstance(sd, dict) else "it is not a psgd checkpoint"


def checkpoint_fault(path: str, whole: bool = True) -> str:
    """'' if the file at `path` is whole, as `write_checkpoint` wrote it: a zip archive
    (its directory, at the end, is there: not cut short) each of whose records matches
    its CRC-32 (checked if `whole`: it reads every byte, 0.2 s for 400 MB from the page
    cache); else what is wrong with it. torch.load takes a record whose bytes changed
    since (a disk's fault, a copy gone wrong) without a word, and says of a truncated
    file "Invalid argument" or that it was not saved with `_use_new_zipfile_serialization`."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip() if whole else None
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    except Exception as e:   # BadZipFile, a record cut short (EOFError), ...
        return f"it is not a whole checkpoint: truncated or corrupt ({e})"
    return f"it is corrupt ({bad} does not match its CRC-32)" if bad else ""


def resumable(path: str, cfg: Config, index: int, whole: bool = True) -> bool:
    """Would shard `index` of a job of `cfg` resume from the checkpoint at `path`?"""
    return not why_not_resume_from(path, cfg, index, whole)


def unresumable(cfg: Config, out: str | None, whole: bool = True, skip: int | None = None) -> dict[int, str]:
    """The shards of a job of `cfg` (but `skip`) whose checkpoint (`Config.checkpoint_file`)
    would not be resumed, each with why not: missing, unreadable, or of another job or
    configuration. A job resumes the whole set or none: some shards resumed and the others
    at their initial values make one model of two versions. (`whole`: `checkpoint_fault`'s
    CRCs too, which read every byte: the reasons are kept, not read again.)"""
    cannot = {}
    for i in range(cfg.cluster.servers):
        why = why_not_resume_from(cfg.checkpoint_file(out, i) or "", cfg, i, whole) if i != skip else ""
        if why:
            cannot[i] = why
    return cannot


def copied(x):
    """A state dict with its tensors cloned (torch's optimizer state_dict shares them with
    the optimizer, whose next step would change a checkpoint being written or kept)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: copied(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(copied(v) for v in x)
    return x


def registration(live_id: str) -> tuple[str, int] | None:
    """A coordinator's `live_id` ("epoch:version": its life, its membership's version) as
    (epoch, version); None if it is none (a version of more than 18 digits is none's:
    no coordinator counts that far, and `int` refuses a string of thousands)."""
    epoch, colon, version = live_id.rpartition(":")
    if not (colon and epoch and version.isascii() and version.isdigit() and len(version) <= 18):
        return None
    return epoch, int(version)


def save_state_dict(sd: dict, path: str, tmp: str = "") -> None:
    """`torch.save` a `state_dict` to `path` atomically (`write_file_atomic`, through
    `tmp`): a full disk or an interrupt leaves no half-written file behind, and its
    OutputError names `path`. A shard's checkpoint (`write_checkpoint`) and a job's final
    model (model.pt, of the last worker or the evaluator) are written with it."""
    write_file_atomic(path, lambda f: torch.save(sd, f), binary=True, tmp=tmp)


def write_checkpoint(sd: dict, path: str) -> None:
    """Atomic checkpoint of a `state_dict` (whose tensors are copies): temp file, fsync,
    rename. Safe to run off the serving thread."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    except OSError as e:
        raise output_error(e, e.filename or path) from None
    save_state_dict(sd, path, tmp=f"{path}.tmp.{os.getpid()}.{threading.get_ident()}")
