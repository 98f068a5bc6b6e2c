"""The simulator's fast paths give what the paths they replace gave: a header's size
counted instead of packed, a step's event-log line written out instead of encoded as a
dict, and the network's arithmetic written out in `Simulation` instead of called on
`Network` (docs/simulation.md, "Speed")."""
from __future__ import annotations

import math
import random
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from psgd import wire
from psgd.config import load
from psgd.metrics import json_line
from psgd.sim import messages
from psgd.sim import run as sim_run
from psgd.sim.messages import packet
from psgd.sim.run import Simulation

_packed = msgpack.Packer(use_bin_type=True).pack


def header_bytes(op: str, id: int, rank: int, clock: int, arrays: list, fields: dict) -> int:
    """What `packet` measured by packing the header: the packer's size of it, and the arrays'."""
    specs = [[messages._NAMES[a.dtype], list(a.shape)] for a in arrays]
    return len(_packed({"v": wire.PROTOCOL_VERSION, "op": op, "id": id, "rank": rank, "clock": clock,
                        "arrays": specs, **fields})) + sum(a.nbytes for a in arrays)


EDGES = [0, 1, 0x1F, 0x20, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0x8000, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000,
         0xFFFFFFFF, 0x100000000, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1]
INTS = sorted(v for v in {s * e for e in EDGES for s in (1, -1)} | {-0x21, -0x81, -0x8001, -0x80000001, -(2 ** 63)}
              if -(2 ** 63) <= v < 2 ** 64)   # (what msgpack packs)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_header_is_counted_to_the_byte_the_packer_gives():
    """Every int size msgpack has (both signs, at each edge), bools, None, floats, ASCII
    and other strings, flat maps, long ones (map16), and values counted by packing the
    header (a list, a map in a map, a non-ASCII name): the packet's bytes are the packer's."""
    g = torch.zeros(5)
    values: list[Any] = [*INTS, True, False, None, 0.5, float("nan"), "", "a" * 31, "a" * 32, "a" * 255, "a" * 256,
                         "é", [1, 2], (3,), {"staleness": 3, "version": 2 ** 40, "s": "x", "n": None, "f": 0.5},
                         {f"k{j}": j for j in range(16)}, {"a": {"b": 1}}, {"é": 1}, {"a": "é"}]
    for v in values:
        for arrays in ([], [g], [g, torch.zeros(2, 3)], [g] * 16):
            for kw in ({"field": v}, {"x" * 40: v, "read_version": 7}, {f"f{j}": v for j in range(12)}):
                assert packet("reply", id=5, rank=3, clock=-1, arrays=arrays, **kw).nbytes == header_bytes(
                    "reply", 5, 3, -1, arrays, kw), (v, len(arrays), list(kw))
    for v in INTS:   # the request's own id, rank and clock
        assert packet("push", id=abs(v), rank=v, clock=v).nbytes == header_bytes("push", abs(v), v, v, [], {}), v
    for big in (2 ** 64, -(2 ** 63) - 1):   # beyond 64 bits: the packer's OverflowError, as before
        with pytest.raises(OverflowError):
            packet("reply", id=1, version=big)
        with pytest.raises(OverflowError):
            packet("reply", id=big)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_random_headers_are_counted_as_packed_and_arrive_as_decoded():
    rng = random.Random(7)
    g = torch.zeros(3)
    pool = [lambda: rng.randint(-2 ** 40, 2 ** 40), lambda: rng.randint(-300, 70_000), lambda: rng.random(),
            lambda: rng.choice([True, False, None]), lambda: "s" * rng.randint(0, 300),
            lambda: {"staleness": rng.randint(0, 5000), "version": rng.randint(0, 2 ** 33)}, lambda: [1, "a"]]
    for _ in range(3000):
        fields = {rng.choice(["step", "finished", "version", "push", "name", "y" * 40]): rng.choice(pool)()
                  for _ in range(rng.randint(0, 16))}
        kw = {"id": rng.randint(0, 2 ** 33), "rank": rng.randint(-1, 4000), "clock": rng.randint(-1, 70_000),
              "arrays": rng.choice([[], [g], [g, torch.zeros(4, 2)]]), **fields}
        got = packet("reply", **kw)
        assert got.nbytes == header_bytes("reply", kw["id"], kw["rank"], kw["clock"], kw["arrays"], fields)
        want = wire.decode(wire.encode("reply", **kw))
        assert got.fields == want.fields and [type(v) for v in got.fields.values()] == [
            type(v) for v in want.fields.values()]


