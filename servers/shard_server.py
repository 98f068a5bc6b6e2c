"""The shard server daemon: a ZeroMQ loop around one `psgd.shard.Shard`.

    psgd server [CONFIG] --shard I --out DIR [--set k=v ...]

Registers with the coordinator (which hands out the run's config), learns the model's
layout from it unless the model is one of psgd's own (psgd/layout.py: the server never
imports user code), removes its checkpoint's temp files and its `.saving` note that a
killed shard left (`_remove_leftovers`), restores its checkpoint if one exists, binds
its ROUTER on shard I's address and serves until the coordinator says the job is done. A
bad message gets an error reply and is counted; the loop goes on. It exits 1 if the
coordinator stays silent for cluster.timeout_s, or if no worker registers a learned
model's layout within that time. Checkpoints are written every `checkpoint.every_s`
seconds, as a run resumed from them starts (its counters from zero), when training ends
(every worker done: a shard restarted during the final evaluation resumes the final
tables) and on SIGTERM (atomically), and once more at the end (while that one is
written, DIR/pids/server-I.saving says so: psgd run's stop waits for it).
"""
from __future__ import annotations

import contextlib
import glob
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import torch
import zmq

from psgd import lane as lanes
from psgd import layout as layouts
from psgd import wire
from psgd.config import SET_CHECKED_ENV, Config
from psgd.log import log
from psgd.membership import AFTER_TRAINING, CoordinatorLink, RegistrationCancelled, job_token
from psgd.metrics import pid_path, write_text_atomic, writer_gone
from psgd.optim import flush_denormals
from psgd.shard import Shard, unresumable, why_not_resume_from, write_checkpoint
from psgd.transport import PeerTimeout, Service, bind_address, server_socket, stop_auth

# A learned model's shard asks the coordinator for the layout this often until it has it
# (at most LAYOUT_POLLS_PER_S asks a second from all shards together): it comes with the
# first worker's registration, often after training's clock has started, and every worker
# waits for the shards' tables. At 0.2 s a training script's job spent 0.2-0.3 s of its
# wall_s (and samples/s) on that wait, where psgd's own workers' shards need no layout.
LAYOUT_POLL_S = 0.01
LAYOUT_POLLS_PER_S = 5000
LAYOUT_CALL_S = 2.0
WAITING_EVERY_S = 5.0
SAVER_JOIN_S = 120.0  # the longest a shard waits at exit for a checkpoint being written
# What `Shard.load_state_dict` reads from a checkpoint (`Shard.state_dict`'s fields)
CHECKPOINT_KEYS = ("params", "buffers", "opt", "version", "rule", "last_clock", "counters", "shard", "sizes")


