"""The report after using `psgd compare` as a user choosing between modes would: one test
per defect found so, each on crafted compare.json entries (no processes)."""
from __future__ import annotations

import json
import os

import pytest

from psgd.report import main as report_main

from .test_report_claims import CTX, run, sentence, told
from .test_report_review import _folder, _one_line_error

pytestmark = pytest.mark.unit


def first_seen_at(t, wall=4.0, acc=0.95):
    """Evaluations of a run already above the target at the evaluator's first score, at t."""
    return [{"t": t, "samples": 500, "accuracy": 0.91, "loss": 0.4},
            {"t": wall + 0.1, "samples": 2000, "accuracy": acc, "loss": 0.3}]


@pytest.mark.timeout(60)
def test_a_configuration_known_to_be_sooner_keeps_the_best_resolved_one_from_being_called_first():
    # sync,async,ssp at 2 workers: ssp's 1.10 s was the one resolved time, and the reading said
    # "First to reach 0.9 test accuracy, of the configurations whose time is resolved: ssp after
    # 1.10 s" while sync and async had been above 0.9 at the evaluator's first score, 0.55 s and 0.53 s.
    res = [run("sync", repeat=i, ttt=0.55 + 0.01 * i, evals=first_seen_at(0.55 + 0.01 * i)) for i in range(2)]
    res += [run("async", "async", repeat=i, ttt=0.53, evals=first_seen_at(0.53)) for i in range(2)]
    res += [run("ssp", "ssp", repeat=i, ttt=1.1 + 0.02 * i) for i in range(2)]
    text = told(res)
    assert "First to reach" not in text
    assert "Shortest resolved time to 0.9 test accuracy: **ssp** after 1.11 s" in text
    assert sentence(text, "Not the first") == (
        "Not the first to get there: sync (2 w) was already at 0.9 by 0.56 s and async (2 w) by 0.53 s, sooner, "
        "though their times are not resolved (below).")
    # Unranked configurations seen above the target only later: ssp may have been first, among one
    late = [dict(r, time_to_target_s=1.5, evals=first_seen_at(1.5)) for r in res[:4]] + res[4:]
    text = told(late)
    assert "Not the first" not in text and "First to reach" not in text
    assert "Time to 0.9 test accuracy of the one configuration whose time is resolved: **ssp** after 1.11 s" in text
    # Two resolved, one unranked later: "first" among the resolved holds, where the next is more
    # than one evaluation period (0.5 s) behind; "shortest" where it is not
    two = [dict(r, time_to_target_s=1.5, evals=first_seen_at(1.5)) for r in res[:2]] + res[2:]
    two[2:4] = [run("async", "async", repeat=i, ttt=1.7 + 0.02 * i) for i in range(2)]
    text = told(two)
    assert "First to reach 0.9 test accuracy, of the configurations whose time is resolved: **ssp** after 1.11 s" \
        in text and "Not the first" not in text
    two[2:4] = [run("async", "async", repeat=i, ttt=1.2 + 0.02 * i) for i in range(2)]
    text = told(two)
    assert "Shortest time to 0.9 test accuracy, of the configurations whose time is resolved: **ssp** after 1.11 s" \
        in text and "First to reach" not in text


@pytest.mark.timeout(60)
def test_merging_into_a_folder_that_holds_a_comparisons_runs_is_refused(tmp_path, capsys):
    # `python -m psgd.report A B`, meant as "merge A and B", replaced A's compare.json with B's runs
    a = _folder(tmp_path / "a", [run("sync:wire.dtype=float32", params={"wire.dtype": "float32"})],
                {**CTX, "command": "psgd compare a"})
    b = _folder(tmp_path / "b", [run("async", "async")], {**CTX, "command": "psgd compare b"})
    before = open(os.path.join(a, "compare.json")).read()
    assert report_main([a, b]) == 2
    err = _one_line_error(capsys)
    assert f"the output folder {a} holds the runs of a psgd compare or simulate" in err
    assert f"python -m psgd.report NEW {a} {b}" in err
    assert open(os.path.join(a, "compare.json")).read() == before and not os.path.exists(os.path.join(a, "report.md"))
    # so is one without a context (no merge wrote it); a new folder, or an earlier merge's, is written
    os.unlink(os.path.join(a, "compare-context.json"))
    assert report_main([a, b]) == 2
    _one_line_error(capsys)
    m = str(tmp_path / "m")
    assert report_main([m, a, b]) == 0
    assert report_main([m, b, a]) == 0 and report_main([m, b]) == 0
    assert [r["label"] for r in json.load(open(os.path.join(m, "compare.json")))] == ["async"]


