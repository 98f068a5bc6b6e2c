"""`mode.prefetch` (async): the worker computes its next gradient while its push and
pull are in flight. Every push is then exactly one update stale (one worker), and the
job still trains. (How much of the round trip it hides is measured by
bench/throughput.py, not asserted here.)"""
from __future__ import annotations

import json

import pytest

from psgd.config import Config
from psgd.launcher import run_local
from tests.conftest import free_port_block

pytestmark = pytest.mark.processes


@pytest.mark.timeout(300)
def test_prefetch_overlaps_the_round_trip_with_one_step_of_staleness(tmp_path):
    base = Config().replace(**{"mode.name": "async", "cluster.workers": 1, "cluster.servers": 1,
                               "optimizer.momentum": 0.0, "train.steps": 400})
    got = {}
    for prefetch in (False, True):
        cfg = base.replace(**{"mode.prefetch": prefetch, "cluster.port": free_port_block(2)})
        out = tmp_path / str(prefetch)
        s = run_local(cfg, str(out), quiet=True, device="cpu", timeout_s=240)
        steps = [json.loads(line) for line in open(out / "events" / "worker-0.jsonl")]
        steps = [e for e in steps if "staleness" in e]
        got[prefetch] = s, steps
    s, steps = got[True]
    assert s["final_accuracy"] >= 0.9, s
    assert len(steps) == 400 and s["samples"] == 400 * base.train.batch_size
    assert [e["staleness"] for e in steps] == [0] + [1] * 399      # the first push was computed on the start
    assert s["mode_params"]["prefetch"] is True
    assert all(e["staleness"] == 0 for e in got[False][1])
