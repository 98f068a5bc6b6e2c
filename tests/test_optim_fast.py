"""psgd.optim's fast step (`eager`): for one flat CPU float32 tensor it calls torch's
kernels itself, without torch.optim's grouping of one tensor by device and dtype. The
values and the state must be bit for bit those of torch's own step."""
from __future__ import annotations

import copy

import pytest
import torch

from psgd.config import Config
from psgd.optim import eager, make_optimizer, set_lr

# psgd's classes made now: torch's own step (the reference here) imports torch._dynamo,
# after which `eager` hands out torch's classes (tests/test_startup.py)
OURS = {c: eager(c) for c in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)}

CONFIGS = [
    {"name": "sgd", "momentum": 0.0},
    {"name": "sgd", "momentum": 0.9},
    {"name": "sgd", "momentum": 0.9, "nesterov": True},
    {"name": "sgd", "momentum": 0.9, "weight_decay": 0.01},
    {"name": "sgd", "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"name": "sgd", "momentum": 0.0, "weight_decay": 0.01},
    {"name": "adam", "lr": 0.01},
    {"name": "adam", "lr": 0.01, "weight_decay": 0.01},
    {"name": "adamw", "lr": 0.01, "weight_decay": 0.01},
]


def _reference(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.optim.Optimizer:
    """torch's own class with the same settings, over p."""
    base = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}[type(opt).__name__]
    kw = {k: v for k, v in opt.defaults.items() if k not in ("lr", "decoupled_weight_decay")}
    return base([p], lr=opt.defaults["lr"], **kw)


def _run(sets: dict, steps: int = 40, hooked: bool = False):
    cfg = Config().replace(**{f"optimizer.{k}": v for k, v in sets.items()}).optimizer
    torch.manual_seed(1)
    p, q = torch.randn(257, requires_grad=True), None
    q = p.detach().clone().requires_grad_(True)
    ours = make_optimizer([p], cfg)
    assert type(ours) in OURS.values() and type(ours) not in OURS, "torch._dynamo was loaded before this module"
    theirs = _reference(ours, q)
    calls = []
    if hooked:
        ours.register_step_pre_hook(lambda *a: calls.append(1))
    inits = []
    init = type(ours)._init_group

    def counted(self, *a, **k):
        inits.append(1)
        return init(self, *a, **k)
    type(ours)._init_group = counted   # (a class of psgd's own: `eager` makes it)
    try:
        for i in range(steps):
            g = torch.randn(257)
            p.grad, q.grad = g, g.clone()
            lr = cfg.lr * (1 + 0.5 * ((i * 7) % 5))   # changes between steps
            set_lr(ours, lr)
            set_lr(theirs, lr)
            ours.step()
            theirs.step()
            assert torch.equal(p, q), i
            a, b = ours.state_dict(), theirs.state_dict()
            assert a["param_groups"] == b["param_groups"]
            assert a["state"].keys() == b["state"].keys()
            for k, s in a["state"].items():
                assert s.keys() == b["state"][k].keys()
                for n, v in s.items():
                    assert torch.equal(v, b["state"][k][n]), (i, n)
                    assert v.dtype == b["state"][k][n].dtype and v.device == b["state"][k][n].device
    finally:
        del type(ours)._init_group
    return ours, inits, calls


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sets", CONFIGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_fast_step_is_torchs_step_bit_for_bit(sets):
    """Many steps with the learning rate changing between them, momentum's first step
    included: the parameter and every state tensor equal torch's own (torch.equal), and
    after the first step (torch's: it makes the state) torch's step is not called."""
    opt, inits, _ = _run(sets)
    stateful = sets["name"] != "sgd" or sets.get("momentum") or sets.get("weight_decay")
    assert len(inits) == (1 if stateful else 0)
    if sets["name"] != "sgd":
        assert float(next(iter(opt.state.values()))["step"]) == 40


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("sets", CONFIGS[1::4], ids=lambda s: s["name"])
def test_a_step_hook_takes_torchs_step(sets):
    """With a step hook registered, every step is torch's own (which runs the hooks)."""
    _, inits, calls = _run(sets, steps=5, hooked=True)
    assert len(calls) == 5 and len(inits) == 5


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_loaded_checkpoint_steps_on_the_same():
    """State loaded from a state_dict (a restored shard) is stepped as torch steps it."""
    cfg = Config().replace(**{"optimizer.name": "sgd", "optimizer.momentum": 0.9}).optimizer
    torch.manual_seed(2)
    p = torch.randn(50, requires_grad=True)
    opt = make_optimizer([p], cfg)
    p.grad = torch.randn(50)
    opt.step()
    sd = opt.state_dict()
    p2, q = p.detach().clone().requires_grad_(True), p.detach().clone().requires_grad_(True)
    a = make_optimizer([p2], cfg)
    b = _reference(a, q)
    a.load_state_dict(copy.deepcopy(sd))   # (loaded, torch's state tensors are the state_dict's own)
    b.load_state_dict(copy.deepcopy(sd))
    for _ in range(5):
        g = torch.randn(50)
        p2.grad, q.grad = g, g.clone()
        a.step()
        b.step()
    assert torch.equal(p2, q)
    assert torch.equal(a.state[p2]["momentum_buffer"], b.state[q]["momentum_buffer"])
