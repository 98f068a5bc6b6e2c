"""A learned model (psgd/layout.py): the layout the workers send, the shard that starts
empty and takes rank 0's initial values (`init`), and the coordinator that keeps the
job's layout and refuses a worker whose model differs."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from psgd import layout as layouts
from psgd import wire
from psgd.config import Config
from psgd.shard import Shard
from psgd.sharding import ShardMap, fingerprint, model_layout, model_tensors

pytestmark = pytest.mark.unit

_ids = itertools.count(1)


class Net(nn.Module):
    def __init__(self, width: int = 5):
        super().__init__()
        self.a = nn.Linear(3, width)
        self.bn = nn.BatchNorm1d(width)
        self.b = nn.Linear(width, 2)
        self.a.bias.requires_grad_(False)  # frozen: not sharded (a "fixed" entry of the layout)


def send(shard: Shard, op: str, rank: int, token=None, **fields):
    frames = wire.encode(op, id=next(_ids), rank=rank, **fields)
    msg = wire.decode([bytes(f) for f in frames])
    try:
        return {t: wire.decode([bytes(f) for f in fr]) for t, fr in shard.handle(token or op, msg)}
    except wire.WireError as e:
        return {token or op: e}


def tables(model: nn.Module, n: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = ShardMap.for_model(model, n)
    t = model_tensors(model)
    return m.gather(t, i, "params"), m.gather(t, i, "buffers")


def test_the_layout_names_trainable_parameters_then_float_buffers():
    net = Net()
    lay = model_layout(net)
    assert lay == [["a.weight", "params", [5, 3], "float32"], ["bn.weight", "params", [5], "float32"],
                   ["bn.bias", "params", [5], "float32"], ["b.weight", "params", [2, 5], "float32"],
                   ["b.bias", "params", [2], "float32"], ["bn.running_mean", "buffers", [5], "float32"],
                   ["bn.running_var", "buffers", [5], "float32"],
                   # not sharded, fingerprinted: the frozen bias, the integer buffer
                   ["a.bias", "fixed", [5], "float32", fingerprint(net.a.bias)],
                   ["bn.num_batches_tracked", "fixed", [], "int64", fingerprint(net.bn.num_batches_tracked)]]
    assert layouts.checked(lay) == lay
    assert layouts.size(lay) == sum(p.numel() for p in Net().parameters() if p.requires_grad) + 10
    # the shard map from a layout is the map from the model
    assert ShardMap(layouts.entries(lay), 2).pieces == ShardMap.for_model(Net(), 2).pieces


@pytest.mark.parametrize("bad", [[], "x", [["w", "params", [2]]], [["w", "weights", [2], "float32"]],
                                 [["w", "params", [-1], "float32"]], [[1, "params", [2], "float32"]]])
def test_a_bad_layout_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="layout"):
        layouts.checked(bad)


def test_the_difference_of_two_layouts_is_said_in_words():
    a, b = model_layout(Net(5)), model_layout(Net(6))
    assert layouts.difference(a, a) == ""
    assert "a.weight" in layouts.difference(a, b) and "(5, 3)" in layouts.difference(a, b)
    assert layouts.difference(a[:3], a[:2]) == "the job's model has 3 tensors, this one 2"


def test_a_frozen_tensor_built_differently_is_a_difference_that_names_it():
    torch.manual_seed(1)
    a = Net()
    b = Net()
    b.load_state_dict(a.state_dict())
    assert layouts.difference(model_layout(a), model_layout(b)) == ""       # built alike
    with torch.no_grad():
        b.a.bias.add_(1e-6)                                                 # a frozen layer of its own
    diff = layouts.difference(model_layout(a), model_layout(b))
    assert diff.startswith("a.bias (not trained") and "other values" in diff and "torch.manual_seed" in diff
    with torch.no_grad():
        b.b.bias.add_(1)                                                    # trainable: rank 0's values win
    assert layouts.difference(model_layout(a), model_layout(b)) == diff
    assert layouts.checked(model_layout(b)) == model_layout(b)
    assert fingerprint(torch.zeros(3, dtype=torch.bfloat16)) != fingerprint(torch.zeros(3, dtype=torch.float16)[:0])


@pytest.mark.parametrize("bad", [[["w", "fixed", [2], "float32"]], [["w", "params", [2], "float32", "x"]],
                                 [["w", "fixed", [2], "float32", "f0"]]])
def test_a_fixed_entry_has_a_fingerprint_and_a_layout_has_something_to_train(bad):
    with pytest.raises(ValueError, match="layout"):
        layouts.checked(bad)


def test_only_psgds_own_models_are_built_by_the_shards():
    assert not layouts.learned("mlp") and not layouts.learned("resnet20")
    assert layouts.learned("script") and layouts.learned("pkg.mod:factory")


def shard_for(model: nn.Module, index: int = 0, servers: int = 2) -> Shard:
    cfg = Config().replace(**{"cluster.workers": 3, "cluster.servers": servers, "model.name": "script"})
    return Shard(cfg, index, model_layout(model))


def test_a_learned_shard_serves_only_init_until_rank_0_sends_its_values():
    model = Net()
    shard = shard_for(model)
    assert not shard.ready
    got = send(shard, "pull", 1, clock=0)
    assert got["pull"].op == "error" and got["pull"].get("code") == wire.NOT_READY   # answered, not a bad message
    assert send(shard, "init", 1, token="wait-1") == {}          # a waiter is parked
    p, b = tables(model, 2, 0)
    p1 = p + 1
    assert send(shard, "init", 2, token="rank-2", arrays=[p1, b]) == {}  # not rank 0's: parked too
    got = send(shard, "init", 0, token="rank-0", arrays=[p, b])
    assert set(got) == {"rank-0", "wait-1", "rank-2"}
    assert got["rank-0"].get("took") is True and got["wait-1"].get("took") is False
    assert shard.ready and torch.equal(shard.params, p) and torch.equal(shard.buffers, b)
    got = send(shard, "init", 0, token="again", arrays=[p1, b])      # a ready shard keeps what it has
    assert got["again"].get("took") is False and torch.equal(shard.params, p)
    reply = send(shard, "pull", 1, clock=0, join=True)["pull"]
    assert torch.equal(wire.tensor(reply, 0), p)


def test_init_requests_parked_before_the_values_are_bounded_and_keep_no_arrays(monkeypatch):
    """A resend (the same request id from the same sender) is parked once; a parked
    request does not hold the arrays it came with; beyond MAX_AWAITING_INIT they are refused."""
    import psgd.shard
    monkeypatch.setattr(psgd.shard, "MAX_AWAITING_INIT", 3)
    model = Net()
    shard = shard_for(model)
    p, b = tables(model, 2, 0)
    for _ in range(3):   # one request, resent
        frames = wire.encode("init", id=7, rank=2, arrays=[p + 1, b])
        assert shard.handle("rank-2", wire.decode([bytes(f) for f in frames])) == []
    assert len(shard._awaiting_init) == 1
    assert all(not m.arrays for _, m in shard._awaiting_init.values())
    assert send(shard, "init", 1, token="wait-1") == {} and send(shard, "init", 1, token="wait-2") == {}
    refused = send(shard, "init", 1, token="wait-3")["wait-3"]
    assert isinstance(refused, wire.WireError) and refused.code == wire.REFUSED and "3 requests wait" in str(refused)
    got = send(shard, "init", 0, token="rank-0", arrays=[p, b])
    assert set(got) == {"rank-0", "rank-2", "wait-1", "wait-2"} and got["rank-2"].get("took") is False
    assert torch.equal(shard.params, p) and shard._awaiting_init == {}


def test_waits_for_the_initial_values_end_when_worker_0_leaves_before_sending_them():
    """A review: worker 0 died between registering and its init; the others waited for
    its values for ever (their client renews its deadline while the shards are alive)."""
    model = Net()
    shard = shard_for(model)
    assert send(shard, "init", 1, token="wait-1") == {}
    assert shard.set_live({0: 0, 1: 0, 2: 0}) == []                    # no change for the waiter
    [(token, frames)] = shard.set_live({1: 0, 2: 0})                   # worker 0 dropped
    refused = wire.decode([bytes(f) for f in frames])
    assert token == "wait-1" and refused.op == "error" and refused.get("code") == wire.REFUSED
    assert "worker 0, which brings the initial values, left the job before sending them" in refused.get("reason")
    late = send(shard, "init", 2, token="wait-2")["wait-2"]               # one that comes after
    assert isinstance(late, wire.WireError) and late.code == wire.REFUSED and shard._awaiting_init == {}
    shard.set_live({0: 0, 1: 0, 2: 0})                                 # worker 0 back (restarted): its values count
    p, b = tables(model, 2, 0)
    assert send(shard, "init", 0, token="rank-0", arrays=[p, b])["rank-0"].get("took") is True


def test_a_restarted_shard_with_nothing_restored_takes_any_workers_copy():
    model = Net()
    shard = shard_for(model, index=1)
    shard.inits_from_any = True
    p, b = tables(model, 2, 1)
    assert send(shard, "init", 2, token="rank-2", arrays=[p, b])["rank-2"].get("took") is True
    assert shard.ready


def test_init_values_are_checked():
    model = Net()
    shard = shard_for(model)
    p, b = tables(model, 2, 0)
    bad = send(shard, "init", 0, arrays=[torch.zeros(p.numel() + 1), b])["init"]
    assert isinstance(bad, wire.WireError) and bad.code == wire.BAD_SHAPE
    nan = p.clone()
    nan[0] = float("nan")
    bad = send(shard, "init", 0, arrays=[nan, b])["init"]
    assert isinstance(bad, wire.WireError) and "NaN" in str(bad)
    assert not shard.ready


def test_a_checkpoint_makes_a_learned_shard_ready(tmp_path):
    model = Net()
    first = shard_for(model)
    p, b = tables(model, 2, 0)
    send(first, "init", 0, arrays=[p, b])
    first.save(str(tmp_path / "s.pt"))
    again = shard_for(model)
    again.load(str(tmp_path / "s.pt"))
    assert again.ready and torch.equal(again.params, p)


def test_a_model_with_a_transposed_parameter_is_a_replica_like_any_other():
    """A review: psgd.connect failed with torch's "view size is not compatible" for a
    parameter that is a transpose (not contiguous), and the job was not told."""
    from psgd.replica import Replica
    torch.manual_seed(0)
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(3, 4).t())
    model.register_buffer("m", torch.randn(2, 5).t())
    before, opt = {k: v.clone() for k, v in model.state_dict().items()}, torch.optim.SGD(model.parameters(), 0.1)
    rep = Replica(model, 2, torch.device("cpu"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())   # the same values
    assert opt.param_groups[0]["params"][0] is model.w                           # the same Parameter
    params, buffers = rep.params(), rep.buffers()
    rep.load([p + 1 for p in params], [b * 2 for b in buffers])
    assert torch.equal(model.w, before["w"] + 1) and torch.equal(model.m, before["m"] * 2)
