"""What a shard killed with -9 mid-training and restored leaves behind: its clocks, its
groups' open steps, its step lines, its checkpoint's temp files and its `.saving` note."""
from __future__ import annotations

import pytest

from psgd.config import Config


def restored_rule(mode: str, finished: dict[int, int], **sets):
    """Rule `mode` of two workers restored from a checkpoint whose clocks are `finished`."""
    from psgd.consistency import get as get_mode
    cfg = Config().replace(**{"mode.name": mode, "cluster.workers": 2, **sets})
    make = lambda: get_mode(mode).rule(cfg.mode, 2, type("Tables", (), {"version": 0})())  # noqa: E731
    earlier = make()
    earlier.clocks.finished.update(finished)
    rule = make()
    rule.load_state_dict(earlier.state_dict())
    return rule


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_restored_async_shard_takes_the_coordinators_clocks_for_its_checkpoints():
    """async, a shard killed at step 150 and restored from its checkpoint of 0.3 s before:
    its clock table kept the checkpoint's clocks (120), the coordinator's live clocks
    (150) did not replace them (`set_live` took only ranks that joined), and the first
    read at the reader's clock measured a gap of 30 that no worker had
    (summary.json: max_clock_gap 133 on the restored shard, 39 on the other)."""
    from psgd.consistency.rule import Read
    rule = restored_rule("async", {0: 120, 1: 120})
    rule.membership({0: 150, 1: 150})
    rule.gated_read(Read("r", 0, 151))
    assert rule.stats()["max_clock_gap"] == 1
    assert rule.read_fields(1)["finished"] == 150


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_restored_ssp_shard_still_gates_on_its_checkpoints_clocks():
    """Under SSP the coordinator's clock may count a push still on its way (with the cache
    or prefetch the worker's clock moves as it sends it): the restored clocks gate, and
    each worker's next push or read moves its own."""
    from psgd.consistency.rule import Push, Read
    rule = restored_rule("ssp", {0: 120, 1: 120}, **{"mode.staleness": 3})
    rule.membership({0: 150, 1: 150})
    assert rule.gated_read(Read("r", 0, 151)) == []      # parked: rank 1 is at 120 here
    released = rule.push(Push("p", 1, 150, 0, None, None))
    assert [d.token for d in released if getattr(d, "token", None) == "r"], released
    assert rule.stats()["max_clock_gap"] <= 3


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_restored_group_step_that_the_group_left_behind_drops_no_gradient():
    """ltfb, `mode.trainer_size = 2`: a shard restored from a checkpoint whose open step 10
    had rank 0's push, while the lost life had closed it and the group went on. The next
    push (step 30) moved the group there and counted rank 0's push as dropped
    (summary.json dropped_gradients 1) though the lost life had applied it and answered
    its read, so no step line said `dropped`. It is not counted; a push of this life that
    a push ahead drops still is, and its read says so."""
    import torch

    from psgd.consistency.tournament import GroupSteps, Late
    g = torch.zeros(3)
    earlier = GroupSteps(2, [0, 1])
    for c in range(10):
        earlier.push(0, c, g, g)
        earlier.push(1, c, g, g)
    earlier.push(0, 10, g, g)
    steps = GroupSteps(2, [0, 1])
    steps.load_state_dict(earlier.state_dict())
    assert steps.push(1, 30, g, g)[0]
    assert steps.dropped == 0
    assert steps.read(1, 31, "r1") is None                  # waits for rank 0's push of 30
    assert steps.push(0, 30, g, g)[0]
    assert steps.push(0, 31, g, g)[0]                       # accepted here, then dropped by
    assert steps.push(1, 33, g, g)[0]                       # a push ahead (rank 1 restarted there, say)
    assert steps.dropped == 1
    assert steps.read(0, 32, "r0") == Late(33, dropped=True)
    # A review: a contributor that reads the restored open step again never had its
    # answer (the lost life died before the step closed): a step left behind drops its push
    again = GroupSteps(2, [0, 1])
    again.load_state_dict(earlier.state_dict())
    assert again.read(0, 11, "r0") is None                  # rank 0 resends its read of 11: parked
    assert again.push(1, 30, g, g)[0]
    assert again.dropped == 1 and again.lost == {0: 10}


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_step_whose_tournament_a_restarted_shard_refuses_has_its_line():
    """ltfb, a shard restarted with nothing to restore (`checkpoint.every_s = 0`): the
    deposit of the step that ends a round is refused `not_ready`, after the step trained
    (its optimizer step, its clock, its samples), and the step wrote no line: each rank
    logged 399 step lines with clock 400. It has its line, `refused: true` (as diloco's
    step whose exchange is refused), and the worker still counts the refusal."""
    from psgd import wire
    from tests.test_ltfb import ltfb_cfg, trainers_on
    cfg = ltfb_cfg(**{"cluster.workers": 1, "train.steps": 9, "mode.round_steps": 3})
    _, [(w, s)] = trainers_on(cfg, 1)
    w.replica.score = lambda *a, **k: (0.5, 1.0)

    def refused(*a, **k):
        raise wire.Refused(wire.NOT_READY, "shard 1 has no values yet", "tcp://shard-1")
    w.client.put_model = refused
    s.step(w)
    s.step(w)
    with pytest.raises(wire.Refused):
        s.step(w)
    assert w.clock == 3
    assert [(clock, extra.get("refused", False)) for clock, _, extra in w.logged] == [(1, False), (2, False), (3, True)]


