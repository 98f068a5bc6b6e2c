"""`sync`: bulk-synchronous parallel, with optional backup workers.

Server rule: every step, each shard sums the gradients of the live workers for that
step and applies the optimizer once to their mean; reads of the next step are parked
until then. With `mode.backup_workers = b` (Chen et al. 2016) a step closes after the
first N - b gradients and the late ones are dropped and counted. W workers with batch b
equal one process with batch W*b. A push for a later step waits at the shard until
its step opens; once every live worker has pushed for the open step or shown that it
is past it (a push for a later step, or a read of a later clock without a push here),
no gradient for it is to come, and it closes with what it has (or, empty, skips
ahead): a shard restored from a checkpoint meets workers that are ahead, and a
restarted worker may rejoin past a step that a shard has open.

Worker schedule: push+pull every step; a late worker (its push dropped) and a joining
worker continue at the shards' step.
"""
from __future__ import annotations

from dataclasses import replace

from . import barrier as bsp
from .barrier import StepBarrier
from .clock import ClockTable
from .pushpull import PushPullSchedule
from .rule import REFUSED, Accumulate, Answer, ApplySum, Decision, Push, Read, Refuse, ServerRule, SetBuffers


class SyncRule(ServerRule):
    name = "sync"
    serves = frozenset({"push", "pull"})

    def __init__(self, mode, world, tables):
        super().__init__(mode, world, tables)
        self.barrier = StepBarrier(range(world), self.backup())
        self.clocks = ClockTable(range(world), None)  # unbounded: measures the clock gap only
        self.fast_forwards = 0  # empty steps skipped
        self.short_steps = 0     # steps closed without every live worker's gradient (see `settle`)
        self.early: dict = {}    # rank -> its contribution (Push; ElasticOffer) to a later step
        self.past: dict[int, int] = {}  # rank -> the lowest step it may push for next (see `gated_read`)

    def backup(self) -> int:
        return self.mode.backup_workers

    def push(self, e: Push) -> list[Decision]:
        return self.offer(e)

    def offer(self, e) -> list[Decision]:
        """A worker's contribution to step `step_of(e)`: taken, answered as late, or
        waiting for its step."""
        verdict = self.barrier.offer(e.rank, self.step_of(e))
        out = self.wait(e) if verdict == bsp.EARLY else self.take(e, verdict)
        return out + self.settle()

    def step_of(self, e) -> int:
        return e.clock

    def keep(self, e):
        """A copy of a contribution that outlives its message (the shard reuses its buffers)."""
        return replace(e, grad=e.grad.clone(), buffers=e.buffers.clone())

    def take(self, e, verdict: str) -> list[Decision]:
        if verdict != bsp.ACCEPT:  # late or a duplicate: answered, not summed
            if verdict == bsp.DUPLICATE:
                # Its rank's gradient is in the step already, and the shard's last clock of
                # the rank did not say so (the shard keeps it across a leave and return, so
                # only where a restore left it older). Dropped, so counted (the barrier
                # counts the late ones), as the worker's step line says.
                self.barrier.dropped += 1
            return [Answer(e.token, {"dropped": True, "staleness": e.tau})]
        self.past.pop(e.rank, None)
        self.clocks.push(e.rank, e.clock)
        self.hist.add(e.tau)
        first = len(self.barrier.contributors) == 1
        return [Accumulate(e.grad, e.buffers, first), Answer(e.token, {"staleness": e.tau})]

    def wait(self, e) -> list[Decision]:
        """A contribution to a later step waits at the shard, as a read does, until its
        step opens (one per worker: one for another step replaces it, and the replaced
        one is refused). Its worker has shown that it will not contribute to the open
        step. Another for the same step is a resend (the client's, after `retry_s`: an
        easgd offer; the shard answers a push's as a duplicate before it comes here):
        the waiting copy stays and will answer the resend's token, as `take` does with
        a DUPLICATE of the open step."""
        old = self.early.pop(e.rank, None)
        if old is not None and self.step_of(old) == self.step_of(e):
            self.early[e.rank] = replace(old, token=e.token)
            return []
        self.early[e.rank] = self.keep(e)
        if old is None:
            return []
        return [Refuse(old.token, REFUSED, f"step {self.step_of(old)} was superseded by {self.step_of(e)}")]

    def settle(self) -> list[Decision]:
        """Close every complete step and take the waiting pushes whose step is open. A
        step for which no gradient is to come (every live worker has pushed for it or is
        past it, `ahead`: a shard restored with an open step, a worker that rejoined
        past it) closes with the gradients it has, or, empty, skips to the earliest
        step a worker may still push for."""
        out: list[Decision] = []
        while True:
            if self.early:   # (the usual: none waits)
                # its step open, or passed without it: a fast-forward while its worker was not live skips to
                # the live workers' step, and a waiting push below the open step, kept, was `ahead` for good
                # (every step closed short without its rank; with its rank the only one live, the loop never
                # ended: the shard hung). Taken, it is answered late (dropped, counted).
                # Taken until the step is complete: with backup workers it closes with the first
                # N - b (in arrival order), and the waiting pushes after them are late, dropped and
                # counted (all were taken: a step of more than N - b gradients, fewer counted dropped).
                for rank in [r for r, p in self.early.items() if self.step_of(p) <= self.barrier.step]:
                    if self.barrier.contributors and self.barrier.complete():
                        break
                    p = self.early.pop(rank)
                    out += self.take(p, self.barrier.offer(rank, self.step_of(p)))
            ahead = self.ahead() if self.early or self.past else {}
            if self.barrier.contributors and self.barrier.complete():
                out += self.close_step()
            elif ahead and self.barrier.passed(ahead.keys()):
                if self.barrier.contributors:
                    self.short_steps += 1
                    out += self.close_step()
                else:
                    self.fast_forwards += 1
                    live = [c for r, c in ahead.items() if r in self.barrier.live] or list(ahead.values())
                    out += [self.released(r) for r in self.barrier.fast_forward(min(live))]  # type: ignore[arg-type]
            else:
                return out
            for clock, read in self.barrier.waiting():  # still parked after the step moved on: past it
                self.read_past(read.rank, clock)  # type: ignore[attr-defined]

    def ahead(self) -> dict[int, int]:
        """The ranks known to be past the open step: rank -> the lowest step it may
        still push for (a waiting push's step; a read's clock, see `gated_read`)."""
        step = self.barrier.step
        out = {r: c for r, c in self.past.items() if c > step}
        for r, p in self.early.items():
            at = self.step_of(p)
            out[r] = min(out.get(r, at), at)
        return out

    def read_past(self, rank: int, clock: int) -> None:
        """`rank` reads `clock` past the open step: its next push is for `clock` or later."""
        self.past[rank] = max(self.past.get(rank, 0), clock)

    def close_step(self) -> list[Decision]:
        step = self.barrier.step
        done, released = self.barrier.advance()
        n = len(done)
        out: list[Decision] = [ApplySum(n, step), SetBuffers(None, n)]
        if released:
            out += [self.released(r) for r in released]  # type: ignore[arg-type]
        return out

    def released(self, e: Read) -> Answer:
        """A worker's read answered: its clock's lead over the slowest live worker then is
        the clock gap (in lockstep 0: a read parked until its step closes leads no one)."""
        self.clocks.answered(e.clock)
        return self.answer(e)

    def gated_read(self, e: Read) -> list[Decision]:
        self.clocks.note(e.rank, e.clock)   # the barrier, not the clock table, gates the read
        if self.barrier.read(e.clock, e):
            return [self.released(e)]
        if self.barrier.contributed(e.rank):
            return []  # the usual: it pushed for the open step and waits for the step's end
        # A worker reads clock c after its push for c - 1: it reads past the open step
        # without having pushed for it here. Its push went to this shard's previous life
        # (restored from a checkpoint, the push answered before the kill), or was refused
        # (a non-finite gradient): it will not push for the open step.
        self.read_past(e.rank, e.clock)
        return self.settle()

    def membership(self, live: dict[int, int]) -> list[Decision]:
        for rank in live.keys() - self.barrier.live:
            self.past.pop(rank, None)  # a returning worker starts afresh
        self.clocks.set_live(live)
        self.barrier.set_live(live.keys())
        return self.settle()

    def read_fields(self, rank: int) -> dict:
        return {"step": self.barrier.step, "finished": self.clocks.finished.get(rank, 0)}

    def parked(self) -> int:
        return self.barrier.parked

    def waiting_pushes(self) -> dict[int, int]:
        return {r: e.clock for r, e in self.early.items() if isinstance(e, Push)}

    def stats(self) -> dict:
        return {**super().stats(), "max_clock_gap": self.clocks.max_gap, "dropped": self.barrier.dropped,
                "step": self.barrier.step, "fast_forwards": self.fast_forwards,
                "short_steps": self.short_steps}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "step": self.barrier.step, "dropped": self.barrier.dropped,
                "finished": dict(self.clocks.finished), "max_gap": self.clocks.max_gap,
                "fast_forwards": self.fast_forwards,
                "short_steps": self.short_steps,
                "contributors": list(self.barrier.contributors)}  # the open step's (their sum: the shard's)

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.barrier.step = int(sd["step"])
        self.barrier.dropped = int(sd.get("dropped", 0))
        self.clocks.restore({int(k): int(v) for k, v in sd["finished"].items()}, int(sd.get("max_gap", 0)))
        self.fast_forwards = int(sd.get("fast_forwards", 0))
        self.short_steps = int(sd.get("short_steps", 0))
        self.barrier.contributors = [int(r) for r in sd.get("contributors", [])]

    def new_run(self) -> None:
        super().new_run()
        self.barrier.dropped = self.clocks.max_gap = self.fast_forwards = self.short_steps = 0


class SyncSchedule(PushPullSchedule):
    def resume_clock(self, answers: list) -> int:
        return max([int(m.get("step", 0)) for m in answers])

    def next_clock(self, clock: int, pulled: list) -> int:
        return max(clock + 1, self.resume_clock(pulled))  # a late worker catches up
