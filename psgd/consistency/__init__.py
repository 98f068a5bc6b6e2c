"""Consistency modes: one module per mode, each with its server rule and its worker
schedule (see `rule`), and the registry below. Adding a mode is one new module and one
line here.

Building blocks the modes share, all pure state machines or arithmetic:
- `barrier.StepBarrier` — bulk-synchronous steps with backup workers; easgd's rounds
- `clock.ClockTable`    — the bounded-staleness read gate (unbounded: async)
- `staleness`           — staleness-aware learning rate, delay compensation, histograms
- `elastic`             — the EASGD centre's arithmetic
- `tournament`          — LTFB pairings, adoption, and the model exchange
- `pushpull`            — the worker schedule of the parameter-server modes
"""
from __future__ import annotations

from . import asynchronous, easgd, ltfb, ssp, sync
from .rule import Mode

MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("sync", sync.SyncRule, sync.SyncSchedule, ("backup_workers",)),
    Mode("ssp", ssp.SspRule, ssp.SspSchedule, ("staleness",)),
    Mode("async", asynchronous.AsyncRule, asynchronous.AsyncSchedule, ("lr_policy", "dc_lambda")),
    Mode("easgd", easgd.EasgdRule, easgd.EasgdSchedule, ("tau", "alpha", "sync")),
    Mode("ltfb", ltfb.LtfbRule, ltfb.LtfbSchedule, ("round_steps", "tournament_fraction", "exchange"),
         ltfb.global_model),
)}


def get(name: str) -> Mode:
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r} (modes: {', '.join(MODES)})") from None
