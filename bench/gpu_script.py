"""bench/gpu_modes.sh's training script: a user's own loop with the model on psgd.device() (the GPU
under `psgd run --device cuda`), its optimizer stepped by psgd in the local modes."""
import torch
from torch import nn

import psgd

torch.manual_seed(0)
dev = psgd.device()
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2)).to(dev)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
w = torch.randn(20, device=dev)
test_x = torch.randn(512, 20, device=dev)
test_y = (test_x @ w > 0).long()


def score(m):
    with torch.no_grad():
        out = m(test_x)
        return (out.argmax(1) == test_y).float().mean().item(), nn.functional.cross_entropy(out, test_y).item()


with psgd.connect(model, opt, score=score) as ps:
    assert next(model.parameters()).device == dev, next(model.parameters()).device   # (connect left it there)
    while True:
        x = torch.randn(64, 20, device=dev)
        y = (x @ w > 0).long()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if not ps.step(loss, samples=64):
            break
    acc, test_loss = score(model)
    ps.report(accuracy=acc, loss=test_loss)
    print("device", dev, "accuracy", acc)
