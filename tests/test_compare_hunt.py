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
