"""The report where repeats do not spread (simulations are exact), faults differ per
configuration, and worker-count curves turn: one test per defect found so, each on crafted
compare.json entries (no processes)."""
from __future__ import annotations

import pytest

from .test_report_claims import CTX, run, sentence, told

pytestmark = pytest.mark.unit


@pytest.mark.timeout(60)
def test_throughputs_that_print_the_same_are_not_ranked():
    # `psgd simulate --modes sync,ssp:staleness=0,async --repeats 2 --set sim.train=false`: repeats
    # are identical (sd 0), so 12,321.56 against 12,321.71 was ranked: "lowest: ssp (bound s=0)
    # with 12,322" while sync was also at 12,322
    results = [run(label, mode, repeat=k, params=params, sps=sps, evals=[], acc=None, simulated=True)
               for label, mode, params, sps in (("sync", "sync", {}, 12321.71),
                                                ("ssp:staleness=0", "ssp", {"staleness": 0}, 12321.56),
                                                ("async", "async", {}, 14000.0))
               for k in range(2)]
    line = sentence(told(results), "Highest throughput")
    assert "lowest: **ssp (bound s=0)** with 12,322" not in line or "not told apart" in line, line
    assert "**sync** (12,322)" in line and "equal" in line, line
    level = [run(label, mode, repeat=k, params=params, sps=sps, evals=[], acc=None, simulated=True)
             for label, mode, params, sps in (("sync", "sync", {}, 12321.71),
                                              ("ssp:staleness=0", "ssp", {"staleness": 0}, 12321.56))
             for k in range(2)]
    assert sentence(told(level), "Throughput") == ("Throughput does not separate the configurations: all at 12,322 "
                                                  "samples/s.")
    # ... nor a sweep's course called a rise
    sweep = [run(f"ssp:staleness={s}", "ssp", repeat=k, params={"staleness": s}, sweep="staleness", sps=sps,
                 evals=[], acc=None, simulated=True) for s, sps in ((0, 12321.56), (4, 12321.71)) for k in range(2)]
    assert "throughput stayed flat (12,322, 12,322 samples/s)" in sentence(told(sweep), "Sweep of ssp")
    # ... nor a staleness written the same called the highest alone
    stale = [run(label, mode, repeat=k, stal=st, evals=[], acc=None, simulated=True)
             for label, mode, st in (("ssp", "ssp", 1.001), ("async", "async", 0.999)) for k in range(2)]
    assert "highest in **ssp** (1.00, max 2), not told apart from **async**" in told(stale)


@pytest.mark.timeout(60)
def test_a_fault_that_a_mode_item_turns_off_is_not_said_to_be_in_every_run():
    # `--set faults.step_delay_s=0.05 --modes sync:faults.step_delay_s=0,async`: "All runs had a
    # fault injected", and async "kept" its samples/s "under it" against a sync that had none
    faults = {"slow_rank": -1, "slow_factor": 1.0, "step_delay_s": 0.05, "jitter_prob": 0.0, "jitter_s": 0.0}
    ctx = {**CTX, "faults": faults, "workers": [2]}
    results = [run("sync:faults.step_delay_s=0", params={"faults.step_delay_s": 0.0}, repeat=k, sps=9000.0 + k)
               for k in range(2)] + [run("async", "async", repeat=k, sps=5000.0 + k) for k in range(2)]
    said = sentence(told(results, ctx), "had a fault injected")
    assert said.startswith("Some runs had a fault injected: every step of every worker is delayed by 0.05 s"), said
    assert "except in sync:faults.step_delay_s=0 (2 w), whose mode item sets faults.* of its own" in said
    assert "Under it" not in said
    # an item that changes the fault: every run had one, and the item's sync is no reference "under it"
    results = [run("sync:faults.step_delay_s=0.1", params={"faults.step_delay_s": 0.1}, repeat=k, sps=900.0 + k)
               for k in range(2)] + results[2:]
    said = sentence(told(results, ctx), "had a fault injected")
    assert said.startswith("All runs had a fault injected") and "Under it" not in said, said


