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
