"""The one serve loop and the errors that reach the caller.

- Every daemon serves through `psgd.transport.Service`: a message that fails validation,
  an op the daemon does not serve and a handler that raises each get an error reply
  with the request's id, at once, and the loop goes on.
- An error reply is a typed exception in the parameter client.
- The coordinator waits `cluster.timeout_s` for its workers and says what it waits for;
  a daemon that cannot reach the coordinator names its address.
- The evaluator's reports share one socket to the coordinator.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import numpy as np
import pytest
import zmq

from psgd import transport, wire
from psgd.config import Config, ConfigError, SecurityConfig
from psgd.inprocess import InProcessCluster
from psgd.membership import JOB_TOKEN_ENV, CoordinatorLink
from psgd.servers.coordinator import Coordinator
from psgd.transport import Peers, PeerTimeout, Service, server_socket
from psgd.workers.client import ParameterClient
from tests.conftest import free_port_block

pytestmark = pytest.mark.inprocess


def config(**sets) -> Config:
    return Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 1, "cluster.timeout_s": 5.0,
                               **sets})


def raw_request(address: str, frames: list, timeout_s: float = 10.0) -> tuple[wire.Message, float]:
    """Send raw frames on a fresh DEALER; the decoded answer and how long it took (a
    connection and a thread's turn: seconds, on a loaded machine)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        t0 = time.monotonic()
        sock.send_multipart(frames)
        assert sock.poll(int(timeout_s * 1000)), f"no answer within {timeout_s} s"
        return wire.decode(sock.recv_multipart()), time.monotonic() - t0
    finally:
        sock.close()


@pytest.mark.timeout(60)
def test_service_answers_every_failure_with_the_request_id_and_goes_on():
    ctx = zmq.Context()
    port = free_port_block(1)
    sock = server_socket(ctx, f"tcp://127.0.0.1:{port}", Config().security)

    def boom(ident, msg):
        raise KeyError("a bug")

    def status(ident, msg):
        return [(ident, wire.reply(msg, ok=True))]

    service = Service(sock, {"status": status, "stats": boom}, "the test daemon")
    stop = threading.Event()
    thread = threading.Thread(target=lambda: [service.poll(20) for _ in iter(stop.is_set, True)], name="service")
    thread.start()
    address = f"tcp://127.0.0.1:{port}"
    try:
        m, _ = raw_request(address, wire.encode("push", id=41, read_version=0))       # not served here
        assert (m.op, m.id, m.get("code")) == ("error", 41, wire.UNKNOWN_OP)
        assert "does not serve 'push'" in m.get("reason")
        m, _ = raw_request(address, wire.encode("stats", id=42))                       # the handler raises
        assert (m.op, m.id, m.get("code")) == ("error", 42, wire.INTERNAL) and "KeyError" in m.get("reason")
        bad = {"v": 1, "op": "pull", "id": 43, "rank": 0, "clock": 0, "arrays": [], "nonsense": 1}
        m, _ = raw_request(address, [msgpack.packb(bad)])                               # fails validation
        assert (m.op, m.id, m.get("code")) == ("error", 43, wire.BAD_FIELD)
        m, _ = raw_request(address, [b"\xc1not msgpack"])                               # no header: id 0
        assert (m.op, m.id, m.get("code")) == ("error", 0, wire.BAD_HEADER)
        m, _ = raw_request(address, wire.encode("status", id=44))                      # and it goes on
        assert (m.op, m.id, m.get("ok")) == ("reply", 44, True)
        assert service.counters["bad_messages"] == 4
    finally:
        stop.set()
        thread.join(timeout=5)
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(60)
def test_service_tracks_the_frames_it_sends_without_copying_until_zeromq_is_done():
    ctx = zmq.Context()
    port = free_port_block(1)
    sock = server_socket(ctx, f"tcp://127.0.0.1:{port}", Config().security)
    table = np.arange(1 << 20, dtype=np.float32)    # 4 MiB: above COPY_THRESHOLD, sent without a copy
    calls = []

    def pull(ident, msg):
        return [(ident, wire.reply(msg, arrays=[table]))]

    service = Service(sock, {"pull": pull}, "the test daemon", sent=lambda: calls.append(service.in_flight()))
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"tcp://127.0.0.1:{port}")
    try:
        peer.send_multipart(wire.encode("pull", id=5))
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            service.poll(20)
        assert len(calls) == 1                         # `sent` after the event's replies were handed over
        assert peer.poll(5000)
        m = wire.decode(peer.recv_multipart())
        np.testing.assert_array_equal(m.arrays[0], table)
        while service.in_flight() and time.monotonic() < deadline:  # released once ZeroMQ has sent it
            time.sleep(0.01)
        assert not service.in_flight()
    finally:
        peer.close(0)
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(60)
def test_service_keeps_no_tracker_of_frames_zeromq_is_done_with_when_nobody_asks():
    """A daemon whose tables never change (ltfb's shards: its steps answer with the group's
    mean, its fetches with stored models) never asks `in_flight`: the tracker of every
    zero-copy frame it sent was kept for the whole run (about 2 KB each, one per large
    reply: a shard's memory grew by hundreds of MB an hour)."""
    ctx = zmq.Context()
    port = free_port_block(1)
    sock = server_socket(ctx, f"tcp://127.0.0.1:{port}", Config().security)
    table = np.arange(1 << 18, dtype=np.float32)    # 1 MiB: above COPY_THRESHOLD, sent without a copy
    service = Service(sock, {"pull": lambda ident, msg: [(ident, wire.reply(msg, arrays=[table]))]},
                      "the test daemon", sent=lambda: None)
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"tcp://127.0.0.1:{port}")
    n = 8 * transport.PRUNE_TRACKERS
    try:
        for i in range(n):   # one reply at a time, each read before the next request
            peer.send_multipart(wire.encode("pull", id=i + 1))
            while not peer.poll(5):
                service.poll(5)
            assert wire.decode(peer.recv_multipart()).id == i + 1
        assert len(service._trackers) <= 2 * transport.PRUNE_TRACKERS, f"{len(service._trackers)} of {n} kept"
    finally:
        peer.close(0)
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(60)
def test_service_tracks_each_reply_until_it_has_left_once_asked_to():
    """`track_leaving` (the coordinator's answers after a job's end: its socket is closed
    with linger 0, which discards what is still queued): each reply, headers of a few
    dozen bytes too, is sent without a copy and tracked until ZeroMQ's I/O thread took it;
    the list is pruned as it grows, not only when asked."""
    ctx = zmq.Context()
    port = free_port_block(1)
    sock = server_socket(ctx, f"tcp://127.0.0.1:{port}", Config().security)
    service = Service(sock, {"status": lambda ident, msg: [(ident, wire.reply(msg, ok=True))]}, "the test daemon")
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"tcp://127.0.0.1:{port}")
    try:
        peer.send_multipart(wire.encode("status", id=1))
        while not peer.poll(5):
            service.poll(5)
        peer.recv_multipart()
        assert service.leaving() == []          # (not asked: nothing tracked)
        service.track_leaving()
        n = 3 * transport.PRUNE_TRACKERS
        for i in range(n):
            peer.send_multipart(wire.encode("status", id=i + 2))
            while not peer.poll(5):
                service.poll(5)
            assert wire.decode(peer.recv_multipart()).get("ok") is True
            if i == 0:
                assert len(service._leaving or ()) == 1   # (tracked: a copied frame's tracker is none)
        assert len(service._leaving or ()) < transport.PRUNE_TRACKERS, len(service._leaving or ())
        deadline = time.monotonic() + 5
        while service.leaving() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert service.leaving() == []          # every reply the peer read has left
    finally:
        peer.close(0)
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(60)
def test_coordinator_answers_an_op_it_does_not_serve_at_once():
    """Not after cluster.timeout_s (5 s here), as a request it does not answer would be."""
    cfg = config()
    with InProcessCluster(cfg):
        m, took = raw_request(cfg.coordinator_address(), wire.encode("pull", id=7, rank=0, clock=0))
    assert (m.op, m.id, m.get("code")) == ("error", 7, wire.UNKNOWN_OP)
    assert took < 3.0, took