def _scaled(sps_by_w: dict[int, tuple[float, ...]]) -> list[dict]:
    return [run("sync", repeat=k, workers=w, sps=v) for w, vs in sps_by_w.items() for k, v in enumerate(vs)]


@pytest.mark.timeout(60)
def test_a_worker_count_sweep_that_peaks_inside_says_where():
    # `psgd compare --modes sync --workers 1,2,3`: "sync from 1 to 3 workers: throughput ×1.81"
    # hid that 2 workers did better than 3 (10,512 against 8,151 samples/s)
    line = sentence(told(_scaled({1: (4500.0, 4506.0), 2: (10500.0, 10524.0), 3: (8150.0, 8152.0)})), "sync from 1")
    assert line.startswith("sync from 1 to 3 workers: throughput ×1.81 (scaling efficiency 60%)"), line
    assert "peaking at 2 workers with 10,512 samples/s (×2.33)" in line, line
    # a peak within two run-to-run sds of an end is not one
    noisy = sentence(told(_scaled({1: (4500.0, 4506.0), 2: (8000.0, 9000.0), 3: (8150.0, 8152.0)})), "sync from 1")
    assert "peaking" not in noisy, noisy
    assert "8,500 samples/s at 2 workers, above both ends but not told apart from them (within two run-to-run " \
        "sds)" in noisy, noisy
    # a dip inside, told apart from both ends
    dip = sentence(told(_scaled({1: (4500.0, 4506.0), 2: (3000.0, 3010.0), 3: (8150.0, 8152.0)})), "sync from 1")
    assert "dipping at 2 workers to 3,005 samples/s (×0.67)" in dip, dip
    # each count ran once: the values, not ranked
    once = sentence(told(_scaled({1: (4503.0,), 2: (10512.0,), 3: (8151.0,)})), "sync from 1")
    assert "4,503, 10,512, 8,151 samples/s at 1, 2, 3 workers" in once and "peaking" not in once, once
    # a monotone curve keeps its sentence
    assert "at 2 workers" not in sentence(told(_scaled({1: (4500.0, 4506.0), 2: (6000.0, 6010.0),
                                                        3: (8150.0, 8152.0)})), "sync from 1")


@pytest.mark.timeout(60)
def test_the_straggler_table_of_the_simulation_docs_writes_samples_per_s_as_the_report_does():
    # docs/simulation.md gave 7,581 for the 64-worker ssp s = 16 run, whose report says 7,580:
    # compare.json holds 41,334 samples in 5.452678 virtual s, 7,580.495 a second (stored 7,580.5)
    import pathlib

    from psgd.report import build_rows, render
    sps = round(41334 / 5.452678, 2)
    row = run("ssp:staleness=16", "ssp", params={"staleness": 16}, workers=64, sps=sps, evals=[], acc=None)
    assert "| 7,580 |" in render(build_rows([row]), CTX, [])
    doc = (pathlib.Path(__file__).parent.parent / "docs" / "simulation.md").read_text()
    assert "| 64 | ssp s = 16 | 7,580 |" in doc


def _saved(monkeypatch, name: str) -> list:
    """The figures make_plots saves as `name`, kept for inspection."""
    figure = pytest.importorskip("matplotlib.figure")
    figs: list = []
    savefig = figure.Figure.savefig
    monkeypatch.setattr(figure.Figure, "savefig", lambda self, path, *a, **k: (
        figs.append(self) if str(path).endswith(name) else None, savefig(self, path, *a, **k))[1])
    return figs


