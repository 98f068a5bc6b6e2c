"""The report of `psgd compare`: DIR/report.md and the PNG plots, from the run summaries.

    python -m psgd.report DIR     # rebuild DIR/report.md and the plots from DIR/compare.json

`python -m psgd.report OUT DIR1 DIR2 ...` merges folders; it refuses (one line, exit 2) a
folder given twice, an OUT that is one of the DIRs (its compare.json would be overwritten),
an OUT that holds a compare's or simulate's own runs (not an earlier merge's: `python -m
psgd.report A B` would have replaced A's runs with B's),
folders whose times are to different targets (eval.target_accuracy), and a compare.json
or compare-context.json that psgd did not write. A compare.json of no
run (`[]`, a compare interrupted before its first run ended) gives a report saying so, and
a context that says the command was interrupted (`interrupted`, `not_run`) is said first.

One row per configuration (label x worker count), repeats folded into mean ± sd;
speedups are ratios of mean time to target (reference time / this time: > 1 is faster)
against the `sync` row with the same worker count, kind (real or simulated) and settings
(a sync row with settings of its own, which would be its own reference: the plain
`sync`, else the first value of its sweep, named under the table), and against the
sequential baseline (real rows only: a virtual second is not a real one). The "reading"
paragraph is generated from these numbers, and the section after it gives each
configuration as the `psgd run` that trains it (`run_commands`). This module assembles
report.md; the parts live in psgd.report_numbers (rows, statistics), psgd.report_tables
(markdown tables), psgd.report_reading and psgd.report_relations (the sentences) and
psgd.report_plots (matplotlib; without it the report is written without plots). Their
public names are importable from here as before.
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable

from .config import config_key, format_value, is_number
from .metrics import write_text_atomic
from .report_numbers import (
    SIM_SUFFIX,
    Row,
    amount,
    build_rows,
    counted,
    eval_period,
    eval_periods,
    mean,
    sd,
    spearman,
    sweeps,
    trend,
    worker_batches,
    worker_sweeps,
)
from .report_plots import PLOT_DPI, make_plots, plt_or_none
from .report_reading import describe_faults, item_faults, reading
from .report_relations import sweep_sentences
from .report_tables import clip, detail_table, main_table

__all__ = ["PLOT_DPI", "Row", "build_rows", "describe_faults", "detail_table", "eval_period", "main",
           "main_table", "make_plots", "mean", "reading", "render", "run_commands", "sd", "spearman",
           "sweep_sentences", "sweeps", "trend", "worker_sweeps", "write_report"]


def _budget(job: dict, varies: list[str]) -> str:
    if "steps" in varies or "seconds" in varies:
        return "per folder (below)"
    return ((f"{job.get('steps')} steps per worker" if job.get("steps") else "") +
            (f"{', ' if job.get('steps') else ''}{job.get('seconds'):g} s per worker" if job.get("seconds") else ""))


def _capped_largest(rows: list[Row], largest, job: dict) -> str:
    """Where the largest run's workers held batches smaller than train.batch_size (their
    shares of the training set), the samples that run processed: fewer than the baseline's,
    whose one process holds the whole set. '' otherwise."""
    batch, seconds = job.get("batch_size"), float(job.get("seconds") or 0.0)
    big = [r for r in rows if not r.is_baseline and not r.simulated and r.workers == largest
           and (held := worker_batches(r, seconds)) and batch and max(held) < batch]
    if not big:
        return ""
    lo, hi = (amount(f(x for r in big for x in worker_batches(r, seconds))) for f in (min, max))
    samples = max(mean(r.values("samples")) or 0.0 for r in big)
    return (f", though its workers' batches were their shares of the training set ({lo}{'' if hi == lo else f'-{hi}'} "
            f"samples a step, not {batch}): it processed {amount(samples)} samples")


def _runs_phrase(ctx: dict, n_runs: int, sim: bool) -> str:
    """How the runs were scheduled, as far as the context knows: a compare runs them one
    after another; a simulation may run several at once (--jobs), each on its own clock;
    a merged report holds runs of several commands."""
    runs = counted(n_runs, "run")
    if len(ctx.get("merged_from") or []) > 1:
        return f"{runs} from {len(ctx['merged_from'])} folders"
    if sim:
        return f"{runs}, each on its own virtual clock" if n_runs != 1 else f"{runs}, on a virtual clock"
    return f"{runs}, one after another" if n_runs != 1 else runs


def interruption(ctx: dict) -> list[str] | None:
    """The labels of the planned runs that did not finish (the one it stopped, and those it
    never started) when the command that wrote `ctx` was interrupted or ended before
    running them all (psgd compare writes `interrupted`
    and `not_run` into compare-context.json then), else None."""
    not_run = ctx.get("not_run") or []
    if not ctx.get("interrupted") and not not_run:
        return None
    return [str(x) for x in not_run] if isinstance(not_run, list) else []


def _labels(labels: list[str]) -> str:
    """'sync ×2; async, 2 workers, repeat 1': the runs' names or descriptions (which hold
    commas), one that recurs counted, in the plan's order."""
    counts = {x: labels.count(x) for x in labels}
    return "; ".join(f"{x} ×{n}" if n > 1 else x for x, n in counts.items())


