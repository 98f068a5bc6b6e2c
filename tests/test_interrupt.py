"""Stopping psgd's commands as a user does: Ctrl-C (SIGINT to the process group, as a
terminal sends it), SIGTERM, SIGHUP, at the moments a command is in (its work done and
the interpreter exiting, say). Every test starts its processes in a session of their own
and kills what is left of it."""
from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable

import pytest

from tests.conftest import free_port_block, processes_with

ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}, "OMP_NUM_THREADS": "1"}


def session(pid: int) -> list[int]:
    """The processes of the session that `pid` leads (what a terminal's job left)."""
    return sorted(processes_with(3, pid))


def start(argv: list[str], **kw) -> subprocess.Popen:
    """A command in a session of its own, with Ctrl-C's and a hang-up's default actions as
    a shell's foreground job has them."""
    return subprocess.Popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=defaults, **kw)


def defaults() -> None:
    for s in (signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)


def end_session(proc: subprocess.Popen) -> None:
    """Kill whatever is left of the session (test clean-up), and reap its leader."""
    for pid in session(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


# A psgd command whose work is done while a thread of it still runs: the interpreter's exit
# (threading._shutdown) waits for that thread, and a signal comes meanwhile.
LINGERS = """
import sys, threading, time
from psgd import cli
marker = sys.argv[1]

def linger():
    while threading.main_thread().is_alive():
        time.sleep(0.01)
    open(marker, "w").close()   # main has returned: the interpreter is exiting
    time.sleep(60)

def done(args):
    threading.Thread(target=linger).start()
    return 0

cli.cmd_run = cli.cmd_daemon = cli.cmd_simulate = done
if sys.argv[2].startswith("psgd."):   # a module's own entry: python -m psgd.simulate
    import runpy
    sys.argv = [sys.argv[2]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
sys.argv = ["psgd", sys.argv[2]]
raise SystemExit(cli.main())
"""


@pytest.mark.processes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("verb,sig", [("worker", signal.SIGTERM), ("coordinator", signal.SIGINT),
                                      ("worker", signal.SIGHUP), ("run", signal.SIGTERM), ("run", signal.SIGINT),
                                      ("psgd.simulate", signal.SIGTERM)])
def test_a_signal_while_a_command_exits_stops_it_without_a_traceback(tmp_path, verb, sig):
    """SIGTERM to the process group at the end of a `psgd run` job reached the coordinator
    after its serve() had returned, while the interpreter exited: its handler raised there
    and the terminal showed a traceback from threading._shutdown. A command whose work is
    done now ends at once on Ctrl-C or SIGTERM, quietly."""
    marker = tmp_path / "exiting"
    proc = start([sys.executable, "-c", LINGERS, str(marker), verb])
    try:
        deadline = time.monotonic() + 40
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), "the command did not get to its exit"
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=20)
    finally:
        end_session(proc)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert proc.returncode in (-sig, 128 + sig), (proc.returncode, err)


# A psgd command that prints its last line (to a pipe: into Python's buffer) and returns;
# a signal comes at once, before the interpreter's exit flushes that buffer.
PRINTS = """
import os, signal, sys
from psgd import cli

def done(args):
    print("its summary")
    return 0

cli.cmd_run = done
sys.argv = ["psgd", "run"]
code = cli.main()
os.kill(os.getpid(), signal.SIGTERM)
raise SystemExit(code)
"""


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_signal_as_a_command_returns_leaves_its_output_written():
    """Ctrl-C, SIGTERM and SIGHUP end a command whose work is done at once (their default
    action): its output to a file or a pipe, still in Python's buffer, was lost with it
    (psgd run's summary line). It is written before."""
    proc = subprocess.Popen([sys.executable, "-c", PRINTS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env={k: v for k, v in ENV.items() if k != "PYTHONUNBUFFERED"})   # (buffered)
    try:
        out, err = proc.communicate(timeout=40)
    finally:
        end_session(proc)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, err)
    assert out == "its summary\n", err


