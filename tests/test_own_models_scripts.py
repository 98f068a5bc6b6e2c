"""A researcher's own model in a training script (`psgd.connect`): what such scripts bring
that psgd trained otherwise than the script's plain loop would, without a word."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import psgd
from psgd.inprocess import InProcessCluster
from tests.test_script_misuse import config

pytestmark = pytest.mark.inprocess


def fine_tune(ps, model: nn.Sequential, opt: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(0)
    while True:
        opt.zero_grad()
        model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        if not ps.step():
            return


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_optimizer_of_some_trainable_parameters_is_refused_where_the_shards_train_them_all(port_block, mode):
    """A script that fine-tunes a head (its optimizer holds the head's parameters; the
    backbone's still require gradients): in sync, ssp and async the shards step every
    trainable parameter, and the backbone was trained (moved by 1.07 in 6 steps), where
    the script's own loop leaves it as it is. Now a ConfigError at connect that says how
    to freeze it, and the job ends with it."""
    cfg = config(port_block, mode)
    with InProcessCluster(cfg) as cluster:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        with pytest.raises(psgd.ConfigError, match=rf"optimizer holds 2 of the model's 4 trainable parameters, not "
                                                   rf"0.weight, 0.bias: in mode {mode} the shards train every "
                                                   rf"trainable parameter .*requires_grad_\(False\)"):
            psgd.connect(model, torch.optim.SGD(model[2].parameters(), lr=0.1), config=cfg, rank=0)
        assert "optimizer holds 2 of the model's 4" in cluster.coordinator.abort


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "easgd"])
def test_a_backbone_frozen_or_left_to_a_local_optimizer_is_not_trained(port_block, mode):
    """What the error says to do trains the head alone (sync); in a mode that steps the
    script's optimizer (easgd), one of the head alone is the script's choice, as in its loop."""
    cfg = config(port_block, mode)
    with InProcessCluster(cfg):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        if mode == "sync":
            model[0].requires_grad_(False)
        before = [t.detach().clone() for t in (model[0].weight, model[2].weight)]
        opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
        with psgd.connect(model, opt, config=cfg, rank=0, score=lambda m: 0.5) as ps:
            fine_tune(ps, model, opt)
        assert torch.equal(model[0].weight, before[0]) and not torch.equal(model[2].weight, before[1])


@pytest.mark.timeout(60)
def test_a_float64_model_is_told_that_it_trains_at_float32_precision(port_block, capfd):
    """psgd.connect takes a float64 model, and it trained, but every value the shards wrote
    into it was a float32 one (its weights equal their float32 rounding after the job):
    a script that chose float64 for its precision was not told."""
    cfg = config(port_block, "sync")
    with InProcessCluster(cfg):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
        with psgd.connect(model, config=cfg, rank=0) as ps:
            g = torch.Generator().manual_seed(0)
            while True:
                model(torch.randn(8, 4, generator=g, dtype=torch.float64)).pow(2).mean().backward()
                if not ps.step():
                    break
                model.zero_grad()
    w = model[0].weight.detach()
    assert torch.equal(w, w.float().double())
    assert "0.weight and 3 more: float64 parameters; the shards hold the model in float32, so it trains at " \
           "float32 precision" in capfd.readouterr().err
