"""`psgd compare`: run several consistency modes one after another and report.

    psgd compare [CONFIG] --modes sync,ssp:staleness=2,async,easgd:tau=4,ltfb \\
                 [--workers 3 | --workers 1,2,4] [--servers S] [--repeats N] \\
                 [--set k=v ...] [--no-baseline] --out DIR

`--modes` is a comma-separated list of modes, each optionally followed by parameters
(`mode:key=value`, several as `mode:k1=v1:k2=v2`). A list of values for the last key
sweeps it: `ssp:staleness=0,1,2,4,8` is five runs. Because commas also separate modes,
an item without ':' that is not a mode name (and has no '=') is one more value of the
previous item's last key: `sync,ssp:staleness=0,2,async` is sync, ssp s=0, ssp s=2, async;
such a value close to a mode's name (`job.name=a,asnyc`) is refused as a misspelled mode.

Every configuration (mode x parameters x worker count) runs with the same model, data,
optimizer and budget via the local launcher, each in DIR/runs/<name>/ (its own events,
logs, summary.json). Repeat r uses job.seed + r for every configuration, so repeats are
paired across modes. `--set` flags apply to every run (a --set of a key that a mode item
sets too is refused: the item would win for its runs). Unless --no-baseline, each repeat
also trains the sequential baseline (psgd.baseline) in this process, with the budget of
the largest run: max(W) x train.steps steps of train.batch_size samples.

Writes DIR/compare.json (the per-run summaries, tagged with label, mode, params,
workers, repeat, and the evaluator's period), DIR/compare-context.json (what was run, on
what), DIR/report.md and the PNG plots (psgd.report). `python -m psgd.report DIR` rebuilds
the report.
"""
from __future__ import annotations

import difflib
import glob
import json
import os
import re
import shlex
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import IO, Any

from .config import (
    MODES,
    Config,
    ConfigError,
    config_key,
    env_sets,
    format_value,
    given_sets,
    load,
    parse_value_for,
    refuse_set_against_flag,
)
from .log import say
from .metrics import cpu_wait_said, write_json_atomic
from .report_numbers import AFTER_END, FIRST_SCORE, amount, lost_words, records_staleness, ttt_flag

# ---------------------------------------------------------------- --modes / --workers


def mode_keys(mode: str) -> list[str]:
    """The parameters of `mode` (the keys of Config.mode_params)."""
    return list(Config().replace(**{"mode.name": mode, "cluster.workers": 2}).mode_params)


@dataclass(frozen=True)
class ModeSpec:
    mode: str
    params: tuple = ()           # ((key, value), ...) as written, in order
    sweep: str | None = None     # the key this entry sweeps, if it came from a value list

    @property
    def label(self) -> str:
        return ":".join([self.mode] + [f"{k}={format_value(v)}" for k, v in self.params])

    @property
    def sweep_value(self) -> Any:
        return dict(self.params).get(self.sweep) if self.sweep else None


def _is_config_key(key: str) -> bool:
    """SECTION.KEY naming a config key: a mode item may set or sweep any of them
    (`sync:wire.dtype=float32,bfloat16`)."""
    section, dot, name = key.partition(".")
    return bool(dot) and hasattr(getattr(Config(), section, None), name)


# Config keys that the plan itself sets for each run, and the flag that does it: a mode
# item setting one would run something else than the run it is reported as.
PLAN_KEYS = {"mode.name": "the mode item's own name (MODE:...)", "cluster.workers": "--workers",
             "job.seed": "--repeats (each repeat has its own seed)", "cluster.servers": "--servers"}
# Sections that say what every run is measured on (the budget, the data and model, the
# target and how often it is scored): the report reads them once for all runs, so a
# mode item may not set them; --set sets them for every run.
SHARED_SECTIONS = ("train", "eval", "data", "model")
COMPARE_LOCK = ".compare.lock"   # in --out: held by the psgd compare (or simulate) that writes there


def split_outside(text: str, sep: str) -> list[str]:
    """`text` split at `sep` where it is not inside brackets, braces or quotes: a list
    or a table value (`optimizer.betas=[0.9,0.99]`) is one value."""
    parts, depth, quote, start = [], 0, "", 0
    for k, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth = max(0, depth - 1)
        elif ch == sep and depth == 0:
            parts.append(text[start:k])
            start = k + 1
    return parts + [text[start:]]


