"""The open step's sums in sync (`Shard._accumulate`): a step's first gradient is held
where its request put it, not copied, while the event lasts. A step that closes with it
alone steps on it; one that stays open copies it before the event ends, since the
request's memory (its frames, the shard's conversion buffer) is then reused."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from psgd import wire
from psgd.config import Config
from psgd.optim import make_optimizer
from psgd.shard import Shard

pytestmark = pytest.mark.unit


def sync_shard(workers: int, **sets) -> Shard:
    cfg = Config().replace(**{"mode.name": "sync", "cluster.workers": workers, "cluster.servers": 1, **sets})
    return Shard(cfg, 0)


def push_frames(shard: Shard, rank: int, clock: int, g) -> list:
    """A push+pull request's frames, writable as a socket's are."""
    frames = wire.encode("push", id=rank + 1, rank=rank, clock=clock, read_version=0, pull=True,
                         arrays=[g, np.zeros(shard.B, np.float32)])
    return [bytearray(f) for f in frames]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_left_open_keeps_its_first_gradient_not_the_request_s_memory(dtype):
    """Two workers: the first push leaves the step open. Its frame is then overwritten
    (float32: as a reused buffer would be) or the shard's conversion buffer takes the
    second push (bfloat16): the step still sums the first gradient as it came."""
    shard = sync_shard(2, **{"optimizer.momentum": 0.0, "wire.dtype": dtype})
    p0 = shard.params.detach().clone()
    g0, g1 = torch.full((shard.P,), 1.0), torch.full((shard.P,), 3.0)
    wired = getattr(torch, dtype)
    first = push_frames(shard, 0, 0, g0.to(wired))
    assert shard.handle("w0", wire.decode(first)) == []   # the step waits for worker 1
    first[1][:] = bytes(len(first[1]))                    # the request's memory, reused
    out = shard.handle("w1", wire.decode(push_frames(shard, 1, 0, g1.to(wired))))
    assert len(out) == 2 and shard.version == 1
    torch.testing.assert_close(shard.params.detach(), p0 - shard.cfg.optimizer.lr * (g0 + g1) / 2, rtol=0, atol=0)


@pytest.mark.timeout(60)
def test_one_worker_s_step_is_torch_s_step_on_its_gradient_bit_for_bit():
    """W = 1: the step's mean is the gradient itself (not divided by 1), stepped by the
    shard's optimizer (momentum, fused) as torch steps it."""
    shard = sync_shard(1)
    ref = shard.params.detach().clone()
    opt = make_optimizer([ref], shard.opt_cfg)
    gen = torch.Generator().manual_seed(0)
    for clock in range(3):
        g = torch.randn(shard.P, generator=gen)
        shard.handle("w0", wire.decode(push_frames(shard, 0, clock, g)))
        ref.grad = g / 1
        opt.step()
    assert torch.equal(shard.params.detach(), ref)


@pytest.mark.timeout(60)
def test_an_event_that_raises_after_holding_a_first_gradient_keeps_it_in_the_sum(monkeypatch):
    """A decision that raises after the first gradient was held (`carry_out`): the event
    still ends with it copied into the step's sum, not with the request's memory held
    for the next event to add to."""
    shard = sync_shard(2, **{"optimizer.momentum": 0.0})
    frames = push_frames(shard, 0, 0, torch.full((shard.P,), 2.0))
    msg = wire.decode(frames)
    original = shard.rule.push

    def then_fail(*a, **k):
        decisions = original(*a, **k)
        return decisions + [object()]   # (no carrier: an error after the Accumulate)
    monkeypatch.setattr(shard.rule, "push", then_fail)
    with pytest.raises(TypeError):
        shard.handle("w0", msg)
    frames[1][:] = bytes(len(frames[1]))
    assert shard._first is None
    assert torch.equal(shard.summed()[0], torch.full((shard.P,), 2.0))
