"""Same-host round trips: a request and its answer between two processes over raw pyzmq
and over psgd's lane (psgd/lane.py), sleeping and spinning, with an MLP step between
requests as a worker has.

    .venv/bin/python -m bench.lane                     # about 20 s on 2 cores
    .venv/bin/python -m bench.lane --bytes 104K --steps 3000 --repeats 3

Each way moves the same bytes in the same pattern between a client process and an echo
process started for it: the client computes one forward and backward of an MLP about as
costly as psgd's (784-32-10 on random 28x28 inputs, 25.4k multiply-adds a sample against
the digits MLP's 26.1k; batch 32, one thread, denormals flushed), then sends one message (a small header
frame and BYTES of payload) and waits for the answer (a small header frame and BYTES),
and reads the answer's payload. Ways:

- `zmq`: a DEALER against a ROUTER on tcp loopback, psgd's socket options (its copy
  threshold), copy=False; each side's ZeroMQ I/O thread carries the bytes.
- `zmq_spin`: the same, both sides looking for the message for up to `--spin-us` before
  they sleep (the I/O threads still sleep in epoll).
- `lane`: psgd's `lane.Conn` over a Unix socket, both sides waiting in poll(2).
- `lane_spin`: the same, both sides looking for the message for up to `--spin-us`
  (`spinning.spin`, as `cluster.spin_us`) before they sleep.

It times the step (compute + round trip) and the round trip alone (from the send to
the answer read), the mean of `--steps` after 300 warm-up steps; each repeat runs the
ways in turn. JSON: `*_step_us`, `*_rtt_us` (medians over the repeats),
`rtt_ratio_lane`, `rtt_ratio_lane_spin` and `rtt_ratio_zmq_spin` (each way's round trip /
`zmq`'s)."""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

from bench.common import child_ignores_ctrl_c, emit_json, main_of, number, progress, stop_on_signals, table
from bench.transport import parse_size

WAYS = ("zmq", "zmq_spin", "lane", "lane_spin")


def echo(way: str, where: str, nbytes: int, spin_s: float, ready) -> None:
    """The echo process: answers each message with a header and `nbytes` of its own."""
    import numpy as np
    import zmq

    from psgd import lane, spinning, transport
    child_ignores_ctrl_c()
    payload = np.ones(nbytes, np.uint8)
    parent = os.getppid()
    if way.startswith("zmq"):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.copy_threshold = transport.COPY_THRESHOLD
        sock.rcvtimeo = 1000   # (a look at its parent each idle second, at no cost a message)
        try:
            sock.bind(where)
        except zmq.ZMQError as e:   # (the client says so: `_timed`)
            raise SystemExit(f"bench.lane: cannot listen on {where}: {e}") from None
        ready.set()
        looking = zmq.Poller()
        looking.register(sock, zmq.POLLIN)
        while True:
            if spin_s:
                spinning.spin(looking, spin_s)
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.Again:
                if os.getppid() != parent:   # the benchmark is gone (killed): so is its echo
                    return
                continue
            if len(frames) == 2:   # (the client's "done")
                break
            sock.send_multipart([frames[0], b"h", payload], copy=False)
        sock.close(0)
        ctx.term()
        return
    listener = lane.Listener.open(where)
    assert listener is not None
    ready.set()
    poller = zmq.Poller()
    poller.register(listener.fd, zmq.POLLIN)
    poller.poll(10_000)
    conn = listener.accept()
    assert conn is not None
    poller = zmq.Poller()
    poller.register(conn.fd, zmq.POLLIN)
    while True:
        if not (spin_s and spinning.spin(poller, spin_s)):
            poller.poll(10_000)
        try:
            for _ in conn.messages(1 << 30):
                conn.offer([b"h", payload])
        except lane.LaneError:
            break
    conn.close()
    listener.close()


