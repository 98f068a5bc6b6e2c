"""Messages in process: what `wire.encode` and then `wire.decode` would hand the
receiver, without building the bytes.

A `Packet` is the `wire.Message` the receiver gets, and it knows its size on the wire
(`nbytes`: the msgpack header and the arrays, exactly as `wire.encode` sends them;
`payload`: the arrays alone, what a shard's service time is made of). Its arrays are
the sender's tensors (`tensors`, what `wire.tensor` reads), and `arrays` their numpy
views, made when first read (a received frame is a view of the bytes sent without
copies, too). Header fields that are not scalars (or flat maps of scalars) go through
msgpack, so that they arrive as they would (tuples as lists); the header is packed
only to be measured.

`SimShard` is the real `Shard` whose replies are packets (it makes them in `_reply_with`);
its error replies (refusals, bad messages) are encoded by the shard as always, and
`received` turns those frames into packets.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import torch

from .. import wire
from ..shard import Shard

_SCALARS = frozenset({int, float, str, bool, type(None)})
_NAMES = {getattr(torch, name): name for name in wire.DTYPES}


class Packet(wire.Message):
    """A message in process (see the module docstring)."""

    leaves_at = 0.0   # a request queued behind its sender's earlier ones: when it leaves (`Simulation.send`)

    def __init__(self, op: str, id: int, rank: int, clock: int, fields: dict, dtypes: list[str],
                 tensors: list[torch.Tensor], nbytes: int, payload: int, arrays: list | None = None):
        # one attribute a statement: faster than assigning tuples (a few packets per worker step)
        self.op = op
        self.id = id
        self.rank = rank
        self.clock = clock
        self.fields = fields
        self.dtypes = dtypes
        self.tensors = tensors
        self.nbytes = nbytes
        self.payload = payload
        self._arrays = arrays

    @property
    def arrays(self) -> list[np.ndarray]:  # type: ignore[override]
        if self._arrays is None:
            self._arrays = [t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
                            for t in self.tensors]
        return self._arrays


def packet(op: str, *, id: int = 0, rank: int = -1, clock: int = -1, arrays: Any = (), **fields: Any) -> Packet:
    """The message `wire.decode(wire.encode(op, ...))` gives, with its sizes (`make`)."""
    return make(op, id, rank, clock, arrays, fields)


def make(op: str, id: int, rank: int, clock: int, arrays: Any, fields: dict) -> Packet:
    """`packet`, its arguments positional and its fields a dict that the packet keeps
    (the caller's own: not changed after). Every request and reply of a run is made
    here, a few per worker step: the loops are written out, not calls per array or per
    field (a Python call costs about as much as packing the whole header), and the
    simulation's callers pass their fields as the dict they have (a keyword call that
    spreads a dict and collects it again cost a sixth of a packet)."""
    tensors: list[torch.Tensor] = []
    specs: list[list] = []
    dtypes: list[str] = []
    payload = 0
    described = 0   # the specs' packed bytes
    for a in arrays:   # each tensor that goes as it is is described once (`_seen`, filled by `_described`)
        key = _key(a)
        seen = _seen.get(key)
        # described before: the same tensor (ids compared: `a is` its referent would make mypy take
        # `a` for Tensor | None, and `typing.cast` is a call per array)
        if seen is not None and _key(seen[0]()) == key:
            t, spec, nbytes, spec_bytes = a if seen[3] else a.detach(), seen[1], seen[2], seen[4]
        else:
            t, spec, nbytes, spec_bytes = _described(a)
        tensors.append(t)
        specs.append(spec)
        dtypes.append(spec[0])
        payload += nbytes
        described += spec_bytes
    # The header's size, counted as msgpack packs it (the sizes of ints, bools, None and
    # floats written out; see `_scalar_size`); a value of another kind is measured by packing.
    size = _OPS.get(op) if type(id) is int and type(rank) is int and type(clock) is int and "v" not in fields else None
    if size is not None:
        entries, count = len(fields) + 6, len(specs)
        size += (described + (1 if count < 16 else 3 if count < 0x10000 else 5)
                 + (1 if entries < 16 else 3 if entries < 0x10000 else 5))
        try:   # an int's size by its bit length (`_POS`, `_NEG`; IndexError: beyond 64 bits, measured by packing)
            size += ((_POS[id.bit_length()] if id >= 0 else _NEG[(~id).bit_length()])
                     + (_POS[rank.bit_length()] if rank >= 0 else _NEG[(~rank).bit_length()])
                     + (_POS[clock.bit_length()] if clock >= 0 else _NEG[(~clock).bit_length()]))
            for name, v in fields.items():
                kind = type(v)
                if kind is int:
                    size += _POS[v.bit_length()] if v >= 0 else _NEG[(~v).bit_length()]
                elif kind is bool or v is None:
                    size += 1
                elif kind is float:
                    size += 9
                elif kind is dict:   # a flat map (a push's answer inside its read's), its scalars as above
                    count = len(v)
                    size += 1 if count < 16 else 3 if count < 0x10000 else 5
                    for inner, x in v.items():
                        kind = type(x)
                        if kind is int:
                            size += _POS[x.bit_length()] if x >= 0 else _NEG[(~x).bit_length()]
                        elif kind is bool or x is None:
                            size += 1
                        else:
                            size += _scalar_size(x)
                        size += _KEYS.get(inner) or _key_size(inner)
                else:
                    size += _str_size(v) if kind is str else _NO_SIZE
                size += _KEYS.get(name) or _key_size(name)
        except IndexError:
            size = _NO_SIZE
        if size < 0:
            size = None
    if size is None:   # measured by packing; a field that is not a scalar or a flat map arrives as msgpack makes it
        packed = _pack({"v": wire.PROTOCOL_VERSION, "op": op, "id": id, "rank": rank, "clock": clock,
                        "arrays": specs, **fields})
        size = len(packed)
        for v in fields.values():
            if type(v) not in _SCALARS and not _flat_map(v):
                fields = {k: v for k, v in msgpack.unpackb(packed, strict_map_key=True).items() if k in fields}
                break
    return Packet(op, id, rank, clock, fields, dtypes, tensors, size + payload, payload)


_key = id   # (`packet`'s own `id` is the request's)

# The header's packer: the simulation runs one body at a time (greenlets, or threads
# strictly handed off), so one reused Packer serves every packet (`wire.pack_header`
# keeps one per thread, for the daemons' threads).
_pack = msgpack.Packer(use_bin_type=True).pack


# ---------------------------------------------------------------- the header's size, counted
# A header is measured, not packed (packing it, and the dict it is packed from, was about
# a tenth of a timing-only worker step): msgpack's sizes of the values it holds, as
# `msgpack.Packer(use_bin_type=True)` writes them (`packet` has those of ints, bools,
# None and floats written out). Any other value (a list, a map in a map, a non-ASCII string,
# an int beyond 64 bits or of a subclass) makes `packet` pack the header, as it did
# before; tests/test_simulate.py checks the sizes against the packer's.
_NO_SIZE = -(1 << 40)   # a value measured by packing: the sum stays negative
# msgpack's size of an int by its bit length: `_POS[v.bit_length()]` for v >= 0 (fixint,
# uint8, 16, 32, 64), `_NEG[(~v).bit_length()]` for v < 0 (negative fixint, int8 ... int64);
# beyond 64 bits an IndexError or _NO_SIZE (the packer's OverflowError)
_POS = [1] * 8 + [2] + [3] * 8 + [5] * 16 + [9] * 32
_NEG = [1] * 6 + [2] * 2 + [3] * 8 + [5] * 16 + [9] * 32 + [_NO_SIZE]


def _str_size(s: str) -> int:
    """msgpack's size of an ASCII str (_NO_SIZE for another: its UTF-8 is measured by packing)."""
    if not s.isascii():
        return _NO_SIZE
    n = len(s)
    return n + (1 if n < 32 else 2 if n < 0x100 else 3 if n < 0x10000 else 5)


