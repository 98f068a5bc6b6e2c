"""Scaling: psgd's steady-state samples/s against workers and shards, for every mode.

    .venv/bin/python -m bench.scaling                      # everything: 2 models x 6 modes x 3 x 3 runs (long)
    .venv/bin/python -m bench.scaling --quick              # MLP, workers 1,2,4, 1 shard (a few minutes)
    .venv/bin/python -m bench.scaling --models resnet20 --modes sync,async --workers 1,2 --shards 1

Each point is one `psgd run` (psgd.launcher.run_local: coordinator, S shard processes,
W worker processes; evaluator off, one compute thread per process) of the MLP on digits
or ResNet-20 on synthetic 3x32x32 data, batch 32 per worker, the same number of steps
per worker for every point of a model. samples/s is steady state, the definition of
bench/common.py (`steady_rate`: all workers' samples in the window when every worker
is past its warm-up steps and none has finished, over its length); `wait` is the
fraction of the workers' time blocked on the shards (summary.json's `wait_fraction`,
whole run). Modes run with their defaults (ssp staleness 2, easgd tau 4, ltfb
round_steps 50 and diloco local_steps 20: with ResNet-20's few steps no tournament and
at most one outer step happens). Progress and the time
left go to stderr; the last line is one JSON object. A point that fails is said on stderr
and in the JSON's `failed` (with its error), the others still run, and the exit status is 1.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from bench.common import (
    emit_json,
    fresh_folder,
    int_list,
    main_of,
    name_list,
    number,
    progress,
    reported,
    run_psgd,
    stop_on_signals,
    table,
)
from psgd import config

MODELS = {  # name -> (config keys, steps per worker, warm-up steps)
    "mlp": (["model.name=mlp", "data.name=digits"], 300, 30),
    "resnet20": (["model.name=resnet20", "data.name=synthetic", "data.shape=[3,32,32]"], 24, 6),
}
MODES = "sync,ssp,async,easgd,ltfb,diloco"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", type=name_list(MODELS), default="mlp,resnet20", help="mlp, resnet20 (default: both)")
    ap.add_argument("--modes", type=name_list(config.MODES), default=MODES, help=f"some of {MODES} (default: all)")
    ap.add_argument("--workers", type=int_list(1), default="1,2,4", help="worker counts (default: 1,2,4)")
    ap.add_argument("--shards", type=int_list(1), default="1,2,4", help="shard counts (default: 1,2,4)")
    ap.add_argument("--quick", action="store_true", help="= --models mlp --shards 1 (not with either)")
    ap.add_argument("--steps-scale", type=number(float, 0, above=True), default=1.0,
                    help="multiply every run's steps")
    ap.add_argument("--keep", help="keep the runs' folders here")
    a = ap.parse_args()
    if a.quick:   # (it replaced them without a word: --quick --models resnet20 ran the mlp)
        given = [f for f in ("--models", "--shards") if any(x == f or x.startswith(f + "=") for x in sys.argv[1:])]
        if given:
            ap.error(f"--quick is --models mlp --shards 1: give {' and '.join(given)} without it")
        a.models, a.shards = ["mlp"], [1]
    points = [(m, mode, w, s) for m in a.models for mode in a.modes for w in a.workers for s in a.shards]
    for model, mode, w, s in points:   # every point's config checked before the first run, not after hours
        try:
            config.load(None, point_sets(model, mode, w, s, a.steps_scale), env={})
        except config.ConfigError as e:
            ap.error(f"{model} {mode} W={w} S={s}: {e}")
    stop_on_signals()
    work = a.keep or tempfile.mkdtemp(prefix="bench-scaling-")
    records: list[dict] = []
    failed: list[dict] = []
    took: dict[tuple[str, int], list[float]] = {}
    t0 = time.monotonic()
    try:
        for k, (model, mode, w, s) in enumerate(points):
            warm = MODELS[model][2]
            left = sum(_guess(took, p[0], p[2]) for p in points[k:])
            name = f"{model} {mode} W={w} S={s}"
            progress(f"{k + 1}/{len(points)}: {name}  "
                     f"({time.monotonic() - t0:.0f} s so far, about {left:.0f} s left)")
            out = fresh_folder(os.path.join(work, f"{model}-{mode}-w{w}-s{s}"))
            point = {"model": model, "mode": mode, "workers": w, "shards": s}
            t = time.monotonic()
            with reported(name, lambda error, point=point: failed.append({**point, "error": error})):
                summary = run_psgd(point_sets(model, mode, w, s, a.steps_scale), out, warm)
                records.append({**point, "samples_per_s": round(summary["steady"], 1),
                                "wait_fraction": summary.get("wait_fraction")})
            took.setdefault((model, w), []).append(time.monotonic() - t)
            if not a.keep:
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    shards = sorted({r["shards"] for r in records})
    for model in dict.fromkeys(r["model"] for r in records):
        rows = []
        for mode, w in dict.fromkeys((r["mode"], r["workers"]) for r in records if r["model"] == model):
            got = {r["shards"]: r for r in records if (r["model"], r["mode"], r["workers"]) == (model, mode, w)}
            one = [r for r in records if (r["model"], r["mode"], r["workers"], r["shards"]) == (model, mode, 1,
                                                                                               shards[0])]
            row = [mode, w]
            for s in shards:
                r = got.get(s)
                row += [r["samples_per_s"] if r else float("nan"), r["wait_fraction"] if r else float("nan")]
            row.append(got[shards[0]]["samples_per_s"] / one[0]["samples_per_s"] if one and shards[0] in got
                       else float("nan"))
            rows.append(row)
        headers = ["mode", "workers"]
        for s in shards:
            headers += [f"S={s} samples/s", f"S={s} wait"]
        headers.append(f"speedup vs W=1 (S={shards[0]})")
        print(table(headers, rows, f"\n{model}: steady-state samples/s (batch 32 per worker, "
                                   f"{steps_of(model, a.steps_scale)} steps per worker)"))
    if failed:
        print("\nfailed (not measured): " + "; ".join(f"{f['model']} {f['mode']} W={f['workers']} S={f['shards']}"
                                                    for f in failed), flush=True)
    emit_json({"bench": "scaling", "rows": records, "wall_s": round(time.monotonic() - t0, 1),
               "steps": {m: steps_of(m, a.steps_scale) for m in a.models},
               **({"failed": failed} if failed else {})})
    if failed:
        raise SystemExit(1)


def point_sets(model: str, mode: str, workers: int, shards: int, steps_scale: float) -> list[str]:
    """The config keys of one point's `psgd run`."""
    return MODELS[model][0] + [f"mode.name={mode}", f"cluster.workers={workers}", f"cluster.servers={shards}",
                               "cluster.evaluator=false", "train.batch_size=32",
                               f"train.steps={steps_of(model, steps_scale)}"]


def steps_of(model: str, steps_scale: float) -> int:
    """A point's train.steps: the model's steps x `--steps-scale`, at least its warm-up + 4."""
    _, steps, warm = MODELS[model]
    return max(warm + 4, int(steps * steps_scale))


def _guess(took: dict, model: str, workers: int) -> float:
    """Expected seconds of one run: the mean of this (model, workers) so far, else of the model,
    else a rough prior."""
    same = took.get((model, workers)) or [x for (m, _), xs in took.items() if m == model for x in xs]
    if same:
        return sum(same) / len(same)
    return 12.0 if model == "mlp" else 40.0


if __name__ == "__main__":
    main_of(main)