def not_a_shard_checkpoint(path: str, sizes: list[int] | None = None, digest: str = "") -> str:
    """'' if the file at `path` holds a shard checkpoint's fields (and, given `sizes`,
    tables of those sizes: [params, buffers]), else what it is instead. `why_not_resume_from`
    takes any dict for one (a model.pt copied into the folder, another program's
    state_dict): `psgd run` said it resumed it and each shard died on its KeyError, five
    times, with a traceback; and a learned model (a factory's, a script's) changed since
    the checkpoints were written has tables of other sizes, refused by the shards whose
    sizes changed while the others resumed theirs, one model of two versions. A file that
    cannot be read is '': `why_not_resume_from` says why."""
    try:
        sd = torch.load(path, weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 (why_not_resume_from says what)
        return ""
    if not isinstance(sd, dict):
        return ""
    missing = [k for k in CHECKPOINT_KEYS if k not in sd]
    if missing:
        return (f"it is not a psgd shard checkpoint (it has no {', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''}: a model's state_dict, or another program's file?)")
    try:
        had = [int(n) for n in sd["sizes"]]
    except (TypeError, ValueError):
        return f"it is not a psgd shard checkpoint (its sizes are {sd['sizes']!r})"
    if sizes is not None and had != list(sizes):
        return (f"it is of a model of another layout (its tables hold {had[0]:,} parameters and {had[1]:,} "
                f"buffer values, this job's shard {sizes[0]:,} and {sizes[1]:,}: the model changed)")
    if digest and sd.get("map", digest) != digest:   # (older checkpoints do not say)
        return ("it is of a model of another layout (its tensors' names or sizes are not this job's model's, "
                "though its tables' sizes are: the model changed)")
    return ""



# Optimizer states shaped like the parameters that an ltfb deposit may carry: momentum
# is 1, Adam's moments 2, AMSGrad's 3 (`LTFB.opt_state`).
DEPOSIT_STATES = 4


class TrainingBusy:
    """A shard's time spent serving (`Service.busy_s`) while the job trains: the `busy_s`
    that summary.json's `shard_busy_fraction` divides by `wall_s`, the time from the start
    of training to when the last worker was done. (Counted over the process's life, it held
    what was served after that too, rank 0's reads while it holds the end and the evaluator's
    final read, and a restarted shard's lacked its earlier processes'.) It goes on from
    `base` (a shard restarted during the run: its checkpoint's), and stops while no worker
    is live and once training has ended, as the coordinator's answers to the heartbeats say
    (every SHARD_BEAT_S). Nothing is served before training: the workers wait for the
    rendezvous. (Tracked on the serving thread, read by the heartbeats': under a lock,
    without which a read between `track`'s two changes failed on a `since` gone None, or
    counted the time since it twice.)"""

    def __init__(self, base: float = 0.0):
        self.served: Callable[[], float] = lambda: 0.0   # the service's busy time (once it serves)
        self.counted = base       # time served in training up to `since`
        self.since: float | None = 0.0   # `served()` when training was last seen going on; None: not now
        self._lock = threading.Lock()

    def track(self, state: dict) -> None:
        """Take in the coordinator's view (`CoordinatorLink.state`): training goes on, or not."""
        ended = state["phase"] != "rendezvous" and (state["phase"] != "training" or not state["live"])
        with self._lock:
            if ended and self.since is not None:
                self.counted += self.served() - self.since
                self.since = None
            elif not ended and self.since is None:
                self.since = self.served()

    def __call__(self) -> float:
        with self._lock:
            return self.counted + (self.served() - self.since if self.since is not None else 0.0)


def message_limit(P: int, B: int) -> int:
    """The largest message a shard of P parameter and B buffer values takes, in bytes: an
    ltfb deposit, its largest, holds the parameters, the buffers, up to DEPOSIT_STATES
    optimizer states and a meta array shaped like the parameters, each of 4-byte values
    (a limit of four tables refused an outcome's deposit with Adam's moments and buffers)."""
    return 4 * ((2 + DEPOSIT_STATES) * max(P, 1) + B) + wire.MAX_HEADER

class ShardServer:
    def __init__(self, cfg: Config, index: int, out: str | None = None, ctx: zmq.Context | None = None):
        if not 0 <= index < cfg.cluster.servers:
            raise ValueError(f"--shard {index} is out of range: cluster.servers = {cfg.cluster.servers}")
        self.cfg = cfg
        self.index = index
        self.out = out
        self.ctx = ctx or zmq.Context.instance()
        self.name = f"server-{index}"
        self._term = False
        self._signum = 0   # (the signal that set `_term`; 0: `stop()`, a test's, ends run() with 0)
        self._saver: threading.Thread | None = None  # the periodic checkpoint being written
        self._unwritten = False   # the last one failed (said in the log)
        self.afresh = ""   # why a checkpoint of the job's training config was not resumed (`_resume`)

    def _checkpoint_in_background(self, shard: Shard, path: str, wait: bool = False) -> None:
        """Copy the state here (the serving thread), write it on another thread: the
        serve loop does not wait for the disk. One write at a time: with `wait`, after
        the one being written (up to SAVER_JOIN_S), else none while one is."""
        if self._saver is not None and wait:
            self._saver.join(timeout=SAVER_JOIN_S)
        if self._saver is not None and self._saver.is_alive():
            if wait:   # (a stalled disk: the end of training's checkpoint, `trained`, is not written)
                log(self.name, f"the checkpoint being written is not done after {SAVER_JOIN_S:.0f} s; "
                               f"this one is not written")
            return
        self._saver = threading.Thread(target=self._write_checkpoint, args=(shard.state_dict(), path),
                                       name=f"checkpoint-{self.index}", daemon=True)
        self._saver.start()

    def _write_checkpoint(self, sd: dict, path: str) -> None:
        """A checkpoint written off the serving thread: one that cannot be written (a full
        disk) is said in one line, and the shard serves on (the job's outputs fail it
        where they must; its checkpoint at exit says it again)."""
        try:
            write_checkpoint(sd, path)
        except (OSError, RuntimeError) as e:   # an OutputError, or what torch.save raised itself
            if not self._unwritten:   # (said once, not at every checkpoint while the disk stays full)
                log(self.name, f"checkpoint not written: {e}; serving on without it")
            self._unwritten = True
        else:
            self._unwritten = False

    def _resume(self, shard: Shard, path: str, whole_set: bool = False) -> bool:
        """Resume from the checkpoint at `path` if there is one this job may resume from
        (this shard's, of an unfinished job of the same training config: `Shard.resume`),
        and, with `whole_set` (a job's start: a shard restarted during a job resumes on its
        own), if every other shard's would be resumed too (`unresumable`: the launcher of
        `psgd run` checks the set before it starts the shards; under Compose or Slurm each
        shard checks it). Else say why not (its own checkpoint's reason first, the other
        shards' only when its own would do): this job's checkpoints replace it, and one
        that would do but for the others is moved aside (`shard-I.pt.earlier`). A whole
        set resumed is a new run, which counts from zero (`Shard.new_run`). True if it
        resumed."""
        if not os.path.exists(path):
            return False
        why_config = why_not_resume_from(path, shard.cfg, self.index)
        why = why_config or not_a_shard_checkpoint(path, [shard.P, shard.B], shard.map.digest)
        others = self._others_unresumable(shard, path) if whole_set and not why else ""
        if others:
            # Its own would do: moved aside (as `psgd run` does), or this shard, restarted
            # before its first checkpoint of this job, would resume it alone (a model of
            # two jobs, whose clocks make this job's pushes duplicates).
            with contextlib.suppress(OSError):
                os.replace(path, path + ".earlier")
            why = f"{others}; moved to {os.path.basename(path)}.earlier"
        if not why:
            why = shard.resume(path)
        if why:
            log(self.name, f"not resuming from {path}: {why}; starting afresh")
            if whole_set and not why_config and not not_a_shard_checkpoint(path):
                # A shard checkpoint of the same training config: psgd run's launcher (which
                # checks those, not a learned model's layout) said the job resumes, and under
                # Compose or Slurm nothing but this log said otherwise. The coordinator says
                # it (`afresh` in the heartbeats).
                self.afresh = why
            return False
        if whole_set:
            shard.new_run()
        log(self.name, f"resumed from {path} at version {shard.version}")
        return True

    def _remove_leftovers(self, path: str) -> None:
        """Remove this shard's checkpoint temp files (`write_checkpoint`'s
        `shard-I.pt.tmp.PID.TID`) whose writer is gone (`writer_gone`): a shard killed
        while writing one left a checkpoint-sized file that nothing removed. Another
        process's file, while it lives, is left alone. Its note `pids/server-I.saving`
        (`_saving`) too, which a shard killed while writing its checkpoint at exit left:
        psgd run's stop removes the note of a shard it killed, but under Compose or Slurm
        it stayed, saying a checkpoint was being written. (Its writer does not hold it
        open, so only the pid and the times tell: a second shard of this index writing
        at once, on another host sharing DIR or before a clock step, could lose its note;
        psgd run's stop, the note's only reader, heeds it only where it names that
        stop's own child.)"""
        for tmp in glob.glob(glob.escape(path) + ".tmp.*"):
            pid, _, tid = tmp[len(path) + len(".tmp."):].partition(".")
            if pid.isdigit() and tid.isdigit() and writer_gone(tmp, int(pid)):
                with contextlib.suppress(OSError):
                    os.remove(tmp)
                    log(self.name, f"removed {os.path.basename(tmp)}, a checkpoint that process {pid} "
                                   f"left half-written")
        note = pid_path(self.out, self.name, "saving") if self.out else ""
        try:
            with open(note) as f:
                pid = f.read().strip()
        except OSError:   # (none: the usual case)
            return
        if pid.isdigit() and writer_gone(note, int(pid)):
            with contextlib.suppress(OSError):
                os.remove(note)
                log(self.name, f"removed pids/{os.path.basename(note)}, the note of a checkpoint at exit that "
                               f"process {pid} did not finish")

    def _others_unresumable(self, shard: Shard, path: str) -> str:
        """'' if every other shard's checkpoint would be resumed too, else which would not."""
        # (where psgd run has read them all whole, their CRCs are each shard's own to read: S
        # shards reading all S checkpoints whole read S² of them, minutes for large ones
        # on a network disk)
        whole = os.environ.get(SET_CHECKED_ENV) != "1"
        others = list(unresumable(shard.cfg, self.out, whole, skip=self.index))   # (its own was read: `_resume`)
        for i in range(shard.cfg.cluster.servers):   # a model's state_dict; a learned model of another layout
            other = shard.cfg.checkpoint_file(self.out, i) or ""
            if i != self.index and i not in others and not_a_shard_checkpoint(
                    other, [shard.map.size(i, "params"), shard.map.size(i, "buffers")], shard.map.digest):
                others.append(i)
        others.sort()
        return (f"the checkpoints of shard{'s' * (len(others) > 1)} {', '.join(map(str, others))} in "
                f"{os.path.dirname(path)} cannot be resumed (missing, or of another job or configuration), "
                f"and resuming a part of the model would mix two" if others else "")

    def _on_sigterm(self, signum: int | None = None, _frame=None) -> None:
        """SIGTERM or Ctrl-C: checkpoint and exit 128 + the signal's number (143, 130), as
        every other daemon does, so that `psgd run` restarts a shard stopped alone (exit 0
        said it had heard of the job's end, and the job waited for it cluster.timeout_s)."""
        self._term = True
        self._signum = signum or self._signum

    stop = _on_sigterm  # end run() from another thread (tests)

    def _learn_layout(self, link: CoordinatorLink, layout: list | None, timeout_s: float) -> list | None:
        """The model's layout, as the first worker registered it with the coordinator
        (a learned model: psgd/layout.py); None, said in the log, if none comes within
        cluster.timeout_s."""
        start = said = time.monotonic()
        while layout is None:
            now = time.monotonic()
            if now - start > timeout_s or self._term:
                log(self.name, f"no worker registered the model's layout within {timeout_s:.0f} s "
                               f"(cluster.timeout_s); exiting")
                return None
            if now - said >= WAITING_EVERY_S:
                said = now
                log(self.name, "waiting for a worker to register the model's layout")
            time.sleep(max(LAYOUT_POLL_S, self.cfg.cluster.servers / LAYOUT_POLLS_PER_S))
            with contextlib.suppress(PeerTimeout):  # the coordinator may be restarting: ask again
                layout = link.call("layout", timeout=LAYOUT_CALL_S).get("layout")
        return layouts.checked(layout)

    def run(self) -> int:
        link = CoordinatorLink(self.cfg, "server", self.index, self.ctx)
        try:
            answer = link.register(cancel=lambda: self._term)   # SIGTERM (stop) while waiting: no job yet
        except RegistrationCancelled:
            log(self.name, "stopped before the coordinator answered its registration")
            link.close()
            return 0
        cfg = link.take_job_config(answer)
        layout = None
        if layouts.learned(cfg.model.name):
            layout = self._learn_layout(link, answer.get("layout"), cfg.cluster.timeout_s)
            if layout is None:
                link.close()
                return 1
        shard = Shard(cfg, self.index, layout)
        shard.job = job_token()
        ckpt = cfg.checkpoint_file(self.out, self.index)
        if ckpt:
            self._remove_leftovers(ckpt)
        restarted = bool(answer.get("restarted"))
        resumed = bool(ckpt and self._resume(shard, ckpt, whole_set=not restarted))
        # (a new run counts from zero, a shard restarted during the run on from its checkpoint)
        busy = TrainingBusy(shard.busy() if restarted else 0.0)
        shard.busy = busy
        if ckpt and resumed and not restarted:
            # A new run, counting from zero (`Shard.new_run`), checkpointed at once: killed
            # before its first periodic checkpoint, this shard came back with the earlier
            # run's counters (its bad messages, dropped gradients), reported as this run's.
            self._checkpoint_in_background(shard, ckpt)
        if restarted and answer.get("phase") not in AFTER_TRAINING:
            # Training goes on: a checkpoint still the earlier run's (this run's first, written
            # in the background, not done when it was killed), of a run stopped during its
            # final evaluation, says `trained`, and the shard refused every push of this one.
            shard.trained = False
        if restarted and answer.get("phase") in AFTER_TRAINING and not shard.trained:
            # Restarted after training ended without the tables it ended with (killed before
            # it learned of the end, and checkpointed it: `_end_of_training`): no worker is
            # left to bring them, and older ones would make the final model a mix of two.
            # It serves none, and its heartbeats tell the coordinator, which ends the job
            # without a final model if the final evaluation is not in yet.
            why = (f"its checkpoint is of version {shard.version}, from before the end" if resumed
                   else "it had no checkpoint to resume")
            lost = f"restarted after training ended without its final tables ({why})"
            shard.ready, shard.unready = False, f"was {lost}"
            link.fields_fn = lambda: {"lost_tables": shard.unready}
            log(self.name, f"{lost}: it serves none")
        elif not resumed and restarted:
            # (rank 0's first values are long gone: any worker's current copy is taken)
            shard.restarted_empty()
            log(self.name, "restarted with nothing to restore: taking the first worker's current copy of its tables")
        if self.afresh:
            link.fields_fn = lambda: {"afresh": self.afresh}
        address = cfg.shard_address(self.index)
        # The largest legitimate frame is one table (`message_limit` for a message).
        # Anything larger is refused before it is read.
        table_bytes = 4 * max(shard.P, shard.B, 1)
        sock = server_socket(self.ctx, bind_address(address), cfg.security, table_bytes + wire.MAX_HEADER)
        self.max_message = message_limit(shard.P, shard.B)
        log(self.name, f"serving {shard.P + shard.B:,} values on {address} ({cfg.mode.name})")
        link.stats_fn = shard.stats
        link.start()
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                # Ctrl-C (a terminal's reaches every daemon of `psgd run`) stops the shard
                # as SIGTERM does: a second one cannot interrupt the final checkpoint
                signal.signal(signal.SIGINT, self._on_sigterm)
        except ValueError:  # not the main thread (in-process tests)
            pass
        listener = None
        if cfg.cluster.local_lane and not cfg.security.curve and lanes.name(address) is not None:
            listener = lanes.Listener.open(address)
            if listener is None:   # (the name taken: a daemon of the same address in this network namespace)
                log(self.name, f"cannot listen for same-host lanes to {address}: its workers reach it over ZeroMQ")
        service = Service(sock, shard.handlers, f"shard {self.index}", self.max_message, shard.counters,
                          sent=shard.sent, role=self.name, lane=listener, spin_s=cfg.cluster.spin_s)
        shard.in_flight = service.in_flight  # replies leave as they are made: snapshots may lend the tables
        busy.served = lambda: service.busy_s
        seen_version, last_ckpt = (-1, None), time.monotonic()
        code = 0
        flushed = flush_denormals(cfg.train.flush_denormal)   # (the shard's updates: `denormals_flushed`)
        try:
            while True:
                # The membership first: a restarted shard learns the live workers' clocks
                # (`ClockTable.set_live`) before it answers the requests waiting for it
                state = link.state
                busy.track(state)
                seen = (state["version"], state.get("live_id"))  # live_id: a restarted coordinator may repeat a version
                if seen != seen_version and state["phase"] != "rendezvous":
                    seen_version = seen
                    service.send(shard.set_live(state["live"], str(state.get("live_id") or "")))
                service.poll(50)
                state = link.state
                now = time.monotonic()
                if shard.ready and not shard.trained and state["phase"] in AFTER_TRAINING:
                    self._end_of_training(shard, ckpt)
                    last_ckpt = now
                if ckpt and shard.ready and cfg.checkpoint.every_s and now - last_ckpt >= cfg.checkpoint.every_s:
                    self._checkpoint_in_background(shard, ckpt)
                    last_ckpt = now
                if self._term:
                    log(self.name, "stopped (SIGTERM or Ctrl-C): checkpointing and exiting")
                    code = 128 + self._signum if self._signum else 0
                    break
                if link.done:
                    shard.finished = True   # its last checkpoint says so: no later job resumes from it
                    break
                if link.lost:
                    log(self.name, f"lost the coordinator at {link.address} for {cfg.cluster.timeout_s:.0f} s; exiting")
                    code = 1
                    break
        finally:
            flush_denormals(flushed)
            try:
                self._final_checkpoint(shard, ckpt)
            finally:   # (also when it fails: a full disk left the heartbeats going and the port bound)
                link.close()  # the heartbeats and the socket of its calls (the layout): ctx.term() waits for them
                service.close_lanes()
                sock.close(0)
                stop_auth(self.ctx)
        return code

    def _end_of_training(self, shard: Shard, ckpt: str | None) -> None:
        """Every worker is done (the coordinator's phase after training): the tables are
        the final model's share, and are checkpointed at once, marked so (`trained`). A
        shard killed during the final evaluation resumes them: with only its periodic
        checkpoint (every 10 s) it came back with older tables, and the final model
        mixed them with the other shards' final ones (or, with none, had no values)."""
        shard.trained = True
        if ckpt:
            self._checkpoint_in_background(shard, ckpt, wait=True)

    def _final_checkpoint(self, shard: Shard, ckpt: str | None) -> None:
        """The checkpoint at exit, once the periodic one being written is done, with a note
        that it is being written (`_saving`)."""
        with self._saving(ckpt):
            self._write_final_checkpoint(shard, ckpt)

    @contextlib.contextmanager
    def _saving(self, ckpt: str | None) -> Iterator[None]:
        """DIR/pids/server-I.saving, naming this process, while it writes its checkpoint
        (if it has one) at exit: psgd run's stop waits for it then (`metrics.pid_path`),
        where its SIGKILL 5 s after SIGTERM cut a large model's checkpoint short. A note
        that cannot be written costs only that wait."""
        path = pid_path(self.out, self.name, "saving") if self.out and ckpt else ""
        try:
            if path:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                write_text_atomic(path, f"{os.getpid()}\n")
        except OSError:
            path = ""
        try:
            yield
        finally:
            if path:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def _write_final_checkpoint(self, shard: Shard, ckpt: str | None) -> None:
        if self._saver is not None:
            self._saver.join(timeout=SAVER_JOIN_S)
        if self._saver is not None and self._saver.is_alive():  # a stalled disk: do not race it, nor wait forever
            log(self.name, f"the checkpoint being written is not done after {SAVER_JOIN_S:.0f} s; "
                           f"exiting without the final checkpoint")
        elif ckpt and shard.ready:
            shard.save(ckpt)
        elif ckpt:   # a checkpoint of tables never given their values would resume the next job at zeros
            log(self.name, f"no checkpoint written: the shard {shard.unready or 'never received its initial values'}")
