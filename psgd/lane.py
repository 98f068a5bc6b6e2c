"""The same-host lane: a request and its answer between a client and a daemon on one
machine, over a Unix stream socket instead of ZeroMQ.

Why: ZeroMQ hands each message to an I/O thread on either side, so a request and its
answer pass six threads (client, its I/O thread, the daemon's I/O thread, the daemon,
and back), and each hand-off wakes a thread, often on another CPU. On a Unix socket the
client's send wakes the daemon and the answer wakes the client: two hand-offs. With an
MLP step between requests, a 104 KB round trip took 261 µs this way against 377 µs over
pyzmq, and 123 µs with both sides looking for their message before they sleep
(`spinning.spin`; bench/lane.py, docs/performance.md "The same-host lane").

What it carries: `wire.encode`'s frames, unchanged. On the socket each message is its
framing, of a fixed size (the frame count and the frames' lengths, little-endian uint32,
then zeros to MAX_FRAMES lengths: read in one call), then the frames.

Where: a daemon listens on an abstract Unix socket named after the address it serves
(`name`: Linux only; each network namespace has its own names). A client connects to
it when it is there and sends a request on it when the request fits the socket's
buffer (`Conn.max_message`); the daemon answers on the way the request came. Larger
messages, CurveZMQ jobs (the lane has no handshake), other hosts, a lane that failed
and a name held by another user's process (`_connect`) go over ZeroMQ.

Nothing here waits for long: a daemon's connections never block, and keep what the
kernel would not take yet until the socket is writable (views of the frames, which
`transport.Service.in_flight` reports); a client's send waits at most its caller's
`wait_s` for room. A lane that fails in any way raises `LaneError`,
and its owner closes it.
"""
from __future__ import annotations

import errno
import itertools
import os
import select
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from . import wire

_COUNT = struct.Struct("<I")
_CRED = struct.Struct("3i")   # struct ucred: pid, uid, gid (SO_PEERCRED)
MAX_FRAMES = wire.MAX_FRAMES + 1     # a header and its arrays
# The kernel's buffer a lane asks for on its socket (SO_SNDBUF, capped by
# net.core.wmem_max: 208 KiB by default, 4 MiB on this project's machine): a message goes on a lane
# when it fits in half of what it got (the kernel's own accounting takes some of it)
SNDBUF = 8 << 20
# Answers a daemon keeps for a lane whose peer does not read them; past this many, the
# lane is closed (counted as a bad message), as ZeroMQ's path drops replies past
# transport.MAX_UNREAD_REPLIES.
MAX_QUEUED = 16
_PREFIX = 4 + 4 * MAX_FRAMES   # a message's framing: its frame count, then their lengths (the rest zeros)
# Frame memory a lane keeps to read into again once nothing holds it (`Conn._buffer`):
# memory the reader wrote last time, in its caches, not fresh pages each message. Frames
# larger than a message the lane's own peer would send (`Conn.max_message`: a daemon
# reads larger ones from a peer that breaks that rule) are fresh memory each, as ZeroMQ's.
SPARE = 4
_idents = itertools.count(1)


def _unheld_refs() -> int:
    """sys.getrefcount of a spare buffer that nothing else holds, asked as `Conn._buffer`
    asks it: the list, the loop's name and the call's argument up to Python 3.13; an
    interpreter that borrows a reference for a local's load (3.14) counts fewer, and a
    fixed 3 would then take a held buffer for a free one (its memory read into again
    under the arrays made from it). Anything else but 2 or 3: no buffer is taken again."""
    spare = [np.empty(1, np.uint8)]
    for buf in spare:
        if sys.getrefcount(buf) in (2, 3):
            return sys.getrefcount(buf)
    return 0


_UNHELD = _unheld_refs()


class LaneError(ConnectionError):
    """A lane that cannot go on: its peer closed it (`bad` false), or broke its framing,
    or does not read its answers (`bad`: a bad message, as ZeroMQ's path counts one)."""

    def __init__(self, why: str, bad: bool = False):
        super().__init__(why)
        self.bad = bad


def name(address: str) -> bytes | None:
    """The abstract Unix socket name of the daemon serving `address` (None: no lane)."""
    if not sys.platform.startswith("linux") or not address.startswith("tcp://"):
        return None
    n = b"\0psgd-lane " + address.encode()
    return n if len(n) <= 107 else None   # (sockaddr_un's sun_path)


