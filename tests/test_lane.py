"""The same-host lane (psgd.lane): wire frames over a Unix stream socket between a client
and a daemon on one host. Its framing read whole from any split of the bytes; a broken
or oversized message, or a peer that does not read, closes that lane and counts a bad
message, and the daemon serves on; answers that nothing holds any more reuse their
memory, and held ones are never written over; a client whose lane fails goes on over
ZeroMQ; a real shard serves a worker's steps on its lane; CurveZMQ jobs take none."""
from __future__ import annotations

import contextlib
import errno
import math
import os
import socket
import struct
import time

import numpy as np
import pytest
import zmq

from psgd import lane, spinning, transport, wire
from psgd.config import Config, SecurityConfig
from psgd.inprocess import InProcessCluster
from psgd.spinning import Spinner
from psgd.transport import Peers, PeerTimeout, Service, server_socket
from psgd.workers.client import ParameterClient

pytestmark = pytest.mark.timeout(30)


def pair() -> tuple[lane.Conn, lane.Conn]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return lane.Conn(a), lane.Conn(b)


def read_all(conn: lane.Conn, want: int, max_bytes: int = wire.MAX_MESSAGE) -> list:
    got: list = []
    until = time.monotonic() + 5
    while len(got) < want and time.monotonic() < until:
        got += conn.messages(max_bytes)
    return got


def push_frames(values: np.ndarray, rid: int = 1) -> list:
    return wire.encode_with("push", rid, 0, 3, [values], {"pull": True, "read_version": 2})


@pytest.mark.unit
def test_messages_are_read_whole_from_any_split_of_their_bytes():
    a, b = pair()
    values = np.arange(1000, dtype=np.float32)
    raw = b"".join(bytes(v) for frames in (push_frames(values), [b"x", b"", b"yz"]) for v in lane.Conn._packed(frames))
    got: list = []
    for k in range(0, len(raw), 7):    # 7 bytes at a time: every part of the framing cut somewhere
        a.sock.sendall(raw[k:k + 7])
        got += b.messages(wire.MAX_MESSAGE)
    assert len(got) == 2
    assert np.array_equal(wire.decode(got[0]).arrays[0], values)
    assert [bytes(f) for f in got[1]] == [b"x", b"", b"yz"]
    a.close(), b.close()


@pytest.mark.unit
def test_a_message_decodes_as_zeromqs_and_several_sent_at_once_are_each_read():
    a, b = pair()
    values = np.arange(5000, dtype=np.float32)
    for rid in (1, 2, 3):
        a.send(push_frames(values + rid, rid), 1.0)
    msgs = read_all(b, 3)
    assert len(msgs) == 3
    for rid, frames in zip((1, 2, 3), msgs, strict=True):
        m = wire.decode(frames)
        assert (m.op, m.id, m.clock) == ("push", rid, 3)
        assert np.array_equal(m.arrays[0], values + rid)
    a.close(), b.close()


@pytest.mark.unit
def test_a_held_answers_memory_is_not_written_over_and_a_free_ones_is_read_into_again():
    a, b = pair()
    values = np.arange(3000, dtype=np.float32)
    a.send(push_frames(values, 1), 1.0)
    held = wire.decode(read_all(b, 1)[0])
    first = held.arrays[0]
    for rid in (2, 3, 4):
        a.send(push_frames(values * 0 - rid, rid), 1.0)
        wire.decode(read_all(b, 1)[0])   # (dropped at once: its memory is free again)
    assert np.array_equal(first, values)  # the held one intact
    assert len(b._spare) < lane.SPARE     # the free ones were read into again, not one new buffer each
    a.close(), b.close()


@pytest.mark.unit
@pytest.mark.parametrize("head, bad, why", [
    (struct.pack("<I", 0), True, "0 frames"),
    (struct.pack("<I", lane.MAX_FRAMES + 1), True, f"{lane.MAX_FRAMES + 1} frames"),
    (struct.pack("<II", 1, 1 << 20), True, "at most 1000"),
])
def test_a_broken_message_ends_the_lane_as_a_bad_one(head, bad, why):
    a, b = pair()
    a.sock.sendall(head.ljust(lane._PREFIX, b"\0"))   # (a framing is read whole)
    with pytest.raises(lane.LaneError, match=why) as e:
        read_all(b, 1, max_bytes=1000)
    assert e.value.bad is bad
    with pytest.raises(lane.LaneError):   # and stays ended
        b.messages(1000)
    a.close(), b.close()


