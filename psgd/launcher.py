"""`psgd run`: the whole job on one machine, every role its own process on loopback.

The launcher writes the resolved config to DIR/config.toml, starts the coordinator,
the shards, the workers and the evaluator with it (`python -m psgd ROLE DIR/config.toml
--out DIR`; all but the coordinator forked, as that command, from one process that has
imported torch: psgd/forkserver.py, unless `cluster.fork = false`; that process has
imported it before the coordinator starts, whose wait for the workers, cluster.timeout_s,
counts from its start), shows the
coordinator's progress, and supervises: a shard or the evaluator that exits with a code
other than 0 is started again (a shard resumes from its checkpoint); a coordinator killed
or crashed while the job is under way is started again and resumes from its state file;
with `restart_workers` a dead worker is started again with its rank, unless the job is
ending (aborted, or done training); a child restarted MAX_RESTARTS times that dies again
fails the run. Daemons log to DIR/logs/<role>-<i>.log (their stderr; a training
script's stdout too), but for the coordinator, whose progress goes to the terminal
(unless --quiet, as in the runs of psgd compare). A worker
that exits before the job begins training (a training script; psgd's own worker
with an error, not restarted) stops the job at once, with its log; once the job has
ended, the scripts' work after close() is waited for (up to --timeout), and one that
exits with a code other than 0 fails the run. Every child is stopped on the way out,
whatever happens: SIGTERM (and SIGCONT, which a stopped one needs to take it), then SIGKILL
STOP_S later, or, for a shard writing its checkpoint at exit, once it is written (SAVING_S
at most). After a Ctrl-C the training scripts, which had it too, are first given
SCRIPT_LEAVE_S to exit by themselves.

Start-up: each child touches DIR/logs/<role>-<i>.started once its code is loaded
(`--started-file`), and the launcher shows how many have ("started 3/7 processes"; the
coordinator then shows "workers registered 1/2"). The coordinator gets the moment the
job was launched (`--launched-at`) and reports the time from it to the start of
training as `startup_s` in summary.json, which `format_summary` prints. A job with more
busy processes (shards, workers, evaluator) than this process may use cores gets a
warning: they take turns, so start-up and steps are slower than with a core each.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import math
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO

from . import forkserver
from .config import AUTO_SPIN_US, CPU_ENV, SET_CHECKED_ENV, Config, ConfigError, anchored, in_psgd_format, tcp_parts
from .log import log
from .membership import JOB_TOKEN_ENV
from .metrics import EXIT_CANNOT_WRITE, pid_path, proc_stat, write_text_atomic
from .transport import EXIT_ADDRESS_IN_USE, raise_fd_limit

MAX_RESTARTS = 5  # per child; past that the job fails instead of looping
JOINED = "joined"   # what psgd.connect writes in its PSGD_STARTED_FILE once the coordinator registered it
ENDING_WAIT_S = 1.0  # how long a worker's exit waits for the coordinator to say the job ends (see _restarted)
MAX_MOVES = 5     # a job whose chosen ports were taken before its daemons bound them moves this often
SCRIPT_NOTE_S = 30  # how often psgd run says it still waits for a training script after the job ended
LOCK_FILE = ".launcher.lock"  # in the output folder: held by the launcher of the job that uses it
EARLIER = "earlier"            # in the output folder: logs, event logs and tb/ of the job a resumed job goes on from
TOKEN_FILE = ".job-token"     # in the output folder while its job runs: the job's PSGD_JOB_TOKEN (folder_token)
# The stop (`LocalJob._stop_children`): SIGTERM, then SIGKILL what has not exited STOP_S
# later; a shard writing its checkpoint at exit (`metrics.pid_path`) is waited for until
# SAVING_S after SIGTERM. A large model's checkpoint (hundreds of MB, a slow disk, several
# shards writing at once) took longer than STOP_S, and SIGKILL cut it short.
STOP_S = 5.0
SAVING_S = 120.0
# After a Ctrl-C, before the stop: the training scripts had it too (a terminal's Ctrl-C
# reaches `psgd run`'s process group) and leave the job by themselves (psgd.connect's Ctrl-C
# path: a heartbeat's answer time a call to the coordinator, which had it too; the script's
# own KeyboardInterrupt handling, a save or a `finally`), which SIGTERM at once cut short
# (`LocalJob.let_scripts_leave`).
SCRIPT_LEAVE_S = 10.0
_warned: set[str] = set()  # warnings already given by this process (psgd compare starts many jobs)


class LaunchError(RuntimeError):
    pass


def available_cores(cgroup: str = "/sys/fs/cgroup") -> int:
    """The cores this process may run on (its affinity mask, as taskset or a container's
    cpuset limit it), else the machine's; fewer where its cgroup's CPU quota allows less
    time than that (`docker run --cpus 2`, a Kubernetes CPU limit: every core is in its
    mask, and no job was warned), rounded up."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cpu_quota(cgroup)
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def cpu_quota(cgroup: str = "/sys/fs/cgroup") -> float | None:
    """The CPU time, in cores, that this process's cgroup may use (cgroup v2's cpu.max,
    "QUOTA PERIOD"; v1's cpu/cpu.cfs_quota_us over cpu/cpu.cfs_period_us; a container
    sees its own at the root), or None: no quota ("max", -1), or none to read."""
    def read(*names: str) -> str:
        with open(os.path.join(cgroup, *names)) as f:
            return f.read().strip()
    for quota_period in (lambda: read("cpu.max").split(),
                         lambda: [read("cpu", "cpu.cfs_quota_us"), read("cpu", "cpu.cfs_period_us")]):
        try:
            quota, period = quota_period()
            if quota in ("max", "-1"):
                return None
            return int(quota) / int(period) if int(quota) > 0 and int(period) > 0 else None
        except (OSError, ValueError):
            continue
    return None


def busy_processes(cfg: Config) -> tuple[int, str]:
    """How many of the job's processes compute (shards, workers, the evaluator; the
    coordinator mostly waits), and which."""
    c = cfg.cluster
    parts = [f"{c.servers} shard{'s' * (c.servers != 1)}", f"{c.workers} worker{'s' * (c.workers != 1)}"]
    if c.evaluator:
        parts.append("an evaluator")
    return c.servers + c.workers + int(c.evaluator), ", ".join(parts)


def one_a_core_first(cpus: list[int], topology: str = "/sys/devices/system/cpu") -> list[int]:
    """`cpus` with one hardware thread of each core first, then the second of each, and so
    on (Linux's topology files: package and core of each CPU; as given where they cannot be
    read): two pinned processes share a core's execution units only where there are more
    of them than cores."""
    def read(cpu: int, name: str) -> str:
        with open(os.path.join(topology, f"cpu{cpu}", "topology", name)) as f:
            return f.read().strip()
    taken: dict[tuple[str, str], int] = {}   # (package, core) -> its threads listed so far
    order = []
    for k, cpu in enumerate(cpus):
        try:
            core = (read(cpu, "physical_package_id"), read(cpu, "core_id"))
        except OSError:
            return list(cpus)
        order.append((taken.get(core, 0), k, cpu))
        taken[core] = taken.get(core, 0) + 1
    return [cpu for *_, cpu in sorted(order)]


def cpu_places(cfg: Config, script: bool = False, threads: str = "1",
               cpus: list[int] | None = None) -> tuple[dict[str, int], str]:
    """Where `cluster.pin_cpus` puts the job's shards and workers (`server-I` and
    `worker-R` -> a CPU), and its evaluator where a CPU is left for it (`evaluator-0`),
    and what `psgd run` says of it ('' if nothing): each process, with all its threads,
    on one CPU of those this process may use, on cores of their own first. A process's
    ZeroMQ I/O thread then shares its CPU: a message hands over between the two threads
    without waking a CPU that sleeps (docs/performance.md, "Where the time of a step
    goes"). Pinned only where each gets a CPU of its own and computes on one
    thread (`threads`: the daemons' OMP_NUM_THREADS), and not a training script's workers
    (`--script`: the script's process, its threads and loaders are the user's)."""
    if not cfg.cluster.pin_cpus:
        return {}, ""
    if script:
        return {}, "cluster.pin_cpus: a training script's workers are not pinned, so neither are the shards"
    if threads != "1":
        return {}, (f"cluster.pin_cpus: OMP_NUM_THREADS={threads}: a process that computes "
                    f"on several threads is not pinned to one CPU; nothing is pinned")
    if cfg.data.loader_workers > 0:
        return {}, ("cluster.pin_cpus: data.loader_workers > 0: a worker's loader processes would share its CPU; "
                    "nothing is pinned")
    if cpus is None:
        try:
            cpus = one_a_core_first(sorted(os.sched_getaffinity(0)))
        except (AttributeError, OSError):   # (not Linux)
            return {}, "cluster.pin_cpus: this system cannot pin a process to a CPU; nothing is pinned"
    c = cfg.cluster
    names = [f"server-{i}" for i in range(c.servers)] + [f"worker-{r}" for r in range(c.workers)]
    if len(names) > len(cpus):
        return {}, (f"cluster.pin_cpus: {c.servers} shard{'s' * (c.servers != 1)} and {c.workers} "
                    f"worker{'s' * (c.workers != 1)} on {len(cpus)} CPU{'s' * (len(cpus) != 1)}: each needs a "
                    f"CPU of its own; nothing is pinned")
    places = dict(zip(names, cpus, strict=False))
    on = ', '.join(map(str, places.values()))
    if not c.evaluator:
        return places, f"cluster.pin_cpus: shards and workers on CPUs {on}, one each"
    if len(cpus) > len(names):
        places["evaluator-0"] = cpus[len(names)]
        return places, f"cluster.pin_cpus: shards, workers and the evaluator on CPUs {on}, {cpus[len(names)]}, one each"
    return places, (f"cluster.pin_cpus: shards and workers on CPUs {on}, one each; the evaluator is not pinned: "
                    f"no CPU is left for it, so it takes turns with them")


