"""The report after a review of its claims and of `python -m psgd.report`: one test per
defect the review demonstrated, each on crafted compare.json entries (no processes)."""
from __future__ import annotations

import json
import os

import pytest

from psgd.report import build_rows, render, write_report
from psgd.report import main as report_main
from psgd.report_plots import curve_points, make_plots
from psgd.report_relations import ONCE, noise_note, tie_reason

from .test_report_claims import CTX, run, sentence, told

pytestmark = pytest.mark.unit

# Phrases that rank one configuration above another, or a trend along a sweep.
RANKING = ("Highest throughput", "lowest:", " rose", " fell", "went up and down", "ranged from", "highest in",
           "First to reach", "Order to the target", "sooner than", "ended higher", "ended lower")


def scores(*points):
    """An evaluation curve from (t, accuracy) points, 100 samples a score."""
    return [{"t": t, "samples": 100 * (i + 1), "accuracy": a, "loss": 1.0} for i, (t, a) in enumerate(points)]


# ---------------------------------------------------------------- 1. single repeats are not ranked


@pytest.mark.timeout(60)
def test_values_of_single_repeats_are_stated_without_being_ranked():
    # Two identical configurations differed by 46% in samples/s; one repeat ranked anything 1% apart.
    results = [run("baseline", "baseline", ttt=1.0, sps=30000.0, workers=1, wall=5.0),
               run("sync", ttt=2.0, sps=5000.0, acc=0.95, wait=0.6),
               run("async", "async", ttt=2.6, sps=7300.0, acc=0.93, stal=2.0),
               run("ssp:staleness=0", "ssp", params={"staleness": 0}, sweep="staleness", ttt=3.0, sps=6000.0,
                   stal=0.5),
               run("ssp:staleness=4", "ssp", params={"staleness": 4}, sweep="staleness", ttt=3.5, sps=6500.0,
                   acc=0.91, stal=1.5)]
    text = told(results)
    for phrase in RANKING:
        assert phrase not in text, (phrase, text)
    assert ("Throughput: **sync** 5,000, **async** 7,300, **ssp (bound s=0)** 6,000, **ssp (bound s=4)** 6,500 "
            f"samples/s ({ONCE}).") in text
    assert f"Time to 0.9 test accuracy: **sync** 2.00 s, **async** 2.60 s, **ssp (bound s=0)** 3.00 s, " \
           f"**ssp (bound s=4)** 3.50 s ({ONCE})." in text
    assert f"(max 2), **ssp (bound s=4)** 1.50 (max 2) ({ONCE})" in sentence(text, "Measured staleness (mean")
    sweep = sentence(text, "Sweep of ssp")
    assert "throughput 6,000, 6,500 samples/s; time to target 3.00, 3.50 s; final accuracy 0.9200, 0.9100; " \
           f"measured staleness (mean) 0.50, 1.50; each value {ONCE}." in sweep
    assert f"The sequential baseline alone processed 30,000 samples/s ({ONCE})." in text
    assert "ran once: no spread measured" in sentence(text, "blocked on the servers")
    assert "not ranked" in sentence(text, "Every configuration ran once")
    assert tie_reason([5000.0], [7300.0]) == ONCE and tie_reason([5000.0], [5000.0]) == "equal"
    assert noise_note([[5000.0], [5030.0]]) == f"; {ONCE}"


@pytest.mark.timeout(60)
def test_repeats_with_a_spread_still_rank():
    # The existing behaviour where repeats measured a spread: ranked against it.
    results = [run("sync", repeat=r, sps=5000.0 + 10 * r, ttt=2.0 + 0.01 * r) for r in range(2)]
    results += [run("async", "async", repeat=r, sps=7300.0 + 10 * r, ttt=2.6 + 0.01 * r) for r in range(2)]
    text = told(results)
    assert "Highest throughput: **async** with 7,305 samples/s" in text
    assert "First to reach 0.9 test accuracy: **sync** after 2.00 s" in text
    assert ONCE not in text
    # one single-repeat configuration is ranked only by the other's spread; two of them not against each other
    mixed = results + [run("ssp", "ssp", sps=5001.0), run("easgd", "easgd", sps=9000.0)]
    said = sentence(told(mixed), "Throughput")
    assert "Highest throughput" not in said and ONCE in said


