"""A daemon hears when a peer's process ends, not when it is stopped (`Service.watch`):
the coordinator waits for an evaluator whose process ended to be started again, and gives
up one that is stopped (servers/coordinator.py, `_heard_evaluator`)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import told_closed, watching_service

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
    with watching_service() as (service, said, address):
        peer = subprocess.Popen([sys.executable, "-c", PEER, address])
        try:
            end = time.monotonic() + 30
            while not said:
                assert time.monotonic() < end and peer.poll() is None, "the peer did not say hello"
                service.poll(20)
            time.sleep(0.2)   # (its answer read)
            peer.send_signal(signal.SIGSTOP)
            assert told_closed(service, 1.5) == []   # stopped: its connection stays open
            peer.kill()
            peer.wait(10)
            assert told_closed(service) == [said[0][0]]
            assert service.closed() == []   # (told once)
        finally:
            if peer.poll() is None:
                peer.kill()
                peer.wait(10)