@pytest.mark.unit
def test_messages_complete_before_the_peer_closed_are_read_first():
    a, b = pair()
    a.send([b"one"], 1.0)
    a.send([b"two"], 1.0)
    a.close()
    assert [bytes(m[0]) for m in b.messages(100) + b.messages(100)] == [b"one", b"two"]
    with pytest.raises(lane.LaneError, match="closed") as e:
        b.messages(100)
    assert not e.value.bad
    b.close()


@pytest.mark.unit
def test_a_daemons_answers_wait_for_room_and_a_peer_that_never_reads_ends_its_lane():
    a, b = pair()
    b.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)   # (the kernel's least)
    big = np.ones(50_000, np.uint8)
    b.offer([b"h", big], copy=True)   # more than the kernel takes: the rest kept, copied
    assert b.queued
    big[:] = 7                        # the caller's memory may change at once
    got = []
    until = time.monotonic() + 5
    while (b.queued or not got) and time.monotonic() < until:
        got += a.messages(wire.MAX_MESSAGE)
        b.flush()
    assert not b.queued and len(got) == 1 and bytes(got[0][1]) == bytes(50_000 * [1])
    with pytest.raises(lane.LaneError, match="does not read") as e:
        for _ in range(lane.MAX_QUEUED + 2):
            b.offer([b"h", big])
    assert e.value.bad
    a.close(), b.close()


@pytest.mark.inprocess
def test_a_reply_a_lane_still_writes_is_in_flight_for_the_shard(port_block):
    """Without `copy` a lane keeps views of what the kernel has not taken: the shard's lent
    tables, which it moves to a copy before they change while `in_flight` says so."""
    echo = Echo(port_block(1))
    a, b = pair()
    try:
        b.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        echo.service._lanes[b.fd] = echo.service._lane_of[b.ident] = b
        assert not echo.service.in_flight()
        table = np.ones(50_000, np.float32)
        echo.service.send([(b.ident, [b"h", table])])
        assert b.queued and echo.service.in_flight()
        got: list = []
        until = time.monotonic() + 5
        while not got and time.monotonic() < until:
            got += a.messages(wire.MAX_MESSAGE)
            echo.service.poll(10)   # (writes the rest when the socket is writable)
        assert bytes(got[0][1]) == table.tobytes() and not echo.service.in_flight()
    finally:
        a.close()
        echo.close()


@pytest.mark.unit
def test_a_lane_is_named_for_tcp_addresses_on_linux_only(monkeypatch):
    assert lane.name("tcp://127.0.0.1:5556") == b"\0psgd-lane tcp://127.0.0.1:5556"
    assert lane.name("ipc:///tmp/x") is None
    assert lane.name("tcp://" + "h" * 120 + ":1") is None
    monkeypatch.setattr(lane.sys, "platform", "darwin")
    assert lane.name("tcp://127.0.0.1:5556") is None


# ---------------------------------------------------------------- a daemon and its clients
class Echo:
    """A Service with a lane whose one op (`stats`) answers with its request's fields."""

    def __init__(self, port: int):
        self.address = f"tcp://127.0.0.1:{port}"
        self.ctx = zmq.Context()
        self.sock = server_socket(self.ctx, self.address, SecurityConfig())
        self.by_socket = 0
        self.service = Service(self.sock, {"stats": self.on_stats}, "echo", lane=lane.Listener.open(self.address))

    def on_stats(self, token, msg: wire.Message) -> list:
        self.by_socket += type(token) is bytes
        return [(token, wire.encode("reply", id=msg.id, lane=type(token) is int))]

    def serve(self, until) -> None:
        deadline = time.monotonic() + 5
        while not until() and time.monotonic() < deadline:
            self.service.poll(10)

    def close(self) -> None:
        self.service.close_lanes()
        self.sock.close(0)
        self.ctx.term()


def call(echo: Echo, peers: Peers, **kw) -> wire.Message:
    rid = peers.send(0, "stats", rank=0, **kw)
    got: dict = {}

    def answered() -> bool:
        try:
            got.update(peers.wait({rid: 0}, 0.01, "stats"))
        except PeerTimeout:
            pass
        return rid in got
    echo.serve(answered)
    return got[rid]


@contextlib.contextmanager
def served(port: int, spin_s: float = 0.0, lane: bool = True):
    """An Echo daemon on `port` and a client of it with lanes on (`lane`), both spinning `spin_s`."""
    echo = Echo(port)
    echo.service.spinner = Spinner(spin_s)
    peers = Peers(echo.ctx, [echo.address], SecurityConfig(), lane=lane, spin_s=spin_s)
    try:
        yield echo, peers
    finally:
        peers.close()
        echo.close()


