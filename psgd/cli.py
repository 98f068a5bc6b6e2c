"""The `psgd` command line.

    psgd run [CONFIG] [--mode M] [--workers W] [--servers S] [--out DIR] [--set k=v ...]
    psgd compare [CONFIG] --modes sync,ssp:staleness=2,async ... --out DIR
    psgd simulate [CONFIG] --modes ... --workers 8,64,256 --out DIR   (a virtual clock)
    psgd coordinator|server --shard I|worker|evaluator [CONFIG] --out DIR [--set k=v ...]
    psgd shards [CONFIG] [--servers S]
    psgd status DIR | --address tcp://HOST:PORT [--keys DIR | --config FILE | --set k=v] [--watch [S]]
    psgd keys DIR

CONFIG defaults to $PSGD_CONFIG, --out to $PSGD_OUT. Errors in the config or the data
print one line and exit 2.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import math
import os
import signal
import sys
import threading
import time
from typing import NoReturn

# This command's first moment, and the CPU time its process had spent by then (the
# interpreter's start): what `psgd run`'s startup_s counts from (metrics.command_start)
BEGAN = (time.time(), sum(os.times()[:2]))

try:
    from .config import MODES, ConfigError, given_keys, load, parse_value, refuse_set_against_flag
    from .layout import BUILTIN_MODELS, SCRIPT_MODEL, unfit_input
    from .log import flush_aside, say, to_devnull, write_aside
    from .metrics import EXIT_CANNOT_WRITE, OutputError, cpu_wait_said
    from .transport import EXIT_ADDRESS_IN_USE, AddressInUse
    from .wire import RemoteError, WireError
except KeyboardInterrupt:   # Ctrl-C while psgd loads (numpy, ZeroMQ): nothing started yet, no traceback
    raise SystemExit(130) from None


def _common(p: argparse.ArgumentParser, out_help: str | None) -> None:
    """CONFIG and --set, and --out with `out_help` (None: a command that writes nothing)."""
    p.add_argument("config", nargs="?", default=os.environ.get("PSGD_CONFIG"),
                   help="TOML config file (default: $PSGD_CONFIG, else the built-in default job)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config key (repeatable); beats PSGD_* variables and the file")
    if out_help is not None:
        p.add_argument("--out", default=os.environ.get("PSGD_OUT"), help=out_help)


def _device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=os.environ.get("PSGD_DEVICE", "auto"),
                   help="auto | cpu | cuda | cuda:N (auto: CUDA when present, one GPU per local rank)")


DAEMONS = ("coordinator", "server", "worker", "evaluator")
# What each daemon writes into --out (README, "Output files").
NOTHING = "(default: $PSGD_OUT; with neither, nothing is written)"
DAEMON_OUT = {"coordinator": f"summary.json, config.toml, coordinator-state.json, coordinator-scores.jsonl, "
                             f"events/, pids/ {NOTHING}",
              "server": "checkpoints/shard-I.pt, pids/ (default: $PSGD_OUT; checkpoint.dir, if set, holds the "
                        "checkpoints instead, with or without --out)",
              "worker": f"events/worker-R.jsonl, pids/ {NOTHING}", "evaluator": f"model.pt, events/, pids/ {NOTHING}"}


def _seconds(text: str) -> float:
    """A time limit: a finite number of seconds > 0 (nan would be no limit at all); one
    longer than the platform's longest wait (`threading.TIMEOUT_MAX`, some 292 years)
    is that (time.sleep(1e308) raised OverflowError)."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return min(v, threading.TIMEOUT_MAX)


SERVERS_HELP = "number of shards (= --set cluster.servers=...)"
WORKERS_HELP = "worker count, or a comma-separated sweep: {} (default: the config's cluster.workers)"
REPEATS_HELP = "runs of each mode and worker count, with seeds job.seed + 0, 1, ... (default 1, at most 10000)"


def _insecure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--insecure", action="store_true",
                   help="allow binding a non-loopback address without CurveZMQ")


