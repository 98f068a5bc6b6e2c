"""`ltfb`: Livermore Tournament Fast Batch (Jacobs, Dryden, Pearce, Van Essen, MLHPC'17).

Server rule: the shards are the exchange. Every `mode.round_steps` local steps each
trainer deposits its model (weights, buffers, and with `mode.exchange =
"weights+optimizer"` its optimizer's state) with its tournament score; a request for a
partner's model of round r is answered with that model, or the partner's later one,
or parked until it is deposited (`tournament.Exchange`). Each owner's older deposits
are forgotten.

Worker schedule: local steps with the worker's own optimizer; at the end of a round it
scores its model on its held-out tournament split (`mode.tournament_fraction`),
deposits it, fetches the partner that `pairings(seed, round, live)` names (an odd
trainer sits out), scores it on the same split and keeps it only if strictly better.

The global model (for the evaluator and a rejoining trainer) is the best-scored
deposit of the latest round: its (round, owner) is chosen once from every shard's index
and then fetched exactly from every shard, so its slices never mix two trainers.
"""
from __future__ import annotations

from typing import Any

import torch

from .. import wire
from .pushpull import load
from .rule import (
    REFUSED,
    Answer,
    AnswerModel,
    Decision,
    Deposit,
    Fetch,
    Forget,
    Refuse,
    Schedule,
    ServerRule,
    Store,
    Trainer,
    local_step,
    make_local_optimizer,
)
from .tournament import Exchange, adopt, pairings

FETCH_TRIES = 5   # a chosen deposit can be replaced by a newer one between index and fetch


class LtfbRule(ServerRule):
    name = "ltfb"
    serves = frozenset({"put_model", "get_model", "models", "pull"})

    def __init__(self, mode, world, tables):
        super().__init__(mode, world, tables)
        self.exchange = Exchange()
        self.scores: dict[tuple[int, int], float] = {}   # stored (round, owner) -> score

    def deposit(self, e: Deposit) -> list[Decision]:
        key = (e.round, e.rank)
        self.scores[key] = e.score
        out: list[Decision] = [Store(key, e.score, e.arrays), Answer(e.token)]
        out += [self.answer_model(t, k) for t, k in self.exchange.put(e.round, e.rank, key)]
        keep = self.exchange.keys()
        gone = [k for k in self.scores if k not in keep]
        for k in gone:
            del self.scores[k]
        return out + ([Forget(gone)] if gone else [])

    def fetch(self, e: Fetch) -> list[Decision]:
        if e.exact:
            key = (e.round, e.owner)
            if key not in self.scores:
                return [Refuse(e.token, REFUSED, f"no deposit of trainer {e.owner} for round {e.round} here")]
            return [self.answer_model(e.token, key)]
        found = self.exchange.get(e.round, e.owner, e.token)
        return [] if found is None else [self.answer_model(e.token, found)]

    def answer_model(self, token: Any, key: Any) -> AnswerModel:
        """`key` is a stored (round, owner)."""
        return AnswerModel(token, key, {"round": key[0], "owner": key[1], "score": self.scores[key]})

    def index(self, token: Any) -> list[Decision]:
        return [Answer(token, {"models": [[r, o, s] for (r, o), s in sorted(self.scores.items())]})]

    def stats(self) -> dict:
        return {**super().stats(), "parked": self.exchange.parked}


def choose_best(indexes: list[list]) -> tuple[int, int] | None:
    """The global model's (round, owner), from each shard's index of [round, owner, score]:
    among the deposits that every shard holds, the latest round, then the best score,
    then the lower rank. None before any complete deposit."""
    held = [{(int(r), int(o)): float(s) for r, o, s in idx} for idx in indexes]
    common = set(held[0]).intersection(*held[1:]) if held else set()
    if not common:
        return None
    latest = max(r for r, _ in common)
    return max((k for k in common if k[0] == latest), key=lambda k: (held[0][k], -k[1]))


