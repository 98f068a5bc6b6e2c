"""Consistency modes: one module per mode, each with its server rule and its worker
schedule (see `rule`), and the registry below. Adding a mode is one new module and one
line here.

A registry line names the mode's module and classes; the module (and torch, which the
rules use) is imported when the mode is first looked up (`get(name)`, `MODES[name]`).
The names and config keys of the modes (`NAMES`, `PARAMS`, iterating `MODES`) import
nothing, so that `psgd.config` takes them from here and the coordinator, which runs no
rule, starts without torch.

Building blocks the modes share, all pure state machines or arithmetic:
- `barrier.StepBarrier` — bulk-synchronous steps with backup workers; easgd's rounds
- `clock.ClockTable`    — the bounded-staleness read gate (unbounded: async)
- `staleness`           — staleness-aware learning rate, delay compensation, histograms
- `elastic`             — the EASGD centre's arithmetic
- `tournament`          — LTFB pairings, adoption, and the model exchange
- `pushpull`            — the worker schedule of the parameter-server modes
"""
from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .rule import Mode


@dataclass(frozen=True)
class Entry:
    """One registry line: the mode's name; its module in this package; the names there
    of its `ServerRule` and `Schedule` classes; the config keys that matter for it
    (`ModeConfig` fields: summaries, labels); the name there of its `global_model`
    function, when its global model is not the shards' parameters; and the key of the
    share of each worker's partition it holds out of training (`data_split`), if any."""
    name: str
    module: str
    rule: str
    schedule: str
    params: tuple[str, ...]
    global_model: str = ""
    data_split: str = ""


class Registry(Mapping[str, "Mode"]):
    """name -> `rule.Mode`, importing a mode's module on its first lookup."""

    def __init__(self, *entries: Entry):
        self.entries = {e.name: e for e in entries}
        self._loaded: dict[str, Mode] = {}

    def __getitem__(self, name: str) -> Mode:
        if name not in self._loaded:
            e = self.entries[name]
            from . import rule
            module = importlib.import_module(f"{__name__}.{e.module}")
            extra = (getattr(module, e.global_model),) if e.global_model else ()
            self._loaded[name] = rule.Mode(e.name, getattr(module, e.rule), getattr(module, e.schedule), e.params,
                                           *extra)
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


MODES = Registry(
    Entry("sync", "sync", "SyncRule", "SyncSchedule", ("backup_workers",)),
    Entry("ssp", "ssp", "SspRule", "SspSchedule", ("staleness", "cache", "prefetch")),
    Entry("async", "asynchronous", "AsyncRule", "AsyncSchedule",
          ("lr_policy", "dc_lambda", "prefetch", "n_push", "n_fetch")),
    Entry("easgd", "easgd", "EasgdRule", "EasgdSchedule", ("tau", "alpha", "sync")),
    Entry("ltfb", "ltfb", "LtfbRule", "LtfbSchedule",
          ("round_steps", "tournament_fraction", "exchange", "trainer_size", "strategy", "truncation_k", "metric",
           "explore", "mutation"), "global_model", data_split="tournament_fraction"),
    Entry("diloco", "diloco", "DilocoRule", "DilocoSchedule", ("local_steps", "outer_lr", "outer_momentum")),
)

NAMES: tuple[str, ...] = tuple(MODES)
PARAMS: dict[str, tuple[str, ...]] = {name: e.params for name, e in MODES.entries.items()}


def data_split(cfg) -> float:
    """The share of each worker's partition that the job's mode holds out of training
    (its schedule's `data_split`), without importing the mode: the launcher checks the
    partitions without torch."""
    key = MODES.entries[cfg.mode.name].data_split
    return float(getattr(cfg.mode, key)) if key else 0.0


def shared_step(cfg) -> bool:
    """Do the shards keep a step (a round) that every worker moves up to: sync, ssp,
    diloco, easgd with sync rounds? A new process taking up a lost rank starts there at
    the slowest live worker's clock (SSP's gate counts it from there), and its schedule
    moves it up to the shards'. In async, easgd's async rounds and ltfb each worker's
    clock is its own budget of `train.steps`: a new process continues at its rank's."""
    return cfg.mode.name in ("sync", "ssp", "diloco") or (cfg.mode.name == "easgd" and bool(cfg.mode.sync))


def get(name: str) -> Mode:
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r} (modes: {', '.join(MODES)})") from None
