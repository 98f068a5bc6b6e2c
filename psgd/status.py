"""`psgd status`: look into a running job.

    psgd status DIR [--watch [SECONDS]]       # the job whose output folder is DIR
    psgd status --address tcp://HOST:PORT      # or its coordinator, wherever it runs
        [--keys DIR | --config FILE | --set security.keys=DIR ...]   # a job secured with CurveZMQ

Asks the job's coordinator (its `status` op: one request, with a timeout) and prints a
table: the phase and mode, each worker's clock, samples/s, live/lost/finished state,
mean staleness and wait share, each shard's version, and the last evaluation. A job
that has finished (its coordinator is gone and DIR/summary.json exists) gets its
summary (an aborted one: "aborted: REASON: ..." and exit 1, as psgd run); one that is
not running while another job's coordinator answers at its address (an interrupted
job: no summary) gets a line that says so, and exit 1.
`--watch` prints the table again every few seconds until the job ends.

DIR/config.toml gives the job's security settings; with `--address` they come from
`--config FILE` (the job's config), `--set` or `--keys DIR` (= security.curve = true,
security.keys = DIR): a job secured with CurveZMQ answers only a client with its keys.
"""
from __future__ import annotations

import argparse
import errno
import glob
import json
import math
import os
import sys
import time
from collections.abc import Sequence

from . import wire
from .config import ConfigError, address_fault, format_value, load
from .consistency.staleness import Histogram
from .report_numbers import amount
from .transport import HandshakeFailed, Peers, PeerTimeout

ASK_TIMEOUT_S = 3.0


