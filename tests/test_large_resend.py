"""A late answer is not a lost request (workers/client.py, `ParameterClient.finish`).

With a 100 MB model on a busy machine a push and its read took 4-5 s, past the client's
retry window (2 s): every step's push went again, 100 MB more each way (bytes_per_sample
twice the model's, 11 duplicates of 12 pushes on each shard of an ssp run). A shard that
answers the reachability probe as the same process it was before the request left holds
the request: only a restarted one (another incarnation), one never probed before, or a
wait that reached the longest window gets it again. Scaled down: a fake connection and
a retry window of 10 ms."""
from __future__ import annotations

import time

import pytest
import torch

from psgd import wire
from psgd.config import Config, SecurityConfig
from psgd.transport import Peers, PeerTimeout
from psgd.workers.client import ParameterClient
from tests.loopback import PartwiseSocket

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class Line(PartwiseSocket):
    """A client socket that keeps what is sent on it, copied, in order."""

    def __init__(self):
        self.queue: list[list[bytes]] = []

    def send_multipart(self, frames: list, copy: bool = True) -> None:
        self.queue.append([bytes(f) for f in frames])

    def disable_monitor(self) -> None:
        pass

    def close(self, linger: int | None = None) -> None:
        self.queue.clear()


class FakeShard(Peers):
    """One shard behind a `Line`. `late`: how many of the client's next waits time out
    before it answers what it has read (each request once, by id). Its `stats` answers
    carry `incarnation`."""

    def __init__(self):
        super().__init__(None, ["tcp://shard:1"], SecurityConfig())
        self.late = 0
        self.incarnation = "a"
        self.sent: list[tuple[str, int]] = []   # (op, clock) of every request as it was sent

    def _open(self, address: str):
        return Line(), None

    def _close(self, i: int) -> None:
        self.socks[i].close(0)

    def refused(self, i: int) -> str:
        return ""   # (no monitor: a test sets `handshook` itself)

    def send(self, i, op, rid=None, copy=False, **kw):
        self.sent.append((op, kw.get("clock", 0)))
        return super().send(i, op, rid=rid, copy=copy, **kw)

    def wait(self, pending, timeout, what, cancel=None):
        if self.late:
            self.late -= 1
            raise PeerTimeout(self.addresses[0], timeout, what)
        got = {}
        while self.socks[0].queue:
            msg = wire.decode(self.socks[0].queue.pop(0))
            if msg.id in pending and msg.id not in got:
                fields = {"incarnation": self.incarnation} if msg.op == "stats" else {}
                got[msg.id] = wire.decode(wire.reply(msg, **fields))
        return got


class Client(ParameterClient):
    def __init__(self, cfg: Config):
        self._setup(cfg, 0)
        self.peers, self._probes = FakeShard(), FakeShard()
        self.retry_s = 0.01   # windows of 10, 20, then 40 ms (the longest: 4 x retry_s)
        self._waiting_since = 0.0
        self.alive = lambda i: True


def pushes(client: Client, clock: int) -> int:
    return client.peers.sent.count(("push", clock))


def step(client: Client, clock: int, late: int) -> None:
    client.peers.late = late
    client.push(clock, [torch.ones(1000)], [torch.zeros(0)], [0])


def test_a_late_answer_from_the_same_shard_is_waited_for_not_sent_again():
    client = Client(Config().replace(**{"cluster.servers": 1}))
    step(client, 1, late=1)
    assert pushes(client, 1) == 2   # never probed before: it may have restarted since, so it goes again
    step(client, 2, late=2)         # the same shard process, slow twice: the push went once
    assert pushes(client, 2) == 1 and client.retries == 1   # (summary.json's resends: the one that went)


def test_a_restarted_shard_gets_the_request_again():
    client = Client(Config().replace(**{"cluster.servers": 1}))
    step(client, 1, late=1)
    client._probes.incarnation = "b"   # the shard restarted after the push left: it lost it
    step(client, 2, late=1)
    assert pushes(client, 2) == 2


def test_the_longest_window_sends_it_again():
    """A request that the same shard has not answered through the growing windows goes
    again once the window is the longest (a connection dropped and made again may lose
    what it carried)."""
    client = Client(Config().replace(**{"cluster.servers": 1}))
    step(client, 1, late=1)
    step(client, 2, late=3)   # windows of 10 and 20 ms: waited for; the 40 ms one: sent again
    assert pushes(client, 2) == 2


def test_a_request_on_a_connection_made_again_since_goes_again():
    """A review: the same shard process, but ZeroMQ had made the data connection again
    (a dropped TCP connection) after the push left, which may have lost it or its answer:
    it waited through every window (14 s at the defaults) before it went again."""
    client = Client(Config().replace(**{"cluster.servers": 1}))
    step(client, 1, late=1)
    real_wait = client.peers.wait

    def reconnected_then_late(pending, timeout, what, cancel=None):
        client.peers.handshook[0] = time.monotonic()   # a handshake after the push left
        client.peers.wait = real_wait
        return real_wait(pending, timeout, what, cancel)
    client.peers.wait = reconnected_then_late
    step(client, 2, late=1)
    assert pushes(client, 2) == 2


def test_a_shard_names_its_incarnation_in_its_stats_answer():
    """A review: the client's half alone was tested; a shard whose stats answer said no
    incarnation ('') would have every late push sent again, as before, with no test failing."""
    from psgd.shard import Shard
    cfg = Config().replace(**{"cluster.servers": 1})
    probe = wire.decode(wire.encode("stats", id=7, rank=0))

    def said(shard: Shard) -> str:
        [(_, frames)] = shard.on_stats(b"token", probe)
        return str(wire.decode(frames).get("incarnation") or "")
    first, second = Shard(cfg, 0), Shard(cfg, 0)   # the same shard, restarted: another process's object
    assert said(first) and said(first) == said(first)
    assert said(second) and said(second) != said(first)
