"""The markdown tables of the `psgd compare` report, and the formatting of their cells.

`main_table`: one row per configuration (accuracy, time to target, throughput, measured
staleness, waiting, traffic, speedups); `detail_table`: runs, wall time, ratios, clock
gap, drops, losses, the busiest shard's share of the time, the training threads' wait for
a CPU. A time to target that cannot rank a configuration (reached after training had
ended, or at the evaluator's first score) and every speedup computed from one carry a
mark, explained under the table. The number formats are shared with the reading
(psgd.report_reading) and the plots (psgd.report_plots).
"""
from __future__ import annotations

from .report_numbers import ONCE, Row, amount, mean, sd, sync_sweep_first, tie_reason

MARK = "†"
MARK_NOTE = (f"{MARK} Not a resolved time: the target was first seen by a score taken after training had "
             f"ended, or the model was already above it at the first score (the evaluator's; the baseline's: its "
             f"untrained model, before any step), or the time is "
             f"shorter than one evaluation period. Such a time, and a speedup computed from it, says when the "
             f"evaluator looked, not when the model got there; the reading does not rank by it.")


TIE_MARK = "≈"
TIE_NOTE = (f"{TIE_MARK} Not told apart from 1×: the two times to the target are equal, within two run-to-run "
            f"sds of each other, or less than one evaluation period apart.")


THROUGHPUT_TIE_NOTE = (f"{TIE_MARK} Not told apart from 1×: the two throughputs are equal or within two "
                      f"run-to-run sds of each other.")


FAILED_MARK = "‡"
FAILED_NOTE = (f"{FAILED_MARK} Computed from a configuration that lost repeats (failed runs): its time is "
               f"that of the repeats that finished, which may not be the typical ones; the reading does not "
               f"rank by it.")


def num(x: float | None, digits: int = 2, none: str = "—") -> str:
    return none if x is None else f"{x:.{digits}f}"


def pm(xs: list[float], digits: int) -> str:
    m, s = mean(xs), sd(xs)
    if m is None:
        return "—"
    return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if s is not None else "")


def _sec_digits(x: float) -> int:
    return 4 if abs(x) < 0.1 else 2 if abs(x) < 10 else 1


def secs(x: float) -> str:
    """Seconds: 0.0184, 0.95, 12.3."""
    return f"{x:.{_sec_digits(x)}f}"


def pm_secs(xs: list[float]) -> str:
    m, s = mean(xs), sd(xs)
    if m is None:
        return "—"
    d = _sec_digits(m)
    return f"{m:.{d}f}" + (f" ± {s:.{d}f}" if s is not None else "")


def smax(v: int | None) -> str:
    """A run's maximum staleness: exact (summary.json's `staleness.max`, kept apart from the
    histogram, whose last bin collects everything >= BINS - 1)."""
    return "—" if v is None else str(v)


