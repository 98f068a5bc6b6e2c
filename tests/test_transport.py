"""psgd/transport.py's client sockets (`Peers`) over real ZeroMQ sockets in this process."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from psgd import transport, wire
from psgd.config import SecurityConfig
from psgd.transport import HandshakeFailed, Peers, Service, readable
from tests.conftest import free_port_block, told_closed, watching_service

pytestmark = pytest.mark.inprocess


@contextmanager
def answering(ctx: zmq.Context, answer=lambda msg: wire.reply(msg), security: SecurityConfig | None = None
              ) -> Iterator[str]:
    """A server on a thread that answers `stats` at once (`answer`'s frames); its address.
    With `security`, it is a daemon's (`server_socket`: CurveZMQ and its authenticator)."""
    if security is None:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        address = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    else:
        address = f"tcp://127.0.0.1:{free_port_block(1)}"
        sock = transport.server_socket(ctx, address, security)
    service = Service(sock, {"stats": lambda ident, msg: [(ident, answer(msg))]}, "test")
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [service.poll(20) for _ in iter(stop.is_set, True)], name="answering")
    thread.start()
    try:
        yield address
    finally:
        stop.set()
        thread.join(10)
        sock.close(0)
        if security is not None and security.curve:
            transport.stop_auth(ctx)


@pytest.mark.timeout(60)
def test_a_waiting_client_reads_its_monitors_events(monkeypatch):
    """A helper's review: a socket's monitor was read only when an answer was late, and
    one that holds about a thousand unread events (handshakes: a peer restarting, a
    connection dropped and made again) blocks ZeroMQ's I/O thread, and every socket of
    the process. Every MONITOR_READ_S, a wait reads them: here the first handshake's."""
    monkeypatch.setattr(transport, "MONITOR_READ_S", 0.0, raising=False)   # every poll of a wait reads them
    ctx = zmq.Context()
    try:
        with answering(ctx) as address:
            peers = Peers(ctx, [address], SecurityConfig())
            try:
                peers.call(0, "stats", timeout=10)   # answered: its handshake succeeded, an event
                assert peers.call(0, "stats", timeout=10).op == "reply"
                assert not readable(peers.monitors[0]), "the handshake's event is still queued"
                assert peers.refused(0) == ""
            finally:
                peers.close()
    finally:
        ctx.term()


@pytest.mark.timeout(60)
def test_a_client_whose_connection_is_made_again_and_again_goes_on_talking(monkeypatch):
    """Thousands of handshakes on one socket (its peer drops each connection: a frame over
    its limit; made again after 1 ms, not ZeroMQ's 100 ms, so that they come within
    seconds, where a real peer's come at most 10 a second) while the client's answers
    come on time from another peer: the process's sockets still move messages."""
    base = transport._base

    def reconnecting_at_once(sock, *args):
        sock.setsockopt(zmq.RECONNECT_IVL, 1)   # (before connect: a connection takes its options then)
        return base(sock, *args)
    monkeypatch.setattr(transport, "_base", reconnecting_at_once)
    ctx = zmq.Context()
    dropping = ctx.socket(zmq.ROUTER)
    dropping.setsockopt(zmq.MAXMSGSIZE, 10)
    dropping.setsockopt(zmq.LINGER, 0)
    drop_address = f"tcp://127.0.0.1:{dropping.bind_to_random_port('tcp://127.0.0.1')}"
    try:
        with answering(ctx) as address:
            peers = Peers(ctx, [drop_address, address], SecurityConfig())
            try:
                end = time.monotonic() + 5   # (about 400 handshakes a second here: 1,000 unread stopped it in 2.5 s)
                while time.monotonic() < end:
                    for _ in range(20):
                        try:   # each connection takes one frame over the limit, and is dropped for it
                            peers.socks[0].send(b"x" * 100, zmq.NOBLOCK)
                        except zmq.Again:
                            pass
                        time.sleep(0.002)   # at most 500 handshakes a second: fewer than a thousand between reads
                    assert peers.call(1, "stats", timeout=5).op == "reply"
            finally:
                while readable(peers.monitors[0]):   # (a blocked I/O thread would hang the close)
                    peers.monitors[0].recv_multipart()
                peers.close()
    finally:
        dropping.close(0)
        ctx.term()


