"""`async`: Downpour / Hogwild (Dean et al. 2012): SSP without a bound.

Server rule: a push is applied on arrival at lr / W, reads never wait. Options:
`mode.lr_policy = "staleness"` scales by 1 / max(1, tau) (Zhang et al. 2016), and
`mode.dc_lambda > 0` compensates the delay (DC-ASGD, Zheng et al. 2017) with the
parameters each worker last read.

Worker schedule: as ssp (push+pull every step). With `mode.prefetch = true` the worker
computes its next gradient on the parameters it has while its push and pull are in
flight (Downpour's overlap of fetching and computing): each gradient is then one
update staler, and the round trip hides behind the compute.
"""
from __future__ import annotations

from typing import Any

from .pushpull import load
from .rule import Answer, Read, Trainer
from .ssp import SspRule, SspSchedule
from .staleness import delay_compensate, lr_scale


class AsyncRule(SspRule):
    name = "async"

    def __init__(self, mode, world, tables):
        super().__init__(mode, world, tables)
        self.w_read: dict = {}   # DC-ASGD: the parameters at each worker's last read

    def bound(self) -> int | None:
        return None

    def lr_scale(self, tau: int) -> float:
        return lr_scale(tau, self.mode.lr_policy)

    def gradient(self, e):
        if self.mode.dc_lambda > 0 and e.rank in self.w_read:
            return delay_compensate(e.grad, self.tables.params.detach(), self.w_read[e.rank], self.mode.dc_lambda)
        return e.grad

    def answer(self, e: Read) -> Answer:
        if self.mode.dc_lambda > 0 and e.rank >= 0:
            self.w_read[e.rank] = self.tables.params.detach().clone()
        return super().answer(e)


class AsyncSchedule(SspSchedule):
    inflight: Any = None        # the push+pull in flight (prefetch)
    slot = 0                    # which set of gradient buffers the next push uses

    def step(self, w: Trainer) -> None:
        if not self.cfg.mode.prefetch:
            return super().step(w)
        w.replica.model.train()
        w.compute()                      # on the parameters we have, while the last push travels
        grads, buffers = w.replica.grads(self.slot), w.replica.buffers(self.slot)
        read = self.versions             # the versions this gradient was computed on
        self.settle(w)
        self.inflight = w.client.begin_push_pull(w.clock, grads, buffers, read, self.slot)
        self.slot ^= 1
        w.clock += 1
        return None

    def finish(self, w: Trainer) -> None:
        self.settle(w)

    def settle(self, w: Trainer) -> None:
        """Wait for the push+pull in flight, load what it read, log its step."""
        if self.inflight is None:
            return
        inflight, self.inflight = self.inflight, None
        w0 = w.client.wait_s
        pushed, pulled = w.client.finish_push_pull(inflight)
        tau = max(int(m.get("staleness", 0)) for m in pushed)
        if not any(m.get("duplicate") for m in pushed):
            w.hist.add(tau)
        self.versions = load(w, pulled)
        w.log_step(tau, w.client.wait_s - w0)