def times(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.2g}×" if v < 0.1 else f"{v:.2f}×"


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters at a word boundary, the cut marked " …" (a cell cut
    mid-word read "…; stoppi"); unchanged where it fits."""
    if len(text) <= limit:
        return text
    head = text[:limit - 2]
    if not text[limit - 2].isspace() and " " in head[limit // 2:]:
        head = head[:head.rindex(" ")]
    return head.rstrip(" ;,:(") + " …"


def md_escape(s: str) -> str:
    return s.replace("|", "\\|")


def ttt_cell(row: Row, period: float | None = None) -> str:
    if not row.runs:
        return "—"
    got, n = row.ttt, len(row.runs)
    if not any(r.get("evals") for r in row.runs):
        return "no evaluation"
    if not got:
        # Scored fewer than MIN_SCORES times while training: not a resolved miss (Row.thin_misses).
        thin = row.thin_misses()
        return f"not seen ({max(thin)} score{'' if max(thin) == 1 else 's'} in training)" if thin else "not reached"
    cell = pm_secs(got) + (f" {MARK}" if row.ttt_flags(period) else "")
    return cell if len(got) == n else f"{cell} ({len(got)}/{n} reached)"


def _scored_of(row: Row) -> str:
    """' (k/n scored)' where only k of the row's n finished repeats have a final accuracy
    (the others' final evaluation is missing): the mean is of those k."""
    k, n = len(row.acc), len(row.runs)
    return f" ({k}/{n} scored)" if 0 < k < n else ""


def _speedup_cell(row: Row, ref: Row | None, period: float | None) -> str:
    v = row.speedup(ref)
    if v is None:
        return times(v)
    why = tie_reason(row.ttt, ref.ttt) if ref is not None and ref is not row else None
    # (times less than one evaluation period apart are not told apart either, as the reading
    # says of them: "1.73x" stood unmarked beside "not told apart: less than one period apart")
    near = (ref is not None and ref is not row and bool(period) and row.ttt_mean is not None
            and ref.ttt_mean is not None and abs(row.ttt_mean - ref.ttt_mean) < (period or 0.0))
    marks = ([] if row.ttt_resolved(period) and ref is not None and ref.ttt_resolved(period) else [MARK]) + \
            ([FAILED_MARK] if row.errors or (ref is not None and ref.errors) else []) + \
            ([TIE_MARK] if why is not None and why != ONCE or near else [])
    return " ".join([times(v)] + marks)


def reference_note(rows: list[Row]) -> list[str]:
    """Names the sync row that "vs sync" means wherever it is not the plain `sync` of the
    row's worker count (a sync with settings of its own, e.g. one value of a sweep). A sync
    row with settings of its own is not its own reference (sync_reference): its note says
    which it has."""
    named = [(r, ref) for r in rows if r.runs and r.ref_named and (ref := r.ref_sync) is not None]
    if not named:
        return []

    def why(r: Row, ref: Row) -> str:
        if r.mode == "sync":
            return " (the first value of its sweep)" if sync_sweep_first(r, rows) is ref else " (no plain sync row)"
        return "" if ref.settings == r.settings else " (no sync row has its settings)"
    return ["vs sync: " + "; ".join(f"{r.name} ({r.workers} w) against {ref.name}{why(r, ref)}"
                                    for r, ref in named) + "."]


def seconds(rows: list[Row]) -> str:
    """A column of times' unit: a simulated run's times are virtual (of the rows with a
    finished run: a failed row has no kind)."""
    kinds = {row.simulated for row in rows if row.runs}
    return ("(virtual s)" if kinds == {True} else
            "(s; virtual for the rows marked (simulated))" if kinds == {True, False} else "(s)")


def rate(rows: list[Row]) -> str:
    """The samples/s column's header: beside real runs, a simulated run's are per virtual
    second (a report of simulated runs alone says so of every number above its tables)."""
    kinds = {row.simulated for row in rows if row.runs}
    return "samples/s (per virtual s for the rows marked (simulated))" if kinds == {True, False} else "samples/s"


def main_table(rows: list[Row], target: float, period: float | None = None) -> list[str]:
    lines = [f"| configuration | workers | final accuracy | time to {target:g} {seconds(rows)} | {rate(rows)} | "
             f"measured staleness mean / max | wait fraction | bytes/sample | speedup vs sync | "
             f"speedup vs baseline |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if not row.runs:
            first = row.errors[0].splitlines()[0] if row.errors else "failed"
            lines.append(f"| {md_escape(row.name)} | {row.workers} | failed: {md_escape(clip(first, 120))} "
                         f"| | | | | | | |")
            continue
        # none counted (ltfb's independent trainers: an empty histogram): none claimed, as the plot's "—"
        stal = "—" if row.is_baseline or not row.hist else f"{num(row.staleness_mean)} / {smax(row.staleness_max)}"
        wait = "—" if row.is_baseline else num(mean(row.values("wait_fraction")))
        bps = "—" if row.is_baseline else amount(mean(row.values("bytes_per_sample")))
        sps = mean(row.sps)
        sps_sd = sd(row.sps)
        sps_cell = amount(sps) + (f" ± {amount(sps_sd)}" if sps_sd is not None else "")
        failed = f" ({len(row.errors)} failed)" if row.errors else ""
        lines.append(
            f"| {md_escape(row.name)}{failed} | {row.workers} | {pm(row.acc, 4)}{_scored_of(row)} | "
            f"{ttt_cell(row, period)} | "
            f"{sps_cell} | {stal} | {wait} | {bps} | {_speedup_cell(row, row.ref_sync, period)} | "
            f"{_speedup_cell(row, row.ref_base, period)} |")
    if any(MARK in line for line in lines[2:]):
        lines += ["", MARK_NOTE]
    if any(FAILED_MARK in line for line in lines[2:]):
        lines += ["", FAILED_NOTE]
    if any(f" {TIE_MARK}" in line for line in lines[2:]):
        lines += ["", TIE_NOTE]
    note = reference_note(rows)
    if note:
        lines += [""] + note
    return lines


def detail_table(rows: list[Row]) -> list[str]:
    """The detail rows of the configurations with a finished run; none (no table, not a
    header alone) when every run failed."""
    if not any(row.runs for row in rows):
        return []
    unit = seconds(rows)
    lines = [f"| configuration | workers | runs | {'virtual wall (s)' if unit == '(virtual s)' else f'wall {unit}'} | "
             "samples | throughput vs sync | "
             "throughput vs baseline | max clock gap | dropped gradients | workers lost | busiest shard | "
             "waiting for a CPU |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if not row.runs:
            continue
        lost = sum(int((r.get("failures") or {}).get("workers_lost", 0)) for r in row.runs)
        lines.append(
            f"| {md_escape(row.name)} | {row.workers} | {len(row.runs)}/{row.n} | {pm_secs(row.values('wall_s'))} | "
            f"{amount(mean(row.values('samples')))} | {_throughput_cell(row, row.ref_sync)} | "
            f"{_throughput_cell(row, row.ref_base)} | "
            f"{clock_gap(row)} | "
            f"{sum(int(r.get('dropped_gradients', 0)) for r in row.runs)} | {lost} | {busiest(row)} | "
            f"{cpu_wait_cell(row)} |")
    marked = any(f" {TIE_MARK}" in line for line in lines[2:])
    if {row.mode for row in rows if row.runs} & {*ROUND_MODES, "ltfb"}:
        lines += ["", CLOCK_GAP_NOTE]
    if marked:
        lines += ["", THROUGHPUT_TIE_NOTE]
    return lines


# summary.json's max_clock_gap counts what a mode's shards see of a worker's clock: its steps
# in sync, ssp and async, its exchanges in easgd and diloco (one each tau or local_steps
# steps), nothing in ltfb (its 0 is no measurement, as its staleness is none).
ROUND_MODES = ("easgd", "diloco")
CLOCK_GAP_NOTE = ("Max clock gap: in steps; for easgd and diloco in exchange rounds (\"rounds\": their shards "
                  "see a worker's clock only at its exchanges, each of tau or local_steps steps), so not "
                  "comparable with the other modes' steps; — for ltfb, whose trainers read no shared model.")


def clock_gap(row: Row) -> str:
    """The largest clock gap of a row's runs, with its unit where it is not steps
    (CLOCK_GAP_NOTE); — for the baseline and ltfb, which have none."""
    if row.is_baseline or row.mode == "ltfb":
        return "—"
    gap = max(int(r.get("max_clock_gap", 0)) for r in row.runs)
    return f"{gap} round{'s' if gap != 1 else ''}" if row.mode in ROUND_MODES else str(gap)


def _throughput_cell(row: Row, ref: Row | None) -> str:
    """The ratio of the mean samples/s to ref's, marked ≈ where the spread does not tell the
    two apart (tie_reason with the reading's number format, as the reading's throughput
    sentences: single runs are not marked, as the speedups are not)."""
    v = row.throughput_ratio(ref)
    if v is None or ref is None or ref is row:
        return times(v)
    why = tie_reason(row.sps, ref.sps, amount)
    return times(v) + (f" {TIE_MARK}" if why is not None and why != ONCE else "")


def busiest(row: Row) -> str:
    """The busiest shard's share of the wall time spent serving (summary.json's
    shard_busy_fraction), the mean over repeats: near 100%, the shards are the bottleneck."""
    m = mean([max(r["shard_busy_fraction"]) for r in row.runs if r.get("shard_busy_fraction")])
    return "—" if row.is_baseline or m is None else f"{100 * m:.0f}%"


def cpu_wait_cell(row: Row) -> str:
    """The share of the time its training threads could run that they spent waiting for a
    CPU (summary.json's cpu_wait_fraction; the baseline's one thread too), the mean over
    the repeats that counted it (`cpu_wait_counted` says how many where not all did); —
    where none did (psgd simulate, a kernel without the count, a compare.json from before
    the field)."""
    m = mean(row.values("cpu_wait_fraction"))
    return "—" if m is None else f"{100 * m:.0f}%{cpu_wait_counted(row)}"


def cpu_wait_counted(row: Row) -> str:
    """' (k of n repeats)' where only k of a row's n finished repeats counted their wait for a
    CPU, else ''."""
    k, n = len(row.values("cpu_wait_fraction")), len(row.runs)
    return f" ({k} of {n} repeats)" if 0 < k < n else ""