def spin_for(cfg: Config, cores: int | None = None) -> Config:
    """`cfg` with `cluster.spin_us` resolved where it is auto (-1): AUTO_SPIN_US where the
    job's busy processes fit the cores this process may use (a spinning process then takes
    a core no other process's compute needs), else 0 (one would take turns with the others'
    compute). Over ZeroMQ each process's I/O thread, and its peer's, still needs a CPU
    while it spins: measured unpinned at W = 1, S = 1 on 2 cores (docs/performance.md,
    "ZeroMQ's waits spin too"), where it helped; not measured with `cluster.pin_cpus`,
    which puts the I/O thread on its process's one CPU. Other programs' processes are not
    counted here: each waiting thread watches for them itself (`spinning.Spinner`)."""
    if cfg.cluster.spin_us != -1:
        return cfg
    cores = available_cores() if cores is None else cores
    return cfg.replace(**{"cluster.spin_us": AUTO_SPIN_US if busy_processes(cfg)[0] <= cores else 0.0})


def oversubscribed(cfg: Config, cores: int | None = None) -> str:
    """A warning when the job has more busy processes than there are cores, else ""."""
    cores = available_cores() if cores is None else cores
    busy, which = busy_processes(cfg)
    if busy <= cores:
        return ""
    return (f"warning: {busy} busy processes ({which}) on {cores} core{'s' * (cores != 1)}: they take turns, "
            f"so start-up takes longer and steps wait for a core; throughput and times measured so are not "
            f"those of one core per process")


def bind_error(host: str, port: int) -> OSError | None:
    """Why a daemon could not bind `port` on `host` ('' for every address), or None. The
    probe sets SO_REUSEADDR, as ZeroMQ's bind does: a port held only by an earlier job's
    TIME_WAIT connections (for a minute after it ended) is free to it, a port another
    socket listens on is not."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def ports_free(host: str, base: int, n: int) -> bool:
    """Whether the daemons could bind ports base..base+n-1 (`bind_error`)."""
    return all(bind_error(host, p) is None for p in range(base, base + n))


def busy_port(host: str, base: int, n: int) -> int | None:
    """The first port of base..base+n-1 that cannot be bound, or None."""
    return next((p for p in range(base, base + n) if bind_error(host, p) is not None), None)


def taken_port(cfg: Config) -> int:
    """The first of a job's ports on this node (the coordinator's, then each shard's, bound as
    the daemons bind them: `bind_address`) that a program here listens on, else 0. The Slurm
    scripts check it before they start anything: the shards bind only once a worker has
    registered the model's layout, and the workers, meanwhile, sent their requests to
    whatever had a shard's port (another job's coordinator); the job was aborted with that
    program's answer ("the coordinator does not serve 'init'"), exit code 1."""
    import errno

    from .transport import bind_address
    for a in [cfg.coordinator_address()] + [cfg.shard_address(i) for i in range(cfg.cluster.servers)]:
        if not a.startswith("tcp://"):
            continue
        host, port = tcp_parts(bind_address(a))
        e = bind_error("" if host == "*" else host.strip("[]"), int(port))
        if e is not None and e.errno == errno.EADDRINUSE:
            return int(port)
    return 0


