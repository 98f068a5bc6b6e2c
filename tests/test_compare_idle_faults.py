"""`psgd compare` of a plan whose injected fault slows no worker of a run: warned of once,
on stderr and in the report, as psgd run and psgd simulate warn. Runs are stood in for."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import psgd.compare

pytestmark = pytest.mark.inprocess


def warnings_of(out, monkeypatch, capsys, workers: str, sets: list[str], modes: str = "sync",
                baseline: bool = False) -> tuple[list[str], list[str], str]:
    """(compare-context.json's warnings, stderr's warning lines, report.md) of a comparison
    whose every run fails at once (no processes)."""
    monkeypatch.setattr(psgd.compare, "run_one", lambda run, *a, **kw: (_ for _ in ()).throw(RuntimeError("x")))
    args = SimpleNamespace(config=None, set=["train.steps=5", *sets], modes=modes, workers=workers, servers=None,
                           repeats=1, no_baseline=not baseline, device="cpu", timeout=60.0, out=str(out),
                           cmd="compare", jobs=1)
    psgd.compare.main(args)
    ctx = json.load(open(out / "compare-context.json"))
    said = [line.split("warning: ", 1)[1] for line in capsys.readouterr().err.splitlines()
            if line.startswith("psgd compare: warning: ")]
    return ctx.get("warnings") or [], said, (out / "report.md").read_text()


@pytest.mark.timeout(60)
def test_a_fault_that_slows_no_worker_is_warned_of_once(tmp_path, monkeypatch, capsys):
    """`--set faults.jitter_prob=0.5` without jitter_s, a slow_rank some runs of a
    worker-count sweep lack: psgd compare ran them at full speed without a word, where
    psgd run and psgd simulate warn."""
    warnings, said, report = warnings_of(tmp_path / "a", monkeypatch, capsys, "2,4",
                                         ["faults.jitter_prob=0.5", "faults.slow_rank=3", "faults.slow_factor=2"],
                                         modes="sync,async")
    assert warnings == [
        "sync with 2 workers; async with 2 workers: faults.slow_rank = 3 is no rank of this job's 2 workers "
        "(ranks 0..1): no worker is slowed",
        "faults.jitter_prob = 0.5 delays nothing: faults.jitter_s = 0 (set both: each step is delayed by jitter_s "
        "with probability jitter_prob)"], warnings
    assert said == warnings
    assert all(f"**Warning:** {w}" in report for w in warnings)
    warnings, said, _ = warnings_of(tmp_path / "b", monkeypatch, capsys, "2", ["faults.slow_factor=3"])
    assert warnings == said == ["faults.slow_factor = 3 slows no worker: faults.slow_rank = -1 (set it to a rank)"]


@pytest.mark.timeout(60)
def test_the_baseline_is_no_run_a_straggler_rank_is_missing_from(tmp_path, monkeypatch, capsys):
    """The sequential baseline is rank 0 alone, slowed only by faults.slow_rank = 0 (by
    design): README's straggler comparison is not warned of for it."""
    warnings, said, report = warnings_of(tmp_path / "a", monkeypatch, capsys, "3",
                                         ["faults.slow_rank=1", "faults.slow_factor=4"], baseline=True)
    assert warnings == said == [] and "**Warning:**" not in report
    warnings, _, _ = warnings_of(tmp_path / "b", monkeypatch, capsys, "3", ["faults.jitter_s=0.1"], baseline=True)
    assert warnings == ["faults.jitter_s = 0.1 delays nothing: faults.jitter_prob = 0 (set both: each step is "
                        "delayed by jitter_s with probability jitter_prob)"]
