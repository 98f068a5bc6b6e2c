"""A daemon hears when a peer's process ends, not when it is stopped (`Service.watch`):
the coordinator waits for an evaluator whose process ended to be started again, and gives
up one that is stopped (servers/coordinator.py, `_heard_evaluator`)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import zmq

from psgd import wire
from psgd.transport import Service

pytestmark = pytest.mark.processes

PEER = """
import sys, time, zmq
from psgd import wire
s = zmq.Context.instance().socket(zmq.DEALER)
s.connect(sys.argv[1])
s.send_multipart(wire.encode("stats", id=1))
assert s.poll(10_000)
s.recv_multipart()
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_watched_peer_is_told_closed_once_its_process_is_killed_not_while_it_is_stopped():
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    address = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    idents: list = []

    def answer(ident, msg):
        service.watch(ident)
        idents.append(ident)
        return [(ident, wire.reply(msg))]

    service = Service(sock, {"stats": answer}, "the test daemon", watching=True)
    peer = subprocess.Popen([sys.executable, "-c", PEER, address])
    try:
        end = time.monotonic() + 30
        while not idents:
            assert time.monotonic() < end and peer.poll() is None, "the peer did not say hello"
            service.poll(20)
        time.sleep(0.2)   # (its answer read)
        peer.send_signal(signal.SIGSTOP)
        end = time.monotonic() + 1.5
        while time.monotonic() < end:   # stopped: its connection stays open
            service.poll(20)
            assert service.closed() == []
        peer.kill()
        peer.wait(10)
        told: list = []
        end = time.monotonic() + 10
        while not told and time.monotonic() < end:
            service.poll(20)
            told = service.closed()
        assert told == idents
        assert service.closed() == []   # (told once)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)
        service.close()
