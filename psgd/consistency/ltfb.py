"""`ltfb`: Livermore Tournament Fast Batch (Jacobs, Dryden, Pearce, Van Essen, MLHPC'17),
as LBANN runs it: trainers that are data-parallel groups, pairwise or truncation
selection, and population-based hyperparameter exploration.

Trainers: with `mode.trainer_size = k`, ranks t*k .. t*k + k - 1 form trainer t. Its
workers train synchronously, as one data-parallel trainer: every step each pushes its
gradient, and the shards answer all of them with the mean (`tournament.GroupSteps`), on
which each steps its own optimizer, so their replicas stay identical (k = 1: no
per-step traffic at all). Its first live worker, the leader, plays the tournaments for
it on its tournament split; the others take the outcome.

Server rule: the shards are the exchange and the reduction.
- `push` + `pull` (k > 1): the trainer's step mean, as above.
- `put_model` of round r >= 1: a trainer's model (weights, buffers, with
  `mode.exchange = "weights+optimizer"` its optimizer's state, with `mode.explore` its
  hyperparameters) and its score (`tournament.fitness`: higher is better). A request
  for a partner's model of round r is answered with it, or the partner's later one, or
  parked until deposited (`tournament.Exchange`); each trainer's older deposits are
  forgotten. The answer names the rank that deposited it (`player`), and carries the
  `tag` that its depositor drew for it, as an outcome's does (below).
- `put_model` of round -r (k > 1): what the trainer carries out of round r (its model,
  optimizer state and hyperparameters, and the decision), stored once per trainer for
  its other workers, who ask for it with `get_model` of round -r; asked for `exact`ly
  (a worker rejoining the trainer, `trainer_model`), it is answered only if it is round
  r's, else refused, never parked. Each answer carries the `tag` that the leader drew for
  that deposit: a leader restarted partway through depositing (a round's model or its
  outcome) deposits that round again, and its second deposit replaces the first, so a
  reader takes a deposit only when every shard's slice carries the same tag, else asks
  again (`one_deposit`, `whole_deposit`). The index (`models`) lists each trainer's
  latest outcome's round beside the deposits, and the tags of both.
- `get_model` with owner -1 (truncation): every live trainer's score of round r,
  parked until all of them have deposited it (`tournament.Scoreboard`).

Worker schedule: every `mode.round_steps` steps, while at least one whole local round
follows (LBANN ends with a final local round after the last tournament), the leader
1. scores its model on its tournament split (`mode.metric`: accuracy or loss) and
   deposits it;
2. pairwise: fetches the model of the partner trainer that `pairings(seed, round,
   live trainers)` names (an odd trainer sits out), scores it on the same split and
   keeps it only if strictly better; truncation: ranks the round's scores and, in the
   bottom `truncation_k`, takes the model of a random top-k trainer;
3. on adopting, takes the partner's hyperparameters times (1 - m) or (1 + m)
   (`mode.mutation`); with `weights+optimizer` also its optimizer state;
4. deposits the outcome for its group; every worker writes a `tournament` line.
A diverged trainer (a non-finite loss) makes no update at that step and loses its next
round, whatever its loss does until then (`LtfbSchedule.diverge`); in a group its step
is dropped, or at a round's last step closed on the others (`GroupSteps.passed`). A
deposit that a shard lost (restored from an older checkpoint), or holds as another
deposit of the same round (restored from one taken between the two), is made again
while its trainer waits for its partner's (`keep_deposit`); an outcome, while its
leader's next group step waits for the followers that wait for it (`group_exchange`).

The global model (for the evaluator, and a worker rejoining a trainer of one) is the
best-scored deposit of the latest round: its (round, trainer) is chosen once from every
shard's index and then fetched exactly from every shard, so its slices never mix two
trainers (nor two deposits of its round: `one_deposit`). A worker rejoining a trainer
group continues from its own trainer's model, as its other workers hold it
(`trainer_model`), at that model's round; a new process for a rank whose earlier one
played a round and ended before its outcome plays the round again (`left_unplayed`):
its followers wait for that outcome.
"""
from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Callable
from typing import Any

import torch

from .. import wire
from ..sharding import model_grads
from ..workers.client import Cancelled
from . import data_split
from .pushpull import caught_up, load
from .rule import (
    FINAL_ROUND,
    REFUSED,
    Answer,
    AnswerModel,
    Decision,
    Deposit,
    Diverged,
    Fetch,
    Forget,
    Push,
    Read,
    Refuse,
    Schedule,
    ServerRule,
    Store,
    Trainer,
    lower_lr,
    make_local_optimizer,
    schedule_lr,
    waited,
)
from .tournament import (
    Exchange,
    GroupSteps,
    Late,
    Scoreboard,
    adopt,
    draw_hyper,
    fitness,
    mutate,
    pairings,
    trainer_of,
    trainers,
    truncation,
)

FETCH_TRIES = 5   # a chosen deposit can be replaced by a newer one between index and fetch
DEPOSIT_WAIT_S = 0.05   # then 0.1, 0.2, 0.4 s: for a deposit to reach every shard (`global_model`, `trainer_model`)
SCORES = -1       # get_model's owner for a round's scores (truncation)
META = ("adopted", "partner", "local_score", "partner_score")  # then the hyperparameters, in key order
NOT_HELD = -1.0   # an outcome's "adopted" when the leader held no tournament (time budget)
DIVERGED_ROUNDS = 3   # a trainer diverging this many rounds in a row ends the job (`diverge`)
FINAL = FINAL_ROUND  # the round of the trainers' final models (after the last local round)