class Conn:
    """One end of a lane: a non-blocking Unix stream socket, read whole messages at a time."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        except OSError:
            pass
        self.sock = sock
        self.fd = sock.fileno()
        self.ident = next(_idents)   # a daemon's routing token for it (ZeroMQ's are bytes; these are ints)
        self.max_message = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2
        self._lengths: list[int] | None = None   # the message being read: its frames' lengths, once read
        self._frames: list[Any] = []              # ... its frames so far
        self._got = 0                             # ... bytes of its framing read
        self._part = bytearray(_PREFIX)            # its framing (the count, then the lengths)
        self._rest: list[memoryview] = []         # ... what is left of its frames to read
        self._queued: deque[memoryview] = deque()  # what the kernel did not take yet (`offer`)
        self._answers: deque[int] = deque()        # ... of each answer kept, its buffers there
        self._failed: LaneError | None = None      # the error that ended reading (`messages`)
        self._spare: list[np.ndarray] = []         # frame memory to read into again (`_buffer`)

    @property
    def queued(self) -> bool:
        """Does `offer` keep any answer the kernel has not taken yet?"""
        return bool(self._queued)

    def close(self) -> None:
        self.sock.close()

    # ------------------------------------------------------------ reading
    def messages(self, max_bytes: int) -> list[list[Any]]:
        """The message completed by what has arrived, if one is (a list of its frames; at
        most one a call: a next one is read at the next, which the caller's poll says is
        due). Two system calls a message: its framing, then its frames at once. LaneError:
        the peer closed the lane, or sent a message of more than MAX_FRAMES frames or
        `max_bytes` bytes."""
        if self._failed is not None:
            raise self._failed
        try:
            while True:
                if self._lengths is None:
                    n = self.sock.recv_into(memoryview(self._part)[self._got:])
                    if n == 0:
                        raise LaneError("the peer closed the lane")
                    self._got += n
                    if self._got < _PREFIX:
                        continue
                    self._start(max_bytes)
                if self._rest:
                    n = self.sock.recvmsg_into(self._rest)[0]
                    if n == 0:
                        raise LaneError("the peer closed the lane")
                    rest = self._rest
                    while n >= len(rest[0]):
                        n -= len(rest.pop(0))
                        if not rest:
                            break
                    if rest and n:
                        rest[0] = rest[0][n:]
                if not self._rest:
                    frames, self._frames, self._lengths, self._got = self._frames, [], None, 0
                    return [frames]
        except (BlockingIOError, InterruptedError):
            return []
        except (LaneError, OSError) as e:
            self._failed = e if isinstance(e, LaneError) else LaneError(f"lane read failed: {e}")
            raise self._failed from None

    def _start(self, max_bytes: int) -> None:
        """The framing is in: check it, and make the frames' memory (`_rest`: what is left to read)."""
        count = _COUNT.unpack_from(self._part)[0]
        if not 1 <= count <= MAX_FRAMES:
            raise LaneError(f"a message of {count} frames (1 to {MAX_FRAMES})", bad=True)
        lengths = list(struct.unpack_from(f"<{count}I", self._part, 4))
        if sum(lengths) > max_bytes:
            raise LaneError(f"a message of {sum(lengths)} bytes, at most {max_bytes}", bad=True)
        try:
            self._frames = [memoryview(cast(Any, self._buffer(n))) if n else b"" for n in lengths]
        except MemoryError:   # (a framing that claims more than the machine has: the lane's, not the daemon's end)
            raise LaneError(f"a message of {sum(lengths)} bytes: no memory for it", bad=True) from None
        self._lengths = lengths
        self._rest = [f for f in self._frames if len(f)]

    def _buffer(self, length: int) -> np.ndarray:
        """Memory for a frame of `length` bytes: one of the lane's own that nothing holds any
        more (nothing made from an earlier message's frame is alive), else a new one."""
        for buf in self._spare:
            if buf.nbytes == length and sys.getrefcount(buf) == _UNHELD:
                return buf
        buf = np.empty(length, np.uint8)
        if len(self._spare) < SPARE and length <= self.max_message:
            self._spare.append(buf)
        return buf

    # ------------------------------------------------------------ writing
    @staticmethod
    def _packed(frames: Sequence[Any]) -> list[memoryview]:
        """The frames' bytes as one message: its count and lengths, then the frames (as
        byte views: a partly written one is cut by bytes, not by its items)."""
        views = [memoryview(f).cast("B") for f in frames]
        if len(views) > MAX_FRAMES:
            raise ValueError(f"{len(views)} frames, at most {MAX_FRAMES}")
        head = bytearray(_PREFIX)
        struct.pack_into(f"<{1 + len(views)}I", head, 0, len(views), *map(len, views))
        return [memoryview(head)] + [v for v in views if len(v)]

    def _write(self, bufs: list[memoryview]) -> list[memoryview]:
        """Write what the kernel takes now; what is left of `bufs`."""
        while bufs:
            try:
                n = self.sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                return bufs
            except OSError as e:
                raise LaneError(f"lane write failed: {e}") from None
            while bufs and n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs.pop(0)
            if n:
                bufs[0] = bufs[0][n:]
        return bufs

    def send(self, frames: Sequence[Any], wait_s: float) -> None:
        """A client's send: the whole message, waiting at most `wait_s` for room (then
        LaneError: the message is cut, and the lane with it)."""
        rest = self._write(self._packed(frames))
        if not rest:
            return
        poll = select.poll()
        poll.register(self.fd, select.POLLOUT)
        until = time.monotonic() + wait_s
        while rest:
            left = until - time.monotonic()
            if left <= 0:
                raise LaneError(f"no room on the lane for {wait_s:.0f} s")
            poll.poll(left * 1000)
            rest = self._write(rest)

    def offer(self, frames: Sequence[Any], copy: bool = False) -> None:
        """A daemon's send, which never waits: what the kernel does not take now is kept
        for `flush`, as views of `frames` (the caller keeps them unchanged while `queued`
        says so, as `Service.in_flight` tells a shard), or as a copy with `copy`. LaneError
        past MAX_QUEUED answers kept."""
        bufs = self._packed(frames)
        if not self._queued:
            bufs = self._write(bufs)
        elif len(self._answers) >= MAX_QUEUED:
            raise LaneError(f"{MAX_QUEUED} answers unsent (the peer does not read its answers)", bad=True)
        if bufs:
            self._answers.append(len(bufs))
            self._queued.extend([memoryview(bytes(b)) for b in bufs] if copy else bufs)

    def flush(self) -> bool:
        """Write what `offer` kept, as far as the kernel takes it; whether any is left."""
        if self._queued:
            rest = self._write(list(self._queued))
            gone = len(self._queued) - len(rest)   # buffers written whole: the oldest answers' first
            while gone and gone >= self._answers[0]:
                gone -= self._answers.popleft()
            if gone:
                self._answers[0] -= gone
            self._queued = deque(rest)
        return bool(self._queued)