def parse_modes(text: str, shared: tuple[str, ...] = SHARED_SECTIONS) -> list[ModeSpec]:
    """`sync,ssp:staleness=0,1,2,async,easgd:tau=4:alpha=0.3` -> ModeSpecs, sweeps expanded.
    A mode item may not set keys of the `shared` sections (the same for every run)."""
    if not text or not text.strip():
        raise ConfigError("--modes: empty (expected e.g. sync,ssp:staleness=2,async)")
    groups: list[tuple[str, list[list]]] = []  # (mode, [[key, [values...]], ...])
    for raw in split_outside(text, ","):
        item = raw.strip()
        if not item:
            raise ConfigError(f"--modes {text!r}: empty item (two commas in a row?)")
        if ":" in item or item in MODES:
            mode, _, rest = item.partition(":")
            mode = mode.strip()
            if mode not in MODES:
                hint = ""
                if groups and groups[-1][1]:   # sync:wire.compression=none,topk:wire.topk_fraction=0.05
                    last = groups[-1][1][-1][0]
                    hint = (f"; if {mode!r} is one more value of {last}: only an item's last parameter takes a "
                            f"list, so put {last} last")
                raise ConfigError(f"--modes: unknown mode {mode!r} in {item!r} (modes: {', '.join(MODES)}){hint}")
            keys = mode_keys(mode)
            params: list[list] = []
            if ":" in item and not rest.strip():
                raise ConfigError(f"--modes: {item!r}: nothing after the colon (expected {mode}:key=value)")
            for part in (split_outside(rest, ":") if rest else []):
                key, eq, value = part.partition("=")
                key, value = key.strip(), value.strip()
                if not eq or not key or not value:
                    raise ConfigError(f"--modes: {item!r}: expected {mode}:key=value, got {part!r}")
                if key in PLAN_KEYS:
                    raise ConfigError(f"--modes: {item!r}: {key} is set by the plan, not by a mode item: "
                                      f"use {PLAN_KEYS[key]}")
                if key.partition(".")[0] in shared:
                    raise ConfigError(f"--modes: {item!r}: {key} is the same for every run of a comparison (the "
                                      f"report reads it once): set it with --set {key}=...")
                if key.startswith("mode."):   # mode.staleness is ssp's staleness: a parameter of the mode, or none
                    if key[len("mode."):] not in keys:
                        raise ConfigError(f"--modes: {mode} has no parameter {key[len('mode.'):]!r} (its "
                                          f"parameters: {', '.join(keys) or 'none'})")
                    key = key[len("mode."):]
                elif key not in keys and not _is_config_key(key):
                    raise ConfigError(f"--modes: {mode} has no parameter {key!r} (its parameters: {', '.join(keys)};"
                                      f" or any config key as SECTION.KEY, e.g. wire.dtype)")
                if any(p[0] == key for p in params):
                    raise ConfigError(f"--modes: {item!r} sets {key} twice")
                params.append([key, [parse_value_for(config_key(key), value)]])
            groups.append((mode, params))
        elif "=" not in item and groups and groups[-1][1]:
            # One more value of the previous item's last key: ssp:staleness=0,1,2
            groups[-1][1][-1][1].append(parse_value_for(config_key(groups[-1][1][-1][0]), item))
        elif "=" in item:
            raise ConfigError(f"--modes: {item!r} names no mode (write MODE:{item})")
        else:
            raise ConfigError(f"--modes: {item!r} is neither a mode ({', '.join(MODES)}) nor a value "
                              f"of the previous mode's parameter")
    specs: list[ModeSpec] = []
    for mode, params in groups:
        fixed = tuple((k, vs[0]) for k, vs in params[:-1])
        for _key, vs in params[:-1]:
            if len(vs) > 1:  # cannot happen: only the last key collects values
                raise ConfigError(f"--modes: only the last parameter of {mode} can take a list")
        if params and len(params[-1][1]) > 1:
            key, values = params[-1]
            if len(set(map(repr, values))) != len(values):
                raise ConfigError(f"--modes: {mode}:{key} lists a value twice")
            specs += [ModeSpec(mode, fixed + ((key, v),), sweep=key) for v in values]
        else:
            specs.append(ModeSpec(mode, fixed + ((params[-1][0], params[-1][1][0]),) if params else ()))
    seen = set()
    for s in specs:
        if s.label in seen:
            raise ConfigError(f"--modes: {s.label} is listed twice")
        seen.add(s.label)
    return specs


def parse_workers(text: str | None) -> list[int] | None:
    """`"3"` -> [3]; `"1,2,4"` -> [1, 2, 4]; None -> None (the config's cluster.workers).
    An empty --workers (a shell variable that was not set) is an error, not the default."""
    if text is None:
        return None
    if not str(text).strip():
        raise ConfigError("--workers: empty (expected a worker count, or a comma-separated sweep: 1,2,4)")
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ConfigError(f"--workers: expected positive integers separated by commas, got {text!r}")
        if int(part) in out:
            raise ConfigError(f"--workers: {part} is listed twice")
        out.append(int(part))
    return out


def refuse_sets_the_plan_overrides(sets: list[str], workers: list[int] | None, servers: int | None) -> None:
    """A --set of a key that the plan sets for every run, which it would override without
    a word while the report listed it as applied: each run's mode (--modes), and the
    workers or servers where --workers or --servers give other values."""
    given = given_sets(sets)
    if "mode.name" in given:
        raise ConfigError(f"--set mode.name={given['mode.name']}: each run's mode comes from --modes; give "
                          f"--modes {given['mode.name']} instead")
    if workers is not None:   # (a sweep of several counts disagrees with any one)
        refuse_set_against_flag(sets, "cluster.workers", workers[0] if len(workers) == 1 else workers,
                                f"--workers {','.join(map(str, workers))}")
    if servers is not None:
        refuse_set_against_flag(sets, "cluster.servers", servers, f"--servers {servers}")


def refuse_sets_an_item_overrides(sets: list[str], specs: list[ModeSpec]) -> None:
    """A --set of a key that a mode item also sets (`--set mode.staleness=4` with
    `--modes ssp:staleness=0,2`): the item's value wins for its runs, while the report
    listed the --set as applied to every run."""
    given = given_sets(sets)
    for spec in specs:
        for key, value in spec.params:
            dotted = config_key(key)
            if dotted in given and parse_value_for(dotted, given[dotted]) != value:
                raise ConfigError(f"--set {dotted}={given[dotted]} and --modes {spec.label} disagree (the item's "
                                  f"value would win for its runs): give {dotted} in one place")


# ---------------------------------------------------------------- the plan


@dataclass
class Run:
    label: str
    mode: str
    params: dict
    workers: int
    repeat: int
    cfg: Config
    name: str
    sweep: str | None = None
    sweep_value: Any = None
    baseline_steps: int | None = None  # set for the sequential baseline

    @property
    def is_baseline(self) -> bool:
        return self.mode == "baseline"

    def describe(self) -> str:
        if self.is_baseline:
            return f"baseline (sequential, 1 process), repeat {self.repeat}"
        return f"{self.label}, {self.workers} worker{'s' if self.workers != 1 else ''}, repeat {self.repeat}"


