"""A seeded fuzzer of the daemons' serve paths (helper K, session 31): mutations of the
messages each mode's shard and the coordinator take (pushes dense, topk, onebit, in
bfloat16 and float16; elastic offers; ltfb deposits with their optimizer-state arrays and
fetches; reads, inits, stats; registrations, heartbeats with counters, finishes, scores),
each served through the daemon's own `Service._serve`. No message may raise out of a
handler (an `internal` error reply), a shard's tables stay finite, and the coordinator's
work outside any request (its tick, its status, summary.json) goes on after each.
`psgd run` under the same fuzzer (10,000 messages a job, every mode) is what
test_reliability's `test_fuzz_a_live_shard_while_it_trains` does for one."""
from __future__ import annotations

import math
import random
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from psgd import compression, wire
from psgd.config import Config
from psgd.shard import Shard
from psgd.transport import Service
from tests.conftest import closed_after, hand_served

INTS = [0, 1, 2, 3, 5, 9, 10, 11, -1, -2, 2 ** 31, 2 ** 53, 2 ** 62 - 1, -(2 ** 62)]
FLOATS = [0.0, 0.5, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e308, 1e-300]
ANY = INTS + FLOATS + [True, False, "", "topk", "onebit", None, [], {}, [1, 2], {"a": 1}]


