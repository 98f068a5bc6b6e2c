"""The report of `psgd compare`: DIR/report.md and the PNG plots, from the run summaries.

    python -m psgd.report DIR     # rebuild DIR/report.md and the plots from DIR/compare.json

One row per configuration (label x worker count), repeats folded into mean ± sd; speedups
are ratios of mean time to target (reference time / this time: > 1 is faster) against
the `sync` row with the same worker count and against the sequential baseline. The
"reading" paragraph is generated from these numbers. Plots use matplotlib's Agg backend
(no display needed); without matplotlib the report is written without them.
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

PLOT_DPI = 80


# ---------------------------------------------------------------- statistics


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
    """Rank correlation; None with fewer than 3 points or a constant side."""
    if len(xs) < 3 or len(xs) != len(ys):
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = mean(rx), mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den > 0 else None


def trend(values: list[float]) -> str:
    """'rose', 'fell', 'stayed flat' or 'went up and down' for a sequence."""
    if len(values) < 2:
        return "stayed flat"
    span = max(values) - min(values)
    if span <= 1e-9 * max(1.0, abs(max(values))):
        return "stayed flat"
    ups = all(b >= a for a, b in zip(values, values[1:]))
    downs = all(b <= a for a, b in zip(values, values[1:]))
    return "rose" if ups else "fell" if downs else "went up and down"


# ---------------------------------------------------------------- rows


@dataclass
class Row:
    label: str
    mode: str
    workers: int
    params: dict
    sweep: str | None
    sweep_value: Any
    runs: list = field(default_factory=list)      # successful summaries
    errors: list = field(default_factory=list)    # failed runs' messages
    ref_sync: "Row | None" = None
    ref_base: "Row | None" = None

    @property
    def key(self) -> tuple:
        return (self.label, self.workers)

    @property
    def is_baseline(self) -> bool:
        return self.mode == "baseline"

    @property
    def name(self) -> str:
        return "baseline (sequential)" if self.is_baseline else self.label

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

    def speedup(self, ref: "Row | None") -> float | None:
        """ref's mean time to target / this row's (1.0 for the reference itself)."""
        if ref is None or ref.ttt_mean is None or self.ttt_mean is None or self.ttt_mean <= 0:
            return None
        return ref.ttt_mean / self.ttt_mean

    def throughput_ratio(self, ref: "Row | None") -> float | None:
        a, b = mean(self.sps), mean(ref.sps) if ref else None
        if ref is None or a is None or not b:
            return None
        return a / b


def build_rows(results: list[dict]) -> list[Row]:
    rows: dict[tuple, Row] = {}
    for r in results:
        key = (r.get("label", r.get("mode")), int(r.get("workers", 1)))
        row = rows.get(key)
        if row is None:
            row = rows[key] = Row(key[0], r.get("mode", "?"), key[1], r.get("params") or {},
                                  r.get("sweep"), r.get("sweep_value"))
        if r.get("error"):
            row.errors.append(r["error"])
        else:
            row.runs.append(r)
    out = list(rows.values())
    base = next((x for x in out if x.is_baseline), None)
    for row in out:
        syncs = [x for x in out if x.mode == "sync" and x.workers == row.workers]
        row.ref_sync = next((x for x in syncs if not x.params), syncs[0] if syncs else None)
        row.ref_base = base
    return out


# ---------------------------------------------------------------- formatting


def _f(x: float | None, digits: int = 2, none: str = "—") -> str:
    return none if x is None else f"{x:.{digits}f}"


def _pm(xs: list[float], digits: int) -> str:
    if not xs:
        return "—"
    s = sd(xs)
    return f"{mean(xs):.{digits}f}" + (f" ± {s:.{digits}f}" if s is not None else "")


def _sec_digits(x: float) -> int:
    return 4 if abs(x) < 0.1 else 2 if abs(x) < 10 else 1


def _secs(x: float) -> str:
    """Seconds: 0.0184, 0.95, 12.3."""
    return f"{x:.{_sec_digits(x)}f}"


def _pm_secs(xs: list[float]) -> str:
    if not xs:
        return "—"
    m, s = mean(xs), sd(xs)
    d = _sec_digits(m)
    return f"{m:.{d}f}" + (f" ± {s:.{d}f}" if s is not None else "")


def _ttt_cell(row: Row) -> str:
    if not row.runs:
        return "—"
    got, n = row.ttt, len(row.runs)
    if not any(r.get("evals") for r in row.runs):
        return "no evaluation"
    if not got:
        return "not reached"
    cell = _pm_secs(got)
    return cell if len(got) == n else f"{cell} ({len(got)}/{n} reached)"


def _smax(v: int | None) -> str:
    """The histogram's last bin collects everything >= BINS - 1."""
    from .consistency.staleness import BINS
    return "—" if v is None else f"≥{v}" if v >= BINS - 1 else str(v)


