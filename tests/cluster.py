"""In-process cluster for tests: coordinator and shard servers on threads, port block
from the OS, everything stopped at the end."""
from __future__ import annotations

import threading

import zmq

from psgd.config import Config
from psgd.transport import stop_auth
from servers.coordinator import Coordinator
from servers.shard_server import ShardServer


class InProcessCluster:
    def __init__(self, cfg: Config, out: str | None = None):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.coordinator = Coordinator(cfg, out, ctx=self.ctx, quiet=True)
        self.servers = [ShardServer(cfg, i, out, ctx=self.ctx) for i in range(cfg.cluster.servers)]
        self.threads = [threading.Thread(target=self.coordinator.serve, daemon=True)]
        self.threads += [threading.Thread(target=s.run, daemon=True) for s in self.servers]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        for s in self.servers:
            s.stop()
        self.coordinator.stop_requested = True
        for t in self.threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in self.threads), "cluster threads did not stop"
        stop_auth(self.ctx)
        self.ctx.term()
