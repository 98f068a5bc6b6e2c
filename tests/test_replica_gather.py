"""Replica.grads: the gradient tables are the model's gradients in the shard map's order
(whole tensors and slices of one split between shards), zeros for a parameter without
one, a sparse one made dense; a second slot is a buffer of its own; the gather reads the
gradients of each step (not the first step's tensors: set_to_none makes new ones)."""
import pytest
import torch
from torch import nn

from psgd.replica import Replica
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
