"""Your own training loop as a psgd worker.

    import psgd
    ps = psgd.connect(model, optimizer)      # joins the job (blocks until every worker has)
    for x, y in loader:                      # ps.rank / ps.world_size: which part of the data is yours
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if not ps.step(loss):                # the mode decides what happens here
            break
    ps.report(accuracy=acc, loss=test_loss)  # optional: summary.json's score when the job has no evaluator
    ps.close()                               # also `with psgd.connect(...) as ps:`

`connect` reads the job's config from `config` (a path or a Config), else $PSGD_CONFIG,
then `PSGD_<SECTION>_<KEY>` variables; the output folder from `out` or $PSGD_OUT; the
rank to ask for from `rank` or $PSGD_RANK (default: the next free one). `psgd run
--script FILE` sets all three for each copy of the script it starts. A model on a GPU
(cuda:N) makes cuda:N the current CUDA device, as `psgd worker --device cuda:N` does.

What `step()` does is the mode's worker schedule (psgd/consistency/), the same one
`psgd worker` runs, with the script's backward pass as its compute:
- sync, ssp, async: push the gradients in the model's `.grad` (a sparse one as dense),
  pull the next model into the model's parameters. The shards run `[optimizer]`; `optimizer` may be None (one
  given is not stepped).
- easgd, diloco, ltfb: step `optimizer` locally (psgd's `[optimizer]` when None; the
  script's own keeps its learning rate, psgd's lr schedule does not touch it: a loop that
  also calls `optimizer.step()` itself is a JobError at the next step()) and
  exchange every tau / H / round (an ltfb trainer of several workers steps on its group's
  mean gradient, sparse where the script's was: SparseAdam takes no dense one).
- ltfb needs `score=fn`: `fn(model)` returns the model's accuracy on the trainer's
  tournament data (higher is better), or an `(accuracy, loss)` pair; what fn raises
  (in step(), or close()'s final deposit) ends the job with its reason and is raised.
It returns False once the job's budget (`train.steps`, `train.seconds`) is spent or the
job has ended; then it does nothing more.

`step()` with no gradient at all (every trainable parameter's `.grad` is None: no
`loss.backward()`) raises `JobError` in every mode: it would push zeros, or step a local
optimizer that skips parameters without one.
A model changed after `connect` (a layer replaced or added, a tensor given new storage:
`.double()`, `.to(...)`, `p.data = ...`) raises `JobError` at the first `step()` and at
`close()`: psgd reads the gradients from and loads the model into the tensors it was given.

The shards learn the model from the workers: its layout (names, shapes, dtypes) when
the workers register, rank 0's initial values when it connects (psgd/layout.py), so the
servers never import the script. Frozen parameters and integer buffers are not sent:
every worker must build them alike (the layout carries their fingerprint; a worker whose
differ is refused). A model with no trainable parameter, a lazy layer not yet initialized,
a complex trainable parameter or tensors on more than one device is a ConfigError. On `close()`,
rank 0 waits for the other workers to finish (while they are live, however long),
loads the job's final global model into its `model` and saves it as
DIR/model.pt (a state_dict); if another worker fails meanwhile, close() raises
`JobError` and saves nothing (a coordinator that stops answering for cluster.timeout_s
is a `JobError` too). A Ctrl-C in close() is raised once the worker has left the job,
within seconds (rank 0's hold on the job's end released; a share not yet settled ends
the job with it, as inside `with`); so is one inside `with`, or uncaught outside it
(the job told its reason if the coordinator answers within a heartbeat's answer time).
A worker that fails (too many refused steps, shards unreachable) raises `JobError`, as
do a refused `connect` (the rank is taken) and a `report()` after the job ended; an
exception inside `with` ends the job with its reason (`sys.exit()` or `sys.exit(0)`
there is a clean end), and so does one that the script does not catch while a
connection is open without `with` (`sys.excepthook`, unless the script set its own, or
runs at an interactive prompt).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import multiprocessing
import operator
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from . import layout as layouts
from . import wire
from .config import Config, ConfigError, load
from .consistency import get as get_mode
from .forkserver import end_with_launcher
from .launcher import JOINED, adopt_folder_token
from .log import log
from .membership import beat_answer_s
from .metrics import PidFile
from .replica import pick_device
from .shard import save_state_dict
from .sharding import model_entries, model_tensors
from .transport import HandshakeFailed, PeerTimeout
from .workers.client import Cancelled, ShardUnreachable
from .workers.worker import Worker, local_rank

FINAL_POLL_S = 0.2


class JobError(RuntimeError):
    """The job cannot go on for this worker: the reason, in one line."""


def _aborted(reason: str) -> JobError:
    """What step() and close() raise in a job that was aborted (another worker failed)."""
    return JobError(f"the job was aborted: {reason}")


# psgd's own failures, not the script's: a shard unreachable, or answering with an error
# (a fault in serving, a request it found malformed), the coordinator not answering. A
# step or a close that meets one ends the job with it and raises JobError: raised as they
# were, `except psgd.JobError` missed them, and the job's reason blamed the script.
FAILURES = (ShardUnreachable, wire.RemoteError, PeerTimeout, HandshakeFailed)


def _failure(rank: int, e: BaseException) -> str:
    """The job's reason for ending when worker `rank` met psgd's failure `e` (FAILURES)."""
    return str(e) if isinstance(e, ShardUnreachable) else f"worker {rank}: {e}"


def connect(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
            score: Callable[[nn.Module], Any] | None = None, config: str | Config | None = None,
            out: str | None = None, rank: int | None = None) -> Connection:
    """Join the job as a worker (see this module's docstring)."""
    from .transport import forget_socket_keys
    forget_socket_keys()   # (this process's earlier job's keys, re-made since in the same folder, say)
    return Connection(model, optimizer, score=score, config=config, out=out, rank=rank)


def device() -> torch.device:
    """The device for this worker's model: `psgd run --device` (PSGD_DEVICE; default
    auto: GPU LOCAL_RANK % GPUs where there is CUDA, else the CPU; empty: auto). A
    script started by hand sets the variable itself: an error names it, not the flag."""
    return pick_device(os.environ.get("PSGD_DEVICE", "").strip() or "auto", local_rank(),
                       name="PSGD_DEVICE")


def _sample_count(samples: Any) -> int:
    """step()'s `samples` as an int: a Python or numpy integer, or a one-element integer
    tensor (`mask.sum()`). Kept as given, it could not be sent: the step line and the
    heartbeats failed, and the worker was lost. Anything else is a ConfigError: a bool
    too (Python's True is the integer 1, and a bool tensor's index is one, which counted
    `samples=True` as one sample)."""
    try:
        boolean = isinstance(samples, bool) or getattr(samples, "dtype", None) == torch.bool
        n = -1 if boolean else operator.index(samples)
    except TypeError:
        n = -1
    if n < 0:
        raise ConfigError(f"step(samples={samples!r}): samples is the batch's size, a count of samples "
                          f"(an integer >= 0)")
    return n


def _described(value: Any) -> str:
    """A value that is not one number, for an error: a tensor by its shape, else its repr."""
    return f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)[:60]


