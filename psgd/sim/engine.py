"""The virtual clock: an event loop, the network's cost model, and worker bodies run one
at a time.

`Loop` pops (time, sequence) ordered events; ties go in the order they were scheduled,
so a run is a pure function of its inputs. `Network` turns a message's size into its
delivery time: the sender's NIC serializes it (`bytes / bandwidth`), it travels
`latency_s`, and the receiver's NIC takes it in at its own bandwidth behind every
message that reached it before (incast: the switch buffers what the receiving NIC cannot
take yet; `Simulation.send` books a message there when it leaves its sender). A shard
serves what arrives in order, each request for `request bytes / apply rate`. `Process`
runs a worker's schedule on its own greenlet (or thread), strictly handed off: the loop
resumes it and waits until it blocks again (on a reply or on its own clock) or ends, so
exactly one body runs at any time; a body that trains has torch's random state of its own
(`TorchRandom`), current while it runs.
"""
from __future__ import annotations

import functools
import gc
import heapq
import itertools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


class Loop:
    """A discrete-event loop on a virtual clock (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self.seq = itertools.count()
        # `push((t, next(seq), fn, args))` is `at(t, fn, *args)` for a caller that has made
        # sure t is not before `now`, without a Python call (the simulation's messages and
        # hand-offs: a few per worker step)
        self.push = functools.partial(heapq.heappush, self._heap)
        self._stopped = False
        self.events = 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        """Run fn(*args) at virtual time t (never before now)."""
        heapq.heappush(self._heap, (t if t >= self.now else self.now, next(self.seq), fn, args))

    def run(self, tick: Callable[[], None] | None = None, every: int = 1024) -> None:
        """Until no event is left or `stop()` is called (by an event); `tick()` after
        every `every` events (a progress report)."""
        heap, pop = self._heap, heapq.heappop
        self._stopped = False
        while heap and not self._stopped:
            t, _, fn, args = pop(heap)
            self.now = t
            self.events += 1
            fn(*args)
            if tick is not None and not self.events % every:
                tick()

    def stop(self) -> None:
        """End `run` after the event that calls this."""
        self._stopped = True

    def next_at(self) -> float | None:
        """The time of the next event, if any."""
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)


@contextmanager
def few_collections(young: int = 100_000) -> Iterator[None]:
    """Python's cyclic garbage collector, rarely: a run makes and drops millions of small
    objects, and at the default threshold (a collection per 700 net allocations)
    collecting took a fifth of a timing-only run of 1,024 workers. Garbage in reference
    cycles, rare here, waits for a later collection."""
    threshold = gc.get_threshold()
    gc.set_threshold(young, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


class Node:
    """One NIC (and, for a shard, the thread that serves it): when each is free."""
    __slots__ = ("name", "tx_free", "rx_free", "cpu_free", "busy_s")

    def __init__(self, name: str):
        self.name = name
        self.tx_free = 0.0
        self.rx_free = 0.0
        self.cpu_free = 0.0
        self.busy_s = 0.0    # time spent serving (shards)

    def busy(self) -> float:
        """Its time spent serving so far (a shard's `busy`)."""
        return self.busy_s


class Network:
    """Delivery times of messages between nodes (see the module docstring)."""

    def __init__(self, latency_s: float, bandwidth_gbps: float, apply_gbps: float):
        self.latency_s = latency_s
        self.byte_s = 8.0 / (bandwidth_gbps * 1e9)     # seconds per byte on a link
        self.apply_byte_s = 8.0 / (apply_gbps * 1e9)   # seconds per byte a shard works through

    def depart(self, src: Node, nbytes: int, t: float) -> float:
        """nbytes handed to src's NIC at t; when its first byte leaves (after the bytes
        of every message handed to it before)."""
        start = t if t > src.tx_free else src.tx_free
        src.tx_free = start + nbytes * self.byte_s
        return start

    def arrive(self, dst: Node, nbytes: int, start: float) -> float:
        """A message whose first byte left its sender at `start`; when its last byte
        has arrived at dst, behind every message booked there before it. Booked in the
        order the messages reach dst (`Simulation.send` books at `start`), a message
        waits only for those that reached the NIC before it."""
        arrive = start + self.latency_s
        if dst.rx_free > arrive:
            arrive = dst.rx_free
        dst.rx_free = arrive + nbytes * self.byte_s
        return dst.rx_free

    def serve(self, shard: Node, nbytes: int, arrived: float) -> float:
        """A request that arrived at `arrived`, and makes the shard work through nbytes,
        is served after those before it; when done."""
        start = arrived if arrived > shard.cpu_free else shard.cpu_free
        cost = nbytes * self.apply_byte_s
        shard.cpu_free = start + cost
        shard.busy_s += cost
        return shard.cpu_free


class Stop(BaseException):
    """Raised inside a worker body that the loop abandons (the run failed)."""


def _locked() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock


try:  # greenlets switch in about a microsecond, threads in tens (more on a busy machine)
    import greenlet as _greenlet  # type: ignore[import-untyped,import-not-found,unused-ignore]
except ImportError:  # pragma: no cover - depends on the environment
    _greenlet = None


class TorchRandom:
    """torch's random state of one body, current only while the body runs: a real worker
    is a process of its own that seeds torch with `job.seed * 1000 + rank`
    (workers/worker.py `_train`), so its dropout masks (and any other draw of its model)
    are its own; the simulated workers share this process's generators, and each has its
    state swapped in while it runs (`Process.resume`). A few microseconds a hand-off: a
    timing-only run, which draws nothing, has none."""

    def __init__(self, seed: int, device: Any):
        cuda = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(seed)
            self.cpu = torch.get_rng_state()
            self.cuda = [(d, torch.cuda.get_rng_state(d)) for d in cuda]

    def swap(self) -> None:
        """Make the body's state current and keep the one that was in its place (called
        when the body is resumed, and again when it hands back)."""
        cpu = torch.get_rng_state()
        torch.set_rng_state(self.cpu)
        self.cpu = cpu
        for k, (d, state) in enumerate(self.cuda):
            self.cuda[k] = (d, torch.cuda.get_rng_state(d))
            torch.cuda.set_rng_state(state, d)


class Process:
    """A body (a worker's step loop) that runs only while the loop waits for it.

    `resume()` (from the loop) hands control to the body and returns when the body calls
    `suspend()` or ends; only one of the two runs at any time, so a run is deterministic.
    With `rng`, torch's random state is the body's own while it runs.
    An exception in the body is re-raised by `resume()`; `abandon()` ends a suspended
    body by raising `Stop` inside it. The body runs on a greenlet when the `greenlet`
    package is installed, else on its own thread with strict hand-off."""

    STACK = 1 << 20  # bytes per worker thread (torch's CPU kernels run on it)

    def __init__(self, name: str, body: Callable[[], None], rng: TorchRandom | None = None):
        self.name = name
        self.body = body
        self.rng = rng
        self.done = False
        self.error: BaseException | None = None
        self._stop = False
        self._started = False
        self._grad = True   # torch's grad mode inside the body (thread-local state a greenlet shares)
        if _greenlet is not None:
            self._g = _greenlet.greenlet(self._main)
            self.thread = None
            return
        self._go = _locked()
        self._back = _locked()
        old = threading.stack_size()
        threading.stack_size(self.STACK)
        try:
            self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        finally:
            threading.stack_size(old)

    def _main(self) -> None:
        if self.thread is not None:
            self._go.acquire()
        try:
            if not self._stop:
                self.body()
        except Stop:
            pass
        except BaseException as e:  # handed to the loop, which re-raises it
            self.error = e
        finally:
            self.done = True
            if self.thread is not None:
                self._back.release()

    def running(self) -> bool:
        """Is the caller this body (not the loop)?"""
        if self.thread is None:
            return _greenlet.getcurrent() is self._g
        return threading.current_thread() is self.thread

    def resume(self) -> None:
        if self.done:
            return
        if self.rng is not None:
            self.rng.swap()
            try:
                self._switch()
            finally:
                self.rng.swap()
        else:
            self._switch()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _switch(self) -> None:
        """Run the body until it suspends or ends."""
        if self.thread is None:
            outer = torch.is_grad_enabled()
            if outer != self._grad:
                torch.set_grad_enabled(self._grad)
            try:
                self._g.parent = _greenlet.getcurrent()
                self._g.switch()
            finally:
                self._grad = torch.is_grad_enabled()
                if outer != self._grad:
                    torch.set_grad_enabled(outer)
        else:
            if not self._started:
                self._started = True
                self.thread.start()
            self._go.release()
            self._back.acquire()

    def suspend(self) -> None:
        """(The body) give control back to the loop until resumed."""
        if self.thread is None:
            self._g.parent.switch()
        else:
            self._back.release()
            self._go.acquire()
        if self._stop:
            raise Stop

    def abandon(self) -> None:
        """End a body that will not be resumed any more (it unwinds with Stop)."""
        if self.done:
            return
        self._stop = True
        if self.thread is None:
            if self._g:   # started and suspended: raise Stop where it waits
                self._g.parent = _greenlet.getcurrent()
                self._g.throw(Stop)
            self.done = True
            return
        if not self._started:
            return
        self._go.release()
        self._back.acquire()
        self.thread.join(timeout=10)
