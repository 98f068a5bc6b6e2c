"""The metrics contract: event logs, pid files and `summary.json`.

- `DIR/events/<role>-<id>.jsonl`: one JSON object a line (`EventLog`).
- `DIR/pids/<role>-<index>.pid`: written while a daemon runs (`PidFile`).
- `DIR/summary.json`: written by the coordinator at the end (`summarize`).
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable
from typing import IO, Any, cast

from .consistency.staleness import Histogram

# The exit code of a daemon that cannot write its outputs (a full disk, a read-only or
# vanished folder: `OutputError`); sysexits' EX_CANTCREAT. `psgd run` does not start it
# again (a restart would fail the same way), and stops the job with the path and cause.
EXIT_CANNOT_WRITE = 73
# A worker's clock (a step, or an exchange round) in a job without a step limit
# (train.steps = 0) is at most this; the coordinator and the shards refuse one past it.
# No tighter bound holds for an honest worker: it catches up to the shards' step, which a
# job resumed from its checkpoints (each run another train.seconds) carries on from, so
# only a physical one does: a million steps a second take 285 years to reach it. It is
# the coordinator's bound on a counter (`MAX_STAT`): a worker's counters carry its clock,
# so one started past it (a new process taking up a rank starts at the live set's clock)
# had every heartbeat refused.
MAX_CLOCK = 2 ** 53


class OutputError(OSError):
    """A file of the job's outputs could not be written: the OSError, with the file's path
    (a write to an open file, or torch.save, says only "No space left on device")."""

    def __str__(self) -> str:
        if self.errno == errno.EMFILE:   # the process's limit, not the folder (ENFILE: the system's, said so)
            return f"cannot write {self.filename}: {self.strerror} ({fd_limit()}: raise it)"
        return f"cannot write {self.filename}: {self.strerror}"


def fd_limit() -> str:
    """'ulimit -n 1024, hard limit 4096': this process's limit of open files."""
    try:
        import resource
    except ImportError:   # (not on Windows)
        return "ulimit -n"
    soft, hard = ("unlimited" if n == resource.RLIM_INFINITY else n for n in resource.getrlimit(resource.RLIMIT_NOFILE))
    return f"ulimit -n {soft}, hard limit {hard}"


def output_error(e: OSError, path: str) -> OutputError:
    """`e`, raised while writing `path`, as an OutputError naming it."""
    if isinstance(e, OutputError):
        return e
    return OutputError(e.errno, e.strerror or str(e), path)


class EventLog:
    """Appends JSON lines to DIR/events/<role>-<id>.jsonl; a no-op without DIR. A line
    that cannot be written raises OutputError."""

    def __init__(self, out: str | None, role: str, ident: Any):
        self.role = role
        self._role_text = json.dumps(role) if type(role) is str else None   # (as `step` writes it)
        self._f = None
        self.path = ""
        if out:
            self.path = os.path.join(out, "events", f"{role}-{ident}.jsonl")
            try:
                os.makedirs(os.path.join(out, "events"), exist_ok=True)
                self._f = open(self.path, "a", buffering=1)
            except OSError as e:
                raise output_error(e, e.filename or self.path) from None

    def write(self, at: float | None = None, **fields: Any) -> None:
        """A line of `fields` at time `at` (time.time(); default now)."""
        if self._f:
            self._put(json_line({"t": round(time.time() if at is None else at, 4), "role": self.role, **fields}))

    def _put(self, line: str) -> None:
        try:
            self._f.write(line)   # type: ignore[union-attr]   # (asked by the callers)
        except OSError as e:
            raise output_error(e, self.path) from None

    def step(self, rank: int, step: int, clock: int, loss: float, samples: int, staleness: int, wait_s: float,
             bytes_sent: int, bytes_recv: int, extra: dict, at: float | None = None) -> None:
        """A worker's step line: `write(rank=..., step=..., ..., **extra)`, the same text,
        written out directly for the usual values (a step's line is written every step:
        the JSON encoder's set-up cost more than the rest of the line). `at`: when the
        step ended (time.time(); default now)."""
        if self._f:
            t = round(time.time() if at is None else at, 4)
            line = None if self._role_text is None else step_text(
                t, self._role_text, rank, step, clock, loss, samples, staleness, wait_s, bytes_sent, bytes_recv, extra)
            if line is None:
                self.write(at, rank=rank, step=step, clock=clock, loss=loss, samples=samples, staleness=staleness,
                           wait_s=wait_s, bytes_sent=bytes_sent, bytes_recv=bytes_recv, **extra)
            else:
                self._put(line)

    def close(self) -> None:
        if self._f:
            f, self._f = self._f, None
            with contextlib.suppress(OSError):   # (its last line's failure was raised by write)
                f.close()


