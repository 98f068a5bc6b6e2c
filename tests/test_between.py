"""psgd's own worker writes a step's line as the step ends, before its next request
leaves (a kill -9 once the shards took a request loses no line of a step they hold but
that one), and draws its next batch while the request is on its way (`Worker.between`,
called by the client's `finish` before it waits): the batches are what they were when
they were drawn after the answer."""
from __future__ import annotations

import json

import pytest

from psgd.config import load
from psgd.inprocess import InProcessCluster
from tests.conftest import train_on_threads


def step_lines(path) -> list[dict]:
    return [e for e in (json.loads(x) for x in open(path)) if "staleness" in e]


@pytest.mark.inprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "diloco"])
def test_every_step_line_is_written_before_the_next_request_and_the_last_at_the_end(port_block, tmp_path,
                                                                                     mode):
    steps = 12
    cfg = load(None, [f"cluster.port={port_block(2)}", "cluster.workers=1", "cluster.servers=1",
                      "cluster.evaluator=false", f"mode.name={mode}", f"train.steps={steps}",
                      "mode.local_steps=3"], env={})
    path = tmp_path / "events" / "worker-0.jsonl"
    seen: list[tuple[int, int, int]] = []   # at each wait: (steps, step lines before it, the batches' position)

    def prepare(w):
        between = w.between

        def watched():
            before = len(step_lines(path)) if path.exists() else 0
            between()
            seen.append((w.steps, before, w.batches.pos))
        w.between = watched
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        codes = train_on_threads(cfg, str(tmp_path), cluster, prepare)
    assert codes == {0: 0}
    lines = step_lines(path)
    assert [e["clock"] for e in lines] == list(range(1, steps + 1))   # every step, in order, the last too
    assert all(a["t"] <= b["t"] for a, b in zip(lines, lines[1:], strict=False))
    waits = [s for s in seen if s[0] > 0]
    assert waits
    # When a request's wait begins, every step so far has its line: the latest one's was
    # written when it ended, before the request left.
    assert all(before == n for n, before, _ in waits)
    if mode == "sync":
        assert all(pos % 32 == 0 and pos > 0 for *_, pos in waits)   # the next batch is drawn (32 a batch)


@pytest.mark.unit
def test_a_step_line_is_written_at_once_in_order_with_the_other_events(tmp_path):
    from psgd.metrics import EventLog
    from psgd.workers.worker import Worker

    class Client:
        bytes_sent, bytes_recv = 10, 20
    w = Worker(load(None, [], env={}))
    w.cfg, w.rank, w.client, w.events = w.cfg0, 0, Client(), EventLog(str(tmp_path), "worker", 0)
    w.log_step(0, 0.001)
    assert [e["step"] for e in step_lines(tmp_path / "events" / "worker-0.jsonl")] == [1]
    w.event(kind="note")
    w.log_step(0, 0.001)
    assert [e.get("step") for e in map(json.loads, open(tmp_path / "events" / "worker-0.jsonl"))] == [1, None, 2]
    w.events.close()
