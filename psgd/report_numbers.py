"""The numbers of the `psgd compare` report, from the run summaries; no text, no plots.

One Row per configuration (label x worker count) with its repeats: means, sample sds,
speedups (reference time to target / this time) and throughput ratios; Spearman's rank
correlation and the trend of a sequence; which rows form a parameter or worker-count
sweep. And what the numbers cannot carry: whether a time to target is resolved
(`ttt_flag`) and which rows a staleness correlation may use (`correlation_rows`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .config import format_value

# Modes whose measured staleness is "updates a shard applied between a worker's read and
# its push". easgd's counts moves of the centre between a worker's exchanges (another
# quantity, never put on the same axis) and ltfb records none (independent trainers).
READ_PUSH_MODES = ("sync", "ssp", "async")
# A staleness correlation needs MIN_POINTS comparable configurations of MIN_REPEATS runs
# each. Five is the fewest points for which any Spearman ρ can be told from chance at the
# 5 % level (|ρ| = 1 has probability 2/n! under no relation: 1/12 for n = 4, 1/60 for 5);
# three repeats give every point a run-to-run sd to hold the differences against.
MIN_POINTS = 5
MIN_REPEATS = 3

# The two-sided 5 % critical values of Spearman's ρ under no relation, exact (from all n!
# orderings) for n = 5..10 points; above 10, 1.96 / sqrt(n - 1), which counted over random
# orderings keeps the level at or below 5 % (it falls below for n = 9 and fewer).
RHO_CRITICAL = {5: 1.0, 6: 0.886, 7: 0.786, 8: 0.738, 9: 0.700, 10: 0.648}

# Why a time to target does not rank (see ttt_flag).
AFTER_END = "after the end"
FIRST_SCORE = "first score"

# The label suffix of simulated rows in a report that also has real ones.
SIM_SUFFIX = " (simulated)"

# Means closer than this fraction of the larger are the same number and never ranked.
# Means of single repeats (no run-to-run sd measured) are not ranked at all, however far
# apart: two runs of one configuration have differed by 46% in samples/s, so no fixed
# fraction stands in for the spread that was not measured.
REL_EQUAL = 1e-6

# A run that did not reach the target counts as having missed it only when the evaluator
# scored it at least this many times while it trained; fewer (one score, or only the final
# one after training ended) says when the evaluator looked, not that the model never got there.
MIN_SCORES = 2

# Mode parameters whose name is also the name of a measured quantity, as the report names them.
PARAM_NAMES = {("ssp", "staleness"): "bound s"}


def param_name(mode: str, key: str) -> str:
    return PARAM_NAMES.get((mode, key), key)


# Final accuracies this close are not told apart anywhere in a report: the configurations'
# range ("hardly separates"), a configuration against the baseline, a sweep's course.
ACC_HARDLY = 0.005


def amount(x: float | None) -> str:
    """A rate or a size as the report writes it: whole, with thousands separators, from 10
    up; three significant digits below (a simulation at a low bandwidth runs at 0.04
    samples/s, which a whole number wrote as 0); — for none."""
    if x is None:
        return "—"
    return f"{x:,.0f}" if abs(x) >= 10 else f"{x:.3g}"


def close(a: float, b: float, rel: float) -> bool:
    """a and b within `rel` of the larger magnitude."""
    return abs(a - b) <= rel * max(abs(a), abs(b))


# Why two values of configurations that each ran once are not ranked.
ONCE = "ran once: no spread measured, so differences are not ranked"


def tie_reason(a: list[float], b: list[float], fmt: Callable[[float], str] | None = None) -> str | None:
    """Why the means of a and b cannot be ranked, or None when they can: equal (or, given
    the `fmt` a sentence writes them with, written the same: repeats of a simulation do not
    spread, so an sd of 0 ranked 12,321.56 below 12,321.71, both written 12,322); closer
    than twice the larger run-to-run sd of the two (the bound a sweep's trend words use,
    noise_note: at one sd a report ranked two values that its sweep sentence then called
    "not established"); or no sd measured on either side (single repeats: ONCE, however
    far apart they are)."""
    ma, mb = mean(a), mean(b)
    if ma is None or mb is None:
        return None
    if close(ma, mb, REL_EQUAL) or (fmt is not None and fmt(ma) == fmt(mb)):
        return "equal"
    sds = [x for x in (sd(a), sd(b)) if x is not None]
    if sds:
        return "within two run-to-run sds" if abs(ma - mb) < 2 * max(sds) else None
    return ONCE


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def sd(xs: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2.0
        i = j + 1
    return r


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Rank correlation; None with fewer than 3 points or a constant side. Whether there
    are enough points to say anything is the caller's question (MIN_POINTS)."""
    if len(xs) < 3 or len(xs) != len(ys):
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = mean(rx), mean(ry)
    if mx is None or my is None:
        return None
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den > 0 else None