def _folder(mode: str, params: dict, workers: int, repeat: int) -> str:
    parts = [mode] + [f"{k}={format_value(v)}" for k, v in params.items()] + [f"w{workers}", f"r{repeat}"]
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", "-".join(parts))


def baseline_config(base: Config, seed: int) -> Config:
    """The sequential baseline's config: one worker, and the default mode section, since it
    runs no mode (the base's mode keys, as mode.backup_workers = 1 or ltfb's trainer_size = 2,
    may need more workers than its one)."""
    d = {**base.to_dict(), "mode": {}}
    d["job"]["seed"], d["cluster"]["workers"] = seed, 1
    try:
        return Config.from_dict(d)
    except ConfigError as e:
        raise ConfigError(f"the sequential baseline: {e}") from None


def _sweeps_topk(spec: ModeSpec, specs: list[ModeSpec]) -> bool:
    """Whether `spec` is one value of a wire.compression sweep that has a topk value (whose
    wire.topk_fraction the item sets: sync:wire.topk_fraction=0.05:wire.compression=none,topk)."""
    def fixed(s: ModeSpec) -> tuple:
        return tuple(p for p in s.params if p[0] != "wire.compression")
    return spec.sweep == "wire.compression" and any(
        o.mode == spec.mode and o.sweep == spec.sweep and fixed(o) == fixed(spec)
        and dict(o.params).get("wire.compression") == "topk" for o in specs)


def _read_as_a_value(spec: ModeSpec, specs: list[ModeSpec], cutoff: float = 0.6) -> str:
    """'...so it was read as one more value: if it is a mode, did you mean ltfb?' for a
    swept value after the list's first that is close to a mode's name (`easgd:tau=4,ltbf`:
    a misspelled mode after a value list is read as one more value of that list), else ''."""
    k, value = specs.index(spec), spec.sweep_value
    later = k > 0 and (specs[k - 1].mode, specs[k - 1].sweep) == (spec.mode, spec.sweep)   # not the list's first
    close = difflib.get_close_matches(value, MODES, n=1, cutoff=cutoff) \
        if later and spec.sweep and isinstance(value, str) else []
    return (f"{value!r} came after a value of {spec.sweep}, so it was read as one more value: if it is a mode, "
            f"did you mean {close[0]}?") if close else ""


def _the_jobs_key(base: Config, sets: dict, error: str) -> str:
    """'wire.compression is the job's (...): set it in the items that take it' for an
    error that names a key the job sets for every item (`--set`, the config file), not
    this item (`--modes sync,easgd --set wire.compression=topk`: easgd pushes none), else ''."""
    default = Config().to_dict()
    for section, values in base.to_dict().items():
        for key, value in values.items():
            dotted = f"{section}.{key}"
            if (value != default[section][key] and dotted not in sets
                    and re.search(rf"(?<![\w.]){re.escape(dotted)}(?![\w])", error)):
                return (f"{dotted} = {value} is the job's, for every mode item: set it in the items that take it "
                        f"instead, as MODE:{dotted}={value}")
    return ""


MISSPELLED_CUTOFF = 0.75   # a value of a key that takes any text is taken for a mode's misspelling only this close


def _takes_any_text(base: Config, key: str) -> bool:
    """Whether config key `key` takes any text (job.name, checkpoint.dir), not one of a few
    choices (optimizer.name=sgd is one, though close to easgd's name)."""
    try:
        base.replace(**{key: "psgd-no-choice-of-any-key"})
    except ConfigError:
        return False
    return isinstance(getattr(getattr(base, key.partition(".")[0]), key.partition(".")[2]), str)


MAX_REPEATS = 10_000   # of each configuration (each repeat is a run of its own)


def build_plan(base: Config, specs: list[ModeSpec], workers: list[int], repeats: int,
               servers: int | None = None, baseline: bool = True) -> list[Run]:
    """Every run, in order: for each repeat the baseline, then each worker count x mode.
    Configs are built (and validated) here, before anything runs."""
    if not 1 <= repeats <= MAX_REPEATS:   # (a typo of 100000000 built its plan for minutes)
        raise ConfigError(f"--repeats must be in 1..{MAX_REPEATS}, got {repeats}")
    if base.job.seed + repeats > 2 ** 32:
        raise ConfigError(f"--repeats {repeats} with job.seed = {base.job.seed}: repeat r runs with seed job.seed + r, "
                          f"which must stay below 2**32; set a smaller job.seed")
    plan: list[Run] = []
    for r in range(repeats):
        seed = base.job.seed + r
        if baseline:
            steps = max(workers) * base.train.steps if base.train.steps else 0
            cfg = baseline_config(base, seed)
            plan.append(Run("baseline", "baseline", {}, 1, r, cfg, f"baseline-r{r}", baseline_steps=steps))
        for w in workers:
            for spec in specs:
                sets = {"mode.name": spec.mode, "cluster.workers": w, "job.seed": seed}
                if servers is not None:
                    sets["cluster.servers"] = servers
                sets.update({config_key(k): v for k, v in spec.params})
                try:
                    cfg = base.replace(**sets)
                except ConfigError as e:
                    hint = _read_as_a_value(spec, specs) or _the_jobs_key(base, sets, str(e))
                    raise ConfigError(f"--modes {spec.label} with {w} worker{'s' * (w != 1)}: {e}"
                                      + (f" ({hint})" if hint else "")) from None
                value = spec.sweep_value
                if spec.sweep and isinstance(value, str) and value.isalpha() \
                        and _takes_any_text(base, config_key(spec.sweep)):
                    # (refused as a value of a key of choices or numbers is: sync:job.name=a,asnyc; a word
                    # only, and closer: sync:job.name=sync1,sync2 and checkpoint.dir=/tmp/sync are values)
                    said = _read_as_a_value(spec, specs, MISSPELLED_CUTOFF)
                    if said:
                        raise ConfigError(f"--modes {spec.label}: {said} If it is a value of {spec.sweep}, give it "
                                          f"in an item of its own: {spec.mode}:{spec.sweep}={value}")
                params = dict(spec.params)
                if "wire.topk_fraction" in params and cfg.wire.compression != "topk" and not _sweeps_topk(spec, specs):
                    raise ConfigError(f"--modes {spec.label}: wire.topk_fraction is the share a topk push sends, and "
                                      f"this run's wire.compression is {cfg.wire.compression}: it would change "
                                      f"nothing (set wire.compression=topk, in the item or with --set)")
                plan.append(Run(spec.label, spec.mode, params, w, r, cfg, _folder(spec.mode, params, w, r),
                                sweep=spec.sweep, sweep_value=spec.sweep_value))
    seen: dict[str, Run] = {}
    for run in plan:   # a run's folder is its own (a second would replace the first's), and a mode run's config
        keys = [run.name] if run.is_baseline else [run.name, json.dumps(run.cfg.to_dict(), sort_keys=True)]
        for key in keys:
            if key in seen:
                raise ConfigError(f"--modes {seen[key].label} and {run.label} with {run.workers} "
                                  f"worker{'s' * (run.workers != 1)} are the "
                                  f"same run (folder runs/{seen[key].name}): give each configuration once "
                                  f"(--repeats repeats them)")
            seen[key] = run
    for run in plan:   # (after: the check above compares the configurations as given)
        if run.cfg.checkpoint.dir and not run.is_baseline:
            # Each run's own: with one checkpoint.dir a run's shards found the earlier run's
            # checkpoints there (and `psgd run` refuses a folder another job holds).
            run.cfg = run.cfg.replace(**{"checkpoint.dir": os.path.join(run.cfg.checkpoint.dir, run.name)})
    return plan