def client(way: str, nbytes: int, steps: int, spin_s: float, port: int) -> tuple[float, float]:
    """One way's run: (mean step, mean round trip) in seconds."""
    where = f"tcp://127.0.0.1:{port}"
    ready = mp.Event()
    proc = mp.Process(target=echo, args=(way, where, nbytes, spin_s, ready), daemon=True)
    proc.start()
    done = False
    try:
        got = _timed(way, where, nbytes, steps, spin_s, port, proc, ready)
        done = True   # (the echo was told: it ends)
        return got
    finally:   # (also on Ctrl-C, SIGTERM or an error: no echo left behind, holding the port)
        proc.join(10 if done else 0)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _timed(way: str, where: str, nbytes: int, steps: int, spin_s: float, port: int, proc, ready) -> tuple[float, float]:
    import numpy as np
    import torch
    import zmq

    from psgd import lane, spinning, transport
    end = time.monotonic() + 30
    while not ready.wait(0.1):
        if not proc.is_alive() or time.monotonic() > end:
            raise RuntimeError(f"the {way} echo process did not start (exit code {proc.exitcode}"
                               + (f"; is port {port} in use? --port picks another" if way.startswith("zmq") else "")
                               + ")")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    loss = torch.nn.CrossEntropyLoss()
    payload = np.full(nbytes, 7, np.uint8)
    poller = zmq.Poller()
    if way.startswith("zmq"):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.copy_threshold = transport.COPY_THRESHOLD
        sock.connect(where)
        if spin_s:
            poller.register(sock, zmq.POLLIN)

        def round_trip() -> None:
            sock.send_multipart([b"h", payload], copy=False)
            if spin_s:
                spinning.spin(poller, spin_s)
            np.frombuffer(sock.recv_multipart(copy=False)[1].buffer, np.uint8).sum()
    else:
        conn = lane.connect(where)
        assert conn is not None
        poller.register(conn.fd, zmq.POLLIN)

        def round_trip() -> None:
            conn.send([b"h", payload], 1.0)
            got: list = []
            while not got:
                if not (spin_s and spinning.spin(poller, spin_s)):
                    poller.poll(10_000)
                got = conn.messages(1 << 30)
            np.frombuffer(got[0][1], np.uint8).sum()
    comm = 0.0
    start = 0.0
    for i in range(steps + 300):
        if i == 300:
            start, comm = time.perf_counter(), 0.0
        for p in model.parameters():
            p.grad = None
        loss(model(x), y).backward()
        t = time.perf_counter()
        round_trip()
        comm += time.perf_counter() - t
    step = (time.perf_counter() - start) / steps
    if way.startswith("zmq"):
        sock.send_multipart([b"done"])
        sock.close(linger=1000)
        ctx.term()
    else:
        conn.close()
    return step, comm / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=parse_size, default=parse_size("104K"),
                    help="payload each way (the MLP's table: 104K)")
    ap.add_argument("--steps", type=number(int, 1), default=3000, help="timed steps of each way")
    ap.add_argument("--repeats", type=number(int, 1), default=2, help="runs of every way, in turn")
    ap.add_argument("--spin-us", type=number(float, 1), default=1000.0, help="the *_spin ways' spin (cluster.spin_us)")
    ap.add_argument("--port", type=number(int, 1024, maximum=65535), default=39213,
                    help="the tcp port the zmq ways use")
    a = ap.parse_args()
    stop_on_signals()
    got: dict[str, list[tuple[float, float]]] = {w: [] for w in WAYS}
    for r in range(a.repeats):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):   # (in turn: a drift of the machine's speed is no way's)
            progress(f"repeat {r + 1}/{a.repeats}: {way}")
            try:
                got[way].append(client(way, a.bytes, a.steps, a.spin_us * 1e-6 if way.endswith("_spin") else 0.0,
                                       a.port))
            except RuntimeError as e:
                raise SystemExit(f"bench.lane: error: {e}") from None
    med = {w: (statistics.median(s for s, _ in v) * 1e6, statistics.median(c for _, c in v) * 1e6)
           for w, v in got.items()}
    print(table(["way", "step µs", "round trip µs", "compute µs (step - round trip)"],
                [[w, med[w][0], med[w][1], med[w][0] - med[w][1]] for w in WAYS],
                f"{a.bytes:,} bytes each way, an MLP step between requests, median of {a.repeats}"))
    emit_json({"bench": "lane", "bytes": a.bytes, "steps": a.steps, "repeats": a.repeats, "spin_us": a.spin_us,
               **{f"{w}_step_us": round(med[w][0], 1) for w in WAYS},
               **{f"{w}_rtt_us": round(med[w][1], 1) for w in WAYS},
               "rtt_ratio_lane": round(med["lane"][1] / med["zmq"][1], 4),
               "rtt_ratio_lane_spin": round(med["lane_spin"][1] / med["zmq"][1], 4),
               "rtt_ratio_zmq_spin": round(med["zmq_spin"][1] / med["zmq"][1], 4)})


if __name__ == "__main__":
    main_of(main)
