"""`async`: Downpour / Hogwild (Dean et al. 2012): SSP without a bound.

Server rule: a push is applied on arrival at lr / W, reads never wait. Options:
`mode.lr_policy = "staleness"` applies it at lr / max(1, tau) instead (Zhang et al.
2016: alpha0 / tau, alpha0 the synchronous rate; in place of the 1 / W, not on top), and
`mode.dc_lambda > 0` compensates the delay (DC-ASGD, Zheng et al. 2017) with the
parameters that the pushing worker read at its gradient's read version (w_bak).

Worker schedule: as ssp (push+pull every step). With `mode.prefetch = true` the worker
computes its next gradient on the parameters it has while its push and pull are in
flight (Downpour's overlap of fetching and computing): each gradient is then one
update staler, and the round trip hides behind the compute. Downpour's `mode.n_push`
and `mode.n_fetch` (Dean et al. 2012): push the gradients accrued over n_push steps
as one sum, fetch the parameters every n_fetch steps, and in between step the
worker's own copy by its own gradients (`AsyncSchedule.downpour_step`); they combine
with prefetch.
"""
from __future__ import annotations

from typing import Any

from .. import wire
from .pushpull import counted, finite_or_diverged, load, own_update, step_flags
from .rule import Answer, Read, Trainer
from .ssp import SspRule, SspSchedule
from .staleness import delay_compensate, lr_scale

READS = 2  # DC-ASGD copies kept per worker: the read a gradient is computed on, and one in flight


class AsyncRule(SspRule):
    name = "async"

    def __init__(self, mode, world, tables):
        super().__init__(mode, world, tables)
        self.w_read: dict = {}   # DC-ASGD: rank -> {version: the parameters it read}, its last READS
        self.pushed_at: dict[int, int] = {}   # n_push > 1: rank -> the clock of its latest push

    def bound(self) -> int | None:
        return None

    def lr_scale(self, tau: int) -> float:
        """1 / W, or 1 / max(1, tau) in its place with `lr_policy = "staleness"`."""
        return lr_scale(tau, self.mode.lr_policy, self.world)

    def steps_per_push(self) -> int:
        """Downpour's `mode.n_push`: a push is the sum of that many steps, so the lr
        schedule moves n_push / W steps per push."""
        return self.mode.n_push

    def holds_own(self) -> bool:
        """Does the model a worker computes on hold its own pushes since its read? With
        Downpour's `mode.n_fetch` > 1 it does: between fetches the worker steps its copy by
        each of its gradients (`pushpull.own_update`). Otherwise the next read brings them
        (with prefetch a gradient is computed on a read that lacks the push before it:
        that one is stale)."""
        return self.mode.n_fetch > 1

    def gradient(self, e):
        """DC-ASGD: compensated with w_bak, the copy this worker read at the version its
        gradient was computed on (the push's read_version = version - tau), stepped by the
        worker's own pushes since then as the worker steps its copy (`holds_own`:
        -lr / W * g, `pushpull.own_update`), so that w_now - w_bak is the other workers'
        updates. A push of Downpour's `mode.n_push` is the sum S of n gradients: it is
        compensated as n times their mean g = S / n, n (g + lambda g g (w_now - w_bak)) =
        S + lambda / n S S (...), as each of n equal gradients would be (lambda S S, the
        sum taken for one gradient, compensated n times as strongly). n is the steps the push
        carries (`carried`): n_push, or fewer in the push of what is still summed when the
        budget ends."""
        if self.mode.dc_lambda <= 0:
            return e.grad
        n = self.carried(e)   # (on every push while DC-ASGD is on: it counts from the rank's previous one)
        reads = self.w_read.get(e.rank, {})
        w_bak = reads.get(self.tables.version - e.tau)
        g = e.grad
        if w_bak is not None:
            g = delay_compensate(e.grad, self.tables.params.detach(), w_bak, self.mode.dc_lambda / n)
        if self.holds_own():   # the worker's copies of every read it may still compute on take this push
            lr = self.tables.worker_lr(e.clock)
            for w in reads.values():
                w.add_(e.grad, alpha=-lr)
        return g

    def carried(self, e) -> int:
        """How many steps' gradients a push sums: `mode.n_push`, or, for a push fewer steps
        after the rank's previous one (`AsyncSchedule.finish`: the last, partial sum), that
        many. (A push's clock is its last step's; a worker's first push carries the steps
        from 0, or n_push after a jump of its clock: a rejoin, a restore.)"""
        n = self.mode.n_push
        if n > 1:
            last, self.pushed_at[e.rank] = self.pushed_at.get(e.rank, -1), e.clock   # -1: from step 0
            if 0 < e.clock - last < n:
                return e.clock - last
        return n

    def answer(self, e: Read) -> Answer:
        if self.mode.dc_lambda > 0 and e.rank >= 0:  # keep its last READS reads (prefetch computes on the older)
            reads = self.w_read.setdefault(e.rank, {})
            reads[self.tables.version] = self.tables.params.detach().clone()
            for v in sorted(reads)[:-READS]:
                del reads[v]
        return super().answer(e)

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.w_read, self.pushed_at = {}, {}  # the reads were of the tables before the restore