# ---------------------------------------------------------------- progress


def _fmt_duration(s: float) -> str:
    s = max(0.0, s)
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def processes(run: Run) -> float:
    """A real run's size for `estimate_left`: seconds per run ~ a + b*W; with few points,
    proportional to W + 3 other processes (to start, and to share the cores)."""
    return run.workers + 3


def estimate_left(plan: list[Run], done: dict[int, float], next_index: int,
                  size: Callable[[Run], float] = processes) -> float | None:
    """Seconds left for plan[next_index:], from the durations of the runs done so far:
    the mean of finished runs of the same kind (baseline or distributed), scaled by
    `size` for distributed runs."""
    dist = [(size(plan[i]), d) for i, d in done.items() if not plan[i].is_baseline]
    base = [d for i, d in done.items() if plan[i].is_baseline]
    per_unit = sum(d for _, d in dist) / sum(n for n, _ in dist) if dist else None
    total = 0.0
    for run in plan[next_index:]:
        if run.is_baseline:
            if base:
                total += sum(base) / len(base)
            elif per_unit is not None:
                total += per_unit * size(run)  # a guess until one baseline has run
            else:
                return None
        elif per_unit is not None:
            total += per_unit * size(run)
        else:
            return None
    return total


def _tail_line(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4096))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


class _AfterTheLine:
    """sys.stderr while a Monitor's updating line is on a terminal: what another writes
    there (the launcher's warnings, a daemon's exit) starts on a cleared line, not glued
    after the status ("...started 3/10 processes[psgd run] port block ..."), and the
    status waits until that line is ended."""

    def __init__(self, monitor: Monitor):
        self._monitor = monitor

    def write(self, text: str) -> int:
        m = self._monitor
        with m.lock:
            if m.on_line and text:
                m.stream.write("\r\033[K")
                m.on_line = False
            if text:
                m.mid_line = not text.endswith("\n")
            return m.stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._monitor.stream, name)


class Monitor:
    """While a run goes on, reads the tail of its event logs and shows how far it is:
    one updating line on a terminal (not a TERM=dumb one), a line every `every_s`
    otherwise."""

    def __init__(self, prefix: str, folder: str, steps: int, stream=None, every_s: float | None = None):
        self.prefix, self.folder, self.steps = prefix, folder, steps
        self.stream = stream or sys.stderr
        # (a dumb terminal, Emacs' shell's, shows \033[K as "^[[K": it gets the lines a log gets)
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) and os.environ.get("TERM") != "dumb"
        self.every_s = every_s if every_s is not None else (1.0 if self.tty else 15.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.t0 = time.monotonic()
        self._shown = False
        self._started: tuple[int, int] | None = None   # (k, N) processes started: the launcher's count
        self.lock = threading.Lock()   # (a terminal's line: the status, or another's through _AfterTheLine)
        self.on_line = False           # the status is on the terminal's current line
        self.mid_line = False          # another's line is on it, not yet ended
        self._stderr: Any = None       # sys.stderr as it was, while _AfterTheLine stands in for it

    def started(self, k: int, total: int) -> None:
        """The launcher's `on_started`: k of the run's `total` processes have started."""
        self._started = (k, total)

    def status(self) -> str:
        events = os.path.join(self.folder, "events")
        clocks, acc = [], None
        try:
            names = os.listdir(events)
        except OSError:
            names = []
        for n in names:
            if n.startswith("worker-"):
                last = _tail_line(os.path.join(events, n))
                if last and "clock" in last:
                    clocks.append(int(last["clock"]))
            elif n.startswith("evaluator-"):
                last = _tail_line(os.path.join(events, n))
                if last and "accuracy" in last:
                    acc = float(last["accuracy"])
        elapsed = time.monotonic() - self.t0
        if not clocks:   # (a quiet launcher says nothing of its start-up: its count is said here)
            where = f"started {self._started[0]}/{self._started[1]} processes" if self._started \
                else "starting processes"
        else:
            total = f"/{self.steps}" if self.steps else ""
            where = f"step {min(clocks)}{total}"
        return f"{self.prefix}  {elapsed:5.0f} s  {where}" + (f"  acc {acc:.3f}" if acc is not None else "")

    def show(self) -> None:
        line = self.status()
        with self.lock:
            if self.tty:
                if self.mid_line:
                    return
                # (wider than the terminal, it wraps, and \r\033[K clears only its last row:
                # the rows above stayed, one more at each update)
                self.stream.write("\r\033[K" + line[:max(1, _columns(self.stream) - 1)])
                self.on_line = True
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
            self._shown = True

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.show()

    def __enter__(self):
        if self.tty and self.stream is sys.stderr:
            self._stderr, sys.stderr = sys.stderr, _AfterTheLine(self)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        try:
            self._thread.join(timeout=5)
        finally:   # (a second Ctrl-C in the join left sys.stderr wrapped after the run)
            if self._stderr is not None:
                sys.stderr, self._stderr = self._stderr, None
            with self.lock:
                if self.tty and self._shown and self.on_line:
                    self.stream.write("\r\033[K")
                    self.stream.flush()
                self.on_line = False   # (a writer still holding the wrapper clears no later line)


def _columns(stream) -> int:
    """The width of the terminal `stream` shows on: $COLUMNS where set (as
    shutil.get_terminal_size reads it), else the terminal's own, now (it may be resized
    while a run goes on), else 80."""
    with suppress(ValueError):
        if int(os.environ.get("COLUMNS", "")) > 0:
            return int(os.environ["COLUMNS"])
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, ValueError, OSError):   # (io.UnsupportedOperation is both)
        return 80


