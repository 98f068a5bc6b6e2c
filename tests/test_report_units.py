"""The report's numbers carry their units: one test per defect that a review demonstrated,
on crafted summaries (no processes)."""
from __future__ import annotations

import pytest

from psgd.report import build_rows, write_report

from .test_report_claims import run

pytestmark = pytest.mark.unit


def _cell(table: list[str], name: str, column: str) -> str:
    head = [c.strip() for c in table[0].strip("|").split("|")]
    line = next(line for line in table if line.startswith(f"| {name} |"))
    return [c.strip() for c in line.strip("|").split("|")][head.index(column)]


@pytest.mark.timeout(30)
def test_the_detail_tables_clock_gap_says_its_unit_per_mode():
    """A review: `psgd compare --modes sync,easgd:tau=4,ltfb,diloco` gave "max clock gap" 8
    for async (steps) and 10 for easgd (exchange rounds: 40 steps at tau 4) in one column,
    with no unit anywhere, and 0 for ltfb, which measures none."""
    from psgd.report_tables import CLOCK_GAP_NOTE, detail_table
    rows = build_rows([run("async", "async", max_clock_gap=8), run("easgd:tau=4", "easgd", max_clock_gap=10),
                       run("diloco", "diloco", max_clock_gap=1), run("ltfb", "ltfb", max_clock_gap=0)])
    table = detail_table(rows)
    assert _cell(table, "async", "max clock gap") == "8"
    assert _cell(table, "easgd:tau=4", "max clock gap") == "10 rounds"
    assert _cell(table, "diloco", "max clock gap") == "1 round"
    assert _cell(table, "ltfb", "max clock gap") == "—"
    assert CLOCK_GAP_NOTE in table and "exchange rounds" in CLOCK_GAP_NOTE
    # a table of step-counting modes alone needs no note
    plain = detail_table(build_rows([run("sync", max_clock_gap=0), run("async", "async", max_clock_gap=3)]))
    assert CLOCK_GAP_NOTE not in plain and _cell(plain, "async", "max clock gap") == "3"


def _failed_value(label, params, sweep, repeat):
    return {"label": label, "mode": "sync", "params": params, "workers": 2, "repeat": repeat, "sweep": sweep,
            "sweep_value": params[sweep], "dir": f"runs/{label}-r{repeat}",
            "error": "job aborted: worker 0: gradient has NaN or Inf values at step 2"}


