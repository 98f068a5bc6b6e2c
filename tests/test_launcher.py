"""`psgd run`'s supervisor (psgd/launcher.py) with stand-in children: real processes that
do no training, so that restarts happen at once."""
from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time

import numpy as np
import pytest

from psgd.config import load
from psgd.data import load_dataset
from psgd.launcher import MAX_RESTARTS, LaunchError, LocalJob, ephemeral_ports, pick_port, ports_free
from psgd.metrics import EXIT_CANNOT_WRITE
from psgd.servers.coordinator import STATE_FILE
from psgd.transport import EXIT_ADDRESS_IN_USE
from tests.conftest import free_port_block, listening_on

pytestmark = pytest.mark.processes


class StandInJob(LocalJob):
    """The coordinator, the worker and the evaluator wait to be stopped; a shard says it
    started and dies. (A dying evaluator is restarted too: it would race the shard to give
    up first; a worker dying before training stops the job at once.)"""

    def _argv(self, role: str, *extra: str) -> list[str]:
        if role in ("coordinator", "worker", "evaluator"):
            return [sys.executable, "-c", "import time; time.sleep(60)"]
        return [sys.executable, "-c", f"import sys; print('{role} up', file=sys.stderr); sys.exit(3)"]


def launch_failure(job: LocalJob, match: str | None = None) -> str:
    """Start the job and wait for it to fail, with a LaunchError (whose message matches
    the regular expression `match`, if given), then stop it; the LaunchError's message."""
    try:
        job.start()
        with pytest.raises(LaunchError, match=match) as e:
            job.wait()
    finally:
        job.stop()
    return str(e.value)


def open_descriptors_on(paths: set[str]) -> list[str]:
    """This process's open file descriptors that point at one of paths."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target in paths:
            found.append(target)
    return found


@pytest.mark.timeout(60)
def test_restarts_append_to_one_log_and_leave_no_handle_open(tmp_path):
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=1"], env={})
    job = StandInJob(cfg, str(tmp_path), quiet=True, timeout_s=50)
    try:
        job.start()
        with pytest.raises(LaunchError, match="server-0 keeps dying"):
            job.wait()
        logs = {c.log_path for c in job.children}
        assert len(logs) == 4 and all(logs)  # coordinator, server, worker, evaluator
        # Before the fix every (re)start opened a handle that stayed open: 1 + MAX_RESTARTS
        # for the shard alone, until stop().
        assert open_descriptors_on(logs) == []
    finally:
        job.stop()
    server = next(c for c in job.children if c.role == "server")
    assert server.restarts == MAX_RESTARTS
    with open(server.log_path) as f:
        assert f.read().splitlines() == ["server up"] * (1 + MAX_RESTARTS)  # appended, not truncated


class DyingCoordinatorJob(LocalJob):
    """The coordinator says it started and dies at once: killed (SIGKILL), or exiting 1
    with its state file saying the job is under way (`phase`), or exiting 1 before any
    (its own refusal); the other children wait to be stopped."""
    phase: str | None = None
    code = -signal.SIGKILL

    def _argv(self, role: str, *extra: str) -> list[str]:
        if role != "coordinator":
            return [sys.executable, "-c", "import time; time.sleep(60)"]
        state = os.path.join(self.out, STATE_FILE)
        die = "os.kill(os.getpid(), 9)" if self.code < 0 else f"sys.exit({self.code})"
        write = f"json.dump({{'phase': {self.phase!r}}}, open({state!r}, 'w')); " if self.phase else ""
        return [sys.executable, "-c", f"import json, os, sys; print('coordinator up', file=sys.stderr); "
                                      f"{write}{die}"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code,phase,restarts", [(-signal.SIGKILL, None, MAX_RESTARTS), (1, "training", MAX_RESTARTS),
                                                 (1, None, 0)])
def test_a_dying_coordinator_is_restarted_up_to_the_limit_unless_it_ended_the_job_itself(tmp_path, capsys, code,
                                                                                         phase, restarts):
    """Killed, or crashed (exit 1) while its state file says the job is under way, the
    coordinator is started again, MAX_RESTARTS times and no more; its own exit 1 before
    training (a refusal, which it has said) is the job's end, not a crash. Its exit code
    is said as the other daemons' are: a kill's with the signal's name (it used to be a
    bare "-9")."""
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=1"], env={})
    job = DyingCoordinatorJob(cfg, str(tmp_path), quiet=True, timeout_s=50)
    job.code, job.phase = code, phase
    said = "-9 (SIGKILL)" if code < 0 else str(code)
    gave_up = f"the coordinator keeps dying (exit {said}); gave up after {MAX_RESTARTS} restarts"
    launch_failure(job, re.escape(gave_up) if restarts else "ended without a summary")
    err = capsys.readouterr().err
    assert (f"the coordinator exited with {said}; restarting it (restart 1)" in err) == bool(restarts), err
    coord = job.children[0]
    assert coord.role == "coordinator" and coord.restarts == restarts
    with open(coord.log_path) as f:
        assert f.read().splitlines() == ["coordinator up"] * (1 + restarts)


class StartedJob(LocalJob):
    """Every child touches its --started-file (the last argument) and waits to be stopped."""

    def _argv(self, role: str, *extra: str) -> list[str]:
        code = "import sys, time; open(sys.argv[-1], 'w').close(); time.sleep(60)"
        return [sys.executable, "-c", code, *extra]


def start_all(job: LocalJob, n: int) -> None:
    """Start the job and wait (up to 40 s) until n children have started."""
    job.start()
    deadline = time.monotonic() + 40
    while len(job.started) < n and time.monotonic() < deadline:
        time.sleep(0.1)
        job.show_started()


class CoordinatorFirstJob(LocalJob):
    """Each start notes whether the coordinator had loaded its code (its started file)."""

    def _start(self, child) -> None:
        self.order = [*getattr(self, "order", []), (child.name, os.path.exists(self.started_file("coordinator-0")))]
        super()._start(child)


@pytest.mark.timeout(120)
def test_the_forked_daemons_start_once_the_coordinator_has(tmp_path):
    """A helper's finding: the forked workers start at once, the coordinator (a new
    interpreter) up to 7 s later on a busy machine; each waits cluster.timeout_s from its
    own start, so theirs ran out first, and they blamed its address. Here the coordinator's
    interpreter takes 2 s more to start (a sitecustomize)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys, time\nif 'coordinator' in sys.argv: time.sleep(2)\n")
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=2"], env={})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.path.dirname(os.path.dirname(__file__))])}
    job = CoordinatorFirstJob(cfg, str(tmp_path / "out"), quiet=True, timeout_s=50, env=env)
    try:
        job.start()
    finally:
        job.stop()
    assert job.order[0] == ("coordinator-0", False) and len(job.order) == 5, job.order
    assert all(up for _, up in job.order[1:]), job.order


