"""The sequential baseline: one process, one model, a plain PyTorch training loop.

This is the row that `psgd compare` reports speedups against (as Jacobs et al.,
MLHPC'17, report LTFB's speedup over sequential training). No coordinator, no shards,
no sockets: the same model (built from the job's seed), the same data, the same
optimizer config and learning-rate schedule, the same per-step batch size as one worker.

Budget: `steps` optimizer steps of `train.batch_size` samples (the caller passes
W x train.steps, so the baseline sees the same total number of samples as a W-worker
run), stopped early by `train.seconds` if that is set. Faults apply as they would to a
worker of rank 0 (`faults.step_delay_s` always, `faults.jitter_*` with rank 0's draws,
`slow_factor` only if `slow_rank` is 0).

Time: `t` counts training only. Evaluations pause the clock, so scoring the test set as
often as we like (every `eval.every_seconds` of training, and ~50 times per run)
changes the resolution of the time-to-target, not its value. The distributed runs are
scored by a separate evaluator process every `eval.every_seconds` of wall time, so their
time to target is rounded up to that period; the report says so.

Threads: torch uses `threads` compute threads here (default 1), as each worker process
of `psgd run` does (OMP_NUM_THREADS=1), so the baseline is "one of those workers, alone".
"""
from __future__ import annotations

import math
import time

import torch
from torch import nn

from .config import Config
from .data import load_dataset, partition
from .metrics import ThreadCpu, rate, write_json_atomic
from .models import build_model
from .optim import flush_denormals, lr_at, make_optimizer, set_lr
from .replica import Replica, pick_device

EVALS_PER_RUN = 50


class BaselineTimeout(RuntimeError):
    """The baseline ran past its time limit (`psgd compare --timeout`)."""


def run_baseline(cfg: Config, out: str | None = None, device: str = "cpu", steps: int | None = None,
                 threads: int = 1, timeout_s: float | None = None) -> dict:
    """Train sequentially; returns a summary with the fields of summary.json (mode "baseline").
    Past `timeout_s` of wall time (`psgd compare --timeout`; None: no limit, since the
    baseline does W x the steps of a W-worker run alone) it raises BaselineTimeout, as a
    distributed run past it fails."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    steps = cfg.train.steps if steps is None else int(steps)
    seconds = cfg.train.seconds
    dev = pick_device(device)
    old_threads = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    flushed = flush_denormals(cfg.train.flush_denormal)   # as the workers and shards compute
    try:
        ds = load_dataset(cfg.data, cfg.job.seed)
        model = build_model(cfg.model.name, ds.input_shape, ds.num_classes, cfg.job.seed, cfg.model.hidden)
        torch.manual_seed(cfg.job.seed * 1000)  # as worker rank 0
        replica = Replica(model, 1, dev)
        model = replica.model
        part = partition(ds.train_size, 0, 1, cfg.job.seed)
        batches = ds.train_batches(part, cfg.train.batch_size, cfg.job.seed, 0)
        cpu = ThreadCpu()   # (this thread trains: summary.json's cpu_wait_fraction, as a worker's)
        cpu.count()
        opt = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optimizer)
        f = cfg.faults
        from .workers.worker import Jitter
        jitter = Jitter(f.jitter_prob, f.jitter_s, cfg.job.seed, 0)   # rank 0's transient stragglers
        every_steps = max(1, steps // EVALS_PER_RUN) if steps else 0
        every_s = min(cfg.eval.every_seconds, seconds / EVALS_PER_RUN) if seconds else cfg.eval.every_seconds
        evals: list[dict] = []
        samples, step, train_s, loss = 0, 0, 0.0, float("nan")

        def evaluate(final: bool = False) -> None:
            acc, test_loss = replica.score_batches(ds.test_batches(cfg.eval.batch_size))
            evals.append({"t": round(train_s, 4), "samples": samples, "accuracy": acc, "loss": test_loss,
                          **({"final": True} if final else {})})

        evaluate()
        last_eval_t = 0.0
        model.train()
        while (not steps or step < steps) and (not seconds or train_s < seconds):
            if deadline is not None and time.monotonic() > deadline:
                raise BaselineTimeout(f"the baseline did not finish within {timeout_s:g} s (--timeout): "
                                      f"{step:,}{f' of {steps:,}' if steps else ''} steps done")
            t0 = time.perf_counter()
            set_lr(opt, lr_at(cfg.optimizer, step, steps))
            x, y = batches.next()
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=False)
            out_ = model(x)
            batch_loss = nn.functional.cross_entropy(out_, y)
            batch_loss.backward()
            loss = float(batch_loss.item())   # (on a GPU: waits for the backward, which slow_factor scales)
            extra = f.step_delay_s + jitter.draw()
            if f.slow_rank == 0 and f.slow_factor > 1:
                extra += (f.slow_factor - 1) * (time.perf_counter() - t0)
            if extra > 0:
                time.sleep(extra)
            opt.step()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            step += 1
            samples += len(y)
            train_s += time.perf_counter() - t0
            if (every_steps and step % every_steps == 0) or train_s - last_eval_t >= every_s:
                last_eval_t = train_s
                evaluate()
        if evals[-1]["samples"] == samples and step:
            evals[-1]["final"] = True
        else:
            evaluate(final=True)
        cpu_wait = cpu.share()
    finally:
        torch.set_num_threads(old_threads)
        flush_denormals(flushed)

    target = cfg.eval.target_accuracy
    reached = [e["t"] for e in evals if e["accuracy"] >= target]
    final = evals[-1]
    summary = {
        "mode": "baseline",
        "mode_params": {},
        "workers": 1,
        "servers": 0,
        "wall_s": round(train_s, 4),
        "samples": samples,
        "samples_per_s": rate(samples / train_s) if train_s > 0 else 0.0,
        "final_accuracy": final["accuracy"],
        "final_loss": final["loss"],
        "time_to_target_s": round(min(reached), 4) if reached else None,
        "target_accuracy": target,
        "staleness": {"mean": 0.0, "max": 0, "hist": {"0": step} if step else {}},
        "max_clock_gap": 0,
        "wait_fraction": 0.0,
        "cpu_wait_fraction": cpu_wait,
        "bytes_per_sample": 0.0,
        "failures": {"workers_lost": 0, "workers_rejoined": 0, "workers_restarted": 0, "workers_gone": 0,
                     "shard_restarts": 0, "coordinator_restarts": 0},   # (a real summary's fields)
        "dropped_gradients": 0,
        "rejected": 0,
        "bad_messages": 0,
        "evals": evals,
        "job": cfg.job.name, "seed": cfg.job.seed, "model": cfg.model.name, "data": cfg.data.name,
        "batch_size": cfg.train.batch_size, "steps": step, "last_loss": loss,
        "faults": dict(vars(cfg.faults)), "threads": threads, "device": str(dev),
    }
    if isinstance(final["loss"], float) and not math.isfinite(final["loss"]):
        summary["final_loss_not_finite"] = True   # as in a distributed run's summary: it diverged
    if out:
        import os
        os.makedirs(out, exist_ok=True)
        write_json_atomic(os.path.join(out, "summary.json"), summary)
    return summary