@pytest.mark.timeout(60)
def test_a_single_repeat_worker_sweep_says_it_ran_once():
    results = [run("sync", workers=w, sps=s) for w, s in ((2, 5000.0), (4, 7000.0))]
    assert f"(each worker count {ONCE})" in sentence(told(results), "from 2 to 4 workers")
    repeated = [run("sync", r, workers=w, sps=s + r) for w, s in ((2, 5000.0), (4, 7000.0)) for r in range(2)]
    assert ONCE not in told(repeated)


# ---------------------------------------------------------------- 2. "never reached" needs scores


@pytest.mark.timeout(60)
def test_a_target_not_seen_in_too_few_training_scores_is_not_called_missed(tmp_path):
    # async was scored once while it trained (and once after), sync reached the target.
    results = [run("sync", ttt=2.0, wall=4.0, evals=scores((1.0, 0.6), (2.0, 0.92), (4.1, 0.93))),
               run("async", "async", wall=4.0, acc=0.88, evals=scores((1.0, 0.6), (4.1, 0.88))),
               run("ssp", "ssp", wall=4.0, acc=0.87, evals=scores((4.2, 0.87)))]     # scored only after training
    text = told(results)
    assert "Never reached" not in text
    said = sentence(text, "Not known to have missed 0.9")
    assert "async (2 w) (not seen ≥ 0.9 in 1 score during training)" in said
    assert "ssp (2 w) (not seen ≥ 0.9 in 0 scores during training)" in said
    report = open(write_report(str(tmp_path), results, CTX)).read()
    assert "| not seen (1 score in training) |" in next(x for x in report.splitlines() if x.startswith("| async |"))
    # scored twice or more while training: a miss
    results[1] = run("async", "async", wall=4.0, acc=0.88, evals=scores((1.0, 0.6), (3.0, 0.8), (4.1, 0.88)))
    assert "Never reached 0.9: async (2 w)." in told(results)


@pytest.mark.timeout(60)
def test_a_repeat_scored_too_rarely_is_said_in_the_partial_sentence_and_the_sweep():
    reached = scores((1.0, 0.6), (2.0, 0.92), (4.1, 0.93))
    thin = scores((4.1, 0.85))
    results = [run("ssp:staleness=0", "ssp", r, ttt=2.0 if r == 0 else None, acc=0.93 if r == 0 else 0.85,
                   params={"staleness": 0}, sweep="staleness", evals=reached if r == 0 else thin) for r in range(2)]
    results += [run("ssp:staleness=2", "ssp", r, acc=0.85, params={"staleness": 2}, sweep="staleness", evals=thin)
                for r in range(2)]
    text = told(results)
    assert "ssp (bound s=0) (2 w): 1/2 reached (the others: not seen ≥ 0.9 in 0 scores during training, 1 of 2 " \
           "repeats)" in text
    assert "not seen ≥ 0.9 in 0 scores during training, 2 of 2 repeats" in sentence(text, "Sweep of ssp")
    assert "Never reached" not in text


# ---------------------------------------------------------------- 3, 4, 5: what `python -m psgd.report` reads


def _folder(path, results, ctx=None) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "compare.json"), "w") as f:
        f.write(results if isinstance(results, str) else json.dumps(results))
    if ctx is not None:
        with open(os.path.join(path, "compare-context.json"), "w") as f:
            json.dump(ctx, f)
    return str(path)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.timeout(60)
def test_merge_refuses_an_output_folder_that_is_one_of_its_inputs(tmp_path, capsys):
    c1 = _folder(tmp_path / "c1", [run("sync")], CTX)
    c2 = _folder(tmp_path / "c2", [run("async", "async")], CTX)
    before = open(os.path.join(c1, "compare.json")).read()
    assert report_main([c1, c1, c2]) == 2
    assert "psgd report: the output folder" in _one_line_error(capsys)
    os.symlink(c1, tmp_path / "link")        # the same real path under another name
    assert report_main([str(tmp_path / "link"), c2, c1 + "/"]) == 2
    _one_line_error(capsys)
    assert open(os.path.join(c1, "compare.json")).read() == before
    assert not os.path.exists(os.path.join(c1, "report.md"))


