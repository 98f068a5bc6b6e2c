"""A worker killed (kill -9) and started again: summary.json's staleness histogram counts
its earlier processes' pushes as their step lines have them, as samples and bytes do.
The coordinator heard a dead process only up to its last heartbeat: an ssp run's
summary.json had 497 histogram entries where the applied step lines were 597."""
from __future__ import annotations

import json
import os
import time

import pytest

from psgd import wire
from psgd.config import Config
from psgd.consistency.staleness import Histogram
from psgd.metrics import earlier_lives, json_line
from tests.conftest import free_port_block
from tests.test_coordinator_state import coordinator


def _line(t: float, step: int, tau: int, **extra) -> str:
    """A step line as Worker.log_step writes it (EventLog.write: json_line)."""
    return json_line({"t": t, "role": "worker", "rank": 1, "step": step, "clock": step, "loss": 0.5,
                      "samples": 32 * step, "staleness": tau, "wait_s": 0.001, "bytes_sent": 10 * step,
                      "bytes_recv": 20 * step, **extra})


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_earlier_lives_has_the_staleness_of_the_applied_step_lines(tmp_path):
    """Every applied push of this job's earlier processes: not an earlier job's line, not a
    dropped one (late behind sync's backup workers), not Downpour's step that pushed
    nothing (`pushed: false`, which repeats the latest push's τ), not a line cut short."""
    os.makedirs(tmp_path / "events")
    lines = [_line(5.0, 9, 30),                                          # an earlier job's
             _line(11.0, 1, 0), _line(11.1, 2, 3), _line(11.2, 3, 3, dropped=True),
             _line(11.3, 4, 2, dropped=False), _line(11.4, 5, 2, pushed=False),
             _line(12.0, 1, 40),                                         # a second process
             json.dumps({"step": 2, "t": 12.1, "role": "worker", "rank": 1, "staleness": 1, "samples": 64},
                        separators=(",", ":")) + "\n",                   # written otherwise: decoded
             _line(12.2, 3, 7)[:-30]]                                    # cut short as it was killed
    (tmp_path / "events" / "worker-1.jsonl").write_text("".join(lines))
    logged = earlier_lives(str(tmp_path), 1, since=10.0)
    hist = Histogram.of(logged)
    assert (hist.total, hist.tau_sum, hist.max) == (5, 0 + 3 + 2 + 40 + 1, 40)
    assert hist.as_dict() == {"0": 1, "1": 1, "2": 1, "3": 1, "32+": 1}
    assert logged["samples"] == 32 * 5 + 64 and logged["steps"] == 5 + 2
    # lines without a push's τ (none applied): no histogram, as before
    (tmp_path / "events" / "worker-1.jsonl").write_text(_line(11.0, 1, 4, dropped=True))
    assert "staleness_hist" not in earlier_lives(str(tmp_path), 1, since=10.0)