def step_lines(w: Any) -> list[tuple]:
    """Step lines (as `log_step` keeps them) of every kind the schedules log, and odd ones."""
    lines = []
    for loss in (0.0, 0.123456789, float("nan"), float("inf"), -float("inf"), 1e-7, 12345678.9, 3, np.float64(0.25)):
        for extra in ({}, {"dropped": False}, {"dropped": True, "jitter": False}, {"cached": True},
                      {"pushed": False}, {"refused": True, "round": 3}, {"note": None}, {"partner": 7, "won": True},
                      {"score": 0.5}, {"name": "é"}, {"é": True}, {"clock": 99}, {"loss": False},
                      {"ratio": float("nan")}):
            lines.append((1.23456789, 17, 18, loss, 34, 2, 0.0123456789, 123_456, 234_567, extra))
    lines += [(1e-5, 1, 1, 0.5, 2, 0, 1e-9, 0, 0, {}), (2.5e17, 2, 2, 0.5, 2, 0, float("inf"), 0, 0, {}),
              (0.5, 4, 4, 0.5, 2, True, 0.0, 0, 0, {}),
              (0.5, 5, 5, 0.5, 2, 0, 0.0, 2 ** 70, -1, {}), (-0.0, 6, 6, -0.0, 0, 0, -0.0, 0, 0, {})]
    return lines


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_step_line_is_written_as_json_line_writes_its_dict():
    cfg = load(None, ["cluster.workers=2", "sim.train=false", "sim.compute_s=0.01", "train.steps=1"], env={})
    w = Simulation(cfg, 0.01).workers[1]
    lines = step_lines(w)
    w.lines = [*lines, {"t": 0.5, "role": "worker", "event": "x"}, lines[0]]
    assert w.log_text() == [json_line(x) for x in w.log_lines()]
    assert w.log_text(3) == [json_line(x) for x in w.log_lines(3)]


def reference_network(monkeypatch) -> None:
    """The simulation's message path as it was, through `Network`'s methods."""
    def send(self, w, items):
        now, net = self.loop.now, self.net
        for i, msg, token in items:
            start = net.depart(w.node, msg.nbytes, now)
            if start > now:
                self.loop.at(start, self.arrive, i, token, msg, start)
            else:
                self.arrive(i, token, msg, start)

    def arrive(self, i, token, msg, start):
        node, net = self.nodes[i], self.net
        self.loop.at(net.serve(node, self.applied(i, msg), net.arrive(node, msg.nbytes, start)), self.handle, i,
                     token, msg)

    def handle(self, i, token, msg):
        self.changes += 1
        self.moved_at = self.loop.now
        for tok, m in self.serve(i, token, msg):
            self.reply(i, tok, m)

    def reply(self, i, token, msg):
        now, net = self.loop.now, self.net
        start = net.depart(self.nodes[i], msg.nbytes, now)
        if start > now and len(self.nodes) > 1:
            self.loop.at(start, self.answer, i, token, msg, start)
        else:
            self.answer(i, token, msg, start)

    def answer(self, i, token, msg, start):
        self.loop.at(self.net.arrive(token[0].node, msg.nbytes, start), self.deliver, i, token, msg)

    for name, fn in (("send", send), ("arrive", arrive), ("handle", handle), ("reply", reply), ("answer", answer)):
        monkeypatch.setattr(sim_run.Simulation, name, fn)


@pytest.mark.unit
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async", "easgd", "ltfb"])
def test_the_network_written_out_gives_the_runs_network_gives(monkeypatch, mode):
    """Slow NICs (messages queue at both ends), 1 and 3 shards, stragglers: the same
    summaries, event counts and busy times as the path through `Network`'s methods."""
    def summaries() -> list:
        out: list = []
        for servers in (1, 3):
            cfg = load(None, [f"mode.name={mode}", "cluster.workers=6", f"cluster.servers={servers}",
                              "sim.train=false", "train.steps=12", "sim.compute_s=0.001", "sim.compute_cv=0.5",
                              "sim.bandwidth_gbps=0.05", "sim.apply_gbps=0.1", "sim.latency_s=3e-4"], env={})
            sim = Simulation(cfg, cfg.sim.compute_s)
            out.append(sim.run())
            # the NICs' and shards' times to the last bit (summary.json rounds them)
            nodes = sim.nodes + [w.node for w in sim.workers]
            out.append([(n.tx_free, n.rx_free, n.cpu_free, n.busy_s) for n in nodes])
        return out
    fast = summaries()
    with monkeypatch.context() as m:
        reference_network(m)
        assert summaries() == fast
    assert all(math.isfinite(s["wall_s"]) and s["sim"]["events"] > 0 for s in fast[::2])


@pytest.mark.inprocess
@pytest.mark.timeout(120)
def test_a_first_spill_that_fails_part_way_leaves_no_event_logs(tmp_path, monkeypatch):
    """A full disk while the event logs are written as the run goes (`Simulation.spill`):
    the run fails and the files it began go, as before the step lines were written out."""
    from psgd.sim.worker import SimWorker
    monkeypatch.setattr(sim_run, "SPILL_LINES", 20, raising=False)
    monkeypatch.setattr(SimWorker, "_step_text", lambda self, step: (_ for _ in ()).throw(OSError(28, "No space left")))
    cfg = load(None, ["cluster.workers=4", "train.steps=60", "sim.compute_s=0.01", "mode.name=async",
                      "sim.train=false"], env={})
    with pytest.raises(OSError):
        Simulation(cfg, 0.01).run(str(tmp_path / "c"))
    assert not (tmp_path / "c" / "events").exists()
