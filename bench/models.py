"""Model factories for the benchmarks (`model.name = "bench.models:table"`).

psgd's daemons import them, so children need the repository root on PYTHONPATH
(bench/common.py's `child_env` sets it).
"""
from __future__ import annotations

import math

from torch import nn


def table(input_shape, num_classes):
    """One bias-free Linear: prod(input_shape) x num_classes float32 values, i.e. a
    parameter table of exactly 4 * that many bytes (split over the shards by psgd)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes, bias=False))