@pytest.mark.timeout(60)
def test_an_error_reply_is_a_typed_exception_in_the_client():
    cfg = config(**{"mode.name": "sync"})
    with InProcessCluster(cfg) as cluster:
        client = ParameterClient(cfg, cluster.ctx, 0)
        try:
            with pytest.raises(wire.Refused, match="elastic is not used in mode sync") as e:
                client.request([(0, "elastic", {"round": 0, "clock": 0})])
            assert e.value.code == wire.REFUSED and e.value.peer == cfg.shard_address(0)
            with pytest.raises(wire.BadRequest):
                client.request([(0, "push", {"clock": 0, "read_version": 0, "arrays": [np.zeros(3, np.float32)]})])
        finally:
            client.close()


@pytest.mark.timeout(60)
def test_a_shard_refuses_table_changes_from_a_worker_of_another_job(monkeypatch):
    """A worker of another job still dialing the port (its own shards gone, this job's on
    the same port) would have its pushes applied to this job's model. A shard refuses a
    push, an offer, a deposit or initial values whose job token is not its own, counts
    it as a bad message and keeps its tables; a read too (a review: a pull moves the
    rule's clocks, ssp's finished clock of the rank, sync's step)."""
    monkeypatch.setenv(JOB_TOKEN_ENV, "ours")
    cfg = config(**{"mode.name": "async"})
    with InProcessCluster(cfg) as cluster:
        own = ParameterClient(cfg, cluster.ctx, 0)
        # every shard serving: its token read (shard 1, asked nothing, had read "theirs": 1 run in ~100)
        stats = own.request([(i, "stats", {}) for i in range(cfg.cluster.servers)])[0]
        monkeypatch.setenv(JOB_TOKEN_ENV, "theirs")
        stray = ParameterClient(cfg, cluster.ctx, 0)
        try:
            size = own.pull(0)[0].arrays[0].size   # (this job's read: served)
            g, b = np.ones(size, np.float32), np.zeros(0, np.float32)
            for op, fields in [("push", {"clock": 0, "read_version": 0, "arrays": [g, b]}),
                               ("init", {"arrays": [g, b]}), ("pull", {"clock": 5})]:
                with pytest.raises(wire.Refused, match=f"this {op} comes from a worker of another job"):
                    stray.request([(0, op, fields)])
            after = own.request([(0, "stats", {})])[0]
            assert after.get("version") == stats.get("version") == 0
            assert after.get("bad_messages") == stats.get("bad_messages") + 3
            own.request([(0, "push", {"clock": 0, "read_version": 0, "arrays": [g, b]})])
            assert own.request([(0, "stats", {})])[0].get("version") == 1   # this job's own push is taken
        finally:
            own.close()
            stray.close()


@pytest.mark.timeout(60)
def test_coordinator_alone_gives_up_after_timeout_and_says_what_it_waits_for(capsys, monkeypatch):
    import psgd.servers.coordinator as coordinator
    monkeypatch.setattr(coordinator, "WAITING_EVERY_S", 0.5)
    cfg = config(**{"cluster.workers": 2, "cluster.timeout_s": 1.5})
    t0 = time.monotonic()
    code = Coordinator(cfg, quiet=True, ctx=zmq.Context.instance()).serve()
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 1 and took < 5, took
    assert "0/2 workers registered, giving up in 1 s" in err, err
    assert "0/2 workers registered after cluster.timeout_s = 1.5 s; giving up" in err, err   # (it said 2 s)
    assert "psgd.connect" not in err   # (psgd's own workers)
    assert "more busy processes than the machine has cores, starting them can take longer than that: raise " \
           "cluster.timeout_s?)" in err, err   # (their start on a busy machine: 30-47 s for 12 workers on 2 cores)