class _VerbParser(argparse.ArgumentParser):
    """A verb's parser (`psgd run`, ...): an option's bad or missing value (`--workers two`,
    `psgd server` without `--shard`) is one line, exit 2, as psgd's other input errors are.
    argparse printed the verb's whole usage first, five lines before the one that said what
    was wrong."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def parser() -> argparse.ArgumentParser:
    from . import __version__
    ap = argparse.ArgumentParser(prog="psgd", description="Sharded parameter-server training for PyTorch.")
    ap.add_argument("--version", action="version", version=f"psgd {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_VerbParser)

    p = sub.add_parser("run", help="run a whole job on this machine (coordinator, shards, workers, evaluator)")
    _common(p, "output folder: summary.json, events/, logs/, model.pt (default: $PSGD_OUT, else "
               "runs/MODE-DATE-TIME)")
    _device(p)
    p.add_argument("--mode", help=f"{' | '.join(MODES)} (= --set mode.name=...)")
    p.add_argument("--workers", type=int, help="number of workers (= --set cluster.workers=...)")
    p.add_argument("--servers", type=int, help=SERVERS_HELP)
    p.add_argument("--restart-workers", action="store_true", help="restart a worker that dies")
    p.add_argument("--timeout", type=_seconds, default=None,
                   help="give up after this many seconds (default: an hour, or train.seconds + 600 if longer)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--script", metavar="FILE",
                   help="run W copies of this training script (it calls psgd.connect) as the workers; "
                        "arguments after -- go to it")

    p = sub.add_parser("compare", help="run several modes side by side and write a report")
    _common(p, "output folder: report.md, compare.json, runs/ (default: $PSGD_OUT, else runs/compare-DATE-TIME)")
    _device(p)
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated modes, each optionally with parameters (ssp:staleness=2, "
                        "easgd:tau=4:alpha=0.3) or config keys as SECTION.KEY (sync:wire.dtype=bfloat16); a "
                        f"value list sweeps the item's last parameter: ssp:staleness=0,1,2,4,8 (default: every "
                        f"mode, {','.join(MODES)})")
    p.add_argument("--workers", default=None, help=WORKERS_HELP.format("1,2,4"))
    p.add_argument("--servers", type=int, help=SERVERS_HELP)
    p.add_argument("--repeats", type=int, default=1, help=REPEATS_HELP)
    p.add_argument("--no-baseline", action="store_true", help="skip the sequential 1-worker baseline")
    p.add_argument("--timeout", type=_seconds, default=None,
                   help="per run, in seconds (default: an hour, or train.seconds + 600 if longer; "
                        "the sequential baseline: none unless given)")

    from .simulate import add_parser as add_simulate
    add_simulate(sub)

    for role, text in (("coordinator", "rendezvous, liveness, summary.json"),
                       ("server", "one shard server"), ("worker", "one worker"),
                       ("evaluator", "scores the global model")):
        p = sub.add_parser(role, help=text)
        _common(p, f"output folder: {DAEMON_OUT[role]}")
        if role == "server":
            p.add_argument("--shard", type=int, required=True, help="shard index I (port = cluster.port + 1 + I)")
        if role == "worker":
            p.add_argument("--rank", type=int, default=-1, help="ask for this rank (default: the next free one)")
        if role in ("worker", "evaluator"):
            _device(p)
        if role in ("coordinator", "server"):
            _insecure(p)
        if role == "coordinator":
            p.add_argument("--launched-at", type=float, metavar="T",
                           help="when the job was launched (seconds since the epoch, as time.time()): "
                                "summary.json's startup_s counts from T (psgd run passes it) instead of from "
                                "this process's start")
        p.add_argument("--started-file", metavar="PATH", help=argparse.SUPPRESS)  # psgd run's progress

    p = sub.add_parser("shards", help="print the shard map for the config's model")
    _common(p, out_help=None)
    p.add_argument("--servers", type=int, help=SERVERS_HELP)

    from .status import add_parser as add_status
    add_status(sub)

    p = sub.add_parser("keys", help="make CurveZMQ key pairs for security.curve = true")
    p.add_argument("dir", help="folder to create (server.key*, client.key*, authorized/)")
    return ap


# The flags that set a config key, as an error names them.
FLAG_OF = {"mode.name": "--mode {}", "cluster.workers": "--workers {}", "cluster.servers": "--servers {}",
           "model.name": "--script", "cluster.evaluator": "--script (a script's job runs no evaluator)"}


def _config(args, extra: dict | None = None):
    """The config from CONFIG and --set, with the keys the flags set (`extra`); a --set
    of a flag's key to another value is an error (the flag won without a word)."""
    sets, flags = list(args.set), {}
    for key, value in (extra or {}).items():
        if value is None:
            continue
        flag = FLAG_OF.get(key, key + "={}").format(value)
        refuse_set_against_flag(args.set, key, parse_value(str(value)), flag)
        sets.append(f"{key}={value}")
        flags[sets[-1]] = flag
    return load(args.config, sets, said_as=flags)


def _check_bind(cfg, addresses: list[str], insecure: bool) -> None:
    from .transport import is_loopback
    if cfg.security.curve or insecure:
        return
    for a in addresses:
        if not is_loopback(a):
            raise ConfigError(f"refusing to listen on {a} without CurveZMQ: anyone who can reach it could "
                              f"read or change the model. Set security.curve = true (keys from `psgd keys DIR`) "
                              f"or pass --insecure on a trusted network")


def _script(args) -> list[str] | None:
    """psgd run --script FILE -- ARGS: [FILE, ARGS...], checked."""
    if not args.script:
        return None
    if not os.path.isfile(args.script):
        raise ConfigError(f"--script {args.script}: " + ("a folder, not a Python file" if os.path.isdir(args.script)
                                                         else "no such file"))
    if args.config and not os.path.exists(args.config) and args.config != os.environ.get("PSGD_CONFIG"):
        # `psgd run --script train.py 32`: the script's argument taken as CONFIG, which
        # failed as "config file 32 does not exist"
        raise ConfigError(f"config file {args.config} does not exist (arguments for the script go after --: "
                          f"psgd run --script {args.script} [options] -- {args.config})")
    return [os.path.abspath(args.script), *args.script_args]


def check_model(cfg) -> None:
    """A model.name that no worker could build, as one ConfigError now (not a job whose
    evaluator is restarted until it gives up, or whose workers wait cluster.timeout_s): a
    built-in name is checked without torch; a factory's model is built as the workers
    build it, from the seed on the CPU, so that one that is not an nn.Module, has no
    trainable parameter or one not float32 is refused here."""
    if ":" in cfg.model.name:
        from .data import describe
        from .models import build_model
        try:
            build_model(cfg.model.name, *describe(cfg.data), cfg.job.seed, cfg.model.hidden, check=True)
        except ConfigError:
            raise
        except Exception as e:   # the factory's own error: one line here, each worker's log has its traceback
            raise ConfigError(f"model.name {cfg.model.name!r}: the factory raised {type(e).__name__}: {e}") from None
    elif cfg.model.name not in BUILTIN_MODELS:
        raise ConfigError(f"model.name {cfg.model.name!r}: expected {', '.join(BUILTIN_MODELS)} "
                          f"or package.module:factory")
    elif cfg.model.name in ("cnn", "resnet20"):
        # (one on flat data started, and its workers died on torch's conv2d traceback; only
        # these two ask: `describe` loads a factory's data again)
        from .data import describe
        unfit = unfit_input(cfg.model.name, describe(cfg.data)[0])
        if unfit:
            raise ConfigError(unfit)


