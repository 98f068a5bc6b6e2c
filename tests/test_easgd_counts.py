"""What easgd's shards count of the elastic offers: an offer is counted by its verdict
(taken, late, or a resend), and the counters of sync rounds are those of the rounds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from psgd import wire
from psgd.config import Config
from psgd.consistency.easgd import EasgdSchedule
from psgd.shard import Shard
from tests.loopback import FakeTrainer, Loopback

pytestmark = pytest.mark.unit

ALPHA = 0.3


def shard_of(sync: bool, workers: int = 2, **sets) -> Shard:
    return Shard(Config().replace(**{"mode.name": "easgd", "mode.sync": sync, "cluster.workers": workers,
                                     "cluster.servers": 1, "mode.alpha": ALPHA, "mode.tau": 1, **sets}), 0)


def offer(shard: Shard, rank: int, round_: int, x: torch.Tensor) -> wire.Message:
    return wire.decode(wire.encode("elastic", id=9 + rank, rank=rank, clock=round_, round=round_,
                                   arrays=[x.numpy(), np.zeros(shard.B, np.float32)]))


def answer(replies: list, token) -> wire.Message:
    return wire.decode(dict(replies)[token])


@pytest.mark.timeout(60)
def test_sync_a_resend_of_an_answered_offer_is_a_resend_not_counted_dropped():
    """Round 0 closes with both workers' offers; worker 0 did not get its answer and
    resends. It was counted in `dropped` (late gradients) and answered `dropped`, as if
    its round had closed without it: it is answered as async answers a resend, with its
    d and the centre unmoved, and `dropped` counts the late offers only."""
    shard = shard_of(sync=True)
    c0 = shard.params.detach().clone()
    x0, x1 = c0 + 1.0, c0 - 2.0
    shard.handle("worker 0", offer(shard, 0, 0, x0))
    shard.handle("worker 1", offer(shard, 1, 0, x1))
    c1 = shard.params.detach().clone()
    m = answer(shard.handle("resend", offer(shard, 0, 0, x0)), "resend")
    assert m.op == "reply" and m.get("duplicate") is True and m.get("dropped") is None
    torch.testing.assert_close(torch.from_numpy(m.arrays[0].copy()), ALPHA * (x0 - c1))
    assert shard.version == 1 and torch.equal(shard.params.detach(), c1)
    assert shard.stats()["dropped"] == 0


@pytest.mark.timeout(60)
def test_sync_a_late_offer_is_counted_dropped_once_and_its_resend_is_a_resend():
    """Worker 1 was not live when round 0 closed: its offer is late, answered `dropped`
    and counted; its resend is a resend, not a second late offer."""
    shard = shard_of(sync=True)
    shard.set_live({0: 0})
    c0 = shard.params.detach().clone()
    shard.handle("worker 0", offer(shard, 0, 0, c0 + 1.0))
    late = answer(shard.handle("late", offer(shard, 1, 0, c0 - 2.0)), "late")
    assert late.get("dropped") is True and shard.stats()["dropped"] == 1
    again = answer(shard.handle("resend", offer(shard, 1, 0, c0 - 2.0)), "resend")
    assert again.get("duplicate") is True and shard.stats()["dropped"] == 1 and shard.version == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sync", [False, True])
def test_a_resent_offer_is_not_counted_as_another_push(sync):
    """The shard counted every elastic offer in `pushes` as it came, before the rule
    decided whether it was taken, late or a resend: a resend (async: of a round that
    moved the centre; sync: of an answered round, or of one still open) counted as an
    offer that moved the centre. A push's resend counts in `duplicates`, not `pushes`."""
    shard = shard_of(sync)
    c0 = shard.params.detach().clone()
    shard.handle("first", offer(shard, 0, 0, c0 + 1.0))
    shard.handle("resend", offer(shard, 0, 0, c0 + 1.0))       # sync: the round is open
    shard.handle("worker 1", offer(shard, 1, 0, c0 - 2.0))
    shard.handle("resend again", offer(shard, 1, 0, c0 - 2.0))  # its round (sync) or round (async) answered
    assert shard.version == (1 if sync else 2)
    assert (shard.counters["pushes"], shard.counters["duplicates"]) == (2, 2)
    if sync:   # an offer waiting for a later round, and its resend
        shard.handle("ahead", offer(shard, 0, 2, c0 + 1.0))
        shard.handle("ahead again", offer(shard, 0, 2, c0 + 1.0))
        assert (shard.counters["pushes"], shard.counters["duplicates"]) == (3, 3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sync", [False, True])
def test_each_exchange_is_in_the_workers_staleness_histogram_and_none_in_the_shards(sync):
    """summary.json's staleness histogram is the workers' (`metrics.summarize`): the
    exchange counts one sample per exchange in either variant (sync's 0: the round's
    own move is not another's). The rule's own histogram counts no offer in either
    variant: sync rounds are not behind async there."""
    steps = 6
    cfg = Config().replace(**{"mode.name": "easgd", "mode.sync": sync, "cluster.workers": 1, "cluster.servers": 1,
                              "mode.tau": 2, "mode.alpha": ALPHA, "train.steps": steps})
    shards = [Shard(cfg, 0)]
    w = FakeTrainer(cfg, Loopback(shards, 0), lambda x: 0.5 * x - 0.1)
    schedule = EasgdSchedule(cfg)
    schedule.start(w)
    for _ in range(steps):
        schedule.step(w)
    schedule.finish(w)
    assert w.hist.total == steps // 2 + 1 and w.hist.max == 0   # rounds 0, 1, 2 and the budget's end, round 3
    assert shards[0].stats()["staleness_hist"] == [0] * len(w.hist.counts)


@pytest.mark.timeout(60)
def test_sync_rounds_answer_no_offer_ahead_of_the_slowest_live_worker():
    """max_clock_gap counts the lead of an answered offer's round over the slowest live
    worker's latest (async: `test_async_the_clock_gap_is_the_lead_...`). A sync round
    answers its offers when every live worker has offered for it or waits ahead (a
    straggler holds the round; a shard restored from an older checkpoint skips to the
    workers' round): the lead of every answer, counted here, is 0, as stats() say."""
    shard = shard_of(sync=True, workers=3, **{"train.steps": 40})
    old = shard.state_dict()
    c = shard.params.detach().clone()
    latest = {0: -1, 1: -1, 2: -1}
    lead = []

    def send(rank, rnd, s=shard):
        latest[rank] = max(latest[rank], rnd)
        for token, _ in s.handle((rank, rnd), offer(s, rank, rnd, c + rank)):
            lead.append(token[1] - min(latest.values()))

    for rnd in range(4):
        for rank in (0, 2, 1) if rnd % 2 else (1, 0, 2):   # rank 1, the straggler, last in odd rounds
            send(rank, rnd)
    assert len(lead) == 12 and shard.version == 4
    restored = shard_of(sync=True, workers=3, **{"train.steps": 40})
    restored.load_state_dict(old)   # round 0; the workers offer round 4
    for rank in (2, 0, 1):
        send(rank, 4, restored)
    assert len(lead) == 15 and restored.version == 1
    assert max(lead) == 0
    assert shard.stats()["max_clock_gap"] == restored.stats()["max_clock_gap"] == 0