def _unix_socket(address: str, how: Callable[[socket.socket, bytes], Any]) -> socket.socket | None:
    """A Unix stream socket to or for the daemon serving `address`, on which `how(sock,
    name)` (a connect, a bind) succeeded; None where there is no lane's name, or it failed."""
    where = name(address)
    if where is None:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        how(sock, where)
    except OSError:
        sock.close()
        return None
    return sock


def _listen(sock: socket.socket, where: bytes) -> None:
    sock.bind(where)
    sock.listen(128)


def _connect(sock: socket.socket, where: bytes) -> None:
    sock.setblocking(False)   # (a daemon that does not accept, its queue full: EAGAIN, not a wait)
    sock.connect(where)
    # An abstract name has no permissions: another user's process that took the name first
    # got the worker's gradients, and never answering them, held its steps past every
    # timeout (the shard answered the probes over ZeroMQ). Only a process of this user's is
    # a lane's peer.
    _, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    if uid != os.geteuid():
        raise PermissionError(f"the lane's name is held by a process of user {uid}")


def connect(address: str) -> Conn | None:
    """A lane to the daemon serving `address` on this host (None: there is none, or it
    takes no lane now)."""
    sock = _unix_socket(address, _connect)
    return Conn(sock) if sock is not None else None


class Listener:
    """A daemon's end: the abstract Unix socket it accepts lanes on."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.fd = sock.fileno()

    @classmethod
    def open(cls, address: str) -> Listener | None:
        """Listen for lanes to the daemon serving `address` (None: no lane here, or the
        name is taken, by another daemon of the same address in this network namespace)."""
        sock = _unix_socket(address, _listen)
        if sock is None:
            return None
        sock.setblocking(False)
        return cls(sock)

    def accept(self) -> Conn | None:
        """A lane that a client opened, if one waits (None). OSError: this process has no
        descriptor for it (EMFILE, ENFILE; `Service._check_fds` says so): it waits."""
        try:
            sock, _ = self.sock.accept()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise
            return None
        return Conn(sock)

    def close(self) -> None:
        self.sock.close()
