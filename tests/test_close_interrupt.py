"""Ctrl-C (KeyboardInterrupt) inside a training script's `close()` (psgd/connection.py).

Rank 0's close() holds the job's end while it waits for the other workers and reads the
final model, then releases it (`finish` with `hold`, then `release`: servers/coordinator.py).
A review listed "Ctrl-C inside rank 0's close()" as a defect. What it did:

- a Ctrl-C as the coordinator answered the finish that holds the job's end, or as the
  release was sent (or a second Ctrl-C while it was), left the hold in place: the job's end
  waited out cluster.timeout_s, and a connection interrupted before the release kept its
  sockets, heartbeats and pid file;
- one during the settle (before the finish) left the connection open, the job told nothing;
- one while the coordinator did not answer (it had the same Ctrl-C, say) still waited
  cluster.timeout_s for the release before the script could end.

Now the interrupt ends close() within a heartbeat's answer time, the job told (this
worker's finish; the hold released) and the connection closed, and it reaches the script.
So does one in the script's training, inside `with` (or uncaught without it): the finish
that told the job why waited cluster.timeout_s for a coordinator gone with the same Ctrl-C.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

import psgd
from psgd.config import Config
from psgd.connection import Connection
from psgd.inprocess import InProcessCluster
from psgd.launcher import LocalJob
from tests.conftest import free_port_block
from tests.test_script import SMALL, child_named, wait_for_line


@pytest.fixture(autouse=True)
def pythons_ctrl_c():
    """Python's own SIGINT handler, as in a terminal: a CI that runs the tests in the
    background has SIGINT ignored from the start (bash ignores it in a background job of
    a script), and neither a KeyboardInterrupt nor the handler close() puts back is
    then Python's."""
    was = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, was)

TIMEOUT_S = 20.0   # cluster.timeout_s: how long a hold left in place, or a call unanswered, would last
PROMPT_S = 8.0     # what an interrupted close() may take (a heartbeat's answer time is 2 s here)


def config(port_block, **sets) -> Config:
    return Config().replace(**{"cluster.port": port_block(3), "cluster.workers": 1, "cluster.servers": 1,
                               "model.name": "script", "cluster.evaluator": False, "mode.name": "async",
                               "train.steps": 3, "cluster.timeout_s": TIMEOUT_S, **sets})


