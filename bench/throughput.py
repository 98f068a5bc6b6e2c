"""Training throughput: psgd against torch DDP and against a plain one-process loop.

    .venv/bin/python -m bench.throughput                         # every part, about 3 minutes on 2 cores
    .venv/bin/python -m bench.throughput --parts ddp --repeats 3
    .venv/bin/python -m bench.throughput --parts ddp,local --backend nccl --device cuda --workers 1   # one GPU

Every run: evaluation off (`cluster.evaluator=false`), one compute thread per process
(OMP_NUM_THREADS=1, torch.set_num_threads(1)), the same model (built from the job's
seed), per-worker batch (32), optimizer (psgd's default: SGD lr 0.1, momentum 0.9) and
data (psgd.data: load_dataset, partition by rank, Batches), every process separate.

Parts (`--parts`, default all):
- `ddp`: psgd `sync` (psgd.launcher.run_local: coordinator, `--servers` shards, W
  workers) against torch DDP (`--backend`, gloo by default, its default buckets) in W
  processes: the MLP on digits (`ratio_vs_ddp_small`) and ResNet-20 on synthetic
  3x32x32 data (`ratio_vs_ddp_large`).
- `local`: psgd `sync` with 1 worker and 1 shard against a plain training loop in one
  process (`ratio_vs_local`, MLP); `async`: the same with psgd `async` with prefetch
  (`ratio_async_vs_local`: the next gradient is computed while the push+pull travels)
  and without (`ratio_async_noprefetch_vs_local`: a worker computes, then waits for its
  push+pull). The three share one plain loop per repeat.

`--pin-cpus`: psgd's jobs with `cluster.pin_cpus = true` (each shard and worker on a CPU
of its own, where they fit), and the baseline's rank r on the CPU of psgd's worker r where
psgd's are pinned (not DDP's two ranks against psgd's three processes on two CPUs); the JSON
says `pin_cpus: true`.
Both sides compute with denormal floats flushed to zero (`train.flush_denormal`, psgd's
default; the JSON's `flush_denormal`): unflushed, the plain loop, then timed over at least
a second (about 3,000 MLP steps), ran into the momentum buffer's denormals, which psgd's
600 steps do not reach, and the ratios against it overstated psgd by about a fifth.
`--no-flush-denormal` runs both sides unflushed. `--no-local-lane`: psgd's workers reach
their shard over ZeroMQ only (`cluster.local_lane = false`; the JSON's `local_lane`).
Each ratio: the repeats (`--repeats`, 3) run psgd and its baseline interleaved, and the
ratio is the median of the repeats' own ratios (the baseline's runs are not set apart
from psgd's, so the machine's drifting load hits both alike).
- `overlap`: psgd `sync` of ResNet-20 with 2 shards, its pushes sent after backward and
  from backward's hooks (`wire.overlap`), each against the same DDP runs as `ddp`
  (`ratio_overlap_off`, `ratio_overlap_on`), and `overlap_gain`: the median over repeats
  of the one's samples/s over the other's. The two differ as a user's two jobs do: with
  `wire.overlap` the shard map places whole layers in order (ResNet-20's two shards hold
  499 KB and 598 KB, against 548 KB each balanced).
- `startup`: `psgd run` of the default job (evaluator on, `--device`): seconds from launching the
  command to the end of the first worker step (the earliest `t` in the worker event
  logs) (`startup_s`); also summary.json's own `startup_s` (to the start of training).
- `phases` (with `--device cpu` only): where the time of a psgd MLP `sync` step goes (W
  workers, `--servers` shards), on both ends: worker 0 runs with timers around compute, gather
  (Replica.grads/buffers), encode+send and wait (Peers.send / Peers.wait inside
  ParameterClient.push_pull; of the wait, the time blocked in zmq's poll and in
  wire.decode) and scatter (Replica.load); shard 0 with timers around its blocking poll,
  wire.decode, the push handler (of which validation with the finiteness check, the
  accumulation, the optimizer step), the pull handler (a pull alone), the snapshot (a
  reply's tables: taken for a push that reads, as sync's and async's are, as for a pull),
  wire.encode and the sends. Each as wall time and as the main thread's CPU time
  (time.thread_time: the difference is time spent waiting for a peer or for a core), per
  step (a shard's step: from the end of one optimizer step to the end of the next); the
  other workers and shards are plain processes. Then the same worker-side operations run
  alone in the benchmark's process (no job running): each phase's floor, without other
  processes competing for the cores.

samples/s is steady state for every side, by one definition (bench.common.steady_rate):
the samples all processes completed in the window when every one is past its first
`warm-up` steps (50 MLP, 8 ResNet-20) and none has finished, over the window's length.
Each baseline process runs the steps a psgd worker runs (600 MLP, 40 ResNet-20, times
`--steps-scale`) over the same batches, so both sides are timed over the same steps
(the MLP's 51st to 600th; `--steps-scale` lengthens both alike). (Until 2026-12-06 the plain loop went on for at least a
second, about 3,000 steps, and was timed over all of them: a window of other work than
psgd's, its warm-up a smaller share of it.)
psgd's side reads (t, samples) of each step from the worker event logs; the baselines
record the same pair after each step (after `loss.item()`, as a psgd worker does).
The last line is one JSON object. A part that fails is said on stderr and in the JSON's
`failed` (part: its error), the others still run, and the exit status is 1.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict

from bench.common import (
    Procs,
    child_env,
    child_ignores_ctrl_c,
    emit_json,
    fresh_folder,
    main_of,
    name_list,
    number,
    progress,
    psgd_argv,
    psgd_config,
    reported,
    run_psgd,
    steady_rate,
    table,
    worker_events,
    write_config,
)

MODELS = {  # name -> (config keys, steps per worker, warm-up steps)
    "mlp": (["model.name=mlp", "data.name=digits"], 600, 50),
    "resnet20": (["model.name=resnet20", "data.name=synthetic", "data.shape=[3,32,32]"], 40, 8),
}
# (no shard checkpoints: the baselines write none, and a slow machine's ResNet-20 job wrote one
# inside its timed window)
COMMON = ["cluster.evaluator=false", "train.batch_size=32", "checkpoint.every_s=0"]
PARTS = ("ddp", "local", "async", "overlap", "startup", "phases")
DDP_PARTS = {"ddp", "overlap"}   # the parts that run DDP (their backend is checked, and named in the JSON)
BACKENDS = ("gloo", "nccl")


# ---------------------------------------------------------------- baselines: plain loop and DDP
def train_loop(cfg_dict: dict, rank: int, world: int, steps: int, device: str, ddp: bool) -> list[dict]:
    """A plain PyTorch loop over psgd's data for this rank; (t, samples) after each of
    `steps` steps: the steps, and so the batches, a psgd worker of this rank runs, timed
    over the same ones (a longer run is other work: its warm-up a smaller share, its
    model trained further)."""
    import torch
    from torch import nn

    from psgd.config import Config
    from psgd.data import Batches, load_dataset, partition
    from psgd.models import build_model
    from psgd.optim import denormals_flushed, make_optimizer
    cfg = Config.from_dict(cfg_dict)
    with denormals_flushed(cfg.train.flush_denormal):   # as psgd's workers and shards compute (its config)
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", rank % torch.cuda.device_count())
        ds = load_dataset(cfg.data, cfg.job.seed)
        model = build_model(cfg.model.name, ds.input_shape, ds.num_classes, cfg.job.seed, cfg.model.hidden).to(dev)
        torch.manual_seed(cfg.job.seed * 1000 + rank)
        if ddp:
            model = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
        opt = make_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optimizer)
        part = partition(len(ds.train_y), rank, world, cfg.job.seed)
        batches = Batches(ds.train_x, ds.train_y, part, cfg.train.batch_size, cfg.job.seed, rank)
        model.train()
        rows, samples = [], 0
        for step in range(1, steps + 1):
            x, y = batches.next()
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            opt.zero_grad(set_to_none=False)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            float(loss.item())
            samples += len(y)
            rows.append({"t": time.time(), "step": step, "samples": samples, "rank": rank})
        return rows


def _loop_process(q, cfg_dict, rank, world, steps, device, backend, port, cpus) -> None:
    child_ignores_ctrl_c()
    import torch
    torch.set_num_threads(1)
    if cpus:   # the CPU of psgd's worker of this rank (`--pin-cpus`)
        os.sched_setaffinity(0, {cpus[rank]})
    try:
        if backend:
            import torch.distributed as dist
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            q.put((rank, train_loop(cfg_dict, rank, world, steps, device, ddp=bool(backend))))
        finally:
            if backend:
                dist.destroy_process_group()
    except BaseException as e:
        q.put((rank, f"{type(e).__name__}: {e}"))


def run_loops(sets: list[str], world: int, steps: int, device: str, backend: str | None, warmup: int,
              cpus: list[int] | None = None) -> float:
    """W processes of `train_loop` (DDP when `backend`), spawned, rank r on CPU `cpus[r]`
    where given; steady samples/s."""
    from psgd.launcher import pick_port
    cfg = psgd_config(sets)
    port = pick_port("127.0.0.1", 29500, 1)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_loop_process, args=(q, cfg.to_dict(), r, world, steps, device, backend, port, cpus),
                         daemon=True) for r in range(world)]
    done = False
    try:
        for p in procs:
            p.start()
        runs: dict[int, list[dict]] = {}
        end = time.monotonic() + 900
        while len(runs) < world:
            try:
                rank, rows = q.get(timeout=1)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > end:
                    raise RuntimeError(f"baseline processes: exit codes {dead} (or 900 s passed)") from None
                continue
            if isinstance(rows, str):
                raise RuntimeError(f"baseline rank {rank}: {rows}")
            runs[rank] = rows
        done = True
        return steady_rate(runs, warmup)
    finally:   # every rank has sent its rows (they end by themselves), or the benchmark is stopped or failed
        for p in procs:   # (a rank still training, or waiting for a failed peer, is not waited for)
            p.join(timeout=10 if done else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


# ---------------------------------------------------------------- psgd sides
def psgd_rate(sets: list[str], work: str, name: str, warmup: int, device: str) -> float:
    return run_psgd(sets, fresh_folder(os.path.join(work, name)), warmup, device=device)["steady"]


def startup(work: str, device: str) -> tuple[float, float, float | None]:
    """(seconds from launching `psgd run` to the end of the first worker step, the whole
    command, summary.json's own `startup_s` (to the start of training) if it has one)."""
    out = fresh_folder(os.path.join(work, "startup"))
    exe = os.path.join(os.path.dirname(sys.executable), "psgd")
    argv = [exe] if os.path.exists(exe) else [sys.executable, "-m", "psgd"]
    # The command a user types, on this checkout's psgd: the environment's `psgd` is an
    # install's, maybe of another checkout (an editable one), which the daemons' PYTHONPATH
    # (`child_env`) did not reach: the launcher was another tree's, and the JSON's commit this one's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}
    env["PYTHONPATH"] = child_env()["PYTHONPATH"]
    with Procs(os.path.join(work, "startup-logs")) as procs:
        t0 = time.time()
        procs.start("run", argv + ["run", "--out", out, "--quiet", "--device", device], env=env)
        rc = procs.wait("run", 300)
        t1 = time.time()
        if rc != 0:
            raise RuntimeError(f"psgd run exited with {rc}:\n{procs.tail('run')}")
    first = min(rows[0]["t"] for rows in worker_events(out).values())
    with open(os.path.join(out, "summary.json")) as f:
        own = json.load(f).get("startup_s")
    return first - t0, t1 - t0, own


def phases(work: str, workers: int, servers: int, steps: int, warmup: int) -> dict:
    """A psgd MLP sync job with timers in worker 0 and shard 0 (see `profiled`)."""
    out = fresh_folder(os.path.join(work, "phases"))
    cfg = psgd_config(MODELS["mlp"][0] + COMMON + ["mode.name=sync", f"cluster.workers={workers}",
                                                   f"cluster.servers={servers}", f"train.steps={steps}"])
    path = write_config(cfg, out)
    dumps = {role: os.path.join(out, f"phases-{role}-0.json") for role in ("worker", "server")}

    def argv(role: str, *extra: str) -> list[str]:
        if extra[1] != "0":  # not the one with timers
            return psgd_argv(role, path, out, *extra)
        return [sys.executable, "-m", "bench.throughput", "--profiled", role, dumps[role], str(warmup),
                *psgd_argv(role, path, out, *extra)[3:]]
    with Procs(os.path.join(out, "logs")) as procs:
        procs.start("coordinator", psgd_argv("coordinator", path, out))
        for i in range(servers):
            procs.start(f"server-{i}", argv("server", "--shard", str(i)))
        for r in range(workers):
            procs.start(f"worker-{r}", argv("worker", "--rank", str(r), "--device", "cpu"))
        procs.wait("coordinator", 300)
        procs.wait("worker-0", 30)
        procs.wait("server-0", 30)
    got = {}
    for role, dump in dumps.items():
        with open(dump) as f:
            got[role] = json.load(f)
    runs = worker_events(out)
    waits = [e["wait_s"] for rows in runs.values() for e in rows[warmup:]]
    got["events_wait_ms"] = 1e3 * statistics.mean(waits)
    got["events_step_ms"] = 1e3 * statistics.mean(
        (rows[-1]["t"] - rows[warmup - 1]["t"]) / (len(rows) - warmup) for rows in runs.values())
    return got


def phases_alone(servers: int, reps: int = 500) -> dict:
    """The same operations of one MLP step, timed in this process alone (no job running):
    the floor for each phase. ms per step (all shards)."""
    import torch
    from torch import nn

    from psgd import wire
    from psgd.data import Batches, load_dataset, partition
    from psgd.models import build_model
    from psgd.replica import Replica
    cfg = psgd_config(MODELS["mlp"][0] + COMMON)
    ds = load_dataset(cfg.data, cfg.job.seed)
    model = build_model(cfg.model.name, ds.input_shape, ds.num_classes, cfg.job.seed, cfg.model.hidden)
    rep = Replica(model, servers, torch.device("cpu"))
    batches = Batches(ds.train_x, ds.train_y, partition(len(ds.train_y), 0, 1, 0), cfg.train.batch_size, 0, 0)
    grads, bufs = rep.grads(), rep.buffers()
    params = [p.clone() for p in rep.params()]
    replies = [[bytes(f) for f in wire.encode("reply", id=1, arrays=[params[i], bufs[i]], version=1)]
               for i in range(servers)]

    def compute():
        x, y = batches.next()
        model.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()

    def encode():   # one request per shard, a push that reads (workers/client.py begin_push_pull)
        for i in range(servers):
            wire.encode("push", id=1, rank=0, clock=1, arrays=[grads[i], bufs[i]], read_version=0, pull=True)

    ops = {"compute": compute, "gather": lambda: (rep.grads(), rep.buffers()), "encode": encode,
           "decode": lambda: [wire.decode(r) for r in replies], "scatter": lambda: rep.load(params, bufs)}
    out = {}
    for name, fn in ops.items():
        for _ in range(50):
            fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        out[name] = 1e3 * (time.perf_counter() - t) / reps
    return out


# (owner, attribute, phase) timed in a profiled worker / shard; the first one marks the end of a step
WORKER_TIMERS = (("psgd.consistency.pushpull:PushPullSchedule", "step", "step"),
                 ("psgd.workers.worker:Worker", "compute", "compute"),
                 ("psgd.replica:Replica", "grads", "gather"), ("psgd.replica:Replica", "buffers", "gather"),
                 ("psgd.workers.client:ParameterClient", "push_pull", "push_pull"),
                 ("psgd.transport:Peers", "send", "encode+send"), ("psgd.transport:Peers", "wait", "wait+decode"),
                 ("zmq:Poller", "poll", "poll"), ("psgd.wire", "decode", "decode"),
                 ("psgd.replica:Replica", "load", "scatter"))
SERVER_TIMERS = (("psgd.shard:Shard", "_step", "optimizer"),
                 ("zmq:Poller", "poll", "poll"), ("psgd.wire", "decode", "decode"),
                 ("psgd.shard:Shard", "on_push", "push"), ("psgd.shard:Shard", "_vectors", "validate"),
                 ("psgd.shard:Shard", "_accumulate", "accumulate"),
                 ("psgd.shard:Shard", "on_pull", "pull"), ("psgd.shard:Shard", "_snapshot", "snapshot"),
                 ("psgd.wire", "encode_with", "encode"), ("psgd.transport:Service", "send", "send"))


def profiled(role: str, dump: str, warmup: int, argv: list[str]) -> int:
    """`psgd worker` or `psgd server` with timers around the phases of a step (its main
    thread only: not the heartbeats); writes each phase's mean wall and CPU ms per step,
    over the steps after the first `warmup`, to `dump`. Nested phases count in both."""
    import importlib
    import threading

    from psgd.cli import main as psgd_main
    timers = WORKER_TIMERS if role == "worker" else SERVER_TIMERS
    mark = timers[0][2]
    total: dict[str, float] = defaultdict(float)   # phase (and phase@cpu) -> seconds so far
    ends: list[dict] = []                          # `total` and the time at the end of each step
    main = threading.main_thread()

    def timed(owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            if threading.current_thread() is not main:
                return fn(*a, **k)
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                now = time.perf_counter()
                total[phase] += now - t
                total[phase + "@cpu"] += time.thread_time() - c
                if phase == mark:
                    ends.append(dict(total, at=now))
        setattr(owner, name, wrapper)

    for where, name, phase in timers:
        module, _, cls = where.partition(":")
        owner = importlib.import_module(module)
        timed(getattr(owner, cls) if cls else owner, name, phase)
    try:
        return psgd_main(argv)
    finally:
        first, last = ends[min(warmup, len(ends) - 1)], ends[-1]
        n = max(1, len(ends) - 1 - min(warmup, len(ends) - 1))
        names = {phase for _, _, phase in timers}
        with open(dump, "w") as f:
            json.dump({"steps": n, "step_ms": 1e3 * (last["at"] - first["at"]) / n,
                       "ms": {k: 1e3 * (last.get(k, 0.0) - first.get(k, 0.0)) / n for k in names},
                       "cpu_ms": {k: 1e3 * (last.get(k + "@cpu", 0.0) - first.get(k + "@cpu", 0.0)) / n
                                  for k in names}}, f)


def print_phases(ph: dict, workers: int, servers: int) -> None:
    nan = float("nan")
    w, s, alone = ph["worker"], ph["server"], ph["alone"]
    rows = [["compute", "compute", alone["compute"]], ["gather", "gather", alone["gather"]],
            ["send/wait (push_pull)", "push_pull", nan], ["  of which encode+send", "encode+send", alone["encode"]],
            ["  of which wait+decode", "wait+decode", nan], ["    of which blocked in poll", "poll", nan],
            ["    of which decode", "decode", alone["decode"]], ["scatter", "scatter", alone["scatter"]],
            ["other (log, bookkeeping)", None, nan], ["step", "step", nan]]

    def get(d: dict, k: str | None) -> float:  # None: what the other phases leave of the step
        return d[k] if k else d["step"] - d["compute"] - d["gather"] - d["push_pull"] - d["scatter"]
    print()
    print(table(["phase (worker 0)", "wall ms/step", "% of step", "CPU ms/step", "alone ms (floor)"],
                [[name, get(w["ms"], k), 100 * get(w["ms"], k) / w["ms"]["step"], get(w["cpu_ms"], k), floor]
                 for name, k, floor in rows],
                f"MLP sync step, W={workers} S={servers}, mean of {w['steps']} steps after warm-up; "
                f"event log: wait_s {ph['events_wait_ms']:.3f} ms, step {ph['events_step_ms']:.3f} ms"))
    rows = [["blocked in poll (waiting for a request)", "poll"], ["decode", "decode"], ["push handler", "push"],
            ["  of which validation (finite check)", "validate"], ["  of which accumulate", "accumulate"],
            ["  of which optimizer step", "optimizer"], ["pull handler (a pull alone)", "pull"],
            ["snapshot (a reply's tables, a push's or a pull's)", "snapshot"],
            ["encode (replies)", "encode"], ["send", "send"]]
    print()
    print(table(["phase (shard 0)", "wall ms/step", "% of step", "CPU ms/step"],
                [[name, s["ms"][k], 100 * s["ms"][k] / s["step_ms"], s["cpu_ms"][k]] for name, k in rows]
                + [["step (one optimizer step to the next)", s["step_ms"], 100.0, nan]],
                f"the same steps on shard 0, mean of {s['steps']}"))


# ---------------------------------------------------------------- main
def check_device_and_backend(ap: argparse.ArgumentParser, a: argparse.Namespace, parts: set[str]) -> None:
    """--device and, where the DDP part runs, --backend: a usage error before anything
    starts, not a part that fails after the others' minutes of runs."""
    import torch
    kind, _, index = a.device.partition(":")
    if a.device != "cpu":
        if kind != "cuda" or not (index == "" or index.isdigit()):
            ap.error(f"--device must be cpu, cuda or cuda:N, got {a.device!r}")
        if not torch.cuda.is_available():
            ap.error(f"--device {a.device}: no CUDA device visible to torch {torch.__version__} "
                     f"(cuda build: {torch.version.cuda})")
        n = torch.cuda.device_count()
        if index and int(index) >= n:
            ap.error(f"--device {a.device}: torch sees {n} CUDA device{'s' if n != 1 else ''} here "
                     f"(cuda:0{f' to cuda:{n - 1}' if n > 1 else ''})")
    if "phases" in parts and a.device != "cpu":   # its workers, and the floor it measures alone, run on the CPU
        ap.error(f"--parts phases times a step on the CPU only: leave it out with --device {a.device}")
    if not parts & DDP_PARTS:
        return
    import torch.distributed as dist
    if not dist.is_available() or not getattr(dist, f"is_{a.backend}_available")():
        ap.error(f"--backend {a.backend}: torch {torch.__version__} here has no {a.backend} backend")
    if a.backend == "nccl":
        if a.device == "cpu":
            ap.error("--backend nccl runs on GPUs: give --device cuda")
        gpus = 1 if index else torch.cuda.device_count()
        if a.workers > gpus:
            ap.error(f"--backend nccl takes a GPU per DDP rank: --workers {a.workers} on {gpus} GPU(s) "
                     f"(--workers {gpus}, or --backend gloo)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--profiled":
        raise SystemExit(profiled(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", type=name_list(PARTS),
                    help=f"some of {','.join(PARTS)} (default: all; all but phases with a GPU --device)")
    ap.add_argument("--workers", type=number(int, 1), default=2, help="W for the DDP comparison and the phases")
    ap.add_argument("--servers", type=number(int, 1), default=1,
                    help="psgd shards in the DDP comparison and the phases")
    ap.add_argument("--backend", choices=BACKENDS, default="gloo", help="DDP backend (nccl with --device cuda)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N: psgd's workers and the baselines")
    ap.add_argument("--models", type=name_list(MODELS), default="mlp,resnet20",
                    help="models of the DDP comparison: mlp, resnet20")
    ap.add_argument("--repeats", type=number(int, 1), default=3,
                    help="interleaved repeats of each side (ratios: the median of the repeats' ratios)")
    ap.add_argument("--steps-scale", type=number(float, 0, above=True), default=1.0,
                    help="multiply every run's steps")
    ap.add_argument("--pin-cpus", action="store_true",
                    help="psgd with cluster.pin_cpus = true, and each baseline process on a CPU of its own too")
    ap.add_argument("--no-flush-denormal", dest="flush_denormal", action="store_false",
                    help="psgd and the baselines with train.flush_denormal = false (denormal floats computed on)")
    ap.add_argument("--no-local-lane", dest="local_lane", action="store_false",
                    help="psgd with cluster.local_lane = false (its workers reach the shards over ZeroMQ only)")
    ap.add_argument("--keep", help="keep the runs' folders here")
    a = ap.parse_args()
    parts = set(a.parts or [p for p in PARTS if p != "phases" or a.device == "cpu"])
    used = ((set(a.models) if "ddp" in parts else set()) | ({"mlp"} if parts & {"local", "async", "phases"} else set())
            | ({"resnet20"} if "overlap" in parts else set()))
    for model in sorted(used):
        steps, warm = MODELS[model][1:]
        if int(steps * a.steps_scale) < warm + 2:
            ap.error(f"--steps-scale {a.steps_scale:g} leaves {model} {int(steps * a.steps_scale)} steps, fewer "
                     f"than its {warm} warm-up steps + 2")
    check_device_and_backend(ap, a, parts)
    from bench.common import stop_on_signals
    stop_on_signals()
    os.environ.update({k: v for k, v in child_env().items() if k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")})
    if a.device == "cpu":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    torch.set_num_threads(1)
    work = a.keep or tempfile.mkdtemp(prefix="bench-throughput-")
    # (DDP's backend and worker count only where the DDP part runs: the local parts are W = 1
    # against one process, and a GPU run's JSON of those named gloo and 2 workers)
    ddp = {"backend": a.backend, "workers": a.workers} if parts & DDP_PARTS else {}
    # (and the other flags only where a part reads them: `--parts startup`'s named two models and 3 repeats)
    rows, result = [], {"bench": "throughput", "device": a.device, **ddp,
                        **({"servers": a.servers} if parts & {"ddp", "phases"} else {}),
                        **({"models": ",".join(a.models)} if "ddp" in parts else {}),
                        **({"repeats": a.repeats} if parts & {"ddp", "local", "async", "overlap"} else {}),
                        "steps_scale": a.steps_scale, "flush_denormal": a.flush_denormal,
                        "local_lane": a.local_lane}
    t_start = time.monotonic()

    if a.pin_cpus:
        result["pin_cpus"] = True
    from psgd.launcher import cpu_places

    def steps_of(model: str) -> tuple[list[str], int, int]:
        keys, steps, warm = MODELS[model]
        extra = ["cluster.pin_cpus=true"] if a.pin_cpus else []
        extra += [] if a.flush_denormal else ["train.flush_denormal=false"]
        extra += [] if a.local_lane else ["cluster.local_lane=false"]
        return keys + COMMON + extra + [f"train.steps={int(steps * a.steps_scale)}"], int(steps * a.steps_scale), warm

    def paired(model: str, world: int, backend: str | None, base_label: str,
               variants: list[tuple[str, str, list[str]]]) -> dict[str, list[float]]:
        """psgd `variants` (key, label, sets) against one baseline, interleaved: each
        repeat runs the baseline and every variant once (the baseline first in even
        repeats, last in odd ones; the variants in turn the other way round), and a
        ratio is the median over repeats of psgd's rate over that repeat's baseline rate
        (the machine's load drifts between runs; a baseline run apart from its psgd run
        measured another machine). Each variant's samples/s, repeat by repeat."""
        sets, steps, warm = steps_of(model)
        base_runs, ours_runs = [], {key: [] for key, _, _ in variants}
        # (the baseline's rank r on the CPU of psgd's worker r: `--pin-cpus`; a review: it took the
        # r-th CPU of the order, where psgd's shards go first: the shard's CPU)
        places = [cpu_places(psgd_config(sets + v))[0] for _, _, v in variants] if a.pin_cpus else []
        if a.pin_cpus:   # (`pin_cpus` says it was asked; psgd pins a job only where each process gets a CPU)
            result.setdefault("pinned", {}).update({key: bool(p) for (key, _, _), p in zip(variants, places,
                                                                                             strict=True)})
        pin = ([places[0][f"worker-{r}"] for r in range(world)]
               if places and all(places) and all(p == places[0] for p in places) else None)

        def baseline() -> None:
            progress(f"{base_label} (repeat {i + 1}/{a.repeats}, {time.monotonic() - t_start:.0f} s so far)")
            base_runs.append(run_loops(sets, world, steps, a.device, backend, warm, pin))

        for i in range(a.repeats):
            if i % 2 == 0:
                baseline()
            for key, label, psgd_sets in variants if i % 2 == 0 else variants[::-1]:
                progress(f"psgd {label} (repeat {i + 1}/{a.repeats}, {time.monotonic() - t_start:.0f} s so far)")
                ours_runs[key].append(psgd_rate(sets + psgd_sets, work, key, warm, a.device))
            if i % 2 == 1:
                baseline()
        base = statistics.median(base_runs)
        for key, label, _ in variants:
            ours = statistics.median(ours_runs[key])
            ratio = statistics.median(o / b for o, b in zip(ours_runs[key], base_runs, strict=True))
            rows.append([label, f"{ours:,.0f}", base_label, f"{base:,.0f}", ratio])
            result[f"psgd_{key}"], result[f"base_{key}"] = round(ours, 1), round(base, 1)
            result[f"ratio_{key}"] = round(ratio, 4)
        return ours_runs

    failed: dict[str, str] = {}

    def part(name: str) -> contextlib.AbstractContextManager[None]:
        return reported(name, lambda error: failed.__setitem__(name, error))

    try:
        if "ddp" in parts:
            w, s = a.workers, a.servers
            for model in a.models:
                name = "small" if model == "mlp" else "large"
                with part(f"ddp {model}"):
                    paired(model, w, a.backend, f"DDP {a.backend} W={w}",
                           [(f"vs_ddp_{name}", f"{model} sync W={w} S={s}",
                             ["mode.name=sync", f"cluster.workers={w}", f"cluster.servers={s}"])])
        one = ["cluster.workers=1", "cluster.servers=1"]
        local = ([("vs_local", "mlp sync W=1 S=1", ["mode.name=sync", *one])] if "local" in parts else [])
        if "async" in parts:   # the goal's figure is with prefetch; without it, beside it
            local += [("async_vs_local", "mlp async W=1 S=1 mode.prefetch=true",
                       ["mode.name=async", *one, "mode.prefetch=true"]),
                      ("async_noprefetch_vs_local", "mlp async W=1 S=1 mode.prefetch=false",
                       ["mode.name=async", *one, "mode.prefetch=false"])]
        if local:   # one plain loop, shared by the three
            with part(",".join(p for p in ("local", "async") if p in parts)):
                paired("mlp", 1, None, "plain loop", local)
        if "overlap" in parts:
            w, job = a.workers, ["mode.name=sync", f"cluster.workers={a.workers}", "cluster.servers=2"]
            with part("overlap"):
                runs = paired("resnet20", w, a.backend, f"DDP {a.backend} W={w}",
                              [("overlap_off", f"resnet20 sync W={w} S=2", [*job, "wire.overlap=false"]),
                               ("overlap_on", f"resnet20 sync W={w} S=2 wire.overlap=true",
                                [*job, "wire.overlap=true"])])
                off, on = runs["overlap_off"], runs["overlap_on"]
                result["overlap_gain"] = round(statistics.median(b / a_ for a_, b in zip(off, on, strict=True)), 4)
        if "startup" in parts:
            progress("startup: psgd run (default job)")
            with part("startup"):
                first, whole, own = startup(work, a.device)
                result["startup_s"], result["default_job_wall_s"] = round(first, 2), round(whole, 2)
                result["summary_startup_s"] = own
        if "phases" in parts:
            progress("phases: an instrumented MLP sync step")
            _, steps, warm = steps_of("mlp")
            with part("phases"):
                got = phases(work, a.workers, a.servers, steps, warm)
                got["alone"] = phases_alone(a.servers)
                result["phases_ms"] = got
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    if rows:
        print(table(["psgd run", "psgd samples/s", "baseline", "baseline samples/s", "psgd/baseline"], rows,
                    f"steady-state samples/s (medians of {a.repeats} interleaved repeats; psgd/baseline: the median of "
                    f"the repeats' ratios; device {a.device}; batch 32 per worker)"))
    if "startup_s" in result:
        own = result["summary_startup_s"]
        print(f"\nstartup: `psgd run` (default job) to the end of the first worker step: {result['startup_s']:.2f} s "
              f"(whole command {result['default_job_wall_s']:.1f} s"
              + (f"; summary.json's startup_s, to the start of training: {own:.2f} s)" if own is not None else ")"))
    if "phases_ms" in result:
        print_phases(result["phases_ms"], a.workers, a.servers)
    if failed:
        print("\nfailed (not measured): " + "; ".join(failed), flush=True)
        result["failed"] = failed
    emit_json(result)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main_of(main)
