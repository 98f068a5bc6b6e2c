"""`sync`: bulk-synchronous parallel, with optional backup workers.

Server rule: every step, each shard sums the gradients of the live workers for that
step and applies the optimizer once to their mean; reads of the next step are parked
until then. With `mode.backup_workers = b` (Chen et al. 2016) a step closes after the
first N - b gradients and the late ones are dropped and counted. W workers with batch b
equal one process with batch W*b. A shard restored from an older checkpoint meets
workers that are ahead: an empty step fast-forwards to them.

Worker schedule: push+pull every step; a late worker (its push dropped) and a joining
worker continue at the shards' step.
"""
from __future__ import annotations

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
        self.fast_forwards = 0

    def backup(self) -> int:
        return self.mode.backup_workers

    def offer(self, rank: int, clock: int) -> tuple[str, list[Read]]:
        """Offer a contribution to the open step; an empty step fast-forwards to a
        worker that is ahead. Returns the verdict and the reads that the jump releases."""
        verdict = self.barrier.offer(rank, clock)
        if verdict != bsp.EARLY or self.barrier.contributors:
            return verdict, []
        released = self.barrier.fast_forward(clock)
        self.fast_forwards += 1
        return self.barrier.offer(rank, clock), released  # type: ignore[return-value]

    def push(self, e: Push) -> list[Decision]:
        verdict, released = self.offer(e.rank, e.clock)
        if verdict == bsp.EARLY:
            return [Refuse(e.token, REFUSED, f"clock {e.clock} is ahead of step {self.barrier.step}")]
        out: list[Decision] = []
        if verdict == bsp.ACCEPT:
            first = len(self.barrier.contributors) == 1
            out += [Accumulate(e.grad, e.buffers, first), Answer(e.token, {"staleness": e.tau})]
            self.clocks.push(e.rank, e.clock)
            self.hist.add(e.tau)
        else:
            out.append(Answer(e.token, {"dropped": True, "staleness": e.tau}))
        out += [self.answer(r) for r in released]
        if self.barrier.complete():
            out += self.close_step()
        return out

    def close_step(self) -> list[Decision]:
        n = len(self.barrier.contributors)
        out: list[Decision] = [ApplySum(n, self.barrier.step), SetBuffers(None, n)]
        _, released = self.barrier.advance()
        return out + [self.answer(r) for r in released]  # type: ignore[arg-type]

    def gated_read(self, e: Read) -> list[Decision]:
        self.clocks.read(e.rank, e.clock, e)  # never parks: tracks the gap
        return [self.answer(e)] if self.barrier.read(e.clock, e) else []

    def membership(self, live: dict[int, int]) -> list[Decision]:
        self.clocks.set_live(live)
        self.barrier.set_live(live.keys())
        if self.barrier.contributors and self.barrier.complete():
            return self.close_step()
        return []

    def read_fields(self, rank: int) -> dict:
        return {"step": self.barrier.step, "finished": self.clocks.finished.get(rank, 0)}

    def stats(self) -> dict:
        return {**super().stats(), "max_clock_gap": self.clocks.max_gap, "dropped": self.barrier.dropped,
                "parked": self.barrier.parked, "step": self.barrier.step, "fast_forwards": self.fast_forwards}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "step": self.barrier.step, "dropped": self.barrier.dropped,
                "finished": dict(self.clocks.finished), "fast_forwards": self.fast_forwards,
                "contributors": list(self.barrier.contributors)}  # the open step's (their sum: the shard's)

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.barrier.step = int(sd["step"])
        self.barrier.dropped = int(sd.get("dropped", 0))
        self.clocks.restore({int(k): int(v) for k, v in sd["finished"].items()})
        self.fast_forwards = int(sd.get("fast_forwards", 0))
        self.barrier.contributors = [int(r) for r in sd.get("contributors", [])]


class SyncSchedule(PushPullSchedule):
    def resume_clock(self, answers: list) -> int:
        return max(int(m.get("step", 0)) for m in answers)

    def next_clock(self, clock: int, pulled: list) -> int:
        return max(clock + 1, self.resume_clock(pulled))  # a late worker catches up
