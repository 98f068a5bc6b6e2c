"""One process that imports torch once, and forks psgd's daemons from it.

Every shard, worker and evaluator of a `psgd run` imported torch on its own: on two
cores, five processes importing it at once took most of a job's start-up (and of each
run of a `psgd compare`). The launcher now starts this server once per launcher process
(`python -m psgd.forkserver`); it imports what the daemons need and then forks one
child per request, which runs `psgd ROLE ...` exactly as `python -m psgd ROLE ...`
would, with its own environment, its stderr appended to its log, and stdin and stdout
on /dev/null. The server runs no torch operation and starts no thread of its own (it
imports with the job's environment, OMP_NUM_THREADS=1, so numpy's BLAS starts none
either), so a fork inherits no thread pool and no lock held by another thread; it
refuses to serve if importing initialised CUDA.

Protocol, one JSON object per line. Requests on the server's stdin:
`{"argv": [...], "env": {...}, "log": PATH or null, "cwd": PATH}`; answers on its stdout:
`{"pid": N}` for each request, in order, and `{"exit": N, "code": C}` when a child
ends (C as `subprocess.Popen.returncode`: negative for a signal). The server exits when
its stdin closes (the launcher is gone), and its children get SIGTERM when it does
(`exit_with_parent`): a `psgd run` killed with -9 leaves no daemon training on its own.

`Forked` gives the launcher the part of `subprocess.Popen` it uses (pid, poll, wait,
terminate, kill, send_signal).
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import IO

from .config import CPU_ENV
from .metrics import proc_stat

# What a daemon imports before it does anything (torch most of all).
PRELOAD = ("torch", "numpy", "zmq", "msgpack", "psgd.cli", "psgd.shard", "psgd.models", "psgd.data",
           "psgd.servers.shard_server", "psgd.workers.worker", "psgd.workers.evaluator")
READY_S = 120.0   # the preload may take long on a busy machine
ANSWER_S = 30.0   # a fork is answered at once; this is only the deadline
PARENT_ENV = "PSGD_PARENT_PID"   # set by the launcher for the processes it starts itself
_PR_SET_PDEATHSIG = 1


def exit_with_parent(parent: int) -> None:
    """Have this process get SIGTERM when its parent ends (Linux's PR_SET_PDEATHSIG;
    elsewhere nothing), and exit at once if `parent`, the pid it was started by, is gone
    already. A daemon stopped so runs its `finally` blocks (psgd/cli.py)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return
    if prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:
        raise SystemExit(f"psgd: the process that started this one ({parent}) is gone")


def end_with_launcher() -> None:
    """`exit_with_parent` for a process that `psgd run` started itself (PARENT_ENV names
    it: the launcher's pid); nothing for one started otherwise (by hand, Slurm, Compose)."""
    if os.environ.get(PARENT_ENV, "").isdigit():
        exit_with_parent(int(os.environ[PARENT_ENV]))


def take_cpu() -> None:
    """Pin this process to the CPU that `psgd run` gave it (CPU_ENV: `cluster.pin_cpus`,
    `launcher.cpu_places`), before it starts a thread: the ones it starts later (ZeroMQ's
    I/O thread, the heartbeats) share it. A CPU it may not use is said, and left."""
    cpu = os.environ.get(CPU_ENV, "")
    if not cpu.isdigit():
        return
    try:
        os.sched_setaffinity(0, {int(cpu)})
    except (AttributeError, OSError, ValueError) as e:
        from .log import log
        log("psgd", f"could not pin this process to CPU {cpu} (cluster.pin_cpus): {e}; it runs where the system "
                    f"puts it")


class ForkServerError(RuntimeError):
    pass


# ---------------------------------------------------------------- the server process
def serve() -> None:
    try:
        end_with_launcher()
    except SystemExit:   # the launcher ended while this started (SIGTERM during its Popen): no one to serve or tell
        return
    # The collector is off while the preload imports (torch's ~170k objects): a full
    # collection that a few allocations more or less set off mid-import cost 0.1-0.35 s
    # of every job's start-up (a 22-line function added to psgd/shard.py moved the default
    # job's from 1.37 to 1.59 s); what it imported is frozen, as each daemon's is (cli._started).
    gc.disable()
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()
    gc.enable()
    import torch
    if torch.cuda.is_initialized():  # a fork could not use CUDA: the launcher falls back to interpreters
        raise SystemExit("psgd.forkserver: CUDA was initialized while importing; not forking")
    _say({"ready": os.getpid()})
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.05)
        _reap()
        if not readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            return  # the launcher is gone
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            _say({"pid": _fork(json.loads(line))})


