import numpy as np
import pytest
import torch
from torch import nn

from psgd.models import build_model
from psgd.sharding import ShardMap, model_entries, model_tensors, runs_of

pytestmark = pytest.mark.unit


def coverage(smap, entries):
    seen = {name: np.zeros(n, int) for name, _, n in entries}
    for p in smap.pieces:
        seen[p.name][p.start:p.start + p.length] += 1
    return seen


@pytest.mark.parametrize("name,shape", [("mlp", (1, 8, 8)), ("cnn", (1, 8, 8)), ("resnet20", (3, 32, 32))])
@pytest.mark.parametrize("shards", [1, 2, 3, 5])
@pytest.mark.parametrize("placement", ["balanced", "layers"])
def test_every_element_lives_on_exactly_one_shard(name, shape, shards, placement):
    model = build_model(name, shape, 10, seed=0)
    entries = model_entries(model)
    smap = ShardMap(entries, shards, placement)
    for name_, counts in coverage(smap, entries).items():
        assert (counts == 1).all(), name_
    for s in range(shards):  # offsets are contiguous per shard and table
        for table in ("params", "buffers"):
            off = 0
            for p in smap.pieces_of(s, table):
                assert p.offset == off
                off += p.length
            assert off == smap.size(s, table)


def test_balanced_by_bytes_and_deterministic():
    model = build_model("resnet20", (3, 32, 32), 10, seed=0)
    a = ShardMap.for_model(model, 4)
    b = ShardMap.for_model(build_model("resnet20", (3, 32, 32), 10, seed=1), 4)
    assert a.pieces == b.pieces
    loads = a.bytes_per_shard()
    assert max(loads) / min(loads) < 1.1, loads


def test_large_tensor_is_split_into_chunks():
    smap = ShardMap([("big", "params", 100_000), ("small", "params", 10)], 2)
    assert len([p for p in smap.pieces if p.name == "big"]) > 1
    sizes = smap.sizes["params"]
    assert abs(sizes[0] - sizes[1]) <= smap.chunk


def test_gather_scatter_roundtrip():
    model = build_model("cnn", (1, 8, 8), 10, seed=0)
    smap = ShardMap.for_model(model, 3)
    tensors = model_tensors(model)
    flats = {(s, t): smap.gather(tensors, s, t).clone() for s in range(3) for t in ("params", "buffers")}
    other = build_model("cnn", (1, 8, 8), 10, seed=5)
    ot = model_tensors(other)
    for (s, t), flat in flats.items():
        smap.scatter(flat, s, t, ot)
    for name, _, _ in model_entries(model):
        assert torch.equal(tensors[name], ot[name]), name


def test_frozen_parameters_and_integer_buffers_are_not_sharded():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    names = {n for n, _, _ in model_entries(model)}
    assert "0.weight" not in names and "0.bias" in names
    assert "1.running_mean" in names and "1.num_batches_tracked" not in names


def test_describe_lists_bytes_per_shard():
    text = ShardMap.for_model(build_model("mlp", (1, 8, 8), 10, 0), 2).describe()
    assert "shard 0:" in text and "shard 1:" in text and "bytes" in text
    # one column each: a range such as [5462:8192] pushed its row's bytes out of line
    rows = [line for line in text.splitlines() if line.startswith("  ")]
    assert len({line.index(" B") if line.endswith(" B") else -1 for line in rows}) == 1
    assert len({line.rindex("]") for line in rows}) > 1 and all(line.endswith(" B") for line in rows)
    assert "hold no part of the model" not in text


@pytest.mark.timeout(30)
def test_describe_names_shards_that_hold_nothing():
    """A helper's finding: 8 shards of a hidden-16 MLP (6 tensors, each one piece) left two
    shards empty; their processes started and served nothing, said only in their logs."""
    shard_map = ShardMap.for_model(build_model("mlp", (1, 8, 8), 10, 0, 16), 8)
    text = shard_map.describe()
    assert "2 of the 8 shards hold no part of the model (6, 7): it is cut into only 6 pieces" in text, text
    assert "cluster.servers = 6 serves it with fewer processes" in text
    assert text.splitlines()[-1] == shard_map.idle_note()
    assert ShardMap.for_model(build_model("mlp", (1, 8, 8), 10, 0, 16), 6).idle_note() == ""


@pytest.mark.parametrize("shards", [2, 3, 4])
def test_layers_give_each_shard_a_run_of_whole_tensors_in_the_models_order(shards):
    """wire.overlap's placement: the last layers on the last shard, every tensor whole, a
    table's runs in order, none empty where there are enough tensors; and its checkpoints
    are not the balanced map's (the digest differs)."""
    model = build_model("resnet20", (3, 32, 32), 10, seed=0)
    entries = model_entries(model)
    smap = ShardMap(entries, shards, "layers")
    assert all(p.start == 0 for p in smap.pieces)
    for table in ("params", "buffers"):
        names = [name for name, t, _ in entries if t == table]
        owner = {p.name: p.shard for p in smap.pieces if p.table == table}
        order = [owner[name] for name in names]
        assert order == sorted(order) and set(order) == set(range(shards)), order
    loads = [smap.size(s, "params") for s in range(shards)]
    sizes = [n for _, t, n in entries if t == "params"]
    assert max(loads) <= sum(sizes) / shards + max(sizes), loads   # within a tensor of even
    assert smap.digest != ShardMap(entries, shards).digest
    assert "whole tensors in the model's order (wire.overlap)" in smap.describe()


def test_runs_of_cuts_in_order_with_the_least_largest_run():
    assert runs_of([5, 1, 1, 1, 10, 1], 3) == [0, 0, 0, 0, 1, 2]   # runs of 8, 10, 1: none can be under 10
    assert runs_of([1] * 5, 2) == [0, 0, 0, 1, 1]
    assert runs_of([3, 3, 3], 5) == [0, 1, 2]   # fewer tensors than shards: one each
    assert runs_of([9, 1, 1, 1], 4) == [0, 1, 2, 3]   # as many: none left empty, though 9 is the largest anyway
    assert runs_of([0, 0], 2) == [0, 1] and runs_of([], 3) == []
    with pytest.raises(ValueError, match="placement"):
        ShardMap([("w", "params", 4)], 2, "rows")