@pytest.mark.timeout(60)
def test_a_client_refused_by_a_curve_server_is_refused_again_not_stuck_sending(tmp_path):
    """ZeroMQ does not connect again after a refused CurveZMQ handshake: the socket is left
    with no connection, and a send on it blocked for good (no send timeout). A heartbeat
    thread or a script's `finish` that had been refused once hung at its next request.
    Each request now fails again with the reason, whether or not a wait has read the
    refusal before it."""
    import os

    from psgd.keys import make_keys
    keys = str(tmp_path / "keys")
    make_keys(keys)
    os.remove(os.path.join(keys, "authorized", "client.key"))   # the server knows no client
    security = SecurityConfig(curve=True, keys=keys)
    ctx = zmq.Context()
    outcomes: list = []
    with answering(ctx, security=security) as address:
        peers = Peers(ctx, [address], security)

        def requests() -> None:
            try:
                for _ in range(2):   # refused, which the wait reads; refused again
                    try:
                        peers.call(0, "stats", timeout=2)
                    except HandshakeFailed as e:
                        outcomes.append(e)
                time.sleep(1)   # refused again: what no wait has read yet
                peers.send(0, "stats")
                peers.send(0, "stats")
                outcomes.append("sent")
            except zmq.ContextTerminated:   # (the test's end, below, of a send stuck for good)
                outcomes.append("stuck")
            finally:
                peers.close()

        asking = threading.Thread(target=requests)
        asking.start()
        asking.join(20)
    ctx.term()   # (a stuck send ends with ContextTerminated, and its thread closes its socket)
    asking.join(10)
    assert outcomes[-1:] == ["sent"] and len(outcomes) == 3, outcomes
    assert "authorized" in str(outcomes[1])


@pytest.mark.timeout(60)
def test_a_request_that_cannot_be_queued_is_a_peer_timeout_after_send_s(monkeypatch):
    """A peer that reads none of its requests (none listens here: ZeroMQ queues them for
    the connection it keeps trying) fills the socket's queue; the next request waits
    SEND_S for room, then raises PeerTimeout, instead of blocking for good."""
    from psgd.transport import PeerTimeout
    base = transport._base

    def small_queue(sock, *args):
        sock.setsockopt(zmq.SNDHWM, 2)   # (before connect: a connection takes its options then)
        return base(sock, *args)
    monkeypatch.setattr(transport, "_base", small_queue)
    monkeypatch.setattr(transport, "SEND_S", 0.5)
    ctx = zmq.Context()
    peers = Peers(ctx, [f"tcp://127.0.0.1:{free_port_block(1)}"], SecurityConfig())
    try:
        peers.send(0, "stats")
        peers.send(0, "stats")
        t0 = time.monotonic()
        with pytest.raises(PeerTimeout, match=r"\(stats: its request could not be queued\)"):
            peers.send(0, "stats")
        assert 0.5 <= time.monotonic() - t0 < 10
    finally:
        peers.close()
        ctx.term()


@pytest.mark.timeout(60)
def test_a_step_whose_request_to_one_shard_cannot_be_queued_drops_what_it_sent_the_others(monkeypatch):
    """`ParameterClient.begin` sends a step's requests shard by shard, their arrays without
    copies; one that cannot be queued (PeerTimeout, above) left the ones sent before it in
    their shards' queues, where ZeroMQ reads the caller's buffers while the caller goes on.
    They are dropped now, as `finish` drops a step given up (`abandon`)."""
    from psgd.config import Config
    from psgd.transport import PeerTimeout
    from psgd.workers.client import ParameterClient
    base = transport._base

    def small_queue(sock, *args):
        sock.setsockopt(zmq.SNDHWM, 2)
        return base(sock, *args)
    monkeypatch.setattr(transport, "_base", small_queue)
    monkeypatch.setattr(transport, "SEND_S", 0.5)
    ctx = zmq.Context()   # (none listens on the shards' ports: their queues keep what is sent)
    c = ParameterClient(Config().replace(**{"cluster.port": free_port_block(3), "cluster.servers": 2}), ctx, 0)
    try:
        c.peers.send(1, "stats")
        c.peers.send(1, "stats")   # shard 1's queue is full
        first, second = c.peers.socks
        with pytest.raises(PeerTimeout, match="could not be queued"):
            c.begin([(0, "stats", {}), (1, "stats", {})])
        assert c.peers.socks[0] is not first and first.closed   # shard 0's request: dropped
        assert c.peers.socks[1] is second   # (nothing of this step's is queued there)
    finally:
        c.close()
        ctx.term()


