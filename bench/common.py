"""What the benchmarks share: child processes that are always stopped, psgd's daemons
as processes, psgd jobs, steady-state throughput from event logs, tables, the JSON line.

Every child is started through a `Procs` group (a context manager): on leaving it, and
on SIGTERM or Ctrl-C of the benchmark, each child still running is terminated, then
killed after a grace period. Children get PYTHONPATH = the repository root (so that
`bench.models:...` factories import in psgd's daemons), one compute thread each
(OMP_NUM_THREADS=1) and no PSGD_* variables from the caller's environment.
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOAD_AT_START = os.getloadavg()  # the machine's load when the benchmark started (others may share it)


def child_env(threads: int = 1, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSGD_")}
    env.update({"PYTHONPATH": REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
                "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def stop_on_signals() -> None:
    """SIGTERM becomes SystemExit, so that every `finally` (and `Procs.__exit__`) runs."""
    def _raise(signum, _frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, _raise)


def main_of(main: Callable[[], None]) -> None:
    """A benchmark's `main`, whose Ctrl-C or SIGTERM (`stop_on_signals`) ends it with one
    line (its `finally`s have stopped the processes it started), exit 130 or 143: it was a
    traceback, and with a terminal's Ctrl-C one from each child process too (196 lines)."""
    try:
        main()
    except KeyboardInterrupt:
        progress("stopped (Ctrl-C); the processes it started are stopped")
        raise SystemExit(128 + signal.SIGINT) from None
    except SystemExit as e:
        if e.code == 128 + signal.SIGTERM:
            progress("stopped (SIGTERM); the processes it started are stopped")
        raise


def child_ignores_ctrl_c() -> None:
    """In a benchmark's child process (a multiprocessing target): a terminal's Ctrl-C, sent
    to the whole process group, is the benchmark's to handle (`main_of`), which stops its
    children; each printed its own KeyboardInterrupt traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Procs:
    """A group of child processes, all stopped on exit from the `with` block."""

    def __init__(self, logs: str):
        self.logs = logs
        os.makedirs(logs, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: Sequence[str], env: dict | None = None) -> subprocess.Popen:
        with open(os.path.join(self.logs, f"{name}.log"), "a") as log:
            p = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=env or child_env(), cwd=REPO)
        self.procs[name] = p
        return p

    def tail(self, name: str, n: int = 15) -> str:
        path = os.path.join(self.logs, f"{name}.log")
        if not os.path.exists(path):
            return ""
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def check(self) -> None:
        """Raise if a child died with an error (with its log's tail)."""
        for name, p in self.procs.items():
            if p.poll() not in (None, 0):
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.tail(name)}")

    def wait(self, name: str, timeout: float) -> int:
        end = time.monotonic() + timeout
        p = self.procs[name]
        while p.poll() is None:
            if time.monotonic() > end:
                raise TimeoutError(f"{name} did not finish within {timeout:.0f} s:\n{self.tail(name)}")
            self.check()
            time.sleep(0.05)
        return p.returncode

    def stop(self, grace: float = 5.0) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        end = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs.clear()

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------- flags
def int_list(minimum: int = 1):
    """An argparse type: whole numbers separated by commas, each at least `minimum`
    (a bad value is a usage error before anything starts, not a traceback mid-run)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas (e.g. 1,2,4), "
                                             f"got {text!r}") from None
        if any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"each must be >= {minimum}, got {text!r}")
        return values
    return parse


def name_list(choices: Iterable[str]):
    """An argparse type: names separated by commas, each one of `choices`."""
    known = list(choices)

    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",")]
        bad = [v for v in values if v not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"{', '.join(map(repr, bad))}: not one of {', '.join(known)}")
        return values
    return parse


def number(kind: type = int, minimum: float = 1, above: bool = False, maximum: float | None = None):
    """An argparse type: one number of `kind`, at least `minimum` (above it if `above`),
    at most `maximum` if given."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a whole number' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not (value > minimum if above else value >= minimum) or value != value:
            raise argparse.ArgumentTypeError(f"must be {'>' if above else '>='} {minimum:g}, got {text}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum:g}, got {text}")
        return value
    return parse


# ---------------------------------------------------------------- psgd
def psgd_config(sets: Iterable[str] = ()):
    """A psgd Config from `section.key=value` strings (no file, no PSGD_* variables),
    on a free block of ports."""
    from psgd.config import load
    from psgd.launcher import pick_port
    cfg = load(None, list(sets), env={})
    c = cfg.cluster
    return cfg.replace(**{"cluster.port": pick_port(c.host, 7000 + (os.getpid() % 20000), c.servers + 1)})


def psgd_argv(role: str, config_path: str, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "psgd", role, config_path, "--out", out, *extra]