@pytest.mark.timeout(60)
def test_a_coordinator_restarted_after_it_gave_up_waiting_for_its_workers_ends_at_once(tmp_path, capsys):
    """A review: under Compose (`restart: on-failure:3`) a coordinator that gave up waiting
    for its workers was restarted into the same rendezvous, which waited cluster.timeout_s
    again: four times in all. It records the end in its state file, as an abort does."""
    cfg = config(**{"cluster.workers": 2, "cluster.timeout_s": 1.0})
    for _ in range(2):   # (each on a context of its own, terminated: a closed socket's listener goes on
        ctx = zmq.Context()   # ZeroMQ's I/O thread, and the next bind to the port found it in use, once in CI)
        try:
            assert Coordinator(cfg, str(tmp_path), quiet=True, ctx=ctx).serve() == 1
        finally:
            ctx.term()
    assert "ended 0 s ago, aborted: 0/2 workers registered after cluster.timeout_s = 1 s; nothing to do" in \
        capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_coordinator_off_loopback_gives_up_naming_the_address_workers_dial(capsys, tmp_path):
    """On a cluster (cluster.host a node's address) the coordinator binds tcp://*:PORT; its
    give-up line asked "do they reach tcp://*:5555?", not the address the workers dial.
    With CurveZMQ, a worker with other keys is never answered: the line says so."""
    from psgd.cli import main as cli_main
    cli_main(["keys", str(tmp_path / "keys")])
    capsys.readouterr()
    cfg = config(**{"cluster.workers": 2, "cluster.timeout_s": 0.5, "cluster.host": "psgd-head.invalid",
                    "security.curve": True, "security.keys": str(tmp_path / "keys")})
    assert Coordinator(cfg, quiet=True, ctx=zmq.Context.instance()).serve() == 1
    err = capsys.readouterr().err
    assert f"do they reach tcp://psgd-head.invalid:{cfg.cluster.port}; where the job has more busy processes than " \
           f"the machine has cores, starting them can take longer than that: raise cluster.timeout_s?; " \
           f"with security.curve, a worker without this " \
           f"job's keys ({tmp_path / 'keys'}) is never answered)" in err, err


@pytest.mark.timeout(60)
def test_a_script_job_that_gives_up_on_registrations_says_the_scripts_start_counts(capsys):
    """A review: the rendezvous counts from the coordinator's start, so a script that loads
    its data before psgd.connect for longer than cluster.timeout_s failed with "0/2 workers
    registered ... giving up (are all workers started ...?)" and no word of what to raise."""
    cfg = config(**{"cluster.workers": 2, "cluster.timeout_s": 0.5, "model.name": "script"})
    assert Coordinator(cfg, quiet=True, ctx=zmq.Context.instance()).serve() == 1
    err = capsys.readouterr().err
    assert "a script's work before psgd.connect counts: raise cluster.timeout_s if it takes longer?)" in err, err


@pytest.mark.timeout(60)
def test_a_daemon_whose_coordinator_host_does_not_resolve_says_so_at_its_give_up():
    """A helper's finding: `psgd worker --set cluster.host=nosuchhost.invalid` (started by
    hand; psgd run refuses it before the start) gave up "no answer from ... is it running
    there?", as for a host that is up but silent. ZeroMQ retries a name it cannot look up
    as it retries a silent peer; the give-up says the name does not resolve."""
    cfg = config(**{"cluster.timeout_s": 1.0, "cluster.host": "psgd-no-such-host.invalid"})
    with pytest.raises(PeerTimeout) as e:
        CoordinatorLink(cfg, "worker", 0, zmq.Context.instance()).register()
    assert "the host 'psgd-no-such-host.invalid' does not resolve (" in str(e.value), str(e.value)


@pytest.mark.timeout(60)
def test_a_shard_that_cannot_reach_the_coordinator_names_its_address():
    cfg = config(**{"cluster.timeout_s": 1.0})
    link = CoordinatorLink(cfg, "server", 0, zmq.Context.instance())
    with pytest.raises(PeerTimeout) as e:
        link.register()
    text = str(e.value)
    assert cfg.coordinator_address() in text and "server 0" in text
    assert "workers" not in text  # the hint about workers belongs to the coordinator's side


@pytest.mark.timeout(60)
def test_calls_to_the_coordinator_share_one_socket():
    cfg = config()
    with InProcessCluster(cfg) as cluster:
        seen = []
        on_status = cluster.coordinator.on_status

        def spy(ident, msg):
            seen.append(bytes(ident.bytes if hasattr(ident, "bytes") else ident))
            return on_status(ident, msg)

        cluster.coordinator.service.handlers["status"] = spy
        link = CoordinatorLink(cfg, "evaluator", 0, cluster.ctx)
        try:
            for _ in range(3):
                link.call("status")
        finally:
            link.close()
    assert len(seen) == 3 and len(set(seen)) == 1, seen


@pytest.mark.timeout(60)
def test_leaving_an_in_process_cluster_with_a_socket_open_names_it_instead_of_hanging():
    # ctx.term() waits for every socket of the context: a client left open hung the test for ever
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.evaluator": False})
    with pytest.raises(RuntimeError, match=r"1 socket\(s\) still open on its context .* \(DEALER\)"):
        with InProcessCluster(cfg) as cluster:
            client = cluster.ctx.socket(zmq.DEALER)
    assert client.closed


@pytest.mark.timeout(60)
def test_a_shard_told_to_stop_while_waiting_for_the_coordinator_stops_at_once(tmp_path):
    # it waited up to cluster.timeout_s (60 s) for a coordinator that was never coming: a
    # psgd server sent SIGTERM before its job began, or an in-process cluster left at once
    from psgd.servers.shard_server import ShardServer
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.evaluator": False})   # nobody listens
    ctx = zmq.Context()
    server = ShardServer(cfg, 0, str(tmp_path), ctx=ctx)
    code: list[int] = []
    t = threading.Thread(target=lambda: code.append(server.run()), name="shard-waiting")
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    server.stop()
    t.join(timeout=10)
    assert not t.is_alive() and code == [0] and time.monotonic() - t0 < 2
    ctx.term()


