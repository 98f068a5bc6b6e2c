"""The parameter client: one DEALER per shard, every request in flight at once.

A push and the next pull go out back to back on each shard's socket (the shard serves
them in order, so the read sees this worker's own update) and all shards work in
parallel: one round trip per step. A request that gets no answer within the retry
window is sent again on a fresh connection (pushes are deduplicated by (rank, clock),
so a resend is safe) with backoff, until `cluster.timeout_s` runs out; then
`ShardUnreachable` names the address. An error reply raises its typed exception
(`wire.Refused`, `wire.BadRequest`, `wire.ServerFault`) at once. `cancel`, when set,
is asked while waiting: turning true gives up with `Cancelled` (the job ended).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import zmq

from psgd import wire
from psgd.config import Config
from psgd.sharding import as_tensor
from psgd.transport import Peers, PeerTimeout


class ShardUnreachable(RuntimeError):
    pass


class Cancelled(RuntimeError):
    """A request given up because the caller's condition changed (e.g. a partner left)."""


class ParameterClient:
    def __init__(self, cfg: Config, ctx: zmq.Context, rank: int):
        self.cfg = cfg
        self.rank = rank
        self.n = cfg.cluster.servers
        self.peers = Peers(ctx, [cfg.shard_address(i) for i in range(self.n)], cfg.security)
        self.retry_s = max(2.0, 4 * cfg.cluster.heartbeat_s)  # resend window (a restarted shard lost them)
        self.wait_s = 0.0     # time blocked on the servers
        self.retries = 0
        self.cancel: Callable[[], bool] | None = None  # for every request: give up when true

    @property
    def bytes_sent(self) -> int:
        return self.peers.bytes_sent

    @property
    def bytes_recv(self) -> int:
        return self.peers.bytes_recv

    def request(self, reqs: Sequence[tuple[int, str, dict]],
                cancel: Callable[[], bool] | None = None) -> list[wire.Message]:
        """Send (shard, op, fields) requests at once; answers in the same order.
        `cancel()` (or the client's own `cancel`) turning true gives up with `Cancelled`."""
        if cancel is None:
            cancel = self.cancel
        elif self.cancel is not None:
            own, extra = self.cancel, cancel
            cancel = lambda: own() or extra()  # noqa: E731
        t0 = time.monotonic()
        pending = {self.peers.send(i, op, rank=self.rank, **kw): (k, i) for k, (i, op, kw) in enumerate(reqs)}
        out: list[Any] = [None] * len(reqs)
        deadline = t0 + self.cfg.cluster.timeout_s
        backoff = 0.5
        while pending:
            window = min(self.retry_s, max(0.1, deadline - time.monotonic()))
            try:
                got = self.peers.wait({rid: i for rid, (_, i) in pending.items()}, window,
                                      "parameter request", cancel)
            except wire.RemoteError:
                self.wait_s += time.monotonic() - t0
                raise
            except PeerTimeout as e:
                got = e.partial
                if cancel is not None and cancel():
                    self.wait_s += time.monotonic() - t0
                    raise Cancelled(e.address) from None
                if time.monotonic() >= deadline:
                    raise ShardUnreachable(f"worker {self.rank}: shard at {e.address} did not answer within "
                                           f"cluster.timeout_s = {self.cfg.cluster.timeout_s:.0f} s") from None
                for rid, m in got.items():
                    out[pending.pop(rid)[0]] = m
                missing = {i for _, i in pending.values()}
                for i in missing:
                    self.peers.reconnect(i)
                time.sleep(backoff)
                backoff = min(4.0, backoff * 2)
                self.retries += 1
                resent = {}
                for k, i in pending.values():
                    shard, op, kw = reqs[k]
                    resent[self.peers.send(shard, op, rank=self.rank, **kw)] = (k, i)
                pending = resent
                continue
            for rid, m in got.items():
                out[pending.pop(rid)[0]] = m
        self.wait_s += time.monotonic() - t0
        return out

    # ------------------------------------------------------------ ops
    def pull(self, clock: int) -> list[wire.Message]:
        return self.request([(i, "pull", {"clock": clock}) for i in range(self.n)])

    def join(self, clock: int) -> list[wire.Message]:
        """Pull without waiting on any gate; the answers say where the shards stand."""
        return self.request([(i, "pull", {"clock": clock, "join": True}) for i in range(self.n)])

    def push_pull(self, clock: int, grads: list[torch.Tensor], buffers: list[torch.Tensor],
                  read_versions: list[int]) -> tuple[list[wire.Message], list[wire.Message]]:
        reqs = []
        for i in range(self.n):
            reqs.append((i, "push", {"clock": clock, "arrays": [grads[i], buffers[i]],
                                     "read_version": read_versions[i]}))
            reqs.append((i, "pull", {"clock": clock + 1}))
        got = self.request(reqs)
        return got[0::2], got[1::2]

    def elastic(self, round_: int, xs: list[torch.Tensor], bs: list[torch.Tensor], clock: int) -> list[wire.Message]:
        return self.request([(i, "elastic", {"round": round_, "clock": clock, "arrays": [xs[i], bs[i]]})
                             for i in range(self.n)])

    def put_model(self, round_: int, score: float, arrays: list[list[torch.Tensor]], step: int) -> None:
        self.request([(i, "put_model", {"round": round_, "score": score, "step": step, "arrays": arrays[i]})
                      for i in range(self.n)])

    def get_model(self, round_: int, owner: int, cancel: Callable[[], bool] | None = None,
                  exact: bool = False, missing_ok: bool = False) -> list[wire.Message] | None:
        """`owner`'s model of `round_` (or its later one unless `exact`) from every shard.
        `missing_ok`: None instead of an exception when it is not delivered."""
        try:
            return self.request([(i, "get_model", {"round": round_, "owner": owner, "exact": exact})
                                 for i in range(self.n)], cancel)
        except (Cancelled, ShardUnreachable, wire.Refused):
            if missing_ok:
                return None
            raise

    def index(self) -> list[wire.Message]:
        """Each shard's index of the models deposited with it."""
        return self.request([(i, "models", {}) for i in range(self.n)])

    @staticmethod
    def tables(msgs: Sequence[wire.Message]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The (first, second) arrays of each shard's answer as tensors, without copies:
        (params, buffers), or (deltas, buffers) for an elastic exchange."""
        return tensors_of(msgs, 0), tensors_of(msgs, 1)

    def close(self) -> None:
        self.peers.close()


def tensors_of(msgs: Sequence[wire.Message], k: int) -> list[torch.Tensor]:
    """The k-th array of each shard's answer, as tensors (no copy)."""
    return [as_tensor(m.arrays[k]) for m in msgs]
