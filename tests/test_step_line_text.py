"""A worker's step line, written out directly by `EventLog.step` (every step), is the text
`EventLog.write` gives the same fields (the JSON encoder): the event log's contract."""
from __future__ import annotations

import math

import pytest

from psgd import metrics
from psgd.metrics import EventLog

pytestmark = pytest.mark.unit

CASES = [
    (0, 1, 1, 2.30258, 32, 0, 0.00012, 100, 200, {"dropped": False}),
    (3, 7, 9, math.nan, 64, 2, 0.5, 10**12, 5, {"dropped": True, "cached": True}),
    (3, 7, 9, math.inf, 64, 2, -0.0, 1, 5, {}),
    (3, 7, 9, 1e-7, 64, 2, 1e20, 1, 5, {"jitter": None, "n": 3, "x": 1.5}),   # a float extra: encoded
    (3, 7, 9, 1.0, 64, 2, 0.0, 1, 5, {"événement": True, "refused": True}),
    (True, 7, 9, 1.0, 64, 2, 0.0, 1, 5, {}),                                   # not an int: encoded
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_a_step_line_is_the_text_the_encoder_writes(tmp_path, monkeypatch, case):
    monkeypatch.setattr(metrics.time, "time", lambda: 1733333333.123456)
    direct, encoded = EventLog(str(tmp_path), "worker", 0), EventLog(str(tmp_path), "worker", 1)
    rank, step, clock, loss, samples, staleness, wait_s, sent, recv, extra = case
    direct.step(rank, step, clock, loss, samples, staleness, wait_s, sent, recv, dict(extra))
    encoded.write(rank=rank, step=step, clock=clock, loss=loss, samples=samples, staleness=staleness, wait_s=wait_s,
                  bytes_sent=sent, bytes_recv=recv, **extra)
    direct.close()
    encoded.close()
    assert open(direct.path).read() == open(encoded.path).read()
