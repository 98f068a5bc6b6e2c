"""A push that a shard answers `duplicate` was applied when this process had sent it
before (a resend after the shard restored a checkpoint holding it, a step refused by
another shard and tried again), and not when another process of the rank had (a
restarted worker repeating a clock). The staleness histogram and the step lines count
the same pushes either way: CI's kill -9 of a shard in a sync run (3 workers, 2 shards)
wrote 600 applied step lines against 599 pushes in summary.json's histogram, the
resend that the restored shard answered as a duplicate left out of the histogram only."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from psgd.config import Config
from psgd.consistency.pushpull import counted
from psgd.inprocess import InProcessCluster
from psgd.metrics import EventLog, Histogram, _applied_tau
from psgd.workers.client import ParameterClient

pytestmark = pytest.mark.inprocess


@pytest.mark.timeout(60)
def test_a_duplicate_counts_as_applied_only_for_the_process_that_sent_it_before(port_block, tmp_path):
    cfg = Config().replace(**{"cluster.port": port_block(3), "cluster.workers": 1, "cluster.servers": 2,
                              "mode.name": "async", "cluster.timeout_s": 10.0})
    with InProcessCluster(cfg) as cluster:
        first, second = ParameterClient(cfg, cluster.ctx, 0), ParameterClient(cfg, cluster.ctx, 0)
        try:
            params, buffers = first.tables(first.join(0))
            grads = [0.01 * p for p in params]
            w = SimpleNamespace(hist=Histogram())

            def push(client, clock):
                return counted(w, client.push_pull(clock, grads, buffers, [0, 0])[0])

            assert push(first, 0) == (0, False, False) and w.hist.total == 1                # applied
            tau, dropped, theirs = push(first, 0)      # the same process again (a refused step's retry)
            assert not theirs and w.hist.total == 2
            tau, dropped, theirs = push(second, 0)     # a new process for the rank, at a clock pushed
            assert theirs and not dropped and w.hist.total == 2
            assert push(second, 1)[2] is False and w.hist.total == 3
        finally:
            first.close()
            second.close()


@pytest.mark.timeout(30)
def test_a_step_line_of_another_processs_push_is_not_applied(tmp_path):
    """The lines say what the histogram counted: a new process for a rank credits its
    earlier ones' pushes from their lines (`metrics.earlier_lives`)."""
    log = EventLog(str(tmp_path), "worker", 0)
    log.step(0, 1, 1, 0.5, 32, 3, 0.001, 10, 10, {"dropped": False})
    log.step(0, 2, 2, 0.5, 64, 4, 0.001, 20, 20, {"dropped": False, "duplicate": True})
    log.close()
    lines = open(log.path).read().splitlines()
    assert [_applied_tau(x + "\n") for x in lines] == [3, None]
    assert _applied_tau('{"staleness": 4, "duplicate": true}') is None   # (the slow path, as a dict)


@pytest.mark.timeout(30)
def test_a_resend_to_one_shard_marks_that_shards_answer_only():
    """A review: a resend to one shard marked every shard's answer `resent`, so another
    shard's `duplicate` (a restarted worker repeating a clock its rank's earlier process
    pushed) was counted as this process's push, applied."""
    from psgd import wire
    from psgd.workers.client import InFlight
    client = ParameterClient.__new__(ParameterClient)
    reqs = [(0, "push", {"clock": 4, "pull": True}), (1, "push", {"clock": 4, "pull": True})]
    answers = [wire.Message("reply", 1, 0, 4, {"push": {"duplicate": True, "staleness": 0}}),
               wire.Message("reply", 2, 0, 4, {"push": {"duplicate": True, "staleness": 0}})]
    client.finish = lambda f: answers
    w = SimpleNamespace(hist=Histogram())
    f = InFlight(reqs, {}, [None, None], None, {}, resent={1})
    pushed, pulled = client.finish_push_pull(f)
    assert [bool(m.get("resent")) for m in pushed] == [False, True] and len(pulled) == 2
    assert counted(w, pushed)[2] is False          # shard 1's duplicate was this process's: applied
    f = InFlight(reqs, {}, [None, None], None, {}, repeat=True)   # a refused step's again: every shard had it
    assert [bool(m.get("resent")) for m in client.finish_push_pull(f)[0]] == [True, True]
    f = InFlight(reqs, {}, [None, None], None, {})                 # sent once: both duplicates another process's
    assert counted(w, client.finish_push_pull(f)[0])[2] is True