# A step's line as `json_line` writes its dict (`EventLog.step`): floats as `float.__repr__`
# (null if not finite), ints as `int.__repr__`, ", " and ": " between.
_STEP = ('{"t": %s, "role": %s, "rank": %d, "step": %d, "clock": %d, "loss": %s, "samples": %d, '
         '"staleness": %d, "wait_s": %s, "bytes_sent": %d, "bytes_recv": %d%s')
_STEP_KEYS = frozenset({"t", "role", "rank", "step", "clock", "loss", "samples", "staleness", "wait_s", "bytes_sent",
                        "bytes_recv"})
_EXTRA_KEYS: dict[str, str] = {}   # an extra field's name -> its text before the value (', "name": ')
_LITERALS = {True: "true", False: "false"}


def step_text(t: float, role_text: str, rank: int, step: int, clock: int, loss: float, samples: int,
              staleness: int, wait_s: float, sent: int, recv: int, extra: dict) -> str | None:
    """A worker's step line as `json_line` writes its dict (`role_text`: the role as JSON),
    for the usual values (floats, ints, and bool, None or int extra fields of plain names);
    None for any other, which the caller encodes as the dict."""
    tail = _extra_text(extra) if extra else "}\n"
    if (tail is None or not float is type(t) is type(loss) is type(wait_s)
            or not int is type(rank) is type(step) is type(clock) is type(samples) is type(staleness)
            is type(sent) is type(recv)):
        return None
    return _STEP % (repr(t) if t - t == 0 else "null", role_text, rank, step, clock,
                    repr(loss) if loss - loss == 0 else "null", samples, staleness,
                    repr(wait_s) if wait_s - wait_s == 0 else "null", sent, recv, tail)


def _extra_text(extra: dict) -> str | None:
    """The end of a step's line from its extra fields (', "dropped": false}\n'), as
    `json_line` writes them; None where one is not a bool, None or int of a name that is
    not the line's own (the line is then encoded as a dict)."""
    out = []
    for k, v in extra.items():
        key = _EXTRA_KEYS.get(k)
        if key is None:
            if type(k) is not str or k in _STEP_KEYS:
                return None
            key = _EXTRA_KEYS[k] = ", " + json.dumps(k) + ": "
        if v is True or v is False:
            out.append(key + _LITERALS[v])
        elif v is None:
            out.append(key + "null")
        elif type(v) is int:
            out.append(key + repr(v))
        else:
            return None
    out.append("}\n")
    return "".join(out)


# A worker's counters that its step lines carry (stat -> the line's field), each counted
# from its process's start: a process's last line has them up to its last step.
LOGGED_STATS = {"samples": "samples", "steps": "step", "bytes_sent": "bytes_sent", "bytes_recv": "bytes_recv"}


# The head of a worker's step line as EventLog.write and Worker.log_step write it: (t, step)
# read without decoding the whole line (a long job's file holds millions of them).
_STEP_HEAD = re.compile(r'\{"t": ([0-9.eE+-]+), "role": "worker", "rank": -?\d+, "step": (\d+), ')


