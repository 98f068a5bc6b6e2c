"""Looking for a message before sleeping, while the machine has a CPU to spare for it.

A process that sleeps until its answer comes is woken by the kernel when it does: on
another CPU that had gone idle, an interrupt to it, which took tens of µs on this
project's machine (a virtual one) for each message each way; and a CPU that slept
computes slower at first. One that looks meanwhile (`spin`) is not asleep: the sender's
write wakes nobody. A ZeroMQ socket's messages come through its I/O thread, which sleeps
in epoll either way, but the process that looks is still spared its own wake-up
(bench/lane.py's `zmq_spin` and `lane_spin` ways; docs/performance.md, "The same-host
lane").

Looking holds a CPU. `psgd run` spins only where the job's busy processes fit the cores
(`launcher.spin_for`), but it cannot see what else the machine runs: another job, a
build, a test suite. There a spinning worker burns the share of a CPU that its compute,
or its shard, needed: beside one process of another program that only computes, on two
cores, a one-worker MLP job that spun ran at about a third of the speed of the same job
with `cluster.spin_us = 0` (bench/busy.py, `ratio_busy_*` 0.36-0.43). So each waiting
thread's `Spinner` watches how much of the time its thread was runnable it spent
waiting for a CPU (the kernel's schedstat): the worker and the shard of that job, under
1 % alone, about 45 % beside the busy process. Where that passed WAIT_SHARE over a window
(at least WINDOW_S between its waits, and RUNNABLE_S runnable), its waits stop spinning
for a rest, 1 s, then twice as long after each such window, up to 16 s; each rest ends
with a window of spinning again (a job on a machine whose other work stopped spins on,
and its rests are 1 s again).
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import zmq

from .metrics import cpu_times


def spin(poller: zmq.Poller, spin_s: float) -> list:
    """What `poller` has within `spin_s`, looked for without sleeping ([] if nothing)."""
    until = time.perf_counter() + spin_s
    while True:
        events = poller.poll(0)
        if events or time.perf_counter() >= until:
            return events


class Spinner:
    """A thread's waits: each looks for up to `spin_s` (`poll`) before its caller sleeps,
    but not while its spins rest (see the module's docstring). One thread's: the times it
    reads are the calling thread's (a window begun on another thread is begun again)."""

    WINDOW_S = 0.05    # the wall time, at least, over which the thread's wait for a CPU is judged
    RUNNABLE_S = 0.01  # ... and the thread's time runnable (on a CPU or waiting for one), at least
    WAIT_SHARE = 0.1   # the share of that runnable time spent waiting above which the spins rest
    REST_S = 1.0       # the first rest; doubled after each window that waited, up to MAX_REST_S,
    MAX_REST_S = 16.0  # and back to REST_S after one that did not

    def __init__(self, spin_s: float, clock: Callable[[], float] = time.monotonic,
                 times: Callable[[], tuple[float, float] | None] = cpu_times):
        self.spin_s = spin_s
        self._clock, self._times = clock, times
        # where the window began: (clock, the thread's run and wait times, the thread); None before
        # a window (the first wait, the first after a rest)
        self._window: tuple[float, float, float, int] | None = None
        self._rest_s = self.REST_S
        self._until = 0.0    # clock() before which no wait spins
        self.rests = 0       # how many times the spins rested

    def poll(self, poller: zmq.Poller, limit_s: float) -> list:
        """What `poller` has within `spin_s` (at most `limit_s`), looked for without
        sleeping; [] at once where it does not spin, or while its spins rest."""
        if not self.spin_s:
            return []
        now = self._clock()
        if now < self._until:
            return []
        if self._window is None or self._window[3] != threading.get_native_id():
            self._begin(now)
        elif now - self._window[0] >= self.WINDOW_S and self._rests(now):
            return []
        return spin(poller, min(self.spin_s, limit_s))

    def _begin(self, now: float) -> None:
        """A window begins (where the kernel keeps no such count, none ends: it spins as told)."""
        times = self._times()
        counted = bool(times and any(times))   # (a kernel that keeps no such count reads 0 0)
        self._window = (now if counted else math.inf, *(times or (0.0, 0.0)), threading.get_native_id())

    def _rests(self, now: float) -> bool:
        """A window may be over: whether its thread waited for a CPU, and so rests."""
        assert self._window is not None
        times = self._times()
        if times is None:
            return False
        ran, waited = times[0] - self._window[1], times[1] - self._window[2]
        if ran < 0 or waited < 0:   # (another thread's, of the same id: the one that began the window ended)
            self._begin(now)
            return False
        if ran + waited < self.RUNNABLE_S:   # (too little of its time wanted a CPU to judge: the window goes on)
            return False
        if waited > self.WAIT_SHARE * (ran + waited):
            self._until = now + self._rest_s
            self._rest_s = min(2 * self._rest_s, self.MAX_REST_S)
            self.rests += 1
            self._window = None   # (a new one begins with the first wait after the rest)
            return True
        self._rest_s = self.REST_S
        self._begin(now)
        return False
