"""Models with buffers (BatchNorm's running statistics) in every mode: what a job
resumed from its shards' checkpoints, or a worker that rejoins, continues from."""
from __future__ import annotations

import math

import pytest
import torch

from psgd.config import Config
from psgd.consistency.ltfb import LtfbSchedule
from psgd.shard import Shard
from tests.loopback import FakeTrainer, flat
from tests.test_ltfb import TourLoopback, grad, trainers_on

unit = pytest.mark.unit


def ltfb_cnn(**sets) -> Config:
    return Config().replace(**{"mode.name": "ltfb", "cluster.workers": 2, "cluster.servers": 2,
                               "model.name": "cnn", "mode.round_steps": 3, "train.steps": 30,
                               "optimizer.momentum": 0.9, **sets})


@unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("explore", [{}, {"optimizer.lr": [0.01, 0.5]}])
def test_a_resumed_ltfb_job_continues_each_trainer_from_its_own_deposit(explore):
    """psgd run --mode ltfb stopped after a tournament and run again into the same --out
    (the shards resume their checkpoints, deposits included): every worker began again at
    step 0 from the initial model (loss 2.3 on cnn/digits), its weights, BatchNorm
    statistics and optimizer state lost, and trained the whole budget again, where sync,
    ssp, async, easgd and diloco continue from the checkpoints' step. Each trainer now
    continues from its own latest deposit (weights, buffers and explored values: the
    population stays as it was) at that round's step."""
    cfg = ltfb_cnn(**{"mode.explore": explore})
    shards, trainers = trainers_on(cfg, 2)
    deposited = {}
    for t, (w, s) in enumerate(trainers):
        for _ in range(3):
            s.step(w)
        with torch.no_grad():   # the trainers' running statistics differ from the initial ones and each other's
            for b in w.replica.model.buffers():
                if b.is_floating_point():
                    b.add_(0.5 + t)
        s.deposit(w, 1, 0.5 + t, [0.0, -1.0, math.nan, math.nan], s.with_opt)
        deposited[t] = (flat(w.replica.params()), flat(w.replica.buffers()), dict(s.hyper))
    restored = []
    for i, shard in enumerate(shards):   # the job is stopped; the next run's shards resume its checkpoints
        again = Shard(cfg, i)
        again.load_state_dict(shard.state_dict())
        again.new_run()
        restored.append(again)
    for t in range(2):
        w = FakeTrainer(cfg, TourLoopback(restored, t), grad, t)
        w.live = lambda: {0, 1}
        s = LtfbSchedule(cfg)
        s.start(w)                       # a new run's coordinator: every worker registers at clock 0
        params, buffers, hyper = deposited[t]
        assert w.clock == cfg.mode.round_steps
        assert torch.equal(flat(w.replica.params()), params)
        assert torch.equal(flat(w.replica.buffers()), buffers)
        assert s.hyper == hyper