def _step_of(line: str) -> tuple[float, int] | None:
    """(t, step) of a worker's step line, None for any other line (an event's, one cut short)."""
    m = _STEP_HEAD.match(line)
    if m:
        return float(m[1]), int(m[2])
    try:   # (written otherwise: decoded)
        d = json.loads(line)
    except ValueError:
        return None
    if not isinstance(d, dict) or "event" in d or not isinstance(d.get("step"), int) \
            or not isinstance(d.get("t"), (int, float)):
        return None
    return float(d["t"]), d["step"]


# The modes whose step lines are one push each (`pushed: false` and `dropped: true` aside),
# with the push's staleness: the staleness histogram of a rank's earlier processes can be
# read from their lines (`earlier_lives`, `credit_staleness`). Not easgd's (a line a local
# step, the exchange's τ on the round's last), diloco's and ltfb's (0 for every local step).
LINE_PER_PUSH_MODES = ("sync", "ssp", "async")

# A step line's staleness, and the extra fields that say its push was not applied, as
# EventLog.write and Worker.log_step write them (a line written otherwise is decoded).
_STEP_TAU = re.compile(r', "staleness": (\d+), ')
_NOT_APPLIED_FIELDS = {"dropped": True, "pushed": False, "refused": True, "duplicate": True}
_NOT_APPLIED = tuple(f'"{k}": {"true" if v else "false"}' for k, v in _NOT_APPLIED_FIELDS.items())   # as written


def _applied_tau(line: str) -> int | None:
    """The staleness of a step line's push if the shards applied it (not `dropped`, not a
    step that pushed nothing, `pushed: false`, not `refused`, not another process's,
    `duplicate`); None otherwise."""
    m = _STEP_TAU.search(line)
    if m and line.startswith('{"t": '):
        return None if any(s in line for s in _NOT_APPLIED) else int(m[1])
    try:
        d = json.loads(line)
    except ValueError:
        return None
    tau = d.get("staleness") if isinstance(d, dict) else None
    if not isinstance(tau, int) or isinstance(tau, bool) or any(d.get(k) is v for k, v in _NOT_APPLIED_FIELDS.items()):
        return None
    return tau


def earlier_lives(out: str | None, rank: int, since: float, until: float = math.inf,
                  tail_bytes: int | None = None) -> dict:
    """What the earlier processes of worker `rank` did in this job, from their step lines
    in DIR/events/worker-<rank>.jsonl written at `since` (a time.time(): the job's start)
    or later, and not after `until` (the end of its training, where that has come): their
    LOGGED_STATS summed (each process's last line's), and the staleness histogram of
    their lines' applied pushes (`staleness_hist`, `_sum`, `_max`, as Histogram.stats();
    what the coordinator takes in LINE_PER_PUSH_MODES only: `credit_staleness`); {} if
    the file cannot be read. Read by a new process for the rank, and by the coordinator
    for a rank lost for good: the coordinator heard a process that died only up to its
    last heartbeat. Each process's `step` goes up by one a line from 1, which tells its
    lines from those of another process written in between (one whose rank was taken
    over, still stepping until its next heartbeat says so). `tail_bytes`: only the file's
    last bytes (the coordinator's read, in its serve loop: a day's file holds nearly a
    million lines): a process's last line there has its counters whole, the earlier
    processes' there may not be (counted short, never twice), and the histogram is of
    those lines only (taken only where it has more pushes than were heard). A line that
    does not decode (two processes' lines run together, where one was cut short) is not
    taken for a process's last."""
    lasts: list[tuple[int, str]] = []   # each earlier process's latest step line: (step, the line)
    hist = Histogram()
    path = os.path.join(out or "", "events", f"worker-{rank}.jsonl")
    if not out or not os.path.exists(path):
        return {}
    try:
        with open(path, "rb") as raw:
            if tail_bytes is not None and (size := os.fstat(raw.fileno()).st_size) > tail_bytes:
                raw.seek(size - tail_bytes)
                raw.readline()   # (the line the seek cut)
            for line in io.TextIOWrapper(raw, encoding="utf-8", errors="replace"):
                if '"step"' not in line or not line.endswith("\n"):   # (a line cut short as its process died)
                    continue
                if (k := line.rfind(_LINE_HEAD)) > 0:
                    # Two processes' lines run together (the first cut short as its process died, a
                    # short write): the second, whole. Taken whole, the first's head made it that
                    # process's last line, which then did not decode: its good line before went too.
                    line = line[k:]
                got = _step_of(line)
                if got is None or not since <= got[0] <= until:
                    continue
                step = got[1]
                tau = _applied_tau(line)
                if tau is not None:
                    hist.add(tau)
                i = next((i for i in range(len(lasts) - 1, -1, -1) if lasts[i][0] == step - 1), None)
                if i is None:
                    lasts.append((step, line))
                else:
                    lasts[i] = (step, line)
    except OSError:
        return {}
    last = [d for _, line in lasts if isinstance(d := _decoded(line), dict)]
    totals = {k: sum(d[f] for d in last if isinstance(d.get(f), int)) for k, f in LOGGED_STATS.items()}
    return {**{k: v for k, v in totals.items() if v}, **(hist.stats() if hist.total else {})}