# ---------------------------------------------------------------- running


class BaselineFailed(RuntimeError):
    """What the baseline, which trains in this process, raised (a ValueError of the
    user's model, a KeyError of a dataset's item): its run failed, as a distributed run's
    job that ends with an error, and the plan goes on (it ended the comparison, with
    a traceback and no report)."""


def run_one(run: Run, folder: str, device: str, timeout_s: float | None, prefix: str = "") -> dict:
    """One run's summary (raises LaunchError / ConfigError on failure)."""
    from .launcher import run_local
    if os.path.exists(folder):
        # Events are appended: start each run from an empty folder. The baseline's too: an
        # earlier comparison's summary.json stayed in a baseline folder whose run now failed
        # or was interrupted, and `psgd status` read it as this run's.
        shutil.rmtree(folder)
    # One TensorBoard run per configuration and repeat, side by side: OUT/tb/RUN/, this run's
    # (an earlier comparison's of the same name stood there where this one failed)
    tb = os.path.join(os.path.dirname(os.path.dirname(folder)), "tb", os.path.basename(folder))
    shutil.rmtree(tb, ignore_errors=True)
    if run.cfg.checkpoint.dir and not run.is_baseline and os.path.isdir(run.cfg.checkpoint.dir):
        # This run's own checkpoint folder (`build_plan`) outside its run folder: an
        # earlier comparison's run of the same name, interrupted, left its shards'
        # checkpoints there, and the launcher resumed them (this run's summary counted
        # from the start of a job that began with that one's model). Not while a job holds
        # the folder (another comparison's run of that name): the launcher refuses the run.
        from .launcher import LOCK_FILE, hold
        lock = hold(os.path.join(run.cfg.checkpoint.dir, LOCK_FILE))
        if lock is not None:
            try:
                for path in glob.glob(os.path.join(run.cfg.checkpoint.dir, "shard-*.pt*")):
                    os.unlink(path)
            finally:
                lock.close()
    if run.is_baseline:
        from .baseline import run_baseline
        try:
            return run_baseline(run.cfg, out=folder, device=device, steps=run.baseline_steps, timeout_s=timeout_s)
        except (RuntimeError, ConfigError, OSError):
            raise
        except Exception as e:   # the user's model or dataset, in this process: the run fails, not the plan
            raise BaselineFailed(f"the baseline failed: {type(e).__name__}: {e}") from e
    summary = None
    try:
        with Monitor(prefix, folder, run.cfg.train.steps) as monitor:
            # A port taken by another job before the daemons bind it: the launcher moves the job.
            summary = run_local(run.cfg, folder, device=device, quiet=True, timeout_s=timeout_s,
                                on_started=monitor.started)
        if run.cfg.eval.tensorboard and os.path.isdir(os.path.join(folder, "tb")):
            shutil.copytree(os.path.join(folder, "tb"), tb)
    except KeyboardInterrupt as e:   # after run_local returned (the monitor's end, the copy): the run is done
        if summary is not None and getattr(e, "ended", None) is None:
            e.ended = summary   # type: ignore[attr-defined]
        raise
    return summary


def tag(summary: dict, run: Run, folder_rel: str, duration_s: float) -> dict:
    """The summary with what the report needs to know about the run: its configuration and,
    for a distributed run, the evaluator's period (the resolution of its time to target)."""
    period = {} if run.is_baseline else {"eval_every_s": run.cfg.eval.every_seconds}
    return {"label": run.label, "mode": run.mode, "params": run.params, "workers": run.workers,
            "repeat": run.repeat, "seed": run.cfg.job.seed, "sweep": run.sweep, "sweep_value": run.sweep_value,
            "dir": folder_rel, "duration_s": round(duration_s, 6), **period,
            **{k: v for k, v in summary.items() if k not in ("mode", "workers")}}


def run_entry(run: Run, outcome: dict | BaseException, t0: float) -> dict:
    """compare.json's entry for a run started at time.monotonic() `t0` that ended with its
    summary (`tag`), or with the error that failed it (`failed_entry`)."""
    if isinstance(outcome, dict):
        return tag(outcome, run, os.path.join("runs", run.name), time.monotonic() - t0)
    return failed_entry(run, str(outcome).strip() or type(outcome).__name__,
                        duration_s=round(time.monotonic() - t0, 2))