def honest_arrays(rng: random.Random, op: str, shard: Shard, nopt: int) -> list[tuple[str, np.ndarray]]:
    """The arrays of an honest request `op` to `shard` (before any mutation)."""
    g = np.random.default_rng(rng.randrange(1 << 30))
    P, B = shard.P, shard.B

    def vec(n: int) -> np.ndarray:
        return (g.standard_normal(n) * 0.01).astype(np.float32)
    if op == "push" and shard.codec != "none":
        (dt0, n0), (dt1, n1) = compression.shapes(shard.codec, P, shard.cfg.wire.topk_fraction)
        if shard.codec == "topk":
            return [("float32", vec(n0)), ("float32", vec(B)),
                    ("int32", g.choice(P, n1, replace=False).astype(np.int32))]
        return [("uint8", g.integers(0, 256, n0).astype(np.uint8)), ("float32", vec(B)),
                ("float32", np.abs(vec(n1)))]
    if op in ("push", "elastic"):
        if shard.wire_dtype == "bfloat16":
            bits = torch.from_numpy(vec(P)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return [("bfloat16", bits), ("float32", vec(B))]
        return [(shard.wire_dtype, vec(P).astype(wire.DTYPES[shard.wire_dtype])), ("float32", vec(B))]
    if op in ("put_model", "init"):
        return [("float32", vec(P)), ("float32", vec(B))] + [("float32", vec(P)) for _ in range(nopt)]
    return []


def mutated(rng: random.Random, arrays: list, P: int, B: int) -> list:
    arrays = list(arrays)
    k = rng.randrange(5)
    if k == 0 and arrays:   # a NaN, an Inf, an index out of range, a NaN's bfloat16 bits
        i = rng.randrange(len(arrays))
        dt, a = arrays[i]
        a = a.copy()
        if a.size:
            j = rng.randrange(a.size)
            if a.dtype.kind == "f":
                a[j] = rng.choice([np.nan, np.inf, -np.inf, float(np.finfo(a.dtype).max)])
            elif dt == "int32":
                a[j] = rng.choice([-1, P, 2 ** 31 - 1, a[0]])
            elif dt == "bfloat16":
                a[j] = rng.choice([0x7FC0, 0x7F80, 0xFF80])
        arrays[i] = (dt, a)
    elif k == 1:   # an array too few or too many
        if arrays and rng.random() < 0.5:
            arrays.pop(rng.randrange(len(arrays)))
        else:
            arrays.append(("float32", np.zeros(rng.choice([P, B, 3]), np.float32)))
    elif k == 2 and arrays:   # another dtype
        i = rng.randrange(len(arrays))
        name = rng.choice(sorted(wire.DTYPES))
        arrays[i] = (name, np.zeros(arrays[i][1].size, wire.DTYPES[name]))
    elif k == 3 and arrays:   # another shape
        i = rng.randrange(len(arrays))
        dt, a = arrays[i]
        arrays[i] = (dt, a.reshape(2, -1) if a.size % 2 == 0 and a.size and rng.random() < 0.5
                     else np.concatenate([a, np.zeros(1, a.dtype)]))
    elif arrays:
        rng.shuffle(arrays)
    return arrays


def shard_message(rng: random.Random, shard: Shard, nopt: int) -> list:
    op = rng.choice(sorted(shard.rule.serves) * 2 + ["stats", "models", "init", "get_model", "elastic", "push"])
    rank = rng.choice([0, 1, 0, 1, -1, 2, 2 ** 40])
    clock = rng.choice([0, 1, 2, 3, 9, 10, 11, -1, 2 ** 61])
    rnd = rng.choice([0, 1, 2, -1, 10, 11, 2 ** 40, -(2 ** 62)])
    fields: dict = {"push": {"read_version": rng.choice([0, 1, 2]), "pull": rng.random() < 0.3,
                             **({"codec": shard.codec} if shard.codec != "none" else {})},
                    "elastic": {"round": rnd}, "put_model": {"round": rnd, "score": rng.random(), "step": 1},
                    "get_model": {"round": rnd, "owner": rng.choice([-1, 0, 1, 7]), "exact": rng.random() < 0.5,
                                  **({"score": rng.random()} if rng.random() < 0.5 else {})},
                    "pull": {"join": rng.random() < 0.1}}.get(op, {})
    arrays = honest_arrays(rng, op, shard, nopt)
    r = rng.random()
    if r < 0.45:
        arrays = mutated(rng, arrays, shard.P, shard.B)
    elif r < 0.8 and wire.OPS[op]:
        fields[rng.choice(sorted(wire.OPS[op]))] = rng.choice(ANY)
    header = {"v": 1, "op": op, "id": rng.randrange(1 << 20), "rank": rank, "clock": clock,
              "arrays": [[dt, list(a.shape)] for dt, a in arrays], **fields}
    frames = [msgpack.packb(header, use_bin_type=True)] + [a.tobytes() for _, a in arrays]
    if rng.random() < 0.03:
        frames.append(b"beyond the header's count")
    return frames


SHARD_JOBS = {
    "sync": {}, "sync-backup": {"mode.backup_workers": 1}, "ssp": {"mode.name": "ssp"},
    "async": {"mode.name": "async", "mode.dc_lambda": 0.1}, "easgd": {"mode.name": "easgd", "mode.alpha": 0.1},
    "easgd-sync": {"mode.name": "easgd", "mode.sync": True, "mode.alpha": 0.1},
    "diloco": {"mode.name": "diloco", "mode.local_steps": 2}, "ltfb": {"mode.name": "ltfb"},
    "ltfb-adam": {"mode.name": "ltfb", "optimizer.name": "adam"},
    "topk": {"wire.compression": "topk"}, "onebit": {"mode.name": "async", "wire.compression": "onebit"},
    "bfloat16": {"wire.dtype": "bfloat16"}, "float16": {"mode.name": "ssp", "wire.dtype": "float16"},
}


@pytest.mark.inprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("job", list(SHARD_JOBS), ids=list(SHARD_JOBS))
def test_a_fuzzed_shard_refuses_bad_messages_and_keeps_its_tables_finite(job):
    cfg = Config().replace(**{"cluster.workers": 2, "cluster.servers": 1, "train.steps": 10, "model.hidden": 16,
                              **SHARD_JOBS[job]})
    shard = Shard(cfg, 0)
    nopt = {"adam": 2, "sgd": 1}.get(cfg.optimizer.name, 0) if cfg.mode.name == "ltfb" else 0
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)   # (never bound: `_serve` reads no socket)
    try:
        service = Service(sock, shard.handlers, "shard 0", counters=shard.counters)
        rng = random.Random(31)
        codes: dict = {}
        for i in range(300):
            for _, frames in service._serve(b"peer%d" % (i % 5), shard_message(rng, shard, nopt)):
                m = wire.decode([bytes(f) for f in frames])
                codes[m.get("code", m.op)] = codes.get(m.get("code", m.op), 0) + 1
            if i % 60 == 0:
                shard.set_live({0: 0, 1: 0} if rng.random() < 0.7 else {0: 0})
            assert torch.isfinite(shard.params).all() and torch.isfinite(shard.buffers).all(), i
        assert wire.INTERNAL not in codes, codes
        assert shard.counters["bad_messages"] >= 100, (shard.counters, codes)
    finally:
        sock.close(0)
        ctx.term()


