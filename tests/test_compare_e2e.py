"""`psgd compare` end to end, with real processes: runs, compare.json, report.md, plots."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from psgd.config import load
from tests.test_compare import ROOT, check_png
from tests.test_report_commands import commands

pytestmark = pytest.mark.processes


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compare_end_to_end(tmp_path):
    """Real processes: the CLI runs sync and an ssp staleness sweep with 2 workers, plus the
    baseline, and writes compare.json, report.md and valid PNG plots; the report's command for
    a configuration trains it as its run in the comparison was configured."""
    out = tmp_path / "cmp"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}
    cmd = [sys.executable, "-m", "psgd", "compare", "--modes", "sync,ssp:staleness=0,3", "--workers", "2",
           "--servers", "1", "--set", "train.steps=60", "--set", "eval.every_seconds=0.25",
           "--set", "eval.target_accuracy=0.5", "--device", "cpu", "--timeout", "240", "--out", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=850)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[1/4] baseline" in p.stderr and "[4/4]" in p.stderr and "left" in p.stderr
    assert "applied to every run: train.steps=60" in p.stderr

    runs = json.loads((out / "compare.json").read_text())
    assert [(r["label"], r["mode"], r["workers"], r["repeat"]) for r in runs] == [
        ("baseline", "baseline", 1, 0), ("sync", "sync", 2, 0),
        ("ssp:staleness=0", "ssp", 2, 0), ("ssp:staleness=3", "ssp", 2, 0)]
    assert runs[2]["params"] == {"staleness": 0}
    assert runs[3]["mode_params"] == {"staleness": 3, "cache": False, "prefetch": False}
    assert runs[3]["sweep"] == "staleness" and runs[3]["sweep_value"] == 3
    for r in runs:
        assert "error" not in r, r.get("error")
        assert r["final_accuracy"] is not None and r["evals"]
        assert (out / r["dir"] / "summary.json").exists()
    assert runs[0]["samples"] == 2 * 60 * 32
    for r in runs[1:]:
        assert r["samples"] == 2 * 60 * 32 and r["servers"] == 1
        assert (out / r["dir"] / "events").is_dir()
    assert runs[1]["staleness"]["max"] == 0  # sync never reads stale parameters

    text = (out / "report.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    for label in ("baseline (sequential)", "sync", "ssp (bound s=0)", "ssp (bound s=3)"):
        assert any(line.startswith(f"| {label} |") for line in rows), label
    assert "## Reading" in text
    said = text.split("## Reading", 1)[1]
    # which sentence depends on the times the evaluator resolved in this run (report_reading.py)
    assert ("First to reach" in said or "No distributed configuration reached" in said
            or "The budget is too short to rank" in said or "Time to 0.5 test accuracy" in said
            or "No distributed configuration was seen at" in said
            or "Shortest resolved time to 0.5 test accuracy" in said
            or "Shortest time to 0.5 test accuracy" in said
            or "Time to 0.5 does not rank the configurations" in said), said
    assert all(r["eval_every_s"] == 0.25 for r in runs[1:]) and "eval_every_s" not in runs[0]
    # Training with a configuration: its command trains it as the comparison's run did (config.toml alike)
    section = text.split("## Training with a configuration", 1)[1].split("\n## ", 1)[0]
    argv = commands(section.splitlines())["ssp (bound s=3), 2 workers"]
    assert argv[:2] == ["psgd", "run"], argv
    again = tmp_path / "again"
    p = subprocess.run([sys.executable, "-m", "psgd", *argv[1:], "--quiet", "--timeout", "240", "--out", str(again)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    ran, compared = (load(str(d / "config.toml"), [], env={}).to_dict() for d in (again, out / runs[3]["dir"]))
    for c in (ran, compared):
        c["cluster"].pop("port")   # (each job's own free block)
    assert ran == compared
    pytest.importorskip("matplotlib")   # the plots: psgd[plots]
    for name in ("accuracy_vs_time.png", "accuracy_vs_samples.png", "throughput.png", "staleness.png",
                 "sweep_ssp_staleness_w2.png"):
        w, h = check_png(str(out / name))
        assert w >= 200 and h >= 150
        assert f"]({name})" in text