def write_config(cfg, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "config.toml")
    with open(path, "w") as f:
        f.write(cfg.to_toml())
    return path


def start_daemons(procs: Procs, cfg, out: str) -> str:
    """The coordinator and every shard server of `cfg` as processes; the config's path."""
    path = write_config(cfg, out)
    procs.start("coordinator", psgd_argv("coordinator", path, out))
    for i in range(cfg.cluster.servers):
        procs.start(f"server-{i}", psgd_argv("server", path, out, "--shard", str(i)))
    return path


def run_psgd(sets: Iterable[str], out: str, warmup: int, device: str = "cpu", timeout_s: float = 900) -> dict:
    """One `psgd run` job (psgd.launcher.run_local: every role its own process);
    its summary with `steady` = steady-state samples/s from the worker events."""
    from psgd.launcher import run_local
    cfg = psgd_config(sets)
    summary = run_local(cfg, out, device=device, quiet=True, timeout_s=timeout_s,
                        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": child_env()["PYTHONPATH"]})
    summary["steady"] = steady_rate(worker_events(out), warmup)
    return summary


def worker_events(out: str) -> dict[int, list[dict]]:
    """rank -> that worker's step events (t, step, samples, wait_s ...), in order."""
    runs: dict[int, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(out, "events", "worker-*.jsonl"))):
        rows = []
        with open(path) as f:
            for line in f:
                e = json.loads(line)
                if "step" in e and "samples" in e and "event" not in e:
                    rows.append(e)
        if rows:
            runs[int(rows[0]["rank"])] = rows
    return runs


def steady_rate(runs: dict[int, list[dict]], warmup: int) -> float:
    """Steady-state samples/s of all workers together: the samples processed in the window
    when every worker is past its first `warmup` steps and none has finished (from the
    latest end of a step `warmup` to the earliest end of a last step), over its length.
    Each worker's cumulative samples are interpolated linearly between the ends of its
    steps. With one worker: its samples after step `warmup` over the time from the end of
    that step to the end of its last. Baselines log the same (t, samples) per step.
    (Summing each worker's own rate instead would overstate the total when independent
    workers' windows do not overlap: a worker that runs alone at the end has a core to
    itself.)"""
    for rows in runs.values():
        if len(rows) <= warmup + 1:
            raise ValueError(f"only {len(rows)} steps logged: fewer than the {warmup} warm-up steps + 2")
    start = max(rows[max(0, warmup - 1)]["t"] for rows in runs.values())
    end = min(rows[-1]["t"] for rows in runs.values())
    if end <= start:
        raise ValueError("the workers' steady windows do not overlap (one finished before another warmed up)")
    return sum(_samples_at(rows, end) - _samples_at(rows, start) for rows in runs.values()) / (end - start)


def _samples_at(rows: list[dict], t: float) -> float:
    """A worker's cumulative samples at time t (within its first and last step's end),
    linear between the ends of its steps."""
    k = bisect.bisect_left([r["t"] for r in rows], t)
    if k == 0:
        return rows[0]["samples"]
    if k == len(rows):
        return rows[-1]["samples"]
    a, b = rows[k - 1], rows[k]
    return a["samples"] + (b["samples"] - a["samples"]) * (t - a["t"]) / (b["t"] - a["t"])


# ---------------------------------------------------------------- output
def table(headers: Sequence[str], rows: Sequence[Sequence], title: str = "") -> str:
    cells = [[str(h) for h in headers]] + [[fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [title] if title else []
    lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        lines.append("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                       for i, (c, w) in enumerate(zip(r, widths, strict=True))) + " |")
    return "\n".join(lines)


def fmt(v) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def emit_json(obj: dict) -> None:
    """The benchmark's last line: one JSON object, with the machine's load averages (1, 5 min)
    at the start and at the end: other processes on the machine skew every number."""
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    obj = {**obj, "commit": commit or None, "cores": os.cpu_count(),
           "loadavg_start": [round(x, 2) for x in LOAD_AT_START[:2]],
           "loadavg_end": [round(x, 2) for x in os.getloadavg()[:2]]}
    sys.stdout.flush()
    print(json.dumps(obj, sort_keys=False), flush=True)


def progress(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def fresh_folder(path: str) -> str:
    """`path`, emptied of an earlier --keep run's job: psgd would resume that job from there."""
    shutil.rmtree(path, ignore_errors=True)
    return path


@contextlib.contextmanager
def reported(label: str, record: Callable[[str], None]) -> Iterator[None]:
    """A part of a benchmark that fails is reported (stderr, and `record(error)` for the
    JSON's `failed`); the other parts still run, and what they measured is printed."""
    try:
        yield
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        record(error)
        progress(f"{label} failed: {error}")
