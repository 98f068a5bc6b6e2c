"""The worker schedule of the parameter-server modes (sync, ssp, async).

Every step: compute a gradient on the model as last read, then push it and pull the
next model in one round trip to all shards (the push first on each shard's socket, so
the read sees the worker's own update). The shards' rule decides when each pull is
answered; a mode only says where a (re)joining worker continues.
"""
from __future__ import annotations

from typing import Any

from .rule import Schedule, Trainer


class PushPullSchedule(Schedule):
    versions: list[int]

    def resume_clock(self, answers: list) -> int:
        """Where a (re)joining worker continues, given the shards' join answers."""
        return 0

    def next_clock(self, clock: int, pulled: list) -> int:
        return clock + 1

    def rejoin(self, w: Trainer) -> None:
        answers = w.client.join(w.clock)
        w.clock = max(w.clock, self.resume_clock(answers))
        self.versions = load(w, answers)

    def step(self, w: Trainer) -> None:
        w.replica.model.train()
        w.compute()
        w0 = w.client.wait_s
        pushed, pulled = w.client.push_pull(w.clock, w.replica.grads(), w.replica.buffers(), self.versions)
        tau = max(int(m.get("staleness", 0)) for m in pushed)
        if not any(m.get("dropped") or m.get("duplicate") for m in pushed):
            w.hist.add(tau)
        w.clock = self.next_clock(w.clock, pulled)
        self.versions = load(w, pulled)
        w.log_step(tau, w.client.wait_s - w0, dropped=any(bool(m.get("dropped")) for m in pushed))


def load(w: Trainer, answers: list[Any]) -> list[int]:
    """Write the shards' answers (params, buffers) into the model; their versions."""
    w.replica.load(*w.client.tables(answers))
    return [int(m.get("version", 0)) for m in answers]
