"""End to end: every consistency mode trains the default job with real processes
(coordinator, 2 shards, 3 workers, evaluator on loopback) through `run_local`.

- every mode reaches >= 0.85 test accuracy;
- with an injected straggler (worker 1 four times slower): ssp with staleness 1 keeps
  the clock gap <= 1, async sees stale gradients;
- ltfb writes one `tournament` line per trainer and round, consistent across trainers.

Timing is measured, never asserted here (see docs/modes.md and bench/).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from psgd import consistency
from psgd.config import Config
from psgd.consistency.tournament import pairings
from psgd.launcher import LaunchError, run_local
from tests.conftest import free_port_block

pytestmark = [pytest.mark.processes, pytest.mark.slow]

WORKERS, SERVERS = 3, 2
STRAGGLER = {"faults.slow_rank": 1, "faults.slow_factor": 4.0}
RUN_TIMEOUT_S = 240

_runs: dict = {}


def run(tmp_path_factory, label: str, **sets) -> tuple[dict, str]:
    """One job on the default config with 3 workers and 2 shards (cached per label)."""
    if label not in _runs:
        for attempt in range(2):
            port = free_port_block(SERVERS + 1)  # a block of our own: other jobs on this machine default to 5555
            cfg = Config().replace(**{"cluster.workers": WORKERS, "cluster.servers": SERVERS,
                                      "cluster.port": port, **sets})
            out = str(tmp_path_factory.mktemp(label))
            try:
                _runs[label] = (run_local(cfg, out, quiet=True, timeout_s=RUN_TIMEOUT_S), out)
                break
            except LaunchError as e:  # someone took the ports between the check and the bind
                if attempt or "Address already in use" not in str(e) + _logs(out):
                    raise
    return _runs[label]


def _logs(out: str) -> str:
    text = ""
    for path in glob.glob(os.path.join(out, "logs", "*.log")):
        with open(path, errors="replace") as f:
            text += f.read()
    return text


def events(out: str, role: str) -> list[dict]:
    lines = []
    for path in sorted(glob.glob(os.path.join(out, "events", f"{role}-*.jsonl"))):
        with open(path) as f:
            lines += [json.loads(line) for line in f if line.strip()]
    return lines


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("mode", consistency.NAMES)
def test_every_mode_reaches_085(tmp_path_factory, mode):
    s, out = run(tmp_path_factory, mode, **{"mode.name": mode})
    assert s["mode"] == mode and s["workers"] == WORKERS and s["servers"] == SERVERS
    assert s["final_accuracy"] is not None and s["final_accuracy"] >= 0.85, s
    assert s["samples"] == WORKERS * Config().train.steps * Config().train.batch_size
    assert s["failures"] == {"workers_lost": 0, "workers_rejoined": 0, "workers_restarted": 0, "workers_gone": 0,
                             "shard_restarts": 0, "coordinator_restarts": 0}
    assert len(events(out, "worker")) >= WORKERS * Config().train.steps


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_sync_with_pushes_from_backward_trains_as_sync(tmp_path_factory):
    """wire.overlap: the shards serve whole layers in order (shard 1: the second and last
    layers, 17,802 values of the MLP's 26,122), the workers push from backward's hooks,
    the evaluator reads with the same map, and the job trains as sync does."""
    plain, _ = run(tmp_path_factory, "sync", **{"mode.name": "sync"})
    s, out = run(tmp_path_factory, "sync-overlap", **{"mode.name": "sync", "wire.overlap": True})
    assert s["final_accuracy"] >= 0.85 and abs(s["final_accuracy"] - plain["final_accuracy"]) <= 0.02, (s, plain)
    assert s["samples"] == plain["samples"] and s["rejected"] == 0
    with open(os.path.join(out, "logs", "server-1.log")) as f:
        assert "serving 17,802 values" in f.read()


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_ltfb_writes_tournament_lines(tmp_path_factory):
    s, out = run(tmp_path_factory, "ltfb", **{"mode.name": "ltfb"})
    lines = [e for e in events(out, "worker") if e.get("event") == "tournament"]
    cfg = Config()
    rounds = cfg.train.steps // cfg.mode.round_steps - 1  # the budget ends with a local round (LBANN)
    assert len(lines) == WORKERS * rounds
    by_round: dict[int, dict[int, dict]] = {}
    for e in lines:
        for key in ("round", "rank", "partner", "local_score", "partner_score", "adopted"):
            assert key in e, f"tournament line without {key}: {e}"
        by_round.setdefault(e["round"], {})[e["rank"]] = e
    assert sorted(by_round) == list(range(1, rounds + 1))
    for rnd, lines_of in by_round.items():
        assert sorted(lines_of) == list(range(WORKERS))
        # the pairs every trainer used are the ones (seed, round) give: nobody was lost
        expect = pairings(cfg.job.seed, rnd, range(WORKERS))
        assert {r: e["partner"] for r, e in lines_of.items()} == expect
        for r, e in lines_of.items():
            if e["partner"] is None:  # the odd one sits out
                assert e["partner_score"] is None and e["adopted"] is False
            else:
                assert lines_of[e["partner"]]["partner"] == r
                assert 0 <= e["local_score"] <= 1 and 0 <= e["partner_score"] <= 1
                assert e["adopted"] == (e["partner_score"] > e["local_score"])  # only on strict improvement


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_ssp_with_a_straggler_keeps_the_clock_gap_within_the_bound(tmp_path_factory):
    s, _ = run(tmp_path_factory, "ssp-s1-straggler", **{"mode.name": "ssp", "mode.staleness": 1, **STRAGGLER})
    assert s["mode_params"] == {"staleness": 1, "cache": False, "prefetch": False}
    assert s["faults"]["slow_rank"] == 1 and s["faults"]["slow_factor"] == 4.0
    assert s["max_clock_gap"] <= 1, s
    assert s["wait_fraction"] > 0  # the fast workers did wait for the straggler


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_async_with_a_straggler_applies_stale_gradients(tmp_path_factory):
    s, _ = run(tmp_path_factory, "async-straggler", **{"mode.name": "async", **STRAGGLER})
    assert s["staleness"]["max"] >= 1, s
    assert s["staleness"]["mean"] > 0
    assert sum(s["staleness"]["hist"].values()) == WORKERS * Config().train.steps


@pytest.mark.timeout(150)
def test_ltfb_pairings_identical_in_another_process():
    """Different interpreters (and hash seeds) derive the same pairs."""
    ranks = [5, 0, 3, 2, 9, 1, 7]
    expect = {str(r): pairings(11, rnd, ranks) for r, rnd in enumerate(range(6))}
    code = ("import json; from psgd.consistency.tournament import pairings; "
            "print(json.dumps({str(i): pairings(11, r, [7, 1, 9, 2, 3, 0, 5]) for i, r in enumerate(range(6))}))")
    import json
    for hashseed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONHASHSEED": hashseed}, check=True).stdout
        got = {k: {int(a): b for a, b in v.items()} for k, v in json.loads(out).items()}
        assert got == expect
