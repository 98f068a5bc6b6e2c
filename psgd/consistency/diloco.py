"""`diloco`: DiLoCo / local SGD with an outer optimizer (Douillard et al. 2023,
*DiLoCo: Distributed Low-Communication Training of Language Models*).

Worker schedule: each round, a worker takes `mode.local_steps` (H) steps with its own
inner optimizer (`[optimizer]`, with its lr schedule and warm-up; its state is kept
across rounds, as in the paper), then pushes the pseudo-gradient
    Delta_i = theta (the global model at the round's start) - theta_i (its parameters now)
and pulls the next round's global model, from which it starts the next round. A worker
whose push came after its round closed (dropped) and a joining worker continue from the
shards' open round. When the step budget is not a multiple of H, the last, shorter
round is pushed when the budget ends.

Server rule: a synchronous round over the live workers (sync's `StepBarrier`, with its
membership changes, fast-forward after a restore and dropped late pushes; no backups).
The pseudo-gradients go through sync's decisions: `Accumulate` each, then `ApplySum`,
which steps the shard's optimizer on their mean Delta. That optimizer is the outer one
(`server_optimizer`): SGD with `mode.outer_lr` (eta, default 0.2) and Nesterov momentum
`mode.outer_momentum` (mu, default 0.9), at a constant rate (the inner lr schedule is
not applied to it). In torch's convention:
    m <- mu m + mean(Delta);   theta <- theta - eta (mean(Delta) + mu m)
Its momentum m lives on the shard and is checkpointed with it (the shard's optimizer
state), the round with the rule. `outer_lr = 1, outer_momentum = 0` is plain local SGD:
theta <- theta - mean(Delta) = mean(theta_i), model averaging. BatchNorm buffers: the
round's mean. A push's clock is its round; staleness is always 0 for a push in its
round (rounds are synchronous), and the clock gap is counted in rounds.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import wire
from ..config import OptimizerConfig
from .pushpull import caught_up, counted, load, step_flags
from .rule import Diverged, Schedule, Trainer, local_step, make_local_optimizer
from .sync import SyncRule

if TYPE_CHECKING:
    from ..config import Config


class DilocoRule(SyncRule):
    """Sync's round barrier over pseudo-gradients; the shard steps the outer optimizer."""
    name = "diloco"

    @classmethod
    def server_optimizer(cls, cfg: Config) -> OptimizerConfig:
        m = cfg.mode
        return OptimizerConfig(name="sgd", lr=m.outer_lr, momentum=m.outer_momentum,
                               nesterov=m.outer_momentum > 0, weight_decay=0.0)

    @classmethod
    def last_exchange(cls, cfg: Config) -> int:
        """A push's clock is its round: the last is the round of step train.steps - 1
        (a shorter last round when local_steps does not divide train.steps)."""
        return (cfg.train.steps - 1) // cfg.mode.local_steps

    def backup(self) -> int:
        return 0

    def membership(self, live: dict[int, int]) -> list:
        """The coordinator's clocks are steps; this rule's clocks are rounds (as easgd's)."""
        return super().membership({r: c // self.mode.local_steps for r, c in live.items()})


class DilocoSchedule(Schedule):
    local_optimizer = True

    def start(self, w: Trainer) -> None:
        self.opt = make_local_optimizer(w)  # the inner optimizer, kept across rounds
        self.rejoin(w)

    def rejoin(self, w: Trainer) -> None:
        self.begin_round(w, w.client.join(w.clock))

    def begin_round(self, w: Trainer, answers: list, catch_up: bool = True) -> None:
        """Continue in the shards' open round (`catch_up`), from the global model they sent."""
        if catch_up:
            w.clock = caught_up(w, max(int(m.get("step", 0)) for m in answers) * self.cfg.mode.local_steps)
        self.versions = load(w, answers)
        self.origin = [p.clone() for p in w.replica.params()]   # theta at the round's start, per shard

    def step(self, w: Trainer) -> None:
        local_step(w, self.opt)
        h = self.cfg.mode.local_steps
        if w.clock % h:
            w.log_step(0, 0.0)
            return
        tau, wait, dropped, theirs = self.exchange(w, w.clock // h - 1, logged=True)
        w.log_step(tau, wait, dropped=dropped, **step_flags(theirs, False))

    def finish(self, w: Trainer) -> None:
        """The budget ended inside a round: push that shorter round too."""
        if w.clock % self.cfg.mode.local_steps:
            self.exchange(w, w.clock // self.cfg.mode.local_steps, catch_up=False)

    def exchange(self, w: Trainer, round_: int, catch_up: bool = True,
                 logged: bool = False) -> tuple[int, float, bool, bool]:
        """Push this round's pseudo-gradient, pull the next round's global model; the
        push's staleness, the wait, and whether it was dropped or another process's
        (`counted`).
        `logged`: the exchange ends a step (the round's last), whose line is written here
        when the shards refuse it: the step happened locally (its clock and samples
        count), only its exchange was refused (`refused: true`; the worker counts it in
        `rejected`)."""
        deltas = [s - p for s, p in zip(self.origin, w.replica.params(), strict=True)]
        w0 = w.client.wait_s
        try:
            pushed, pulled = w.client.push_pull(round_, deltas, w.replica.buffers(), self.versions)
        except (wire.Refused, Diverged):   # not this round's (a shard restored, or we are ahead), or refused
            # by the worker itself (a pseudo-gradient beyond float16's range): start from the open round's model
            if logged:
                w.log_step(0, w.client.wait_s - w0, dropped=False, refused=True)
            self.rejoin(w)
            raise
        tau, dropped, theirs = counted(w, pushed)
        self.begin_round(w, pulled, catch_up)
        return tau, w.client.wait_s - w0, dropped, theirs
