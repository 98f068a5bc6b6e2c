"""The evaluator's scores as a user comparing modes reads them: when the model it scores
was read (the time and samples its score is stamped with)."""
from __future__ import annotations

import time

import pytest

from psgd.config import Config
from psgd.workers.evaluator import Evaluator


class SlowClient:
    """A parameter client whose pull is answered `delay` s after it is asked (parked
    until rank 0's initial values, a busy machine): the answer is the model of then."""

    def __init__(self, delay: float):
        self.delay = delay
        self.answered_at = 0.0

    def pull(self, clock: int) -> list:
        time.sleep(self.delay)
        self.answered_at = time.monotonic()
        return [{"step": 17}]

    @staticmethod
    def tables(msgs):
        return [], []


class Replica:
    def load(self, params, buffers) -> None:
        pass

    @staticmethod
    def score_batches(batches):
        return 0.5, 1.0


class Data:
    @staticmethod
    def test_batches(batch_size: int):
        return iter(())


@pytest.mark.unit
@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["sync", "async", "easgd", "diloco"])
def test_a_score_is_timed_when_the_model_was_answered_not_asked_for(mode):
    """A read that waited (0.3 s here) was timed from its request: the coordinator stamped
    the score with the time and the workers' samples of before the wait, while the model
    scored was the one answered at its end (sync, 2 workers: step 17's model, 1,088
    samples, stamped 418), so time to target and accuracy vs samples came out early."""
    ev = Evaluator.__new__(Evaluator)
    ev.cfg = Config().replace(**{"mode.name": mode})
    ev.client, ev.replica, ev.ds = SlowClient(0.3), Replica(), Data()
    asked = time.monotonic()
    acc, loss, read_at = ev.evaluate()
    assert (acc, loss) == (0.5, 1.0)
    assert read_at >= ev.client.answered_at > asked + 0.25, (asked, ev.client.answered_at, read_at)
