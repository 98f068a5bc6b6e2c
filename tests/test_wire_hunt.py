"""Defects found by using the fewer-bytes path (`wire.dtype`, `wire.compression`) as
users do (helper H, session 29)."""
from __future__ import annotations

import pytest
import torch

from psgd import compression
from psgd.compression import ErrorFeedback, decode


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("size,fraction", [(8, 1.0), (2, 1.0), (9, 1.0), (3, 0.9)])
def test_a_topk_push_of_every_value_of_its_shard_is_not_warned_of(size, fraction, capsys, monkeypatch):
    """`psgd simulate --servers 6 --set model.hidden=8 --set wire.compression=topk --set
    wire.topk_fraction=1` warned "topk pushes 8 of a shard's 8 values (wire.topk_fraction = 1):
    ... error feedback sends each value in rare bursts ...; raise wire.topk_fraction": a
    push of the whole shard leaves nothing out (the residual stays zero), and the fraction
    cannot be raised past 1."""
    monkeypatch.setattr(compression, "_warned", set())
    assert compression.topk_count(size, fraction) == size
    assert compression.few_elements("topk", size, fraction) == ""
    ef = ErrorFeedback("topk", size, fraction)
    g = torch.randn(size)
    first, last = ef.encode(g)
    assert torch.equal(decode("topk", first, last, size), g) and not ef.residual.any()
    assert "warning" not in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_topk_push_that_leaves_values_out_is_still_warned_of(monkeypatch):
    monkeypatch.setattr(compression, "_warned", set())
    assert "pushes 5 of a shard's 442 values" in compression.few_elements("topk", 442, 0.01)
    assert "pushes 7 of a shard's 8 values" in compression.few_elements("topk", 8, 0.8)