# A psgd command with a thread still running (a daemon's heartbeat) that gets SIGTERM while
# its exit flushes its output: the thread, not the main one, takes it.
FLUSHES = """
import os, signal, sys, threading, time
from psgd import cli

class Stderr:
    def write(self, text):
        return len(text)

    def flush(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        os.write(1, b"flushed")

def done(args):
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    sys.stderr = Stderr()
    return 0

cli.cmd_run = done
sys.argv = ["psgd", "run"]
raise SystemExit(cli.main())
"""


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_signal_during_the_exits_flush_waits_for_it_in_any_thread():
    """A signal during the flush at a command's end waits for its end, then has its default
    action, also where another thread of the process took it (the main one had it blocked):
    its handler, run in the main thread, would raise there."""
    proc = start([sys.executable, "-c", FLUSHES])
    try:
        out, err = proc.communicate(timeout=40)
    finally:
        end_session(proc)
    assert "Traceback" not in err, err
    assert proc.returncode == -signal.SIGTERM and out == "flushed", (proc.returncode, out, err)


def pids_when_training(out, proc: subprocess.Popen, names: set[str], seconds: float = 120,
                       tick=lambda: None) -> dict[str, int]:
    """The daemons' pids (their pid files) once they all run and worker 0 has logged a
    step; `tick()` meanwhile, every 0.2 s."""
    pids: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None and not (
            names <= set(pids) and (out / "events" / "worker-0.jsonl").exists()):
        if (out / "pids").is_dir():
            for f in (out / "pids").iterdir():
                with contextlib.suppress(OSError, ValueError):   # being written
                    pids[f.name] = int(f.read_text())
        tick()
        time.sleep(0.2)
    assert names <= set(pids) and (out / "events" / "worker-0.jsonl").exists(), pids
    return pids


