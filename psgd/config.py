"""Configuration: one TOML file, `--set` flags and `PSGD_*` variables, validated once.

Precedence, written once here and nowhere else::

    --set section.key=value  >  PSGD_SECTION_KEY=value  >  CONFIG file  >  defaults

Every section is a frozen dataclass; unknown sections or keys and ill-typed or
out-of-range values raise `ConfigError` with a message that names the key and the
source it came from. `Config.to_dict()` / `Config.from_dict()` round-trip through
msgpack, so the coordinator can hand the run config to every daemon.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from . import consistency

# The modes and the keys that matter for each, from the registry (which imports no mode
# module for them): a new mode is known here without a line in this file.
MODES: tuple[str, ...] = consistency.NAMES

# Environment variables that are not config keys: read by the CLI and by psgd.connect.
# Set by psgd run in its shards' environment once it has read every shard's checkpoint
# whole (shard.unresumable): a shard then reads only its own whole, the others'
# directories (ShardServer). Under Compose or Slurm no launcher checked the set, and each
# shard reads all of them whole: another shard's corrupt checkpoint, taken for whole,
# would be refused by that shard alone, which starts afresh beside the others resumed: a
# model of two versions.
SET_CHECKED_ENV = "PSGD_CHECKPOINT_SET_CHECKED"
# `cluster.spin_us`: the most a worker or a shard may poll for a message before it sleeps, and
# what auto (-1) gives where `psgd run`'s busy processes fit its cores (`launcher.spin_for`;
# spins rest while the machine's other work wants the CPU: psgd/spinning.py)
MAX_SPIN_US = 100_000.0
AUTO_SPIN_US = 1000.0
CPU_ENV = "PSGD_CPU"   # the CPU that `psgd run` pins a daemon to (`cluster.pin_cpus`; psgd/forkserver.py `take_cpu`)
ENV_OWN = ("PSGD_CONFIG", "PSGD_OUT", "PSGD_DEVICE", "PSGD_RANK")   # a user's variables that are no setting
HUNT_ENV = "PSGD_HUNT"   # the test suite's examples per property (docs/modes.md), in a shell that runs psgd too
ENV_RESERVED = {*ENV_OWN, "PSGD_STARTED_FILE", "PSGD_PARENT_PID", "PSGD_JOB_TOKEN", SET_CHECKED_ENV, CPU_ENV, HUNT_ENV}


class ConfigError(ValueError):
    """A configuration problem, phrased for the user."""


@dataclass(frozen=True)
class JobConfig:
    name: str = "psgd"
    seed: int = 0


@dataclass(frozen=True)
class ModelConfig:
    name: str = "mlp"          # mlp | cnn | resnet20 | package.module:factory
    hidden: int = 128          # width of the MLP's hidden layers


@dataclass(frozen=True)
class DataConfig:
    name: str = "digits"       # digits | synthetic | cifar10 | mnist | package.module:factory
    path: str = ""             # folder with the files, for cifar10 / mnist
    test_fraction: float = 0.2  # held-out share, for datasets without a test split
    shape: list = field(default_factory=lambda: [1, 8, 8])  # synthetic: one sample's shape
    classes: int = 0           # number of classes: factories that return torch Datasets must set it; synthetic: 0 = 10
    samples: int = 4096        # synthetic: number of training samples
    loader_workers: int = 0    # torch Datasets: DataLoader worker processes per psgd worker (0: in-process)
    loader_timeout_s: float = 300.0   # loader processes: a batch of theirs that takes longer ends the job


SYNTHETIC_CLASSES = 10  # the synthetic dataset's classes when data.classes is unset (0)


def synthetic_classes(cfg: DataConfig) -> int:
    return cfg.classes or SYNTHETIC_CLASSES


@dataclass(frozen=True)
class ModeConfig:
    name: str = "sync"
    backup_workers: int = 0    # sync: apply after the first N - b gradients
    staleness: int = 2         # ssp: the bound s
    lr_policy: str = "constant"  # async: constant | staleness  (lr / max(1, tau))
    dc_lambda: float = 0.0     # async: delay compensation (DC-ASGD); 0 = off
    prefetch: bool = False     # async, ssp (within its bound): compute the next gradient while the push and pull travel
    tau: int = 4               # easgd: communication period in local steps
    alpha: float = 0.0         # easgd: elastic coefficient; 0 = 0.9 / workers
    sync: bool = False         # easgd: synchronous rounds
    round_steps: int = 50      # ltfb: local steps per tournament round
    tournament_fraction: float = 0.1  # ltfb: held-out share of each partition
    exchange: str = "weights+optimizer"  # ltfb: weights | weights+optimizer (current LBANN)
    trainer_size: int = 1      # ltfb: workers per trainer (a synchronous data-parallel group)
    strategy: str = "pairwise"  # ltfb: pairwise | truncation
    truncation_k: int = 1      # ltfb truncation: the bottom k trainers take a random top-k trainer's model
    metric: str = "accuracy"   # ltfb: accuracy | loss, on each trainer's tournament split
    explore: dict = field(default_factory=dict)  # ltfb: {"optimizer.lr" = [lo, hi], ...}, drawn log-uniformly
    mutation: float = 0.2      # ltfb explore: an adopter's values times (1 - m) or (1 + m)
    local_steps: int = 20      # diloco: inner steps H per round
    outer_lr: float = 0.2      # diloco: outer Nesterov SGD learning rate (the paper: 0.7, for an AdamW inner optimizer)
    outer_momentum: float = 0.9  # diloco: outer momentum (0 with outer_lr 1: model averaging)
    cache: bool = False        # ssp: serve reads from the worker's cache while within the bound
    n_push: int = 1            # async (Downpour): push the accumulated gradient every n_push steps
    n_fetch: int = 1           # async (Downpour): pull the model every n_fetch steps


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "sgd"          # sgd | adam | adamw
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0      # linear warm-up from lr / warmup_steps
    schedule: str = "constant"  # constant | step | cosine
    step_size: int = 100       # step schedule: multiply by gamma every step_size updates
    gamma: float = 0.1
    min_lr: float = 0.0        # cosine schedule floor


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300           # per worker; 0 = no step limit
    seconds: float = 0.0       # per worker; 0 = no time limit
    batch_size: int = 32       # per worker
    flush_denormal: bool = True   # workers and shards compute with denormal floats as zero (optim.denormals_flushed)


@dataclass(frozen=True)
class ClusterConfig:
    host: str = "127.0.0.1"    # where the coordinator (and, without addresses, the shards) live
    port: int = 5555           # coordinator; shard I on port + 1 + I
    servers: int = 2
    workers: int = 2
    addresses: list = field(default_factory=list)  # tcp://HOST:PORT per shard (optional)
    timeout_s: float = 60.0    # longest wait on a peer that does not answer (not on a live worker's next step)
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 5.0
    evaluator: bool = True     # wait for an evaluator's final score before ending
    max_rejections: int = 10   # a worker stops after this many refused steps in a row
    fork: bool = True          # psgd run forks shards, workers, evaluator from one process with torch imported
    pin_cpus: bool = False     # psgd run: each shard and worker (all its threads) on a CPU of its own, if they
    #                            fit; the evaluator too where a CPU is left
    local_lane: bool = True    # a worker and a shard on one host talk over a Unix socket, not ZeroMQ (psgd.lane)
    spin_us: float = -1.0      # how long a worker and a shard poll for a message before they sleep; -1: auto (psgd run)

    @property
    def spin_s(self) -> float:
        """`spin_us` in seconds, as a daemon uses it: auto (-1) that `psgd run` did not
        resolve (`launcher.spin_for`: a daemon started by hand) is 0."""
        return max(self.spin_us, 0.0) * 1e-6


@dataclass(frozen=True)
class EvalConfig:
    every_seconds: float = 0.5
    target_accuracy: float = 0.9
    batch_size: int = 512
    tensorboard: bool = False  # TensorBoard scalars under OUT/tb/ (pip install 'psgd[tensorboard]')


@dataclass(frozen=True)
class CheckpointConfig:
    every_s: float = 10.0      # shard checkpoint period; 0: no periodic ones (a resumed start, the end, the stop)
    dir: str = ""              # default: OUT/checkpoints


@dataclass(frozen=True)
class SecurityConfig:
    curve: bool = False
    keys: str = ""             # folder made by `psgd keys`


@dataclass(frozen=True)
class FaultsConfig:
    slow_rank: int = -1        # this worker takes slow_factor times as long per step
    slow_factor: float = 1.0
    step_delay_s: float = 0.0  # added to every worker's step (a slow link)
    on_worker_loss: str = "continue"  # continue | abort
    jitter_prob: float = 0.0   # each step of each worker is delayed by jitter_s with this probability
    jitter_s: float = 0.0      # (transient stragglers; independent per step, seeded by job.seed and rank)


@dataclass(frozen=True)
class WireConfig:
    dtype: str = "float32"     # gradients and parameters on the wire: float32 | bfloat16 | float16
                               # (the shards keep float32 master weights)
    compression: str = "none"  # pushed gradients: none | onebit | topk, with error feedback on the worker
    topk_fraction: float = 0.01  # topk: the share of a shard's gradient elements sent each push
    overlap: bool = False      # sync: each shard's push leaves from backward's hooks once its layers' gradients
                               # are made (the shard map then gives each shard a run of whole layers)


WIRE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class SimConfig:
    """`psgd simulate`'s cost model (virtual seconds)."""
    compute_s: float = 0.0     # one step's forward + backward; 0 = calibrate on this machine
    compute_cv: float = 0.0    # its spread: coefficient of variation of a lognormal
    latency_s: float = 50e-6   # one-way link latency
    bandwidth_gbps: float = 10.0  # per worker NIC and per shard NIC
    apply_gbps: float = 20.0   # a shard's apply rate (Gbit/s of its float32 tables worked through)
    encode_ns: float = 0.0     # wire.compression: a worker's encode, ns a value of a push; 0 = calibrate
    decode_ns: float = 0.0     # ... and a shard's decode, ns a value; 0 = calibrate
    train: bool = True         # compute real gradients (false: timing only)

