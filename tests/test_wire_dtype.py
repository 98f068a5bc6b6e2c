"""`wire.dtype`: gradients and parameters travel as float32, bfloat16 or float16; the
shards keep float32 master weights. Round trips through the wire, the shard's tables,
and a whole job that trains with half the bytes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from psgd import wire
from psgd.compare import parse_modes
from psgd.config import Config
from psgd.shard import Shard
from tests.conftest import free_port_block


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tensors_round_trip_without_copies(dtype):
    t = torch.randn(1000).to(dtype)
    m = wire.decode(wire.encode("push", id=1, arrays=[t, np.zeros(2, np.float32)], read_version=0))
    name = str(dtype).replace("torch.", "")
    assert m.dtypes == [name, "float32"]
    got = wire.tensor(m, 0)
    assert got.dtype == dtype and torch.equal(got, t)
    assert wire.expect_array(m, 0, name, (1000,)) is m.arrays[0]
    with pytest.raises(wire.WireError, match=f"expected float32, got {name}"):
        wire.expect_array(m, 0, "float32", (1000,))


@pytest.mark.unit
def test_a_raw_uint16_array_is_not_taken_for_bfloat16():
    with pytest.raises(wire.WireError, match="not allowed"):
        wire.encode("push", arrays=[np.zeros(3, np.uint16)], read_version=0)


@pytest.mark.unit
def test_a_bfloat16_shard_keeps_float32_master_weights():
    cfg = Config().replace(**{"mode.name": "ssp", "cluster.workers": 1, "cluster.servers": 1,
                              "optimizer.momentum": 0.0, "wire.dtype": "bfloat16"})
    shard = Shard(cfg, 0)
    p0 = shard.params.detach().clone()
    g = torch.full((shard.P,), 1 / 3)
    push = wire.decode(wire.encode("push", id=1, rank=0, clock=0, read_version=0,
                                   arrays=[g.bfloat16(), torch.zeros(shard.B)]))
    shard.handle("push", push)
    expect = p0 - cfg.optimizer.lr * g.bfloat16().float()          # the update: float32, from the bf16 gradient
    assert shard.params.dtype == torch.float32
    torch.testing.assert_close(shard.params.detach(), expect)
    (_, frames), = shard.handle("pull", wire.decode(wire.encode("pull", id=2, rank=0, clock=1)))
    reply = wire.decode(frames)
    assert reply.dtypes == ["bfloat16", "float32"]
    torch.testing.assert_close(wire.tensor(reply, 0), expect.bfloat16())
    with pytest.raises(wire.WireError, match="expected bfloat16, got float32"):
        shard.handle("again", wire.decode(wire.encode("push", id=3, rank=0, clock=1, read_version=1,
                                                      arrays=[g, torch.zeros(shard.B)])))


@pytest.mark.unit
def test_compare_sweeps_a_config_key_like_a_mode_parameter():
    specs = parse_modes("sync:wire.dtype=float32,bfloat16,float16")
    assert [s.label for s in specs] == ["sync:wire.dtype=float32", "sync:wire.dtype=bfloat16",
                                        "sync:wire.dtype=float16"]
    assert specs[1].sweep == "wire.dtype" and specs[1].sweep_value == "bfloat16"


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_bfloat16_job_trains_with_half_the_bytes(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}, "OMP_NUM_THREADS": "1"}
    bps = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        r = subprocess.run([sys.executable, "-m", "psgd", "run", "--quiet", "--out", str(out),
                            "--set", f"wire.dtype={dtype}", "--set", f"cluster.port={free_port_block(3)}"],
                           capture_output=True, text=True, timeout=240, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        s = json.loads((out / "summary.json").read_text())
        assert s["final_accuracy"] >= 0.9, s
        bps[dtype] = s["bytes_per_sample"]
    assert 0.45 < bps["bfloat16"] / bps["float32"] < 0.55, bps
