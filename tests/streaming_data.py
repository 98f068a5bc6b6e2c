"""A dataset factory for tests: torch Datasets whose samples are made on demand from
their index (never all in memory), as `data.name = "tests.streaming_data:on_demand"`."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset

CLASSES = 10
SHAPE = (3, 32, 32)


class OnDemand(Dataset):
    """Sample i: class i % 10, a fixed class centre plus noise seeded by i."""

    def __init__(self, n: int, offset: int = 0):
        self.n, self.offset = n, offset
        g = torch.Generator().manual_seed(0)
        self.centres = torch.randn((CLASSES,) + SHAPE, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        j = self.offset + i
        g = torch.Generator().manual_seed(j)
        y = j % CLASSES
        return self.centres[y] + 2.0 * torch.randn(SHAPE, generator=g), y


def on_demand() -> tuple[OnDemand, OnDemand]:
    """1,000,000 training samples of 3 x 32 x 32 floats (12 GB if held), 2,000 test ones."""
    return OnDemand(1_000_000), OnDemand(2_000, offset=10_000_000)
