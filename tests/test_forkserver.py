"""psgd/forkserver.py: the daemons forked from one process that has imported torch
behave as `python -m psgd ROLE` would: their exit codes (signals negative), their
stderr in their log, their own environment; `psgd run` forks its shards, workers and
evaluator from it, and falls back to separate interpreters when it cannot start."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from psgd import forkserver
from psgd.config import load
from psgd.launcher import LocalJob
from tests.conftest import free_port_block

pytestmark = pytest.mark.processes

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def server():
    s = forkserver.server(ENV)
    assert s is not None
    return s


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(120)
def test_exit_code_and_stderr_go_where_the_launcher_looks(server, tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("before\n")
    child = server.spawn(["worker", str(tmp_path / "missing.toml")], ENV, str(log))
    assert child.wait(timeout=60) == 2
    error = f"psgd: error: config file {tmp_path}/missing.toml does not exist"
    assert log.read_text().splitlines() == ["before", error]


@pytest.mark.timeout(120)
def test_signals_reach_the_child_and_its_code_says_which(server, tmp_path):
    port = free_port_block(1)
    env = {**ENV, "PSGD_CLUSTER_TIMEOUT_S": "100"}  # its own environment: waits for a coordinator that never comes
    # Ctrl-C: psgd's KeyboardInterrupt exit, as in its own interpreter; where this test runs with SIGINT
    # ignored (the background of a shell without job control), the server and its daemons inherit that.
    ctrl_c = None if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else 130
    # SIGTERM: a daemon exits 143 through its finally blocks (psgd/cli.py `_exit_on_term`).
    cases = ((signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, ctrl_c))
    for sig, code in cases:
        started = tmp_path / f"{sig}.started"
        child = server.spawn(["worker", "--set", f"cluster.port={port}", "--started-file", str(started)], env,
                             str(tmp_path / "w.log"))
        end = time.monotonic() + 60
        while not started.exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert parent_of(child.pid) == server.pid
        child.send_signal(sig)
        if code is None:  # ignored: it goes on waiting
            with pytest.raises(subprocess.TimeoutExpired):
                child.wait(timeout=2)
            child.kill()
            code = -signal.SIGKILL
        assert child.wait(timeout=30) == code
        assert child.poll() == code
        child.kill()  # ended: no signal is sent to a pid that may be reused


@pytest.mark.timeout(240)
def test_psgd_run_forks_every_daemon_but_the_coordinator(tmp_path):
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "train.steps=60"], env={})
    job = LocalJob(cfg, str(tmp_path), quiet=True, timeout_s=200)
    try:
        job.start()
        kinds = {c.name: type(c.proc).__name__ for c in job.children}
        summary = job.wait()
    finally:
        job.stop()
    assert kinds == {"coordinator-0": "Popen", "server-0": "Forked", "server-1": "Forked", "worker-0": "Forked",
                     "worker-1": "Forked", "evaluator-0": "Forked"}
    assert summary["samples"] == 2 * 60 * 32 and summary["final_accuracy"] > 0.5, summary
    assert all(c.poll() == 0 for c in job.children), [(c.name, c.poll()) for c in job.children]


@pytest.mark.timeout(240)
def test_without_a_fork_server_each_daemon_is_its_own_interpreter(tmp_path):
    cfg = load(None, [f"cluster.port={free_port_block(3)}", "train.steps=20", "cluster.evaluator=false",
                      "cluster.fork=false"], env={})
    job = LocalJob(cfg, str(tmp_path), quiet=True, timeout_s=200)
    try:
        job.start()
        assert {type(c.proc).__name__ for c in job.children} == {"Popen"}
        assert job.wait()["samples"] == 2 * 20 * 32
    finally:
        job.stop()


@pytest.mark.timeout(120)
def test_a_forked_daemon_imports_from_its_own_folder_and_pythonpath(server, tmp_path):
    """A model factory of the user's is found as a new interpreter would find it: from
    the folder psgd run was started in, or from the job's PYTHONPATH."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "usermodels.py").write_text("raise SystemExit(7)\n")  # imported: the daemon exits 7
    env = {**ENV, "PYTHONPATH": str(lib)}
    child = server.spawn(["worker", "--set", "model.name=usermodels:net", "--set", "cluster.timeout_s=5"], env,
                         str(tmp_path / "w.log"))
    assert child.wait(timeout=60) == 7, (tmp_path / "w.log").read_text()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("forked", [True, False], ids=["forked", "own interpreter"])