class AsyncSchedule(SspSchedule):
    """Push+pull every step (`SspSchedule`'s step) unless `mode.prefetch`, `mode.n_push` or
    `mode.n_fetch` say otherwise; then `downpour_step`."""

    caches = False
    inflight: Any = None        # the request in flight (prefetch), whether it pushed, and its step's (loss, samples)
    inflight_step: tuple[float, int] | None = None
    inflight_clock: int | None = None   # the clock of its push (None: it only reads)
    inflight_sum: list | None = None    # the accrued sum it pushes (n_push > 1), kept in case it is refused
    slot = 0                    # which set of gradient buffers the next push uses

    def __init__(self, cfg):
        super().__init__(cfg)
        m = cfg.mode
        self.n_push, self.n_fetch, self.prefetch = m.n_push, m.n_fetch, m.prefetch
        self.since_push = self.since_fetch = 0   # steps since the last push, since the last fetch
        self.accrued: list | None = None          # the gradients summed since the last push (n_push > 1)
        self.accrued_read: list[int] = []         # the read the latest of them was computed on
        self.last_tau = 0

    def rejoin(self, w: Trainer) -> None:
        self.settle(w)
        super().rejoin(w)
        self.since_fetch = 0

    def step(self, w: Trainer) -> None:
        if not self.prefetch and self.n_push == self.n_fetch == 1:
            return super().step(w)
        return self.downpour_step(w)

    def downpour_step(self, w: Trainer) -> None:
        """Downpour's client (Dean et al. 2012, Algorithm 7.1 of the supplement): compute on
        the parameters it has, sum the gradient into those accrued, step its own copy by it
        (parameters -= lr/W * gradient, `own_update`; with n_fetch = 1 the next fetch
        replaces the copy, so the step is skipped); push the sum every n_push steps and
        fetch the parameters every n_fetch steps, in one round trip when both fall due.
        With prefetch the request travels while the next step computes, and is settled
        (its answers loaded) after that step's gradient is taken."""
        w.compute(self.slot)             # on the parameters we have, while the last request travels
        grads, buffers = w.replica.grads(self.slot), w.replica.buffers(self.slot)
        if self.n_push > 1 or self.n_fetch > 1:   # summed into the accrued, stepping the worker's own copy:
            finite_or_diverged(w, grads)          # refused before either (the shards never see it to refuse it)
        read = self.versions             # the read this gradient was computed on (settle may load a newer one)
        self.settle(w)
        self.since_push += 1
        self.since_fetch += 1
        push = self.since_push >= self.n_push
        fetch = self.since_fetch >= self.n_fetch
        if self.n_push > 1:
            grads, self.accrued_read = self.accrue(grads), read
        if self.n_fetch > 1:
            own_update(w)
        if push or fetch:
            self.inflight_clock = w.clock if push else None
            self.inflight_sum = self.accrued if push else None
            self.inflight = w.client.begin_push_pull(w.clock, grads if push else None, buffers if push else None,
                                                     read, self.slot, pull=fetch)
            self.inflight_step = (w.loss, w.samples)
            self.slot ^= 1
            if push:
                self.since_push, self.accrued = 0, None
            if fetch:
                self.since_fetch = 0
        w.clock += 1
        if self.inflight is None:
            w.log_step(self.last_tau, 0.0, pushed=False)
        elif not self.prefetch:
            self.settle(w)
        return None

    def refused(self, w: Trainer, clock: int) -> None:
        """`SspSchedule.refused`; with n_fetch > 1 the copy the worker stepped by the
        refused gradients (`own_update`) is replaced at the next step (a fetch falls due);
        with n_push > 1 the refused sum is accrued again, and the next step pushes it with
        its own gradient at the refused clock (only the gradient of the step that a
        prefetched refusal interrupted is lost, as a single step's is; with
        `wire.compression`, whose residual took the sum in as it was encoded, the sum is
        not accrued again; the sum pushed by `finish` at the budget's end is not tried
        again either)."""
        super().refused(w, clock)
        self.since_fetch = max(self.since_fetch, self.n_fetch - 1)
        if self.inflight_sum is not None and w.cfg.wire.compression == "none":
            # (compressed, the sum's residual already took it in: accrued again, it would go twice;
            # what the refused push carried is lost, as README says of a refused compressed push)
            self.accrued, self.since_push = self.inflight_sum, self.n_push - 1
        self.inflight_sum = None

    def accrue(self, grads: list) -> list:
        """Add this step's gradient tables to the accrued sum (kept apart from the gather
        buffers, which the next step reuses); the sum."""
        if self.accrued is None:
            self.accrued = [g.clone() for g in grads]
        else:
            for a, g in zip(self.accrued, grads, strict=True):
                a.add_(g)
        return self.accrued

    def finish(self, w: Trainer) -> None:
        """Settle the request in flight, then push what is still accrued (n_push > 1),
        counting its staleness as every other push's."""
        self.settle(w)
        if self.accrued is not None and self.since_push > 0:
            counted(w, w.client.push(w.clock - 1, self.accrued, w.replica.buffers(self.slot), self.accrued_read))
            self.accrued, self.since_push = None, 0

    def settle(self, w: Trainer, reread: bool = True) -> None:
        """Wait for the request in flight, load what it read, log its step. (`reread`:
        ssp's; async's shards apply every push, so no drop leaves its copy stale.)"""
        if self.inflight is None:
            return
        inflight, self.inflight = self.inflight, None
        w0 = w.client.wait_s
        try:
            pushed, pulled = w.client.finish_push_pull(inflight)
        except wire.Refused:
            if self.inflight_clock is not None:
                self.refused(w, self.inflight_clock)
            raise
        self.inflight_sum = None   # (answered: not kept for a retry)
        extra = {"pushed": False}
        if pushed:
            self.last_tau, dropped, theirs = counted(w, pushed)
            extra = step_flags(theirs, False)
            if dropped:
                extra = {"dropped": True, **extra}
        if pulled:
            self.versions = load(w, pulled)
        w.log_step(self.last_tau, w.client.wait_s - w0, self.inflight_step, **extra)
