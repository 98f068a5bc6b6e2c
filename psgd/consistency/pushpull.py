"""The worker schedule of the parameter-server modes (sync, ssp, async).

Every step: compute a gradient on the model as last read, then push it and pull the
next model in one round trip to all shards (one request per shard, which the shard
serves as the push and then the read, so the read sees the worker's own update). The
shards' rule decides when each pull is answered; a mode only says where a (re)joining
worker continues, and whether the model it has may serve the next step without a pull
(`cached`: ssp's client cache), in which case the step pushes only and applies its own
update locally (`own_update`).
"""
from __future__ import annotations

from typing import Any

import torch

from .. import wire
from ..optim import lr_at
from .rule import Diverged, Schedule, Trainer


class PushPullSchedule(Schedule):
    versions: list[int]
    gathers_grads = True

    def resume_clock(self, answers: list) -> int:
        """Where a (re)joining worker continues, given the shards' join answers."""
        return 0

    def next_clock(self, clock: int, pulled: list) -> int:
        return clock + 1

    def cached(self, w: Trainer, clock: int) -> bool:
        """May the model the worker has serve its read at `clock` (no pull)? Never, here."""
        return False

    def loaded(self, w: Trainer, answers: list) -> None:
        """The shards answered a read: write it into the model."""
        self.versions = load(w, answers)

    def rejoin(self, w: Trainer) -> None:
        answers = w.client.join(w.clock)
        w.clock = max(w.clock, self.resume_clock(answers))
        self.loaded(w, answers)

    def step(self, w: Trainer) -> None:
        w0 = w.client.wait_s
        if self.cfg.wire.overlap:   # (sync only: the config's check)
            cached = False
            pushed, pulled = w.client.finish_push_pull(self.overlapped(w))
        else:
            w.compute()
            cached = self.cached(w, w.clock + 1)
            grads, buffers = w.replica.grads(), w.replica.buffers()
            if cached:
                pushed, pulled = w.client.push(w.clock, grads, buffers, self.versions), []
            else:
                pushed, pulled = w.client.push_pull(w.clock, grads, buffers, self.versions)
        tau, dropped, theirs = counted(w, pushed)
        if cached:
            own_update(w)
            w.clock += 1
        else:
            w.clock = self.next_clock(w.clock, pulled)
            self.loaded(w, pulled)
        w.log_step(tau, w.client.wait_s - w0, dropped=dropped, **step_flags(theirs, cached))

    def overlapped(self, w: Trainer) -> Any:
        """Compute the step, each shard's push and read leaving as soon as backward has
        made the gradients of its tables (`wire.overlap`: `Replica.arm`), while it goes on
        to the layers before; then the shards it did not get to. The requests in flight,
        in shard order. The pushes are the ones `step` sends after backward, so a sync
        step is the same. Given up unanswered (`abandon`) if the step fails meanwhile."""
        f = None
        failed: list[BaseException] = []

        def ready(shard: int) -> None:   # (in backward's hook: an error is raised after it)
            nonlocal f
            if failed:
                return
            try:
                one = (shard,)
                f = w.client.begin_push_pull(w.clock, w.replica.grads(shards=one), w.replica.buffers(shards=one),
                                             self.versions, shards=one, into=f)
            except BaseException as e:
                failed.append(e)

        w.replica.arm(ready)
        try:
            try:
                w.compute()
            finally:
                rest = w.replica.disarm()
            if failed:
                raise failed[0]
            if rest:
                f = w.client.begin_push_pull(w.clock, w.replica.grads(shards=rest), w.replica.buffers(shards=rest),
                                             self.versions, shards=rest, into=f)
        except BaseException:
            if f is not None:
                w.client.abandon(f)
            raise
        assert f is not None
        return f.in_shard_order()


def acknowledged(pushed: list[Any]) -> tuple[int, bool, bool]:
    """The shards' answers to a push (at least one): (its staleness, the largest of
    theirs; did a shard drop it as late; was it another process's: every shard had this
    rank's push of this clock already, and none from a resend of this very request
    (`ParameterClient.finish_push_pull` marks those answers `resent`), so nothing of this
    one was applied: a restarted worker repeating a clock that its rank's earlier process
    pushed). A shard that had it from this process's own earlier send (a resend after a
    shard restored a checkpoint holding it, a step refused by another shard and tried
    again) applied it: it counts. One pass over the answers' fields: every step of every
    worker reads them."""
    taus = []
    dropped = False
    theirs = True
    for m in pushed:
        taus.append(int(m.get("staleness", 0)))
        if m.get("dropped"):
            dropped = True
        if theirs and (not m.get("duplicate") or m.get("resent")):
            theirs = False
    return max(taus), dropped, theirs


def counted(w: Trainer, pushed: list[Any]) -> tuple[int, bool, bool]:
    """`acknowledged`, the push's staleness added to the worker's histogram where the
    shards applied it: not dropped, not another process's. The step line says which
    (`dropped`, and `step_flags`), so that the lines and the histogram count the same
    pushes (a new process for a rank credits its earlier ones' from their lines)."""
    tau, dropped, theirs = acknowledged(pushed)
    if not (dropped or theirs):
        w.hist.add(tau)
    return tau, dropped, theirs


def step_flags(theirs: bool, cached: bool) -> dict[str, Any]:
    """A step line's optional fields: `duplicate` (the push was another process's:
    `acknowledged`), `cached` (the step read no model: ssp's client cache, prefetch)."""
    if not (theirs or cached):
        return _NONE
    return {**({"duplicate": True} if theirs else {}), **({"cached": True} if cached else {})}


_NONE: dict[str, Any] = {}


def load(w: Trainer, answers: list[Any]) -> list[int]:
    """Write the shards' answers (params, buffers) into the model; their versions."""
    w.replica.load(*w.client.tables(answers))
    return [int(m.get("version", 0)) for m in answers]


def caught_up(w: Trainer, clock: int) -> int:
    """A joining worker's clock, moved up to `clock` (the start of the shards' open round,
    or the round after its own last), but never past the job's last step: a round that
    starts after it was never held, and the coordinator refuses a clock beyond it."""
    steps = w.cfg.train.steps
    return max(w.clock, min(clock, steps) if steps else clock)


def finite_or_diverged(w: Trainer, grads: list[torch.Tensor]) -> None:
    """Refuse (Diverged) a gradient with NaN or Inf before the worker steps its own copy
    by it: the shards refuse the push, but the copy would keep the NaN, and every later
    gradient computed on it."""
    for g in grads:
        if not wire.finite(g):
            raise Diverged(f"worker {w.rank}: the gradient at step {w.clock} has NaN or Inf values; lower "
                           f"optimizer.lr")


@torch.no_grad()
def own_update(w: Trainer) -> None:
    """Read-my-writes: apply the worker's own gradient (the model's `.grad`, as pushed)
    to its copy of the model as a plain SGD step at the shards' per-push rate,
    -lr / W * g (lr at the worker's clock). Exact for a shard running plain SGD; with
    momentum, weight decay or Adam it approximates the shard's step (their state lives
    on the shards), and the next pull replaces it with the shards' model. With
    `wire.compression` the push carries only part of g (error feedback sends the rest
    later), so the copy runs ahead of the shards by what is still left out."""
    lr = lr_at(w.cfg.optimizer, w.clock, w.cfg.train.steps) / w.cfg.cluster.workers
    for p in w.replica.model.parameters():
        if p.grad is not None:
            p.add_(p.grad, alpha=-lr)
