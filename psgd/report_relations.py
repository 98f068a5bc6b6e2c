"""Sentences of the `psgd compare` reading that relate one quantity to another, and the
phrase helpers the whole reading shares.

Measured staleness against final accuracy and time to target: a rank correlation is
stated only over configurations whose staleness means the same thing (sync, ssp, async:
updates applied between a worker's read and its push), at least MIN_POINTS of them with
MIN_REPEATS runs each (psgd.report_numbers says why those numbers), and called a relation
only where |ρ| reaches the 5 % critical value for its count (rho_critical); easgd's
figures are named as the different quantity they are, and ltfb's lack of any (NO_STALENESS).
Then the parameter sweeps and the worker-count sweeps, each value against throughput, time
to target, accuracy.
Values that are not ordered: equal ones, ones closer than two run-to-run sds (tie_reason),
and those of configurations that each ran once, which are stated without higher, lower or
a trend verb, with the reason (ONCE): with no spread measured, no difference is ranked.
"""
from __future__ import annotations

from collections.abc import Callable

from .config import format_value
from .report_numbers import (  # ONCE and tie_reason: imported from here too
    ACC_HARDLY,
    MIN_POINTS,
    MIN_REPEATS,
    ONCE,
    READ_PUSH_MODES,
    REL_EQUAL,
    Row,
    amount,
    close,
    correlation_rows,
    counted,
    mean,
    param_name,
    rho_critical,
    sd,
    spearman,
    steps_per_s,
    sweep_fixed,
    sweeps,
    tie_reason,
    trend,
    worker_batches,
    worker_sweeps,
)
from .report_tables import secs, smax

OTHER_STALENESS = {"easgd": "easgd's counts moves of the centre between a worker's exchanges (the other workers' "
                            "exchanges, each of tau local steps, not updates)"}
# Modes that count no staleness (summary.json's histogram is empty): said so, not given a 0.
NO_STALENESS = {"ltfb": "ltfb records no staleness (independent trainers: none reads a shared model)"}


# A sweep's sentence gives bytes/sample where its values differ by more than this factor.
TRAFFIC_MOVED = 1.1

# A worker-count sweep's sentence gives steps/s where the mean batches of its ends differ
# by more than this fraction (a share of the training set below train.batch_size).
BATCH_ALIKE = 0.01


def unmeasured(series: list[list[float]]) -> bool:
    """Whether these values cannot be ordered at all: two or more means, not all equal, and
    no run-to-run sd measured for any of them (every one ran once). A sentence then states
    the values, without higher, lower or a trend verb, and says why (ONCE)."""
    means = [m for v in series if (m := mean(v)) is not None]
    return (len(means) >= 2 and not close(max(means), min(means), REL_EQUAL)
            and all(sd(v) is None for v in series))


def noise_note(series: list[list[float]], fmt: Callable[[float], str] = str) -> str:
    """'; within the run-to-run noise ...' when the means' range is below 2 sd; with no sd
    measured, '; ran once ...' (ONCE) unless they are equal; else ''."""
    sds = [s for v in series if (s := sd(v)) is not None]
    means = [m for v in series if (m := mean(v)) is not None]
    if len(means) < 2:
        return ""
    span = max(means) - min(means)
    if close(max(means), min(means), REL_EQUAL) or fmt(max(means)) == fmt(min(means)):
        return ""  # the same number, or written the same: the trend says "stayed flat"
    if sds:
        if span < 2 * max(sds):
            return f"; within the run-to-run noise, sd up to {fmt(max(sds))}: not established"
        return ""
    return f"; {ONCE}"


