"""A new job in a folder an earlier job used: it replaces the earlier job's outputs, and
its shards resume from a checkpoint only if it is of an unfinished job of the same
training config (a restarted job), never from a finished job's or another config's."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from psgd.config import Config, load
from psgd.launcher import LaunchError, LocalJob, file_stamps, resumable
from psgd.servers.shard_server import ShardServer
from psgd.shard import Shard, why_not_resume_from
from tests.conftest import free_port_block


def default_job(out) -> LocalJob:
    """A launcher of the default job into `out`, on a port block of its own (none of
    these tests starts it)."""
    return LocalJob(load(None, [f"cluster.port={free_port_block(3)}"], env={}), str(out), quiet=True)


@contextlib.contextmanager
def launcher_of(out, *children) -> Iterator[LocalJob]:
    """`default_job(out)` watching `children` (stand-ins for its daemons), stopped after
    without them."""
    j = default_job(out)
    j.children = list(children)
    try:
        yield j
    finally:
        j.children = []
        j.stop()


class Exited:
    """A daemon's process as the launcher sees it: its exit code (None: running)."""

    def __init__(self, code: int | None):
        self.pid, self.code = 4242425, code

    def poll(self) -> int | None:
        return self.code


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_new_job_replaces_the_earlier_jobs_outputs(tmp_path):
    """(A review: tb/ stayed, and TensorBoard read the two jobs' event files in it as one
    run, their curves spliced.)"""
    def earlier(pid: int) -> None:
        for name, text in (("summary.json", "{}"), ("coordinator-state.json", "{}"), ("events/worker-0.jsonl", "{}\n"),
                           ("logs/server-0.log", "old\n"), ("pids/worker-0.pid", f"{pid}\n"), ("model.pt", "old"),
                           ("tb/events.out.tfevents.1.host.1.0", "old")):
            (tmp_path / name).parent.mkdir(exist_ok=True)
            (tmp_path / name).write_text(text)

    def files() -> list[str]:
        return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())

    cfg = load(None, [f"cluster.port={free_port_block(3)}"], env={})
    earlier(999999999)   # a pid that is gone
    LocalJob(cfg, str(tmp_path), quiet=True)
    assert files() == [".launcher.lock", "config.toml", "model.pt"]   # the model stays until this job saves its own
    (tmp_path / "config.toml").unlink()
    earlier(os.getpid())  # a job still running there: refused, and nothing touched
    with pytest.raises(LaunchError, match="is the output folder of a job that is still running"):
        LocalJob(cfg, str(tmp_path), quiet=True)
    assert files() == [".launcher.lock", "coordinator-state.json", "events/worker-0.jsonl", "logs/server-0.log",
                       "model.pt", "pids/worker-0.pid", "summary.json", "tb/events.out.tfevents.1.host.1.0"]


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_two_jobs_are_not_given_one_checkpoint_dir(tmp_path):
    """A helper's review: two jobs given the same checkpoint.dir wrote the same shard-I.pt,
    and a restarted shard of one resumed from the other's."""
    shared = str(tmp_path / "shared")
    cfg = load(None, [f"cluster.port={free_port_block(3)}", f"checkpoint.dir={shared}"], env={})
    first = LocalJob(cfg, str(tmp_path / "a"), quiet=True)
    try:
        with pytest.raises(LaunchError, match=f"checkpoint.dir = {shared} holds the shard checkpoints of a job that "
                                              f"is still running"):
            LocalJob(cfg, str(tmp_path / "b"), quiet=True)
        assert not (tmp_path / "b" / "config.toml").exists()
        LocalJob(cfg.replace(**{"checkpoint.dir": ""}), str(tmp_path / "c"), quiet=True).stop()   # its own folder
    finally:
        first.stop()
    LocalJob(cfg, str(tmp_path / "b"), quiet=True).stop()   # the first job ended: its folder is free


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_pid_file_whose_pid_is_now_another_process_is_stale(tmp_path):
    """A review: a pid file left by a job killed with -9 (or a reboot) names a pid that a
    later process took; it blocked the folder for good. A process that started after
    the file was written did not write it."""
    cfg = load(None, [f"cluster.port={free_port_block(3)}"], env={})
    (tmp_path / "pids").mkdir()
    pid_file = tmp_path / "pids" / "worker-0.pid"
    pid_file.write_text(f"{os.getpid()}\n")
    os.utime(pid_file, (1.0e9, 1.0e9))   # written in 2001: this process started after it
    LocalJob(cfg, str(tmp_path), quiet=True).stop()
    assert not pid_file.exists()


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_second_launcher_started_at_the_same_moment_is_refused(tmp_path):
    """Before the first job's pid files exist, its launcher holds the folder: a second
    one wrote its config.toml over the first job's, whose daemons then ran the second
    job's config. Once the first job stops, the folder is free."""
    first = default_job(tmp_path)
    written = (tmp_path / "config.toml").read_text()
    other = load(None, [f"cluster.port={free_port_block(3)}", "mode.name=async"], env={})
    with pytest.raises(LaunchError, match="still running .*another psgd launcher holds"):
        LocalJob(other, str(tmp_path), quiet=True)
    assert (tmp_path / "config.toml").read_text() == written
    first.stop()
    LocalJob(other, str(tmp_path), quiet=True).stop()
    assert 'name = "async"' in (tmp_path / "config.toml").read_text()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_an_incomplete_set_of_shard_checkpoints_is_not_resumed(tmp_path, capsys):
    """A review: shard-0.pt without shard-1.pt (a save cut short, a file removed), or a
    set mixed from two jobs of other shard counts in one folder: some shards resumed and
    the others started from the initial values, one model of two versions. The whole set,
    or none: the job starts afresh, and says why."""
    port = free_port_block(3)
    two = load(None, [f"cluster.port={port}", "cluster.servers=2"], env={})
    four = load(None, [f"cluster.port={port}", "cluster.servers=4"], env={})
    ckpt = tmp_path / "checkpoints"

    def saved(cfg, *shards):
        for i in shards:
            Shard(cfg, i).save(str(ckpt / f"shard-{i}.pt"))

    def files():
        return sorted(os.listdir(ckpt))
    saved(two, 0)
    LocalJob(two, str(tmp_path), quiet=True).stop()
    assert files() == ["shard-0.pt.earlier"] and "only 1 of the 2 shard checkpoints" in capsys.readouterr().err
    saved(two, 0, 1)                           # a whole set stays, to be resumed
    LocalJob(two, str(tmp_path), quiet=True).stop()
    assert files() == ["shard-0.pt", "shard-0.pt.earlier", "shard-1.pt"]
    saved(four, 0, 1, 2, 3)                    # a 4-shard job, then a 2-shard one in the same folder
    saved(two, 0, 1)
    LocalJob(four, str(tmp_path), quiet=True).stop()   # shards 2, 3 would resume, 0 and 1 not
    assert [f for f in files() if f.endswith(".pt")] == [] and "only 2 of the 4" in capsys.readouterr().err
    (ckpt / "shard-0.pt").write_text("not a checkpoint")   # none resumable: each shard says why, nothing moved
    LocalJob(two, str(tmp_path), quiet=True).stop()
    assert "shard-0.pt" in files()


