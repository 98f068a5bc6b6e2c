"""Shared fixtures: test tiers, free ports, and checks that no test leaves a process or
a thread behind.

Every test belongs to exactly one tier (setup.cfg registers the markers; README's "Tests"
section says how to run each): `unit` (pure logic, no sockets), `inprocess` (daemons on
threads of the test process, psgd.inprocess), `processes` (real subprocesses), `slurm`
(needs the Slurm cluster). A test with none, or with two (pytest adds up marks: a
module's `pytestmark` and a test's own mark both count), is a collection error, so that
`pytest -m unit` neither leaves a test out of every tier nor runs a slow one. A file that
mixes tiers marks each test, not the module.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

TIERS = ("unit", "inprocess", "processes", "slurm")
THREAD_GRACE_S = 5.0  # how long an in-process test's threads get to end after it
# Threads that a library starts once per process, on first use, and keeps: not a leak.
PROCESS_THREADS = {("zmq.utils.garbage", "GarbageCollectorThread")}  # pyzmq's, for copy=False sends


def _listing(nodeids: list[str], most: int = 20) -> str:
    more = f"\n  ... and {len(nodeids) - most} more" if len(nodeids) > most else ""
    return "\n  " + "\n  ".join(nodeids[:most]) + more


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    none, several = [], []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if not tiers:
            none.append(item.nodeid)
        elif len(tiers) > 1:
            several.append(f"{item.nodeid}: {' + '.join(tiers)}")
    problems = []
    if none:
        problems.append(f"tests without a tier marker ({', '.join(TIERS)}): add `pytestmark = pytest.mark.TIER` "
                        f"to the file or a mark to the test:{_listing(none)}")
    if several:
        problems.append(f"tests with more than one tier (a module's pytestmark adds to a test's own mark: in a "
                        f"file that mixes tiers, mark each test):{_listing(several)}")
    if problems:
        raise pytest.UsageError("\n".join(problems))


def processes_with(field: int, value: int) -> set[int]:
    """The live (not zombie) processes whose /proc stat field `field` (counted after the
    command's name: 1 the parent, 3 the session) is `value`."""
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[field]) == value and fields[0] != "Z":
            out.add(int(name))
    return out


def children(pid: int) -> set[int]:
    """Direct children of pid, from /proc."""
    return processes_with(1, pid)


# Set in this session's environment, which every process it starts inherits (unless given
# another): a process whose parent ended (a grandchild re-parented to init) is still found
# by it. (Not PSGD_*: `no_psgd_environment` removes those.)
SESSION_MARK = "PYTEST_PSGD_SESSION"
os.environ[SESSION_MARK] = f"{os.getpid()}-{random.getrandbits(64):x}"


def marked_processes() -> set[int]:
    """The live processes, other than this one, whose environment holds this session's mark."""
    from psgd.metrics import proc_stat
    mark = f"{SESSION_MARK}={os.environ[SESSION_MARK]}".encode()
    out = set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
        except OSError:   # (gone, or another user's)
            continue
        stat = proc_stat(name)
        if stat is not None and stat[0] != "Z":
            out.add(int(name))
    return out


def started_processes() -> set[int]:
    """This process's children, the daemons its fork server forked (psgd/forkserver.py;
    the server itself lives as long as this process, like a thread pool, and so does
    multiprocessing's resource tracker, which `psgd simulate --jobs` starts), and every
    process of this session's (`SESSION_MARK`), whose parent may have ended: a daemon that
    outlived a killed `psgd run`, a shell's background child."""
    from multiprocessing import resource_tracker

    from psgd import forkserver
    server = forkserver.running_pid()
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    return ((children(os.getpid()) | marked_processes()) - {server, tracker}
            | (children(server) if server else set()))


@pytest.fixture(autouse=True)
def no_psgd_environment(monkeypatch):
    """The tests run without the developer's PSGD_* variables (a PSGD_OUT made
    `psgd.connect` write into that folder; a PSGD_<SECTION>_<KEY> changes every config
    that `load` builds); a test that needs one sets it."""
    for name in [n for n in os.environ if n.startswith("PSGD_")]:
        monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def no_leaked_signal_handlers():
    """A test that runs psgd's `main([...])` in this process's main thread installs its
    handlers (a daemon's SIGTERM raises SystemExit: `cli._exit_on_term`), and they outlived
    it. A later test's forked pool workers inherited that handler, and the pool's terminate
    waited for one of them until the test's timeout (test_cli's check of two commands at
    once, once in the fast tier); with the default action, a worker told to stop dies."""
    held = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    yield
    for s, handler in held.items():
        if handler is not None and signal.getsignal(s) is not handler:
            signal.signal(s, handler)


@pytest.fixture(autouse=True)
def no_leaked_processes():
    before = started_processes()
    yield
    deadline = time.monotonic() + 10
    while True:
        leaked = started_processes() - before
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid in leaked:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not leaked, f"test left processes running: {sorted(leaked)}"


def leaked_threads(before: set[threading.Thread], grace_s: float) -> list[threading.Thread]:
    """Threads alive now that were not in `before`, after waiting up to grace_s for them to end."""
    deadline = time.monotonic() + grace_s
    while True:
        new = [t for t in threading.enumerate() if t not in before and t.is_alive()
               and (type(t).__module__, type(t).__qualname__) not in PROCESS_THREADS]
        if not new or time.monotonic() >= deadline:
            return new
        new[0].join(timeout=min(0.1, max(0.0, deadline - time.monotonic())))