@pytest.mark.inprocess
def test_a_client_talks_on_the_lane_and_goes_on_over_zeromq_when_it_fails(port_block):
    with served(port_block(1)) as (echo, peers):
        assert call(echo, peers).get("lane") is True and peers.lanes[0] is not None
        assert echo.by_socket == 0 and peers.bytes_sent > 0 and peers.bytes_recv > 0
        rid = peers.send(0, "stats", rank=0)
        echo.service.close_lanes()      # the daemon's end goes before it read the request (it was killed)
        with pytest.raises(PeerTimeout):   # the request is lost ...
            peers.wait({rid: 0}, 0.3, "stats")
        assert peers.lanes[0] is None and peers.handshook[0] > 0   # ... as on a connection made again
        assert call(echo, peers).get("lane") is False and echo.by_socket == 1   # and ZeroMQ carries the next


@pytest.mark.inprocess
def test_a_lane_that_opens_after_the_first_request_is_taken_in_a_moment(port_block, monkeypatch):
    """A shard opens its lane just after it binds, and a worker's first request may come
    before: the next try came a second later, and a short job's every step went over
    ZeroMQ (about 20 % slower, in 5 of 20 one-worker jobs of bench/throughput.py). A try
    that finds none is made again 10 ms later, each wait twice the one before, up to
    LANE_RETRY_S: a peer that has none (on another host) costs a few tries, not one a send."""
    tries = []
    connect = lane.connect
    monkeypatch.setattr(lane, "connect", lambda address: tries.append(address) or connect(address))
    address = f"tcp://127.0.0.1:{port_block(1)}"
    ctx = zmq.Context()   # (nothing serves the address: ZeroMQ queues the requests)
    peers = Peers(ctx, [address], SecurityConfig(), lane=True)
    listener = None
    try:
        start = time.monotonic()
        while time.monotonic() - start < 0.3 or (len(tries) < 2 and time.monotonic() - start < 5):
            peers.send(0, "stats")
            time.sleep(0.001)
        took = time.monotonic() - start   # (tries at 0, 10, 30, 70, 150, 310 ms ...)
        assert peers.lanes[0] is None and 2 <= len(tries) <= 2 + math.log2(took / 0.01), (len(tries), took)
        for _ in range(10):   # ... up to LANE_RETRY_S apart
            peers._lane_at[0] = 0.0
            peers.send(0, "stats")
        assert peers._lane_wait[0] == transport.LANE_RETRY_S
        peers.reconnect(0)   # (the waits start again from 10 ms)
        peers.send(0, "stats")
        listener = lane.Listener.open(address)
        assert listener is not None
        time.sleep(0.05)
        peers.send(0, "stats")
        assert peers.lanes[0] is not None
        closed_at = time.monotonic()
        peers._close_lane(0)   # a lane that failed: tried again a second later, then from 10 ms again
        assert peers._lane_at[0] >= closed_at + transport.LANE_RETRY_S
        assert peers._lane_wait[0] == transport.LANE_FIRST_RETRY_S
    finally:
        peers.close()
        if listener is not None:
            listener.sock.close()
        ctx.term()


@pytest.mark.inprocess
def test_a_daemon_counts_a_broken_lane_as_a_bad_message_and_serves_on(port_block):
    """A broken framing closes its lane; a message framed right but not a wire message is
    answered with an error, as on the socket, and its lane stays."""
    with served(port_block(1)) as (echo, peers), contextlib.ExitStack() as closing:
        broken, garbage = (closing.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)) for _ in range(2))
        broken.connect(lane.name(echo.address))
        broken.sendall(struct.pack("<I", 10_000) + os.urandom(lane._PREFIX))   # 10,000 frames
        garbage.connect(lane.name(echo.address))
        garbage.sendall(b"".join(bytes(v) for v in lane.Conn._packed([b"\xc1 not msgpack"])))
        echo.serve(lambda: echo.service.counters["bad_messages"] >= 2)
        assert echo.service.counters["bad_messages"] == 2 and len(echo.service._lanes) == 1
        answer = read_all(lane.Conn(garbage.dup()), 1)[0]
        assert wire.decode(answer).op == "error"
        assert call(echo, peers).get("lane") is True


@pytest.mark.inprocess
def test_a_request_larger_than_the_lane_takes_goes_over_zeromq(port_block):
    with served(port_block(1)) as (echo, peers):
        call(echo, peers)
        peers.lanes[0].max_message = 10
        assert call(echo, peers).get("lane") is False and echo.by_socket == 1


