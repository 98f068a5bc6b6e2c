"""`psgd simulate`: compare consistency modes at any worker count, on a virtual clock.

    psgd simulate [CONFIG] --modes sync,ssp:staleness=4,async,easgd,ltfb,diloco \\
                  --workers 64 | 8,64,256 [--servers S] [--repeats N] [--jobs N] --out DIR [--set k=v ...]

Every configuration of the plan (`--modes`, `--workers`, `--repeats` mean what they
mean for `psgd compare`, whose parser and plan this uses) runs in one process, this
one (or, with `--jobs N`, one of N spawned processes that take runs one after
another), as a discrete-event
simulation (psgd.sim): the real rules (psgd/consistency/) and the real shards
(psgd.shard) are driven by simulated workers that compute real gradients on their own
batches (unless `sim.train = false`), so accuracy is real and only time is simulated,
with the cost model of the `[sim]` section (docs/simulation.md):
`sim.compute_s` per step (0: calibrated here, by timing the model's forward and
backward), its lognormal spread `sim.compute_cv`, `sim.latency_s`, `sim.bandwidth_gbps`
per NIC, the shards' `sim.apply_gbps`, a compressed push's `sim.encode_ns` and
`sim.decode_ns` (0: calibrated here), and the `faults.*` keys.

Writes what `psgd compare` writes: DIR/compare.json, DIR/compare-context.json,
DIR/report.md, the plots, DIR/runs/<name>/summary.json and events/, with times in
virtual seconds and every summary marked `"simulated": true`. The same config and seed
give the same compare.json to the last digit (with `sim.compute_s` given, and for
compressed pushes `sim.encode_ns` and `sim.decode_ns`; a calibrated
value, the one the runs used, is in compare-context.json, to pass back with --set: one
per batch size, so a sweep whose worker counts differ in batch is passed back one worker
count at a time).
No sequential baseline.
Progress, with the time left, goes to stderr.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Generator
from contextlib import closing
from typing import Any

from .compare import (
    SHARED_SECTIONS,
    build_plan,
    config_key,
    estimate_left,
    failed_entry,
    hold_output,
    idle_faults_of,
    parse_modes,
    parse_workers,
    refuse_sets_an_item_overrides,
    refuse_sets_the_plan_overrides,
    tag,
)
from .config import Config, ConfigError, given_sets, load
from .metrics import write_json_atomic


def add_parser(subparsers) -> argparse.ArgumentParser:
    """`psgd simulate`'s arguments, on the `psgd` command's subparsers."""
    p = subparsers.add_parser("simulate", help="compare modes at any worker count on a virtual clock (one process)")
    p.add_argument("config", nargs="?", default=os.environ.get("PSGD_CONFIG"),
                   help="TOML config file (default: $PSGD_CONFIG, else the built-in default job)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key (repeatable), e.g. sim.train=false, faults.jitter_prob=0.05")
    p.add_argument("--out", default=os.environ.get("PSGD_OUT"),
                   help="output folder: report.md, compare.json, runs/ (default: $PSGD_OUT, else "
                        "runs/simulate-DATE-TIME)")
    p.add_argument("--modes", default="sync,ssp,async",
                   help="comma-separated modes with parameters, as for psgd compare: sync,ssp:staleness=4,async "
                        "(default: sync,ssp,async)")
    from .cli import REPEATS_HELP, SERVERS_HELP, WORKERS_HELP
    p.add_argument("--workers", default=None, help=WORKERS_HELP.format("8,64,256"))
    p.add_argument("--servers", type=int, help=SERVERS_HELP)
    p.add_argument("--repeats", type=int, default=1, help=REPEATS_HELP)
    p.add_argument("--device", default="cpu",
                   help="where the simulated workers compute: cpu (default) | auto | cuda | cuda:N")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="runs simulated at once, in N processes that take runs one after another (default 1); "
                        "the results are the same")
    p.set_defaults(no_baseline=True, cmd="simulate")
    return p


def compute_cost(cfg, device: str, cache: dict) -> tuple[float, str]:
    """(seconds per step, "config" or "calibrated"): `sim.compute_s`, or the time of one
    forward and backward here, measured once per (model, data, worker 0's batch size)."""
    if cfg.sim.compute_s > 0:
        return cfg.sim.compute_s, "config"
    from .sim.run import calibrate
    return calibrate(cfg, device, cache), "calibrated"


def runnable(specs: list) -> list:
    """The mode configurations whose mode module loads (a mode being written may not yet)."""
    from .consistency import get as get_mode
    out = []
    for spec in specs:
        try:
            get_mode(spec.mode)
        except (ImportError, AttributeError) as e:
            print(f"psgd simulate: skipping {spec.label}: its mode does not load ({type(e).__name__}: {e})",
                  file=sys.stderr, flush=True)
            continue
        out.append(spec)
    if not out:
        raise ConfigError("--modes: none of the modes loads")
    return out


def cost_model(base, calibrated: dict, codecs: dict) -> dict:
    s = base.sim
    return {"compute_s": s.compute_s or None, "calibrated_compute_s": calibrated or None,
            "compute_cv": s.compute_cv, "latency_s": s.latency_s, "bandwidth_gbps": s.bandwidth_gbps,
            "apply_gbps": s.apply_gbps, "train": s.train,
            **({"codec_ns": codecs} if codecs else {})}


def codec_said(codecs: dict, sim) -> str:
    """The progress line's words for the compressed pushes' costs (`codec_costs`)."""
    given = [f"sim.{k}" for k in ("encode_ns", "decode_ns") if getattr(sim, k)]
    source = ("calibrated here" if not given else " and ".join(given) if len(given) == 2
              else f"{given[0]}; the other calibrated here")
    return "".join(f"; {name}: encode {e:g} ns, decode {d:g} ns a value" for name, (e, d) in codecs.items()) + (
        f" ({source})" if codecs else "")


def main(args) -> int:
    base = load(args.config, args.set)
    specs = runnable(parse_modes(args.modes, SHARED_SECTIONS + ("sim",)))   # one cost model for the whole plan
    refuse_sets_the_plan_overrides(args.set, parse_workers(args.workers), args.servers)
    refuse_sets_an_item_overrides(args.set, specs)
    workers = parse_workers(args.workers) or [base.cluster.workers]
    if args.servers is not None and args.servers < 1:
        raise ConfigError(f"--servers must be >= 1, got {args.servers}")
    if args.jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
    from .replica import check_device
    check_device(args.device)   # once, before calibrating and before any run
    refuse_unsimulated([base])   # (first: a key of the job's that the plan refused, for the items of
    #                              a mode that does not take it, it told to set in the items instead)
    plan = build_plan(base, specs, workers, args.repeats, args.servers, baseline=False)
    if not base.train.steps and not base.train.seconds:
        raise ConfigError("psgd simulate needs a budget: train.steps or train.seconds (virtual seconds) > 0")
    check_cost_model(base)
    from .cli import check_job
    # the data and model are every run's (SHARED_SECTIONS): one error, not every run failing
    # (more workers than the training set has samples for, too), as psgd compare
    n = check_job(base, [run.cfg for run in plan])
    check_data(plan)
    refuse_unsimulated([run.cfg for run in plan])
    out = args.out or os.path.join("runs", f"simulate-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    lock = hold_output(out, "psgd simulate")
    try:
        return _simulate(args, base, workers, plan, out, n)
    finally:
        lock.close()


# The cost model's bounds: as the injected delays' (config.MAX_DELAY_S: 11.6 days a step or
# a message), and links of at least 0.001 bit/s, far outside any network an experiment
# means (a test runs at 1 bit/s), where a message's time stays finite
MIN_GBPS = 1e-12


def check_cost_model(cfg) -> None:
    """`sim.compute_s` or `sim.latency_s` of 1e300 s, or a bandwidth of 1e-300 Gbit/s, ran:
    the virtual times overflowed to inf (summary.json's wall_s null, psgd status of the run
    'not a psgd summary', the report's wall 'inf') or printed as 300-digit numbers. Refused,
    once, before anything runs."""
    from .config import MAX_DELAY_S
    s = cfg.sim   # (one cost model for the whole plan: a --modes item cannot set sim.*)
    for key in ("encode_ns", "decode_ns"):
        if getattr(s, key) > MAX_DELAY_S:
            raise ConfigError(f"sim.{key} must be at most {MAX_DELAY_S:g} ns a value, got {getattr(s, key):g}")
    for key in ("compute_s", "latency_s"):
        if getattr(s, key) > MAX_DELAY_S:
            raise ConfigError(f"sim.{key} must be at most {MAX_DELAY_S:g} s (11.6 virtual days), got "
                              f"{getattr(s, key):g}")
    for key in ("bandwidth_gbps", "apply_gbps"):
        if getattr(s, key) < MIN_GBPS:
            raise ConfigError(f"sim.{key} must be at least {MIN_GBPS:g} Gbit/s (0.001 bit/s), got {getattr(s, key):g}")


def check_data(plan: list) -> None:
    """A dataset that the runs need in memory (training, or a mode's held-out share) but
    is streamed: one error before anything runs, not one failed run each."""
    from .consistency import get as get_mode
    from .sim.run import in_memory
    seen = set()
    for run in plan:
        split = get_mode(run.mode).schedule(run.cfg).data_split
        key = (repr(run.cfg.data), run.cfg.job.seed)
        if (run.cfg.sim.train or split > 0) and key not in seen:
            seen.add(key)
            in_memory(run.cfg, split)


def refuse_unsimulated(cfgs: list[Config]) -> None:
    """Refused before anything runs, in the job's config or a run's: `eval.tensorboard`,
    whose scalars are the coordinator's, on the real clock (it writes them as the
    heartbeats come; a simulation has neither, and wrote nothing); `wire.overlap`, pushes
    that leave during backward (a simulated step's compute is one span of virtual time)."""
    if any(cfg.eval.tensorboard for cfg in cfgs):
        raise ConfigError("eval.tensorboard = true: psgd simulate writes no TensorBoard scalars (they are a real "
                          "job's coordinator's); the runs' summary.json and events/ hold the same numbers")
    if any(cfg.wire.overlap for cfg in cfgs):
        raise ConfigError("wire.overlap = true: psgd simulate does not model pushes that leave while backward "
                          "runs (a simulated step's compute is one span of virtual time); leave it out")


def same_worker_dropped(plan: list) -> str | None:
    """A warning for the runs whose backup workers drop the same worker at every step:
    with no spread in step times (`sim.compute_cv = 0`, no `faults.jitter_*`) the pushes
    of every step reach the shards in the order of the first step's (each shard answers
    in the order they arrived, and equal steps keep that order), so the last
    `mode.backup_workers` to arrive are the same ranks every time, and their partitions
    never train the model. Real runs spread the drops; so does any spread here (jitter
    with `faults.jitter_prob` = 1 is none: it delays every step alike)."""
    runs = dict.fromkeys(run.label for run in plan if run.mode == "sync"   # (the one mode with backup workers)
                         and run.cfg.mode.backup_workers > 0 and run.cfg.sim.compute_cv <= 0
                         and not (0 < run.cfg.faults.jitter_prob < 1 and run.cfg.faults.jitter_s > 0))
    if not runs:
        return None
    return (f"{', '.join(runs)}: mode.backup_workers with no spread in step times (sim.compute_cv = 0, no "
            f"faults.jitter_* with 0 < jitter_prob < 1) drops the same worker(s) at every step, whose partitions "
            f"never train the model (real runs spread the drops); set sim.compute_cv > 0 (e.g. 0.1) for a spread")


# Config keys that nothing in a simulation reads: (a key, or a section's prefix; why)
MEANINGLESS = (
    ("cluster.host", "no sockets: the shards and workers are objects of one process"),
    ("cluster.port", "no sockets: the shards and workers are objects of one process"),
    ("cluster.addresses", "no sockets: the shards and workers are objects of one process"),
    ("security.", "no sockets: the shards and workers are objects of one process"),
    ("cluster.fork", "no processes are started"),
    ("cluster.pin_cpus", "no processes are started"),
    ("cluster.local_lane", "no sockets are opened"),
    ("cluster.spin_us", "no sockets are opened"),
    ("cluster.heartbeat_s", "no heartbeats: a membership change reaches the shards after sim.latency_s"),
    ("checkpoint.", "no checkpoints are written: no shard restarts are simulated"),
    ("faults.on_worker_loss", "no worker is lost: no failures are simulated"),
    ("data.loader_workers", "batches are read in this process"),
    ("data.loader_timeout_s", "batches are read in this process"),
)


def meaningless_sets(sets: list[str], plan: list) -> str | None:
    """A warning naming the keys given with --set (or a --modes item) that nothing in a
    simulation reads: `--set checkpoint.every_s=1` or `--set security.curve=true` ran as
    if not given, without a word, while the report listed them as applied."""
    keys = list(given_sets(sets))
    keys += [config_key(key) for run in plan for key in run.params]
    found: dict[str, list[str]] = {}   # why -> keys
    for key in dict.fromkeys(keys):
        for name, why in MEANINGLESS:
            if key == name or (name.endswith(".") and key.startswith(name)):
                found.setdefault(why, []).append(key)
                break
    if not found:
        return None
    n = sum(map(len, found.values()))
    return ("a simulation reads none of " + "; ".join(f"{', '.join(k)} ({why})" for why, k in found.items())
            + f": setting {'it changes' if n == 1 else 'them changes'} nothing")


def _simulate(args, base, workers: list[int], plan: list, out: str, n: int) -> int:
    """`n`: the training set's size (`cli.check_job`)."""
    from .cli import interrupted_code
    from .compare import batch_over_shares, context, finish, said_if_interrupted, unread_by_every_mode
    from .log import say
    from .sim.run import codec_costs
    cache: dict = {}
    codec_cache: dict = {}
    with said_if_interrupted("psgd simulate"):
        costs = {run.name: compute_cost(run.cfg, args.device, cache) for run in plan}
        codecs = {run.name: codec_costs(run.cfg, codec_cache) for run in plan}
        ctx = context(args, base, workers, plan)
    calibrated = {f"{k[0]} on {k[2]}, batch {k[4]}": v for k, v in cache.items()}
    used = {run.cfg.wire.compression + (f" (topk_fraction {run.cfg.wire.topk_fraction:g})"
                                        if run.cfg.wire.compression == "topk" else ""): list(codecs[run.name])
            for run in plan if run.cfg.wire.compression != "none"}
    ctx["simulated"] = cost_model(base, calibrated, used)
    ctx["machine"]["device"] = args.device
    warnings = [w for w in (same_worker_dropped(plan), batch_over_shares(plan, n), *idle_faults_of(plan),
                            meaningless_sets(args.set, plan), unread_by_every_mode(args.set, plan)) if w]
    if warnings:
        ctx["warnings"] = warnings
    for warning in warnings:
        print(f"psgd simulate: warning: {warning}", file=sys.stderr, flush=True)
    write_json_atomic(os.path.join(out, "compare-context.json"), ctx)
    write_json_atomic(os.path.join(out, "compare.json"), [])
    n = len(plan)
    where = ", ".join(f"{k}: {v * 1e3:.3f} ms" for k, v in calibrated.items())
    print(f"psgd simulate: {n} run{'s' if n != 1 else ''}, out {out}; compute per step: "
          f"{f'{base.sim.compute_s:g} s (sim.compute_s)' if base.sim.compute_s else f'calibrated here, {where}'}"
          f"{codec_said(used, base.sim)}", file=sys.stderr, flush=True)

    entries: dict[int, dict] = {}
    durations: dict[int, float] = {}
    real: dict[str, float] = {}
    failed = 0
    t_start = time.monotonic()
    tasks = [(i, run.cfg, (costs[run.name][0], codecs[run.name]), args.device, os.path.join(out, "runs", run.name),
              f"[{i + 1}/{n}]", run.describe()) for i, run in enumerate(plan)]
    interrupted = 0   # the exit code when a signal ended the plan early
    try:
        with closing(simulated(tasks, args.jobs)) as done:  # closed on leaving early: its processes stop
            for i, result in done:
                failed += _record(plan, i, result, entries, durations, real, out, args.jobs)
    except KeyboardInterrupt as e:
        interrupted = interrupted_code(e)
        say(f"psgd simulate: interrupted after {len(entries)} of {n} runs; writing the report of those")
    results = [entries[k] for k in sorted(entries)]

    ctx["simulated"]["real_s"] = {k: round(v, 2) for k, v in real.items()}
    if len(entries) < n:
        ctx["interrupted"] = True
        ctx["not_run"] = [run.describe() for k, run in enumerate(plan) if k not in entries]
    write_json_atomic(os.path.join(out, "compare.json"), results)
    write_json_atomic(os.path.join(out, "compare-context.json"), ctx)
    return finish("psgd simulate", out, results, ctx, done=len(entries) - failed, n=n, failed=failed,
                  t_start=t_start, interrupted=interrupted)


def _record(plan: list, i: int, result: tuple, entries: dict, durations: dict, real: dict, out: str,
            jobs: int) -> int:
    """Run i's result into compare.json, with a progress line; 1 if it failed."""
    from .compare import _fmt_duration, _one_line
    s, events, error, seconds = result
    n, run = len(plan), plan[i]
    if error is None and s is not None:
        entry = tag(s, run, os.path.join("runs", run.name), float(s["wall_s"]))
        said = _one_line(s) + f", {seconds_said(float(s['wall_s']))} virtual s, {events:,} events"
        if s.get("aborted"):
            error = entry["error"] = s["aborted"]
    else:
        entry = failed_entry(run, error or "no result", simulated=True)
    if error is not None:
        said = f"FAILED: {error.splitlines()[0]}"
    real[run.name] = seconds
    if error is None:   # (a run that failed at once says nothing of how long the others take)
        durations[i] = seconds
    entries[i] = entry
    write_json_atomic(os.path.join(out, "compare.json"), [entries[k] for k in sorted(entries)])
    pending = [k for k in range(n) if k not in entries]
    left = _time_left(plan, durations, pending, jobs)
    eta = "" if not pending else (f"; about {_fmt_duration(left)} left" if left is not None else "")
    print(f"[{i + 1}/{n}] {run.name}: {said} ({seconds:.1f} s real{eta})", file=sys.stderr, flush=True)
    return 0 if error is None else 1


def seconds_said(x: float) -> str:
    """Virtual seconds as a progress line says them: to the millisecond, and to 3
    significant digits below 10 ms (a run of 30 virtual µs was said to take 0.000 s)."""
    return f"{x:.3f}" if x >= 0.01 or x <= 0 else f"{x:.3g}"


def simulate_one(task: tuple) -> tuple[int, tuple[dict | None, int, str | None, float]]:
    """One run of the plan: (its index, (summary, events, error message, real seconds))."""
    from .sim.run import Simulation, progress_line
    i, cfg, cost, device, folder, prefix, describe = task
    print(f"{prefix} {describe} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    shutil.rmtree(folder, ignore_errors=True)   # an earlier plan's run of that name: nothing of it stays
    try:
        compute_s, codec = cost if isinstance(cost, tuple) else (cost, None)   # (codec: measured in `Simulation`)
        sim = Simulation(cfg, compute_s, device, progress_line(prefix), codec_ns=codec)
        return i, (sim.run(folder), sim.loop.events, None, time.monotonic() - t0)
    except Exception as e:  # a deadlock, a bad dataset, a worker's error, a bug: the run failed, the plan goes on
        msg = str(e).strip()
        if not msg or not isinstance(e, (RuntimeError, ConfigError, OSError)):  # name what is not self-explaining
            msg = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
        _remove_if_empty(folder)
        return i, (None, 0, msg, time.monotonic() - t0)
    except BaseException:   # interrupted (Ctrl-C; SIGTERM in a --jobs process): nothing of the run stays (its
        shutil.rmtree(folder, ignore_errors=True)   # logs and summary, if it was writing them when it came)
        raise


def _remove_if_empty(folder: str) -> None:
    """A run that failed or was interrupted removed its event logs (`Simulation.run`):
    its folder, empty, goes too (it stood among the finished runs' folders, where `psgd
    status` took it for a run's and found no config)."""
    try:
        os.rmdir(folder)
    except OSError:
        pass


class _Process:
    """One of `--jobs`' long-lived processes: it runs the tasks it is sent, one after
    another, and answers each with `simulate_one`'s result (see `_serve`)."""

    def __init__(self, ctx: Any, task: tuple, k: int):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), name=f"psgd-simulate-{k}", daemon=True)
        self.task: tuple | None = task   # the task it runs, or will run once it is ready
        self.started = time.monotonic()
        self.sent: float | None = None   # when the task was sent (it was ready)
        self.proc.start()
        child.close()

    def send(self, task: tuple | None) -> None:
        """Hand it a task (None: there is none left, it ends)."""
        self.task, self.sent = task, time.monotonic()
        self.conn.send(task)

    def lost(self) -> tuple[int, tuple]:
        """The result of its task when it ended (killed, out of memory) without answering."""
        self.proc.join(10)
        assert self.task is not None
        return self.task[0], (None, 0, f"its process ended with exit code {self.proc.exitcode} and no result",
                              time.monotonic() - (self.sent or self.started))

    def stop(self) -> None:
        self.conn.close()
        if self.proc.is_alive():
            self.proc.terminate()


def simulated(tasks: list[tuple], jobs: int) -> Generator[tuple[int, tuple], None, None]:
    """`simulate_one` of every task, as each ends: one after the other in this process, or
    (`--jobs` > 1) in `jobs` long-lived spawned processes that each run one task after
    another (a run is one process either way, and its numbers do not depend on where it
    ran, nor on what ran there before). A task is sent to a process once it has started
    (imported torch), and its real seconds are this process's, from sending to answer.
    A process that ends without an answer (killed, out of memory) fails its run, and a
    fresh one takes the next task; leaving early (Ctrl-C, SIGTERM, an error, the
    generator closed) stops the processes still running."""
    if jobs <= 1 or len(tasks) <= 1:
        yield from map(simulate_one, tasks)   # each timed by simulate_one, in this process
        return
    import multiprocessing
    from collections import deque
    from multiprocessing.connection import wait
    ctx = multiprocessing.get_context("spawn")
    waiting = deque(tasks)
    started = 0
    procs: list[_Process] = []    # those running or starting
    ending: list[_Process] = []   # those with nothing more to do
    try:
        while waiting or procs:
            while waiting and len(procs) < jobs:
                procs.append(_Process(ctx, waiting.popleft(), started))
                started += 1
            ready = wait([p.conn for p in procs] + [p.proc.sentinel for p in procs], timeout=5)
            for p in list(procs):
                if p.conn not in ready and p.proc.sentinel not in ready:
                    continue
                try:
                    got = p.conn.recv() if p.conn.poll() else None
                except (EOFError, OSError):
                    got = None
                if got == "ready":   # started: its task goes now
                    try:
                        p.send(p.task)
                        continue
                    except OSError:
                        got = None
                if got is None:      # it ended without answering
                    procs.remove(p)
                    result = p.lost()
                    p.stop()
                    yield result
                    continue
                i, (s, events, error, _) = got
                result = i, (s, events, error, time.monotonic() - (p.sent or p.started))
                following = waiting.popleft() if waiting else None
                try:
                    if not p.proc.is_alive():
                        raise BrokenPipeError
                    p.send(following)
                except OSError:   # it ended after its answer: the next task goes to a fresh process
                    if following is not None:
                        waiting.appendleft(following)
                    p.task = None
                if p.task is None:   # sent None: it ends on its own, while the others run on
                    procs.remove(p)
                    ending.append(p)
                yield result
    finally:
        for p in procs + ending:
            p.stop()
        for p in procs + ending:
            p.proc.join(10)
            if p.proc.is_alive():
                p.proc.kill()
                p.proc.join(10)


def _serve(conn: Any) -> None:
    """A `--jobs` process: says it is ready (torch imported), then runs each task it is
    sent until it is sent None or this process's end of the pipe closes. Ctrl-C is the
    parent's to handle: it stops this process."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The parent stops a process with SIGTERM (Ctrl-C, SIGTERM, an error): its run unwinds
    # and removes the event logs it had written (it died with them, tens of MB at 1,024
    # workers, in the folder of a run the report says did not finish)
    signal.signal(signal.SIGTERM, _stopped)
    from .sim import run  # noqa: F401  (torch and the simulator: the start-up, paid once per process)
    try:
        conn.send("ready")
        while (task := conn.recv()) is not None:
            conn.send(simulate_one(task))
    except (EOFError, OSError):  # the parent is gone
        pass
    finally:   # (a SIGTERM from here on finds no run to unwind: raised in an atexit callback as the
        signal.signal(signal.SIGTERM, signal.SIG_DFL)   # process ends, it printed "Exception ignored ...")
        conn.close()


def _stopped(signum: int, frame: Any) -> None:
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_DFL)   # once: the unwinding is not interrupted again
    raise SystemExit(128 + signum)   # (multiprocessing ends the process with that code, without a traceback)


def worker_steps(run) -> float:
    """A simulated run's size for `estimate_left`: its events, and so its time, grow with
    workers x steps (a time budget: with workers)."""
    return run.workers * max(1, run.cfg.train.steps)


def _time_left(plan: list, durations: dict[int, float], pending: list[int], jobs: int) -> float | None:
    """`estimate_left` for the runs not yet done, `jobs` of them at a time."""
    done = list(durations)
    left = estimate_left([plan[k] for k in done + pending], {j: durations[k] for j, k in enumerate(done)}, len(done),
                         worker_steps)
    return None if left is None else left / max(1, min(jobs, len(pending)))


def cli(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """`python -m psgd.simulate ...`: `psgd simulate ...`, errors and signals handled alike
    (`own_process`: as its process's command; psgd.cli.main)."""
    from .cli import main as psgd_main
    return psgd_main(["simulate", *(sys.argv[1:] if argv is None else argv)], own_process=own_process)


if __name__ == "__main__":
    sys.exit(cli(own_process=True))
