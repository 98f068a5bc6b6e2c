"""Sentences of the `psgd compare` reading that relate one quantity to another, and the
phrase helpers the whole reading shares.

Measured staleness against final accuracy and time to target: a rank correlation is
stated only over configurations whose staleness means the same thing (sync, ssp, async:
updates applied between a worker's read and its push), at least MIN_POINTS of them with
MIN_REPEATS runs each (psgd.report_numbers says why those numbers); easgd's and ltfb's
figures are named as the different quantities they are. Then the parameter sweeps and
the worker-count sweeps, each value against throughput, time to target, accuracy.
"""
from __future__ import annotations

from collections.abc import Callable

from .report_numbers import (
    MIN_POINTS,
    MIN_REPEATS,
    READ_PUSH_MODES,
    REL_EQUAL,
    REL_TIE,
    Row,
    close,
    correlation_rows,
    mean,
    param_name,
    sd,
    spearman,
    sweep_fixed,
    sweeps,
    trend,
    worker_sweeps,
)
from .report_tables import secs, smax

OTHER_STALENESS = {"easgd": "easgd's counts moves of the centre between a worker's exchanges",
                   "ltfb": "ltfb's is 0 by definition (independent trainers)"}


def tie_reason(a: list[float], b: list[float]) -> str | None:
    """Why the means of a and b cannot be ranked, or None when they can: equal; closer
    than the larger run-to-run sd of the two; or, with no sd measured (single repeats),
    within REL_TIE of each other."""
    ma, mb = mean(a), mean(b)
    if ma is None or mb is None:
        return None
    if close(ma, mb, REL_EQUAL):
        return "equal"
    sds = [x for x in (sd(a), sd(b)) if x is not None]
    if sds:
        return "within one run-to-run sd" if abs(ma - mb) < max(sds) else None
    return f"within {REL_TIE:.0%} of each other, and no run-to-run spread was measured" if close(ma, mb) else None


def tie(a: list[float], b: list[float]) -> bool:
    """Means that the numbers cannot rank (tie_reason)."""
    return tie_reason(a, b) is not None


def noise_note(series: list[list[float]], fmt: Callable[[float], str] = str) -> str:
    """'; within the run-to-run noise ...' when the means' range is below 2 sd; with no sd
    measured, '; ... within 1% ...' when their range is below REL_TIE of the largest; else ''."""
    sds = [s for v in series if (s := sd(v)) is not None]
    means = [m for v in series if (m := mean(v)) is not None]
    if len(means) < 2:
        return ""
    span = max(means) - min(means)
    if close(max(means), min(means), REL_EQUAL):
        return ""  # the same number: the trend says "stayed flat"
    if sds:
        if span < 2 * max(sds):
            return f"; within the run-to-run noise, sd up to {fmt(max(sds))}: not established"
        return ""
    if span <= REL_TIE * max(abs(m) for m in means):
        return f"; all within {REL_TIE:.0%} of each other: no difference claimed"
    return ""


def names(rows: list[Row]) -> str:
    return ", ".join(f"{r.name}" + (f" ({r.workers} w)" if not r.is_baseline else "") + r.failed_note
                     for r in rows)


def rname(r: Row, many_w: bool) -> str:
    w = f" with {r.workers} worker{'s' if r.workers != 1 else ''}"
    return f"**{r.name}**" + (w if many_w and not r.is_baseline else "") + r.failed_note


def _staleness_vs_accuracy(st: list[Row]) -> str:
    pts = correlation_rows(st)
    if not pts:
        k = sum(1 for r in st if len(r.runs) >= MIN_REPEATS)
        return (f"; no relation to final accuracy is claimed: that takes at least {MIN_POINTS} configurations "
                f"of sync, ssp or async with {MIN_REPEATS} or more repeats each, and this comparison has {k}")
    # Every correlation row has a measured staleness and an accuracy for each run (correlation_rows).
    pairs = [(sm, acc) for r in pts if (sm := r.staleness_mean) is not None and (acc := mean(r.acc)) is not None]
    rho = spearman([sm for sm, _ in pairs], [acc for _, acc in pairs])
    if rho is None:
        return "; measured staleness or final accuracy is the same everywhere: no rank correlation to compute"
    over = f"Spearman ρ = {rho:.2f} over {len(pts)} configurations of at least {MIN_REPEATS} repeats"
    if noise_note([r.acc for r in pts]):
        top_sd = max(sd(r.acc) or 0.0 for r in pts)
        return (f"; the final accuracies differ by less than the run-to-run noise (sd up to {top_sd:.4f}), so "
                f"they show no effect of staleness ({over})")
    if rho <= -0.5:
        return f"; more staleness went with lower final accuracy ({over})"
    if rho >= 0.5:
        return (f"; more staleness did not cost final accuracy here — it went with higher accuracy ({over}), "
                f"so other differences between the configurations dominate")
    return f"; no consistent relation between staleness and final accuracy ({over})"


def _run_staleness(r: Row) -> list[float]:
    return [float(x["staleness"]["mean"]) for x in r.runs if x.get("staleness")]