def interrupted_lines(ctx: dict, n_runs: int) -> list[str]:
    """What report.md says first about runs that never ran: per folder for a merged report
    (merge's `interruptions`), else from this command's context; [] when every run ran."""
    stops = ctx.get("interruptions")
    if stops is None:
        not_run = interruption(ctx)
        stops = [] if not_run is None else [{"folder": None, "not_run": not_run, "ran": n_runs}]
    many = len(ctx.get("merged_from") or []) > 1
    out = []
    for stop in stops:
        where = f"folder {stop['folder']}: " if many and stop.get("folder") else ""
        missing = list(stop.get("not_run") or [])
        planned = int(stop.get("ran", 0)) + len(missing)
        if missing:
            out.append(f"**Interrupted:** {where}{len(missing)} of {planned} planned runs did not finish: "
                       f"{_labels(missing)}. This report covers the {planned - len(missing)} that did.")
        else:
            out.append(f"**Interrupted:** {where}the command was interrupted before it ended normally.")
    return out + [""] if out else []


def render(rows: list[Row], ctx: dict, plots: list[tuple[str, str]]) -> str:
    target = float(ctx.get("target_accuracy", 0.9))
    job = ctx.get("job") or {}
    varies = list(ctx.get("job_varies") or [])
    m = ctx.get("machine") or {}
    workers = ctx.get("workers") or sorted({r.workers for r in rows if not r.is_baseline})
    n_runs = sum(r.n for r in rows)
    sim = ctx.get("simulated")
    mixed = not sim and any(r.simulated for r in rows) and any(not r.simulated for r in rows if r.runs)
    lines = ["# psgd simulate" if sim else "# psgd compare", ""]
    if ctx.get("command"):
        lines += ["```", ctx["command"], "```", ""]
    lines += interrupted_lines(ctx, n_runs)
    opt = job.get("optimizer") or {}
    budget = _budget(job, varies)

    def val(x, key):
        return "varies (below)" if key in varies else x.get(key, "?")

    # Optimizer keys a mode item sets (sync:optimizer.lr=0.01,0.05): those rows' own, not the
    # job's optimizer stated here, which the sequential baseline ran with.
    own_opt = sorted({k for r in rows if not r.is_baseline for k in (r.params or {}) if k.startswith("optimizer.")})
    own_said = (f"; {' and '.join(own_opt)} as the configuration's name sets it, where it does"
                if own_opt else "")
    lines.append(f"Model **{val(job, 'model')}** on **{val(job, 'data')}**, batch {val(job, 'batch_size')} "
                 f"per worker (at most its share of the training set), budget {budget or '?'}, optimizer "
                 + (f"{opt.get('name', '?')} (lr {opt.get('lr', '?')}, momentum {opt.get('momentum', '?')}"
                    f"{own_said})"
                    if "optimizer" not in varies else "varies (below)")
                 + f", {ctx.get('servers', '?')} shard"
                 f"{'s' if ctx.get('servers') != 1 else ''}, {', '.join(map(str, workers))} worker"
                 f"{'s' if workers != [1] else ''}; seeds {', '.join(map(str, ctx.get('seeds') or []))} "
                 f"(repeat r uses job.seed + r for every configuration); {_runs_phrase(ctx, n_runs, bool(sim))}.")
    lines.append("")
    real = sorted({r.workers for r in rows if not r.is_baseline and not r.simulated}) if mixed else workers
    many = " or ".join(map(str, real))
    lines.append(f"Machine: {m.get('cpus', '?')} CPU cores, device {machine_device(m)}, torch {m.get('torch', '?')}."
                 + (f" Each distributed{' real' if mixed else ''} run starts its {many} "
                    f"worker{'s' if real != [1] else ''}, "
                    f"{ctx.get('servers', '?')} shards, a coordinator and an evaluator on these {m.get('cpus')} cores."
                    if isinstance(m.get("cpus"), int) and isinstance(ctx.get("servers"), int) and not sim else ""))
    lines.append("")
    if sim:
        lines += [simulated_note(sim, rows, describe_faults(ctx.get("faults") or {}, workers) is not None
                                 or bool(item_fault_lines(rows, ctx.get("faults") or {}, False))), ""]
    elif mixed:
        lines += [f"**Simulated and real runs side by side:** rows marked{SIM_SUFFIX} are `psgd simulate` runs "
                  f"of the same configuration, on a virtual clock (their times are virtual seconds); the others "
                  f"ran for real. {simulated_rows_cost(rows)}", ""]
    for warning in ctx.get("warnings") or []:   # what the command warned of (psgd compare's, simulate's)
        lines += [f"**Warning:** {warning}", ""]
    sets, env = ctx.get("sets") or [], ctx.get("env_sets") or []
    setups = ctx.get("setups") or []
    said = []
    if sets or env:   # (the environment's PSGD_* settings: bytes halved by PSGD_WIRE_DTYPE went unexplained)
        said.append("**Applied to every run:** " + " and ".join(
            ([f"`{' '.join('--set ' + s for s in sets)}`"] if sets else [])
            + ([f"from the environment (PSGD_*) `{' '.join(env)}`"] if env else [])) + ".")
    for s in setups:
        tag = f" (rows marked [{s['tag']}])" if s.get("tag") else ""
        cmd = f"`{s['command']}`" if s.get("command") else "no compare-context.json"
        only = f"; its runs also had `{' '.join('--set ' + x for x in s['sets'])}` (not every merged folder's did)"
        said.append(f"**Folder {s['folder']}**{tag}: {cmd}" + (only if s.get("sets") else "") + ".")
    # (a fault set in the config file or the environment, with no --set, is stated too)
    faults = describe_faults(ctx.get("faults") or {}, workers, any(r.is_baseline and r.runs for r in rows))
    if faults:
        said.append(f"**Injected fault:** {faults}.")
    said += item_fault_lines(rows, ctx.get("faults") or {}, bool(faults))
    if said:
        lines += [*said, ""]
    b = ctx.get("baseline")
    if b:
        if "steps" in varies or "seconds" in varies or ctx.get("baseline_budgets_differ"):
            budget = "the budget of the largest run of its own folder (its row says its steps where they differ)"
        elif b.get("steps"):
            steps = job.get("steps")   # its folder's largest run: the baseline's steps over each worker's
            largest = b["steps"] // steps if steps and not b["steps"] % steps else max(workers) if workers else "?"
            budget = (f"{b.get('steps')} steps = {b.get('samples'):,} samples, the budget of the largest run "
                      f"({largest} workers × {steps} steps)"
                      + (f", or {job.get('seconds'):g} s, whichever comes first" if job.get("seconds") else "")
                      + _capped_largest(rows, largest, job))
        else:
            budget = f"{job.get('seconds'):g} s of training, each worker's time budget"
        same = ("same model, data and batch size, and the optimizer above without a configuration's own "
                f"{' or '.join(own_opt)}" if own_opt and "optimizer" not in varies
                else "same model, data, optimizer and batch size")
        lines.append(f"Baseline: one process, plain PyTorch loop (no servers), {same}; {budget}; "
                     f"{b.get('threads', 1)} compute thread like each worker; its clock stops while it is scored.")
        lines.append("")
    period = eval_period([run for r in rows for run in r.runs], ctx)
    periods = eval_periods([run for r in rows for run in r.runs])
    every = (f"{'?' if period is None else f'{period:g}'} s by the evaluator, so their times are rounded up to "
             f"that period" if len(periods) < 2 else
             f"{' or '.join(f'{p:g}' for p in periods)} s by the evaluator (by configuration), so their times are "
             f"rounded up to their period, and two are told apart only beyond the coarsest, {period:g} s")
    clock = "virtual" if sim else "wall (virtual for the rows marked (simulated))" if mixed else "wall"
    timing_only = sim is not None and sim.get("train") is False
    distributed = [r for r in rows if not r.is_baseline and r.runs]   # (failed runs were not scored for want of one)
    unscored = bool(distributed) and not any(r.scored for r in distributed)
    lines.append("Time to target: none; these runs are timing only (sim.train = false): no gradients, no scores. "
                 if timing_only else
                 "Time to target: none; no distributed run was scored (no evaluator: cluster.evaluator = false; "
                 "or none of its scores came). " if unscored else
                 f"Time to target: {clock} time from the start of training until the global model first scored "
                 f"≥ {target:g} on the test set; distributed runs are scored every {every}. Speedup = reference "
                 f"time to target / this time (> 1: faster). ")
    lines[-1] += ("Measured staleness = updates applied between a worker's read and its push (easgd: moves of the "
                  "center between two of a worker's exchanges, each another worker's exchange of tau local steps: "
                  "another unit, so its numbers are not comparable with the other modes'; ltfb: none recorded, "
                  "—). It is not ssp's bound s, which limits "
                  "how many clocks a worker may run ahead of the slowest: even with s = 0 the other workers' pushes "
                  "of the same clock land between a read and a push.")
    lines.append("")
    lines.append("## Results")
    lines.append("")
    if rows:
        lines += main_table(rows, target, period)
        detail = detail_table(rows)
        lines += [""] + detail if detail else []
    else:   # compare.json is [] (a compare interrupted before its first run ended)
        lines.append("No run finished: compare.json lists no run, so there is nothing to tabulate.")
    lines.append("")
    lines.append("## Reading")
    lines.append("")
    lines += [f"- {s}" for s in reading(rows, ctx)]
    lines.append("")
    lines += run_commands(rows, ctx)
    failed = [(r, e) for r in rows for e in r.failed]
    if failed:
        lines.append("## Failed runs")
        lines.append("")
        for r, e in failed:   # each run told apart (its repeat), and where its logs are
            lines.append(f"- {failed_run(r, e)}: {clip(str(e['error']).splitlines()[0], 300)}")
        lines.append("")
    if plots:
        lines.append("## Plots")
        lines.append("")
        for title, name in plots:
            lines += [f"### {title}", "", f"![{title}]({name})", ""]
    elif plt_or_none() is None:
        lines += ["(No plots: matplotlib is not installed; `pip install 'psgd[plots]'`.)", ""]
    return "\n".join(lines)


