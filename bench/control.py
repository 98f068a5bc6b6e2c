"""The control path: what a heartbeat costs the coordinator and the daemon that sends it,
against the number of workers.

    .venv/bin/python -m bench.control                        # W = 2, 64, 256, 1024: about a minute
    .venv/bin/python -m bench.control --workers 2,1024 --beats 2000

Workers heartbeat every `cluster.heartbeat_s` (default 0.5 s), shards and the evaluator
every `membership.SHARD_BEAT_S` (0.05 s), each with its counters, and each gets the
job's view back (phase, membership version, the live set). The coordinator serves them
in its one serve loop, so at W workers it serves about W / heartbeat_s + (S + 1) /
SHARD_BEAT_S of them a second; the figures below count the workers' beats only (at
W = 2, S = 1: 4 of about 44 a second; at W = 1,024 the shards' and the evaluator's are
about 2% of them).

For each W a real `Coordinator` (its socket bound, no other process) takes W workers'
registrations; then worker heartbeats, with the counters a worker sends, go through
its serve path as they do off the socket (`Service._serve`: decode, validate, the
handler, the reply's encoding), and the sender decodes the reply (`wire.decode`) and
takes it in (`CoordinatorLink._apply`). Two cases: "steady", every sender has the
current live set (`live_id`), as at every beat of a job but the first after a
membership change; "changed", none has, so every reply carries the live set (W
entries), as every reply did before `live_id`.

Besides the messages, the coordinator's serve loop looks over every worker (missed
heartbeats, the job's end: `Coordinator._tick`, an O(W) scan) every `CHECK_EVERY_S`
(0.05 s): its cost is measured alone (`scan_us`, the mean of 200 looks), and the
coordinator's share of a core (workers' beats) is (W / heartbeat_s) x the steady cost per
heartbeat + scan_us / CHECK_EVERY_S. Then (`--live`, 6 s by default) the whole coordinator runs
its serve loop on its socket while another process sends W workers' heartbeats at
W / heartbeat_s a second: the process's CPU time over the wall time (`live_share`)
includes what the figures above leave out (receiving and sending on the socket,
ZeroMQ's I/O thread, the poll). (Until 2026-12-01 the scan ran after every poll of the
loop, about once per heartbeat, which this benchmark did not measure: a review found a
real coordinator using 89% of a core at 1,024 workers, where the table said 7%.) The
window is `--live` less a second, and opens once the sender process is up, which beats
from then on for the window's length. (Until 2026-12-06 it began as soon as it was up,
about 0.85 s before the window on an idle machine, and the window served that backlog
too: at 1,024 workers 11,952-11,972 beats in 5 s, not 10,240.)

Baseline, in the same run: the same path at W = 2. The table gives microseconds per
heartbeat, the scan, and the coordinator's share of a core at `cluster.heartbeat_s` (W
workers' beats, steady); the last line is one JSON object with `coordinator_us` and
`sender_us` per W and case, `scan_us` and `core_share` per W, and `ratio_<W>` (the
coordinator's steady cost per heartbeat at the largest W over that at W = 2).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import time

import zmq

from bench.common import child_ignores_ctrl_c, emit_json, int_list, main_of, number, progress, stop_on_signals, table
from psgd import wire
from psgd.config import Config
from psgd.launcher import pick_port
from psgd.membership import CoordinatorLink
from psgd.servers.coordinator import CHECK_EVERY_S, Coordinator

START_S = 60.0   # the most `--live` waits for its heartbeat sender's process to start

WORKER_STATS = {"samples": 123456, "steps": 3858, "clock": 3858, "elapsed_s": 61.2345, "wait_s": 12.3456,
                "bytes_sent": 412345678, "bytes_recv": 412345678, "staleness_hist": [3000, 500, 200, 100, 40, 10, 5, 3],
                "loss": 0.123456, "retries": 0, "rejected": 0}


def coordinator_with(workers: int, ctx: zmq.Context) -> Coordinator:
    cfg = Config().replace(**{"cluster.workers": workers, "cluster.port": pick_port("127.0.0.1", 29500, 2),
                              "train.steps": 10 ** 9})   # the heartbeats' clock (3858) is within the job
    with contextlib.redirect_stderr(io.StringIO()):   # a line per registration
        coord = Coordinator(cfg, None, ctx, quiet=True)
        register(coord, workers)
    assert coord.phase == "training", coord.phase
    return coord


def register(coord: Coordinator, workers: int) -> None:
    for r in range(workers):
        coord.service._serve(b"w%d" % r, wire.encode("register", id=1, rank=-1, role="worker", want_rank=r,
                                                     nonce=f"n{r}"))


def measure(workers: int, beats: int, changed: bool, ctx: zmq.Context) -> dict:
    coord = coordinator_with(workers, ctx)
    link = CoordinatorLink(coord.cfg, "worker", 0, ctx)
    known = "" if changed else f"{coord.epoch}:{coord.members.version}"   # the live set the sender has
    reqs = [wire.encode("heartbeat", id=k, rank=k % workers, clock=3858, role="worker", index=k % workers,
                        stats=WORKER_STATS, live_id=known) for k in range(beats)]
    serve = coord.service._serve
    t0 = time.perf_counter()
    replies = [serve(b"w", [bytes(f) for f in frames]) for frames in reqs]
    t_coord = time.perf_counter() - t0
    t0 = time.perf_counter()
    for (_, frames), in replies:
        link._apply(wire.decode([bytes(f) for f in frames]))
    t_sender = time.perf_counter() - t0
    answer = wire.decode([bytes(f) for f in replies[-1][0][1]])
    if answer.op != "reply":   # an error reply's path is not the one to time
        raise RuntimeError(f"the coordinator refused the benchmark's heartbeat: {answer.get('reason')}")
    now, scans = time.monotonic(), 200
    t0 = time.perf_counter()
    for _ in range(scans):   # each a look over every worker, as every CHECK_EVERY_S
        coord._checked = -math.inf   # (due: `now - (now - CHECK_EVERY_S)` can fall short of CHECK_EVERY_S
        coord._tick(now)             # in floating point, and then no look was made: 0.5 us at any W)
    t_scan = time.perf_counter() - t0
    coord.service.close()
    return {"coordinator_us": 1e6 * t_coord / beats, "sender_us": 1e6 * t_sender / beats,
            "reply_bytes": sum(len(f) for f in replies[-1][0][1]), "scan_us": 1e6 * t_scan / scans}


def beats_at(address: str, live_id: str, workers: int, seconds: float, rate: float, ready, go) -> None:
    """A process that sends `rate` worker heartbeats a second to the coordinator at
    `address` (ranks in turn) for `seconds` from `go` on, and reads the replies. It sets
    `ready` once up and sends nothing before `go`: a beat sent earlier would wait in the
    coordinator's queue and be served in the timed window, on top of the window's own."""
    child_ignores_ctrl_c()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    ready.set()
    parent = os.getppid()
    if go.wait(timeout=START_S):   # (not set: the benchmark gave up on this sender)
        t0, k = time.monotonic(), 0
        while time.monotonic() - t0 < seconds and os.getppid() == parent:   # not past the benchmark's end
            wait = t0 + k / rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            sock.send_multipart(wire.encode("heartbeat", id=k + 1, rank=k % workers, clock=3858, role="worker",
                                            index=k % workers, stats=WORKER_STATS, live_id=live_id))
            while sock.poll(0):
                sock.recv_multipart()
            k += 1
    sock.close(0)
    ctx.term()


def wait_ready(sender, ready) -> None:
    """Until the sender process says it is up (its interpreter started, its socket made),
    or raise if it died or took longer than START_S."""
    end = time.monotonic() + START_S
    while not ready.wait(timeout=0.1):
        if not sender.is_alive() or time.monotonic() > end:
            raise RuntimeError(f"the heartbeat sender did not start (exit code {sender.exitcode}, "
                               f"{START_S:.0f} s allowed)")


def live_share(workers: int, seconds: float, heartbeat_s: float, ctx: zmq.Context) -> float:
    """The share of a core the whole coordinator process uses (its serve loop, ZeroMQ's
    I/O thread) while another process sends W workers' heartbeats over its socket at
    W / heartbeat_s a second: the cost the serve path's figures leave out. Timed over
    `seconds` less the second `--live` leaves for the sender's start, once it is up."""
    import multiprocessing as mp
    coord = coordinator_with(workers, ctx)
    now = time.monotonic()
    for m in coord.members.members.values():
        m.last_seen = now
    spawn = mp.get_context("spawn")
    ready, go = spawn.Event(), spawn.Event()
    window = seconds - 1.0
    sender = spawn.Process(
        target=beats_at, args=(coord.address, f"{coord.epoch}:{coord.members.version}", workers, window,
                               workers / heartbeat_s, ready, go), daemon=True)
    sender.start()
    try:
        wait_ready(sender, ready)
        cpu0, t0 = time.process_time(), time.monotonic()
        go.set()   # (after the window's start: every beat the sender sends falls within it)
        coord.serve(deadline_s=window)
        share = (time.process_time() - cpu0) / (time.monotonic() - t0)
        sender.join(timeout=30)
    finally:   # also on Ctrl-C or SIGTERM (stop_on_signals): no sender left beating for the rest of its window
        if sender.is_alive():
            sender.kill()
            sender.join(timeout=5)
    return share


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--workers", type=int_list(1), default="2,64,256,1024",
                    help="worker counts (W = 2, the baseline, always runs)")
    ap.add_argument("--beats", type=number(int, 1), default=4000, help="heartbeats measured at each W")
    ap.add_argument("--heartbeat-s", type=number(float, 0, above=True), default=Config().cluster.heartbeat_s,
                    help="the heartbeat period the core share is worked out for (cluster.heartbeat_s)")
    ap.add_argument("--live", type=number(float, 0), default=6.0, metavar="SECONDS",
                    help="also run the whole coordinator on its socket under W workers' heartbeats this long "
                         "(0: not; else more than 1 s: timed over this less 1 s, left for the sender's start)")
    a = ap.parse_args()
    if 0 < a.live <= 1:
        ap.error(f"--live must be 0 or more than 1 s (timed over it less the 1 s left for the sender's start), "
                 f"got {a.live:g}")
    sizes = sorted({2, *a.workers})
    stop_on_signals()
    ctx = zmq.Context()
    rows, out, shares, lives = [], {}, {}, {}
    for w in sizes:
        for case in ("steady", "changed"):
            progress(f"control path: W = {w}, {case}")
            runs = [measure(w, a.beats, case == "changed", ctx) for _ in range(3)]
            out[(w, case)] = min(runs, key=lambda m: m["coordinator_us"])
        st = out[(w, "steady")]
        shares[w] = (w / a.heartbeat_s * st["coordinator_us"] + st["scan_us"] / CHECK_EVERY_S) * 1e-6
        if a.live > 0:
            progress(f"control path: W = {w}, the whole coordinator on its socket for {a.live:g} s")
            with contextlib.redirect_stderr(io.StringIO()):
                lives[w] = live_share(w, a.live, a.heartbeat_s, ctx)
    base = out[(2, "steady")]["coordinator_us"]   # (after every W: a W below 2 is measured before it)
    for w in sizes:
        st, ch, share = out[(w, "steady")], out[(w, "changed")], shares[w]
        rows.append([w, round(st["coordinator_us"], 1), round(st["coordinator_us"] / base, 2),
                     round(st["sender_us"], 1), st["reply_bytes"], round(st["scan_us"], 1), f"{100 * share:.1f} %",
                     f"{100 * lives[w]:.1f} %" if w in lives else "-",
                     round(ch["coordinator_us"], 1), round(ch["sender_us"], 1), ch["reply_bytes"]])
    ctx.term()
    print(table(["workers", "steady: coordinator us/beat", "vs W=2", "sender us/beat", "reply bytes",
                 f"scan us (every {CHECK_EVERY_S} s)", f"coordinator core share (heartbeat_s={a.heartbeat_s})",
                 "whole process on its socket", "changed: coordinator us/beat",
                 "sender us/beat", "reply bytes"], rows,
                f"worker heartbeats through the coordinator's serve path (best of 3 runs of {a.beats} beats)"))
    top = max(sizes)
    emit_json({"bench": "control",
               **{f"{key}_{case}": {str(w): round(out[(w, case)][key], 2) for w in sizes}
                  for case in ("steady", "changed") for key in ("coordinator_us", "sender_us")},
               "scan_us": {str(w): round(out[(w, "steady")]["scan_us"], 2) for w in sizes},
               "core_share": {str(w): round(shares[w], 4) for w in sizes},
               "live_share": {str(w): round(lives[w], 4) for w in lives},
               f"ratio_{top}": round(out[(top, "steady")]["coordinator_us"] / out[(2, "steady")]["coordinator_us"], 3)})


if __name__ == "__main__":
    main_of(main)
