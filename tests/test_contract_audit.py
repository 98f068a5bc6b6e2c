"""The output contract as scripts and users read it (README "Output files"): values that
an audit of every mode's summary.json, event logs and TensorBoard scalars found off."""
from __future__ import annotations

import pytest

from psgd import scalars
from tests.test_scalars import needs_tensorboard, read


@needs_tensorboard
@pytest.mark.unit
@pytest.mark.timeout(60)
def test_tensorboard_draws_no_staleness_where_none_was_counted(tmp_path):
    """ltfb's trainers count no staleness (summary.json's histogram is empty, psgd run's
    line and the report show none): TensorBoard drew worker-R/staleness and job/staleness
    at 0 for them, a measurement nobody made. A worker that counted some keeps its own."""
    s = scalars.Scalars(str(tmp_path / "ltfb"))
    s.workers({0: {"samples": 320, "elapsed_s": 1.0, "wait_s": 0.1},
               1: {"samples": 320, "elapsed_s": 1.0, "wait_s": 0.1, "staleness_hist": [0] * 33}}, step=640)
    s.close()
    got = read(str(tmp_path / "ltfb"))
    assert not [tag for tag in got if tag.endswith("/staleness")], got
    assert got["job/samples_per_s"] == [(640, 640.0)] and got["job/wait_fraction"] == [(640, pytest.approx(0.1))]

    s = scalars.Scalars(str(tmp_path / "mixed"))   # (diloco before a worker's first round: that one has none yet)
    s.workers({0: {"samples": 320, "elapsed_s": 1.0, "wait_s": 0.0, "staleness_hist": [1, 1]},
               1: {"samples": 320, "elapsed_s": 1.0, "wait_s": 0.0}}, step=640)
    s.close()
    got = read(str(tmp_path / "mixed"))
    assert got["worker-0/staleness"] == [(640, 0.5)] and "worker-1/staleness" not in got
    assert got["job/staleness"] == [(640, 0.5)]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_samples_per_s_is_samples_over_the_written_wall_s():
    """README: `samples_per_s` is `samples / wall_s`. It was of the unrounded wall time, so
    that the file's own two fields disagreed in the digits it keeps: a simulated sync run
    of 12,800 samples in 0.146352 virtual s wrote 87,460.63 samples/s, 87,460.37 by its
    wall_s."""
    from psgd.metrics import rate, summarize
    s = summarize(mode="sync", mode_params={}, workers=2, servers=2, wall_s=0.1463524448,
                  worker_stats={0: {"samples": 6400}, 1: {"samples": 6400}}, server_stats={}, evals=[],
                  target=0.9, failures={})
    assert s["wall_s"] == 0.146352
    assert s["samples_per_s"] == rate(s["samples"] / s["wall_s"]) == 87460.37