def rho_critical(n: int) -> float:
    """The smallest |ρ| over n points that chance gives at most 5 % of the time (RHO_CRITICAL):
    a weaker rank correlation establishes no relation (|ρ| >= 0.5 happens ~45 % of the time at n = 5)."""
    return RHO_CRITICAL[n] if n in RHO_CRITICAL else 1.96 / math.sqrt(n - 1) if n > 10 else math.inf


def trend(values: list[float]) -> str:
    """'rose', 'fell', 'stayed flat' or 'went up and down' for a sequence."""
    if len(values) < 2:
        return "stayed flat"
    span = max(values) - min(values)
    if span <= 1e-9 * max(1.0, abs(max(values))):
        return "stayed flat"
    ups = all(b >= a for a, b in zip(values, values[1:], strict=False))
    downs = all(b <= a for a, b in zip(values, values[1:], strict=False))
    return "rose" if ups else "fell" if downs else "went up and down"


def run_period(run: dict, period: float | None) -> float | None:
    """The seconds between two scores of `run`: its own `eval_every_s` (runs of merged
    folders or of a label that sets eval.every_seconds may differ), else `period`."""
    return float(run["eval_every_s"]) if run.get("eval_every_s") else period


def records_staleness(s: dict) -> bool:
    """Did the run count any staleness (a histogram with a read in it)? Not ltfb's
    independent trainers, which read no shared model, nor the sequential baseline,
    which reads none: their zeros are no measurement (Row.hist, the tables' "—")."""
    return bool((s.get("staleness") or {}).get("hist"))


def counted(n: int, noun: str) -> str:
    """'1 worker', '2 workers': a count with its noun in the right number."""
    return f"{n} {noun}{'s' if n != 1 else ''}"


def lost_words(s: dict) -> str:
    """'1 worker lost (of 2)' for a job that went on without some of its workers (a
    worker died and was not replaced; the job ended with the others), else '': the
    line's accuracy and samples/s are those of fewer workers than the job was given."""
    lost = int((s.get("failures") or {}).get("workers_gone") or 0)
    if lost <= 0:
        return ""
    return f"{counted(lost, 'worker')} lost (of {s.get('workers', '?')})"


def ttt_flag(run: dict, period: float | None) -> str | None:
    """Why a run's time to target cannot rank it, or None when it can (or is None).

    AFTER_END: the time is at or past the run's wall time: the target was first seen by a
    score taken once training had ended, which says when the evaluator looked, not when
    the model got there. FIRST_SCORE (distributed runs): the model was already above the
    target at the evaluator's first score, or the time is shorter than one evaluation
    period (the run's own, run_period): the time is the evaluator's phase. The sequential
    baseline is scored on its own training clock, from step 0, many times per run, so of
    FIRST_SCORE only its first score applies to it: the untrained model's, at step 0, at
    or above the target (a time of 0.0 s, which made every speedup against it 0×)."""
    t = run.get("time_to_target_s")
    if t is None:
        return None
    wall = run.get("wall_s")
    if wall is not None and float(t) >= float(wall):
        return AFTER_END
    target = run.get("target_accuracy")
    evals = [e for e in run.get("evals") or [] if e.get("accuracy") is not None]
    if run.get("mode") == "baseline":
        return FIRST_SCORE if target is not None and evals and float(evals[0]["accuracy"]) >= float(target) \
            and not evals[0].get("samples") else None
    first = next((e for e in evals if target is not None and float(e["accuracy"]) >= float(target)), None)
    if first is not None and first.get("final"):   # the score after the workers were done: its time can
        return AFTER_END                            # round to just below wall_s
    if target is not None and evals and float(evals[0]["accuracy"]) >= float(target):
        return FIRST_SCORE
    own = run_period(run, period)
    return FIRST_SCORE if own and float(t) < own else None