def _x(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.2g}×" if v < 0.1 else f"{v:.2f}×"


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|")


def main_table(rows: list[Row], target: float) -> list[str]:
    lines = [f"| configuration | workers | final accuracy | time to {target:g} (s) | samples/s | "
             f"staleness mean / max | wait fraction | bytes/sample | speedup vs sync | speedup vs baseline |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if not row.runs:
            first = row.errors[0].splitlines()[0] if row.errors else "failed"
            lines.append(f"| {_md_escape(row.name)} | {row.workers} | failed: {_md_escape(first[:120])} "
                         f"| | | | | | | |")
            continue
        stal = "—" if row.is_baseline else f"{_f(row.staleness_mean)} / {_smax(row.staleness_max)}"
        wait = "—" if row.is_baseline else _f(mean(row.values("wait_fraction")))
        bps = "—" if row.is_baseline else f"{mean(row.values('bytes_per_sample')):,.0f}"
        sps = mean(row.sps)
        sps_sd = sd(row.sps)
        sps_cell = f"{sps:,.0f}" + (f" ± {sps_sd:,.0f}" if sps_sd is not None else "")
        failed = f" ({len(row.errors)} failed)" if row.errors else ""
        lines.append(
            f"| {_md_escape(row.name)}{failed} | {row.workers} | {_pm(row.acc, 4)} | {_ttt_cell(row)} | {sps_cell} | "
            f"{stal} | {wait} | {bps} | {_x(row.speedup(row.ref_sync))} | {_x(row.speedup(row.ref_base))} |")
    return lines


def detail_table(rows: list[Row]) -> list[str]:
    lines = ["| configuration | workers | runs | wall (s) | samples | throughput vs sync | "
             "throughput vs baseline | max clock gap | dropped gradients | workers lost |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if not row.runs:
            continue
        lost = sum(int((r.get("failures") or {}).get("workers_lost", 0)) for r in row.runs)
        lines.append(
            f"| {_md_escape(row.name)} | {row.workers} | {len(row.runs)}/{row.n} | {_pm(row.values('wall_s'), 2)} | "
            f"{mean(row.values('samples')):,.0f} | {_x(row.throughput_ratio(row.ref_sync))} | "
            f"{_x(row.throughput_ratio(row.ref_base))} | "
            f"{'—' if row.is_baseline else max(int(r.get('max_clock_gap', 0)) for r in row.runs)} | "
            f"{sum(int(r.get('dropped_gradients', 0)) for r in row.runs)} | {lost} |")
    return lines


def describe_faults(faults: dict, workers: list[int]) -> str | None:
    parts = []
    rank, factor = int(faults.get("slow_rank", -1)), float(faults.get("slow_factor", 1.0))
    if rank >= 0 and factor > 1:
        s = f"worker rank {rank} is an injected straggler: each of its steps takes {factor:g}× as long"
        small = [w for w in workers if w <= rank]
        if small:
            s += f" (no effect in runs with {', '.join(map(str, small))} worker{'s' if small != [1] else ''})"
        s += "; the sequential baseline is rank 0, " + ("so it is slowed too" if rank == 0 else "so it is not slowed")
        parts.append(s)
    delay = float(faults.get("step_delay_s", 0.0))
    if delay > 0:
        parts.append(f"every step of every worker (and of the baseline) is delayed by {delay:g} s (a slow link)")
    return "; ".join(parts) if parts else None


# ---------------------------------------------------------------- the reading


def _tie(a: list[float], b: list[float]) -> bool:
    """Means closer than the larger run-to-run sd of the two (needs repeats)."""
    sds = [x for x in (sd(a), sd(b)) if x is not None]
    return bool(sds) and abs(mean(a) - mean(b)) < max(sds)


def _noise_note(series: list[list[float]], what: str, fmt) -> str:
    """' (... within the run-to-run spread ...)' when the means' range is below 2 sd."""
    sds = [sd(v) for v in series if v and sd(v) is not None]
    means = [mean(v) for v in series if v]
    if not sds or len(means) < 2:
        return ""
    if max(means) - min(means) < 2 * max(sds):
        return f"; within the run-to-run noise, sd up to {fmt(max(sds))}: not established"
    return ""


def _names(rows: list[Row]) -> str:
    return ", ".join(f"{r.name}" + (f" ({r.workers} w)" if not r.is_baseline else "") for r in rows)


def _rname(r: Row, many_w: bool) -> str:
    w = f" with {r.workers} worker{'s' if r.workers != 1 else ''}"
    return f"**{r.name}**" + (w if many_w and not r.is_baseline else "")


def reading(rows: list[Row], ctx: dict) -> list[str]:
    """Sentences about the trade-off, each computed from the rows."""
    out: list[str] = []
    target = float(ctx.get("target_accuracy", 0.9))
    period = float(ctx.get("eval_every_s", 0.5))
    ok = [r for r in rows if r.runs]
    dist = [r for r in ok if not r.is_baseline]
    base = next((r for r in ok if r.is_baseline), None)
    many_w = len({r.workers for r in dist}) > 1
    if not dist:
        out.append("No distributed run finished, so there is nothing to compare.")
        return out

    # Time to target.
    reached = sorted([r for r in dist if r.ttt_mean is not None], key=lambda r: r.ttt_mean)
    missed = [r for r in dist if r.ttt_mean is None]
    if reached:
        best = reached[0]
        s = f"First to reach {target:g} test accuracy: {_rname(best, many_w)} after {_secs(best.ttt_mean)} s"
        sp_sync, sp_base = best.speedup(best.ref_sync), best.speedup(best.ref_base)
        extras = []
        if sp_sync is not None and best.ref_sync is not best:
            extras.append(f"{_x(sp_sync)} the speed of sync")
        if sp_base is not None:
            extras.append(f"{_x(sp_base)} the speed of the sequential baseline, which needed {_secs(base.ttt_mean)} s")
        s += (" (" + "; ".join(extras) + ")") if extras else ""
        out.append(s + ".")
        if len(reached) > 1:
            order = ", ".join(f"{r.name}{f' ({r.workers} w)' if many_w else ''} {_secs(r.ttt_mean)} s" for r in reached)
            out.append(f"Order to the target: {order}.")
            tied = [r for r in reached[1:] if _tie(best.ttt, r.ttt)]
            if tied:
                out.append(f"Within one run-to-run sd of {best.name}'s time: {_names(tied)}.")
            close = [r for r in reached[1:] if r.ttt_mean - best.ttt_mean < period and r not in tied]
            if close:
                out.append(f"{_names(close)} reached it less than one evaluation period ({period:g} s) after "
                           f"{best.name}: the evaluator scores the model every {period:g} s, so that order is "
                           f"within the measurement's resolution.")
        if base is not None and base.ttt_mean is not None and base.ttt_mean < best.ttt_mean:
            out.append(f"The sequential baseline reached the target in {_secs(base.ttt_mean)} s, sooner than any "
                       f"distributed configuration: on this job and machine no mode paid for its communication.")
    else:
        out.append(f"No distributed configuration reached {target:g} test accuracy in every repeat within the budget.")
    if missed:
        partial = [r for r in missed if r.ttt]
        never = [r for r in missed if not r.ttt]
        if never:
            out.append(f"Never reached {target:g}: {_names(never)}.")
        if partial:
            out.append(f"Reached {target:g} in only some repeats: {_names(partial)}.")

    # Throughput.
    by_sps = sorted(dist, key=lambda r: mean(r.sps) or 0.0, reverse=True)
    top, low = by_sps[0], by_sps[-1]
    s = f"Highest throughput: {_rname(top, many_w)} with {mean(top.sps):,.0f} samples/s"
    ratio = top.throughput_ratio(top.ref_sync)
    if ratio is not None and top.ref_sync is not top:
        s += f" ({ratio:.2f}× sync's {mean(top.ref_sync.sps):,.0f})"
    if len(by_sps) > 1 and _tie(top.sps, by_sps[1].sps):
        s += (f", but {_rname(by_sps[1], many_w)}, at {mean(by_sps[1].sps):,.0f}, is within one run-to-run sd "
              f"of it")
    if low is not top:
        s += f"; lowest: {_rname(low, many_w)} with {mean(low.sps):,.0f}"
    out.append(s + ".")
    if base is not None and mean(base.sps):
        b = mean(base.sps)
        if b > mean(top.sps):
            out.append(f"The sequential baseline alone processed {b:,.0f} samples/s, {b / mean(top.sps):.1f}× the "
                       f"best distributed configuration: the per-step cost of the parameter-server round trips and "
                       f"of sharing {ctx.get('machine', {}).get('cpus', '?')} cores among the processes outweighs "
                       f"what the extra workers add.")
        else:
            out.append(f"The best distributed configuration processed {mean(top.sps) / b:.2f}× the samples per second "
                       f"of the sequential baseline ({b:,.0f}).")

    # Accuracy.
    accs = [(mean(r.acc), r) for r in dist if r.acc]
    if accs:
        hi, lo = max(accs, key=lambda t: t[0]), min(accs, key=lambda t: t[0])
        noise = max([sd(r.acc) or 0.0 for _, r in accs] + [0.0])
        if hi[0] - lo[0] <= max(0.005, 2 * noise):
            out.append(f"Final accuracy hardly separates the configurations: all lie between {lo[0]:.4f} and "
                       f"{hi[0]:.4f}.")
        else:
            out.append(f"Final accuracy ranged from {lo[0]:.4f} ({_rname(lo[1], many_w)}) to {hi[0]:.4f} "
                       f"({_rname(hi[1], many_w)}).")
        if base is not None and base.acc:
            ba = mean(base.acc)
            better = [r for a, r in accs if a > ba + 0.002]
            out.append(f"The sequential baseline ended at {ba:.4f}" +
                       (f"; {_names(better)} ended higher." if better else
                        ", as high as or higher than every distributed configuration."))

    # Staleness and accuracy.
    # Rows that measured staleness (ltfb's independent trainers record none).
    st = [(r.staleness_mean, mean(r.acc), r) for r in dist if r.staleness_mean is not None and r.acc and r.hist]
    if st:
        most = max(st, key=lambda t: t[0])
        if most[0] == 0:
            out.append("No configuration read stale parameters (mean staleness 0 everywhere).")
        else:
            rho = spearman([t[0] for t in st], [t[1] for t in st])
            s = (f"Staleness: highest mean in {_rname(most[2], many_w)} ({most[0]:.2f} updates, max "
                 f"{_smax(most[2].staleness_max)})")
            acc_noise = _noise_note([t[2].acc for t in st], "accuracy", lambda x: f"{x:.4f}")
            if rho is not None and acc_noise:
                top_sd = max(sd(t[2].acc) or 0.0 for t in st)
                s += (f"; the final accuracies differ by less than the run-to-run noise (sd up to {top_sd:.4f}), "
                      f"so they show no effect of staleness (Spearman ρ = {rho:.2f} over {len(st)} configurations).")
            elif rho is None:
                s += "; too few distinct configurations to relate staleness to accuracy."
            elif rho <= -0.5:
                s += (f"; more staleness went with lower final accuracy (Spearman ρ = {rho:.2f} over "
                      f"{len(st)} configurations).")
            elif rho >= 0.5:
                s += (f"; more staleness did not cost final accuracy here — it went with higher accuracy "
                      f"(Spearman ρ = {rho:.2f} over {len(st)} configurations), so other differences between the "
                      f"modes dominate.")
            else:
                s += f"; no consistent relation between staleness and final accuracy (Spearman ρ = {rho:.2f} over {len(st)} configurations)."
            out.append(s)
            tt = [(t[0], t[2].ttt_mean, t[2].ttt) for t in st if t[2].ttt_mean is not None]
            rho_t = spearman([a for a, _, _ in tt], [b for _, b, _ in tt])
            if rho_t is not None and abs(rho_t) >= 0.5 and not _noise_note([c for _, _, c in tt], "", str):
                out.append(f"More staleness went with {'longer' if rho_t > 0 else 'shorter'} times to the target "
                           f"(Spearman ρ = {rho_t:.2f}).")

    # Waiting.
    waits = [(mean(r.values("wait_fraction")), r) for r in dist if r.values("wait_fraction")]
    if len(waits) > 1:
        hi, lo = max(waits, key=lambda t: t[0]), min(waits, key=lambda t: t[0])
        if hi[0] - lo[0] >= 0.05:
            out.append(f"Workers of {_rname(hi[1], many_w)} spent {100 * hi[0]:.0f}% of their time blocked on the "
                       f"servers, those of {_rname(lo[1], many_w)} {100 * lo[0]:.0f}%.")

    # Faults.
    faults = describe_faults(ctx.get("faults") or {}, ctx.get("workers") or [])
    if faults:
        syncs = [r for r in dist if r.mode == "sync"]
        s = f"All runs had a fault injected: {faults}."
        if syncs and top.mode != "sync":
            s += (f" Under it, {_rname(top, many_w)} kept {mean(top.sps):,.0f} samples/s against sync's "
                  f"{mean(syncs[0].sps):,.0f}.")
        out.append(s)

    out += sweep_sentences(dist)
    return out


def sweeps(rows: list[Row]) -> list[tuple[str, str, int, list[Row]]]:
    """[(mode, key, workers, rows ordered by value)] for every swept mode parameter."""
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        if r.sweep and not r.is_baseline:
            groups.setdefault((r.mode, r.sweep, r.workers), []).append(r)
    out = []
    for (mode, key, w), rs in groups.items():
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


def sweep_sentences(dist: list[Row]) -> list[str]:
    out = []
    for mode, key, w, rs in sweeps(dist):
        rs = [r for r in rs if r.runs]
        if len(rs) < 2:
            continue
        vals = [str(r.sweep_value) for r in rs]
        parts = []
        tput = [mean(r.sps) for r in rs]
        parts.append(f"throughput {trend(tput)} ({', '.join(f'{t:,.0f}' for t in tput)} samples/s"
                     + _noise_note([r.sps for r in rs], "throughput", lambda x: f"{x:,.0f}") + ")")
        ttts = [r.ttt_mean for r in rs]
        if all(t is not None for t in ttts):
            parts.append(f"time to target {trend(ttts)} ({', '.join(_secs(t) for t in ttts)} s"
                         + _noise_note([r.ttt for r in rs], "time-to-target", lambda x: f"{_secs(x)} s") + ")")
        else:
            parts.append("time to target " + ", ".join("not reached" if t is None else f"{_secs(t)} s" for t in ttts))
        accs = [mean(r.acc) for r in rs if r.acc]
        if len(accs) == len(rs):
            parts.append(f"final accuracy {trend(accs)} ({', '.join(f'{a:.4f}' for a in accs)}"
                         + _noise_note([r.acc for r in rs], "accuracy", lambda x: f"{x:.4f}") + ")")
        st = [r.staleness_mean for r in rs]
        if all(s is not None for s in st):
            parts.append(f"mean staleness {trend(st)} ({', '.join(f'{s:.2f}' for s in st)})")
        out.append(f"Sweep of {mode} {key} over {', '.join(vals)} ({w} workers): " + "; ".join(parts) + ".")
    for label, rs in worker_sweeps(dist).items():
        first, last = rs[0], rs[-1]
        a, b = mean(first.sps), mean(last.sps)
        if a and b:
            gain = b / a
            eff = gain / (last.workers / first.workers)
            s = (f"{label} from {first.workers} to {last.workers} workers: throughput ×{gain:.2f} "
                 f"(scaling efficiency {100 * eff:.0f}%)")
            if first.ttt_mean is not None and last.ttt_mean is not None:
                s += f", time to target {_secs(first.ttt_mean)} s → {_secs(last.ttt_mean)} s"
            out.append(s + ".")
    return out


# ---------------------------------------------------------------- plots


def _plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def _colors(rows: list[Row]) -> dict[tuple, Any]:
    plt = _plt()
    cmap = plt.get_cmap("tab10") if plt else None
    out, i = {}, 0
    for r in rows:
        if r.is_baseline:
            out[r.key] = "black"
        else:
            out[r.key] = cmap(i % 10) if cmap else None
            i += 1
    return out


def _curve_plot(plt, rows: list[Row], colors, xkey: str, xlabel: str, target: float, path: str,
                allow_log: bool = True) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    positive = []
    for r in rows:
        for j, run in enumerate(r.runs):
            ev = [e for e in run.get("evals") or [] if e.get("accuracy") is not None]
            if not ev:
                continue
            xs = [float(e[xkey]) for e in ev]
            ys = [float(e["accuracy"]) for e in ev]
            positive += [x for x in xs if x > 0]
            ax.plot(xs, ys, color=colors[r.key], lw=1.6 if j == 0 else 0.8, alpha=1.0 if j == 0 else 0.45,
                    ls="--" if r.is_baseline else "-", marker="." if len(xs) < 30 else None,
                    label=(r.name + (f" ({r.workers} w)" if not r.is_baseline else "")) if j == 0 else None)
    ax.axhline(target, color="grey", ls=":", lw=1, label=f"target {target:g}")
    if allow_log and positive and max(positive) / max(min(positive), 1e-9) > 30:
        ax.set_xscale("log")
        xlabel += " (log scale)"
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right", ncol=2 if len(rows) > 6 else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


def _throughput_plot(plt, rows: list[Row], colors, path: str) -> None:
    ok = [r for r in rows if r.runs]
    fig, ax = plt.subplots(figsize=(max(5, 0.7 * len(ok) + 2), 4))
    xs = range(len(ok))
    ax.bar(xs, [mean(r.sps) for r in ok], yerr=[sd(r.sps) or 0 for r in ok], capsize=3,
           color=[colors[r.key] for r in ok])
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r.name.replace(" (sequential)", "") + ("" if r.is_baseline else f"\n{r.workers} w")
                        for r in ok], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("samples / s")
    ax.set_title("throughput", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


def _bin_order(k: str) -> float:
    return float(k.rstrip("+")) + (0.5 if k.endswith("+") else 0)


def _staleness_plot(plt, rows: list[Row], colors, path: str) -> None:
    """One panel per configuration: the fraction of steps at each staleness, log scale so
    that rare long delays (the last bin collects >= 32) stay visible."""
    ok = [r for r in rows if r.runs and not r.is_baseline]
    n = len(ok)
    cols = n if n <= 5 else 4
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(2.4 * cols + 0.6, 2.1 * nrows + 0.6), squeeze=False)
    top = max([_bin_order(k) for r in ok for k in r.hist] + [1])
    for i, r in enumerate(ok):
        ax = axes[i // cols][i % cols]
        h = r.hist
        total = sum(h.values())
        keys = sorted(h, key=_bin_order)
        if total:
            ax.bar([_bin_order(k) for k in keys], [h[k] / total for k in keys], width=0.8, color=colors[r.key])
            ax.set_yscale("log")
            ax.set_ylim(min(0.5 / total, 0.5e-3), 1.5)
            title = f"mean {_f(r.staleness_mean)}, max {_smax(r.staleness_max)}"
        else:
            ax.text(0.5, 0.5, "no staleness recorded\n(independent trainers)" if r.mode == "ltfb"
                    else "no staleness recorded", ha="center", va="center", fontsize=7, transform=ax.transAxes)
            ax.set_yticks([])
            title = "—"
        ax.set_title(f"{r.name} ({r.workers} w)\n{title}", fontsize=7)
        ax.set_xlim(-0.6, top + 0.6)
        ax.tick_params(labelsize=6)
        ax.grid(axis="y", alpha=0.3)
    for j in range(n, nrows * cols):
        axes[j // cols][j % cols].axis("off")
    fig.supxlabel("staleness: updates applied between a worker's read and its push (last bin: >= 32)", fontsize=7)
    fig.supylabel("fraction of steps (log)", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


def _sweep_plot(plt, xs_label: str, xs: list, rows: list[Row], path: str, title: str) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
    pos = xs if numeric else list(range(len(xs)))
    tt = [r.ttt_mean for r in rows]
    tt_sd = [sd(r.ttt) or 0 for r in rows]
    pts = [(p, t, e) for p, t, e in zip(pos, tt, tt_sd) if t is not None]
    if pts:
        ax.errorbar([p for p, _, _ in pts], [t for _, t, _ in pts], yerr=[e for _, _, e in pts],
                    color="tab:blue", marker="o", capsize=3, label="time to target")
    ax.set_xlabel(xs_label)
    ax.set_ylabel("time to target (s)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.errorbar(pos, [mean(r.sps) or 0 for r in rows], yerr=[sd(r.sps) or 0 for r in rows], color="tab:orange",
                 marker="s", capsize=3, label="samples/s")
    ax2.set_ylabel("samples / s", color="tab:orange")
    if not numeric:
        ax.set_xticks(pos)
        ax.set_xticklabels([str(x) for x in xs])
    missing = [str(x) for x, t in zip(xs, tt) if t is None]
    ax.set_title(title + (f"\n(target not reached at {', '.join(missing)})" if missing else ""), fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


def _workers_plot(plt, groups: dict[str, list[Row]], colors, path: str) -> None:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for label, rs in groups.items():
        c = colors[rs[0].key]
        ws = [r.workers for r in rs]
        a1.plot(ws, [mean(r.sps) or 0 for r in rs], marker="o", color=c, label=label)
        pts = [(r.workers, r.ttt_mean) for r in rs if r.ttt_mean is not None]
        if pts:
            a2.plot([p for p, _ in pts], [t for _, t in pts], marker="o", color=c, label=label)
    ws = sorted({r.workers for rs in groups.values() for r in rs})
    for ax, yl in ((a1, "samples / s"), (a2, "time to target (s)")):
        ax.set_xticks(ws)
        ax.set_xlabel("workers")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


def make_plots(out: str, rows: list[Row], target: float) -> list[tuple[str, str]]:
    """[(title, file name)] of the plots written into `out`."""
    plt = _plt()
    if plt is None:
        return []
    colors = _colors(rows)
    ok = [r for r in rows if r.runs]
    made = []
    if not ok:
        return made
    _curve_plot(plt, ok, colors, "t", "wall time since training started (s)", target,
                os.path.join(out, "accuracy_vs_time.png"))
    made.append(("Accuracy vs wall time", "accuracy_vs_time.png"))
    _curve_plot(plt, ok, colors, "samples", "samples processed (all workers)", target,
                os.path.join(out, "accuracy_vs_samples.png"), allow_log=False)
    made.append(("Accuracy vs samples processed", "accuracy_vs_samples.png"))
    _throughput_plot(plt, ok, colors, os.path.join(out, "throughput.png"))
    made.append(("Throughput (mean ± sd over repeats)", "throughput.png"))
    if any(not r.is_baseline for r in ok):
        _staleness_plot(plt, ok, colors, os.path.join(out, "staleness.png"))
        made.append(("Staleness histogram per configuration", "staleness.png"))
    for mode, key, w, rs in sweeps(ok):
        rs = [r for r in rs if r.runs]
        if len(rs) < 2:
            continue
        name = f"sweep_{mode}_{key}_w{w}.png"
        _sweep_plot(plt, f"{mode} {key}", [r.sweep_value for r in rs], rs, os.path.join(out, name),
                    f"{mode}: {key} sweep, {w} workers")
        made.append((f"Sweep: {mode} {key} ({w} workers)", name))
    groups = worker_sweeps(ok)
    if groups:
        _workers_plot(plt, groups, colors, os.path.join(out, "sweep_workers.png"))
        made.append(("Sweep: worker count", "sweep_workers.png"))
    return made


# ---------------------------------------------------------------- report.md


def render(rows: list[Row], ctx: dict, plots: list[tuple[str, str]]) -> str:
    target = float(ctx.get("target_accuracy", 0.9))
    job = ctx.get("job") or {}
    m = ctx.get("machine") or {}
    workers = ctx.get("workers") or sorted({r.workers for r in rows if not r.is_baseline})
    n_runs = sum(r.n for r in rows)
    lines = ["# psgd compare", ""]
    if ctx.get("command"):
        lines += ["```", ctx["command"], "```", ""]
    opt = job.get("optimizer") or {}
    budget = (f"{job.get('steps')} steps per worker" if job.get("steps") else "") + \
             (f"{', ' if job.get('steps') else ''}{job.get('seconds'):g} s per worker" if job.get("seconds") else "")
    lines.append(f"Model **{job.get('model', '?')}** on **{job.get('data', '?')}**, batch {job.get('batch_size', '?')} "
                 f"per worker, budget {budget or '?'}, optimizer {opt.get('name', '?')} (lr {opt.get('lr', '?')}, "
                 f"momentum {opt.get('momentum', '?')}), {ctx.get('servers', '?')} shard"
                 f"{'s' if ctx.get('servers') != 1 else ''}, {', '.join(map(str, workers))} worker"
                 f"{'s' if workers != [1] else ''}; seeds {', '.join(map(str, ctx.get('seeds') or []))} "
                 f"(repeat r uses job.seed + r for every configuration); {n_runs} runs, one after another.")
    lines.append("")
    lines.append(f"Machine: {m.get('cpus', '?')} CPU cores, device {m.get('device', '?')}"
                 f"{' (CUDA available)' if m.get('cuda') else ' (no CUDA)'}, torch {m.get('torch', '?')}."
                 + (f" Each distributed run starts {max(workers)} workers, {ctx.get('servers', '?')} shards, a "
                    f"coordinator and an evaluator on these {m.get('cpus')} cores."
                    if isinstance(m.get("cpus"), int) and isinstance(ctx.get("servers"), int) else ""))
    lines.append("")
    sets = ctx.get("sets") or []
    if sets:
        lines.append(f"**Applied to every run:** `{' '.join('--set ' + s for s in sets)}`.")
        faults = describe_faults(ctx.get("faults") or {}, workers)
        if faults:
            lines.append(f"**Injected fault:** {faults}.")
        lines.append("")
    b = ctx.get("baseline")
    if b:
        if b.get("steps"):
            budget = (f"{b.get('steps')} steps = {b.get('samples'):,} samples, the budget of the largest run "
                      f"({max(workers)} workers × {job.get('steps')} steps)"
                      + (f", or {job.get('seconds'):g} s, whichever comes first" if job.get("seconds") else ""))
        else:
            budget = f"{job.get('seconds'):g} s of training, each worker's time budget"
        lines.append(f"Baseline: one process, plain PyTorch loop (no servers), same model, data, optimizer and "
                     f"batch size; {budget}; {b.get('threads', 1)} compute thread like each worker; its clock "
                     f"stops while it is scored.")
        lines.append("")
    lines.append(f"Time to target: wall time from the start of training until the global model first scored "
                 f"≥ {target:g} on the test set; distributed runs are scored every {ctx.get('eval_every_s', '?')} s "
                 f"by the evaluator, so their times are rounded up to that period. Speedup = reference time to "
                 f"target / this time (> 1: faster). Staleness = updates applied between a worker's read and its "
                 f"push (easgd: moves of the center between two exchanges; ltfb: 0).")
    lines.append("")
    lines.append("## Results")
    lines.append("")
    lines += main_table(rows, target)
    lines.append("")
    lines += detail_table(rows)
    lines.append("")
    lines.append("## Reading")
    lines.append("")
    lines += [f"- {s}" for s in reading(rows, ctx)]
    lines.append("")
    failed = [(r, e) for r in rows for e in r.errors]
    if failed:
        lines.append("## Failed runs")
        lines.append("")
        for r, e in failed:
            lines.append(f"- {r.name} ({r.workers} workers): {e.splitlines()[0][:300]}")
        lines.append("")
    if plots:
        lines.append("## Plots")
        lines.append("")
        for title, name in plots:
            lines += [f"### {title}", "", f"![{title}]({name})", ""]
    elif _plt() is None:
        lines += ["(No plots: matplotlib is not installed; `pip install psgd[plots]`.)", ""]
    return "\n".join(lines)


def write_report(out: str, results: list[dict], ctx: dict) -> str:
    rows = build_rows(results)
    plots = make_plots(out, rows, float(ctx.get("target_accuracy", 0.9)))
    path = os.path.join(out, "report.md")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(render(rows, ctx, plots))
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m psgd.report DIR   (DIR holds compare.json)", file=sys.stderr)
        return 2
    out = argv[0]
    with open(os.path.join(out, "compare.json")) as f:
        results = json.load(f)
    ctx = {}
    if os.path.exists(os.path.join(out, "compare-context.json")):
        with open(os.path.join(out, "compare-context.json")) as f:
            ctx = json.load(f)
    print(write_report(out, results, ctx))
    return 0


if __name__ == "__main__":
    sys.exit(main())
