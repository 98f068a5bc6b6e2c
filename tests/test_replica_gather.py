"""Replica.grads: the gradient tables are the model's gradients in the shard map's order
(whole tensors and slices of one split between shards), zeros for a parameter without
one, a sparse one made dense; a second slot is a buffer of its own; the gather reads the
gradients of each step (not the first step's tensors: set_to_none makes new ones)."""
import pytest
import torch
from torch import nn

from psgd.replica import Replica, flat_layout
from psgd.sharding import TABLES


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.a = nn.Linear(8, 300)
        self.b = nn.Linear(300, 3)
        self.unused = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.tensor(2.0))   # a 0-dim parameter

    def forward(self, idx):
        return self.b(torch.relu(self.a(self.emb(idx)))) * self.scale


def expected(r: Replica) -> list[torch.Tensor]:
    """The tables as the shard map's pieces say, one piece at a time."""
    out = []
    for i in range(r.n):
        parts = []
        for piece in r.map.pieces_of(i, "params"):
            p = r.trainable[piece.name]
            g = torch.zeros_like(p) if p.grad is None else p.grad.to_dense()
            parts.append(g.reshape(-1)[piece.start:piece.start + piece.length])
        out.append(torch.cat(parts) if parts else torch.empty(0))
    return out


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("shards", [1, 2, 3, 7])
def test_grads_are_the_shard_maps_pieces(shards):
    torch.manual_seed(0)
    r = Replica(Net(), shards, torch.device("cpu"))
    assert TABLES
    for _ in range(3):
        r.model.zero_grad(set_to_none=True)
        r.model(torch.randint(0, 50, (16,))).sum().backward()
        want = expected(r)
        got = r.grads()
        assert [t.shape for t in got] == [w.shape for w in want]
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        other = r.grads(slot=1)
        for g, w, o in zip(got, want, other, strict=True):
            assert torch.equal(o, w)
            assert o.numel() == 0 or o.data_ptr() != g.data_ptr()
        assert r.model.unused.weight.grad is None   # (the gather gives zeros; it sets no gradient)


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("shards", [1, 2, 3, 7])
def test_a_flat_replica_loads_and_gathers_what_a_plain_one_does(shards):
    """`flat`: the trainable parameters move into one block, each shard's params table a
    slice of it, so that `load` is one copy a shard. The same values, gradients and
    model.pt as without it; a frozen parameter stays where it was."""
    torch.manual_seed(0)
    nets = [Net(), Net()]
    nets[1].load_state_dict(nets[0].state_dict())
    for n in nets:
        n.unused.requires_grad_(False)
    frozen = nets[1].unused.weight
    cpu = torch.device("cpu")
    plain, flat = Replica(nets[0], shards, cpu), Replica(nets[1], shards, cpu, flat=True)
    assert bool(flat._flat) == (flat_layout(flat.map, shards) is not None) and not plain._flat
    assert flat._flat or shards > 1   # (one shard: always one block; more: where the map allows it)
    assert nets[1].unused.weight is frozen
    if flat._flat:
        block = flat._flat[next(iter(flat._flat))]
        assert all(p.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()
                   for p in flat.trainable.values())
        assert frozen.untyped_storage().data_ptr() != block.untyped_storage().data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(flat.params(), plain.params(), strict=True))
    tables = [torch.randn(flat.map.size(i, "params")) for i in range(shards)]
    for step in range(2):
        for r in (plain, flat):
            r.load([t * (step + 1) for t in tables])
            r.model.zero_grad(set_to_none=True)
            r.model(torch.arange(16) % 50).sum().backward()
        assert all(torch.equal(a, b) for a, b in zip(plain.params(), flat.params(), strict=True))
        assert all(torch.equal(a, b) for a, b in zip(plain.grads(), flat.grads(), strict=True))
    saved = flat.cpu_state_dict()
    assert saved.keys() == plain.cpu_state_dict().keys()
    assert all(torch.equal(v, plain.cpu_state_dict()[k]) for k, v in saved.items())
    assert all(v.untyped_storage().nbytes() == v.numel() * v.element_size() for v in saved.values())


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_no_flat_block_where_a_tensors_pieces_are_not_adjacent():
    """A tensor cut into pieces that lie apart in the shards' tables one after another
    has no place in one block: the replica keeps the tensors as they are."""
    from types import SimpleNamespace

    from psgd.sharding import Piece
    pieces = {(0, "params"): [Piece("w", "params", 0, 4, 0, 0), Piece("v", "params", 0, 2, 0, 4)],
              (1, "params"): [Piece("w", "params", 4, 4, 1, 0)]}
    apart = SimpleNamespace(pieces_of=lambda i, t: pieces[(i, t)])
    assert flat_layout(apart, 2) is None
    pieces[(0, "params")].reverse()
    assert flat_layout(apart, 2) == [("v", 0), ("w", 2)]


