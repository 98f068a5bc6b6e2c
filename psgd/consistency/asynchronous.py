"""`async`: Downpour / Hogwild (Dean et al. 2012): SSP without a bound.

Server rule: a push is applied on arrival at lr / W, reads never wait. Options:
`mode.lr_policy = "staleness"` scales by 1 / max(1, tau) (Zhang et al. 2016), and
`mode.dc_lambda > 0` compensates the delay (DC-ASGD, Zheng et al. 2017) with the
parameters each worker last read.

Worker schedule: as ssp (push+pull every step).
"""
from __future__ import annotations

from .rule import Answer, Read
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


AsyncSchedule = SspSchedule
