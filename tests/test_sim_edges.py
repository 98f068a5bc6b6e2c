"""`psgd simulate` at its edges: a refused request's others still on their way, and
virtual times below a microsecond."""
from __future__ import annotations

import json

import pytest

from psgd import wire
from psgd.config import load
from psgd.shard import Shard
from psgd.sim.run import Simulation


@pytest.mark.inprocess
def test_a_refused_push_drops_what_had_not_left_the_worker_as_the_real_clients_abandon_does(monkeypatch):
    """The real client gives up a refused request's others (`ParameterClient.abandon`): a
    fresh connection drops what still waits to leave. 1 worker, 3 shards, a slow link:
    shard 0 refuses the push of clock 2 while the push to shard 1 is leaving the worker's
    NIC and shard 2's waits behind it. The simulated worker sent shard 2's all the same
    (applied, so the retry of clock 2 was a duplicate there), and held its retry behind
    those bytes."""
    check, refused = Shard._check_push, []

    def refuses_once(self, msg, read_version):
        if self.index == 0 and msg.clock == 2 and not refused:
            refused.append(msg.clock)
            raise wire.WireError(wire.REFUSED, "refused once")
        return check(self, msg, read_version)
    monkeypatch.setattr(Shard, "_check_push", refuses_once)
    cfg = load(None, ["mode.name=async", "cluster.workers=1", "cluster.servers=3", "sim.train=false",
                      "sim.compute_s=0.01", "train.steps=4", "sim.latency_s=1e-6", "sim.bandwidth_gbps=0.01",
                      "sim.apply_gbps=1000"])
    sim = Simulation(cfg, cfg.sim.compute_s)
    s = sim.run()
    assert refused == [2] and s["rejected"] == 1 and s["samples"] == 5 * 32, s   # (the refused step computed too)
    shards = [sh.counters for sh in sim.shards]
    # shard 1's push had left: the retry's is its duplicate; shard 2's had not: only the retry's came
    assert [c["pushes"] for c in shards] == [4, 4, 4] and [c["duplicates"] for c in shards] == [0, 1, 0], shards


@pytest.mark.unit
def test_virtual_times_are_written_to_the_microsecond_and_to_3_digits_below_a_tenth_of_a_ms():
    from psgd.metrics import written
    assert written(12.3456789) == 12.345679 and written(1.23456789e-4) == 0.000123
    assert written(1.23456e-7) == 1.23e-7 and written(4e-7) == 4e-7 and written(5.5e-5) == 5.5e-5
    assert written(0.0) == 0.0


@pytest.mark.inprocess
def test_sub_microsecond_virtual_times_are_not_written_as_zeros(tmp_path):
    """A cost model of 0.1 µs steps and 10 ns links: every time was rounded to the
    microsecond, so the first steps were written at t 0.0 with waits of 0.0, and the
    workers' elapsed_s and wait_s (summary.json's wait_fraction: 0.0) too."""
    cfg = load(None, ["mode.name=async", "cluster.workers=2", "cluster.servers=1", "sim.train=false",
                      "sim.compute_s=1e-7", "train.steps=5", "sim.latency_s=1e-8", "sim.bandwidth_gbps=1e6",
                      "sim.apply_gbps=1e6"])
    sim = Simulation(cfg, cfg.sim.compute_s)
    s = sim.run(str(tmp_path))
    for w in sim.workers:
        steps = [json.loads(x) for x in open(tmp_path / "events" / f"worker-{w.rank}.jsonl")]
        ts = [x["t"] for x in steps]
        assert len(ts) == 5 and 0 < ts[0] and ts == sorted(set(ts)), ts   # apart, in order
        assert all(x["wait_s"] > 0 for x in steps), steps
        stats = w.stats()
        assert 0 < stats["wait_s"] < stats["elapsed_s"] < 1e-6, stats
    assert 0 < s["wait_fraction"] < 1, s["wait_fraction"]
    done = [json.loads(x) for x in open(tmp_path / "events" / "coordinator-0.jsonl")][-1]
    assert done["event"] == "done" and 0 < done["t"] < 1e-6 and done["wall_s"] == s["wall_s"], done
    # summary.json's own times too: its wall_s was written 0 or 1e-06 (samples_per_s off by a
    # quarter, or 0), and a shard's busy_s 0 (shard_busy_fraction [0.0])
    assert s["wall_s"] == done["t"] and s["samples_per_s"] == pytest.approx(s["samples"] / s["wall_s"], rel=0.01)
    assert 0 < s["shard_busy_fraction"][0] < 1, s["shard_busy_fraction"]


@pytest.mark.unit
def test_a_progress_line_says_a_short_virtual_run_in_significant_digits():
    from psgd.simulate import seconds_said
    assert seconds_said(2.6354) == "2.635" and seconds_said(0.0123) == "0.012"
    assert seconds_said(3.1e-5) == "3.1e-05" and seconds_said(0.0) == "0.000"   # (was 0.000 s)
