"""A diverging job, as a new user meets it: `psgd run --set optimizer.lr=1e6` ends with
one clear line that names the reason and the fix, a non-zero exit code, no traceback
and no hang, in every kind of mode (shards refuse the non-finite gradient; local
optimizers refuse their own non-finite loss)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import free_port_block

pytestmark = pytest.mark.processes

ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}, "OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode, reason", [("sync", "gradient has NaN or Inf values"),
                                          ("easgd", "loss is nan")])
def test_a_diverging_job_ends_with_a_clear_message(tmp_path, mode, reason):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "psgd", "run", "--mode", mode, "--out", str(out),
                        "--set", "optimizer.lr=1e6", "--set", "cluster.max_rejections=5",
                        "--set", f"cluster.port={free_port_block(3)}"],
                       capture_output=True, text=True, timeout=150, env=ENV)
    text = r.stdout + r.stderr
    assert r.returncode != 0, text
    assert "Traceback" not in text, text
    assert reason in text and "lower optimizer.lr" in text and "stopping after 5 refused steps" in text, text
    logs = sorted((out / "logs").glob("*.log"))
    assert len(logs) >= 5, logs   # the shards', the workers' and the evaluator's: none unread
    for log in logs:
        assert "Traceback" not in log.read_text(), log
    summary = json.loads((out / "summary.json").read_text())
    assert reason in summary["aborted"]
    assert summary["rejected"] >= 5


@pytest.mark.timeout(180)
def test_refused_exchanges_between_local_steps_are_refusals_in_a_row(tmp_path):
    """A float16 diloco job whose outer step left float16's range: every exchange was
    refused, but the local steps between two exchanges each ended the run of refusals,
    so the workers never stopped; they trained on alone, without the global model (and,
    with ZeroMQ's I/O thread blocked, were dropped). A step that asks the shards nothing
    ends no run of refusals: the job stops with the reason and its fix."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "psgd", "run", "--mode", "diloco", "--workers", "2", "--out", str(out),
                        "--set", "wire.dtype=float16", "--set", "mode.outer_lr=30", "--set", "mode.local_steps=5",
                        "--set", "train.steps=300", "--set", "cluster.max_rejections=3",
                        "--set", f"cluster.port={free_port_block(3)}"],
                       capture_output=True, text=True, timeout=150, env=ENV)
    text = r.stdout + r.stderr
    assert r.returncode != 0, text
    assert "beyond float16's range" in text and "stopping after 3 refused steps in a row" in text, text
    assert "beyond float16's range" in json.loads((out / "summary.json").read_text())["aborted"]