@pytest.mark.timeout(120)
def test_a_sweep_value_whose_every_run_failed_is_named_in_the_sweeps_sentence_and_plot(tmp_path, monkeypatch):
    """A review: `psgd compare --modes sync:optimizer.lr=0.05,0.2,1e6 --repeats 2` (1e6 diverged
    in both repeats) said "Sweep of sync optimizer.lr over 0.05, 0.2 (2 workers): throughput
    rose ..." and drew the sweep plot over 0.05 and 0.2 alone, its title silent on 1e6, as
    if the sweep had been of two values."""

    from .test_report_claims import CTX, sentence, titles_and_error_bars, told
    said, _bars = titles_and_error_bars(monkeypatch)
    results = []
    for k in range(2):
        results += [run(f"sync:optimizer.lr={lr}", params={"optimizer.lr": lr}, sweep="optimizer.lr", repeat=k,
                        sps=4000.0 + 700 * i + 30 * k, ttt=1.0 + i + 0.01 * k, wall=5.0)
                    for i, lr in enumerate((0.05, 0.2))]
        results.append(_failed_value("sync:optimizer.lr=1000000.0", {"optimizer.lr": 1000000.0}, "optimizer.lr", k))
    text = sentence(told(results), "Sweep of sync optimizer.lr")
    assert text.startswith("Sweep of sync optimizer.lr over 0.05, 0.2 (2 workers; 1000000.0: every run failed, "
                           "left out): "), text
    write_report(str(tmp_path), results, CTX)
    title = next(" ".join(t.split()) for t in said if t.startswith("sync: optimizer.lr sweep"))
    assert "(1000000.0: every run failed, left out)" in title, title
    # a sweep that lost no value says nothing of it
    ok = [r for r in results if not r.get("error")]
    assert "failed" not in sentence(told(ok), "Sweep of sync optimizer.lr")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("waits, said", [
    (((0.60, 0.61), (0.30, 0.31)), True),    # repeats that separate the two
    (((0.60,), (0.30,)), False),             # one run each: no spread measured
    (((0.414, 0.415), (0.411, 0.412)), False),   # "41% against sync's 41%"
])
def test_ssps_wait_is_explained_by_its_bound_only_where_the_difference_is_established(waits, said):
    """A review: the sentence that explains ssp's smaller wait by its bound was said of two
    runs whose waits read the same ("waited 41% of the time against sync's 41%")."""
    from .test_report_claims import CTX, told
    ctx = {**CTX, "workers": [4], "faults": {"jitter_prob": 0.05, "jitter_s": 0.5}}
    (sync_waits, ssp_waits) = waits
    results = [run("sync", "sync", repeat=k, wait=w, workers=4, sps=2000.0 + k) for k, w in enumerate(sync_waits)]
    results += [run("ssp:staleness=4", "ssp", repeat=k, wait=w, workers=4, sps=6000.0 + k,
                    params={"staleness": 4}) for k, w in enumerate(ssp_waits)]
    results += [run("async", "async", repeat=k, wait=0.0, workers=4, sps=9000.0 + k) for k in range(len(sync_waits))]
    text = told(results, ctx)
    assert ("the bound lets a worker run up to 4 clocks ahead of the slowest" in text) == said, text
    # a review: said of a bound of 0 (lockstep: no lead), and of a delay of every step (no one delayed more)
    zero = [{**x, "label": "ssp:staleness=0", "params": {"staleness": 0}} if x["mode"] == "ssp" else x
            for x in results]
    assert "the bound lets a worker run up to" not in told(zero, ctx)
    assert "the bound lets a worker run up to" not in told(results, {**ctx, "faults": {"step_delay_s": 0.1}})


@pytest.mark.timeout(60)
def test_an_entry_without_samples_per_s_is_no_bar_of_zero_and_no_crash(tmp_path):
    """A review: `python -m psgd.report` on a compare.json entry without samples_per_s
    (which the entry check lets through) ended with matplotlib's TypeError and wrote no
    report; the sweep and worker plots drew the missing value as 0."""
    from .test_report_claims import CTX
    results = [run("sync", "sync", repeat=k, ttt=2.0, samples_per_s=None) for k in range(2)]
    results += [run("async", "async", repeat=k, ttt=1.5) for k in range(2)]
    write_report(str(tmp_path), results, CTX)
    assert (tmp_path / "report.md").exists() and (tmp_path / "throughput.png").exists()


