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


def _run(mode: str, t: float, evals: list[tuple[float, int, float]], target: float = 0.03) -> dict:
    return {"mode": mode, "label": mode, "workers": 1 if mode == "baseline" else 2, "wall_s": 1.0,
            "time_to_target_s": t, "target_accuracy": target, "final_accuracy": 0.97, "samples_per_s": 1e4,
            "evals": [{"t": a, "samples": n, "accuracy": acc, "loss": 1.0} for a, n, acc in evals]}


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_baseline_at_the_target_before_any_step_is_not_a_time():
    """A target at or below the untrained model's accuracy: the baseline's score at step 0
    met it, its time was 0.0 s, written as a resolved time, and every speedup against it
    was "0×". It is a first score (†), and no speedup is computed from a time of 0."""
    from psgd.report_numbers import FIRST_SCORE, build_rows, ttt_flag
    from psgd.report_tables import main_table
    base = _run("baseline", 0.0, [(0.0, 0, 0.0334), (0.01, 192, 0.37)])
    sync = _run("sync", 0.3, [(0.3, 1939, 0.81), (0.7, 9600, 0.97)])
    assert ttt_flag(base, 0.3) == FIRST_SCORE
    # a baseline that got there by training is timed as before
    assert ttt_flag(_run("baseline", 0.01, [(0.0, 0, 0.0334), (0.01, 192, 0.37)], target=0.3), 0.3) is None
    rows = build_rows([base, sync])
    assert rows[1].speedup(rows[0]) is None
    table = "\n".join(main_table(rows, 0.03, 0.3))
    assert " 0×" not in table and "0.0000 †" in table, table
