"""The Livermore Tournament Fast Batch rules (Jacobs, Dryden, Pearce, Van Essen, MLHPC'17),
with LBANN's trainer groups and selection strategies and population-based training's
hyperparameter exploration (Jaderberg et al. 2017). All pure: every party that calls
them with the same arguments gets the same answer, with no communication.

Trainers: ranks t*k .. t*k + k - 1 form trainer t (`mode.trainer_size = k`).

- `pairings(seed, round, trainers)`: the pairs of a round; an odd trainer sits out.
- `adopt(local, partner)`: keep the partner's model only if its score is strictly better.
- `fitness(metric, accuracy, loss)`: a score where higher is better (a non-finite one is
  the worst), so that `adopt` and the rankings serve both metrics.
- `truncation(seed, round, scores, k)`: the bottom k trainers, each with the random
  top-k trainer whose model it takes (PBT's truncation selection).
- `draw_hyper` / `mutate`: a trainer's starting hyperparameters, log-uniform in the
  exploration ranges; an adopter's perturbation by x (1 - m) or x (1 + m).
- `Exchange`: the server side of a round's model swap (deposits, parked requests).
- `Scoreboard`: the server side of truncation: every live trainer's score of a round.
- `GroupSteps`: the server side of a trainer's synchronous data-parallel step: the mean
  of its workers' gradients, the same answer for every one of them.
"""
from __future__ import annotations

import math
import random
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .rule import FINAL_ROUND


def trainer_of(rank: int, k: int) -> int:
    return rank // k


