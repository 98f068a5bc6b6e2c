"""A worker's steps as its event log and its refusals count them, with prefetch and
Downpour's n_fetch: a step line carries its own loss and samples, one bad gradient is one
refused step, and refusals in a row stop the worker (`cluster.max_rejections`)."""
from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from psgd.config import load
from psgd.inprocess import InProcessCluster
from psgd.workers.worker import Worker

pytestmark = pytest.mark.inprocess


def run(port: int, out: str, bad, *sets: str) -> tuple[Worker, int, list]:
    """One worker, one shard; `bad(n)`: make the n-th compute's gradient NaN. The worker,
    its exit code and (clock, loss, samples) after each compute."""
    cfg = load(None, [f"cluster.port={port}", "cluster.workers=1", "cluster.servers=1", "cluster.evaluator=false",
                      "cluster.max_rejections=5", "optimizer.momentum=0", *sets], env={})
    computed: list = []

    class W(Worker):
        def compute(self, slot=0):
            loss = super().compute(slot)
            computed.append((self.clock, round(loss, 5), self.samples))
            if bad(len(computed)):
                next(self.replica.model.parameters()).grad[0].fill_(math.nan)
            return loss
    box: dict = {}
    with InProcessCluster(cfg, out) as cluster:
        def go():
            box["w"] = W(cfg, out, "cpu", 0, cluster.ctx)
            box["code"] = box["w"].run()
        t = threading.Thread(target=go)
        t.start()
        t.join(timeout=100)
    return box["w"], box["code"], computed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_prefetched_steps_line_has_its_own_loss_and_samples(port_block, tmp_path, mode):
    """With prefetch a step is settled (and logged) after the next one computed: its line
    carried the next compute's loss and samples (the first loss was never logged)."""
    w, code, computed = run(port_block(3), str(tmp_path), lambda n: False, f"mode.name={mode}",
                            "mode.prefetch=true", "train.steps=6")
    assert code == 0
    lines = [e for e in map(json.loads, open(tmp_path / "events" / "worker-0.jsonl")) if "staleness" in e]
    assert [(e["clock"] - 1, e["loss"], e["samples"]) for e in lines] == computed


@pytest.mark.timeout(200)
@pytest.mark.parametrize("sets", [(), ("mode.n_fetch=2",), ("mode.n_fetch=2", "mode.prefetch=true"),
                                  ("mode.n_push=2",)], ids=["n_fetch=1", "n_fetch=2", "n_fetch=2+prefetch", "n_push=2"])
def test_one_nan_gradient_is_one_refused_step(port_block, tmp_path, sets):
    """Downpour with n_fetch > 1 steps the worker's own copy by its gradient before the
    shards see it: a NaN one made the copy NaN for good (every later push refused). It is
    refused by the worker first, as one step."""
    w, code, _ = run(port_block(3), str(tmp_path), lambda n: n == 3, "mode.name=async", "train.steps=20", *sets)
    assert (code, w.rejected, w.clock) == (0, 1, 20)
    assert all(bool(torch.isfinite(p).all()) for p in w.replica.model.parameters())


@pytest.mark.timeout(200)
@pytest.mark.parametrize("prefetch", ["false", "true"])
def test_refusals_in_a_row_stop_the_worker_with_prefetch_too(port_block, tmp_path, prefetch):
    """With prefetch a refusal comes in the step after the one that sent the push, and
    the step between counted as one that went through: refusals never came "in a row",
    and a worker whose every push was refused trained to the end of its budget."""
    w, code, _ = run(port_block(3), str(tmp_path), lambda n: n >= 3, "mode.name=async",
                     f"mode.prefetch={prefetch}", "train.steps=40")
    assert code == 1 and w.rejected == 5 and w.clock < 10


@pytest.mark.timeout(200)
def test_a_diloco_round_whose_exchange_is_refused_keeps_its_last_steps_line(port_block, tmp_path):
    """A round's last local step advances the clock and counts its samples before the
    round's exchange; when the shards refused that exchange (here a NaN pseudo-gradient
    from the round's last step; under Compose a shard that restarted), the step had no
    line: the worker said 'finished 11 steps, ... 1 rejected' at clock 12 of train.steps
    12. The step happened
    locally; its line now says that its exchange was refused (`refused: true`), and the
    lines, the worker's count and its samples agree."""
    w, code, computed = run(port_block(3), str(tmp_path), lambda n: n == 4, "mode.name=diloco",
                            "mode.local_steps=4", "train.steps=12")
    assert (code, w.rejected, w.clock) == (0, 1, 12)
    lines = [e for e in map(json.loads, open(tmp_path / "events" / "worker-0.jsonl")) if "staleness" in e]
    assert len(lines) == w.steps == len(computed) == 12
    assert [e["clock"] for e in lines] == list(range(1, 13))
    assert [e["clock"] for e in lines if e.get("refused")] == [4]
    assert lines[-1]["samples"] == w.samples == computed[-1][2]



@pytest.mark.timeout(120)
def test_a_worker_that_continues_at_a_clock_draws_the_batches_of_that_clock(port_block, tmp_path):
    """A worker of a resumed job (or one restarted into its rank) continued at its rank's
    clock but drew its data from epoch 0's first batch again: a job resumed each time
    before an epoch ends trained on the same first part of every partition."""
    from psgd.data import load_dataset, worker_part
    cfg = load(None, [f"cluster.port={port_block(3)}", "cluster.workers=1", "cluster.servers=1",
                      "cluster.evaluator=false", "train.steps=70"], env={})
    drawn: list = []

    class W(Worker):
        def join(self, model):
            got = super().join(model)
            self.clock = 60   # as the coordinator's start_clock says of the rank's earlier process
            return got

        def compute(self, slot=0):
            x, y = self.batches.next()
            drawn.append(y)
            self.batches.next = lambda: (x, y)   # (the batch just read, for the worker's own compute)
            try:
                return super().compute(slot)
            finally:
                del self.batches.next
    box: dict = {}
    with InProcessCluster(cfg, str(tmp_path)) as cluster:
        t = threading.Thread(target=lambda: box.update(code=W(cfg, str(tmp_path), "cpu", 0, cluster.ctx).run()))
        t.start()
        t.join(timeout=100)
    assert box["code"] == 0 and len(drawn) == 10
    ds = load_dataset(cfg.data, cfg.job.seed)
    batches = ds.train_batches(worker_part(ds.train_size, 0, 1, cfg.job.seed)[0], 32, cfg.job.seed, 0)
    whole = [batches.next()[1] for _ in range(70)]
    assert all(torch.equal(a, b) for a, b in zip(drawn, whole[60:], strict=True))