def test_a_request_goes_as_wire_encode_makes_it(monkeypatch):
    """`Peers.send` takes the header's fields out of its keywords itself (not spread into
    `wire.encode`'s): the frames are what `wire.encode` makes of the same request."""
    import numpy as np
    sent: list = []
    monkeypatch.setattr(transport, "send_frames", lambda sock, frames, copy, flags=0: sent.append(frames))
    ctx = zmq.Context()
    peers = Peers(ctx, ["tcp://127.0.0.1:9"], SecurityConfig())
    try:
        a = np.arange(4, dtype=np.float32)
        kw = {"clock": 5, "read_version": 3, "arrays": [a, np.zeros(0, np.float32)], "pull": True}
        rid = peers.send(0, "push", rank=2, **kw)
        assert [bytes(f) for f in sent[0]] == [bytes(f) for f in wire.encode("push", id=rid, rank=2, **kw)]
        assert kw["clock"] == 5 and len(kw) == 4   # (the caller's dict is not the one taken apart)
        rid = peers.send(0, "stats")
        assert [bytes(f) for f in sent[1]] == [bytes(f) for f in wire.encode("stats", id=rid)]
        assert peers.bytes_sent == sum(len(bytes(f)) for frames in sent for f in frames)
    finally:
        peers.close()
        ctx.term()


@pytest.mark.timeout(60)
def test_an_answer_that_came_by_the_deadline_is_taken_by_a_wait_that_looks_after_it():
    """CI (2026-12-05): a shard ran on until cluster.timeout_s and exited 1 "lost the
    coordinator" though the job had ended: most likely its heartbeat thread got no CPU
    until past the wait's deadline, and the wait raised PeerTimeout without reading the
    answer (`done`) that had come meanwhile; the next heartbeat's fresh connection dropped
    it. At the deadline, what has come is read first; nothing there is still a timeout."""
    ctx = zmq.Context()
    try:
        with answering(ctx) as address:
            peers = Peers(ctx, [address], SecurityConfig())
            try:
                peers.call(0, "stats", timeout=10)   # (connected)
                rid = peers.send(0, "stats")
                deadline = time.monotonic() + 10
                while not readable(peers.socks[0]) and time.monotonic() < deadline:
                    time.sleep(0.01)   # the answer is here before the wait starts
                assert peers.wait({rid: 0}, 0.0, "a late look")[rid].op == "reply"
                with pytest.raises(transport.PeerTimeout):
                    peers.wait({rid + 1000: 0}, 0.0, "none to take")   # (an id never sent)
            finally:
                peers.close()
    finally:
        ctx.term()


@pytest.mark.timeout(60)
def test_an_answer_that_cannot_be_read_here_is_an_error_not_a_wait_for_good():
    """A review: an answer that failed to decode was dropped even where its header named
    the request waiting (a tournament's model past wire.MAX_MESSAGE), and the request was
    sent again, answered the same, for good."""
    import numpy as np

    def unreadable(msg):
        frames = list(wire.reply(msg, [np.zeros(4, np.float32)]))
        frames[-1] = b"abc"   # (a length the header does not give: as an answer past the limit, unread)
        return frames
    ctx = zmq.Context()
    try:
        with answering(ctx, unreadable) as address:
            peers = Peers(ctx, [address], SecurityConfig())
            try:
                t0 = time.monotonic()
                with pytest.raises(wire.BadAnswer, match="its answer cannot be read here: array 0: 3 bytes"):
                    peers.call(0, "stats", timeout=30)
                assert time.monotonic() - t0 < 20
            finally:
                peers.close()
    finally:
        ctx.term()


@pytest.mark.timeout(60)
def test_a_message_of_too_many_frames_keeps_only_one_more_than_a_message_may_have():
    """A review: a message of 500,000 empty frames (1 MB on the wire) became 130 MB of
    frame objects in a daemon before wire.decode refused it."""
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://frames")
        b.connect("inproc://frames")
        b.send_multipart([b""] * 10_000)
        b.send_multipart([b"next", b"message"])
        deadline = time.monotonic() + 10
        while not readable(a) and time.monotonic() < deadline:
            time.sleep(0.01)
        frames = transport.recv_frames(a)
        assert len(frames) == wire.MAX_FRAMES + 3
        with pytest.raises(wire.WireError, match="frames, at most"):
            wire.decode(frames[1:])
        assert [f.bytes for f in transport.recv_frames(a)] == [b"next", b"message"]   # the rest was read
        a.close(0)
        b.close(0)
    finally:
        ctx.term()


