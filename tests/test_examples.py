"""The examples' own data (examples/): what ltfb's tournaments score a model on (the
script's `score=`) is held out of what the script trains on and of what it reports its
score on, as psgd's own ltfb holds the tournament data out of each partition."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import example

pytestmark = pytest.mark.unit


def rows(x: torch.Tensor) -> set[bytes]:
    return {r.numpy().tobytes() for r in x.reshape(len(x), -1)}


def test_custom_loss_scores_its_tournaments_on_other_data_than_its_test_set():
    """A review: the pinball example's score=, ltfb's tournament data, was the first 500
    windows of its test set, which it then reported its accuracy on: the reported score
    was that of the model the tournaments picked on the same windows."""
    ex = example("custom_loss")
    torch.manual_seed(0)
    (tour_x, _), (test_x, _) = ex.held_out()
    assert len(tour_x) and len(test_x) and not rows(tour_x) & rows(test_x)


@pytest.mark.parametrize("size", [1200, 6000])
def test_the_cifar_example_holds_its_tournament_data_out_of_training(size):
    """A review: the CIFAR example's tournament data was the last 500 samples of the
    training set, which every worker also trained on: a tournament scored trainers on
    data they had fit."""
    ex = example("cifar10_resnet")
    train, _ = ex.cifar10(None, size)
    fit, tournament = ex.tournament_split(train)
    assert len(fit) + len(tournament) == len(train) and 0 < len(tournament) <= 500
    assert not rows(fit.tensors[0]) & rows(tournament.tensors[0])


def test_the_cifar_example_steps_with_a_batch_larger_than_its_share():
    """A user: `-- --synthetic 1200 --batch 512` with 2 workers (450 training samples
    each) never stepped: the loader dropped its only, partial, batch, and the loop went
    round an empty loader until psgd run's --timeout. The share is then the batch."""
    ex = example("cifar10_resnet")
    train, _ = ex.tournament_split(ex.cifar10(None, 1200)[0])
    sizes = [len(y) for _, y in ex.loader(train, 2, 0, 512)[1]]
    assert sizes == [450]
    assert {len(y) for _, y in ex.loader(train, 2, 1, 32)[1]} == {32}   # a share of several batches: whole ones


def test_the_cifar_example_scores_the_whole_test_set():
    """A review: the score the CIFAR example reported with --data was that of the first
    2,000 of CIFAR-10's 10,000 test images, which nothing said."""
    ex = example("cifar10_resnet")
    y = torch.arange(2500) % 10
    logits = torch.nn.functional.one_hot(y, 10).float()
    logits[2000:] = logits[2000:].roll(1, dims=1)     # the last 500 predicted wrong
    acc, loss = ex.evaluate(torch.nn.Identity(), torch.utils.data.TensorDataset(logits, y))
    assert acc == pytest.approx(0.8)


def test_custom_loss_draws_its_data_from_its_seed_alone():
    """A helper's review: the pinball example's noise came from torch's global generator,
    so its test set was the one the script drew only after `torch.manual_seed(0)` and
    building its model: held_out() in a fresh process scoring DIR/model.pt gave other
    windows, and another accuracy than the script's report."""
    ex = example("custom_loss")
    first = ex.held_out()
    torch.manual_seed(123)
    torch.rand(7)
    again = ex.held_out()
    for (x, y), (x2, y2) in zip(first, again, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