def run_commands(rows: list[Row], ctx: dict) -> list[str]:
    """The section that gives each configuration of a comparison as a `psgd run` of its
    own (README: measure, "then train with the winner"): the comparison's config file,
    shards, PSGD_* settings, `--set` and device, and the configuration's mode, workers and
    item keys, as `compare.build_plan` built its runs (the seed is its first repeat's), but
    for the folder of its own that each run had inside a `checkpoint.dir` (a job run again
    from there would resume or replace the comparison's), and the comparison's --timeout
    (a short run's limit would stop a longer job). None for psgd simulate's rows or merged
    folders (each folder's runs had a command of their own)."""
    configs = [r for r in rows if not r.is_baseline and not r.simulated]
    if ctx.get("simulated") or ctx.get("setups") or not configs:
        return []
    config = [ctx["config"]] if ctx.get("config") else []
    shared = ["--servers", str(ctx["servers"])] if isinstance(ctx.get("servers"), int) else []
    for s in [*(ctx.get("env_sets") or []), *(ctx.get("sets") or [])]:   # (--set beats the environment)
        shared += ["--set", s]
    device = (ctx.get("machine") or {}).get("device")
    if device and device != "auto":
        shared += ["--device", device]
    longer = _longer_job(configs, ctx.get("job") or {})
    lines = ["## Training with a configuration", "",
             "Each configuration as a job of its own, with this comparison's settings (its config file, "
             "`--servers`, `--set` and `--device`, and the `PSGD_*` settings of its environment as `--set`): "
             "`psgd run` trains it with its first repeat's seed. A job stops at whichever of `train.steps` and "
             f"`train.seconds` it reaches first: for a longer one, {longer}. Where `checkpoint.dir` is set, these "
             "jobs share it (each run of the comparison had a folder of its own inside it).", ""]
    for r in configs:
        keys = [x for k, v in (r.params or {}).items() for x in ("--set", f"{config_key(k)}={format_value(v)}")]
        command = ["psgd", "run", *config, "--mode", r.mode, "--workers", str(r.workers), *shared, *keys]
        lines.append(f"- {r.name}, {counted(r.workers, 'worker')}: `{shlex.join(command)}`")
    return lines + [""]