@pytest.mark.timeout(60)
def test_start_up_progress_counts_the_children_that_have_started(tmp_path, capsys):
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=1"], env={})
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "worker-0.started").write_text("")  # an earlier job's: not counted
    job = StartedJob(cfg, str(tmp_path), quiet=False, timeout_s=50)
    try:
        start_all(job, 4)
    finally:
        job.stop()
    err = capsys.readouterr().err
    assert "[psgd run] started 4/4 processes in" in err, err
    counts = [int(line.split("started ")[1].split("/")[0]) for line in err.splitlines() if "] started " in line]
    assert counts == sorted(counts) and counts[-1] == 4
    assert "--launched-at" in job.children[0].argv


def test_an_explicit_busy_port_is_refused_not_moved(tmp_path):
    base = free_port_block(2)
    with listening_on(base + 1):   # the shard's port
        cfg = load(None, [f"cluster.port={base}", "cluster.servers=1", "cluster.workers=1"], env={})
        with pytest.raises(LaunchError, match=f"cluster.port = {base}: port {base + 1} on 127.0.0.1 is in use"):
            LocalJob(cfg, str(tmp_path), quiet=True, port_explicit=True)
        job = LocalJob(cfg, str(tmp_path), quiet=True)   # unset: the launcher chooses another block
        assert job.cfg.cluster.port != base
        assert f"port = {job.cfg.cluster.port}" in (tmp_path / "config.toml").read_text()


def test_an_explicit_port_another_job_listens_on_is_refused(tmp_path):
    """A listener with SO_REUSEADDR (as ZeroMQ binds: another job's daemon) still counts as busy."""
    base = free_port_block(2)
    with listening_on(base):   # the coordinator's port
        cfg = load(None, [f"cluster.port={base}", "cluster.servers=1", "cluster.workers=1"], env={})
        with pytest.raises(LaunchError, match=f"port {base} on 127.0.0.1 is in use"):
            LocalJob(cfg, str(tmp_path), quiet=True, port_explicit=True)


def test_a_busy_block_moves_below_the_ephemeral_range():
    """A port there can be taken as the local end of an outgoing connection (or by a
    connection to itself) before its daemon binds it: the launcher's own choice avoids it."""
    base = free_port_block(2)
    low, _ = ephemeral_ports()
    with listening_on(base):
        for _ in range(20):
            port = pick_port("127.0.0.1", base, 2)
            assert port != base and 1024 <= port and port + 1 < low and ports_free("127.0.0.1", port, 2)
    assert pick_port("127.0.0.1", base, 2) == base   # free again: the block asked for


@pytest.mark.parametrize("quiet", [False, True])
def test_an_explicit_port_in_the_ephemeral_range_is_warned_about(tmp_path, capsys, quiet):
    """Also under --quiet (a review: the warning was dropped there, and psgd compare's
    runs are quiet)."""
    low, high = ephemeral_ports()
    # (the first free block from low + 1000 on: outgoing connections hold ports there, more under pytest -n 2)
    base = next((b for b in range(low + 1000, high - 2, 389) if ports_free("127.0.0.1", b, 2)), None)
    if base is None:
        pytest.skip("no free block in the ephemeral range")
    cfg = load(None, [f"cluster.port={base}", "cluster.servers=1", "cluster.workers=1"], env={})
    LocalJob(cfg, str(tmp_path), port_explicit=True, quiet=quiet)
    assert f"warning: cluster.port = {base}: ports {base}-{base + 1} lie in the OS's range" in capsys.readouterr().err


def test_jobs_started_at_once_choose_blocks_of_their_own(tmp_path):
    """Two psgd runs started at the same moment, cluster.port unset: both found the
    default block free (no daemon had bound it yet) and chose it, and one job's daemons
    reached the other's coordinator. A launcher holds the ports it chose until its job
    ends: the second chooses another block, a job given them explicitly is refused, and
    once the first job stops they are free to the next."""
    base = free_port_block(3)
    cfg = load(None, [f"cluster.port={base}", "cluster.servers=1", "cluster.workers=1"], env={})
    first = LocalJob(cfg, str(tmp_path / "a"), quiet=True)
    try:
        second = LocalJob(cfg, str(tmp_path / "b"), quiet=True)
        try:
            assert first.cfg.cluster.port == base
            assert abs(second.cfg.cluster.port - base) >= 2, (base, second.cfg.cluster.port)
            with pytest.raises(LaunchError, match=f"cluster.port = {base}: another psgd run of this user chose"):
                LocalJob(cfg, str(tmp_path / "c"), quiet=True, port_explicit=True)
        finally:
            second.stop()
    finally:
        first.stop()
    third = LocalJob(cfg, str(tmp_path / "d"), quiet=True)
    third.stop()
    assert third.cfg.cluster.port == base


def leave_time_wait(port: int) -> None:
    """A connection to a listener on port that the listening side closes first: its end
    stays in TIME_WAIT (a minute on Linux), as after a job whose coordinator served workers."""
    with listening_on(port) as listener:
        with socket.socket() as client:
            client.connect(("127.0.0.1", port))
            conn, _ = listener.accept()
            conn.close()          # the active close: this end goes to TIME_WAIT
            client.recv(1)        # the FIN arrived
    time.sleep(0.1)


@pytest.mark.timeout(30)
def test_an_explicit_port_left_in_time_wait_by_an_earlier_job_is_accepted(tmp_path):
    """It used to be refused as "in use" for a minute after the earlier job, although the
    daemons' bind (ZeroMQ's, with SO_REUSEADDR) succeeds there."""
    base = free_port_block(2)
    leave_time_wait(base)
    with socket.socket() as plain:   # the old probe: a bind without SO_REUSEADDR fails
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", base))
    cfg = load(None, [f"cluster.port={base}", "cluster.servers=1", "cluster.workers=1"], env={})
    job = LocalJob(cfg, str(tmp_path), quiet=True, port_explicit=True)
    assert job.cfg.cluster.port == base
    import zmq
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(f"tcp://127.0.0.1:{base}")   # and the daemon's bind succeeds
        sock.close(linger=0)
    finally:
        ctx.term()