def add_parser(sub) -> None:
    p = sub.add_parser("status", help="show a running job: phase, workers, shards, accuracy")
    p.add_argument("dir", nargs="?", help="the job's output folder (it holds config.toml and summary.json)")
    p.add_argument("--address", help="the coordinator's address, tcp://HOST:PORT (instead of DIR)")
    from .cli import _seconds  # (cli imports this module: not at the top)
    p.add_argument("--watch", nargs="?", type=_seconds, const=2.0, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until the job ends")
    p.add_argument("--config", metavar="FILE",
                   help="the job's TOML config: its coordinator's address and security settings (instead of DIR)")
    p.add_argument("--keys", metavar="DIR",
                   help="a job secured with CurveZMQ: its keys folder (= --set security.curve=true "
                        "--set security.keys=DIR)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key (repeatable), e.g. security.keys=DIR")


def main(args: argparse.Namespace) -> int:
    if not args.dir and not args.address and not args.config:
        raise ConfigError("give the job's folder (DIR), --address tcp://HOST:PORT or --config FILE")
    if args.dir and args.config:
        raise ConfigError("give DIR (its config.toml is the job's) or --config FILE, not both")
    if (args.dir and os.path.isdir(args.dir) and not os.path.exists(os.path.join(args.dir, "config.toml"))
            and os.path.exists(os.path.join(args.dir, "summary.json"))):   # a psgd simulate's run: it has
        return _finished(os.path.join(args.dir, "summary.json"))       # ended, and had no coordinator to ask
    sets = list(args.set) + (["security.curve=true", f"security.keys={args.keys}"] if args.keys else [])
    cfg = _config(args.dir, args.config, sets)
    address = args.address or cfg.coordinator_address()
    why = address_fault(address)
    if why:
        raise ConfigError(f"--address must be tcp://HOST:PORT (a port in 1..65535) or ipc://PATH, "
                          f"got {address!r} ({why})")
    keys = (f"it was asked with the keys in {cfg.security.keys}: a job secured with other keys "
            f"does not answer" if cfg.security.curve else
            "a job secured with CurveZMQ answers only a client with its keys: --keys DIR or --config FILE")
    summary = os.path.join(args.dir, "summary.json") if args.dir else ""
    phase = there = ""   # the last answer's phase, and where its job's summary will be (its `out`)
    asked = time.time()
    while True:
        if summary and os.path.exists(summary):   # DIR's job has ended (a job removes an earlier one's at its
            return _finished(summary)             # start): whatever answers at its address is a later job
        try:
            reply = ask(cfg, address)
        except HandshakeFailed as e:
            print(f"psgd status: {e} ({keys})", file=sys.stderr)
            return 1
        except PeerTimeout:
            if summary and os.path.exists(summary):
                return _finished(summary)
            if there and not summary and _mtime(there) >= asked - 1:
                return _finished(there)   # (--address: the folder its coordinator named, on this machine)
            if phase in ENDING:   # watched to its end: the coordinator exits once every daemon has heard
                print(f"the job has ended (it was {phase}, and its coordinator is gone)")
                return 0
            why = (f"{_silent(cfg, args.dir, phase)}{f'; {keys}' if cfg.security.curve else ''}" if args.dir else
                   f"it was {phase}: the job was stopped, or ended where {there or 'its summary.json'} cannot be "
                   f"read from here" if phase else
                   f"not started yet, or gone without a summary; {keys}")
            print(f"psgd status: no answer from the coordinator at {address} within {ASK_TIMEOUT_S:.0f} s "
                  f"({why})", file=sys.stderr)
            return 1
        if args.dir and not _answers_for(reply, args.dir):
            print(f"psgd status: {_not_running(cfg, args.dir, reply, address)}", file=sys.stderr)
            return 1
        print(table(reply), flush=True)
        phase = str(reply.get("phase"))
        there = os.path.join(str(reply.get("out")), "summary.json") if reply.get("out") else ""
        if reply.get("done"):
            return 1 if reply.get("abort") else 0   # (an aborted job: as its summary, below)
        if not args.watch:
            return 0
        time.sleep(args.watch)
        print()


ENDING = ("final_eval", "settling", "done")   # the coordinator's phases once every worker has finished


def _answers_for(reply: wire.Message, folder: str) -> bool:
    """Is the coordinator that answered DIR's job's? Every job listens on 5555 unless
    that is taken, so after DIR's job was interrupted (no summary) a later job, in
    another folder, answers at its address: the reply names its output folder (`out`)."""
    return bool(reply.get("out")) and os.path.realpath(str(reply.get("out"))) == os.path.realpath(folder)


def _not_running(cfg, folder: str, reply: wire.Message, address: str) -> str:
    """Why DIR's job has no status: another job's coordinator answers at its address."""
    checkpoints = cfg.checkpoint_folder(folder)
    interrupted = (f"interrupted: its checkpoints are in {checkpoints}; "
                   if glob.glob(os.path.join(checkpoints, "shard-*.pt")) else "")
    return (f"{folder}'s job is not running ({interrupted}the coordinator at {address} is another job's, "
            f"in {reply.get('out') or 'no folder'})")


def _silent(cfg, folder: str, phase: str = "") -> str:
    """Why DIR's job may not answer. Its config.toml has the job's security settings, so
    the keys are not it, unless it runs with CurveZMQ; a job interrupted or killed (no
    summary) may have left checkpoints (which a psgd run into DIR may resume from).
    `phase`: the job's, where an earlier answer (--watch) gave it."""
    from .metrics import live_pid
    live = [os.path.basename(p)[:-4] for p in sorted(glob.glob(os.path.join(folder, "pids", "*.pid")))
            if live_pid(p) is not None]
    checkpoints = cfg.checkpoint_folder(folder)
    resume = f"; its checkpoints are in {checkpoints}" if glob.glob(os.path.join(checkpoints, "shard-*.pt")) else ""
    if live:   # its daemons run (here: a pid file written on another host names a pid of that host's):
        return (f"{folder}'s pid files name processes that run on this machine ({', '.join(live)}) and its "   # the
                f"coordinator does not answer"   # coordinator is busy, stopped (SIGSTOP), or gone alone
                f"{'' if 'coordinator-0' in live else ' (no coordinator among them)'}{resume}")
    written = [t for t in map(_mtime, glob.glob(os.path.join(folder, "events", "*.jsonl"))) if t > -math.inf]
    when = (f"ended without a summary (it was {phase})" if phase else
            f"ended without a summary (it ran: its last event was written at "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(max(written)))})" if written else
            "has not started yet, or ended without a summary")
    return f"{folder}'s job {when}: interrupted or killed{resume}"


def _mtime(path: str) -> float:
    """When `path` was last written; -inf where it is gone (a job that starts in the
    folder removes the earlier job's files while they are read)."""
    try:
        return os.path.getmtime(path)
    except OSError:
        return -math.inf


def _launcher_note(folder: str) -> str:
    """A note for a summary whose `psgd run` has not returned: it still holds the folder's
    .launcher.lock while it waits for its training scripts' own work after close() (up
    to --timeout) or stops the daemons, and a script that then fails fails the run."""
    from .launcher import LOCK_FILE, held
    if not held(os.path.join(folder or ".", LOCK_FILE)):
        return ""
    return ("  (its psgd run has not returned yet: it waits for the training scripts' own work after "
            "close(), or stops the daemons; the run's outcome is known when it returns)")


