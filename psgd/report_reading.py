"""The generated reading of the `psgd compare` report: sentences computed from the rows.

Time to target (ranked only where the time is resolved; a warning instead of a ranking
when the budget is too short for the evaluator's period), throughput, final accuracy,
waiting, injected faults; then measured staleness and the sweeps (psgd.report_relations).
Every sentence says only what the numbers carry: ties within the run-to-run sd or within
one evaluation period are called so.
"""
from __future__ import annotations

from .report_numbers import AFTER_END, Row, eval_period, mean, sd
from .report_relations import names, rname, staleness_sentences, sweep_sentences, tie
from .report_tables import secs, times


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
    prob, jitter = float(faults.get("jitter_prob", 0.0)), float(faults.get("jitter_s", 0.0))
    if prob > 0 and jitter > 0:
        parts.append(f"transient stragglers: each step of each worker is delayed by {jitter:g} s with probability "
                     f"{prob:g}, independently (seeded by job.seed and rank), so a step of W workers waits for at "
                     f"least one delayed worker with probability 1 − (1 − {prob:g})^W")
    return "; ".join(parts) if parts else None


def _why_unranked(r: Row, target: float, period: float | None) -> str:
    flags = r.ttt_flags(period)
    flag, run = next(((g, x) for g, x in flags if g == AFTER_END), flags[0])
    t = float(run["time_to_target_s"])
    if flag == AFTER_END:
        s = (f"first scored ≥ {target:g} at {secs(t)} s, after its training had ended at "
             f"{secs(float(run['wall_s']))} s")
    else:
        s = f"already ≥ {target:g} at the evaluator's first score, {secs(t)} s"
        s += f", less than one evaluation period ({period:g} s) after the start" if period and t < period else ""
    n = len(r.runs)
    return f"{r.name} ({s}" + (f"; {len(flags)} of {n} repeats" if n > 1 else "") + ")"


def _time_sentences(dist: list[Row], base: Row | None, target: float, period: float | None,
                    many_w: bool) -> list[str]:
    out: list[str] = []
    reached = [r for r in dist if r.ttt_mean is not None]
    # [(mean time to target, row)] of the rows whose time is resolved, fastest first.
    ranked = sorted([(t, r) for r in reached if (t := r.resolved_ttt_mean(period)) is not None],
                    key=lambda p: p[0])
    unranked = [r for r in reached if not r.ttt_resolved(period)]
    base_t = base.resolved_ttt_mean(period) if base is not None else None
    if ranked:
        best_t, best = ranked[0]
        among = ", of the configurations whose time is resolved" if unranked else ""
        s = f"First to reach {target:g} test accuracy{among}: {rname(best, many_w)} after {secs(best_t)} s"
        extras = []
        if best.ref_sync is not None and best.ref_sync is not best and best.ref_sync.ttt_resolved(period):
            extras.append(f"{times(best.speedup(best.ref_sync))} the speed of sync")
        if base_t is not None:
            extras.append(f"{times(best.speedup(base))} the speed of the sequential baseline, which needed "
                          f"{secs(base_t)} s")
        out.append(s + ((" (" + "; ".join(extras) + ")") if extras else "") + ".")
        if len(ranked) > 1:
            order = ", ".join(f"{r.name}{f' ({r.workers} w)' if many_w else ''} {secs(t)} s" for t, r in ranked)
            out.append(f"Order to the target: {order}.")
            tied = [r for _, r in ranked[1:] if tie(best.ttt, r.ttt)]
            if tied:
                out.append(f"Within one run-to-run sd of {best.name}'s time: {names(tied)}.")
            close = [r for t, r in ranked[1:] if period and t - best_t < period and r not in tied]
            if close:
                out.append(f"{names(close)} reached it less than one evaluation period ({period:g} s) after "
                           f"{best.name}: the evaluator scores the model every {period:g} s, so that order is "
                           f"within the measurement's resolution.")
        if base_t is not None and base_t < best_t:
            out.append(f"The sequential baseline reached the target in {secs(base_t)} s, sooner than any "
                       f"distributed configuration: on this job and machine no mode paid for its communication.")
    elif unranked:
        walls = [w for r in dist for w in r.values("wall_s")]
        facts = ([f"training lasted {secs(min(walls))}–{secs(max(walls))} s"] if walls else []) + \
                ([f"the evaluator scores every {period:g} s"] if period else [])
        out.append(f"The budget is too short to rank the configurations by time to {target:g}: each one that "
                   f"reached it was first seen there by a score taken after its training had ended or by the "
                   f"evaluator's first score" + (f" ({'; '.join(facts)})" if facts else "")
                   + ". Raise train.steps or train.seconds, or lower eval.every_seconds, to get times that rank.")
    else:
        out.append(f"No distributed configuration reached {target:g} test accuracy in every repeat within the budget.")
    if unranked:
        out.append(f"Not ranked by time to {target:g}: "
                   + "; ".join(_why_unranked(r, target, period) for r in unranked) + ".")
    missed = [r for r in dist if r.ttt_mean is None]
    never = [r for r in missed if not r.ttt]
    partial = [r for r in missed if r.ttt]
    if never:
        out.append(f"Never reached {target:g}: {names(never)}.")
    if partial:
        out.append(f"Reached {target:g} in only some repeats: {names(partial)}.")
    return out