def _longer_job(rows: list[Row], job: dict) -> str:
    """How to make a job longer than the comparison's runs: raise the budget that ended
    them (a longer train.steps does nothing where train.seconds ended them first). With
    both set, the runs' wall times tell which (each within 10 % of train.seconds: the
    time), else both are named."""
    steps = "`--set train.steps=N`"
    seconds = "`--set train.seconds=S`"
    limit = float(job.get("seconds") or 0.0)
    if not limit:
        return f"add {steps} at the end (or `--set train.steps=0 --set train.seconds=S`)"
    by_time = f"add {seconds} at the end (or `--set train.seconds=0 --set train.steps=N`)"
    if not job.get("steps"):
        return by_time
    walls = [w for r in rows for w in r.values("wall_s")]
    timed = [w >= 0.9 * limit for w in walls]
    if walls and all(timed):
        return by_time
    if walls and not any(timed):
        return f"add {steps} at the end (its runs ended at their steps, before train.seconds)"
    return f"raise the one that ends it: {steps} or {seconds} at the end"


def item_fault_lines(rows: list[Row], common: dict, stated: bool) -> list[str]:
    """A line per configuration whose mode item sets faults.* keys (`sync:faults.step_delay_s=0.1`):
    all the faults its runs had, the item's values in place of `common`'s (the faults of every
    run, from --set or the config, stated before when `stated`). The baseline runs none of an
    item's."""
    out, seen = [], set()
    for r in rows:
        own = item_faults(r)
        if r.is_baseline or not own or r.label in seen:
            continue
        seen.add(r.label)
        desc = describe_faults({**common, **own}, sorted({x.workers for x in rows if x.label == r.label}), False)
        if desc:
            out.append(f"**Injected fault in {r.name}:** {desc}" + (" (its item's faults.* in place of those of "
                                                                    "every run)." if stated else "."))
        else:
            sets = " ".join(f"faults.{k}={v}" for k, v in own.items())
            out.append(f"**No injected fault in {r.name}:** its item sets {sets}"
                       + (", in place of those of every run." if stated else "."))
    return out


def failed_run(r: Row, e: dict) -> str:
    """Which run of row `r` the failed entry `e` is: 'sync (2 workers), repeat 1, runs/sync-w2-r1'."""
    who = r.name if r.is_baseline else f"{r.name} ({counted(r.workers, 'worker')})"
    return who + "".join(f", {x}" for x in (f"repeat {e['repeat']}" if e.get("repeat") is not None else "",
                                             # (a simulated run that failed leaves no folder: no logs to name)
                                             f"`{e['dir']}`" if e.get("dir") and not e.get("simulated") else "")
                         if x)