@pytest.mark.timeout(60)
def test_a_folder_without_its_context_names_its_runs_target(tmp_path):
    """A review: without compare-context.json the report named the default target, 0.9,
    of times to the runs' 0.97."""
    import json

    from psgd.report import main
    results = [{**run("sync", "sync", repeat=k, ttt=2.0, acc=0.98), "target_accuracy": 0.97} for k in range(2)]
    (tmp_path / "compare.json").write_text(json.dumps(results))
    assert main([str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "0.97" in text and "to 0.9 " not in text and "time to 0.9 (s)" not in text, text


@pytest.mark.timeout(60)
def test_a_final_accuracy_of_some_repeats_only_says_so():
    """A review: repeats whose final evaluation was missing dropped out of the accuracy
    mean, without a word: "0.9500" of one repeat in three."""
    from psgd.report_tables import main_table

    from .test_report_claims import told
    results = [run("sync", "sync", repeat=k, ttt=2.0, acc=0.95) for k in range(3)]
    for r in results[1:]:
        r["final_accuracy"], r["final_eval_missing"] = None, True
    results += [run("async", "async", repeat=k, ttt=1.5, acc=0.93 + k / 1000) for k in range(3)]
    rows = build_rows(results)
    assert "0.9500 (1/3 scored)" in "\n".join(main_table(rows, 0.9, 0.5))
    assert "Final accuracy of the repeats with a final score only: **sync** (1 of 3)." in told(results)


@pytest.mark.timeout(60)
def test_a_speedup_of_times_less_than_one_evaluation_period_apart_is_marked_as_a_tie():
    """A review: the table's "1.73×" stood unmarked while the reading said the same two
    times were "not told apart: less than one evaluation period apart"."""
    from psgd.report_tables import TIE_MARK, main_table
    results = [run("sync", "sync", repeat=k, ttt=9.0 + k / 100, wall=30.0, eval_every_s=5.0) for k in range(3)]
    results += [run("async", "async", repeat=k, ttt=5.2 + k / 100, wall=30.0, eval_every_s=5.0) for k in range(3)]
    line = next(x for x in main_table(build_rows(results), 0.9, 5.0) if x.startswith("| async"))
    assert f"1.73× {TIE_MARK}" in line, line


@pytest.mark.timeout(60)
def test_a_merge_of_two_folders_with_the_same_simulations_and_seeds_is_refused(tmp_path, capsys):
    """A review: two folders of one setup, each with seed 42's simulated sync and async,
    merged into rows of "2 repeats" with an sd of 0 (a simulation's clock and model are
    its seed's), and the report ranked them. Real runs of one seed are two timings: the
    compares of one mode each, merged, keep both baselines (a later review)."""
    import json

    from psgd.report import main
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        results = [{**run(m, m, ttt=2.0, sps=s), "seed": 42, "simulated": True}
                   for m, s in (("sync", 5000.0), ("async", 5200.0))]
        (tmp_path / name / "compare.json").write_text(json.dumps(results))
    assert main([str(tmp_path / "both"), str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert ("both hold the simulation of sync with 2 workers and seed 42 under one setup: one run twice"
            in capsys.readouterr().err)
    other = [{**r, "seed": 43} for r in json.loads((tmp_path / "b" / "compare.json").read_text())]
    (tmp_path / "b" / "compare.json").write_text(json.dumps(other))
    assert main([str(tmp_path / "both"), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    for name, mode in (("a", "sync"), ("b", "async")):   # real: a compare of each mode, each with its baseline
        results = [{**run("baseline", "baseline", ttt=3.0, workers=1), "seed": 42}, {**run(mode, mode), "seed": 42}]
        (tmp_path / name / "compare.json").write_text(json.dumps(results))
    assert main([str(tmp_path / "both"), str(tmp_path / "a"), str(tmp_path / "b")]) == 0


@pytest.mark.timeout(60)
def test_a_merge_keeps_baselines_of_different_budgets_apart(tmp_path):
    """A review: folders of --workers 2 and --workers 8 merged their baselines (200 and 800
    steps) into one row of "repeats", its sd the budgets' difference, and the header gave
    the first folder's budget for both."""
    import json

    from psgd.report import main
    for name, steps, w in (("a", 200, 2), ("b", 800, 8)):
        (tmp_path / name).mkdir()
        results = [{**run("baseline", "baseline", ttt=3.0, acc=0.80 if w == 2 else 0.95, workers=1), "seed": 0},
                   {**run("sync", "sync", ttt=2.0, workers=w), "seed": 0}]
        (tmp_path / name / "compare.json").write_text(json.dumps(results))
        (tmp_path / name / "compare-context.json").write_text(json.dumps(
            {"target_accuracy": 0.9, "workers": [w], "seeds": [0], "job": {"steps": 100},
             "baseline": {"steps": steps, "samples": 32 * steps, "threads": 1}}))
    assert main([str(tmp_path / "both"), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    text = (tmp_path / "both" / "report.md").read_text()
    names = {line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| baseline")}
    assert names == {"baseline (sequential) [200 steps]", "baseline (sequential) [800 steps]"}, names
    assert "the budget of the largest run of its own folder" in text
