"""`easgd`: elastic averaging SGD (Zhang, Choromanska, LeCun 2015).

Server rule: the shards hold the centre x~. An elastic offer of worker i's replica x_i
moves the centre by d = alpha (x_i - x~) and answers d (Algorithm 1, asynchronous).
With `mode.sync = true` the offers of a round wait for each other (a round barrier,
with fast-forward after a restore); the centre moves by the sum of the round's d_i,
and an offer that comes after its round closed gets its d without moving the centre.
BatchNorm buffers: a running mean (async) or the round's mean (sync).

Worker schedule: local steps with the worker's own optimizer; every `mode.tau` steps
an elastic exchange, after which the replica moves by -d. Staleness counts the centre
moves by others since the worker's previous exchange.
"""
from __future__ import annotations

import torch

from . import barrier as bsp
from .elastic import default_alpha, elastic_delta, round_deltas
from .pushpull import load
from .rule import (
    BUFFERS,
    REFUSED,
    Answer,
    Decision,
    ElasticOffer,
    MixBuffers,
    Move,
    Refuse,
    Schedule,
    SetBuffers,
    Trainer,
    local_step,
    make_local_optimizer,
)
from .sync import SyncRule


class EasgdRule(SyncRule):
    """The round barrier and its fast-forward are sync's; the rest is elastic."""
    name = "easgd"
    serves = frozenset({"elastic", "pull"})

    def __init__(self, mode, world, tables):
        super().__init__(mode, world, tables)
        self.alpha = default_alpha(mode.alpha, world)
        self.round: dict[int, ElasticOffer] = {}   # sync rounds: the offers of the open round

    def backup(self) -> int:
        return 0

    def push(self, e):
        raise NotImplementedError  # not in `serves`

    def elastic(self, e: ElasticOffer) -> list[Decision]:
        center = self.tables.params.detach()
        if not self.mode.sync:
            d = elastic_delta(e.x, center, self.alpha)
            return [Move(d), MixBuffers(e.buffers, 1.0 / self.world), Answer(e.token, arrays=[d, BUFFERS])]
        verdict, _ = self.offer(e.rank, e.round)
        if verdict == bsp.LATE:  # the round closed without it: it moves, the centre does not
            d = elastic_delta(e.x, center, self.alpha)
            return [Answer(e.token, {"dropped": True}, arrays=[d, BUFFERS])]
        if verdict != bsp.ACCEPT:
            return [Refuse(e.token, REFUSED, f"round {e.round} is not the open round {self.barrier.step}")]
        self.round[e.rank] = ElasticOffer(e.token, e.rank, e.round, e.x.clone(), e.buffers.clone())
        return self.close_step() if self.barrier.complete() else []

    def close_step(self) -> list[Decision]:
        offers = [self.round[r] for r in sorted(self.round)]
        ds = round_deltas([o.x for o in offers], self.tables.params.detach(), self.alpha)
        self.round = {}
        self.barrier.advance()
        out: list[Decision] = [Move(torch.stack(ds).sum(0)),
                               SetBuffers(torch.stack([o.buffers for o in offers]).mean(0))]
        return out + [Answer(o.token, arrays=[d, BUFFERS]) for o, d in zip(offers, ds, strict=True)]

    def membership(self, live: dict[int, int]) -> list[Decision]:
        self.barrier.set_live(live.keys())
        return self.close_step() if self.round and self.barrier.complete() else []

    def gated_read(self, e):
        return [self.answer(e)]


class EasgdSchedule(Schedule):
    def start(self, w: Trainer) -> None:
        self.last_version = self.join(w)
        w.replica.model.train()
        self.opt = make_local_optimizer(w)

    def join(self, w: Trainer) -> int:
        answers = w.client.join(w.clock)
        if self.cfg.mode.sync:   # continue in the shards' open round
            w.clock = max(w.clock, max(int(m.get("step", 0)) for m in answers) * self.cfg.mode.tau)
        return load(w, answers)[0]

    def rejoin(self, w: Trainer) -> None:
        self.join(w)

    def step(self, w: Trainer) -> None:
        local_step(w, self.opt)
        tau = self.cfg.mode.tau
        staleness, wait = 0, 0.0
        if w.clock % tau == 0:
            w0 = w.client.wait_s
            answers = w.client.elastic(w.clock // tau - 1, w.replica.params(), w.replica.buffers(), w.clock)
            wait = w.client.wait_s - w0
            version = int(answers[0].get("version", 0))
            staleness = max(0, version - self.last_version - 1)  # centre moves by others since our last
            self.last_version = version
            w.hist.add(staleness)
            ds, _ = w.client.tables(answers)
            w.replica.load([p - d for p, d in zip(w.replica.params(), ds, strict=True)])
        w.log_step(staleness, wait)