def global_model(client: Any) -> list:
    """The best trainer's model, all of its slices from the same deposit; the initial
    model (the shards' tables) before the first round."""
    for attempt in range(FETCH_TRIES):
        best = choose_best([m.get("models") for m in client.index()])
        if best is None:
            return client.pull(-1)
        got = client.get_model(best[0], best[1], exact=True, missing_ok=attempt < FETCH_TRIES - 1)
        if got is not None:
            return got
    raise AssertionError("unreachable: the last try raises")


class LtfbSchedule(Schedule):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.data_split = cfg.mode.tournament_fraction
        self.with_opt = cfg.mode.exchange == "weights+optimizer"

    def start(self, w: Trainer) -> None:
        self.rejoin(w)
        w.replica.model.train()
        self.opt = make_local_optimizer(w)

    def rejoin(self, w: Trainer) -> None:
        """Continue from the best trainer's model."""
        load(w, global_model(w.client))

    def step(self, w: Trainer) -> None:
        local_step(w, self.opt)
        if w.clock % self.cfg.mode.round_steps:
            w.log_step(0, 0.0)
            return
        w0 = w.client.wait_s
        self.tournament(w, w.clock // self.cfg.mode.round_steps)
        w.log_step(0, w.client.wait_s - w0)

    def tournament(self, w: Trainer, rnd: int) -> None:
        bs = self.cfg.eval.batch_size
        local_score, _ = w.replica.score(*w.holdout, bs)
        params, buffers = w.replica.params(), w.replica.buffers()
        keys, state = self.opt_state(w) if self.with_opt else ([], [])
        arrays = [[params[i], buffers[i]] + [w.replica.map.gather(t, i, "params").cpu() for t in state]
                  for i in range(w.replica.n)]
        w.client.put_model(rnd, local_score, arrays, w.clock)
        # Trainers that finished or were lost deposit no more models: pair the live ones.
        partner = pairings(self.cfg.job.seed, rnd, w.live() | {w.rank}).get(w.rank)
        partner_score, adopted = None, False
        if partner is not None:
            got = w.client.get_model(rnd, partner, cancel=lambda: partner not in w.live(), missing_ok=True)
            if got is None:
                w.note(f"round {rnd}: partner {partner} did not deliver; sitting out")
            else:
                w.replica.load(*w.client.tables(got))
                partner_score, _ = w.replica.score(*w.holdout, bs)
                adopted = adopt(local_score, partner_score)
                if not adopted:
                    w.replica.load(params, buffers)
                elif self.with_opt and len(got[0].arrays) == 2 + len(keys):
                    self.load_opt_state(w, keys, got)
        w.event(event="tournament", round=rnd, rank=w.rank, partner=partner, local_score=round(local_score, 5),
                partner_score=None if partner_score is None else round(partner_score, 5), adopted=adopted)

    def _trainable(self, w: Trainer) -> tuple[list[torch.Tensor], dict[int, str]]:
        model = w.replica.model
        return [p for p in model.parameters() if p.requires_grad], {id(p): n for n, p in model.named_parameters()}

    def opt_state(self, w: Trainer) -> tuple[list[str], list[dict]]:
        """Optimizer state tensors shaped like the parameters (momentum, Adam moments)."""
        params, names = self._trainable(w)
        state = self.opt.state
        keys = sorted({k for p in params for k, v in state.get(p, {}).items()
                       if torch.is_tensor(v) and v.shape == p.shape})
        return keys, [{names[id(p)]: state[p][k] if k in state.get(p, {}) else torch.zeros_like(p) for p in params}
                      for k in keys]

    def load_opt_state(self, w: Trainer, keys: list[str], got: list) -> None:
        params, names = self._trainable(w)
        for j, k in enumerate(keys):
            target = {names[id(p)]: self.opt.state.setdefault(p, {}).setdefault(k, torch.zeros_like(p))
                      for p in params}
            for i, m in enumerate(got):
                w.replica.map.scatter(wire.tensor(m, 2 + j), i, "params", target)
