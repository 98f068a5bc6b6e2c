"""`ssp`: stale-synchronous parallel (Ho et al., NIPS 2013; Petuum Bösen).

Server rule: a gradient is applied on arrival at lr / W, so that W pushes move the
model as far as one synchronous step of W averaged gradients. A worker that finished
clock c may read only when every live worker has finished clock >= c - s (bound
`mode.staleness`); otherwise its read is parked until a push or a membership change
frees it (`clock.ClockTable`), never by polling.

Worker schedule: push+pull every step; a joining worker continues at the clock it had
finished on the shards.
"""
from __future__ import annotations

from .clock import ClockTable
from .pushpull import PushPullSchedule
from .rule import Answer, Apply, Decision, MixBuffers, Push, Read, ServerRule


class SspRule(ServerRule):
    name = "ssp"
    serves = frozenset({"push", "pull"})

    def __init__(self, mode, world, tables):
        super().__init__(mode, world, tables)
        self.clocks = ClockTable(range(world), self.bound())

    def bound(self) -> int | None:
        return self.mode.staleness

    def lr_scale(self, tau: int) -> float:
        return 1.0

    def gradient(self, e: Push):
        return e.grad

    def push(self, e: Push) -> list[Decision]:
        progress = self.tables.version / self.world
        out: list[Decision] = [Apply(self.gradient(e), self.lr_scale(e.tau) / self.world, progress),
                               MixBuffers(e.buffers, 1.0 / self.world), Answer(e.token, {"staleness": e.tau})]
        self.hist.add(e.tau)
        return out + [self.answer(r) for r in self.clocks.push(e.rank, e.clock)]  # type: ignore[arg-type]

    def gated_read(self, e: Read) -> list[Decision]:
        return [self.answer(r) for r in self.clocks.read(e.rank, e.clock, e)]  # type: ignore[arg-type]

    def membership(self, live: dict[int, int]) -> list[Decision]:
        return [self.answer(r) for r in self.clocks.set_live(live)]  # type: ignore[arg-type]

    def read_fields(self, rank: int) -> dict:
        return {"step": 0, "finished": self.clocks.finished.get(rank, 0)}

    def stats(self) -> dict:
        return {**super().stats(), "max_clock_gap": self.clocks.max_gap, "parked": self.clocks.parked}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "finished": dict(self.clocks.finished)}

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.clocks.finished.update({int(k): int(v) for k, v in sd["finished"].items()})


class SspSchedule(PushPullSchedule):
    def resume_clock(self, answers: list) -> int:
        return max(int(m.get("finished", 0)) for m in answers)
