"""Parameter-exchange throughput: psgd's push+pull round trip against raw ZeroMQ.

    python -m bench.push_pull [--mb 16] [--servers 2] [--iters 30]   (from the repo root)

Both sides move the same bytes over tcp loopback in the same process: the baseline is
a DEALER/ROUTER echo of one frame per shard (copy=False); psgd is a `sync` shard
server with its optimizer step, a push of the gradient and a pull of the parameters,
through the validated wire format. The ratio psgd/raw is what to watch; absolute
numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import threading
import time

import numpy as np
import torch
import zmq

from psgd.config import load
from psgd.inprocess import InProcessCluster
from psgd.launcher import pick_port
from psgd.workers.client import ParameterClient


def raw_echo(nbytes_per_shard: int, shards: int, iters: int) -> float:
    ctx = zmq.Context()
    port = pick_port("127.0.0.1", 7300, shards)
    stop = threading.Event()

    def serve(i):
        s = ctx.socket(zmq.ROUTER)
        s.bind(f"tcp://127.0.0.1:{port + i}")
        while not stop.is_set():
            if s.poll(100):
                ident, payload = s.recv_multipart(copy=False)
                s.send_multipart([ident, payload], copy=False)
        s.close(0)

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(shards)]
    for t in threads:
        t.start()
    socks = []
    for i in range(shards):
        d = ctx.socket(zmq.DEALER)
        d.connect(f"tcp://127.0.0.1:{port + i}")
        socks.append(d)
    payload = np.zeros(nbytes_per_shard // 4, np.float32)
    t0 = 0.0
    for it in range(iters + 3):
        if it == 3:
            t0 = time.perf_counter()
        for d in socks:
            d.send(payload, copy=False)   # "push"
        for d in socks:
            d.recv(copy=False)
        for d in socks:
            d.send(payload, copy=False)   # "pull"
        for d in socks:
            d.recv(copy=False)
    took = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join()
    for d in socks:
        d.close(0)
    ctx.term()
    return 2 * nbytes_per_shard * shards * iters / took


def psgd_push_pull(mb: float, shards: int, iters: int) -> float:
    features = int(mb * (1 << 20) / 4 / 10)  # an MLP-free model: one Linear(features, 10)
    cfg = load(None, [f"cluster.port={pick_port('127.0.0.1', 7400, shards + 1)}", "cluster.workers=1",
                      f"cluster.servers={shards}", "data.name=synthetic", f"data.shape=[{features}]",
                      "data.samples=64", "model.name=bench.push_pull:linear", "cluster.evaluator=false"], env={})
    with InProcessCluster(cfg) as cluster:
        client = ParameterClient(cfg, cluster.ctx, 0)
        msgs = client.request([(i, "pull", {"clock": 0, "join": True}) for i in range(shards)])
        grads = [torch.from_numpy(np.array(m.arrays[0])) for m in msgs]
        bufs = [torch.zeros(0) for _ in msgs]
        versions = [m.get("version") for m in msgs]
        nbytes = sum(g.numel() * 4 for g in grads)
        t0 = 0.0
        for it in range(iters + 3):
            if it == 3:
                t0 = time.perf_counter()
            _, pulled = client.push_pull(it, grads, bufs, versions)
            versions = [m.get("version") for m in pulled]
        took = time.perf_counter() - t0
        client.close()
    return 2 * nbytes * iters / took


def linear(input_shape, num_classes):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(int(np.prod(input_shape)), num_classes, bias=False))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=16.0, help="model size in MiB")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(1)
    raw = raw_echo(int(a.mb * (1 << 20)) // a.servers, a.servers, a.iters)
    ours = psgd_push_pull(a.mb, a.servers, a.iters)
    print(f"model {a.mb:.0f} MiB over {a.servers} shards, {a.iters} round trips")
    print(f"raw ZeroMQ echo      {raw / 1e9:6.2f} GB/s")
    print(f"psgd push+pull+step  {ours / 1e9:6.2f} GB/s   ratio {ours / raw:.2f}")


if __name__ == "__main__":
    main()