class BusyOnceJob(LocalJob):
    """The first coordinator finds its port taken (exit EXIT_ADDRESS_IN_USE), as when
    another job binds the block between the launcher's check and the daemon's bind; the
    second one runs."""

    def _argv(self, role: str, *extra: str) -> list[str]:
        if role == "coordinator" and self.moves == 0:
            return [sys.executable, "-c", f"import sys; print('port taken', file=sys.stderr); "
                                          f"sys.exit({EXIT_ADDRESS_IN_USE})"]
        return [sys.executable, "-c", "import time; time.sleep(60)"]


def run_stand_ins(job_class: type[LocalJob], tmp_path, timeout_s: float) -> tuple[int, LocalJob]:
    """A job of 1 shard and 1 worker on a free port block, its daemons `job_class`'s
    stand-ins, which never end: run until its timeout. The block's first port, and the job."""
    base = free_port_block(3)
    cfg = load(None, [f"cluster.port={base}", "cluster.servers=1", "cluster.workers=1"], env={})
    job = job_class(cfg, str(tmp_path), quiet=False, timeout_s=timeout_s)
    launch_failure(job, "did not finish within")   # the stand-ins never end
    return base, job


@pytest.mark.timeout(60)
def test_a_job_whose_chosen_ports_are_taken_moves_to_another_block(tmp_path, capsys):
    base, job = run_stand_ins(BusyOnceJob, tmp_path, timeout_s=2)
    assert job.moves == 1 and job.cfg.cluster.port != base
    assert f"moved the job to {job.cfg.cluster.port}" in capsys.readouterr().err
    assert f"port = {job.cfg.cluster.port}" in (tmp_path / "config.toml").read_text()