def _scalar_size(v: Any) -> int:
    """msgpack's size of a scalar that arrives as it is sent (_NO_SIZE for another value)."""
    t = type(v)
    if t is int:
        return (1 if -0x21 < v < 0x80 else 2 if -0x81 < v < 0x100 else 3 if -0x8001 < v < 0x10000 else
                5 if -0x80000001 < v < 0x100000000 else 9 if -0x8000000000000001 < v < 0x10000000000000000 else
                _NO_SIZE)
    if t is bool or v is None:
        return 1
    if t is float:
        return 9
    if t is str:
        return _str_size(v)
    return _NO_SIZE


_KEYS: dict[str, int] = {}   # a field's name -> its packed size


def _key_size(k: Any) -> int:
    """A field name's packed size (kept in `_KEYS` when it is counted)."""
    n = _str_size(k) if type(k) is str else _NO_SIZE
    if n > 0:
        _KEYS[k] = n
    return n


# a header's fixed part by its op: its keys ("v", "op", "id", "rank", "clock", "arrays"),
# its version and its op (an op that is not the wire's is measured by packing)
_BASE = sum(len(_pack(k)) for k in ("v", "op", "id", "rank", "clock", "arrays")) + len(_pack(wire.PROTOCOL_VERSION))
_OPS: dict[str, int] = {op: _BASE + len(_pack(op)) for op in wire.OPS}


