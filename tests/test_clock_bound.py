"""The coordinator's bound on a worker's clock in a job without a step limit
(`train.steps = 0`, a `train.seconds` budget). With a step limit it refuses a clock past
the job's last step (tests/test_coordinator_state.py); without one it kept any clock the
wire carries (up to 2**62): a peer's 2**60 became the live set's clock, the start of a
new process taking up a lost rank, and that worker's every heartbeat was then refused
(its counters carry its clock, and a counter past 2**53 is refused), so it was dropped."""
from __future__ import annotations

import time

import pytest

from psgd import wire
from psgd.servers import coordinator
from tests.conftest import ask, closed_after, hand_served
from tests.test_hostile_peers import honest_worker_stats

UNBOUNDED = {"train.steps": 0, "train.seconds": 60.0, "mode.name": "sync"}


def lose_and_restart_rank_0(c) -> wire.Message:
    """Rank 0 missed its heartbeats and a new process (another nonce) takes it up: where
    the shards share a step it starts at the slowest live worker's clock."""
    c.members.members[0].last_seen -= 3600
    c.members.expire(time.monotonic())
    return ask(c, "register", role="worker", want_rank=0, nonce="n0-again")


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_clock_no_worker_reaches_is_refused_without_a_step_limit():
    with closed_after(hand_served(workers=2, **UNBOUNDED)) as c:
        told = [ask(c, "heartbeat", role="worker", rank=1, clock=2 ** 60, nonce="n1")]
        again = lose_and_restart_rank_0(c)
        beat = ask(c, "heartbeat", role="worker", rank=0, clock=again.get("start_clock"), nonce="n0-again",
                   stats={**honest_worker_stats(), "clock": again.get("start_clock")})
        # (kept, the clock was the new process's start, and its heartbeats were refused)
        assert again.op == "reply" and again.get("start_clock") == 0
        assert beat.op == "reply" and not beat.get("rejoin"), beat.fields
        assert c.members.live() == {0: 0, 1: 0}
        told.append(ask(c, "finish", rank=1, clock=2 ** 60, nonce="n1"))
        assert c.members.live() == {0: 0, 1: 0}
        for m in told:
            assert (m.op, m.get("code")) == ("error", wire.REFUSED), m.fields
            assert "train.steps = 0" in m.get("reason") and f"{coordinator.MAX_CLOCK:,}" in m.get("reason")


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_every_clock_up_to_the_bound_is_kept():
    """The bound is no honest worker's: every clock up to it is a clock (and a counter)
    the coordinator keeps, and a new process started there is heard."""
    top = coordinator.MAX_CLOCK
    with closed_after(hand_served(workers=2, **UNBOUNDED)) as c:
        assert ask(c, "heartbeat", role="worker", rank=1, clock=top, nonce="n1").op == "reply"
        assert ask(c, "heartbeat", role="worker", rank=1, clock=top + 1, nonce="n1").get("code") == wire.REFUSED
        assert c.members.live()[1] == top
        again = lose_and_restart_rank_0(c)
        assert again.get("start_clock") == top
        beat = ask(c, "heartbeat", role="worker", rank=0, clock=top, nonce="n0-again",
                   stats={**honest_worker_stats(), "clock": top})
        assert beat.op == "reply" and not beat.get("rejoin")
        assert ask(c, "finish", rank=1, clock=top, nonce="n1").op == "reply"


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_shard_refuses_a_clock_past_the_bound_without_a_step_limit(mode):
    """The shard's side: a pull (or a push's read) at a clock past MAX_CLOCK moved sync's
    barrier, or set an ssp rank's clock, for good; without a step limit it was taken."""
    from tests.test_hostile_peers import request, small_shard
    shard = small_shard(mode, workers=2, **{"train.steps": 0, "train.seconds": 60.0})
    with pytest.raises(wire.WireError, match="is past any worker's") as e:
        shard.handle("w", request("pull", rank=0, clock=2 ** 60))
    assert "train.steps = 0" in e.value.reason
    assert shard.handle("w", request("pull", rank=1, clock=coordinator.MAX_CLOCK)) is not None