def shard_server(cfg: Config, out) -> tuple[ShardServer, Shard]:
    return ShardServer(cfg, 0, str(out)), Shard(cfg, 0)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_shard_resumes_only_an_unfinished_job_of_the_same_training_config(tmp_path, capsys):
    cfg = Config().replace(**{"cluster.servers": 1, "cluster.workers": 1})
    path = str(tmp_path / "shard-0.pt")
    earlier = Shard(cfg, 0)
    earlier.version = 7
    earlier.save(path)
    server, fresh = shard_server(cfg.replace(**{"train.steps": 900, "cluster.port": 1234}), tmp_path)
    assert server._resume(fresh, path) and fresh.version == 7   # a restarted job: its budget or port may differ
    for why, change in (("its job finished", lambda s: setattr(s, "finished", True)),
                        ("it is of another training configuration", lambda s: setattr(s, "cfg", s.cfg.replace(
                            **{"optimizer.lr": 0.5})))):
        earlier = Shard(cfg, 0)
        earlier.version = 7
        change(earlier)
        earlier.save(path)
        server, fresh = shard_server(cfg, tmp_path)
        assert not server._resume(fresh, path) and fresh.version == 0
        assert f"not resuming from {path}: {why}" in capsys.readouterr().err
    with open(path, "wb") as f:
        f.write(b"not a checkpoint")
    assert not server._resume(Shard(cfg, 0), path)
    assert "it is not a whole checkpoint" in capsys.readouterr().err   # (no zip archive)
    # A review: a job stopped at step 237 and resumed with train.steps = 30: its workers
    # continued at clock 237, were refused every push, and the job failed. A smaller budget
    # than the steps done starts afresh; the budget of the steps done (or more) resumes.
    earlier = Shard(cfg, 0)
    earlier.last_clock = {0: 236}
    earlier.save(path)
    server, fresh = shard_server(cfg.replace(**{"train.steps": 30}), tmp_path)
    assert not server._resume(fresh, path)
    assert "its workers had pushed for step 236, past this job's last (train.steps = 30)" in capsys.readouterr().err
    server, fresh = shard_server(cfg.replace(**{"train.steps": 237}), tmp_path)
    assert server._resume(fresh, path)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_checkpoint_written_before_wire_overlap_resumes_and_one_with_it_only_with_it(tmp_path, capsys):
    """A review: `wire.overlap` joined the training configuration, and a job checkpointed by
    the version before (its configuration without the key) read as another one
    ('wire.overlap null → false'): its progress was lost on upgrading. A key added later
    is left out at its default; set, it is another placement of the tables."""
    import json

    from psgd.shard import training_config
    cfg = Config().replace(**{"cluster.servers": 2, "cluster.workers": 1})
    assert "overlap" not in json.loads(training_config(cfg))["wire"]
    path = str(tmp_path / "shard-0.pt")
    earlier = Shard(cfg, 0)
    earlier.version = 7
    earlier.save(path)
    server, fresh = shard_server(cfg, tmp_path)
    assert server._resume(fresh, path) and fresh.version == 7
    server, fresh = shard_server(cfg.replace(**{"wire.overlap": True}), tmp_path)
    assert not server._resume(fresh, path) and fresh.version == 0
    assert "it is of another training configuration (wire.overlap null → true)" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_checkpoint_naming_its_data_folder_relative_resumes_under_its_absolute_name(tmp_path, monkeypatch):
    """A review: psgd run now makes data.path absolute (config.anchored), so the checkpoint
    of a job run before with `data.path=data` read as another training configuration
    ('data.path "data" → "/.../data"'), and its progress was lost. The same folder is the
    same configuration; another folder is not."""
    from psgd.config import anchored
    monkeypatch.chdir(tmp_path)
    cfg = Config().replace(**{"cluster.servers": 1, "cluster.workers": 1, "data.path": "data"})
    path = str(tmp_path / "shard-0.pt")
    earlier = Shard(cfg, 0)
    earlier.version = 7
    earlier.save(path)
    sd = torch.load(path, weights_only=True)   # as the job before wrote it: the path as given
    training = json.loads(sd["training"])
    training["data"]["path"] = "data"
    sd["training"] = json.dumps(training, sort_keys=True)
    torch.save(sd, path)
    assert why_not_resume_from(path, anchored(cfg), 0) == ""
    assert why_not_resume_from(path, cfg, 0) == ""   # (a daemon given the relative path: the same)
    assert "data.path" in why_not_resume_from(path, cfg.replace(**{"data.path": str(tmp_path / "other")}), 0)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_at_a_jobs_start_a_shard_resumes_only_with_the_whole_set(tmp_path, capsys):
    """A review: under Compose or Slurm (no launcher looks at the set before the shards
    start) shard 0 resumed its checkpoint while shard 1, whose checkpoint was missing or of
    another configuration, started from the initial values: one model of two versions.
    At a job's start each shard looks at the whole set; a shard restarted during a job
    (`restarted` in the coordinator's answer) resumes its own."""
    cfg = Config().replace(**{"cluster.servers": 2, "cluster.workers": 1})
    folder = tmp_path / "checkpoints"
    earlier = Shard(cfg, 0)
    earlier.version = 7
    earlier.save(str(folder / "shard-0.pt"))
    path = str(folder / "shard-0.pt")
    server, fresh = shard_server(cfg, tmp_path)
    assert not server._resume(fresh, path, whole_set=True) and fresh.version == 0
    assert (f"not resuming from {path}: the checkpoints of shard 1 in {folder} cannot be resumed"
            in capsys.readouterr().err)
    # moved aside: restarted during this job, before its first checkpoint, it would resume it
    # alone (tests/test_shard_restart_modes.py)
    assert not os.path.exists(path) and not server._resume(fresh, path) and fresh.version == 0
    os.replace(path + ".earlier", path)
    assert server._resume(fresh, path) and fresh.version == 7          # restarted during its job
    other = Shard(cfg.replace(**{"optimizer.lr": 0.5}), 1)
    other.save(str(folder / "shard-1.pt"))                           # of another configuration
    server, fresh = shard_server(cfg, tmp_path)
    assert not server._resume(fresh, path, whole_set=True) and fresh.version == 0
    os.replace(path + ".earlier", path)
    Shard(cfg, 1).save(str(folder / "shard-1.pt"))                   # the whole set
    assert server._resume(fresh, path, whole_set=True) and fresh.version == 7
    assert (folder / "shard-0.pt").exists() and (folder / "shard-1.pt").exists()   # resumed: none moved


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_shards_log_names_its_own_checkpoints_reason_not_another_shards(tmp_path, capsys):
    """A review: both shards' checkpoints are of an interrupted job of another config (mode
    sync, the new job async). Each shard's log said only that the *other* shard's
    checkpoint cannot be resumed and that "resuming a part of the model would mix two",
    as if its own were fine; README promises the log says why (here: another training
    configuration)."""
    cfg = Config().replace(**{"cluster.servers": 2, "cluster.workers": 2, "mode.name": "async"})
    sync = cfg.replace(**{"mode.name": "sync"})
    folder = tmp_path / "checkpoints"
    for i in range(2):
        Shard(sync, i).save(str(folder / f"shard-{i}.pt"))
    server, fresh = shard_server(cfg, tmp_path)
    assert not server._resume(fresh, str(folder / "shard-0.pt"), whole_set=True)
    err = capsys.readouterr().err
    assert "another training configuration" in err and "mix two" not in err, err


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_whole_set_resumed_counts_afresh_and_a_restarted_shard_keeps_its_counts(tmp_path):
    """A review: a new run that resumed the job's checkpoints reported the earlier
    process's bad messages, dropped gradients and clock gap as its own (its workers'
    samples and its wall time are its own); a shard restarted during a run keeps them,
    since the coordinator takes a shard's latest counters as the run's."""
    cfg = Config().replace(**{"cluster.servers": 1, "cluster.workers": 2})
    path = str(tmp_path / "checkpoints" / "shard-0.pt")
    earlier = Shard(cfg, 0)
    earlier.counters["bad_messages"] = 5
    earlier.rule.barrier.dropped, earlier.rule.clocks.max_gap = 3, 2
    earlier.save(path)
    counted = ("bad_messages", "dropped", "max_clock_gap")
    for whole_set, counts in ((True, [0, 0, 0]), (False, [5, 3, 2])):
        server, fresh = shard_server(cfg, tmp_path)
        assert server._resume(fresh, path, whole_set=whole_set)
        assert [fresh.stats()[k] for k in counted] == counts, whole_set


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_resumed_jobs_summary_counts_its_own_bad_messages_only(tmp_path):
    """A review: a job stopped with SIGTERM after 5 malformed messages reached shard 0, then
    the same command again: the shards resume, and summary.json counts samples, staleness,
    wall time and failures from this run only, but `bad_messages` (and
    `dropped_gradients`, `max_clock_gap`: the shard counters restored with the
    checkpoint) added the earlier process's: this job received none. Here the earlier
    process's checkpoints are made directly, with 5 bad messages and 3 dropped
    gradients counted."""
    port = free_port_block(3)
    sets = [f"cluster.port={port}", "train.steps=30"]
    cfg = load(None, sets, env={})
    for i in range(cfg.cluster.servers):
        shard = Shard(cfg, i)
        shard.counters["bad_messages"] = 5
        shard.rule.barrier.dropped = 3
        shard.rule.barrier.step = 10   # (its workers had done 10 of the 30 steps)
        shard.save(str(tmp_path / "checkpoints" / f"shard-{i}.pt"))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "psgd", "run", "--quiet", "--out", str(tmp_path),
                        *[a for s in sets for a in ("--set", s)]], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in (tmp_path / "logs" / "server-0.log").read_text()
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["samples"] == 2 * 20 * 32          # this run's only: the 20 steps left
    assert (s["bad_messages"], s["dropped_gradients"]) == (0, 0), s   # were 10 and 3: the earlier process's
    # the worker's log said "starting at clock 0", then "finished 20 steps", and nothing of the 10 between
    log = (tmp_path / "logs" / "worker-0.log").read_text()
    assert "continuing at clock 10, where the shards' answers put it" in log, log


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_the_same_command_twice_trains_twice(tmp_path):
    """The second run resumed from the first one's final checkpoints: it trained 0
    samples and reported the first job's accuracy as its own."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "job"
    summaries = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-m", "psgd", "run", "--quiet", "--out", str(out), "--set",
                            "train.steps=30", "--set", f"cluster.port={free_port_block(3)}"],
                           capture_output=True, text=True, timeout=240, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        summaries.append(json.loads((out / "summary.json").read_text()))
    assert [s["samples"] for s in summaries] == [2 * 30 * 32] * 2, summaries
    assert torch.load(out / "checkpoints" / "shard-0.pt", weights_only=True)["finished"] is True
    # the first job's, moved aside when the second began (it had ended: its summary was there)
    assert torch.load(out / "checkpoints" / "shard-0.pt.earlier", weights_only=True)["finished"] is True


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_stopping_a_job_whose_daemon_never_reports_its_end_does_not_raise(tmp_path, capsys):
    """A review: with the fork server stopped (SIGSTOP) its daemons' exit codes never
    came, and stopping the job raised TimeoutExpired after SIGKILL: a traceback in place
    of `psgd run`'s summary line."""
    import subprocess as sp

    from psgd.launcher import Child

    class Silent:   # a forked daemon whose exit code its (stopped) fork server never collects
        pid = 4242424

        def poll(self):
            return None

        def terminate(self):
            pass

        def send_signal(self, sig):
            pass

        def kill(self):
            pass

        def wait(self, timeout=None):
            raise sp.TimeoutExpired(f"pid {self.pid}", timeout or 0)

    j = default_job(tmp_path)
    j.children = [Child("worker", 0, [], proc=Silent())]
    j.stop()
    assert "worker-0 (pid 4242424) did not report its end after SIGKILL; leaving it" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_coordinator_that_dies_after_writing_the_summary_leaves_a_finished_job(tmp_path, capsys):
    """A review: kill -9 of the coordinator once summary.json was written (while it waited
    for every daemon to hear that the job was done) made `psgd run` fail: "the coordinator
    exit code -9", with the job's complete summary on disk."""
    from psgd.launcher import Child

    with launcher_of(tmp_path, Child("coordinator", 0, [], proc=Exited(-9))) as j:
        (tmp_path / "summary.json").write_text(json.dumps({"mode": "sync", "samples": 64}))
        assert j.wait() == {"mode": "sync", "samples": 64}
        assert "the coordinator exited with -9 (SIGKILL) after writing the job's summary" in capsys.readouterr().err
        (tmp_path / "summary.json").unlink()
        j.children[0].proc.code = 1   # its own code, without a summary (a -9 would restart it)
        with pytest.raises(LaunchError, match=r"the coordinator ended without a summary \(exit code 1\)"):
            j.wait()
        # with --quiet its output is in its log, not on the terminal: its reason is said (a review)
        log = tmp_path / "logs" / "coordinator-0.log"
        log.parent.mkdir(exist_ok=True)
        log.write_text("[psgd coordinator] 0/2 workers registered after cluster.timeout_s = 60 s; giving up\n")
        j.children[0].log_path = str(log)
        with pytest.raises(LaunchError, match=r"--- coordinator-0 ---\n.*0/2 workers registered .* giving up"):
            j.wait()
        # a rendezvous given up (its state file says so): its line, not every daemon's log after it (a review:
        # 65 dumps of "no answer from the coordinator" followed it, and the last line left out why)
        from psgd.servers.coordinator import STATE_FILE
        (tmp_path / STATE_FILE).write_text(json.dumps({"phase": "done", "abort": "0/2 workers registered after "
                                                       "cluster.timeout_s = 60 s"}))
        with pytest.raises(LaunchError) as e:
            j.wait()
        assert str(e.value) == ("the coordinator: 0/2 workers registered after cluster.timeout_s = 60 s; giving up; "
                                f"logs in {tmp_path}/logs"), str(e.value)
        j.children[0].log_path = None   # (not --quiet: its line went to the terminal)
        with pytest.raises(LaunchError) as e:
            j.wait()
        assert str(e.value) == (f"the coordinator: 0/2 workers registered after cluster.timeout_s = 60 s; logs in "
                                f"{tmp_path}/logs"), str(e.value)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_coordinator_that_crashes_mid_job_is_restarted_and_one_that_gave_up_is_not(tmp_path):
    """A review: a Python error in the coordinator exits 1, which the launcher took for
    its own ending (an abort, or a rendezvous given up) and never restarted it: "the
    coordinator ended without a summary" mid-training. A 1 while the state file says the
    job was under way is a crash."""
    from psgd.launcher import Child
    j = default_job(tmp_path)
    started = []
    j._start = started.append
    coord = Child("coordinator", 0, [])
    try:
        state = tmp_path / "coordinator-state.json"
        for phase, restarted in (("rendezvous", False), ("training", True), ("final_eval", True), ("done", False)):
            state.write_text(json.dumps({"phase": phase}))
            assert j._coordinator_died(coord, 1) is restarted, phase
        state.write_text(json.dumps({"phase": "training"}))
        (tmp_path / "summary.json").write_text("{}")   # an abort: its summary says why
        assert j._coordinator_died(coord, 1) is False
        assert started == [coord, coord]
    finally:
        j.stop()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_shard_that_lost_a_coordinator_still_running_names_the_coordinator(tmp_path):
    """A review: with the coordinator stopped (SIGSTOP) each shard gave up on it after
    cluster.timeout_s, exited 1, and was restarted, five times over: "server-0 keeps
    dying", minutes later, and the coordinator not named."""
    from psgd.launcher import Child

    logs = tmp_path / "logs"
    with launcher_of(tmp_path, Child("coordinator", 0, [], proc=Exited(None), log_path=str(logs / "coordinator.log")),
                     Child("server", 0, [], proc=Exited(1), log_path=str(logs / "server-0.log"))) as j:
        (logs / "server-0.log").write_text("[psgd server-0] lost the coordinator at tcp://127.0.0.1:1 for 60 s; "
                                           "exiting\n")   # (the launcher clears an earlier job's logs: written after)
        (logs / "coordinator.log").write_text("[psgd coordinator] sync  12.0 s  step 40/300\n")
        with pytest.raises(LaunchError, match=r"server-0 lost the coordinator .*whose process still runs: is it "
                                              r"stopped \(SIGSTOP\) or hung\?(.|\n)*step 40/300"):
            j.wait()


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_the_checkpoints_of_a_job_that_ended_are_not_resumed(tmp_path):
    """A review: the coordinator killed after writing the summary, the shards were stopped
    before being told the job was done, and their checkpoints said `finished: false`: the
    next job in the folder resumed from them ("resumed ... at version 100", 0 samples)."""
    cfg = load(None, [f"cluster.port={free_port_block(3)}"], env={})
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "shard-0.pt").write_text("unfinished")
    LocalJob(cfg, str(tmp_path), quiet=True).stop()          # no summary: a crashed job, to resume
    assert (tmp_path / "checkpoints" / "shard-0.pt").exists()
    (tmp_path / "summary.json").write_text("{}")             # the job ended
    LocalJob(cfg, str(tmp_path), quiet=True).stop()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["shard-0.pt.earlier"]


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_an_interrupted_job_names_the_checkpoints_only_where_a_rerun_resumes_from_them(tmp_path):
    """A review: `psgd run` stopped by Ctrl-C or SIGTERM always said "the shards'
    checkpoints are in DIR (a psgd run into the same --out resumes from them)": also
    before any shard had saved one, and after the job's summary (a next run then moves
    them aside)."""
    cfg = load(None, ["cluster.servers=2"], env={})
    out = str(tmp_path)
    files = [str(tmp_path / "checkpoints" / f"shard-{i}.pt") for i in range(2)]
    launch = file_stamps(files)
    assert not resumable(cfg, out, launch)                  # none saved
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "shard-0.pt").write_text("")
    assert not resumable(cfg, out, launch)                  # one of the two: the next job moves it aside
    (tmp_path / "checkpoints" / "shard-1.pt").write_text("")
    assert resumable(cfg, out, launch)
    assert not resumable(cfg, out, file_stamps(files))      # an earlier job's, not this one's
    (tmp_path / "summary.json").write_text("{}")
    assert not resumable(cfg, out, launch)                  # the job ended: not resumed


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_pid_file_is_never_seen_empty(tmp_path, monkeypatch):
    """A pid file was truncated, then written: a launcher reading it in between found no
    pid, took the file for a stale one and removed it (and the running job's logs). It is
    written whole under another name and renamed."""
    import builtins

    from psgd.metrics import PidFile
    written = []
    real_open = builtins.open

    def open_(path, mode="r", *a, **k):
        if "w" in mode:
            written.append(str(path))
        return real_open(path, mode, *a, **k)
    monkeypatch.setattr(builtins, "open", open_)
    with PidFile(str(tmp_path), "server", 0) as pid:
        assert written and pid.path not in written
        assert open(pid.path).read() == f"{os.getpid()}\n"
        assert os.listdir(tmp_path / "pids") == ["server-0.pid"]
    assert os.listdir(tmp_path / "pids") == []


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_pid_file_taken_over_by_another_process_is_left_to_it(tmp_path):
    """A stopped worker whose rank was taken over (`psgd worker --rank 1` wrote its own pid
    file) exited on SIGCONT and removed pids/worker-1.pid, while the new process trained
    on without one: `psgd status` and a later `psgd run` no longer saw it."""
    from psgd.metrics import PidFile
    with PidFile(str(tmp_path), "worker", 1) as pid:
        with open(pid.path, "w") as f:   # the process that took the rank over
            f.write("4194000\n")
    assert open(tmp_path / "pids" / "worker-1.pid").read() == "4194000\n"


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_psgd_runs_own_timeout_outlasts_the_jobs_time_budget(tmp_path):
    """`psgd run --timeout` defaulted to an hour whatever the job's budget: a job of
    train.seconds = 7200 was stopped at 3600 s as failed."""
    port = free_port_block(3)
    job = LocalJob(load(None, [f"cluster.port={port}"], env={}), str(tmp_path / "a"), quiet=True)
    long = LocalJob(load(None, [f"cluster.port={port}", "train.seconds=7200", "train.steps=0"], env={}),
                    str(tmp_path / "b"), quiet=True)
    given = LocalJob(load(None, [f"cluster.port={port}"], env={}), str(tmp_path / "c"), quiet=True, timeout_s=5)
    for j in (job, long, given):
        j.stop()
    assert (job.timeout_s, long.timeout_s, given.timeout_s) == (3600.0, 7800.0, 5)