def _number(value: Any) -> float | None:
    """`value` as a float if it is one number (a Python or numpy number, a one-element
    tensor), else None (None, text, a list, a tensor of several values)."""
    try:
        return float(value.detach().item() if isinstance(value, torch.Tensor) else value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _loss_value(loss: Any) -> float | None:
    """step()'s `loss` as a float (None: not given): a number or a one-element tensor.
    Anything else (the per-sample losses of reduction="none", a list) is a ConfigError,
    not torch's or float()'s error from inside step()."""
    if loss is None:
        return None
    value = _number(loss)
    if value is None:
        raise ConfigError(f"step(loss={_described(loss)}): loss is the batch's loss, one number (a float or a "
                          f"one-element tensor: the mean of per-sample losses)")
    return value


def _needs_a_closure(opt: Any) -> bool:
    """Does an optimizer's step() need an argument (LBFGS's `closure`)? A local mode calls
    it as `step()`: the TypeError would come from inside psgd's step, as if the script
    had raised it. An LR scheduler wraps `opt.step` on the instance (a plain function
    whose signature, read through `__wrapped__`, is the class's unbound `(self, closure=None)`):
    what it calls, the wrapped function bound to `opt`, says what step() takes; read
    as it was, `self` made every optimizer with a scheduler "need a closure"."""
    step = opt.step
    if not inspect.ismethod(step) and inspect.isfunction(getattr(step, "__wrapped__", None)):
        step = step.__wrapped__.__get__(opt, type(opt))
    try:
        params = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):   # (no signature to read: taken as it is)
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               for p in params)


def _rank_from_env(text: str) -> int:
    """$PSGD_RANK: a rank (0, 1, ...), or unset or empty for the next free one."""
    text = text.strip()
    if not text:
        return -1
    try:
        rank = int(text)
    except ValueError:
        rank = -2
    if rank < 0:
        raise ConfigError(f"PSGD_RANK must be a worker rank (0, 1, ...) or unset, not {text!r}")
    return rank


def _argument_problem(model: Any, optimizer: Any, score: Any, config: Any, rank: Any, out: Any) -> str:
    """Why connect's arguments are not what it takes (a type), or '': checked before
    anything is sent, instead of an AttributeError or TypeError from inside psgd (or, for
    an optimizer, nothing in the modes that do not step it, a ConfigError that ended the
    job in the others)."""
    if not isinstance(model, nn.Module):
        return (f"psgd.connect(model, optimizer): model must be a torch.nn.Module, not {type(model).__name__}"
                + (" (model and optimizer swapped?)" if isinstance(model, torch.optim.Optimizer) else ""))
    if optimizer is not None and (isinstance(optimizer, type) or not callable(getattr(optimizer, "step", None))
                                  or not isinstance(getattr(optimizer, "param_groups", None), list)):
        what = f"the class {optimizer.__name__}" if isinstance(optimizer, type) else _described(optimizer)
        return (f"psgd.connect(model, optimizer): optimizer must be a torch.optim.Optimizer or None, not {what} "
                f"(an optimizer of the model's parameters: torch.optim.SGD(model.parameters(), lr=0.1))")
    if score is not None and not callable(score):
        return f"psgd.connect(score=...) must be a function of the model, not {_described(score)}"
    if config is not None and not isinstance(config, (str, os.PathLike, Config)):
        return f"psgd.connect(config=...) must be a config file's path or a psgd Config, not {type(config).__name__}"
    if out is not None and not isinstance(out, (str, os.PathLike)):
        return f"psgd.connect(out=...) must be the job's output folder (a path), not {type(out).__name__}"
    if rank is not None and (isinstance(rank, bool) or not hasattr(type(rank), "__index__")):
        return f"psgd.connect(rank=...) must be a worker rank (an integer: 0, 1, ...), not {rank!r:.60}"
    return ""


def _folder_problem(out: str | None, given: str) -> str:
    """Why the job's output folder `out` (`given` as out= or PSGD_OUT) cannot be written,
    or '': made here if it is not there, as the worker's step log would make it."""
    if not out:
        return ""
    events = os.path.join(out, "events")
    try:
        os.makedirs(events, exist_ok=True)
        if not os.access(events, os.W_OK | os.X_OK):   # (there already, read-only: makedirs says nothing)
            raise PermissionError(13, "Permission denied", events)
    except OSError as e:
        return (f"psgd.connect: {given} {out!r} is not a folder this worker can write its step log in "
                f"({e.strerror or e}{': ' + e.filename if e.filename and e.filename != out else ''}): "
                f"give the job's output folder (psgd run --out)")
    return ""


