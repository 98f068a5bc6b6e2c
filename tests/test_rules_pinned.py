"""Values of the rules that a mutation test found unpinned (session 51): each line of the
rule below could be changed (min for max, a reset or a count dropped, an off-by-one)
with every test passing, though the change gives users another value. Each test here
fails on that change."""
from __future__ import annotations

import pytest
import torch

from psgd.compression import onebit_encode, shapes
from psgd.config import Config
from psgd.consistency import get as get_mode
from psgd.consistency.rule import Push
from psgd.consistency.ssp import ClientCache, SspSchedule, guaranteed
from psgd.shard import Shard
from tests.test_async_knobs import rule as a_rule  # (a mode's rule over stand-in tables)

pytestmark = pytest.mark.unit


def test_a_read_of_several_shards_guarantees_the_smallest_of_their_clocks():
    """ssp with `mode.cache`: a copy read from shards that guarantee clocks 1 and 5 is
    good for clock 1 only; with the largest, a worker at clock 4 with bound 1 would
    compute on a copy older than the bound allows."""
    g = guaranteed([{"guaranteed": 1}, {"guaranteed": 5}])
    assert g == 1
    cache = ClientCache(1)
    cache.fill(g, {0, 1})
    assert not cache.fresh(4, {0, 1}) and cache.fresh(2, {0, 1})


def test_a_rejoining_worker_resumes_at_the_furthest_clock_its_shards_finished():
    """ssp and async (one class): the shards' answers say finished 3 and 5; the rank's
    pushes up to 5 were taken, so it goes on from 5, not 3 (its pushes 3 and 4 again)."""
    schedule = SspSchedule(Config().replace(**{"mode.name": "ssp"}))
    assert schedule.resume_clock([{"finished": 3}, {"finished": 5}]) == 5
    assert schedule.resume_clock([{"finished": 5}, {"finished": 3}]) == 5


def test_a_restored_ssp_shard_forgets_the_pushes_it_had_taken_of_each_rank():
    """The staleness of a push counts the updates by other workers since its read: a
    restored shard's own-push record is of the process before; one worker, read at 2,
    pushed at version 4 after the restore: both updates count (2), none is its own."""
    rule = a_rule("ssp", 1, **{"mode.cache": True})
    for k in range(5):
        rule.tables.version = k
        rule.push(Push(("push", 0), 0, k, 0, "g", "b"))
    rule.load_state_dict(rule.state_dict())
    rule.tables.version = 4
    answered = [d for d in rule.push(Push(("push", 0), 0, 5, 2, "g", "b")) if hasattr(d, "fields")]
    assert answered[0].fields["staleness"] == 2, answered


def test_a_new_sync_run_counts_its_short_steps_from_zero():
    """A resumed job reports its own run (README): summary.json's `short_steps` too."""
    rule, g = a_rule("sync", 2), torch.zeros(3)
    rule.push(Push(("push", 0), 0, 0, 0, g, g))
    rule.push(Push(("push", 1), 1, 1, 0, g, g))   # rank 1 is past step 0: it closes short
    assert rule.stats()["short_steps"] == 1
    rule.new_run()
    assert rule.stats()["short_steps"] == 0


def test_a_duplicate_sync_push_is_answered_dropped_and_counted_so():
    """summary.json's `dropped_gradients` counts what the workers' step lines say was dropped."""
    rule, g = a_rule("sync", 2), torch.zeros(3)
    rule.push(Push(("push", 0), 0, 0, 0, g, g))
    out = rule.push(Push(("push", 0, "again"), 0, 0, 0, g, g))
    assert [d.fields.get("dropped") for d in out if hasattr(d, "fields")] == [True]
    assert rule.stats()["dropped"] == 1


@pytest.mark.parametrize("steps,local,last", [(100, 10, 9), (101, 10, 10), (9, 10, 0), (10, 1, 9)])
def test_diloco_s_last_round_is_that_of_the_last_step(steps, local, last):
    """A shard takes pushes up to this round (`Shard._within_job`): one round more let a
    hostile or stale push of a round the job never has mark the rank's later ones duplicates."""
    cfg = Config().replace(**{"mode.name": "diloco", "train.steps": steps, "mode.local_steps": local})
    assert get_mode("diloco").rule.last_exchange(cfg) == last


def test_the_rate_a_worker_steps_its_own_copy_is_the_shards_over_the_workers():
    """async with n_fetch > 1 (and DC-ASGD's copies): a worker steps its copy at lr / W
    between fetches, as the shards apply each push at lr / W."""
    cfg = Config().replace(**{"mode.name": "async", "cluster.workers": 4, "cluster.servers": 1,
                              "mode.dc_lambda": 0.5, "mode.n_fetch": 4})
    assert Shard(cfg, 0).worker_lr(0) == pytest.approx(cfg.optimizer.lr / 4)


@pytest.mark.parametrize("size", [1, 7, 255, 256, 257, 512, 1000])
def test_a_shard_expects_the_onebit_arrays_an_honest_push_sends(size):
    """The shard validates a onebit push by `shapes`: at a multiple of 256 values (a block)
    a count of means one too many refused every honest push of that shard."""
    bits, means = onebit_encode(torch.randn(size))
    assert shapes("onebit", size, 0.01) == (("uint8", bits.numel()), ("float32", means.numel()))
    assert (str(bits.dtype), str(means.dtype)) == ("torch.uint8", "torch.float32")


# ------------------------------------------------------------ the second pass: easgd, ltfb, async, optim, onebit