def idle_faults_of(plan: list) -> list[str]:
    """`psgd run`'s warnings for an injected fault that slows no worker (`cli.idle_faults`:
    one half of a pair set without the other, a straggler rank the run does not have),
    each once, with the runs it is about where not every run: `--set
    faults.jitter_prob=0.5` alone delayed nothing, and neither stderr nor the report said
    so (its fault lines name only faults that act)."""
    from .cli import idle_faults
    said: dict[str, list[str]] = {}
    for run in plan:
        for warning in idle_faults(run.cfg):   # (each pair of keys on its own)
            runs = said.setdefault(warning, [])
            name = f"{run.label} with {run.workers} worker{'s' * (run.workers != 1)}"
            if name not in runs:
                runs.append(name)
    every = {f"{run.label} with {run.workers} worker{'s' * (run.workers != 1)}" for run in plan}
    return [warning if set(runs) == every else f"{'; '.join(runs)}: {warning}" for warning, runs in said.items()]


def failed_entry(run: Run, msg: str, **extra: Any) -> dict:
    """compare.json's entry for a run that failed, with its error message."""
    return {"label": run.label, "mode": run.mode, "params": run.params, "workers": run.workers,
            "repeat": run.repeat, "seed": run.cfg.job.seed, "sweep": run.sweep, "sweep_value": run.sweep_value,
            "dir": os.path.join("runs", run.name), **extra, "error": msg[:4000]}


def _one_line(s: dict) -> str:
    acc = s.get("final_accuracy")
    ttt = s.get("time_to_target_s")
    parts = [f"acc {acc:.4f}" + (" (loss not finite: the model diverged)" if s.get("final_loss_not_finite") else "")
             if acc is not None else
             "no final evaluation" if s.get("final_eval_missing") else "no evaluation",
             f"{amount(s.get('samples_per_s', 0))} samples/s",
             # (a time the report marks † is not given as one: as psgd run's line, shorter)
             f"target {s.get('target_accuracy')} first seen after training ({ttt:.2f} s)"
             if ttt is not None and ttt_flag(s, None) == AFTER_END else
             f"target {s.get('target_accuracy')} already at the first score ({ttt:.2f} s)"
             if ttt is not None and ttt_flag(s, None) == FIRST_SCORE else
             f"target {s.get('target_accuracy')} in {ttt:.2f} s" if ttt is not None else
             f"target {s.get('target_accuracy')} not reached" if acc is not None else "",
             # (the sequential baseline reads no servers, ltfb's trainers no shared model)
             f"measured staleness {s['staleness']['mean']:.2f}/{s['staleness']['max']}"
             if records_staleness(s) and s.get("mode") != "baseline" else "", lost_words(s),
             f"waiting for a CPU {100 * s['cpu_wait_fraction']:.0f}% of its runnable time"
             if cpu_wait_said(s.get("cpu_wait_fraction")) else ""]
    return ", ".join(p for p in parts if p)


def command_line(args) -> str:
    cmd = getattr(args, "cmd", None) or "compare"   # psgd simulate builds its context here too
    parts = ["psgd", cmd]
    if args.config:
        parts.append(args.config)
    parts += ["--modes", args.modes]
    if args.workers is not None:
        parts += ["--workers", str(args.workers)]
    if args.servers is not None:
        parts += ["--servers", str(args.servers)]
    if args.repeats != 1:
        parts += ["--repeats", str(args.repeats)]
    for s in args.set:
        parts += ["--set", s]
    device = getattr(args, "device", None)
    if device and device != ("cpu" if cmd == "simulate" else "auto"):   # not the flag's default
        parts += ["--device", device]
    if getattr(args, "jobs", 1) != 1:
        parts += ["--jobs", str(args.jobs)]
    if args.no_baseline and cmd == "compare":
        parts.append("--no-baseline")
    if args.out:
        parts += ["--out", args.out]
    return " ".join(shlex.quote(p) for p in parts)


