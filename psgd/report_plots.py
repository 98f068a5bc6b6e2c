"""The PNG plots of the `psgd compare` report (matplotlib, Agg backend: no display needed).

Accuracy against wall time and against samples, throughput bars, one measured-staleness
histogram per configuration, for sweeps the swept value (or the worker count) against
time to target and throughput, mean ± sd over repeats (an error bar only where a
configuration ran more than once: a single run measured no sd, and the titles say so; only
resolved times of configurations that lost no repeats are drawn; a sweep plot's title says
why the others have none), and for ltfb with
`mode.explore` each trainer's explored hyperparameters after every tournament.
`make_plots` writes them and lists them; without matplotlib it writes nothing and the
report goes without plots.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import textwrap
from typing import Any

from .report_numbers import Row, counted, mean, param_name, sd, sweep_fixed, sweeps, worker_sweeps
from .report_relations import failed_values, time_status
from .report_tables import num, smax

PLOT_DPI = 80


def plt_or_none():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def _colors(rows: list[Row]) -> dict[tuple, Any]:
    """{row key: colour}: one colour per configuration (label), whatever its worker count,
    so that sync is the same colour in the histograms, the bars and the worker-count plot's
    one sync line; the accuracy plots tell its worker counts apart by marker (_markers)."""
    plt = plt_or_none()
    cmap = plt.get_cmap("tab10") if plt else None
    labels = list(dict.fromkeys(r.label for r in rows if not r.is_baseline))
    return {r.key: "black" if r.is_baseline else cmap(labels.index(r.label) % 10) if cmap else None for r in rows}


MARKERS = "os^Dv<>PX*"


def _markers(rows: list[Row]) -> dict[int, str]:
    """{worker count: marker} of the accuracy curves, which share a configuration's colour
    across its worker counts (_colors); "." alone where every row has one worker count."""
    ws = sorted({r.workers for r in rows if not r.is_baseline})
    return {w: MARKERS[i % len(MARKERS)] if len(ws) > 1 else "." for i, w in enumerate(ws)}


def curve_points(run: dict, xkey: str) -> tuple[list[float], list[float]]:
    """(xs, accuracies) of a run's evaluation curve against `xkey` ("t" or "samples"). A
    score's `samples` is the workers' count when the evaluator read the model (summary.json's
    `evals`), so one counted at 0 after the start is of the model before any step: it is
    drawn (it was left out when the count was the heartbeats' at the score's arrival)."""
    ev = [e for e in run.get("evals") or [] if e.get("accuracy") is not None]
    return [float(e[xkey]) for e in ev], [float(e["accuracy"]) for e in ev]


# Two lines closer than this fraction of their axes' spans at every point are drawn on each
# other (about a pixel at the plots' size): the later one is dashed over the earlier (_hosts).
ALIKE = 0.005


def _hosts(lines: list[tuple[list[float], list[float]]], log: bool = False) -> list[int | None]:
    """For each line (xs, ys), the index of the first earlier line it would hide (the same
    x values, as near as ALIKE at every point: simulated repeats and configurations that
    behave alike draw exactly the same curve), or None."""
    def fx(x: float) -> float:
        return math.log(x) if log else x
    xs = [fx(x) for line, _ in lines for x in line]
    ys = [y for _, line in lines for y in line]
    xspan = (max(xs) - min(xs)) if xs else 0.0
    yspan = (max(ys) - min(ys)) if ys else 0.0
    out: list[int | None] = []
    for i, (xa, ya) in enumerate(lines):
        out.append(next((k for k, (xb, yb) in enumerate(lines[:i]) if out[k] is None and len(xb) == len(xa)
                         and all(abs(fx(a) - fx(b)) <= ALIKE * xspan for a, b in zip(xa, xb, strict=True))
                         and all(abs(a - b) <= ALIKE * yspan for a, b in zip(ya, yb, strict=True))), None))
    return out


def _dashes(hosts: list[int | None]) -> list[Any]:
    """The line style of each line: its own (None) where it hides no other, else dashes that
    leave its host (and the host's other guests) showing in the gaps."""
    guests: dict[int, list[int]] = {}
    for i, h in enumerate(hosts):
        if h is not None:
            guests.setdefault(h, []).append(i)
    out: list[Any] = [None] * len(hosts)
    for gs in guests.values():
        for k, i in enumerate(gs):
            out[i] = (4 * k, (4, 4 * len(gs)))
    return out


def _curve_plot(plt, rows: list[Row], colors, xkey: str, xlabel: str, target: float, path: str,
                allow_log: bool = True) -> None:
    """Draws the accuracy curves against `xkey` (curve_points). A configuration's first
    repeat is its line, its other repeats faint lines (the legend says so); a line on
    another's (_hosts) is dashed over it, named so in the legend; a curve of one score is
    a large marker above the lines."""
    fig, ax = plt.subplots(figsize=(10, 4.2))
    curves = [(r, j, curve_points(run, xkey)) for r in rows for j, run in enumerate(r.runs)]
    positive = [x for _, _, (xs, _) in curves for x in xs if x > 0]
    # A log axis has no place for a score at 0 s (the baseline's first): matplotlib would
    # clip it to a tiny x and draw a flat line from the axis' edge at the next score's height.
    log = allow_log and bool(positive) and max(positive) / max(min(positive), 1e-9) > 30
    at_zero = 0
    markers = _markers(rows)
    drawn: list[tuple[Row, int, list[float], list[float]]] = []
    for r, j, (xs, ys) in curves:
        if log:
            at_zero += sum(1 for x in xs if x <= 0)
            xs, ys = [x for x in xs if x > 0], [y for x, y in zip(xs, ys, strict=True) if x > 0]
        if xs:
            drawn.append((r, j, xs, ys))
    firsts = [k for k, (_, j, _, _) in enumerate(drawn) if j == 0]
    hosts = _hosts([(drawn[k][2], drawn[k][3]) for k in firsts], log)
    dashes = dict(zip(firsts, _dashes(hosts), strict=True))
    host_of = {k: firsts[h] for k, h in zip(firsts, hosts, strict=True) if h is not None}

    def name(r: Row) -> str:
        return r.name + (f" ({r.workers} w)" if not r.is_baseline else "")
    for k, (r, j, xs, ys) in enumerate(drawn):
        marker = "." if r.is_baseline else markers[r.workers]
        one = len(xs) == 1   # a single score: a point, not a line, drawn large and above the lines
        label = None
        if j == 0 and k in host_of:   # (a point on another's: smaller, inside it)
            label = name(r) + (f", inside {name(drawn[host_of[k]][0])}'s point" if one else
                               f", dashed on {name(drawn[host_of[k]][0])}'s line")
        elif j == 0:
            label = name(r)
        ax.plot(xs, ys, color=colors[r.key], lw=1.6 if j == 0 else 0.8, alpha=1.0 if j == 0 else 0.45,
                ls=dashes.get(k) or ("--" if r.is_baseline else "-"), marker="o" if one else marker,
                ms=(4 if k in host_of else 8 if j == 0 else 6) if one else 4 if marker != "." else None,
                zorder=3 if one else None,
                markevery=max(1, len(xs) // 15), label=label)
    if any(j for _, j, _, _ in drawn):
        ax.plot([], [], color="grey", lw=0.8, alpha=0.45, label="faint: each configuration's other repeats")
    ax.axhline(target, color="grey", ls=":", lw=1, label=f"target {target:g}")
    if log:
        ax.set_xscale("log")
        xlabel += " (log scale" + ("; scores at 0 s not drawn)" if at_zero else ")")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    # (outside the axes, to the right: inside, "best" still covered the curves)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
              ncol=2 if len(rows) > 12 else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


def clock(rows: list[Row]) -> str:
    """What a second on the plots is: "wall", "virtual", or both for a merged report."""
    kinds = {r.simulated for r in rows if r.runs}
    return "virtual" if kinds == {True} else "wall" if kinds != {True, False} else "wall or virtual"


def _seconds(rows: list[Row]) -> str:
    """The unit note of a time axis: plain seconds unless real and simulated runs share it."""
    return "s; virtual s for simulated rows" if clock(rows) == "wall or virtual" else "s"


def _per_s(rows: list[Row]) -> str:
    """A throughput axis's unit: per virtual second where every row is simulated (psgd simulate's
    plot said "samples / s" beside its time axes in virtual s)."""
    kind = clock(rows)
    return ("samples / virtual s" if kind == "virtual" else
            "samples / s" + (" (virtual s for simulated rows)" if kind == "wall or virtual" else ""))


def spread_words(counts: list[int]) -> str:
    """What a plot's points are, given how many runs each point is the mean of: "mean ± sd
    over repeats", "one run each: no sd measured", or where both kinds are drawn, which
    points have no error bar. (A zero-length bar for a single run drew an sd never measured.)"""
    counts = [n for n in counts if n]
    if counts and all(n == 1 for n in counts):
        return "one run each: no sd measured"
    if any(n == 1 for n in counts):
        return "mean ± sd over repeats; no error bar where one run was measured"
    return "mean ± sd over repeats"


def _error_bars(ax, xs: list, ys: list, errs: list[float | None], **kw) -> None:
    """Error bars at the points whose sd was measured (not None), none at the others."""
    pts = [(x, y, e) for x, y, e in zip(xs, ys, errs, strict=True) if e is not None and y is not None]
    if pts:
        ax.errorbar([x for x, _, _ in pts], [y for _, y, _ in pts], yerr=[e for _, _, e in pts], fmt="none",
                    capsize=3, **kw)


def _line(ax, xs: list, ys: list, errs: list[float | None], **kw) -> None:
    """A line through (xs, ys), with error bars where an sd was measured (_error_bars)."""
    ax.plot(xs, ys, **kw)
    _error_bars(ax, xs, ys, errs, color=kw.get("color"))


def _throughput_plot(plt, rows: list[Row], colors, path: str) -> None:
    ok = [r for r in rows if r.runs]
    fig, ax = plt.subplots(figsize=(max(5, 0.7 * len(ok) + 2), 4))
    xs = list(range(len(ok)))
    ys = [mean(r.sps) for r in ok]
    ax.bar(xs, ys, color=[colors[r.key] for r in ok])
    # black with a white rim: the baseline's bar is black, and a plain black bar hid the lower half of its own
    from matplotlib import patheffects
    _error_bars(ax, xs, ys, [sd(r.sps) for r in ok], color="black", lw=1.2,
                path_effects=[patheffects.withStroke(linewidth=3.5, foreground="white")])
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r.name.replace(" (sequential)", "") + ("" if r.is_baseline else f"\n{r.workers} w")
                        for r in ok], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(_per_s(ok))
    ax.set_title(f"throughput ({spread_words([len(r.sps) for r in ok])})", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


def _bin_order(k: str) -> float:
    return float(k.rstrip("+")) + (0.5 if k.endswith("+") else 0)


def staleness_axis(rows: list[Row]) -> tuple[float, str]:
    """(top, caption): the panels' shared x axis runs from 0 to the highest bin that any of
    them filled, and the caption describes that axis: it names the overflow bin (the last
    one, which collects every delay >= BINS - 1) only when the axis reaches it."""
    from .consistency.staleness import BINS
    keys = {k for r in rows for k in r.hist}
    top = max([_bin_order(k) for k in keys] + [1])
    caption = "measured staleness: updates applied between a worker's read and its push"
    if any(r.mode == "easgd" for r in rows):
        caption += " (easgd: moves of the centre between a worker's exchanges, each of tau local steps)"
    if any(k.endswith("+") for k in keys):
        caption += f"; the last bar, {BINS - 1}+, collects every delay ≥ {BINS - 1}"
    return top, caption


def _staleness_plot(plt, rows: list[Row], colors, path: str) -> None:
    """One panel per configuration: the fraction of steps at each measured staleness, log
    scale so that rare long delays stay visible."""
    ok = [r for r in rows if r.runs and not r.is_baseline]
    n = len(ok)
    cols = n if n <= 5 else 4
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(2.4 * cols + 0.6, 2.1 * nrows + 0.6), squeeze=False)
    top, caption = staleness_axis(ok)
    for i, r in enumerate(ok):
        ax = axes[i // cols][i % cols]
        h = r.hist
        total = sum(h.values())
        keys = sorted(h, key=_bin_order)
        if total:
            ax.bar([_bin_order(k) for k in keys], [h[k] / total for k in keys], width=0.8, color=colors[r.key])
            ax.set_yscale("log")
            ax.set_ylim(min(0.5 / total, 0.5e-3), 1.5)
            title = f"measured mean {num(r.staleness_mean)}, max {smax(r.staleness_max)}"
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
    # (wrapped to the figure's width: on one line the caption ran past both edges of a 3-panel figure;
    # about 14 characters of 7-point text to the inch)
    fig.supxlabel(textwrap.fill(caption, max(30, int(14 * fig.get_figwidth()))), fontsize=7)
    fig.supylabel("fraction of steps (log)", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


def plotted_time(r: Row, period: float | None) -> float | None:
    """The time to target a plot draws for a row: a resolved mean of a row that lost no
    repeats (time_status says why another has none), else None."""
    return None if time_status(r, period) else r.resolved_ttt_mean(period)


def _why_unplotted(xs: list, rows: list[Row], period: float | None, target: float | None) -> dict[str, list[str]]:
    """Why the values `xs` (of `rows`) without a plotted time (plotted_time) have none, in
    the reading's words (time_status): {why: [the values, as text]}."""
    by_why: dict[str, list[str]] = {}
    for x, r in zip(xs, rows, strict=True):
        if why := time_status(r, period, target):
            by_why.setdefault(why, []).append(str(x))
    return by_why


def _unplotted(xs: list, rows: list[Row], period: float | None, target: float) -> str:
    """A second title line, "(0, 4: not scored; 8: 2/3 reached)"; "" if every value has
    a plotted time."""
    said = "; ".join(", ".join(values) + f": {why}" for why, values in _why_unplotted(xs, rows, period, target).items())
    return f"\n({said})" if said else ""


def _sweep_plot(plt, xs_label: str, xs: list, rows: list[Row], path: str, title: str, period: float | None,
                target: float) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)
    pos = xs if numeric else list(range(len(xs)))
    tt = [plotted_time(r, period) for r in rows]
    pts = [(p, t, sd(r.ttt)) for p, t, r in zip(pos, tt, rows, strict=True) if t is not None]
    if pts:
        _line(ax, [p for p, _, _ in pts], [t for _, t, _ in pts], [e for _, _, e in pts],
              color="tab:blue", marker="o", label="time to target")
    ax.set_xlabel(xs_label)
    ax.set_ylabel(f"time to target ({clock(rows)} s)", color="tab:blue")
    ax2 = ax.twinx()
    rated = [(p, r) for p, r in zip(pos, rows, strict=True) if r.sps]   # (none measured: no point, not a 0)
    _line(ax2, [p for p, _ in rated], [mean(r.sps) for _, r in rated], [sd(r.sps) for _, r in rated],
          color="tab:orange", marker="s", label="samples/s")
    timed = [len(r.ttt) for r, t in zip(rows, tt, strict=True) if t is not None]
    if any(n == 1 for n in [len(r.sps) for r in rows] + timed):   # (with repeats everywhere, the bars are sds)
        title += f"\n(throughput: {spread_words([len(r.sps) for r in rows])}" + \
            (f"; time: {spread_words(timed)})" if timed else ")")
    ax2.set_ylabel(_per_s(rows), color="tab:orange")
    if not numeric:
        ax.set_xticks(pos)
        ax.set_xticklabels([str(x) for x in xs])
    # (wrapped: the reasons a value has no time run past the figure's edges on one line)
    ax.set_title("\n".join(textwrap.fill(line, 72) for line in (title + _unplotted(xs, rows, period, target))
                           .split("\n")), fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


def _workers_plot(plt, groups: dict[str, list[Row]], colors, path: str, period: float | None,
                  target: float | None = None) -> None:
    """Throughput and time to target against the worker count, one line per configuration,
    mean ± sd over repeats as in the other plots; the time panel's title says which worker
    counts have no plotted time and why (time_status), as a parameter sweep's does."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6), sharex=True)   # (a panel with no point keeps the axis)
    missing: list[str] = []
    rows = list(groups.values())
    names = [rs[0].name for rs in rows]
    rated = [[r for r in rs if r.sps] for rs in rows]   # (none measured: no point, not a 0)
    tput = [([float(r.workers) for r in rs], [mean(r.sps) or 0.0 for r in rs]) for rs in rated]
    times = [[(r.workers, t, sd(r.ttt)) for r in rs if (t := plotted_time(r, period)) is not None]
             for rs in rows]
    # A line on another's (simulated sync and ssp s=0 can run alike) is dashed over it (_hosts).
    t_hosts = _hosts(tput)
    p_hosts = _hosts([([float(w) for w, _, _ in pts], [t for _, t, _ in pts]) for pts in times])
    t_dash, p_dash = _dashes(t_hosts), _dashes(p_hosts)

    def label(i: int, hosts: list[int | None]) -> str:
        h = hosts[i]
        return names[i] + (f", dashed on {names[h]}'s line" if h is not None else "")
    for i, rs in enumerate(rows):
        c = colors[rs[0].key]
        _line(a1, tput[i][0], tput[i][1], [sd(r.sps) for r in rated[i]], marker="o", color=c,
              label=label(i, t_hosts), ls=t_dash[i] or "-")
        pts = times[i]
        if pts:
            _line(a2, [p for p, _, _ in pts], [t for _, t, _ in pts], [e for _, _, e in pts], marker="o",
                  color=c, label=label(i, p_hosts), ls=p_dash[i] or "-")
        if any(r.scored for r in rs) and (by_why := _why_unplotted([r.workers for r in rs], rs, period, target)):
            missing.append(f"{names[i]}: " + "; ".join(f"{', '.join(w)} w {why}" for why, w in by_why.items()))
    ws = sorted({r.workers for rs in groups.values() for r in rs})
    every = [r for rs in groups.values() for r in rs]
    seconds = "virtual s" if clock(every) == "virtual" else _seconds(every)   # (as the parameter sweep's axis)
    for ax, yl in ((a1, _per_s(every)), (a2, f"time to target ({seconds})")):
        ax.set_xticks(ws)
        ax.set_xlabel("workers")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:   # timing only, or no resolved time to target: nothing drawn
            ax.text(0.5, 0.5, "no run was scored" if not any(r.scored for r in every) else
                    "no resolved time to target (see the reading)", ha="center", va="center",
                    transform=ax.transAxes, fontsize=8, color="grey")
    a1.set_title(f"throughput ({spread_words([len(r.sps) for r in every])})", fontsize=8)
    timed = [len(r.ttt) for rs in groups.values() for r in rs if plotted_time(r, period) is not None]
    a2.set_title("\n".join([f"time to target ({spread_words(timed)})" if timed else "time to target"]
                           + [textwrap.fill(f"(not drawn: {m})", 64) for m in missing]), fontsize=7 if missing else 8)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


def hyper_traces(out: str, run: dict) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """An ltfb run's explored hyperparameters over time, from its leaders' tournament
    lines: {key: {trainer: [(seconds since the first line, value), ...]}}; {} if none."""
    lines = []
    for path in sorted(glob.glob(os.path.join(out, run.get("dir", ""), "events", "worker-*.jsonl"))):
        with open(path) as f:   # only lines that name a tournament are decoded: a long run has millions of others
            lines += [e for e in (json.loads(x) for x in f if '"tournament"' in x)
                      if e.get("event") == "tournament" and e.get("hyper") and e.get("rank") == e.get("leader")]
    if not lines:
        return {}
    t0 = min(e["t"] for e in lines)
    traces: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for e in sorted(lines, key=lambda e: e["t"]):
        for key, value in e["hyper"].items():
            traces.setdefault(key, {}).setdefault(int(e["trainer"]), []).append((e["t"] - t0, float(value)))
    return traces


def _hyper_plot(plt, label: str, traces: dict[str, dict[int, list[tuple[float, float]]]], path: str) -> None:
    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 3.6), squeeze=False)
    for ax, (key, by_trainer) in zip(axes[0], sorted(traces.items()), strict=True):
        for trainer, points in sorted(by_trainer.items()):
            ax.step([t for t, _ in points], [v for _, v in points], where="post", marker="o", ms=3,
                    label=f"trainer {trainer}")
        ax.set_yscale("log")
        ax.set_xlabel("seconds since the first tournament")
        ax.set_ylabel(f"{key} after each tournament")
        ax.set_title(f"{label}: {key}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)


# The file names make_plots writes: the fixed plots, one per sweep, one per explored ltfb row.
PLOT_FILE = re.compile(r"(accuracy_vs_time|accuracy_vs_samples|throughput|staleness|sweep_.+|hyper_\d+)\.png")


def make_plots(out: str, rows: list[Row], target: float, period: float | None = None) -> list[tuple[str, str]]:
    """[(title, file name)] of the plots written into `out`; `period`: the evaluator's
    (eval_period), which says which times to target are resolved."""
    plt = plt_or_none()
    if plt is None:
        return []
    colors = _colors(rows)
    ok = [r for r in rows if r.runs]
    made: list[tuple[str, str]] = []
    if not ok:
        return made
    kind = clock(ok)
    if any(curve_points(run, "t")[0] for r in ok for run in r.runs):   # (no score, no curve: no empty axes)
        _curve_plot(plt, ok, colors, "t", f"{kind} time since training started ({_seconds(ok)})", target,
                    os.path.join(out, "accuracy_vs_time.png"))
        made.append(("Accuracy vs time (wall seconds; virtual seconds for the simulated rows)"
                     if kind == "wall or virtual" else f"Accuracy vs {kind} time", "accuracy_vs_time.png"))
        _curve_plot(plt, ok, colors, "samples", "samples processed (all workers)", target,
                    os.path.join(out, "accuracy_vs_samples.png"), allow_log=False)
        made.append(("Accuracy vs samples processed", "accuracy_vs_samples.png"))
    measured = [r for r in ok if r.sps]   # (an entry without samples_per_s: no bar of 0, nor a crash)
    if measured:
        _throughput_plot(plt, measured, colors, os.path.join(out, "throughput.png"))
        made.append((f"Throughput ({spread_words([len(r.sps) for r in measured])})", "throughput.png"))
    if any(not r.is_baseline for r in ok):
        _staleness_plot(plt, ok, colors, os.path.join(out, "staleness.png"))
        made.append(("Measured staleness histogram per configuration", "staleness.png"))
    for mode, key, w, rs in sweeps(rows):   # (of every row: a value whose runs all failed is named)
        lost = failed_values(rs)
        rs = [r for r in rs if r.runs]
        if len(rs) < 2:
            continue
        name = f"sweep_{mode}_{key}_w{w}.png"
        taken = {n for _, n in made}
        i = 2
        while name in taken:  # another sweep of the same key (other fixed settings, or simulated)
            name, i = f"sweep_{mode}_{key}_w{w}_{i}.png", i + 1
        what = param_name(mode, key)
        fixed = "; ".join([counted(w, "worker")] + sweep_fixed(rs))
        _sweep_plot(plt, f"{mode} {what}", [r.sweep_value for r in rs], rs, os.path.join(out, name),
                    f"{mode}: {what} sweep, {fixed}" + (f"\n({lost})" if lost else ""), period, target)
        made.append((f"Sweep: {mode} {what} ({fixed})", name))
    groups = worker_sweeps(ok)
    if groups:
        _workers_plot(plt, groups, colors, os.path.join(out, "sweep_workers.png"), period, target)
        made.append(("Sweep: worker count", "sweep_workers.png"))
    for r in ok:  # ltfb with mode.explore: each trainer's hyperparameters against time (first repeat)
        traces = hyper_traces(out, r.runs[0])
        if traces:
            name = f"hyper_{len(made)}.png"
            _hyper_plot(plt, f"{r.label} ({r.workers} w)", traces, os.path.join(out, name))
            made.append((f"Explored hyperparameters per trainer: {r.label} ({r.workers} workers)", name))
    return made