SECTIONS: dict[str, type] = {
    "job": JobConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "mode": ModeConfig,
    "optimizer": OptimizerConfig,
    "train": TrainConfig,
    "cluster": ClusterConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "security": SecurityConfig,
    "faults": FaultsConfig,
    "wire": WireConfig,
    "sim": SimConfig,
}


@dataclass(frozen=True)
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mode: ModeConfig = field(default_factory=ModeConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    sim: SimConfig = field(default_factory=SimConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "config") -> Config:
        return build(d, source)

    def replace(self, **sets: Any) -> Config:
        """`cfg.replace(**{"mode.name": "ssp"})`: a copy with dotted keys changed. A bad
        value's error names the key, not where it came from: the caller says that."""
        d = self.to_dict()
        for dotted, value in sets.items():
            _assign(d, dotted, value, "")
        return build(d, "")

    def to_toml(self) -> str:
        """The whole config as a TOML file (what `load` reads back)."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
            lines.append("")
        return "\n".join(lines)

    def with_run(self, run: Mapping[str, Any]) -> Config:
        """The run's config as the coordinator hands it out, keeping what is this
        daemon's own: how it reaches its peers, its keys and its checkpoint folder."""
        d = dict(run)
        mine = self.to_dict()
        d["security"], d["checkpoint"] = mine["security"], mine["checkpoint"]
        d["cluster"] = {**d.get("cluster", {}), **{k: mine["cluster"][k] for k in ("host", "port", "addresses")}}
        return build(d, "coordinator's config")

    def replaced_by(self, job: Config, who: str) -> str:
        """A warning naming the keys this daemon (`who`) was given, away from their
        defaults, that the job's config (`with_run`) replaces, as 'mode.name async →
        sync'; '' if none. A worker started by hand with its own --set joined the job of
        the coordinator it reached and trained that job's config without a word."""
        mine, theirs, default = self.to_dict(), job.to_dict(), Config().to_dict()
        changed = [f"{section}.{k} {format_value(v)} → {format_value(theirs[section][k])}"
                   for section, values in mine.items() for k, v in values.items()
                   if v != default[section][k] and v != theirs[section][k]]
        if not changed:
            return ""
        return (f"warning: the job's config (the coordinator's) replaces what {who} was given: "
                f"{', '.join(changed[:6])}{f' and {len(changed) - 6} more' if len(changed) > 6 else ''}")

    def shard_address(self, shard: int) -> str:
        if self.cluster.addresses:
            return self.cluster.addresses[shard]
        return f"tcp://{self.cluster.host}:{self.cluster.port + 1 + shard}"

    def checkpoint_folder(self, out: str | None) -> str:
        """Where the shards' checkpoints are: `checkpoint.dir`, else OUT/checkpoints ('' with
        neither: none are written)."""
        return self.checkpoint.dir or (os.path.join(out, "checkpoints") if out else "")

    def checkpoint_file(self, out: str | None, shard: int) -> str | None:
        """Shard `shard`'s checkpoint (None: none is written)."""
        folder = self.checkpoint_folder(out)
        return os.path.join(folder, f"shard-{shard}.pt") if folder else None

    def coordinator_address(self) -> str:
        return f"tcp://{self.cluster.host}:{self.cluster.port}"

    @property
    def placement(self) -> str:
        """The shard map's placement (psgd/sharding.py): whole layers in order where pushes
        leave from backward's hooks (`wire.overlap`)."""
        return "layers" if self.wire.overlap else "balanced"

    @property
    def mode_params(self) -> dict:
        """The parameters that matter for the selected mode (for summaries and labels)."""
        m = self.mode
        out = {k: getattr(m, k) for k in consistency.PARAMS[m.name]}
        if m.name == "easgd":
            out["alpha"] = self.easgd_alpha
        return out

    @property
    def easgd_alpha(self) -> float:
        return self.mode.alpha if self.mode.alpha > 0 else 0.9 / max(1, self.cluster.workers)


# ---------------------------------------------------------------- building


FOLDER_KEYS = ("data.path", "checkpoint.dir", "security.keys")   # the config's folders (`anchored`)


def anchored(cfg: Config) -> Config:
    """`cfg` with its folders (FOLDER_KEYS) absolute, as a job runs with them and its
    OUT/config.toml holds them: a relative one means the folder psgd run (or the
    coordinator) started in, and that file is read from other folders: by a user who
    loads the test set with it to score OUT/model.pt (README, "Output files"), `psgd
    status OUT`, a daemon started again by hand."""
    sets = {}
    for key in FOLDER_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value and not os.path.isabs(value):
            sets[key] = os.path.abspath(value)
    return cfg.replace(**sets) if sets else cfg


def written_by_psgd(text: str) -> bool:
    """Whether a config file's text is one `Config.to_toml` wrote (every key, in its order,
    no comment), not a user's."""
    try:
        return build(tomllib.loads(text), "config.toml").to_toml() == text
    except Exception:   # not TOML, or not a valid config: not psgd's
        return False


# The sections every psgd's `Config.to_toml` has written (0.1.0 on; `wire` and `sim` came later)
WRITTEN_SECTIONS = frozenset({"job", "model", "data", "mode", "optimizer", "train", "cluster", "eval", "checkpoint",
                              "security", "faults"})


def in_psgd_format(text: str) -> bool:
    """Whether a config file's text is as `Config.to_toml` writes, of this psgd or an
    earlier one (whose key set may differ): every section that each psgd wrote
    (WRITTEN_SECTIONS), only `[section]` headers and `key = value` lines in psgd's
    spelling, no comment. A file of the user's (comments, its own spelling, a few
    sections) is not, and `psgd run` does not write over it (launcher): a user's
    `[train]` and `steps = 10`, spelled as psgd spells them, was replaced. Looser than
    `written_by_psgd`, which tells a user's keys from psgd's."""
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return False
    if not WRITTEN_SECTIONS <= d.keys():
        return False
    lines = []
    for section, values in d.items():
        if not isinstance(values, Mapping):
            return False
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return [line for line in text.splitlines() if line.strip()] == lines


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return "[" + ", ".join(_toml_value(x) for x in v) + "]"


def _coerce(value: Any, default: Any, where: str) -> Any:
    kind = type(default)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):  # PSGD_X_Y=1 and --set x.y=1 parse as integers
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true or false (or 1 or 0), got {value!r}")
    if kind is int:   # a float with no integer value (1.5, inf, nan) is no integer
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except OverflowError:   # (an integer of 400 digits: TOML reads it whole)
            raise ConfigError(f"{where}: {value} is too large for a number") from None
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if kind is list:
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return value
    if kind is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        flat: dict = {}
        for key, v in _dotted(dict(value)):   # (TOML reads `{optimizer.lr = [...]}` as nested tables)
            if key in flat:   # ("optimizer.lr" = [..] beside optimizer = {lr = [..]}: the last won, unsaid)
                raise ConfigError(f"{where}: {key} is given twice")
            flat[key] = v
        return flat
    raise ConfigError(f"{where}: unsupported type")  # pragma: no cover