def _say(obj: dict) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(req: dict) -> int:
    server = os.getpid()
    inherited = _mp_temp_dir()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        exit_with_parent(server)
        env = {k: v for k, v in req["env"].items() if k != PARENT_ENV}  # the launcher is not its parent
        code = _child(req["argv"], env, req.get("log"), req.get("cwd"))
    except SystemExit as e:  # as the interpreter treats it: an int, None for 0, else printed and 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
    finally:
        # Its work is done: a signal now (a late SIGTERM to the job's group) would raise
        # from the daemon's handler past os._exit, on into this server's code. From main's
        # end on they wait (cli.exit_on_signals), and go with the process: the daemon's
        # exit code stands. So here, for a child that did not get that far.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
        with contextlib.suppress(Exception):
            _remove_mp_temp_dir(inherited)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _mp_temp_dir() -> str | None:
    """This process's multiprocessing temp folder (`pymp-*`), if it made or inherited one."""
    if "multiprocessing.util" not in sys.modules:
        return None
    import multiprocessing.process
    return multiprocessing.process.current_process()._config.get("tempdir")  # type: ignore[attr-defined]


def _remove_mp_temp_dir(inherited: str | None) -> None:
    """Remove the multiprocessing temp folder this process made (not one `inherited`
    from the fork server), which the interpreter's exit would remove and os._exit does
    not: every daemon of a job with loader processes (`data.loader_workers`) left one in
    /tmp (`pymp-*`, a socket listener's)."""
    folder = _mp_temp_dir()
    if folder and folder != inherited:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)


def _child(argv: list[str], env: dict, log_path: str | None, cwd: str | None = None) -> int:
    """`python -m psgd ARGV` in this forked process."""
    os.environ.clear()
    os.environ.update(env)
    if cwd and cwd != os.getcwd():
        os.chdir(cwd)
    # Where a new interpreter would import from: the folder it starts in (`-m`), then
    # PYTHONPATH (a model factory `package.module:factory` of the user's).
    for entry in [*reversed(env.get("PYTHONPATH", "").split(os.pathsep)), os.getcwd()]:
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    if log_path:
        os.dup2(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), 2)
    os.closerange(3, 64)  # the server's pipes and files are not the daemon's
    sys.argv = ["psgd", *argv]
    signal.signal(signal.SIGINT, _child_sigint)  # the server ignores it; a daemon does as a new interpreter would
    signal.signal(signal.SIGHUP, _child_sighup)  # (so SIGHUP)
    import random

    import numpy as np
    import torch
    random.seed()       # a fresh process seeds these from the OS: so do the forks, or they would all
    np.random.seed()    # draw the server's numbers (the daemons seed torch from the config themselves)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    from .cli import main
    return main(argv, own_process=True, forked=True)