@pytest.mark.unit
def test_curvezmq_clients_take_no_lane():
    ctx = zmq.Context()
    try:
        assert not Peers(ctx, [], SecurityConfig(curve=True, keys="k"), lane=True).lane
    finally:
        ctx.term()


@pytest.mark.inprocess
def test_a_workers_steps_go_on_its_shards_lanes(port_block):
    cfg = Config().replace(**{"cluster.port": port_block(3), "cluster.workers": 1, "cluster.servers": 2,
                              "mode.name": "async", "cluster.timeout_s": 10.0, "train.steps": 100_000})
    with InProcessCluster(cfg) as cluster:
        client = ParameterClient(cfg, cluster.ctx, 0)
        try:
            params, buffers = client.tables(client.join(0))
            clock, until = 0, time.monotonic() + 5   # (a lane is tried again in a moment: the shards
            while not all(client.peers.lanes) and time.monotonic() < until:   # may have had none yet)
                client.push_pull(clock, [0.01 * p for p in params], buffers, [0, 0])
                clock += 1
            assert all(client.peers.lanes)
            for step in range(clock, clock + 3):   # the steps on the lanes are answered
                client.push_pull(step, [0.01 * p for p in params], buffers, [0, 0])
        finally:
            client.close()
    off = cfg.replace(**{"cluster.port": port_block(3), "cluster.local_lane": False})
    with InProcessCluster(off) as cluster:
        client = ParameterClient(off, cluster.ctx, 0)
        try:
            client.tables(client.join(0))
            assert client.peers.lanes == [None, None] and not client.peers.lane
        finally:
            client.close()


# ---------------------------------------------------------------- looking before sleeping
@pytest.mark.unit
def test_spin_returns_what_arrives_and_nothing_after_its_time():
    from psgd.spinning import spin
    a, b = pair()
    poller = zmq.Poller()
    poller.register(b.fd, zmq.POLLIN)
    t0 = time.perf_counter()
    assert spin(poller, 0.005) == [] and time.perf_counter() - t0 >= 0.005
    a.send([b"here"], 1.0)
    assert spin(poller, 5.0) == [(b.fd, zmq.POLLIN)]   # (at once: not after its 5 s)
    a.close(), b.close()


@pytest.mark.unit
def test_psgd_run_spins_only_where_its_busy_processes_fit_the_cores():
    from psgd.config import AUTO_SPIN_US, ConfigError, validate
    from psgd.launcher import spin_for
    one = Config().replace(**{"cluster.workers": 1, "cluster.servers": 1, "cluster.evaluator": False})
    assert spin_for(one, cores=2).cluster.spin_us == AUTO_SPIN_US
    assert spin_for(one, cores=1).cluster.spin_us == 0            # two busy processes on one core
    assert spin_for(Config(), cores=2).cluster.spin_us == 0       # the default job: 2 + 2 + an evaluator
    assert spin_for(one.replace(**{"cluster.spin_us": 50.0}), cores=1).cluster.spin_us == 50   # as given
    with pytest.raises(ConfigError, match="spin_us"):
        validate(one.replace(**{"cluster.spin_us": -5.0}))


@pytest.mark.inprocess
@pytest.mark.parametrize("on_lane", [True, False])
def test_a_spinning_client_and_daemon_answer_as_a_sleeping_pair_does(port_block, monkeypatch, on_lane):
    """Over ZeroMQ too (bench/lane.py's `zmq_spin`: the looking process is spared its
    own wake-up): before, only waits on lanes spun."""
    looked = []

    def counted(poller, spin_s):
        looked.append(spin_s)
        return spin(poller, spin_s)
    spin = spinning.spin
    monkeypatch.setattr(spinning, "spin", counted)
    with served(port_block(1), spin_s=0.002, lane=on_lane) as (echo, peers):
        for _ in range(5):
            assert call(echo, peers).get("lane") is on_lane
    assert len(looked) >= 10 and max(looked) <= 0.002   # (the client's waits and the daemon's polls)


@pytest.mark.unit
def test_a_spare_buffer_is_read_into_again_once_nothing_holds_it():
    """Counted as this interpreter counts a free buffer's references (`lane._UNHELD`): with
    a fixed count, one that counts fewer (3.14) would take a held buffer for a free one."""
    a, b = pair()
    view = memoryview(b._buffer(100))   # a frame of an answer still held
    held = id(view.obj)
    assert id(b._buffer(100)) != held
    del view
    assert id(b._buffer(100)) == held
    a.close(), b.close()