class Mlp(Net):
    """Net without the sparse embedding: tensors small enough that 2 and 3 shards cut none."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.a = nn.Linear(8, 30)
        self.b = nn.Linear(30, 3)


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("net,shards", [(Net, 1), (Net, 2), (Net, 7), (Mlp, 2), (Mlp, 3)])
def test_bound_gradients_are_computed_in_the_tables_of_their_slot(net, shards):
    """`bind_grads`: backward writes each step's gradients into the tables of the slot
    it was computed for, which `grads` then gives without a copy: the same values as a
    gather (a sparse gradient, a parameter without one, a 0-dim one), and a slot's
    tables unchanged by a step computed into the other. Where the map cuts a tensor
    across two tables nothing is bound; where a gradient is replaced, it is gathered."""
    torch.manual_seed(0)
    nets = [net(), net()]
    nets[1].load_state_dict(nets[0].state_dict())
    cpu = torch.device("cpu")
    plain, bound = Replica(nets[0], shards, cpu, flat=True), Replica(nets[1], shards, cpu, flat=True)
    cut = any(start is not None for i in range(shards) for _, start, _ in bound._cuts[(i, "params")])
    assert bound.bind_grads() == (bool(bound._flat) and not cut)
    assert bound._bound or net is Net and shards > 1
    if not bound._bound:
        return
    kept = None   # (slot 0's tables and their values, while a step is computed into slot 1)
    for step in range(4):
        slot = step % 2
        idx = torch.randint(0, 50, (16,))
        plain.model.zero_grad(set_to_none=True)
        plain.model(idx).sum().backward()
        bound.clear_grads(slot)
        bound.model(idx).sum().backward()
        got = bound.grads(slot)
        assert all(g.numel() == 0 or g.data_ptr() == t.data_ptr() for g, t in zip(got, bound._bound[slot][0],
                                                                               strict=True))
        assert all(torch.equal(g, w) for g, w in zip(got, plain.grads(), strict=True))
        assert torch.equal(bound.model.unused.weight.grad, torch.zeros(3, 3))
        if kept is not None:
            assert all(torch.equal(t, v) for t, v in zip(*kept, strict=True))
        kept = (got, [g.clone() for g in got]) if slot == 0 else None
    bound.model.zero_grad(set_to_none=True)   # (not `clear_grads`: the gradients are new tensors)
    bound.model(idx * 2 % 50).sum().backward()
    plain.model.zero_grad(set_to_none=True)
    plain.model(idx * 2 % 50).sum().backward()
    assert all(torch.equal(g, w) for g, w in zip(bound.grads(1), plain.grads(), strict=True))
    bound.clear_grads(5)   # (a slot never bound: no gradient until backward makes one)
    assert all(p.grad is None for p in bound.trainable.values())


@pytest.mark.inprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "ssp", "async", "easgd"])
def test_a_worker_computes_the_gradients_it_pushes_in_its_tables(port_block, tmp_path, mode):
    """psgd's own worker binds its gradients where its schedule gathers them every step
    (sync; ssp and async with prefetch, each compute into the slot it pushes from, the
    two in turn) and not where a local optimizer steps on them (easgd, diloco, ltfb: a
    parameter without a gradient is skipped there, not given zeros). (One shard: the
    default MLP's map cuts its weights across two, and no table then holds a whole
    tensor's gradient.)"""
    from psgd.config import load
    from psgd.inprocess import InProcessCluster
    from tests.conftest import train_on_threads
    cfg = load(None, [f"cluster.port={port_block(2)}", "cluster.workers=1", "cluster.servers=1",
                      "cluster.evaluator=false", f"mode.name={mode}", "train.steps=12",
                      *(["mode.prefetch=true"] if mode in ("ssp", "async") else [])], env={})
    workers = []
    gathered = []   # (slot, bound) of each gather

    def prepare(w):
        attach = w.attach

        def attached(*args):
            schedule = attach(*args)
            r = w.replica
            grads = r.grads

            def watched(slot=0):
                gathered.append((slot, r._bound_tables(slot) is not None))
                return grads(slot)
            r.grads = watched
            return schedule
        w.attach = attached
        workers.append(w)
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        assert train_on_threads(cfg, str(tmp_path), cluster, prepare) == {0: 0}
    assert bool(workers[0].replica._bound) == (mode != "easgd")
    if mode != "easgd":
        assert len(gathered) >= 12 and all(bound for _, bound in gathered)
        assert {slot for slot, _ in gathered} == ({0, 1} if mode in ("ssp", "async") else {0})
