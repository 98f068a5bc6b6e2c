"""The psgd wire protocol: the only module that builds or parses messages.

A message is a ZeroMQ multipart message::

    frame 0      msgpack map, the header (at most MAX_HEADER bytes)
    frame 1..n   raw, C-contiguous, little-endian tensor bytes, one per array that
                 has any (an empty one, a model's buffers where it has none, is all
                 in its header: an empty frame each way made a raw pyzmq round trip
                 of 64 KiB 11-13 % slower on this project's 2-core machine)

The header always carries

    v       protocol version (PROTOCOL_VERSION); anything else is refused
    op      the operation, one of OPS
    id      request id, an int >= 0, echoed in the reply
    rank    sender's worker rank (-1 for other roles)
    clock   sender's clock (-1 when not applicable)
    arrays  one [dtype, shape] pair per array (at most MAX_FRAMES); dtype from DTYPES

plus the fields that OPS lists for that op, each with its type (the ops in NO_ARRAYS
carry no arrays). Replies use op
"reply" (free-form fields: scalars, lists and maps) or "error" (`code`, `reason`). A ROUTER socket
sees one routing-identity frame in front of frame 0; `split_identity` removes it.

Validation is strict and happens before anything is used: header size, msgpack
syntax, map type, version, op, id/rank/clock types, unknown or ill-typed fields,
the dtype whitelist, shapes (non-negative ints, at most MAX_DIMS), and each frame's
byte length against dtype and shape. A reader also takes a message with one frame for
every array, empty ones too (as senders before 2026-12-06 sent them); a reader from
before then refuses a message with an empty array and no frame for it ("header lists 2
arrays but 1 payload frames came"): a job's processes run one psgd. Every failure raises `WireError(code, reason)`;
servers turn it into an error reply and go on serving. Nothing is ever pickled.

Arrays are sent without copies: ZeroMQ reads them after `send` returns, so a sender
must not change an array until the peer has answered (state that the next update
changes is sent as a snapshot). Arrays are received without copies: `np.frombuffer` over the ZeroMQ frame's buffer
(a receiver must not write to it); `torch.from_numpy` can wrap that in turn.
"""
from __future__ import annotations

import math
import sys
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
MAX_HEADER = 1 << 20            # bytes
MAX_DIMS = 8
MAX_FRAMES = 64
MAX_MESSAGE = 1 << 31           # bytes; also set as the sockets' ZMQ_MAXMSGSIZE

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "float16": np.dtype("<f2"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "uint8": np.dtype("u1"),
    "bfloat16": np.dtype("<u2"),   # bfloat16's bits; numpy has no bfloat16 (see `tensor`)
}
_NAMES = {dt: name for name, dt in DTYPES.items() if name != "bfloat16"}  # numpy dtype -> wire name


def wider_than(dtype: str) -> str:
    """The `wire.dtype` values to set where values are beyond narrow `dtype`'s range (a
    refusal's advice, the worker's and the shard's)."""
    return '"bfloat16" (up to 3.39e38) or "float32"' if dtype == "float16" else '"float32"'

# Error codes: stable strings that clients and tests match on.
BAD_HEADER = "bad_header"
BAD_VERSION = "bad_version"
UNKNOWN_OP = "unknown_op"
BAD_FIELD = "bad_field"
BAD_DTYPE = "bad_dtype"
BAD_SHAPE = "bad_shape"
BAD_LENGTH = "bad_length"
TOO_LARGE = "too_large"
REFUSED = "refused"         # valid message, but not acceptable now (e.g. wrong role, unknown rank)
NOT_READY = "not_ready"     # a shard that has no initial values yet (a learned model before its init)
INTERNAL = "internal"

_num = (int, float)
_scalar = (int, float, str, bool, type(None))