def hold(path: str) -> IO | None:
    """An exclusive lock on the file at `path` (created if need be), held until the
    returned file is closed or this process ends; None if another process holds it. The
    lock is on the file that is at `path` once it is taken: one its holder removed
    meanwhile (a launcher refused before its job began takes back the lock file it made,
    while it holds it: `LocalJob._unmake`) is let go, and the one there now is locked."""
    while True:
        # (not truncated, and not through a symbolic link: a lock file another user planted as
        # a link to one of this user's files would have emptied it)
        f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), "r+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        try:
            there = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            there = None
        mine = os.fstat(f.fileno())
        if there is not None and (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
            return f
        f.close()   # (a removed file's lock keeps no one out: two launchers held one folder)


def held(path: str) -> bool:
    """Does a process hold `hold`'s lock on the file at `path`? Only tested: a shared lock,
    not waited for and dropped at once; the file is never created (False if it is not there)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)   # (drops the shared lock, if taken)
    return False


def port_locks_folder() -> str:
    """Where this user's launchers lock the ports they chose: one file per port."""
    return os.path.join(tempfile.gettempdir(), f"psgd-ports-{os.getuid()}")


def claim_ports(base: int, n: int) -> list[IO] | None:
    """Locks on ports base..base+n-1 (port_locks_folder), for the launcher that chose
    them until its job ends: another launcher choosing at the same moment, before any
    daemon has bound a port, finds them taken and chooses another block. (Two jobs
    started at once both chose the default block, free to either's probe: one job's
    daemons reached the other's coordinator.) None, and nothing held, if another
    launcher holds one of them. Per port, not per block: blocks of other sizes overlap.
    Where the folder cannot be written, nothing is held ([]): a job whose block another
    takes still moves (LocalJob._move)."""
    held: list[IO] = []
    try:
        folder = port_locks_folder()
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return []   # (another user's, or writable by others: its files could be theirs)
        for p in range(base, base + n):
            f = hold(os.path.join(folder, f"{p}.lock"))
            if f is None:
                for g in held:
                    g.close()
                return None
            held.append(f)
    except OSError:
        for g in held:
            g.close()
        return []
    return held


def ephemeral_ports() -> tuple[int, int]:
    """The range the OS takes the local port of an outgoing connection from (Linux's
    net.ipv4.ip_local_port_range; IANA's 49152-65535 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def in_ephemeral_range(base: int, n: int) -> bool:
    low, high = ephemeral_ports()
    return base <= high and base + n - 1 >= low


def pick_port(host: str, want: int, n: int, claim: Callable[[int], bool] | None = None) -> int:
    """`want` if ports want..want+n-1 are free, else a free block below the OS's
    ephemeral range, at random (two launchers rarely pick the same). Not in it: a port
    there may be taken, before its daemon binds it, as the local end of some outgoing
    connection, and a connection to it from this host may connect to itself (TCP
    self-connect: the worker's socket then holds the shard's port, and the shard cannot
    bind it; libzmq issue 4588). `claim(base)`, if given, must also hold for the block
    chosen: a launcher's claim_ports, which serializes launchers choosing at once."""
    def usable(base: int) -> bool:
        return ports_free(host, base, n) and (claim is None or claim(base))

    if usable(want):
        return want
    low, _ = ephemeral_ports()
    first = 10000 if low - n > 20000 else 1024
    rng = random.Random()
    for _ in range(200 if low - n > first else 0):
        base = rng.randrange(first, low - n + 1)
        if usable(base):
            return base
    for _ in range(50):   # no free block below it: one the OS suggests
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + n < 65535 and usable(base):
            return base
    raise LaunchError(f"no block of {n} free ports on {host}")


@dataclass
class Child:
    role: str
    index: int
    argv: list[str]
    env: dict | None = None          # the job's environment, plus a training script's PSGD_* variables
    proc: subprocess.Popen | forkserver.Forked | None = None
    restarts: int = 0
    reported: bool = False
    log_path: str = ""
    log_start: int = 0               # the log's size when this process of it started (logs are appended to)
    script: bool = False             # a copy of the user's training script (psgd run --script)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        assert self.proc is not None, f"{self.name} was never started"
        return self.proc.poll()


class LocalJob:
    """`port_explicit`: the user gave cluster.port, so the job listens there or not at
    all; otherwise the launcher chooses a free block (cluster.port if it is free), says
    which, and moves the job to another block if a daemon finds its port taken after
    all (another job bound it between the check and the bind).

    A job it refuses (its ports, its folders another job's, a config error found here)
    raises before it says anything or writes a file: the refusal is all the user sees.
    `announce`, if given, is called once it is accepted, before anything it says (psgd
    run's line that names the job). `on_started`, if given, is told the started count and
    the job's process count (k, N) as the count grows, and (0, N) as the processes start
    (again after a move): a quiet job's start-up progress (psgd compare's)."""
    stop_s = STOP_S       # the stop's budgets (`_stop_children`)
    saving_s = SAVING_S

    def __init__(self, cfg: Config, out: str, device: str = "auto", restart_workers: bool = False,
                 quiet: bool = False, timeout_s: float | None = None, env: dict | None = None,
                 launched_at: float | None = None, port_explicit: bool = False, script: list[str] | None = None,
                 announce: Callable[[], None] | None = None,
                 on_started: Callable[[int, int], None] | None = None):
        # startup_s counts from here (a time.time() value), or from launched_at: psgd run
        # passes its own process's start
        wall = time.time()
        self.launched_at = wall if launched_at is None else launched_at
        self._launched_mono = time.monotonic() - (wall - self.launched_at)   # (start-up counted on it: steps of
        # the wall clock, by NTP or a resumed VM, do not count)
        self.out = os.path.abspath(out)
        made = self._made = [] if os.path.isdir(self.out) else [self.out]   # (what `_unmake` takes back)
        os.makedirs(self.out, exist_ok=True)
        if not os.path.exists(os.path.join(self.out, LOCK_FILE)):
            made.append(os.path.join(self.out, LOCK_FILE))
        self.port_explicit = port_explicit
        self.script = script  # [FILE, ARGS...]: the workers are copies of the user's training script
        self.moves = 0
        self.quiet = quiet
        self.on_started = on_started
        self._ports_note = ""
        self._port_locks: list[IO] = []   # (claim_ports) held until stop()
        self._locks: list[IO] = []        # (_hold_folders) held until stop()
        self.device = device
        self.restart_workers = restart_workers
        self.timeout_s = default_timeout(cfg) if timeout_s is None else timeout_s
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.env = {k: v for k, v in self.env.items() if not (k.startswith("PSGD_") and k not in ("PSGD_DEVICE",))}
        # Many processes share this machine's cores: one compute thread each, unless told
        # otherwise (measured 7x faster on 2 cores than torch's default of one per core).
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.env[forkserver.PARENT_ENV] = str(os.getpid())  # its processes end with it (forkserver.exit_with_parent)
        self.env[JOB_TOKEN_ENV] = os.urandom(8).hex()   # its coordinator refuses other jobs' daemons
        self.config_path = os.path.join(self.out, "config.toml")
        try:   # (whatever ends the job here, a Ctrl-C, a full disk, lets go of its folder and ports)
            self.cfg = spin_for(self._place(anchored(cfg)))   # (its daemons read the config it writes)
            from . import scalars
            scalars.check(self.cfg)  # before any process starts
            self._hold_folders()
            self._refuse_running_job()   # first: a folder of a job still running is refused, untouched
            self._refuse_users_config()
            if not os.path.isdir(os.path.join(self.out, "logs")):
                made.append(os.path.join(self.out, "logs"))
                os.makedirs(os.path.join(self.out, "logs"))
            if announce is not None:
                announce()
            if self._ports_note:
                log("run", self._ports_note)
            self._forget_earlier_job()
            self._step_logs = os.path.join(self.out, "events", "worker-*.jsonl")
            self._events_before = file_stamps(glob.glob(self._step_logs))   # (`_training_began`)
            self._write_config()
        except BaseException:
            self._unmake()
            self._release_folders()
            self._release_ports()
            raise
        self.children: list[Child] = []
        self.started: set[str] = set()  # children whose .started file has appeared
        self._shown_started = 0
        self._starting = 0   # the children start() is starting (the count's total while it does)

    def _hold_folders(self) -> None:
        """The output folder is this launcher's until stop(): an exclusive lock on
        OUT/.launcher.lock, held while the job's files are written (`_locks`). A second
        launcher started at the same moment (before the first job's pid files exist) is
        refused here, where it would have written its config over the first job's. So is
        a `checkpoint.dir` outside it: two jobs given one wrote the same shard-I.pt, each
        resuming the other's."""
        os.makedirs(self.out, exist_ok=True)   # (another launcher refused meanwhile may have taken back its folder)
        f = hold(os.path.join(self.out, LOCK_FILE))
        if f is None:
            raise LaunchError(f"{self.out} is the output folder of a job that is still running (another psgd "
                              f"launcher holds {LOCK_FILE}): give another --out, or stop that job first (Ctrl-C, or "
                              f"SIGTERM to its psgd run)")
        self._locks.append(f)
        folder = self.cfg.checkpoint.dir
        if not folder or os.path.abspath(folder) == os.path.join(self.out, "checkpoints"):
            return
        os.makedirs(folder, exist_ok=True)
        g = hold(os.path.join(folder, LOCK_FILE))
        if g is None:
            raise LaunchError(f"checkpoint.dir = {folder} holds the shard checkpoints of a job that is still "
                              f"running (its launcher holds {LOCK_FILE} there): give another checkpoint.dir, "
                              f"or stop that job first (Ctrl-C, or SIGTERM to its psgd run)")
        self._locks.append(g)

    def _unmake(self) -> None:
        """A job refused before it began (a port in use, a running job's folder, a config
        file of the user's) leaves the output folder as it found it: what this launcher
        made is removed (the folder, its lock file, the logs folder; each only if it is
        still as made: the lock file only where this launcher holds it, removed before
        it lets go of it, and a folder only if empty). Each refused `psgd run` into the
        default `runs/` left an empty run folder."""
        for path in reversed(self._made):
            with contextlib.suppress(OSError):
                if path.endswith(LOCK_FILE):
                    if self._locks:   # (held: another launcher that opened it meanwhile lets it go: `hold`)
                        os.unlink(path)
                else:
                    os.rmdir(path)   # (only when empty)

    def _release_folders(self) -> None:
        for f in self._locks:
            f.close()   # closing the file drops the lock

    def _refuse_running_job(self) -> None:
        """A folder whose pid files name a running process is another job's, still
        running: a LaunchError, and nothing is removed. The pid files of processes that
        are gone (or whose pid another process, started after the file, has now) are
        removed."""
        from .metrics import live_pid
        stale = []
        for path in sorted(glob.glob(os.path.join(self.out, "pids", "*.pid"))):
            pid = live_pid(path)
            if pid is None:   # gone, or not a pid: an earlier job's leftover
                stale.append(path)
                continue
            raise LaunchError(f"{self.out} is the output folder of a job that is still running ({path} names "
                              f"process {pid}): give another --out, or stop that job first (Ctrl-C, or SIGTERM to its "
                              f"psgd run)")
        for path in stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _refuse_users_config(self) -> None:
        """OUT/config.toml is where the job's resolved config goes (every daemon reads it,
        and `psgd status OUT`): a file there that psgd did not write, the user's own (`psgd
        run DIR/config.toml --out DIR`), was replaced without a word, its comments and its
        own spelling lost. It is refused instead (exit 2), and nothing in the folder is
        touched. (One psgd wrote, of this version or an earlier one, is replaced.)"""
        try:
            with open(self.config_path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{self.config_path} cannot be read ({e}); psgd run writes the job's resolved config "
                              f"there: give another --out, or move that file") from None
        if not in_psgd_format(text):
            raise ConfigError(f"{self.config_path} is a config file psgd did not write (yours?); psgd run writes "
                              f"the job's resolved config there: give another --out, or move that file out of "
                              f"the folder")

    def _forget_earlier_job(self) -> None:
        """A new job in a folder that an earlier job used replaces that job's outputs:
        its coordinator state (not this job's to resume), summary.json (read as this
        job's end, it made a crash look like a finished job), event logs and daemon logs
        (this job's would be appended to them), TensorBoard scalars (tb/) -- those three
        moved to OUT/earlier/ when this job resumes that one's checkpoints; its pid files
        went in _refuse_running_job, which refused a job still running there. A model.pt
        stays until this job saves its own; shard checkpoints stay, and a shard resumes
        from one only if it is of an unfinished job of the same training config
        (psgd/servers/shard_server.py); those of a job that wrote its summary (it ended),
        and an incomplete set (some shards' only), are moved aside (`shard-I.pt.earlier`)."""
        def remove(path: str) -> None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

        remove(os.path.join(self.out, "coordinator-state.json"))
        folder = self.cfg.checkpoint_folder(self.out)
        if os.path.exists(os.path.join(self.out, "summary.json")):
            # The earlier job ended (a summary is written at the end): its shards' checkpoints
            # are not to be resumed. A shard marks its own finished when told the job is done;
            # one stopped before it was told (the coordinator died after the summary) did not.
            for path in glob.glob(os.path.join(folder, "shard-*.pt")):
                os.replace(path, path + ".earlier")
        mine = [self.cfg.checkpoint_file(self.out, i) or "" for i in range(self.cfg.cluster.servers)]
        resuming = False
        if any(os.path.exists(path) for path in mine):
            from .shard import unresumable  # (torch: only where there are checkpoints)
            cannot = unresumable(self.cfg, self.out)
            from .servers.shard_server import not_a_shard_checkpoint
            for i, path in enumerate(mine):   # (a model.pt copied in: a dict, which `unresumable` took)
                why = "" if i in cannot or not os.path.exists(path) else not_a_shard_checkpoint(path)
                if why:
                    cannot[i] = why
            cannot = dict(sorted(cannot.items()))
            self.env[SET_CHECKED_ENV] = "1"   # (read whole here: each shard reads only its own whole)
            # Said here, not only in a shard's log: the interrupted job's message promised a
            # resume, and a changed key (optimizer.lr, a smaller train.steps) loses it.
            if not cannot:
                resuming = True
                from .layout import learned
                log("run", f"resuming the unfinished job whose shard checkpoints are in {folder} (same training "
                           f"config): its training goes on from them" +
                           (f", if {own_model(self.cfg.model.name)}'s layout is the same (each shard checks it once "
                            f"the workers bring it, and says in its log if it starts afresh)"
                            if learned(self.cfg.model.name) else ""))
            elif len(cannot) == len(mine):
                first = next(i for i in cannot if os.path.exists(mine[i]))
                log("run", f"warning: not resuming from the shard checkpoints in {folder} "
                           f"({os.path.basename(mine[first])}: {cannot[first]}): "
                           f"the job starts afresh, and its checkpoints replace them")
            else:
                # Some shards would resume and the others start from the initial values: one
                # model of two versions. All of them start afresh instead (a shard resumes
                # no part either: ShardServer._resume), moved aside, with one warning here.
                not_ok = "; ".join(f"{os.path.basename(mine[i])}: " + (why if os.path.exists(mine[i]) else "missing")
                                   for i, why in cannot.items())
                for path in mine:
                    if os.path.exists(path):
                        os.replace(path, path + ".earlier")
                log("run", f"warning: only {len(mine) - len(cannot)} of the {len(mine)} shard checkpoints in "
                           f"{folder} can be resumed (not {not_ok}): not resuming a part of the model; moved "
                           f"to *.pt.earlier, the job starts afresh")
        remove(os.path.join(self.out, "summary.json"))
        # (TensorBoard reads a folder's event files as one run: two jobs' curves spliced)
        files = [(kind, path) for kind, pattern in (("events", "*.jsonl"), ("logs", "*.log"),
                                                    ("tb", "events.out.tfevents.*"))
                 for path in glob.glob(os.path.join(self.out, kind, pattern))]
        # A resumed job keeps those of the job it resumes, what they say of why it stopped, in
        # OUT/earlier/: unless that job wrote none (a resume stopped before its daemons said
        # anything), which keeps what is there, the logs of the job before it.
        keep = resuming and any(os.path.getsize(path) for _, path in files)
        earlier = os.path.join(self.out, EARLIER)
        if keep or not resuming:
            shutil.rmtree(earlier, ignore_errors=True)
        for kind, path in files:
            if not (keep and os.path.getsize(path)):
                remove(path)
                continue
            try:
                os.makedirs(os.path.join(earlier, kind), exist_ok=True)
                shutil.move(path, os.path.join(earlier, kind, os.path.basename(path)))
            except OSError as e:   # (OUT/earlier a file, say: refused, not lost)
                raise LaunchError(f"could not keep the logs of the job it resumes in {earlier}: {e}") from None
        if keep:
            log("run", f"the logs and event logs of the job it resumes are kept in {earlier}")

    def _write_token(self) -> None:
        """The job's token in OUT/.job-token (this user's only): a daemon started by hand
        with `--out OUT` (a worker restarted with `psgd worker --rank R`) joins this job
        with it (folder_token); one of another folder is still refused."""
        path = os.path.join(self.out, TOKEN_FILE)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(self.env[JOB_TOKEN_ENV])

    def _place(self, cfg: Config, avoid: int | None = None) -> Config:
        """The config with the ports the job will listen on."""
        c = cfg.cluster
        if c.addresses:
            return cfg
        n = c.servers + 1
        if self.port_explicit:
            busy = busy_port(c.host, c.port, n)
            if busy is None and not self._claim(c.port, n):
                raise LaunchError(f"cluster.port = {c.port}: another psgd run of this user chose ports of "
                                  f"{c.port}-{c.port + n - 1} for its job; set another cluster.port, or leave it "
                                  f"unset and psgd run picks a free block")
            if busy is not None:
                raise LaunchError(f"cluster.port = {c.port}: port {busy} on {c.host} is in use (the job needs "
                                  f"{c.port}-{c.port + n - 1}: the coordinator and {c.servers} shards); set "
                                  f"another cluster.port, or leave it unset and psgd run picks a free block")
            if in_ephemeral_range(c.port, n):   # a warning: --quiet too (compare's runs are quiet)
                low, high = ephemeral_ports()
                self._ports_note = (f"warning: cluster.port = {c.port}: ports {c.port}-{c.port + n - 1} lie in the "
                                    f"OS's range for outgoing connections ({low}-{high}), where a connection can take "
                                    f"a port before its daemon binds it; a port below {low} is safer")
            return cfg
        before = self._port_locks   # (a move: the old block stays held while the new one is chosen)
        port = pick_port(c.host, c.port if avoid is None else avoid + n + 1, n, claim=lambda base: self._claim(base, n))
        for f in before:
            f.close()
        if not self.quiet:   # said once the job is accepted (__init__); a move says its own line
            self._ports_note = (f"ports {port}-{port + n - 1} on {c.host} (cluster.port unset: "
                                f"{'the default block' if port == c.port and avoid is None else 'a free block'})")
        return cfg.replace(**{"cluster.port": port})

    def _claim(self, base: int, n: int) -> bool:
        """Hold ports base..base+n-1 for this job (claim_ports); False if another launcher does."""
        held = claim_ports(base, n)
        if held is None:
            return False
        self._port_locks = held
        return True

    def _release_ports(self) -> None:
        for f in self._port_locks:
            f.close()
        self._port_locks = []

    def _write_config(self) -> None:
        write_text_atomic(self.config_path, self.cfg.to_toml())

    def _move(self, why: str = "was taken by another program before the daemons bound it") -> bool:
        """A daemon found its port taken before training began: start the whole job again
        on another block, if the launcher chose the ports. True if it did."""
        started = glob.glob(os.path.join(self.out, "events", "worker-*.jsonl"))
        if self.port_explicit or self.cfg.cluster.addresses or started or self.moves >= MAX_MOVES:
            return False
        self.moves += 1
        self._stop_children()
        old = self.cfg.cluster.port
        self.cfg = self._place(self.cfg, avoid=old)
        log("run", f"port block {old} {why}; moved the job to {self.cfg.cluster.port}")
        self._write_config()
        self.children, self.started, self._shown_started = [], set(), 0
        self.start()
        return True

    def _refused_by_another_job(self, child: Child) -> bool:
        """Did `child` (this process of it) reach another job's coordinator on this job's
        port? Another launcher chose the block at the same moment, and its coordinator
        bound the port first. This job's own coordinator need not then fail to bind it:
        the other job may have moved away (one of its shards lost the race) before this
        one's coordinator bound the port, its daemons already refused. Either way the
        block is contested, and the job moves."""
        return "belongs to another job" in self.tail(child, 3, since_start=True)

    def _coordinator_died(self, coord: Child, code: int) -> bool:
        """The coordinator ended without a summary, killed (a signal) or crashed (not
        its own exit codes 0, 1, 2; or 1, a Python error's, while its state file says the
        job was under way: its own 1s, an abort or a rendezvous given up, come with a
        summary or before training): start it again; it resumes from its state file, and
        the other daemons reconnect. True if it did."""
        if code in (0, 2, EXIT_ADDRESS_IN_USE) or os.path.exists(os.path.join(self.out, "summary.json")):
            return False
        if code == 1 and not self._under_way():
            return False
        self._restart(coord, code, "the coordinator")
        return True

    def _restart(self, child: Child, code: int, who: str, ends: str = "") -> None:
        """Start `child` (`who`) again after it exited with `code`; after MAX_RESTARTS
        restarts, give up instead (LaunchError, `ends` said after why)."""
        if child.restarts >= MAX_RESTARTS:
            raise LaunchError(f"{who} keeps dying (exit {_exit(child, code)}); gave up after {MAX_RESTARTS} restarts"
                              + (f"; {ends}" if ends else ""))
        child.restarts += 1
        log("run", f"{who} exited with {_exit(child, code)}; restarting it (restart {child.restarts})")
        self._start(child)

    def _state(self) -> dict:
        """The coordinator's state file ({} where there is none yet): it is rewritten at
        every change of phase, and at an abort."""
        from .servers.coordinator import STATE_FILE
        try:
            with open(os.path.join(self.out, STATE_FILE)) as f:
                state = json.load(f)
        except (OSError, ValueError):
            return {}
        return state if isinstance(state, dict) else {}

    def _under_way(self) -> bool:
        """Whether the coordinator's state file says the job had begun training and not
        ended."""
        from .servers.coordinator import UNDER_WAY
        return self._state().get("phase") in UNDER_WAY

    def _ending(self) -> bool:
        """Whether the coordinator has ended the job or is ending it: summary.json is
        written, or its state file says the job was aborted or its training is over. It
        takes no worker then ("the job is finishing; no new workers")."""
        from .servers.coordinator import FINISHING
        state = self._state()
        return (os.path.exists(os.path.join(self.out, "summary.json")) or bool(state.get("abort"))
                or state.get("phase") in FINISHING)

    def _restarted(self, child: Child) -> bool:
        """Whether a child that exited with a code other than 0 is started again: a shard
        and the evaluator are; a worker with --restart-workers is, unless the job is
        ending: a worker exits 1 on the job's abort, and the coordinator takes no new
        worker then (restarted, it was refused, and the job's error gave the exit codes
        of those refused processes, not of the ones that ended it). The worker whose
        error aborted the job may exit before the coordinator's state file says so: that
        gets up to ENDING_WAIT_S."""
        if child.role in ("server", "evaluator"):
            return True
        return child.role == "worker" and self.restart_workers and not self._within(ENDING_WAIT_S, self._ending)

    @staticmethod
    def _within(seconds: float, happened: Callable[[], bool]) -> bool:
        """Whether `happened()` is true now or becomes true within `seconds`."""
        end = time.monotonic() + seconds
        while not happened():
            if time.monotonic() >= end:
                return False
            time.sleep(0.1)
        return True

    def _argv(self, role: str, *extra: str) -> list[str]:
        return [sys.executable, "-m", "psgd", role, self.config_path, "--out", self.out, *extra]

    def started_file(self, name: str) -> str:
        return os.path.join(self.out, "logs", f"{name}.started")

    def _spec(self, role: str, index: int, *extra: str) -> Child:
        name = f"{role}-{index}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.started_file(name))  # from an earlier job in this folder
        return Child(role, index, self._argv(role, *extra, "--started-file", self.started_file(name)))

    def _worker_spec(self, rank: int) -> Child:
        """Worker `rank`, with LOCAL_RANK set to it: `--device auto` takes GPU
        rank % (GPUs here), one per worker, where every worker took GPU 0."""
        child = self._spec("worker", rank, "--rank", str(rank), "--device", self.device)
        child.env = {**self.env, "LOCAL_RANK": str(rank)}
        return child

    def _script_spec(self, rank: int) -> Child:
        """A copy of the training script as worker `rank` (psgd/connection.py reads the
        PSGD_* variables); its device is its own choice: PSGD_DEVICE is `--device` and
        LOCAL_RANK its rank on this machine, which `psgd.device()` reads."""
        name = f"worker-{rank}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.started_file(name))
        env = {**self.env, "PSGD_CONFIG": self.config_path, "PSGD_OUT": self.out, "PSGD_RANK": str(rank),
               "PSGD_STARTED_FILE": self.started_file(name), "PSGD_DEVICE": self.device, "LOCAL_RANK": str(rank)}
        assert self.script is not None
        return Child("worker", rank, [sys.executable, *self.script], env, script=True)

    def _start(self, child: Child) -> None:
        """A training script's stdout and stderr both go to its log (one file description,
        so in the order written; PYTHONUNBUFFERED is set). psgd's own daemons write
        everything they say to stderr (psgd/log.py) and nothing to stdout, which is
        discarded: the coordinator's would otherwise mix into psgd run's own stdout, the
        summary lines."""
        def popen(stderr: IO[str] | None) -> subprocess.Popen:
            stdout = stderr if child.script and stderr is not None else subprocess.DEVNULL
            return subprocess.Popen(child.argv, stdout=stdout, stderr=stderr, env=child.env or self.env,
                                    stdin=subprocess.DEVNULL)

        if child.script:
            with contextlib.suppress(FileNotFoundError):  # psgd.connect writes it: see _exited_before_connect
                os.unlink(self.started_file(child.name))

        if child.role == "coordinator" and not self.quiet:
            child.proc = popen(None)  # progress goes to the terminal
            return
        child.log_path = os.path.join(self.out, "logs", f"{child.name}.log")
        child.log_start = os.path.getsize(child.log_path) if os.path.exists(child.log_path) else 0
        server = self._forks(child)
        if server is not None:
            try:
                child.proc = server.spawn(child.argv[3:], child.env or self.env, child.log_path)
            except forkserver.ForkServerError as e:   # it died since it was started (killed, say)
                raise LaunchError(f"could not start {child.name}: {e}") from None
            return
        # Appended to across restarts. The child gets its own copy of the descriptor, so
        # this process closes its handle at once: none accumulates, however many restarts.
        with open(child.log_path, "a") as log_file:
            child.proc = popen(log_file)

    def _forks(self, child: Child) -> forkserver.ForkServer | None:
        """The fork server for a daemon that imports torch (`python -m psgd server|worker|
        evaluator`; the coordinator needs no torch and starts at once on its own)."""
        if child.argv[:3] != [sys.executable, "-m", "psgd"] or child.role == "coordinator" \
                or not self.cfg.cluster.fork:
            return None
        return forkserver.server(self.env)

    def start(self) -> None:
        c = self.cfg.cluster
        warning = oversubscribed(self.cfg)
        if warning and warning not in _warned:
            _warned.add(warning)
            log("run", warning)
        self._write_token()
        specs = [self._spec("coordinator", 0, "--launched-at", repr(self.launched_at))]
        specs += [self._spec("server", i, "--shard", str(i)) for i in range(c.servers)]
        if self.script:
            specs += [self._script_spec(r) for r in range(c.workers)]
        else:
            specs += [self._worker_spec(r) for r in range(c.workers)]
        if c.evaluator:
            specs.append(self._spec("evaluator", 0, "--device", self.device))
        places, said = cpu_places(self.cfg, bool(self.script), self.env.get("OMP_NUM_THREADS", ""))
        if said and not (places and self.quiet):   # (why nothing is pinned is said, as a warning is)
            log("run", said)
        for child in specs:
            if child.name in places:
                child.env = {**(child.env or self.env), CPU_ENV: str(places[child.name])}
        # The fork server's import of torch before the coordinator starts (`_forks` starts it
        # for the first daemon it forks): the coordinator waits cluster.timeout_s from its
        # start for every worker, and that import took 30 s of its 60 on a busy 2-core
        # machine (12 workers), up to READY_S on a busier one. Then the coordinator and what
        # is not forked (a training script: a new interpreter, as slow to start as it) at
        # once; the forked daemons once the coordinator has loaded its code.
        later = [child for child in specs[1:] if self._forks(child) is not None]
        self._starting = len(specs)
        if self.on_started is not None:   # (0 again after a move)
            self.on_started(len(self.started), self._starting)
        for child in [c for c in specs if c not in later] + later:
            if later and child is later[0]:
                self._until_started(specs[0])
            self._start(child)
            self.children.append(child)
            self.show_started()   # (forking them all took tens of seconds on a busy machine: said as they start)

    def _until_started(self, child: Child) -> None:
        """Wait (cluster.timeout_s at most) until the coordinator has loaded its code, before
        the forked daemons start: each waits cluster.timeout_s from its own start for it,
        and they start at once, where it is a new interpreter (as a training script is,
        which starts beside it: after it, a script job's start-up took 0.17 s longer). On a
        busy machine it came up 7 s after the workers: with a timeout of 6 s they gave up
        first, blaming its address, and a rank it had counted was lost ("1 worker lost",
        exit 0). Now its wait ends first, with its hint ("raise cluster.timeout_s"). On an
        idle machine it is up before the fork server has imported torch. One that died is
        the watch's to report."""
        path, end = self.started_file(child.name), time.monotonic() + self.cfg.cluster.timeout_s
        while not os.path.exists(path) and child.poll() is None and time.monotonic() < end:
            time.sleep(0.01)

    def show_started(self) -> None:
        """Count the children that have loaded their code; say so when the count grows."""
        total = max(self._starting, len(self.children))
        if len(self.started) == total:
            return
        self.started |= {c.name for c in self.children if os.path.exists(self.started_file(c.name))}
        n = len(self.started)
        if n != self._shown_started:
            self._shown_started = n
            if self.on_started is not None:
                self.on_started(n, total)
            if not self.quiet:
                took = f" in {time.monotonic() - self._launched_mono:.1f} s" if n == total else ""
                log("run", f"started {n}/{total} processes{took}")

    def _ends(self, child: Child) -> str:
        """"LOG ends:" and its last lines, or that it is empty: a copy of a script killed
        before it printed anything (the message ended in a colon and a blank line)."""
        tail = self.tail(child)
        return f"{child.log_path} ends:\n{tail}" if tail.strip() else f"{child.log_path} is empty"

    def _cannot_write(self, child: Child) -> str:
        """A daemon exited with EXIT_CANNOT_WRITE: the file it could not write and why, as
        its log's last line says, or (that log being on the same full disk, or the
        coordinator's on the terminal) what the output folder's file system says. It is
        not started again: it would fail the same way."""
        said = self.tail(child, 1).strip()
        said = said.split(": error: ", 1)[1] if ": error: cannot write " in said else ""
        return f"{child.name} could not write the job's outputs ({said or folder_fault(self.out)})"

    def _say_warnings(self, coord: Child) -> None:
        """A quiet job's (--quiet, psgd compare's runs): the coordinator's warnings, which
        went to its log only (shards that did not resume, or hold nothing; scripts that
        closed before the budget), each said once by this process."""
        for line in self.tail(coord, 10_000).splitlines():
            said = line.removeprefix("[psgd coordinator] ")
            if said.startswith("warning: ") and said not in _warned:
                _warned.add(said)
                log("coordinator", said)

    def tail(self, child: Child, n: int = 12, since_start: bool = False) -> str:
        """The last `n` lines of the child's log; `since_start`: of what its current
        process wrote (the log also holds its earlier processes', before a restart or a move)."""
        if not child.log_path or not os.path.exists(child.log_path):
            return ""
        with open(child.log_path, errors="replace") as f:
            if since_start:
                f.seek(child.log_start)
            return "".join(f.readlines()[-n:])

    def wait(self) -> dict:
        """Supervise until the coordinator exits; returns summary.json's contents."""
        coord = self.children[0]
        deadline = time.monotonic() + self.timeout_s
        while True:
            code = coord.poll()
            in_use = [c for c in self.children if c.role in ("coordinator", "server")
                      and c.poll() == EXIT_ADDRESS_IN_USE]
            if in_use and self._move():
                coord = self.children[0]
                continue
            if in_use:
                child = in_use[0]
                said = self.tail(child, 2).strip() or f"a port of {self.cfg.cluster.port}-" \
                    f"{self.cfg.cluster.port + self.cfg.cluster.servers} is in use"
                raise LaunchError(f"{child.name} could not listen: {said}")
            if code == EXIT_CANNOT_WRITE and not os.path.exists(os.path.join(self.out, "summary.json")):
                raise LaunchError(self._cannot_write(coord) + "; a restart would fail the same way")
            if code is not None and self._coordinator_died(coord, code):
                continue
            if code is not None:
                break
            if time.monotonic() > deadline and not os.path.exists(os.path.join(self.out, "summary.json")):
                raise LaunchError(f"the job did not finish within {self.timeout_s:g} s")   # (done: it lingers)
            self.show_started()
            for child in self.children[1:]:
                rc = child.poll()
                if rc is None:
                    continue
                if rc != 0 and self._refused_by_another_job(child):
                    if not self._move(f"is another job's (its coordinator refused {child.name})"):
                        raise LaunchError(f"{child.name} reached another job's coordinator on this job's port "
                                          f"{self.cfg.cluster.port} and was refused; {self._ends(child)}")
                    coord = self.children[0]
                    break
                if rc == EXIT_CANNOT_WRITE and not child.reported and not child.script:
                    if not os.path.exists(os.path.join(self.out, "summary.json")):
                        raise LaunchError(self._cannot_write(child) + "; the job is stopped, as a restart "
                                                                      "would fail the same way")
                    # The job's end is written: a shard's checkpoint at exit, of a job that ended
                    # (never resumed), is all that is lost
                    log("run", f"warning: {self._cannot_write(child)}")
                    child.reported = True
                    continue
                self._exited_before_connect(child, rc)
                if rc == 0 or child.reported:
                    continue
                if rc == 1 and child.role in ("server", "evaluator") and coord.poll() is None \
                        and "lost the coordinator" in self.tail(child, 3):
                    ends = self.tail(coord)   # (none on the terminal's job: its lines went there)
                    raise LaunchError(f"{child.name} lost the coordinator (no answer for cluster.timeout_s = "
                                      f"{self.cfg.cluster.timeout_s:g} s), whose process still runs: is it stopped "
                                      f"(SIGSTOP) or hung?" + (f" Its log ends:\n{ends}" if ends.strip() else ""))
                if rc == 2 and child.role in ("server", "evaluator"):   # a ConfigError (a DataError): a restart
                    said = self.tail(child, 1).strip().removeprefix("psgd: error: ")   # would say it again
                    raise LaunchError(f"{child.name} stopped: {said} (logs in {os.path.join(self.out, 'logs')})")
                if self._restarted(child):
                    self._restart(child, rc, child.name, self._ends(child))
                elif not child.reported:
                    log("run", f"{child.name} exited with {_exit(child, rc)}; {self._ends(child)}")
                    child.reported = True  # the coordinator decides what follows
            time.sleep(0.1)
        grace = time.monotonic() + 10
        for child in self.children[1:]:
            while child.poll() is None and time.monotonic() < grace and not _stopped(child):
                time.sleep(0.05)
        if self.quiet:
            self._say_warnings(coord)
        path = os.path.join(self.out, "summary.json")
        summary = None
        if os.path.exists(path):
            with open(path) as f:
                summary = json.load(f)
        if summary is not None and summary.get("aborted"):  # the reason is one line: say it, no log dump
            raise self.aborted(summary)
        if summary is None:
            state = self._state()
            if code == 1 and state.get("phase") == "done" and state.get("abort"):   # it gave up before training:
                # why, in one line, and its own log's end where it has one (--quiet), not every daemon's "no answer"
                said = self.tail(coord, 1).strip().removeprefix("[psgd coordinator] ")
                raise LaunchError(f"the coordinator: {said if state['abort'] in said else state['abort']}; logs in "
                                  f"{self.out}/logs")
            # (the coordinator's own too, where it has a log, with --quiet: its reason is there, not on the terminal)
            tails = "\n".join(f"--- {c.name} ---\n{self.tail(c)}" for c in self.children if self.tail(c))
            raise LaunchError(f"the coordinator ended without a summary (exit code {code}); logs in "
                              f"{self.out}/logs\n{tails}")
        if code != 0:   # it wrote this job's summary (an earlier job's is removed at the start), then died
            log("run", f"the coordinator exited with {_code(code)} after writing the job's summary, while it "
                       f"waited for every daemon to hear that the job was done; the summary stands")
        self._scripts_end(deadline)
        return summary

    def aborted(self, summary: dict) -> LaunchError:
        """The error of a job that ended aborted (its summary's `aborted`)."""
        return LaunchError(f"job aborted: {summary['aborted']} ({self.worker_exits()}); logs in {self.out}/logs")

    def ended(self) -> dict | None:
        """This job's summary if the job has ended with nothing of its work left undone,
        else None: its summary.json is written (an earlier job's was removed at the
        start), and every training script has ended by itself, with code 0 (its work
        after close() done). A signal to psgd run that comes then, while the coordinator
        tells the daemons the job is done (up to linger_s) or the launcher waits for them
        to exit, cut nothing short: the job's outputs are complete."""
        try:
            with open(os.path.join(self.out, "summary.json")) as f:
                summary = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(summary, dict) or any(c.script and (c.proc is None or c.poll() != 0)
                                                for c in self.children):
            return None
        return summary

    def _scripts_end(self, deadline: float) -> None:
        """Wait for every training script to end: after close() it may go on (score
        DIR/model.pt, save its results), up to the job's --timeout (`deadline`), saying
        which one it waits for after 2 s and every SCRIPT_NOTE_S (psgd run is otherwise
        silent meanwhile). A script still running then, or one that ended with a code
        other than 0, is the run's failure, with its log's end."""
        scripts = [c for c in self.children if c.script]
        for child in [c for c in scripts if c.restarts and c.poll() is None and not self._joined(c)]:
            # Restarted by --restart-workers, it had not rejoined when the job ended: it
            # has no work after close(), and its psgd.connect would wait cluster.timeout_s
            # for a coordinator that is gone, then fail the finished job.
            log("run", f"{child.name}'s restarted script had not rejoined the job when it ended: stopping it")
            scripts.remove(child)
            self._stop_children([child])
            self._note(child, "this restarted copy of the script had not rejoined the job when the job ended: "
                              "psgd run stopped it")
        said = time.monotonic() - SCRIPT_NOTE_S + 2.0   # (the first note after 2 s: most end at once)
        for child in scripts:
            while child.poll() is None and time.monotonic() < deadline:
                if time.monotonic() - said >= SCRIPT_NOTE_S:
                    log("run", f"the job has ended; waiting for {child.name}'s script to end")
                    said = time.monotonic()
                time.sleep(0.1)
        failed = [self._script_failure(c) for c in scripts if c.poll() != 0]
        if failed:
            raise LaunchError("\n".join(failed) + f"\n(the job itself ended: {self.out}/summary.json)")

    def _joined(self, child: Child) -> bool:
        """Whether this copy of a training script joined the job (psgd.connect registered it)."""
        try:
            with open(self.started_file(child.name)) as f:
                return f.read() == JOINED
        except FileNotFoundError:
            return False

    def _note(self, child: Child, text: str) -> None:
        """Add what psgd run said of this ended child to the end of its log, which psgd
        run's own messages point at (rank 0's for a missing model.pt): a copy it stopped
        wrote no reason there."""
        if child.log_path:
            with contextlib.suppress(OSError), open(child.log_path, "a") as f:
                f.write(f"[psgd run] {text}\n")

    def _script_failure(self, child: Child) -> str:
        """How a training script failed the run, with its log's end."""
        rc = child.poll()
        how = (f"was still running at the job's --timeout ({self.timeout_s:g} s): stopped it" if rc is None
               else f"exited with code {_exit(child, rc)}")
        return f"{child.name}'s script {how}; {self._ends(child)}"

    def _exited_before_connect(self, child: Child, rc: int) -> None:
        """A training script that ends before the job began training never comes back:
        the coordinator would wait for its rank until cluster.timeout_s. So the job stops
        now, with the script's log: one that ended before psgd.connect wrote its .started file
        (its `--help`, a bad argument, an import error, or psgd.connect's refusal of its
        arguments, rank or folder, which comes before that file), or in
        psgd.connect, before any worker began training (refused, say). Not one that
        --restart-workers starts again: one that failed (code != 0) after calling
        psgd.connect, or one killed by a signal. A worker of psgd's own that fails (code
        != 0) before the job began training, and that --restart-workers does not start
        again, is the same: its model factory raised on this machine, it was killed for
        memory."""
        if child.role != "worker" or (self.restart_workers and rc < 0) or (not child.script and rc == 0):
            return
        if child.script and not os.path.exists(self.started_file(child.name)) and not (
                child.restarts and self._training_began()):   # (a restarted copy mid-job: its rank is lost)
            when = "before joining the job (no psgd.connect, or one that refused it before registering)"
        elif not (self.restart_workers and rc != 0) and not self._training_began():
            when = "in psgd.connect, before the job began training" if child.script else "before the job began training"
            coord = self.children[0]
            if self._within(2.0, lambda: coord.poll() is not None or self._ending()):
                return  # the coordinator ended the job (refused it, say): its summary says why
        else:
            return
        which = f"{child.name}'s script" if child.script else child.name
        raise LaunchError(f"{which} exited with code {_exit(child, rc)} {when}; the job cannot start "
                          f"without it. {self._ends(child)}")

    def _training_began(self) -> bool:
        """Whether a worker of this job has begun training: it opens its step log
        (DIR/events/worker-R.jsonl) once every worker has registered."""
        return any(written_since(path, self._events_before) for path in glob.glob(self._step_logs))

    def worker_exits(self) -> str:
        """How each worker process ended, for a failed job's message: "worker exit codes:
        worker-0 1, worker-1 -9 (SIGKILL)" (a restarted worker: its last process)."""
        parts, codes = [], []
        for child in self.children:
            if child.role != "worker" or child.proc is None:
                continue
            rc = child.poll()
            codes.append(rc)
            parts.append(f"{child.name} still running" if rc is None else f"{child.name} {_exit(child, rc)}")
        if not parts:
            return "no worker processes"
        hint = ("; a script that exits without ps.close() (or leaving `with psgd.connect(...)`) leaves the job "
                "without a word" if self.script and all(rc == 0 for rc in codes) else "")
        return "worker exit codes: " + ", ".join(parts) + hint

    def stop(self) -> None:
        """End every daemon of the job, and leave the output folder to the next one."""
        try:
            self._stop_children()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.out, TOKEN_FILE))   # no job of its own runs there now
            self._release_folders()
            self._release_ports()

    def let_scripts_leave(self) -> KeyboardInterrupt | None:
        """A Ctrl-C: wait up to SCRIPT_LEAVE_S, saying so, for the training scripts to exit
        by themselves before the stop (a terminal's Ctrl-C reaches psgd run's whole process
        group: the scripts, and the daemons, which stop on it). A script still running then
        is stopped with the rest (SIGTERM). Another signal meanwhile ends the wait: it is
        returned, for the caller to raise once the daemons are stopped. (A SIGINT sent to
        psgd run alone, `kill -INT PID`, reaches no script: it waits the whole time.)"""
        running = [c for c in self.children if c.script and c.proc and c.proc.poll() is None]
        if not running:
            return None
        log("run", f"waiting up to {SCRIPT_LEAVE_S:g} s for the training scripts to leave the job on their "
                   f"Ctrl-C (another Ctrl-C stops them now)")
        end = time.monotonic() + SCRIPT_LEAVE_S
        try:
            for child in running:
                self._exits_by(child, end)
        except KeyboardInterrupt as e:   # (SIGTERM's and SIGHUP's too)
            log("run", "stopping the training scripts now")
            return e
        return None

    def _stop_children(self, children: list[Child] | None = None) -> None:
        """End these daemons (default: all of the job's): SIGTERM, then SIGKILL after
        `stop_s`; a shard writing its checkpoint at exit is waited for (said) until
        `saving_s` after SIGTERM, and one killed before it wrote it is said."""
        children = self.children if children is None else children
        for child in children:
            if child.proc and child.proc.poll() is None:
                child.proc.terminate()
                # (a stopped one, SIGSTOP, takes its SIGTERM so, as after a shell's kill: it was
                # killed 5 s later, a shard's checkpoint unwritten)
                child.proc.send_signal(signal.SIGCONT)
        start = time.monotonic()
        for child in children:
            if child.proc and not self._exits_by(child, start + self.stop_s):
                if self._saving(child) and not self._saved_by(child, start + self.saving_s):
                    self._kill(child, f"{self.saving_s:g} s", self._lost_checkpoint(child))
                elif child.proc.poll() is None:
                    self._kill(child, f"{self.stop_s:g} s")
        for child in children:   # one killed (-9) left its pid file (and its note): it is gone, so go they
            if child.proc and child.proc.poll() is not None:
                for path in (pid_path(self.out, child.name), pid_path(self.out, child.name, "saving")):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)

    @staticmethod
    def _exits_by(child: Child, end: float) -> bool:
        """Whether the child's process exits by `end` (time.monotonic())."""
        assert child.proc is not None
        try:
            child.proc.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        return True

    def _saving(self, child: Child) -> bool:
        """Whether the child is a shard writing its checkpoint at exit: its note
        (`metrics.pid_path`) names its process (one a killed process left names another)."""
        assert child.proc is not None
        try:
            with open(pid_path(self.out, child.name, "saving")) as f:
                return f.read().strip() == str(child.proc.pid)
        except OSError:
            return False

    def _saved_by(self, child: Child, end: float) -> bool:
        """Wait, saying so, for a shard writing its checkpoint at exit, until it exits or
        `end`; whether it exited."""
        log("run", f"{child.name} is writing its checkpoint; waiting for it (up to {end - time.monotonic():.0f} s "
                   f"more)")
        return self._exits_by(child, end)

    def _lost_checkpoint(self, child: Child) -> str:
        """What a shard killed while it wrote its checkpoint lost."""
        path = self.cfg.checkpoint_file(self.out, child.index)
        return f" while it wrote its checkpoint; {path} is the one written before, if any"

    def _kill(self, child: Child, after: str, lost: str = "") -> None:
        """SIGKILL the child, which did not exit within `after` of SIGTERM, and say so
        (with `lost`, what it lost)."""
        assert child.proc is not None
        child.proc.kill()
        log("run", f"{child.name} did not exit within {after} of SIGTERM: killed (SIGKILL){lost}")
        try:
            child.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:   # e.g. its fork server is stopped: no exit code comes
            log("run", f"{child.name} (pid {child.proc.pid}) did not report its end after SIGKILL; leaving it")