@pytest.mark.timeout(60)
def test_a_shard_whose_final_checkpoint_fails_still_stops_heartbeating_and_closes_its_sockets(tmp_path, monkeypatch):
    # a review: the failed save (a full disk) skipped the rest of the shard's exit: its
    # heartbeats went on, its port stayed bound, and the cluster's context held 3 sockets
    from psgd.shard import Shard

    def full_disk(self, path: str) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Shard, "save", full_disk)
    cluster = InProcessCluster(config(**{"cluster.evaluator": False, "cluster.servers": 1, "checkpoint.every_s": 0}),
                               str(tmp_path))
    server, raised = cluster.servers[0], []

    def run() -> None:
        try:
            server.run()
        except OSError as e:   # (what psgd server's caller says in one line)
            raised.append(e)
    cluster.threads[1] = threading.Thread(target=run, name="inprocess-server-0", daemon=True)
    with cluster:   # (leaving it: an error if a socket of its context is still open)
        until = time.monotonic() + 30
        while 0 not in cluster.coordinator.server_seen and time.monotonic() < until:
            time.sleep(0.05)   # the shard serves: it heartbeats
        assert 0 in cluster.coordinator.server_seen
    assert [e.errno for e in raised] == [28]
    assert not [t for t in threading.enumerate() if t.name == "heartbeat-server"]


def worker_and_evaluator(cfg: Config, out: str) -> dict[str, int]:
    """Worker 0 and the evaluator of `cfg`'s job, each run on a thread against a cluster
    already up: their exit codes."""
    from psgd.workers.evaluator import Evaluator
    from psgd.workers.worker import Worker
    codes: dict[str, int] = {}
    runs = {"worker": lambda: Worker(cfg, out, "cpu", want_rank=0).run(),
            "evaluator": lambda: Evaluator(cfg, out, "cpu").run()}
    threads = [threading.Thread(target=lambda n=n, f=f: codes.__setitem__(n, f())) for n, f in runs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    return codes


@pytest.mark.inprocess
@pytest.mark.timeout(120)
def test_the_final_evaluation_asks_again_a_shard_that_has_no_tables(tmp_path, monkeypatch):
    """A review: a shard restarted during the final evaluation with nothing to restore
    answers `not_ready`; the evaluator raised, the launcher restarted it five times in two
    seconds and gave up, and `psgd run` failed without summary.json. It asks again."""
    from psgd.workers.evaluator import Evaluator
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 1, "cluster.servers": 2,
                              "train.steps": 30, "cluster.evaluator": True, "cluster.timeout_s": 20})
    real, refused = Evaluator.evaluate, []
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        def evaluate(self):
            if cluster.coordinator.phase == "final_eval" and len(refused) < 3:
                refused.append(1)
                raise wire.Refused(wire.NOT_READY, "shard 1 has no initial values yet", "shard 1")
            return real(self)
        monkeypatch.setattr(Evaluator, "evaluate", evaluate)
        codes = worker_and_evaluator(cfg, str(tmp_path))
        assert codes == {"worker": 0, "evaluator": 0} and len(refused) == 3
        assert cluster.coordinator.evals[-1]["final"] and cluster.coordinator.summary["final_accuracy"] > 0.5


@pytest.mark.inprocess
@pytest.mark.timeout(120)
def test_the_evaluator_ends_once_its_final_score_is_answered(tmp_path, monkeypatch):
    """A helper's review under Compose: the evaluator waited for a heartbeat saying `done`;
    when none came before the coordinator's linger ended (2 runs in 3 there), it waited
    cluster.timeout_s, exited 1 "lost the coordinator" and was restarted. Here no heartbeat
    of the evaluator is answered after its final score: it ends with that score, exit 0."""
    from psgd.servers.coordinator import Coordinator
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 1, "cluster.servers": 1,
                              "train.steps": 30, "cluster.evaluator": True, "cluster.timeout_s": 15})
    real = Coordinator.on_heartbeat

    def on_heartbeat(self, ident, msg):
        if msg.get("role") == "evaluator" and any(e["final"] for e in self.evals):
            return []   # unanswered after the final score, as a late heartbeat is
        return real(self, ident, msg)
    monkeypatch.setattr(Coordinator, "on_heartbeat", on_heartbeat)
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        codes = worker_and_evaluator(cfg, str(tmp_path))
        assert codes == {"worker": 0, "evaluator": 0}
        deadline = time.monotonic() + 10   # (the evaluator may end before the coordinator's thread writes it)
        while cluster.coordinator.summary is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cluster.coordinator.summary["final_accuracy"] > 0.5


@pytest.mark.timeout(60)
def test_a_peer_that_keeps_sending_does_not_hold_the_daemons_loop():
    """`Service.poll` returns to the daemon's loop (heartbeats, stop, checkpoints) within
    about DRAIN_S while a peer keeps the socket busy; what is left is served next poll."""
    ctx = zmq.Context()
    sock = server_socket(ctx, "inproc://drain-bound", Config().security)
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect("inproc://drain-bound")
    feed_until = time.monotonic() + 5.0
    served = [0]

    def stats(ident, msg):   # every request served, the peer has sent the next one already
        served[0] += 1
        if time.monotonic() < feed_until:
            peer.send_multipart(wire.encode("stats", id=served[0] + 1))
        return []

    service = Service(sock, {"stats": stats}, "test")
    try:
        peer.send_multipart(wire.encode("stats", id=1))
        t0 = time.monotonic()
        service.poll(50)
        took = time.monotonic() - t0
        assert took < 1.0, f"poll(50) took {took:.1f} s serving {served[0]} messages"
        before = served[0]
        service.poll(50)
        assert served[0] > before > 0   # the rest is served by the next poll
    finally:
        peer.close(0)
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(60)
def test_an_init_wait_resent_on_the_same_connection_is_parked_once():
    """`ParameterClient.finish` resends an unanswered init under the same id on the same
    socket: the shard keeps one wait for it (the routing identity reaches the handlers
    as bytes, which compare by value; zmq frames compare by object, and every resend was
    parked again, towards MAX_AWAITING_INIT)."""
    from torch import nn

    from psgd.shard import Shard
    from psgd.sharding import model_layout
    cfg = Config().replace(**{"cluster.workers": 3, "cluster.servers": 1, "model.name": "script"})
    shard = Shard(cfg, 0, model_layout(nn.Sequential(nn.Linear(3, 5))))
    ctx = zmq.Context()
    sock = server_socket(ctx, "inproc://init-resend", cfg.security)
    service = Service(sock, shard.handlers, "shard 0", counters=shard.counters)
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect("inproc://init-resend")
    try:
        for _ in range(3):
            peer.send_multipart(wire.encode("init", id=7, rank=2))
            time.sleep(0.05)
            service.poll(100)
        assert len(shard._awaiting_init) == 1, list(shard._awaiting_init)
    finally:
        peer.close(0)
        sock.close(0)
        ctx.term()


