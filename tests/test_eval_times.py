"""The times and sample counts of the evaluator's scores, as the coordinator records them
(servers/coordinator.py's on_eval): in summary.json, the event log and TensorBoard."""
from __future__ import annotations

import json
import time

import pytest
import zmq

from psgd import wire
from psgd.config import Config
from psgd.report_numbers import AFTER_END, ttt_flag
from psgd.servers.coordinator import Coordinator
from tests.conftest import free_port_block


def coordinator(out: str, **sets) -> Coordinator:
    """A coordinator in training, its socket closed: its scores are given by hand."""
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 1, "cluster.servers": 1,
                              "cluster.timeout_s": 60.0, **sets})
    ctx = zmq.Context()
    c = Coordinator(cfg, out, ctx=ctx, quiet=True)
    c.service.close()
    ctx.term()
    c.members.join(0.0, 0)
    c.phase = "training"
    return c


def score(c: Coordinator, monkeypatch, now: float, accuracy: float, final: bool = False) -> None:
    """The evaluator's score of the model it read at time.monotonic() `now`."""
    monkeypatch.setattr(time, "monotonic", lambda: now)
    try:
        fields = {"job": c.job, "accuracy": accuracy, "loss": 0.5, "final": final}
        c.on_eval(b"e", wire.Message("eval", 1, fields=fields))
    finally:
        monkeypatch.undo()


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_score_read_just_after_training_ended_is_after_the_end(tmp_path, monkeypatch):
    """A score's t was rounded to 3 decimals and wall_s to 6: a score the evaluator read
    0.02 ms after training ended (before it knew) was written at 1.234 s of a 1.2344 s
    run, so its time to target ranked the run, not flagged as after the end."""
    c = coordinator(str(tmp_path))
    c.t0 = 100.0
    score(c, monkeypatch, 100.5, 0.5)
    c.phase, c.t_end = "final_eval", 101.2344   # the workers are done
    score(c, monkeypatch, 101.23442, 0.95)      # read before the evaluator knew
    score(c, monkeypatch, 101.3, 0.96, final=True)
    c.events.close()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["evals"][1]["t"] > summary["wall_s"], summary
    assert summary["time_to_target_s"] > summary["wall_s"] and ttt_flag(summary, None) == AFTER_END, summary


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_tensorboard_puts_each_score_at_its_samples_in_summary_json(tmp_path, monkeypatch):
    """TensorBoard's job/accuracy and job/loss were written when a score arrived, at the
    heartbeats' count then, while summary.json later put the score at the count at its
    read (thousands of samples apart: at 0 and 8,416 in TensorBoard, 7,318 and 17,221 in
    summary.json). They are written once that count is settled, at summary.json's."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    c = coordinator(str(tmp_path), **{"eval.tensorboard": True})
    c.t0 = 100.0

    def beat(now: float, samples: int) -> None:
        c.members.beat(0, now, samples // 32, {"samples": samples, "elapsed_s": now - 100.0})
        c._count(0, now)
    beat(100.2, 1000)
    score(c, monkeypatch, 100.5, 0.5)   # read between the beats: at 1,500 samples
    beat(100.8, 2000)
    score(c, monkeypatch, 100.9, 0.7)   # after the last beat (none comes): 2,000
    c.members.finish(0, 101.0, {"samples": 2400, "elapsed_s": 1.0})
    c.phase, c.t_end = "final_eval", 101.0
    score(c, monkeypatch, 101.1, 0.9, final=True)
    c.events.close()
    c.scalars.close()
    summary = json.loads((tmp_path / "summary.json").read_text())
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()
    board = [(p.step, round(p.value, 4)) for p in accumulator.Scalars("job/accuracy")]
    assert board == [(e["samples"], e["accuracy"]) for e in summary["evals"]], (board, summary["evals"])
    assert summary["evals"][0]["samples"] == 1500, summary["evals"]