def gone(pids, seconds: float = 10) -> list[int]:
    """Those of `pids` still running after up to `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.1)
    return [p for p in pids if os.path.exists(f"/proc/{p}")]


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_closing_the_terminal_of_psgd_run_stops_the_job_as_sigterm_does(tmp_path):
    """A terminal that closes sends SIGHUP to its session's leader (here `psgd run`; else
    the shell), and a shell sends one to each job's process group (bash: `psgd run` and
    every daemon, the fork server too). Its default action killed them all at once: no
    shard checkpointed, every pid file stayed, and the exit code was a signal's. Now the
    job stops as on SIGTERM: the shards checkpoint, the pid files go, psgd run exits 129
    (its last lines, to a terminal that is gone, are dropped, not a failure of their
    own)."""
    out = tmp_path / "run"
    master, slave = os.openpty()

    def terminal() -> None:   # (after setsid: the terminal becomes the new session's)
        defaults()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    proc = subprocess.Popen([sys.executable, "-m", "psgd", "run", "--out", str(out), "--set", "train.steps=100000",
                             "--set", f"cluster.port={free_port_block(3)}"], env=ENV, stdin=slave, stdout=slave,
                            stderr=slave, start_new_session=True, preexec_fn=terminal)
    os.close(slave)
    os.set_blocking(master, False)
    pids: dict[str, int] = {}
    try:
        pids = pids_when_training(out, proc, {"server-0.pid", "server-1.pid", "worker-0.pid", "coordinator-0.pid"},
                                  tick=lambda: _drain(master))   # a terminal shows what it is sent
        os.close(master)   # the terminal closes: SIGHUP to psgd run, the session's leader
        master = -1
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGHUP)   # and to its job's group, as a shell sends it
        assert proc.wait(timeout=60) == 129
        assert not gone(pids.values())
        assert not session(proc.pid)
        assert sorted(os.listdir(out / "pids")) == []
        assert sorted(os.listdir(out / "checkpoints")) == ["shard-0.pt", "shard-1.pt"]
    finally:
        if master >= 0:
            os.close(master)
        for p in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        end_session(proc)


def _drain(fd: int) -> None:
    """Read what there is to read (a terminal's screen): a full one would block its writers."""
    with contextlib.suppress(OSError):   # (BlockingIOError: nothing more now)
        while os.read(fd, 1 << 16):
            pass


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_hang_up_while_the_daemons_stop_is_held(monkeypatch):
    """A terminal that closes while `psgd run` stops its daemons (after a Ctrl-C) does not
    cut the stop short, as a second Ctrl-C or SIGTERM does not. It was ignored: the
    command's last lines then failed on the dead terminal (EIO: exit 1, a traceback). Its
    stdout and stderr now go to /dev/null at once, and the hang-up is delivered, to the
    handler that was there, once the hold ends."""
    from psgd import cli
    from psgd.launcher import signals_held
    master, slave = os.openpty()
    monkeypatch.setattr(cli, "_TERMINALS", [slave])
    hits: list[int] = []
    before = signal.signal(signal.SIGHUP, lambda n, f: hits.append(n))
    try:
        os.close(master)   # the terminal closes
        with signals_held():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.1)
            assert hits == []
            assert os.readlink(f"/proc/self/fd/{slave}") == os.devnull
        assert hits == [signal.SIGHUP]
    finally:
        signal.signal(signal.SIGHUP, before)
        os.close(slave)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_signal_while_the_daemons_stop_is_delivered_after_the_stop():
    """Ctrl-C or SIGTERM during the stop waits for its end, then comes (the first one
    only), as it would have then; none comes out of a hold that an exception leaves (the
    command is stopping already)."""
    from psgd.launcher import signals_held
    hits: list[int] = []
    before = {s: signal.signal(s, lambda n, f: hits.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            assert hits == []
        assert hits == [signal.SIGTERM]
        with pytest.raises(ValueError), signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            raise ValueError
        time.sleep(0.1)
        assert hits == [signal.SIGTERM]
    finally:
        for s, h in before.items():
            signal.signal(s, h)


SUMMARY = {"mode": "sync", "final_accuracy": 0.97, "final_loss": 0.1, "samples_per_s": 100.0, "wall_s": 1.0,
           "time_to_target_s": 0.5, "target_accuracy": 0.9, "staleness": {"mean": 0.0, "max": 0, "hist": {}},
           "evals": []}


class Script:
    """A training script's process as the launcher sees it: exited with `code`."""

    def __init__(self, code: int | None):
        self.code, self.pid = code, 0

    def poll(self) -> int | None:
        return self.code

    def terminate(self) -> None:
        pass

    def send_signal(self, sig: int) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int | None:
        return self.code


def run_then_signal(monkeypatch, tmp_path, capsys, summary: dict | None, scripts: list[int | None],
                    sig: Callable[[], BaseException] | None = KeyboardInterrupt,
                    during_stop: int | None = None) -> tuple[int, str, str]:
    """`psgd run`, whose job writes `summary` (None: none), has training scripts that
    exited with `scripts`' codes, and then gets `sig` while the launcher waits (the
    coordinator's linger after the summary, say; a LaunchError: the job failed; None: it
    ended), and the signal
    `during_stop` while its daemons are stopped: main's exit code, stdout, stderr."""
    import json

    from psgd import cli, launcher
    from psgd.launcher import Child, LocalJob

    def start(job: LocalJob) -> None:
        job.children = [Child("worker", r, [], proc=Script(code), script=True) for r, code in enumerate(scripts)]

    def wait(job: LocalJob) -> dict:
        if summary is not None:
            (tmp_path / "out" / "summary.json").write_text(json.dumps(summary))
        if sig is None:
            return summary or {}
        raise sig()
    stop, sent = LocalJob.stop, []

    def stop_with_a_signal(job: LocalJob) -> None:
        if during_stop is not None and not sent:
            sent.append(during_stop)
            os.kill(os.getpid(), during_stop)
            time.sleep(0.1)
        stop(job)
    monkeypatch.setattr(LocalJob, "start", start)
    monkeypatch.setattr(LocalJob, "wait", wait)
    monkeypatch.setattr(LocalJob, "stop", stop_with_a_signal)
    monkeypatch.setattr(launcher, "check_before_launch", lambda cfg, device: None)
    monkeypatch.setattr(cli, "check_job", lambda cfg: 10 ** 6)   # (the training set's size)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGHUP, signal.SIG_DFL)   # (under nohup, as a CI may run, it is ignored: psgd run keeps it so)
    try:
        code = cli.main(["run", "--out", str(tmp_path / "out"), "--quiet", "--set",
                         f"cluster.port={free_port_block(3)}"])
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_signal_after_the_job_ended_reports_the_finished_job(monkeypatch, tmp_path, capsys):
    """Ctrl-C just after the job's summary.json and model.pt were written (the coordinator
    still telling the daemons the job was done) made psgd run say "interrupted" and exit
    130 without the summary line, although the job was complete (`psgd status` said
    "finished"). It now prints the summary, as for a job not interrupted, notes the
    signal, and exits 0; SIGTERM too."""
    from psgd.cli import Terminated
    for sig in (KeyboardInterrupt, Terminated):
        code, out, err = run_then_signal(monkeypatch, tmp_path, capsys, SUMMARY, [], sig)
        assert code == 0, err
        assert "sync: accuracy 0.9700" in out and f"summary: {tmp_path}/out/summary.json" in out, out
        assert "after the job had ended; its outputs are complete" in err and "Traceback" not in err, err


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_signal_before_the_end_or_while_a_script_works_on_is_an_interrupt(monkeypatch, tmp_path, capsys):
    """No summary yet, or a training script still at its work after close() (stopped by
    the signal): the run was interrupted (130), and no summary line is printed. A
    script's job whose scripts had all ended with 0 had ended."""
    for summary, scripts in ((None, []), (SUMMARY, [0, -2]), (SUMMARY, [0, None])):
        code, out, err = run_then_signal(monkeypatch, tmp_path, capsys, summary, scripts)
        assert code == 130 and out == "" and "psgd run: interrupted; its daemons are stopped" in err, (code, err)
    code, out, err = run_then_signal(monkeypatch, tmp_path, capsys, SUMMARY, [0, 0])
    assert code == 0 and "sync: accuracy 0.9700" in out, err


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_signal_after_an_aborted_job_ended_says_why_it_was_aborted(monkeypatch, tmp_path, capsys):
    """An aborted job's end is its error (exit 1, the reason), signal or none. run_local
    still raises the signal (psgd compare, its other caller, stops on it)."""
    from psgd.config import load
    from psgd.launcher import LaunchError, ended_before, run_local
    aborted = {**SUMMARY, "aborted": "shard 0 was lost"}
    code, out, err = run_then_signal(monkeypatch, tmp_path, capsys, aborted, [])
    assert code == 1 and "psgd: error: job aborted: shard 0 was lost" in err and out == "", err
    with pytest.raises(KeyboardInterrupt) as e:
        run_local(load(None, [f"cluster.port={free_port_block(3)}"], env={}), str(tmp_path / "out"), quiet=True)
    assert isinstance(ended_before(e.value), LaunchError)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_signal_while_the_daemons_of_an_ended_job_stop_is_noted(monkeypatch, tmp_path, capsys):
    """SIGTERM while the daemons of a job that had ended were stopped was ignored: psgd
    run printed the summary with nothing said. It is now noted, as one that comes a
    moment earlier, and the job reported (exit 0)."""
    code, out, err = run_then_signal(monkeypatch, tmp_path, capsys, SUMMARY, [], None, signal.SIGTERM)
    assert code == 0 and "sync: accuracy 0.9700" in out, err
    assert "psgd run: terminated after the job had ended; its outputs are complete" in err, err
    from psgd.launcher import LaunchError
    code, out, err = run_then_signal(monkeypatch, tmp_path, capsys, None, [],
                                     lambda: LaunchError("job aborted: shard 0 was lost"), signal.SIGTERM)
    assert code == 1 and "psgd: error: job aborted: shard 0 was lost" in err and out == "", err


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_hang_up_while_an_interrupted_job_stops_ends_the_run_with_129(monkeypatch, tmp_path, capsys):
    """A hang-up (the terminal closed) while the daemons stopped after a Ctrl-C was thrown
    away: psgd run's last lines then failed on the dead terminal (exit 1, a traceback).
    It now comes once they are stopped: exit 129, as for a hang-up that came first."""
    code, out, err = run_then_signal(monkeypatch, tmp_path, capsys, None, [], KeyboardInterrupt, signal.SIGHUP)
    assert code == 129 and "psgd run: hung up (SIGHUP); its daemons are stopped" in err, (code, err)
    assert "Traceback" not in err, err


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_second_ctrl_c_before_the_stop_holds_signals_still_stops_the_daemons(monkeypatch, tmp_path, capsys):
    """A helper: under GNU timeout a Ctrl-C reached psgd run two or three times within
    microseconds. One that came after the first's KeyboardInterrupt, before the stop held
    signals, skipped the stop: psgd run said "its daemons are stopped" (8 times in 40)
    while they wrote their checkpoints after it, the resume note missing and the job's
    token left. (The second comes here where it can: in the scripts' wait, before it.)"""
    from psgd.launcher import LocalJob
    stopped = []
    real_stop = LocalJob.stop
    monkeypatch.setattr(LocalJob, "let_scripts_leave", lambda job: (_ for _ in ()).throw(KeyboardInterrupt()))
    monkeypatch.setattr(LocalJob, "stop", lambda job: stopped.append(1) or real_stop(job))
    code, out, err = run_then_signal(monkeypatch, tmp_path, capsys, None, [], KeyboardInterrupt)
    assert code == 130 and "psgd run: interrupted; its daemons are stopped" in err, (code, err)
    assert stopped == [1] and not (tmp_path / "out" / ".job-token").exists()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_signal_while_the_fork_server_stops_is_noted_and_the_code_kept(monkeypatch, tmp_path, capsys):
    """Ctrl-C or SIGTERM while psgd run stops its fork server, at its very end (its summary
    printed, or its error, or its interrupt), exited 143 with nothing said, where one a
    moment earlier, while its daemons stopped, was noted and the job's code kept. It waits
    for that stop, is noted in one line, and the command exits with its own code."""
    from psgd import forkserver
    from psgd.launcher import LaunchError
    monkeypatch.setattr(forkserver, "shutdown", lambda: os.kill(os.getpid(), signal.SIGTERM))
    for summary, sig, want in ((SUMMARY, None, 0), (None, lambda: LaunchError("job aborted: shard 0 was lost"), 1),
                               (None, KeyboardInterrupt, 130)):
        code, out, err = run_then_signal(monkeypatch, tmp_path, capsys, summary, [], sig)
        assert code == want, (code, err)
        assert ("sync: accuracy 0.9700" in out) == (want == 0), out
        assert err.count(f"psgd run: terminated while it exited; its exit code stands ({want})") == 1, err
        assert "Traceback" not in err, err


# A daemon forked by the fork server (psgd/forkserver.py), run as the server runs one
# (_fork, _child, cli.main) with its work stubbed, which gets a signal at its end: while
# main flushes its output ("flush"), or once main has returned ("after").
FORKED = """
import os, signal, sys
from psgd import cli, forkserver
marker, when, sig = sys.argv[1], sys.argv[2], int(sys.argv[3])

class Stderr:
    def write(self, text):
        return len(text)

    def flush(self):
        os.kill(os.getpid(), sig)

def done(args):
    if when == "flush":
        sys.stderr = Stderr()
    return 0

real_main = cli.main

def main(*args, **kw):
    code = real_main(*args, **kw)
    if when == "after":
        os.kill(os.getpid(), sig)
    return code

cli.cmd_daemon, cli.main = done, main
server = os.getpid()
try:
    pid = forkserver._fork({"argv": ["worker"], "env": dict(os.environ)})
finally:
    if os.getpid() != server:
        open(marker, "w").close()   # the fork ran on in the server's code
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.processes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("when,sig", [("flush", signal.SIGTERM), ("after", signal.SIGTERM),
                                      ("after", signal.SIGINT), ("after", signal.SIGHUP)])
def test_a_signal_as_a_forked_daemon_exits_leaves_its_exit_code(tmp_path, when, sig):
    """A forked daemon's end ran with its handlers in place: a late SIGTERM raised
    SystemExit past os._exit, and the child went on in the fork server's own code (its
    loop: a second server reading the launcher's requests). Then its main set their
    default actions before the fork's end: one just after main (or during its flush)
    killed the daemon by the signal, not with its exit code. From main's end on, the
    signals wait, and go with the process: the daemon exits with its own code."""
    marker = tmp_path / "ran-on"
    proc = start([sys.executable, "-c", FORKED, str(marker), when, str(int(sig))])
    try:
        out, err = proc.communicate(timeout=40)
    finally:
        end_session(proc)
    assert not marker.exists(), err
    assert proc.returncode == 0 and out == "0\n", (proc.returncode, out, err)


# A psgd command whose terminal hangs up, with no SIGHUP (it is no session's terminal):
# its next line fails (EIO).
WRITES = """
import os, sys, time
from psgd import cli
ready, closed = sys.argv[1], sys.argv[2]

def run(args):
    open(ready, "w").close()
    while not os.path.exists(closed):
        time.sleep(0.01)
    print("its summary", flush=True)
    return 0

cli.cmd_run = run
sys.argv = ["psgd", "run"]
raise SystemExit(cli.main())
"""


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_a_write_to_a_hung_up_terminal_ends_the_command_as_a_hang_up(tmp_path):
    """A line written to the terminal after it hung up, before the hang-up's handler ran
    (or with none sent), failed with EIO: the error said so to the same dead terminal,
    which failed again (exit 1, a traceback). The command now ends as on a hang-up: 129,
    its output to /dev/null."""
    ready, closed = tmp_path / "ready", tmp_path / "closed"
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-c", WRITES, str(ready), str(closed)], env=ENV,
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    os.set_blocking(master, False)
    try:
        deadline = time.monotonic() + 40
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            _drain(master)
            time.sleep(0.02)
        assert ready.exists()
        _drain(master)
        os.close(master)   # the terminal hangs up
        master = -1
        closed.touch()
        assert proc.wait(timeout=30) == 129
    finally:
        if master >= 0:
            os.close(master)
        end_session(proc)


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_a_command_called_from_python_leaves_its_callers_signals_and_terminal(monkeypatch):
    """cli.main([...]) called from Python (a test, a notebook) left its SIGTERM and SIGHUP
    handlers in the caller's process (a later SIGTERM raised Terminated there), and took
    the caller's terminal for its own (a hang-up sent the caller's output to /dev/null).
    Its handlers are the command's only while it runs; the terminal is a process's own
    command's (`psgd`, `python -m psgd`, `python -m psgd.simulate`)."""
    from psgd import cli
    seen: list[list[int]] = []

    def simulate(args) -> int:
        seen.append(list(cli._TERMINALS))
        assert signal.getsignal(signal.SIGTERM) is cli._terminate
        return 0
    monkeypatch.setattr(cli, "cmd_simulate", simulate)
    monkeypatch.setattr(os, "isatty", lambda fd: True)

    def mine(n, f):
        pass
    before = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        assert cli.main(["simulate"]) == 0
        assert {s: signal.getsignal(s) for s in before} == {s: mine for s in before}
        assert seen == [[]]
    finally:
        for s, h in before.items():
            signal.signal(s, h)


KEEPS_MASK = """
import signal
from psgd import cli
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGHUP])   # blocked by whoever started it
signal.signal(signal.SIGTERM, lambda *a: None)               # a command's handler
cli.exit_on_signals()
print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))
"""


@pytest.mark.processes
@pytest.mark.timeout(60)
def test_the_exits_signal_handling_leaves_a_signal_blocked_before_the_command_blocked():
    """A review: the exit's handling blocked SIGINT, SIGTERM and SIGHUP, then unblocked all
    three, also one the process had been started with blocked."""
    got = subprocess.run([sys.executable, "-c", KEEPS_MASK], env=ENV, capture_output=True, text=True, timeout=40)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == str([int(signal.SIGHUP)]), got.stdout


SCRIPT_SAVES_ON_CTRL_C = """
import os, sys, time, torch, psgd
from torch import nn
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
try:
    with psgd.connect(model) as ps:
        while True:
            model.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(16, 4)), torch.randint(0, 2, (16,))).backward()
            if not ps.step(samples=16):
                break
except KeyboardInterrupt:
    time.sleep(float(sys.argv[2]))   # its own save of what it trained
    with open(os.path.join(sys.argv[1], f"saved-{os.environ['PSGD_RANK']}.txt"), "w") as f:
        f.write("saved")
    raise
"""


def script_job(tmp_path, save_s: float) -> tuple[subprocess.Popen, object]:
    """`psgd run --script` of SCRIPT_SAVES_ON_CTRL_C (2 workers, 1 shard), training; its out folder."""
    script, out = tmp_path / "saves.py", tmp_path / "run"
    script.write_text(SCRIPT_SAVES_ON_CTRL_C)
    proc = start([sys.executable, "-m", "psgd", "run", "--script", str(script), "--out", str(out), "--quiet",
                  "--set", "cluster.workers=2", "--set", "cluster.servers=1", "--set", "train.steps=1000000",
                  "--set", f"cluster.port={free_port_block(3)}", "--", str(tmp_path), str(save_s)])
    try:
        pids_when_training(out, proc, {"server-0.pid", "worker-0.pid", "worker-1.pid", "coordinator-0.pid"})
    except BaseException:
        end_session(proc)
        raise
    return proc, out


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_a_ctrl_c_lets_the_training_scripts_leave_the_job_and_run_their_own_handlers(tmp_path):
    """A review: on a Ctrl-C psgd run SIGTERMed its training scripts at once, though they
    had the Ctrl-C too: a script's own `except KeyboardInterrupt` (a save) never ran, nor
    psgd.connect's leaving of the job that the README promises. The scripts now get
    SCRIPT_LEAVE_S to exit by themselves, the daemons still up, before the stop."""
    proc, out = script_job(tmp_path, 1.0)
    try:
        os.killpg(proc.pid, signal.SIGINT)   # a terminal's Ctrl-C: to psgd run, its daemons and its scripts
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "waiting up to 10 s for the training scripts to leave the job on their Ctrl-C" in err
        assert sorted(p.name for p in tmp_path.glob("saved-*.txt")) == ["saved-0.txt", "saved-1.txt"], err
        for r in range(2):
            assert "this worker left the job" in (out / "logs" / f"worker-{r}.log").read_text()
        assert not session(proc.pid)
    finally:
        end_session(proc)


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_another_ctrl_c_stops_the_training_scripts_at_once(tmp_path):
    """A review: the wait for the scripts ran with the signals held, so a second and a
    third Ctrl-C did not cut it short (10 s). Another signal now ends the wait, and the
    job stops as on one (exit 130)."""
    proc, out = script_job(tmp_path, 60.0)   # (a save that would outlast the wait)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(2.0)
        os.kill(proc.pid, signal.SIGINT)   # another Ctrl-C, to psgd run
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "stopping the training scripts now" in err and not list(tmp_path.glob("saved-*.txt")), err
        assert not session(proc.pid)
    finally:
        end_session(proc)