# ---------------------------------------------------------------- the launcher's side
class ForkServer:
    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "psgd.forkserver"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in: IO[bytes] = self.proc.stdin
        self._fd = self.proc.stdout.fileno()
        os.set_blocking(self._fd, False)
        self._buf = b""
        self.codes: dict[int, int] = {}   # pid -> exit code, once ended
        # Its answers (ready, a fork's pid) read but not yet asked for. A thread that polls a
        # daemon (`Forked.poll`: a test's watcher, a compare's) read the pipe while another
        # waited for a fork's pid, and dropped it: that fork "took more than 30 s" and the
        # job failed. Reads are under `_reading`, forks one at a time under `_spawning`.
        self._answers: list[dict] = []
        self._reading = threading.Lock()
        self._spawning = threading.Lock()
        try:
            self._next(lambda m: "ready" in m, READY_S, "to import torch")
        except BaseException:   # Ctrl-C or SIGTERM too: it would outlive psgd run, and say so after its end
            self.proc.kill()
            self.proc.wait()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, argv: list[str], env: dict, log_path: str | None) -> Forked:
        request = {"argv": argv, "env": env, "log": log_path, "cwd": os.getcwd()}
        with self._spawning:   # (one request, one answer: the next pid is this request's)
            with contextlib.suppress(BrokenPipeError):   # it has ended: _next says with which code
                self._in.write((json.dumps(request) + "\n").encode())
                self._in.flush()
            try:
                return Forked(self, int(self._next(lambda m: "pid" in m, ANSWER_S, "to fork")["pid"]))
            except BaseException:   # (timed out, or a signal came): its late answer would be taken for the
                with contextlib.suppress(OSError):   # next request's pid, and that daemon never supervised
                    self.proc.kill()
                raise

    def collect(self) -> None:
        """Take in the exits reported so far (and keep its other answers for `_next`)."""
        with self._reading:
            for m in self._lines():
                self._note(m)

    def _note(self, m: dict) -> None:
        if "exit" in m:
            self.codes[int(m["exit"])] = int(m["code"])
        else:
            if "pid" in m:   # a new process: an earlier one's code under its pid (the kernel reuses them) is not its
                self.codes.pop(int(m["pid"]), None)
            self._answers.append(m)

    def _lines(self) -> list[dict]:
        try:
            data = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            data = b""
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(line) for line in lines if line]

    def _next(self, wanted, timeout_s: float, doing: str) -> dict:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self._reading:
                for m in self._lines():
                    self._note(m)
                for k, m in enumerate(self._answers):
                    if wanted(m):
                        return self._answers.pop(k)
            if self.proc.poll() is not None:
                raise ForkServerError(f"the fork server exited with {self.proc.returncode}")
            select.select([self._fd], [], [], 0.05)
        raise ForkServerError(f"the fork server took more than {timeout_s:.0f} s {doing}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._in.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


class Forked:
    """A daemon forked by a `ForkServer`, seen as much like `subprocess.Popen` as the
    launcher needs."""

    def __init__(self, server: ForkServer, pid: int):
        self.server = server
        self.pid = pid
        self.code_lost = False   # it ended with its fork server, which took its exit code along
        stat = proc_stat(pid)
        self.started = None if stat is None else stat[2]   # (its start time: the same pid later is another process)

    @property
    def returncode(self) -> int | None:
        return self.server.codes.get(self.pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.collect()
            if self.returncode is None and not self.server.alive():
                self._orphaned()
        return self.returncode

    def _orphaned(self) -> None:
        """Its fork server has ended, and with it the report of its exit. Where this
        process adopted it (it is the init of a container, `psgd run` as its command, or a
        subreaper), it is this process's child now: its exit code is asked here. Else it
        has ended once no process of its start time runs under its pid: not a zombie (one
        that its new parent has not reaped yet), nor another process that took the pid.
        (Before, only a pid missing from /proc counted: an adopted zombie, never reaped,
        was running for good, and so was a reused pid.)"""
        with contextlib.suppress(ChildProcessError):
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.server.codes[self.pid] = os.waitstatus_to_exitcode(status)
                return
        stat = proc_stat(self.pid)
        if stat is not None and stat[1] == os.getpid():   # (adopted as it ended: waitpid has it in a moment)
            return
        if stat is None or stat[0] in "ZX" or stat[2] != self.started:
            self.server.codes[self.pid] = -signal.SIGKILL  # its server died: the code is lost
            self.code_lost = True

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a pid that may have been reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_server: ForkServer | None = None
_failed = False  # it could not start: not tried again by this process


def server(env: dict) -> ForkServer | None:
    """This process's fork server, started on first use with `env` (the first job's:
    each child gets its own); None if it cannot start (the launcher then starts
    daemons as separate interpreters, as before)."""
    global _server, _failed
    if _failed or (_server is not None and _server.alive()):
        return _server
    try:
        _server = ForkServer(env)
    except (ForkServerError, OSError) as e:
        print(f"[psgd run] no fork server ({e}); starting each process on its own", file=sys.stderr)
        _server, _failed = None, True
    return _server


def shutdown() -> None:
    """Close this process's fork server (psgd run and compare, at their end): it would
    otherwise linger until this process exits, holding its stderr."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


def running_pid() -> int | None:
    """The fork server's pid, if this process has one running (tests tell it from a leak)."""
    return _server.pid if _server is not None and _server.alive() else None


_child_sigint = signal.default_int_handler  # what a new interpreter started by the launcher would have
_child_sighup = signal.SIG_DFL

if __name__ == "__main__":
    # Ctrl-C is for the launcher and the daemons. A daemon gets what this process
    # inherited: Python's KeyboardInterrupt, or nothing where the launcher runs with
    # SIGINT ignored (in the background of a shell without job control).
    _child_sigint = signal.getsignal(signal.SIGINT)  # type: ignore[assignment]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # So is a hang-up (the terminal closed: the shell sends SIGHUP to its job's whole
    # process group, this server included): its default action killed the server, which
    # took the daemons' exit codes along.
    _child_sighup = signal.getsignal(signal.SIGHUP)  # type: ignore[assignment]
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    serve()
