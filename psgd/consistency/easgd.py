"""`easgd`: elastic averaging SGD (Zhang, Choromanska, LeCun 2015).

Server rule: the shards hold the centre x~. An elastic offer of worker i's replica x_i
moves the centre by d = alpha (x_i - x~) and answers d (Algorithm 1, asynchronous).
With `mode.sync = true` the offers of a round wait for each other (sync's round
barrier, with its recovery after a restore or a rejoin); the centre moves by the sum
of the round's d_i, and an offer that comes after its round closed gets its d without
moving the centre. A worker's offer moves the centre once: its resend (the client's,
after `retry_s` without an answer) is answered, by its round's close in sync (also
while it waits for a later round: `SyncRule.wait`), or, once it was answered, with its
d and the centre unmoved (`duplicate`: a resend, not a late offer, so not counted dropped).
The shard remembers the answered rounds across a worker's leave and return, and, async,
forgets a returning worker's rounds from its clock on only at its join (`joined`): its
new offers of them move the centre, a resend of its earlier life's never does.
BatchNorm buffers: a running mean (async) or the round's mean (sync).

Worker schedule, in Algorithm 1's order: at every step t with tau | t (t = 0, tau,
2 tau, ...; exchange round t / tau) the worker computes its gradient g(x) and offers the
same x; the replica moves by -d and then takes the local update, so that with plain SGD
    x_i <- x_i - eta g(x_i) - alpha (x_i - x~),   x~ <- x~ + alpha (x_i - x~)
both terms evaluated at the x_i from before the step. (Before this order was fixed, the
exchange offered the x after the step's update.) When the step budget ends, one more
exchange is made, without an update, if local steps came after the last one: at a
multiple of tau it is the round of the step that would come next; otherwise the next
round, early, so that the centre has the last (fewer than tau) local steps too. The local optimizer is `[optimizer]`:
plain SGD is EASGD as the equations above; with `optimizer.nesterov = true` (momentum
> 0) it is EAMSGD (Algorithm 2, in torch's look-ahead form of Nesterov momentum, so the
elastic term acts on the look-ahead point); with plain momentum, EASGD with a
heavy-ball local optimizer (not EAMSGD). Staleness counts the centre's moves by others
since the worker's previous exchange (or its join, which loads the centre).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from . import barrier as bsp
from .elastic import default_alpha, elastic_delta, round_deltas
from .pushpull import caught_up, load
from .rule import (
    BUFFERS,
    Answer,
    Decision,
    ElasticOffer,
    MixBuffers,
    Move,
    Read,
    Schedule,
    SetBuffers,
    Trainer,
    local_step,
    make_local_optimizer,
)
from .sync import SyncRule

if TYPE_CHECKING:
    from ..config import Config


class EasgdRule(SyncRule):
    """The round barrier is sync's, with its recovery (offers for a later round wait;
    a round nobody will complete closes); the rest is elastic."""
    name = "easgd"
    serves = frozenset({"elastic", "pull"})

    def __init__(self, mode, world, tables):
        super().__init__(mode, world, tables)
        self.alpha = default_alpha(mode.alpha, world)
        self.round: dict[int, ElasticOffer] = {}   # sync rounds: the offers of the open round
        # rank -> its last round answered (async: that moved the centre; a new life takes back those from its clock on)
        self.offered: dict[int, int] = {}
        self.left: set[int] = set()   # async: ranks that left the live set since their last join (`joined`)
        self.moving = None   # sync: the centre's moves decided in this `settle`, not yet carried out

    @classmethod
    def last_exchange(cls, cfg: Config) -> int:
        """An offer's round is its step / tau: the last is the one the budget's end makes,
        ceil(train.steps / tau) (`EasgdSchedule.finish`)."""
        return -(-cfg.train.steps // cfg.mode.tau)

    def backup(self) -> int:
        return 0

    def push(self, e):
        raise NotImplementedError  # not in `serves`

    def elastic(self, e: ElasticOffer) -> list[Decision]:
        """An offer of a round answered already is a resend (the worker did not get the
        answer): it gets its d, and the centre stays; in sync it is not late, so not
        counted dropped (the barrier would count it so: its round closed). Async: the
        offer moves the centre, once per round of each worker. Sync: the round barrier
        (`offer`)."""
        if e.round <= self.offered.get(e.rank, -1):
            return [self.unmoved(e, {"duplicate": True})]
        if self.mode.sync:
            return self.offer(e)
        self.offered[e.rank] = e.round
        self.clocks.note(e.rank, e.round)   # the clock gap, in rounds: this offer's lead over the slowest's
        self.clocks.answered(e.round)
        d = elastic_delta(e.x, self.tables.params.detach(), self.alpha)
        return [Move(d), MixBuffers(e.buffers, 1.0 / self.world), Answer(e.token, arrays=[d, BUFFERS])]

    def resent(self, e: ElasticOffer) -> bool:
        """Answered already, or (sync) in the open round or waiting for its round."""
        if e.round <= self.offered.get(e.rank, -1):
            return True
        if not self.mode.sync:
            return False
        waiting = self.early.get(e.rank)
        return (e.round == self.barrier.step and self.barrier.contributed(e.rank)) or (
            waiting is not None and waiting.round == e.round)

    def unmoved(self, e: ElasticOffer, fields: dict) -> Answer:
        """An offer answered with its d = alpha (x - centre) without moving the centre."""
        return Answer(e.token, fields, arrays=[elastic_delta(e.x, self.centre(), self.alpha), BUFFERS])

    def centre(self):
        """The centre as the decisions made so far leave it: the shard's, plus the moves of
        the rounds that this `settle` closed already (the shard carries them out after it)."""
        c = self.tables.params.detach()
        return c if self.moving is None else c + self.moving

    def settle(self) -> list[Decision]:
        """Sync's, over rounds. One event may close several rounds (offers that waited for
        later rounds: a shard restored from a checkpoint, a worker rejoining ahead): each
        round's d_i are taken against the centre that the rounds before it moved (before,
        against the shard's centre, which the earlier rounds' moves had not reached yet)."""
        self.moving = None
        try:
            return super().settle()
        finally:
            self.moving = None

    def step_of(self, e: ElasticOffer) -> int:
        return e.round

    def keep(self, e: ElasticOffer) -> ElasticOffer:
        return replace(e, x=e.x.clone(), buffers=e.buffers.clone())

    def take(self, e: ElasticOffer, verdict: str) -> list[Decision]:
        if verdict == bsp.LATE:  # the round closed without it
            self.offered[e.rank] = e.round
            return [self.unmoved(e, {"dropped": True})]
        if verdict == bsp.DUPLICATE:  # a resend while its round is open: the round's close answers the resend
            self.round[e.rank] = replace(self.round[e.rank], token=e.token)
            return []
        self.round[e.rank] = self.keep(e)
        return []

    def membership(self, live: dict[int, int]) -> list[Decision]:
        """The answered rounds stay when a rank leaves and returns (they were forgotten here:
        told after the returning worker's offers were answered, as the shard's heartbeat may
        tell it, a resend of one moved the centre again). Sync forgets none: a returning
        worker offers from the open round on, past every answered one; async, its join
        begins its new life (`joined`)."""
        if not self.mode.sync:
            self.left |= self.barrier.live - live.keys()
        return super().membership({r: c // self.mode.tau for r, c in live.items()})  # steps -> rounds

    def close_step(self) -> list[Decision]:
        offers = [self.round[r] for r in sorted(self.round)]
        ds = round_deltas([o.x for o in offers], self.centre(), self.alpha)
        self.round = {}
        self.barrier.advance()
        for o in offers:
            self.offered[o.rank] = o.round
        move = torch.stack(ds).sum(0)
        self.moving = move if self.moving is None else self.moving + move
        out: list[Decision] = [Move(move),
                               SetBuffers(torch.stack([o.buffers for o in offers]).mean(0))]
        return out + [Answer(o.token, arrays=[d, BUFFERS]) for o, d in zip(offers, ds, strict=True)]

    def gated_read(self, e):
        return [self.answer(e)]

    def read(self, e: Read) -> list[Decision]:
        """Async: a worker (re)joining learns the last round it must not offer again
        (`offered`, see `joined`), and continues after it."""
        if not e.join or self.mode.sync:
            return super().read(e)
        skip = self.joined(e.rank, e.clock)
        a = self.answer(e)
        a.fields = {**a.fields, "offered": skip}
        return [a]

    def joined(self, rank: int, clock: int) -> int:
        """A worker joins at `clock`; the round it continues after. Its rank did not leave
        the live set since its last join (a process restarted before the coordinator missed
        the one it replaces, or a rejoin between two of the shard's heartbeats): it keeps
        the rank's rounds and continues after them (its offers of them would be resends).
        It left: a new life at its own clock (the rejoining process's, or the coordinator's
        for a new one), nothing to skip (-1). It offers rounds ceil(clock / tau) on, which
        move the centre though its earlier life offered them; the rounds before stay
        answered, so that a resend of the earlier life's that comes late (a copy queued in
        ZeroMQ while the join went on the same-host lane) is still a resend. (One of a
        round the new life offers again, come after this join from a process it replaced
        that still runs, is told from the new offer only by the worker's registration,
        which an offer does not carry.)"""
        if rank not in self.left:
            return self.offered.get(rank, -1)
        self.left.discard(rank)
        first = -(-clock // self.mode.tau)   # the round of its first exchange (`EasgdSchedule.step`, `finish`)
        if self.offered.get(rank, -1) >= first:
            self.offered[rank] = first - 1
        return -1

    def state_dict(self) -> dict:
        # The open round's offers live here, not in the shard's tables, and their askers
        # resend them to a restored shard: it starts the round afresh.
        return {**super().state_dict(), "contributors": [], "offered": dict(self.offered), "left": sorted(self.left)}

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.offered = {int(k): int(v) for k, v in sd.get("offered", {}).items()}
        self.left = {int(r) for r in sd.get("left", ())}


class EasgdSchedule(Schedule):
    local_optimizer = True

    def start(self, w: Trainer) -> None:
        self.last_version = self.join(w)
        self.opt = make_local_optimizer(w)

    def join(self, w: Trainer) -> int:
        answers = w.client.join(w.clock)
        tau = self.cfg.mode.tau
        if self.cfg.mode.sync:   # continue in the shards' open round
            w.clock = caught_up(w, max(int(m.get("step", 0)) for m in answers) * tau)
        else:                    # after the rounds this rank offered already (a restart of its process)
            w.clock = caught_up(w, (max(int(m.get("offered", -1)) for m in answers) + 1) * tau)
        return load(w, answers)[0]

    def rejoin(self, w: Trainer) -> None:
        """The join loads the centre into the replica: the next exchange's staleness counts
        the centre's moves since then (before, since the exchange before the worker was
        dropped, moves that the centre it loaded already held)."""
        self.last_version = self.join(w)

    def step(self, w: Trainer) -> None:
        """Algorithm 1's step t: at tau | t the elastic exchange, with the x the gradient
        was computed at; then the local update (x - d - eta g(x) for plain SGD)."""
        tau = self.cfg.mode.tau
        self.exchanged = (0, 0.0)
        local_step(w, self.opt, (lambda: self.exchange(w, w.clock // tau)) if w.clock % tau == 0 else None)
        w.log_step(*self.exchanged)

    def finish(self, w: Trainer) -> None:
        """The budget ends where step t = clock would begin: the exchange of round
        ceil(t / tau) (no local update), so that the centre has the local steps since the
        last exchange too (all of a job's when tau > train.steps; before, the remainder of
        steps / tau was never offered)."""
        if w.clock:
            self.exchange(w, -(-w.clock // self.cfg.mode.tau))

    def exchange(self, w: Trainer, round_: int) -> None:
        """Offer x_i, move it by -d; staleness counts the centre's moves by others since
        this worker's previous exchange (or its join)."""
        w0 = w.client.wait_s
        answers = w.client.elastic(round_, w.replica.params(), w.replica.buffers(), w.clock)
        version = int(answers[0].get("version", 0))
        staleness = max(0, version - self.last_version - 1)
        self.last_version = version
        w.hist.add(staleness)
        ds, _ = w.client.tables(answers)
        w.replica.load([p - d for p, d in zip(w.replica.params(), ds, strict=True)])
        self.exchanged = (staleness, w.client.wait_s - w0)
