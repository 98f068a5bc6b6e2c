"""A push and the read that follows it as one request (`push` with `pull: true`): the
shard serves the push, then the read of clock + 1, and answers once, with the read's
arrays and the push's answer in the field `push`. Served at shard level, with wire
messages, in every mode that pushes and pulls."""
from __future__ import annotations

import numpy as np
import pytest

from psgd import wire
from psgd.config import Config
from psgd.shard import Shard

pytestmark = pytest.mark.unit

_ids = iter(range(1, 1 << 30))


def shard_for(mode: str, workers: int, **sets) -> Shard:
    cfg = Config().replace(**{"mode.name": mode, "cluster.workers": workers, "cluster.servers": 1,
                              "optimizer.momentum": 0.0, **sets})
    return Shard(cfg, 0)


def push_read(shard: Shard, rank: int, clock: int, g: np.ndarray, read_version: int = 0, rid: int = 0):
    return wire.decode(wire.encode("push", id=rid or next(_ids), rank=rank, clock=clock, read_version=read_version,
                                   pull=True, arrays=[g, np.zeros(shard.B, np.float32)]))


def answers(replies) -> dict:
    return {tok: wire.decode(frames) for tok, frames in replies}


@pytest.mark.timeout(60)
def test_sync_one_reply_per_worker_when_the_step_closes():
    shard = shard_for("sync", 2)
    p0 = shard.params.detach().clone().numpy()
    g = [np.full(shard.P, 1.0 + r, np.float32) for r in range(2)]
    first = push_read(shard, 0, 0, g[0])
    assert shard.handle("w0", first) == []          # pushed; its read of clock 1 waits for the step
    out = answers(shard.handle("w1", push_read(shard, 1, 0, g[1])))
    assert set(out) == {"w0", "w1"} and out["w0"].id == first.id  # one reply each: the read's
    expect = p0 - shard.cfg.optimizer.lr * (g[0] + g[1]) / 2
    for m in out.values():
        assert m.op == "reply"
        np.testing.assert_allclose(m.arrays[0], expect, rtol=1e-6)
        assert m.get("version") == 1
        assert m.get("push")["staleness"] == 0 and not m.get("push").get("duplicate")
    assert shard.counters["pushes"] == 2 and shard.counters["pulls"] == 2


@pytest.mark.timeout(60)
def test_async_reply_carries_the_push_answer_and_the_new_parameters():
    shard = shard_for("async", 2)
    g = np.ones(shard.P, np.float32)
    out = answers(shard.handle("w0", push_read(shard, 0, 0, g)))
    m = out["w0"]
    assert m.get("version") == 1 and m.get("push") == {"staleness": 0, "version": 1}
    np.testing.assert_array_equal(m.arrays[0], shard.params.detach().numpy())
    # a push computed on version 0 after one more update: staleness 1
    m = answers(shard.handle("w1", push_read(shard, 1, 0, g, read_version=0)))["w1"]
    assert m.get("push")["staleness"] == 1 and m.get("version") == 2


@pytest.mark.timeout(60)
def test_a_resent_request_reads_again_and_is_not_applied_twice():
    shard = shard_for("async", 1)
    req = push_read(shard, 0, 0, np.ones(shard.P, np.float32))
    first = answers(shard.handle("a", req))["a"]
    again = answers(shard.handle("b", req))["b"]     # the same request on a fresh connection
    assert again.get("push") == {"duplicate": True, "staleness": 0, "version": 1}
    assert shard.version == 1 and shard.counters["duplicates"] == 1
    np.testing.assert_array_equal(again.arrays[0], first.arrays[0])


