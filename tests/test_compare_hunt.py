"""`psgd compare` as a researcher reruns it: defects found by using it (session 29, helper D)."""
from __future__ import annotations

import json

import pytest

from psgd.compare import build_plan, parse_modes
from psgd.config import load


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_failed_baseline_does_not_keep_an_earlier_comparisons_summary(tmp_path):
    """The same `psgd compare --out DIR` again, its baseline failing this time (--timeout):
    DIR/runs/baseline-r0/summary.json was still the earlier comparison's, and `psgd status
    DIR/runs/baseline-r0` said "finished: baseline: accuracy 0.98" of a run that failed."""
    from psgd.baseline import BaselineTimeout
    from psgd.compare import run_one
    base = load(None, ["train.steps=1000000"], env={})
    baseline = build_plan(base, parse_modes("sync"), [2], 1)[0]
    assert baseline.is_baseline
    folder = tmp_path / "runs" / baseline.name
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"mode": "baseline", "final_accuracy": 0.98}))
    with pytest.raises(BaselineTimeout):
        run_one(baseline, str(folder), "cpu", 0.5)
    assert not (folder / "summary.json").exists()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_the_waiting_sentence_of_one_worker_says_worker():
    """`psgd compare --modes sync,ssp:staleness=0,4 --workers 1,2`: the reading said "With 1
    workers, workers of ssp (bound s=4) spent 58% of their time blocked on the servers"."""
    from psgd.report import build_rows, reading
    from tests.test_compare import CTX, fake_run
    results = [fake_run(label, "ssp" if "ssp" in label else "sync", w, 0, 0.95, 1.0, 5000.0, wait=wait,
                        params={"staleness": 4} if "ssp" in label else None)
               for w in (1, 2) for label, wait in (("sync", 0.2), ("ssp:staleness=4", 0.6))]
    text = "\n".join(reading(build_rows(results), {**CTX, "workers": [1, 2], "baseline": None}))
    assert "With 1 worker, " in text and "With 2 workers, " in text
    assert "With 1 workers" not in text


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_an_optimizer_key_of_a_mode_item_is_not_said_to_be_the_baselines(tmp_path):
    """`psgd compare --modes sync:optimizer.lr=0.01,0.05`: the report said "optimizer sgd (lr
    0.1, ...)" for every run and "Baseline: ... same model, data, optimizer and batch size",
    while the rows ran with lr 0.01 and 0.05 and the baseline with lr 0.1 (build_plan gives
    it the job's optimizer, not a mode item's)."""
    from psgd.report import write_report
    from tests.test_compare import CTX, fake_run
    results = [fake_run("baseline", "baseline", 1, 0, 0.95, 0.5, 40000.0)]
    results += [fake_run(f"sync:optimizer.lr={lr}", "sync", 3, 0, 0.95, 1.0, 5000.0,
                         params={"optimizer.lr": lr}, sweep="optimizer.lr") for lr in (0.01, 0.05)]
    ctx = {**CTX, "job": {**CTX["job"], "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9}}}
    text = open(write_report(str(tmp_path), results, ctx)).read()
    baseline = next(line for line in text.splitlines() if line.startswith("Baseline:"))
    assert "same model, data, optimizer" not in baseline
    assert "without a configuration's own optimizer.lr" in baseline
    header = next(line for line in text.splitlines() if line.startswith("Model "))
    assert "optimizer sgd (lr 0.1, momentum 0.9; optimizer.lr as the configuration's name sets it" in header
    # a plan whose items set no optimizer key says as before
    plain = [results[0], fake_run("sync", "sync", 3, 0, 0.95, 1.0, 5000.0)]
    (tmp_path / "plain").mkdir()
    text = open(write_report(str(tmp_path / "plain"), plain, ctx)).read()
    assert "same model, data, optimizer and batch size" in text and "optimizer sgd (lr 0.1, momentum 0.9)," in text


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_bad_value_in_a_mode_item_is_named_without_an_internal_label():
    """`psgd compare --modes ssp:staleness=0,1,x` said "--modes ssp:staleness=x with 2
    workers: replace: mode.staleness: expected an integer": `replace` was the label of
    Config.replace, a function's name, not where the value came from."""
    from psgd.config import ConfigError
    with pytest.raises(ConfigError) as e:
        build_plan(load(None, [], env={}), parse_modes("ssp:staleness=0,1,x"), [2], 1)
    assert str(e.value) == "--modes ssp:staleness=x with 2 workers: mode.staleness: expected an integer, got 'x'"


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_jobs_key_that_one_mode_refuses_says_to_set_it_in_the_items():
    """helper H: `psgd compare --modes sync,easgd --set wire.compression=topk` said only
    "set wire.compression = none": the --set is every item's, and easgd refuses it."""
    from psgd.config import ConfigError
    with pytest.raises(ConfigError) as e:
        build_plan(load(None, ["wire.compression=topk"], env={}), parse_modes("sync,easgd"), [2], 1)
    assert str(e.value).endswith("(wire.compression = topk is the job's, for every mode item: set it in the items "
                                 "that take it instead, as MODE:wire.compression=topk)"), str(e.value)
    with pytest.raises(ConfigError) as e:   # an item's own key: no such hint
        build_plan(load(None, [], env={}), parse_modes("sync,easgd:wire.compression=topk"), [2], 1)
    assert "is the job's" not in str(e.value)