class ForeignCoordinatorJob(LocalJob):
    """Another job took the block at once: this job's daemons reached its coordinator and
    were refused (they exit 1 at once), and this job's coordinator finds its port taken a
    moment later; the second block runs."""

    def _argv(self, role: str, *extra: str) -> list[str]:
        if self.moves == 0 and role == "coordinator":
            return [sys.executable, "-c", f"import sys, time; time.sleep(0.5); sys.exit({EXIT_ADDRESS_IN_USE})"]
        if self.moves == 0:
            return [sys.executable, "-c", f"import sys; print('psgd {role}: error: this {role} belongs to another "
                                          f"job: the coordinator at ... runs another', file=sys.stderr); sys.exit(1)"]
        return [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.mark.timeout(60)
def test_daemons_refused_by_another_job_on_the_block_are_not_reported_as_failures(tmp_path, capsys):
    """Two jobs that chose the same block at once: the one that lost printed "worker-0
    exited with 1 ... belongs to another job" and restarted its shard and evaluator, then
    moved: alarming messages for a start that recovers."""
    _, job = run_stand_ins(ForeignCoordinatorJob, tmp_path, timeout_s=3)
    err = capsys.readouterr().err
    assert job.moves == 1 and f"moved the job to {job.cfg.cluster.port}" in err
    assert "exited with" not in err and "restarting" not in err, err


class RefusedThenBoundJob(LocalJob):
    """Two jobs chose the block at once; the other job's coordinator bound its first port
    and refused this job's daemons (they exit 1 at once), then that job moved away (one of
    its shards lost the race), and this job's coordinator bound the port after all: it
    runs, no daemon of this job exits EXIT_ADDRESS_IN_USE; the second block runs."""

    def _argv(self, role: str, *extra: str) -> list[str]:
        if self.moves == 0 and role != "coordinator":
            return [sys.executable, "-c", f"import sys; print('psgd {role}: error: this {role} belongs to another "
                                          f"job: the coordinator at ... runs another', file=sys.stderr); sys.exit(1)"]
        if self.moves == 1 and role == "worker":   # (its log still ends with the refusal of the first block's)
            return [sys.executable, "-c", "import time, sys; time.sleep(0.5); sys.exit(1)"]
        return [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.mark.timeout(60)
def test_daemons_refused_by_another_job_move_the_job_though_its_coordinator_bound(tmp_path, capsys):
    """Two psgd runs started at once, both on the default block: the one whose daemons the
    other's coordinator refused failed with "worker-0 exited with code 1 before the job
    began training" where its own coordinator bound the port once the other job had moved
    away. A refusal by another job's coordinator moves the job; one whose current process
    was not refused (only the log's earlier lines say so) does not move it again."""
    base = free_port_block(3)
    cfg = load(None, [f"cluster.port={base}", "cluster.servers=1", "cluster.workers=1"], env={})
    job = RefusedThenBoundJob(cfg, str(tmp_path), quiet=False, timeout_s=20)
    launch_failure(job, "worker-0 exited with code 1 before the job began training")
    err = capsys.readouterr().err
    assert job.moves == 1 and job.cfg.cluster.port != base, err
    assert f"port block {base} is another job's (its coordinator refused " in err
    assert f"moved the job to {job.cfg.cluster.port}" in err


@pytest.mark.timeout(60)
def test_daemons_refused_by_another_job_on_an_explicit_port_say_so(tmp_path):
    """The user's cluster.port: the job cannot move; it stops with the refusal, not with
    "worker-0 exited with code 1 before the job began training"."""
    base = free_port_block(3)
    cfg = load(None, [f"cluster.port={base}", "cluster.servers=1", "cluster.workers=1"], env={})
    job = RefusedThenBoundJob(cfg, str(tmp_path), quiet=True, timeout_s=20, port_explicit=True)
    launch_failure(job, f"(?s)reached another job's coordinator on this job's port {base} and was refused; "
                        f".* belongs to another job")
    assert job.moves == 0


class SummaryThenFullDiskJob(LocalJob):
    """The coordinator writes the job's summary, then cannot write its last event line (a
    full disk) and exits EXIT_CANNOT_WRITE; the other daemons end at once."""

    def _argv(self, role: str, *extra: str) -> list[str]:
        if role == "coordinator":
            return [sys.executable, "-c", f"import json, sys; json.dump({{'mode': 'sync'}}, open("
                                          f"{os.path.join(self.out, 'summary.json')!r}, 'w')); "
                                          f"print('psgd coordinator: error: cannot write x: No space left on device', "
                                          f"file=sys.stderr); sys.exit({EXIT_CANNOT_WRITE})"]
        return [sys.executable, "-c", "pass"]


@pytest.mark.timeout(60)
def test_a_coordinator_that_cannot_write_after_the_summary_leaves_the_job_done(tmp_path, capsys):
    """A review: a coordinator exit 73 (a full disk) failed the run even when the job's
    summary was already written, where a shard's exit 73 then is a warning: the summary
    stands."""
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=1"], env={})
    job = SummaryThenFullDiskJob(cfg, str(tmp_path), quiet=True, timeout_s=30)
    try:
        job.start()
        assert job.wait() == {"mode": "sync"}
    finally:
        job.stop()
    assert "after writing the job's summary" in capsys.readouterr().err


# What psgd.connect leaves behind in a stand-in script: its .started file, then (once
# every worker has registered and training begins) its step log.
CONNECTS = "import os\nopen(os.environ['PSGD_STARTED_FILE'], 'w').close()\n"
TRAINS = ("os.makedirs(os.path.join(os.environ['PSGD_OUT'], 'events'), exist_ok=True)\n"
          "open(os.path.join(os.environ['PSGD_OUT'], 'events', f\"worker-{os.environ['PSGD_RANK']}.jsonl\"), 'a')"
          ".write('{}\\n')\n")


class ScriptStandInJob(LocalJob):
    """The daemons touch their --started-file and wait to be stopped; the workers are
    copies of the test's training script (a stand-in: it never connects to anything)."""

    def _argv(self, role: str, *extra: str) -> list[str]:
        code = "import sys, time; open(sys.argv[-1], 'w').close(); time.sleep(60)"
        return [sys.executable, "-c", code, *extra]


def script_job(tmp_path, code: str, **kw) -> ScriptStandInJob:
    script = tmp_path / "train.py"
    script.write_text(code)
    cfg = load(None, [f"cluster.port={free_port_block(2)}", "cluster.servers=1", "cluster.workers=2",
                      "cluster.evaluator=false"], env={})
    return ScriptStandInJob(cfg, str(tmp_path / "out"), quiet=True, script=[str(script), "--flag"], **kw)


@pytest.mark.timeout(60)
def test_a_scripts_stdout_goes_to_its_log_with_its_stderr_in_order(tmp_path):
    """Everything a training script printed to stdout used to be discarded."""
    job = script_job(tmp_path, CONNECTS + TRAINS + "import sys\n"
                                                   "for i in range(3):\n"
                                                   "    print('out', i, sys.argv[1:])\n"
                                                   "    print('err', i, file=sys.stderr)\n", timeout_s=10)
    launch_failure(job, "did not finish within")   # the stand-in coordinator never ends
    for rank in range(2):
        with open(tmp_path / "out" / "logs" / f"worker-{rank}.log") as f:
            assert f.read().splitlines() == [line for i in range(3) for line in (f"out {i} ['--flag']", f"err {i}")]
    assert all(c.poll() is not None for c in job.children)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [0, 2])
def test_a_script_that_exits_before_psgd_connect_stops_the_job_at_once(tmp_path, code):
    """`-- --help` (exit 0) used to leave the job waiting for its rank until
    cluster.timeout_s, then "0/2 workers registered"."""
    job = script_job(tmp_path, "import os, sys, time\n"
                               "if os.environ['PSGD_RANK'] == '1':\n"
                               f"    print('usage: train.py [--lr LR]'); sys.exit({code})\n"
                               + CONNECTS + "time.sleep(60)\n", timeout_s=50)
    began = time.monotonic()
    message = launch_failure(job)
    assert time.monotonic() - began < 30
    assert message.startswith(f"worker-1's script exited with code {code} before joining the job"), message
    assert "usage: train.py [--lr LR]" in message and "worker-1.log" in message
    assert all(c.poll() is not None for c in job.children)


@pytest.mark.timeout(60)
def test_a_script_whose_psgd_connect_refused_its_arguments_is_not_said_to_have_skipped_it(tmp_path):
    """`psgd.connect(optimizer, model)` (swapped) is refused before psgd.connect writes its
    .started file: psgd run said the script "exited with code 1 before calling
    psgd.connect", above a traceback of psgd.connect's ConfigError."""
    job = script_job(tmp_path, "import os, sys, time\n"
                               "if os.environ['PSGD_RANK'] == '1':\n"
                               "    import psgd, torch\n"
                               "    model = torch.nn.Linear(2, 2)\n"
                               "    psgd.connect(torch.optim.SGD(model.parameters(), lr=0.1), model)\n"
                               + CONNECTS + "time.sleep(60)\n", timeout_s=50)
    message = launch_failure(job)
    assert message.startswith("worker-1's script exited with code 1 before joining the job "
                              "(no psgd.connect, or one that refused it"), message
    assert "before calling psgd.connect" not in message and "model and optimizer swapped" in message, message
    assert all(c.poll() is not None for c in job.children)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("restart_workers", [False, True])
def test_a_script_refused_in_psgd_connect_stops_the_job_at_once(tmp_path, restart_workers):
    """Refused at registration (a model unlike the job's): the job used to wait for its
    rank until cluster.timeout_s. With --restart-workers it is started again instead."""
    job = script_job(tmp_path, CONNECTS + "import sys, time\n"
                                          "if os.environ['PSGD_RANK'] == '1':\n"
                                          "    print('refused: the model differs', file=sys.stderr); sys.exit(1)\n"
                                          "time.sleep(60)\n", timeout_s=50, restart_workers=restart_workers)
    message = launch_failure(job)
    if restart_workers:
        assert message.startswith("worker-1 keeps dying (exit 1)"), message
    else:
        assert message.startswith("worker-1's script exited with code 1 in psgd.connect, before the job began "
                                  "training"), message
        assert "refused: the model differs" in message


@pytest.mark.timeout(60)
def test_scripts_that_exit_0_after_training_are_a_normal_end(tmp_path):
    (tmp_path / "out" / "events").mkdir(parents=True)   # an earlier job's step logs in the same folder
    for rank in range(2):
        (tmp_path / "out" / "events" / f"worker-{rank}.jsonl").write_text("{}\n")
        os.utime(tmp_path / "out" / "events" / f"worker-{rank}.jsonl", (1e9, 1e9))
    job = script_job(tmp_path, CONNECTS + "import time\n"
                                          "if os.environ['PSGD_RANK'] == '1':\n"
                                          "    time.sleep(2)\n"   # rank 0 ends first, after training
                               + TRAINS, timeout_s=5)
    launch_failure(job, "did not finish within")   # not a script's exit


@pytest.mark.timeout(60)
def test_a_restarted_script_stopped_before_it_rejoined_says_so_at_the_end_of_its_log(tmp_path):
    """psgd run's warning of rank 0's missing model.pt points at its log, which held only
    the restarted copy's "waiting for the coordinator" lines: the reason (it had not
    rejoined when the job ended, so psgd run stopped it) was said on psgd run's terminal only."""
    job = script_job(tmp_path, CONNECTS + "import sys, time\n"
                                          "if os.environ['PSGD_RANK'] == '0':\n"
                                          "    print('waiting for the coordinator', flush=True); time.sleep(60)\n",
                     timeout_s=50)
    log = tmp_path / "out" / "logs" / "worker-0.log"
    try:
        job.start()
        rank0 = job.children[1 + job.cfg.cluster.servers]
        assert rank0.name == "worker-0" and rank0.script
        rank0.restarts = 1   # a copy started again by --restart-workers, still in psgd.connect
        deadline = time.monotonic() + 40
        while "waiting" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.1)
        job._scripts_end(time.monotonic() + 40)   # the job has ended: rank 1 exits 0, rank 0 is stopped
        assert rank0.poll() is not None
    finally:
        job.stop()
    lines = log.read_text().splitlines()
    assert lines[0] == "waiting for the coordinator"
    assert lines[-1] == ("[psgd run] this restarted copy of the script had not rejoined the job when the job "
                         "ended: psgd run stopped it"), lines


