"""The output folder of `psgd compare` and `psgd simulate`: held while they run, cleared of
an earlier comparison's report, and an interrupted plan's report says what did not run.
Runs are stood in for (no processes), or simulated small."""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest

import psgd.compare
import psgd.launcher
import psgd.simulate
from psgd.config import ConfigError, load
from psgd.launcher import hold
from psgd.sim.run import Simulation

pytestmark = pytest.mark.inprocess


def compare_args(out, modes: str = "sync,async", **kw) -> SimpleNamespace:
    return SimpleNamespace(config=None, set=["train.steps=5"], modes=modes, workers=None, servers=None, repeats=1,
                           no_baseline=True, device="cpu", timeout=60.0, out=str(out), cmd="compare", jobs=1, **kw)


def context(out) -> dict:
    return json.load(open(os.path.join(out, "compare-context.json")))


@pytest.mark.timeout(60)
def test_a_second_compare_into_a_folder_in_use_is_refused_and_touches_nothing(tmp_path):
    # it had deleted the first's running run folder, and both wrote into one
    out = tmp_path / "cmp"
    (out / "runs" / "sync-w2-r0").mkdir(parents=True)
    (out / "runs" / "sync-w2-r0" / "events.jsonl").write_text("the first's\n")
    lock = hold(str(out / ".compare.lock"))   # as the first compare holds it
    try:
        for main in (psgd.compare.main, psgd.simulate.main):
            with pytest.raises(ConfigError, match="still running: give another --out"):
                main(compare_args(out))
    finally:
        assert lock is not None
        lock.close()
    assert (out / "runs" / "sync-w2-r0" / "events.jsonl").read_text() == "the first's\n"