@pytest.mark.inprocess
@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["ssp", "easgd"])
def test_a_restarted_workers_earlier_processes_staleness_counts_as_their_step_lines_say(tmp_path, mode):
    """The new process for rank 1 sends its earlier process's step lines' histogram
    (`logged`); the coordinator takes it where it has more pushes than it heard, and
    summary.json's staleness is then the lines' (sync, ssp, async: a line a push). In
    easgd a line is a local step, not an exchange: what was heard stands."""
    cfg = Config().replace(**{"cluster.workers": 2, "cluster.port": free_port_block(3), "cluster.evaluator": False,
                              "mode.name": mode})
    c = coordinator(cfg, "")

    def serve(op: str, **kw) -> wire.Message:
        return [wire.decode(f) for _, f in c.service._serve(b"x", wire.encode(op, id=1, **kw))][-1]

    def hist(taus: list[int]) -> dict:
        h = Histogram()
        for tau in taus:
            h.add(tau)
        return h.stats()

    for r in range(2):
        c.service._serve(b"x", wire.encode("register", id=1, role="worker", want_rank=r, nonce=f"first{r}"))
    for r in range(2):   # heard: 3 pushes each
        serve("heartbeat", rank=r, clock=3, role="worker", index=r, live_id="",
              stats={"samples": 96, "steps": 3, **hist([1, 1, 1])})
    # rank 1's first process pushed twice more (τ 4, 5), logged them, and was killed
    assert serve("register", role="worker", want_rank=1, nonce="second1").get("assigned_rank") == 1
    logged = {"samples": 160, "steps": 5, **hist([1, 1, 1, 4, 5])}
    serve("heartbeat", rank=1, clock=6, role="worker", index=1, live_id="", logged=logged,
          stats={"samples": 32, "steps": 1, **hist([2])})
    serve("finish", rank=1, clock=8, stats={"samples": 96, "steps": 3, **hist([2, 2, 2])}, logged=logged)
    # rank 0's too, but its lines have fewer pushes than was heard (its last push had no line
    # when it died): what was heard stands
    assert serve("register", role="worker", want_rank=0, nonce="second0").get("assigned_rank") == 0
    serve("finish", rank=0, clock=8, stats={"samples": 160, "steps": 5, **hist([1] * 5)},
          logged={"samples": 96, "steps": 3, **hist([9, 9])})
    assert Histogram.of(c.members.stats()[0]).stats() == hist([1] * 8)
    got = Histogram.of(c.members.stats()[1])
    if mode == "ssp":
        assert (got.total, got.tau_sum, got.max) == (5 + 3, 1 + 1 + 1 + 4 + 5 + 6, 5)
    else:
        assert (got.total, got.tau_sum, got.max) == (3 + 3, 3 + 6, 2)
    assert c.members.stats()[1]["samples"] == 160 + 96   # (as before)
    c._finish_job()
    assert c.summary is not None
    assert c.summary["staleness"] == {"mean": round((got.tau_sum + 8) / (got.total + 8), 4), "max": got.max,
                                      "hist": (got.as_dict() | {"1": got.as_dict().get("1", 0) + 8})}


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_rank_lost_for_good_counts_in_the_summary_as_its_step_lines_say(tmp_path):
    """Rank 1's only process died before its first heartbeat with a count (a training
    script killed in its first second), and no process took its rank up to send what it
    logged: summary.json counted none of the steps that the shards had applied. The
    coordinator now reads the lost rank's step lines at the job's end; a rank heard with
    more than its lines say keeps what was heard, and lines of an earlier job, or of steps
    after training ended (a process dropped, and back then), do not count."""
    cfg = Config().replace(**{"cluster.workers": 3, "cluster.port": free_port_block(3), "cluster.evaluator": False,
                              "mode.name": "async"})
    c = coordinator(cfg, str(tmp_path))   # (its event log made DIR/events)
    t = c.launched_at
    (tmp_path / "events" / "worker-1.jsonl").write_text(
        "".join([_line(t - 100.0, 9, 30)] + [_line(t + 1.0 + s / 10, s, s % 2) for s in range(1, 5)]
                + [_line(t + 5.0, 5, 0)]))
    (tmp_path / "events" / "worker-2.jsonl").write_text(_line(t + 1.0, 1, 0))

    def serve(op: str, **kw) -> wire.Message:
        return [wire.decode(f) for _, f in c.service._serve(b"x", wire.encode(op, id=1, **kw))][-1]

    for r in range(3):
        c.service._serve(b"x", wire.encode("register", id=1, role="worker", want_rank=r, nonce=f"first{r}"))
    serve("heartbeat", rank=1, clock=0, role="worker", index=1, live_id="", stats={"samples": 0})
    serve("heartbeat", rank=2, clock=3, role="worker", index=2, live_id="",
          stats={"samples": 96, "steps": 3, "staleness_hist": [3], "staleness_sum": 0, "staleness_max": 0})
    serve("finish", rank=0, clock=5, stats={"samples": 160, "steps": 5})
    for r in (1, 2):
        c.members.members[r].last_seen = -1e9
    assert c.members.expire(0.0) == [1, 2]
    c.t_end = time.monotonic() - (time.time() - (t + 2.0))   # training ended at t + 2 s
    # the final score, settled at its arrival (no worker live): at the count heard then (a review: its
    # samples stayed below summary.json's, which holds the credited steps)
    c.evals.append({"t": 2.5, "samples": c.samples(), "accuracy": 0.9, "loss": 0.3, "final": True})
    c._finish_job()
    assert c.summary is not None
    assert c.summary["evals"][-1]["samples"] == c.summary["samples"] == 160 + 128 + 96
    got = c.members.stats()
    assert (got[1]["samples"], got[1]["steps"], got[1]["bytes_sent"]) == (32 * 4, 4, 40)
    assert Histogram.of(got[1]).as_dict() == {"0": 2, "1": 2}
    assert got[2]["samples"] == 96 and Histogram.of(got[2]).total == 3   # heard more than its one line
    assert c.summary["samples"] == 160 + 128 + 96


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_earlier_lives_survives_two_lives_run_together_and_reads_a_tail(tmp_path):
    """A review: a line cut short (its process killed) with the next process's first line
    appended to it passed the step head's test and then failed to decode, raising out of
    the coordinator's end of the job (at every restart: no summary, ever). Such a line is
    not a process's last. And the coordinator reads only a file's tail: the last
    process's counters are whole there."""
    os.makedirs(tmp_path / "events")
    torn = _line(11.4, 4, 0)[:-40] + _line(12.0, 1, 0)   # (the first process's 4th line, cut; no newline)
    (tmp_path / "events" / "worker-1.jsonl").write_text(
        "".join(_line(11.0 + s / 10, s, 0) for s in range(1, 4)) + torn + _line(12.1, 2, 0))
    # (a later review: the torn line became the first process's last, and, undecodable, took the first
    # process's count with it: 64. The second process's line in it is read; the first's last whole line stands)
    got = earlier_lives(str(tmp_path), 1, since=10.0)
    assert (got["samples"], got["steps"]) == (96 + 64, 3 + 2)
    long = "".join(_line(11.0 + s / 1000, s, 0) for s in range(1, 201))
    (tmp_path / "events" / "worker-1.jsonl").write_text(long)
    tail = earlier_lives(str(tmp_path), 1, since=10.0, tail_bytes=2000)
    assert (tail["samples"], tail["steps"]) == (32 * 200, 200)
    assert Histogram.of(tail).total < 200 == Histogram.of(earlier_lives(str(tmp_path), 1, since=10.0)).total