def check_job(cfg, runs: list | None = None) -> int:
    """What psgd's own workers need, checked before psgd run or compare starts one: a bad
    dataset or model, or more workers than the training set has samples for (in each of
    the configs `runs`, default cfg), is one line here, not a failed job later (nor one
    that trained with fewer workers: a worker with no data stops, the others go on).
    Returns the training set's size (for `data.batch_over_share`)."""
    from .consistency import data_split
    from .data import check_dataset, check_partitions
    n = check_dataset(cfg.data, cfg.job.seed)
    check_model(cfg)
    for run in runs or [cfg]:
        check_partitions(n, run.cluster.workers, run.job.seed, data_split(run))
    return n


def known_bad(cfg) -> str:
    """One warning line for a combination of settings measured to train the default job far
    below its 0.98, else "". The bounds are those measured: the neighbouring settings that
    trained get none (docs/modes.md has the runs).
    - diloco with rounds of one step and both momenta at 0.9 (about chance): the inner
      momentum buffer, kept across rounds, makes each pseudo-gradient a momentum sum, and
      the outer Nesterov momentum sums those again ("Short rounds"). A lower lr, outer_lr
      or either momentum, Nesterov or Adam inside trained.
    - async with prefetch at 2 or more workers, SGD with momentum 0.9 at lr 0.1 (0.07-0.73):
      a prefetched gradient is about 2W - 1 updates stale, and staleness acts as momentum
      on top of the optimizer's. Momentum 0.8 or lr 0.05 trained (0.96-0.98), as did Adam
      and one worker (0.88); Nesterov, lr_policy = "staleness" and dc_lambda = 0.1 did not."""
    m, o = cfg.mode, cfg.optimizer
    if (m.name == "diloco" and m.local_steps == 1 and m.outer_lr >= 0.2 and m.outer_momentum >= 0.9
            and o.name == "sgd" and not o.nesterov and o.momentum >= 0.9 and o.lr >= 0.1):
        return ("mode diloco with mode.local_steps = 1 and both momenta at 0.9 (optimizer.momentum, "
                "mode.outer_momentum) trained the default job to about chance at 1-4 workers (docs/modes.md); "
                "set either to 0, or use mode.outer_lr=1 mode.outer_momentum=0 (model averaging)")
    if (m.name == "async" and m.prefetch and cfg.cluster.workers >= 2 and o.name == "sgd" and o.momentum >= 0.9
            and o.lr >= 0.1):
        return ("mode async with mode.prefetch at 2 or more workers and optimizer.momentum = 0.9 trained the "
                "default job to 0.07-0.73 in 15 runs of 2-4 workers, Nesterov, lr_policy = staleness and "
                "dc_lambda = 0.1 among them (docs/modes.md): each gradient is about 2W - 1 updates stale, which "
                "acts as momentum on top of the optimizer's; set optimizer.momentum=0.5 or optimizer.lr=0.05 (0.98)")
    return ""


def lone_trainer(cfg) -> str:
    """A warning for an ltfb job of one trainer (cluster.workers = mode.trainer_size): no
    tournament is ever held, and it ran without a word. Only `psgd run`'s: compare and
    simulate sweep trainer counts from one (its speedup's baseline)."""
    m, w = cfg.mode, cfg.cluster.workers
    if m.name != "ltfb" or w // max(1, m.trainer_size) != 1:
        return ""
    return (f"mode ltfb with one trainer ({w} worker{'s' * (w != 1)}, mode.trainer_size = {m.trainer_size}) holds "
            f"no tournament: it trains that one model alone; give more workers (--workers) for a tournament")


def idle_faults(cfg) -> list[str]:
    """A warning line for each injected fault that would slow no worker of this one job:
    a straggler rank the job does not have, one half of a pair set without the other (the
    job ran at full speed, and said nothing). psgd compare and simulate sweep worker
    counts, and their report says which runs had the fault."""
    f, w = cfg.faults, cfg.cluster.workers
    said = []
    if f.slow_rank >= w:
        said.append(f"faults.slow_rank = {f.slow_rank} is no rank of this job's {w} worker{'s' * (w != 1)} "
                    f"(ranks 0..{w - 1}): no worker is slowed")
    elif f.slow_factor > 1 and f.slow_rank < 0:
        said.append(f"faults.slow_factor = {f.slow_factor:g} slows no worker: faults.slow_rank = -1 (set it to a rank)")
    elif f.slow_rank >= 0 and f.slow_factor == 1:
        said.append(f"faults.slow_rank = {f.slow_rank} slows nothing: faults.slow_factor = 1 (set it above 1)")
    if (f.jitter_prob > 0) != (f.jitter_s > 0):
        said.append((f"faults.jitter_prob = {f.jitter_prob:g} delays nothing: faults.jitter_s = 0" if f.jitter_prob > 0
                     else f"faults.jitter_s = {f.jitter_s:g} delays nothing: faults.jitter_prob = 0")
                    + " (set both: each step is delayed by jitter_s with probability jitter_prob)")
    return said


def unread_keys(cfg, given: set[str] | list[str]) -> str:
    """A warning naming the keys given on the command line or in PSGD_* variables that this
    job never reads: another mode's parameters (`--mode sync --set mode.prefetch=true`),
    psgd simulate's cost model (`sim.*`), and another model's or dataset's keys
    (`model.hidden` but for the mlp, `data.shape` and `data.samples` but for synthetic
    data). They ran as if not given, without a word;
    psgd compare refuses the first in a mode item, psgd simulate warns of the keys it
    never reads."""
    from .consistency import PARAMS
    name = cfg.mode.name
    mine = {"mode.name", *(f"mode.{k}" for k in PARAMS[name])}
    modes = sorted(k for k in given if k.startswith("mode.") and k not in mine)
    sims = sorted(k for k in given if k.startswith("sim."))
    # (a cnn with model.hidden trained the CNN it always trains, without a word)
    others = sorted(k for k in given if (k == "model.hidden" and cfg.model.name != "mlp")
                    or (k in ("data.shape", "data.samples") and cfg.data.name != "synthetic"))
    what = ([f"{', '.join(modes)} (mode {name}'s parameters: {', '.join(PARAMS[name]) or 'none'})"] if modes else []) \
        + ([f"{', '.join(sims)} (psgd simulate's cost model)"] if sims else []) \
        + [f"{k} (the mlp's width; model.name = {cfg.model.name})" if k == "model.hidden" else
           f"{k} (the synthetic dataset's; data.name = {cfg.data.name})" for k in others]
    if not what:
        return ""
    return (f"this job reads none of {'; '.join(what)}: setting {'it' if len(modes + sims + others) == 1 else 'them'} "
            f"changes nothing")