def _finished(summary: str) -> int:
    """A finished job's summary line (`psgd status DIR`); exit 1 for an aborted job."""
    from .launcher import format_summary
    try:
        with open(summary) as f:
            done = json.load(f)
        if not isinstance(done, dict):
            raise ValueError(f"a JSON {type(done).__name__}, not an object")
        if done.get("simulated"):   # psgd simulate's: its times are the virtual clock's
            print(f"finished (simulated by psgd simulate): {format_summary(done)}")
            return 0
        if done.get("aborted"):   # psgd run exits 1 on it: so does this, with the reason
            print(f"aborted: {done['aborted']}: {format_summary(done)}{_launcher_note(os.path.dirname(summary))}")
            return 1
        print(f"finished: {format_summary(done)}{_launcher_note(os.path.dirname(summary))}")
    except (ValueError, OSError, TypeError, KeyError) as e:
        print(f"psgd status: the job ended and {summary} is not a psgd summary ({e})", file=sys.stderr)
        return 1
    return 0


def _config(folder: str | None, path: str | None = None, sets: list[str] | None = None):
    """The job's config: DIR/config.toml, or FILE, or the defaults; with `sets` over it.
    Not the PSGD_* variables of this shell: they are not the job's."""
    if folder:
        path = os.path.join(folder, "config.toml")
        if not os.path.isdir(folder):
            what = f"{folder} is a file, not a folder" if os.path.exists(folder) else f"no folder {folder}"
            raise ConfigError(f"{what} (give a psgd run's output folder, or --address)")
        if not os.path.exists(path):
            runs = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(folder, "runs", "*", "config.toml")))
            simulated = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(folder, "runs", "*", "summary.json")))
            plan = _plan(folder)
            earlier = _earlier_plans(folder, sorted({*runs, *simulated}), plan)
            if [r for r in runs + simulated if r not in earlier]:   # this plan's: the others are named apart
                runs, simulated = [r for r in runs if r not in earlier], [r for r in simulated if r not in earlier]
            if runs or simulated:   # a psgd compare's: each of its runs is a psgd run's folder; a psgd
                some = runs or simulated   # simulate's: each run's has only its summary (and events)
                named = (f"{some[0]}, {some[1]}, ... ({len(some)} runs)" if len(some) > 3 else
                         " or ".join([", ".join(some[:-1]), some[-1]] if len(some) > 1 else some))
                simulate = "simulated" in plan[1] if plan else not runs   # (the plan's own word, not its
                kind = "a psgd simulate's" if simulate else "a psgd compare's"   # predecessor's folders')
                if set(some) <= set(earlier):   # no run folder of this plan's
                    ended = plan and (plan[0] or plan[1].get("interrupted")
                                      or os.path.exists(os.path.join(folder, "report.md")))
                    raise ConfigError(
                        f"{folder} is {kind} output folder "
                        + ("whose runs left no folder (they failed or were not run: read its report.md)" if ended
                           else "whose runs have not started yet")
                        + f": its run folders, {named}, are an earlier plan's (none is in its compare.json)")
                left = [r for r in earlier if r not in some]
                stale = ("" if not left else
                         f" ({len(left)} other run folder{'s' * (len(left) != 1)} there, "
                         f"{', '.join(left[:3])}{', ...' * (len(left) > 3)}, "
                         f"{'is' if len(left) == 1 else 'are'} an earlier plan's, not in its compare.json)")
                if not simulate:
                    raise ConfigError(f"{folder} is a psgd compare's output folder: give one of its runs, "
                                      f"{named}{stale}")
                raise ConfigError(f"{folder} is a psgd simulate's output folder (its runs have ended: nothing runs "
                                  f"there): give one of its runs for its summary, {named}{stale}; or read its "
                                  f"report.md")
            raise ConfigError(f"{folder} has no config.toml (is it a psgd run's output folder?)")
    return load(path, sets or [], env={})


def _plan(folder: str) -> tuple[list, dict] | None:
    """DIR/compare.json's entries and DIR/compare-context.json (the plan that wrote them
    last), or None where either cannot be read."""
    try:
        with open(os.path.join(folder, "compare.json")) as f:
            entries = json.load(f)
        with open(os.path.join(folder, "compare-context.json")) as f:
            ctx = json.load(f)
        if isinstance(entries, list) and isinstance(ctx, dict):
            return entries, ctx
    except (OSError, ValueError):
        pass
    return None