@pytest.mark.timeout(60)
def test_a_refused_push_is_the_answer_and_no_read_is_left_waiting():
    shard = shard_for("sync", 2)
    bad = np.full(shard.P, np.nan, np.float32)
    with pytest.raises(wire.WireError) as e:         # the serve loop makes it the request's error reply
        shard.handle("w0", push_read(shard, 0, 0, bad))
    assert e.value.code == wire.REFUSED
    assert shard.counters["pulls"] == 0              # the read was not served, so nothing parks
    # the step still closes on the two good pushes, answering only their requests
    good = np.ones(shard.P, np.float32)
    assert shard.handle("w0", push_read(shard, 0, 0, good)) == []
    out = answers(shard.handle("w1", push_read(shard, 1, 0, good)))
    assert set(out) == {"w0", "w1"} and all(m.op == "reply" for m in out.values())


@pytest.mark.timeout(60)
def test_pull_must_be_a_bool():
    with pytest.raises(wire.WireError) as e:
        wire.decode(wire.encode("push", id=1, read_version=0, pull=1))
    assert e.value.code == wire.BAD_FIELD


@pytest.mark.timeout(60)
def test_sync_a_waiting_push_superseded_by_a_newer_one_gets_the_error_itself():
    shard = shard_for("sync", 3)
    g = np.ones(shard.P, np.float32)
    assert shard.handle("w1", push_read(shard, 1, 0, g)) == []   # step 0 open, waiting for 0 and 2
    assert shard.handle("early", push_read(shard, 0, 1, g)) == []  # for step 1: waits at the shard
    out = answers(shard.handle("newer", push_read(shard, 0, 2, g)))
    assert out["early"].op == "error" and "superseded" in out["early"].get("reason")
    assert "newer" not in out                         # still waiting: step 0 lacks worker 2
    out = answers(shard.handle("w2", push_read(shard, 2, 0, g)))
    assert {"w1", "w2"} <= set(out) and all(out[k].op == "reply" for k in ("w1", "w2"))
    assert out["w1"].get("push") == {"staleness": 0, "version": 0}


# ---------------------------------------------------------------- replies that lend the tables
# Under a daemon that says when ZeroMQ is done with a reply's frames (`Shard.in_flight`,
# `Shard.sent`: servers/shard_server.py), a read's answer holds the tables themselves, not a copy.

def lending(in_flight: bool) -> Shard:
    shard = shard_for("async", 1)
    shard.in_flight = lambda: in_flight
    return shard


def reply_table(replies) -> np.ndarray:
    (_, frames), = replies
    return wire.decode(frames).arrays[0]


def lend_then_change(in_flight: bool, sent: bool):
    """A push and read whose reply holds the tables (handed to the transport if `sent`),
    then the next push, which changes them: (shard, the first reply's table, its values
    when made, whether it was lent)."""
    shard = lending(in_flight)
    g = np.ones(shard.P, np.float32)
    table = reply_table(shard.handle("a", push_read(shard, 0, 0, g)))
    lent, before = np.shares_memory(table, shard.params.detach().numpy()), table.copy()
    if sent:
        shard.sent()
    shard.handle("b", push_read(shard, 0, 1, g))
    return shard, table, before, lent


@pytest.mark.timeout(60)
def test_a_lent_table_moves_to_a_copy_when_it_changes_while_the_reply_is_read():
    shard, table, before, lent = lend_then_change(in_flight=True, sent=True)
    assert lent                                                       # not copied
    np.testing.assert_array_equal(table, before)                     # the first reply kept its values
    assert not np.shares_memory(table, shard.params.detach().numpy())
    assert not np.array_equal(shard.params.detach().numpy(), before)  # and the tables moved on


@pytest.mark.timeout(60)
def test_a_lent_table_changes_in_place_once_the_transport_is_done_with_it():
    shard, table, _, lent = lend_then_change(in_flight=False, sent=True)
    assert lent and np.shares_memory(table, shard.params.detach().numpy())   # no copy was made


@pytest.mark.timeout(60)
def test_a_reply_not_yet_sent_keeps_its_values():
    _, table, before, _ = lend_then_change(in_flight=False, sent=False)
    np.testing.assert_array_equal(table, before)