def cmd_run(args) -> int:
    from .launcher import (
        LaunchError,
        check_before_launch,
        ended_before,
        file_stamps,
        format_summary,
        oversubscribed,
        resumable,
        run_local,
        written_since,
    )
    from .metrics import command_start, process_start_time
    launched_at = command_start(*BEGAN, process_start_time())  # startup_s: from the command's start
    script = _script(args)
    cfg = _config(args, {"mode.name": args.mode, "cluster.workers": args.workers, "cluster.servers": args.servers,
                         **({"model.name": SCRIPT_MODEL, "cluster.evaluator": "false"} if script else {})})
    port_explicit = "cluster.port" in given_keys(args.config, args.set)
    small = ""
    if not script:   # a script's workers bring their own model and data
        from .consistency import data_split
        from .data import batch_over_share
        small = batch_over_share(check_job(cfg), cfg.train.batch_size, [(cfg.cluster.workers, data_split(cfg))])
    check_before_launch(cfg, args.device)
    bad = "" if script else known_bad(cfg)   # (a script's own optimizer may not be [optimizer]'s)
    unread = unread_keys(cfg, given_keys(None, args.set))   # (a config file may hold every mode's keys)
    for warning in (bad, small, lone_trainer(cfg), *idle_faults(cfg), unread):
        if warning:
            print(f"psgd run: warning: {warning}", file=sys.stderr, flush=True)
    out = args.out or os.path.join("runs", f"{cfg.mode.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    c = cfg.cluster
    job = (f"psgd run: {cfg.job.name}, mode {cfg.mode.name}, {c.workers} workers x {c.servers} shards, "
           f"{f'script {args.script}' if script else f'model {cfg.model.name} on {cfg.data.name}'}, out {out}")
    model = os.path.join(out, "model.pt")
    # the job's files are told from an earlier job's in `out` by these (launcher.written_since)
    before = file_stamps([model, *(cfg.checkpoint_file(out, i) or "" for i in range(c.servers))])
    accepted = []

    def announce() -> None:
        accepted.append(True)
        print(job, file=sys.stderr, flush=True)
    try:   # the job is announced once the launcher has accepted it: a refused run says only why
        s = run_local(cfg, out, device=args.device, restart_workers=args.restart_workers,
                      quiet=args.quiet, timeout_s=args.timeout, launched_at=launched_at, port_explicit=port_explicit,
                      script=script, announce=announce)
    except (LaunchError, KeyboardInterrupt) as e:   # its daemons are stopped by now (run_local)
        # (a refused run's folder may hold the checkpoints of the job running there: not its own)
        again = "with the same checkpoint.dir" if cfg.checkpoint.dir else "into the same --out"   # (where it looks)
        resume = (f"; the shards' checkpoints are in {cfg.checkpoint_folder(out)} (a psgd run {again} resumes "
                  f"from them)" if accepted and resumable(cfg, out, before) else "")
        # A signal after the job had ended cut nothing short: the job is reported, as without it.
        ended = ended_before(e) if isinstance(e, KeyboardInterrupt) else e
        if isinstance(ended, LaunchError):   # (--timeout, a daemon that failed, an aborted job)
            print(f"psgd: error: {ended}{resume}", file=sys.stderr)
            return 1
        assert isinstance(e, KeyboardInterrupt)
        how = stopped_by(e)
        if ended is None:
            say(f"psgd run: {how}; its daemons are stopped{resume}")   # (to a `| tee` the signal ended too)
            raise
        say(f"psgd run: {how} after the job had ended; its outputs are complete")
        s = ended
    print(format_summary(s))
    for warning in (untrained_warning(s, bool(script)), cpu_wait_warning(s, bool(oversubscribed(cfg)))):
        if warning:
            print(f"psgd run: warning: {warning}", file=sys.stderr)
    saved = written_since(model, before)  # not an earlier job's
    print(f"summary: {os.path.join(out, 'summary.json')}" + (f"  model: {model}" if saved else ""))
    if not saved:
        print(f"psgd run: warning: no final model was saved ({model}: "
              + ("the job ran no evaluator, which saves it)" if not script and not cfg.cluster.evaluator else
                 "the evaluator saves it with the final evaluation, which did not come: the coordinator's "
                 "lines say why)" if not script and s.get("final_eval_missing") else
                 f"{'rank 0' if script else 'the evaluator'} did not write it; {out}/logs/"
                 f"{'worker-0' if script else 'evaluator-0'}.log says why)"), file=sys.stderr)
    return 0


# `psgd run` says that the job shared its cores where summary.json's cpu_wait_fraction reaches
# metrics.CPU_WAIT_SAID as written (`metrics.cpu_wait_said`), in a job of at least
# CPU_WAIT_WALL_S (a shorter one's share may be a few preemptions')
CPU_WAIT_WALL_S = 1.0


def cpu_wait_warning(s: dict, crowded: bool) -> str:
    """What a job whose workers waited for a CPU (summary.json's cpu_wait_fraction, from
    metrics.CPU_WAIT_SAID) should not be read as, or ''. Not where the job's own busy processes
    outnumber the cores (`crowded`: said at its start, `launcher.oversubscribed`): its
    workers then wait for its shards and evaluator as much as for anything else."""
    if crowded or not cpu_wait_said(s.get("cpu_wait_fraction")) or float(s.get("wall_s") or 0) < CPU_WAIT_WALL_S:
        return ""
    return (f"its workers waited for a CPU {100 * s['cpu_wait_fraction']:.0f}% of the time they could run "
            f"(summary.json's cpu_wait_fraction): processes other than its shards, workers and evaluator held the "
            f"cores (other programs, or the job's own data loaders or threads), and its times and samples/s show "
            f"that load as much as the mode")


def untrained_warning(s: dict, script: bool) -> str:
    """What a job that ended without a training step (summary.json's `samples` 0) left
    untrained, or '': its model is the initial one, and its line alone (accuracy, 0
    samples/s, exit 0) does not say so (a script that never calls ps.step())."""
    if s.get("samples") != 0:
        return ""
    return ("no worker took a training step (0 samples): the model is untrained" +
            ("; does the script call ps.step() for each batch?" if script else ""))


def cmd_compare(args) -> int:
    from .compare import main as compare_main
    return compare_main(args)


def _started(args) -> None:
    """Tell psgd run that this daemon has loaded its code (its start-up progress). What
    it imported lives as long as it does: frozen out of the collector's sight, or every
    full collection would visit torch's ~170k objects (0.13-0.14 s, a pause mid-run in
    a worker), and, in a daemon forked from psgd/forkserver.py, write to every page it
    shares with the server."""
    gc.freeze()
    if args.started_file:
        try:
            with open(args.started_file, "w"):
                pass
        except OSError as e:  # progress only: not a reason to stop
            print(f"psgd {args.cmd}: cannot write {args.started_file}: {e}", file=sys.stderr)


def cmd_daemon(args) -> int:
    from .launcher import adopt_folder_token
    from .metrics import PidFile, process_start_time
    cfg = _config(args)
    adopt_folder_token(args.out)   # started by hand into a psgd run job's folder: that job's token
    if args.cmd == "coordinator":
        from .servers.coordinator import Coordinator
        from .transport import bind_address
        _check_bind(cfg, [bind_address(cfg.coordinator_address())], args.insecure)
        _started(args)
        if args.launched_at is not None:
            launched: dict = {"launched_at": args.launched_at, "launched_by": "launcher"}
        elif (t := process_start_time()) is not None:
            launched = {"launched_at": t, "launched_by": "coordinator process"}
        else:
            launched = {}
        with PidFile(args.out, "coordinator", 0):
            return Coordinator(cfg, args.out, **launched).serve()
    if args.cmd == "server":
        # A shard computes on the CPU. On a GPU machine torch's Adam and AdamW steps ask for
        # the current CUDA stream even of CPU tensors, which opened a context (hundreds of
        # MB) on GPU 0 in every shard mid-job: no GPU is visible to it.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        from .servers.shard_server import ShardServer
        from .transport import bind_address
        if not 0 <= args.shard < cfg.cluster.servers:
            raise ConfigError(f"--shard {args.shard} is out of range: cluster.servers = {cfg.cluster.servers}")
        _check_bind(cfg, [bind_address(cfg.shard_address(args.shard))], args.insecure)
        _started(args)
        with PidFile(args.out, "server", args.shard):
            return ShardServer(cfg, args.shard, args.out).run()
    if args.cmd == "worker":
        from .workers.worker import Worker
        if args.rank != -1 and not 0 <= args.rank < cfg.cluster.workers:   # (it waited, then asked for rank 0)
            raise ConfigError(f"--rank {args.rank} is out of range: cluster.workers = {cfg.cluster.workers} "
                              f"(ranks 0..{cfg.cluster.workers - 1}; without --rank, the next free one)")
        _started(args)
        return Worker(cfg, args.out, args.device, args.rank).run()  # writes its pid once it has a rank
    from .workers.evaluator import Evaluator
    _started(args)
    with PidFile(args.out, "evaluator", 0):
        return Evaluator(cfg, args.out, args.device).run()


def cmd_shards(args) -> int:
    from .data import describe
    from .models import build_model
    from .sharding import ShardMap
    cfg = _config(args, {"cluster.servers": args.servers})
    shape, classes = describe(cfg.data)
    model = build_model(cfg.model.name, shape, classes, cfg.job.seed, cfg.model.hidden)
    print(ShardMap.for_model(model, cfg.cluster.servers, cfg.placement).describe())
    return 0


def cmd_simulate(args) -> int:
    from .simulate import main as simulate_main
    return simulate_main(args)


def cmd_status(args) -> int:
    from .status import main as status_main
    return status_main(args)


def cmd_keys(args) -> int:
    from .keys import make_keys
    if not args.dir:
        raise ConfigError("psgd keys: give a folder to write the keys into (psgd keys DIR)")
    if os.path.exists(args.dir) and not os.path.isdir(args.dir):
        raise ConfigError(f"psgd keys: {args.dir} is a file, not a folder (psgd keys DIR makes or completes "
                          f"the folder DIR)")
    print(make_keys(args.dir))
    return 0


def check_sets(argv: list[str]) -> None:
    """`--set KEY VALUE` (a space for the `=`) would make VALUE the CONFIG argument and
    fail later as "config file VALUE does not exist": say what is wrong instead."""
    for i, arg in enumerate(argv):
        if arg == "--set" and i + 1 < len(argv):
            item = argv[i + 1]
        elif arg.startswith("--set="):
            item = arg[len("--set="):]
        else:
            continue
        nxt = i + (2 if arg == "--set" else 1)   # the argument after the item
        after = argv[nxt] if nxt < len(argv) else ""
        if "=" in item and "=" in after and not after.startswith("-") and not os.path.exists(after):
            # --set a=1 b=2: b=2 became the CONFIG argument ("config file b=2 does not exist")
            raise ConfigError(f"--set {item} {after}: each --set takes one SECTION.KEY=VALUE; did you mean "
                              f"--set {item} --set {after}?")
        if "=" in item or item.startswith("-"):
            continue  # a well-formed item; or none at all, which argparse reports
        rest = argv[i + 2:i + 4] if arg == "--set" else []
        value = rest[0] if rest else ""
        if value == "=":  # --set train.steps = 100
            value = rest[1] if len(rest) > 1 else ""
        elif value.startswith("="):  # --set train.steps =100
            value = value[1:]
        if not value or value.startswith("-") or os.path.exists(value):
            value = "VALUE"  # nothing that looks like the value: the key alone was given
        raise ConfigError(f"--set {item}: expected SECTION.KEY=VALUE, one word; did you mean --set {item}={value}?")


ENV_DEFAULTS = (("config", "PSGD_CONFIG", ""), ("out", "PSGD_OUT", "--out"), ("device", "PSGD_DEVICE", "--device"))


def from_environment(args, argv: list[str]) -> dict[str, str]:
    """CONFIG, --out and --device that came from $PSGD_CONFIG, $PSGD_OUT or $PSGD_DEVICE,
    not from the command line: {what an error names them by: "$VARIABLE=value"}. (An
    error of `--device 'gpu'` or `config file x.toml`, neither typed, left the user to
    guess where it came from.)"""
    found = {}
    for dest, var, flag in ENV_DEFAULTS:
        value = getattr(args, dest, None)
        if not value or value != os.environ.get(var):
            continue
        given = value in argv if dest == "config" else any(a == flag or a.startswith(flag + "=") for a in argv)
        if not given:
            found[flag or str(value)] = f"${var}={value}"
    return found


def with_env(message: str, env: dict[str, str]) -> str:
    """An error message, with the variable that gave a value it names (`from_environment`)."""
    notes = [note for name, note in env.items() if name in message]
    return f"{message} ({', '.join(notes)})" if notes else message


class Terminated(KeyboardInterrupt):
    """SIGTERM to `psgd run`, `psgd compare` or `psgd simulate`: the job stops as on Ctrl-C
    (its daemons, or simulate's `--jobs` processes, are stopped; compare writes the report
    of the runs done), and the exit code is 143."""


class HungUp(Terminated):
    """SIGHUP (the terminal closed) to `psgd run`, `psgd compare` or `psgd simulate`: the
    job stops as on SIGTERM, and the exit code is 129. By default the hang-up (the shell's,
    to the job's whole process group) killed every process of the job at once: no shard
    checkpointed, every pid file stayed."""


def _terminate(signum, frame) -> None:
    raise Terminated()


_TERMINALS: list[int] = []   # this command's stdout and stderr where they were a terminal at its start


def _hung_up_terminal() -> None:
    """A terminal that hung up fails every write (EIO): the stopped command's last lines
    raised in its `except` blocks (psgd run exited 1, not 129; psgd compare wrote no
    report). Its stdout and stderr, where they were that terminal, go to /dev/null."""
    for fd in _TERMINALS:
        if not os.isatty(fd):   # (a hung-up terminal is not one any more)
            to_devnull(fd)


def _hang_up(signum, frame) -> None:
    _hung_up_terminal()
    raise HungUp()


def _hang_up_daemon(signum, frame) -> None:
    """SIGHUP to a daemon (its terminal closed: the shell hangs up each of its jobs'
    process groups, so every daemon of a `psgd run` started there gets one; the kernel
    itself sends it to the session's leader only): as SIGTERM, whatever handles that now
    (a shard checkpoints first)."""
    _hung_up_terminal()
    signal.raise_signal(signal.SIGTERM)


def _exit_on_term(signum, frame) -> None:
    """SIGTERM to a coordinator, worker or evaluator daemon: exit 143 through its
    `finally` blocks (its pid file goes; the default action left it behind). A shard
    server installs its own handler: it checkpoints first."""
    raise SystemExit(128 + signal.SIGTERM)


def stopped_by(e: KeyboardInterrupt) -> str:
    """How a command was stopped, as its line says it."""
    return {129: "hung up (SIGHUP)", 143: "terminated"}.get(interrupted_code(e), "interrupted")


def interrupted_code(e: KeyboardInterrupt) -> int:
    """The exit code of a command stopped by Ctrl-C (130), SIGTERM (143) or SIGHUP (129)."""
    return 128 + (signal.SIGHUP if isinstance(e, HungUp) else signal.SIGTERM if isinstance(e, Terminated)
                  else signal.SIGINT)


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def main(argv: list[str] | None = None, *, own_process: bool | None = None, forked: bool = False) -> int:
    """psgd's command line. `own_process`: this call is the command of its process, which
    exits when it returns: its entry points (`psgd`, the console script, which can pass
    nothing: main() with no argv; `python -m psgd`; `python -m psgd.simulate`; a daemon
    forked by psgd/forkserver.py, also `forked`: its process ends in os._exit). Its terminal
    is the command's (a hang-up sends its output to /dev/null), and its work done, a signal
    ends it at once (`exit_on_signals`). Any other call, `main([...])` from Python (a test,
    a notebook), leaves its caller's terminal alone and gives back the signal handlers it
    had: it kept the command's."""
    own = argv is None if own_process is None else own_process
    main_thread = threading.current_thread() is threading.main_thread()
    before = {s: signal.getsignal(s) for s in SIGNALS} if main_thread and not own else {}
    try:
        return _main(argv, own)
    finally:
        if own and main_thread:
            exit_on_signals(forked)
        for s, handler in before.items():
            if handler is not None:   # (None: not set from Python)
                signal.signal(s, handler)


def exit_on_signals(forked: bool = False) -> None:
    """The command's work is done and its process exits (psgd's own: `psgd ...`, `python
    -m psgd ...`): Ctrl-C, SIGTERM or SIGHUP now ends it at once, as a signal's default action
    does. Its handlers, left in place, raised KeyboardInterrupt or SystemExit inside the
    interpreter's exit (threading._shutdown), a traceback on the terminal: SIGTERM to a
    `psgd run` job's process group reached the coordinator just after it had written the
    summary. Nothing is left to clean up: every `finally` has run, and the output is
    flushed first (to a file or a pipe, its last lines waited in Python's buffer for the
    exit's flush, which the signal's default action skips). During the flush the signals
    are blocked in this thread (a write would stop with EINTR and run a handler), and one
    another thread takes (a daemon's heartbeat thread) is only noted by the handler; the
    first comes after, with its default action. A daemon `forked` by psgd/forkserver.py
    keeps them blocked, and noted only, until its os._exit: a default action there killed
    it by the signal, not with its exit code. (A signal the process was started ignoring,
    as Ctrl-C in a shell's background job, stays ignored.)"""
    ours = [s for s in SIGNALS if callable(signal.getsignal(s))]
    came: list[int] = []
    for s in ours:
        signal.signal(s, lambda signum, frame: came.append(signum))
    before = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):   # (a dead terminal; closed; None)
            stream.flush()
    if forked:
        return
    for s in ours:
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, before)   # (one this thread held: its default action now; one
    #                                                      blocked before the command stays so)
    if came:
        signal.raise_signal(came[0])