def check_before_launch(cfg: Config, device: str) -> None:
    """What would fail every daemon of a job after it started, as one ConfigError now:
    a device torch cannot use here, CurveZMQ keys that are not there, a cluster.host that
    does not resolve, a checkpoint.dir that cannot be written (the shards logged the
    failure and went on without checkpoints)."""
    if device not in ("auto", "cpu"):   # those two need no check (nor torch imported here)
        from .replica import check_device
        check_device(device)
    if cfg.security.curve:
        from .transport import check_keys
        check_keys(cfg.security.keys)
    try:
        socket.getaddrinfo(cfg.cluster.host, None)
    except OSError as e:   # a host name that does not resolve: every daemon's bind or connect would fail
        raise ConfigError(f"cluster.host = {cfg.cluster.host!r} does not resolve here: {e.strerror or e}") from None
    if cfg.checkpoint.dir:
        try:
            os.makedirs(cfg.checkpoint.dir, exist_ok=True)
            tempfile.TemporaryFile(dir=cfg.checkpoint.dir).close()
        except OSError as e:
            raise ConfigError(f"checkpoint.dir = {cfg.checkpoint.dir!r} cannot be written: "
                              f"{e.strerror or e}") from None


def folder_fault(out: str) -> str:
    """What the file system of the output folder `out` tells of a write that failed there."""
    if not os.path.isdir(out):
        return f"{out} is gone: removed while the job ran"
    try:
        st = os.statvfs(out)
    except OSError as e:
        return f"{out}: {e.strerror}"
    if st.f_flag & os.ST_RDONLY:
        return f"{out} is on a read-only file system"
    if st.f_bavail == 0 or st.f_favail == 0:
        return f"no space left on the device of {out}"
    return (f"in {out}: a full disk ({st.f_bavail * st.f_frsize:,} bytes free now), or a file there that cannot "
            f"be written")


