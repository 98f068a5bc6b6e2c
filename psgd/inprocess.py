"""An in-process cluster: the coordinator and the shard servers on threads of this process.

    from psgd.inprocess import InProcessCluster
    with InProcessCluster(cfg) as cluster:        # cfg: cluster.port = a free block
        client = ParameterClient(cfg, cluster.ctx, rank=0)
        ...

The same daemon classes as `psgd coordinator` and `psgd server` run here, on one ZeroMQ
context, with real tcp sockets on the config's ports, so that tests and benchmarks (bench/)
drive a whole parameter server without starting processes. Workers are the caller's: a
`ParameterClient` per thread, or a `psgd.workers.worker.Worker`. On leaving the `with`
block every daemon is told to stop and its thread joined (an error if one does not stop
within 10 s), then the CurveZMQ authenticator is stopped and the context terminated.
"""
from __future__ import annotations

import threading

import zmq

from .config import Config
from .servers.coordinator import Coordinator
from .servers.shard_server import ShardServer
from .transport import stop_auth

JOIN_TIMEOUT_S = 10.0


class InProcessCluster:
    def __init__(self, cfg: Config, out: str | None = None):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.coordinator = Coordinator(cfg, out, ctx=self.ctx, quiet=True)
        self.servers = [ShardServer(cfg, i, out, ctx=self.ctx) for i in range(cfg.cluster.servers)]
        self.threads = [threading.Thread(target=self.coordinator.serve, name="inprocess-coordinator", daemon=True)]
        self.threads += [threading.Thread(target=s.run, name=f"inprocess-server-{i}", daemon=True)
                         for i, s in enumerate(self.servers)]

    def __enter__(self) -> InProcessCluster:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for s in self.servers:
            s.stop()
        self.coordinator.stop_requested = True
        for t in self.threads:
            t.join(timeout=JOIN_TIMEOUT_S)
        stuck = [t.name for t in self.threads if t.is_alive()]
        if stuck:
            raise RuntimeError(f"in-process cluster threads did not stop within {JOIN_TIMEOUT_S:.0f} s: {stuck}")
        stop_auth(self.ctx, every=True)   # (each daemon let go of its share as it stopped)
        # term() waits for every socket of the context to close: one left open (a caller's
        # client, a daemon's bug) would hang here for ever; say which instead.
        left = [s for s in list(getattr(self.ctx, "_sockets", ())) if not s.closed]
        if left:
            self.ctx.destroy(linger=0)
            kinds = ", ".join(sorted(zmq.SocketType(x.type).name for x in left))
            raise RuntimeError(f"in-process cluster: {len(left)} socket(s) still open on its context after its "
                               f"threads stopped ({kinds}): close them before leaving the `with` block")
        self.ctx.term()