@pytest.mark.timeout(60)
def test_merge_refuses_a_folder_given_twice(tmp_path, capsys):
    c1 = _folder(tmp_path / "c1", [run("sync")], CTX)
    out = str(tmp_path / "dup")
    assert report_main([out, c1, c1]) == 2
    assert "given twice" in _one_line_error(capsys)
    os.symlink(c1, tmp_path / "again")
    assert report_main([out, c1, str(tmp_path / "again")]) == 2
    _one_line_error(capsys)
    assert not os.path.exists(out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("content, why", [
    ("[1,2]", "entry 0 is a number, not an object"), ("null", "(null, not a list of runs)"),
    ('[{"label": "sync"}]', "entry 0 has no mode, workers"), ("{}", "(an object, not a list of runs)"),
    ('[{"label": "sync", "mode": "sync", "workers": "2"}]', "entry 0's workers is '2', not a count"),
    ("{not json", "not JSON")])
def test_a_compare_json_psgd_did_not_write_is_one_line(tmp_path, capsys, content, why):
    d = _folder(tmp_path / "bad", content)
    assert report_main([d]) == 2
    err = _one_line_error(capsys)
    assert err.startswith(f"psgd report: {d}/compare.json is not a psgd compare.json (") and why in err, err
    good = _folder(tmp_path / "good", [run("sync")], CTX)
    assert report_main([str(tmp_path / "m"), good, d]) == 2      # and in a merge
    assert f"{d}/compare.json is not a psgd compare.json" in _one_line_error(capsys)
    assert not os.path.exists(tmp_path / "m")


@pytest.mark.timeout(60)
def test_what_psgd_compare_writes_is_read(tmp_path, capsys):
    from psgd.compare import build_plan, failed_entry, parse_modes, tag
    from psgd.config import load
    plan = build_plan(load(None, [], env={}), parse_modes("sync"), [2], 1)
    entries = [tag({k: v for k, v in run("baseline", "baseline", workers=1).items() if k != "label"}, plan[0],
                   "runs/b", 1.0), failed_entry(plan[1], "the coordinator exited with 1")]
    d = _folder(tmp_path / "ok", entries, CTX)
    assert report_main([d]) == 0
    assert "| sync | 2 | failed: the coordinator exited with 1" in open(os.path.join(d, "report.md")).read()
    bad_ctx = _folder(tmp_path / "ctx", entries)
    (tmp_path / "ctx" / "compare-context.json").write_text("[]")
    assert report_main([bad_ctx]) == 2
    assert "compare-context.json is not a psgd compare-context.json" in _one_line_error(capsys)


@pytest.mark.timeout(60)
def test_an_empty_compare_json_is_a_report_that_no_run_finished(tmp_path, capsys):
    ctx = {**CTX, "workers": [2], "interrupted": True,
           "not_run": ["sync, 2 workers, repeat 0", "async, 2 workers, repeat 0"],   # as psgd compare writes them
           "baseline": {"steps": 10, "samples": 320, "threads": 1}, "job": {"steps": 5}}
    d = _folder(tmp_path / "empty", [], ctx)
    assert report_main([d]) == 0
    text = open(os.path.join(d, "report.md")).read()
    assert "No run finished" in text and "No distributed run finished" in text
    # the first was stopped while it ran (not "did not run"): every one listed did not finish
    assert "**Interrupted:** 2 of 2 planned runs did not finish: sync, 2 workers, repeat 0; async, 2 workers, " \
           "repeat 0." in text


# ---------------------------------------------------------------- 6. interrupted compares


@pytest.mark.timeout(60)
def test_an_interrupted_compare_says_so_at_the_top(tmp_path):
    results = [run("sync"), run("async", "async")]
    ctx = {**CTX, "command": "psgd compare --modes sync,async,ssp --repeats 2", "interrupted": True,
           "not_run": ["async, 2 workers, repeat 1", "ssp", "ssp"]}
    text = render(build_rows(results), ctx, [])
    line = ("**Interrupted:** 3 of 5 planned runs did not finish: async, 2 workers, repeat 1; ssp ×2. This report "
            "covers the 2 that did.")
    assert line in text and text.index(line) < text.index("Model **") < text.index("## Results")
    assert "Interrupted" not in render(build_rows(results), CTX, [])
    assert "Interrupted" not in render(build_rows(results), {**CTX, "interrupted": False, "not_run": []}, [])
    assert "**Interrupted:** the command was interrupted" in render(build_rows(results),
                                                                    {**CTX, "interrupted": True}, [])
    # merged: said per folder, not taken from the first folder's context for all
    a = _folder(tmp_path / "a", results, {**ctx, "command": "psgd compare a"})
    b = _folder(tmp_path / "b", [run("ssp", "ssp")], {**CTX, "command": "psgd compare b"})
    assert report_main([str(tmp_path / "m"), b, a]) == 0
    merged = open(tmp_path / "m" / "report.md").read()
    assert f"**Interrupted:** folder {a}: 3 of 5 planned runs did not finish: async, 2 workers, repeat 1; " \
           "ssp ×2." in merged
    assert merged.count("**Interrupted:**") == 1


# ---------------------------------------------------------------- 7. accuracy vs samples


@pytest.mark.timeout(120)
def test_a_score_counted_at_zero_samples_after_the_start_is_drawn_on_the_samples_axis(tmp_path):
    # a review: the untrained model's score (read 0.086 s after the start, before any worker's
    # first step: summary.json's samples 0, the count at the read) was left off the samples
    # axis, captioned "taken before the first heartbeat counted any samples"
    evals = [{"t": 0.086, "samples": 0, "accuracy": 0.033, "loss": 2.3},   # no step yet
             {"t": 0.32, "samples": 1425, "accuracy": 0.72, "loss": 2.1},
             {"t": 0.45, "samples": 2560, "accuracy": 0.77, "loss": 1.7, "final": True}]
    r = run("sync", evals=evals)
    assert curve_points(r, "samples") == ([0.0, 1425.0, 2560.0], [0.033, 0.72, 0.77])
    assert curve_points(r, "t") == ([0.086, 0.32, 0.45], [0.033, 0.72, 0.77])
    pytest.importorskip("matplotlib")
    made = dict((n, t) for t, n in make_plots(str(tmp_path), build_rows([r]), 0.9))
    assert made["accuracy_vs_samples.png"] == "Accuracy vs samples processed"


@pytest.mark.timeout(30)
def test_the_maximum_staleness_is_exact_not_a_lower_bound():
    # the report wrote "≥63" for summary.json's exact maximum of 63 (past the histogram's last bin)
    from psgd.report_tables import smax
    assert smax(63) == "63" and smax(2) == "2" and smax(None) == "—"


@pytest.mark.timeout(30)
def test_the_detail_table_gives_the_busiest_shards_share_of_the_time():
    from psgd.report_tables import detail_table
    rows = build_rows([run("sync", repeat=0, shard_busy_fraction=[0.2, 0.5]),
                       run("sync", repeat=1, shard_busy_fraction=[0.3, 0.4]),
                       run("async", mode="async")])             # a compare.json from before the field: "—"
    table = detail_table(rows)
    assert table[0].endswith("| workers lost | busiest shard | waiting for a CPU |")
    assert next(line for line in table if line.startswith("| sync |")).endswith("| 45% | — |")
    assert next(line for line in table if line.startswith("| async |")).endswith("| — | — |")


@pytest.mark.timeout(30)
def test_the_detail_table_gives_the_training_threads_wait_for_a_cpu():
    from psgd.report_tables import detail_table
    rows = build_rows([run("baseline", "baseline", workers=1, cpu_wait_fraction=0.012),
                       run("sync", repeat=0, cpu_wait_fraction=0.2), run("sync", repeat=1, cpu_wait_fraction=0.4),
                       run("async", mode="async"),                          # before the field: "—"
                       run("ssp", mode="ssp", cpu_wait_fraction=None),      # none counted (a simulated run's null)
                       run("easgd", "easgd", cpu_wait_fraction=0.1), run("easgd", "easgd", repeat=1)])   # one of two
    table = detail_table(rows)
    assert table[0].endswith("| busiest shard | waiting for a CPU |")
    assert table[1].count("|") == table[0].count("|")
    cell = {line.split(" | ")[0]: line.split(" | ")[-1] for line in table[2:] if line.startswith("| ")}
    assert cell == {"| baseline (sequential)": "1% |", "| sync": "30% |", "| async": "— |", "| ssp": "— |",
                    "| easgd": "10% (1 of 2 repeats) |"}


def cpu_results(sync, async_, base=0.012, workers=2):
    return [run("baseline", "baseline", workers=1, cpu_wait_fraction=base),
            run("sync", repeat=0, workers=workers, cpu_wait_fraction=sync),
            run("sync", repeat=1, workers=workers, cpu_wait_fraction=sync),
            run("async", "async", workers=workers, cpu_wait_fraction=async_)]


CPU_TAIL = ("Where that share is 10% or more, the times and samples/s are those of these processes sharing the "
            "machine's 2 cores: with a core for each process they would differ, and not necessarily by the same "
            "factor for every configuration.")


@pytest.mark.timeout(30)
def test_the_reading_says_how_long_the_training_threads_waited_for_a_cpu_where_it_is_a_tenth_or_more():
    """The default compare on 2 cores (5 busy processes a run) gave workers 26-28% of their
    runnable time waiting for a core, against the baseline's 0%, and the report said nothing
    of it: throughput against the baseline read as the modes' alone."""
    ctx = {**CTX, "machine": {"cpus": 2}}
    line = sentence(told(cpu_results(0.27, 0.3), ctx), "waited for a CPU")
    assert line == ("The training threads waited for a CPU for part of the time they could run (cpu_wait_fraction, "
                    "the mean over repeats): 27% in **sync**, 30% in **async**; 1% in **baseline (sequential)**. "
                    + CPU_TAIL), line
    # From 10% as written (0.0996 is shown as 10% in the table too); below, or not counted: nothing.
    for said in (0.1, 0.0996):
        assert "10% in **async**" in sentence(told(cpu_results(0.0, said, 0.0), ctx), "waited for a CPU")
    assert "waited for a CPU" not in told(cpu_results(0.05, 0.0949, 0.0), ctx)
    assert "waited for a CPU" not in told([dict(r, cpu_wait_fraction=None) for r in cpu_results(0.5, 0.5)], ctx)
    # The baseline alone reaching it says it too (another program held a core).
    assert "0% in **sync**, 0% in **async**; 20% in **baseline" in sentence(told(cpu_results(0.0, 0.0, 0.2), ctx),
                                                                             "waited for a CPU")
    # The mean over the repeats that counted it, and how many did where not all.
    rows = cpu_results(0.2, 0.3)
    rows[2]["cpu_wait_fraction"] = 0.4
    rows.append(run("async", "async", repeat=1))    # (a summary from before the field)
    assert "30% in **sync**, 30% in **async** (1 of 2 repeats);" in sentence(told(rows, ctx), "waited for a CPU")


@pytest.mark.timeout(30)
def test_the_cpu_wait_sentence_lists_per_worker_count_and_names_no_extremes_past_six_rows():
    ctx = {**CTX, "machine": {"cpus": 2}}
    line = sentence(told(cpu_results(0.11, 0.12, workers=1) + cpu_results(0.26, 0.28, workers=2)[1:], ctx),
                    "waited for a CPU")
    assert ("(cpu_wait_fraction, the mean over repeats): with 1 worker, 11% in **sync**, 12% in **async**; "
            "with 2 workers, 26% in **sync**, 28% in **async**; 1% in **baseline (sequential)**.") in line, line

    def ssp(k, share, w=2):
        return run(f"ssp:staleness={k}", "ssp", params={"staleness": k}, sweep="staleness", workers=w,
                   cpu_wait_fraction=share)
    six = sentence(told([ssp(k, 0.3) for k in range(6)]), "waited for a CPU")
    assert "30% in **ssp (bound s=0)**, " in six and "30% in **ssp (bound s=5)**." in six, six
    # Seven of one count: their range, no names (the spread may not separate a most from a least).
    seven = sentence(told([ssp(k, k / 10) for k in range(7)]), "waited for a CPU")
    assert "): 0% to 60% across 7 configurations. Where" in seven and "**" not in seven, seven
    assert "of processes sharing the machine's cores:" in seven   # (no machine in the context: no core count)


@pytest.mark.timeout(30)
def test_the_cpu_wait_sentence_of_merged_folders_and_simulated_rows():
    # Merged folders: each setup's baseline is listed, and no one folder's core count is claimed.
    res = [dict(r, setup=tag) for tag, share in (("a", 0.5), ("b", 0.0)) for r in cpu_results(0.0, 0.0, share)]
    line = sentence(told(res, {**CTX, "machine": {"cpus": 2}, "merged_from": ["a", "b"]}), "waited for a CPU")
    assert "50% in **baseline (sequential) [a]**, 0% in **baseline (sequential) [b]**." in line, line
    assert "of processes sharing the machine's cores:" in line
    # Simulated rows (null) beside real ones: the real group's sentence alone, its baseline the real one.
    res = cpu_results(0.3, 0.3, 0.5) + [run("sync", cpu_wait_fraction=None, simulated=True)]
    text = told(res, {**CTX, "machine": {"cpus": 2}})
    assert sentence(text, "waited for a CPU").startswith("Real runs: The training threads waited")
    assert text.count("waited for a CPU") == 1


@pytest.mark.timeout(30)
def test_the_detail_tables_wall_time_keeps_the_digits_of_a_short_run():
    """A review: a simulated run of 8 workers lasts 0.0184 virtual s, and the detail table said
    "0.02 ± 0.00" (two decimals whatever the size) where the time cells say 0.0184."""
    from psgd.report_tables import detail_table
    rows = build_rows([run("sync", repeat=i, wall=w, simulated=True) for i, w in enumerate((0.0185, 0.0191))]
                      + [run("async", "async", repeat=i, wall=w) for i, w in enumerate((12.34, 12.5))])
    table = detail_table(rows)
    assert "| 2/2 | 0.0188 ± 0.0004 |" in next(line for line in table if line.startswith("| sync (simulated) |"))
    assert "| 2/2 | 12.4 ± 0.1 |" in next(line for line in table if line.startswith("| async |"))


@pytest.mark.timeout(120)
def test_the_worker_count_plots_panels_share_their_axis(tmp_path, monkeypatch):
    """A review: in `psgd simulate --modes sync,ssp:staleness=4 --workers 8,32 --set
    sim.train=false`, the worker-count plot's empty time panel put 8 workers mid-axis and 32
    at its edge, while the throughput panel beside it put them at its two ends."""
    figure = pytest.importorskip("matplotlib.figure")
    limits: list[list[tuple[float, float]]] = []
    savefig = figure.Figure.savefig
    monkeypatch.setattr(figure.Figure, "savefig",
                        lambda self, path, *a, **k: (limits.append([tuple(ax.get_xlim()) for ax in self.axes])
                                                     if str(path).endswith("sweep_workers.png") else None,
                                                     savefig(self, path, *a, **k))[1])
    res = [run(m, m, repeat=i, workers=w, evals=[], acc=None, simulated=True) for m in ("sync", "async")
           for w in (8, 32) for i in range(2)]
    assert ("Sweep: worker count", "sweep_workers.png") in make_plots(str(tmp_path), build_rows(res), 0.9, 0.5)
    (left, right), = limits
    assert left == right


@pytest.mark.timeout(30)
def test_the_mark_note_does_not_place_the_evaluators_first_score_within_one_period():
    """A review: `psgd compare --modes sync,async --repeats 2`: sync's evaluator first scored at
    0.54 s (0.98, above the target; eval period 0.5 s) and the note under the table said such a
    first score is "within one evaluation period of the start"."""
    from psgd.report_tables import main_table
    sync = [run("sync", repeat=0, ttt=0.54, wall=0.89, evals=scores((0.54, 0.98), (1.005, 0.986))),
            run("sync", repeat=1, ttt=0.594, wall=1.04, evals=scores((0.072, 0.85), (0.594, 0.989), (1.11, 0.99)))]
    text = "\n".join(main_table(build_rows(sync), 0.9, 0.5))
    assert "0.57 ± 0.04 †" in text
    assert "within one evaluation period of the start" not in text
    assert ("already above it at the first score (the evaluator's; the baseline's: its untrained model, before "
            "any step), or the time is shorter than one evaluation period") in text