@pytest.mark.timeout(60)
def test_a_script_killed_before_it_printed_is_said_to_have_an_empty_log(tmp_path, capsys):
    """psgd run said "worker-1 exited with -9 (SIGKILL):" and a blank line, and its error
    "worker-1.log ends:" and a blank line: the log was empty."""
    job = script_job(tmp_path, CONNECTS + TRAINS + "import signal, time\n"
                                                   "if os.environ['PSGD_RANK'] == '1':\n"
                                                   "    os.kill(os.getpid(), signal.SIGKILL)\n"
                                                   "time.sleep(60)\n", timeout_s=8)
    try:
        job.start()
        with pytest.raises(LaunchError, match="did not finish within"):  # the stand-in coordinator never ends
            job.wait()
        rank1 = next(c for c in job.children if c.name == "worker-1")
        log = tmp_path / "out" / "logs" / "worker-1.log"
        assert job._script_failure(rank1) == f"worker-1's script exited with code -9 (SIGKILL); {log} is empty"
    finally:
        job.stop()
    assert f"[psgd run] worker-1 exited with -9 (SIGKILL); {log} is empty\n" in capsys.readouterr().err


class EnvJob(LocalJob):
    """Every child writes its LOCAL_RANK and PSGD_DEVICE into its --started-file (the last
    argument) and waits to be stopped."""

    def _argv(self, role: str, *extra: str) -> list[str]:
        # written whole, then renamed: the launcher counts a child started once the file exists,
        # and the test read it empty between the child's open and its write
        code = ("import os, sys, time; f = sys.argv[-1]; open(f + '.tmp', 'w').write("
                "os.environ.get('LOCAL_RANK', '-') + ' ' + os.environ.get('PSGD_DEVICE', '-')); "
                "os.rename(f + '.tmp', f); time.sleep(60)")
        return [sys.executable, "-c", code, *extra]


@pytest.mark.timeout(60)
def test_each_worker_is_told_its_local_rank_and_the_device(tmp_path):
    """`--device auto` picks GPU LOCAL_RANK % GPUs; psgd run set no LOCAL_RANK, so every
    worker of a job on a machine with several GPUs took GPU 0."""
    cfg = load(None, [f"cluster.port={free_port_block(4)}", "cluster.servers=1", "cluster.workers=2",
                      "cluster.evaluator=false"], env={})
    job = EnvJob(cfg, str(tmp_path), device="cuda", quiet=True, timeout_s=50)
    try:
        start_all(job, 4)
        said = {name: (tmp_path / "logs" / f"{name}.started").read_text() for name in ("worker-0", "worker-1")}
    finally:
        job.stop()
    assert said == {"worker-0": "0 -", "worker-1": "1 -"}   # daemons: --device is their argument
    assert "--device" in job.children[2].argv and "cuda" in job.children[2].argv


@pytest.mark.timeout(60)
def test_a_training_script_is_told_its_local_rank_and_the_device(tmp_path, monkeypatch):
    job = script_job(tmp_path, "import os, sys, time\nf = os.environ['PSGD_STARTED_FILE']\n"
                               "open(f + '.tmp', 'w').write(os.environ['LOCAL_RANK'] + ' ' + "
                               "os.environ['PSGD_DEVICE'])\n"
                               "os.rename(f + '.tmp', f)\ntime.sleep(60)\n", device="cpu", timeout_s=50)
    try:
        start_all(job, 4)
        said = [(tmp_path / "out" / "logs" / f"worker-{r}.started").read_text() for r in range(2)]
    finally:
        job.stop()
    assert said == ["0 cpu", "1 cpu"]
    import psgd
    monkeypatch.setenv("PSGD_DEVICE", "cpu")
    assert str(psgd.device()) == "cpu"


class PidJob(LocalJob):
    """Every child writes its pid file as a daemon does, and dies at SIGTERM without
    removing it (as a daemon killed with -9 would)."""

    def _argv(self, role: str, *extra: str) -> list[str]:
        code = ("import os, sys, time; name = os.path.basename(sys.argv[-1]).rsplit('.', 1)[0]; "
                "out = sys.argv[sys.argv.index('--out') + 1]; os.makedirs(out + '/pids', exist_ok=True); "
                "open(f'{out}/pids/{name}.pid', 'w').write(str(os.getpid())); "
                "open(sys.argv[-1], 'w').close(); time.sleep(60)")
        return [sys.executable, "-c", code, "--out", self.out, *extra]