# op -> {field: accepted types}. Every field listed is optional unless in REQUIRED.
OPS: dict[str, dict[str, tuple]] = {
    # to the coordinator
    "register": {"role": (str,), "index": (int,), "want_rank": (int,), "nonce": (str,), "job": (str,),
                 "layout": (list,)},
    "heartbeat": {"role": (str,), "index": (int,), "nonce": (str,), "stats": (dict,), "live_id": (str,),
                  "lost_tables": (str,), "afresh": (str,), "logged": (dict,), "leaving": (str,), "job": (str,),
                  "age_s": _num},
    "finish": {"nonce": (str,), "stats": (dict,), "error": (str,), "hold": (bool,), "logged": (dict,), "job": (str,),
               "idle_s": _num},
    "release": {"job": (str,)},
    "layout": {"job": (str,)},
    "eval": {"accuracy": _num, "loss": _num, "final": (bool,), "source": (int,), "age_s": _num, "job": (str,)},
    "status": {"job": (str,)},
    # to a shard
    "pull": {"join": (bool,), "since": (str,), "job": (str,)},
    "push": {"read_version": (int,), "lr_scale": _num, "codec": (str,), "pull": (bool,), "job": (str,)},
    "elastic": {"round": (int,), "job": (str,)},
    "put_model": {"round": (int,), "score": _num, "step": (int,), "tag": (int,), "job": (str,)},
    "get_model": {"round": (int,), "owner": (int,), "exact": (bool,), "score": _num, "job": (str,)},
    "models": {"job": (str,)},
    "stats": {"job": (str,)},
    "init": {"job": (str,)},
    # replies
    "reply": {"*": _scalar + (dict, list)},
    "error": {"code": (str,), "reason": (str,)},
}
REQUIRED: dict[str, tuple] = {
    "register": ("role",),
    "heartbeat": ("role",),
    "eval": ("accuracy", "loss"),
    "push": ("read_version",),
    "elastic": ("round",),
    "put_model": ("round", "score"),
    "get_model": ("round", "owner"),
    "error": ("code", "reason"),
}
_BASE = ("v", "op", "id", "rank", "clock", "arrays")
_BASE_SET = frozenset(_BASE)
_REPLY_TYPES = frozenset(OPS["reply"]["*"]) - {int}   # a reply field's types but int, whose range is asked (`_decode`)
_LIMIT = 1 << 62   # the header's ints, and a field's, lie in [-_LIMIT, _LIMIT): what a peer keeps must encode again
# ops that carry no arrays: any that come are refused (a parked pull kept them: memory
# that `max_parked` did not bound)
NO_ARRAYS = frozenset({"register", "heartbeat", "finish", "release", "layout", "eval", "status", "pull", "get_model",
                       "models", "stats", "error"})


class WireError(Exception):
    """A message that fails validation; `code` is one of the error codes above.
    `request_id` is the request's id when the header could be read that far (else 0),
    so that the error reply reaches the caller that is waiting for it."""

    def __init__(self, code: str, reason: str, request_id: int = 0):
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason
        self.request_id = request_id


@dataclass
class Message:
    op: str
    id: int = 0
    rank: int = -1
    clock: int = -1
    fields: dict = field(default_factory=dict)
    arrays: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)  # the header's dtype name of each array

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


def _as_array(a: Any) -> tuple[str, np.ndarray]:
    """(dtype name on the wire, little-endian contiguous array) of a numpy array or a
    CPU torch tensor; a bfloat16 tensor travels as its 16-bit patterns."""
    kind = type(a)
    if kind is np.ndarray:   # the common cases first, each the array the general way gives
        name = _NAMES.get(a.dtype)
        if name is not None and a.flags.c_contiguous:
            return name, a
    elif kind is _tensor_type and not a.requires_grad:
        name = _TORCH_NAMES.get(a.dtype)
        if name is not None and a.is_contiguous() and a.is_cpu:
            return name, a.numpy()
    return _as_array_any(a)


def _as_array_any(a: Any) -> tuple[str, np.ndarray]:
    """`_as_array` for any array or tensor."""
    if hasattr(a, "detach"):  # a torch tensor: must be on the CPU
        t = a.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        torch = _torch_module or _torch()
        if t.dtype is torch.bfloat16:
            return "bfloat16", t.view(dtype=torch.int16).numpy().view(np.uint16)
        a = t.numpy()
    a = np.asarray(a, order="C")   # (not `ascontiguousarray`: it makes a 0-d array shape (1,))
    name = _NAMES.get(a.dtype)
    if name is None:  # big-endian, or not allowed
        name = _NAMES.get(a.dtype.newbyteorder("<"))
        if name is None:
            raise WireError(BAD_DTYPE, f"dtype {a.dtype} is not allowed (allowed: {', '.join(DTYPES)})")
        a = a.astype(DTYPES[name])
    return name, a


_torch_module: Any = None
_tensor_type: Any = None   # torch.Tensor once torch is imported here (`_as_array`'s fast path)
_TORCH_NAMES: dict = {}    # torch dtype -> wire name, for the dtypes whose numpy view `_NAMES` names