class LtfbRule(ServerRule):
    name = "ltfb"
    serves = frozenset({"put_model", "get_model", "models", "pull", "push"})

    def __init__(self, mode, world, tables):
        super().__init__(mode, world, tables)
        self.k = mode.trainer_size
        self.exchange = Exchange()
        self.outcomes = Exchange()
        self.scores: dict[tuple[int, int], float] = {}   # stored (round, trainer) -> score
        self.players: dict[tuple[int, int], int] = {}    # stored (round, trainer) -> the rank that deposited it
        self.tags: dict[Any, int | None] = {}   # stored key -> the tag of its deposit (None: it had none)
        self.trainers = trainers(range(world), self.k)   # the job's trainers, whose models one may fetch
        self.board = Scoreboard(self.trainers)
        self.groups = GroupSteps(self.k, range(world))

    # ------------------------------------------------------------ tournaments
    def deposit(self, e: Deposit) -> list[Decision]:
        owner = trainer_of(e.rank, self.k)
        if e.round < 0:
            outcome = ("outcome", owner)
            if -e.round < self.outcomes.latest.get(owner, (-1, None))[0]:
                # A resend of an earlier round's outcome, late (its first send's answer ended the
                # leader's wait): stored, it replaced the newer outcome's arrays under the one key,
                # and a follower asking for the newer round got the older model, labelled newer.
                return [Answer(e.token)]
            self.tags[outcome] = e.tag
            out: list[Decision] = [Store(outcome, e.score, e.arrays), Answer(e.token)]
            return out + [self.answer_outcome(t, e.round, owner)
                          for t, _ in self.outcomes.put(-e.round, owner, outcome)]
        key = (e.round, owner)
        self.scores[key] = e.score
        self.players[key] = e.rank
        self.tags[key] = e.tag
        out = [Store(key, e.score, e.arrays), Answer(e.token)]
        out += [self.answer_model(t, k) for t, k in self.exchange.put(e.round, owner, key)]
        out += [self.answer_scores(t, r, b) for t, r, b in self.board.put(e.round, owner, e.score)]
        keep = self.exchange.keys()
        gone = [k for k in self.scores if k not in keep]
        for k in gone:
            del self.scores[k]
            self.players.pop(k, None)
            self.tags.pop(k, None)
        return out + ([Forget(gone)] if gone else [])

    def fetch(self, e: Fetch) -> list[Decision]:
        if e.owner == SCORES:
            out: list[Decision] = []
            if e.score is not None and e.rank >= 0:   # the asker's own score, as it deposited it: a shard
                # restored from a checkpoint older than that deposit learns it again from the resent request
                # (else the board waited for good for trainers that wait on the board)
                out += [self.answer_scores(t, r, b)
                        for t, r, b in self.board.put(e.round, trainer_of(e.rank, self.k), e.score)]
            board = self.board.get(e.round, e.token)
            return out + ([] if board is None else [self.answer_scores(e.token, e.round, board)])
        if e.owner not in self.trainers:   # (parked, it would wait for a deposit that never comes)
            return [Refuse(e.token, REFUSED, f"there is no trainer {e.owner} (trainers 0..{len(self.trainers) - 1}, "
                                             f"or {SCORES}: a round's scores)")]
        if e.round < 0:
            if e.exact:   # a worker (re)joining the trainer: that round's outcome or none, never parked
                have = self.outcomes.latest.get(e.owner)   # (`trainer_model`)
                if have is None or have[0] != -e.round:
                    return [Refuse(e.token, REFUSED, f"no outcome of trainer {e.owner} for round {-e.round} here",
                                   False)]
                return [self.answer_outcome(e.token, e.round, e.owner)]
            out = []
            if e.rank >= 0 and trainer_of(e.rank, self.k) == e.owner:   # a worker of the trainer, at round -r's
                # tournament, pushes for no step before it: its group's step does not wait for it (its loss was
                # non-finite; else the step closed already), or its leader would wait for good (`GroupSteps.passed`)
                out = [self.answer_step(t, a) for t, a in self.groups.passed(e.rank, -e.round * self.mode.round_steps)]
            found = self.outcomes.get(-e.round, e.owner, e.token)
            return out + ([] if found is None else [self.answer_outcome(e.token, e.round, e.owner)])
        if e.exact:
            key = (e.round, e.owner)
            if key not in self.scores:   # (replaced since the reader saw the index: it tries again; not bad)
                return [Refuse(e.token, REFUSED, f"no deposit of trainer {e.owner} for round {e.round} here", False)]
            return [self.answer_model(e.token, key)]
        found = self.exchange.get(e.round, e.owner, e.token)
        return [] if found is None else [self.answer_model(e.token, found)]

    def answer_model(self, token: Any, key: Any) -> AnswerModel:
        """`key` is a stored (round, trainer); `player`: the rank that deposited it (-1:
        unknown, restored from a checkpoint that did not keep it)."""
        return self.tagged(token, key, {"round": key[0], "owner": key[1], "score": self.scores[key],
                                        "player": self.players.get(key, -1)})

    def answer_outcome(self, token: Any, round_: int, owner: int) -> AnswerModel:
        """`owner`'s latest outcome, asked for as round `round_` (< 0)."""
        return self.tagged(token, ("outcome", owner), {"round": round_, "owner": owner})

    def tagged(self, token: Any, key: Any, fields: dict) -> AnswerModel:
        """The stored model `key`, with the `tag` that names its deposit: a reader tells
        its slices from those of another deposit of the same round (`one_deposit`). No
        tag for one deposited without it (restored from a checkpoint that did not keep
        tags)."""
        tag = self.tags.get(key)
        return AnswerModel(token, key, fields if tag is None else {**fields, "tag": tag})

    @staticmethod
    def answer_scores(token: Any, round_: int, board: dict[int, float]) -> Answer:
        return Answer(token, {"round": round_, "scores": [[t, s] for t, s in sorted(board.items())]})

    def index(self, token: Any) -> list[Decision]:
        """The deposits held, [[round, trainer, score], ...], each trainer's latest
        outcome, [[round, trainer], ...] (`trainer_model`), and the tags of both,
        [[round, trainer, tag], ...], an outcome's round negative, as deposited (a leader
        tells its own deposit from another of the same round: `holds`)."""
        deposits, latest = sorted(self.scores.items()), sorted(self.outcomes.latest.items())
        return [Answer(token, {"models": [[r, o, s] for (r, o), s in deposits],
                               "outcomes": [[r, o] for o, (r, _) in latest],
                               "tags": [[r, o, self.tags.get((r, o))] for (r, o), _ in deposits]
                               + [[-r, o, self.tags.get(("outcome", o))] for o, (r, _) in latest]})]

    # ------------------------------------------------------------ a trainer's steps
    def push(self, e: Push) -> list[Decision]:
        accepted, ready = self.groups.push(e.rank, e.clock, e.grad, e.buffers)
        out: list[Decision] = [Answer(e.token, {"staleness": 0} if accepted else {"dropped": True})]
        return out + [self.answer_step(t, a) for t, a in ready]

    def gated_read(self, e: Read) -> list[Decision]:
        if e.clock <= 0:   # not a step's read: the initial model (`global_model`)
            return [self.answer(e)]
        answer = self.groups.read(e.rank, e.clock, e.token)
        return [] if answer is None else [self.answer_step(e.token, answer)]

    @staticmethod
    def answer_step(token: Any, mean: Any) -> Answer:
        """A step's read: the group's mean gradient and buffers, or where a late worker
        continues."""
        if isinstance(mean, Late):
            return Answer(token, {"late": True, "step": mean.step, "dropped": mean.dropped})
        return Answer(token, {"step": mean.step + 1, "count": mean.count}, arrays=[mean.grad, mean.buffers])

    def membership(self, live: dict[int, int]) -> list[Decision]:
        out: list[Decision] = [self.answer_step(t, a) for t, a in self.groups.set_live(live)]
        return out + [self.answer_scores(t, r, b) for t, r, b in self.board.set_live(trainers(live, self.k))]

    def state_dict(self) -> dict:
        """Everything the rule answers from between requests: the latest deposit and
        outcome of each trainer, their scores and players, their tags, the truncation
        boards and the groups' steps. The models themselves are the shard's
        (`Shard.state_dict`); parked requests are resent by their askers to a restored
        shard."""
        return {**super().state_dict(), "exchange": self.exchange.state_dict(),
                "outcomes": self.outcomes.state_dict(),
                "scores": [[r, o, s] for (r, o), s in sorted(self.scores.items())],
                "players": [[r, o, p] for (r, o), p in sorted(self.players.items())],
                "deposit_tags": dict(self.tags),
                "board": self.board.state_dict(), "groups": self.groups.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        """A key that is missing (a checkpoint written before it was kept) is empty: its
        deposits' tags unknown (also those of a checkpoint that kept its outcomes' alone,
        as "tags")."""
        super().load_state_dict(sd)
        self.exchange.load_state_dict(sd.get("exchange", {}))
        self.outcomes.load_state_dict(sd.get("outcomes", {}))
        self.scores = {(int(r), int(o)): float(s) for r, o, s in sd.get("scores", [])}
        self.players = {(int(r), int(o)): int(p) for r, o, p in sd.get("players", [])}
        self.tags = dict(sd.get("deposit_tags", {}))
        self.board.load_state_dict(sd.get("board", {}))
        self.groups.load_state_dict(sd.get("groups", {}))

    def new_run(self) -> None:
        super().new_run()
        self.groups.dropped = 0

    def parked(self) -> int:
        return self.exchange.parked + self.outcomes.parked + self.board.parked + self.groups.parked

    def stats(self) -> dict:
        return {**super().stats(), "dropped": self.groups.dropped}


def holds(index: Any, trainer: int, rnd: int, tag: int | None) -> bool:
    """Does a shard's index (its `models` answer) hold trainer `trainer`'s deposit of
    round `rnd` (its outcome, where `rnd` < 0) tagged `tag`, or one of a later round? A
    deposit of that round with another tag is another deposit (a shard restored from a
    checkpoint taken between two deposits of the round keeps the first): the readers
    never take slices of two (`one_deposit`), so it is made again."""
    if rnd < 0:
        later = any(int(o) == trainer and int(r) > -rnd for r, o in index.get("outcomes") or ())
    else:
        later = any(int(o) == trainer and int(r) > rnd for r, o, _ in index.get("models"))
    return later or [rnd, trainer, tag] in (index.get("tags") or ())


def choose_best(indexes: list[list]) -> tuple[int, int] | None:
    """The global model's (round, trainer), from each shard's index of [round, trainer,
    score]: among the deposits that every shard holds, the latest round, then the best
    score, then the lower trainer. None before any complete deposit."""
    held = [{(int(r), int(o)): float(s) for r, o, s in idx} for idx in indexes]
    common = set(held[0]).intersection(*held[1:]) if held else set()
    if not common:
        return None
    latest = max(r for r, _ in common)
    return max((k for k in common if k[0] == latest), key=lambda k: (held[0][k], -k[1]))


def global_model(client: Any) -> list:
    """The best trainer's model, all of its slices from the same deposit; the initial
    model (the shards' tables) before the first round. A deposit on its way to some of
    the shards (each keeps a trainer's latest only: for a moment no deposit is on every
    shard, or some hold the round's deposit made again and the others the first one:
    `one_deposit`) is waited for, briefly, where the client can wait (`rule.waited`);
    after that, the shards' tables."""
    for attempt in range(FETCH_TRIES):
        indexes = [m.get("models") for m in client.index()]
        best = choose_best(indexes)
        if best is None:
            if any(indexes) and attempt < FETCH_TRIES - 1 and waited(client, DEPOSIT_WAIT_S * 2 ** attempt):
                continue
            return client.pull(-1)
        got = client.get_model(best[0], best[1], exact=True, missing_ok=attempt < FETCH_TRIES - 1)
        if got is not None and one_deposit(got):
            return got
        if got is not None and (attempt == FETCH_TRIES - 1 or not waited(client, DEPOSIT_WAIT_S * 2 ** attempt)):
            return client.pull(-1)   # (still slices of two deposits of the round: none is whole on every shard)
    raise AssertionError("unreachable: the last try returns or raises")


def trainer_model(client: Any, trainer: int) -> tuple[list, int]:
    """What a worker (re)joining trainer `trainer`'s group (k > 1) continues from, and the
    round whose step it continues at: what its other workers hold, every slice of one
    deposit. Of the trainer's latest round r that every shard holds (each keeps the
    trainer's latest deposit and latest outcome), its outcome (the model, optimizer state
    and hyperparameters that each of its workers left the round with; under a time
    budget, the last one, deposited with no tournament held and no deposit of its round),
    or, where the deposit of a later round is the latest (that round's tournament under
    way, or its leader gone before its outcome), the model the trainer entered that round
    with (after the last round, its final model). A newer round on its way to some shards
    is waited for, briefly (`DEPOSIT_WAIT_S`, as `global_model` waits), where the client
    can wait, and so is a model whose slices are of two deposits (`one_deposit`: never
    taken; in the end, the other of the two is, in its place, or with none, the best
    trainer's as below); after that, the latest round on every shard: the group's step
    moves the worker on from there (`group_mean`), and it takes the next round's outcome
    at that step. Before the trainer's first round, the initial model, where its workers
    began. Where no model of its trainer is on every shard (shards restored from
    checkpoints of different rounds), the best trainer's (`global_model`), at its
    trainer's latest round on any shard: its group's model is on no shard then, and a
    trained model is nearer to it than the initial one (a returning leader would hand
    that to its whole group)."""
    for attempt in range(FETCH_TRIES):
        indexes = client.index()
        deposits = [{int(r) for r, o, _ in m.get("models") if int(o) == trainer} for m in indexes]
        outcomes = [{int(r) for r, o in m.get("outcomes") or () if int(o) == trainer} for m in indexes]
        latest = max((r for held in deposits + outcomes for r in held), default=0)
        if not latest:
            return client.pull(-1), 0
        outcome = max(set.intersection(*outcomes), default=0)
        deposit = max(set.intersection(*deposits), default=0)
        if (max(outcome, deposit) < latest and attempt < FETCH_TRIES - 1
                and waited(client, DEPOSIT_WAIT_S * 2 ** attempt)):
            continue
        # (the later round first; of one round, its outcome, after its tournament, before its deposit)
        for rnd, _, asked in sorted([(outcome, 1, -outcome), (deposit, 0, deposit)], reverse=True):
            got = client.get_model(asked, trainer, exact=True, missing_ok=True) if rnd else None
            if got is not None and one_deposit(got):
                return got, rnd
            if got is not None and attempt < FETCH_TRIES - 1 and waited(client, DEPOSIT_WAIT_S * 2 ** attempt):
                break   # slices of two deposits of the round: the later one on its way to some shards
    return global_model(client), latest


def one_deposit(got: list) -> bool:
    """Are the shards' answers with a model (a round's deposit, or an outcome) the slices
    of one deposit: of the same round, with the same `tag` on every one (or none on any:
    restored from checkpoints that did not keep tags)? A leader restarted partway through
    depositing a round's model or outcome, which reached only some shards, deposits that
    round again (it plays the round again, `left_unplayed`; or, no model of the round
    whole on every shard, it trains the round again), and its deposit, which may differ,
    replaces the first one: until it has reached every shard, some hold each."""
    return len({(m.get("round"), m.get("tag")) for m in got}) == 1


def whole_deposit(client: Any, got: list | None, again: Callable[[list], list | None]) -> list | None:
    """`got`, a model from every shard, if its slices are of one deposit; else read
    `again` (given the answers that differ) from every shard, after a brief wait
    (`DEPOSIT_WAIT_S`, then twice as long each time) where the client can wait, for the
    later deposit to reach every shard. None where they still differ after `FETCH_TRIES`
    reads, or a read gives none (refused: a shard moved on; cancelled): a mix of two
    deposits is never taken."""
    for attempt in range(FETCH_TRIES):
        if got is None or one_deposit(got):
            return got
        if attempt == FETCH_TRIES - 1 or not waited(client, DEPOSIT_WAIT_S * 2 ** attempt):
            break
        got = again(got)
    return None


def new_tag() -> int:
    """A tag naming one deposit (`one_deposit`): random, from the OS (a new process of
    the leader's rank, whose random modules a job's seed may have seeded as the one
    before, must not draw the tag of its deposit again), within the wire's ints,
    and of a fixed size on it (61 random bits under a set 62nd: always msgpack's 9
    bytes, so that the simulator's byte counts do not vary from run to run)."""
    return 1 << 61 | secrets.randbits(61)


def pack_meta(values: list[float], size: int) -> torch.Tensor:
    """Float64 values, bit for bit, in the first entries of a float32 array of `size`
    (a deposit's arrays are params-sized float32)."""
    bits = torch.tensor(values, dtype=torch.float64).view(torch.float32)
    if bits.numel() > size:
        raise ValueError(f"ltfb: shard 0 holds {size} parameters, too few to carry {len(values)} "
                         f"tournament values; use fewer cluster.servers or fewer mode.explore keys")
    out = torch.zeros(size)
    out[:bits.numel()] = bits
    return out


def unpack_meta(array: torch.Tensor, n: int) -> list[float]:
    return array[:2 * n].clone().view(torch.float64).tolist()


class LtfbSchedule(Schedule):
    local_optimizer = needs_score = True

    def __init__(self, cfg):
        super().__init__(cfg)
        m = cfg.mode
        self.k = m.trainer_size
        self.data_split = data_split(cfg)
        self.with_opt = m.exchange == "weights+optimizer"
        self.explore = dict(m.explore)
        self.hyper: dict[str, float] = {}
        self.diverged = False   # a non-finite loss since the last tournament (`diverge`)
        self.lost_to_divergence = 0   # tournaments in a row that this trainer entered diverged
        self.sparse: dict[str, int] = {}   # parameters whose gradients are sparse -> their sparse_dim (`group_step`)
        self.outcome: tuple[int, float, list, int] | None = None   # the leader's last outcome deposit (round,
        # score, arrays, tag), until its next group step closes (`group_exchange`)
        self.deposit_tag: int | None = None   # the tag of the leader's last tournament deposit (`keep_deposit`)

    # ------------------------------------------------------------ set-up
    def start(self, w: Trainer) -> None:
        self.trainer = trainer_of(w.rank, self.k)
        self.opt = make_local_optimizer(w)
        self.scripts_optimizer = self.opt is getattr(w, "user_optimizer", None)
        self.set_hyper(draw_hyper(self.explore, self.cfg.job.seed, self.trainer))
        if w.clock or w.taken_back:   # a worker restarted into the job: its trainer's model, with its values
            self.rejoin(w, restarted=w.taken_back)   # (at clock 0 too: its rank's heartbeats had said none)
        else:   # the job's start: its own draw on the initial model, even if a trainer that started
            got = w.client.pull(-1)   # sooner has deposited a round already; or a resumed job's
            if not (any(int(m.get("version", 0)) for m in got) and self.resume(w)):   # (a deposit moves it)
                load(w, got)
        self.t_round = w.now()
        self.round_s = 0.0

    def rejoin(self, w: Trainer, restarted: bool = False) -> None:
        """A worker (re)joining the job (restarted into it, or taken back after a
        partition) continues where its trainer is (`catch_up`), from its trainer's model:
        in a group (k > 1) the one its other workers hold (`trainer_model`: the best
        trainer's split the group in two, and a rejoining leader handed it to its whole
        group at its next tournament), at the step of the round it loaded (read once: a
        deposit landing between two reads of the index put it a round ahead of its
        model); a trainer of one, whose model went with its worker, from the best
        trainer's (`global_model`). Loaded the model its trainer entered a round with (the
        round's tournament under way), it keeps it: its steps never cross that round
        again, so its group is split until the next outcome (waiting for the round's
        outcome deadlocked a returning leader and the followers waiting for it, each for
        the other); but a new process for the rank that played that round, `restarted`
        before the coordinator missed the one before (the register's `taken_back`), plays
        it again (`left_unplayed`): its followers wait for the round's outcome, which
        nobody else deposits. (Dropped before it came back, after a partition or as a new
        process, it had left the live set, which ended their wait: they kept the model it
        loaded.)"""
        if self.k == 1:
            self.continue_from(w, global_model(w.client))
            self.catch_up(w)
            return
        got, rnd = trainer_model(w.client, self.trainer)
        self.continue_from(w, got)
        self.catch_up(w, rnd)
        if restarted and self.left_unplayed(w, got, rnd):
            w.note(f"round {rnd}: an earlier process of this worker played it for trainer {self.trainer} and "
                   f"ended before its outcome; playing it again")
            self.lead(w, rnd)

    def left_unplayed(self, w: Trainer, got: list, rnd: int) -> bool:
        """Is `got`, loaded at round `rnd`'s step, this rank's tournament deposit with no
        outcome (`trainer_model` takes a round's outcome before its deposit)? Then an
        earlier process of this rank played the round and ended before its outcome. The
        trainer's other workers wait for that outcome (`follow`) until its leader leaves
        the live set, which a worker restarted before the coordinator missed it never did:
        its group step waited for their push, and the job hung. Playing the round again,
        from the model it entered the round with, deposits the outcome they wait for. (Not
        another rank's round: that rank deposits its outcome, and a second one, unlike it,
        would be on the shards beside it: every shard must say that this rank deposited it.)"""
        m = got[0]
        return (0 < rnd < FINAL and m.get("round") == rnd and m.get("owner") == self.trainer
                and all(s.get("player") == w.rank for s in got) and w.clock == rnd * self.cfg.mode.round_steps)

    def continue_from(self, w: Trainer, got: list) -> None:
        """Load a deposit, or an outcome, with the hyperparameters deposited with it (a
        restarted worker's optimizer, fresh, has no state that the deposit's can fill:
        `load_opt_state`; it starts anew): explored values change only by adoption and
        mutation, so a restarted worker does not go back to its trainer's initial draw.
        The shards' tables (no deposit yet): the initial model, with the values we have."""
        load(w, got)
        if got[0].get("owner") is None:
            return
        self.carry_on(w, got)

    def carry_on(self, w: Trainer, got: list) -> None:
        """What travels with a deposit that a (re)starting worker continues from: the
        optimizer state (weights+optimizer; an outcome's always, as its group's workers
        took it: `follow`) and the explored values."""
        outcome = int(got[0].get("round")) < 0
        if self.with_opt or outcome:
            self.load_opt_state(w, got, with_meta=outcome or bool(self.explore))
        if self.explore:
            self.set_hyper(self.read_meta(got)[1])

    def resume(self, w: Trainer) -> bool:
        """A job resumed from its shards' checkpoints: its workers register at clock 0 (a
        new run's coordinator), and the shards hold deposits of their own trainer, which
        a job's start cannot have (a trainer's first deposit waits for its workers' steps).
        The trainer continues from its own latest deposit that every shard holds (weights,
        buffers, explored values; its optimizer starts anew, as `rejoin`'s) at that
        round's step (`catch_up`): the model it entered that round's tournament with, so
        an adoption there is not in it (a group's outcome deposit, which has it, is not
        read); its steps after that round are lost. Before, every
        worker began again from the initial model at step 0. With the shards restored from
        checkpoints of different rounds, no deposit of its own is on every shard: what a
        restarted worker takes (`rejoin`). False where no shard
        holds a deposit of its trainer: the job's start. Asked only of shards whose tables
        have a version past 0 (a deposit made it): a job's start asks nothing more."""
        held = [{int(r) for r, o, _ in m.get("models") if int(o) == self.trainer and int(r) > 0}
                for m in w.client.index()]
        if not any(held):
            return False
        common = set.intersection(*held)
        got = w.client.get_model(max(common), self.trainer, exact=True, missing_ok=True) if common else None
        if got is None or not one_deposit(got):   # (or two deposits of the round: checkpoints between them)
            self.rejoin(w)
            return True
        load(w, got)
        self.catch_up(w, max(common))
        self.carry_on(w, got)
        return True

    def catch_up(self, w: Trainer, rnd: int | None = None) -> None:
        """Move a (re)joining worker's clock up to the latest tournament round that its
        trainer deposited on any shard, where the trainer was: a restarted worker
        registers at the coordinator's last record of its rank's clock, which may be far
        behind it (a coordinator stopped or killed with its workers). Left there, it
        redid those steps (its rank trained past train.steps), and its tournaments asked
        for rounds that its partner had played long before: with shards restored from
        checkpoints of different rounds, no deposit of the partner was on every shard,
        and the two trainers waited for each other for good. Its own trainer's round, not
        the others' (a group's other workers may be behind them: a worker ahead of its
        group would make it skip steps; one behind it is moved up by the group's step,
        `group_mean`). Never past the budget; a final deposit says that the trainer spent
        a budget of steps (killed before the coordinator heard its end, it redid all of
        them), so the worker has nothing left to train (under a time budget the job's
        time says so). `rnd`: the round of the model it loaded (`rejoin`), else its
        trainer's latest on any shard."""
        if rnd is None:
            rnd = max((int(r) for m in w.client.index() for r, o, _ in m.get("models") if int(o) == self.trainer),
                      default=0)
        steps = self.cfg.train.steps
        if 0 < rnd < FINAL:
            w.clock = caught_up(w, rnd * self.cfg.mode.round_steps)
        elif rnd == FINAL and steps:
            w.clock = max(w.clock, steps)

    def set_hyper(self, hyper: dict[str, float]) -> None:
        """The trainer's hyperparameters into its optimizer (the learning rate through its
        schedule, `opt_cfg`; a training script's own optimizer, whose rate `schedule_lr`
        leaves alone, takes it into its param groups, where the script's own scheduler,
        if any, may change it)."""
        self.hyper = dict(hyper)
        values = {key.split(".", 1)[1]: v for key, v in hyper.items()}
        base = self.cfg.optimizer
        self.opt_cfg = dataclasses.replace(base, lr=values["lr"]) if "lr" in values else base
        for name, v in values.items():
            for g in self.opt.param_groups:
                if name == "momentum" and "betas" in g:   # Adam's momentum is beta1
                    g["betas"] = (v, g["betas"][1])
                elif name != "lr" or self.scripts_optimizer:
                    g[name] = v

    # ------------------------------------------------------------ steps
    def step(self, w: Trainer) -> None:
        w0 = w.client.wait_s
        schedule_lr(w, self.opt, self.opt_cfg)
        loss = w.compute()
        finite = math.isfinite(loss)
        if not finite:
            self.diverge(w, loss)
        before = w.clock
        applied, dropped = (True, False) if not finite or self.k == 1 else self.group_mean(w)
        if applied:
            if finite:
                self.opt.step()
            w.clock += 1
        R = self.cfg.mode.round_steps
        extra: dict[str, Any] = {"dropped": dropped} if self.k > 1 else {}
        if w.clock != before and w.clock % R == 0:   # (also a worker behind its group that moved to its step
            now = w.now()                             # there: the step its leader played the round at)
            self.round_s, self.t_round = now - self.t_round, now
            try:
                self.tournament(w, w.clock // R)
            except wire.Refused:   # (a restarted shard's not_ready): the step trained, only its round was
                w.log_step(0, w.client.wait_s - w0, **extra, refused=True)   # refused (the worker counts it
                raise                                                           # in `rejected`)
        w.log_step(0, w.client.wait_s - w0, **extra)

    def diverge(self, w: Trainer, loss: float) -> None:
        """A non-finite loss (a learning rate too high: `mode.explore` draws some): the
        worker makes no update at this step and pushes nothing for it (its group drops the
        step, or at a round's last step closes it on the others' mean: `GroupSteps.passed`),
        and the trainer loses its next tournament (`lead`; a group's when it is its
        leader's loss), whatever its loss does until then: its later steps update it as
        usual (in a group they must: its replica follows the group's mean).
        Diverged, which ends the job, when no tournament can replace its model: no other
        live trainer, or no tournament before the budget's end; or when it diverged again
        with the model (and hyperparameters) it took at each of its last DIVERGED_ROUNDS - 1
        tournaments: a learning rate too high for every trainer, which would otherwise
        train the whole budget on models that keep diverging."""
        R, steps = self.cfg.mode.round_steps, self.cfg.train.steps
        ahead = not steps or (w.clock // R + 1) * R + R <= steps   # (`due` at the next tournament)
        if not ahead or len(trainers(w.live() | {w.rank}, self.k)) < 2:
            raise Diverged(f"loss is {loss} at step {w.clock}; {lower_lr(w)}")
        if self.lost_to_divergence >= DIVERGED_ROUNDS - 1:
            raise Diverged(f"loss is {loss} at step {w.clock}, in {DIVERGED_ROUNDS} rounds in a row of trainer "
                           f"{self.trainer}, the last {DIVERGED_ROUNDS - 1} with the model it took at its "
                           f"tournament; {lower_lr(w)}"
                           f"{' (or narrow mode.explore)' if self.explore else ''}")
        if not self.diverged:
            w.note(f"loss is {loss} at step {w.clock}: trainer {self.trainer} diverged; this step makes no update "
                   f"and the trainer loses its next tournament")
        self.diverged = True

    def group_mean(self, w: Trainer) -> tuple[bool, bool]:
        """Replace the gradient with the trainer's mean (and the buffers with theirs):
        (applied, dropped). Not applied for a worker behind its group: it skips the
        update and moves to the group's step. Dropped: a shard left this worker's
        gradient out of the step (a late push, or an accepted one whose open step a push
        ahead of the group dropped), as the shard counts it in `dropped`."""
        pushed, pulled = self.group_exchange(w)
        dropped = any(bool(m.get("dropped")) for m in [*pushed, *pulled])
        if any(m.get("late") for m in pulled):
            w.note(f"behind trainer {self.trainer}'s step at clock {w.clock}; continuing at its step")
            w.clock = max(w.clock, max(int(m.get("step", 0)) for m in pulled))
            return False, dropped
        # A parameter whose gradients are sparse (nn.Embedding(sparse=True)'s) gets the mean
        # back sparse, over its rows where the mean is not zero: an optimizer for sparse
        # gradients (SparseAdam) raised on a dense one. So does one that had a sparse
        # gradient at an earlier step and none at this one (the group's rows may be others).
        model = w.replica.model
        self.sparse.update({n: p.grad.sparse_dim() for n, p in model.named_parameters()
                            if p.requires_grad and p.grad is not None and p.grad.layout == torch.sparse_coo})
        for p in model.parameters():   # (the mean is written over every one: dense, as the tables)
            if p.requires_grad and (p.grad is None or p.grad.layout != torch.strided):
                p.grad = torch.zeros_like(p)
        grads = model_grads(model)
        for i, m in enumerate(pulled):
            w.replica.map.scatter(wire.tensor(m, 0), i, "params", grads)
        for n, p in model.named_parameters():
            if n in self.sparse:
                p.grad = grads[n].to_sparse(self.sparse[n])
        w.replica.load(None, [wire.tensor(m, 1) for m in pulled])
        return True, dropped

    def group_exchange(self, w: Trainer) -> tuple[list, list]:
        """The step's push and the group's mean (`push_pull`). The leader's first step
        after it deposited an outcome pushes alone, then waits for the mean in windows
        (`cluster.heartbeat_timeout_s`, then twice as long each time up to
        `cluster.timeout_s`, on the worker's clock): a shard restored from a checkpoint
        older than the outcome has lost it, and a follower that waits for it there pushes
        nothing for this step; nobody deposited it again, and the group hung. At each
        window's end the outcome goes again where a shard lacks it (`keep_outcome`), and
        so does the push, as it was encoded (a shard that holds it takes it as a
        duplicate; one restored from a checkpoint older than it has lost it, and a push
        answered is not sent again by the client, as a push with its read is; encoded
        again, a compressed push added the gradient to its error-feedback residual once
        more). Pushing alone costs the leader the round trip of the push's short answer,
        once a round (the client's `push_pull` takes no cancel); a window is waited out
        only where the mean has not come by its end."""
        grads, buffers, versions = w.replica.grads(), w.replica.buffers(), [0] * w.replica.n
        if self.outcome is None:
            return w.client.push_pull(w.clock, grads, buffers, versions)
        sent = w.client.begin_push_pull(w.clock, grads, buffers, versions, pull=False)
        pushed = w.client.finish_push_pull(sent)[0]
        reads = [(i, "pull", {"clock": w.clock + 1}) for i in range(w.replica.n)]
        window = self.cfg.cluster.heartbeat_timeout_s
        while True:
            until = w.now() + window
            try:
                pulled = w.client.request(reads, cancel=lambda until=until: w.now() > until)
            except Cancelled:
                if w.now() <= until:   # (not the window's end: the job's own cancel)
                    raise
                self.keep_outcome(w, *self.outcome)
                w.client.request(sent.reqs)   # (its frames unchanged: no step ran since)
                window = min(2 * window, self.cfg.cluster.timeout_s)
                continue
            self.outcome = None
            return pushed, pulled

    def keep_outcome(self, w: Trainer, rnd: int, score: float, arrays: list, tag: int) -> None:
        """The outcome of round -`rnd` (scored `score`, `arrays` and `tag` as deposited:
        the same deposit) again if a shard holds neither it nor one of a later round
        (`group_exchange`, `holds`)."""
        if all(holds(m, self.trainer, rnd, tag) for m in w.client.index()):
            return
        w.note(f"round {-rnd}: a shard lost trainer {self.trainer}'s outcome (or holds another of the round); "
               f"depositing it again")
        w.client.put_model(rnd, score, arrays, w.clock, tag)

    def finish(self, w: Trainer) -> None:
        """The budget is spent: each trainer's leader deposits its final model, scored,
        in round FINAL, so that the global model (the evaluator's final score,
        model.pt) is the best of the trainers' final models and not the last
        tournament's deposit, which misses the final local round (and, for a budget of
        less than two rounds, is the initial model)."""
        if w.rank != self.leader(w):
            return
        if self.diverged:   # (under a time budget: no tournament came to replace it)
            w.note(f"trainer {self.trainer} diverged after its last tournament; no final model from it")
            return
        acc, loss = w.score()
        self.deposit_model(w, FINAL, fitness(self.cfg.mode.metric, acc, loss))

    def due(self, w: Trainer) -> bool:
        """A tournament only if a whole local round follows it (LBANN's final round)."""
        t = self.cfg.train
        if t.steps and w.clock + self.cfg.mode.round_steps > t.steps:
            return False
        return not (t.seconds and w.now() + self.round_s > t.seconds)   # (the job's time: a restart's too)

    def leader(self, w: Trainer) -> int:
        return min(r for r in w.live() | {w.rank} if trainer_of(r, self.k) == self.trainer)

    # ------------------------------------------------------------ tournaments
    def tournament(self, w: Trainer, rnd: int) -> None:
        leader = self.leader(w)
        held = self.due(w)
        if w.rank != leader:
            if held or self.cfg.train.seconds:   # under a time budget only the leader's clock decides
                self.follow(w, rnd, leader)
            return
        if not held:
            if self.k > 1 and self.cfg.train.seconds:
                self.deposit(w, -rnd, -math.inf, [NOT_HELD, -1.0, math.nan, math.nan], True)
            return
        self.lead(w, rnd)

    def lead(self, w: Trainer, rnd: int) -> None:
        """Play round `rnd` for the trainer. A diverged one loses it: it deposits the
        best trainer's model (`global_model`: a partner waits for a deposit, which must be
        finite) scored as the worst, so that any partner's model, or a top-k one,
        replaces it."""
        if self.diverged:
            if not self.with_opt:   # its momentum (or Adam's moments) diverged too: not for the model it
                self.opt.state.clear()   # takes (with weights+optimizer, that model's state replaces it)
            self.continue_from(w, global_model(w.client))   # (it plays this round, at its clock)
            acc = loss = math.nan
        else:
            acc, loss = w.score()
        self.lost_to_divergence = self.lost_to_divergence + 1 if self.diverged else 0
        self.diverged = False
        metric = self.cfg.mode.metric
        local = fitness(metric, acc, loss)
        params = [t.clone() for t in w.replica.params()]
        buffers = [t.clone() for t in w.replica.buffers()]
        self.deposit_model(w, rnd, local)
        partner, partner_value, adopted = self.select(w, rnd, local)
        if adopted is None:     # nothing to take: our model stays
            adopted = False
        elif not adopted:
            w.replica.load(params, buffers)
        value = acc if metric == "accuracy" else loss
        meta = [float(adopted), -1.0 if partner is None else float(partner), value,
                math.nan if partner_value is None else partner_value]
        if self.k > 1:
            self.deposit(w, -rnd, local, meta, True)
        self.log(w, rnd, w.rank, meta)

    def select(self, w: Trainer, rnd: int, local: float) -> tuple[int | None, float | None, bool | None]:
        """(partner trainer, its score on the metric, adopted); adopted None when there
        was no model to consider. An adopted model is loaded with its optimizer state
        (weights+optimizer) and mutated hyperparameters; a rejected one is left loaded."""
        live = trainers(w.live() | {w.rank}, self.k)
        seed, metric = self.cfg.job.seed, self.cfg.mode.metric
        if self.cfg.mode.strategy == "truncation":
            board = self.scores(w, rnd, local)
            source = truncation(seed, rnd, board, self.cfg.mode.truncation_k).get(self.trainer)
            if source is None:
                return None, None, None
            got = self.fetch(w, rnd, source, local)
            if got is None:
                return source, None, None
            self.take(w, got, rnd)
            s = board[source]
            return source, (s if metric == "accuracy" else -s), True
        partner = pairings(seed, rnd, live).get(self.trainer)
        if partner is None:
            return None, None, None
        got = self.fetch(w, rnd, partner, local)
        if got is None:
            return partner, None, None
        w.replica.load(*w.client.tables(got))
        acc, loss = w.score()
        if not adopt(local, fitness(metric, acc, loss)):
            return partner, acc if metric == "accuracy" else loss, False
        self.take(w, got, rnd)
        return partner, acc if metric == "accuracy" else loss, True

    def fetch(self, w: Trainer, rnd: int, owner: int, own: float) -> list | None:
        """`owner`'s model of round `rnd` or later, every slice of one deposit
        (`whole_deposit`): shards that answer with different rounds (the owner's newer
        deposit on its way to some of them, or a shard restored from a checkpoint without
        a deposit), or with two deposits of one round (the owner's leader restarted
        partway through depositing it, the second on its way to some shards), are asked
        again for the newest, which a shard that lacks it answers when it comes. `own`:
        this trainer's score of round `rnd`, as deposited (`await_model`)."""
        gone = lambda: owner not in trainers(w.live(), self.k)  # noqa: E731

        def again(got: list) -> list | None:   # (the newest round answered: parked where it has not come yet)
            return w.client.get_model(max(int(m.get("round")) for m in got), owner, cancel=gone, missing_ok=True)
        got = whole_deposit(w.client, self.await_model(w, rnd, owner, own, gone), again)
        if got is None:
            w.note(f"round {rnd}: trainer {owner} did not deliver its model; keeping ours")
        return got

    def await_model(self, w: Trainer, rnd: int, owner: int, own: float, gone: Callable[[], bool]) -> list | None:
        """`owner`'s model of round `rnd` or later, from every shard. A shard restored from
        a checkpoint older than both partners' deposits holds neither, and each would
        wait for good for the other's: so once the model comes, and while the owner is
        live and has not answered for a while (`cluster.heartbeat_timeout_s`, then twice
        as long each time), this trainer's own deposit is made again where a shard lacks
        it (`keep_deposit`)."""
        window = self.cfg.cluster.heartbeat_timeout_s   # (on the worker's clock: virtual in psgd simulate)
        while True:
            until = w.now() + window
            got = w.client.get_model(rnd, owner, cancel=lambda until=until: gone() or w.now() > until,
                                     missing_ok=True)
            if got is None and (gone() or w.now() <= until):   # (left, refused, or unreachable)
                return None
            self.keep_deposit(w, rnd, own)
            if got is not None:
                return got
            window = min(2 * window, self.cfg.cluster.timeout_s)

    def keep_deposit(self, w: Trainer, rnd: int, own: float) -> None:
        """This trainer's deposit of round `rnd` (scored `own`) again if a shard holds
        neither it nor one of a later round (`holds`): the partner may wait for it (and
        may have taken ours only from a deposit again of its own). The replica still
        holds the deposited model: a deposit again is the same one, with its tag."""
        if all(holds(m, self.trainer, rnd, self.deposit_tag) for m in w.client.index()):
            return
        w.note(f"round {rnd}: a shard lost trainer {self.trainer}'s deposit (or holds another of the round); "
               f"depositing it again")
        self.deposit_model(w, rnd, own, self.deposit_tag)

    def scores(self, w: Trainer, rnd: int, own: float) -> dict[int, float]:
        """Every live trainer's score of round `rnd` (the same board for all of them);
        the request carries this trainer's own, `own`, as deposited."""
        (m,) = w.client.request([(0, "get_model", {"round": rnd, "owner": SCORES, "score": own})])
        return {int(t): float(s) for t, s in m.get("scores")}

    def take(self, w: Trainer, got: list, rnd: int) -> None:
        """Adopt a deposit: weights and buffers, the optimizer's state with
        weights+optimizer, and its hyperparameters mutated."""
        w.replica.load(*w.client.tables(got))
        if self.with_opt:
            self.load_opt_state(w, got)
        if self.explore:
            self.set_hyper(mutate(self.read_meta(got)[1], self.explore, self.cfg.mode.mutation, self.cfg.job.seed, rnd,
                                  self.trainer))

    def follow(self, w: Trainer, rnd: int, leader: int) -> None:
        """Take the outcome that the trainer's leader deposited for round `rnd`, every
        slice of one deposit (`whole_deposit`: asked again exactly, never parked, as
        every shard answered it once)."""
        gone = lambda: leader not in w.live()  # noqa: E731
        got = w.client.get_model(-rnd, self.trainer, cancel=gone, missing_ok=True)
        if got is None:
            w.note(f"round {rnd}: trainer {self.trainer}'s leader {leader} left before its outcome; "
                   f"keeping our model")
            return
        got = whole_deposit(w.client, got, lambda _: w.client.get_model(-rnd, self.trainer, cancel=gone,
                                                                        exact=True, missing_ok=True))
        if got is None:
            w.note(f"round {rnd}: trainer {self.trainer}'s outcome came as slices of different deposits, and read "
                   f"again it did not come whole; keeping our model")
            return
        meta, hyper = self.read_meta(got)
        if meta[0] == NOT_HELD:   # the leader's time budget left no whole round after it
            return
        self.diverged = False
        w.replica.load(*w.client.tables(got))
        self.load_opt_state(w, got, with_meta=True)
        self.set_hyper(hyper)
        self.log(w, rnd, leader, meta)

    def deposit_model(self, w: Trainer, rnd: int, score: float, tag: int | None = None) -> None:
        """A tournament (or final) deposit of the replica, scored `score`; `tag`: that of
        the same deposit made before (`keep_deposit`)."""
        self.deposit(w, rnd, score, [0.0, -1.0, math.nan, math.nan], self.with_opt, tag)

    def deposit(self, w: Trainer, rnd: int, score: float, meta: list[float], with_opt: bool,
                tag: int | None = None) -> None:
        """Deposit the replica as it is: a tournament model (rnd > 0) or an outcome
        (rnd < 0), tagged (`tag`, else a new one: `new_tag`); with the optimizer's state,
        and the values `meta` and the hyperparameters when explored or for an outcome."""
        params, buffers = w.replica.params(), w.replica.buffers()
        if rnd < 0:   # (kept for `keep_outcome`: the next gather writes over the replica's tables)
            params, buffers = [t.clone() for t in params], [t.clone() for t in buffers]
        state = self.opt_state(w)[1] if with_opt else []
        extra = rnd < 0 or bool(self.explore)
        values = meta + [self.hyper[k] for k in sorted(self.explore)]
        arrays = [[params[i], buffers[i]] + [w.replica.map.gather(t, i, "params").cpu() for t in state]
                  + ([pack_meta(values, params[i].numel()) if i == 0 else torch.zeros(params[i].numel())]
                     if extra else [])
                  for i in range(w.replica.n)]
        tag = new_tag() if tag is None else tag
        w.client.put_model(rnd, score, arrays, w.clock, tag)
        if rnd > 0:
            self.deposit_tag = tag
        else:
            self.outcome = (rnd, score, arrays, tag)

    def read_meta(self, got: list) -> tuple[list[float], dict[str, float]]:
        """A deposit's `META` values and hyperparameters (its last array, on shard 0)."""
        values = unpack_meta(wire.tensor(got[0], len(got[0].arrays) - 1), len(META) + len(self.explore))
        return values[:len(META)], dict(zip(sorted(self.explore), values[len(META):], strict=True))

    def log(self, w: Trainer, rnd: int, leader: int, meta: list[float]) -> None:
        adopted, partner, local, other = meta

        def num(v: float) -> float | None:
            return round(v, 5) if math.isfinite(v) else None

        w.event(event="tournament", round=rnd, rank=w.rank, trainer=self.trainer, leader=leader,
                partner=None if partner < 0 else int(partner), metric=self.cfg.mode.metric,
                local_score=num(local), partner_score=num(other), adopted=bool(adopted),
                hyper={k: float(f"{v:.6g}") for k, v in self.hyper.items()})

    # ------------------------------------------------------------ optimizer state
    def _trainable(self, w: Trainer) -> tuple[list[torch.Tensor], dict[int, str]]:
        model = w.replica.model
        return [p for p in model.parameters() if p.requires_grad], {id(p): n for n, p in model.named_parameters()}

    def opt_state(self, w: Trainer) -> tuple[list[str], list[dict]]:
        """Optimizer state tensors shaped like the parameters (momentum, Adam moments): the
        kinds of state shaped like every parameter that holds one, less Adam's step count
        (0-dim, as a scalar parameter is: not deposited, each trainer counts its own)."""
        params, names = self._trainable(w)
        state = self.opt.state
        held = {k for p in params for k in state.get(p, {})} - {"step"}
        keys = sorted(k for k in held if all(torch.is_tensor(v := state[p][k]) and v.shape == p.shape
                                             for p in params if k in state.get(p, {})))
        return keys, [{names[id(p)]: state[p][k] if k in state.get(p, {}) else torch.zeros_like(p) for p in params}
                      for k in keys]

    def load_opt_state(self, w: Trainer, got: list, with_meta: bool | None = None) -> None:
        """The deposit's optimizer state into ours, when it holds the same kinds of state
        (a live trainer adopting another's model; not a fresh optimizer, a restarted or
        resumed worker's, which holds none yet: its state starts anew; nor Adam's step
        count, which is not deposited). One that holds none (made before its first step,
        or by a diverged trainer's leader, which cleared its own) clears ours: the state
        goes with the model (a group's replicas stay alike)."""
        keys, _ = self.opt_state(w)
        if with_meta is None:
            with_meta = bool(self.explore)
        held = len(got[0].arrays) - 2 - int(with_meta)
        if any(len(m.arrays) != len(got[0].arrays) for m in got):
            return   # (shards that hold unlike deposits: not one trainer's whole state; an IndexError was)
        if held == 0:
            self.opt.state.clear()
        if held != len(keys) or not keys:
            return
        params, names = self._trainable(w)
        state = self.opt.state
        fresh = [p for p in params if not state.get(p)]   # no state of ours yet (no gradient so far)
        for j, k in enumerate(keys):
            target = {names[id(p)]: state.setdefault(p, {}).setdefault(k, torch.zeros_like(p)) for p in params}
            for i, m in enumerate(got):
                w.replica.map.scatter(wire.tensor(m, 2 + j), i, "params", target)
        steps = [st["step"] for p, st in state.items() if "step" in st]
        for p in fresh:   # Adam keeps a step count beside its moments (a state without one is a KeyError)
            if not any(torch.any(state[p][k]) for k in keys):
                state.pop(p)                         # the deposit held none for it either: torch starts it
            elif steps:
                state[p]["step"] = steps[0].clone() if torch.is_tensor(steps[0]) else steps[0]