@pytest.mark.timeout(60)
def test_the_pid_files_of_daemons_that_died_go_with_the_job(tmp_path):
    """A worker killed with -9 (and not restarted) left pids/worker-1.pid after the job."""
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=1"], env={})
    job = PidJob(cfg, str(tmp_path), quiet=True, timeout_s=50)
    try:
        start_all(job, 4)
        assert len(list((tmp_path / "pids").glob("*.pid"))) == 4
    finally:
        job.stop()
    assert list((tmp_path / "pids").glob("*.pid")) == []


@pytest.mark.timeout(30)
def test_a_second_ctrl_c_or_sigterm_while_the_daemons_stop_is_held():
    """README, Reliability: a second Ctrl-C (or SIGTERM) while `psgd run` stops its
    daemons does not cut the stop short: the first of them comes once it is over; the
    handlers are back afterwards."""
    import os
    import signal

    from psgd.launcher import signals_held
    hits: list[int] = []
    before = {s: signal.signal(s, lambda n, f: hits.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with signals_held():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            assert hits == []
        assert hits == [signal.SIGINT]
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert hits == [signal.SIGINT, signal.SIGTERM]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


@pytest.mark.timeout(60)
def test_a_daemon_started_by_hand_into_a_running_jobs_folder_carries_its_token(tmp_path, monkeypatch):
    """README: a worker that comes back, restarted with `--rank R`, rejoins. Under `psgd
    run` a `psgd worker --rank 1 --out DIR` started by hand carried no job token and was
    refused ("this worker belongs to another job ... is another job using its port?"):
    the job's token is in DIR/.job-token while it runs, and a daemon with `--out DIR` and
    none of its own takes it; a daemon of another folder still has none."""
    import psgd.workers.evaluator as evaluator
    from psgd import cli
    from psgd.launcher import TOKEN_FILE, folder_token
    from psgd.membership import JOB_TOKEN_ENV, job_token

    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=1"], env={})
    job = StandInJob(cfg, str(tmp_path / "job"), quiet=True, timeout_s=50)
    seen: list[str] = []

    class Evaluator:   # what the daemon would register with
        def __init__(self, *args, **kw):
            seen.append(job_token())

        def run(self) -> int:
            return 0

    monkeypatch.setattr(evaluator, "Evaluator", Evaluator)
    monkeypatch.delenv(JOB_TOKEN_ENV, raising=False)
    sigterm = signal.getsignal(signal.SIGTERM)   # (cli.main sets a daemon's)
    try:
        job.start()
        token = job.env[JOB_TOKEN_ENV]
        assert token and folder_token(job.out) == token
        assert oct(os.stat(os.path.join(job.out, TOKEN_FILE)).st_mode & 0o777) == "0o600"
        for out in (job.out, str(tmp_path / "other")):
            monkeypatch.delenv(JOB_TOKEN_ENV, raising=False)
            assert cli.main(["evaluator", job.config_path, "--out", out]) == 0
        assert seen == [token, ""]
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        job.stop()
    assert folder_token(job.out) == "" and not os.path.exists(os.path.join(job.out, TOKEN_FILE))


@pytest.mark.timeout(30)
def test_a_daemon_refused_by_the_coordinator_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """A daemon of another job (or started by hand into another folder) is refused by a
    `psgd run` job's coordinator: `psgd worker|server|evaluator` ended with a traceback of
    psgd.wire.Refused, the reason on its last line; now one line and exit code 1."""
    import psgd.workers.evaluator as evaluator
    from psgd import cli, wire

    class Evaluator:
        def __init__(self, *args, **kw):
            pass

        def run(self) -> int:
            raise wire.Refused(wire.REFUSED, "this evaluator belongs to another job: ...", "tcp://127.0.0.1:5555")

    monkeypatch.setattr(evaluator, "Evaluator", Evaluator)
    sigterm = signal.getsignal(signal.SIGTERM)   # (cli.main sets a daemon's)
    try:
        code = cli.main(["evaluator", "--out", str(tmp_path)])
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    err = capsys.readouterr().err
    assert code == 1
    assert err == ("psgd evaluator: error: refused: tcp://127.0.0.1:5555: this evaluator belongs to another job: "
                   "...\n"), err


class SleepingJob(LocalJob):
    """Every daemon waits to be stopped: a job that never ends."""

    def _argv(self, role: str, *extra: str) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.mark.timeout(60)
def test_the_timeout_is_said_as_given(tmp_path):
    """`psgd run --timeout 0.5` said "the job did not finish within 0 s"."""
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=1"], env={})
    job = SleepingJob(cfg, str(tmp_path), quiet=True, timeout_s=0.5)
    launch_failure(job, r"the job did not finish within 0\.5 s$")


class OrderJob(LocalJob):
    """Starts nothing: records the order in which the fork server was readied and the
    children were started."""

    def _start(self, child) -> None:
        self.order.append(child.name)

    def _until_started(self, child) -> None:
        self.order.append(f"until {child.name} started")


@pytest.mark.timeout(30)
def test_the_fork_server_has_imported_torch_before_the_coordinator_starts(tmp_path, monkeypatch):
    """The coordinator gives the workers cluster.timeout_s from its start to register: the
    fork server's import of torch (30 s on a busy machine, READY_S allowed) was counted in
    it, as the coordinator started first, and a slow import ended the job with 0 workers."""
    from psgd import forkserver
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=1"], env={})
    job = OrderJob(cfg, str(tmp_path), quiet=True, timeout_s=20)
    job.order = []
    monkeypatch.setattr(forkserver, "server", lambda env: job.order.append("fork server") or object())
    try:
        job.start()
    finally:
        job.stop()
    assert job.order[0] == "fork server", job.order   # (was the coordinator first)
    started = [x for x in job.order if x != "fork server"]
    assert started[:3] == ["coordinator-0", "until coordinator-0 started", "server-0"], job.order   # then the forked
    # a training script's workers (new interpreters, as the coordinator) start beside it, not after it
    job = OrderJob(cfg, str(tmp_path / "s"), quiet=True, timeout_s=20, script=["train.py"])
    job.order = []
    try:
        job.start()
    finally:
        job.stop()
    started = [x for x in job.order if x != "fork server"]
    assert started[:4] == ["coordinator-0", "worker-0", "until coordinator-0 started", "server-0"], job.order


class TouchingJob(LocalJob):
    """Starts nothing: each child "starts" at once (its .started file is touched)."""

    def _start(self, child) -> None:
        open(self.started_file(child.name), "w").close()


@pytest.mark.timeout(30)
def test_start_up_progress_is_said_while_the_children_are_being_started(tmp_path, capsys, monkeypatch):
    """Forking a dozen daemons took tens of seconds on a busy machine, and the count was
    first said after the last: "started 7/18" came after the coordinator's "workers
    registered 1/12"."""
    from psgd import forkserver
    monkeypatch.setattr(forkserver, "server", lambda env: None)
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=1"], env={})
    job = TouchingJob(cfg, str(tmp_path), quiet=False, timeout_s=20)
    try:
        job.start()
    finally:
        job.stop()
    lines = [line for line in capsys.readouterr().err.splitlines() if "] started " in line]
    assert [line.split("started ")[1].split(" ")[0] for line in lines] == ["1/4", "2/4", "3/4", "4/4"], lines
    assert lines[-1].startswith("[psgd run] started 4/4 processes in ")


@pytest.mark.timeout(30)
def test_a_quiet_job_tells_its_start_up_count_to_on_started(tmp_path, capsys, monkeypatch):
    """psgd compare runs its jobs quietly, and its progress line said only "starting
    processes" while a run's daemons started (tens of seconds on a busy machine): the
    launcher's k/N count is handed to it, and a quiet job still says nothing itself."""
    from psgd import forkserver
    from psgd.compare import Monitor
    monkeypatch.setattr(forkserver, "server", lambda env: None)
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=1"], env={})
    monitor = Monitor("[1/2]", str(tmp_path), cfg.train.steps, every_s=60)
    seen = []
    job = TouchingJob(cfg, str(tmp_path), quiet=True, timeout_s=20,
                      on_started=lambda k, n: (seen.append(f"{k}/{n}"), monitor.started(k, n)))
    try:
        job.start()
    finally:
        job.stop()
    assert seen == ["0/4", "1/4", "2/4", "3/4", "4/4"], seen
    assert "started" not in capsys.readouterr().err
    assert monitor.status().endswith("started 4/4 processes"), monitor.status()


@pytest.mark.timeout(60)
def test_the_job_config_names_its_folders_absolute_so_the_test_set_loads_from_anywhere(tmp_path, monkeypatch):
    """A helper's review: a job run with `--set data.path=data` (a relative folder) wrote
    `path = "data"` to DIR/config.toml, so README's scoring of DIR/model.pt
    (`load_dataset(load("DIR/config.toml").data)`) raised "data/train-images-idx3-ubyte:
    file not found" from any other folder; so did `psgd status DIR` with relative keys."""
    from tests.test_data_models import write_idx
    (tmp_path / "launch" / "data").mkdir(parents=True)
    for split, n in (("train", 30), ("t10k", 10)):
        write_idx(tmp_path / "launch" / "data" / f"{split}-images-idx3-ubyte", np.zeros((n, 28, 28)), 0x803)
        write_idx(tmp_path / "launch" / "data" / f"{split}-labels-idx1-ubyte", np.arange(n) % 10, 0x801)
    monkeypatch.chdir(tmp_path / "launch")
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "data.name=mnist", "data.path=data",
                      "checkpoint.dir=ckpt", "security.keys=keys"], env={})
    LocalJob(cfg, "out", quiet=True, port_explicit=True).stop()
    monkeypatch.chdir(tmp_path)
    written = load(str(tmp_path / "launch" / "out" / "config.toml"))
    assert written.data.path == str(tmp_path / "launch" / "data")
    assert written.checkpoint.dir == str(tmp_path / "launch" / "ckpt")
    assert written.security.keys == str(tmp_path / "launch" / "keys")
    assert len(load_dataset(written.data, written.job.seed).test_y) == 10