def test_a_daemon_freezes_what_it_imported(server, tmp_path, forked):
    """gc.freeze() once a daemon has loaded its code (psgd/cli.py `_started`): its full
    collections skip torch's objects (each took 0.13-0.14 s in a worker mid-run), and a
    forked one does not write to the pages it shares with the server."""
    lib = tmp_path / "lib"
    lib.mkdir()
    # (and collects: the fork server preloads with the collector off, and turns it on again)
    (lib / "frozen.py").write_text("import gc\nraise SystemExit(7 if gc.get_freeze_count() > 50000 and gc.isenabled() "
                                   "else 8)\n")
    argv = ["worker", "--set", "model.name=frozen:net", "--set", "cluster.timeout_s=5"]
    env, log = {**ENV, "PYTHONPATH": str(lib)}, tmp_path / "w.log"
    if forked:
        code = server.spawn(argv, env, str(log)).wait(timeout=60)
    else:
        with open(log, "w") as f:
            code = subprocess.run([sys.executable, "-m", "psgd", *argv], env=env, stderr=f, timeout=60).returncode
    assert code == 7, log.read_text()


@pytest.mark.timeout(120)
def test_a_daemon_that_ended_with_its_fork_server_is_said_so(tmp_path):
    """Its exit code went with the server; the launcher said "exited with -9"."""
    from psgd.launcher import Child, _exit
    own = forkserver.ForkServer(ENV)   # not the module's: this one is killed
    try:
        started = tmp_path / "w.started"
        env = {**ENV, "PSGD_CLUSTER_TIMEOUT_S": "100"}   # waits for a coordinator that never comes
        proc = own.spawn(["worker", "--set", f"cluster.port={free_port_block(1)}", "--started-file", str(started)],
                         env, str(tmp_path / "w.log"))
        end = time.monotonic() + 60
        while not started.exists() and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(own.pid, signal.SIGKILL)
        own.proc.wait(timeout=10)
        rc = proc.wait(timeout=30)           # it got SIGTERM as its parent died (PR_SET_PDEATHSIG)
    finally:
        own.close()
    assert proc.code_lost
    said = _exit(Child("worker", 0, [], proc=proc), rc)
    assert said == "an unknown code: the fork server that started it ended (exit -9 (SIGKILL)), and it with it"


@pytest.mark.timeout(60)
def test_a_fork_server_interrupted_while_it_starts_is_ended_with_it(monkeypatch):
    """A review: Ctrl-C or SIGTERM to `psgd run` while its fork server imported torch left
    that process running on its own, after the command had ended ("the process that started
    this one (PID) is gone", printed into the terminal later)."""
    from tests.conftest import children

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(forkserver.ForkServer, "_next", interrupted)
    before = children(os.getpid())
    with pytest.raises(KeyboardInterrupt):
        forkserver.ForkServer(ENV)
    assert children(os.getpid()) - before == set()


@pytest.mark.timeout(120)
def test_a_fork_server_that_died_before_a_daemon_is_started_is_one_error(tmp_path, monkeypatch):
    """A review: a fork server that died between the job's start and a daemon's (killed,
    say) raised ForkServerError, or BrokenPipeError, through `psgd run` as a traceback; it
    is a LaunchError, which `psgd run` prints in one line and exits 1."""
    from psgd.launcher import LaunchError
    own = forkserver.ForkServer(ENV)   # not the module's: this one is killed
    os.kill(own.pid, signal.SIGKILL)
    own.proc.wait(timeout=10)
    monkeypatch.setattr(forkserver, "server", lambda env: own)
    cfg = load(None, [f"cluster.port={free_port_block(3)}"], env={})
    job = LocalJob(cfg, str(tmp_path), quiet=True)
    try:
        with pytest.raises(LaunchError, match=r"could not start server-0: the fork server exited with -9"):
            job._start(job._spec("server", 0, "--shard", "0"))
    finally:
        job.stop()
        own.close()


@pytest.mark.timeout(60)
def test_a_fork_server_whose_launcher_is_gone_before_it_starts_ends_silently():
    """CI: SIGTERM to `psgd run` while it was starting its fork server (inside Popen, before
    the server's start could be undone) left that process to find its launcher gone; it said
    "psgd: the process that started this one (PID) is gone" into the terminal, after the
    command had ended. Nothing waits for it: it ends with nothing on stderr."""
    env = {**ENV, forkserver.PARENT_ENV: "1"}   # not this process's parent: "gone"
    proc = subprocess.run([sys.executable, "-m", "psgd.forkserver"], env=env, stdin=subprocess.PIPE,
                          capture_output=True, text=True, timeout=30)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


