"""`psgd simulate` used as a user would: odd input, large worker counts, what each run's
outputs say, interrupting it."""
from __future__ import annotations

import pytest

from psgd import data
from psgd.config import load
from psgd.consistency import get as get_mode
from psgd.sim import run as sim_run
from psgd.sim.run import Simulation


@pytest.mark.unit
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "ltfb"])
def test_a_run_draws_the_data_permutation_once_not_once_a_worker(monkeypatch, mode):
    """Building a run drew the training set's permutation once per worker (W x n):
    100,000 timing-only workers of 200,000 synthetic samples spent minutes before the
    first event, without a word. Each worker's partition is still `data.worker_part`'s."""
    W, n = 60, 500
    cfg = load(None, [f"cluster.workers={W}", "sim.train=false", "sim.compute_s=0.01", "train.steps=1",
                      'data.name="synthetic"', f"data.samples={n}", f'mode.name="{mode}"'])
    drawn = []
    real = data.partition

    def counting(*a):
        drawn.append(a)
        return real(*a)
    monkeypatch.setattr(data, "partition", counting)
    if hasattr(sim_run, "partition"):
        monkeypatch.setattr(sim_run, "partition", counting)
    sim = Simulation(cfg, cfg.sim.compute_s)
    assert len(drawn) <= 2, len(drawn)   # check_partitions' and the run's
    monkeypatch.setattr(data, "partition", real)
    split = get_mode(mode).schedule(cfg).data_split
    assert (split > 0) == (mode == "ltfb")
    n_train = sim._train_size()
    for r, (part, held) in enumerate(sim_run.worker_parts(n_train, W, cfg.job.seed, split)):
        want, want_held = data.worker_part(n_train, r, W, cfg.job.seed, split)
        assert part.tolist() == want.tolist()
        assert (held is None) == (want_held is None)
        assert held is None or held.tolist() == want_held.tolist()
