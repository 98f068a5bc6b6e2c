"""The generated reading of the `psgd compare` report: sentences computed from the rows.

Time to target (ranked only where the time is resolved; a warning instead of a ranking
when the budget is too short for the evaluator's period), throughput, final accuracy,
waiting, injected faults; then measured staleness and the sweeps (psgd.report_relations).
Every sentence says only what the numbers carry: ties within two run-to-run sds or within
one evaluation period are called so; values of configurations that each ran once (no
spread measured) are stated without being ranked (report_relations.ONCE); a target not
seen in fewer than MIN_SCORES scores during training is not called missed.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable

from .metrics import CPU_WAIT_SAID, cpu_wait_said
from .report_numbers import (
    ACC_HARDLY,
    AFTER_END,
    FIRST_SCORE,
    MIN_SCORES,
    Row,
    amount,
    counted,
    eval_period,
    lost_words,
    mean,
    run_period,
    sd,
)
from .report_relations import (
    ONCE,
    names,
    noise_note,
    rname,
    staleness_sentences,
    sweep_sentences,
    tie_reason,
    unmeasured,
    unseen,
)
from .report_tables import clip, cpu_wait_counted, secs, times


def describe_faults(faults: dict, workers: list[int], baseline: bool = True) -> str | None:
    """The injected faults in words; `baseline`: whether a sequential baseline ran (psgd
    simulate and `--no-baseline` run none)."""
    parts = []
    rank = _straggler(faults)
    if rank is not None:
        s = (f"worker rank {rank} is an injected straggler: each of its steps takes "
             f"{float(faults['slow_factor']):g}× as long")
        small = [w for w in workers if w <= rank]
        if small and len(small) == len(workers):
            s += (f" (no effect: no run has a rank {rank}; they have {' or '.join(map(str, small))} "
                  f"worker{'s' if small != [1] else ''})")
        elif small:
            s += f" (no effect in runs with {', '.join(map(str, small))} worker{'s' if small != [1] else ''})"
        if baseline:
            s += "; the sequential baseline is rank 0, so it is " + ("slowed too" if rank == 0 else "not slowed")
        parts.append(s)
    delay = float(faults.get("step_delay_s", 0.0))
    if delay > 0:
        parts.append(f"every step of every worker{' (and of the baseline)' if baseline else ''} is delayed by "
                     f"{delay:g} s (a slow link)")
    prob, jitter = float(faults.get("jitter_prob", 0.0)), float(faults.get("jitter_s", 0.0))
    if prob > 0 and jitter > 0:
        parts.append(f"transient stragglers: each step of each worker is delayed by {jitter:g} s with probability "
                     f"{prob:g}, independently (seeded by job.seed and rank), so a step of W workers waits for at "
                     f"least one delayed worker with probability 1 − (1 − {prob:g})^W"
                     + ("; the sequential baseline's steps are delayed as rank 0's" if baseline else ""))
    return "; ".join(parts) if parts else None


def _straggler(faults: dict) -> int | None:
    """The rank that `faults.slow_rank` and `faults.slow_factor` slow down, if any."""
    rank = int(faults.get("slow_rank", -1))
    return rank if rank >= 0 and float(faults.get("slow_factor", 1.0)) > 1 else None


def _faulted(faults: dict, workers: int) -> bool:
    """Does a run of `workers` workers have some injected fault (a delay, jitter, or the
    straggler's rank among its workers)?"""
    rank = _straggler(faults)
    return (float(faults.get("step_delay_s", 0.0)) > 0
            or (float(faults.get("jitter_prob", 0.0)) > 0 and float(faults.get("jitter_s", 0.0)) > 0)
            or (rank is not None and workers > rank))


def item_faults(r: Row) -> dict:
    """The faults.* keys that row `r`'s mode item sets (`sync:faults.step_delay_s=0`), without
    the section: they replace those of every run for its runs."""
    return {str(k)[len("faults."):]: v for k, v in r.params.items() if str(k).startswith("faults.")}


def _all_faults_apply(faults: dict, workers: int) -> bool:
    """Does a run of `workers` workers have every injected fault (the straggler's rank
    among its workers)? The others (delays, jitter) apply to every run."""
    rank = _straggler(faults)
    return rank is None or workers > rank


def _with_workers(r: Row, many_w: bool) -> str:
    """The row's name, with its worker count where the report has several (one label per count)."""
    return r.name + (f" with {counted(r.workers, 'worker')}" if many_w else "")


def _why_unranked(r: Row, target: float, period: float | None, many_w: bool = False) -> str:
    """Why row `r`'s time does not rank: per kind of flag (a score after training ended,
    the evaluator's first score), one repeat's numbers and in how many repeats it was so."""
    flags = r.ttt_flags(period)
    kinds = [g for g in (AFTER_END, FIRST_SCORE) if any(f == g for f, _ in flags)]
    n, parts = len(r.runs), []
    for flag in kinds:
        run = next(x for g, x in flags if g == flag)
        t = float(run["time_to_target_s"])
        if flag == AFTER_END:
            s = (f"first scored ≥ {target:g} at {secs(t)} s, after its training had ended at "
                 f"{secs(float(run['wall_s']))} s")
        else:
            own = run_period(run, period)
            s = (f"already ≥ {target:g} before its first step (the untrained model)" if run.get("mode") == "baseline"
                 else f"already ≥ {target:g} at the evaluator's first score, {secs(t)} s")
            s += f", less than one evaluation period ({own:g} s) after the start" if own and t < own else ""
        k = sum(1 for f, _ in flags if f == flag)
        # one kind: '...; 2 of 2 repeats'; both: each kind with its own count (a repeat is of one kind)
        parts.append(s + ((f"; {k} of {n} repeats" if len(kinds) == 1 else f", in {k} of {n} repeats")
                          if n > 1 else ""))
    return f"{_with_workers(r, many_w)} ({'; '.join(parts)})"


def _unresolved_share(unranked: list[Row], period: float | None) -> str:
    """In which repeats of the unranked rows the time cannot rank: every one, or at least one
    of each row's (a row with one such repeat is not ranked), with the count."""
    flagged = sum(len(r.ttt_flags(period)) for r in unranked)
    repeats = sum(len(r.runs) for r in unranked)
    if flagged == repeats:
        return "in every repeat"
    return f"in at least one of its repeats ({flagged} of {repeats} in all)"


def _order(ranked: list[tuple[float, Row]], period: float | None, many_w: bool) -> str:
    """The rows by their mean time to the target, each joined to the one before it by "<"
    where the two are told apart, by "≈" where they are not: equal, within two run-to-run
    sds of each other, or less than one evaluation period apart; by "vs" where both ran
    once (ONCE: however far apart, no spread says whether the order would hold)."""
    parts, said = [], set()
    for k, (t, r) in enumerate(ranked):
        if k:
            t0, r0 = ranked[k - 1]
            why = tie_reason(r0.ttt, r.ttt)
            near = (why is not None and why != ONCE) or bool(period and t - t0 < period)
            sign = "≈" if near else "vs" if why == ONCE else "<"
            said.add(sign)
            parts.append(f" {sign} ")
        parts.append(f"{r.name}{f' ({r.workers} w)' if many_w else ''} {secs(t)} s")
    legend = [text for sign, text in (("≈", "≈: not told apart from the one before it: equal, within two "
                                             "run-to-run sds, or less than one evaluation period apart"),
                                      ("vs", "vs: both ran once, not ranked against each other")) if sign in said]
    explained = f" ({'; '.join(legend)})" if legend else ""
    return f"Order to the target: {''.join(parts)}{explained}."


def _time_sentences(dist: list[Row], base: Row | None, target: float, period: float | None,
                    many_w: bool) -> list[str]:
    out: list[str] = []
    reached = [r for r in dist if r.ttt_mean is not None]
    # A configuration that lost repeats has a time from its survivors only: not ranked.
    lost = [r for r in reached if r.errors]
    # [(mean time to target, row)] of the rows whose time is resolved, fastest first.
    ranked = sorted([(t, r) for r in reached if r not in lost and (t := r.resolved_ttt_mean(period)) is not None],
                    key=lambda p: p[0])
    unranked = [r for r in reached if r not in lost and not r.ttt_resolved(period)]
    # Reached the target in some repeats only: no time, but one that came sooner than the
    # best's in the repeats that reached it makes the best no "first", nor the baseline
    # sooner than every configuration (a review: async at 1.5 s in 2 of 3 repeats was left out).
    partly = [r for r in dist if r.ttt and r.ttt_mean is None]
    base_t = base.resolved_ttt_mean(period) if base is not None else None
    among = ", of the configurations whose time is resolved" if unranked or lost or partly else ""
    if len(ranked) > 1 and unmeasured([r.ttt for _, r in ranked]):
        # Every resolved configuration ran once: their times are stated, in the rows' order, not ranked.
        best_t, best = ranked[0]
        out.append(f"Time to {target:g} test accuracy{among}: "
                   + ", ".join(f"{rname(r, many_w)} {secs(t)} s" for r in dist for t, x in ranked if x is r)
                   + f" ({ONCE}).")
        if base is not None and base_t is not None and base_t < best_t:
            out += _baseline_sooner(base, base_t, best, best_t, unranked + lost + partly, period,
                                    [r for _, r in ranked[1:]])
    elif ranked:
        best_t, best = ranked[0]
        # An unranked time is an upper bound (the model was above the target when first seen):
        # one below the best resolved time got there sooner, so that one is not "first" -- where
        # the two are told apart: more than one evaluation period (the best's time is rounded up
        # to it) and not within two run-to-run sds (single repeats: the bound holds per run).
        sooner, sooner_partly = ([r for r in rows if (bound := mean(r.ttt) or 0.0) < best_t
                                  and not (period and best_t - bound < period)
                                  and tie_reason(r.ttt, best.ttt) in (None, ONCE)] for rows in (unranked, partly))
        if sooner or sooner_partly:
            s = f"Shortest resolved time to {target:g} test accuracy: {rname(best, many_w)} after {secs(best_t)} s"
        elif len(ranked) == 1 and (unranked or lost):
            s = (f"Time to {target:g} test accuracy of the one configuration whose time is resolved: "
                 f"{rname(best, many_w)} after {secs(best_t)} s")
        elif len(dist) == 1:   # one configuration: nothing to be first among
            s = f"Time to {target:g} test accuracy: {rname(best, many_w)} after {secs(best_t)} s"
        elif any(tie_reason(best.ttt, r.ttt) for _, r in ranked[1:]) or (
                len(ranked) > 1 and period and ranked[1][0] - best_t < period):
            # Another time not told apart from the best's (equal: common in simulations, whose
            # clocks are exact; or less than one evaluation period after it): the best is the
            # shortest, not known to be first (the order says more)
            s = f"Shortest time to {target:g} test accuracy{among}: {rname(best, many_w)} after {secs(best_t)} s"
        else:
            s = f"First to reach {target:g} test accuracy{among}: {rname(best, many_w)} after {secs(best_t)} s"
        extras = []
        ref = best.ref_sync
        if ref is not None and ref is not best and ref.ttt_resolved(period) and not ref.errors:
            ref_t = ref.resolved_ttt_mean(period) or 0.0
            why = tie_reason(best.ttt, ref.ttt) or ("less than one evaluation period apart"
                                                    if period and abs(ref_t - best_t) < period else None)
            extras.append(f"{times(best.speedup(ref))} the speed of {best.sync_name()}" + _tie_clause(why))
        if base is not None and base_t is not None:
            extras.append(_against_base(best, base, base_t))
        out.append(s + ((" (" + "; ".join(extras) + ")") if extras else "") + ".")
        if sooner:
            by = [f"{names([r])}{f' was already at {target:g}' if k == 0 else ''} by {secs(mean(r.ttt) or 0.0)} s"
                  for k, r in enumerate(sooner)]
            out.append(f"Not the first to get there: {', '.join(by[:-1]) + ' and ' if len(by) > 1 else ''}{by[-1]}, "
                       f"sooner, though {'its time is' if len(by) == 1 else 'their times are'} not resolved (below).")
        if sooner_partly:
            out.append("Sooner in the repeats that reached it: "
                       + ", ".join(f"{names([r])} by {secs(mean(r.ttt) or 0.0)} s in {len(r.ttt)} of its "
                                   f"{len(r.runs)} repeats" for r in sooner_partly)
                       + f" (the others did not reach {target:g}: below).")
        if len(ranked) > 1:
            out.append(_order(ranked, period, many_w))
            tied = [(r, why) for _, r in ranked[1:] if (why := tie_reason(best.ttt, r.ttt))]
            # A row that, like the best, ran once is not ranked against it; not tied with it either.
            level = [(r, why) for r, why in tied if why != ONCE]
            if level:
                out.append(f"Not told apart from {names([best])}'s time: "
                           + ", ".join(f"{names([r])} ({why})" for r, why in level) + ".")
            if once := [r for r, why in tied if why == ONCE]:
                out.append(f"Not ranked against {names([best])}'s time: {names(once)} ({ONCE}).")
            close = [r for t, r in ranked[1:] if period and t - best_t < period and r not in [x for x, _ in tied]]
            if close:
                out.append(f"{names(close)} reached it less than one evaluation period ({period:g} s) after "
                           f"{names([best])}: the evaluator scores the model every {period:g} s, so that order is "
                           f"within the measurement's resolution.")
        if base is not None and base_t is not None and base_t < best_t:
            out += _baseline_sooner(base, base_t, best, best_t, unranked + lost + partly, period,
                                    [r for _, r in ranked[1:]])
    elif unranked:
        walls = [w for r in dist for w in r.values("wall_s")]
        lasted = "–".join(dict.fromkeys([secs(min(walls)), secs(max(walls))])) if walls else ""  # 0.27 s, not 0.27–0.27
        facts = ([f"training lasted {lasted} s"] if walls else []) + \
                ([f"the evaluator scores every {period:g} s"] if period else [])
        who = "each one that reached it" + (" with every repeat finished" if lost else "")
        share, said = _unresolved_share(unranked, period), f" ({'; '.join(facts)})" if facts else ""
        if all(flag == FIRST_SCORE for r in unranked for flag, _ in r.ttt_flags(period)):
            # (not the budget: every one was at the target by the evaluator's first score)
            out.append(f"Time to {target:g} does not rank the configurations: {who} was at it by the evaluator's "
                       f"first score, {share}{said}. Raise the target (eval.target_accuracy), or lower "
                       f"eval.every_seconds, to get times that rank.")
        else:
            out.append(f"The budget is too short to rank the configurations by time to {target:g}: {who} was first "
                       f"seen at it, {share}, by a score taken after its training had ended or by the evaluator's "
                       f"first score{said}. Raise train.steps or train.seconds, or lower eval.every_seconds, to get "
                       f"times that rank.")
    elif any(r.thin_misses() for r in dist):
        out.append(f"No distributed configuration was seen at {target:g} test accuracy in every repeat within the "
                   f"budget.")
    else:
        out.append(f"No distributed configuration reached {target:g} test accuracy in every repeat within the budget.")
    if unranked:
        out.append(f"Not ranked by time to {target:g}: "
                   + "; ".join(_why_unranked(r, target, period, many_w) for r in unranked) + ".")
    if lost:
        out.append(f"Not ranked by time to {target:g}, because repeats failed: "
                   + "; ".join(f"{_with_workers(r, many_w)} ({len(r.errors)} of {r.n} repeats failed; "
                               f"{secs(mean(r.ttt) or 0.0)} s in the {len(r.runs)} that finished)" for r in lost) + ".")
    missed = [r for r in dist if r.ttt_mean is None and r.scored]
    # A miss is unresolved, like a † time, when the evaluator scored the run fewer than
    # MIN_SCORES times while it trained (once, or only after training ended).
    unseen_ = [r for r in missed if not r.ttt and r.thin_misses()]
    never = [r for r in missed if not r.ttt and r not in unseen_]
    partial = [r for r in missed if r.ttt]
    unscored = [r for r in dist if not r.scored]
    if never:
        out.append(f"Never reached {target:g}: {names(never)}.")
    if unseen_:
        out.append(f"Not known to have missed {target:g}, scored fewer than {MIN_SCORES} times during training: "
                   + "; ".join(f"{names([r])} ({unseen(r, target)})" for r in unseen_) + ".")
    if partial:
        out.append(f"Reached {target:g} in only some repeats: "
                   + ", ".join(f"{names([r])}: {len(r.ttt)}/{len(r.runs)} reached"
                               + (f" (the others: {u})" if (u := unseen(r, target)) else "") for r in partial) + ".")
    if unscored:
        out.append(f"Not scored (no evaluation), so neither reached nor missed {target:g}: {names(unscored)}.")
    return out


def _against_base(best: Row, base: Row, base_t: float) -> str:
    """The fastest configuration's speed against the baseline's, with the checks its speed
    against sync gets: not stated from a baseline that lost repeats (its survivors' time),
    and said not told apart where the times are within two run-to-run sds (tie_reason)."""
    if base.errors:
        return f"not compared with the sequential baseline{base.failed_note}"
    why = tie_reason(best.ttt, base.ttt)
    return (f"{times(best.speedup(base))} the speed of the sequential baseline, which needed {secs(base_t)} s"
            + _tie_clause(why))


def _unordered(why: str) -> str:
    """How a sentence says that two values are not ordered, for tie_reason's `why`: "not told
    apart from" where the numbers tie them; "not ranked against" where each ran once (ONCE),
    which says nothing of how far apart they are."""
    return "not ranked against" if why == ONCE else "not told apart from"


def _tie_clause(why: str | None) -> str:
    """What a ratio's clause adds about its two values: ', not told apart from it: WHY' where
    the numbers tie them; '; ran once ...' (ONCE) where neither measured a spread, so that a
    36× ratio is not called a tie; '' where they rank."""
    if why == ONCE:
        return f"; {ONCE}"
    return f", not told apart from it: {why}" if why else ""


def _baseline_sooner(base: Row, base_t: float, best: Row, best_t: float, unplaced: list[Row],
                     period: float | None, others: list[Row] | None = None) -> list[str]:
    """Whether the baseline beat every distributed configuration, as far as the numbers
    carry it. An unranked configuration's time is an upper bound on when it got there (it
    was already above the target when first seen); one that lost repeats has its
    survivors' time: either at or below the baseline's and the claim is void; above it,
    the claim covers the resolved configurations only. A baseline that lost repeats has
    its survivors' time too: stated, not ranked; so is one that, like the best, ran once
    (ONCE: however far apart the two times, neither measured a spread). `others`: the
    other resolved configurations, slower than the best; one whose time the spread does
    not tell from the baseline's (a wide sd: 1.51 ± 1.36 s against 0.057 s, marked ≈ in
    the table) is named as such, not counted among those the baseline beat."""
    if any((mean(r.ttt) or 0.0) <= base_t for r in unplaced):
        return []
    if base.errors:
        return [f"The sequential baseline{base.failed_note} reached the target in {secs(base_t)} s in the "
                f"{len(base.runs)} that finished: not ranked against the distributed configurations."]
    why = tie_reason(base.ttt, best.ttt)
    if why == ONCE:   # no spread on either side: its time, not ranked (however far apart), as its samples/s
        return [f"The sequential baseline reached the target in {secs(base_t)} s ({ONCE})."]
    if why:
        return [f"The sequential baseline reached the target in {secs(base_t)} s, not told apart from "
                f"{names([best])}'s {secs(best_t)} s ({why})."]
    if period and best_t - base_t < period:
        return [f"The sequential baseline reached the target in {secs(base_t)} s, less than one evaluation "
                f"period ({period:g} s) before {names([best])}: within the measurement's resolution."]
    level = [(r, w) for r in others or [] if (w := tie_reason(base.ttt, r.ttt))]
    if level:
        beaten = [best] + [r for r in others or [] if r not in [x for x, _ in level]]
        return [f"The sequential baseline reached the target in {secs(base_t)} s, sooner than {names(beaten)}; "
                + "; ".join(f"{names(rs)} {'is' if len(rs) == 1 else 'are'} {_unordered(why)} it ({why})"
                            for why in dict.fromkeys(w for _, w in level)
                            for rs in [[r for r, w in level if w == why]])
                + (f"; {names(unplaced)} cannot be placed against it" if unplaced else "") + "."]
    if unplaced:
        return [f"The sequential baseline reached the target in {secs(base_t)} s, sooner than every distributed "
                f"configuration whose time is resolved; {names(unplaced)} cannot be placed against it."]
    return [f"The sequential baseline reached the target in {secs(base_t)} s, sooner than any distributed "
            f"configuration: on this job and machine no mode paid for its communication."]


def _not_told_apart(level: list[tuple[Row, str]], many_w: bool) -> str:
    """", but B (n) and C (m) are not told apart from it (why)": the rows whose throughput
    the spread cannot tell from the one just named, each with its own mean ("" for none)."""
    if not level:
        return ""
    parts = []
    for why in dict.fromkeys(why for _, why in level):
        rs = [r for r, w in level if w == why]
        parts.append(" and ".join(f"{rname(r, many_w)} ({amount(mean(r.sps))})" for r in rs)
                     + f" {'is' if len(rs) == 1 else 'are'} {_unordered(why)} it ({why})")
    return ", but " + "; ".join(parts)


def _throughput_sentences(dist: list[Row], base: Row | None, ctx: dict, many_w: bool) -> list[str]:
    out: list[str] = []
    by_sps = sorted([r for r in dist if r.sps], key=lambda r: mean(r.sps) or 0.0, reverse=True)
    if not by_sps:  # no distributed configuration has a measured throughput
        return out
    top, low = by_sps[0], by_sps[-1]
    top_sps = mean(top.sps) or 0.0
    flat = tie_reason(top.sps, low.sps, amount) if low is not top else None
    if flat not in (None, "equal", ONCE) and _some_pair_ranks([r.sps for r in by_sps], amount):
        # The two ends tie only through one end's wide repeats (ssp 1,000-7,000): two others,
        # 400 sds apart, were "not separated" too (a review). The highest is named, with its ties.
        flat = None
    if low is top:   # one configuration: nothing to be highest among
        out.append(f"Throughput: {rname(top, many_w)} {amount(top_sps)} samples/s.")
    elif flat == ONCE:   # the highest and the lowest each ran once: the values, in the rows' order, not ranked
        every = "" if unmeasured([r.sps for r in by_sps]) else "the highest and the lowest "
        out.append("Throughput: " + ", ".join(f"{rname(r, many_w)} {amount(mean(r.sps))}" for r in dist if r.sps)
                   + f" samples/s ({every}{ONCE}).")
    elif flat == "equal":
        out.append(f"Throughput does not separate the configurations: all at {amount(top_sps)} samples/s.")
    elif flat:
        out.append(f"Throughput does not separate the configurations: {amount(mean(low.sps))} to {amount(top_sps)} "
                   f"samples/s ({flat}).")
    else:
        s = f"Highest throughput: {rname(top, many_w)} with {amount(top_sps)} samples/s"
        ref = top.ref_sync
        ratio = top.throughput_ratio(ref)
        if ratio is not None and ref is not None and ref is not top:
            s += f" ({ratio:.2f}× {top.sync_name()}'s {amount(mean(ref.sps))})"
        level = [(r, why) for r in by_sps[1:] if (why := tie_reason(top.sps, r.sps, amount))]
        s += _not_told_apart(level, many_w)
        rest = [r for r in by_sps[1:] if r not in [x for x, _ in level]]
        # "lowest" only where the lowest is ranked below every other: no configuration that, like
        # it, ran once (ONCE) lies above it.
        # (nor where the lowest is not told apart from the highest: the sentence named it so already)
        if low is not top and low in rest and not any(tie_reason(low.sps, r.sps, amount) == ONCE for r in rest):
            # (one not told apart from the highest may not be told apart from the lowest either:
            # easgd 2,259 ± 352, sync 1,948 ± 936, async 1,282 ± 79 -- async is not below sync)
            near = [(r, why) for r in by_sps[1:] if r is not low and (why := tie_reason(low.sps, r.sps, amount))]
            s += f"; lowest: {rname(low, many_w)} with {amount(mean(low.sps))}" + _not_told_apart(near, many_w)
        out.append(s + ".")
    b = mean(base.sps) if base is not None else None
    if b and base is not None:
        why = tie_reason(base.sps, top.sps, amount)
        # "the best" only where the highest mean is told apart from every other: where the sentence
        # before said throughput does not separate them (or named ties), the highest mean and its ties
        ties = [(r, w) for r in by_sps[1:] if (w := tie_reason(top.sps, r.sps, amount))]
        # (one distributed configuration measured, as where the others failed: it is named, not "the best")
        best = rname(top, many_w) if low is top else "the best distributed configuration" if not ties else (
            f"the highest distributed mean ({rname(top, many_w)}'s {amount(top_sps)}, "
            + "; ".join(f"{_unordered(why)} {', '.join(rname(r, many_w) for r, w in ties if w == why)}"
                        for why in dict.fromkeys(w for _, w in ties)) + ")")
        if why == ONCE:
            out.append(f"The sequential baseline alone processed {amount(b)} samples/s ({ONCE}).")
        elif why:
            out.append(f"The sequential baseline alone processed {amount(b)} samples/s, not told apart from "
                       + (f"{best}'s {amount(top_sps)}" if low is top or not ties else best)
                       + f" ({why}).")
        elif b > top_sps and not top_sps:   # (runs that processed nothing: no ratio, and no cause to name)
            out.append(f"The sequential baseline alone processed {amount(b)} samples/s; {best} processed none.")
        elif b > top_sps:
            out.append(f"The sequential baseline alone processed {amount(b)} samples/s, {b / top_sps:.1f}× "
                       f"{best}: the per-step cost of the parameter-server round trips and "
                       f"of sharing {ctx.get('machine', {}).get('cpus', '?')} cores among the processes outweighs "
                       f"what the extra workers add.")
        else:
            out.append(f"{best[0].upper() + best[1:]} processed {top_sps / b:.2f}× the samples per second "
                       f"of the sequential baseline ({amount(b)}).")
    return out


def _some_pair_ranks(values: list[list[float]], fmt: Callable[[float], str] | None = None) -> bool:
    """Whether any two of these configurations' repeats are told apart (`tie_reason` None)."""
    return any(tie_reason(a, b, fmt) is None for a, b in itertools.combinations(values, 2))


def _accuracy_sentences(dist: list[Row], base: Row | None, many_w: bool) -> list[str]:
    out: list[str] = []
    accs = [(acc, r) for r in dist if (acc := mean(r.acc)) is not None]
    if not accs:
        return out
    hi, lo = max(accs, key=lambda t: t[0]), min(accs, key=lambda t: t[0])
    # the two ends' own repeats (as tie_reason): a third configuration's spread says nothing of them
    noise = max([sd(r.acc) or 0.0 for r in (hi[1], lo[1])] + [0.0])
    if len(accs) == 1:
        out.append((f"Only {rname(hi[1], many_w)} was scored: final accuracy" if len(dist) > 1 else
                    f"Final accuracy of {rname(hi[1], many_w)}:") + f" {hi[0]:.4f}.")
    elif hi[0] - lo[0] <= ACC_HARDLY:
        spread = f"all ended at {hi[0]:.4f}" if f"{hi[0]:.4f}" == f"{lo[0]:.4f}" else \
            f"all lie between {lo[0]:.4f} and {hi[0]:.4f}"
        out.append(f"Final accuracy hardly separates the configurations: {spread}.")
    elif hi[0] - lo[0] <= 2 * noise and not _some_pair_ranks([r.acc for _, r in accs]):
        # a wide range, but no wider than one end's own repeats, and no two configurations told apart
        noisy = max((hi[1], lo[1]), key=lambda r: sd(r.acc) or 0.0)
        out.append(f"Final accuracy ranged from {lo[0]:.4f} ({rname(lo[1], many_w)}) to {hi[0]:.4f} "
                   f"({rname(hi[1], many_w)}), which does not tell the configurations apart: it is within twice "
                   f"the run-to-run sd of the repeats of {rname(noisy, many_w)} ({noise:.4f}).")
    elif tie_reason(lo[1].acc, hi[1].acc) == ONCE:   # the extremes ran once: the values, in the rows' order
        every = "" if unmeasured([r.acc for _, r in accs]) else "the highest and the lowest "
        out.append("Final accuracy: " + ", ".join(f"{rname(r, many_w)} {a:.4f}" for a, r in accs)
                   + f" ({every}{ONCE}).")
    else:
        out.append(f"Final accuracy ranged from {lo[0]:.4f} ({rname(lo[1], many_w)}) to {hi[0]:.4f} "
                   f"({rname(hi[1], many_w)}).")
    ba = mean(base.acc) if base is not None else None
    if ba is not None and base is not None:
        out.append(f"The sequential baseline ended at {ba:.4f}; " + _against_baseline(accs, base, ba)
                   + _fewer_samples(accs, base) + ".")
    part = [r for _, r in accs if len(r.acc) < len(r.runs)]
    if part:   # (the others' final evaluation is missing: their means are of fewer runs than the rows say)
        out.append("Final accuracy of the repeats with a final score only: "
                   + ", ".join(f"{rname(r, many_w)} ({len(r.acc)} of {len(r.runs)})" for r in part) + ".")
    return out


def _fewer_samples(accs: list[tuple[float, Row]], base: Row) -> str:
    """' (the baseline trained on 19,200 samples; sync (1 w), async (1 w) on 9,600)'
    where some configurations trained on clearly fewer samples than the baseline (with
    `--workers 1,2` the baseline runs the largest count's samples), else ''."""
    b = mean(base.values("samples"))
    if not b:
        return ""
    fewer = [(r, n) for _, r in accs if (n := mean(r.values("samples"))) and n < 0.9 * b]
    if not fewer:
        return ""
    by_n: dict[str, list[Row]] = {}
    for r, n in fewer:
        by_n.setdefault(amount(n), []).append(r)
    return (f" (the baseline trained on {amount(b)} samples; "
            + "; ".join(f"{names(rs)} on {n}" for n, rs in by_n.items()) + ")")


def _against_baseline(accs: list[tuple[float, Row]], base: Row, ba: float) -> str:
    """Each distributed configuration's final accuracy against the baseline's: higher,
    lower, within ACC_HARDLY of it, not told apart from it (tie_reason), or, where neither ran
    more than once, not ranked against it (ONCE: no spread measured, however far apart)."""
    near: list[Row] = []
    higher: list[Row] = []
    lower: list[Row] = []
    level: list[tuple[Row, str]] = []
    for a, r in accs:
        why = tie_reason(r.acc, base.acc)
        if abs(a - ba) < ACC_HARDLY:
            near.append(r)
        elif why:
            level.append((r, why))
        else:
            (higher if a > ba else lower).append(r)
    parts = ([f"{names(higher)} ended higher"] if higher else []) + \
            ([f"{names(lower)} ended lower"] if lower else []) + \
            ([f"{names(near)} ended within {ACC_HARDLY:g} of it"] if near else []) + \
            [f"{names(rs)} {'is' if len(rs) == 1 else 'are'} {_unordered(why)} it ({why})"
             for why in dict.fromkeys(w for _, w in level) for rs in [[r for r, w in level if w == why]]]
    return "; ".join(parts)


def _failed_note(rows: list[Row]) -> list[str]:
    """Said first: the configurations none of whose runs finished, and that every sentence after
    leaves them out (listed only under "Failed runs", a reading of the others read as if they
    were all that ran: "Throughput: **sync** 13,024 samples/s"). Each with its first run's
    reason, up to the first "; "."""
    gone = [r for r in rows if not r.runs and r.failed]
    if not gone:
        return []

    def one(r: Row) -> str:
        who = f"**{r.name}**" + ("" if r.is_baseline else f" with {counted(r.workers, 'worker')}")
        reasons = list(dict.fromkeys(clip((str(e).splitlines() or [""])[0].split("; ")[0], 100) for e in r.errors))
        runs = "its run" if r.n == 1 else f"all {r.n} of its runs" + ("" if len(reasons) < 2 else ", the first")
        return f"{who} ({runs}: {reasons[0] if reasons else 'failed'})"
    it = "it is" if len(gone) == 1 else "they are"
    return [f"Failed, no run finished: {'; '.join(one(r) for r in gone)}; {it} left out of everything below "
            f"(see Failed runs)."]


def _lost_note(rows: list[Row]) -> list[str]:
    """Said first too: the configurations with a run that went on without some of its
    workers (one died and was not replaced: summary.json's failures.workers_gone), whose
    figures below are the workers left's. Only the detail table's "workers lost" column
    said so, and the reading ranked such a run's throughput as a whole job's."""
    hit = [(r, gone) for r in rows if (gone := [x for x in r.runs if lost_words(x)])]
    if not hit:
        return []

    def one(r: Row, gone: list[dict]) -> str:
        who = f"**{r.name}**" + ("" if r.is_baseline else f" with {counted(r.workers, 'worker')}")
        runs = "its run" if len(r.runs) == 1 else f"{len(gone)} of its {len(r.runs)} runs"
        return f"{who} ({runs}: {lost_words(gone[0])}{', the first' if len(gone) > 1 else ''})"
    return [f"Went on without workers that died: {'; '.join(one(r, g) for r, g in hit)}. The figures below are "
            f"those of the workers left; the runs' logs say why they died."]


def _repeat_note(rows: list[Row]) -> list[str]:
    """Said once: which configurations ran a single time, so that no spread was measured
    and their orderings are not checked against run-to-run noise."""
    once = [r for r in rows if len(r.runs) == 1]
    if not once:
        return []
    if len(once) == len(rows):
        head = ("Every configuration ran once: no run-to-run spread was measured, so the values below are stated "
                "but not ranked against each other")
        fixed = fixed_timing(rows)
        if fixed is None:
            return [head + " (two runs of one configuration can differ by more than configurations do); use "
                    "--repeats 3 or more to rank them."]
        if not fixed:   # timing only: nothing the seed changes reaches the clock
            return [head + ". The simulated timing draws nothing at random in these runs (sim.compute_cv = 0, no "
                    "faults.jitter) and they train nothing (sim.train = false), so a repeat with another seed is "
                    "expected to give the same throughput, waiting and staleness; --repeats 2 or more measures "
                    "that spread and lets the report rank them."]
        return [head + ". The simulated timing draws nothing at random in these runs (sim.compute_cv = 0, no "
                "faults.jitter), but another seed changes the data order and the model's initialisation, so "
                "accuracy and time to target can differ between two runs of one configuration by more than "
                "between configurations, and throughput, waiting and staleness change where that changes what "
                "the runs do (refused steps, for instance); use --repeats 3 or more to rank them."]
    it, they = ("it", "it is") if len(once) == 1 else ("them", "they are")
    return [f"{names(once)}: a single successful run, so no run-to-run spread was measured for {it}: {they} "
            f"ranked only against configurations whose repeats measured one, "
            f"by that spread" + (", and not against each other" if len(once) > 1 else "") + "."]


def fixed_timing(rows: list[Row]) -> bool | None:
    """Whether the clock of every run of `rows` is free of chance: each a simulated run whose
    summary records sim.compute_cv = 0 (no lognormal spread of the compute) and faults
    without jitter (the only random draws of psgd.sim's timing). None where any run is real,
    or its summary does not record them; else True where the runs trained (sim.train: the
    seed still changes the data order and initialisation, hence accuracy), False where they
    are timing only."""
    runs = [x for r in rows for x in r.runs]
    if not runs:
        return None
    for x in runs:
        sim, f = x.get("sim"), x.get("faults")
        if not x.get("simulated") or not isinstance(sim, dict) or not isinstance(f, dict) \
                or sim.get("compute_cv") is None or "train" not in sim:
            return None
        if float(sim["compute_cv"]) > 0 or (float(f.get("jitter_prob") or 0) > 0 and float(f.get("jitter_s") or 0) > 0):
            return None
    return any(bool(x["sim"]["train"]) for x in runs)


def _wait_sentences(dist: list[Row], many_w: bool) -> list[str]:
    """The most and the least waiting, compared within one worker count (across counts a
    64-worker row was set against an 8-worker one: waiting grows with the workers)."""
    if many_w:
        return [f"With {w} worker{'s' * (w != 1)}, " + s[0].lower() + s[1:] for w in sorted({r.workers for r in dist})
                for s in _wait_sentences([r for r in dist if r.workers == w], False)]
    waits = [(w, r) for r in dist if (w := mean(r.values("wait_fraction"))) is not None]
    if len(waits) < 2:
        return []
    hi, lo = max(waits, key=lambda t: t[0]), min(waits, key=lambda t: t[0])
    if hi[0] - lo[0] < 0.05:
        return []
    note = noise_note([hi[1].values("wait_fraction"), lo[1].values("wait_fraction")], lambda x: f"{100 * x:.0f}%")
    # (a few rows: those between too, from most to least; ssp between sync and async was left out)
    between = sorted((t for t in waits if t is not hi and t is not lo), key=lambda t: -t[0]) \
        if len(waits) <= MAX_LISTED_WAITS else []
    return [f"Workers of {rname(hi[1], many_w)} spent {100 * hi[0]:.0f}% of their time blocked on the servers, "
            + "".join(f"those of {rname(r, many_w)} {100 * w:.0f}%, " for w, r in between)
            + f"those of {rname(lo[1], many_w)} {100 * lo[0]:.0f}%{note}."]


MAX_LISTED_WAITS = 6   # rows whose waits one sentence lists; past it, the most and the least


def _cpu_wait_sentences(group: list[Row], bases: list[Row], ctx: dict, many_w: bool) -> list[str]:
    """How long the training threads waited for a CPU (summary.json's cpu_wait_fraction, the
    mean over the repeats that counted it), where any configuration's, or a baseline's
    (`bases`: those of the group's kind), reaches CPU_WAIT_SAID as written: the times and
    throughputs of those runs are the machine's, processes sharing its cores (the job's own
    on too few cores, or other programs), and would differ with a core each, not by one
    factor for all. Listed per worker count, as the waits are; past MAX_LISTED_WAITS rows
    of one count, their range without names (naming a most and a least would rank rows
    whose spread may not separate them). No guard on a run's length, as `psgd run`'s
    warning has: that warning names a cause (other programs), which a short job's few
    preemptions could seem to show; this sentence names none, only the sharing.
    Nothing for runs without the count (psgd simulate's virtual clock, a kernel without
    it, a compare.json from before it)."""
    shares = [(w, r) for r in group + bases if (w := mean(r.values("cpu_wait_fraction"))) is not None]
    if not any(cpu_wait_said(w) for w, _ in shares):
        return []

    def listed(rows: list[tuple[float, Row]]) -> str:
        if len(rows) > MAX_LISTED_WAITS:
            ws = [w for w, _ in rows]
            return f"{100 * min(ws):.0f}% to {100 * max(ws):.0f}% across {len(rows)} configurations"
        return ", ".join(f"{100 * w:.0f}% in {rname(r, False)}{cpu_wait_counted(r)}" for w, r in rows)
    dist = [(w, r) for w, r in shares if not r.is_baseline]
    parts = [(f"with {counted(n, 'worker')}, " if many_w else "") + listed([t for t in dist if t[1].workers == n])
             for n in sorted({r.workers for _, r in dist})]
    base = [t for t in shares if t[1].is_baseline]
    parts += [listed(base)] if base else []
    cpus = (ctx.get("machine") or {}).get("cpus")
    where = (f"these processes sharing the machine's {cpus} cores" if isinstance(cpus, int) and cpus > 1
             and len(ctx.get("merged_from") or []) <= 1 else "processes sharing the machine's cores")
    return [f"The training threads waited for a CPU for part of the time they could run (cpu_wait_fraction, "
            f"the mean over repeats): {'; '.join(parts)}. Where that share is {100 * CPU_WAIT_SAID:.0f}% or more, "
            f"the times and samples/s are those of {where}: with a core for each process they would differ, "
            f"and not necessarily by the same factor for every configuration."]


def _bounded_waits(group: list[Row], ref: Row, many_w: bool) -> str:
    """Under an injected fault, why an ssp row beside `ref` (sync, the same workers) waited
    less: its bound. Said only where the difference is established: repeats of both whose
    spread separates them, and waits that differ as written (a run each cannot tell it from
    noise; "41% against sync's 41%" was said of two runs that could not)."""
    sync_wait = mean(ref.values("wait_fraction"))
    said = ""
    for r in group:
        w = mean(r.values("wait_fraction"))
        if (r.mode != "ssp" or r.workers != ref.workers or r.bound is None or r.bound < 1 or w is None
                or sync_wait is None):   # (s = 0 is lockstep: no lead to explain a shorter wait)
            continue
        series = [r.values("wait_fraction"), ref.values("wait_fraction")]
        if (w < sync_wait and all(sd(v) is not None for v in series) and f"{100 * w:.0f}" != f"{100 * sync_wait:.0f}"
                and not noise_note(series, lambda x: f"{100 * x:.0f}%")):
            said += (f" Workers of {rname(r, many_w)} waited {100 * w:.0f}% of the time against "
                     f"{ref.sync_name() if ref is r.ref_sync else ref.name}'s {100 * sync_wait:.0f}%: the bound lets a "
                     f"worker run up to {r.bound} clock{'s' * (r.bound != 1)} ahead of the slowest, so a delayed "
                     f"worker holds the others back only once its delay outlasts that lead.")
    return said


def _refused_sentences(dist: list[Row], many_w: bool) -> list[str]:
    """The configurations whose workers had steps refused (summary `rejected`: a shard refused
    the push, as a NaN or Inf gradient, or the worker's own loss diverged): those steps
    changed no model, yet their batches count in samples and samples/s."""
    hit = [(r, [int(x.get("rejected") or 0) for x in r.runs]) for r in dist]
    hit = [(r, ks) for r, ks in hit if any(ks)]
    if not hit:
        return []
    each = "; ".join(f"{rname(r, many_w)}: {sum(ks):,}" + (f" in {sum(1 for k in ks if k)} of its {len(ks)} "
                                                           f"finished runs" if len(ks) > 1 else "") for r, ks in hit)
    return [f"Refused steps (a shard refused the push, e.g. a NaN or Inf gradient, or the worker's loss diverged): "
            f"{each}. They changed no model, but their batches count in samples and samples/s, so "
            f"{'that throughput overstates' if len(hit) == 1 else 'those throughputs overstate'} the training done."]


def _kinds(dist: list[Row]) -> list[tuple[str, list[Row]]]:
    """[(sentence prefix, rows)]: real and simulated rows apart when a report has both, so
    that no sentence ranks a virtual second against a real one."""
    real = [r for r in dist if not r.simulated]
    sim = [r for r in dist if r.simulated]
    if not real or not sim:
        return [("", dist)]
    return [("Real runs: ", real), ("Simulated runs (virtual seconds): ", sim)]


def _group_base(group: list[Row]) -> Row | None:
    """The baseline every row of `group` is compared with (Row.ref_base), if they share one."""
    bases = {id(r.ref_base): r.ref_base for r in group}
    return next(iter(bases.values())) if len(bases) == 1 else None


def reading(rows: list[Row], ctx: dict) -> list[str]:
    """Sentences about the trade-off, each computed from the rows."""
    target = float(ctx.get("target_accuracy", 0.9))
    period = eval_period([run for r in rows for run in r.runs], ctx)
    ok = [r for r in rows if r.runs]
    dist = [r for r in ok if not r.is_baseline]
    many_w = len({r.workers for r in dist}) > 1
    out = _failed_note(rows) + _lost_note(ok)
    if not dist:
        return out + ["No distributed run finished, so there is nothing to compare."]
    out += _repeat_note(ok)
    for prefix, group in _kinds(dist):
        base = _group_base(group)
        said: list[str] = []
        if any(r.acc for r in group) or any(r.ttt for r in group):
            said += _time_sentences(group, base, target, period, many_w)
        else:  # timing only (psgd simulate with sim.train = false), or no evaluator: nothing to rank by accuracy
            said.append("No run was scored (no evaluator, or a timing-only simulation): throughput, waiting and "
                        "staleness only.")
        said += _throughput_sentences(group, base, ctx, many_w)
        said += _accuracy_sentences(group, base, many_w)
        said += staleness_sentences(group, period, many_w)
        said += _wait_sentences(group, many_w)
        said += _cpu_wait_sentences(group, [r for r in ok if r.is_baseline and r.simulated == group[0].simulated],
                                    ctx, many_w)
        said += _refused_sentences(group, many_w)
        out += [prefix + s for s in said]

    f = ctx.get("faults") or {}
    faults = describe_faults(f, ctx.get("workers") or [], any(r.is_baseline for r in ok))
    if faults:
        # A row whose mode item sets faults.* ran its own (stated with the rows): not "under it".
        own = [r for r in dist if item_faults(r)]
        group = [r for r in _kinds(dist)[0][1] if _all_faults_apply(f, r.workers) and r not in own]
        top = max(group, key=lambda r: mean(r.sps) or 0.0) if group else None
        ref = top.ref_sync if top else None   # the sync row with the same worker count
        hit = [_faulted({**f, **item_faults(r)}, r.workers) for r in dist]
        s = (f"{'All runs' if all(hit) else 'Some runs' if any(hit) else 'No run'} had a fault injected: {faults}"
             + (f"; except in {names(own)}, whose mode item sets faults.* of its own (stated above the tables)"
                if own else "") + ".")
        if top is not None and ref is not None and ref not in own and top.mode != "sync" and mean(ref.sps):
            # (no run without the fault is in the comparison: "kept" said more than it measured; and a
            # difference within the runs' spread is said so, as the throughput sentence says it)
            why = tie_reason(top.sps, ref.sps, amount)
            s += (f" Under it, {rname(top, many_w)} ran at {amount(mean(top.sps))} samples/s against "
                  f"{top.sync_name()}'s {amount(mean(ref.sps))} with {ref.workers} workers"
                  + (f" ({ONCE})" if why == ONCE else f" (not told apart: {why})" if why else "") + ".")
        # (the bound's lead explains a shorter wait only where some worker is delayed more than
        # the others: a straggler or transient ones; a delay of every step slows all alike)
        uneven = _straggler(f) is not None or (float(f.get("jitter_prob", 0.0)) > 0
                                               and float(f.get("jitter_s", 0.0)) > 0)
        if ref is not None and ref not in own and uneven:
            s += _bounded_waits(group, ref, many_w)
        out.append(s)

    # (every distributed row: a swept value whose runs all failed is named, not dropped)
    out += sweep_sentences([r for r in rows if not r.is_baseline], period, target,
                           float((ctx.get("job") or {}).get("seconds") or 0.0),
                           lambda r: _faulted({**f, **item_faults(r)}, r.workers))
    return out