@pytest.mark.timeout(30)
def test_a_forks_answer_read_by_another_thread_is_kept_for_the_fork():
    """CI: a thread polling a daemon (`Forked.poll` -> `collect`: test_leaving's watcher)
    read the fork server's pipe while the launcher waited for a restarted evaluator's pid,
    and dropped the answer: "the fork server took more than 30 s to fork", the job failed.
    An answer read by `collect` is kept for `_next`; so is one after the answer wanted."""
    import json as json_
    import os as os_
    import threading
    from types import SimpleNamespace

    from psgd.forkserver import ForkServer
    r, w = os_.pipe()
    os_.set_blocking(r, False)
    fs = ForkServer.__new__(ForkServer)
    fs.proc = SimpleNamespace(poll=lambda: None)
    fs._fd, fs._buf, fs.codes, fs._answers = r, b"", {}, []
    fs._reading, fs._spawning = threading.Lock(), threading.Lock()
    try:
        os_.write(w, b"".join(json_.dumps(m).encode() + b"\n"
                              for m in ({"exit": 7, "code": 1}, {"pid": 42}, {"pid": 43})))
        fs.collect()   # the other thread
        assert fs.codes == {7: 1}
        assert fs._next(lambda m: "pid" in m, 2, "to fork") == {"pid": 42}
        assert fs._next(lambda m: "pid" in m, 2, "to fork") == {"pid": 43}
    finally:
        os_.close(r)
        os_.close(w)


@pytest.mark.timeout(30)
def test_a_reused_pid_is_not_taken_for_ended_and_a_fork_without_an_answer_ends_its_server(monkeypatch):
    """A review: the exit codes the fork server reported were kept for good, so a new
    daemon forked under a pid the kernel reused looked ended at once, with the old
    process's code (a shard restarted beside itself). And a fork whose answer did not come
    in time left that answer queued, to be taken for the next fork's pid: every later
    daemon was supervised under another's pid. A pid's answer clears its old code; a fork
    without an answer ends the server (the next job starts a new one)."""
    import io
    import json as json_
    import threading
    from types import SimpleNamespace

    from psgd.forkserver import ForkServer, ForkServerError
    r, w = os.pipe()
    os.set_blocking(r, False)
    killed: list[bool] = []
    fs = ForkServer.__new__(ForkServer)
    fs.proc = SimpleNamespace(poll=lambda: None, kill=lambda: killed.append(True))
    fs._fd, fs._buf, fs.codes, fs._answers, fs._in = r, b"", {}, [], io.BytesIO()
    fs._reading, fs._spawning = threading.Lock(), threading.Lock()
    try:
        os.write(w, b"".join(json_.dumps(m).encode() + b"\n" for m in ({"exit": 42, "code": 143}, {"pid": 42})))
        fs.collect()
        assert fs.codes == {} and fs._answers == [{"pid": 42}]   # the new process under pid 42 runs
        os.write(w, json_.dumps({"exit": 42, "code": 0}).encode() + b"\n")
        fs.collect()
        assert fs.codes == {42: 0}
        fs._answers.clear()
        monkeypatch.setattr(forkserver, "ANSWER_S", 0.2)
        with pytest.raises(ForkServerError, match="took more than"):
            fs.spawn(["worker", "config.toml"], {}, None)
        assert killed == [True]
    finally:
        os.close(r)
        os.close(w)


ADOPTED = r"""
import ctypes, json, os, signal, sys, time
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0   # PR_SET_CHILD_SUBREAPER: as a container's init
from psgd import forkserver
env, port, started = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
own = forkserver.ForkServer(env)
try:
    proc = own.spawn(["worker", "--set", f"cluster.port={port}", "--started-file", started], env, started + ".log")
    end = time.monotonic() + 60
    while not os.path.exists(started) and time.monotonic() < end:
        time.sleep(0.05)
    os.kill(own.pid, signal.SIGKILL)
    own.proc.wait(timeout=10)
    try:
        rc = proc.wait(timeout=30)
    except Exception as e:
        rc = repr(e)
finally:
    own.close()
print(json.dumps({"rc": rc, "lost": proc.code_lost}))
"""


@pytest.mark.timeout(120)
def test_a_daemon_adopted_by_the_launcher_when_its_fork_server_ended_is_reaped_with_its_code(tmp_path):
    """`psgd run` as a container's init (or a subreaper) adopts the daemons of a fork
    server that ended: one that exits stays a zombie until reaped, and /proc still had
    its pid, so the launcher took it for running until its wait timed out."""
    env = {**ENV, "PSGD_CLUSTER_TIMEOUT_S": "100"}   # waits for a coordinator that never comes
    out = subprocess.run([sys.executable, "-c", ADOPTED, json.dumps(env), str(free_port_block(1)),
                          str(tmp_path / "w.started")], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    said = json.loads(out.stdout.splitlines()[-1])
    assert said["lost"] is False and isinstance(said["rc"], int), (said, out.stderr)
    assert said["rc"] != 0   # it got SIGTERM as its parent died (PR_SET_PDEATHSIG): not a clean end