@pytest.mark.timeout(60)
def test_refused_steps_are_said_since_their_batches_count_in_the_throughput():
    # sync:optimizer.lr=0.1,50: the lr=50 run finished with 138 of 538 steps refused (NaN
    # gradients), "samples 17,216" of a 12,800 budget and 16,331 samples/s, and the report
    # said nothing of it
    res = [run("sync:optimizer.lr=0.1", params={"optimizer.lr": 0.1}, sweep="optimizer.lr", repeat=i, rejected=0)
           for i in range(2)]
    res += [run("sync:optimizer.lr=50", params={"optimizer.lr": 50}, sweep="optimizer.lr", repeat=i, acc=0.1,
                rejected=k) for i, k in enumerate((0, 138))]
    line = sentence(told(res), "Refused steps")
    assert "**sync:optimizer.lr=50**: 138 in 1 of its 2 finished runs." in line
    assert "lr=0.1" not in line and "their batches count in samples and samples/s" in line
    assert "Refused steps" not in told(res[:2])


@pytest.mark.timeout(60)
def test_unranked_configurations_of_a_worker_sweep_are_told_apart_by_their_worker_count():
    # --modes sync,async --workers 1,2: "Not ranked by time to 0.9: sync (...); async (...);
    # sync (...); async (...)", two rows of each name with nothing to tell which was which;
    # and a sweep at one worker was "(1 workers)"
    res = [run(m, m, workers=w, ttt=0.6, wall=0.5, evals=first_seen_at(0.6, wall=0.5))
           for w in (1, 2) for m in ("sync", "async")]
    line = sentence(told(res), "Not ranked by time to 0.9")
    for w, n in ((1, "1 worker"), (2, "2 workers")):
        assert f"sync with {n} (first scored ≥ 0.9 at 0.60 s" in line and f"async with {n} (first" in line, w
    sweep = [run(f"ssp:staleness={s}", "ssp", params={"staleness": s}, sweep="staleness", workers=1) for s in (1, 4)]
    assert "over 1, 4 (1 worker):" in sentence(told(sweep), "Sweep of ssp")
    assert "with 1 worker" not in sentence(told(res[:2]), "Not ranked by time to 0.9")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sets", [[], ["train.steps=20"]])
def test_a_fault_from_the_config_file_is_stated_as_one_from_a_set_is(tmp_path, sets):
    # A helper's review: `[faults] slow_rank = 1, slow_factor = 2` in the config file (no --set)
    # left the report without its "Injected fault" line: only a report with --set or merged
    # folders stated the fault.
    ctx = {**CTX, "sets": sets, "faults": {"slow_rank": 1, "slow_factor": 2.0}}
    out = _folder(tmp_path / "c", [run("sync"), run("async", "async")], ctx)
    assert report_main([out]) == 0
    text = open(os.path.join(out, "report.md")).read()
    assert "**Injected fault:** worker rank 1 is an injected straggler: each of its steps takes 2× as long" in text