def machine_device(m: dict) -> str:
    """The device the runs used, as compare-context.json's `machine` records it: `--device
    auto` is a GPU for each worker where there is CUDA, else the CPU (psgd/replica.py
    pick_device)."""
    device, cuda = m.get("device", "?"), m.get("cuda")
    if device == "auto":
        return f"{'cuda' if cuda else 'cpu'} (--device auto{'' if cuda else ': no CUDA here'})"
    return f"{device} ({'CUDA available' if cuda else 'no CUDA'})"


def _keys(differs: list[str]) -> list[str]:
    """The config keys of a cost model's fields (a calibrated compute time is sim.compute_s's)."""
    return list(dict.fromkeys("sim." + k.replace("calibrated_", "") for k in differs))


def _compute(sim: dict) -> str:
    cal = sim.get("calibrated_compute_s") or {}
    return compute_words(sim.get("compute_s"), ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in cal.items()))


def compute_words(fixed: float | None, calibrated: str = "") -> str:
    """A simulation's compute time per step: `fixed` (sim.compute_s), or else what was
    calibrated (its value(s), as written)."""
    if fixed:
        return f"{fixed:g} s per step (sim.compute_s)"
    return f"calibrated on this machine by timing the model's forward and backward on one thread: {calibrated}"


# A simulated run's cost model in its summary's `sim` (the keys that make one; `events` is a count).
COST_KEYS = ("compute_s", "compute_s_source", "compute_cv", "latency_s", "bandwidth_gbps", "apply_gbps", "train")


def simulated_rows_cost(rows: list[Row]) -> str:
    """The cost model of the simulated rows of a report that has real ones too, from each
    run's `sim` (its summary's): a simulated time means nothing beside a real one without
    it (a calibrated compute time, say, is the bare forward and backward). Rows of
    different cost models (other folders, or one calibrated value per batch size) are
    named with theirs."""
    groups: dict[tuple, list[str]] = {}
    for r in rows:
        for run in r.runs if r.simulated else []:
            m = run.get("sim")
            if isinstance(m, dict):
                names = groups.setdefault(tuple(m.get(k) for k in COST_KEYS), [])
                name = f"{r.name} ({r.workers} w)"
                if name not in names:
                    names.append(name)
    if not groups:
        return "Their cost model is not recorded (no `sim` in their summaries)."

    def said(key: tuple) -> str:
        m = dict(zip(COST_KEYS, key, strict=True))

        def num(k: str, unit: str = "") -> str:   # (a summary without the key: not written by psgd simulate)
            return f"{m[k]:g}{unit}" if is_number(m[k]) else "?"
        c = float(m["compute_s"]) if is_number(m["compute_s"]) else 0.0
        compute = compute_words(c if m["compute_s_source"] == "config" else None, f"{c * 1e3:.3f} ms per step")
        return (cost_phrase(compute, num("compute_cv"), num("latency_s", " s"), num("bandwidth_gbps", " Gbit/s"),
                            num("apply_gbps", " Gbit/s"))
                + ("" if m["train"] is not False else "; timing only (sim.train = false): no gradients, no scores"))
    if len(groups) == 1:
        return f"Their cost model: {said(next(iter(groups)))} (docs/simulation.md)."
    return " ".join(f"Cost model of {', '.join(v[:-1]) + ' and ' if len(v) > 1 else ''}{v[-1]}: {said(k)}."
                    for k, v in groups.items()) + " (docs/simulation.md)"


def simulated_note(sim: dict, rows: list[Row], any_fault: bool = False) -> str:
    """What a simulated report must say first: that it is simulated, and its cost model
    (merged folders of different cost models: what differs, per folder)."""
    differs, folders = sim.get("differs") or [], sim.get("per_folder") or []

    def said(keys: tuple[str, ...], fmt: Callable[[dict], str]) -> str:
        if not any(k in differs for k in keys):
            return fmt(sim)
        return " and ".join(f"{fmt(m)} in the rows marked [{tag}]" for tag, m in folders)

    scored = any(r.scored for r in rows)   # (training with cluster.evaluator = false scores nothing)
    train = said(("train",), lambda m: "every simulated worker computes real gradients on its own batches, so "
                 + ("accuracy is real" if scored else "training is real, but no run was scored (no evaluator)")
                 if m.get("train", True) else
                 "timing only (sim.train = false): no gradients are computed, so accuracies are absent")
    compute = said(("compute_s", "calibrated_compute_s"), _compute)

    def num(key: str, unit: str) -> str:
        return said((key,), lambda m: f"{m.get(key, 0):g}{unit}")
    cost = cost_phrase(compute, num("compute_cv", ""), num("latency_s", " s"), num("bandwidth_gbps", " Gbit/s"),
                       num("apply_gbps", " Gbit/s"))
    return (f"**These runs are simulated** (`psgd simulate`): one process ran the real consistency rules and "
            f"shards on a virtual clock; {train}; only time is simulated, and every time in this report is in "
            f"virtual seconds. Cost model"
            f"{' (the merged folders differ in ' + ', '.join(_keys(differs)) + ')' if differs else ''}: {cost}"
            f"{'; faults.* as below' if any_fault else ''}. Design and limits: docs/simulation.md.")


