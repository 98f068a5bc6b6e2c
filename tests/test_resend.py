"""What the parameter client's resend of a late request carries (workers/client.py,
`ParameterClient.finish`), over a fake connection that keeps what ZeroMQ keeps of a send."""
from __future__ import annotations

import pytest
import torch

from psgd import transport, wire
from psgd.config import Config, SecurityConfig
from psgd.transport import Peers, PeerTimeout
from psgd.workers.client import ParameterClient
from tests.loopback import PartwiseSocket

pytestmark = pytest.mark.unit

N = 100_000   # elements of each table: their frames are over COPY_THRESHOLD in every wire dtype


class Connection(PartwiseSocket):
    """A client socket as pyzmq and ZeroMQ treat what is sent on it: a frame of at least
    `copy_threshold` bytes sent with copy=False stays a view of the sender's memory until
    ZeroMQ writes it out (`deliver`, in the order sent); the others are copied at send."""

    copy_threshold = transport.COPY_THRESHOLD

    def __init__(self):
        self.queue: list[list] = []
        self.views: list[int] = []   # of each message sent, its frames kept as views

    def send_multipart(self, frames: list, copy: bool = True) -> None:
        kept = [f if not copy and len(f) >= self.copy_threshold else bytes(f) for f in frames]
        self.queue.append(kept)
        self.views.append(sum(not isinstance(f, bytes) for f in kept))

    def deliver(self) -> list[bytes]:
        return [bytes(f) for f in self.queue.pop(0)]

    def disable_monitor(self) -> None:
        pass

    def close(self, linger: int | None = None) -> None:
        self.queue.clear()   # (LINGER 0: what is queued is dropped)


class Shard(Peers):
    """One shard behind a `Connection`, read in order. `late`: its first push is read
    and answered after the client's retry window, once the client has resent it, and
    before the shard has read the resend (still queued behind)."""

    def __init__(self, late: bool):
        super().__init__(None, ["tcp://shard:1"], SecurityConfig())
        self.late = late
        self.held: wire.Message | None = None   # the push answered late, until its answer
        self.seen: list[tuple[wire.Message, list[bytes]]] = []   # what the shard read, as it read it

    def _open(self, address: str):
        return Connection(), None

    def _close(self, i: int) -> None:
        self.socks[i].close(0)

    def refused(self, i: int) -> str:
        return ""   # (no monitor)

    def read(self) -> wire.Message:
        frames = self.socks[0].deliver()
        msg = wire.decode(frames)
        self.seen.append((msg, frames))
        return msg

    def wait(self, pending, timeout, what, cancel=None):
        if self.late:
            self.late = False
            self.held = self.read()
            raise PeerTimeout(self.addresses[0], timeout, what)
        if self.held is not None and self.held.id in pending:   # the original's answer, the resend still queued
            msg, self.held = self.held, None
            return {msg.id: wire.decode(wire.reply(msg))}
        got = {}
        while self.socks[0].queue:
            msg = self.read()
            if msg.id in pending:
                got[msg.id] = wire.decode(wire.reply(msg))
        return got


class Client(ParameterClient):
    """The parameter client with a `Shard` for its connections (no sockets: the parent's
    `__init__`, which opens them, is not called), every shard alive."""

    def __init__(self, cfg: Config):
        self._setup(cfg, 0)
        self.peers, self._probes = Shard(late=True), Shard(late=False)
        self.retry_s = 0.01
        self._waiting_since = 0.0
        self.alive = lambda i: True


@pytest.mark.parametrize("dtype, codec", [("float32", "none"), ("float16", "none"), ("float32", "topk")])
def test_a_resend_carries_the_bytes_of_its_push(dtype, codec):
    """A push answered late was resent from the buffers it was sent from, without a copy:
    the original's answer ended the wait while the resend was still in ZeroMQ's queue,
    the next step gathered its gradient into those buffers, and the resend left with that
    step's values under the first push's (rank, clock) (a NaN there counted as a bad
    message; a shard restored from a checkpoint older than the push applied them). A
    resend now goes with copies; the first send still goes without one."""
    cfg = Config().replace(**{"cluster.servers": 1, "wire.dtype": dtype, "wire.compression": codec})
    client = Client(cfg)
    shard, line = client.peers, client.peers.socks[0]
    grads, buffers = [torch.full((N,), 1.0)], [torch.full((N,), 2.0)]   # the replica's gather buffers
    client.push(5, grads, buffers, [0])
    assert client.retries == 1 and len(line.queue) == 1, "the push was not resent"
    grads[0].fill_(-7.0)   # the next step gathers into the same buffers and pushes
    buffers[0].fill_(3.0)
    client.push(6, grads, buffers, [0])
    (first, sent), (again, resent), (later, _) = shard.seen
    assert (first.clock, again.clock, later.clock) == (5, 5, 6) and again.id == first.id
    assert resent == sent, "the resend carried other bytes than its push"
    assert line.views[0] > 0 and line.views[1] == 0   # the first send aliases the buffers; the resend does not