def test_easgd_s_centre_takes_the_mean_of_its_workers_buffers():
    """BatchNorm's statistics in the centre model: an async offer mixes its buffers in at
    1/W (two workers: halfway from the centre's to the offer's); a sync round sets them
    to the offers' mean (1.0 and 3.0: 2.0), not their sum."""
    from tests.test_easgd_rejoin_resend import elastic
    for sync, offers in ((False, (1.0,)), (True, (1.0, 3.0))):
        cfg = Config().replace(**{"mode.name": "easgd", "cluster.workers": 2, "cluster.servers": 1,
                                  "model.name": "cnn", "mode.sync": sync})
        shard = Shard(cfg, 0)
        x, before = shard.params.detach().clone(), shard.buffers.clone()
        for rank, b in enumerate(offers):
            msg = elastic(shard, rank, 0, x, id_=9 + rank)
            msg.arrays[1] = torch.full((shard.B,), b).numpy()
            shard.handle(f"r{rank}", msg)
        want = torch.full((shard.B,), 2.0) if sync else (before + 1.0) / 2
        assert shard.B and torch.allclose(shard.buffers, want), (sync, shard.buffers[:3])


def test_easgd_staleness_is_never_negative_after_a_shard_restored_an_older_checkpoint():
    from psgd.consistency.easgd import EasgdSchedule
    from tests.loopback import FakeTrainer, Loopback
    cfg = Config().replace(**{"mode.name": "easgd", "mode.sync": False, "mode.tau": 1, "mode.alpha": 0.3,
                              "cluster.workers": 1, "cluster.servers": 1, "optimizer.momentum": 0.0})
    shards = [Shard(cfg, 0)]
    w = FakeTrainer(cfg, Loopback(shards, 0), lambda x: x.clone(), rank=0)
    s = EasgdSchedule(cfg)
    s.start(w)
    s.step(w)
    ckpt = shards[0].state_dict()
    for _ in range(3):
        s.step(w)
    shards[0] = Shard(cfg, 0)
    shards[0].load_state_dict(ckpt)   # restarted from the checkpoint of round 0: versions go back
    s.step(w)
    assert [st for _, st, _ in w.logged] == [0, 0, 0, 0, 0]


def test_easgd_s_default_alpha_with_one_worker_is_beta_over_one():
    cfg = Config().replace(**{"mode.name": "easgd", "cluster.workers": 1, "cluster.servers": 1})
    assert cfg.mode.alpha == 0.0 and Shard(cfg, 0).rule.alpha == pytest.approx(0.9)


def test_easgd_s_clock_gap_counts_a_rejoiner_between_rounds_by_its_last_round():
    """tau 4: a worker back at step 17 exchanged round 4 (step 16) last; with rank 0
    offering round 10, the gap is 10 - 4 = 6 rounds."""
    from tests.test_easgd_math import _offer
    shard = Shard(Config().replace(**{"mode.name": "easgd", "cluster.workers": 2, "cluster.servers": 1,
                                      "mode.tau": 4}), 0)
    shard.set_live({0: 20})
    shard.set_live({0: 20, 1: 17})
    shard.handle("fast", _offer(shard, 0, 10, shard.params.detach().clone()))
    assert shard.stats()["max_clock_gap"] == 6


def test_sync_easgd_an_offer_of_the_next_round_is_not_a_resend_of_the_open_one():
    from tests.test_easgd_rejoin_resend import elastic, shard_of
    shard = shard_of(sync=True)
    c0 = shard.params.detach().clone()
    shard.handle("r0", elastic(shard, 0, 0, c0 + 1.0))
    shard.handle("r1", elastic(shard, 0, 1, c0 + 1.0, id_=10))
    assert (shard.counters["pushes"], shard.counters["duplicates"]) == (2, 0)


def test_ltfb_s_scoreboard_keeps_the_rounds_of_its_window():
    """KEEP rounds back from the newest: a trainer 3 rounds behind still finds round 0's
    scores (else nobody is truncated that round)."""
    from psgd.consistency.tournament import Scoreboard
    board = Scoreboard(live={0, 1})
    board.put(0, 0, 0.5)
    board.put(0, 1, 0.9)
    board.put(Scoreboard.KEEP, 1, 0.7)
    assert board.get(0, "tok") == {0: 0.5, 1: 0.9}


def test_ltfb_a_late_older_score_does_not_lower_a_trainers_latest_round():
    """A resent board request carries its round's score again: trainer 0's round-0 score
    after its round-1 one left round 1's board waiting for it."""
    from psgd.consistency.tournament import Scoreboard
    board = Scoreboard(live={0, 1})
    board.put(1, 0, 0.5)
    board.put(1, 1, 0.9)
    board.put(0, 0, 0.4)
    assert board.get(1, "tok") == {0: 0.5, 1: 0.9} and not board.parked


def test_the_step_schedule_starts_after_the_warm_up():
    from psgd.config import OptimizerConfig
    from psgd.optim import lr_at
    cfg = OptimizerConfig(lr=0.1, warmup_steps=10, schedule="step", step_size=5, gamma=0.5)
    assert [lr_at(cfg, s, 100) for s in (9, 10, 11)] == pytest.approx([0.1, 0.025, 0.025])


def test_onebit_sends_zeros_with_the_negative_values():
    """Each block's values ≤ 0 decode to their mean, those > 0 to theirs."""
    from psgd.compression import decode
    v = torch.tensor([2.0, 0.0, -1.0, 0.0])
    first, last = onebit_encode(v)
    assert decode("onebit", first, last, 4).tolist() == pytest.approx([2.0, -1 / 3, -1 / 3, -1 / 3])
