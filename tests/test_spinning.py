"""psgd/spinning.py: a wait spins while its thread has a CPU to itself, and rests while
other processes want that CPU."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import zmq

from psgd.spinning import Spinner, cpu_wait_s


@pytest.fixture
def ready():
    """A poller whose socket has a message waiting: a wait that looks finds it at once, and
    one that does not look returns []."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://spinning-ready")
    b.connect("inproc://spinning-ready")
    a.send(b"here")
    poller = zmq.Poller()
    poller.register(b, zmq.POLLIN)
    assert poller.poll(1000)
    yield poller
    a.close(0), b.close(0)
    ctx.term()


class Clocks:
    """A Spinner's wall clock and its thread's CPU wait, set by the test."""

    def __init__(self):
        self.t = self.waited = 0.0

    def at(self, t: float, waited: float = 0.0) -> Clocks:
        self.t, self.waited = t, self.waited + waited
        return self


@pytest.mark.inprocess
def test_spins_rest_while_their_thread_waits_for_a_cpu_and_look_again_after(ready):
    c = Clocks()
    s = Spinner(0.001, clock=lambda: c.t, waited=lambda: c.waited)
    looked = lambda: bool(s.poll(ready, 1.0))   # noqa: E731
    window = 0.125                                   # (> WINDOW_S, and exact in binary)
    assert looked()                                  # a window begins at 0
    assert c.at(window, waited=0.005) and looked()   # 4 % of it waited for a CPU: it spins on
    assert c.at(2 * window, waited=0.06) and not looked()   # 48 %: the spins rest, for REST_S
    assert s.rests == 1
    assert c.at(1.24) and not looked()
    assert c.at(1.25) and looked()                   # and look again: a new window
    assert c.at(1.375, waited=0.06) and not looked()   # waited again: twice as long a rest
    assert c.at(3.37) and not looked()
    assert c.at(3.375) and looked()
    assert c.at(3.5, waited=0.001) and looked()      # a window with its CPU: the next rest is REST_S again
    assert c.at(3.625, waited=0.06) and not looked()
    assert c.at(4.62) and not looked()
    assert c.at(4.625) and looked()
    for rest in (2, 4, 8, 16, 16):                   # rests double up to MAX_REST_S
        assert c.at(c.t + window, waited=0.06) and not looked()
        assert c.at(c.t + rest - 0.01) and not looked()
        assert c.at(c.t + 0.01) and looked(), rest
    assert s.rests == 8


@pytest.mark.inprocess
def test_a_wait_that_does_not_spin_never_looks_and_one_without_the_count_spins_as_told(ready):
    c = Clocks()
    assert Spinner(0.0, clock=lambda: c.t, waited=lambda: c.waited).poll(ready, 1.0) == []
    s = Spinner(0.001, clock=lambda: c.t, waited=lambda: None)   # (a kernel that keeps no such count)
    for t in range(20):
        assert c.at(t * 0.125) and s.poll(ready, 1.0)
    assert s.rests == 0


@pytest.mark.processes
@pytest.mark.skipif(cpu_wait_s() is None, reason="the kernel keeps no CPU wait per thread here (schedstat)")
def test_a_spinner_that_shares_its_cpu_with_a_busy_process_rests(ready):
    """On one CPU with a process that only computes: the thread's spins and its work
    between them wait for the CPU about half the time, and its spins rest."""
    cpu = min(os.sched_getaffinity(0))
    mask = os.sched_getaffinity(0)
    empty = zmq.Poller()
    os.sched_setaffinity(0, {cpu})   # this thread; the busy process started from it inherits the CPU
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        s = Spinner(0.001)
        end = time.monotonic() + 10
        while not s.rests and time.monotonic() < end:
            s.poll(empty, 1.0)
            until = time.perf_counter() + 0.0003   # (a step's own work between its waits)
            while time.perf_counter() < until:
                pass
        assert s.rests == 1
        assert s.poll(ready, 1.0) == []   # (resting: it does not look)
    finally:
        os.sched_setaffinity(0, mask)
        busy.kill()
        busy.wait(10)