def _flat_map(v: Any) -> bool:
    """Does `v` arrive as it is sent: a dict of str keys and scalar values (a push's
    answer inside its read's, `Shard._answer`)?"""
    if type(v) is not dict:
        return False
    for k, x in v.items():
        if type(k) is not str or type(x) not in _SCALARS:
            return False
    return True


def _goes_as_it_is(a: Any) -> bool:
    """Is `a` a tensor that is sent as it is (no conversion, no copy)?"""
    return isinstance(a, torch.Tensor) and a.dtype in _NAMES and a.is_contiguous()


# id -> (the tensor, [dtype, shape], bytes, whether it goes without `detach()`, the spec's packed bytes)
_seen: dict[int, tuple[weakref.ref, list, int, bool, int]] = {}


def _described(a: Any) -> tuple[torch.Tensor, list, int, int]:
    """An array not in `_seen` as (its tensor, the header's [dtype, shape], its bytes, the
    spec's packed bytes), kept in `_seen` if it goes as it is (a tensor sent does not
    change its dtype, shape, layout or `requires_grad` in place); others are converted
    every time they are sent. Only a weak reference is kept: a tensor sent may be freed."""
    if _goes_as_it_is(a):
        key = id(a)
        spec = [_NAMES[a.dtype], list(a.shape)]
        n = len(_pack(spec))
        _seen[key] = (weakref.ref(a, _forget(key)), spec, a.nbytes, not a.requires_grad, n)
        return (a.detach() if a.requires_grad else a), spec, a.nbytes, n
    name, x = wire._as_array(a)
    t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if name == "bfloat16" else torch.from_numpy(x)
    spec = [_NAMES[t.dtype], list(t.shape)]
    return t, spec, t.nbytes, len(_pack(spec))


def _forget(key: int, seen: dict = _seen) -> Callable[[Any], None]:
    """The callback that drops a dead tensor's entry (`seen` held here: at the
    interpreter's exit the module's globals may be gone before the last tensors)."""
    return lambda _: seen.pop(key, None)


def packets(replies: list[tuple[Any, Any]]) -> list[tuple[Any, Packet]]:
    """A shard's replies, (token, packet or frames), as packets."""
    return [(token, m if isinstance(m, Packet) else received(m)) for token, m in replies]


def received(frames: list) -> Packet:
    """A message the shard encoded, as the receiver decodes it."""
    m = wire.decode(frames)
    nbytes = sum(len(x) for x in frames)
    return Packet(m.op, m.id, m.rank, m.clock, m.fields, m.dtypes, [wire.tensor(m, k) for k in range(len(m.arrays))],
                  nbytes, nbytes - len(frames[0]), m.arrays)


class SimShard(Shard):
    """The real shard, whose replies are packets (`Shard._reply_with`); its error replies are
    frames, which `received` turns into packets. The simulation builds the model once
    and hands it to each of them (`Shard`'s `model`; they built one each)."""

    def _reply_with(self, req: wire.Message, arrays: Any, fields: dict) -> Packet:
        return make("reply", req.id, req.rank, req.clock, arrays, fields)
