"""Hostile or broken peers against the one serve loop (`psgd.transport.Service`), as a
live daemon meets them: a peer that never reads its replies, and a stream of bad
messages (what the daemon's log says of them)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from psgd import transport, wire
from psgd.config import Config
from psgd.transport import Service, server_socket
from tests.conftest import free_port_block

pytestmark = pytest.mark.inprocess


@pytest.mark.timeout(60)
@pytest.mark.parametrize("values", [1 << 16, 1 << 13], ids=["256 KiB, lent", "32 KiB, copied"])
def test_a_peer_that_never_reads_its_replies_pins_a_bounded_number_of_them(values):
    """A peer that sends reads and never reads the answers: ZeroMQ held up to its default
    high-water mark, 1,000 replies a connection, each a copy of the shard's tables (below
    COPY_THRESHOLD) or lending them as they were (above it, kept until ZeroMQ sends it). Live,
    five such connections to each shard of a digits job (52 KB tables) took each shard
    from 184 MB to 436 MB; with a 40 MB table one connection could pin 40 GB. Now past
    MAX_UNREAD_REPLIES unsent large replies to a peer its replies are dropped and counted,
    and ZeroMQ queues at most SERVER_SNDHWM replies a peer (an honest one has a request or
    two in flight a shard, and reads the answers)."""
    ctx = zmq.Context()
    port = free_port_block(1)
    sock = server_socket(ctx, f"tcp://127.0.0.1:{port}", Config().security)
    served = []

    def pull(ident, msg):   # a table of another revision each time, as a training shard's
        served.append(msg.id)
        return [(ident, wire.reply(msg, arrays=[np.full(values, msg.id, dtype=np.float32)]))]

    service = Service(sock, {"pull": pull}, "the test daemon", sent=lambda: None)
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVHWM, 1)
    peer.setsockopt(zmq.RCVBUF, 4096)
    peer.connect(f"tcp://127.0.0.1:{port}")
    n = 400
    try:
        for i in range(n):
            peer.send_multipart(wire.encode("pull", id=i + 1))
        deadline = time.monotonic() + 30
        while len(served) < n and time.monotonic() < deadline:
            service.poll(20)
        assert len(served) == n
        time.sleep(0.5)   # (what the kernel takes, it takes)
        service.in_flight()
        assert len(service._trackers) <= 2 * transport.MAX_UNREAD_REPLIES + 16, f"{len(service._trackers)} of {n} held"
        got = 0   # the peer reads at last: what ZeroMQ and the kernel had kept for it
        while peer.poll(500):
            peer.recv_multipart()
            got += 1
        assert got <= transport.SERVER_SNDHWM + 100, f"{got} of {n} replies kept for a peer that did not read"
    finally:
        peer.close(0)
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change", ["replaced by another pair", "cut short", "removed"])
def test_a_clients_key_file_changed_during_a_job_leaves_its_reconnects_talking(tmp_path, change):
    """A daemon keeps the keys it started with, as a server keeps the authorized/ it read
    at its start. Each reconnect (a heartbeat unanswered, a shard restarted) loaded the
    client's key file again: replaced during the job by another pair (`psgd keys` elsewhere,
    copied over it) the connection was refused, a HandshakeFailed; cut short or removed, the
    reconnect raised a ConfigError, which ended the heartbeat thread it came from."""
    import os
    import shutil

    from psgd.keys import make_keys
    from psgd.transport import Peers
    keys, other = str(tmp_path / "keys"), str(tmp_path / "other")
    make_keys(keys)
    make_keys(other)
    security = Config().replace(**{"security.curve": True, "security.keys": keys}).security
    ctx = zmq.Context()
    port = free_port_block(1)
    address = f"tcp://127.0.0.1:{port}"
    sock = server_socket(ctx, address, security)
    service = Service(sock, {"stats": lambda ident, msg: [(ident, wire.reply(msg, ok=True))]}, "the test daemon")
    peers = Peers(ctx, [address], security)

    def ask() -> wire.Message:
        rid = peers.send(0, "stats")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            service.poll(20)
            try:
                return peers.wait({rid: 0}, 0.05, "stats")[rid]
            except transport.PeerTimeout:
                continue
        raise AssertionError("no answer")
    try:
        assert ask().get("ok")
        secret = os.path.join(keys, "client.key_secret")
        if change == "replaced by another pair":
            for name in ("client.key", "client.key_secret"):
                shutil.copy(os.path.join(other, name), os.path.join(keys, name))
        elif change == "cut short":
            with open(secret, "r+") as f:
                f.truncate(os.path.getsize(secret) // 2)
        else:
            os.remove(secret)
        peers.reconnect(0)
        assert ask().get("ok")
    finally:
        peers.close()
        sock.close(0)
        transport.stop_auth(ctx)
        ctx.term()


@pytest.mark.timeout(60)
def test_bad_messages_are_said_in_the_log_once_then_counted_not_one_line_each(capsys):
    """A daemon fuzzed live with 6,000 garbled messages said nothing in its log (summary.json's
    bad_messages was the first sign), while a handler that raised said one line a message,
    however fast a peer sent them. Now the first is said at once, with its code and reason,
    and the rest once every BAD_LOG_S, counted, with the latest."""
    ctx = zmq.Context()
    port = free_port_block(1)
    sock = server_socket(ctx, f"tcp://127.0.0.1:{port}", Config().security)

    def broken(ident, msg):
        raise KeyError("a handler's bug")
    service = Service(sock, {"stats": broken}, "the test daemon")
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"tcp://127.0.0.1:{port}")
    n = 200

    def serve(frames_list):   # (8 at a time: a server queues at most SERVER_SNDHWM replies a peer)
        got, deadline = 0, time.monotonic() + 20
        for k in range(0, len(frames_list), 8):
            for frames in frames_list[k:k + 8]:
                peer.send_multipart(frames)
            while got < min(k + 8, len(frames_list)) and time.monotonic() < deadline:
                service.poll(10)
                while peer.poll(0):
                    peer.recv_multipart()
                    got += 1
        assert got == len(frames_list)
    try:
        serve([[b"\xc1 not msgpack"]] * n)
        serve([wire.encode("stats", id=i + 1) for i in range(n)])
        assert service.counters["bad_messages"] == 2 * n
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("[psgd test daemon] ") and "bad_header: header is not valid msgpack" in lines[0]
        service._say_bad_at = time.monotonic()   # BAD_LOG_S later: the rest, in one line
        service.poll(0)
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1, lines
        assert f"{2 * n - 1} bad messages" in lines[0] and "error serving stats: KeyError" in lines[0]
        service.poll(0)
        assert capsys.readouterr().err == ""   # nothing more to say
    finally:
        peer.close(0)
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(30)
def test_keys_made_again_in_one_process_are_the_ones_its_next_sockets_load(tmp_path):
    """A review: a process's sockets keep the keys they first loaded (a key file replaced
    mid-job must not break a running daemon); a long-lived process (`psgd.connect` in a
    notebook) whose next job's keys were made again in the same folder kept the old
    pair, and that job's servers refused it. A new job, or `make_keys`, forgets them."""
    import shutil

    from psgd import transport
    from psgd.keys import make_keys
    keys = str(tmp_path / "keys")
    make_keys(keys)
    first = transport._socket_pair(keys, "client")
    shutil.rmtree(keys)
    make_keys(keys)
    assert transport._socket_pair(keys, "client") != first