def context(args, base: Config, workers: list[int], plan: list[Run]) -> dict:
    import torch
    sample = next((r.cfg for r in plan if not r.is_baseline), base)
    baseline = next((r for r in plan if r.is_baseline), None)
    return {
        "command": command_line(args),
        "config": args.config,
        "sets": list(args.set),
        "env_sets": env_sets(),   # (PSGD_<SECTION>_<KEY>: the report's `psgd run` commands give them as --set)
        "modes": args.modes,
        "workers": workers,
        "servers": sample.cluster.servers,
        "repeats": args.repeats,
        "seeds": sorted({r.cfg.job.seed for r in plan}),
        "job": {"name": base.job.name, "model": base.model.name, "data": base.data.name,
                "batch_size": base.train.batch_size, "steps": base.train.steps, "seconds": base.train.seconds,
                "optimizer": dict(vars(base.optimizer))},
        "target_accuracy": base.eval.target_accuracy,
        "eval_every_s": base.eval.every_seconds,
        "faults": dict(vars(base.faults)),
        "baseline": None if baseline is None else {"steps": baseline.baseline_steps,
                                                    "samples": (baseline.baseline_steps or 0) * base.train.batch_size,
                                                    "threads": 1},
        "machine": {"cpus": os.cpu_count(), "device": args.device, "torch": torch.__version__,
                    "cuda": torch.cuda.is_available()},
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def batch_over_shares(plan: list[Run], n: int) -> str | None:
    """A warning, once for the whole plan, for the worker counts at which train.batch_size
    is larger than a worker's share of the training set (data.batch_over_share): each
    batch shrinks to the share, and the report's samples/s with it. The data and the batch
    are every run's (SHARED_SECTIONS); the sequential baseline trains on the whole set.
    `n`: the training set's size (`cli.check_job`). psgd simulate's plan too."""
    from .consistency import data_split
    from .data import batch_over_share
    if not plan:
        return None
    counts = [(1, 0.0) if run.is_baseline else (run.cfg.cluster.workers, data_split(run.cfg)) for run in plan]
    return batch_over_share(n, plan[0].cfg.train.batch_size, counts) or None


def unread_by_a_real_run(sets: list[str]) -> str:
    """A warning naming the `sim.*` keys given with --set: psgd simulate's cost model,
    which no real run reads (a mode item sweeping one is refused: `main`)."""
    keys = [k for k in given_sets(sets) if k.startswith("sim.")]
    return (f"a real run reads none of {', '.join(keys)} (psgd simulate's cost model): setting "
            f"{'it' if len(keys) == 1 else 'them'} changes nothing") if keys else ""


def unread_by_every_mode(sets: list[str], plan: list) -> str:
    """A warning naming the `mode.*` keys given with --set that no run of the plan reads
    (`--modes sync --set mode.staleness=5`): psgd run warns of such a key, and here the
    report listed it as applied to every run. (A mode item that names another mode's
    parameter is refused.)"""
    from .consistency import PARAMS
    modes = sorted({run.cfg.mode.name for run in plan if not run.is_baseline})
    read = {f"mode.{k}" for name in modes for k in PARAMS[name]} | {"mode.name"}
    keys = [k for k in given_sets(sets) if k.startswith("mode.") and k not in read]
    return (f"no run reads {', '.join(keys)} (the parameters of mode{'s' * (len(modes) != 1)} {', '.join(modes)}: "
            f"{', '.join(sorted(read - {'mode.name'})) or 'none'}): setting {'it' if len(keys) == 1 else 'them'} "
            f"changes nothing") if keys else ""


def main(args) -> int:
    specs = parse_modes(args.modes)
    for spec in specs:   # (two "different" configurations would be one real run, reported as a sweep)
        for key, _ in spec.params:
            if config_key(key).startswith("sim."):
                raise ConfigError(f"--modes {spec.label}: {key} is psgd simulate's cost model, which a real run "
                                  f"never reads: sweep it with psgd simulate")
    try:
        base = load(args.config, args.set)
    except ConfigError as e:   # `--set key=a,b` is one value: a sweep is a mode item's (README: Comparing modes)
        listed = next((item for item in args.set if "," in item.partition("=")[2]   # (the item the error is of)
                       and item.partition(".")[0] not in SHARED_SECTIONS and item in str(e)), None)
        if listed is None:
            raise
        raise ConfigError(f"{e} (--set gives every run one value; to compare several, sweep the key in a mode "
                          f"item: --modes {specs[0].mode}:{listed})") from None
    refuse_sets_the_plan_overrides(args.set, parse_workers(args.workers), args.servers)
    refuse_sets_an_item_overrides(args.set, specs)
    workers = parse_workers(args.workers) or [base.cluster.workers]
    if args.servers is not None and args.servers < 1:
        raise ConfigError(f"--servers must be >= 1, got {args.servers}")
    plan = build_plan(base, specs, workers, args.repeats, args.servers, baseline=not args.no_baseline)
    from .cli import check_job
    from .launcher import check_before_launch
    # the data and model are every run's (SHARED_SECTIONS): one error, not every run failing
    n = check_job(base, [run.cfg for run in plan])
    check_before_launch(base, args.device)   # a bad --device or missing keys: the same
    out = args.out or os.path.join("runs", f"compare-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    lock = hold_output(out, "psgd compare")
    try:
        return _compare(args, base, specs, workers, plan, out, n)
    finally:
        lock.close()


EARLIER = "earlier"   # OUT/earlier/: an earlier comparison's report, plots, compare.json and tb/ (`hold_output`)


def hold_output(out: str, command: str) -> IO:
    """OUT is this command's until it returns (an exclusive lock on OUT/.compare.lock);
    another psgd compare or psgd simulate writing there now is refused: it would remove
    the run folders of this one while its jobs write them. An earlier comparison's
    report, plots, compare.json, context and tb/ are moved to OUT/earlier/ (beside this
    one's, a rebuilt report read its compare.json as this one's; deleted, as they were,
    before this one had run anything, a Ctrl-C then left neither report), replacing what
    an older comparison left there, and said so; its run folders stay, replaced where this
    plan runs the same configuration."""
    from .launcher import hold
    lock = hold(os.path.join(out, COMPARE_LOCK))
    if lock is None:
        raise ConfigError(f"{command}: {out} is the output folder of a psgd compare or psgd simulate that is "
                          f"still running: give another --out")
    from .report_plots import PLOT_FILE
    earlier = [os.path.join(out, f) for f in os.listdir(out)
               if f in ("compare.json", "report.md") or PLOT_FILE.fullmatch(f)]
    if not os.path.exists(os.path.join(out, "compare.json")):
        earlier = []   # not a comparison's folder: nothing of it is psgd's to remove
    if earlier:
        kept = os.path.join(out, EARLIER)
        print(f"{command}: {out} held an earlier comparison: its report, plots, compare.json (its runs' "
              f"summaries) and TensorBoard runs (tb/) are moved to {kept}/; its run folders stay where this one does "
              f"not run the same configuration", file=sys.stderr, flush=True)
        shutil.rmtree(kept, ignore_errors=True)
        os.makedirs(kept)
        # (tensorboard --logdir OUT/tb showed the earlier plan's curves beside this one's)
        for path in earlier + [p for p in [os.path.join(out, "tb"), os.path.join(out, "compare-context.json")]
                               if os.path.exists(p)]:
            os.replace(path, os.path.join(kept, os.path.basename(path)))
        _runs_seen_from(os.path.join(kept, "compare.json"))
    return lock


def _runs_seen_from(path: str) -> None:
    """A compare.json moved one folder down (OUT/earlier/): its runs' folders, relative
    to OUT, as seen from there (`../runs/...`), so that its rebuilt report finds those
    that stay (README: the ones this comparison does not run again)."""
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return
    if isinstance(entries, list):
        entries = [{**e, "dir": os.path.join("..", e["dir"])}
                   if isinstance(e, dict) and isinstance(e.get("dir"), str) and not os.path.isabs(e["dir"]) else e
                   for e in entries]
        write_json_atomic(path, entries)


@contextmanager
def said_if_interrupted(command: str) -> Iterator[None]:
    """Ctrl-C or SIGTERM while a comparison gets ready (importing torch, calibrating) ends it
    with a line that says so, not silently (its runs, later, write the report of those done)."""
    try:
        yield
    except KeyboardInterrupt:
        say(f"{command}: interrupted before its first run: nothing ran, no report written")
        raise


def finish(who: str, out: str, results: list[dict], ctx: dict, *, done: int, n: int, failed: int,
           t_start: float, interrupted: int) -> int:
    """Write the report and say what was done; the exit code. A second Ctrl-C (or
    SIGTERM) while the report is written leaves none: then say what there is and how to
    write it."""
    from .cli import interrupted_code
    from .report import write_report
    try:
        path = write_report(out, results, ctx)
    except KeyboardInterrupt as e:
        k = len(results)
        say(f"{who}: interrupted while writing the report: none written; {os.path.join(out, 'compare.json')} "
            f"holds the {k} run{'s' if k != 1 else ''} done, and `python -m psgd.report {out}` writes their report")
        return interrupted or interrupted_code(e)
    say(f"{who}: {done} of {n} runs done in {_fmt_duration(time.monotonic() - t_start)}"
        f"{f', {failed} failed' if failed else ''}")
    say(f"report: {path}\nruns: {os.path.join(out, 'compare.json')}", sys.stdout)
    return interrupted or (1 if failed else 0)


def _compare(args, base: Config, specs: list[ModeSpec], workers: list[int], plan: list[Run], out: str,
             n: int) -> int:
    with said_if_interrupted("psgd compare"):
        ctx = context(args, base, workers, plan)
        # (the sequential baseline is rank 0 alone, slowed only by faults.slow_rank = 0: by design)
        warnings = [w for w in (batch_over_shares(plan, n),   # (n: the training set's size)
                                *idle_faults_of([run for run in plan if not run.is_baseline]),
                                unread_by_a_real_run(args.set), unread_by_every_mode(args.set, plan)) if w]
        if warnings:
            ctx["warnings"] = warnings
        write_json_atomic(os.path.join(out, "compare-context.json"), ctx)
        write_json_atomic(os.path.join(out, "compare.json"), [])

    n = len(plan)
    print(f"psgd compare: {n} run{'s' if n != 1 else ''} ({len(specs)} mode configuration"
          f"{'s' if len(specs) != 1 else ''} x "
          f"{len(workers)} worker count{'s' if len(workers) != 1 else ''} x {args.repeats} repeat"
          f"{'s' if args.repeats != 1 else ''}{' + baseline' if not args.no_baseline else ''}), out {out}",
          file=sys.stderr, flush=True)
    if args.set or ctx["env_sets"]:
        env = f"{'; ' * bool(args.set)}from the environment: {' '.join(ctx['env_sets'])}" if ctx["env_sets"] else ""
        print(f"psgd compare: applied to every run: {' '.join(args.set)}{env}", file=sys.stderr, flush=True)
    for warning in ctx.get("warnings") or []:
        print(f"psgd compare: warning: {warning}", file=sys.stderr, flush=True)

    results: list[dict] = []
    durations: dict[int, float] = {}
    failed = 0
    interrupted = 0                 # the exit code when a signal ended the comparison early
    t_start = time.monotonic()
    try:
        for i, run in enumerate(plan):
            prefix = f"[{i + 1}/{n}] {run.describe()}"
            print(f"{prefix} ...", file=sys.stderr, flush=True)
            folder = os.path.join(out, "runs", run.name)
            t0 = time.monotonic()
            try:
                entry = run_entry(run, run_one(run, folder, args.device, args.timeout, prefix=f"[{i + 1}/{n}]"), t0)
                result = _one_line(entry)   # (with the run's eval period, as the report reads it)
            except (RuntimeError, ConfigError, OSError) as e:  # LaunchError is a RuntimeError
                failed += 1
                entry = run_entry(run, e, t0)
                result = f"FAILED: {(str(e).strip() or type(e).__name__).splitlines()[0]}"
            durations[i] = time.monotonic() - t0
            results.append(entry)
            write_json_atomic(os.path.join(out, "compare.json"), results)
            left = estimate_left(plan, durations, i + 1)
            eta = "" if i + 1 == n else (f"; about {_fmt_duration(left)} left" if left is not None else "")
            print(f"[{i + 1}/{n}] {result} ({durations[i]:.0f} s{eta})", file=sys.stderr, flush=True)
    except KeyboardInterrupt as e:
        from .cli import interrupted_code
        from .launcher import ended_before
        interrupted = interrupted_code(e)
        ended = ended_before(e)   # the run's job had ended (its summary written): it is one of those done
        if ended is not None:
            if not isinstance(ended, dict):   # (aborted: LaunchError)
                failed += 1
            results.append(run_entry(run, ended, t0))
        say(f"psgd compare: interrupted after {len(results)} of {n} runs; writing the report of those")

    write_json_atomic(os.path.join(out, "compare.json"), results)
    if len(results) < n:   # interrupted: the report says which runs did not run
        ctx = {**ctx, "interrupted": True, "not_run": [run.describe() for run in plan[len(results):]]}
        write_json_atomic(os.path.join(out, "compare-context.json"), ctx)
    return finish("psgd compare", out, results, ctx, done=len(results) - failed, n=n, failed=failed,
                  t_start=t_start, interrupted=interrupted)