def cost_phrase(compute: str, cv: str, latency: str, bandwidth: str, apply: str) -> str:
    """A simulation's cost model in words, given each of its values as written."""
    return (f"compute {compute}, lognormal spread cv {cv}; one-way link latency {latency}; {bandwidth} per worker "
            f"and per shard NIC, messages to one shard queueing behind each other (incast); each shard serves its "
            f"requests in order at {apply} of the bytes each makes it work through (a push or an elastic offer: "
            f"its float32 tables, whatever the wire carried; any other request: its payload); the evaluator's "
            f"reads are free")


def write_report(out: str, results: list[dict], ctx: dict) -> str:
    rows = build_rows(results)
    plots = make_plots(out, rows, float(ctx.get("target_accuracy", 0.9)),
                       eval_period([run for r in rows for run in r.runs], ctx))
    path = os.path.join(out, "report.md")
    write_text_atomic(path, render(rows, ctx, plots))
    return path


class ReportError(ValueError):
    """A folder that `python -m psgd.report` cannot read or must not write: one line, exit 2."""


# The keys every compare.json entry has (psgd.compare's tag and failed_entry write them all).
ENTRY_KEYS = ("label", "mode", "workers")


def _json_kind(x: object) -> str:
    """What a JSON value is, in JSON's words."""
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "a boolean"
    return "an object" if isinstance(x, dict) else "a list" if isinstance(x, list) else \
        "a string" if isinstance(x, str) else "a number"


def _entry_problem(i: int, entry: object) -> str | None:
    """Why entry i of a compare.json is not one psgd wrote, or None."""
    if not isinstance(entry, dict):
        return f"entry {i} is {_json_kind(entry)}, not an object"
    missing = [k for k in ENTRY_KEYS if k not in entry]
    if missing:
        return f"entry {i} has no {', '.join(missing)}"
    if not isinstance(entry["label"], str) or not isinstance(entry["mode"], str):
        return f"entry {i}'s label and mode are not strings"
    w = entry["workers"]
    if not isinstance(w, int) or isinstance(w, bool) or w < 1:
        return f"entry {i}'s workers is {w!r}, not a count"
    return None


def _load(path: str, what: str) -> object:
    with open(path) as f:
        try:
            return json.load(f)
        except ValueError as e:   # not JSON (UnicodeDecodeError is a ValueError too)
            raise ReportError(f"{path} is not a psgd {what} (not JSON: {e})") from None


def _read(folder: str) -> tuple[list[dict], dict]:
    """compare.json and compare-context.json of a folder, checked to be what psgd writes:
    a list of run entries (empty when a compare was interrupted before its first run
    ended), each with ENTRY_KEYS; a context object, or none. Otherwise ReportError."""
    path = os.path.join(folder, "compare.json")
    results = _load(path, "compare.json")
    if not isinstance(results, list):
        raise ReportError(f"{path} is not a psgd compare.json ({_json_kind(results)}, not a list of runs)")
    for i, entry in enumerate(results):
        why = _entry_problem(i, entry)
        if why:
            raise ReportError(f"{path} is not a psgd compare.json ({why})")
    ctx: dict = {}
    cpath = os.path.join(folder, "compare-context.json")
    if os.path.exists(cpath):
        loaded = _load(cpath, "compare-context.json")
        if not isinstance(loaded, dict):
            raise ReportError(f"{cpath} is not a psgd compare-context.json ({_json_kind(loaded)}, not an object)")
        ctx = loaded
    return results, ctx


# What must agree between merged folders for their runs to be rows of one comparison.
SETUP_KEYS = ("config", "job", "target_accuracy", "eval_every_s", "faults", "servers")


def _setup(ctx: dict, with_sim: bool) -> str:
    """A folder's setup as one comparable string: what it ran, less what differs between a
    real run and a simulation of it (sim.* settings, the cost model) unless `with_sim`."""
    sets = sorted(x for x in ctx.get("sets") or [] if with_sim or not x.startswith("sim."))
    keys = {k: ctx.get(k) for k in SETUP_KEYS}
    return json.dumps({"sets": sets, **keys, "sim": cost_model(ctx) if with_sim else None},
                      sort_keys=True, default=str)


def cost_model(ctx: dict) -> dict | None:
    """A simulate folder's cost model (None: real runs), less what differs between two
    simulations of one setup: how many real seconds each run took (`real_s`)."""
    sim = ctx.get("simulated")
    return {k: v for k, v in sim.items() if k != "real_s"} if isinstance(sim, dict) else sim


def _cost_models(ctx: dict, tag: str) -> list[list]:
    """[[the tag of its rows, a cost model]] of a simulate folder: one, or a merged
    folder's own (their rows tagged after the folder's tag)."""
    m = {k: v for k, v in (cost_model(ctx) or {}).items() if k not in ("differs", "per_folder")}
    inner = (ctx.get("simulated") or {}).get("per_folder")
    return [[f"{tag} {t}", im] for t, im in inner] if inner else [[tag, m]]