@pytest.mark.timeout(120)
def test_a_configuration_has_one_colour_in_every_plot(tmp_path, monkeypatch):
    # `--modes sync,async --workers 1,2,3`: the staleness histograms coloured sync at 1, 2 and 3
    # workers blue, red and pink, while the worker-count plot drew sync as one blue line
    to_hex = pytest.importorskip("matplotlib.colors").to_hex

    from psgd.report import build_rows
    from psgd.report_plots import make_plots
    hists, workers, bars = (_saved(monkeypatch, n) for n in ("staleness.png", "sweep_workers.png", "throughput.png"))
    res = [run(m, m, repeat=k, workers=w, sps=(1000.0 if m == "sync" else 1500.0) * w + k)
           for m in ("sync", "async") for w in (1, 2, 3)
           for k in range(2)]
    make_plots(str(tmp_path), build_rows(res), 0.9, 0.5)
    by_panel = {ax.get_title().split(" (")[0] + f" {ax.get_title().split('(')[1][:3]}": to_hex(ax.patches[0]
                .get_facecolor()) for ax in hists[0].axes if ax.patches}
    line = {text.get_text(): to_hex(h.get_color()) for h, text in
            zip(workers[0].axes[0].get_legend().legend_handles, workers[0].axes[0].get_legend().get_texts(),
                strict=True)}
    for mode in ("sync", "async"):
        assert {by_panel[f"{mode} {w} w"] for w in (1, 2, 3)} == {line[mode]}, (by_panel, line)
    assert line["sync"] != line["async"]
    ticks = [t.get_text().split("\n")[0] for t in bars[0].axes[0].get_xticklabels()]
    assert {to_hex(p.get_facecolor()) for t, p in zip(ticks, bars[0].axes[0].patches, strict=True)
            if t == "sync"} == {line["sync"]}


@pytest.mark.timeout(120)
def test_accuracy_curves_that_coincide_or_have_one_score_stay_visible_and_the_legend_says_what_is_faint(
        tmp_path, monkeypatch):
    # `psgd simulate --modes sync,ssp:staleness=0,async --workers 1,2,3 --repeats 2`: at 1 worker the
    # three curves are one, and only async's (drawn last) showed; a curve of one score was a small
    # dot under the lines; the repeats' faint lines were in no legend; the worker-count plot's
    # ssp line hid sync's
    from psgd.report import build_rows
    from psgd.report_plots import make_plots
    curves, workers = _saved(monkeypatch, "accuracy_vs_samples.png"), _saved(monkeypatch, "sweep_workers.png")
    res = [run(label, mode, repeat=k, workers=w, params=params, sps=1000.0 * w)
           for label, mode, params in (("sync", "sync", {}), ("ssp:staleness=0", "ssp", {"staleness": 0}))
           for w in (1, 2) for k in range(2)]
    res += [run("async", "async", repeat=k, workers=w, evals=[{"t": 1.0, "samples": 900, "accuracy": 0.6}])
            for w in (1, 2) for k in range(2)]
    make_plots(str(tmp_path), build_rows(res), 0.9, 0.5)
    ax = curves[0].axes[0]
    lines = {line.get_label(): line for line in ax.lines}
    assert "ssp (bound s=0) (1 w), dashed on sync (1 w)'s line" in lines, list(lines)
    assert lines["ssp (bound s=0) (1 w), dashed on sync (1 w)'s line"].get_linestyle() != "-"
    assert "faint: each configuration's other repeats" in lines
    single = lines["async (1 w)"]
    assert single.get_markersize() >= 8 and single.get_zorder() > lines["sync (1 w)"].get_zorder()
    texts = [t.get_text() for t in workers[0].axes[0].get_legend().get_texts()]
    assert "ssp (bound s=0), dashed on sync's line" in texts, texts


def _no_once_tie(text: str) -> None:
    """No sentence calls two values "not told apart" for the reason that each ran once (ONCE)."""
    from psgd.report_numbers import ONCE
    for line in text.splitlines():
        assert not ("not told apart" in line and ONCE in line), line
    assert "not told apart from the one before it" not in text   # the order's ≈ legend, "both run once"