def course(what: str, values: str, series: list[list[float]], means: list[float],
           fmt: Callable[[float], str] = str) -> str:
    """'WHAT rose (VALUES)' for a sequence of means, with its noise_note; when they cannot
    be ordered (unmeasured), 'WHAT VALUES' without a trend verb: the caller says why (ONCE)."""
    if unmeasured(series):
        return f"{what} {values}"
    # A step between values written the same (repeats of a simulation do not spread) is none.
    shown = means[:1]
    for m in means[1:]:
        shown.append(shown[-1] if fmt(m) == fmt(shown[-1]) else m)
    word, noisy = trend(shown), ""
    if word == "went up and down":
        # A reversal within two run-to-run sds is not one: the told-apart steps decide.
        told = [b > a for (a, b), (u, v) in zip(zip(means, means[1:], strict=False),
                                                 zip(series, series[1:], strict=False), strict=True)
                if tie_reason(u, v, fmt) is None]
        if told and len(set(told)) == 1:
            word = "rose" if told[0] else "fell"
            noisy = "; its other steps are within two run-to-run sds"
    elif word in ("rose", "fell"):
        # (0.62, 0.97, 1.17 "rose" where 1.17 was not told apart from 0.97: the step is said, as the
        # tables' "not told apart" says it)
        steps = [f"{fmt(a)} to {fmt(b)}" for (a, b), (u, v) in zip(zip(means, means[1:], strict=False),
                                                                    zip(series, series[1:], strict=False), strict=True)
                 if fmt(a) != fmt(b) and tie_reason(u, v, fmt) not in (None, ONCE)]
        if steps:
            noisy = f"; {', '.join(steps)} {'is' if len(steps) == 1 else 'are'} within two run-to-run sds"
    return f"{what} {word} ({values}{noise_note(series, fmt) or noisy})"


def unseen(r: Row, target: float | None = None) -> str | None:
    """'not seen ≥ T in N scores during training' for a configuration whose repeats that
    missed the target were scored fewer than MIN_SCORES (psgd.report_numbers) times while training (Row.thin_misses):
    its "not reached" is unresolved. None when every miss is resolved."""
    thin = r.thin_misses()
    if not thin:
        return None
    if target is None:
        target = next((float(x["target_accuracy"]) for x in r.runs if x.get("target_accuracy") is not None), None)
    n = max(thin)
    s = (f"not seen ≥ {'the target' if target is None else f'{target:g}'} in "
         f"{'at most ' if len(set(thin)) > 1 else ''}{n} score{'' if n == 1 else 's'} during training")
    return s + (f", {len(thin)} of {len(r.runs)} repeats" if len(r.runs) > 1 else "")


def names(rows: list[Row]) -> str:
    return ", ".join(f"{r.name}" + (f" ({r.workers} w)" if not r.is_baseline else "") + r.failed_note
                     for r in rows)


def rname(r: Row, many_w: bool) -> str:
    w = f" with {counted(r.workers, 'worker')}"
    return f"**{r.name}**" + (w if many_w and not r.is_baseline else "") + r.failed_note


def _staleness_vs_accuracy(st: list[Row]) -> str:
    pts = correlation_rows(st)
    if not pts:
        if not any(r.acc for r in st):   # (not for want of repeats: it said "takes at least 5 ..., and has 5")
            return ("; no relation to final accuracy is claimed: no run of sync, ssp or async has one (no "
                    "evaluator, or a timing-only simulation)")
        # (the configurations correlation_rows could use: repeats, each with a final accuracy)
        k = sum(1 for r in st if len(r.runs) >= MIN_REPEATS and len(r.acc) == len(r.runs))
        return (f"; no relation to final accuracy is claimed: that takes at least {MIN_POINTS} configurations "
                f"of sync, ssp or async with {MIN_REPEATS} or more scored repeats each, and this comparison "
                f"has {k}")
    # Every correlation row has a measured staleness and an accuracy for each run (correlation_rows).
    pairs = [(sm, acc) for r in pts if (sm := r.staleness_mean) is not None and (acc := mean(r.acc)) is not None]
    rho = spearman([sm for sm, _ in pairs], [acc for _, acc in pairs])
    if rho is None:
        return "; measured staleness or final accuracy is the same everywhere: no rank correlation to compute"
    over = f"Spearman ρ = {rho:.2f} over {len(pts)} configurations of at least {MIN_REPEATS} repeats"
    # "within the noise" only where no two configurations' accuracies are told apart: one
    # configuration's wide spread (sd 0.18) said so of sync at 0.966 ± 0.003 and async at
    # 0.796 ± 0.018, and concluded "no effect of staleness"
    if noise_note([r.acc for r in pts]) and all(tie_reason(a.acc, b.acc) is not None
                                                for i, a in enumerate(pts) for b in pts[i + 1:]):
        top_sd = max(sd(r.acc) or 0.0 for r in pts)
        return (f"; the final accuracies differ by less than the run-to-run noise (sd up to {top_sd:.4f}), so "
                f"they show no effect of staleness ({over})")
    if abs(rho) < (crit := rho_critical(len(pairs))):
        return (f"; no relation between staleness and final accuracy is established ({over}: below {crit:.2f}, the "
                f"|ρ| that chance reaches at most 5 % of the time over {len(pairs)} points)")
    if rho < 0:
        return f"; more staleness went with lower final accuracy ({over})"
    return (f"; more staleness did not cost final accuracy here — it went with higher accuracy ({over}), "
            f"so other differences between the configurations dominate")


