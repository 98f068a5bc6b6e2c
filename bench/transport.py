"""Transport: psgd's push+pull against raw pyzmq moving the same bytes the same way.

    .venv/bin/python -m bench.transport                       # the default run: a few minutes on 2 cores
    .venv/bin/python -m bench.transport --sizes 16M --shards 1 --workers 1 --repeats 5

For each table size (the whole model: 64 KiB, 1 MiB, 16 MiB, 100 MiB, split over the
shards), shard count (1, 2, 4) and worker count (1, 4), both sides run W client
processes (the same processes) against S server processes on tcp loopback, all up at
once; the two sides' timed sections (`--seconds` each, `--repeats` per side) take turns,
and which of a pair goes first alternates, so that a drift of the machine's speed moves
both sides alike (a side not being timed waits in poll):

- psgd: each client registers as a worker with a `psgd coordinator` process
  (`CoordinatorLink.register`, heartbeats on) and calls `ParameterClient.push_pull` in
  a loop against S `psgd server` processes: per shard one request, a push that also
  reads (header, gradient slice, empty buffers), on the shard's DEALER, all shards at
  once, and one reply (header, the shard's slice); one round trip per step. Mode
  `async` (a push is applied on arrival, a pull never waits: no barrier couples the
  workers), optimizer SGD without momentum; the shard validates the message, checks
  the gradient is finite, steps the optimizer and answers with its table.
- raw: one DEALER per shard in each client against a ROUTER in an echo-server process
  per shard (`python -m bench.transport --echo PORT BYTES`): per shard one message
  (small header frame + the shard's slice of the table), answered with one message (a
  small header frame + the shard's slice, a preallocated buffer). copy=False
  everywhere, with psgd's sockets' copy threshold (frames below 256 KiB are copied at
  send) and psgd's receive loop (no zmq.Again raised to end a drain); one round trip
  per step. (Before, the raw side had pyzmq's defaults, a 64 KiB frame going zero-copy,
  which made its round trip about a fifth slower than it need be: a flattering baseline.)

psgd runs with `cluster.local_lane = false`: both sides move the bytes over ZeroMQ (psgd's
same-host lane, a Unix socket, is measured in bench/throughput.py against psgd without
it: `--no-local-lane`).

Bytes are counted identically: a step moves 2 x the table size of payload (push +
pull); throughput = W x steps x that / (last client's end - common start). The table
also shows each side's wire bytes per step, every frame counted as psgd's `Peers`
counts them (headers included), as a check that both move the same bytes. The
round-trip time is the median step time of one client. Each psgd row also gives the
shards' own CPU time per push in psgd's timed sections (`shard_busy_ms`, from their
`busy_s` and `pushes` counters read before and after each section: decoding,
validation, the finiteness check, the optimizer's update and the reply's hand-off) and,
with one worker, the `ceiling` raw / (raw + that): the worker waits for the shard's work
every step, so psgd/raw cannot be much above it unless that work gets cheaper (an
estimate, not a bound: the shard's work and the raw side's echo need not add up
exactly). A psgd/raw above 1 (psgd doing more work, faster) says the machine's speed
changed within a pair of sections: the benchmark says so. The
last line is one JSON object: `ratio` (psgd / raw throughput at 16 MiB, 1 worker, 1
shard), `latency_ratio` (psgd / raw round trip at 64 KiB, 1 worker, 1 shard), each the
median over the pairs of sections of that pair's ratio (since 2026-12-05; before, the
median psgd section over the median raw one),
`ratio_ceiling` (the ceiling of `ratio`) and every measured row.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np
import zmq

from bench.common import (
    Procs,
    child_env,
    child_ignores_ctrl_c,
    emit_json,
    fresh_folder,
    int_list,
    main_of,
    number,
    progress,
    psgd_config,
    start_daemons,
    stop_on_signals,
    table,
)
from psgd.transport import COPY_THRESHOLD, readable

PUSH, DATA = b"push", b"data"
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


MAX_SIZE = 1 << 36   # 64 GiB: a table's bytes, each way (a size past it was an OverflowError's traceback, or psgd's)


def parse_size(text: str) -> int:
    raw = text
    text = text.strip().upper().rstrip("B").rstrip("I")
    try:
        n = int(float(text[:-1]) * UNITS[text[-1]]) if text[-1:] in UNITS else int(text)
    except (ValueError, OverflowError):   # (OverflowError: infK, 1e400K)
        raise argparse.ArgumentTypeError(f"a size is bytes or a number with K, M or G (e.g. 64K, 16M), "
                                         f"got {raw!r}") from None
    if n < 8:
        raise argparse.ArgumentTypeError(f"a table size must be at least 8 bytes, got {raw!r}")
    if n > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"a table size must be at most 64G, got {raw!r}")
    return n - n % 8  # a whole number of float32 pairs


def size_list(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",")]


def label(n: int) -> str:
    """A size in the table's words: 64 KiB, 1.5 MiB, 800 B (not "0 KiB" for every size below one)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} B"


