"""Optimizers and learning-rate schedules (server-side, and local for easgd/ltfb).

`make_optimizer` wraps torch.optim (SGD with momentum/Nesterov/weight decay, Adam,
AdamW) around flat tensors. `lr_at` is the schedule: linear warm-up over
`warmup_steps`, then constant, step (x gamma every step_size) or cosine (to min_lr at
`total` steps). Steps are counted in worker steps, so a shard that applies one update
per push (ssp, async) advances the schedule by 1/W per update.
"""
from __future__ import annotations

import math

import torch

from .config import OptimizerConfig


def make_optimizer(params: list[torch.Tensor], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                               nesterov=cfg.nesterov and cfg.momentum > 0)
    cls = torch.optim.Adam if cfg.name == "adam" else torch.optim.AdamW
    return cls(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def lr_at(cfg: OptimizerConfig, step: float, total: int) -> float:
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "step":
        return cfg.lr * cfg.gamma ** int(step // cfg.step_size)
    if cfg.schedule == "cosine" and total > cfg.warmup_steps:
        frac = min(1.0, (step - cfg.warmup_steps) / (total - cfg.warmup_steps))
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))
    return cfg.lr


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