def folder_token(out: str) -> str:
    """The token of the `psgd run` job running in the output folder `out` ('' if none):
    what a daemon started by hand with `--out OUT` and no PSGD_JOB_TOKEN of its own
    registers with, so that it can join that job (its coordinator refuses a daemon of
    another job, and of none)."""
    try:
        with open(os.path.join(out, TOKEN_FILE)) as f:
            return f.read().strip()
    except OSError:
        return ""


_adopted = ""   # the job token `adopt_folder_token` last set (not one the process was given)


def adopt_folder_token(out: str | None) -> None:
    """A process started by hand with the output folder of a running `psgd run` job (a
    worker restarted with `--rank R`, a training script calling `psgd.connect`) and no
    PSGD_JOB_TOKEN of its own: that job's token, so that its coordinator takes the
    process for one of the job's (it refuses a daemon of another job, and of none). A
    token taken so is the folder's only: a later call (a notebook's or a sweep's next
    `psgd.connect`) takes its own folder's, or none; one the process was given stays."""
    global _adopted
    given = os.environ.get(JOB_TOKEN_ENV, "")
    if given and given != _adopted:
        return
    token = folder_token(out) if out else ""
    if token:
        os.environ[JOB_TOKEN_ENV] = token
    else:
        os.environ.pop(JOB_TOKEN_ENV, None)
    _adopted = token


