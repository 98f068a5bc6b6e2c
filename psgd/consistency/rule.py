"""What a consistency mode is: a server rule and a worker schedule.

A mode is one module in this package holding both halves of its rule, and one line in
the registry (`psgd.consistency.MODES`).

**The server rule** (`ServerRule`) is a pure object: the shard feeds it validated
events and carries out the decisions it returns, in order. No sockets, no threads, no
clock reads, so the real daemon, the in-process test cluster and a simulator on a
virtual clock can all drive it.

    events in   `Push`, `Read`, `ElasticOffer`, `Deposit`, `Fetch`, `index(token)` (the
                `models` op), `membership(live)`, `load_state_dict(...)` (a restore
                from a checkpoint)
    decisions   `Apply`        step the optimizer on a vector at lr x `lr_scale`
                `Accumulate`   add a vector to the open step's sum
                `ApplySum`     step on the mean of the accumulated gradients
                `Move`         add a delta to the parameters (no optimizer: a centre move)
                `MixBuffers`   move the buffers towards a value (a running mean)
                `SetBuffers`   set them (to a mean of the step's sum)
                `Answer`       reply to a request: fields, plus the tables' snapshot
                               (`snapshot=True`) or given arrays
                `Refuse`       an error reply (code, reason), counted
                `Store`/`Forget`  keep or free a deposited model
                `AnswerModel`  reply with a stored model
                (no decision for a request = parked; a later event answers it)

The rule reads the shard's tables through `tables` (read-only by contract) and keeps
its own counters (`stats`) and state (`state_dict`), so that a checkpoint carries them.

**The worker schedule** (`Schedule`) says what a worker does at each step (compute and
push+pull; a local step and an exchange every tau; a tournament every round) and what
it does with the answers. It talks to a `Trainer` (the worker's mechanism: compute,
the parameter client, the replica, the step log) and never to sockets itself.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ..optim import lr_at, make_optimizer, set_lr
from .staleness import Histogram

if TYPE_CHECKING:
    import torch

    from ..config import Config, ModeConfig, OptimizerConfig
    from ..replica import Replica


# ---------------------------------------------------------------- events (shard -> rule)
@dataclass
class Push:
    """A gradient of `rank` computed at `clock`, `tau` updates after the read it used.
    `before_restart`: that read was answered before the shard restarted (from an older
    checkpoint, or with nothing to restore): the gradient may hold updates the shard lost,
    and tau, counted from a version of another life, says nothing of how stale it is. (Also
    a read named past the shard's version where it never restarted: no honest one.)"""
    token: Any
    rank: int
    clock: int
    tau: int
    grad: Any
    buffers: Any
    before_restart: bool = False


@dataclass
class Read:
    """A pull by `rank` (-1: the evaluator) that has finished `clock`. `join`: a worker
    (re)joining, which learns where to start and is never gated."""
    token: Any
    rank: int
    clock: int
    join: bool = False


@dataclass
class ElasticOffer:
    """A worker's replica x (and buffers) for an elastic exchange; `round` counts exchanges."""
    token: Any
    rank: int
    round: int
    x: Any
    buffers: Any


FINAL_ROUND = 2 ** 31 - 1  # the round of the final models (a deposit after the last round, whatever the budget)


@dataclass
class Deposit:
    """A trainer's model for a tournament round (or FINAL_ROUND), with its score; or its
    outcome of round -r. Its `tag` names that deposit (None: deposited without one)."""
    token: Any
    rank: int
    round: int
    score: float
    arrays: list
    tag: int | None = None


@dataclass
class Fetch:
    """A request for `owner`'s model of `round` (or later, unless `exact`); of a round's
    scores (owner SCORES), with the asker's own `score` of it when it has one."""
    token: Any
    owner: int
    round: int
    exact: bool = False
    rank: int = -1
    score: float | None = None


# ---------------------------------------------------------------- decisions (rule -> shard)
@dataclass
class Apply:
    grad: Any
    lr_scale: float
    progress: float          # where the lr schedule stands (steps of the whole job)


@dataclass
class Accumulate:
    grad: Any
    buffers: Any
    first: bool              # the first contribution of a step: copy instead of add


@dataclass
class ApplySum:
    count: int               # step on the mean of the `count` accumulated gradients
    progress: float


@dataclass
class Move:
    delta: Any


@dataclass
class MixBuffers:
    values: Any
    weight: float            # buffers += weight * (values - buffers): a running mean


@dataclass
class SetBuffers:
    values: Any | None       # None: the accumulated buffer sum
    count: int = 1           # buffers = values / count


@dataclass
class Answer:
    token: Any
    fields: dict = field(default_factory=dict)
    snapshot: bool = False   # attach the tables (params, buffers) as they are at this point
    arrays: Sequence[Any] = ()  # or these arrays; BUFFERS stands for a snapshot of the buffers


BUFFERS = "buffers"


@dataclass
class Refuse:
    token: Any
    code: str
    reason: str
    bad: bool = True   # counted in the shard's bad_messages; False: a race that honest clients meet and retry


@dataclass
class Store:
    key: Hashable
    score: float
    arrays: list


@dataclass
class Forget:
    keys: list


@dataclass
class AnswerModel:
    token: Any
    key: Hashable
    fields: dict = field(default_factory=dict)


Decision = (Apply | Accumulate | ApplySum | Move | MixBuffers | SetBuffers | Answer | Refuse | Store | Forget
            | AnswerModel)

REFUSED = "refused"  # the wire's code for "valid, but not acceptable now"


class Tables(Protocol):
    """What a rule may read of the shard: its parameter and buffer tables, the number
    of updates applied, and the scalar parts of its stored models."""
    params: torch.Tensor
    buffers: torch.Tensor
    version: int

    def worker_lr(self, clock: int) -> float:
        """The rate at which a worker steps its own copy at `clock` (`pushpull.own_update`)."""
        ...


# ---------------------------------------------------------------- the server rule
class ServerRule:
    """The base: serves reads only. A mode overrides the events it uses and lists their
    ops in `serves`; the shard refuses the others with a reason naming the mode."""

    name: ClassVar[str] = ""
    serves: ClassVar[frozenset[str]] = frozenset({"pull"})

    @classmethod
    def server_optimizer(cls, cfg: Config) -> OptimizerConfig:
        """The optimizer (and its lr schedule) that the shard builds and steps with
        `Apply`/`ApplySum`: `[optimizer]`, unless the mode has an outer optimizer of its own."""
        return cfg.optimizer

    @classmethod
    def last_exchange(cls, cfg: Config) -> int:
        """The clock of the last push (or round of the last elastic offer) that an honest
        worker sends in a job of `train.steps` (> 0) steps: the shard refuses a later one.
        A push's clock is its step; a mode whose exchanges count rounds says its last."""
        return cfg.train.steps

    def __init__(self, mode: ModeConfig, world: int, tables: Tables):
        self.mode = mode
        self.world = world
        self.tables = tables
        self.hist = Histogram()       # staleness of every applied contribution

    # events
    def push(self, e: Push) -> list[Decision]:
        raise NotImplementedError

    def read(self, e: Read) -> list[Decision]:
        """A read by a non-worker (the evaluator) or a joining worker is never gated."""
        if e.rank < 0 or e.join:
            return [self.answer(e)]
        return self.gated_read(e)

    def gated_read(self, e: Read) -> list[Decision]:
        return [self.answer(e)]

    def elastic(self, e: ElasticOffer) -> list[Decision]:
        raise NotImplementedError

    def resent(self, e: ElasticOffer) -> bool:
        """Is this offer its rank's second of its round (the client's resend after
        `retry_s` without an answer)? The shard counts it in `duplicates`, not `pushes`."""
        raise NotImplementedError

    def deposit(self, e: Deposit) -> list[Decision]:
        raise NotImplementedError

    def fetch(self, e: Fetch) -> list[Decision]:
        raise NotImplementedError

    def index(self, token: Any) -> list[Decision]:
        """What this shard holds of the deposited models: [[round, owner, score], ...]."""
        return [Answer(token, {"models": []})]

    def membership(self, live: dict[int, int]) -> list[Decision]:
        """The live workers (rank -> clock) changed; joiners start at their clock."""
        return []

    # answers and counters
    def answer(self, e: Read) -> Answer:
        """A read's answer: the tables, and where the rule stands for this reader."""
        return Answer(e.token, self.read_fields(e.rank), snapshot=True)

    def read_fields(self, rank: int) -> dict:
        return {"step": 0, "finished": 0}

    def parked(self) -> int:
        """How many requests wait here for a later event to answer them."""
        return 0

    def waiting_pushes(self) -> dict[int, int]:
        """rank -> the clock of its push that waits here, not yet counted, for a later
        event (a later step: `SyncRule.early`). A checkpoint does not hold it: its push
        is not a duplicate when it comes again after a restore (`Shard.state_dict`)."""
        return {}

    def stats(self) -> dict:
        """Counters for summary.json."""
        return {"max_clock_gap": 0, "dropped": 0, "parked": self.parked(), **self.hist.stats()}

    def state_dict(self) -> dict:
        return {"hist": list(self.hist.counts), "hist_sum": self.hist.tau_sum, "hist_max": self.hist.top}

    def load_state_dict(self, sd: dict) -> None:
        """A restore from a checkpoint written by `state_dict`."""
        self.hist = Histogram(sd.get("hist"), sd.get("hist_sum"), sd.get("hist_max"))

    def new_run(self) -> None:
        """Zero the counters of `stats` (a new run resumed from a checkpoint counts its
        own: `Shard.new_run`); what the rule answers from stays."""
        self.hist = Histogram()

    def restarted(self) -> None:
        """The shard restarted, from its checkpoint (after `load_state_dict`) or with nothing
        to restore (`Shard.restarted_empty`): what happened while it was down is unknown."""


# ---------------------------------------------------------------- the worker schedule
class Trainer(Protocol):
    """The worker's mechanism, as a schedule sees it."""
    cfg: Config
    rank: int
    clock: int
    taken_back: bool         # its rank's process before it was still counted live (restarted before it was missed)
    loss: float              # of the step just computed
    samples: int             # trained on so far
    client: Any              # psgd.workers.client.ParameterClient (or a simulator's)
    replica: Replica
    hist: Histogram

    def compute(self, slot: int = 0) -> float: ...   # slot: whose gradient tables it may write (`Replica.bind_grads`)
    def score(self) -> tuple[float, float]: ...   # (accuracy, loss) of the model on its tournament data
    def log_step(self, staleness: int, wait_s: float, step: tuple[float, int] | None = None,
                 **extra: Any) -> None: ...   # step: the (loss, samples) of a step settled later (prefetch)
    def live(self) -> set[int]: ...
    def event(self, **fields: Any) -> None: ...
    def note(self, text: str) -> None: ...
    def now(self) -> float: ...   # how long the job has trained, by the worker's clock (virtual in psgd simulate)


class Diverged(RuntimeError):
    """A local step produced a non-finite loss: the step is refused by the worker itself."""


class Schedule:
    """What a worker does each step. `start` runs once after registering, `rejoin` after
    the coordinator took the worker back, `step` once per step until the budget ends.
    A step that raises `Diverged` (or whose request the shards refuse) is counted as
    rejected and tried again with the next batch."""

    data_split: float = 0.0   # the share of each partition held out of training
    local_optimizer = False   # steps the worker's own optimizer (make_local_optimizer), not the shards'
    needs_score = False       # ranks models by the worker's `score()`
    # Gathers each step's gradient (`Replica.grads`), computed into the slot it gathers it from
    # (`compute(slot)`): backward may write it into the gather's tables (`Replica.bind_grads`)
    gathers_grads = False

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def start(self, w: Trainer) -> None:
        self.rejoin(w)

    def rejoin(self, w: Trainer) -> None:
        raise NotImplementedError

    def step(self, w: Trainer) -> None:
        raise NotImplementedError

    def finish(self, w: Trainer) -> None:
        """The budget is spent: settle what is still in flight."""


READ_TRIES = 5   # reads of the global model whose shards stand at different steps (`read_params`)


def waited(client: Any, seconds: float) -> bool:
    """Wait `seconds` for a message on its way to the shards, where the client can
    (`waits`: the simulator's evaluator reads between events, when nothing moves);
    whether it did."""
    if not getattr(client, "waits", True):
        return False
    time.sleep(seconds)
    return True


def read_params(client: Any) -> list:
    """The global model of the parameter-server modes: the shards' parameters, all of
    the same step where the shards count steps (sync, diloco, synchronous easgd): a read
    between one shard's close of a step and another's would score a model of two steps'
    slices, so it is read again, briefly (where the client can wait: `waited`)."""
    for attempt in range(READ_TRIES):
        answers = client.pull(-1)
        if (len({int(m.get("step", 0)) for m in answers}) <= 1 or attempt == READ_TRIES - 1
                or not waited(client, 0.01 * 2 ** attempt)):
            return answers
    raise AssertionError("unreachable: the last try returns")


@dataclass(frozen=True)
class Mode:
    """A registry entry: the mode's name, its two halves, the config keys that matter
    for it (summaries, labels), and how a reader (the evaluator, a rejoining worker)
    gets the job's global model: callable(client) -> one answer per shard."""
    name: str
    rule: type[ServerRule]
    schedule: type[Schedule]
    params: tuple[str, ...]
    global_model: Callable[[Any], list] = read_params


def local_step(w: Trainer, opt: Any, before_update: Callable[[], None] | None = None) -> None:
    """One step of a worker's own optimizer (the local-optimizer modes). `before_update`
    runs between the gradient and the optimizer's update, on the parameters that the
    gradient was computed at (easgd's exchange: Algorithm 1 evaluates both at the same x)."""
    schedule_lr(w, opt, w.cfg.optimizer)
    loss = w.compute()
    if not math.isfinite(loss):
        raise Diverged(f"loss is {loss} at step {w.clock}; {lower_lr(w)}")
    if before_update is not None:
        before_update()
    opt.step()
    w.clock += 1


def lower_lr(w: Trainer) -> str:
    """What to do about a worker's diverged loss: lower the learning rate of the optimizer
    it steps, which is the training script's own when it gave psgd.connect one
    (`optimizer.lr` does not reach that)."""
    if getattr(w, "user_optimizer", None) is not None:
        return "lower the learning rate of the optimizer given to psgd.connect"
    return "lower optimizer.lr"


def make_local_optimizer(w: Trainer) -> Any:
    """The worker's own optimizer: the training script's (`psgd.connect(model, optimizer)`),
    else one made from `[optimizer]`."""
    given = getattr(w, "user_optimizer", None)
    if given is not None:
        return given
    return make_optimizer([p for p in w.replica.model.parameters() if p.requires_grad], w.cfg.optimizer)


def schedule_lr(w: Trainer, opt: Any, opt_cfg: OptimizerConfig) -> None:
    """`opt_cfg`'s learning rate at the worker's clock into its optimizer, unless that is
    the training script's own: it keeps the rate (and any scheduler) the script gave it."""
    if opt is not getattr(w, "user_optimizer", None):
        set_lr(opt, lr_at(opt_cfg, w.clock, w.cfg.train.steps))