def _run_staleness(r: Row) -> list[float]:
    return [float(x["staleness"]["mean"]) for x in r.runs if x.get("staleness")]


def staleness_sentences(dist: list[Row], period: float | None, many_w: bool) -> list[str]:
    out: list[str] = []
    two = "{:.2f}".format   # as the sentence writes a staleness
    measured = [(sm, r) for r in dist
                if r.mode in READ_PUSH_MODES and (sm := r.staleness_mean) is not None and r.hist]
    st = [r for _, r in measured]
    if measured:
        most_mean, most = max(measured, key=lambda p: p[0])
        whys = {id(r): tie_reason(_run_staleness(r), _run_staleness(most), two) for _, r in measured}
        level = [r for _, r in measured if r is not most and whys[id(r)] not in (None, ONCE)]
        # one that, like the highest, ran once: not ranked below it (ONCE), nor tied with it
        once = [r for _, r in measured if r is not most and whys[id(r)] == ONCE]
        if most_mean == 0 and not any(r.staleness_max for r in st):
            # (named: "no configuration of sync, ssp or async" covered one that failed, measuring nothing;
            # and not where a max says a stale read that the mean, rounded to 4 decimals, does not)
            out.append(f"No worker of {names(st)} read stale parameters (measured staleness 0 in every run).")
        elif len(measured) == 1:   # nothing to be highest among
            out.append(f"Measured staleness (mean updates applied between a worker's read and its push): "
                       f"{rname(most, many_w)} {most_mean:.2f} (max {smax(most.staleness_max)})"
                       + _staleness_vs_accuracy(st) + ".")
        elif unmeasured([_run_staleness(r) for r in st]):
            out.append("Measured staleness (mean updates applied between a worker's read and its push): "
                       + ", ".join(f"{rname(r, many_w)} {sm:.2f} (max {smax(r.staleness_max)})" for sm, r in measured)
                       + f" ({ONCE})" + _staleness_vs_accuracy(st) + ".")
        else:
            out.append(f"Measured staleness (mean updates applied between a worker's read and its push): highest "
                       f"in {rname(most, many_w)} ({most_mean:.2f}, max {smax(most.staleness_max)})"
                       + (f", not told apart from {', '.join(rname(r, many_w) for r in level)}" if level else "")
                       + (f", not ranked against {', '.join(rname(r, many_w) for r in once)} ({ONCE})" if once else "")
                       + _staleness_vs_accuracy(st) + ".")
            tt = [(r, sm, t) for r in correlation_rows(st)
                  if (t := r.resolved_ttt_mean(period)) is not None and (sm := r.staleness_mean) is not None]
            rho_t = spearman([sm for _, sm, _ in tt], [t for _, _, t in tt])
            if (len(tt) >= MIN_POINTS and rho_t is not None and abs(rho_t) >= rho_critical(len(tt))
                    and not noise_note([r.ttt for r, _, _ in tt])):
                out.append(f"More staleness went with {'longer' if rho_t > 0 else 'shorter'} times to the target "
                           f"(Spearman ρ = {rho_t:.2f} over {len(tt)} configurations).")
    other = [m for m in OTHER_STALENESS if any(r.mode == m for r in dist)]
    if other:
        out.append(f"Measured staleness of another kind, not compared with sync, ssp or async: "
                   f"{'; '.join(OTHER_STALENESS[m] for m in other)}.")
    out += [f"{NO_STALENESS[m]}." for m in NO_STALENESS
            if any(r.mode == m and not r.hist for r in dist)]
    return out