Stamp = tuple[int, int, int, int]


def file_stamps(paths: list[str]) -> dict[str, Stamp | None]:
    """Each file's (device, inode, mtime in ns, size), None for one that does not exist:
    taken at a job's launch, `written_since` tells its own files from an earlier job's."""
    stamps: dict[str, Stamp | None] = {}
    for path in paths:
        try:
            st = os.stat(path)
            stamps[path] = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stamps[path] = None
    return stamps


def written_since(path: str, before: dict[str, Stamp | None]) -> bool:
    """Whether the file exists and was written (or replaced) since its stamp was `before`
    (`file_stamps`; absent from it: did not exist then): this job's, not an earlier job's
    in the same output folder. Not judged by its mtime against the job's launch: a wall
    clock stepped back during the job (NTP, a VM resumed) made this job's files look older
    than its launch, and one stepped back since an earlier job made that job's newer."""
    now = file_stamps([path])[path]
    return now is not None and now != before.get(path)


def resumable(cfg: Config, out: str, before: dict[str, Stamp | None]) -> bool:
    """Whether a psgd run into `out` would resume from the shards' checkpoints of the job
    whose launch found the files `before` (`file_stamps`): every shard wrote its own, and
    the job wrote no summary.json (a job that ended is not resumed:
    LocalJob._forget_earlier_job)."""
    if os.path.exists(os.path.join(out, "summary.json")):
        return False
    files = [cfg.checkpoint_file(out, i) for i in range(cfg.cluster.servers)]
    return all(path and written_since(path, before) for path in files)