@pytest.mark.timeout(60)
def test_a_wide_accuracy_range_is_not_called_hardly_separating_when_one_configuration_is_noisy():
    # A helper's review: with --repeats 2, one configuration's repeats at 0.66 and 0.91 made the
    # reading say "Final accuracy hardly separates the configurations: all lie between 0.6588 and 0.9136".
    res = [run("sync", repeat=0, acc=0.66), run("sync", repeat=1, acc=0.91)]
    res += [run("async", "async", repeat=i, acc=0.90 + 0.01 * i) for i in range(2)]
    text = told(res)
    assert "hardly separates" not in text
    assert sentence(text, "Final accuracy") == (
        "Final accuracy ranged from 0.7850 (**sync**) to 0.9050 (**async**), which does not tell the "
        "configurations apart: it is within twice the run-to-run sd of the repeats of **sync** (0.1768).")
    close = [run("sync", repeat=i, acc=0.920) for i in range(2)] + [run("async", "async", repeat=i, acc=0.922)
                                                                    for i in range(2)]
    assert sentence(told(close), "Final accuracy") == \
        "Final accuracy hardly separates the configurations: all lie between 0.9200 and 0.9220."


@pytest.mark.timeout(60)
def test_a_set_that_two_of_three_merged_folders_had_is_not_said_to_be_only_one_folders(tmp_path):
    # A helper's review: merging simA, simC (both --set sim.compute_s=0.001) and a real folder said
    # of each simulated folder that "only this folder's had `--set sim.compute_s=0.001`".
    a = _folder(tmp_path / "a", [run("sync")], {**CTX, "command": "psgd compare a", "sets": ["x.y=1"]})
    c = _folder(tmp_path / "c", [run("async", "async")], {**CTX, "command": "psgd compare c", "sets": ["x.y=1"]})
    r = _folder(tmp_path / "r", [run("ssp", "ssp")], {**CTX, "command": "psgd compare r", "sets": []})
    out = str(tmp_path / "m")
    assert report_main([out, a, c, r]) == 0
    text = open(os.path.join(out, "report.md")).read()
    assert "only this folder" not in text
    assert text.count("its runs also had `--set x.y=1` (not every merged folder's did)") == 2


@pytest.mark.timeout(60)
def test_an_unranked_time_within_the_evaluation_period_or_the_spread_is_not_called_sooner():
    # ssp:staleness=0,2,8 at 2 workers, 2 repeats: "Not the first to get there: ssp (bound s=2) (2 w)
    # was already at 0.9 by 0.57 s, sooner" than s=8's resolved 0.60 s, though 0.57 was the mean of
    # 0.49 (the evaluator's first score) and 0.64 (resolved, later than both of s=8's repeats): less
    # than one 0.5 s evaluation period and less than one sd apart.
    res = [run("ssp:staleness=2", "ssp", repeat=0, ttt=0.49, evals=first_seen_at(0.49)),
           run("ssp:staleness=2", "ssp", repeat=1, ttt=0.64),
           run("ssp:staleness=8", "ssp", repeat=0, ttt=0.586), run("ssp:staleness=8", "ssp", repeat=1, ttt=0.621)]
    text = told(res)
    assert "Not the first" not in text and "sooner" not in text
    assert "Time to 0.9 test accuracy of the one configuration whose time is resolved: **ssp:staleness=8** " \
           "after 0.60 s" in text
    assert "Not ranked by time to 0.9: ssp:staleness=2 (already ≥ 0.9 at the evaluator's first score, 0.49 s, " \
           "less than one evaluation period (0.5 s) after the start; 1 of 2 repeats)" in text


@pytest.mark.timeout(60)
def test_a_single_configuration_is_not_called_first_or_highest():
    # `psgd compare --modes sync --no-baseline`: "Every configuration ran once: ... the values below are
    # stated but not ranked", then "First to reach 0.9 test accuracy: **sync**" and "Highest
    # throughput: **sync**", with nothing to rank it against.
    for res in ([run("sync", ttt=1.2, sps=9066.0)], [run("sync", repeat=i, ttt=1.2 + 0.1 * i) for i in range(2)]):
        text = told(res)
        assert "First" not in text and "Highest" not in text and "lowest" not in text
        assert "Time to 0.9 test accuracy: **sync** after 1.2" in text
        sps = "9,066" if len(res) == 1 else "5,000"
        assert sentence(text, "Throughput") == f"Throughput: **sync** {sps} samples/s."


