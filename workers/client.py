"""The parameter client: one DEALER per shard, every request in flight at once.

A push and the next pull go out as one request on each shard's socket (`pull: true`:
the shard serves the push and then the read, so the read sees this worker's own
update, and answers once) and all shards work in parallel: one round trip, one
message each way per shard and step. A push may also go alone (its answer carries no
arrays), and a pull alone, for schedules that read less often than they push. A
request that gets no answer within the retry window is sent again (unless its shard
most likely holds it: below), its arrays copied
(pushes are deduplicated by (rank, clock) and elastic offers by (rank, round), so a
resend is safe if it carries what was sent first: see `finish`): while its shard
heartbeats to the coordinator (it is parked, or slow, most likely), on the same
connection under the same id, so that the first answer is taken, the original's too,
with a window that doubles, once a `stats` probe that the shard answers at once,
parked or not, has been answered on a connection of its own (what the coordinator
hears says nothing of this worker's way to the shard: a partition, a wrong address;
and an answer on the data connection waits behind the large frames ahead of it); else
on a fresh connection after a backoff. A probe unanswered for
`cluster.timeout_s`, or a shard not live for that long in `finish`, is
`ShardUnreachable`, naming the address.
A shard that answers the probe as the same process (its `incarnation`) that had
answered one before the request left, over a data connection not made again since,
most likely holds the request: it is waited for, not sent again (a 100 MB push late by
a slow apply went twice), until the window is the longest; a restarted shard, a new
connection, or a shard not probed before gets it again at once.
An error reply raises its typed exception (`wire.Refused`, `wire.BadRequest`,
`wire.ServerFault`) at once. `cancel`, when set, is asked while waiting: turning true
gives up with `Cancelled` (the job ended).
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import zmq

from psgd import wire
from psgd.compression import ErrorFeedback
from psgd.config import Config
from psgd.consistency.rule import Diverged
from psgd.membership import job_token
from psgd.transport import Peers, PeerTimeout, unreachable


def _rounds_to_inf(dt: torch.dtype) -> float:
    """The least magnitude that the cast into narrow dtype `dt` makes Inf: its largest
    value plus half a step there (below it, a value rounds to that largest value:
    65510 goes as float16's 65504; ties go to the even neighbour, Inf)."""
    fi = torch.finfo(dt)
    return fi.max + fi.eps * 2.0 ** math.floor(math.log2(fi.max)) / 2


# A narrow wire.dtype's (largest value, least magnitude that arrives as Inf) (`_wire`)
NARROW = {dt: (float(torch.finfo(dt).max), _rounds_to_inf(dt)) for dt in (torch.float16, torch.bfloat16)}


class ShardUnreachable(RuntimeError):
    pass


class Cancelled(RuntimeError):
    """A request given up because the caller's condition changed (e.g. a partner left)."""


@dataclass
class InFlight:
    """Requests sent by `ParameterClient.begin`: request id -> (position, shard)."""
    reqs: list
    pending: dict[int, tuple[int, int]]
    out: list
    cancel: Callable[[], bool] | None
    sent_at: dict[int, float]   # shard -> when its request (or its resend) was last sent (monotonic)
    repeat: bool = False        # a push this process sent before to every shard (a refused step's again)
    resent: set = field(default_factory=set)   # the shards its request went to again (a resend)

    def take(self, got: dict[int, wire.Message]) -> None:
        for rid, m in got.items():
            self.out[self.pending.pop(rid)[0]] = m

    def add(self, more: InFlight) -> None:
        """`more`'s requests (sent since, to other shards) waited for with these."""
        base = len(self.reqs)
        self.reqs += more.reqs
        self.out += more.out
        self.pending.update({rid: (k + base, i) for rid, (k, i) in more.pending.items()})
        self.sent_at.update(more.sent_at)

    def in_shard_order(self) -> InFlight:
        """The requests ordered by shard (sent in another order: `wire.overlap`'s), so that
        the answers come in it."""
        order = sorted(range(len(self.reqs)), key=lambda k: self.reqs[k][0])
        at = {k: j for j, k in enumerate(order)}
        self.reqs = [self.reqs[k] for k in order]
        self.out = [self.out[k] for k in order]
        self.pending = {rid: (at[k], i) for rid, (k, i) in self.pending.items()}
        return self


class ParameterClient:
    # This job's token (`membership.job_token`), on every request (`begin`): a shard refuses
    # another job's changes of its tables and reads (`Shard._ours`). Empty in the simulator.
    job = ""

    def __init__(self, cfg: Config, ctx: zmq.Context, rank: int):
        self._setup(cfg, rank)
        self.job = job_token()
        self.peers = Peers(ctx, [cfg.shard_address(i) for i in range(self.n)], cfg.security,
                           lane=cfg.cluster.local_lane, spin_s=cfg.cluster.spin_s if rank >= 0 else 0.0)
        self._probes: Peers | None = None   # the shards again, for `stats` probes only (`_probe`)
        self.retry_s = max(2.0, 4 * cfg.cluster.heartbeat_s)  # resend window (a restarted shard lost them)
        self._waiting_since = 0.0   # when the wait in progress began (monotonic; 0: none)
        self.alive: Callable[[int], bool] | None = None  # is shard i heartbeating (the coordinator's view)?

    def _setup(self, cfg: Config, rank: int) -> None:
        """What every client has, over sockets or simulated (psgd.sim): the step's
        bookkeeping and its wire buffers."""
        self.cfg = cfg
        self.rank = rank
        self.n = cfg.cluster.servers
        self.wait_s = 0.0     # time blocked on the servers
        self.retries = 0
        self.answered = 0     # requests answered: a step that made none does not end a run of refusals
        self.cancel: Callable[[], bool] | None = None  # for every request: give up when true
        # The live_id of this process's latest registration with the coordinator ('' if it
        # named none), which its join reads carry (`join`)
        self.since: Callable[[], str] = lambda: ""
        # What the caller does while its requests are on their way: `finish` calls it before it waits
        self.idle: Callable[[], None] | None = None
        self.wire_dtype = getattr(torch, cfg.wire.dtype)  # params-sized vectors on the wire
        self._outgoing: dict[tuple[str, int], torch.Tensor] = {}
        self._compressors: dict[int, ErrorFeedback] = {}  # per shard, with its residual (wire.compression)
        # shard -> (its incarnation, when a probe's answer first said it: monotonic), from `_probe`
        self._incarnations: dict[int, tuple[str, float]] = {}
        self._pushed_to = -1   # the latest clock this process pushed (`begin_push_pull`)

    def _wire(self, kind: str, shard: int, t: torch.Tensor, clock: int) -> torch.Tensor:
        """A params-sized float32 vector in `wire.dtype`, converted into a buffer reused
        every step (it is sent without copying and answered before the next use). A value
        beyond float16's range (or bfloat16's, 3.39e38, a little below float32's) would
        arrive as Inf: the step is refused here, naming why."""
        if t.dtype == self.wire_dtype:
            return t
        narrow = NARROW.get(self.wire_dtype)
        if narrow is not None and t.numel():
            limit, inf_from = narrow
            low, high = torch.aminmax(t)   # no P-sized temporary; NaN and Inf go on, for the shard to refuse
            peak = max(-float(low), float(high))
            if inf_from <= peak < float("inf"):
                name = str(self.wire_dtype).removeprefix("torch.")
                raise Diverged(f"values up to {peak:.3g} at step {clock} are beyond {name}'s range ({limit:.6g}): "
                               f"set wire.dtype = {wire.wider_than(name)}")
        buf = self._outgoing.get((kind, shard))
        if buf is None or buf.numel() != t.numel():
            buf = self._outgoing[(kind, shard)] = torch.empty(t.numel(), dtype=self.wire_dtype)
        return buf.copy_(t)

    @property
    def bytes_sent(self) -> int:
        return self.peers.bytes_sent

    @property
    def bytes_recv(self) -> int:
        return self.peers.bytes_recv

    def request(self, reqs: Sequence[tuple[int, str, dict]],
                cancel: Callable[[], bool] | None = None) -> list[wire.Message]:
        """Send (shard, op, fields) requests at once; answers in the same order.
        `cancel()` (or the client's own `cancel`) turning true gives up with `Cancelled`."""
        return self.finish(self.begin(reqs, cancel))

    def begin(self, reqs: Sequence[tuple[int, str, dict]],
              cancel: Callable[[], bool] | None = None) -> InFlight:
        """Send the requests and return at once; `finish` waits for the answers. The
        arrays sent must not change until then (they go without copies; a resend's are
        copies, see `finish`)."""
        if cancel is None:
            cancel = self.cancel
        elif self.cancel is not None:
            own, extra = self.cancel, cancel
            cancel = lambda: own() or extra()  # noqa: E731
        if self.job:   # (every request carries this job's token: a shard refuses another job's, `Shard._ours`)
            for _, _, kw in reqs:
                kw["job"] = self.job
        pending: dict[int, tuple[int, int]] = {}
        try:
            for k, (i, op, kw) in enumerate(reqs):
                pending[self.peers.send(i, op, rank=self.rank, **kw)] = (k, i)
        except BaseException:   # (a shard whose queue has no room: PeerTimeout) the others sent are dropped
            self._drop({i for _, i in pending.values()})
            raise
        now = time.monotonic()
        return InFlight(list(reqs), pending, [None] * len(reqs), cancel, {i: now for i, _, _ in reqs})

    def finish(self, f: InFlight) -> list[wire.Message]:
        """Wait for the answers of `begin`'s requests (resending, see the module's
        docstring, while the shards that owe one answer probes, or until a shard not live
        has not answered for `cluster.timeout_s`); the time spent here is `wait_s`, and
        only it counts towards the timeout (a request sent ahead may wait parked while
        the worker computes). `idle`, if set, is called first (not counted in `wait_s`)."""
        if self.idle is not None:
            self.idle()
        t0 = self._waiting_since = time.monotonic()
        timeout_s = self.cfg.cluster.timeout_s
        deadline = t0 + timeout_s
        backoff = 0.5
        # At most half the timeout: a parked request's shard is probed at least twice per
        # timeout_s (a partition found within 1.5 x timeout_s).
        patience = min(self.retry_s, timeout_s / 2)
        try:
            while f.pending:
                window = min(patience, max(0.1, deadline - time.monotonic()))
                try:
                    got = self.peers.wait({rid: i for rid, (_, i) in f.pending.items()}, window,
                                          "parameter request", f.cancel)
                except PeerTimeout as e:
                    if f.cancel is not None and f.cancel():
                        raise Cancelled(e.address) from None
                    f.take(e.partial)
                    alive = self._alive(f)
                    if not alive and time.monotonic() >= deadline:
                        raise self._unreachable(self._dead(f) or e.address) from None
                    owing = {i for _, i in f.pending.values()}
                    again = owing   # the shards whose requests go again
                    if alive:
                        # Parked or slow, most likely, once the shards answer a probe (one that
                        # does not for timeout_s is unreachable): the requests again (a shard that
                        # restarted lost them) on the same connections under the same ids, so
                        # that the first answer to come is taken, the original's too, and at
                        # once; the window doubles, up to 4 x retry_s or half the timeout (a
                        # parked request waits for a peer).
                        before = {i: self._incarnations.get(i) for i in owing}
                        self._probe(owing, f.cancel)
                        longest = min(4 * self.retry_s, timeout_s / 2)
                        if patience < longest:
                            # A shard that answers the probe as the same process that had answered
                            # one before the request left, over a data connection not made again
                            # since, holds it (a large push still on its way or being applied, a
                            # parked read): sent again, 100 MB went twice each step that took over
                            # retry_s, and the shard read, checked and answered both. Only a restarted
                            # shard, a new connection (or a shard never probed) gets it again, and,
                            # once the window is the longest, every shard that still owes an answer.
                            again = {i for i in owing if not self._holds(i, before[i], f.sent_at[i])}
                        deadline = time.monotonic() + timeout_s
                        patience = min(longest, 2 * patience)
                    else:
                        for i in {i for _, i in f.pending.values()}:
                            self.peers.reconnect(i)
                        time.sleep(backoff)
                        backoff = min(4.0, backoff * 2)
                    self.retries += bool(again)   # (a window that resends nothing is a wait, not a retry)
                    f.resent |= again
                    # A resend goes with copies of its arrays: the answer that ends this wait may
                    # be an earlier send's while the resend still waits in ZeroMQ's queue, and the
                    # caller's next step rewrites the buffers the frames would be read from (the
                    # shard would take that step's values for this request's (rank, clock)).
                    f.pending = {(self.peers.send(f.reqs[k][0], f.reqs[k][1], rid=rid if alive else None,
                                                  copy=True, rank=self.rank, **f.reqs[k][2]) if i in again else rid):
                                 (k, i) for rid, (k, i) in f.pending.items()}
                    now = time.monotonic()
                    f.sent_at.update({i: now for i in again})
                    continue
                f.take(got)
        except BaseException:
            # Given up (a refusal, a cancel, a timeout) while requests to other shards may
            # still wait in ZeroMQ's queues: dropped (`abandon`).
            self.abandon(f)
            raise
        finally:
            self.wait_s += time.monotonic() - t0
            self._waiting_since = 0.0
        self.answered += 1
        return f.out

    def waited(self) -> float:
        """`wait_s` with the wait in progress (a heartbeat's: the coordinator tells a
        worker parked in a long step from one that does not step)."""
        since = self._waiting_since
        return self.wait_s + (time.monotonic() - since if since else 0.0)

    def _holds(self, shard: int, before: tuple[str, float] | None, sent_at: float) -> bool:
        """Does `shard` hold a request sent at `sent_at`, most likely? Yes if the probe just
        answered names the incarnation that a probe's answer had named before the request
        left (`before`: the same process then and now) and the data connection has not
        been made again since (ZeroMQ reconnects a dropped one by itself: what it carried
        may be lost, and an answer to the old connection is dropped). A loss that neither
        shows is sent again once the window is the longest."""
        self.peers.refused(shard)   # (reads its handshakes so far)
        now = self._incarnations.get(shard)
        return (before is not None and bool(before[0]) and before[1] <= sent_at and now is not None
                and now[0] == before[0] and self.peers.handshook[shard] <= sent_at)

    def _probe(self, shards: set[int], cancel: Callable[[], bool] | None) -> None:
        """Return once each of `shards` has answered a `stats` probe on the probe
        connections, which carry nothing else: an answer there queues behind no large
        frames, so a slow answer on its way on the data connection is not taken for
        silence. Each window the unanswered probes go again on fresh connections;
        `ShardUnreachable` when one has none after `cluster.timeout_s`."""
        timeout_s = self.cfg.cluster.timeout_s
        if self._probes is None:
            self._probes = Peers(self.peers.ctx, self.peers.addresses, self.peers.security)
        probes = self._probes
        until = time.monotonic() + timeout_s
        while True:
            pending = {probes.send(i, "stats", rank=self.rank): i for i in shards}
            try:
                got = probes.wait(pending, min(self.retry_s, timeout_s / 2, max(0.1, until - time.monotonic())),
                                  "reachability probe", cancel)
                self._note_incarnations(pending, got)
                return
            except PeerTimeout as e:
                self._note_incarnations(pending, e.partial)
                if cancel is not None and cancel():
                    raise Cancelled(e.address) from None
                shards = {i for rid, i in pending.items() if rid not in e.partial}
                if time.monotonic() >= until:
                    raise self._unreachable(e.address) from None
                for i in shards:
                    probes.reconnect(i)

    def _note_incarnations(self, pending: dict[int, int], got: dict[int, wire.Message]) -> None:
        """Keep each answered probe's incarnation (a shard's own id: `Shard.incarnation`;
        '' from one that does not say), with when it was first said."""
        now = time.monotonic()
        for rid, m in got.items():
            said = str(m.get("incarnation") or "")
            if rid in pending and self._incarnations.get(pending[rid], ("",))[0] != said:
                self._incarnations[pending[rid]] = (said, now)   # (since when: the first answer that said it)

    def _unreachable(self, address: str) -> ShardUnreachable:
        who = f"worker {self.rank}" if self.rank >= 0 else "the evaluator"   # (its client's rank is -1)
        why = unreachable(address)
        return ShardUnreachable(f"{who}: shard at {address} did not answer within "
                                f"cluster.timeout_s = {self.cfg.cluster.timeout_s:.0f} s" + (f": {why}" if why else ""))

    def _dead(self, f: InFlight) -> str:
        """The address of the first shard that owes `f` an answer and is not known to be
        alive ('' if none is known so): the one the error names. The first that had not
        answered may be a live shard holding a parked request, gated on the dead one."""
        alive = self.alive
        owing = sorted({i for _, i in f.pending.values()})
        return next((self.peers.addresses[i] for i in owing if alive is not None and not alive(i)), "")

    def _alive(self, f: InFlight) -> bool:
        """Is every shard that still owes `f` an answer known to be alive?"""
        alive = self.alive
        return alive is not None and all(alive(i) for _, i in f.pending.values())

    # ------------------------------------------------------------ ops
    def pull(self, clock: int) -> list[wire.Message]:
        return self.request([(i, "pull", {"clock": clock}) for i in range(self.n)])

    def join(self, clock: int) -> list[wire.Message]:
        """Pull without waiting on any gate; the answers say where the shards stand. It
        names the registration it follows (`since`): a shard then keeps this rank live
        against the coordinator's views from before it, which may reach the shard after
        this read (`Shard._joined_since`)."""
        since = self.since()
        named = {"since": since} if since else {}   # (none from a registration that named none)
        return self.request([(i, "pull", {"clock": clock, "join": True, **named}) for i in range(self.n)])

    def push_pull(self, clock: int, grads: list[torch.Tensor], buffers: list[torch.Tensor],
                  read_versions: list[int]) -> tuple[list[wire.Message], list[wire.Message]]:
        return self.finish_push_pull(self.begin_push_pull(clock, grads, buffers, read_versions))

    def push(self, clock: int, grads: list[torch.Tensor], buffers: list[torch.Tensor],
             read_versions: list[int]) -> list[wire.Message]:
        """Push clock `clock`'s gradient without pulling (the shards' acknowledgements)."""
        return self.finish_push_pull(self.begin_push_pull(clock, grads, buffers, read_versions, pull=False))[0]

    def begin_push_pull(self, clock: int, grads: list[torch.Tensor] | None, buffers: list[torch.Tensor] | None,
                        read_versions: list[int] | None, slot: int = 0, pull: bool = True,
                        shards: Sequence[int] | None = None, into: InFlight | None = None) -> InFlight:
        """Push clock `clock`'s gradient and pull for `clock + 1` on every shard, and return
        at once (`finish_push_pull` gives the answers). `grads=None`: pull only;
        `pull=False`: push only. `slot` picks the conversion buffers, so that two pushes
        can be in flight. `shards`: to these only, `grads` and `buffers` holding their
        tables in that order (`read_versions` is every shard's); `into`: the requests are
        added to that step's others, sent before (`wire.overlap`: `InFlight.in_shard_order`
        before `finish_push_pull`)."""
        reqs = []
        if grads is not None and self.cfg.wire.compression != "none":
            self._finite_before_residuals(grads, clock)
        for k, i in enumerate(range(self.n) if shards is None else shards):
            if grads is None:
                reqs.append((i, "pull", {"clock": clock + 1}))
                continue
            assert buffers is not None and read_versions is not None
            fields = {"clock": clock, "read_version": read_versions[i],
                      **self._gradient(slot, i, grads[k], buffers[k], clock)}
            if pull:
                fields["pull"] = True
            reqs.append((i, "push", fields))
        f = self.begin(reqs)
        if into is not None:
            into.add(f)
            return into
        if grads is not None:
            f.repeat = clock <= self._pushed_to   # (a step refused by a shard, tried again)
            self._pushed_to = max(self._pushed_to, clock)
        return f

    def abandon(self, f: InFlight) -> None:
        """Give up `f`'s requests unanswered: a fresh connection to each shard that owes an
        answer drops what may still wait in ZeroMQ's queue (its frames are the caller's
        buffers, sent without copies, which its next step rewrites)."""
        self._drop({i for _, i in f.pending.values()})

    def _drop(self, shards: set[int]) -> None:
        """What may still wait in ZeroMQ's queues to these shards, dropped (a fresh connection)."""
        for i in shards:
            with contextlib.suppress(zmq.ZMQError):   # (a context terminated meanwhile: nothing queued is sent)
                self.peers.reconnect(i)

    def _finite_before_residuals(self, grads: list[torch.Tensor], clock: int) -> None:
        """A gradient with NaN or Inf is not compressed: it would stay in the error-feedback
        residual and spoil every later push. The step is refused before any shard's slice
        is encoded: a slice encoded changes its residual, and the step would not be sent."""
        if not all(wire.finite(g) for g in grads):   # as the shard checks a gradient
            codec = self.cfg.wire.compression
            raise Diverged(f"gradient has NaN or Inf values at step {clock}; lower optimizer.lr (not sent: the "
                           f"{codec} residual keeps what a push leaves out, and would keep them)")

    def _gradient(self, slot: int, shard: int, g: torch.Tensor, buffers: torch.Tensor, clock: int) -> dict:
        """A push's arrays (and codec): the gradient in `wire.dtype`, or compressed (a
        finite one: `_finite_before_residuals`)."""
        codec = self.cfg.wire.compression
        if codec == "none":
            return {"arrays": [self._wire(f"g{slot}", shard, g, clock), buffers]}
        if shard not in self._compressors:
            self._compressors[shard] = ErrorFeedback(codec, g.numel(), self.cfg.wire.topk_fraction,
                                                     name=f"worker-{self.rank}")
        first, last = self._compressors[shard].encode(g)
        return {"arrays": [first, buffers, last], "codec": codec}

    def finish_push_pull(self, f: InFlight) -> tuple[list[wire.Message], list[wire.Message]]:
        """(the pushes' answers, the pulls' answers), one each per shard (or none). A push
        that also read has one answer: the read's, with the push's answer in its field
        `push`. A push this process had sent before to a shard (`InFlight.repeat`, for
        every shard; `InFlight.resent`, to some) has that shard's answer marked `resent`: its
        `duplicate` is then this process's push, applied (`pushpull.acknowledged`). Another
        shard's `duplicate` is another process's: a resend to one shard says nothing of the
        others (a restarted worker repeating a clock its rank's earlier process pushed)."""
        answers = self.finish(f)
        pushed, pulled = [], []
        for (_, op, kw), m in zip(f.reqs, answers, strict=True):
            if op == "pull":
                pulled.append(m)
            elif kw.get("pull"):
                pushed.append(wire.Message("reply", m.id, m.rank, m.clock, m.get("push")))
                pulled.append(m)
            else:
                pushed.append(m)
        if f.repeat or f.resent:
            shards = [i for i, op, kw in f.reqs if op == "push"]
            pushed = [wire.Message(m.op, m.id, m.rank, m.clock, {**m.fields, "resent": True})
                      if f.repeat or i in f.resent else m for i, m in zip(shards, pushed, strict=True)]
        return pushed, pulled

    def elastic(self, round_: int, xs: list[torch.Tensor], bs: list[torch.Tensor], clock: int) -> list[wire.Message]:
        return self.request([(i, "elastic", {"round": round_, "clock": clock,
                                              "arrays": [self._wire("x", i, xs[i], clock), bs[i]]})
                             for i in range(self.n)])

    def put_model(self, round_: int, score: float, arrays: list[list[torch.Tensor]], step: int,
                  tag: int | None = None) -> None:
        """Deposit a model (ltfb), in float32 whatever `wire.dtype`: the members of a
        trainer load it and must leave the round with the weights their leader keeps.
        `tag`: names this deposit on every shard (a reader takes slices of one deposit)."""
        fields = {"round": round_, "score": score, "step": step} | ({} if tag is None else {"tag": tag})
        self.request([(i, "put_model", {**fields, "arrays": arrays[i]}) for i in range(self.n)])

    def get_model(self, round_: int, owner: int, cancel: Callable[[], bool] | None = None,
                  exact: bool = False, missing_ok: bool = False) -> list[wire.Message] | None:
        """`owner`'s model of `round_` (or its later one unless `exact`) from every shard.
        `missing_ok`: None instead of an exception when it is not delivered."""
        try:
            return self.request([(i, "get_model", {"round": round_, "owner": owner, "exact": exact})
                                 for i in range(self.n)], cancel)
        except (Cancelled, ShardUnreachable, wire.Refused):
            if missing_ok:
                return None
            raise

    def init(self, tables: tuple[list[torch.Tensor], list[torch.Tensor]] | None) -> list[wire.Message]:
        """Offer every shard initial values (params, buffers per shard, float32), or, with
        None, wait until it has them (psgd/shard.py `on_init`)."""
        return self.request([(i, "init", {"arrays": [tables[0][i], tables[1][i]]} if tables else {})
                             for i in range(self.n)])

    def index(self) -> list[wire.Message]:
        """Each shard's index of the models deposited with it."""
        return self.request([(i, "models", {}) for i in range(self.n)])

    @staticmethod
    def tables(msgs: Sequence[wire.Message]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The (first, second) arrays of each shard's answer as tensors, without copies:
        (params, buffers), or (deltas, buffers) for an elastic exchange."""
        return tensors_of(msgs, 0), tensors_of(msgs, 1)

    def close(self) -> None:
        self.peers.close()
        if self._probes is not None:
            self._probes.close()


def tensors_of(msgs: Sequence[wire.Message], k: int) -> list[torch.Tensor]:
    """The k-th array of each shard's answer, as tensors (no copy)."""
    return [wire.tensor(m, k) for m in msgs]