def _main(argv: list[str] | None, own_process: bool) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if os.getcwd() not in sys.path:  # as `python -m psgd`: a `package.module:factory` in the folder it runs in
        sys.path.insert(0, os.getcwd())
    script_args: list[str] = []
    if "--" in argv:  # psgd run --script FILE ... -- ARGS: the rest is the script's, not checked here
        script_args, argv = argv[argv.index("--") + 1:], argv[:argv.index("--")]
    try:
        check_sets(argv)
    except ConfigError as e:
        print(f"psgd: error: {e}", file=sys.stderr)
        return 2
    try:
        ap = parser()
        args, extra = ap.parse_known_args(argv)
    except KeyboardInterrupt:   # Ctrl-C while the verbs' modules load: nothing started yet
        return 130
    if extra:
        print(f"psgd {args.cmd}: error: {_unrecognized(ap, args, argv, extra)}", file=sys.stderr)
        return 2
    args.script_args = script_args
    if script_args and not getattr(args, "script", None):
        print("psgd: error: arguments after -- are a training script's: give --script FILE", file=sys.stderr)
        return 2
    env = from_environment(args, argv)
    out = getattr(args, "out", None)
    if out and os.path.exists(out) and not os.path.isdir(out):   # (not an errno after the job was announced)
        print(f"psgd {args.cmd}: error: {with_env(f'--out {out} is a file, not a folder', env)}", file=sys.stderr)
        return 2
    # (not a daemon's: those of one job start at once into one folder, which one may make as another removes it)
    problem = _cannot_make(out) if out and args.cmd not in DAEMONS else ""
    if problem:
        print(f"psgd {args.cmd}: error: {with_env(problem, env)}", file=sys.stderr)
        return 2
    handlers = {"run": cmd_run, "compare": cmd_compare, "shards": cmd_shards, "keys": cmd_keys,
                "status": cmd_status, "simulate": cmd_simulate}
    main_thread = threading.current_thread() is threading.main_thread()
    hangup = main_thread and signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN   # (not under nohup)
    if main_thread:   # (a call from Python: its caller's terminal is not the command's)
        _TERMINALS[:] = [fd for fd in (1, 2) if own_process and os.isatty(fd)]
    if args.cmd in ("run", "compare", "simulate") and main_thread:
        signal.signal(signal.SIGTERM, _terminate)  # default: die at once, the daemons left running
        if hangup:
            signal.signal(signal.SIGHUP, _hang_up)
    elif args.cmd in DAEMONS and main_thread:
        signal.signal(signal.SIGTERM, _exit_on_term)
        if hangup:
            signal.signal(signal.SIGHUP, _hang_up_daemon)
    if args.cmd in DAEMONS:
        from .forkserver import end_with_launcher, take_cpu  # started by psgd run: it ends when psgd run does
        end_with_launcher()
        if own_process:   # (not a caller's process: `main([...])` from Python keeps its threads and limits)
            take_cpu()
            one_compute_thread()
            from .transport import raise_fd_limit  # (a worker's too: about 4 descriptors a shard)
            raise_fd_limit()
            if args.cmd == "coordinator":   # (its serve loop writes progress lines: on psgd run's terminal)
                write_aside()
    code: int | None = None
    try:
        code = _command(handlers.get(args.cmd, cmd_daemon), args, env)
    finally:
        flush_aside()   # (lines written aside: `write_aside`)
        if args.cmd in ("run", "compare"):
            _stop_fork_server(args.cmd, code)
    assert code is not None
    return code