@pytest.mark.timeout(60)
def test_a_score_at_0_s_is_not_drawn_on_the_log_time_axis(tmp_path, monkeypatch):
    # The default comparison's accuracy_vs_time.png (log axis): the baseline's first score, at 0 s
    # and accuracy 0.03, was clipped by matplotlib to the axis' far left and drawn as a flat line at
    # 0.45 (its next score's, at 0.05 s) from 0.003 s on: a curve no score measured.
    plt = pytest.importorskip("matplotlib.pyplot")
    from psgd.report import build_rows
    from psgd.report_plots import _colors, _curve_plot
    base = run("baseline", "baseline", workers=1, ttt=0.06, wall=0.2,
               evals=[{"t": 0.0, "samples": 0, "accuracy": 0.03, "loss": 2.3},
                      {"t": 0.05, "samples": 1000, "accuracy": 0.45, "loss": 1.0},
                      {"t": 0.06, "samples": 2000, "accuracy": 0.92, "loss": 0.3}])
    rows = build_rows([base, run("sync", ttt=1.2)])
    drawn = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, *a, **k: drawn.extend(
        (list(line.get_xdata()), fig.axes[0].get_xscale(), fig.axes[0].get_xlabel()) for line in fig.axes[0].lines))
    _curve_plot(plt, rows, _colors(rows), "t", "wall time since training started (s)", 0.9,
                str(tmp_path / "a.png"))
    assert drawn and all(scale == "log" for _, scale, _ in drawn)
    assert all(x > 0 for xs, _, _ in drawn[:-1] for x in xs)   # (the last line: the target's)
    assert drawn[0][2] == "wall time since training started (s) (log scale; scores at 0 s not drawn)"


@pytest.mark.timeout(60)
def test_a_time_shared_with_another_is_not_called_first():
    # `psgd simulate --modes sync,async --workers 2 --set eval.every_seconds=0.1`: both first scored
    # >= 0.9 at 0.20 virtual s, and the reading said "First to reach 0.9 test accuracy: **sync** after
    # 0.20 s" before its order called the two equal
    sim = {"wall": 1.3, "simulated": True, "eval_every_s": 0.1,
           "evals": [{"t": 0.1, "samples": 100, "accuracy": 0.5, "loss": 1.0},
                     {"t": 0.2, "samples": 200, "accuracy": 0.91, "loss": 0.3}]}
    for results in ([run("sync", ttt=0.2, **sim), run("async", "async", ttt=0.2, **sim)],
                    [run("sync", repeat=r, ttt=1.0) for r in range(2)]
                    + [run("easgd", "easgd", repeat=r, ttt=1.0) for r in range(2)]
                    + [run("async", "async", repeat=r, ttt=2.0) for r in range(2)]):
        text = told(results)
        assert "First to reach" not in text
        assert "Shortest time to 0.9 test accuracy: **sync** after" in text
        assert "(equal)" in sentence(text, "Not told apart from")
    # told apart: first
    text = told([run("sync", repeat=r, ttt=1.0) for r in range(2)]
                + [run("async", "async", repeat=r, ttt=2.0) for r in range(2)])
    assert "First to reach 0.9 test accuracy: **sync** after 1.00 s" in text


@pytest.mark.timeout(60)
def test_no_accuracy_is_the_reason_no_staleness_relation_is_claimed():
    # `psgd simulate --modes sync,ssp:staleness=0,1,2,async --repeats 3 --set sim.train=false`: "no relation
    # to final accuracy is claimed: that takes at least 5 configurations of sync, ssp or async with 3 or more
    # repeats each, and this comparison has 5"
    plan = [("sync", "sync", 0.0), ("ssp:staleness=0", "ssp", 1.0), ("ssp:staleness=1", "ssp", 1.5),
            ("ssp:staleness=2", "ssp", 2.0), ("async", "async", 2.5)]
    timing = [run(label, mode, repeat=r, stal=stal, evals=[], final_accuracy=None, simulated=True)
              for label, mode, stal in plan for r in range(3)]
    said = sentence(told(timing), "Measured staleness")
    assert "this comparison has" not in said
    assert said.endswith("no relation to final accuracy is claimed: no run of sync, ssp or async has one (no "
                         "evaluator, or a timing-only simulation).")
    # scored, but one configuration's third repeat has no final accuracy: it is not among those counted
    scored = [run(label, mode, repeat=r, stal=stal) for label, mode, stal in plan for r in range(3)]
    scored[-1] = {**scored[-1], "final_accuracy": None}
    assert "3 or more scored repeats each, and this comparison has 4." in sentence(told(scored), "Measured staleness")


