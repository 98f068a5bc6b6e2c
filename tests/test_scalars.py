"""TensorBoard scalars (`eval.tensorboard = true`, psgd/scalars.py)."""
from __future__ import annotations

import importlib.util

import pytest

from psgd import scalars
from psgd.config import Config, ConfigError
from psgd.launcher import run_local
from tests.conftest import free_port_block

# psgd[tensorboard]: without it these skip, as the option then refuses (the first test)
needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="needs tensorboard: pip install 'psgd[tensorboard]'")


def read(folder: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(folder)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.unit
def test_without_tensorboard_the_option_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'psgd\[tensorboard\]'"):
        scalars.check(Config().replace(**{"eval.tensorboard": True}))
    scalars.check(Config())  # off: nothing needed


@needs_tensorboard
@pytest.mark.unit
def test_worker_scalars_per_worker_and_for_the_job(tmp_path):
    s = scalars.Scalars(str(tmp_path))
    s.workers({0: {"samples": 300, "elapsed_s": 2.0, "wait_s": 1.0, "staleness_hist": [1, 0, 1]},
               1: {"samples": 100, "elapsed_s": 2.0, "wait_s": 0.0, "staleness_hist": [2]}}, step=400)
    s.add({"job/accuracy": 0.5}, step=400)
    s.close()
    got = read(str(tmp_path))
    assert got["worker-0/samples_per_s"] == [(400, 150.0)] and got["worker-1/samples_per_s"] == [(400, 50.0)]
    assert got["worker-0/staleness"] == [(400, 1.0)] and got["job/staleness"] == [(400, 0.5)]
    assert got["job/samples_per_s"] == [(400, 200.0)] and got["job/wait_fraction"] == [(400, 0.25)]
    assert got["job/accuracy"] == [(400, 0.5)]


@needs_tensorboard
@pytest.mark.processes
@pytest.mark.timeout(180)
def test_a_job_writes_its_curves_for_tensorboard(tmp_path):
    cfg = Config().replace(**{"cluster.port": free_port_block(4), "eval.tensorboard": True, "train.steps": 200})
    summary = run_local(cfg, str(tmp_path), quiet=True, timeout_s=150)
    got = read(str(tmp_path / "tb"))
    assert len(got["job/accuracy"]) == len(summary["evals"])
    assert got["job/accuracy"][-1][1] == pytest.approx(summary["final_accuracy"], abs=1e-6)
    assert {"worker-0/samples_per_s", "worker-1/samples_per_s", "job/wait_fraction"} <= set(got)
    steps = [step for step, _ in got["job/samples_per_s"]]
    assert steps == sorted(steps) and steps[-1] == summary["samples"]


@needs_tensorboard
@pytest.mark.processes
@pytest.mark.timeout(300)
def test_compare_writes_one_tensorboard_run_per_configuration(tmp_path):
    from psgd.cli import main
    out = tmp_path / "cmp"
    code = main(["compare", "--modes", "sync,async", "--workers", "2", "--no-baseline", "--out", str(out),
                 "--set", "eval.tensorboard=true", "--set", "train.steps=60",
                 "--set", f"cluster.port={free_port_block(4)}"])
    assert code == 0
    runs = sorted(p.name for p in (out / "tb").iterdir())
    assert len(runs) == 2 and runs[0].startswith("async") and runs[1].startswith("sync"), runs
    for name in runs:
        assert "job/accuracy" in read(str(out / "tb" / name))