def _times_clause(rs: list[Row], period: float | None, target: float | None = None) -> str | None:
    """The sweep's times to target; None when no row of it was scored."""
    if not any(r.scored for r in rs):
        return None
    resolved = [t for r in rs if (t := r.resolved_ttt_mean(period)) is not None]
    if len(resolved) == len(rs) and not any(r.errors for r in rs):
        values = f"{', '.join(secs(t) for t in resolved)} s"
        if period and max(resolved) - min(resolved) < period:   # (as the order's ≈: the evaluator's resolution)
            return f"time to target {values} (all within one evaluation period, {period:g} s: no trend resolved)"
        return course("time to target", values, [r.ttt for r in rs], resolved, lambda x: f"{secs(x)} s")
    return "time to target " + ", ".join(_one_time(r, period, target) for r in rs)


def time_status(r: Row, period: float | None, target: float | None = None) -> str:
    """Why a sweep point has no plain, resolved time to target: "not scored", "not reached"
    (or unseen), "k/n reached", "not resolved", "k of n repeats failed"; "" when it has one."""
    if not r.scored:
        return "not scored"
    got, n = len(r.ttt), len(r.runs)
    if not got:
        return unseen(r, target) or "not reached"
    parts = [f"{got}/{n} reached" if got < n else "" if r.ttt_resolved(period) else "not resolved",
             r.failed_repeats]
    return "; ".join(p for p in parts if p)


def _one_time(r: Row, period: float | None, target: float | None = None) -> str:
    """One sweep point's time to target, saying how many repeats reached it (time_status)."""
    why = time_status(r, period, target)
    if not r.scored or not r.ttt:   # (one with its own commas in brackets: the sentence lists the values by commas)
        return f"({why})" if "," in why else why
    return f"{secs(mean(r.ttt) or 0.0)} s" + (f" ({why})" if why else "")