@contextmanager
def served_coordinator(cfg: Config) -> Iterator[zmq.Context]:
    """A coordinator of `cfg` serving on a thread of its own; its context, for clients
    (closed before the block ends); the coordinator stops, and the context ends, after."""
    ctx = zmq.Context()
    c = Coordinator(cfg, None, ctx=ctx, quiet=True)
    served = threading.Thread(target=c.serve, daemon=True)
    served.start()
    try:
        yield ctx
    finally:
        c.stop_requested = True
        served.join(10)
        ctx.term()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["key not authorized", "client without curve"])
def test_a_refused_curve_handshake_is_named_not_waited_out(tmp_path, how):
    """A client whose CurveZMQ key the server does not accept, or a client without
    CurveZMQ at a server with it: registration fails with the reason (HandshakeFailed,
    at a resend), not with "is it running there?" after cluster.timeout_s (a
    PeerTimeout)."""
    import os

    from psgd.keys import make_keys
    from psgd.transport import HandshakeFailed
    keys = str(tmp_path / "keys")
    make_keys(keys)
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 1, "cluster.timeout_s": 30.0,
                              "security.curve": True, "security.keys": keys})
    if how == "key not authorized":
        os.remove(os.path.join(keys, "authorized", "client.key"))
    with served_coordinator(cfg) as ctx:
        link = CoordinatorLink(cfg if how == "key not authorized" else cfg.replace(**{"security.curve": False}),
                               "worker", 0, ctx)
        try:
            t0 = time.monotonic()
            with pytest.raises(HandshakeFailed) as e:
                link.register()
            assert time.monotonic() - t0 < cfg.cluster.timeout_s   # (its resends come every REGISTER_RESEND_S)
            expect = "authorized" if how == "key not authorized" else "security.curve the same everywhere"
            assert expect in str(e.value)
        finally:
            link.close()


@pytest.mark.timeout(60)
def test_a_frame_over_the_servers_limit_cuts_its_sender_off():
    """`server_socket(max_frame=...)` (ZMQ_MAXMSGSIZE): a larger frame is never read,
    ZeroMQ drops the sender's connection, and the socket serves others on."""
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port_block(1)}"
    sock = server_socket(ctx, address, Config().security, max_frame=4096)
    seen = []
    service = Service(sock, {"stats": lambda ident, msg: seen.append(len(msg.arrays)) or
                             [(ident, wire.reply(msg))]}, "test")
    big, small = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for s in (big, small):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
        big.send_multipart([b"\x00" * 8192])   # one frame over the limit
        end = time.monotonic() + 2
        while time.monotonic() < end:
            service.poll(50)
        assert seen == [] and service.counters["bad_messages"] == 0   # never read at all
        small.send_multipart(wire.encode("stats", id=3))
        end = time.monotonic() + 10
        while time.monotonic() < end and not small.poll(0):
            service.poll(50)
        assert wire.decode(small.recv_multipart()).id == 3 and seen == [0]
    finally:
        big.close(0)
        small.close(0)
        sock.close(0)
        ctx.term()


@pytest.mark.timeout(60)
def test_a_dropped_greeting_is_no_refusal():
    """A peer that dropped a connection during its greeting (killed, restarting) left a
    handshake event in the client's monitor; a later ordinary timeout (a parked request)
    was raised as HandshakeFailed, which no caller retries. Only a refused key or one
    side without CurveZMQ is a refusal, and a handshake that succeeded since ends it."""
    import socket

    ctx = zmq.Context()
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    raw.bind(("127.0.0.1", 0))
    port = raw.getsockname()[1]
    raw.listen(8)
    peers = Peers(ctx, [f"tcp://127.0.0.1:{port}"], Config().security)
    conn, _ = raw.accept()   # accepts, reads the greeting, and hangs up
    conn.recv(10)
    conn.close()
    raw.close()
    time.sleep(0.3)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"tcp://127.0.0.1:{port}")
    stop = threading.Event()

    def serve():   # answers the first request and parks the second
        n = 0
        while not stop.is_set():
            if router.poll(50):
                ident, *body = router.recv_multipart()
                n += 1
                if n == 1:
                    router.send_multipart([ident] + [bytes(f) for f in wire.encode("reply", id=wire.decode(body).id)])
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        assert peers.call(0, "stats", timeout=10).op == "reply"
        with pytest.raises(PeerTimeout) as e:
            peers.call(0, "stats", timeout=1.0)
        assert type(e.value) is PeerTimeout
    finally:
        stop.set()
        t.join()
        peers.close()
        router.close(0)
        ctx.term()


@pytest.mark.timeout(120)
def test_reconnecting_every_peer_in_a_row_never_fails():
    """Each monitor has a name of its own: pyzmq's default (the socket's fd) could still
    be bound by a closed socket's monitor when a new socket got the same fd, and
    `reconnect` failed with 'Address already in use' (3% of bursts of 8)."""
    ctx = zmq.Context()
    peers = Peers(ctx, [f"tcp://127.0.0.1:{k + 1}" for k in range(8)], Config().security)
    try:
        for _ in range(100):
            for i in range(8):   # as ParameterClient.finish reconnects the shards it gave up on
                peers.reconnect(i)
            time.sleep(0.02)     # (ZeroMQ's reaper closes the sockets let go: their files are not at once free)
    finally:
        peers.close()
        ctx.term()


@pytest.mark.timeout(60)
def test_a_daemon_without_its_server_key_takes_no_share_of_the_authenticator(tmp_path):
    import os

    from psgd import transport
    from psgd.keys import make_keys
    keys = str(tmp_path / "keys")
    make_keys(keys)
    os.remove(os.path.join(keys, "server.key_secret"))
    ctx = zmq.Context()
    security = Config().replace(**{"security.curve": True, "security.keys": keys}).security
    with pytest.raises(ConfigError, match="server.key_secret not found"):
        server_socket(ctx, f"tcp://127.0.0.1:{free_port_block(1)}", security)
    assert id(ctx) not in transport._auth
    ctx.term()