def _did_you_mean(word: str, known: Iterable[str], prefix: str = "") -> str:
    """'; did you mean X?' for the known name closest to a misspelt one ('' if none is
    close): `cluster.worker`, `[optimiser]`, `PSGD_CLUSTER_WORKER`."""
    close = difflib.get_close_matches(str(word).lower(), [k.lower() for k in known], n=1, cutoff=0.75)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def _section_of(key: str) -> str:
    """Where a key written outside any section belongs: '; it belongs under [train]
    (train.steps)', the sections that have one of that name, or the sections."""
    owners = [name for name, cls in SECTIONS.items() if key in {f.name for f in dataclasses.fields(cls)}]
    if len(owners) == 1:
        return f"; it belongs under [{owners[0]}] ({owners[0]}.{key})"
    if owners:
        return f"; it is a key of {', '.join(f'[{o}]' for o in owners)}: write it under one"
    return f" (sections: {', '.join(SECTIONS)})"


def build(d: Mapping[str, Any], source: str, check: bool = True) -> Config:
    at = f"{source}: " if source else ""   # ("": Config.replace, whose caller says where)
    if not isinstance(d, Mapping):
        raise ConfigError(f"{at}expected a table of sections")
    sections = {}
    for name, section in d.items():
        if name not in SECTIONS and not isinstance(section, Mapping):   # a key above every [section] header
            raise ConfigError(f"{at}{name} = {section!r} is outside any [section]{_section_of(name)}")
        if name not in SECTIONS:
            raise ConfigError(f"{at}unknown section [{name}]{_did_you_mean(name, SECTIONS)} "
                              f"(known: {', '.join(SECTIONS)})")
        if not isinstance(section, Mapping):   # (`mode = "ssp"` above every header said "[mode] must be a table")
            keys = sorted(f.name for f in dataclasses.fields(SECTIONS[name]))
            raise ConfigError(f"{at}{name} = {section!r}: {name} is a section, not a key: write its keys under a "
                              f"[{name}] header{' (name = ...)' if 'name' in keys else ''} (known: {', '.join(keys)})")
        cls = SECTIONS[name]
        defaults = cls()
        known = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for key, value in section.items():
            if key not in known:
                raise ConfigError(f"{at}unknown key {name}.{key}{_did_you_mean(key, known, name + '.')} "
                                  f"(known: {', '.join(sorted(known))})")
            values[key] = _coerce(value, getattr(defaults, key), f"{at}{name}.{key}")
        sections[name] = cls(**values)
    cfg = Config(**sections)
    if check:
        validate(cfg)
    return cfg


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def is_number(x: object) -> bool:
    """An int or a float, not a bool (which Python counts as an int)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# The wire's integers are below 2**62 in magnitude (psgd.wire: a header's clock, a field):
# a config int past them could not reach the daemons, nor a worker's clock count to it.
WIRE_INT = 1 << 62


def _numbers(value: Any) -> Iterator[Any]:
    """The numbers in a config value, inside its lists and tables too."""
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, list):
        for v in value:
            yield from _numbers(v)
    elif is_number(value):
        yield value


def validate(cfg: Config) -> None:
    """Range checks that span keys; each message names the key."""
    m, c, t, o = cfg.mode, cfg.cluster, cfg.train, cfg.optimizer
    for section in fields(cfg):   # every number, in lists and tables too
        for f in fields(getattr(cfg, section.name)):
            key, v = f"{section.name}.{f.name}", getattr(getattr(cfg, section.name), f.name)
            for x in _numbers(v):   # inf or nan: a time that never ends, a rate that is none
                _check(not isinstance(x, float) or math.isfinite(x), f"{key} must be finite, got {v}")
                _check(not isinstance(x, int) or -WIRE_INT < x < WIRE_INT,
                       f"{key} must be below 2**62 in magnitude (the coordinator sends the config to every "
                       f"daemon, and the wire's integers stop there), got {v}"
                       f"{f' ({float(v):g})' if isinstance(v, int) and abs(v) >= 10 ** 15 else ''}")
    _check(m.name in MODES, f"mode.name must be one of {', '.join(MODES)}, got {m.name!r}")
    _check(c.servers >= 1, f"cluster.servers must be >= 1, got {c.servers}")
    _check(cfg.wire.dtype in WIRE_DTYPES,
           f"wire.dtype must be one of {', '.join(WIRE_DTYPES)}, got {cfg.wire.dtype!r}")
    _check(cfg.wire.compression in ("none", "onebit", "topk"),
           f"wire.compression must be none, onebit or topk, got {cfg.wire.compression!r}")
    _check(0 < cfg.wire.topk_fraction <= 1, f"wire.topk_fraction must be in (0, 1], got {cfg.wire.topk_fraction}")
    _check(c.workers >= 1, f"cluster.workers must be >= 1, got {c.workers}")
    _check(c.servers <= 65535 - 2, f"cluster.servers must be at most {65535 - 2} (each shard listens on a port "
                                   f"above the coordinator's, and ports end at 65535), got {c.servers}")
    _check(1 <= c.port <= 65535 - 1 - c.servers,
           f"cluster.port must be in 1..{65535 - 1 - c.servers} (the coordinator's; the shards take the next "
           f"{c.servers}), got {c.port}")
    _check(0 <= cfg.job.seed < 2 ** 32, f"job.seed must be in 0..{2 ** 32 - 1}, got {cfg.job.seed}")
    _check(not c.addresses or len(c.addresses) == c.servers,
           f"cluster.addresses lists {len(c.addresses)} shards but cluster.servers = {c.servers}")
    for a in c.addresses:
        why = address_fault(a) if isinstance(a, str) else ""
        _check(isinstance(a, str) and not why, f"cluster.addresses: {a!r} is not tcp://HOST:PORT or ipc://PATH"
                                               + (f" ({why})" if why else ""))
    _check(isinstance(c.host, str) and not _host_fault(c.host),
           f"cluster.host must be a host name or address, with no scheme, port or path (the port is "
           f"cluster.port; an IPv6 address in brackets), got {c.host!r}")
    _check(c.timeout_s > 0, f"cluster.timeout_s must be > 0, got {c.timeout_s}")
    _check(c.max_rejections >= 1, f"cluster.max_rejections must be >= 1, got {c.max_rejections}")
    _check(c.spin_us == -1 or 0 <= c.spin_us <= MAX_SPIN_US,
           f"cluster.spin_us must be -1 (auto) or in 0..{MAX_SPIN_US:.0f} (microseconds), got {c.spin_us}")
    _check(0 < c.heartbeat_s < c.heartbeat_timeout_s,
           "cluster.heartbeat_s must be > 0 and below cluster.heartbeat_timeout_s")
    _check(0 <= m.backup_workers < c.workers,
           f"mode.backup_workers must be in [0, workers), got {m.backup_workers}")
    _check(m.staleness >= 0, f"mode.staleness must be >= 0, got {m.staleness}")
    _check(m.lr_policy in ("constant", "staleness"),
           f"mode.lr_policy must be constant or staleness, got {m.lr_policy!r}")
    _check(m.dc_lambda >= 0, f"mode.dc_lambda must be >= 0, got {m.dc_lambda}")
    _check(m.tau >= 1, f"mode.tau must be >= 1, got {m.tau}")
    _check(0 <= m.alpha < 1, f"mode.alpha must be in [0, 1), got {m.alpha}")
    _check(m.name != "easgd" or not m.sync or m.alpha * (c.workers + 1) < 2,
           f"mode.alpha = {m.alpha} with {c.workers} workers: a synchronous EASGD round moves each worker by "
           f"-alpha (x_i - centre) and the centre by alpha x workers (mean - centre), so mean - centre changes by "
           f"1 - alpha (workers + 1) = {1 - m.alpha * (c.workers + 1):.3g} times a round, which diverges unless "
           f"alpha (workers + 1) < 2, i.e. mode.alpha < {2 / (c.workers + 1):.3g} "
           f"(Zhang et al. use beta = 0.9: alpha = 0.9 / workers, the default, mode.alpha = 0)")
    _check(m.round_steps >= 1, f"mode.round_steps must be >= 1, got {m.round_steps}")
    _check(0 < m.tournament_fraction < 1, "mode.tournament_fraction must be in (0, 1)")
    _check(m.exchange in ("weights", "weights+optimizer"),
           f"mode.exchange must be weights or weights+optimizer, got {m.exchange!r}")
    _check(m.trainer_size >= 1, f"mode.trainer_size must be >= 1, got {m.trainer_size}")
    _check(m.name != "ltfb" or c.workers % m.trainer_size == 0,
           f"mode.trainer_size = {m.trainer_size} does not divide cluster.workers = {c.workers}: "
           f"ltfb needs whole trainers (workers a multiple of trainer_size)")
    _check(cfg.wire.compression == "none" or not (m.name == "easgd" or (m.name == "ltfb" and m.trainer_size == 1)),
           f"wire.compression = {cfg.wire.compression} compresses pushed gradients, and mode {m.name}"
           f"{' with mode.trainer_size = 1' if m.name == 'ltfb' else ''} pushes none (it exchanges parameters): "
           f"set wire.compression = none")
    _check(not cfg.wire.overlap or (m.name == "sync" and cfg.wire.compression == "none"),
           f"wire.overlap pushes each shard's gradient while backward still runs: it is for mode sync with "
           f"wire.compression = none, not {m.name}" + (f" with wire.compression = {cfg.wire.compression} (a push is "
           f"encoded only once the whole gradient is known to be finite)" if cfg.wire.compression != "none" else "")
           + (" (ssp and async overlap the push with the next step's compute: mode.prefetch)"
              if m.name in ("ssp", "async") else ""))
    _check(m.strategy in ("pairwise", "truncation"),
           f"mode.strategy must be pairwise or truncation, got {m.strategy!r}")
    _check(m.truncation_k >= 1, f"mode.truncation_k must be >= 1, got {m.truncation_k}")
    _check(m.name != "ltfb" or m.strategy != "truncation" or 2 * m.truncation_k <= c.workers // m.trainer_size,
           f"mode.truncation_k = {m.truncation_k} needs at least {2 * m.truncation_k} trainers "
           f"(cluster.workers / mode.trainer_size = {c.workers // m.trainer_size})")
    _check(m.metric in ("accuracy", "loss"), f"mode.metric must be accuracy or loss, got {m.metric!r}")
    for key, span in m.explore.items():
        _check(key.startswith("optimizer.") and key[len("optimizer."):] in _NUMERIC_OPTIMIZER_KEYS,
               f"mode.explore: {key!r} is not a numeric optimizer key "
               f"(one of {', '.join('optimizer.' + k for k in _NUMERIC_OPTIMIZER_KEYS)})")
        _check(isinstance(span, list) and len(span) == 2
               and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in span)
               and span[0] <= span[1],
               f"mode.explore: {key} must be [low, high] with 0 < low <= high, got {span!r}")
        _check(key != "optimizer.momentum" or not isinstance(span, list) or len(span) != 2 or span[1] < 1,
               f"mode.explore: optimizer.momentum must stay below 1 (SGD diverges at 1 and above; it is Adam's "
               f"beta1 there, which must be < 1 too), got {span!r}")
        _check(key != "optimizer.eps" or o.name != "sgd",
               "mode.explore: optimizer.eps is Adam's and AdamW's epsilon; optimizer.name = sgd has none, so the "
               "trainers would differ only in the values their tournament lines show")
    _check(0 <= m.mutation < 1, f"mode.mutation must be in [0, 1), got {m.mutation}")
    _check(m.local_steps >= 1, f"mode.local_steps must be >= 1, got {m.local_steps}")
    _check(m.outer_lr > 0, f"mode.outer_lr must be > 0, got {m.outer_lr}")
    _check(0 <= m.outer_momentum < 1, f"mode.outer_momentum must be in [0, 1), got {m.outer_momentum}")
    _check(m.n_push >= 1 and m.n_fetch >= 1, f"mode.n_push and mode.n_fetch must be >= 1, got {m.n_push}, {m.n_fetch}")
    _check(o.name in ("sgd", "adam", "adamw"), f"optimizer.name must be sgd, adam or adamw, got {o.name!r}")
    _check(o.lr > 0, f"optimizer.lr must be > 0, got {o.lr}")
    _check(o.schedule in ("constant", "step", "cosine"),
           f"optimizer.schedule must be constant, step or cosine, got {o.schedule!r}")
    _check(o.warmup_steps >= 0, f"optimizer.warmup_steps must be >= 0, got {o.warmup_steps}")
    _check(o.step_size >= 1, f"optimizer.step_size must be >= 1 (steps between two decays of the step "
                             f"schedule), got {o.step_size}")
    _check(len(o.betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in o.betas),
           f"optimizer.betas must be two numbers in [0, 1), got {o.betas}")
    _check(0 <= o.momentum < 1, f"optimizer.momentum must be in [0, 1) (at 1 and above SGD's steps grow without "
                                f"bound), got {o.momentum}")
    outer = ("; in diloco [optimizer] is the inner optimizer, and the outer step is Nesterov already "
             "(mode.outer_momentum)") if m.name == "diloco" else ""
    _check(not o.nesterov or (o.name == "sgd" and o.momentum > 0),   # (else dropped without a word: plain SGD, Adam)
           f"optimizer.nesterov = true is Nesterov momentum for optimizer.name = sgd with optimizer.momentum > 0, "
           f"got optimizer.name = {o.name}, optimizer.momentum = {o.momentum:g}: set optimizer.nesterov = false"
           f"{' (psgd offers no NAdam)' if o.name != 'sgd' else ''}{outer}")
    _check(o.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")
    _check(o.eps > 0, f"optimizer.eps must be > 0, got {o.eps}")
    _check(o.gamma > 0 and o.min_lr >= 0, f"optimizer.gamma must be > 0 and optimizer.min_lr >= 0, "
                                          f"got {o.gamma}, {o.min_lr}")
    if o.schedule == "cosine":   # (else the rate stayed constant, or rose, without a word)
        _check(t.steps > o.warmup_steps, f"optimizer.schedule = \"cosine\" decays over train.steps after the "
                                         f"warm-up: it needs train.steps > optimizer.warmup_steps (a budget of "
                                         f"train.seconds alone has no length), got {t.steps}, {o.warmup_steps}")
        _check(o.min_lr <= o.lr, f"optimizer.min_lr must be <= optimizer.lr for the cosine schedule to decay, "
                                 f"got {o.min_lr} > {o.lr}")
    _check(cfg.model.hidden >= 1, f"model.hidden must be >= 1, got {cfg.model.hidden}")
    _check(cfg.eval.batch_size >= 1, f"eval.batch_size must be >= 1, got {cfg.eval.batch_size}")
    _check(len(cfg.data.shape) >= 1 and all(is_number(d) and isinstance(d, int) and d >= 1
                                            for d in cfg.data.shape),
           f"data.shape must be a list of sizes >= 1 (e.g. [1, 8, 8]), got {cfg.data.shape}")
    _check(t.batch_size >= 1, f"train.batch_size must be >= 1, got {t.batch_size}")
    _check(t.steps >= 0, f"train.steps must be >= 0, got {t.steps}")
    _check(t.seconds >= 0, f"train.seconds must be >= 0, got {t.seconds}")
    _check(t.steps > 0 or t.seconds > 0, "set train.steps or train.seconds (both are 0: the job would never end)")
    _check(0 < cfg.data.test_fraction < 1, f"data.test_fraction must be in (0, 1), got {cfg.data.test_fraction}")
    _check(cfg.data.loader_workers >= 0, f"data.loader_workers must be >= 0, got {cfg.data.loader_workers}")
    _check(0 < cfg.data.loader_timeout_s <= MAX_DELAY_S,   # (a DataLoader's queue read overflows past ~2.1e6 s)
           f"data.loader_timeout_s must be in (0, {MAX_DELAY_S:g}] seconds, got {cfg.data.loader_timeout_s}")
    _check(cfg.data.classes == 0 or cfg.data.classes >= 2,
           f"data.classes must be 0 (the dataset's own) or >= 2, got {cfg.data.classes}")
    _check(cfg.data.samples >= 1, f"data.samples must be >= 1 (the synthetic dataset's training samples), "
                                  f"got {cfg.data.samples}")
    if cfg.data.name == "synthetic":   # (refused later, in the data loader, as "data.classes must be >= 2 and
        classes = synthetic_classes(cfg.data)   # data.samples >= data.classes", naming neither value nor source)
        _check(cfg.data.samples >= classes,
               f"data.samples = {cfg.data.samples} is fewer than the synthetic dataset's {classes} classes "
               f"(data.classes{f' = 0: {classes}' if not cfg.data.classes else ''}): set data.samples >= {classes}")
    _check(cfg.eval.every_seconds > 0, f"eval.every_seconds must be > 0, got {cfg.eval.every_seconds}")
    _check(0 <= cfg.eval.target_accuracy <= 1,
           f"eval.target_accuracy must be in [0, 1], got {cfg.eval.target_accuracy}")
    faults = cfg.faults   # a worker sleeps its delays: past Python's longest sleep (~292 years), time.sleep
    #                      raised OverflowError at every worker's first step: the job aborted, all of them lost
    _check(faults.slow_rank >= -1,
           f"faults.slow_rank must be -1 (no straggler) or a worker's rank >= 0, got {faults.slow_rank}")
    _check(1 <= faults.slow_factor <= MAX_SLOW_FACTOR,
           f"faults.slow_factor must be in [1, {MAX_SLOW_FACTOR:g}] (times a step's compute), got {faults.slow_factor}")
    for key in ("step_delay_s", "jitter_s"):
        _check(0 <= getattr(faults, key) <= MAX_DELAY_S, f"faults.{key} must be in [0, {MAX_DELAY_S:g}] seconds "
                                                         f"(a worker sleeps it at a step), got {getattr(faults, key)}")
    _check(0 <= cfg.faults.jitter_prob <= 1, f"faults.jitter_prob must be in [0, 1], got {cfg.faults.jitter_prob}")
    sim = cfg.sim
    for key in ("compute_s", "compute_cv", "latency_s", "encode_ns", "decode_ns"):   # one key a message (load)
        _check(getattr(sim, key) >= 0, f"sim.{key} must be >= 0, got {getattr(sim, key)}")
    for key in ("bandwidth_gbps", "apply_gbps"):
        _check(getattr(sim, key) > 0, f"sim.{key} must be > 0, got {getattr(sim, key)}")
    _check(cfg.faults.on_worker_loss in ("continue", "abort"),
           f"faults.on_worker_loss must be continue or abort, got {cfg.faults.on_worker_loss!r}")
    _check(cfg.checkpoint.every_s >= 0, f"checkpoint.every_s must be >= 0, got {cfg.checkpoint.every_s}")
    _check(not cfg.security.curve or bool(cfg.security.keys),
           "security.curve = true needs security.keys (a folder made by `psgd keys DIR`)")


_NUMERIC_OPTIMIZER_KEYS = ("lr", "momentum", "weight_decay", "eps")
# The injected faults' bounds (a worker sleeps step_delay_s + jitter_s + (slow_factor - 1) x its compute at a
# step): far inside threading.TIMEOUT_MAX, and past any delay an experiment means (11.6 days a step).
MAX_DELAY_S = 1e6
MAX_SLOW_FACTOR = 1e6


def parse_value(text: str) -> Any:
    """A `--set` or environment value: TOML syntax if it parses, else a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_value_for(dotted: str, text: str) -> Any:
    """`parse_value`, but the text itself for a string key: `job.name=2024` and
    `PSGD_DATA_PATH=2024-01-01` (a TOML integer and date) were refused as "expected a
    string", with no quotes to give them in an environment variable."""
    value = parse_value(text)
    section, _, key = dotted.strip().partition(".")
    default = getattr(SECTIONS[section](), key, None) if section in SECTIONS else None
    return text if isinstance(default, str) and not isinstance(value, str) else value