@pytest.mark.timeout(60)
def test_an_interrupted_compare_says_which_runs_did_not_run(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cmp"
    out.mkdir()
    for name in ("compare.json", "report.md", "sweep_staleness.png", "hyper_3.png", "holiday.png"):   # earlier
        (out / name).write_text('[{"label": "earlier", "dir": "runs/sync-w2-r0"}]' if name.endswith(".json")
                                else "old")
    (out / "tb" / "old-run").mkdir(parents=True)   # an earlier plan's TensorBoard run (a review: it stayed)
    calls, seen = [], []

    def run_one(run, folder, device, timeout_s, prefix=""):
        calls.append(run.label)
        if len(calls) == 1:   # what the folder holds when the first run starts (asserted below)
            seen.append((json.loads((out / "compare.json").read_text()) if (out / "compare.json").exists() else None,
                         (out / "sweep_staleness.png").exists() or (out / "hyper_3.png").exists()))
            raise RuntimeError("the job did not finish")
        raise KeyboardInterrupt
    monkeypatch.setattr(psgd.compare, "run_one", run_one)
    code = psgd.compare.main(compare_args(out, "sync,async,ssp"))
    assert code == 130 and calls == ["sync", "async"]
    # a new comparison's compare.json is its own from the start, not the earlier one's
    assert seen == [([], False)]
    assert (out / "holiday.png").read_text() == "old"   # not a file psgd writes: left alone
    ctx = context(out)
    assert ctx["interrupted"] is True
    assert ctx["not_run"] == ["async, 2 workers, repeat 0", "ssp, 2 workers, repeat 0"]
    assert [e["label"] for e in json.load(open(out / "compare.json"))] == ["sync"]
    err = capsys.readouterr().err
    assert ("held an earlier comparison: its report, plots, compare.json (its runs' summaries) and TensorBoard runs "
            f"(tb/) are moved to {out / 'earlier'}/") in err
    assert not (out / "tb").exists()
    # (a review: they were deleted before anything ran, and a Ctrl-C then left neither report)
    assert sorted(os.listdir(out / "earlier")) == ["compare.json", "hyper_3.png", "report.md", "sweep_staleness.png",
                                                   "tb"]
    # (its runs' folders as seen from there: `python -m psgd.report OUT/earlier` finds those that stay)
    assert json.loads((out / "earlier" / "compare.json").read_text()) == [{"label": "earlier",
                                                                          "dir": "../runs/sync-w2-r0"}]
    assert "interrupted after 1 of 3 runs" in err
    assert not (out / ".compare.lock").exists() or hold(str(out / ".compare.lock")) is not None   # released


@pytest.mark.timeout(60)
def test_ctrl_c_while_the_compare_report_is_written_says_what_is_left(tmp_path, monkeypatch, capsys):
    # a second Ctrl-C after "writing the report of those" ended psgd compare with a traceback
    # and no report.md (psgd simulate's twin: tests/test_simulate.py)
    import psgd.report
    monkeypatch.setattr(psgd.compare, "run_one", lambda run, *a, **kw: {"label": run.label, "failed": "stood in"})

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(psgd.report, "write_report", interrupted)
    out = tmp_path / "cmp"
    assert psgd.compare.main(compare_args(out, "sync")) == 130
    err = capsys.readouterr().err
    assert "psgd compare: interrupted while writing the report: none written" in err
    assert "holds the 1 run done" in err and f"python -m psgd.report {out}" in err
    assert not (out / "report.md").exists()


@pytest.mark.timeout(120)
def test_an_interrupted_simulation_writes_the_report_of_the_runs_done(tmp_path, monkeypatch, capsys):
    # it exited 130 silently, leaving an earlier run's report beside the new compare.json
    real = psgd.simulate.simulate_one
    done = []

    def simulate_one(task):
        if done:
            raise KeyboardInterrupt
        done.append(task[0])
        return real(task)
    monkeypatch.setattr(psgd.simulate, "simulate_one", simulate_one)
    out = tmp_path / "sim"
    code = psgd.simulate.cli(["--modes", "sync,async", "--workers", "2", "--set", "train.steps=5",
                              "--set", "sim.compute_s=0.001", "--set", "sim.train=false", "--out", str(out)])
    assert code == 130
    assert [e["label"] for e in json.load(open(out / "compare.json"))] == ["sync"]
    assert context(out)["not_run"] == ["async, 2 workers, repeat 0"]
    assert (out / "report.md").exists()
    assert "interrupted after 1 of 2 runs" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_simulated_run_leaves_nothing_of_an_earlier_run_of_its_name(tmp_path, monkeypatch):
    from psgd.sim.run import Simulation

    def fails(self, *a, **kw):
        raise RuntimeError("a run that fails")
    monkeypatch.setattr(Simulation, "run", fails)
    out = tmp_path / "sim"
    old = out / "runs" / "sync-w16-r0"
    old.mkdir(parents=True)
    (old / "summary.json").write_text('{"final_accuracy": 0.688}')   # an earlier plan's
    code = psgd.simulate.cli(["--modes", "sync", "--workers", "16", "--set", "train.steps=5",
                              "--set", "sim.compute_s=0.001", "--set", "sim.train=false", "--out", str(out)])
    assert code == 1 and "error" in json.load(open(out / "compare.json"))[0]
    assert not (old / "summary.json").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("item", ["sync:sim.latency_s=0.01", "async:sim.train=false"])
def test_the_cost_model_is_one_for_the_whole_simulation(tmp_path, item):
    # the report gave the base cost model for runs that used another
    with pytest.raises(ConfigError, match="the same for every run"):
        psgd.simulate.main(compare_args(tmp_path / "x", item))


@pytest.mark.timeout(60)
def test_a_streamed_dataset_that_must_be_in_memory_is_one_error_before_any_run(tmp_path):
    args = compare_args(tmp_path / "s", "sync,async")
    args.set = ["data.name=tests.streaming_data:on_demand", "data.classes=10", "train.steps=5",
                "sim.compute_s=0.001"]
    with pytest.raises(ConfigError, match="needs an in-memory dataset"):
        psgd.simulate.main(args)
    assert not (tmp_path / "s").exists()


@pytest.mark.timeout(60)
def test_steps_far_longer_than_the_evaluation_period_are_scored_once_each_change():
    # 100 s steps, a score every 0.5 s: 4,002 scores for 80 steps (and 1e9 s steps never ended)
    for compute_s in (100.0, 1e9):
        sim = Simulation(load(None, ["cluster.workers=4", "train.steps=3", f"sim.compute_s={compute_s}",
                                     "mode.name=sync"]), compute_s)
        sim.run()
        assert len(sim.evals) <= 3 + 2, len(sim.evals)
        assert sim.evals[-1]["samples"] == 4 * 3 * 32


@pytest.mark.timeout(60)
def test_python_m_psgd_simulate_says_an_os_error_in_one_line(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    code = psgd.simulate.cli(["--workers", "2", "--set", "train.steps=5", "--set", "sim.compute_s=0.001",
                              "--out", str(afile)])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err



@pytest.mark.timeout(60)
def test_a_batch_larger_than_a_workers_share_is_warned_once_in_stderr_and_the_report(tmp_path, monkeypatch, capsys):
    # `psgd compare --workers 2 --set data.samples=40`: each worker's batch (train.batch_size 32)
    # shrank to its 20 samples without a word, as psgd simulate's once did
    monkeypatch.setattr(psgd.compare, "run_one", lambda run, *a, **kw: (_ for _ in ()).throw(RuntimeError("x")))
    small = ["train.steps=5", "data.name=synthetic", "data.samples=40"]
    args = compare_args(tmp_path / "a", "sync,async,ltfb")
    args.set, args.workers, args.no_baseline = small, "1,2", False
    psgd.compare.main(args)
    said = [line for line in capsys.readouterr().err.splitlines() if "warning: train.batch_size" in line]
    assert said == ["psgd compare: warning: train.batch_size = 32 is larger than a worker's share of the 40 "
                    "training samples at 2 workers (20 each), 2 workers (18 each): a worker's batch is its whole "
                    "share, so each step processes fewer samples than train.batch_size and samples/s fall with the "
                    "batch; use fewer workers, a smaller train.batch_size or a larger dataset"], said
    assert f"**Warning:** {said[0].split('warning: ')[1]}" in (tmp_path / "a" / "report.md").read_text()
    assert context(tmp_path / "a")["warnings"] == [said[0].split("warning: ")[1]]
    args = compare_args(tmp_path / "b", "sync")
    args.set = ["train.steps=5", "data.name=synthetic", "data.samples=64"]
    psgd.compare.main(args)
    assert "warning: train.batch_size" not in capsys.readouterr().err
    assert "**Warning:**" not in (tmp_path / "b" / "report.md").read_text()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("aborted", [False, True])
def test_a_signal_after_a_runs_job_had_ended_keeps_that_run(tmp_path, monkeypatch, capsys, aborted):
    """A Ctrl-C while a run's daemons were stopped, its summary.json written, left the run out of
    compare.json, and the report listed it among those that did not finish; psgd run reports
    such a job. It is kept (or counted failed, an aborted job), and the comparison stops."""
    from psgd.baseline import run_baseline
    from psgd.launcher import LaunchError
    summary = run_baseline(load(None, ["train.steps=5"], env={}), device="cpu", steps=5)
    calls = []

    def run_one(run, folder, device, timeout_s, prefix=""):
        calls.append(run.label)
        if len(calls) == 1:
            return dict(summary)
        e = KeyboardInterrupt()
        e.ended = LaunchError("job aborted: shard 0 was lost") if aborted else dict(summary)  # as run_local sets it
        raise e
    monkeypatch.setattr(psgd.compare, "run_one", run_one)
    out = tmp_path / "cmp"
    code = psgd.compare.main(compare_args(out, "sync,async,ssp"))
    assert code == 130 and calls == ["sync", "async"]
    entries = json.load(open(out / "compare.json"))
    assert [e["label"] for e in entries] == ["sync", "async"]
    assert ("shard 0 was lost" in entries[1].get("error", "")) == aborted
    assert context(out)["not_run"] == ["ssp, 2 workers, repeat 0"]
    assert "interrupted after 2 of 3 runs" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_signal_after_run_local_returned_keeps_the_run_it_returned(tmp_path, monkeypatch):
    """A review: a Ctrl-C after run_local had returned (in the progress line's end, the
    TensorBoard copy) carried no summary, and the finished run was called not run."""
    summary = {"mode": "sync", "samples": 10}
    monkeypatch.setattr(psgd.launcher, "run_local", lambda *a, **kw: dict(summary))

    ends = psgd.compare.Monitor.__exit__

    def interrupted(self, *exc):
        ends(self, *exc)
        raise KeyboardInterrupt
    monkeypatch.setattr(psgd.compare.Monitor, "__exit__", interrupted)
    run = psgd.compare.Run(label="sync", mode="sync", params={}, workers=2, repeat=0, cfg=load(None, [], env={}),
                           name="sync-r0")
    with pytest.raises(KeyboardInterrupt) as e:
        psgd.compare.run_one(run, str(tmp_path / "run"), "cpu", 30)
    assert psgd.launcher.ended_before(e.value) == summary


@pytest.mark.timeout(60)
def test_a_second_ctrl_c_while_the_progress_line_ends_leaves_stderr_as_it_was(monkeypatch):
    """A review: a KeyboardInterrupt in the Monitor's wait for its thread skipped putting
    sys.stderr back: the wrapper stayed after the run."""
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    monitor = psgd.compare.Monitor("[1/1]", "/nonexistent", 10, every_s=60)
    with pytest.raises(KeyboardInterrupt):
        with monitor:
            assert sys.stderr is not term
            monkeypatch.setattr(monitor._thread, "join", lambda timeout=None: (_ for _ in ()).throw(KeyboardInterrupt))
    assert sys.stderr is term


@pytest.mark.timeout(60)
def test_a_baseline_that_raises_an_error_of_the_users_code_fails_its_run_and_the_plan_goes_on(tmp_path,
                                                                                           monkeypatch, capsys):
    """A review: the baseline trains in compare's own process, and an error of the user's
    model or dataset other than RuntimeError or OSError (BatchNorm's ValueError at batch 1,
    a Dataset's KeyError) ended the comparison with a traceback, before any mode ran, and
    wrote no report."""
    import psgd.baseline
    summary = psgd.baseline.run_baseline(load(None, ["train.steps=5"], env={}), device="cpu", steps=5)
    monkeypatch.setattr(psgd.baseline, "run_baseline", lambda *a, **kw: (_ for _ in ()).throw(
        ValueError("Expected more than 1 value per channel when training")))
    monkeypatch.setattr(psgd.launcher, "run_local", lambda *a, **kw: dict(summary))
    args = compare_args(tmp_path / "c", "sync")
    args.no_baseline = False
    assert psgd.compare.main(args) == 1
    entries = json.load(open(tmp_path / "c" / "compare.json"))
    assert [e["label"] for e in entries] == ["baseline", "sync"]
    assert entries[0]["error"] == ("the baseline failed: ValueError: Expected more than 1 value per channel when "
                                   "training"), entries[0]
    assert (tmp_path / "c" / "report.md").exists() and "Traceback" not in capsys.readouterr().err