def sweep_sentences(dist: list[Row], period: float | None = None, target: float | None = None,
                    seconds: float = 0.0, faulted: Callable[[Row], bool] | None = None) -> list[str]:
    """A sentence per parameter sweep (each quantity's trend over the swept values, or,
    where every value ran once, the values without a trend: ONCE) and per worker-count sweep.
    `seconds`: the job's time budget (train.seconds), which run_steps needs; `faulted`:
    whether a row's runs had an injected fault (a worker-count sweep whose ends differ in
    it says so: a straggler's rank only the larger count has)."""
    out = []
    for mode, key, w, rs in sweeps(dist):
        lost = failed_values(rs)
        rs = [r for r in rs if r.runs]
        if len(rs) < 2:
            continue
        vals = [format_value(r.sweep_value) for r in rs]
        parts = []
        once = False   # whether some quantity's values could not be ordered (unmeasured)
        tput = [t for r in rs if (t := mean(r.sps)) is not None]
        if len(tput) == len(rs):
            parts.append(course("throughput", f"{', '.join(amount(t) for t in tput)} samples/s",
                                [r.sps for r in rs], tput, amount))
            once |= unmeasured([r.sps for r in rs])
        times_clause = _times_clause(rs, period, target)
        if times_clause:
            parts.append(times_clause)
            once |= unmeasured([r.ttt for r in rs]) and all(r.resolved_ttt_mean(period) is not None for r in rs)
        accs = [acc for r in rs if (acc := mean(r.acc)) is not None]
        if len(accs) == len(rs) and max(accs) - min(accs) <= ACC_HARDLY:   # as the range sentence says
            parts.append(f"final accuracy hardly moved ({', '.join(f'{a:.4f}' for a in accs)})")
        elif len(accs) == len(rs):
            parts.append(course("final accuracy", ", ".join(f"{a:.4f}" for a in accs), [r.acc for r in rs], accs,
                                lambda x: f"{x:.4f}"))
            once |= unmeasured([r.acc for r in rs])
        traffic = [b for r in rs if (b := mean(r.values("bytes_per_sample"))) is not None]
        # What a wire.dtype, wire.compression or communication-period sweep trades accuracy
        # for; left out where the sweep moved it by less than TRAFFIC_MOVED (ssp's bound).
        if len(traffic) == len(rs) and max(traffic) > TRAFFIC_MOVED * min(traffic):
            parts.append(course("bytes/sample", ", ".join(amount(b) for b in traffic),
                                [r.values("bytes_per_sample") for r in rs], traffic, amount))
            once |= unmeasured([r.values("bytes_per_sample") for r in rs])
        st = [sm for r in rs if (sm := r.staleness_mean) is not None]
        if len(st) == len(rs):
            parts.append(course("measured staleness (mean)", ", ".join(f"{s:.2f}" for s in st),
                                [_run_staleness(r) for r in rs], st, lambda x: f"{x:.2f}"))
            once |= unmeasured([_run_staleness(r) for r in rs])
        fixed = "; ".join([counted(w, "worker")] + sweep_fixed(rs) + ([lost] if lost else []))
        out.append(f"Sweep of {mode} {param_name(mode, key)} over {', '.join(vals)} ({fixed}): "
                   + "; ".join(parts) + (f"; each value {ONCE}" if once else "") + ".")
    for rs in worker_sweeps(dist).values():
        first, last = rs[0], rs[-1]
        a, b = mean(first.sps), mean(last.sps)
        if a and b:
            gain = b / a
            eff = gain / (last.workers / first.workers)
            why = tie_reason(first.sps, last.sps, amount)
            shrank = _batch_clause(rs, seconds)
            s = (f"{first.name} from {first.workers} to {last.workers} workers: throughput ×{gain:.2f} "
                 + ("in samples/s " if shrank else "")
                 + f"(scaling efficiency {percent(eff)}" + (f"; not told apart: {why}" if why and why != ONCE else "")
                 + ")" + shrank + _turn(rs) + _times_across(first, last, period))
            if why == ONCE:
                s += f" (each worker count {ONCE})"
            hit = [r.workers for r in rs if faulted is not None and faulted(r)]
            if hit and len(hit) < len(rs):   # (a straggler's rank that the smaller counts lack)
                s += (f" (the injected fault is in the runs with {' and '.join(map(str, hit))} "
                      f"worker{'s' if hit != [1] else ''} only)")
            out.append(s + ".")
    return out


def failed_values(rs: list[Row]) -> str:
    """The values of a sweep (its rows, `rs`) of which every run failed, which its sentence
    and plot leave out: "1e+06: every run failed, left out"; "" where none."""
    gone = [format_value(r.sweep_value) for r in rs if not r.runs]
    return f"{', '.join(gone)}: every run failed, left out" if gone else ""


def _batch_clause(rs: list[Row], seconds: float) -> str:
    """Where a worker's batch differs between the ends of a worker-count sweep (its share of
    a small training set is below train.batch_size at the larger count, and a batch holds
    no more), samples/s measure the data split as much as the mode: the throughput in
    steps/s and its scaling efficiency, and each count's batch (mean samples per step per
    worker, worker_batches), e.g. ', ×13.35 in steps/s (scaling efficiency 42%): a worker's
    batch held 32, 22.5, 5.6 samples at 8, 64, 256 workers, so samples/s change with the
    batch as well as with the worker count' (what the sweep varies: the mode is the same at
    every count). '' where the batches are equal or not known
    (run_steps: a time budget, lost workers)."""
    batches = {id(r): mean(worker_batches(r, seconds)) for r in rs}
    first, last = rs[0], rs[-1]
    ba, bb = batches[id(first)], batches[id(last)]
    sa, sb = steps_per_s(first, seconds), steps_per_s(last, seconds)
    if ba is None or bb is None or close(ba, bb, BATCH_ALIKE) or not sa or not sb:
        return ""
    gain = (mean(sb) or 0.0) / (mean(sa) or 1.0)
    why = tie_reason(sa, sb, amount)
    told = [r for r in rs if batches[id(r)] is not None]
    held = ", ".join(_batch(batches[id(r)] or 0.0) for r in told)
    return (f", ×{gain:.2f} in steps/s (scaling efficiency {percent(gain / (last.workers / first.workers))}"
            + (f"; not told apart: {why}" if why and why != ONCE else "")
            + f"): a worker's batch held {held} samples at {', '.join(str(r.workers) for r in told)} workers "
            f"(samples per step: train.batch_size, or the worker's share of the training set where that is "
            f"smaller), so samples/s change with the batch as well as with the worker count")