@pytest.mark.timeout(60)
def test_the_environment_the_launcher_gives_its_daemons_loads_as_their_config(tmp_path):
    """A review: PSGD_CHECKPOINT_SET_CHECKED, set for the daemons of a job over a folder of
    shard checkpoints, was read as the config key checkpoint.set_checked, unknown: every
    daemon of every resumed job exited 2 at its start."""
    from psgd.config import SET_CHECKED_ENV
    from psgd.shard import Shard
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "cluster.servers=1", "cluster.workers=1"], env={})
    Shard(cfg, 0).save(cfg.checkpoint_file(str(tmp_path), 0))
    job = LocalJob(cfg, str(tmp_path), quiet=True, port_explicit=True)
    try:
        assert job.env[SET_CHECKED_ENV] == "1"
        assert load(job.config_path, [], env=job.env) == job.cfg
    finally:
        job.stop()


@pytest.mark.timeout(30)
def test_port_locks_follow_no_link_and_no_folder_others_may_write(tmp_path, monkeypatch):
    """A review: the port locks' folder was used whoever made it, and a lock file was opened
    for writing, truncated, through a symbolic link: another user could plant
    PORT.lock -> ~/.bashrc there and empty it. A link is not followed (no locks then, and
    the file is untouched), nor a folder others may write."""
    import tempfile

    from psgd.launcher import claim_ports, port_locks_folder
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    folder = port_locks_folder()
    os.makedirs(folder, mode=0o700)
    precious = tmp_path / "bashrc"
    precious.write_text("keep me\n")
    os.symlink(precious, os.path.join(folder, "25001.lock"))
    assert claim_ports(25001, 2) == [] and precious.read_text() == "keep me\n"
    held = claim_ports(25010, 2)
    assert held and len(held) == 2
    for f in held:
        f.close()
    os.chmod(folder, 0o777)
    assert claim_ports(25020, 2) == []


