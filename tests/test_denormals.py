"""`train.flush_denormal`: workers and shards compute with denormal floats (below
2**-126) as zero. An MLP's momentum buffer fills with them as the model grows confident,
and an operation on one costs ~100 cycles: the default job's shard took 94 us a step for
its SGD update, against 19 us flushed (docs/performance.md)."""
from __future__ import annotations

import threading

import pytest
import torch

from psgd.config import load
from psgd.inprocess import InProcessCluster
from psgd.optim import denormals_flushed, flush_denormals, flushing_denormals
from tests.conftest import train_on_threads

TINY = 1.1754943508222875e-38   # float32's smallest normal


def denormal(t: torch.Tensor) -> int:
    a = t.abs()
    return int(((a > 0) & (a < TINY)).sum())


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_flushing_is_set_for_the_block_and_inherited_by_threads_started_in_it():
    before = flushing_denormals()
    tiny = torch.full((8,), TINY / 4)
    with denormals_flushed(True):
        assert flushing_denormals() and denormal(tiny * 1.0) == 0
        other: list[bool] = []
        t = threading.Thread(target=lambda: other.append(flushing_denormals()))
        t.start()
        t.join(10)
        assert other == [True]   # (a thread takes its creator's floating-point mode: torch's pools too)
        with denormals_flushed(False):
            assert not flushing_denormals() and denormal(tiny * 1.0) == 8
        assert flushing_denormals()
    assert flushing_denormals() == before
    assert flush_denormals(before) == before


@pytest.mark.inprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("flush", [True, False])
def test_a_job_flushes_denormals_in_its_workers_and_shards_as_configured(port_block, tmp_path, flush):
    """The shard's momentum buffer after 1,500 steps of the default model holds
    denormals only where they are not flushed; the worker computed as configured."""
    cfg = load(None, [f"cluster.port={port_block(2)}", "cluster.workers=1", "cluster.servers=1",
                      "cluster.evaluator=false", "train.steps=1500", f"train.flush_denormal={str(flush).lower()}"],
               env={})
    seen: list[bool] = []

    def prepare(w):
        between = w.between

        def watched():
            seen.append(flushing_denormals())
            between()
        w.between = watched
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        codes = train_on_threads(cfg, str(tmp_path), cluster, prepare)
    assert codes == {0: 0}
    assert seen and set(seen) == {flush}
    ckpt = torch.load(tmp_path / "checkpoints" / "shard-0.pt", weights_only=False)
    momentum = ckpt["opt"]["state"][0]["momentum_buffer"]
    assert (denormal(momentum) == 0) == flush, denormal(momentum)
