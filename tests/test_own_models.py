"""A researcher's own model with psgd: the kinds of models users bring (a lazy layer, ...),
through a `model.name = "package.module:factory"` and through a training script's
`psgd.connect`, in the commands that build them."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from psgd.baseline import run_baseline
from psgd.config import Config
from psgd.models import build_model
from psgd.sharding import ShardMap
from psgd.sim.run import Simulation

pytestmark = pytest.mark.unit


def lazy_net(input_shape, num_classes):
    """A factory whose first layer learns its input size at the first forward (nn.LazyLinear)."""
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, num_classes))


LAZY = f"{__name__}:lazy_net"


@pytest.mark.timeout(120)
def test_a_lazy_factory_model_is_built_alike_by_every_command():
    """Was: `psgd run` trained it (the workers and the evaluator check a factory's model with a
    forward, which initialized the lazy layer), but `psgd simulate` failed every run, and
    `psgd shards` and `psgd compare`'s baseline stopped with torch's traceback ("Attempted to
    use an uninitialized parameter"): they build the model without that check."""
    checked = build_model(LAZY, (1, 8, 8), 10, seed=3, check=True)
    plain = build_model(LAZY, (1, 8, 8), 10, seed=3)
    assert not any(nn.parameter.is_lazy(p) for p in plain.parameters())
    assert plain.state_dict().keys() == checked.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), checked.state_dict().values(),
                                                     strict=True))
    assert "1.weight" in ShardMap.for_model(plain, 2).describe()   # psgd shards
    cfg = Config().replace(**{"model.name": LAZY, "train.steps": 20, "cluster.workers": 2, "sim.compute_s": 0.001})
    assert run_baseline(cfg, steps=20)["final_accuracy"] > 0   # psgd compare's baseline
    assert Simulation(cfg, cfg.sim.compute_s).run()["final_accuracy"] > 0   # psgd simulate