def _exit(child: Child, rc: int) -> str:
    """A daemon's exit code as said in messages, or why it is not known."""
    proc = child.proc
    if isinstance(proc, forkserver.Forked) and proc.code_lost:
        server = proc.server.proc.returncode
        return f"an unknown code: the fork server that started it ended (exit {_code(server)}), and it with it"
    return _code(rc)


def _code(rc: int) -> str:
    """An exit code as said in messages: "1", "-9 (SIGKILL)"."""
    if rc >= 0:
        return str(rc)
    try:
        return f"{rc} ({signal.Signals(-rc).name})"
    except ValueError:
        return f"{rc} (a signal)"


def default_timeout(cfg: Config) -> float:
    """How long `psgd run` waits for a job by default (`--timeout`): an hour, or the
    job's `train.seconds` and ten minutes more when that is longer."""
    return max(3600.0, cfg.train.seconds + 600.0)


def run_local(cfg: Config, out: str, **kw) -> dict:
    """Run the job; its summary. A Ctrl-C, SIGTERM or SIGHUP (KeyboardInterrupt) still
    raises, once the daemons are stopped; one that came after the job had ended (while
    its coordinator told the daemons so, or its scripts' work after close() was waited
    for, or its daemons were stopped) carries the job's end (`ended_before`): psgd run
    reports the job, not an interrupt (psgd compare keeps that run, and stops). One held while the
    daemons stopped (`signals_held`) comes then: after a Ctrl-C, it is the one raised
    (a hang-up's exit code, 129)."""
    raise_fd_limit()   # (its own and its children's: a log and pipes a child here, a connection a peer there)
    job = LocalJob(cfg, out, **kw)
    end: dict | BaseException | None = None   # its summary, or what ended it
    try:
        job.start()
        summary = end = job.wait()
    except BaseException as e:
        end = e
        raise
    finally:   # (also on a signal in `except`: the daemons are stopped, and waited for)
        # The stop runs whatever signal comes before its own are held: a second Ctrl-C
        # microseconds after the first (GNU timeout passes one on to the group it had) cut
        # it out, and psgd run said "its daemons are stopped" while they still wrote their
        # checkpoints. The latest signal is the one raised: one that cut the scripts' wait
        # short, or one held while the daemons stopped.
        again: KeyboardInterrupt | None = None
        waited = stopped = False
        while not stopped:
            try:
                if type(end) is KeyboardInterrupt and not waited:   # (a Ctrl-C's, not SIGTERM's or SIGHUP's)
                    waited = True
                    again = job.let_scripts_leave()
                with signals_held():
                    job.stop()   # (first: a script that the stop cut short has not ended with 0)
                    stopped = True
            except KeyboardInterrupt as e:
                again = e
        if again is not None:
            again.ended = _ended(job, end)  # type: ignore[attr-defined]
            raise again
        if isinstance(end, KeyboardInterrupt):
            end.ended = _ended(job, end)  # type: ignore[attr-defined]
    return summary


