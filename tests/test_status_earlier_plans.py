"""`psgd status DIR` of a psgd compare's or simulate's output folder that an earlier plan
wrote to as well: it names the current plan's runs (those its compare.json names, or the
one it runs now), and the earlier plan's run folders (which stay: README, Comparing
modes) only as that."""
from __future__ import annotations

import json
import os
import time

import pytest

from psgd.cli import main

pytestmark = pytest.mark.unit

SUMMARY = {"mode": "sync", "final_accuracy": 0.89, "final_loss": 0.3, "samples_per_s": 85552.0, "wall_s": 0.0,
           "time_to_target_s": None, "target_accuracy": 0.9, "staleness": {"mean": 0.0, "max": 0},
           "simulated": True}


def run_folder(out, name: str, real: bool = False, age_s: float = 0.0) -> None:
    run = out / "runs" / name
    (run / "events").mkdir(parents=True)
    (run / ("config.toml" if real else "summary.json")).write_text("" if real else json.dumps(SUMMARY))
    if age_s:   # written by an earlier plan
        for p in (run / "events", run / ("config.toml" if real else "summary.json"), run):
            os.utime(p, (time.time() - age_s, time.time() - age_s))


def plan(out, *names: str, failed: int = 0) -> None:
    """DIR's compare.json and compare-context.json, of a psgd simulate started now that ran
    `names` (and `failed` runs more, which left no folder)."""
    (out / "compare.json").write_text(json.dumps([{"label": "sync", "dir": os.path.join("runs", n)} for n in names]
                                                 + [{"label": "sync", "error": "diverged"}] * failed))
    (out / "compare-context.json").write_text(json.dumps({"started": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                          "simulated": {"compute_s": 0.001}}))


@pytest.mark.timeout(30)
def test_status_of_a_simulate_folder_names_only_its_plans_runs(tmp_path, capsys):
    """A psgd simulate into a folder that an earlier simulate (--workers 8) wrote to: psgd
    status listed the earlier plan's runs beside this one's, as if all were its."""
    for name in ("sync-w8-r0", "async-w8-r0"):
        run_folder(tmp_path, name, age_s=86400)
    for name in ("sync-w2-r0", "async-w2-r0"):
        run_folder(tmp_path, name)
    plan(tmp_path, "sync-w2-r0", "async-w2-r0")
    assert main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    runs = tmp_path / "runs"
    assert (f"{tmp_path} is a psgd simulate's output folder (its runs have ended: nothing runs there): give one "
            f"of its runs for its summary, {runs / 'async-w2-r0'} or {runs / 'sync-w2-r0'} (2 other run folders "
            f"there, {runs / 'async-w8-r0'}, {runs / 'sync-w8-r0'}, are an earlier plan's, not in its "
            f"compare.json); or read its report.md") in err, err


@pytest.mark.timeout(30)
def test_status_of_a_folder_a_compare_wrote_before_a_simulate(tmp_path, capsys):
    """The earlier plan was a psgd compare (its runs have config.toml): the folder was said
    to be a psgd compare's, naming that plan's runs. A run being written now, not yet in
    compare.json, is this plan's; before any is, the earlier folders are named as such,
    and the folder is the plan's own kind (compare-context.json), not its predecessor's."""
    run_folder(tmp_path, "sync-w2-r0", real=True, age_s=3600)
    plan(tmp_path)
    assert main(["status", str(tmp_path)]) == 2
    assert (f"{tmp_path} is a psgd simulate's output folder whose runs have not started yet: its run folders, "
            f"{tmp_path / 'runs' / 'sync-w2-r0'}, are an earlier plan's (none is in its compare.json)"
            ) in capsys.readouterr().err
    plan(tmp_path, failed=1)   # its one run failed, and its folder went: it has not "not started"
    assert main(["status", str(tmp_path)]) == 2
    assert (f"{tmp_path} is a psgd simulate's output folder whose runs left no folder (they failed or were not "
            f"run: read its report.md): its run folders, {tmp_path / 'runs' / 'sync-w2-r0'}, are an earlier "
            f"plan's") in capsys.readouterr().err
    plan(tmp_path)
    run_folder(tmp_path, "async-w2-r0")   # (running: compare.json names the runs done)
    assert main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert (f"is a psgd simulate's output folder (its runs have ended: nothing runs there): give one of its runs "
            f"for its summary, {tmp_path / 'runs' / 'async-w2-r0'} (1 other run folder there, "
            f"{tmp_path / 'runs' / 'sync-w2-r0'}, is an earlier plan's, not in its compare.json)") in err, err


@pytest.mark.timeout(30)
def test_a_run_folder_removed_while_status_reads_the_folder_is_no_earlier_plans(tmp_path):
    """A run folder that the plan running there removes (an earlier plan's run of the same
    name, or a failed run's empty folder) between psgd status's listing and its look at
    the folder's times: `max() arg is an empty sequence`, a traceback."""
    from psgd.status import _earlier_plans, _plan
    plan(tmp_path)
    gone = str(tmp_path / "runs" / "gone-meanwhile")
    assert _earlier_plans(str(tmp_path), [gone], _plan(str(tmp_path))) == []
