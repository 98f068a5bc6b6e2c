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