@pytest.mark.timeout(30)
def test_psgd_keys_never_leaves_a_secret_key_readable_by_others(tmp_path, monkeypatch):
    """A review: make_keys lets pyzmq write the secret key files with the umask's mode (0644 under
    the usual 022) and chmods them to 0600 only afterwards: for a moment (or for good, if
    interrupted there) any local user can read the job's secret keys."""
    import os
    import stat

    import zmq.auth.certs as certs

    from psgd.keys import make_keys
    seen = {}
    original = certs._write_key_file

    def spy(path, *a, **kw):
        original(path, *a, **kw)
        if str(path).endswith("_secret"):
            seen[str(path)] = stat.S_IMODE(os.stat(path).st_mode)

    monkeypatch.setattr(certs, "_write_key_file", spy)
    old = os.umask(0o022)
    try:
        make_keys(str(tmp_path / "keys"))
    finally:
        os.umask(old)
    assert len(seen) == 2, seen   # both secret keys went through the spy (else nothing below is checked)
    assert all(mode & 0o077 == 0 for mode in seen.values()), {p: oct(m) for p, m in seen.items()}


@pytest.mark.timeout(30)
def test_a_server_whose_keys_folder_has_no_authorized_keys_refuses_to_start(tmp_path):
    """A review: keys.py: "Copy the whole folder to machines that run servers". A folder copied
    without authorized/: pyzmq logs "Failed to load CURVE certs" and the daemon serves on,
    refusing every client until cluster.timeout_s (check_keys does not look for it)."""
    import shutil

    from psgd.keys import make_keys
    keys = tmp_path / "keys"
    make_keys(str(keys))
    shutil.rmtree(keys / "authorized")
    cfg = Config().replace(**{"security.curve": True, "security.keys": str(keys)})
    ctx = zmq.Context()
    try:
        with pytest.raises(ConfigError, match="authorized holds no client's public key"):
            sock = server_socket(ctx, f"tcp://127.0.0.1:{free_port_block(1)}", cfg.security)
            sock.close(0)
    finally:
        from psgd.transport import stop_auth
        stop_auth(ctx, every=True)
        ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_a_client_with_another_jobs_server_key_is_told_to_look_at_it(tmp_path):
    """A review: a worker whose keys folder holds another job's server.key (keys made
    with `psgd keys` on each machine) is never answered: ZeroMQ says only NO_DETAIL of
    its handshake, which is no refusal to name. After cluster.timeout_s it was told "is
    it running there?", nothing of the keys; the hint now names server.key."""
    import os
    import shutil

    from psgd.keys import make_keys
    keys, other, mixed = (str(tmp_path / n) for n in ("keys", "other", "mixed"))
    make_keys(keys)
    make_keys(other)
    os.makedirs(mixed)
    for name in ("client.key", "client.key_secret", "server.key_secret"):   # this job's client pair ...
        shutil.copy(os.path.join(keys, name), mixed)
    shutil.copy(os.path.join(other, "server.key"), mixed)                  # ... another job's server key
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 1, "cluster.timeout_s": 3.0,
                              "security.curve": True, "security.keys": keys})
    with served_coordinator(cfg) as ctx:
        link = CoordinatorLink(cfg.replace(**{"security.keys": mixed}), "worker", 0, ctx)
        try:
            with pytest.raises(PeerTimeout, match=f"{mixed}/server.key is not the coordinator's public key"):
                link.register()
        finally:
            link.close()


@pytest.mark.timeout(30)
def test_psgd_keys_again_keeps_a_key_removed_from_authorized_locked_out(tmp_path):
    """A review: running `psgd keys DIR` again copied both public keys into authorized/
    again, silently undoing a lock-out (keys.py: remove a key there to lock its holder
    out), and said "keys written" though it wrote none."""
    import os

    from psgd.keys import make_keys
    keys = str(tmp_path / "keys")
    assert "the server and client pairs" in make_keys(keys)
    os.remove(os.path.join(keys, "authorized", "client.key"))
    assert "nothing written" in make_keys(keys)
    assert os.listdir(os.path.join(keys, "authorized")) == ["server.key"]


@pytest.mark.timeout(30)
def test_psgd_keys_on_a_clients_folder_keeps_the_servers_public_key(tmp_path):
    """A helper's use: a client's folder holds the servers' server.key and its own pair
    (keys.py: "clients need server.key and their own pair"); `psgd keys DIR` there, as
    the message for a missing key file advised, made a new server pair over that
    server.key, and the client was then never answered. A public key without its secret
    is kept, and said to be."""
    import os
    import shutil

    from psgd.keys import make_keys
    from psgd.transport import client_socket
    keys, client = str(tmp_path / "keys"), str(tmp_path / "client")
    make_keys(keys)
    os.makedirs(client)
    shutil.copy(os.path.join(keys, "server.key"), client)
    said = make_keys(client)
    assert "the client pair" in said and "server.key kept" in said, said
    # (a review: the servers know only the pairs in their authorized/; the new pair is not there)
    assert f"copy {os.path.join(client, 'client.key')} into the servers' authorized/ folder" in said, said
    with open(os.path.join(keys, "server.key")) as a, open(os.path.join(client, "server.key")) as b:
        assert a.read() == b.read()
    assert not os.path.exists(os.path.join(client, "server.key_secret"))
    os.remove(os.path.join(client, "server.key"))   # and a client without it is told to copy it, not to make keys
    security = Config().replace(**{"security.curve": True, "security.keys": client}).security
    ctx = zmq.Context()
    try:
        with pytest.raises(ConfigError, match="server.key not found .copy it from the folder `psgd keys` made"):
            client_socket(ctx, "tcp://127.0.0.1:1", security, connect=False).close(0)
    finally:
        ctx.term()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("damage", ["cut short", "another pair's public key"])
