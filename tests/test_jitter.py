"""Transient stragglers (`faults.jitter_prob` = p, `faults.jitter_s` = d): every step of
every worker is delayed by d with probability p, independently, from a generator seeded
by (job.seed, rank); the step lines say which steps were delayed (`jitter`)."""
from __future__ import annotations

import json
import math

import pytest

from psgd.config import load
from psgd.inprocess import InProcessCluster
from psgd.workers.worker import Jitter
from tests.conftest import train_on_threads


@pytest.mark.unit
def test_the_draw_is_seeded_independent_per_rank_and_at_rate_p():
    n, p = 20000, 0.2
    a = Jitter(p, 0.05, 7, 0)
    seq = [a.draw() for _ in range(n)]
    assert set(seq) == {0.0, 0.05}
    rate = sum(d > 0 for d in seq) / n
    assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / n)           # binomial, 4 sigma
    b = Jitter(p, 0.05, 7, 0)
    assert [b.draw() for _ in range(n)] == seq                       # reproducible
    other_rank, other_seed = Jitter(p, 0.05, 7, 1), Jitter(p, 0.05, 8, 0)
    assert [other_rank.draw() for _ in range(200)] != seq[:200]
    assert [other_seed.draw() for _ in range(200)] != seq[:200]
    assert all(Jitter(0.0, 0.05, 7, 0).draw() == 0 for _ in range(100))
    assert all(Jitter(1.0, 0.05, 7, 0).draw() == 0.05 for _ in range(100))


@pytest.mark.inprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["ssp", "async"])
def test_a_run_with_jitter_takes_its_delays(port_block, tmp_path, mode):
    steps, p, d = 30, 0.3, 0.1
    cfg = load(None, [f"cluster.port={port_block(3)}", "cluster.workers=2", "cluster.servers=1",
                      "cluster.evaluator=false", f"mode.name={mode}", f"train.steps={steps}",
                      f"faults.jitter_prob={p}", f"faults.jitter_s={d}"], env={})
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        codes = train_on_threads(cfg, str(tmp_path), cluster)
    assert codes == {0: 0, 1: 0}
    for rank in range(2):
        lines = [json.loads(x) for x in open(tmp_path / "events" / f"worker-{rank}.jsonl")]
        lines = [e for e in lines if "staleness" in e]
        assert [e["clock"] for e in lines] == list(range(1, steps + 1))
        expect = Jitter(p, d, cfg.job.seed, rank)
        assert [e["jitter"] for e in lines] == [expect.draw() > 0 for _ in range(steps)]
        gaps = [b["t"] - a["t"] for a, b in zip(lines, lines[1:], strict=False)]
        delayed = [g for g, e in zip(gaps, lines[1:], strict=True) if e["jitter"]]
        assert delayed and min(delayed) >= d * 0.95                 # each delayed step took its delay


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_simulated_step_line_flags_its_own_computes_delay_with_prefetch(mode):
    """With prefetch the next compute runs before a step's line is written: the simulated
    line took the flag of the latest compute (a third of the lines were wrong), where the
    real worker's takes its own step's (the compute at clock - 1)."""
    from psgd.sim.run import Simulation
    p, d = 0.3, 0.02
    cfg = load(None, [f"mode.name={mode}", "mode.prefetch=true", "cluster.workers=2", "train.steps=40",
                      "sim.train=false", "sim.compute_s=0.01", f"faults.jitter_prob={p}", f"faults.jitter_s={d}"],
               env={})
    sim = Simulation(cfg, 0.01)
    sim.run()
    for w in sim.workers:
        expect = Jitter(p, d, cfg.job.seed, w.rank)
        draws = [expect.draw() > 0 for _ in range(60)]
        lines = [x for x in w.log_lines() if "step" in x]
        assert lines and [x["jitter"] for x in lines] == [draws[x["clock"] - 1] for x in lines]
