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
cores, a one-worker MLP job that spun ran at 14,900-15,700 samples/s against
45,000-47,600 with `cluster.spin_us = 0` (bench/busy.py). So `Spinner` watches how long
its thread waits for a CPU while it is runnable (the kernel's schedstat): the worker and
the shard of that job waited under 1 % of the time alone, about 40 % beside the busy
process. Where the thread waited more than WAIT_SHARE of a window of spinning, the spins
rest, and are tried again after the rest (a job on a machine whose other work stopped
spins again).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import zmq


def spin(poller: zmq.Poller, spin_s: float) -> list:
    """What `poller` has within `spin_s`, looked for without sleeping ([] if nothing)."""
    until = time.perf_counter() + spin_s
    while True:
        events = poller.poll(0)
        if events or time.perf_counter() >= until:
            return events


def cpu_wait_s() -> float | None:
    """How long the calling thread has waited for a CPU while runnable, in all (seconds;
    the second field of Linux's /proc/thread-self/schedstat); None where the kernel does
    not say."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return None


class Spinner:
    """A thread's waits: each looks for up to `spin_s` (`poll`) before its caller sleeps,
    but not while its spins rest (see the module's docstring). One thread's: the CPU wait
    it reads is the calling thread's."""

    WINDOW_S = 0.1     # the wall time over which the thread's wait for a CPU is judged, spinning
    WAIT_SHARE = 0.1   # the share of that window, waited for a CPU, above which the spins rest
    REST_S = 1.0       # the first rest; doubled after each window that waited, up to MAX_REST_S,
    MAX_REST_S = 16.0  # and back to REST_S after one that did not

    def __init__(self, spin_s: float, clock: Callable[[], float] = time.monotonic,
                 waited: Callable[[], float | None] = cpu_wait_s):
        self.spin_s = spin_s
        self._clock, self._waited = clock, waited
        self._window: tuple[float, float] | None = None   # (clock, waited) where the window began
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
        if self._window is None:   # (where the kernel keeps no such count, no window ends: it spins as told)
            waited = self._waited()
            self._window = (now, waited) if waited is not None else (math.inf, 0.0)
        elif now - self._window[0] >= self.WINDOW_S and self._rests(now):
            return []
        return spin(poller, min(self.spin_s, limit_s))

    def _rests(self, now: float) -> bool:
        """A window of spinning is over: whether its thread waited for a CPU, and so rests."""
        assert self._window is not None
        began, waited_then = self._window
        waited = self._waited()
        if waited is not None and waited - waited_then > self.WAIT_SHARE * (now - began):
            self._until = now + self._rest_s
            self._rest_s = min(2 * self._rest_s, self.MAX_REST_S)
            self.rests += 1
            self._window = None   # (a new one begins with the first wait after the rest)
            return True
        self._rest_s = self.REST_S
        self._window = (now, waited_then if waited is None else waited)
        return False