@pytest.mark.timeout(60)
def test_runs_without_an_evaluator_are_not_said_to_be_scored():
    # `psgd simulate ... --set cluster.evaluator=false`: the report said "so accuracy is real" and "distributed
    # runs are scored every 0.5 s by the evaluator", though no run was scored
    from psgd.report import render
    from psgd.report_numbers import build_rows
    unscored = [run(label, mode, evals=[], final_accuracy=None, simulated=True) for label, mode in
                (("sync", "sync"), ("async", "async"))]
    sim = {"train": True, "compute_s": 0.01, "compute_cv": 0.0, "latency_s": 5e-5, "bandwidth_gbps": 10,
           "apply_gbps": 20}
    text = render(build_rows(unscored), {**CTX, "simulated": sim}, [])
    assert "Time to target: none; no distributed run was scored (no evaluator: cluster.evaluator = false" in text
    # a review: every distributed run failed (the baseline ran): not the evaluator's doing
    failed = render(build_rows([run("baseline", "baseline", workers=1), {**run("sync"), "error": "it broke"}]),
                    CTX, [])
    assert "no distributed run was scored" not in failed
    # a review: a simulated run whose summary's sim lacks keys was a TypeError
    from psgd.report import simulated_rows_cost
    rows = build_rows([run("sync"), run("sync", simulated=True, sim={"train": True})])
    assert "lognormal spread cv ?" in simulated_rows_cost(rows)
    assert "scored every" not in text and "accuracy is real" not in text
    assert "training is real, but no run was scored (no evaluator)" in text
    scored = render(build_rows([run("sync"), run("async", "async")]), {**CTX, "simulated": sim}, [])
    assert "distributed runs are scored every 0.5 s" in scored and "so accuracy is real" in scored


@pytest.mark.timeout(60)
def test_a_fault_that_a_mode_item_sets_is_stated_for_its_rows():
    # `--modes sync:faults.step_delay_s=0.01,async`: the report had no "Injected fault" line
    # (only --set or the config's faults made one); the fault showed only in the row's label
    from psgd.report import build_rows, render
    delayed = run("sync:faults.step_delay_s=0.01", params={"faults.step_delay_s": 0.01})
    faults = {"slow_rank": -1, "slow_factor": 1.0, "step_delay_s": 0.0, "jitter_prob": 0.0, "jitter_s": 0.0}
    text = render(build_rows([delayed, run("async", "async")]), {**CTX, "faults": faults}, [])
    assert ("**Injected fault in sync:faults.step_delay_s=0.01:** every step of every worker is delayed by 0.01 s "
            "(a slow link).") in text
    assert "**Injected fault:**" not in text and "async:" not in text
    # with a fault for every run too: the item's line gives all its run had, the item's value in place
    straggler = {**faults, "slow_rank": 1, "slow_factor": 2.0, "step_delay_s": 0.05}
    text = render(build_rows([delayed, run("async", "async")]), {**CTX, "faults": straggler}, [])
    assert "**Injected fault:** worker rank 1 is an injected straggler" in text
    line = sentence(text, "**Injected fault in sync")
    assert "worker rank 1 is an injected straggler" in line and "delayed by 0.01 s" in line
    assert "0.05" not in line and "baseline" not in line
    # an item that turns the fault off says so
    off = run("sync:faults.step_delay_s=0", params={"faults.step_delay_s": 0.0})
    text = render(build_rows([off]), {**CTX, "faults": {**faults, "step_delay_s": 0.05}}, [])
    assert "**No injected fault in sync:faults.step_delay_s=0:**" in text


