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
def test_a_float16_value_beyond_its_range_is_refused_by_the_worker_naming_the_dtype():
    """A finite gradient of 1e5 became Inf in float16; the shard refused it as 'NaN or
    Inf; lower optimizer.lr' at every step, and the job stopped."""
    import zmq

    from psgd.consistency.rule import Diverged
    from psgd.workers.client import ParameterClient
    ctx = zmq.Context()
    c = ParameterClient(Config().replace(**{"cluster.port": free_port_block(2), "wire.dtype": "float16"}), ctx, 0)
    try:
        g = torch.ones(100)
        assert c._wire("g0", 0, g, clock=0).dtype == torch.float16
        g[3] = -1e5
        with pytest.raises(Diverged, match=r"values up to 1e\+05 at step 4 are beyond float16's range \(65504\): "
                                           r"set wire.dtype = \"bfloat16\""):
            c._wire("g0", 0, g, clock=4)
        g[3] = float("nan")     # not a range problem: the shard refuses it as a NaN
        assert torch.isnan(c._wire("g0", 0, g, clock=5)).any()
        g[3] = float("inf")     # a review: nor is an Inf (the run diverged), which was blamed on float16
        assert torch.isinf(c._wire("g0", 0, g, clock=6)).any()
    finally:
        c.close()
        ctx.term()


@pytest.mark.unit
def test_a_float16_read_of_parameters_beyond_its_range_is_refused_naming_the_dtype():
    """A review: the shard sent its float32 master weights as float16 unchecked. A
    parameter past 65504 (reached by gradients all in range) reached every worker as Inf,
    whose next gradient was NaN: it stopped with "...; lower optimizer.lr", not naming
    float16. The read is refused, naming it."""
    cfg = Config().replace(**{"mode.name": "ssp", "cluster.workers": 1, "cluster.servers": 1,
                              "optimizer.momentum": 0.0, "optimizer.lr": 1000.0, "wire.dtype": "float16"})
    s = Shard(cfg, 0)
    g = torch.zeros(s.P)
    g[0] = -100.0                                   # well within float16's range
    s.handle("t", wire.decode(wire.encode("push", id=1, rank=0, clock=0, read_version=0,
                                          arrays=[g.half(), torch.zeros(s.B)])))
    assert float(s.params[0]) > 65504               # the master weight is fine, in float32
    (_, frames), = s.handle("t", wire.decode(wire.encode("pull", id=2, rank=0, clock=1)))
    m = wire.decode(frames)
    assert (m.op, m.get("code")) == ("error", wire.REFUSED)
    assert "beyond float16's range (65504)" in m.get("reason") and "bfloat16" in m.get("reason")


@pytest.mark.unit
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_evaluator_reads_the_float32_master_weights_whatever_the_wire_dtype(dtype):
    """A diverging diloco job with wire.dtype = "float16": the shards refused the
    evaluator's reads (parameters beyond float16's range), the evaluator died and was
    restarted 5 times, and the job ended with no summary. The evaluator (rank -1) scores
    the model the shards hold, in float32: a diverged one is scored (its loss not finite),
    not refused; a worker's read still travels in wire.dtype."""
    cfg = Config().replace(**{"mode.name": "async", "cluster.workers": 1, "cluster.servers": 1,
                              "optimizer.momentum": 0.0, "wire.dtype": dtype})
    s = Shard(cfg, 0)
    with torch.no_grad():
        s.params.fill_(1 / 3)
        s.params[0] = 1e6
    (_, frames), = s.handle("e", wire.decode(wire.encode("pull", id=1, rank=-1, clock=-1)))
    m = wire.decode(frames)
    assert m.op == "reply" and m.dtypes[0] == "float32"
    assert torch.equal(wire.tensor(m, 0), s.params.detach())
    (_, frames), = s.handle("w", wire.decode(wire.encode("pull", id=2, rank=0, clock=0)))
    m = wire.decode(frames)
    if dtype == "float16":
        assert (m.op, m.get("code")) == ("error", wire.REFUSED)
    else:
        assert m.dtypes[0] == "bfloat16"


@pytest.mark.unit
def test_ltfb_deposits_and_a_trainers_buffers_stay_float32_under_bfloat16():
    """The deposit went as bfloat16: a trainer's followers loaded a rounded copy of the
    model their leader kept in float32, so its replicas differed; a group step's mean
    buffers went as bfloat16 too, where buffers travel as float32."""
    cfg = Config().replace(**{"mode.name": "ltfb", "cluster.workers": 2, "mode.trainer_size": 2,
                              "cluster.servers": 1, "wire.dtype": "bfloat16", "model.name": "cnn"})
    s = Shard(cfg, 0)
    ids = iter(range(1, 100))

    def ask(op, rank, clock, arrays=(), **fields):
        m = wire.decode(wire.encode(op, id=next(ids), rank=rank, clock=clock, arrays=arrays, **fields))
        return [wire.decode(frames) for _, frames in s.handle("t", m)]

    x = torch.full((s.P,), 1 / 3)
    ask("put_model", 0, 10, [x, torch.full((s.B,), 1000.05)], round=1, score=0.5)
    got, = ask("get_model", 1, 10, round=1, owner=0, exact=True)
    assert got.dtypes[:2] == ["float32", "float32"] and torch.equal(wire.tensor(got, 0), x)
    for rank, b in ((0, 1000.0), (1, 1000.1)):
        answers = ask("push", rank, 0, [torch.zeros(s.P).bfloat16(), torch.full((s.B,), b)], read_version=0,
                      pull=True)
    assert len(answers) == 2                   # the step closes: both members' reads are answered
    for step in answers:
        assert step.dtypes == ["bfloat16", "float32"]
        torch.testing.assert_close(wire.tensor(step, 1), torch.full((s.B,), 1000.05))


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