def _torch() -> Any:
    """torch, imported on first use (only for tensors: the wire itself needs no torch)."""
    global _torch_module, _tensor_type
    if _torch_module is None:
        import torch
        if sys.byteorder == "little":   # (a tensor's numpy view is then little-endian, as the wire)
            _TORCH_NAMES.update({getattr(torch, name): name for name in _NAMES.values()})   # (torch's own names)
        _torch_module = torch
        _tensor_type = torch.Tensor
    return _torch_module


def tensor(msg: Message, i: int) -> Any:
    """The i-th array as a torch tensor, without copying (read-only: the caller must not
    write to it); a bfloat16 array is viewed as torch.bfloat16."""
    torch = _torch()
    a = msg.arrays[i]
    bf16 = bool(msg.dtypes) and msg.dtypes[i] == "bfloat16"
    if bf16:
        a = a.view(np.int16)
    if a.flags.writeable:  # a ZeroMQ frame's buffer is; bytes are not
        t = torch.from_numpy(a)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch warns of read-only arrays
            t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if bf16 else t


def encode(op: str, *, id: int = 0, rank: int = -1, clock: int = -1,
           arrays: Sequence[Any] = (), **fields: Any) -> list:
    """Build a message's frames. Arrays (numpy or CPU torch) are sent without copies."""
    return encode_with(op, id, rank, clock, arrays, fields)


def encode_with(op: str, id: int, rank: int, clock: int, arrays: Sequence[Any], fields: dict) -> list:
    """`encode` with its fields as a dict (read, not kept): a daemon's answer made for
    every request is not spread into keywords and collected again."""
    if op not in OPS:
        raise WireError(UNKNOWN_OP, f"unknown op {op!r}")
    specs, payload = [], []
    for a in arrays:
        name, a = _as_array(a)
        specs.append([name, list(a.shape)])
        if a.size:   # (an empty array has no frame)
            payload.append(memoryview(cast(Any, a)).cast("B"))   # (its bytes, one a byte: len is nbytes)
    header = {"v": PROTOCOL_VERSION, "op": op, "id": int(id), "rank": int(rank), "clock": int(clock),
              "arrays": specs}
    if not _BASE_SET.isdisjoint(fields):
        raise WireError(BAD_FIELD, f"field {next(k for k in fields if k in _BASE_SET)!r} is reserved")
    header.update(fields)
    head = pack_header(header)
    # What decode refuses is refused here, where the sender can say why: the peer's refusal
    # of a header it could not read carries no request id, so no caller would hear of it.
    if len(head) > MAX_HEADER or len(specs) > MAX_FRAMES:
        raise WireError(TOO_LARGE, f"{op}: a header of {len(head)} bytes and {len(specs)} arrays; a peer reads "
                                   f"at most {MAX_HEADER} bytes and {MAX_FRAMES} arrays")
    return [head, *payload]


_packers = threading.local()   # one msgpack Packer per thread, reused (`msgpack.packb` makes one per call)


def pack_header(header: dict) -> bytes:
    """A header's msgpack bytes (what `msgpack.packb(header, use_bin_type=True)` gives),
    packed by this thread's reused Packer: a message's header is packed on the thread
    that sends it, and a Packer holds its buffer between calls (it empties it after each
    call, and after a failed one)."""
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(header)


def reply(req: Message, arrays: Sequence[Any] = (), **fields: Any) -> list:
    return encode_with("reply", req.id, req.rank, req.clock, arrays, fields)


def reply_with(req: Message, arrays: Sequence[Any], fields: dict) -> list:
    """`reply` with its fields as a dict (`encode_with`)."""
    return encode_with("reply", req.id, req.rank, req.clock, arrays, fields)


def error(req_id: int, code: str, reason: str) -> list:
    return encode("error", id=req_id, code=code, reason=reason[:1000])


def _check_field(op: str, name: str, value: Any) -> None:
    spec = OPS[op]
    types = spec.get(name, spec.get("*"))
    if types is None:
        raise WireError(BAD_FIELD, f"op {op!r} has no field {name!r}")
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise WireError(BAD_FIELD, f"field {name!r} must be {'/'.join(t.__name__ for t in types)}, "
                                   f"got {type(value).__name__}")
    if type(value) is int and not -_LIMIT <= value < _LIMIT:   # as the header's own ints
        raise WireError(BAD_FIELD, f"field {name!r} is out of range: {value}")