def coordinator_message(rng: random.Random) -> list:
    op = rng.choice(["register", "heartbeat", "heartbeat", "finish", "release", "layout", "eval", "status"])
    role = rng.choice(["worker", "worker", "server", "evaluator", "other"])
    stats = {"samples": 64, "steps": 2, "clock": 2, "elapsed_s": 1.5, "wait_s": 0.25, "bytes_sent": 100,
             "bytes_recv": 200, "staleness_hist": [2] + [0] * 32, "staleness_sum": 0, "staleness_max": 0,
             "loss": 0.5, "retries": 0, "rejected": 0, "bad_messages": 0, "busy_s": 0.1, "dropped": 0,
             "max_clock_gap": 0}
    for _ in range(rng.choice([0, 1, 1, 2])):
        stats[rng.choice(sorted(stats))] = rng.choice(ANY + [[3] * 40, -3])
    f: dict = {
        "register": {"role": role, "index": rng.choice([0, 1, -1]), "want_rank": rng.choice([-1, 0, 1, 2, 2 ** 40]),
                     "nonce": rng.choice(["n0", "n1", "zz", ""])},
        "heartbeat": {"role": role, "index": rng.choice([0, 1, 9]), "nonce": rng.choice(["n0", "n1", "", "zz"]),
                      "stats": stats, "logged": rng.choice([{}, {"samples": 10}, {"samples": -5}, {"steps": [1]}])},
        "finish": {"nonce": rng.choice(["n0", "n1", ""]), "stats": stats, "hold": rng.random() < 0.1},
        "eval": {"accuracy": rng.choice([0.5, 1.0, math.nan, 2.0]), "loss": rng.choice(FLOATS),
                 "age_s": rng.choice(FLOATS + INTS), "final": rng.random() < 0.3},
    }.get(op, {})
    if rng.random() < 0.3 and wire.OPS[op]:
        f[rng.choice(sorted(wire.OPS[op]))] = rng.choice(ANY + [[["w", [2], "float32", True]], "x" * 3000])
    header = {"v": 1, "op": op, "id": rng.randrange(1 << 20), "rank": rng.choice([0, 1, 0, 1, -1, 2, 2 ** 40]),
              "clock": rng.choice([0, 1, 5, 300, 301, 302, -1, 2 ** 61]), "arrays": [], **f}
    return [msgpack.packb(header, use_bin_type=True)]


@pytest.mark.inprocess
@pytest.mark.timeout(60)
def test_a_fuzzed_coordinator_refuses_bad_messages_and_goes_on_ticking(tmp_path):
    """What died of such a message was the coordinator's work outside any request (its
    tick's sums of samples, status, summary.json): each is run after every message."""
    rng = random.Random(31)
    internal = []
    for trial in range(3):
        with closed_after(hand_served(out=str(tmp_path / str(trial)), **{"train.steps": 300})) as c:
            for i in range(150):
                for _, frames in c.service._serve(b"peer%d" % (i % 5), coordinator_message(rng)):
                    m = wire.decode(frames)
                    if m.get("code") == wire.INTERNAL:
                        internal.append(m.get("reason"))
                c._tick(time.monotonic())
                c.on_status(b"s", wire.decode(wire.encode("status")))
            if c.phase != "done":
                c._finish_job()
            assert isinstance(c.summary["samples"], int)
    assert not internal, internal[:5]