def describe_thread(t: threading.Thread) -> str:
    """'daemon' or 'non-daemon', and what it runs: its class or its target function."""
    target = getattr(t, "_target", None)
    runs = type(t).__qualname__ if type(t) is not threading.Thread else getattr(target, "__qualname__", "")
    return ("daemon" if t.daemon else "non-daemon") + (f", {runs}" if runs else "")


@pytest.fixture(autouse=True)
def no_leaked_threads(request: pytest.FixtureRequest):
    """For `inprocess` tests (as dask's gen_cluster): every thread the test started, the
    daemons' loops and heartbeats and the CurveZMQ authenticator included, has ended
    within THREAD_GRACE_S of its end. ZeroMQ's own I/O threads are not Python threads."""
    if request.node.get_closest_marker("inprocess") is None:
        yield
        return
    before = set(threading.enumerate())
    yield
    leaked = leaked_threads(before, THREAD_GRACE_S)
    if leaked:
        names = ", ".join(f"{t.name} ({describe_thread(t)})" for t in leaked)
        pytest.fail(f"test left {len(leaked)} thread(s) running {THREAD_GRACE_S:g} s after it ended: {names}",
                    pytrace=False)


def free_port_block(n: int) -> int:
    """A free block of n ports below the OS's ephemeral range, at random (why not in
    it: psgd/launcher.py `pick_port`); under pytest-xdist in this worker's share of that
    range (a block free when chosen was bound by another worker's test before this one's
    bind, or held in TIME_WAIT by its job: `pytest -n 2`)."""
    from psgd.launcher import ephemeral_ports, pick_port, ports_free
    low, high = 10000, ephemeral_ports()[0] - n
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker.startswith("gw") and worker[2:].isdigit() and count > 1:
        share = (high - low) // count
        low += int(worker[2:]) % count * share
        high = low + share
    for _ in range(100):
        base = random.randrange(low, high)
        if ports_free("127.0.0.1", base, n):
            return base
    return pick_port("127.0.0.1", random.randrange(10000, ephemeral_ports()[0] - n), n)


@contextlib.contextmanager
def listening_on(port: int) -> Iterator[Any]:
    """A listener on 127.0.0.1:`port` (a port in use), bound as ZeroMQ binds, with
    SO_REUSEADDR: a port chosen free (`free_port_block`, whose probe binds so too) may
    still hold an earlier test's connections in TIME_WAIT, which a plain bind refuses."""
    import socket
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        yield listener


@contextlib.contextmanager
def watching_service() -> Iterator[tuple[Any, list, str]]:
    """A Service whose `stats` handler watches its sender (`Service.watch`), served by the
    test (`service.poll`); the senders with what `watch` said, and its address."""
    import zmq

    from psgd import wire
    from psgd.transport import Service
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    address = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    said: list = []

    def answer(ident, msg):
        said.append((ident, service.watch(ident)))
        return [(ident, wire.reply(msg))]

    service = Service(sock, {"stats": answer}, "test", watching=True)
    try:
        yield service, said, address
    finally:
        service.close()


def told_closed(service: Any, seconds: float = 10) -> list:
    """What `closed` tells within `seconds` (without serving a message)."""
    end = time.monotonic() + seconds
    while not (gone := service.closed()) and time.monotonic() < end:
        time.sleep(0.02)
    return gone



@pytest.fixture
def port_block():
    return free_port_block


def kill_all(procs) -> None:
    """Kill and reap every process still running (test clean-up)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def hand_served(workers: int = 2, servers: int = 1, start: bool = True, out: str | None = None,
                **sets) -> Any:
    """A coordinator served by hand (`ask`), through its serve path but with no socket
    read; with `start`, every worker registered (training)."""
    from psgd import wire
    from psgd.config import Config
    from psgd.servers.coordinator import Coordinator
    cfg = Config().replace(**{"cluster.workers": workers, "cluster.servers": servers, "cluster.evaluator": False,
                              "cluster.port": free_port_block(2), **sets})
    c = Coordinator(cfg, out, quiet=True)
    if start:
        for r in range(workers):
            c.service._serve(b"w%d" % r, wire.encode("register", id=1, role="worker", want_rank=r, nonce=f"n{r}"))
        assert c.phase == "training"
    return c


@contextlib.contextmanager
def closed_after(c: Any) -> Iterator[Any]:
    """`c`, a coordinator served by hand (`hand_served`, `_serve`) with its socket open:
    its socket and event log are closed after the block, also when the block fails (a
    failed assert had left the socket open, to the garbage collector). Both close again
    harmlessly after a `serve()` that closed them."""
    try:
        yield c
    finally:
        c.service.close()
        c.events.close()


def ask(c: Any, op: str, **fields) -> Any:
    """The coordinator's one answer to a request, through its serve path."""
    from psgd import wire
    (_, frames), = c.service._serve(b"x", wire.encode(op, id=2, **fields))
    return wire.decode(frames)


def train_on_threads(cfg: Any, out: str, cluster: Any, prepare: Any = None) -> dict[int, int]:
    """Every rank's `Worker` of `cfg` trained on a thread of this process against an
    `InProcessCluster` (each after `prepare(worker)`, if given): their exit codes."""
    from psgd.workers.worker import Worker
    codes: dict[int, int] = {}

    def work(rank: int) -> None:
        w = Worker(cfg, out, device="cpu", want_rank=rank, ctx=cluster.ctx)
        if prepare is not None:
            prepare(w)
        codes[rank] = w.run()
    threads = [threading.Thread(target=work, args=(r,)) for r in range(cfg.cluster.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    return codes


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def example(name: str) -> Any:
    """examples/NAME.py, imported as a module (its functions, without running its main)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
