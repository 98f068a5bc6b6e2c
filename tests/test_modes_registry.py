"""Modes as plug-ins: the registry, the mechanism free of mode names, and the defects
that the rule objects fixed (LTFB's global model from one deposit, counters that
survive a restore)."""
from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

from psgd import wire
from psgd.config import Config
from psgd.consistency import MODES, get
from psgd.consistency import rule as r
from psgd.consistency.ltfb import choose_best, global_model
from psgd.shard import Shard

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_registry_has_every_mode_with_both_halves():
    assert set(MODES) == {"sync", "ssp", "async", "easgd", "ltfb", "diloco"}
    for name, mode in MODES.items():
        assert mode.name == name and mode.rule.name == name
        assert issubclass(mode.rule, r.ServerRule) and issubclass(mode.schedule, r.Schedule)
        assert mode.params and all(hasattr(Config().mode, k) for k in mode.params)
    with pytest.raises(ValueError, match="unknown mode 'bsp'"):
        get("bsp")


def test_the_mechanism_names_no_mode():
    """No string literal naming a mode in the shard, the servers or the workers."""
    files = [ROOT / "psgd" / "shard.py", *sorted((ROOT / "servers").glob("*.py")),
             *sorted((ROOT / "workers").glob("*.py"))]
    pattern = re.compile(r"""["'](sync|ssp|async|easgd|ltfb|diloco)["']""")
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in files
             for i, line in enumerate(f.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


# ---------------------------------------------------------------- shards driven in memory
def shards(mode: str, workers: int = 2, servers: int = 2, **sets) -> list[Shard]:
    cfg = Config().replace(**{"mode.name": mode, "cluster.workers": workers, "cluster.servers": servers, **sets})
    return [Shard(cfg, i) for i in range(servers)]


_ids = iter(range(1, 1 << 30))


def request(shard: Shard, op: str, rank: int = -1, clock: int = -1, arrays=(), **fields) -> list[wire.Message]:
    """Serve one request on a shard; the decoded replies (its own and any it releases)."""
    m = wire.decode(wire.encode(op, id=next(_ids), rank=rank, clock=clock, arrays=arrays, **fields))
    out = []
    for _, frames in shard.handle(object(), m):
        reply = wire.decode(frames)
        wire.raise_if_error(reply, f"shard {shard.index}")
        out.append(reply)
    return out


class MemoryClient:
    """The parameter client's reads, served by Shard objects in this process."""

    def __init__(self, shards: list[Shard]):
        self.shards = shards

    def pull(self, clock: int) -> list[wire.Message]:
        return [request(s, "pull", clock=clock)[0] for s in self.shards]

    def index(self) -> list[wire.Message]:
        return [request(s, "models")[0] for s in self.shards]

    def get_model(self, round_, owner, exact=False, missing_ok=False, cancel=None):
        try:
            return [request(s, "get_model", round=round_, owner=owner, exact=exact)[0] for s in self.shards]
        except wire.Refused:
            if missing_ok:
                return None
            raise


def deposit(shard: Shard, rank: int, round_: int, score: float) -> None:
    p = np.full(shard.P, rank * 100 + round_, np.float32)
    request(shard, "put_model", rank=rank, clock=round_, arrays=[p, np.zeros(shard.B, np.float32)],
            round=round_, score=score)


def test_ltfb_global_model_never_mixes_two_trainers():
    """Trainer 0 has deposited round 2 on shard 0 only (its deposit to shard 1 is still in
    flight); trainer 1's round-1 model scored best. Each shard choosing on its own gave
    shard 0's slice from (2, trainer 0) and shard 1's from (1, trainer 1): a hybrid."""
    s0, s1 = shards("ltfb")
    for s in (s0, s1):
        deposit(s, 0, 1, 0.5)
        deposit(s, 1, 1, 0.9)
    deposit(s0, 0, 2, 0.7)
    got = global_model(MemoryClient([s0, s1]))
    assert [(m.get("round"), m.get("owner")) for m in got] == [(1, 1), (1, 1)]
    assert all(float(m.arrays[0][0]) == 101 for m in got)
    deposit(s1, 0, 2, 0.7)                       # the deposit lands: round 2 is complete
    got = global_model(MemoryClient([s0, s1]))
    assert [(m.get("round"), m.get("owner")) for m in got] == [(2, 0), (2, 0)]


def test_ltfb_global_model_before_any_round_is_the_initial_model():
    s0, s1 = shards("ltfb")
    got = global_model(MemoryClient([s0, s1]))
    np.testing.assert_array_equal(got[0].arrays[0], s0.params.numpy())


def test_ltfb_choose_best_latest_round_then_score_then_lower_rank():
    idx = [[1, 0, 0.5], [1, 1, 0.9], [2, 2, 0.1], [2, 3, 0.1]]
    assert choose_best([idx, idx]) == (2, 2)
    assert choose_best([idx, idx[:2]]) == (1, 1)
    assert choose_best([idx, []]) is None and choose_best([]) is None


def test_ltfb_exact_fetch_of_a_forgotten_deposit_is_refused():
    (s,) = shards("ltfb", servers=1)
    deposit(s, 0, 1, 0.5)
    deposit(s, 0, 2, 0.5)                        # round 1 of trainer 0 is forgotten
    with pytest.raises(wire.Refused, match="no deposit of trainer 0 for round 1"):
        request(s, "get_model", round=1, owner=0, exact=True)
    assert request(s, "get_model", round=1, owner=0)[0].get("round") == 2   # "or later" still answers


def test_dropped_gradients_survive_a_restore(tmp_path):
    (s,) = shards("sync", workers=3, servers=1, **{"mode.backup_workers": 1})
    g = np.ones(s.P, np.float32)
    b = np.zeros(s.B, np.float32)
    for rank in (0, 1, 2):                       # rank 2 comes after the step closed: dropped
        request(s, "push", rank=rank, clock=0, arrays=[g, b], read_version=0)
    assert s.stats()["dropped"] == 1
    s.save(str(tmp_path / "shard.pt"))
    (restored,) = shards("sync", workers=3, servers=1, **{"mode.backup_workers": 1})
    restored.load(str(tmp_path / "shard.pt"))
    assert restored.stats()["dropped"] == 1 and restored.stats()["step"] == 1


def restored_inside_step_0(tmp_path):
    """A sync shard (2 workers, plain SGD) saved after rank 0's push of step 0 (all
    ones) and restored: (the restored shard, the parameters before, (g0, g1 = 3s, b))."""
    (s,) = shards("sync", workers=2, servers=1, **{"optimizer.momentum": 0.0})
    g0, g1, b = np.full(s.P, 1.0, np.float32), np.full(s.P, 3.0, np.float32), np.zeros(s.B, np.float32)
    before = s.params.clone()
    request(s, "push", rank=0, clock=0, arrays=[g0, b], read_version=0)
    s.save(str(tmp_path / "shard.pt"))
    (restored,) = shards("sync", workers=2, servers=1, **{"optimizer.momentum": 0.0})
    restored.load(str(tmp_path / "shard.pt"))
    return restored, before, (g0, g1, b)


def test_a_checkpoint_inside_an_open_step_keeps_its_gradients(tmp_path):
    """Saved after rank 0's push and before rank 1's: the restored shard still has rank
    0's gradient, takes its resend as a duplicate, and closes the step on rank 1's push
    with the mean of both (a requeued job's workers resume at that step)."""
    restored, before, (g0, g1, b) = restored_inside_step_0(tmp_path)
    assert request(restored, "push", rank=0, clock=0, arrays=[g0, b], read_version=0)[0].get("duplicate")
    request(restored, "push", rank=1, clock=0, arrays=[g1, b], read_version=0)
    assert restored.stats()["step"] == 1
    lr = restored.opt.param_groups[0]["lr"]
    np.testing.assert_allclose(restored.params.numpy(), (before - lr * 2.0).numpy(), rtol=1e-6)


def test_a_push_for_a_later_step_waits_for_it():
    """A push ahead of a step that has gradients gets no answer yet; it is taken when
    its step opens, and its worker's resend meanwhile is a duplicate."""
    (s,) = shards("sync", workers=3, servers=1)
    g, b = np.ones(s.P, np.float32), np.zeros(s.B, np.float32)
    request(s, "push", rank=0, clock=0, arrays=[g, b], read_version=0)
    assert request(s, "push", rank=1, clock=1, arrays=[g, b], read_version=0) == []        # waits
    assert request(s, "push", rank=1, clock=1, arrays=[g, b], read_version=0)[0].get("duplicate")
    request(s, "push", rank=1, clock=0, arrays=[g, b], read_version=0)   # an older one: duplicate too
    replies = request(s, "push", rank=2, clock=0, arrays=[g, b], read_version=0)
    assert s.stats()["step"] == 1 and s.stats()["short_steps"] == 1     # ranks 0 and 2; rank 1 went on
    assert len(replies) == 2 and s.rule.barrier.contributors == [1]    # its waiting push, now answered


def test_a_shard_restored_inside_a_step_meets_workers_past_it(tmp_path):
    """The Slurm requeue and the kill -9 of a shard: its checkpoint has rank 0's push of
    step 0; the other shard had closed step 0, so both workers resume at 1. Nobody will
    push step 0 again: once both wait with step 1, step 0 closes on rank 0's gradient
    and step 1 goes on (before, it refused them until the workers gave up)."""
    restored, before, (g0, g1, b) = restored_inside_step_0(tmp_path)
    assert request(restored, "pull", rank=0, clock=2) == []               # parked until step 1 closes
    assert request(restored, "push", rank=0, clock=1, arrays=[g1, b], read_version=1) == []
    replies = request(restored, "push", rank=1, clock=1, arrays=[g1, b], read_version=1)
    assert len(replies) == 3                                               # both pushes and the read
    assert restored.stats()["step"] == 2 and restored.stats()["short_steps"] == 1
    lr = restored.opt.param_groups[0]["lr"]
    np.testing.assert_allclose(restored.params.numpy(), (before - lr * (1.0 + 3.0)).numpy(), rtol=1e-6)


def test_reads_past_a_restored_shard_move_it_to_the_workers(tmp_path):
    """The kill -9 of a shard that had answered both workers' pushes of step 2 (and
    not their reads of 3) before it died; restored at step 0 with rank 0's push, it gets
    only the resent reads of clock 3. They show that both workers are past steps 0-2:
    step 0 closes on rank 0's gradient, the shard skips to 3 and answers the reads (it
    waited for ever before)."""
    restored, _, _ = restored_inside_step_0(tmp_path)
    assert request(restored, "pull", rank=0, clock=3) == []
    replies = request(restored, "pull", rank=1, clock=3)
    assert len(replies) == 2 and [m.get("step") for m in replies] == [3, 3]
    assert restored.stats()["short_steps"] == 1 and restored.stats()["fast_forwards"] == 1


def test_a_read_after_a_refused_push_does_not_hold_the_step():
    """A worker whose push this shard refused (a non-finite slice) reads on: the step
    closes with the other worker's gradient, and the retried push is late."""
    (s,) = shards("sync", workers=2, servers=1)
    g, b = np.ones(s.P, np.float32), np.zeros(s.B, np.float32)
    with pytest.raises(wire.WireError, match="NaN or Inf"):
        request(s, "push", rank=0, clock=0, arrays=[np.full(s.P, np.nan, np.float32), b], read_version=0)
    request(s, "push", rank=1, clock=0, arrays=[g, b], read_version=0)
    assert request(s, "pull", rank=1, clock=1) == []
    assert len(request(s, "pull", rank=0, clock=1)) == 2 and s.stats()["short_steps"] == 1
    assert request(s, "push", rank=0, clock=0, arrays=[g, b], read_version=0)[0].get("dropped")


def test_a_worker_that_rejoined_past_an_open_step_closes_it():
    """The restarted-worker race: rank 1 was lost, rejoined, and continued at step 1
    (another shard had closed step 0 without it). Its push of step 1 here shows that
    step 0 will not get its gradient: the step closes on rank 0's."""
    (s,) = shards("sync", workers=2, servers=1)
    g, b = np.ones(s.P, np.float32), np.zeros(s.B, np.float32)
    request(s, "push", rank=0, clock=0, arrays=[g, b], read_version=0)
    assert request(s, "pull", rank=0, clock=1) == []
    replies = request(s, "push", rank=1, clock=1, arrays=[g, b], read_version=0)
    assert len(replies) == 2 and s.stats()["step"] == 1                   # rank 0's read, rank 1's push
    request(s, "push", rank=0, clock=1, arrays=[g, b], read_version=1)
    assert s.stats()["step"] == 2 and s.stats()["short_steps"] == 1


def test_a_non_finite_gradient_is_refused_and_names_the_fix():
    (s,) = shards("ssp", servers=1)
    g, b = np.full(s.P, np.nan, np.float32), np.zeros(s.B, np.float32)
    with pytest.raises(wire.WireError, match="gradient has NaN or Inf values at step 12; lower optimizer.lr"):
        s.handle(object(), wire.decode(wire.encode("push", id=1, rank=0, clock=12, arrays=[g, b],
                                                   read_version=0)))
    assert s.version == 0


def test_easgd_sync_rounds_recover_as_sync_steps_do(tmp_path):
    """EASGD's synchronous rounds share sync's barrier and its recovery. A checkpoint
    inside round 0 does not keep its offers (their askers resend them to a restored
    shard): restored, the shard meets both workers at round 1, skips to it once both
    wait there, and closes it on both offers."""
    sets = {"mode.sync": True, "mode.alpha": 0.5}
    (s,) = shards("easgd", workers=2, servers=1, **sets)
    b = np.zeros(s.B, np.float32)
    centre = s.params.numpy().copy()
    x0, x1 = centre + 1.0, centre + 3.0
    assert request(s, "elastic", rank=0, clock=0, arrays=[x0, b], round=0) == []   # waits for rank 1
    s.save(str(tmp_path / "shard.pt"))
    (restored,) = shards("easgd", workers=2, servers=1, **sets)
    restored.load(str(tmp_path / "shard.pt"))
    assert request(restored, "elastic", rank=0, clock=1, arrays=[x0, b], round=1) == []
    replies = request(restored, "elastic", rank=1, clock=1, arrays=[x1, b], round=1)
    assert len(replies) == 2 and restored.rule.fast_forwards == 1 and restored.rule.barrier.step == 2
    np.testing.assert_allclose(restored.params.numpy(), centre + 0.5 * 1.0 + 0.5 * 3.0, rtol=1e-6)


def test_easgd_sync_round_closes_for_a_worker_that_rejoined_past_it():
    (s,) = shards("easgd", workers=2, servers=1, **{"mode.sync": True, "mode.alpha": 0.5})
    b = np.zeros(s.B, np.float32)
    centre = s.params.numpy().copy()
    assert request(s, "elastic", rank=0, clock=0, arrays=[centre + 1.0, b], round=0) == []
    replies = request(s, "elastic", rank=1, clock=1, arrays=[centre + 3.0, b], round=1)
    assert len(replies) == 1 and s.rule.short_steps == 1 and s.rule.round.keys() == {1}   # rank 0's answer
    np.testing.assert_allclose(s.params.numpy(), centre + 0.5, rtol=1e-6)


@pytest.mark.parametrize("mode,sets,gap", [("sync", {}, 0), ("ssp", {"mode.staleness": 0}, 0), ("diloco", {}, 0),
                                           ("ssp", {"mode.staleness": 1}, 1)])   # s = 1 reads ahead: it is a gap
def test_workers_in_lockstep_have_no_clock_gap(mode, sets, gap):
    """sync counted a read's lead when it arrived, parked until its step closed: 1 in
    perfect lockstep, where ssp with s = 0 said 0, so sync looked like ssp with s = 1."""
    (s,) = shards(mode, workers=2, servers=1, **{"optimizer.momentum": 0.0, **sets})
    g = np.full(s.P, 1e-3, np.float32)
    for rank in range(2):
        request(s, "pull", rank=rank, clock=0, join=True)
    for c in range(5):   # both push clock c and read c + 1, one after the other, as the client does
        for rank in range(2):
            request(s, "push", rank=rank, clock=c, arrays=[g, np.zeros(s.B, np.float32)], read_version=s.version,
                    pull=True)
    assert s.stats()["max_clock_gap"] == gap


def test_sync_with_a_worker_behind_has_its_clock_gap():
    """A gap that is there is still counted: a backup-worker step leaves the late worker
    behind, and the others read ahead of it."""
    (s,) = shards("sync", workers=3, servers=1, **{"optimizer.momentum": 0.0, "mode.backup_workers": 1})
    g = np.full(s.P, 1e-3, np.float32)
    for rank in range(3):
        request(s, "pull", rank=rank, clock=0, join=True)
    for c in range(3):   # ranks 0 and 1 close every step; rank 2 never pushes
        for rank in range(2):
            request(s, "push", rank=rank, clock=c, arrays=[g, np.zeros(s.B, np.float32)], read_version=s.version,
                    pull=True)
    assert s.stats()["max_clock_gap"] == 3
