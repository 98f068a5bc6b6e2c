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

`SimShard` is the real `Shard` whose replies are packets (it makes them in `_reply`);
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
    """The message `wire.decode(wire.encode(op, ...))` gives, with its sizes."""
    tensors, specs, dtypes, payload = _payload(arrays)
    packed = wire.pack_header({"v": wire.PROTOCOL_VERSION, "op": op, "id": id, "rank": rank, "clock": clock,
                               "arrays": specs, **fields})
    if not _as_sent(fields):
        fields = {k: v for k, v in msgpack.unpackb(packed, strict_map_key=True).items() if k in fields}
    return Packet(op, id, rank, clock, fields, dtypes, tensors, len(packed) + payload, payload)


def _payload(arrays: Any) -> tuple[list[torch.Tensor], list[list], list[str], int]:
    """A packet's arrays as sent: (their tensors, the header's [dtype, shape] of each,
    their dtypes' names, their bytes). Each tensor that goes as it is is described once
    (`_seen`, filled by `_described`): a worker sends the same buffers every step, a
    shard the same snapshot to every reader; every array of every packet comes here."""
    tensors: list[torch.Tensor] = []
    specs: list[list] = []
    dtypes: list[str] = []
    payload = 0
    for a in arrays:
        seen = _seen.get(id(a))
        if seen is not None and seen[0]() is a:
            t, spec, nbytes = _without_grad(a), seen[1], seen[2]
        else:
            t, spec, nbytes = _described(a)
        tensors.append(t)
        specs.append(spec)
        dtypes.append(spec[0])
        payload += nbytes
    return tensors, specs, dtypes, payload


def _as_sent(fields: dict) -> bool:
    """Does every field arrive as it is sent: a scalar, or a flat map of scalars? (Loops,
    not `all` over a generator, nor sets of the types: every packet asks, a few times
    per worker step, of a few fields.)"""
    for v in fields.values():
        if type(v) not in _SCALARS and not _flat_map(v):
            return False
    return True


def _flat_map(v: Any) -> bool:
    """Does `v` arrive as it is sent: a dict of str keys and scalar values (a push's
    answer inside its read's, `Shard._answer`)?"""
    if type(v) is not dict:
        return False
    for k, x in v.items():
        if type(k) is not str or type(x) not in _SCALARS:
            return False
    return True


def _tensor(a: Any) -> torch.Tensor:
    """An array to send (a CPU tensor or a numpy array) as the tensor `wire.tensor` reads."""
    if _goes_as_it_is(a):
        return _without_grad(a)
    name, x = wire._as_array(a)
    return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if name == "bfloat16" else torch.from_numpy(x)


def _without_grad(t: Any) -> torch.Tensor:
    return t.detach() if t.requires_grad else t


def _goes_as_it_is(a: Any) -> bool:
    """Is `a` a tensor that is sent as it is (no conversion, no copy)?"""
    return isinstance(a, torch.Tensor) and a.dtype in _NAMES and a.is_contiguous()


_seen: dict[int, tuple[weakref.ref, list, int]] = {}   # id -> (the tensor, [dtype, shape], bytes)


def _described(a: Any) -> tuple[torch.Tensor, list, int]:
    """An array not in `_seen` as (its tensor, the header's [dtype, shape], its bytes),
    kept in `_seen` if it goes as it is (a tensor sent does not change its dtype, shape
    or layout in place); others are converted every time they are sent. Only a weak
    reference is kept: a tensor sent may be freed."""
    key = id(a)
    t = _tensor(a)
    spec, nbytes = [_NAMES[t.dtype], list(t.shape)], t.nbytes
    if _goes_as_it_is(a):
        _seen[key] = (weakref.ref(a, _forget(key)), spec, nbytes)
    return t, spec, nbytes


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
    """The real shard, whose replies are packets (`Shard._reply`); its error replies are
    frames, which `received` turns into packets."""

    def _reply(self, req: wire.Message, arrays: Any = (), **fields: Any) -> Packet:
        return packet("reply", id=req.id, rank=req.rank, clock=req.clock, arrays=arrays, **fields)