def test_a_damaged_secret_key_is_one_line_before_anything_starts(tmp_path, damage):
    """A helper's use: a client.key_secret cut short (or edited) passed check_keys, so
    `psgd run` started the job and every daemon died with a "zmq.error.ZMQError: Invalid
    argument" traceback (`psgd status --keys`: "cannot connect ...: Invalid argument"). A
    key is checked as it is loaded, and the message names the file, not the key."""
    import os
    import re

    from psgd.keys import make_keys
    from psgd.transport import check_keys
    keys, other = str(tmp_path / "keys"), str(tmp_path / "other")
    make_keys(keys)
    make_keys(other)
    path = os.path.join(keys, "client.key_secret")
    with open(path) as f:
        text = f.read()
    if damage == "cut short":
        text = re.sub(r'(secret-key = ").{5}', r"\1", text)
    else:
        with open(os.path.join(other, "client.key")) as f:
            public = re.search(r'public-key = "(.*)"', f.read()).group(1)
        text = re.sub(r'public-key = ".*"', lambda m: f'public-key = "{public}"', text)
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(ConfigError, match=f"{re.escape(path)}'s .*(malformed|not one pair)") as e:
        check_keys(keys)
    assert not any(k in str(e.value) for k in re.findall(r'-key = "(.*)"', text)), str(e.value)


@pytest.mark.timeout(30)
def test_a_server_key_that_is_not_the_servers_pair_is_one_line_before_anything_starts(tmp_path):
    """A review: a folder holding another pair's server.key (servers re-keyed since) passed
    check_keys, and every client's handshake failed without a word: a worker said the
    shards did not answer within cluster.timeout_s."""
    import os
    import shutil

    from psgd.keys import make_keys
    from psgd.transport import check_keys
    keys, other = str(tmp_path / "keys"), str(tmp_path / "other")
    make_keys(keys)
    make_keys(other)
    check_keys(keys)
    shutil.copy(os.path.join(other, "server.key"), os.path.join(keys, "server.key"))
    with pytest.raises(ConfigError, match="server.key is not the public key of .*server.key_secret"):
        check_keys(keys)


@pytest.mark.timeout(30)
def test_a_secret_key_readable_by_others_is_warned_about_once(tmp_path, capsys):
    """A helper's use: a keys folder unpacked or copied with 0644 files (tar, chmod -R)
    left the secret keys readable by every local user, and nothing said so: whoever reads
    one can join the job. Its loading warns, once a process."""
    import os

    from psgd.keys import make_keys
    from psgd.transport import check_keys
    keys = str(tmp_path / "keys")
    make_keys(keys)
    check_keys(keys)
    assert "readable" not in capsys.readouterr().err   # psgd keys' own files: 0600
    os.chmod(os.path.join(keys, "client.key_secret"), 0o644)
    check_keys(keys)
    check_keys(keys)
    err = capsys.readouterr().err
    assert err.count("readable by other users") == 1 and "client.key_secret" in err and "chmod 600" in err, err


@pytest.mark.timeout(30)
def test_reconnecting_while_a_handshake_is_under_way_leaves_the_process_able_to_talk():
    """A worker whose diloco exchange was refused reconnected its sockets, and its
    heartbeats then went unanswered until the coordinator dropped it (the same in a
    kill -9 test's rare failure): a socket's monitor closed before the socket itself
    left ZeroMQ's I/O thread blocked for good on the handshake's event, and with it every
    socket of the process."""
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
    peers = Peers(ctx, [address], SecurityConfig())
    fresh = ctx.socket(zmq.DEALER)
    try:
        for _ in range(30):
            peers.reconnect(0)   # each closes a socket whose handshake is under way
        fresh.connect(address)
        fresh.send(b"still there?")
        assert server.poll(5000), "this process's sockets no longer move messages"
    finally:
        peers.close()
        for s in (fresh, server):
            s.close(0)
        ctx.term()


def written_summary(coordinator, within_s: float = 30.0) -> dict:
    """The coordinator's summary, once written: it writes it after the final score is in,
    a moment after the evaluator's thread has ended (read at once, it was None)."""
    until = time.monotonic() + within_s
    while coordinator.summary is None and time.monotonic() < until:
        time.sleep(0.05)
    assert coordinator.summary is not None, f"no summary within {within_s:g} s"
    return coordinator.summary


@pytest.mark.inprocess
@pytest.mark.timeout(120)
def test_the_evaluator_scores_from_the_start_of_training_not_from_its_next_heartbeat(tmp_path):
    """A review: the evaluator learned that training had begun (and, later, that it had
    ended) from its heartbeats' answers, every cluster.heartbeat_s: the first score came up
    to 0.5 s into training (0.48 s of a 4 s run; 0.05 s in another), whatever
    eval.every_seconds said, and set time_to_target_s where the target was met early. Here
    its heartbeats are 3 s apart and training lasts 1.5 s: it still scores during it."""
    from psgd.workers.evaluator import Evaluator
    from psgd.workers.worker import Worker
    cfg = config(**{"cluster.servers": 1, "cluster.evaluator": True, "cluster.timeout_s": 30,
                    "cluster.heartbeat_s": 3.0, "cluster.heartbeat_timeout_s": 20.0,
                    "train.steps": 0, "train.seconds": 1.5, "eval.every_seconds": 0.1})
    codes: dict[str, int] = {}
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        ev = threading.Thread(target=lambda: codes.__setitem__("evaluator", Evaluator(cfg, str(tmp_path), "cpu").run()))
        ev.start()
        until = time.monotonic() + 30
        while not cluster.coordinator.evaluator_seen and time.monotonic() < until:
            time.sleep(0.02)   # registered and heartbeating before training begins
        time.sleep(0.2)
        codes["worker"] = Worker(cfg, str(tmp_path), "cpu", want_rank=0).run()
        ev.join(timeout=60)
        assert codes == {"worker": 0, "evaluator": 0}
        summary = written_summary(cluster.coordinator)
    during = [e for e in summary["evals"] if not e.get("final") and e["t"] < summary["wall_s"]]
    assert during, summary["evals"]