def _cannot_make(out: str) -> str:
    """Why the output folder `out` cannot be made (its parent a file, read-only or under
    /proc), or, where it is a folder already, written in (read-only), or "". It was an
    errno after the job's checks, exit 1, and named neither --out nor $PSGD_OUT ("psgd
    run: error: No such file or directory: /proc/x"). Asked of its nearest folder that
    exists, with a folder of this process's own made and removed there: making `out`
    itself and removing it again raced with another command making a folder beside it
    (`--out sweep/a` and `--out sweep/b` at once), whose parent one removed as the other
    made its own. (An `out` that is a file is said by the command's own check.)"""
    folder = os.path.abspath(out)
    while not os.path.lexists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    there = folder == os.path.abspath(out)
    if there and not os.path.isdir(folder):
        return ""
    probe = os.path.join(folder, f".psgd-out-check-{os.getpid()}-{threading.get_ident()}")
    try:
        os.mkdir(probe)
    except OSError as e:
        return f"--out {out}: cannot {'write in' if there else 'make'} this folder: {e.strerror or e}"
    with contextlib.suppress(OSError):
        os.rmdir(probe)
    return ""


def one_compute_thread() -> None:
    """A daemon's torch computes on one thread unless OMP_NUM_THREADS says otherwise, as
    under `psgd run`, the Dockerfile and the Slurm scripts: a daemon started by hand took
    torch's default, a thread per core, and the processes of a job on one machine fought
    for the cores (a job of hand-started daemons on 2 cores: 1,692 samples/s against
    23,335 with one thread each)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    os.environ["OMP_NUM_THREADS"] = "1"   # (before torch is imported: its pools and numpy's BLAS read it)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _unrecognized(ap: argparse.ArgumentParser, args, argv: list[str], extra: list[str]) -> str:
    """The one line for arguments no option takes (argparse printed the top-level usage and
    "psgd: error: unrecognized arguments: --batch"): a training script's options given
    before `--` say where they go (the README's `psgd run --script S -- --batch 64` without
    its `--`); a misspelt option names the closest one (`--mdoe`: --mode)."""
    import collections
    import difflib
    said = " ".join(extra)
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices[args.cmd]
    options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    meant = ""
    for word in extra:
        close = difflib.get_close_matches(word.split("=")[0], options, n=1, cutoff=0.75)
        if word.startswith("--") and close:
            meant = f"did you mean {close[0]}?"
            break
    if args.cmd == "run" and getattr(args, "script", None):   # (a misspelt option of psgd's, or the script's own)
        config = args.config if (args.config and args.config != os.environ.get("PSGD_CONFIG")
                                 and not os.path.exists(args.config)) else None
        # In the order typed (a value after one is taken as CONFIG), from the end: the script's
        # come after psgd's own, whose values may repeat them (`--workers 2 --batch 2`).
        left = collections.Counter(extra + ([config] if config else []))
        theirs: list[str] = []
        for a in reversed(argv):
            if left[a] > 0:
                left[a] -= 1
                theirs.insert(0, a)
        either = f"{meant} Or, if they are the script's, " if meant else ""
        return (f"unrecognized arguments: {said} ({either}"
                f"arguments for the script go after --: psgd run --script {args.script} [options] -- "
                f"{' '.join(theirs)})")
    if meant:
        return f"unrecognized arguments: {said}; {meant} (psgd {args.cmd} --help lists them)"
    return f"unrecognized arguments: {said} (psgd {args.cmd} --help lists the options)"


def _stop_fork_server(cmd: str, code: int | None) -> None:
    """psgd run's and compare's last step, once the command has its exit code (`code`;
    None: an exception goes on): their fork server is stopped. A Ctrl-C, SIGTERM or SIGHUP
    meanwhile waits for that stop (a terminal's next Ctrl-C does not cut it short), then
    is noted, and the command exits with its own code, as one that came while the daemons
    of an ended job stopped (it exited 143 with nothing said, after the summary)."""
    from .forkserver import shutdown
    from .launcher import signals_held
    try:
        with signals_held():
            shutdown()
    except KeyboardInterrupt as e:   # held, raised once the stop was over
        if code is not None:
            print(f"psgd {cmd}: {stopped_by(e)} while it exited; its exit code stands ({code})", file=sys.stderr)


def _command(handler, args, env: dict[str, str]) -> int:
    """The command's exit code: its handler's, or the one for what it raised (said as
    `say` says a line: after a coordinator's lines still waiting, `log.write_aside`)."""
    try:
        return handler(args)
    except ConfigError as e:
        say(f"psgd: error: {with_env(str(e), env)}")
        return 2
    except AddressInUse as e:
        say(f"psgd {args.cmd}: error: {e}")
        return EXIT_ADDRESS_IN_USE
    except (RemoteError, WireError) as e:   # a peer's answer that ends this daemon (refused by the
        say(f"psgd {args.cmd}: error: {e}")   # coordinator), or a request no peer reads
        return 1
    except OutputError as e:   # a full disk, a read-only or vanished folder: a daemon started again fails again
        with contextlib.suppress(OSError):   # (a daemon's stderr is a log on that same disk)
            say(f"psgd {args.cmd}: error: {e}")
        return EXIT_CANNOT_WRITE if args.cmd in DAEMONS else 1
    except BrokenPipeError:   # `psgd shards | head -1`: the reader is gone; end as SIGPIPE would, quietly
        to_devnull(sys.stdout.fileno())   # (the exit's flush would fail again)
        return 128 + signal.SIGPIPE
    except (OSError, TimeoutError) as e:
        if isinstance(e, OSError) and e.errno == errno.EIO and any(not os.isatty(fd) for fd in _TERMINALS):
            _hung_up_terminal()   # a line to the terminal after it hung up (before, or without, its SIGHUP):
            return 128 + signal.SIGHUP   # saying so to it failed again (exit 1, a traceback)
        if isinstance(e, OSError) and e.errno == errno.EMFILE:
            return _out_of_descriptors(args.cmd)
        said = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.strerror and e.filename else e
        say(f"psgd {args.cmd}: error: {said}")
        return 1
    except KeyboardInterrupt as e:
        return interrupted_code(e)
    except Exception as e:
        if getattr(e, "errno", None) != errno.EMFILE:   # (ZeroMQ's, zmq.ZMQError, is no OSError)
            raise
        return _out_of_descriptors(args.cmd, zeromq=True)


def _out_of_descriptors(cmd: str, zeromq: bool = False) -> int:
    """The one line for a process out of file descriptors (each connection and socket
    takes some: a daemon raises its soft limit itself, up to the hard one); exit 1.
    ZeroMQ says the same of a context at its limit of sockets (`zeromq`)."""
    from .metrics import fd_limit
    also = "; or ZeroMQ's limit of sockets a process, 1,023 by default: about 3 a peer" if zeromq else ""
    say(f"psgd {cmd}: error: {os.strerror(errno.EMFILE)} ({fd_limit()}: raise it{also})")
    return 1