def setup_tags(folders: list[str], ctxs: list[dict]) -> list[str | None]:
    """A tag per folder when the folders' setups differ (other --set values, budget,
    config, faults; among simulations also the cost model), else None for each: the runs
    of two setups are not repeats of one configuration. The tag is what the folder set
    that not every folder did, or else its name. A folder without a compare-context.json
    has no known setup and is taken to share the others'."""
    known = [(f, c) for f, c in zip(folders, ctxs, strict=True) if c]
    plain = {_setup(c, False) for _, c in known}
    costs = {_setup(c, True) for _, c in known if c.get("simulated")}
    if len(plain) <= 1 and len(costs) <= 1:
        return [None] * len(folders)
    common = set.intersection(*(set(c.get("sets") or []) for _, c in known))
    tags: list[str | None] = [" ".join(x for x in c.get("sets") or [] if x not in common) or None
                              for _, c in known]
    if None in tags or len(set(tags)) < len(tags):
        tags = [os.path.basename(os.path.normpath(f)) for f, _ in known]
        if len(set(tags)) < len(tags):
            tags = [f"folder {i + 1}" for i in range(len(known))]
    by_folder = dict(zip([f for f, _ in known], tags, strict=True))
    return [by_folder.get(f) for f in folders]


def _target(ctx: dict, runs: list[dict]) -> float | None:
    """The test accuracy a folder's times to target are times to: its context's, else its runs'."""
    t = ctx.get("target_accuracy", next((r["target_accuracy"] for r in runs if r.get("target_accuracy") is not None),
                                        None))
    return None if t is None else float(t)


def one_target(folders: list[str], targets: list[float | None]) -> float | None:
    """The target every folder shares (None when none says): a report ranks times to one
    target and names it once, so folders of different targets are refused (ReportError)."""
    known = {f: t for f, t in zip(folders, targets, strict=True) if t is not None}
    if len(set(known.values())) > 1:
        raise ReportError("the folders measured time to different targets ("
                          + ", ".join(f"{f}: {t:g}" for f, t in known.items())
                          + "): a report compares times to one target; merge folders of one eval.target_accuracy")
    return next(iter(known.values()), None)


def merge(out: str, folders: list[str]) -> tuple[list[dict], dict]:
    """The runs of several compare/simulate folders in one list (each run's `dir`
    relative to `out`), and the context of the first real one (else the first). When the
    folders' setups differ (setup_tags), each run carries its folder's `setup` tag, which
    keeps it in a row of its own, and the context says what each folder applied. Folders
    of different targets are refused (one_target)."""
    per_folder, ctxs = [], []
    for folder in folders:
        rs, ctx = _read(folder)
        per_folder.append(rs)
        ctxs.append(ctx)
    target = one_target(folders, [_target(c, rs) for c, rs in zip(ctxs, per_folder, strict=True)])
    tags = setup_tags(folders, ctxs)
    # Baselines of different budgets (folders of other --workers: W x train.steps) are no
    # repeats of one another: each is a row of its own, tagged with its steps (a review:
    # 200 and 800 steps made one row, whose sd was the budgets' difference).
    budgets = [(c.get("baseline") or {}).get("steps") for c in ctxs]
    budgets_differ = len({b for b in budgets if b is not None}) > 1
    results = []
    seen: dict[tuple, str] = {}
    for folder, rs, tag, budget in zip(folders, per_folder, tags, budgets, strict=True):
        for r in rs:
            if budgets_differ and r.get("mode") == "baseline" and budget is not None:
                r = {**r, "setup": f"{r['setup']} {budget} steps" if r.get("setup") else f"{budget} steps"}
            # A simulation of one configuration, setup and seed in two folders is one run twice,
            # not two repeats: its virtual clock and its model are the seed's (a review: seed
            # 42's runs of two folders made a row of "2 repeats", sd 0, and the report ranked
            # what that sd could not tell apart). Two real runs of one seed are two timings.
            key = (r.get("label"), r.get("workers"), tag, r.get("setup"), r.get("seed"))
            if r.get("simulated") and r.get("seed") is not None and not r.get("error"):
                if key in seen and seen[key] != folder:
                    raise ReportError(f"{seen[key]} and {folder} both hold the simulation of {r.get('label')} with "
                                      f"{r.get('workers')} workers and seed {r.get('seed')} under one setup: one run "
                                      f"twice, not two repeats; merge folders of other seeds (psgd simulate "
                                      f"--repeats, --set job.seed)")
                seen[key] = folder
            if r.get("dir"):
                r = {**r, "dir": os.path.relpath(os.path.join(folder, r["dir"]), out)}
            if tag:   # (a run of a merged folder keeps its own tag after its folder's)
                r = {**r, "setup": f"{tag} {r['setup']}" if r.get("setup") else tag}
            results.append(r)
    ctx = dict(next((c for c in ctxs if not c.get("simulated")), ctxs[0]))
    if target is not None:
        ctx["target_accuracy"] = target
    if not all(c.get("simulated") for c in ctxs):
        ctx.pop("simulated", None)  # a merged report says per row which runs are simulated
    else:   # simulations of different cost models: the report says what differs, per folder (its rows' tag)
        costs = [x for f, t, c in zip(folders, tags, ctxs, strict=True) for x in _cost_models(c, t or f)]
        models = [m for _, m in costs]
        differs = sorted({k for m in models for k in m if any(m.get(k) != o.get(k) for o in models)})
        if differs:
            ctx["simulated"] = {**models[0], "differs": differs, "per_folder": costs}
    ctx["merged_from"] = list(folders)
    if budgets_differ:
        ctx["baseline_budgets_differ"] = True
    # Each folder's interruption, said per folder: the first folder's context speaks for none but its own.
    ctx.pop("interrupted", None)
    ctx.pop("not_run", None)
    stops = [{"folder": f, "not_run": list(c.get("not_run") or []), "ran": len(rs)}
             for f, c, rs in zip(folders, ctxs, per_folder, strict=True) if interruption(c) is not None]
    if stops:
        ctx["interruptions"] = stops
    if len(folders) == 1:
        return results, ctx
    ctx.pop("command", None)  # each folder's command is listed with it
    known = [c for c in ctxs if c] or [{}]
    common = [x for x in known[0].get("sets") or [] if all(x in (c.get("sets") or []) for c in known)]
    ctx["sets"] = common
    ctx["setups"] = [{"folder": f, "tag": t, "command": c.get("command"),
                      "sets": [x for x in c.get("sets") or [] if x not in common]}
                     for f, c, t in zip(folders, ctxs, tags, strict=True)]
    jobs = [c.get("job") or {} for c in ctxs]
    ctx["job_varies"] = sorted({k for j in jobs for k in j if any(j.get(k) != o.get(k) for o in jobs)})
    ctx["seeds"] = sorted({s for c in ctxs for s in c.get("seeds") or []})
    ctx["workers"] = sorted({w for c in ctxs for w in c.get("workers") or []})
    return results, ctx


