"""`wire.compression`: 1-bit SGD and top-k sparsification of pushed gradients, with
error feedback on the worker (what a message leaves out stays in the residual)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from psgd import compression, wire
from psgd.compression import BLOCK, ErrorFeedback, decode
from psgd.config import Config
from psgd.shard import Shard
from tests.conftest import free_port_block


@pytest.mark.unit
@pytest.mark.parametrize("codec", ["onebit", "topk"])
def test_error_feedback_keeps_sent_plus_residual_equal_to_the_gradients(codec):
    torch.manual_seed(0)
    size = 3 * BLOCK + 17
    ef = ErrorFeedback(codec, size, topk_fraction=0.05)
    sent_total, grad_total = torch.zeros(size, dtype=torch.float64), torch.zeros(size, dtype=torch.float64)
    for _ in range(20):
        g = torch.randn(size)
        old = ef.residual.clone()
        first, last = ef.encode(g)
        sent = decode(codec, first, last, size)
        torch.testing.assert_close(sent + ef.residual, g + old, rtol=0, atol=1e-5)
        sent_total += sent.double()
        grad_total += g.double()
    torch.testing.assert_close(sent_total + ef.residual.double(), grad_total, rtol=0, atol=1e-4)


@pytest.mark.unit
def test_onebit_keeps_each_blocks_sums_of_both_signs():
    v = torch.randn(2 * BLOCK + 5)
    signs, means = compression.onebit_encode(v)
    assert signs.dtype == torch.uint8 and signs.numel() == (v.numel() + 7) // 8 and means.numel() == 2 * 3
    d = decode("onebit", signs, means, v.numel())
    for b in range(3):
        block, got = v[b * BLOCK:(b + 1) * BLOCK], d[b * BLOCK:(b + 1) * BLOCK]
        assert torch.equal(got > 0, block > 0)
        torch.testing.assert_close(got[block > 0].sum(), block[block > 0].sum())
        torch.testing.assert_close(got[block <= 0].sum(), block[block <= 0].sum())


@pytest.mark.unit
def test_onebit_sends_the_negatives_mean_beside_much_larger_positives():
    """The negatives' sum was the block's sum less the positives': 255 values of 1000 and
    one of -0.001 sent 0 for the negative one (float32 rounding of 255000 - 0.001)."""
    v = torch.full((BLOCK,), 1000.0)
    v[7] = -0.001
    signs, means = compression.onebit_encode(v)
    torch.testing.assert_close(means, torch.tensor([1000.0, -0.001]))
    assert decode("onebit", signs, means, BLOCK)[7] == means[1]


@pytest.mark.unit
def test_topk_sends_the_largest_magnitudes():
    v = torch.tensor([0.1, -5.0, 0.2, 4.0, -0.3])
    values, idx = compression.topk_encode(v, 2)
    assert sorted(idx.tolist()) == [1, 3] and idx.dtype == torch.int32
    assert torch.equal(decode("topk", values, idx, 5), torch.tensor([0.0, -5.0, 0.0, 4.0, 0.0]))


@pytest.mark.unit
@pytest.mark.parametrize("size,fraction,k", [(100, 0.07, 7), (700, 0.07, 49), (300, 0.07, 21), (1000, 0.01, 10),
                                             (101, 0.01, 2), (10, 0.001, 1), (0, 0.01, 0), (5, 1.0, 5)])
def test_topk_count_is_the_fraction_rounded_up(size, fraction, k):
    """0.07 of 100 carried 8 values: the product's float error (7.000000000000001) was rounded up."""
    assert compression.topk_count(size, fraction) == k


def shard(codec: str) -> Shard:
    cfg = Config().replace(**{"mode.name": "ssp", "cluster.workers": 1, "cluster.servers": 1,
                              "optimizer.momentum": 0.0, "wire.compression": codec, "wire.topk_fraction": 0.1})
    return Shard(cfg, 0)


@pytest.mark.unit
@pytest.mark.parametrize("codec", ["onebit", "topk"])
def test_a_shard_applies_the_decoded_gradient(codec):
    s = shard(codec)
    p0 = s.params.detach().clone()
    g = torch.randn(s.P)
    first, last = ErrorFeedback(codec, s.P, 0.1).encode(g)
    s.handle("t", wire.decode(wire.encode("push", id=1, rank=0, clock=0, read_version=0, codec=codec,
                                          arrays=[first, torch.zeros(s.B), last])))
    expect = p0 - s.cfg.optimizer.lr * decode(codec, first, last, s.P)
    torch.testing.assert_close(s.params.detach(), expect)