@pytest.mark.unit
def test_a_framing_that_claims_more_memory_than_there_is_ends_its_lane_not_the_daemon(monkeypatch):
    a, b = pair()

    def no_memory(self, length: int):
        raise MemoryError
    monkeypatch.setattr(lane.Conn, "_buffer", no_memory)
    a.sock.sendall(struct.pack("<II", 1, 1000).ljust(lane._PREFIX, b"\0"))
    with pytest.raises(lane.LaneError, match="no memory for it") as e:
        read_all(b, 1)
    assert e.value.bad
    a.close(), b.close()


@pytest.mark.unit
def test_the_answers_kept_are_those_unsent_not_those_offered_since_none_was():
    """A peer that reads every answer while the next is still being written (large answers,
    one after another) is not one that does not read: the lane counted the answers offered
    since its queue was last empty, and closed such a lane at MAX_QUEUED."""
    a, b = pair()
    b.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)   # (the kernel's least)
    big = np.ones(200_000, np.uint8)
    b.offer([b"h", big])
    b.offer([b"h", big])
    for _ in range(3 * lane.MAX_QUEUED):
        got: list = []
        until = time.monotonic() + 5
        while not got and time.monotonic() < until:
            b.flush()
            got = a.messages(wire.MAX_MESSAGE)
        assert got and b.queued   # one read whole, the next one still being written
        b.offer([b"h", big])
    assert len(b._answers) == 2
    a.close(), b.close()


@pytest.mark.unit
def test_a_lane_to_a_daemon_that_takes_none_is_not_waited_for(port_block):
    """A daemon that does not accept (stopped; out of descriptors), its queue full: a
    client's connect blocked until it accepted, outside every timeout of the client's."""
    address = f"tcp://127.0.0.1:{port_block(1)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(lane.name(address))
        listener.listen(0)
        opened = []
        while len(opened) < 10 and (conn := lane.connect(address)) is not None:
            opened.append(conn)
        assert 1 <= len(opened) < 10   # then no lane, at once: the request goes over ZeroMQ
        for conn in opened:
            conn.close()


@pytest.mark.unit
def test_a_lane_whose_name_another_user_holds_is_not_taken(port_block):
    """An abstract name has no permissions: another user's process that held a shard's
    lane name took the worker's requests and never answered them, and the worker waited
    past every timeout, its probes answered by the shard over ZeroMQ. A lane's peer is a
    process of the client's own user (here: the listener's as another uid, as root)."""
    address = f"tcp://127.0.0.1:{port_block(1)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(lane.name(address))
        listener.listen(4)
        mine = lane.connect(address)
        assert mine is not None
        mine.close()
        uid = os.geteuid()
        try:
            os.seteuid(uid + 1)   # (root only: the client as another user)
        except PermissionError:
            pytest.skip("changing the effective uid needs root")
        try:
            assert lane.connect(address) is None
        finally:
            os.seteuid(uid)


@pytest.mark.inprocess
def test_a_daemon_out_of_descriptors_leaves_its_lanes_waiting_and_takes_them_later(port_block, monkeypatch):
    """A lane in the listener's queue that no descriptor was free to take kept the
    daemon's poll returning at once: a CPU spent on nothing while it lasted. The listener
    now waits for `_check_fds` to find a descriptor free."""
    with served(port_block(1)) as (echo, peers), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as waiting:
        service = echo.service

        def no_descriptor(self):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        monkeypatch.setattr(lane.Listener, "accept", no_descriptor)
        waiting.connect(lane.name(echo.address))
        service._check_fds_at = time.monotonic() + 60   # (its next check: below, once descriptors are back)
        service.poll(100)
        assert service.lane.fd not in {fd for fd, _ in service.poller.sockets} and not service._lanes
        monkeypatch.undo()
        service._check_fds(time.monotonic())
        service.poll(100)
        assert len(service._lanes) == 1
        assert call(echo, peers).get("lane") is True and len(service._lanes) == 2


@pytest.mark.inprocess
def test_a_connection_made_again_makes_its_lane_again_too(port_block):
    """A client gives a peer that owes answers a fresh connection (`reconnect`); its lane,
    which may be the way that stalls (a daemon that took it and reads nothing), went on."""
    with served(port_block(1)) as (echo, peers):
        assert call(echo, peers).get("lane") is True
        first = peers.lanes[0]
        peers.reconnect(0)
        assert peers.lanes[0] is None
        assert call(echo, peers).get("lane") is True and peers.lanes[0] is not first