def _stopped(child: Child) -> bool:
    """Whether the child's process is stopped (SIGSTOP: state T; t, traced): it will not exit
    by itself (`_stop_children` wakes it with its SIGTERM)."""
    stat = proc_stat(child.proc.pid) if child.proc else None
    return stat is not None and stat[0] in "Tt"


def _ended(job: LocalJob, end: dict | BaseException | None) -> dict | LaunchError | None:
    """How the job had ended when a signal came (`ended_before`), given what ended
    run_local (`end`): its summary or LaunchError; after a signal, what its folder
    says (`LocalJob.ended`); else None."""
    if isinstance(end, KeyboardInterrupt):
        summary = job.ended()
        return job.aborted(summary) if summary and summary.get("aborted") else summary
    return end if isinstance(end, (dict, LaunchError)) else None


def ended_before(e: KeyboardInterrupt) -> dict | LaunchError | None:
    """How the job had ended when the signal `e` stopped run_local: its summary, the
    LaunchError of an aborted job (as wait() raises it), or None: it had not ended."""
    ended = getattr(e, "ended", None)
    return ended if isinstance(ended, (dict, LaunchError)) else None


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP held while the daemons are being stopped (a bounded
    wait): one then would cut the stop short and leave them running. Held, not ignored:
    the first comes, to the handler that was there, once the stop is over (unless it
    ended with an exception: the command is stopping already). A hang-up sends this
    process's output away from the dead terminal at once (`cli._hung_up_terminal`): the
    lines the stop and the command's end write would fail (EIO)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from .cli import _hung_up_terminal
    came: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if signum == signal.SIGHUP:
            _hung_up_terminal()
        came.append(signum)
    held = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for s, handler in held.items():
        if handler is not signal.SIG_IGN:   # (one ignored stays so: SIGHUP under nohup)
            signal.signal(s, hold)
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)
    if came:
        signal.raise_signal(came[0])


def own_model(name: str) -> str:
    """A learned model as a sentence names it: a script's is "the script's model"."""
    return "the script's model" if name == "script" else name


def format_summary(s: dict) -> str:
    acc = s.get("final_accuracy")
    ttt = s.get("time_to_target_s")
    target = s.get("target_accuracy")
    from .report_numbers import AFTER_END, FIRST_SCORE, amount, lost_words, ttt_flag
    flag = ttt_flag(s, None)
    virtual = bool(s.get("simulated"))   # psgd simulate's: virtual seconds, finer than a real run's tenths,
    at = "{:.3f} virtual s".format if virtual else "{:.1f} s".format   # and no start-up (nothing started)
    if ttt is None:   # (nothing scored: nothing to say of the target)
        reached = f"target {target} not reached" if acc is not None or s.get("evals") else ""
    elif flag == AFTER_END:   # first seen by a score after training: when it looked
        # (the final score, or one the evaluator read before it knew training had ended)
        first: dict = next((e for e in s.get("evals") or [] if e.get("accuracy") is not None
                              and target is not None and e["accuracy"] >= target), {})
        by = "the final score" if first.get("final") else "a score"
        reached = f"target {target} first seen by {by} ({at(ttt)}), after training"
    elif flag == FIRST_SCORE:   # there at the first score (the evaluator's, or a script's report): when it looked
        reached = f"target {target} reached by the first score ({at(ttt)}): when it looked"
    else:
        reached = f"time to {target}: {at(ttt)}"
    last = s["evals"][-1] if s.get("evals") else None
    parts = [f"{s['mode']}: accuracy {acc:.4f}" if acc is not None else
             f"{s['mode']}: no final evaluation (the last score, during training: accuracy "
             f"{last['accuracy']:.4f} at {last['t']:.1f} s)" if s.get("final_eval_missing") and last else
             f"{s['mode']}: no evaluation",
             f"loss {s['final_loss']:.4f}" if s.get("final_loss") is not None else
             "loss not finite (the model diverged)" if s.get("final_loss_not_finite") else "",
             f"{amount(s['samples_per_s'])} samples/s", f"wall {at(s['wall_s'])}", reached,
             staleness_words(s),
             f"start-up {s['startup_s']:.1f} s" if s.get("startup_s") is not None and not virtual else "",
             lost_words(s)]
    return "  ".join(p for p in parts if p)


def staleness_words(s: dict) -> str:
    """'staleness mean M max N', or '' where the job counted none: an empty histogram (ltfb's
    independent trainers read no shared model; nothing is measured, so no 0 is claimed).
    easgd's says its unit: the others' exchanges (each tau local steps), not updates, so that
    its 1.00 does not read as fresher than async's."""
    from .report_numbers import records_staleness
    if not records_staleness(s):
        return ""
    unit = " (centre moves between exchanges)" if s.get("mode") == "easgd" else ""
    return f"staleness mean {s['staleness']['mean']:.2f} max {s['staleness']['max']}{unit}"
