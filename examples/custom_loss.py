"""A model of your own on a loss of your own, trained by psgd from your own loop.

    psgd run --script examples/custom_loss.py --mode async --workers 3

The task: predict a noisy signal's median from its 16 recent values, with the pinball
(quantile) loss at q = 0.5 -- a loss that no classifier recipe uses. The "accuracy"
reported is the share of test predictions within 0.1 of the truth.
"""
from __future__ import annotations

import argparse
import math

import torch
from torch import nn

import psgd

WINDOW = 16


class Forecaster(nn.Module):
    """A gated two-branch network: a linear view of the window and a nonlinear one."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.linear = nn.Linear(WINDOW, 1)
        self.deep = nn.Sequential(nn.Linear(WINDOW, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        g = torch.sigmoid(self.gate)
        return (g * self.linear(x) + (1 - g) * self.deep(x)).squeeze(1)


def pinball(pred: torch.Tensor, target: torch.Tensor, q: float = 0.5) -> torch.Tensor:
    diff = target - pred
    return torch.maximum(q * diff, (q - 1) * diff).mean()


def series(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of a sum of two sines with heavy-tailed noise; the target is the next clean value.
    All of it drawn from `seed`, so that a fresh process (scoring DIR/model.pt) gets the same set."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n + WINDOW, dtype=torch.float32) * 0.1
    phase = torch.rand(1, generator=g) * 2 * math.pi
    clean = torch.sin(t + phase) + 0.5 * torch.sin(3.1 * t)
    z = torch.randn(3, len(t), generator=g)   # Student's t with 2 degrees of freedom: z0 / sqrt((z1² + z2²) / 2)
    noisy = clean + 0.1 * z[0] / ((z[1] ** 2 + z[2] ** 2) / 2).sqrt()
    x = torch.stack([noisy[i:i + WINDOW] for i in range(n)])
    return x, clean[WINDOW:WINDOW + n]


def held_out() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(tournament, test): ltfb's tournament data (psgd.connect's score) apart from the test
    set that the script reports on, so that the reported score is not that of the model
    the tournaments picked on the same data."""
    return series(500, seed=20_000), series(2000, seed=10_000)


def within(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        p = model(x)
    return ((p - y).abs() < 0.1).float().mean().item(), pinball(p, y).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01,
                    help="this script's optimizer's learning rate: easgd, diloco and ltfb step it; in sync, "
                         "ssp and async the shards run [optimizer] (optimizer.lr) instead")
    a = ap.parse_args()

    torch.manual_seed(0)
    model = Forecaster()
    optimizer = torch.optim.Adam(model.parameters(), lr=a.lr)
    (tour_x, tour_y), (test_x, test_y) = held_out()
    with psgd.connect(model, optimizer, score=lambda m: within(m, tour_x, tour_y)) as ps:
        torch.manual_seed(1 + ps.rank)
        x, y = series(4000, seed=ps.rank)           # each worker its own stretch of signal
        while True:
            i = torch.randint(0, len(y), (a.batch,))
            optimizer.zero_grad()
            loss = pinball(model(x[i]), y[i])
            loss.backward()
            if not ps.step(loss, samples=a.batch):
                break
        acc, test_loss = within(model, test_x, test_y)
        ps.report(accuracy=acc, loss=test_loss)


if __name__ == "__main__":
    main()
