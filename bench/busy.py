"""psgd beside other busy processes: does its spinning still pay, or cost?

    .venv/bin/python -m bench.busy                   # sync and async, about 2 minutes on 2 cores
    .venv/bin/python -m bench.busy --busy 2 --repeats 5

A worker waiting for its answer, and a shard for its next request, look for it before
they sleep (`cluster.spin_us`, which `psgd run` turns on where the job's busy processes
fit the cores: psgd/spinning.py). Other programs on the machine are not the job's to
count. This runs psgd's one-worker, one-shard MLP job (as bench/throughput.py's `local`
part: evaluation off, batch 32, one compute thread per process) spinning as `psgd run`
decides (`spin_us` auto) against the same job not spinning (`cluster.spin_us = 0`), on
an idle machine and beside `--busy` processes that do nothing but compute (default: the
cores less one), for `sync` and for `async` with prefetch. Each pair's jobs alternate
(which goes first, in turn), and each ratio is the median of the repeats' own ratios
(spinning / not spinning): `ratio_busy_<mode>` beside the busy processes,
`ratio_idle_<mode>` without them. Above 1, spinning pays; below, it costs.

samples/s is steady state (bench.common.steady_rate), from the worker's event log.
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from bench.common import (
    emit_json,
    fresh_folder,
    main_of,
    number,
    progress,
    psgd_config,
    run_psgd,
    stop_on_signals,
    table,
)
from bench.throughput import COMMON, MODELS

MODES = {"sync": ["mode.name=sync"], "async": ["mode.name=async", "mode.prefetch=true"]}


# A process that only computes, until its parent (the benchmark, PID) is gone, Ctrl-C ignored (the
# benchmark's own stops it). (PID is the benchmark's own: one asked at the child's start, ended before
# that, was init's, and the child computed on for good.)
BUSY = ("import os, signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "while os.getppid() == {pid}: sum(range(100_000))")


class Busy:
    """`n` busy processes while in the `with`."""

    def __init__(self, n: int):
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Busy:
        self.procs = [subprocess.Popen([sys.executable, "-c", BUSY.format(pid=os.getpid())]) for _ in range(self.n)]
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait(10)


def main() -> None:
    from psgd.launcher import available_cores, spin_for
    stop_on_signals()
    cores = available_cores()
    ap = argparse.ArgumentParser(prog="python -m bench.busy", description=__doc__.split("\n")[0])
    ap.add_argument("--busy", type=number(int, 1, maximum=4 * cores), default=max(1, cores - 1),
                    help="busy processes beside the job (default: the cores less one; at most 4 a core)")
    ap.add_argument("--repeats", type=number(int, 1), default=3)
    a = ap.parse_args()
    keys, steps, warm = MODELS["mlp"]
    base = [*keys, *COMMON, f"train.steps={steps}", "cluster.workers=1", "cluster.servers=1"]
    if not spin_for(psgd_config(base)).cluster.spin_us:
        ap.error(f"psgd run does not spin this job on {cores} core{'s' * (cores != 1)} (its worker and shard "
                 f"need one each): there is nothing to compare")
    work = tempfile.mkdtemp(prefix="psgd-bench-busy-")
    rates: dict[tuple[str, str, str], list[float]] = {}
    ways = [("spinning", []), ("sleeping", ["cluster.spin_us=0"])]
    try:
        for where, n in (("idle", 0), ("busy", a.busy)):
            with Busy(n):
                for r in range(a.repeats):
                    for mode, sets in MODES.items():
                        for way, spin in ways if r % 2 == 0 else ways[::-1]:   # (either first in turn)
                            progress(f"{where}: {mode} {way}, repeat {r + 1}/{a.repeats}")
                            out = fresh_folder(os.path.join(work, "job"))
                            rate = run_psgd([*base, *sets, *spin], out, warm)["steady"]
                            rates.setdefault((where, mode, way), []).append(rate)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows, result = [], {}
    for where in ("idle", "busy"):
        for mode in MODES:
            spun, slept = rates[(where, mode, "spinning")], rates[(where, mode, "sleeping")]
            ratio = statistics.median(s / z for s, z in zip(spun, slept, strict=True))
            result[f"ratio_{where}_{mode}"] = round(ratio, 4)
            rows.append([where if where == "idle" else f"beside {a.busy} busy", mode,
                         round(statistics.median(spun)), round(statistics.median(slept)), f"{ratio:.2f}"])
    print(table(["machine", "mode", "spinning (auto) samples/s", "cluster.spin_us=0", "ratio"], rows,
                "psgd MLP W=1 S=1, spinning against not spinning (medians of the repeats)"))
    emit_json({"bench": "busy", "busy": a.busy, "repeats": a.repeats, **result})


if __name__ == "__main__":
    main_of(main)
