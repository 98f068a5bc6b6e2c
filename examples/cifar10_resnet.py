"""CIFAR-10 on a small ResNet, from your own training loop, as a psgd worker.

    psgd run --script examples/cifar10_resnet.py --mode sync --workers 2 -- --data ~/cifar-10-batches-bin
    psgd run --script examples/cifar10_resnet.py --mode easgd --workers 2 --set train.steps=200

It reads the official binary files (data_batch_1.bin ... test_batch.bin) from --data
(a folder without them is an error), and without --data makes a synthetic CIFAR-shaped
set whose classes are learnable (a per-class pattern plus noise), so that it runs
anywhere. The loop is
an ordinary PyTorch loop; psgd adds three lines: connect (a `with` block, which closes
the connection at its end), step and report.
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import psgd


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ResNet(nn.Module):
    """A CIFAR ResNet (He et al. 2016): `n` blocks per stage, widths w, 2w, 4w."""

    def __init__(self, width: int = 16, n: int = 1, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for stage, cout in enumerate((width, 2 * width, 4 * width)):
            for i in range(n):
                layers.append(Block(cin, cout, 2 if stage and i == 0 else 1))
                cin = cout
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        return self.head(self.body(self.stem(x)).mean((2, 3)))


def cifar10(folder: str | None, synthetic: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, test): the real files in `folder`, or without one a learnable synthetic set."""
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    missing = [n for n in names if folder and not os.path.exists(os.path.join(folder, n))]
    if missing:   # a mistyped path would train on the synthetic set and call it CIFAR-10
        raise SystemExit(f"--data {folder}: no CIFAR-10 binary file {missing[0]} there (leave --data out for the "
                         f"synthetic set)")
    if folder:
        def read(name):
            raw = np.fromfile(os.path.join(folder, name), dtype=np.uint8).reshape(-1, 3073)
            x = torch.from_numpy(raw[:, 1:].reshape(-1, 3, 32, 32).astype(np.float32) / 255.0)
            return (x - 0.5) / 0.25, torch.from_numpy(raw[:, 0].astype(np.int64))
        parts = [read(n) for n in names[:5]]
        tx, ty = read(names[5])
        return TensorDataset(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])), TensorDataset(tx, ty)
    g = torch.Generator().manual_seed(0)  # the same set in every worker
    patterns = torch.randn(10, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (synthetic,), generator=g)
    x = patterns[y] + 1.5 * torch.randn(synthetic, 3, 32, 32, generator=g)
    cut = synthetic * 5 // 6
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def tournament_split(train: TensorDataset) -> tuple[TensorDataset, TensorDataset]:
    """(what the workers train on, ltfb's tournament data): the last tenth of the training
    set (at most 500 samples) held out, so that a tournament scores trainers on data that
    none of them trained on."""
    n = min(500, len(train) // 10)
    return (TensorDataset(*[t[:-n] for t in train.tensors]), TensorDataset(*[t[-n:] for t in train.tensors]))


def loader(train: TensorDataset, world_size: int, rank: int, batch: int) -> tuple[DistributedSampler, DataLoader]:
    """This worker's share of `train` in batches of `batch`, the last partial batch dropped
    (so that every step's batch has the same size), except where the share is smaller than
    one batch: then the whole share is the batch, as psgd's own workers do, instead of an
    empty loader around which the loop would spin without ever stepping."""
    sampler = DistributedSampler(train, num_replicas=world_size, rank=rank, seed=0)
    return sampler, DataLoader(train, batch_size=batch, sampler=sampler, drop_last=len(sampler) >= batch)


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorDataset, chunk: int = 1000) -> tuple[float, float]:
    """(accuracy, mean loss) over the whole of `data` (CIFAR-10's 10,000 test images
    included), `chunk` samples a forward pass."""
    was = model.training
    model.eval()
    out = torch.cat([model(x) for x in data.tensors[0].split(chunk)])
    model.train(was)
    y = data.tensors[1]
    return (out.argmax(1) == y).float().mean().item(), nn.functional.cross_entropy(out, y).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", help="folder with the CIFAR-10 binary files")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=1, help="blocks per stage (3 = ResNet-20)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05,
                    help="this script's optimizer's learning rate: easgd, diloco and ltfb step it; in sync, "
                         "ssp and async the shards run [optimizer] (optimizer.lr) instead")
    ap.add_argument("--synthetic", type=int, default=6000, help="samples of the synthetic set")
    a = ap.parse_args()

    torch.manual_seed(0)
    train, test = cifar10(a.data, a.synthetic)
    model = ResNet(a.width, a.blocks)
    optimizer = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    train, tournament = tournament_split(train)  # ltfb scores trainers on data held out of training
    with psgd.connect(model, optimizer, score=lambda m: evaluate(m, tournament)) as ps:
        sampler, batches = loader(train, ps.world_size, ps.rank, a.batch)
        epoch, going = 0, True
        while going:
            sampler.set_epoch(epoch)
            for x, y in batches:
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                if not ps.step(loss, samples=len(y)):
                    going = False
                    break
            epoch += 1
        acc, test_loss = evaluate(model, test)
        ps.report(accuracy=acc, loss=test_loss)


if __name__ == "__main__":
    main()