@pytest.mark.inprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["saved after a step back", "an earlier job's, before a step back", "interrupted"])
def test_a_jobs_own_files_are_told_from_an_earlier_jobs_whatever_the_wall_clock_did(tmp_path, monkeypatch, capsys,
                                                                                    case):
    """psgd run told the job's model.pt and shard checkpoints from an earlier job's by their
    mtime against its launch: with the wall clock stepped back (NTP, a VM resumed) during
    the job, it warned "no final model was saved" of the model the job had just saved, and
    an interrupted job did not name the checkpoints a rerun resumes from; stepped back since
    an earlier job, that job's model.pt was named as this job's. (The job is faked: its
    files get the mtimes such steps give them.)"""
    import psgd.launcher
    from psgd.cli import main
    out = tmp_path / "run"
    model = out / "model.pt"
    if case == "an earlier job's, before a step back":   # written an hour "after" this job's launch
        out.mkdir()
        model.write_text("earlier")
        os.utime(model, (time.time() + 3600,) * 2)

    def run_local(cfg, out_, announce=None, **kw):
        announce()
        os.makedirs(out_, exist_ok=True)
        stepped = (time.time() - 3600,) * 2   # written after the clock was stepped an hour back
        if case == "saved after a step back":
            model.write_text("model")
            os.utime(model, stepped)
        elif case == "interrupted":
            for i in range(cfg.cluster.servers):
                path = cfg.checkpoint_file(str(out), i)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "w").close()
                os.utime(path, stepped)
            raise KeyboardInterrupt
        return {}

    monkeypatch.setattr(psgd.launcher, "run_local", run_local)
    monkeypatch.setattr(psgd.launcher, "format_summary", lambda s: "(the summary)")
    if case == "interrupted":
        with contextlib.suppress(KeyboardInterrupt, SystemExit):
            main(["run", "--out", str(out), "--set", "cluster.servers=2"])
    else:
        assert main(["run", "--out", str(out)]) == 0
    r = capsys.readouterr()
    if case == "saved after a step back":
        assert f"model: {model}" in r.out and "no final model" not in r.err, (r.out, r.err)
    elif case == "an earlier job's, before a step back":
        assert "model:" not in r.out and "no final model was saved" in r.err, (r.out, r.err)
    else:
        assert f"the shards' checkpoints are in {out / 'checkpoints'}" in r.err, r.err