def digits(x: float) -> float:
    """A figure for the JSON: 4 decimals, or 4 significant digits below 1 (a tiny table's
    4.03e-05 GB/s was written 0.0)."""
    return round(x, 4) if abs(x) >= 1 else float(f"{x:.4g}")


# ---------------------------------------------------------------- the raw echo server (its own process)
def echo_server(port: int, nbytes: int) -> None:
    child_ignores_ctrl_c()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.copy_threshold = COPY_THRESHOLD   # as psgd's sockets: frames below it are copied at send
    sock.bind(f"tcp://127.0.0.1:{port}")
    payload = np.zeros(nbytes // 4, np.float32)
    parent = os.getppid()
    print(f"echo serving {nbytes} bytes on {port}", flush=True)
    while True:
        if not sock.poll(1000):
            if os.getppid() != parent:
                return  # the benchmark is gone
            continue
        while readable(sock):   # as psgd's serve loop: no zmq.Again raised to end a drain
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            sock.send_multipart([frames[0], DATA, payload], copy=False)


# ---------------------------------------------------------------- one client process, either side
class PsgdSide:
    def __init__(self, cfg_dict: dict, rank: int):
        import torch

        from psgd.config import Config
        from psgd.membership import CoordinatorLink
        from psgd.models import build_model
        from psgd.replica import Replica
        from psgd.sharding import model_layout
        from psgd.workers.client import ParameterClient
        cfg = Config.from_dict(cfg_dict)
        self.ctx = zmq.Context()
        self.rank, self.clock = rank, 0
        # The table is not one of psgd's own models: the shards learn its layout from the
        # workers' registration and its values from rank 0 (psgd/layout.py), as a worker's.
        # Built from data.shape, not from a dataset: 64 synthetic samples of 16 MiB's
        # table took 19 s and 2.9 GB a client, and 4 of them on a busy machine outlasted
        # the coordinator's wait for its workers (cluster.timeout_s).
        model = build_model(cfg.model.name, tuple(cfg.data.shape), cfg.data.classes, cfg.job.seed)
        self.link = CoordinatorLink(cfg, "worker", rank, self.ctx)
        self.link.register(rank, layout=model_layout(model))
        self.link.clock_fn = lambda: self.clock
        self.link.start()
        self.client = ParameterClient(cfg, self.ctx, rank)
        replica = Replica(model, cfg.cluster.servers, torch.device("cpu"))
        self.client.init((replica.params(), replica.buffers()) if rank == 0 else None)
        answers = self.client.join(0)
        params, buffers = ParameterClient.tables(answers)
        self.grads = [torch.zeros_like(p) for p in params]
        self.buffers = [torch.zeros_like(b) for b in buffers]
        self.versions = [int(m.get("version", 0)) for m in answers]
        self.shard_bytes = [4 * g.numel() for g in self.grads]

    def step(self) -> None:
        _, pulled = self.client.push_pull(self.clock, self.grads, self.buffers, self.versions)
        self.versions = [int(m.get("version", 0)) for m in pulled]
        self.clock += 1

    def traffic(self) -> int:
        return self.client.bytes_sent + self.client.bytes_recv

    def retries(self) -> int:
        return self.client.retries  # requests sent again after no answer within the retry window

    def close(self) -> None:
        try:
            self.link.call("finish", rank=self.rank, clock=self.clock, stats={"samples": 0}, timeout=10)
        finally:
            self.link.close()
            self.client.close()
            self.ctx.destroy(linger=0)


class RawSide:
    def __init__(self, addresses: list[str], shard_bytes: list[int]):
        self.ctx = zmq.Context()
        self.socks = []
        self.poller = zmq.Poller()
        for a in addresses:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.copy_threshold = COPY_THRESHOLD
            s.connect(a)
            self.socks.append(s)
            self.poller.register(s, zmq.POLLIN)
        self.payload = [np.zeros(n // 4, np.float32) for n in shard_bytes]
        self.shard_bytes = shard_bytes
        self.sent = self.recv = 0

    def step(self) -> None:
        for s, p in zip(self.socks, self.payload, strict=True):
            s.send_multipart([PUSH, p], copy=False)
            self.sent += len(PUSH) + p.nbytes
        pending = len(self.socks)
        deadline = time.monotonic() + 60
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError("an echo server did not answer within 60 s")
            for sock, _ in self.poller.poll(1000):
                while readable(sock):
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    self.recv += sum(len(f.buffer) for f in frames)
                    pending -= 1

    def traffic(self) -> int:
        return self.sent + self.recv

    def retries(self) -> int:
        return 0

    def close(self) -> None:
        for s in self.socks:
            s.close(0)
        self.ctx.destroy(linger=0)


def client_main(conn, index: int) -> None:
    child_ignores_ctrl_c()
    import torch
    torch.set_num_threads(1)
    sides: dict[str, PsgdSide | RawSide] = {}
    while True:
        try:
            cmd, *args = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        try:
            result: object = None
            if cmd == "exit":
                return
            if cmd == "psgd":
                sides["psgd"] = PsgdSide(*args)
                result = sides["psgd"].shard_bytes
            elif cmd == "raw":
                sides["raw"] = RawSide(*args)
            elif cmd == "warm":
                name, n = args
                for _ in range(n):
                    sides[name].step()
            elif cmd == "timed":   # steps until `seconds` after t_go (at least MIN_STEPS)
                name, seconds, t_go = args
                side = sides[name]
                while time.time() < t_go:
                    time.sleep(0.001)
                b0, r0, times = side.traffic(), side.retries(), []
                t0 = time.time()
                while len(times) < MIN_STEPS or time.time() < t_go + seconds:
                    s = time.perf_counter()
                    side.step()
                    times.append(time.perf_counter() - s)
                result = {"t0": t0, "t1": time.time(), "steps": len(times), "median_s": statistics.median(times),
                          "wire": side.traffic() - b0, "retries": side.retries() - r0}
            elif cmd == "close":
                for side in sides.values():
                    side.close()
                sides = {}
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", f"client {index}: {traceback.format_exc()}"))


class Pool:
    """W persistent client processes driven over pipes."""

    def __init__(self, n: int):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=client_main, args=(child, i), daemon=True, name=f"bench-client-{i}")
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def ask(self, msgs: dict[int, tuple], timeout: float = 300) -> dict[int, object]:
        for i, m in msgs.items():
            self.conns[i].send(m)
        out = {}
        end = time.monotonic() + timeout
        for i in msgs:
            if not self.conns[i].poll(max(0.0, end - time.monotonic())):
                raise TimeoutError(f"client {i} did not answer {msgs[i][0]!r} within {timeout:.0f} s")
            status, result = self.conns[i].recv()
            if status != "ok":
                raise RuntimeError(result)
            out[i] = result
        return out

    def all(self, *msg) -> dict[int, object]:
        return self.ask({i: msg for i in range(len(self.conns))})

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("exit",))
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


# ---------------------------------------------------------------- the benchmark
MIN_STEPS = 3   # per client and timed section, however long a step takes


def wait_for(procs: Procs, names: list[str], text: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    for name in names:
        while text not in procs.tail(name, 50):
            procs.check()
            if time.monotonic() > end:
                raise TimeoutError(f"{name} did not say {text!r} within {timeout:.0f} s:\n{procs.tail(name)}")
            time.sleep(0.05)


def measure(pool: Pool, workers: list[int], size: int, repeats: int, seconds: float,
            shards_busy) -> dict[int, dict[str, dict]]:
    """For each worker count: warm up both sides, then `repeats` pairs of timed sections
    of `seconds` each, psgd's and the raw side's in turn (which goes first alternates, so
    that a drift of the machine's speed during a pair moves both sides alike). Per side,
    the median section; for psgd also the shards' CPU time per push over its timed
    sections alone (`shards_busy()`: (busy_s, pushes) per shard, read between sections)."""
    out = {}
    for w in workers:
        active = range(w)
        for name in ("psgd", "raw"):
            pool.ask({i: ("warm", name, 3 if size < (64 << 20) else 2) for i in active})
        runs: dict[str, list] = {"psgd": [], "raw": []}
        busy = []
        for k in range(repeats):
            for name in (("psgd", "raw") if k % 2 == 0 else ("raw", "psgd")):
                before = shards_busy() if name == "psgd" else None
                got = pool.ask({i: ("timed", name, seconds, time.time() + 0.05) for i in active})
                if before is not None:
                    after = shards_busy()
                    busy.append(max(1e3 * (a[0] - b[0]) / max(1, a[1] - b[1]) for a, b in zip(after, before,
                                                                                                strict=True)))
                t0 = min(r["t0"] for r in got.values())
                t1 = max(r["t1"] for r in got.values())
                steps = sum(r["steps"] for r in got.values())
                runs[name].append({"GBps": steps * 2 * size / (t1 - t0) / 1e9,
                                   "rtt_ms": 1e3 * statistics.median(r["median_s"] for r in got.values()),
                                   "wire_per_step": sum(r["wire"] for r in got.values()) / steps,
                                   "steps": steps // w, "retries": sum(r["retries"] for r in got.values())})
        # The ratios of each pair of sections, taken in turn, then their median (as
        # bench/throughput.py's): the medians of the two sides apart could come from
        # different pairs, and a drift of the machine's speed within a run lands in them.
        pairs = list(zip(runs["psgd"], runs["raw"], strict=True))
        ratios = {"ratio": statistics.median(p["GBps"] / r["GBps"] for p, r in pairs),
                  "rtt_ratio": statistics.median(p["rtt_ms"] / r["rtt_ms"] for p, r in pairs)}
        out[w] = {}
        for name, rs in runs.items():
            rs.sort(key=lambda r: r["GBps"])
            best = rs[(len(rs) - 1) // 2]   # the median section (of an even count, the lower of the two)
            best["rtt_ms"] = statistics.median(r["rtt_ms"] for r in rs)
            out[w][name] = best
        out[w]["psgd"]["busy_ms"] = statistics.median(busy)
        out[w].update(ratios)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=size_list, default="64K,1M,16M,100M", help="table sizes (whole model, KiB/MiB)")
    ap.add_argument("--shards", type=int_list(1), default="1,2,4", help="shard counts (default: 1,2,4)")
    ap.add_argument("--workers", type=int_list(1), default="1,4", help="client processes")
    ap.add_argument("--repeats", type=number(int, 1), default=3, help="timed sections per side and point (median)")
    ap.add_argument("--seconds", type=number(float, 0, above=True), default=1.0,
                    help="length of each timed section")
    ap.add_argument("--keep", help="keep psgd's logs in this folder")
    ap.add_argument("--echo", nargs=2, type=int, metavar=("PORT", "BYTES"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.echo:
        echo_server(*a.echo)
        return
    sizes, shard_counts, workers = a.sizes, a.shards, sorted(set(a.workers))
    from psgd.config import ConfigError
    for size in sizes:   # every point's psgd config checked before anything starts
        for shards in shard_counts:
            try:
                psgd_config(psgd_sets(size, shards, max(workers)))
            except ConfigError as e:
                ap.error(f"{label(size)} over {shards} shard(s): {e}")
    stop_on_signals()
    os.environ.update({k: v for k, v in child_env().items() if k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")})
    work = a.keep or tempfile.mkdtemp(prefix="bench-transport-")
    rows, records = [], []
    t_start = time.monotonic()
    pool = Pool(max(workers))
    try:
        total = len(sizes) * len(shard_counts)
        for k, (size, shards) in enumerate((z, s) for z in sizes for s in shard_counts):
            progress(f"{label(size)} over {shards} shard(s) ({k + 1}/{total}, {time.monotonic() - t_start:.0f} s)")
            got = run_point(pool, work, size, shards, workers, a.repeats, a.seconds)
            for w in workers:
                r, p = got[w]["raw"], got[w]["psgd"]
                shard_ms = p["busy_ms"]
                ceiling = r["rtt_ms"] / (r["rtt_ms"] + shard_ms) if w == 1 else None
                if p["GBps"] > r["GBps"]:
                    progress(f"{label(size)}, {shards} shard(s), {w} worker(s): psgd faster than raw pyzmq, which "
                             f"does less: the machine's speed changed within a pair of sections; run again")
                rows.append([label(size), shards, w, r["GBps"], p["GBps"], got[w]["ratio"],
                             "" if ceiling is None else ceiling, r["rtt_ms"], p["rtt_ms"], shard_ms,
                             f"{r['wire_per_step']:,.0f}", f"{p['wire_per_step']:,.0f}", r["steps"], p["steps"]])
                records.append({"bytes": size, "shards": shards, "workers": w,
                                "raw_GBps": digits(r["GBps"]), "psgd_GBps": digits(p["GBps"]),
                                "raw_rtt_ms": digits(r["rtt_ms"]), "psgd_rtt_ms": digits(p["rtt_ms"]),
                                "ratio": round(got[w]["ratio"], 4), "rtt_ratio": round(got[w]["rtt_ratio"], 4),
                                "shard_busy_ms": digits(shard_ms),
                                "ceiling": None if ceiling is None else round(ceiling, 4),
                                "raw_wire_per_step": round(r["wire_per_step"]),
                                "psgd_wire_per_step": round(p["wire_per_step"]), "psgd_retries": p["retries"]})
                if p["retries"]:
                    progress(f"psgd resent {p['retries']} requests (no answer within the client's retry window)")
    finally:
        pool.close()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(table(["table", "shards", "workers", "raw GB/s", "psgd GB/s", "psgd/raw", "ceiling", "raw ms/step",
                 "psgd ms/step", "shard busy ms", "raw wire B/step", "psgd wire B/step", "raw steps",
                 "psgd steps"], rows,
                "psgd push+pull vs raw pyzmq (payload 2 x table per step; per side the median of "
                f"{a.repeats} timed sections of {a.seconds:g} s, the two sides' sections in turn; psgd/raw: the "
                "median of the pairs' ratios, not the quotient of the two medians beside it; ms/step = median "
                "round trip of one client; steps: per client in the median section; shard busy ms: the shard's own "
                "CPU time per push in psgd's timed sections, from its counters (the most of any shard, the median "
                "over sections); ceiling = raw / (raw + busy), an estimate of the most psgd/raw can be with one "
                "worker, which waits for that work)"))

    def pick(size: int) -> dict:
        return next((r for r in records if r["bytes"] == size and r["shards"] == 1 and r["workers"] == 1), {})

    at16, at64 = pick(16 << 20), pick(64 << 10)
    p16, r16 = at16.get("psgd_GBps"), at16.get("raw_GBps")
    p64, r64 = at64.get("psgd_rtt_ms"), at64.get("raw_rtt_ms")
    emit_json({"bench": "transport", "ratio": at16.get("ratio"), "latency_ratio": at64.get("rtt_ratio"),
               "ratio_ceiling": at16.get("ceiling"),
               "psgd_GBps_16MiB": p16, "raw_GBps_16MiB": r16, "psgd_rtt_ms_64KiB": p64, "raw_rtt_ms_64KiB": r64,
               "mode": "async", "repeats": a.repeats, "seconds": a.seconds, "rows": records})


def psgd_sets(size: int, shards: int, workers: int) -> list[str]:
    return [f"cluster.servers={shards}", f"cluster.workers={workers}",
            "cluster.evaluator=false", "mode.name=async", "optimizer.momentum=0",
            "checkpoint.every_s=0", "model.name=bench.models:table", "data.name=synthetic",
            f"data.shape=[{size // 8}]", "data.classes=2", "data.samples=64",
            "train.steps=1000000000",   # the clients push as often as they like: no step limit
            "cluster.local_lane=false"]   # psgd over ZeroMQ, as the raw side: its same-host lane has no ZeroMQ to match


def shards_busy(cfg) -> list[tuple[float, int]]:
    """Each shard's (busy_s, pushes) now, from its counters (`psgd server`'s `busy_s`: the
    CPU time from taking a request off the socket to handing its reply to ZeroMQ, i.e.
    decoding, validation, the finiteness check, the optimizer step, the reply)."""
    from psgd.transport import Peers
    out = []
    for i in range(cfg.cluster.servers):
        peers = Peers(zmq.Context.instance(), [cfg.shard_address(i)], cfg.security)
        try:
            st = peers.call(0, "stats", 30).fields
        finally:
            peers.close()
        out.append((float(st["busy_s"]), int(st["pushes"])))
    return out


def run_point(pool: Pool, work: str, size: int, shards: int, workers, repeats, seconds):
    """psgd's daemons and the raw echo servers, as processes, both up for the whole point
    (a side not being timed waits in poll); every pool client registers as psgd worker
    `index` and connects to the echo servers too."""
    from psgd.launcher import pick_port
    out = fresh_folder(os.path.join(work, f"psgd-{size >> 10}K-{shards}"))
    cfg = psgd_config(psgd_sets(size, shards, len(pool.conns)))
    with Procs(os.path.join(out, "logs")) as procs:
        start_daemons(procs, cfg, out)
        wait_for(procs, ["coordinator"], "shards registered")  # then the workers' layout, and they serve
        shard_bytes = pool.ask({i: ("psgd", cfg.to_dict(), i) for i in range(len(pool.conns))})[0]
        port = pick_port("127.0.0.1", 7300, shards)
        for i, n in enumerate(shard_bytes):
            procs.start(f"echo-{i}", [sys.executable, "-m", "bench.transport", "--echo", str(port + i), str(n)])
        wait_for(procs, [f"echo-{i}" for i in range(shards)], "echo serving")
        pool.all("raw", [f"tcp://127.0.0.1:{port + i}" for i in range(shards)], shard_bytes)
        try:
            got = measure(pool, workers, size, repeats, seconds, lambda: shards_busy(cfg))
        finally:
            pool.all("close")
        try:
            procs.wait("coordinator", 30)  # every worker finished: the job ends and the shards exit
        except (TimeoutError, RuntimeError) as e:
            progress(f"psgd's job did not end cleanly ({e}); stopping it")
    return got


if __name__ == "__main__":
    main_of(main)
