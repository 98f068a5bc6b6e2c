"""psgd/spinning.py: a wait spins while its thread has a CPU to itself, and rests while
other processes want that CPU."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import zmq

from psgd.metrics import cpu_times
from psgd.spinning import Spinner


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
    """A Spinner's wall clock and its thread's run and wait times, moved by the test."""

    def __init__(self):
        self.t = self.waited = 0.0
        self.ran = 1.0   # (a thread that has run: a kernel that keeps no count reads 0 0)

    def at(self, t: float, ran: float = 0.0, waited: float = 0.0) -> Clocks:
        """The clock at `t`, the thread having run `ran` and waited for a CPU `waited` since."""
        self.t, self.ran, self.waited = t, self.ran + ran, self.waited + waited
        return self

    def spinner(self) -> Spinner:
        return Spinner(0.001, clock=lambda: self.t, times=lambda: (self.ran, self.waited))


@pytest.mark.inprocess
def test_spins_rest_while_their_thread_waits_for_a_cpu_and_look_again_after(ready):
    c = Clocks()
    s = c.spinner()
    looked = lambda: bool(s.poll(ready, 1.0))   # noqa: E731
    window = 0.125                                   # (> WINDOW_S, and exact in binary)
    assert looked()                                  # a window begins at 0
    assert c.at(0.03125, ran=0.01, waited=0.05) and looked()  # (83 % so far, but WINDOW_S has not passed)
    assert c.at(window, ran=0.49, waited=0.0) and looked()    # 9 % of its runnable time waited: spins on
    assert c.at(2 * window, ran=0.06, waited=0.06) and not looked()   # 50 %: the spins rest, for REST_S
    assert s.rests == 1
    assert c.at(1.24) and not looked()
    assert c.at(1.25) and looked()                   # and look again: a new window
    assert c.at(1.375, ran=0.06, waited=0.06) and not looked()   # waited again: twice as long a rest
    assert c.at(3.37) and not looked()
    assert c.at(3.375) and looked()
    assert c.at(3.5, ran=0.1, waited=0.001) and looked()   # a window with its CPU: the next rest is REST_S again
    assert c.at(3.625, ran=0.06, waited=0.06) and not looked()
    assert c.at(4.62) and not looked()
    assert c.at(4.625) and looked()
    for rest in (2, 4, 8, 16, 16):                   # rests double up to MAX_REST_S
        assert c.at(c.t + window, ran=0.06, waited=0.06) and not looked()
        assert c.at(c.t + rest - 0.01) and not looked()
        assert c.at(c.t + 0.01) and looked(), rest
    assert s.rests == 8


@pytest.mark.inprocess
def test_a_window_is_judged_on_the_time_its_thread_was_runnable_not_on_its_sleeps(ready):
    """A thread that sleeps most of a window (a shard between requests) and waited for a
    CPU half the time it was runnable rests; one whose window was too little runnable to
    judge is judged later, over a longer window."""
    c = Clocks()
    s = c.spinner()
    looked = lambda: bool(s.poll(ready, 1.0))   # noqa: E731
    assert looked()
    assert c.at(5.0, ran=0.3, waited=0.02) and looked()      # 6 % of 0.32 s runnable (in 5 s): spins on
    assert c.at(10.0, ran=0.03, waited=0.03) and not looked()   # 50 % of 0.06 s runnable, in 5 s asleep: rests
    assert s.rests == 1
    assert c.at(11.0) and looked()
    assert c.at(11.5, ran=0.002, waited=0.006) and looked()   # 8 ms runnable: too little to judge
    assert c.at(12.0, ran=0.004, waited=0.0) and not looked()   # 12 ms: 50 % of them waited


@pytest.mark.inprocess
def test_a_wait_that_does_not_spin_never_looks_and_one_without_the_count_spins_as_told(ready):
    c = Clocks()
    assert Spinner(0.0, clock=lambda: c.t, times=lambda: (c.ran, c.waited)).poll(ready, 1.0) == []
    for times in (lambda: None, lambda: (0.0, 0.0)):   # (no schedstat; a kernel that keeps no count: 0 0 0)
        s = Spinner(0.001, clock=lambda: c.t, times=times)
        for _ in range(20):
            assert c.at(c.t + 0.125) and s.poll(ready, 1.0)
        assert s.rests == 0


@pytest.mark.unit
def test_cpu_times_reads_the_threads_run_and_wait_from_schedstat(tmp_path):
    stat = tmp_path / "schedstat"
    stat.write_text("1500000000 250000000 7\n")
    assert cpu_times(str(stat)) == (1.5, 0.25)
    stat.write_text("")
    assert cpu_times(str(stat)) is None
    assert cpu_times(str(tmp_path / "none")) is None


@pytest.mark.inprocess
def test_a_window_begun_on_another_thread_is_begun_again(ready):
    """The times read are the calling thread's: a Spinner polled first on one thread and
    then on another judges the second's window from its own start."""
    import threading
    c = Clocks()
    s = c.spinner()
    assert s.poll(ready, 1.0)                        # a window begins on this thread
    got = []
    c.at(0.25, ran=0.06, waited=0.06)                # (as if the other thread's counts were these)
    t = threading.Thread(target=lambda: got.append(s.poll(ready, 1.0)))
    t.start()
    t.join(10)
    assert got and got[0] and s.rests == 0           # begun again there, not judged


@pytest.mark.processes
@pytest.mark.skipif(not any(cpu_times() or ()), reason="the kernel keeps no run and wait times per thread here")
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


@pytest.mark.inprocess
def test_a_window_whose_counts_went_back_begins_again(ready):
    """Counts below the window's start are another thread's, of the same id (the one that
    began the window ended): the window begins again from them, not judged."""
    c = Clocks().at(0.0, ran=1.0, waited=1.0)
    s = c.spinner()
    looked = lambda: bool(s.poll(ready, 1.0))   # noqa: E731
    assert looked()
    c.ran, c.waited = 0.1, 0.0                       # (the new thread's own counts)
    assert c.at(0.125) and looked() and s.rests == 0
    assert c.at(0.25, ran=0.01, waited=0.01) and not looked()   # judged from there: 50 %