def test_a_peer_that_did_not_answer_is_told_apart_by_why():
    """Said where a daemon gives up on a shard or the coordinator ("did not answer within
    cluster.timeout_s: ..."): ZeroMQ retries a name that does not resolve, a port where
    nothing listens and a silent peer alike, and the give-up said only "no answer"."""
    import socket

    from psgd.transport import unreachable
    assert unreachable("tcp://psgd-no-such-host.invalid:5556").startswith(
        "the host 'psgd-no-such-host.invalid' does not resolve (")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert unreachable(f"tcp://127.0.0.1:{port}") == f"nothing listens at 127.0.0.1:{port} (connection refused)"
        s.listen()   # there, silent: nothing this can tell
        assert unreachable(f"tcp://127.0.0.1:{port}") == unreachable(f"tcp://localhost:{port}") == ""
    assert unreachable("ipc:///tmp/psgd-x") == unreachable("tcp://*:5556") == ""


def peer(address: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.linger = 2000   # (its last message leaves before its close)
    s.connect(address)
    return s


def served(service: Service, said: list, n: int) -> None:
    end = time.monotonic() + 10
    while len(said) < n:
        assert time.monotonic() < end, said
        service.poll(20)


@pytest.mark.timeout(60)
def test_a_message_read_after_its_connections_close_is_known_watches_nothing_and_says_so():
    """A review: an evaluator's last heartbeat, read after the close of its connection
    (the coordinator reads closes in its tick, between polls), took it for one that is
    there, and the job gave it up as a stopped one."""
    with watching_service() as (service, said, address):
        a = peer(address)
        try:
            a.send_multipart(wire.encode("stats", id=1))
            served(service, said, 1)
            a.send_multipart(wire.encode("stats", id=2))   # its last message, then its process ends
        finally:
            a.close()
        ident = said[0][0]
        assert said == [(ident, True)] and told_closed(service) == [ident]
        served(service, said, 2)
        assert said[1] == (ident, False) and told_closed(service, 0.5) == []   # (told once, not watched again)


@pytest.mark.timeout(60)
def test_a_first_message_read_after_its_connections_close_watches_nothing_and_says_so():
    """A review: a connection that closed before its first message was read had its close
    read with nobody watched on it: its peer was watched as there, and never told gone."""
    with watching_service() as (service, said, address):
        w = peer(address)
        try:
            w.send_multipart(wire.encode("stats", id=1))
            served(service, said, 1)   # (the monitor is made)
            a = peer(address)
            try:
                a.send_multipart(wire.encode("stats", id=2))   # its one message, then its process ends
            finally:
                a.close()
            end = time.monotonic() + 10
            while not service._closed_fds:   # its close read before its message (with none watched on it)
                assert time.monotonic() < end, "its close was not seen"
                service.closed()
                time.sleep(0.02)
            served(service, said, 2)
            assert said[0][1] and said[1][0] != said[0][0] and not said[1][1], said
        finally:
            w.close()


@pytest.mark.timeout(60)
def test_a_close_is_told_of_its_own_connection_not_of_the_next_on_its_descriptor():
    """A connection closed and the next one made at once (a socket made again) take the
    same descriptor here: the close read after the new connection's first message was
    told of both, and the new one, open, counted as gone for good."""
    with watching_service() as (service, said, address):
        a = peer(address)
        a.send_multipart(wire.encode("stats", id=1))
        served(service, said, 1)
        a.close()
        b = peer(address)
        try:
            b.send_multipart(wire.encode("stats", id=2))
            served(service, said, 2)
            (first, _), (second, watched) = said
            assert watched and second != first
            assert told_closed(service, 0.5) == [first]
            b.close()
            assert told_closed(service) == [second]
        finally:
            b.close()


@pytest.mark.timeout(60)
def test_a_watch_without_a_descriptor_free_answers_and_watches_at_a_later_message():
    """A review: the monitor of `watch`, made in the handler, raised ZeroMQ's "Too many open
    files" in a process out of descriptors: the coordinator refused the evaluator's
    messages, its final score too (`internal`), until one was free."""
    import os
    with watching_service() as (service, said, address):
        a = peer(address)
        try:
            a.send_multipart(wire.encode("stats", id=1))
            assert a.poll(0) == 0 and service.sock.poll(10_000)
            held: list[int] = []
            try:
                while True:
                    held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                service.poll(100)
                made = service._closes is not None
            finally:
                for fd in held:
                    os.close(fd)
            assert said[0][1] and not made and service.counters["bad_messages"] == 0
            assert a.poll(5000) and wire.decode(a.recv_multipart()).op == "reply"
            a.send_multipart(wire.encode("stats", id=2))
            served(service, said, 2)   # watched now
            a.close()
            assert told_closed(service) == [said[0][0]]
        finally:
            a.close()