def _model_problem(model: nn.Module) -> str:
    """Why psgd cannot train `model`, or '': checked before registering, instead of
    torch's error from inside psgd (a lazy module's shape, a complex table's cast)."""
    if not any(p.requires_grad for p in model.parameters()):
        return ("the model has no trainable parameters (none with requires_grad=True): psgd trains a model's "
                "trainable parameters; unfreeze some before connecting")
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if nn.parameter.is_lazy(t):
            return (f"{name} is not initialized yet (a lazy module: nn.LazyLinear, ...): run one forward pass "
                    f"on a batch before psgd.connect, so that the model has its shapes")
    for name, p in model.named_parameters():
        if p.requires_grad and not p.is_floating_point():
            return (f"{name} is a trainable {str(p.dtype).removeprefix('torch.')} parameter: psgd trains real "
                    f"floating-point parameters (float32, float16, bfloat16, float64)")
    where: dict[torch.device, str] = {}   # device -> its first tensor (a model split over GPUs, or GPU and CPU)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        where.setdefault(t.device, name)
    if len(where) > 1:
        (first, _), *_ = where.items()
        return (f"the model's tensors are on {len(where)} devices ("
                + ", ".join(f"{name} on {dev}" for dev, name in where.items())
                + f"): psgd keeps one copy of the model on one device, and would have moved all of it to {first} "
                  f"(the first parameter's); put the whole model on one device before connecting")
    return ""


_OPEN: weakref.WeakSet[Connection] = weakref.WeakSet()   # this process's connections, until they end


def _end_on_uncaught(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """sys.excepthook while a connection is open: a script that raises outside `with`
    (the README's first example closes by hand) ends the job with its reason, as `with`
    does, instead of leaving the other workers to train on until the job's end while the
    coordinator waits out its heartbeats. The traceback is printed first."""
    sys.__excepthook__(kind, value, tb)
    for c in list(_OPEN):
        if not c.closed:
            try:
                c._close_raised(value)
            except Exception as e:  # (the job may be gone already: nothing more to tell)
                log(f"worker-{c.rank}", f"could not end the job: {type(e).__name__}: {e}")


def _importing_main() -> bool:
    """Is this a child process that 'spawn' or 'forkserver' started (a DataLoader's
    worker: `multiprocessing_context="spawn"`), running the script's top level to
    import it? A script without `if __name__ == "__main__":` calls connect there: the
    child registered for the script's rank (the environment's PSGD_RANK), took it over
    from the script, and the script's step failed. (multiprocessing's own check, which
    torch's reads too: `_inheriting` is set while the child imports the main module.)"""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def _connected_already(address: str, model: nn.Module, rank: int) -> str:
    """Why this process may not connect `model` as `rank` (-1: any) to the job at `address`,
    or '': a second connect of the same model, or for a rank this process holds, would
    register as another process taking that rank over, and the first connection was told
    so and stopped, with "rank R was taken over by another process"."""
    for c in list(_OPEN):
        if c.closed or c.link.address != address:
            continue
        if c.replica.model is model or c.rank == rank:
            what = "this model" if c.replica.model is model else f"rank {rank}"
            return (f"psgd.connect: {what} is connected to this job already (rank {c.rank}, by an earlier "
                    f"psgd.connect in this process): use that connection, or close() it first")
    return ""


def _left_out_by_optimizer(opt: Any, model: nn.Module, mode: str) -> str:
    """In a mode whose shards train every trainable parameter with `[optimizer]` (sync,
    ssp, async), a script's optimizer that holds some of them and not the others says
    that the script trains only those (a head fine-tuned, the backbone left out of the
    optimizer but not frozen): the shards trained the others too, without a word. Why
    that is refused, or ''. (An optimizer of none of them is of no use here, and harms none.)"""
    groups = getattr(opt, "param_groups", None)
    if not isinstance(groups, list):
        return ""
    held = {id(p) for g in groups if isinstance(g, dict) for p in g.get("params", ())}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    left = [n for n, p in trainable if id(p) not in held]
    if not left or len(left) == len(trainable):
        return ""
    named = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
    return (f"psgd.connect's optimizer holds {len(trainable) - len(left)} of the model's {len(trainable)} trainable "
            f"parameters, not {named}: in mode {mode} the shards train every trainable parameter with [optimizer] "
            f"(the script's optimizer is not stepped), so they would train those too; freeze them before "
            f"psgd.connect (p.requires_grad_(False)), or give an optimizer of all of them, or none")


def _hook_uncaught() -> None:
    """Install `_end_on_uncaught`: not over a hook the script or a debugger set, nor at an
    interactive prompt, where the hook sees every error typed and the session goes on."""
    if sys.excepthook is sys.__excepthook__ and not (hasattr(sys, "ps1") or sys.flags.interactive):
        sys.excepthook = _end_on_uncaught


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """Another Ctrl-C taken and dropped while a connection leaves the job after one
    (`_interrupted`, a bounded wait): raised there, it cut the release and the closing short
    (the hold left in place, the sockets open), and the KeyboardInterrupt that close()
    raises, or that the script's `with` lets through, says it already. Python takes signals
    in the main thread only; there, the script's handler is put back after. SIG_IGN and
    SIG_DFL (no KeyboardInterrupt) are left as they are."""
    was = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(was):
        yield
        return
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, was)