def training_scores(run: dict) -> int:
    """How many of the evaluator's scores of `run` fell inside its training time (before
    wall_s; all of them when the run has no wall time)."""
    wall = run.get("wall_s")
    return sum(1 for e in run.get("evals") or [] if e.get("accuracy") is not None
               and (wall is None or float(e.get("t", 0.0)) < float(wall)))


def eval_periods(results: list[dict]) -> list[float]:
    """The distinct `eval_every_s` of the distributed runs (compare tags every one), ascending."""
    return sorted({float(r["eval_every_s"]) for r in results if r.get("eval_every_s") and r.get("mode") != "baseline"})


def eval_period(results: list[dict], ctx: dict) -> float | None:
    """Seconds between two scores of the evaluator, as far as two times can be told apart:
    the coarsest of the runs' `eval_every_s` (a time is known to within its own run's
    period, so two runs scored every 0.5 s and every 5 s are ranked only beyond 5 s), else
    the compare context's, else the median spacing of the distributed runs' evaluation
    curves (less the last point, the final score)."""
    periods = eval_periods(results)
    if periods:
        return periods[-1]
    if ctx.get("eval_every_s"):
        return float(ctx["eval_every_s"])
    gaps = sorted(b["t"] - a["t"] for r in results if r.get("mode") != "baseline"
                  for a, b in zip((r.get("evals") or [])[:-2], (r.get("evals") or [])[1:-1], strict=True))
    return gaps[len(gaps) // 2] if gaps else None


@dataclass
class Row:
    label: str
    mode: str
    workers: int
    params: dict
    sweep: str | None
    sweep_value: Any
    runs: list = field(default_factory=list)      # successful summaries
    failed: list = field(default_factory=list)    # failed runs' entries (their error, and repeat, dir: which run)
    ref_sync: Row | None = None
    ref_base: Row | None = None
    suffix: str = ""       # what build_rows appended to the label: " [setup]", SIM_SUFFIX

    @property
    def key(self) -> tuple:
        return (self.label, self.workers)

    @property
    def is_baseline(self) -> bool:
        return self.mode == "baseline"

    @property
    def simulated(self) -> bool:
        """Runs of `psgd simulate` (times in virtual seconds)."""
        return any(r.get("simulated") for r in self.runs)

    @property
    def name(self) -> str:
        """The label, with ssp's `staleness` (the bound) called "bound s" and its other
        settings kept, so that two configurations never share a name."""
        core = self.label[:len(self.label) - len(self.suffix)] if self.suffix else self.label
        if self.is_baseline:
            return "baseline (sequential)" + self.suffix
        if self.mode != "ssp":
            return self.label
        bound = self.bound
        if bound is None:
            return self.label
        others = [p for p in core.split(":")[1:] if p.partition("=")[0] != "staleness"]
        inner = ", ".join([f"{param_name('ssp', 'staleness')}={bound}"] + others)
        return f"ssp ({inner}){self.suffix}"

    @property
    def bound(self) -> int | None:
        """ssp's bound s (`mode.staleness`) as the configuration or its runs give it."""
        if self.mode != "ssp":
            return None
        return self.params.get("staleness", (self.runs[0].get("mode_params") or {}).get("staleness")
                               if self.runs else None)

    @property
    def settings(self) -> dict:
        """The config keys (SECTION.KEY) this configuration sets, apart from its mode's own
        parameters: what a fair reference must share with it."""
        return {k: v for k, v in self.params.items() if "." in str(k)}

    @property
    def failed_repeats(self) -> str:
        """'k of n repeats failed' for a configuration that lost repeats, else ''."""
        return f"{len(self.errors)} of {self.n} repeats failed" if self.errors and self.runs else ""

    @property
    def failed_note(self) -> str:
        """' (k of n repeats failed)' for a configuration that lost repeats, else ''."""
        return f" ({self.failed_repeats})" if self.failed_repeats else ""

    @property
    def scored(self) -> bool:
        """Whether any repeat was scored by the evaluator: one that was not (no evaluator,
        a timing-only simulation) neither reached nor missed the target."""
        return any(e.get("accuracy") is not None for r in self.runs for e in r.get("evals") or [])

    @property
    def errors(self) -> list[str]:
        """The failed runs' messages."""
        return [str(e["error"]) for e in self.failed]

    @property
    def n(self) -> int:
        return len(self.runs) + len(self.errors)

    def values(self, key: str) -> list[float]:
        return [float(r[key]) for r in self.runs if r.get(key) is not None]

    @property
    def acc(self) -> list[float]:
        return self.values("final_accuracy")

    @property
    def ttt(self) -> list[float]:
        return self.values("time_to_target_s")

    @property
    def ttt_mean(self) -> float | None:
        # Only a configuration that reached the target in every successful repeat has a time.
        return mean(self.ttt) if self.runs and len(self.ttt) == len(self.runs) else None

    def thin_misses(self) -> list[int]:
        """The in-training score counts (training_scores) of the scored repeats that did not
        reach the target and were scored fewer than MIN_SCORES times while training: for
        them "not reached" is unresolved."""
        return [n for r in self.runs if r.get("time_to_target_s") is None
                and any(e.get("accuracy") is not None for e in r.get("evals") or [])
                and (n := training_scores(r)) < MIN_SCORES]

    def ttt_flags(self, period: float | None) -> list[tuple[str, dict]]:
        """[(flag, run)] for the repeats whose time to target cannot rank (ttt_flag)."""
        return [(f, r) for r in self.runs for f in [ttt_flag(r, period)] if f]

    def ttt_resolved(self, period: float | None) -> bool:
        return self.ttt_mean is not None and not self.ttt_flags(period)

    def resolved_ttt_mean(self, period: float | None) -> float | None:
        """The mean time to target where it is resolved (ttt_resolved), else None."""
        t = self.ttt_mean
        return t if t is not None and not self.ttt_flags(period) else None

    @property
    def sps(self) -> list[float]:
        return self.values("samples_per_s")

    @property
    def staleness_mean(self) -> float | None:
        return mean([float(r["staleness"]["mean"]) for r in self.runs if r.get("staleness")])

    @property
    def staleness_max(self) -> int | None:
        xs = [int(r["staleness"]["max"]) for r in self.runs if r.get("staleness")]
        return max(xs) if xs else None

    @property
    def hist(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.runs:
            for k, v in ((r.get("staleness") or {}).get("hist") or {}).items():
                out[k] = out.get(k, 0) + int(v)
        return out

    def speedup(self, ref: Row | None) -> float | None:
        """ref's mean time to target / this row's (1.0 for the reference itself)."""
        if ref is None or ref.ttt_mean is None or self.ttt_mean is None or self.ttt_mean <= 0 or ref.ttt_mean <= 0:
            return None   # (a reference at 0 s: the target met before any step, no speed to compare)
        return ref.ttt_mean / self.ttt_mean

    @property
    def ref_named(self) -> bool:
        """Whether "vs sync" must name its reference: a sync row with settings of its own."""
        return self.ref_sync is not None and self.ref_sync is not self and bool(self.ref_sync.params)

    def sync_name(self) -> str:
        """How a sentence names this row's sync reference."""
        ref = self.ref_sync
        return "sync" if ref is None or not (ref.params or ref.suffix) else ref.name

    def throughput_ratio(self, ref: Row | None) -> float | None:
        a, b = mean(self.sps), mean(ref.sps) if ref else None
        if ref is None or a is None or not b:
            return None
        return a / b


def run_steps(x: dict, seconds: float = 0.0) -> int | None:
    """Every worker's steps of one run together, where its summary tells them: train.steps
    (`steps`) times its workers, for a run with a step budget and no time budget (`seconds`:
    either ends a run, and a summary does not say which did), no worker lost, rejoined or
    restarted (a rejoining worker's clock jumps), no refused step (its samples counted,
    its step taken again) and not aborted; its samples at most `batch_size` per step.
    None otherwise."""
    steps, workers = int(x.get("steps") or 0), int(x.get("workers") or 0)
    if (not steps or not workers or seconds or x.get("aborted") or x.get("rejected")
            or any(v for v in (x.get("failures") or {}).values())):
        return None
    total, batch = steps * workers, x.get("batch_size")
    samples = x.get("samples")
    if samples is None or (batch and samples > total * int(batch)):
        return None
    return total


def worker_batches(r: Row, seconds: float = 0.0) -> list[float]:
    """Each run's mean samples per step per worker (its samples over run_steps): the batch
    a worker held, train.batch_size or, where a worker's share of the training set is
    smaller, that share. [] unless every run of r tells its steps. `seconds`: the job's
    time budget ([train] is every configuration's)."""
    got = [(x["samples"] / n) for x in r.runs if (n := run_steps(x, seconds))]
    return got if r.runs and len(got) == len(r.runs) else []


def steps_per_s(r: Row, seconds: float = 0.0) -> list[float]:
    """Each run's steps per second, all workers together (run_steps over wall_s); [] unless
    every run of r tells its steps and has a wall time."""
    got = [n / float(x["wall_s"]) for x in r.runs if (n := run_steps(x, seconds)) and x.get("wall_s")]
    return got if r.runs and len(got) == len(r.runs) else []


def build_rows(results: list[dict]) -> list[Row]:
    """One Row per (label, workers). Simulated and real runs of the same configuration
    (one compare.json holding both: `python -m psgd.report OUT REAL SIM`) are separate
    rows, the simulated one labelled so; runs of merged folders whose setups differ carry
    their folder's `setup` tag in the label. Each row is compared with the sync row (and
    the baseline) of its own kind and setup: a virtual second is not a real one."""
    rows: dict[tuple, Row] = {}
    mixed = len({bool(r.get("simulated")) for r in results}) > 1
    for r in results:
        # A summary without a label goes by its mode; one without either by "?", like Row.mode.
        label = r.get("label", r.get("mode", "?"))
        suffix = (f" [{r['setup']}]" if r.get("setup") else "") + \
                 (SIM_SUFFIX if mixed and r.get("simulated") and not label.endswith(SIM_SUFFIX) else "")
        key = (label + suffix, int(r.get("workers", 1)))
        row = rows.get(key)
        if row is None:
            row = rows[key] = Row(key[0], r.get("mode", "?"), key[1], r.get("params") or {},
                                  r.get("sweep"), r.get("sweep_value"), suffix=suffix)
        if r.get("error"):
            row.failed.append(r)
        else:
            row.runs.append(r)
    out = list(rows.values())
    for row in out:   # (the baseline is measured against no sync row: with --workers 1 it found sync's 1-worker
        #              row, which trained half its samples at W = 2, and the table gave it a speedup "vs sync")
        row.ref_sync = None if row.is_baseline else sync_reference(row, out)
        row.ref_base = next((x for x in out if x.is_baseline and same_kind(x, row)), None)
    return out


def same_kind(a: Row, b: Row) -> bool:
    """Both real or both simulated, from the same setup (merged folders): comparable clocks
    and budgets. The suffix carries both (build_rows)."""
    return a.suffix == b.suffix


def sync_reference(row: Row, rows: list[Row]) -> Row | None:
    """The sync row `row` is measured against: same worker count, kind and setup, and
    preferably the same config settings (a swept sync:wire.dtype=... has one per value).
    Without such a row: the plain `sync`, else the first sync row; the report then names
    it (Row.ref_named), since it differs from `row` in more than the mode.

    A sync row with settings of its own would be its own reference, 1.00× whatever its
    times (every row of `sync:wire.compression=none,onebit,topk`): it is measured against
    the plain `sync` where there is one, else against the first value of its sweep
    (sync_sweep_first), else against the first sync row, as a row of another mode is."""
    syncs = [x for x in rows if x.mode == "sync" and x.workers == row.workers and same_kind(x, row)]
    if row.mode == "sync" and row.params:
        return next((x for x in syncs if not x.params), sync_sweep_first(row, rows) or syncs[0])
    alike = [x for x in syncs if x.settings == row.settings]
    return next((x for x in alike if not x.params), alike[0] if alike else
                next((x for x in syncs if not x.params), syncs[0] if syncs else None))


def sync_sweep_first(row: Row, rows: list[Row]) -> Row | None:
    """The first row (in the sweeps' order) with a finished run of the sweep that `row` is a
    value of, else None."""
    rs = next((rs for _mode, _key, _w, rs in sweeps(rows) if any(x is row for x in rs)), [])
    return next((x for x in rs if x.runs), rs[0] if rs else None)


def correlation_rows(rows: list[Row]) -> list[Row]:
    """The rows a staleness correlation may use: read-push staleness (READ_PUSH_MODES),
    measured, at least MIN_REPEATS successful runs, and none failed (a row that lost
    repeats has its survivors' means, which the report ranks nowhere else). Fewer than
    MIN_POINTS: none."""
    ok = [r for r in rows if r.mode in READ_PUSH_MODES and r.hist and len(r.runs) >= MIN_REPEATS
          and len(r.acc) == len(r.runs) and not r.errors]
    return ok if len(ok) >= MIN_POINTS else []


def sweep_fixed(rs: list[Row]) -> list[str]:
    """What the rows of one sweep hold fixed besides mode and workers, as the report
    names it: the other settings ("bound s=0", "wire.dtype=bfloat16") and the row suffix
    (setup, simulated)."""
    r = rs[0]
    fixed = [f"{param_name(r.mode, k)}={format_value(v)}" for k, v in r.params.items() if k != r.sweep]
    setup = r.suffix.partition("[")[2].partition("]")[0]
    return fixed + ([setup] if setup else []) + (["simulated"] if r.suffix.endswith(SIM_SUFFIX) else [])


def sweeps(rows: list[Row]) -> list[tuple[str, str, int, list[Row]]]:
    """[(mode, key, workers, rows ordered by value)] for every swept mode parameter. One
    sweep is the rows that differ only in the swept value: same mode, workers, other
    settings and kind (real, simulated, setup)."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        if r.sweep and not r.is_baseline:
            fixed = tuple(sorted((str(k), repr(v)) for k, v in r.params.items() if k != r.sweep))
            groups.setdefault((r.mode, r.sweep, r.workers, fixed, r.suffix), []).append(r)
    out = []
    for (mode, key, w, _fixed, _suffix), rs in groups.items():
        if len(rs) >= 2:
            try:
                rs = sorted(rs, key=lambda r: float(r.sweep_value))
            except (TypeError, ValueError):
                pass
            out.append((mode, key, w, rs))
    return out


def worker_sweeps(rows: list[Row]) -> dict[str, list[Row]]:
    """{label: rows ordered by worker count} for labels run at two or more worker counts."""
    groups: dict[str, list[Row]] = {}
    for r in rows:
        if not r.is_baseline and r.runs:
            groups.setdefault(r.label, []).append(r)
    return {k: sorted(v, key=lambda r: r.workers) for k, v in groups.items() if len(v) >= 2}