@pytest.mark.timeout(60)
def test_values_measured_once_are_not_called_not_told_apart_however_far_apart():
    # `psgd compare --modes ssp:staleness=0,1,2,4,8 --workers 3 --set train.steps=100`: "The
    # sequential baseline reached the target in 0.0174 s, not told apart from ssp (bound s=4)
    # (3 w)'s 0.63 s": 36x apart, each run once, so unranked, not tied
    from psgd.report_numbers import ONCE
    base = run("baseline", "baseline", ttt=0.0174, wall=0.1, acc=0.9833, sps=63000.0, workers=1,
               evals=[{"t": 0.0174, "samples": 100, "accuracy": 0.91}, {"t": 0.1, "samples": 200, "accuracy": 0.9833}])
    sweep = [run(f"ssp:staleness={s}", "ssp", params={"staleness": s}, sweep="staleness", workers=3, ttt=t,
                 acc=a, wall=2.0) for s, t, a in ((0, 0.60, 0.9805), (4, 0.63, 0.9444))]
    text = told([base, *sweep])
    _no_once_tie(text)
    assert f"The sequential baseline reached the target in 0.0174 s ({ONCE})." in text, text
    assert f"ssp (bound s=4) (3 w) is not ranked against it ({ONCE})" in sentence(text, "The sequential baseline ended")
    # the straggler comparison: one configuration's time resolved, against the baseline's
    ctx = {**CTX, "faults": {"slow_rank": 1, "slow_factor": 4.0}, "workers": [3]}
    text = told([base, run("sync", workers=3, ttt=0.59, wall=2.0)], ctx)
    _no_once_tie(text)
    assert f"0.029× the speed of the sequential baseline, which needed 0.0174 s; {ONCE})" in text, text


@pytest.mark.timeout(60)
def test_rows_measured_once_among_repeated_ones_are_not_ranked_nor_tied_with_each_other():
    # async and ssp ran once each, sync twice: async against ssp (3x apart in time to target, 3x in
    # samples/s, 3x in staleness) was "not told apart (ran once ...)"
    from psgd.report_numbers import ONCE
    results = [run("sync", repeat=k, ttt=2.0 + k / 50, sps=2000.0 + k, stal=0.0, wall=6.0) for k in range(2)]
    results += [run("async", "async", ttt=1.0, sps=9000.0, stal=3.0, wall=6.0),
                run("ssp", "ssp", ttt=3.0, sps=3000.0, stal=1.0, wall=6.0)]
    text = told(results)
    _no_once_tie(text)
    assert f"Not ranked against async (2 w)'s time: ssp (2 w) ({ONCE})." in text, text
    assert f"but **ssp** (3,000) is not ranked against it ({ONCE})" in sentence(text, "Highest throughput")
    assert f"highest in **async** (3.00, max 2), not ranked against **ssp** ({ONCE})" in text, text


@pytest.mark.timeout(60)
def test_a_mode_that_records_no_staleness_has_none_in_the_table_nor_the_reading():
    # ltfb's trainers are independent: summary.json's staleness.hist is empty (README: "none in
    # ltfb"), yet the table gave it a measured staleness "0.00 / 0" and the reading "ltfb's is 0"
    from psgd.report import build_rows, render
    results = [run("sync", ttt=1.0, wall=3.0),
               run("ltfb", "ltfb", ttt=1.2, wall=3.0, staleness={"mean": 0.0, "max": 0, "hist": {}})]
    report = render(build_rows(results), CTX, [])
    row = next(line for line in report.splitlines() if line.startswith("| ltfb"))
    assert row.split(" | ")[5] == "—", row
    assert next(line for line in report.splitlines() if line.startswith("| sync")).split(" | ")[5] == "0.00 / 2"
    assert "ltfb: 0)" not in report and "ltfb's is 0" not in report
    assert "ltfb: none recorded" in report
    assert "ltfb records no staleness (independent trainers" in told(results)