@pytest.mark.unit
def test_a_shard_refuses_bad_compressed_pushes():
    s = shard("topk")
    k = compression.shapes("topk", s.P, 0.1)[1][1]
    bad = torch.full((k,), s.P, dtype=torch.int32)
    with pytest.raises(wire.WireError, match="topk indices must be in"):
        s.handle("t", wire.decode(wire.encode("push", id=1, rank=0, clock=0, read_version=0, codec="topk",
                                              arrays=[torch.ones(k), torch.zeros(s.B), bad])))
    with pytest.raises(wire.WireError, match="push codec None, this job uses 'topk'"):
        s.handle("t", wire.decode(wire.encode("push", id=2, rank=0, clock=0, read_version=0,
                                              arrays=[torch.zeros(s.P), torch.zeros(s.B)])))
    same = torch.zeros(k, dtype=torch.int32)   # k values for one index: all but one would be lost
    with pytest.raises(wire.WireError, match="topk indices must be distinct"):
        s.handle("t", wire.decode(wire.encode("push", id=3, rank=0, clock=0, read_version=0, codec="topk",
                                              arrays=[torch.ones(k), torch.zeros(s.B), same])))
    assert s.version == 0 and s.counters["pushes"] == 0


def client(codec: str, **sets):
    """A parameter client (its sockets connect to nobody: only its encoding is used)."""
    import zmq

    from psgd.workers.client import ParameterClient
    cfg = Config().replace(**{"cluster.port": free_port_block(2), "wire.compression": codec,
                              "wire.topk_fraction": 0.1, **sets})
    ctx = zmq.Context()
    return ParameterClient(cfg, ctx, rank=0), ctx


@pytest.mark.inprocess   # a client's sockets, no peer
@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["onebit", "topk"])
def test_a_gradient_with_nan_is_refused_by_the_worker_and_leaves_every_residual_clean(codec):
    """It went into the residual, which then carried the NaN into every later push: the
    shards refused them all and the worker stopped after cluster.max_rejections. A
    review: with an Inf in the slice of shard 1 only, shard 0's slice had been encoded
    already, and its residual reduced by a push never sent."""
    from psgd.consistency.rule import Diverged
    c, ctx = client(codec, **{"cluster.servers": 2, "cluster.port": free_port_block(3)})
    try:
        torch.manual_seed(0)
        g, none = [torch.randn(700), torch.randn(300)], [torch.zeros(0), torch.zeros(0)]
        c.begin_push_pull(0, g, none, [0, 0], pull=False)
        before = [c._compressors[i].residual.clone() for i in (0, 1)]
        bad = g[1].clone()
        bad[5] = float("inf")            # an overflow in one layer, which lives on shard 1
        with pytest.raises(Diverged, match="gradient has NaN or Inf values at step 1"):
            c.begin_push_pull(1, [g[0], bad], none, [0, 0], pull=False)
        for i in (0, 1):
            assert torch.equal(c._compressors[i].residual, before[i])
        first, last = c._gradient(0, 0, g[0], none[0], clock=2)["arrays"][::2]
        assert torch.isfinite(decode(codec, first, last, 700)).all()
    finally:
        c.close()
        ctx.term()


@pytest.mark.unit
@pytest.mark.parametrize("codec", ["onebit", "topk"])
def test_finite_gradients_whose_sum_overflows_float32_leave_the_residual_finite(codec, capsys):
    """Two steps of finite gradients near float32's limit: topk's residual kept the first
    one's values left out, and adding the second made them Inf; onebit's block sums
    overflowed at once. The push carried Inf (refused by the shard), the residual became
    Inf - Inf = NaN, and every later push was refused: the worker stopped, blaming a
    gradient that was finite, where an uncompressed job trained on."""
    size = 2 * BLOCK
    ef = ErrorFeedback(codec, size, topk_fraction=0.01)
    ef.name = "worker-3"
    huge = torch.full((size,), 3e38)
    pushes = [ef.encode(huge) for _ in range(2)]
    for first, last in pushes:
        assert torch.isfinite(decode(codec, first, last, size)).all()
    assert torch.isfinite(ef.residual).all()
    old = ef.residual.clone()
    g = torch.randn(size)
    first, last = ef.encode(g)      # the pushes after it go on as before
    torch.testing.assert_close(decode(codec, first, last, size) + ef.residual, g + old, rtol=1e-6, atol=1e-5)
    said = capsys.readouterr().err
    if codec == "topk":   # onebit's means are summed in float64: nothing to drop
        assert ef.dropped == 1 and said.count("[psgd worker-3] wire.compression = topk: the gradient plus its "
                                              "error-feedback residual overflowed float32") == 1
    else:
        assert ef.dropped == 0 and not said
        assert torch.equal(pushes[0][1], torch.tensor([3e38, 3e38, 0.0, 0.0]))   # each block's mean, no negatives