def _throughput_sentences(dist: list[Row], base: Row | None, ctx: dict, many_w: bool) -> list[str]:
    out: list[str] = []
    by_sps = sorted(dist, key=lambda r: mean(r.sps) or 0.0, reverse=True)
    top, low = by_sps[0], by_sps[-1]
    top_sps = mean(top.sps)
    if top_sps is None:  # no distributed configuration has a measured throughput
        return out
    s = f"Highest throughput: {rname(top, many_w)} with {top_sps:,.0f} samples/s"
    ref = top.ref_sync
    ratio = top.throughput_ratio(ref)
    if ratio is not None and ref is not None and ref is not top:
        s += f" ({ratio:.2f}× sync's {mean(ref.sps):,.0f})"
    if len(by_sps) > 1 and tie(top.sps, by_sps[1].sps):
        s += (f", but {rname(by_sps[1], many_w)}, at {mean(by_sps[1].sps):,.0f}, is within one run-to-run sd "
              f"of it")
    if low is not top:
        s += f"; lowest: {rname(low, many_w)} with {mean(low.sps):,.0f}"
    out.append(s + ".")
    b = mean(base.sps) if base is not None else None
    if b:
        if b > top_sps:
            out.append(f"The sequential baseline alone processed {b:,.0f} samples/s, {b / top_sps:.1f}× the "
                       f"best distributed configuration: the per-step cost of the parameter-server round trips and "
                       f"of sharing {ctx.get('machine', {}).get('cpus', '?')} cores among the processes outweighs "
                       f"what the extra workers add.")
        else:
            out.append(f"The best distributed configuration processed {top_sps / b:.2f}× the samples per second "
                       f"of the sequential baseline ({b:,.0f}).")
    return out


def _accuracy_sentences(dist: list[Row], base: Row | None, many_w: bool) -> list[str]:
    out: list[str] = []
    accs = [(acc, r) for r in dist if (acc := mean(r.acc)) is not None]
    if not accs:
        return out
    hi, lo = max(accs, key=lambda t: t[0]), min(accs, key=lambda t: t[0])
    noise = max([sd(r.acc) or 0.0 for _, r in accs] + [0.0])
    if hi[0] - lo[0] <= max(0.005, 2 * noise):
        out.append(f"Final accuracy hardly separates the configurations: all lie between {lo[0]:.4f} and "
                   f"{hi[0]:.4f}.")
    else:
        out.append(f"Final accuracy ranged from {lo[0]:.4f} ({rname(lo[1], many_w)}) to {hi[0]:.4f} "
                   f"({rname(hi[1], many_w)}).")
    ba = mean(base.acc) if base is not None else None
    if ba is not None:
        better = [r for a, r in accs if a > ba + 0.002]
        out.append(f"The sequential baseline ended at {ba:.4f}" +
                   (f"; {names(better)} ended higher." if better else
                    ", as high as or higher than every distributed configuration."))
    return out


def reading(rows: list[Row], ctx: dict) -> list[str]:
    """Sentences about the trade-off, each computed from the rows."""
    target = float(ctx.get("target_accuracy", 0.9))
    period = eval_period([run for r in rows for run in r.runs], ctx)
    ok = [r for r in rows if r.runs]
    dist = [r for r in ok if not r.is_baseline]
    base = next((r for r in ok if r.is_baseline), None)
    many_w = len({r.workers for r in dist}) > 1
    if not dist:
        return ["No distributed run finished, so there is nothing to compare."]
    if any(r.acc for r in dist) or any(r.ttt for r in dist):
        out = _time_sentences(dist, base, target, period, many_w)
    else:  # timing only (psgd simulate with sim.train = false), or no evaluator: nothing to rank by accuracy
        out = ["No run was scored (no evaluator, or a timing-only simulation): throughput, waiting and "
               "staleness only."]
    out += _throughput_sentences(dist, base, ctx, many_w)
    out += _accuracy_sentences(dist, base, many_w)
    out += staleness_sentences(dist, period, many_w)

    waits = [(w, r) for r in dist if (w := mean(r.values("wait_fraction"))) is not None]
    if len(waits) > 1:
        hi, lo = max(waits, key=lambda t: t[0]), min(waits, key=lambda t: t[0])
        if hi[0] - lo[0] >= 0.05:
            out.append(f"Workers of {rname(hi[1], many_w)} spent {100 * hi[0]:.0f}% of their time blocked on the "
                       f"servers, those of {rname(lo[1], many_w)} {100 * lo[0]:.0f}%.")

    faults = describe_faults(ctx.get("faults") or {}, ctx.get("workers") or [])
    if faults:
        top = max(dist, key=lambda r: mean(r.sps) or 0.0)
        ref = top.ref_sync   # the sync row with the same worker count
        s = f"All runs had a fault injected: {faults}."
        if ref is not None and top.mode != "sync" and mean(ref.sps):
            s += (f" Under it, {rname(top, many_w)} kept {mean(top.sps):,.0f} samples/s against sync's "
                  f"{mean(ref.sps):,.0f} with {ref.workers} workers.")
        out.append(s)

    out += sweep_sentences(dist, period)
    return out