def decode(frames: Sequence[Any], max_bytes: int = MAX_MESSAGE) -> Message:
    """Validate and parse a message (without a routing identity). Raises WireError."""
    if not frames:
        raise WireError(BAD_HEADER, "empty message")
    if len(frames) > MAX_FRAMES + 1:
        raise WireError(TOO_LARGE, f"{len(frames)} frames, at most {MAX_FRAMES + 1}")
    head = memoryview(frames[0])   # (a zmq.Frame's, as its `.buffer`: without the getattr of a Python subclass)
    if len(head) > MAX_HEADER:
        raise WireError(TOO_LARGE, f"header of {len(head)} bytes, at most {MAX_HEADER}")
    try:
        h = msgpack.unpackb(head, raw=False, strict_map_key=True, max_bin_len=0,
                            max_ext_len=0, use_list=True)
    except Exception as e:  # msgpack raises several types; all mean the same here
        raise WireError(BAD_HEADER, f"header is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(h, dict):
        raise WireError(BAD_HEADER, f"header must be a map, got {type(h).__name__}")
    rid = h.get("id")
    try:
        return _decode(h, head, frames, max_bytes)
    except WireError as e:
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < _LIMIT:
            e.request_id = rid
        raise


def _base_error(rid: Any, rank: Any, clock: Any) -> WireError:
    """The error of the first of a header's id, rank and clock that is not an int >= -1 (one is not)."""
    k, v = next((k, v) for k, v in (("id", rid), ("rank", rank), ("clock", clock))
                if type(v) is not int or not -1 <= v < _LIMIT)
    return WireError(BAD_HEADER, f"header field {k!r} must be an int >= -1, got {v!r}")


def _decode(h: dict, head: memoryview, frames: Sequence[Any], max_bytes: int) -> Message:
    # The base fields are popped off `decode`'s own dict: what is left is the op's fields,
    # each asked once (every step's answer has two; a loop over all eight skipped six).
    v = h.pop("v", None)
    if type(v) is not int or v != PROTOCOL_VERSION:   # (true and 1.0 are equal to 1)
        raise WireError(BAD_VERSION, f"protocol version {v!r}, this peer speaks {PROTOCOL_VERSION}")
    op = h.pop("op", None)
    if not isinstance(op, str) or op not in OPS:
        raise WireError(UNKNOWN_OP, f"unknown op {op!r}")
    rid: Any = h.pop("id", None)
    rank: Any = h.pop("rank", None)
    clock: Any = h.pop("clock", None)
    if not (type(rid) is int and type(rank) is int and type(clock) is int   # msgpack's ints are exact ints;
            and -1 <= rid < _LIMIT and -1 <= rank < _LIMIT and -1 <= clock < _LIMIT):   # bool is not one
        raise _base_error(rid, rank, clock)
    if rid < 0:
        raise WireError(BAD_HEADER, "request id must be >= 0")
    specs = h.pop("arrays", None)
    fields = h
    if op == "reply":   # (a step's every answer) its fields may be any value msgpack gives but bytes and
        for k, v in fields.items():   # ext types: only those and an int's range are asked (`_check_field` says why)
            t = type(v)
            if (t is int and not -_LIMIT <= v < _LIMIT) or (t is not int and t not in _REPLY_TYPES):
                _check_field(op, k, v)
    else:
        for k, v in fields.items():
            _check_field(op, k, v)
    for k in REQUIRED.get(op, ()):
        if k not in fields:
            raise WireError(BAD_FIELD, f"op {op!r} needs field {k!r}")
    if not isinstance(specs, list) or len(specs) > MAX_FRAMES:
        raise WireError(BAD_HEADER,
                        f"header lists {len(specs) if isinstance(specs, list) else '?'} arrays "
                        f"(a list of at most {MAX_FRAMES})")
    every = len(specs) == len(frames) - 1   # a frame for every array, empty ones too (as older senders)
    arrays, dtypes, total, j = [], [], len(head), 1
    for i, spec in enumerate(specs):
        if not (isinstance(spec, list) and len(spec) == 2):
            raise WireError(BAD_HEADER, f"array {i}: spec must be [dtype, shape]")
        dtype_name, shape = spec
        dt = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dt is None:
            raise WireError(BAD_DTYPE, f"array {i}: dtype {dtype_name!r} not allowed")
        if type(shape) is list and len(shape) == 1 and type(n := shape[0]) is int and 0 <= n < 1 << 40 and (
                n or dt.itemsize <= max_bytes):
            pass   # a vector (a step's tables): the general test's answer for one dimension, without its generators
        elif type(shape) is not list or len(shape) > MAX_DIMS or not all(
                type(d) is int and 0 <= d < 1 << 40 for d in shape) or (
                0 in shape and math.prod(d for d in shape if d) * dt.itemsize > max_bytes):  # empty, but impossible
            raise WireError(BAD_SHAPE, f"array {i}: bad shape {shape!r}")
        expect = math.prod(shape) * dt.itemsize
        if expect or every:
            if j == len(frames):
                raise _frames_error(specs, frames)
            buf = memoryview(frames[j])
            j += 1
            total += len(buf)
            if total > max_bytes:
                raise WireError(TOO_LARGE, f"message larger than {max_bytes} bytes")
            if len(buf) != expect:
                raise WireError(BAD_LENGTH, f"array {i}: {len(buf)} bytes, {dtype_name}{shape} needs {expect}")
        a = np.frombuffer(buf, dtype=dt) if expect else np.zeros(shape, dt)
        arrays.append(a if len(shape) == 1 else a.reshape(shape))
        dtypes.append(dtype_name)
    if j != len(frames):
        raise _frames_error(specs, frames)
    if arrays and op in NO_ARRAYS:
        raise WireError(BAD_FIELD, f"op {op!r} carries no arrays, {len(arrays)} came")
    return Message(op, rid, rank, clock, fields, arrays, dtypes)


def _frames_error(specs: list, frames: Sequence[Any]) -> WireError:
    return WireError(BAD_HEADER, f"header lists {len(specs)} arrays but {len(frames) - 1} payload frames came "
                                 f"(one for each array, or for each that is not empty)")


def finite(t: Any) -> bool:
    """Has tensor `t` no NaN or Inf? Its sum is then finite (no t-sized temporary, as
    `isfinite(t).all()` would make; an empty tensor has nothing to sum: no reduction).
    A sum that is not may have overflowed from finite values: then each value is asked
    (a float16 tensor's sum overflows at 65504; summing it in float32, `dtype=`, would be
    2-3x slower for every float32 one)."""
    return not t.numel() or abs(t.sum().item()) < float("inf") or bool(t.isfinite().all())


def expect_array(msg: Message, i: int, dtype: str, shape: tuple) -> np.ndarray:
    """The i-th payload array, checked against the registered dtype and shape."""
    if i >= len(msg.arrays):
        raise WireError(BAD_SHAPE, f"op {msg.op!r} needs array {i}, got {len(msg.arrays)} arrays")
    a = msg.arrays[i]
    got = msg.dtypes[i] if msg.dtypes else a.dtype.name
    if got != dtype:
        raise WireError(BAD_DTYPE, f"array {i}: expected {dtype}, got {got}")
    if tuple(a.shape) != tuple(shape):
        raise WireError(BAD_SHAPE, f"array {i}: expected shape {list(shape)}, got {list(a.shape)}")
    return a


def split_identity(frames: Sequence[Any]) -> tuple[Any, list]:
    """A ROUTER socket's message: (routing identity, message frames)."""
    if len(frames) < 2:
        raise WireError(BAD_HEADER, "message has no routing identity")
    return frames[0], list(frames[1:])


def raise_if_error(msg: Message, peer: str) -> Message:
    """An error reply becomes the typed exception for its code."""
    if msg.op == "error":
        code = str(msg.get("code", "?"))
        cls = Refused if code in (REFUSED, NOT_READY) else ServerFault if code == INTERNAL else BadRequest
        raise cls(code, str(msg.get("reason", "")), peer)
    return msg


class RemoteError(Exception):
    """A peer answered with an error reply: `code`, `reason`, and the peer's address."""

    def __init__(self, code: str, reason: str, peer: str = ""):
        super().__init__(f"{code}: {peer + ': ' if peer else ''}{reason}")
        self.code = code
        self.reason = reason
        self.peer = peer


class Refused(RemoteError):
    """A valid request that the peer would not carry out now (a non-finite gradient, a
    clock ahead of the step, an op the mode does not use, an unknown rank)."""


class BadRequest(RemoteError):
    """The peer found the request malformed (a bug on this side or a version mismatch)."""


class ServerFault(RemoteError):
    """The peer failed while serving the request (a bug on its side); it goes on serving."""


class BadAnswer(RemoteError):
    """The peer's answer to a request could not be read here (larger than this side's
    limit, `MAX_MESSAGE`, or malformed, its header naming the request): sent again, it
    would be answered the same."""