def trained(cfg: Config, out: str) -> psgd.Connection:
    """Rank 0, connected and through its steps (its close() still to come)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ps = psgd.connect(model, config=cfg, out=out, rank=0)
    while True:
        model.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
        if not ps.step(samples=8):
            return ps


def interrupt_at(ps: psgd.Connection, op: str, answered: bool = False, then=None) -> None:
    """Ctrl-C once in close(), at its first call `op` to the coordinator: before it is sent,
    or (`answered`) as its answer comes. `then()` runs first (the coordinator stopped, ...)."""
    call = ps.link.call
    fired: list[str] = []

    def calling(o: str, **kw):
        if o != op or fired:
            return call(o, **kw)
        fired.append(o)
        if answered:
            call(o, **kw)
        if then is not None:
            then()
        raise KeyboardInterrupt
    ps.link.call = calling


def ctrl_c_again_at(ps: psgd.Connection, at: str) -> None:
    """A second Ctrl-C (a user pressing again) as the connection sends `at` to the coordinator."""
    call = ps.link.call

    def again(op: str, **kw):
        if op == at:
            os.kill(os.getpid(), signal.SIGINT)
        return call(op, **kw)
    ps.link.call = again


def closed_cleanly(ps: psgd.Connection, out) -> None:
    """Nothing of the connection is left: sockets, heartbeats, pid file."""
    assert ps.closed
    assert ps.link._calls is None and not ps.link._thread.is_alive()
    assert not (out / "pids" / "worker-0.pid").exists()


def left_promptly(ps: psgd.Connection, out, leave, what: str) -> None:
    """`leave()`, the Ctrl-C's way out of the job, timed: the connection is closed cleanly
    (closed by hand if `leave` failed), within PROMPT_S (a heartbeat's answer time a call,
    not cluster.timeout_s)."""
    t0 = time.monotonic()
    try:
        leave()
        took = time.monotonic() - t0
    finally:
        if not ps.closed:
            ps.close("test clean-up")
    closed_cleanly(ps, out)
    assert took < PROMPT_S, f"{what} took {took:.1f} s after the Ctrl-C (cluster.timeout_s = {TIMEOUT_S:g})"


def ended_within(out, seconds: float) -> dict:
    """summary.json, written within `seconds` (the job's end not held)."""
    deadline = time.monotonic() + seconds
    while not (out / "summary.json").exists():
        assert time.monotonic() < deadline, f"the job had not ended {seconds:g} s after close() (held?)"
        time.sleep(0.1)
    return json.loads((out / "summary.json").read_text())


@pytest.mark.inprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("op,answered", [("finish", True), ("status", False), ("release", False)],
                         ids=["as-the-hold-is-taken", "while-waiting-for-the-others", "as-the-release-goes"])
def test_ctrl_c_in_rank_0s_close_releases_the_job_and_closes_the_connection(port_block, tmp_path, op, answered):
    cfg = config(port_block)
    with InProcessCluster(cfg, str(tmp_path)):
        ps = trained(cfg, str(tmp_path))
        interrupt_at(ps, op, answered)
        try:
            with pytest.raises(KeyboardInterrupt):
                ps.close()
            closed_cleanly(ps, tmp_path)
            summary = ended_within(tmp_path, 5.0)   # (held: cluster.timeout_s = 20 s)
        finally:
            if not ps.closed:   # (the old code's connection, left open)
                ps.close("test clean-up")
    assert not summary.get("aborted"), summary.get("aborted")   # rank 0 had done its share
    assert summary["failures"]["workers_lost"] == 0, summary   # its finish was taken (not lost: no heartbeats)
    # what was done is kept: the model saved before the Ctrl-C at the release
    assert (tmp_path / "model.pt").exists() == (op == "release")


@pytest.mark.inprocess
@pytest.mark.timeout(90)
def test_ctrl_c_in_close_before_the_finish_ends_the_job_with_it(port_block, tmp_path):
    """Ctrl-C while close() settles what is in flight (before this worker's finish): the
    job ends with it, as an interrupt inside `with` ends it."""
    cfg = config(port_block)
    with InProcessCluster(cfg, str(tmp_path)):
        ps = trained(cfg, str(tmp_path))

        def settle(w) -> None:
            raise KeyboardInterrupt
        ps.schedule.finish = settle
        try:
            with pytest.raises(KeyboardInterrupt):
                ps.close()
            closed_cleanly(ps, tmp_path)
            summary = ended_within(tmp_path, 5.0)
        finally:
            if not ps.closed:
                ps.close("test clean-up")
    assert summary.get("aborted") == "worker 0's training script raised KeyboardInterrupt", summary.get("aborted")


@pytest.mark.inprocess
@pytest.mark.timeout(90)
def test_ctrl_c_in_close_with_the_coordinator_gone_ends_it_promptly(port_block, tmp_path):
    """The coordinator had the same Ctrl-C (one process group) and is gone: close() waited
    cluster.timeout_s for the release's answer before the interrupt reached the script."""
    cfg = config(port_block)
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        ps = trained(cfg, str(tmp_path))

        def coordinator_gone() -> None:
            cluster.coordinator.stop_requested = True
            cluster.threads[0].join(timeout=10)
        interrupt_at(ps, "status", then=coordinator_gone)

        def leave() -> None:
            with pytest.raises(KeyboardInterrupt):
                ps.close()
        left_promptly(ps, tmp_path, leave, "close()")


@pytest.mark.inprocess
@pytest.mark.timeout(90)
def test_a_second_ctrl_c_does_not_cut_the_release_short(port_block, tmp_path):
    """The first Ctrl-C while rank 0 waits; a second (a user pressing again) as close()
    releases the job's end: the release is still sent, and the interrupt raised is one."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # (pytest's main thread, Python's)
    cfg = config(port_block)
    with InProcessCluster(cfg, str(tmp_path)):
        ps = trained(cfg, str(tmp_path))
        interrupt_at(ps, "status")
        ctrl_c_again_at(ps, "release")
        try:
            with pytest.raises(KeyboardInterrupt):
                ps.close()
            closed_cleanly(ps, tmp_path)
            ended_within(tmp_path, 5.0)
        finally:
            if not ps.closed:
                ps.close("test clean-up")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


SCRIPT = """
import signal, sys, time, torch, psgd
signal.signal(signal.SIGINT, signal.default_int_handler)   # (Python's, as in a terminal: see `pythons_ctrl_c`)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
ps = psgd.connect(model)
for k in range(3):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
    ps.step(samples=8)
if ps.rank == 1:
    time.sleep(10 ** 6)   # live, never done: rank 0's close() waits for it
print("CLOSING", flush=True)
ps.close()
"""


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_to_a_script_in_close_with_the_coordinator_stopped_ends_it_promptly(tmp_path):
    """A real script, a real SIGINT: rank 0 waits in close() for rank 1, the coordinator
    does not answer (stopped), Ctrl-C. The script ended cluster.timeout_s later; now within
    seconds, its log saying what close() did."""
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    cfg = Config().replace(**{**SMALL, "cluster.servers": 1, "mode.name": "async", "train.steps": 1000,
                              "cluster.timeout_s": TIMEOUT_S, "cluster.heartbeat_s": 0.25,
                              "cluster.heartbeat_timeout_s": 2, "cluster.port": free_port_block(2)})
    j = LocalJob(cfg, str(tmp_path / "out"), quiet=True, timeout_s=200, script=[str(path)])
    j.start()
    coordinator, rank0 = j.children[0], child_named(j, "worker-0")
    try:
        wait_for_line(j, "worker-0", "CLOSING", 120)
        time.sleep(1.0)   # rank 0 polls the coordinator's status in close()
        coordinator.proc.send_signal(signal.SIGSTOP)
        rank0.proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        while rank0.poll() is None and time.monotonic() - t0 < TIMEOUT_S + 10:
            time.sleep(0.1)
        took = time.monotonic() - t0
        assert took < PROMPT_S, f"the script ended {took:.1f} s after Ctrl-C (cluster.timeout_s = {TIMEOUT_S:g})"
        assert rank0.poll() == -signal.SIGINT   # (Python's exit on an uncaught KeyboardInterrupt)
        log = open(rank0.log_path).read()
        assert "close() was interrupted" in log, log[-2000:]
    finally:
        coordinator.proc.send_signal(signal.SIGCONT)
        j.stop()


def trained_a_little(cfg: Config, out: str) -> tuple[nn.Module, psgd.Connection]:
    """Rank 0, connected and a step into training (the job's budget far from spent)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ps = psgd.connect(model, config=cfg, out=out, rank=0)
    nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
    assert ps.step(samples=8)
    return model, ps


def stop_the_coordinator(cluster: InProcessCluster) -> None:
    """The coordinator had the same Ctrl-C (`psgd run --script` and its scripts are one
    process group) and is gone."""
    cluster.coordinator.stop_requested = True
    cluster.threads[0].join(timeout=10)
    assert not cluster.threads[0].is_alive()


@pytest.mark.inprocess
@pytest.mark.timeout(90)
def test_ctrl_c_inside_with_and_the_coordinator_gone_ends_it_promptly(port_block, tmp_path):
    """A user's run: Ctrl-C in the script's loop, inside `with`. The finish that tells the
    job why (`__exit__` -> close(error)) waited cluster.timeout_s for a coordinator that had
    the same Ctrl-C before the script could end; now a heartbeat's answer time at most, as
    for a Ctrl-C in close()."""
    cfg = config(port_block, **{"train.steps": 1000})
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        _, ps = trained_a_little(cfg, str(tmp_path))
        stop_the_coordinator(cluster)

        def leave() -> None:
            with pytest.raises(KeyboardInterrupt), ps:
                raise KeyboardInterrupt
        left_promptly(ps, tmp_path, leave, "leaving `with`")


@pytest.mark.inprocess
@pytest.mark.timeout(90)
def test_ctrl_c_uncaught_outside_with_and_the_coordinator_gone_ends_it_promptly(port_block, tmp_path):
    """The same Ctrl-C in a script that closes by hand (no `with`): uncaught, it ends the
    job through sys.excepthook (`_end_on_uncaught`), which waited cluster.timeout_s too."""
    from psgd.connection import _end_on_uncaught
    cfg = config(port_block, **{"train.steps": 1000})
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        _, ps = trained_a_little(cfg, str(tmp_path))
        stop_the_coordinator(cluster)
        left_promptly(ps, tmp_path, lambda: _end_on_uncaught(KeyboardInterrupt, KeyboardInterrupt(), None),
                      "the hook")


@pytest.mark.inprocess
@pytest.mark.timeout(90)
def test_a_second_ctrl_c_as_with_leaves_does_not_cut_the_finish_short(port_block, tmp_path):
    """Ctrl-C inside `with`, and again (a user pressing twice) as the connection tells the
    job: the finish still carries the reason, the interrupt raised is the first, and the
    script's SIGINT handler is back."""
    cfg = config(port_block, **{"train.steps": 1000})
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        _, ps = trained_a_little(cfg, str(tmp_path))
        ctrl_c_again_at(ps, "finish")
        first = KeyboardInterrupt("the first")
        try:
            with pytest.raises(KeyboardInterrupt) as raised, ps:
                raise first
        finally:
            if not ps.closed:
                ps.close("test clean-up")
        closed_cleanly(ps, tmp_path)
        assert raised.value is first
        assert cluster.coordinator.abort == "worker 0's training script raised KeyboardInterrupt: the first"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.unit
def test_a_ctrl_c_while_another_thread_is_in_a_call_names_what_it_could_not_do():
    """A Ctrl-C in the script's training while another thread is in one of the
    connection's calls (an evaluation thread's report()) cannot use its sockets: the
    error says so in the script's terms, not by the name of a private method."""
    busy = type("Busy", (), {"_busy": threading.Lock()})()
    busy._busy.acquire()
    with pytest.raises(psgd.JobError, match=r"^leaving the job on the training script's KeyboardInterrupt "
                                            r"\(Ctrl-C\) while another thread is in a call of this connection"):
        Connection._leave_interrupted(busy, "worker 0's training script raised KeyboardInterrupt")