def _earlier_plans(folder: str, runs: list[str], plan: tuple[list, dict] | None) -> list[str]:
    """The run folders under DIR/runs/ that an earlier psgd compare or simulate into DIR
    left (README: its run folders stay): neither named in DIR/compare.json nor written
    since this plan started (compare-context.json's `started`: the run it runs now). None
    where DIR has no compare.json to tell them by."""
    try:
        entries, ctx = plan or ([], {})
        started = time.mktime(time.strptime(ctx["started"], "%Y-%m-%d %H:%M:%S"))
        named = {os.path.normpath(os.path.join(folder, str(e["dir"]))) for e in entries if e.get("dir")}
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError):
        return []

    def written(run: str) -> float:   # (a run of this plan starts from an empty folder, or writes its summary;
        times = [_mtime(p) for p in (run, *(os.path.join(run, f) for f in ("config.toml", "summary.json")))]
        return max((t for t in times if t > -math.inf), default=math.inf)   # one removed meanwhile, by the plan
                                                                            # that runs there: not an earlier one's
    return [run for run in runs if os.path.normpath(run) not in named and written(run) < started]


def ask(cfg, address: str) -> wire.Message:
    import zmq
    try:
        peers = Peers(zmq.Context.instance(), [address], cfg.security)
    except zmq.ZMQError as e:
        if e.errno == errno.EMFILE:   # (the process's, not the address's: `cli._command` says so)
            raise
        raise ConfigError(f"cannot connect to {address!r}: {e}") from None
    try:
        return peers.call(0, "status", ASK_TIMEOUT_S)
    finally:
        peers.close()


def _fmt(x: float | None) -> str:
    """A score's value, or '-' where it has none (a loss that was not finite is kept as
    null: a restarted coordinator reads it so from its state file)."""
    return "-" if x is None else f"{x:.4f}"


def table(r: wire.Message) -> str:
    """The status reply as text."""
    mode = r.get("mode", "?")
    params = " ".join(f"{k}={format_value(v)}" for k, v in (r.get("mode_params") or {}).items())
    steps = r.get("steps") or 0
    head = [f"phase {r.get('phase')}  mode {mode} {params}".rstrip() + f"  elapsed {r.get('elapsed_s', 0):.1f} s  "
            f"samples {r.get('samples', 0):,}  live {len(r.get('live') or {})}/{r.get('workers_expected', '?')}"]
    if r.get("abort"):
        head.append(f"aborted: {r.get('abort')}")
    ev = r.get("last_eval")
    head.append(f"last evaluation: accuracy {_fmt(ev.get('accuracy'))}  loss {_fmt(ev.get('loss'))}  at "
                f"{ev['t']:.1f} s" if ev else "last evaluation: none yet")
    rows: list[tuple[str, ...]] = [("worker", "state", "clock", "samples/s", "staleness", "wait", "rejected", "joins")]
    for w in r.get("workers") or []:
        elapsed = float(w.get("elapsed_s") or 0)
        rate = amount((w.get('samples') or 0) / elapsed) if elapsed > 0 else "-"
        hist = Histogram.of(w)
        wait = f"{float(w.get('wait_s') or 0) / elapsed:.0%}" if elapsed > 0 else "-"
        clock = f"{w['clock']}/{steps}" if steps else str(w["clock"])
        rows.append((str(w["rank"]), w["state"], clock, rate, f"{hist.mean:.2f}" if hist.total else "-", wait,
                     str(w.get("rejected") or 0), str(w.get("joins", 1))))
    elapsed = float(r.get("elapsed_s") or 0)
    shards = "  ".join(f"shard {s['index']}: version {'-' if s.get('version') is None else s['version']}"
                       + (f", busy {float(s['busy_s']) / elapsed:.0%}" if s.get("busy_s") and elapsed > 0 else "")
                       + (f", {s['restarts']} restart{'s' if s['restarts'] != 1 else ''}" if s.get("restarts") else "")
                       + (f", {s['bad_messages']} bad message{'s' if s['bad_messages'] != 1 else ''}"
                          if s.get("bad_messages") else "")
                       for s in r.get("shards") or [])
    return "\n".join(head + [_columns(rows), shards or "shards: none registered yet"])


def _columns(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    def line(row: tuple[str, ...]) -> str:  # names left, numbers right
        return "  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
    return "\n".join(line(row) for row in rows)