def _batch(x: float) -> str:
    """A mean batch: 32, 22.5, 5.6."""
    return f"{x:.1f}".removesuffix(".0")


def _turn(rs: list[Row]) -> str:
    """Where a worker-count curve of more than two counts turns inside its ends, which the
    ends' ratio hides: '; peaking at 2 workers with 10,512 samples/s (×2.33)' (or 'dipping')
    for a count above (below) both ends and told apart from each (tie_reason); one within
    two run-to-run sds of an end is said not told apart; with every count run once (ONCE),
    the values at each count, unranked. '' for a curve that does not turn."""
    tput = [mean(r.sps) for r in rs]
    if len(rs) < 3 or any(t is None for t in tput):
        return ""
    if unmeasured([r.sps for r in rs]):
        return (f"; {', '.join(amount(t) for t in tput)} samples/s at "
                f"{', '.join(str(r.workers) for r in rs)} workers")
    first, last, a = rs[0], rs[-1], tput[0] or 0.0
    inner = rs[1:-1]
    hi = max(inner, key=lambda r: mean(r.sps) or 0.0)
    lo = min(inner, key=lambda r: mean(r.sps) or 0.0)
    for r, word, beyond in ((hi, "peaking", lambda x, y: x > y), (lo, "dipping", lambda x, y: x < y)):
        t = mean(r.sps) or 0.0
        ends = [e for e in (first, last) if not beyond(t, mean(e.sps) or 0.0)]
        whys = [why for e in (first, last) if (why := tie_reason(r.sps, e.sps, amount))]
        if ends or "equal" in whys:
            continue   # not beyond both ends (as written)
        if whys:
            side = "above" if word == "peaking" else "below"
            return (f"; {amount(t)} samples/s at {r.workers} workers, {side} both ends but not told apart from them "
                    f"({'; '.join(dict.fromkeys(whys))})")
        to = "with" if word == "peaking" else "to"
        return f"; {word} at {r.workers} workers {to} {amount(t)} samples/s (×{t / a:.2f})" if a else ""
    return ""


def percent(x: float) -> str:
    """A fraction as a percentage, to two significant digits below 10% (0.0071: "0.71%", not
    "1%", which would also be what 0.0116 gives), else to whole percents ("51%")."""
    return f"{100 * x:.0f}%" if 100 * x >= 9.5 else f"{100 * x:.2g}%"


def _times_across(first: Row, last: Row, period: float | None) -> str:
    """', time to target T0 s → T1 s' of a worker-count sweep, where both are resolved, with
    why they are not told apart (tie_reason, or less than one evaluation period apart). A
    worker count that lost repeats has its survivors' time, which the time sentences do not
    rank either: said instead of the times."""
    lost = [r for r in (first, last) if r.errors]
    if lost:
        return "; " + " and ".join(f"{r.failed_repeats} at {r.workers} workers" for r in lost) + \
            ", so the times to target are not compared"
    t0, t1 = first.resolved_ttt_mean(period), last.resolved_ttt_mean(period)
    if t0 is None or t1 is None:
        return ""
    why = tie_reason(first.ttt, last.ttt) or ("less than one evaluation period apart"
                                              if period and abs(t1 - t0) < period else None)
    return f", time to target {secs(t0)} s → {secs(t1)} s" + (f" (not told apart: {why})" if why and why != ONCE
                                                               else "")
