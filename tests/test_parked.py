"""A request that a shard parks longer than `cluster.timeout_s` (a synchronous round
waiting for a slow worker) is not a lost shard: while the shard heartbeats to the
coordinator, the parameter client keeps waiting; without that knowledge it gives up
with ShardUnreachable, as before."""
from __future__ import annotations

import threading
import time

import pytest

from psgd.config import Config
from psgd.inprocess import InProcessCluster
from psgd.membership import CoordinatorLink
from psgd.workers.client import ParameterClient, ShardUnreachable

pytestmark = pytest.mark.inprocess

TIMEOUT_S = 2.0


def config(port_block) -> Config:
    return Config().replace(**{"cluster.port": port_block(2), "cluster.workers": 2, "cluster.servers": 1,
                               "cluster.timeout_s": TIMEOUT_S, "cluster.heartbeat_s": 0.2,
                               "cluster.heartbeat_timeout_s": 1.0, "mode.name": "sync"})


def push_pull_waiting_for_rank_1(cfg: Config, cluster: InProcessCluster, alive, late_s: float):
    """Rank 0 pushes clock 0 and pulls clock 1; rank 1 pushes `late_s` later. Returns
    rank 0's outcome (its pulled answers, or the exception)."""
    clients = [ParameterClient(cfg, cluster.ctx, r) for r in range(2)]
    clients[0].alive = alive
    tables = clients[0].tables(clients[0].join(0))
    out: dict = {}

    def rank_0() -> None:
        try:
            out["pulled"] = clients[0].push_pull(0, tables[0], tables[1], [0])[1]
        except ShardUnreachable as e:
            out["error"] = e

    t = threading.Thread(target=rank_0)
    t.start()
    time.sleep(late_s)
    clients[1].push_pull(0, tables[0], tables[1], [0])
    t.join(timeout=30)
    for c in clients:
        c.close()
    return out


def registered_workers(cfg: Config, cluster: InProcessCluster) -> list[CoordinatorLink]:
    """Both workers registered and heartbeating (the coordinator waits for no one), and
    worker 0's view of the live shards filled in."""
    links = [CoordinatorLink(cfg, "worker", r, cluster.ctx) for r in range(2)]
    threads = [threading.Thread(target=link.register, args=(r,)) for r, link in enumerate(links)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    for link in links:
        link.start()
    deadline = time.monotonic() + 10
    while 0 not in links[0].state.get("live_shards", ()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return links


@pytest.mark.timeout(60)
@pytest.mark.parametrize("knows", [True, False], ids=["shards-heartbeat", "no-liveness"])
def test_a_parked_pull_outlives_the_timeout_only_while_the_shard_heartbeats(port_block, knows):
    cfg = config(port_block)
    with InProcessCluster(cfg) as cluster:
        links = registered_workers(cfg, cluster)
        try:
            alive = (lambda i: i in links[0].state["live_shards"]) if knows else None
            out = push_pull_waiting_for_rank_1(cfg, cluster, alive, late_s=2.5 * TIMEOUT_S)
        finally:
            for link in links:
                link.close()
    if knows:
        assert "error" not in out, out["error"]
        assert int(out["pulled"][0].get("version")) == 1  # the round closed with both gradients
    else:
        assert isinstance(out.get("error"), ShardUnreachable)


@pytest.mark.timeout(60)
def test_a_parked_request_is_answered_when_its_step_closes_not_at_the_next_resend(port_block):
    """Rank 0's push+pull waits 7.8 s for rank 1 (longer than the 2 s retry window). While
    the shard heartbeats the client resends on the same connection under the same id and
    keeps listening, so the step's close answers it at once (it used to reconnect, sleep
    and resend: the answer went to a closed socket and came 1.7 s later, after 3 resends of
    the gradient). The gradient is applied once."""
    cfg = config(port_block).replace(**{"cluster.timeout_s": 30.0})
    with InProcessCluster(cfg) as cluster:
        links = registered_workers(cfg, cluster)
        try:
            clients = [ParameterClient(cfg, cluster.ctx, r) for r in range(2)]
            clients[0].alive = lambda i: i in links[0].state["live_shards"]
            assert clients[0].retry_s == 2.0
            params, buffers = clients[0].tables(clients[0].join(0))
            out: dict = {}

            def rank_0() -> None:
                out["pushed"], out["pulled"] = clients[0].push_pull(0, params, buffers, [0])
                out["t"] = time.monotonic()

            t = threading.Thread(target=rank_0)
            t.start()
            time.sleep(7.8)
            clients[1].push_pull(0, params, buffers, [0])
            closed = time.monotonic()
            t.join(timeout=30)
            assert out["t"] - closed < 1.0, out["t"] - closed
            assert int(out["pulled"][0].get("version")) == 1
            # sent again at 2 s (the shard not probed before); at 2 + 4 s (the window doubles) the
            # same shard process, on the same connection, holds it: waited for, not sent again
            assert clients[0].retries == 1
            # its answer is marked so: had the resend's come first, its `duplicate` would be
            # this process's push, applied (tests/test_duplicate_push.py)
            assert out["pushed"][0].get("resent") is True
            for c in clients:
                c.close()
        finally:
            for link in links:
                link.close()


@pytest.mark.timeout(60)
def test_a_prefetched_request_parked_over_a_long_compute_is_not_unreachable(port_block):
    """A review: a push+pull begun ahead (prefetch, or a psgd.connect script computing
    long between steps) and finished after a compute longer than cluster.timeout_s, while
    legitimately parked (rank 1 has not pushed), was ShardUnreachable at once, without a
    single probe: the shard's silence was counted from `begin`, and what it sent was
    heard only inside a wait. Only the time in `finish` counts now, and the shard, which
    answers probes, is waited for until the step closes, 0.5 s into `finish`."""
    cfg = config(port_block)
    with InProcessCluster(cfg) as cluster:
        links = registered_workers(cfg, cluster)
        clients = [ParameterClient(cfg, cluster.ctx, r) for r in range(2)]
        try:
            clients[0].alive = lambda i: i in links[0].state["live_shards"]
            params, buffers = clients[0].tables(clients[0].join(0))
            f = clients[0].begin_push_pull(0, params, buffers, [0])   # parked: rank 1 has not pushed
            time.sleep(TIMEOUT_S + 0.3)                                  # the next step's compute
            late = threading.Timer(0.5, lambda: clients[1].push_pull(0, params, buffers, [0]))
            late.start()
            try:
                pulled = clients[0].finish_push_pull(f)[1]
            finally:
                late.join()
            assert int(pulled[0].get("version")) == 1
        finally:
            for c in [*clients, *links]:
                c.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank, who", [(0, "worker 0"), (-1, "the evaluator")])
def test_an_unreachable_shard_is_reported_by_who_waited_for_it(port_block, rank, who):
    """The evaluator's client (rank -1) cut off from a shard said "worker -1: shard at ...
    did not answer" in the evaluator's log."""
    import zmq
    cfg = config(port_block).replace(**{"cluster.timeout_s": 0.5})   # no shard listens there
    client = ParameterClient(cfg, zmq.Context.instance(), rank)
    try:
        with pytest.raises(ShardUnreachable) as e:
            client.pull(0)
    finally:
        client.close()
    assert str(e.value).startswith(f"{who}: shard at {cfg.shard_address(0)} did not answer within "
                                   f"cluster.timeout_s"), str(e.value)