def check_merge_folders(out: str, folders: list[str]) -> None:
    """A merge reads each folder once and writes OUT/compare.json: refuse (ReportError) a
    folder given twice, whose runs would count as repeats of themselves, and an OUT that is
    one of the folders, whose compare.json it would overwrite (both by real path)."""
    seen: dict[str, str] = {}
    for f in folders:
        real = os.path.realpath(f)
        if real in seen:
            raise ReportError(f"{f} is given twice (as {seen[real]} and {f}): each folder's runs are merged once")
        seen[real] = f
    real_out = os.path.realpath(out)
    if real_out in seen:
        raise ReportError(f"the output folder {out} is also one of the folders to merge ({seen[real_out]}): its "
                          f"compare.json would be overwritten; give a new output folder")
    # `python -m psgd.report A B`, meant as "merge A and B", makes A the output: a compare's or
    # simulate's runs there would be replaced by B's. Only an earlier merge's output is rewritten.
    if os.path.exists(os.path.join(out, "compare.json")):
        try:
            merged = bool(_read(out)[1].get("merged_from"))
        except (ReportError, OSError):
            merged = False
        if not merged:
            raise ReportError(f"the output folder {out} holds the runs of a psgd compare or simulate (its "
                              f"compare.json), which the merge would replace; to merge them with the others, name "
                              f"it after a new output folder: python -m psgd.report NEW {out} {' '.join(folders)}")


def main(argv: list[str] | None = None) -> int:
    """`python -m psgd.report DIR` rebuilds DIR's report; `python -m psgd.report OUT DIR1
    DIR2 ...` writes OUT/report.md, OUT/compare.json and OUT/compare-context.json (from
    which `python -m psgd.report OUT` rebuilds it) over the runs of several folders,
    e.g. a `psgd compare` and a `psgd simulate` of the same configuration side by side."""
    argv = sys.argv[1:] if argv is None else argv
    usage = ("usage: python -m psgd.report DIR   (DIR holds compare.json)\n"
             "       python -m psgd.report OUT DIR1 DIR2 ...   (the runs of several folders in one report)")
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if len(argv) < 1:
        print(usage, file=sys.stderr)
        return 2
    out = argv[0]
    try:
        if len(argv) == 1:
            results, ctx = _read(out)
            if "target_accuracy" not in ctx:
                # (a folder without its context: its times are to its runs' target, not the default
                # 0.9 -- "First to reach 0.9" was said of times to 0.97)
                target = _target(ctx, results)
                if target is not None:
                    ctx = {**ctx, "target_accuracy": target}
        else:
            check_merge_folders(out, argv[1:])
            results, ctx = merge(out, argv[1:])
    except ReportError as e:
        print(f"psgd report: {e}", file=sys.stderr)
        return 2
    except OSError as e:   # no compare.json there
        print(f"psgd report: {e} (a psgd compare or simulate folder holds compare.json)", file=sys.stderr)
        return 2
    if len(argv) > 1:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "compare.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(out, "compare-context.json"), "w") as f:   # what `python -m psgd.report OUT` reads
            json.dump(ctx, f, indent=2)
    print(write_report(out, results, ctx))
    return 0


if __name__ == "__main__":
    sys.exit(main())