_LINE_HEAD = '{"t": '   # how every event line starts (`json_line`, `step_text`)


def _decoded(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None


def credit_staleness(past: dict, logged: dict) -> bool:
    """The staleness histogram of a rank's earlier processes (`past`: their counters as
    the coordinator heard them, summed) replaced by their step lines' (`logged`, from
    `earlier_lives`) where the lines have more pushes: a process that died was heard up
    to its last heartbeat. For LINE_PER_PUSH_MODES only (the caller's to tell). Whether
    `past` changed."""
    if not isinstance(logged.get("staleness_hist"), list):
        return False
    lines = Histogram.of(logged)
    if lines.total <= Histogram.of(past).total:
        return False
    past.update(lines.stats())
    return True


def pid_path(out: str, name: str, kind: str = "pid") -> str:
    """DIR/pids/<name>.<kind>: a daemon's pid file (`PidFile`), or, `saving`, the note a
    shard keeps, naming its process, while it writes its checkpoint at exit (psgd run's
    stop waits for it then: `LocalJob._stop_children`)."""
    return os.path.join(out, "pids", f"{name}.{kind}")


class PidFile:
    """DIR/pids/<role>-<index>.pid for as long as the daemon runs."""

    def __init__(self, out: str | None, role: str, index: int):
        self.path = pid_path(out, f"{role}-{index}") if out else None

    def __enter__(self):
        if self.path:
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                tmp = f"{self.path}.tmp.{os.getpid()}"   # whole or absent: a launcher reading an empty file
                with open(tmp, "w") as f:                # took it for a stale one and removed it
                    f.write(f"{os.getpid()}\n")
                os.replace(tmp, self.path)
            except BaseException as e:   # SIGTERM's SystemExit once the file exists, before `with` holds it
                with contextlib.suppress(OSError):
                    os.unlink(f"{self.path}.tmp.{os.getpid()}")
                self.__exit__()
                if isinstance(e, OSError):   # a full disk: exit 73 naming the file (it said neither, and was
                    raise output_error(e, self.path) from None   # restarted as a daemon that crashed)
                raise
        return self

    def __exit__(self, *exc):
        """Removes the file while it names this process: a process that took this rank over
        (`psgd worker --rank R` while this one was stopped) has written its own pid there."""
        if self.path:
            with contextlib.suppress(OSError):   # (gone already, or unreadable: left as it is)
                with open(self.path) as f:
                    named = f.read().strip()
                if named == str(os.getpid()):
                    os.unlink(self.path)


def proc_stat(pid: int | str = "self") -> tuple[str, int, int] | None:
    """Process `pid`'s state letter (R, S, Z for a zombie, ...), parent's pid and start
    time (field 22, clock ticks since boot), from /proc/PID/stat; None where it has none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()   # (after the command's name, which may hold spaces)
        return fields[0], int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


SCHEDSTAT = "/proc/thread-self/schedstat"


def schedstat_of(tid: int) -> str:
    """The schedstat file of this process's thread `tid` (threading.get_native_id())."""
    return f"/proc/self/task/{tid}/schedstat"


def cpu_times(path: str = SCHEDSTAT) -> tuple[float, float] | None:
    """How long a thread (default: the calling one; `schedstat_of`) has run on a CPU, and
    waited for one while runnable, in all (seconds: the first two fields of Linux's
    schedstat); None where the kernel does not say (not Linux; a kernel that keeps no
    such count reads 0 0)."""
    try:
        with open(path, "rb") as f:
            ran, waited = f.read().split()[:2]
        return int(ran) * 1e-9, int(waited) * 1e-9
    except (OSError, ValueError):
        return None


class ThreadCpu:
    """The CPU times of the thread that does some work (a worker's training, the
    baseline's): its time on a CPU and waiting for one while runnable (other processes held
    the cores), counted from `count` on that thread, read from any thread (`read`: a
    worker's heartbeats'). Where the work moves to another thread (`follow` there, a
    script's steps), that one's are counted on, the earlier thread's carried; the last read
    is kept once the thread has ended (an in-process worker's, before its last report); a
    read below the count's start (another thread of the same id) is ignored; none where
    the kernel does not say (`cpu_times`)."""

    def __init__(self) -> None:
        self._at: tuple[int, str, tuple[float, float]] | None = None   # the thread, its schedstat, its times
        self._read: dict = {}                                           # at `count`; and the times as last read
        self._carried = (0.0, 0.0)   # ... of the threads that did the work before this one

    def count(self) -> None:
        """Count the calling thread's times from now on (those of the thread before, kept)."""
        if self._at is not None:
            read = self.read()   # (the thread before's, up to now)
            self._carried = (read.get("cpu_run_s", 0.0), read.get("cpu_wait_s", 0.0))
        tid = threading.get_native_id()
        path = schedstat_of(tid)
        times = cpu_times(path)
        self._at = (tid, path, times) if times and any(times) else None

    def follow(self) -> None:
        """The work goes on on the calling thread: counted from now on if that is another one."""
        if self._at is not None and self._at[0] != threading.get_native_id():
            self.count()

    def read(self) -> dict:
        """`cpu_run_s` and `cpu_wait_s` since `count` ({} before it, or where not counted)."""
        if self._at is not None and (now := cpu_times(self._at[1])) is not None:
            since = [t - t0 for t, t0 in zip(now, self._at[2], strict=True)]
            if min(since) >= 0:   # (not another thread's, of the same id)
                ran, waited = (round(a + b, 4) for a, b in zip(self._carried, since, strict=True))
                self._read = {"cpu_run_s": ran, "cpu_wait_s": waited}
        return self._read

    def share(self) -> float | None:
        """summary.json's cpu_wait_fraction of what `read` says (`cpu_wait_share`)."""
        read = self.read()
        return cpu_wait_share(read.get("cpu_run_s", 0.0), read.get("cpu_wait_s", 0.0))


# cpu_wait_fraction from which `psgd run` warns (cli.cpu_wait_warning) and the compare report
# says what it means for the comparison (report_reading): a few preemptions give a few %
CPU_WAIT_SAID = 0.1


def cpu_wait_said(share: Any) -> bool:
    """Whether a cpu_wait_fraction is one to say: a number that reaches CPU_WAIT_SAID as a
    whole percent, as it is written (0.0996 is said, as "10%")."""
    return isinstance(share, (int, float)) and round(100 * share) >= round(100 * CPU_WAIT_SAID)


def cpu_wait_share(ran: float, waited: float) -> float | None:
    """summary.json's cpu_wait_fraction from a run's run and wait times (`cpu_times`): the
    share of the time it could run spent waiting for a CPU; None where none was counted."""
    return round(waited / (ran + waited), 4) if ran + waited > 0 else None


def process_start_time(pid: int | str = "self") -> float | None:
    """When process `pid` (default this one) was started (forked or exec'd), as a
    time.time() value: from /proc on Linux (to the kernel's clock tick, 10 ms); None
    where that cannot be read."""
    stat = proc_stat(pid)
    if stat is None:
        return None
    try:
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - stat[2] / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    return time.time() - age if 0 <= age < 7 * 86400 else None


# How much earlier than its Python's first moment, less the CPU time spent by then, a
# process may have been forked and still be this command's own (`command_start`): the
# interpreter's start waiting on a cold disk
EXEC_SLACK_S = 0.5


def command_start(began: float, cpu_s: float, forked: float | None) -> float:
    """When a command began, as a time.time() value, from `began` (the first moment of
    its Python code), `cpu_s` (the process's CPU time by then: the interpreter's start)
    and `forked` (`process_start_time`): the fork, unless the process ran long before
    the command was exec'd into it. A shell execs a list's last command in its own
    process (`bash -c 'pip install … && psgd run'`), whose start was the shell's: psgd
    run's startup_s counted the install. Then `began - cpu_s`, which misses only what
    the interpreter's start waited for."""
    estimate = began - cpu_s
    if forked is None or forked < estimate - EXEC_SLACK_S:
        return estimate
    return forked


def live_pid(path: str) -> int | None:
    """The pid that the pid file `path` names, if that process runs; None if it is gone,
    the file is not a pid, or the pid is another process now (started after the file)."""
    try:
        with open(path) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
        written = os.path.getmtime(path)
    except (OSError, ValueError):
        return None
    started = process_start_time(pid)
    return None if started is not None and started > written + 1 else pid


def holds_open(pid: int, path: str) -> bool:
    """Whether process `pid` has the file `path` open (from /proc/PID/fd: a process of
    this user's); False where that cannot be read."""
    try:
        st = os.stat(path)
        fds = f"/proc/{pid}/fd"
        for fd in os.listdir(fds):
            with contextlib.suppress(OSError):
                s = os.stat(os.path.join(fds, fd))
                if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
                    return True
    except OSError:
        pass
    return False


def writer_gone(tmp: str, pid: int) -> bool:
    """Is the process `pid` that wrote the temporary file `tmp` gone? No such process
    here, or one started after the file was last written (its pid taken again: a
    restarted container's processes number from 1 again) that does not hold it open.
    False where that cannot be told: a live process's file is never taken for a leftover.
    (Start and mtime are wall times: a clock stepped on between the file's last write and
    now, by more than its writer had run then, puts the start after the write; the
    writer, which holds the file open while it writes, is told by that.)"""
    try:
        written = os.stat(tmp).st_mtime
        if pid <= 0:
            return False
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:   # another user's process: alive
        pass
    except OSError:
        return False
    started = process_start_time(pid)
    # (start times are estimates to about 10 ms)
    return started is not None and started > written + 1.0 and not holds_open(pid, tmp)


class _Writes:
    """The file that a `write_file_atomic` callable writes to, keeping the OSError of its
    own writes: that one is the file's (a full disk), not another's the callable met."""

    def __init__(self, f: IO):
        self.f = f
        self.failed: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.failed = e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


def write_file_atomic(path: str, write: Callable[[IO], object], binary: bool = False, tmp: str = "") -> None:
    """Write `path` with `write(file)` through a temporary file (`tmp`, default
    PATH.tmp.PID), fsync'd and renamed over it: a reader sees the old file or the new
    one, never half of one. One that fails (a full disk, a value JSON cannot hold, an
    interrupt) leaves no temporary file behind. A failure of the file's own open, writes,
    fsync or rename raises OutputError, which names `path` (torch.save says of a write
    that failed only RuntimeError "unexpected pos"); any other error is raised as it is.
    Text is UTF-8, whatever the locale (report.md's "≈", "×" and "—" are not ASCII: under
    LC_ALL=C with PYTHONUTF8=0 the locale's codec refused them)."""
    tmp = tmp or f"{path}.tmp.{os.getpid()}"
    own: OSError | None = None
    try:
        try:
            f = open(tmp, "wb") if binary else open(tmp, "w", encoding="utf-8")
        except OSError as e:
            own = e
            raise
        with f:
            writes = _Writes(f)
            try:
                write(cast(IO, writes))
            finally:
                own = writes.failed
            try:
                f.flush()
                os.fsync(f.fileno())
                f.close()   # (a network file system may say EDQUOT or EIO only here)
            except OSError as e:
                own = e
                raise
        try:
            os.replace(tmp, path)
        except OSError as e:
            own = e
            raise
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if own is None:
            raise
        raise output_error(own, path) from None


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` atomically (`write_file_atomic`)."""
    write_file_atomic(path, lambda f: f.write(text))


def write_json_atomic(path: str, obj: Any, encoded: dict[str, str] | None = None) -> None:
    """Write `obj` as strict JSON, atomically (`write_file_atomic`): a float that is not
    finite (an untrained baseline's last loss) is written as null, never as NaN or
    Infinity, which JSON does not have. `encoded`: more members of the object `obj` is,
    each value already JSON text (a long list whose items were encoded once each,
    `json_line`)."""
    text = json.dumps(finite_json(obj), indent=2, sort_keys=False, allow_nan=False)
    if encoded:
        members = ",\n".join(f"  {json.dumps(k)}: {v}" for k, v in encoded.items())
        text = text[:-1].rstrip() + (",\n" if obj else "\n") + members + "\n}"
    write_file_atomic(path, lambda f: f.write(text + "\n"))


_STRICT = json.JSONEncoder(allow_nan=False)


def json_line(obj: dict) -> str:
    """One event-log line: JSON, so a float that is not finite (a step's loss that the
    script did not give, a diverged one) is null, as summary.json writes it; Python's
    NaN and Infinity are not JSON, and strict readers refuse the whole file."""
    try:
        return _STRICT.encode(obj) + "\n"
    except ValueError:
        return _STRICT.encode(finite_json(obj)) + "\n"


def finite_json(obj: Any) -> Any:
    """`obj` with every float that is not finite, in any dict, list or tuple, as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def rate(x: float) -> float:
    """A rate as summary.json keeps it: to 2 decimals, and to 4 significant digits below
    10 (a simulation at a low bandwidth runs at 5e-05 samples/s, which 2
    decimals kept as 0.0 for every mode: the report then said throughput did not
    separate modes whose virtual walls differed by half)."""
    return rounded(x, 2, 4)


def written(t: float) -> float:
    """A time or duration in seconds as psgd writes it (summary.json's wall_s, a shard's
    busy_s; a simulation's event logs, scores, a worker's elapsed_s and wait_s): to the
    microsecond, and to 3 significant digits below 0.1 ms, where microseconds keep
    fewer: a simulation's cost model of sub-microsecond steps and links wrote its steps'
    times and waits as 0.0, its wall_s as 0 or 1e-06 (samples_per_s off by a quarter),
    and summary.json's wait_fraction and shard_busy_fraction as 0."""
    return rounded(t, 6, 3)


def rounded(x: float, decimals: int, digits: int) -> float:
    """x to `decimals` decimals, or to `digits` significant digits where those keep more."""
    if x <= 0 or not math.isfinite(x):
        return round(x, decimals)
    return round(x, max(decimals, digits - 1 - math.floor(math.log10(x))))


def summarize(*, mode: str, mode_params: dict, workers: int, servers: int, wall_s: float,
              worker_stats: dict[int, dict], server_stats: dict[int, dict], evals: list[dict],
              target: float, failures: dict, extra: dict | None = None, final_expected: bool = False) -> dict:
    """Build summary.json from the workers' cumulative counters, the shards' counters and
    the evaluator's scores (t relative to the start of training). `final_expected`: the
    evaluator scores the model after training (`final`); when that score never came, the
    final accuracy and loss are null and `final_eval_missing` says so (the last score
    then is of the model during training, and stays in `evals`)."""
    samples = sum(int(s.get("samples", 0)) for s in worker_stats.values())
    # The wall time as written: samples_per_s is `samples / wall_s` of the file's own numbers
    # (of the unrounded time, a simulation's 0.146352 virtual s wrote 87,460.63 samples/s
    # where the two fields give 87,460.37)
    wall_s = written(wall_s)
    hist = Histogram()
    for s in worker_stats.values():
        hist.merge(Histogram.of(s))
    busy = sum(float(s.get("elapsed_s", 0)) for s in worker_stats.values())
    wait = sum(float(s.get("wait_s", 0)) for s in worker_stats.values())
    traffic = sum(int(s.get("bytes_sent", 0)) + int(s.get("bytes_recv", 0)) for s in worker_stats.values())
    cpu = [(float(s["cpu_run_s"]), float(s["cpu_wait_s"])) for s in worker_stats.values() if "cpu_wait_s" in s]
    reached = [e["t"] for e in evals if e["accuracy"] >= target]
    final = evals[-1] if evals else None
    missing = final_expected and not (final and final.get("final"))
    if missing:
        final = None
    out = {
        "mode": mode,
        "mode_params": mode_params,
        "workers": workers,
        "servers": servers,
        "wall_s": wall_s,
        "samples": samples,
        "samples_per_s": rate(samples / wall_s) if wall_s > 0 else 0.0,
        "final_accuracy": final["accuracy"] if final else None,
        "final_loss": final["loss"] if final else None,
        "time_to_target_s": written(min(reached)) if reached else None,   # as wall_s
        "target_accuracy": target,
        "staleness": {"mean": round(hist.mean, 4), "max": hist.max, "hist": hist.as_dict()},
        "max_clock_gap": max((int(s.get("max_clock_gap", 0)) for s in server_stats.values()), default=0),
        "wait_fraction": round(wait / busy, 4) if busy > 0 else 0.0,
        # the share of the workers' training threads' runnable time spent waiting for a CPU (other processes
        # held the cores: the job's own beyond the cores, or other programs'); null where none was counted
        "cpu_wait_fraction": cpu_wait_share(sum(r for r, _ in cpu), sum(w for _, w in cpu)),
        "bytes_per_sample": round(traffic / samples, 1) if samples else 0.0,
        "failures": failures,
        "dropped_gradients": max((int(s.get("dropped", 0)) for s in server_stats.values()), default=0),
        "bad_messages": sum(int(s.get("bad_messages", 0)) for s in server_stats.values()),
        # each shard's time spent serving requests over the run's wall time: near 1, that shard is the bottleneck.
        # Both span the training, from its start to when the last worker was done: a shard daemon counts
        # busy_s so (servers/shard_server.py `TrainingBusy`: not the reads after it, and a restarted
        # shard's earlier processes' too)
        "shard_busy_fraction": [round(float(server_stats[i].get("busy_s", 0)) / wall_s, 4) if wall_s > 0 else 0.0
                                for i in sorted(server_stats)],
        "rejected": sum(int(s.get("rejected", 0)) for s in worker_stats.values()),
        # requests sent again, unanswered within the retry window (their bytes count in bytes_per_sample)
        "resends": sum(int(s.get("retries", 0)) for s in worker_stats.values()),
        "evals": [{"t": e["t"], "samples": e["samples"], "accuracy": e["accuracy"], "loss": e["loss"],
                   **({"final": True} if e.get("final") else {})} for e in evals],   # final: after training
    }
    if missing:
        out["final_eval_missing"] = True
    # final_loss is written null: a diverged model, not a score missing. (A score restored by a
    # restarted coordinator has its non-finite loss as null already, as its files write it: an
    # evaluator's score always has a loss, so a null one beside an accuracy was not finite.)
    if final and (isinstance(final["loss"], float) and not math.isfinite(final["loss"])
                  or final["loss"] is None and final.get("accuracy") is not None):
        out["final_loss_not_finite"] = True
    if extra:
        out.update(extra)
    return out