def _alone(call: Callable | None = None, *, what: str = "") -> Callable:
    """A connection's call, refused (JobError, and nothing done) while another thread is
    in one of its calls: they share its sockets, which are not thread-safe (ZeroMQ's: two
    calls at once can kill the process, or take each other's answers), as an evaluation
    thread's report() beside the loop's step() or close() would. One thread after another
    is fine. `what`: the call as the error names it (default its name: `step()`), for
    one the script makes without naming it (`@_alone(what=...)`)."""
    if call is None:
        return functools.partial(_alone, what=what)
    what = what or f"{call.__name__}()"

    @functools.wraps(call)
    def alone(self: Connection, *args: Any, **kwargs: Any) -> Any:
        if not self._busy.acquire(blocking=False):
            raise JobError(f"{what} while another thread is in a call of this connection: a "
                           f"connection is used by one thread at a time (its sockets are not thread-safe)")
        try:
            return call(self, *args, **kwargs)
        finally:
            self._busy.release()
    return alone


class Connection(Worker):
    own_model = False   # the script's model: its tensors stay where the script has them

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 score: Callable[[nn.Module], Any] | None = None, config: str | Config | None = None,
                 out: str | None = None, rank: int | None = None):
        self._busy = threading.Lock()   # held by the call under way (`_alone`)
        self._trained_at: float | None = None   # when step() first said False (`_trained`)
        self._closing_at: float | None = None   # when close() began
        self._stepped: list | None = None       # the gradients the last step took (`_gradients`)
        problem = _argument_problem(model, optimizer, score, config, rank, out)
        if problem:
            raise ConfigError(problem)
        if _importing_main():
            raise ConfigError("psgd.connect was called by a child process (a DataLoader worker started with "
                              "'spawn' or 'forkserver') that runs the script's top level to import it: put the "
                              "script's training under `if __name__ == \"__main__\":`")
        rank = None if rank is None else operator.index(rank)   # (a numpy integer: sent as an int)
        env = os.environ
        cfg = config if isinstance(config, Config) else load(config or env.get("PSGD_CONFIG"))
        want = rank if rank is not None else _rank_from_env(env.get("PSGD_RANK", ""))
        if want >= cfg.cluster.workers or (rank is not None and rank < 0):   # (-1 from the environment: any)
            raise ConfigError(f"rank {want} ({'rank=' if rank is not None else 'PSGD_RANK='}{want}) is not a worker "
                              f"rank of this job: 0..{cfg.cluster.workers - 1} (cluster.workers = "
                              f"{cfg.cluster.workers})")
        problem = _connected_already(cfg.coordinator_address(), model, want)
        if problem:
            raise ConfigError(problem)
        given = "out=" if out else "PSGD_OUT"
        out = os.fspath(out) if out else env.get("PSGD_OUT")
        problem = _folder_problem(out, given)
        if problem:   # (was: an OutputError from inside psgd, after registering, which ended the job)
            raise ConfigError(problem)
        adopt_folder_token(out)   # a script started by hand into a psgd run job's folder: that job's token
        super().__init__(cfg, out, want_rank=want)
        if env.get("PSGD_STARTED_FILE"):  # psgd run's start-up progress
            open(env["PSGD_STARTED_FILE"], "w").close()
        end_with_launcher()  # started by psgd run --script: it ends when psgd run does
        problem = _model_problem(model)   # before registering: the others are not held up
        if problem:
            raise ConfigError(f"psgd.connect: {problem}")
        self.user_optimizer = optimizer
        self.score_fn = score
        self.closed = False
        self._loss: float | None = None
        self._batch = 0
        try:
            cfg = self.join(model)
        except (wire.RemoteError, PeerTimeout, HandshakeFailed) as e:  # refused (the rank is taken, ...), or none
            self.link.close()
            unset = ""
            if isinstance(e, PeerTimeout) and config is None and not env.get("PSGD_CONFIG"):
                unset = ("; no config was given (psgd.connect(config=...), $PSGD_CONFIG), so this address is from "
                         "psgd's defaults" + (" and the PSGD_CLUSTER_* variables" if any(
                             k.startswith("PSGD_CLUSTER_") for k in env) else "")
                         + ": start the script with `psgd run --script`, or set PSGD_CONFIG to the job's config file")
            raise JobError(f"psgd.connect: {getattr(e, 'reason', e)}{unset}") from None
        if env.get("PSGD_STARTED_FILE"):  # ... and that this copy joined the job (a restarted one may not)
            with open(env["PSGD_STARTED_FILE"], "w") as f:
                f.write(JOINED)
        self._check(cfg, model)
        try:
            self.schedule = self.attach(model, next(model.parameters()).device)
        except Exception as e:   # the job is told at once, not after missed heartbeats
            self._report_end(f"worker {self.rank} could not start: {type(e).__name__}: {e}")
            self.link.close()
            raise
        # What the replica reads and writes: the tensors (and their storage) of the model as given.
        self._held = {name: self.replica.tensors[name].data_ptr() for name, _, _ in model_entries(model)}
        self._checked = False
        self.pidfile = PidFile(self.out, "worker", self.rank).__enter__()
        try:
            self.start(self.schedule)
        except (FAILURES + (Cancelled,)) as e:   # e.g. worker 0 left before the shards had its initial values
            abort = self._abort_heard()
            why = f"the job was aborted: {abort}" if abort else e.reason if isinstance(e, wire.RemoteError) else str(e)
            self._end(f"worker {self.rank} could not start: {why}")
            raise JobError(f"psgd.connect: {why}") from None
        except BaseException as e:
            self._end(f"worker {self.rank} could not start: {e}")
            raise
        self._computed_at = time.perf_counter()
        self._watch_the_scripts_optimizer()
        _OPEN.add(self)
        _hook_uncaught()

    def _abort_heard(self) -> str:
        """Why the job was aborted ('' if it was not), asking the coordinator once more
        (a heartbeat's answer time at most) where this worker's heartbeats have not said
        so yet: what ended a wait at the start (a shard's refusal, worker 0 having left
        before its initial values) can come before the heartbeat that says why the job
        ended, and connect then named the shard's refusal, not the reason."""
        if not self.link.state.get("abort"):
            with contextlib.suppress(PeerTimeout, HandshakeFailed, wire.RemoteError):
                self.link.beat(timeout=beat_answer_s(self.cfg))
        return self.link.state.get("abort") or ""

    def _watch_the_scripts_optimizer(self) -> None:
        """A local mode steps the script's optimizer in step(): a loop that still calls
        `optimizer.step()` itself (kept from a plain training loop, or `scaler.step(optimizer)`)
        stepped every batch twice, without a word (twice the learning rate; Adam's moments
        updated twice). A step hook counts the optimizer's steps that psgd did not take."""
        self._psgd_stepping = False
        self._script_steps = 0
        self._step_hook = None
        opt = self.user_optimizer
        if opt is None or not self.schedule.local_optimizer or not hasattr(opt, "register_step_pre_hook"):
            return
        me = weakref.ref(self)

        def counted(*_: Any) -> None:
            c = me()
            if c is not None and not c._psgd_stepping:
                c._script_steps += 1
        self._step_hook = opt.register_step_pre_hook(counted)

    @contextlib.contextmanager
    def _psgd_steps(self) -> Iterator[None]:
        """What the schedule does here steps the script's optimizer as psgd's own."""
        self._psgd_stepping = True
        try:
            yield
        finally:
            self._psgd_stepping = False

    def _refuse_the_scripts_own_steps(self) -> None:
        """JobError (the job ends with it) if the script stepped the optimizer that psgd steps."""
        if self._script_steps:
            name = type(self.user_optimizer).__name__
            error = (f"step(): the script called optimizer.step() itself: in mode {self.cfg.mode.name} ps.step() "
                     f"steps the optimizer given to psgd.connect ({name}), so each batch was stepped twice; remove "
                     f"optimizer.step() (or scaler.step(optimizer)) from the loop")
            self._end(f"worker {self.rank}: {error}")
            raise JobError(error)

    def _check(self, cfg: Config, model: nn.Module) -> None:
        problem = ""
        schedule = get_mode(cfg.mode.name).schedule
        if not layouts.learned(cfg.model.name):
            problem = (f"this job's shards build psgd's own model {cfg.model.name!r}; a training script brings its "
                       f"own: start the job with `psgd run --script` or set model.name = \"{layouts.SCRIPT_MODEL}\"")
        elif schedule.needs_score and self.score_fn is None:
            problem = (f"mode {cfg.mode.name} needs psgd.connect(..., score=fn): fn(model) scores it on the "
                       f"trainer's own data")
        elif schedule.local_optimizer and self.user_optimizer is not None:
            problem = self._optimizer_problem(self.user_optimizer, model)
        elif self.user_optimizer is not None:
            problem = _left_out_by_optimizer(self.user_optimizer, model, cfg.mode.name)
        if problem:
            self._report_end(problem)
            self.link.close()
            raise ConfigError(problem)
        if cfg.wire.overlap:
            self.note("wire.overlap: the training script runs backward before psgd.step, so each step's pushes "
                      "leave after it, as without wire.overlap (the shards still place whole layers in order; "
                      "psgd puts no hooks on the script's model)")
        if self.user_optimizer is not None and not schedule.local_optimizer:
            self.note(f"mode {cfg.mode.name}: the shards run [optimizer]; the optimizer given to psgd.connect "
                      f"is not stepped")
        wide = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float64]
        if wide:   # (the values psgd writes into the model are the shards' float32 ones, in every mode)
            self.note(f"{wide[0]}{f' and {len(wide) - 1} more' if len(wide) > 1 else ''}: float64 parameters; the "
                      f"shards hold the model in float32, so it trains at float32 precision")

    def _optimizer_problem(self, opt: Any, model: nn.Module) -> str:
        """Why the script's optimizer cannot be a local mode's (it is stepped on the model's
        gradients), or ''. (One that is no optimizer was refused before connecting: _argument_problem.)"""
        if _needs_a_closure(opt):
            return (f"psgd.connect's optimizer {type(opt).__name__} needs a closure in step(closure) (mode "
                    f"{self.cfg.mode.name} steps it locally, as optimizer.step()): give one that steps on the "
                    f"gradients alone (SGD, Adam, ...)")
        mine = {id(p) for p in model.parameters() if p.requires_grad}
        if not any(id(p) in mine for group in opt.param_groups for p in group.get("params", ())):
            return (f"psgd.connect's optimizer holds none of the model's trainable parameters (mode "
                    f"{self.cfg.mode.name} steps it locally): build it on the parameters of the model given to "
                    f"psgd.connect")
        return ""

    # ------------------------------------------------------------ the script's calls
    @property
    def world_size(self) -> int:
        return self.cfg.cluster.workers

    @_alone
    def step(self, loss: float | torch.Tensor | None = None, samples: int | None = None) -> bool:
        """The mode's step on the gradients the script just computed (`loss`, if given,
        goes into the step log, null there when not given or not finite; a non-finite
        gradient is refused by the shards, a non-finite loss by the modes that step a
        local optimizer: easgd, diloco, ltfb; `samples`: the batch's size, default
        `train.batch_size`). False once the job's budget is spent; JobError
        if the job was aborted (another worker failed, ...), with the reason."""
        if self.closed:
            raise JobError("step() after close()")
        try:
            batch = self.cfg.train.batch_size if samples is None else _sample_count(samples)
            value = _loss_value(loss)
        except ConfigError as e:   # the job is told, as for a step without gradients
            self._end(f"worker {self.rank}: {e}")
            raise
        if not self.more():
            self._raise_if_aborted()
            self._trained()
            return False
        if all(p.grad is None for p in self.replica.trainable.values()):
            # Every mode steps on the script's gradients (pushed, or the local optimizer's,
            # which skips a parameter without one): none at all is a script's mistake.
            error = "step() without gradients: call loss.backward() before ps.step()"
            self._end(f"worker {self.rank}: {error}")
            raise JobError(error)
        if self._stepped is not None and self._same_gradients(self._stepped):
            # (a step pushed them again, and counted the batch again: the batch trained twice)
            error = ("step() again on the gradients of the step before (no backward since): call "
                     "loss.backward() on the next batch before each ps.step()")
            self._end(f"worker {self.rank}: {error}")
            raise JobError(error)
        if not self._checked:   # (once: a model is changed between connect and the loop, not per step)
            self._checked = True
            self._refuse_a_changed_model("step()")
        self._refuse_the_scripts_own_steps()
        self._loss = value
        self._batch = batch
        try:
            with self._psgd_steps():
                error = self._rejoin_and_step(self.schedule)
        except Cancelled:
            self._raise_if_aborted()
            self._trained()
            return False
        except FAILURES as e:
            error = _failure(self.rank, e)
            self._end(error)
            raise JobError(error) from None
        except ConfigError as e:   # the script's score function's answer (ltfb)
            self._end(f"worker {self.rank}: {e}")
            raise
        except Exception as e:   # what the script's score function raised (ltfb): the job is told at once
            self._end(self._raised(e))
            raise
        if error:
            self._end(error)
            raise JobError(error)
        self._computed_at = time.perf_counter()
        self._stepped = self._gradients()
        if self.more():
            return True
        self._raise_if_aborted()
        self._trained()
        return False

    def _gradients(self) -> list:
        """Which gradients the model holds now: each trainable tensor's `.grad`, with its
        version (a backward into it in place changes that; one into None makes a new one).
        Held by weak reference: a `.grad` that `zero_grad()` let go is freed, and a new one
        may then have its `id()`."""
        return [None if g is None else (weakref.ref(g), g._version)
                for g in (p.grad for p in self.replica.trainable.values())]

    def _same_gradients(self, taken: list) -> bool:
        """Whether every trainable tensor's `.grad` is the one `taken` (`_gradients`), unchanged."""
        for p, was in zip(self.replica.trainable.values(), taken, strict=True):
            g = p.grad
            if (g is None) != (was is None) or (g is not None and (was[0]() is not g or g._version != was[1])):
                return False
        return True

    def _trained(self) -> None:
        """step() says False: this worker's training ended now (the first time). What the
        script does before close() (score, save) is not the job's training: its finish
        says how long that took (`idle_s`), and wall_s and samples/s leave it out. What
        close() does (settling what is in flight: a last push, round, exchange or
        deposit) is, as psgd's own worker's settle is."""
        if self._trained_at is None:
            self._trained_at = time.monotonic()

    def _report_end(self, error: str, timeout: float | None = None, **fields: Any) -> bool:
        if self._trained_at is not None:
            until = time.monotonic() if self._closing_at is None else self._closing_at
            fields["idle_s"] = round(max(0.0, until - self._trained_at), 6)
        return super()._report_end(error, timeout, **fields)

    def _model_change(self) -> str:
        """How the script's model is no longer the one given to connect, or ''. psgd reads
        the gradients from, and writes the shards' model into, the tensors that the model
        had then, in place: a layer replaced since, or a tensor given new storage
        (`.double()`, `.half()`, `.to(...)`, `p.data = ...`), would train nothing and leave
        the script's model as it was (and rank 0's model.pt), while the job ran on."""
        now = model_tensors(self.replica.model)
        for name, ptr in self._held.items():
            t = now.get(name)
            if t is None or t is not self.replica.tensors[name]:
                return f"{name} was {'removed' if t is None else 'replaced'}"
            if t.data_ptr() != ptr:
                return f"{name} has new storage (.double(), .half(), .to(...) or .data = ...)"
        added = [n for n, p in self.replica.model.named_parameters() if p.requires_grad and n not in self._held]
        return f"{added[0]} is a new trainable parameter" if added else ""

    def _refuse_a_changed_model(self, call: str) -> None:
        """JobError (the job ends with it) if the model changed after connect."""
        change = self._model_change()
        if change:
            error = (f"{call}: the model changed after psgd.connect: {change}; psgd trains the tensors the model "
                     f"had at connect: change the model (layers, dtype, device) before psgd.connect")
            self._end(f"worker {self.rank}: {error}")
            raise JobError(error)

    def _raise_if_aborted(self) -> None:
        """The job was aborted (not its budget spent), or its training ended while the
        coordinator had this worker dropped (`left_behind`): leave it, and say why."""
        abort = self.link.state.get("abort")
        if abort:
            self._end("")
            raise _aborted(abort)
        behind = self.left_behind()
        if behind:   # no finish (the coordinator refuses it): the rank is not done
            self._end(behind, reported=True)
            raise JobError(behind)

    @_alone
    def report(self, accuracy: float, loss: float) -> None:
        """A score of the model (the script's own evaluation): the job's evaluation curve
        and summary.json's final accuracy, when the job runs no evaluator."""
        if self.closed:
            raise JobError("report() after close(): report the score before leaving the job")
        if self.stopped():
            raise JobError(f"report(): the job has ended ({self.link.state.get('abort') or 'done'}); "
                           f"the score was not recorded")
        score = {}
        for name, value in (("accuracy", accuracy), ("loss", loss)):
            number = _number(value)
            if number is None:
                raise JobError(f"report(): the score was not recorded: {name} {_described(value)} is not a number")
            score[name] = number
        acc = score["accuracy"]
        if not 0.0 <= acc <= 1.0:   # (the coordinator refuses it too, without a word about percentages)
            raise JobError(f"report(): the score was not recorded: accuracy {acc:g} is not a fraction in [0, 1]"
                           + (" (a percentage? divide it by 100)" if 1.0 < acc <= 100.0 else ""))
        try:
            # The score's sample count is the workers' as of their last heartbeats: this
            # worker's own is brought up to date first (a report right after the loop).
            self.link.beat()
            self.link.call("eval", **score)
        except (PeerTimeout, HandshakeFailed, wire.RemoteError) as e:
            raise JobError(f"report(): the score was not recorded: {getattr(e, 'reason', e)}") from None

    @_alone
    def close(self, error: str = "") -> None:
        """Settle what is in flight and leave the job (rank 0: after saving the final
        model). `error` ends the job with that reason. JobError if the job was aborted
        meanwhile, or the settle failed (the job ends with that), or rank 0 saved no final
        model (the job ended or the coordinator stopped answering first, or the model could
        not be read). A Ctrl-C meanwhile leaves the job at once (`_interrupted`) and is raised."""
        if self.closed:
            return
        if self._closing_at is None:
            self._closing_at = time.monotonic()
        # What `_interrupted` tells the job: the interrupt, until this worker's share is settled.
        self._ending = error or self._raised(KeyboardInterrupt())
        self._holding = False   # rank 0 may hold the job's end: its finish with `hold` is sent, not yet released
        try:
            self._leave(error)
        except KeyboardInterrupt:
            self._interrupted()
            raise

    def _leave(self, error: str) -> None:
        """close()'s work (see there); a Ctrl-C that cuts it short is close()'s to handle."""
        if not error:
            self._raise_if_aborted()
            self._refuse_a_changed_model("close()")   # rank 0 would save the stale tensors as model.pt
        settled = ""   # what the settle ran into (refusals past cluster.max_rejections, psgd's FAILURES)
        cancelled = False
        try:
            if not error:
                with self._psgd_steps():
                    settled = self._attempt(self.schedule.finish)
        except Cancelled:
            cancelled = True
        except FAILURES as e:
            settled = _failure(self.rank, e)
        except ConfigError as e:   # the script's score function's answer (ltfb's final deposit)
            self._end(f"worker {self.rank}: {e}")
            raise
        except Exception as e:   # what it raised: the job ends with that, not after missed heartbeats
            self._end(self._raised(e))
            raise
        self._ending = error or settled
        if cancelled:   # (the job ended meanwhile: aborted, or its training ended without this worker)
            self._raise_if_aborted()
        if error or settled or self.rank != 0:
            self._end(error or settled)
            if settled:
                raise JobError(settled)
            if not error and self.link.state.get("abort"):
                raise _aborted(self.link.state["abort"])
            if not error and not self.reported:   # (unanswered, or refused: the log said which)
                raise JobError(f"close(): the coordinator did not take worker {self.rank}'s finish: the job counts "
                               f"its rank as lost once its heartbeats stop")
            return
        self._holding = True   # (from the sending: a Ctrl-C before its answer may leave the hold taken)
        held = self._holding = self._report_end("", hold=True)
        abort = problem = ""
        try:
            if held:
                abort, problem = self._final_model()
            else:
                abort = self.link.state.get("abort", "")
                problem = "" if abort else "the coordinator did not take this worker's finish: no final model"
        except KeyboardInterrupt:
            raise   # (close() lets the job go: `_interrupted`, without the long waits)
        except BaseException:   # (the model could not be saved, ...): the job is let go all the same
            self._let_go(held)
            raise
        # An abort the status view said: the coordinator keeps answering until the holder of
        # the end has heard it (`_lingered`), and a status call does not say who asked, so the
        # hold is released all the same, with a heartbeat's answer time (it may be gone).
        problem = self._let_go(held, timeout=beat_answer_s(self.cfg) if abort else None) or problem
        if abort:
            raise _aborted(abort)
        if problem:
            raise JobError(f"close(): {problem}")

    def _let_go(self, held: bool, timeout: float | None = None) -> str:
        """Rank 0's end of close(): release the job's end (`_release`, which says what went
        wrong with the coordinator, or ''; `timeout` as its) and leave the job."""
        try:
            problem = self._release(held, timeout)
            self._holding = False
            return problem
        finally:  # a coordinator gone by now must not keep the pid file and the sockets
            self._end("", reported=True)

    def _release(self, held: bool, timeout: float | None = None) -> str:
        """Let the job end (`held`: rank 0 held its end for the final model), unless it
        has ended (done or aborted: the coordinator lingers only until this worker has
        heard so, and may be gone) or the coordinator stopped answering meanwhile: another
        cluster.timeout_s would go on it for nothing (a hold ends by itself). `timeout`:
        the longest wait for its answer (default cluster.timeout_s). What went wrong with
        the coordinator, or ''."""
        if held and not self.link.unanswered and not self.stopped():
            try:
                self.link.call("release", timeout=timeout)
            except (PeerTimeout, HandshakeFailed, wire.RemoteError) as e:
                return f"release: {getattr(e, 'reason', e)}"
        return f"the coordinator stopped answering ({self.link.unanswered})" if self.link.unanswered else ""

    def _interrupted(self, what: str = "close()") -> None:
        """A Ctrl-C in close(), wherever it came (the settle, rank 0's wait for the other
        workers or its release, the finish), or in the script's training (`_close_raised`;
        `what` was interrupted): leave the job now. The job is told (this
        worker's finish, if the coordinator has none: with the interrupt for its reason
        while the share was not settled, as inside `with`), rank 0's hold on its end is
        released (else the job's end waited out cluster.timeout_s), and the sockets and the
        pid file are closed. Each call to the coordinator waits a heartbeat's answer time at
        most, not cluster.timeout_s: it may have had the same Ctrl-C (`psgd run --script`
        and its scripts are one process group) and be gone. Another Ctrl-C meanwhile is
        dropped (`_ctrl_c_held`)."""
        quick = beat_answer_s(self.cfg)
        with _ctrl_c_held():
            try:
                if self._holding:
                    self._release(True, timeout=quick)
                    self._holding = False
            finally:
                self._end(self._ending, reported=self.reported, timeout=quick)
        log(self.name, f"{what} was interrupted (KeyboardInterrupt): this worker left the job"
                       + (f" ({self._ending})" if self._ending else ""))

    def _raised(self, e: BaseException) -> str:
        """The job's reason for ending when the script raised `e` (Ctrl-C's KeyboardInterrupt
        says nothing more: its name alone)."""
        said = str(e)
        return f"worker {self.rank}'s training script raised {type(e).__name__}" + (f": {said}" if said else "")

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None or (kind is SystemExit and value.code in (None, 0)):  # (sys.exit() inside `with`: a clean end)
            self.close()
        else:
            self._close_raised(value)

    def _close_raised(self, e: BaseException) -> None:
        """Leave the job, ending it with what the script raised (`e`, inside `with` or
        uncaught: `_end_on_uncaught`). Anything but a Ctrl-C is told with close()'s waits:
        the coordinator, alive as far as this worker knows, must hear why. A Ctrl-C leaves
        at once, as one in close() does: the finish that told the job waited
        cluster.timeout_s for a coordinator that may have had the same Ctrl-C, before the
        script could end."""
        if isinstance(e, KeyboardInterrupt):
            self._leave_interrupted(self._raised(e))
        else:
            self.close(self._raised(e))

    @_alone(what="leaving the job on the training script's KeyboardInterrupt (Ctrl-C)")
    def _leave_interrupted(self, error: str) -> None:
        """`_interrupted` for a Ctrl-C in the script's training: nothing to settle or hold."""
        if not self.closed:
            self._ending, self._holding = error, False
            self._interrupted("the training script")

    # ------------------------------------------------------------ what the schedule calls
    def compute(self, slot: int = 0) -> float:
        """The script's backward pass is done: its gradients are in the model, where its
        backward put them (`slot` is not used). The injected slowness (`faults.*`) counts
        the time since the last step."""
        self.slow_down(time.perf_counter() - self._computed_at)
        self.samples += self._batch
        self.loss = math.nan if self._loss is None else self._loss
        return 0.0 if self._loss is None else self._loss

    def score(self) -> tuple[float, float]:
        assert self.score_fn is not None
        model = self.replica.model
        was = model.training
        try:
            got = self.score_fn(model)
        finally:
            model.train(was)   # a score function that sets eval() leaves the script's mode as it was
        if isinstance(got, tuple):
            acc, loss = (_number(got[0]), _number(got[1])) if len(got) == 2 else (None, None)
        else:
            acc = _number(got)
            loss = None if acc is None else -acc
        if acc is None or loss is None:   # None, a tensor of several values, a triple
            raise ConfigError(f"psgd.connect(score=...) returned {_described(got)}: it returns the model's "
                              f"accuracy (a number) or an (accuracy, loss) pair")
        if acc == acc and not 0.0 <= acc <= 1.0:   # (NaN: a diverged model's score, which loses its tournament)
            raise ConfigError(f"psgd.connect(score=...) returned accuracy {acc:g}: an accuracy is a fraction in "
                              f"[0, 1]" + (" (a percentage? divide it by 100)" if 1.0 < acc <= 100.0 else ""))
        return acc, loss

    # ------------------------------------------------------------ the end
    def _end(self, error: str, reported: bool = False, timeout: float | None = None) -> None:
        """Leave the job: tell the coordinator (unless `reported`; `timeout`: the longest
        wait for its answer, default cluster.timeout_s), close the sockets and the pid file."""
        self.closed = True
        hook, self._step_hook = getattr(self, "_step_hook", None), None
        if hook is not None:   # (after the job, the script may step its optimizer itself)
            hook.remove()
        try:
            if not reported:
                self._report_end(error, timeout)
        finally:
            self._close(error)
            self.pidfile.__exit__(None, None, None)

    def _final_model(self) -> tuple[str, str]:
        """Wait until every other worker is done (however long they train, while they
        are live: heartbeating), then load the job's global model into the script's
        model and save it as DIR/model.pt. No final model if the job ends or aborts
        meanwhile, or the coordinator stops answering for cluster.timeout_s, or the model
        cannot be read. Returns (the abort's reason if the job was aborted meanwhile (a
        worker that failed is no longer live either: its end must not pass for the others'
        being done), why there is no final model otherwise), each '' if none."""
        renew_s = self.cfg.cluster.timeout_s / 3
        renewed = time.monotonic()
        while True:
            try:
                view = self.link.state if self.stopped() else self.link.call("status")
                if view.get("done") or view.get("abort"):
                    log(self.name, f"the job ended before the other workers finished "
                                   f"({view.get('abort') or 'done'}): no final model")
                    return view.get("abort") or "", "the job ended before the other workers finished: no final model"
                if all(w["state"] != "live" for w in view.get("workers", []) if w["rank"] != self.rank):
                    break
                if time.monotonic() - renewed >= renew_s:  # the coordinator holds the end for timeout_s at a time
                    self.link.call("finish", rank=self.rank, clock=self.clock, stats=self.stats(), hold=True)
                    renewed = time.monotonic()
            except (PeerTimeout, wire.RemoteError) as e:
                log(self.name, f"the coordinator stopped answering ({e}): no final model")
                # (its heartbeats' answers may have said why)
                return self.link.state.get("abort", ""), f"the coordinator stopped answering ({e}): no final model"
            time.sleep(FINAL_POLL_S)
        try:
            self.replica.load(*self.client.tables(get_mode(self.cfg.mode.name).global_model(self.client)))
        except (FAILURES + (Cancelled,)) as e:
            log(self.name, f"could not read the final model ({e}): no final model")
            return "", f"could not read the final model ({e}): no final model"
        if self.out:
            path = os.path.join(self.out, "model.pt")
            save_state_dict(self.replica.cpu_state_dict(), path)
            log(self.name, f"saved the final model: {path}")
        return "", ""