@pytest.mark.timeout(60)
def test_a_config_file_of_the_users_in_the_folder_is_refused_not_replaced(tmp_path):
    """`psgd run DIR/config.toml --out DIR` with a config of the user's own: psgd run
    replaced it with the resolved config, its comments lost, without a word. Refused
    (a ConfigError: exit 2), nothing in the folder touched; one psgd wrote, of this
    version or of an earlier one with fewer keys, is replaced as before."""
    from psgd.config import ConfigError
    mine = "# my job: short\n[train]\nsteps = 20   # enough\n"
    (tmp_path / "config.toml").write_text(mine)
    (tmp_path / "summary.json").write_text("{}")   # an earlier job's: kept
    cfg = load(str(tmp_path / "config.toml"), ["cluster.servers=1", "cluster.workers=1"], env={})
    with pytest.raises(ConfigError, match="config.toml is a config file psgd did not write"):
        LocalJob(cfg, str(tmp_path), quiet=True)
    assert (tmp_path / "config.toml").read_text() == mine
    assert (tmp_path / "summary.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path)) == ["config.toml", "summary.json"]   # (it made logs/ and its lock file)
    plain = "[train]\nsteps = 20\n"   # (a review: spelled as psgd spells it, it was replaced)
    (tmp_path / "config.toml").write_text(plain)
    with pytest.raises(ConfigError, match="config.toml is a config file psgd did not write"):
        LocalJob(cfg, str(tmp_path), quiet=True)
    assert (tmp_path / "config.toml").read_text() == plain
    older = "\n".join(line for line in cfg.to_toml().splitlines() if not line.startswith("n_fetch"))
    (tmp_path / "config.toml").write_text(older)   # an earlier psgd's, without a key added since
    job = LocalJob(cfg, str(tmp_path), quiet=True)
    try:
        assert (tmp_path / "config.toml").read_text() == job.cfg.to_toml()
    finally:
        job.stop()


@pytest.mark.timeout(30)
def test_a_job_refused_for_a_port_in_use_leaves_no_folder_behind(tmp_path, port_block):
    """A review: each `psgd run` refused before it began (a port in use) left an empty
    run folder with a logs/ folder in it (runs/sync-DATE/logs), one more each retry."""

    from psgd.launcher import LaunchError
    base = port_block(3)
    cfg = load(None, [f"cluster.port={base}", "cluster.servers=1", "cluster.workers=1"], env={})
    out = tmp_path / "runs" / "sync-1"
    with listening_on(base + 1):   # the shard's port
        with pytest.raises(LaunchError, match="is in use"):
            LocalJob(cfg, str(out), quiet=True, port_explicit=True)
    assert os.listdir(tmp_path / "runs") == []


@pytest.mark.timeout(30)
def test_taken_port_names_the_first_of_a_jobs_ports_that_a_program_listens_on(port_block):
    """The Slurm scripts' check before they start a job (`taken_port`): a port another
    socket listens on is named, the coordinator's before the shards'; a port in TIME_WAIT
    or free is not."""

    from psgd.config import load
    from psgd.launcher import bind_error, taken_port
    base = port_block(3)
    cfg = load(None, [f"cluster.port={base}", "cluster.servers=2", "cluster.host=127.0.0.1"], env={})
    assert taken_port(cfg) == 0
    shard = cfg.shard_address(1).rpartition(":")[2]
    with listening_on(int(shard)):
        assert taken_port(cfg) == int(shard)
        assert bind_error("127.0.0.1", int(shard)) is not None
    assert taken_port(cfg) == 0


@pytest.mark.timeout(30)
def test_a_job_refused_for_a_busy_checkpoint_dir_leaves_no_folder_behind(tmp_path, port_block):
    """A review: refused for a `checkpoint.dir` another launcher holds, a job let go of
    its own folder's lock before it could take it back: the run folder stayed, with the
    lock file in it."""
    from psgd.launcher import LOCK_FILE, LaunchError, hold
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    other = hold(str(ckpt / LOCK_FILE))
    try:
        cfg = load(None, [f"cluster.port={port_block(3)}", "cluster.servers=1", "cluster.workers=1",
                          f"checkpoint.dir={ckpt}"], env={})
        with pytest.raises(LaunchError, match="holds the shard checkpoints of a job that is still running"):
            LocalJob(cfg, str(tmp_path / "runs" / "sync-1"), quiet=True)
        assert os.listdir(tmp_path / "runs") == []
    finally:
        other.close()


@pytest.mark.timeout(30)
def test_a_lock_file_removed_by_its_holder_is_not_held_by_one_who_opened_it_before(tmp_path, monkeypatch):
    """A review: launcher B opened OUT/.launcher.lock while A held it; A, refused, removed
    the file it had made and let go; B's lock then succeeded on the removed file, and a
    third launcher made a new one and held it too: two jobs in one folder. `hold` locks the
    file that is at the path once it has the lock."""
    from psgd import launcher
    path = str(tmp_path / "lock")
    a = launcher.hold(path)
    early = os.open(path, os.O_RDWR)   # B's open, before A's removal
    os.unlink(path)
    a.close()
    real, calls = os.open, []
    monkeypatch.setattr(launcher.os, "open", lambda *args, **kw: calls.append(1) or (
        early if len(calls) == 1 else real(*args, **kw)))
    b = launcher.hold(path)
    assert b is not None and len(calls) == 2   # let go of the removed file, locked the one at the path
    assert os.fstat(b.fileno()).st_ino == os.stat(path).st_ino
    monkeypatch.undo()
    assert launcher.hold(path) is None   # C is refused
    b.close()


@pytest.mark.timeout(30)
def test_a_quiet_job_says_the_coordinators_warnings_once_each(capsys, monkeypatch):
    """A review: with --quiet (and in every run of psgd compare) the coordinator's warnings
    (shards that did not resume, or hold nothing; scripts that closed before the budget)
    went to its log only, while the terminal said "resuming". A quiet job says them once
    the coordinator ends, each once per process (psgd compare's runs say the same)."""
    from types import SimpleNamespace

    import psgd.launcher as launcher
    monkeypatch.setattr(launcher, "_warned", set())
    log = ("[psgd coordinator] all 2 workers registered; training\n"
           "[psgd coordinator] warning: shard 1 did not resume from its checkpoint (x): the job starts afresh\n"
           "[psgd coordinator] sync     2.0 s  step 630/100000\n")
    job = SimpleNamespace(tail=lambda child, n: log)
    for _ in range(2):
        LocalJob._say_warnings(job, None)
    assert capsys.readouterr().err == ("[psgd coordinator] warning: shard 1 did not resume from its checkpoint (x): "
                                       "the job starts afresh\n")