def trainers(ranks: Iterable[int], k: int) -> set[int]:
    """The trainers that have at least one of these ranks."""
    return {r // k for r in ranks}


def pairings(seed: int, round_: int, ranks: Iterable[int]) -> dict[int, int | None]:
    order = sorted(set(ranks))
    random.Random(f"ltfb:{seed}:{round_}").shuffle(order)
    out: dict[int, int | None] = {}
    for i in range(0, len(order) - 1, 2):
        a, b = order[i], order[i + 1]
        out[a], out[b] = b, a
    if len(order) % 2:
        out[order[-1]] = None
    return out


def adopt(local_score: float, partner_score: float) -> bool:
    return partner_score > local_score


def fitness(metric: str, accuracy: float, loss: float) -> float:
    """Higher is better: the accuracy, or minus the loss; -inf for a non-finite score
    (a diverged model loses every comparison)."""
    value = accuracy if metric == "accuracy" else -loss
    return value if math.isfinite(value) else -math.inf


def truncation(seed: int, round_: int, scores: Mapping[int, float], k: int) -> dict[int, int]:
    """{loser: winner}: trainers ranked by score (higher first, ties to the lower trainer);
    each of the bottom k takes the model of a top-k trainer drawn from (seed, round,
    loser). Fewer than 2k trainers: only the bottom len - k can lose, nobody when
    len <= k."""
    ranked = sorted(scores, key=lambda t: (-scores[t], t))
    top, bottom = ranked[:k], ranked[max(k, len(ranked) - k):]
    return {t: random.Random(f"ltfb-truncation:{seed}:{round_}:{t}").choice(top) for t in bottom}


def draw_hyper(explore: Mapping[str, list], seed: int, trainer: int) -> dict[str, float]:
    """Trainer `trainer`'s starting values: each key's value log-uniform in [low, high],
    drawn in key order from (seed, trainer)."""
    rng = random.Random(f"ltfb-explore:{seed}:{trainer}")
    out = {}
    for key in sorted(explore):
        lo, hi = (float(v) for v in explore[key])
        u = rng.random()
        out[key] = lo if lo == hi else math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
    return out


def mutate(hyper: Mapping[str, float], explore: Mapping[str, list], m: float, seed: int, round_: int,
           trainer: int) -> dict[str, float]:
    """An adopter's values: each of the partner's times (1 - m) or (1 + m), chosen from
    (seed, round, trainer) in key order, then kept within the key's exploration range
    (a momentum above 1, or a rate far beyond what was explored, would diverge)."""
    rng = random.Random(f"ltfb-mutate:{seed}:{round_}:{trainer}")
    out = {}
    for key in sorted(hyper):
        value = hyper[key] * ((1 - m) if rng.random() < 0.5 else (1 + m))
        lo, hi = (float(v) for v in explore.get(key, (value, value)))
        out[key] = min(hi, max(lo, value))
    return out


class Exchange:
    """Models deposited per (round, owner). A request for (round r, owner o) is answered
    with o's model from round r, or from o's latest later round if o has moved on
    (trainers drift apart when one sits out or straggles); otherwise it is parked until
    o deposits round r or later. Each owner's deposits older than its latest are
    forgotten, so memory stays at one model per trainer plus the parked requests."""

    def __init__(self):
        self.latest: dict[int, tuple[int, Hashable]] = {}  # owner -> (round, stored model key)
        self._waiting: list[tuple[tuple[int, int], Hashable]] = []

    def put(self, round_: int, owner: int, model: Hashable) -> list[tuple[Hashable, Hashable]]:
        """Deposit; returns (parked request, model) pairs that may now be answered."""
        if round_ >= self.latest.get(owner, (-1, None))[0]:
            self.latest[owner] = (round_, model)
        ready = [(t, model) for (r, o), t in self._waiting if o == owner and r <= round_]
        self._waiting = [((r, o), t) for (r, o), t in self._waiting if not (o == owner and r <= round_)]
        return ready

    def get(self, round_: int, owner: int, token: Hashable) -> Hashable | None:
        """The model if deposited for this round or later; else the request is parked
        under `token` (None)."""
        have = self.latest.get(owner)
        if have is not None and have[0] >= round_:
            return have[1]
        self._waiting.append(((round_, owner), token))
        return None

    def keys(self) -> set:
        """Stored model keys still reachable (the shard frees the others)."""
        return {m for _, m in self.latest.values()}

    def state_dict(self) -> dict:
        """Each owner's latest deposit, for a checkpoint. The parked requests are not
        kept: their askers resend them to a restored shard."""
        return {"latest": {o: [r, m] for o, (r, m) in self.latest.items()}}

    def load_state_dict(self, sd: dict) -> None:
        """`sd` from `state_dict`; an empty one (a checkpoint older than it) holds nothing."""
        self.latest = {int(o): (int(r), m) for o, (r, m) in sd.get("latest", {}).items()}

    @property
    def parked(self) -> int:
        return len(self._waiting)


class Scoreboard:
    """Truncation selection's scores: each trainer's score of each round. A request for
    round r's scores is parked until every live trainer has deposited round r (or a
    later one), then answered with the scores of round r, the same for everyone: a
    round's board is frozen when it first completes. A trainer that joins later is not
    on it and keeps its model. Only the last few rounds are kept."""

    KEEP = 3

    def __init__(self, live: Iterable[int]):
        self.live = set(live)
        self.rounds: dict[int, dict[int, float]] = {}
        self.latest: dict[int, int] = {}       # trainer -> its latest deposited round
        self.frozen: dict[int, dict[int, float]] = {}
        self._waiting: list[tuple[int, Hashable]] = []

    def put(self, round_: int, trainer: int, score: float) -> list[tuple[Hashable, int, dict[int, float]]]:
        """Record a deposit's score; the parked requests that may now be answered:
        (token, round, scores)."""
        self.latest[trainer] = max(round_, self.latest.get(trainer, 0))
        if round_ < FINAL_ROUND:   # a final model is on no board: it only shows its trainer past every round
            if round_ not in self.frozen:
                self.rounds.setdefault(round_, {})[trainer] = score
            newest = max(round_, *self.rounds, *self.frozen)
            for r in [r for r in self.rounds if r < newest - self.KEEP]:
                del self.rounds[r]
            for r in [r for r in self.frozen if r < newest - self.KEEP]:
                del self.frozen[r]
        return self._release()

    def get(self, round_: int, token: Hashable) -> dict[int, float] | None:
        board = self.board(round_)
        if board is None:
            self._waiting.append((round_, token))
        return board

    def set_live(self, live: Iterable[int]) -> list[tuple[Hashable, int, dict[int, float]]]:
        self.live = set(live)
        return self._release()

    def board(self, round_: int) -> dict[int, float] | None:
        if round_ not in self.frozen:
            if not all(self.latest.get(t, 0) >= round_ for t in self.live):
                return None
            self.frozen[round_] = dict(self.rounds.get(round_, {}))
        return self.frozen[round_]

    def state_dict(self) -> dict:
        """The scores and the frozen boards, for a checkpoint: a restored shard answers a
        round's board as before, never a second, different one. The live trainers come
        from the membership; the parked requests are resent by their askers."""
        return {"rounds": {r: dict(s) for r, s in self.rounds.items()}, "latest": dict(self.latest),
                "frozen": {r: dict(s) for r, s in self.frozen.items()}}

    def load_state_dict(self, sd: dict) -> None:
        """`sd` from `state_dict`; an empty one (a checkpoint older than it) holds nothing."""
        scores = lambda boards: {int(r): {int(t): float(v) for t, v in s.items()}  # noqa: E731
                                 for r, s in boards.items()}
        self.rounds, self.frozen = scores(sd.get("rounds", {})), scores(sd.get("frozen", {}))
        self.latest = {int(t): int(r) for t, r in sd.get("latest", {}).items()}

    def _release(self) -> list[tuple[Hashable, int, dict[int, float]]]:
        ready, still = [], []
        for r, token in self._waiting:
            board = self.board(r)
            if board is None:
                still.append((r, token))
            else:
                ready.append((token, r, board))
        self._waiting = still
        return ready

    @property
    def parked(self) -> int:
        return len(self._waiting)


@dataclass
class Mean:
    """A closed step of a trainer: the mean gradient and buffers of its `count` workers."""
    step: int
    grad: Any
    buffers: Any
    count: int


@dataclass
class _Group:
    step: int = 0                       # the step being collected
    contributors: set = field(default_factory=set)
    grad: Any = None                    # sums of the open step
    buffers: Any = None
    done: Mean | None = None            # the last closed step (answers a late or resent read)
    reads: list = field(default_factory=list)  # parked (rank, clock, token)
    restored: set = field(default_factory=set)  # the open step's contributors from a checkpoint


@dataclass
class Late:
    """The answer to a read of a worker behind its group: continue at `step`. `dropped`:
    the reader's push for the step it read was accepted, then left out when a push ahead
    of the group dropped that open step (counted in `GroupSteps.dropped`, so its step
    line says so)."""
    step: int
    dropped: bool = False


class GroupSteps:
    """A trainer's synchronous data-parallel step, on the shards (an allreduce through
    them). Each worker of trainer t pushes its gradient for step c and reads clock c + 1;
    the read is answered once every live worker of t has pushed step c, with the mean of
    their gradients and buffers: the same arrays for all of them, so replicas that
    start equal stay equal. A worker that leaves shrinks its group (the open step closes
    on the others), as does one that will push for no step before a later one
    (`passed`: its loss was non-finite and it went on to its tournament). A push behind
    the group's step is dropped and its read answered `Late` with the group's step (the
    worker catches up there); a push ahead of it (a worker that the others lag, or a
    shard that restarted) moves the group to its step, dropping the open one: its
    contributors' pushes, already accepted, are counted as dropped and their reads
    answered `Late` with `dropped`, but for those of an open step restored from a
    checkpoint (the lost life closed it with them and answered their reads: no step
    line would say so), unless one reads that step here again (its answer was lost).
    Arrays of a closed step are never modified (they may still be on their way out)."""

    def __init__(self, k: int, live: Iterable[int]):
        self.k = k
        self.live = set(live)
        self.groups: dict[int, _Group] = {}
        self.dropped = 0
        self.past: dict[int, int] = {}   # rank -> the step it pushes for next, when it is past its group's
        self.lost: dict[int, int] = {}   # rank -> the step of its accepted push that an open step's drop left out

    def push(self, rank: int, clock: int, grad: Any, buffers: Any) -> tuple[bool, list[tuple[Hashable, Any]]]:
        """(accepted, the reads that may now be answered: (token, Mean or Late))."""
        t = trainer_of(rank, self.k)
        g = self.groups.setdefault(t, _Group())
        self.past.pop(rank, None)
        if clock < g.step:
            self.dropped += 1
            return False, []
        if clock == g.step and rank in g.contributors:   # again, the shard's last clock of it older: dropped
            self.dropped += 1
            return False, []
        if clock > g.step:
            # (not the pushes of a restored open step that the group left behind: the
            # shard's lost life closed that step with them and answered their reads)
            dropped = g.contributors - g.restored
            self.dropped += len(dropped)
            self.lost.update(dict.fromkeys(dropped, g.step))
            g.step, g.contributors, g.grad, g.buffers, g.restored = clock, set(), None, None, set()
        if g.grad is None:
            g.grad, g.buffers = grad.clone(), buffers.clone()
        else:
            g.grad.add_(grad)
            g.buffers.add_(buffers)
        g.contributors.add(rank)
        if self._complete(t, g):
            self._close(g)
        return True, self._release(g)

    def read(self, rank: int, clock: int, token: Hashable) -> Any:
        """The answer to a read of `clock` (a Mean, or Late), or None: parked."""
        g = self.groups.setdefault(trainer_of(rank, self.k), _Group())
        if clock == g.step + 1:   # it still waits for the open step: the lost life answered it nothing,
            g.restored.discard(rank)   # so a step left behind is dropped for it (counted, said)
        answer = self._answer(g, rank, clock)
        if answer is None:
            g.reads.append((rank, clock, token))
        return answer

    def passed(self, rank: int, step: int) -> list[tuple[Hashable, Any]]:
        """`rank` will push for no step before `step` (a worker whose step had a
        non-finite loss, so pushed nothing, and went on to its tournament): its group's
        open step no longer waits for it, as for a worker that left; the reads that may
        now be answered."""
        t = trainer_of(rank, self.k)
        g = self.groups.get(t)
        if g is None or step <= g.step:
            return []
        self.past[rank] = max(step, self.past.get(rank, step))
        if g.contributors and self._complete(t, g):
            self._close(g)
            return self._release(g)
        return []

    def set_live(self, live: Iterable[int]) -> list[tuple[Hashable, Any]]:
        self.live = set(live)
        out = []
        for t, g in self.groups.items():
            if g.contributors and self._complete(t, g):
                self._close(g)
                out += self._release(g)
        return out

    def state_dict(self) -> dict:
        """Each trainer's open step (its contributors and sums: their pushes are deduped
        by the shard's clocks, so they are not offered again) and last closed step (a
        resent read's answer), for a checkpoint. The sums are copied (the next push adds
        into them); a closed step's arrays are never modified. Parked reads are resent."""
        return {"dropped": self.dropped, "groups": {
            t: {"step": g.step, "contributors": sorted(g.contributors), "grad": _clone(g.grad),
                "buffers": _clone(g.buffers),
                "done": None if g.done is None else {"step": g.done.step, "grad": g.done.grad,
                                                     "buffers": g.done.buffers, "count": g.done.count}}
            for t, g in self.groups.items()}}

    def load_state_dict(self, sd: dict) -> None:
        """`sd` from `state_dict`; an empty one (a checkpoint older than it) holds nothing:
        the groups restart at the first push they see. The sums are copied, as in
        `state_dict`: one checkpoint may be restored more than once."""
        self.dropped = int(sd.get("dropped", 0))
        self.groups = {}
        for t, g in sd.get("groups", {}).items():
            done = g["done"]
            contributors = {int(r) for r in g["contributors"]}
            self.groups[int(t)] = _Group(
                int(g["step"]), contributors, _clone(g["grad"]), _clone(g["buffers"]),
                None if done is None else Mean(int(done["step"]), done["grad"], done["buffers"], int(done["count"])),
                restored=set(contributors))

    def _complete(self, t: int, g: _Group) -> bool:
        return all(r in g.contributors or self.past.get(r, 0) > g.step
                   for r in self.live if trainer_of(r, self.k) == t)

    def _close(self, g: _Group) -> None:
        n = len(g.contributors)
        g.done = Mean(g.step, g.grad.div_(n), g.buffers.div_(n), n)
        g.step, g.contributors, g.grad, g.buffers, g.restored = g.step + 1, set(), None, None, set()

    def _answer(self, g: _Group, rank: int, clock: int) -> Any:
        if g.done is not None and g.done.step == clock - 1:
            return g.done
        return Late(g.step, self.lost.get(rank) == clock - 1) if clock <= g.step else None

    def _release(self, g: _Group) -> list[tuple[Hashable, Any]]:
        ready, still = [], []
        for rank, clock, token in g.reads:
            answer = self._answer(g, rank, clock)
            if answer is None:
                still.append((rank, clock, token))
            else:
                ready.append((token, answer))
        g.reads = still
        return ready

    @property
    def parked(self) -> int:   # (a copy of the groups: a heartbeat thread asks while the serving thread adds)
        return sum(len(g.reads) for g in list(self.groups.values()))


def _clone(x: Any) -> Any:
    """A copy of a tensor (a running sum that the next push adds into), or None."""
    return None if x is None else x.clone()