def config_key(key: str) -> str:
    """A --modes item's key as the config key it sets: a mode's parameter (`staleness`) is
    `mode.staleness`; a SECTION.KEY is itself."""
    return key if "." in key else f"mode.{key}"


def _host_fault(host: str) -> str:
    """Why `host` is not a host of tcp://HOST:PORT ('' if it may be): a daemon bound
    tcp://*:PORT for any host but loopback, so a port given with the host was taken for
    the port (`bind_address`) and the job waited out its timeout."""
    if not host:
        return "no host"
    if "/" in host or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        return "a host takes no scheme, port or path"
    return ""


def tcp_parts(address: str) -> tuple[str, str]:
    """HOST and PORT of tcp://HOST:PORT as written (an IPv6 HOST in its brackets); PORT
    '' where none follows the host (tcp://10.0.0.1, tcp://[::1])."""
    rest = address[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    return (host, port) if sep and not port.endswith("]") else (rest, "")


def address_fault(address: str) -> str:
    """Why `address` is not tcp://HOST:PORT or ipc://PATH ('' if it is): a shard's address
    without a port (tcp://10.0.0.1) was bound as tcp://*:10.0.0.1, port 10 of every
    interface, and its workers died of ZeroMQ's "Invalid argument" traceback."""
    if address.startswith("ipc://"):
        return "" if address[6:] else "no path"
    if not address.startswith("tcp://"):
        return "no tcp:// or ipc:// scheme"
    host, port = tcp_parts(address)
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return "no port 1..65535 after the host"
    return _host_fault(host)


def format_value(v: Any) -> str:
    """`v` as a --set or --modes item writes it: `[0.9,0.99]`,
    `{optimizer.lr=[0.01,0.1]}`, not Python's repr (`{'optimizer': {'lr': [0.01, 0.1]}}`),
    in labels, report sentences and folder names."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ",".join(format_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}={format_value(x)}" for k, x in _dotted(v)) + "}"
    return str(v)


def _dotted(table: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """A table's values under their dotted keys: TOML reads `{optimizer.lr=...}` as nested tables."""
    for k, v in table.items():
        if isinstance(v, dict) and v:
            yield from _dotted(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def set_key(dotted: str) -> str:
    """A `--set` item's key as `load` reads it: ` cluster . servers ` is cluster.servers."""
    return ".".join(part.strip() for part in dotted.split("."))


def given_sets(sets: Sequence[str]) -> dict[str, str]:
    """`--set` items as `load` applies them: key (`set_key`) -> the text of its value, the
    last item's where a key is given twice."""
    return {set_key(k): text.strip() for k, _, text in (s.partition("=") for s in sets)}


def refuse_set_against_flag(sets: Sequence[str], key: str, value: Any, flag: str) -> None:
    """A ConfigError if a `--set key=...` in `sets` (the last one, which `load` applies)
    gives `key` another value than `value`, which `flag` (as the user wrote it) gives it:
    the flag would win without a word."""
    given = given_sets(sets)
    if key in given and parse_value_for(key, given[key]) != value:
        raise ConfigError(f"--set {key}={given[key]} and {flag} disagree: give one")


def _assign(d: dict, dotted: str, value: Any, source: str) -> None:
    section, _, key = dotted.partition(".")
    if not section or not key or "." in key:   # (`.workers=3` named an "unknown section []")
        raise ConfigError(f"{source}: expected section.key, got {dotted!r}" if source else
                          f"expected section.key, got {dotted!r}")
    d.setdefault(section, {})[key] = value


def _env_sets(env: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    out = []
    for name, text in env.items():
        if not name.startswith("PSGD_") or name in ENV_RESERVED:
            continue
        rest = name[len("PSGD_"):].lower()
        section, _, key = rest.partition("_")
        if section not in SECTIONS or not key:
            # (a misspelt variable of psgd's own, PSGD_OTU, was told only the settings' form)
            own = difflib.get_close_matches(name, ENV_OWN, n=1, cutoff=0.75)
            raise ConfigError(f"environment: {name} is not a psgd setting "
                              + (f"(did you mean {own[0]}?)" if own else
                                 f"(expected PSGD_<SECTION>_<KEY>, sections: {', '.join(SECTIONS)}; "
                                 f"the deploy files' own settings are DEPLOY_*)"))
        out.append((f"{section}.{key}", parse_value_for(f"{section}.{key}", text), f"environment {name}"))
    return out


def env_sets(env: Mapping[str, str] | None = None) -> list[str]:
    """The settings of the PSGD_<SECTION>_<KEY> variables, as `--set` items."""
    return [f"{dotted}={format_value(value)}" for dotted, value, _ in _env_sets(os.environ if env is None else env)]


def given_keys(path: str | None = None, sets: list[str] | tuple = (),
               env: Mapping[str, str] | None = None) -> set[str]:
    """The dotted keys that the file, the environment or `--set` give a value (the rest
    are defaults): `psgd run` honours an explicit cluster.port and chooses an unset one.
    A file psgd wrote (a job's OUT/config.toml: every key, `written_by_psgd`) gives none:
    its cluster.port is the block an earlier psgd run chose, not the user's, and a job run
    again from it was refused whenever another job held that block."""
    env = os.environ if env is None else env
    keys = {dotted for dotted, _, _ in _env_sets(env)}
    keys |= set(given_sets(sets))
    if path:
        text, d = _read_config(path)
        if written_by_psgd(text):
            return keys
        keys |= {f"{section}.{key}" for section, values in d.items() if isinstance(values, Mapping) for key in values}
    return keys


def _read_toml(path: str) -> dict:
    """A config file's contents; a ConfigError naming the file if it cannot be read."""
    return _read_config(path)[1]


def _read_config(path: str) -> tuple[str, dict]:
    """A config file's text and contents, from one read; a ConfigError naming the file if
    it cannot be read."""
    try:
        with open(path, encoding="utf-8-sig") as f:   # (a byte-order mark, as Windows editors save
            text = f.read()                          # UTF-8, was "Invalid statement (at line 1, column 1)")
        return text, tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}); TOML files are UTF-8") from None
    except OSError as e:   # a folder, no permission
        raise ConfigError(f"config file {path}: {e.strerror or e}") from None


def load(path: str | None = None, sets: list[str] | tuple = (),
         env: Mapping[str, str] | None = None, said_as: Mapping[str, str] | None = None) -> Config:
    """Build the config from defaults, a TOML file, the environment and `--set` flags.
    An error names a bad value's source: the file, the variable, `--set ITEM`, or what
    `said_as` gives for ITEM (the command-line flag that set it: `--workers 0`)."""
    env = os.environ if env is None else env
    d: dict = {}
    if path:
        d = _read_toml(path)
        build(d, path, check=False)  # report type errors against the file
    layered = [(k, v, s) for k, v, s in _env_sets(env)]
    for item in sets:
        dotted, eq, text = item.partition("=")
        if not eq:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        dotted = set_key(dotted)
        layered.append((dotted, parse_value_for(dotted, text.strip()),
                        (said_as or {}).get(item, f"--set {item}")))
    sources = {f"{section}.{key}": path for section, values in d.items() if isinstance(values, Mapping)
               for key in values}
    for dotted, value, source in layered:
        _assign(d, dotted, value, source)
        section, key = dotted.split(".", 1)
        build({section: {key: value}}, source, check=False)  # name the source of a bad value
        sources[dotted.strip()] = source
    try:
        return build(d, path or "config")
    except ConfigError as e:   # a value out of range: named with where it came from, if one key says so
        named = [key for key in sources if re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", str(e))]
        if len(named) == 1:
            raise ConfigError(f"{sources[named[0]]}: {e}") from None
        raise