def leftover(path: str, pid: int) -> str:
    tmp = f"{path}.tmp.{pid}.140234"
    with open(tmp, "wb") as f:
        f.write(b"half a checkpoint")
    return tmp


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_temp_files_writer_is_gone_only_when_no_process_that_could_have_written_it_lives(tmp_path):
    import os
    import subprocess

    from psgd.metrics import writer_gone
    ended = subprocess.Popen(["true"])
    ended.wait()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        assert writer_gone(leftover(str(tmp_path / "a"), ended.pid), ended.pid)
        mine = leftover(str(tmp_path / "b"), os.getpid())
        assert not writer_gone(mine, os.getpid())
        theirs = leftover(str(tmp_path / "c"), sleeper.pid)
        assert not writer_gone(theirs, sleeper.pid)          # written by it, as far as can be told
        os.utime(theirs, (1_000_000, 1_000_000))              # written long before it started: its pid again
        assert writer_gone(theirs, sleeper.pid)
        assert not writer_gone(str(tmp_path / "none"), ended.pid)
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_a_restarted_shard_removes_the_checkpoint_its_killed_life_left_half_written(tmp_path, monkeypatch):
    """A shard killed while writing a checkpoint left `checkpoints/shard-I.pt.tmp.PID.TID`
    behind, a checkpoint-sized file that nothing removed. Restarted, it removes its own
    index's whose writer is gone; a live process's, and another shard's, stay. So with
    the note `pids/server-I.saving` of a shard killed while writing its checkpoint at exit."""
    import os
    import subprocess

    import tests.test_shard_restart_modes as restart_modes
    from tests.test_reliability import job, wait_for_steps
    j = job(tmp_path, "mode.name=sync", "train.steps=300", "faults.step_delay_s=0.004")
    ended = subprocess.Popen(["true"])
    ended.wait()
    sleeper = subprocess.Popen(["sleep", "200"])
    made: dict = {}

    def then_leave_leftovers(jj, rank, n):   # (before the kill)
        wait_for_steps(jj, rank, n)
        folder = os.path.join(jj.out, "checkpoints")
        os.makedirs(folder, exist_ok=True)
        made["gone"] = leftover(os.path.join(folder, "shard-1.pt"), ended.pid)
        made["live"] = leftover(os.path.join(folder, "shard-1.pt"), sleeper.pid)
        made["other"] = leftover(os.path.join(folder, "shard-0.pt"), ended.pid)
        with open(os.path.join(jj.out, "pids", "server-1.saving"), "w") as f:   # (the note of one killed at exit)
            f.write(f"{ended.pid}\n")
    monkeypatch.setattr(restart_modes, "wait_for_steps", then_leave_leftovers)
    try:
        s = restart_modes.kill_and_restart(j, "server-1", (0, 100))
    finally:
        sleeper.kill()
        sleeper.wait()
    assert s["failures"]["shard_restarts"] == 1, s["failures"]
    assert not os.path.exists(made["gone"])
    assert os.path.exists(made["live"]) and os.path.exists(made["other"])
    said = open(os.path.join(j.out, "logs", "server-1.log")).read()
    assert f"removed {os.path.basename(made['gone'])}" in said, said
    assert f"removed pids/server-1.saving, the note of a checkpoint at exit that process {ended.pid}" in said, said


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_temp_file_its_live_writer_holds_open_is_not_gone_after_the_clock_steps_on(tmp_path, monkeypatch):
    """writer_gone took a live writer for another process with its pid once the wall clock
    stepped on (NTP, a VM resumed) by more than the time from the writer's start to its
    last write: its start, read as a wall time now, came after the file's mtime. A shard
    starting then removed a checkpoint that a live process was writing. A process that
    holds the file open is its writer, whatever the clocks say."""
    import os
    import time

    from psgd.metrics import writer_gone
    tmp = f"{tmp_path / 'shard-0.pt'}.tmp.{os.getpid()}.1"
    with open(tmp, "wb") as f:   # being written
        f.write(b"half a checkpoint")
        f.flush()
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 3600)   # stepped an hour on
        assert not writer_gone(tmp, os.getpid())


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_restarted_shard_removes_the_saving_note_its_killed_life_left(tmp_path, capsys):
    """A shard killed (-9) while writing its checkpoint at exit left DIR/pids/server-I.saving.
    psgd run's stop removes it, but under Compose or Slurm nothing did: the note said for
    good that the shard was writing its checkpoint. Started again, the shard removes its
    own index's note where the process it names is gone; a live writer's note, and another
    shard's, stay."""
    import os
    import subprocess

    from psgd.config import load
    from psgd.metrics import pid_path
    from psgd.servers.shard_server import ShardServer
    out = str(tmp_path)
    cfg = load(None, ["cluster.servers=2"], env={})
    ended = subprocess.Popen(["true"])
    ended.wait()
    mine, other = pid_path(out, "server-1", "saving"), pid_path(out, "server-0", "saving")
    os.makedirs(os.path.dirname(mine))
    for note in (mine, other):
        with open(note, "w") as f:
            f.write(f"{ended.pid}\n")
    server = ShardServer(cfg, 1, out)
    server._remove_leftovers(cfg.checkpoint_file(out, 1))
    assert not os.path.exists(mine) and os.path.exists(other)
    assert f"removed pids/server-1.saving, the note of a checkpoint at exit that process {ended.pid}" in \
        capsys.readouterr().err
    with open(mine, "w") as f:   # a live process's, written now: its writer, as far as can be told
        f.write(f"{os.getpid()}\n")
    server._remove_leftovers(cfg.checkpoint_file(out, 1))
    assert os.path.exists(mine)