def staleness_sentences(dist: list[Row], period: float | None, many_w: bool) -> list[str]:
    out: list[str] = []
    measured = [(sm, r) for r in dist
                if r.mode in READ_PUSH_MODES and (sm := r.staleness_mean) is not None and r.hist]
    st = [r for _, r in measured]
    if measured:
        most_mean, most = max(measured, key=lambda p: p[0])
        level = [r for _, r in measured if r is not most and tie(_run_staleness(r), _run_staleness(most))]
        if most_mean == 0:
            out.append("No configuration of sync, ssp or async read stale parameters (measured staleness (mean) "
                       "0 everywhere).")
        else:
            out.append(f"Measured staleness (mean updates applied between a worker's read and its push): highest "
                       f"in {rname(most, many_w)} ({most_mean:.2f}, max {smax(most.staleness_max)})"
                       + (f", not told apart from {', '.join(rname(r, many_w) for r in level)}" if level else "")
                       + _staleness_vs_accuracy(st) + ".")
            tt = [(r, sm, t) for r in correlation_rows(st)
                  if (t := r.resolved_ttt_mean(period)) is not None and (sm := r.staleness_mean) is not None]
            rho_t = spearman([sm for _, sm, _ in tt], [t for _, _, t in tt])
            if len(tt) >= MIN_POINTS and rho_t is not None and abs(rho_t) >= 0.5 and not noise_note(
                    [r.ttt for r, _, _ in tt]):
                out.append(f"More staleness went with {'longer' if rho_t > 0 else 'shorter'} times to the target "
                           f"(Spearman ρ = {rho_t:.2f} over {len(tt)} configurations).")
    other = [m for m in OTHER_STALENESS if any(r.mode == m for r in dist)]
    if other:
        out.append(f"Measured staleness of another kind, not compared with sync, ssp or async: "
                   f"{'; '.join(OTHER_STALENESS[m] for m in other)}.")
    return out


def _times_clause(rs: list[Row], period: float | None) -> str | None:
    """The sweep's times to target; None when no row of it was scored."""
    if not any(r.scored for r in rs):
        return None
    resolved = [t for r in rs if (t := r.resolved_ttt_mean(period)) is not None]
    if len(resolved) == len(rs) and not any(r.errors for r in rs):
        return (f"time to target {trend(resolved)} ({', '.join(secs(t) for t in resolved)} s"
                + noise_note([r.ttt for r in rs], lambda x: f"{secs(x)} s") + ")")
    return "time to target " + ", ".join(_one_time(r, period) for r in rs)


def _one_time(r: Row, period: float | None) -> str:
    """One sweep point's time to target, saying how many repeats reached it."""
    if not r.scored:
        return "not scored"
    got, n = len(r.ttt), len(r.runs)
    if not got:
        return "not reached"
    t = mean(r.ttt) or 0.0
    s = f"{secs(t)} s" + ("" if r.ttt_resolved(period) or got < n else " (not resolved)")
    return s + (f" ({got}/{n} reached)" if got < n else "") + r.failed_note


def sweep_sentences(dist: list[Row], period: float | None = None) -> list[str]:
    out = []
    for mode, key, w, rs in sweeps(dist):
        rs = [r for r in rs if r.runs]
        if len(rs) < 2:
            continue
        vals = [str(r.sweep_value) for r in rs]
        parts = []
        tput = [t for r in rs if (t := mean(r.sps)) is not None]
        if len(tput) == len(rs):
            parts.append(f"throughput {trend(tput)} ({', '.join(f'{t:,.0f}' for t in tput)} samples/s"
                         + noise_note([r.sps for r in rs], lambda x: f"{x:,.0f}") + ")")
        times_clause = _times_clause(rs, period)
        if times_clause:
            parts.append(times_clause)
        accs = [acc for r in rs if (acc := mean(r.acc)) is not None]
        if len(accs) == len(rs):
            parts.append(f"final accuracy {trend(accs)} ({', '.join(f'{a:.4f}' for a in accs)}"
                         + noise_note([r.acc for r in rs], lambda x: f"{x:.4f}") + ")")
        st = [sm for r in rs if (sm := r.staleness_mean) is not None]
        if len(st) == len(rs):
            parts.append(f"measured staleness (mean) {trend(st)} ({', '.join(f'{s:.2f}' for s in st)}"
                         + noise_note([_run_staleness(r) for r in rs], lambda x: f"{x:.2f}") + ")")
        fixed = "; ".join([f"{w} workers"] + sweep_fixed(rs))
        out.append(f"Sweep of {mode} {param_name(mode, key)} over {', '.join(vals)} ({fixed}): "
                   + "; ".join(parts) + ".")
    for rs in worker_sweeps(dist).values():
        first, last = rs[0], rs[-1]
        a, b = mean(first.sps), mean(last.sps)
        if a and b:
            gain = b / a
            eff = gain / (last.workers / first.workers)
            s = (f"{first.name} from {first.workers} to {last.workers} workers: throughput ×{gain:.2f} "
                 f"(scaling efficiency {100 * eff:.0f}%)")
            t0, t1 = first.resolved_ttt_mean(period), last.resolved_ttt_mean(period)
            if t0 is not None and t1 is not None:
                s += f", time to target {secs(t0)} s → {secs(t1)} s"
            out.append(s + ".")
    return out
