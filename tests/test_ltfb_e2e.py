"""End to end: LTFB with trainer groups and hyperparameter exploration trains the default
job with real processes (coordinator, 2 shards, 4 workers as 2 trainers of 2, evaluator)
through `run_local`: it reaches >= 0.85 test accuracy, holds a tournament every round
but the last (the budget ends with a local round), and every worker of a trainer writes
the same tournament line, with its trainer and its hyperparameters.
"""
from __future__ import annotations

import glob
import json
import os

import pytest

from psgd.config import Config
from psgd.launcher import run_local
from tests.conftest import free_port_block

pytestmark = [pytest.mark.processes, pytest.mark.slow]

EXPLORE = {"optimizer.lr": [0.02, 0.4]}


@pytest.mark.timeout(400)
def test_trainer_groups_with_explore_train_and_log_their_tournaments(tmp_path):
    cfg = Config().replace(**{"cluster.workers": 4, "cluster.servers": 2, "cluster.port": free_port_block(3),
                              "mode.name": "ltfb", "mode.trainer_size": 2, "mode.explore": EXPLORE})
    s = run_local(cfg, str(tmp_path), quiet=True, timeout_s=300)
    assert s["final_accuracy"] is not None and s["final_accuracy"] >= 0.85, s
    assert s["mode_params"]["trainer_size"] == 2 and s["mode_params"]["exchange"] == "weights+optimizer"
    lines = []
    for path in sorted(glob.glob(os.path.join(str(tmp_path), "events", "worker-*.jsonl"))):
        with open(path) as f:
            lines += [e for e in map(json.loads, f) if e.get("event") == "tournament"]
    rounds = cfg.train.steps // cfg.mode.round_steps - 1
    assert sorted({e["round"] for e in lines}) == list(range(1, rounds + 1))
    assert len(lines) == 4 * rounds
    for rnd in range(1, rounds + 1):
        for trainer in (0, 1):
            a, b = ({k: v for k, v in e.items() if k not in ("t", "rank")}
                    for e in lines if e["round"] == rnd and e["trainer"] == trainer)
            assert a == b and a["leader"] == 2 * trainer and a["partner"] == 1 - trainer
            assert set(a["hyper"]) == {"optimizer.lr"} and 0.02 <= a["hyper"]["optimizer.lr"] <= 0.4
            assert a["adopted"] == (a["partner_score"] > a["local_score"])