@pytest.mark.unit
def test_a_topk_push_of_few_elements_is_warned_of_once(capsys, monkeypatch):
    """A small model's shard pushed 3-5 elements a step at 1 %: trained far worse than
    uncompressed at the default lr and momentum (error feedback's bursts, amplified by the
    momentum), and nothing said why."""
    monkeypatch.setattr(compression, "_warned", set())
    assert compression.few_elements("topk", 458, 0.01).startswith(
        "warning: wire.compression = topk pushes 5 of a shard's 458 values (wire.topk_fraction = 0.01)")
    assert compression.few_elements("topk", 1000, 0.01) == ""       # 10 a push
    assert compression.few_elements("topk", 458, 0.05) == ""
    assert compression.few_elements("topk", 0, 0.01) == ""          # a shard without parameters pushes none
    assert compression.few_elements("onebit", 458, 0.01) == ""
    for rank in (0, 1):
        ErrorFeedback("topk", 458, 0.01, name=f"worker-{rank}")
    ErrorFeedback("topk", 26_000, 0.01, name="worker-0")
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith("[psgd worker-0] warning: wire.compression = topk pushes 5 of")


@pytest.mark.unit
def test_topk_sends_nothing_for_a_shard_without_parameters():
    """A small model over many shards leaves one with no trainable parameter: k was 1,
    and torch.topk of an empty vector raised."""
    ef = ErrorFeedback("topk", 0, topk_fraction=0.1)
    first, last = ef.encode(torch.zeros(0))
    assert first.numel() == last.numel() == 0
    assert compression.shapes("topk", 0, 0.1) == (("float32", 0), ("int32", 0))
    assert decode("topk", first, last, 0).numel() == 0


@pytest.mark.unit
@pytest.mark.parametrize("mode,sets", [("easgd", {}), ("ltfb", {"mode.trainer_size": 1})])
def test_compression_is_refused_where_no_gradient_is_pushed(mode, sets):
    from psgd.config import ConfigError
    with pytest.raises(ConfigError, match=f"wire.compression = topk compresses pushed gradients, and mode {mode}"):
        Config().replace(**{"mode.name": mode, "cluster.workers": 2, "wire.compression": "topk", **sets})
    Config().replace(**{"mode.name": "ltfb", "cluster.workers": 2, "mode.trainer_size": 2,
                        "wire.compression": "topk"})   # a trainer's group steps push


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_topk_job_trains_and_pushes_few_bytes(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "psgd", "run", "--quiet", "--out", str(out),
                        "--set", "wire.compression=topk", "--set", f"cluster.port={free_port_block(3)}"],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["final_accuracy"] >= 0.9, s
    steps = [json.loads(line) for line in open(out / "events" / "worker-0.jsonl")]
    steps = [e for e in steps if "bytes_sent" in e]
    per_step = (steps[-1]["bytes_sent"] - steps[0]["bytes_sent"]) / (len(steps) - 1)
    dense = 4 * 26_122                                    # the MLP's float32 gradient, over both shards
    assert per_step < 0.1 * dense, per_step
    assert np.isfinite(s["final_loss"])


@pytest.mark.unit
def test_compare_refuses_a_topk_fraction_item_without_topk():
    """A sweep of wire.topk_fraction without wire.compression=topk ran identical dense jobs
    and reported them as a sweep of the fraction."""
    from psgd.compare import build_plan, parse_modes
    from psgd.config import ConfigError
    base = Config()
    for modes in ("sync:wire.topk_fraction=0.01,0.5", "sync:wire.compression=onebit:wire.topk_fraction=0.1",
                  "sync,sync:wire.topk_fraction=0.5", "sync:wire.topk_fraction=0.05:wire.compression=none,onebit"):
        with pytest.raises(ConfigError, match="wire.topk_fraction .* would change nothing"):
            build_plan(base, parse_modes(modes), [2], 1)
    plan = build_plan(base, parse_modes("sync:wire.compression=topk:wire.topk_fraction=0.01,0.5"), [2], 1)
    assert [r.cfg.wire.topk_fraction for r in plan if not r.is_baseline] == [0.01, 0.5]
    plan = build_plan(base, parse_modes("sync:wire.topk_fraction=0.05:wire.compression=none,topk"), [2], 1)
    assert [r.cfg.wire.compression for r in plan if not r.is_baseline] == ["none", "topk"]   # the topk value's
    topk = base.replace(**{"wire.compression": "topk"})   # --set wire.compression=topk
    assert len(build_plan(topk, parse_modes("sync,async:wire.topk_fraction=0.1"), [2], 1)) == 3


@pytest.mark.unit
def test_compare_says_a_list_goes_on_the_items_last_parameter():
    """`sync:wire.compression=none,topk:wire.topk_fraction=0.05` read 'topk:...' as a mode
    and said only "unknown mode 'topk'", not what to do."""
    from psgd.compare import parse_modes
    from psgd.config import ConfigError
    with pytest.raises(ConfigError, match="only an item's last parameter takes a list, so put wire.compression last"):
        parse_modes("sync:wire.compression=none,topk:wire.topk_fraction=0.05")
    specs = parse_modes("sync:wire.topk_fraction=0.05:wire.compression=none,topk")
    assert [s.label for s in specs] == ["sync:wire.topk_fraction=0.05:wire.compression=none",
                                        "sync:wire.topk_fraction=0.05:wire.compression=topk"]
