"""The coordinator's state file (servers/coordinator.py): what a restarted coordinator
resumes, and what it refuses to resume."""
from __future__ import annotations

import json
import os
import time

import pytest

from psgd.config import Config
from psgd.membership import Membership
from psgd.servers.coordinator import STATE_FILE, Coordinator
from tests.conftest import free_port_block


@pytest.mark.unit
def test_membership_round_trips_through_its_state_dict():
    m = Membership(3, timeout_s=5.0)
    for r in range(3):
        m.join(0.0, r)
    m.beat(0, 1.0, 7, {"samples": 10})
    m.finish(2, {"samples": 3})
    m.expire(100.0)  # 0 and 1 are lost
    m.join(101.0, 1)  # 1 comes back
    again = Membership(3, timeout_s=5.0)
    again.load_state_dict(json.loads(json.dumps(m.state_dict())), now=200.0)
    assert again.live() == m.live() and again.stats() == m.stats()
    assert (again.lost, again.rejoined) == (m.lost, m.rejoined) and again.version > m.version
    assert all(again.members[r].last_seen == 200.0 for r in again.live())
    assert again.expire(204.0) == [] and again.expire(206.0) == [1]


def coordinator(cfg: Config, out: str) -> Coordinator:
    c = Coordinator(cfg, out, quiet=True)
    c.sock.close(0)  # only its state matters here
    c.events.close()
    return c


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_restarted_coordinator_resumes_only_its_own_recent_unfinished_job(tmp_path):
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 2, "cluster.timeout_s": 30.0})
    out = str(tmp_path)
    first = coordinator(cfg, out)
    first.members.join(0.0, 0)
    first.members.join(0.0, 1)
    first.nonces = {"abc": 1}
    first.phase, first.t0 = "training", time.monotonic() - 12.0
    first.evals = [{"t": 5.0, "samples": 100, "accuracy": 0.5, "loss": 1.0, "final": False}]
    first._save_state(time.monotonic())
    state = json.load(open(os.path.join(out, STATE_FILE)))

    second = coordinator(cfg, out)
    assert (second.phase, second.restarts, second.nonces, second.evals) == ("training", 1, {"abc": 1}, first.evals)
    assert set(second.members.live()) == {0, 1}
    assert 11.5 < time.monotonic() - second.t0 < 13.0   # the job's clock goes on

    for change, why in ((lambda st: st.update(config=Config().to_dict()), "another config's"),
                        (lambda st: st.update(saved_at=time.time() - 31), "older than cluster.timeout_s"),
                        (lambda st: st.update(phase="done"), "its job is done")):
        st = json.loads(json.dumps(state))
        change(st)
        json.dump(st, open(os.path.join(out, STATE_FILE), "w"))
        fresh = coordinator(cfg, out)
        assert (fresh.phase, fresh.restarts, fresh.members.members) == ("rendezvous", 0, {}), why


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_repeated_registration_gets_the_same_rank_and_no_new_join():
    from psgd import wire
    from psgd.inprocess import InProcessCluster
    from psgd.transport import Peers
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 1, "cluster.servers": 1,
                              "cluster.timeout_s": 10.0})
    with InProcessCluster(cfg) as cluster:
        peers = Peers(cluster.ctx, [cfg.coordinator_address()], cfg.security)
        try:
            def register(nonce: str) -> wire.Message:
                return peers.call(0, "register", 5.0, role="worker", want_rank=-1, nonce=nonce)
            assert register("n1").get("assigned_rank") == 0
            assert register("n1").get("assigned_rank") == 0   # its answer was lost: asked again
            with pytest.raises(wire.Refused, match="all 1 worker ranks are taken"):
                register("n2")
        finally:
            peers.close()
        assert cluster.coordinator.members.members[0].joins == 1
        assert cluster.coordinator.members.rejoined == 0


@pytest.mark.inprocess
@pytest.mark.timeout(30)
def test_a_dropped_worker_is_not_told_to_rejoin_once_the_job_is_finishing(tmp_path):
    """A worker whose heartbeats come back while the job evaluates its final model would
    be refused registration ("the job is finishing") and died on that refusal; it is not
    told to rejoin then (the job's end stops it), but it is while training."""
    from psgd import wire
    cfg = Config().replace(**{"cluster.port": free_port_block(3), "cluster.workers": 2, "cluster.servers": 1})
    c = coordinator(cfg, str(tmp_path))
    beat = wire.Message("heartbeat", id=1, rank=1, clock=3, fields={"role": "worker"})
    for phase, told in (("training", True), ("final_eval", False), ("done", False)):
        c.phase = phase
        [(_, frames)] = c.on_heartbeat(b"w1", beat)   # rank 1 is not a live member (dropped, or never seen)
        assert wire.decode(frames).get("rejoin") is told, phase