def short_compression_sweep() -> list[dict]:
    """sync:wire.compression=none,onebit,topk, 2 repeats, scored once during training: only
    none's first repeat reached 0.9."""
    def scored_once(value, repeat, ttt=None):
        evals = [{"t": 0.3, "samples": 600, "accuracy": 0.5 if ttt is None else 0.92, "loss": 1.0},
                 {"t": 0.5, "samples": 1280, "accuracy": 0.8, "loss": 0.6}]
        return run(f"sync:wire.compression={value}", params={"wire.compression": value}, sweep="wire.compression",
                   repeat=repeat, wall=0.4, ttt=ttt, acc=0.8, evals=evals)
    return [scored_once(v, i, ttt=0.3 if (v, i) == ("none", 0) else None)
            for v in ("none", "onebit", "topk") for i in range(2)]


@pytest.mark.timeout(120)
def test_a_sweep_plots_title_fits_its_figure(tmp_path, monkeypatch):
    # `psgd compare --modes sync:wire.compression=none,onebit,topk --repeats 2` with a short budget:
    # the sweep plot's second title line ("(none: 1/2 reached; onebit: not seen ≥ 0.9 in at most 1
    # score during training, 2 of 2 repeats; topk: ...)") ran past both edges of the figure, cut
    matplotlib = pytest.importorskip("matplotlib")
    pytest.importorskip("matplotlib.figure")
    from psgd.report import write_report
    from psgd.report_plots import plt_or_none
    plt_or_none()
    titles: list[tuple[str, bool]] = []
    savefig = matplotlib.figure.Figure.savefig

    def keep(self, *a, **k):
        savefig(self, *a, **k)
        renderer = self.canvas.get_renderer()
        for ax in self.axes:
            box = ax.title.get_window_extent(renderer)
            titles.append((ax.title.get_text(), box.x0 >= 0 and box.x1 <= self.bbox.width))
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)

    write_report(str(tmp_path), short_compression_sweep(), CTX)
    sweep = [(t, fits) for t, fits in titles if t.startswith("sync: wire.compression sweep")]
    assert sweep and "onebit, topk: not seen ≥ 0.9 in 1 score during" in sweep[0][0], titles
    assert all(fits for _, fits in titles), titles


@pytest.mark.timeout(60)
def test_the_note_on_configurations_run_once_is_grammatical():
    # merging a --repeats 2 folder with a folder of single runs: "...no run-to-run spread was
    # measured for them: them are ranked only against configurations whose repeats measured one"
    res = [run("sync", repeat=i) for i in range(2)] + [run("async", "async"), run("ssp", "ssp")]
    assert sentence(told(res), "a single successful run") == (
        "async (2 w), ssp (2 w): a single successful run, so no run-to-run spread was measured for them: they "
        "are ranked only against configurations whose repeats measured one, by that spread, and not against each "
        "other.")
    assert "measured for it: it is ranked only" in sentence(told(res[:3]), "a single successful run")


@pytest.mark.timeout(60)
def test_a_sweeps_times_to_target_are_as_many_as_its_values():
    # the sweep sentence of --modes sync:wire.compression=none,onebit,topk read "time to target 0.61 s
    # (1/2 reached), not seen ≥ 0.9 in 1 score during training, 2 of 2 repeats, not seen ≥ 0.9 in 1
    # score during training, 2 of 2 repeats": five items, by its commas, for three values
    line = sentence(told(short_compression_sweep()), "Sweep of sync wire.compression")
    assert ("time to target 0.30 s (1/2 reached), (not seen ≥ 0.9 in 1 score during training, 2 of 2 repeats), "
            "(not seen ≥ 0.9 in 1 score during training, 2 of 2 repeats);") in line