@pytest.mark.inprocess
@pytest.mark.timeout(120)
def test_a_score_read_before_the_workers_first_step_counts_no_samples(tmp_path, monkeypatch):
    """A review: a score's samples are the workers' count at its read, between the
    heartbeats around it, in proportion to the time; a worker's beat before the wait for
    the initial values and its next one, after steps began, put the untrained model's
    score at 584 and 1,175 samples in 2-worker runs whose step lines had none yet. A
    worker beats when it begins stepping. Here the initial values take 1 s to come, and
    its heartbeats are 3 s apart. And its heartbeat thread comes to that beat 0.5 s late
    (a busy machine: under pytest -n 2 a score read 0.08 s in counted 2 samples): the
    beat carried the samples of its first steps, now their count when it began."""
    import json
    cfg = config(**{"cluster.servers": 1, "cluster.evaluator": True, "cluster.timeout_s": 30,
                    "cluster.heartbeat_s": 3.0, "cluster.heartbeat_timeout_s": 20.0,
                    "train.steps": 0, "train.seconds": 1.5, "eval.every_seconds": 0.1})
    real, real_start = ParameterClient.init, CoordinatorLink.start

    def slow_init(self, tables):
        time.sleep(1.0)
        return real(self, tables)

    class LateWake(threading.Event):
        def wait(self, timeout=None):
            woken = super().wait(timeout)
            if woken:
                time.sleep(0.5)
            return woken

    def late_start(self):
        if self.role == "worker":
            self._wake = LateWake()
        real_start(self)
    monkeypatch.setattr(ParameterClient, "init", slow_init)
    monkeypatch.setattr(CoordinatorLink, "start", late_start)
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        assert worker_and_evaluator(cfg, str(tmp_path)) == {"worker": 0, "evaluator": 0}
        evals = written_summary(cluster.coordinator)["evals"]

    def lines(name: str) -> list[dict]:
        with open(tmp_path / "events" / f"{name}.jsonl") as f:
            return [json.loads(line) for line in f]
    start = next(e["t"] for e in lines("coordinator-0") if e.get("event") == "start")
    first_step = min(e["t"] for e in lines("worker-0") if "step" in e)
    before = [e for e in evals if not e.get("final") and start + e["t"] < first_step - 0.2]
    assert before and all(e["samples"] == 0 for e in before), (first_step - start, evals)


@pytest.mark.inprocess
@pytest.mark.timeout(60)
def test_an_evaluator_still_loading_its_data_when_training_ends_gives_the_final_score(tmp_path, monkeypatch):
    """A review: an evaluator registered, then loaded its data and built its model, and
    only then began heartbeating; a coordinator gives up the final evaluation of an
    evaluator silent for cluster.heartbeat_timeout_s, and did so here (a short job, a
    slow data set), with the evaluator about to score. It heartbeats from its
    registration."""
    import psgd.workers.evaluator as evaluator_module
    cfg = config(**{"cluster.servers": 1, "cluster.evaluator": True, "cluster.timeout_s": 30,
                    "cluster.heartbeat_s": 0.2, "cluster.heartbeat_timeout_s": 1.0, "train.steps": 5})
    real = evaluator_module.load_dataset
    loading = threading.Event()

    def slow_load(*args):
        loading.set()
        time.sleep(3.0)
        return real(*args)
    monkeypatch.setattr(evaluator_module, "load_dataset", slow_load)
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        assert worker_and_evaluator(cfg, str(tmp_path)) == {"worker": 0, "evaluator": 0}
        assert loading.is_set()
        s = written_summary(cluster.coordinator)
    assert not s.get("final_eval_missing") and s["final_accuracy"] is not None, s


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_workers_beat_as_it_begins_is_sent_again_after_a_beat_that_failed(monkeypatch):
    """A review: the counters read as a worker begins stepping (`beat_soon`) were dropped
    when that beat went unanswered, and the next beat sent the counts of the steps since,
    as if they had been done before it."""
    import psgd.membership as membership
    sent: list[dict] = []

    class Coordinator:   # it misses the first beat
        def __init__(self, *args, **kwargs):
            pass

        def call(self, i, op, timeout, cancel=None, **fields):
            sent.append(fields)
            if len(sent) == 1:
                raise PeerTimeout("no answer")
            return wire.decode(wire.encode("reply", id=1, phase="training", done=False))

        def reconnect(self, i):
            pass

        def close(self):
            pass
    monkeypatch.setattr(membership, "Peers", Coordinator)
    link = CoordinatorLink(config(**{"cluster.heartbeat_s": 0.05, "cluster.heartbeat_timeout_s": 1.0}), "worker", 0)
    samples = [0]
    link.stats_fn = lambda: {"samples": samples[0]}
    link.beat_soon()       # it begins stepping: 0 samples
    samples[0] = 64        # two steps before its heartbeat thread comes to it
    link.start()
    try:
        deadline = time.monotonic() + 10
        while len(sent) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        link.stop()
    assert [(f["stats"]["samples"], "age_s" in f) for f in sent[:3]] == [(0, True), (0, True), (64, False)], sent


def test_a_shard_takes_an_ltfb_deposit_with_amsgrads_three_moments_and_the_buffers():
    """A review: a shard took messages of four tables at most (of its larger table's size),
    and an ltfb outcome's deposit holds the parameters, the buffers, the optimizer's state
    (AMSGrad: 3 tables) and a meta array: with buffers beside it, it was refused as too
    large, and the trainers' leaders failed."""
    from psgd.servers.shard_server import message_limit
    P, B = 1_000_000, 300_000

    def deposit(states: int) -> list:
        arrays = [np.zeros(P, np.float32), np.zeros(B, np.float32)] + [np.zeros(P, np.float32)] * (states + 1)
        return wire.encode("put_model", id=1, rank=0, clock=5, arrays=arrays, round=-3, score=0.5, step=5)
    frames = deposit(3)
    assert sum(map(len, frames)) > 4 * 4 * max(P, B) + wire.MAX_HEADER   # (more than four tables' bytes)
    assert wire.decode(frames, message_limit(P, B)).op == "put_model"
    with pytest.raises(wire.WireError, match="larger than"):   # and a limit still holds
        wire.decode(deposit(6), message_limit(P, B))
