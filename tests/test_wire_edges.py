"""Edges of the wire: a 0-d array's shape, an empty array's (missing) frame, and values
beyond bfloat16's range (which float16's are checked for, `test_wire_dtype.py`)."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from psgd import wire
from psgd.config import Config
from psgd.shard import Shard
from tests.conftest import free_port_block

pytestmark = pytest.mark.unit

BF16_OVERFLOW = 3.4e38   # finite in float32 (max 3.40e38), beyond bfloat16's (3.39e38): Inf when cast


def header(arrays: list) -> bytes:
    return msgpack.packb({"v": wire.PROTOCOL_VERSION, "op": "reply", "id": 1, "rank": -1, "clock": -1,
                          "arrays": arrays}, use_bin_type=True)


@pytest.mark.parametrize("value", [np.float32(3.5), np.array(3.5, np.float32), np.array(7, ">i8"),
                                   torch.tensor(3.5), torch.tensor(3.5, requires_grad=True),
                                   torch.tensor(3.5, dtype=torch.float16), torch.tensor(3.5, dtype=torch.bfloat16)],
                         ids=["np-scalar", "np-0d", "np-0d-big-endian", "tensor", "tensor-grad", "float16",
                              "bfloat16"])
def test_a_0d_array_travels_as_shape_empty(value):
    """`np.ascontiguousarray` made a 0-d array shape (1,): a scalar left as [1] and came
    back a vector (a bfloat16 tensor, which does not go through it, came back 0-d)."""
    frames = wire.encode("reply", id=1, arrays=[value])
    assert msgpack.unpackb(frames[0])["arrays"][0][1] == []
    m = wire.decode([bytes(f) for f in frames])
    got = wire.tensor(m, 0)
    assert m.arrays[0].shape == () and got.shape == ()
    assert got.item() == value.item()


def test_an_in_process_packet_of_a_0d_tensor_is_the_size_the_wire_sends():
    """psgd simulate's messages say [] for a 0-d tensor's shape, and their size is the
    encoded message's: it was a byte short of the wire's [1]."""
    from psgd.sim import messages
    t = torch.tensor(2.0)
    p = messages.packet("reply", id=1, arrays=[t], version=3)
    assert p.nbytes == sum(len(f) for f in wire.encode("reply", id=1, arrays=[t], version=3))
    assert p.arrays[0].shape == ()


@pytest.mark.parametrize("shape,payload,code", [
    ([], b"", wire.BAD_LENGTH),              # a 0-d array holds one value, not none
    ([], b"12345678", wire.BAD_LENGTH),      # ... nor two
    ([1, -1], b"", wire.BAD_SHAPE),
    ([1 << 40], b"", wire.BAD_SHAPE),
    ([[]], b"1234", wire.BAD_SHAPE),
])
def test_shape_empty_is_one_value_and_other_shapes_stay_strict(shape, payload, code):
    assert wire.decode([header([["float32", []]]), np.float32(9).tobytes()]).arrays[0].shape == ()
    with pytest.raises(wire.WireError) as e:
        wire.decode([header([["float32", shape]]), payload])
    assert e.value.code == code


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_finite_asks_each_value_of_a_half_precision_tensor_whose_sum_overflowed(dtype):
    """`wire.finite`, which the shard refuses a gradient by, takes any dtype: a bfloat16
    (or float16) sum that overflowed from finite values is not taken for an Inf."""
    big = float(torch.finfo(dtype).max) / 2
    t = torch.full((1000,), big, dtype=dtype)
    assert wire.finite(t)
    for bad in (float("inf"), float("nan")):
        t[7] = bad
        assert not wire.finite(t)


def test_a_bfloat16_value_beyond_its_range_is_refused_by_the_worker_naming_the_dtype():
    """As float16's (test_wire_dtype.py): a finite gradient beyond bfloat16's range (a
    float32 value above 3.39e38) became Inf on the wire, unchecked, and the shard refused
    it as 'NaN or Inf; lower optimizer.lr'."""
    import zmq

    from psgd.consistency.rule import Diverged
    from psgd.workers.client import ParameterClient
    assert torch.isinf(torch.tensor(BF16_OVERFLOW).bfloat16()) and np.isfinite(np.float32(BF16_OVERFLOW))
    ctx = zmq.Context()
    c = ParameterClient(Config().replace(**{"cluster.port": free_port_block(2), "wire.dtype": "bfloat16"}), ctx, 0)
    try:
        g = torch.ones(100)
        g[3] = 3.38e38          # within bfloat16's range
        assert wire.finite(c._wire("g0", 0, g, clock=0))
        g[3] = -BF16_OVERFLOW
        with pytest.raises(Diverged, match=r"values up to 3\.4e\+38 at step 4 are beyond bfloat16's range"):
            c._wire("g0", 0, g, clock=4)
        g[3] = float("inf")     # not a range problem (the run diverged): the shard refuses it
        assert torch.isinf(c._wire("g0", 0, g, clock=5)).any()
    finally:
        c.close()
        ctx.term()


def test_a_bfloat16_read_of_parameters_beyond_its_range_is_refused_naming_the_dtype():
    """As float16's (test_wire_dtype.py): a float32 master weight beyond bfloat16's range
    reached the worker as Inf, unchecked, its next gradient NaN."""
    cfg = Config().replace(**{"mode.name": "async", "cluster.workers": 1, "cluster.servers": 1,
                              "optimizer.momentum": 0.0, "wire.dtype": "bfloat16"})
    s = Shard(cfg, 0)
    with torch.no_grad():
        s.params[0] = BF16_OVERFLOW
    (_, frames), = s.handle("w", wire.decode(wire.encode("pull", id=1, rank=0, clock=0)))
    m = wire.decode(frames)
    assert (m.op, m.get("code")) == ("error", wire.REFUSED), wire.tensor(m, 0)[:2]
    assert "beyond bfloat16's range" in m.get("reason")


def test_an_empty_array_has_no_frame_and_arrives_as_its_header_says():
    """A model without buffers pushed and read an empty frame each way with every step: a
    send and a receive of their own, about a tenth of a small table's round trip."""
    g = np.arange(6, dtype=np.float32)
    frames = wire.encode("push", arrays=[g, np.zeros(0, np.float32), torch.zeros(0, 3)], read_version=0)
    assert len(frames) == 2
    m = wire.decode(frames)
    assert [a.shape for a in m.arrays] == [(6,), (0,), (0, 3)] and m.dtypes == ["float32"] * 3
    np.testing.assert_array_equal(m.arrays[0], g)
    # as senders before sent it, a frame for every array, the empty ones' empty
    old = wire.decode([frames[0], frames[1], b"", b""])
    assert [a.shape for a in old.arrays] == [(6,), (0,), (0, 3)]


@pytest.mark.parametrize("payload", [
    [],                    # the non-empty array's frame missing
    [b"\0" * 24, b""],     # neither one frame per array nor one per non-empty array
    [b"", b"\0" * 24],     # the frames out of order
    [b"\0" * 24, b"", b"", b""],
])
def test_frames_other_than_one_per_array_or_one_per_nonempty_array_are_refused(payload):
    head = wire.encode("push", arrays=[np.zeros(6, np.float32), np.zeros(0, np.float32), np.zeros(0, np.float32)],
                       read_version=0)[0]
    with pytest.raises(wire.WireError) as e:
        wire.decode([head, *payload])
    assert e.value.code in (wire.BAD_HEADER, wire.BAD_LENGTH) and e.value.request_id == 0


def test_empty_arrays_are_bounded_as_frames_are():
    """Empty arrays have no frame, so frames no longer bound their count: the header's list does."""
    empty = np.zeros(0, np.float32)
    with pytest.raises(wire.WireError, match="arrays; a peer reads"):
        wire.encode("reply", arrays=[empty] * (wire.MAX_FRAMES + 1))
    head = msgpack.packb({"v": wire.PROTOCOL_VERSION, "op": "reply", "id": 3, "rank": -1, "clock": -1,
                          "arrays": [["float32", [0]]] * (wire.MAX_FRAMES + 1)})
    with pytest.raises(wire.WireError, match="at most 64") as e:
        wire.decode([head])
    assert e.value.code == wire.BAD_HEADER and e.value.request_id == 3
    assert len(wire.decode(wire.encode("reply", arrays=[empty] * wire.MAX_FRAMES)).arrays) == wire.MAX_FRAMES


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_worker_refuses_exactly_the_values_that_its_wire_dtype_makes_inf(dtype):
    """A review: the worker refused any value above the dtype's largest, though values up
    to half a step beyond it round to that largest value (65510 goes as float16's 65504),
    and the shard's check, made after its cast, let them through."""
    import zmq

    from psgd.consistency.rule import Diverged
    from psgd.workers.client import ParameterClient
    narrow = getattr(torch, dtype)
    ctx = zmq.Context()
    c = ParameterClient(Config().replace(**{"cluster.port": free_port_block(2), "wire.dtype": dtype}), ctx, 0)
    try:
        inf_from = torch.tensor([float(torch.finfo(narrow).max) * 1.01], dtype=torch.float32)
        while torch.isinf(torch.nextafter(inf_from, torch.zeros(1)).to(narrow)).item():   # the least that goes Inf
            inf_from = torch.nextafter(inf_from, torch.zeros(1))
        below = torch.nextafter(inf_from, torch.zeros(1))
        assert float(below.item()) > float(torch.finfo(narrow).max)
        g = torch.zeros(10)
        g[2] = -below.item()
        sent = c._wire("g0", 0, g, clock=1)
        assert wire.finite(sent) and sent[2].item() == -torch.finfo(narrow).max
        g[2] = inf_from.item()
        with pytest.raises(Diverged, match=f"beyond {dtype}'s range"):
            c._wire("g0", 0, g, clock=2)
    finally:
        c.close()
        ctx.term()


def test_a_read_of_parameters_that_are_nan_is_refused_as_such_not_as_a_range():
    """A review: parameters that hold NaN were refused as 'beyond bfloat16's range: set
    wire.dtype = "float32"', which would not help."""
    cfg = Config().replace(**{"mode.name": "async", "cluster.workers": 1, "cluster.servers": 1,
                              "optimizer.momentum": 0.0, "wire.dtype": "bfloat16"})
    s = Shard(cfg, 0)
    with torch.no_grad():
        s.params[0] = float("nan")
    (_, frames), = s.handle("w", wire.decode(wire.encode("pull", id=1, rank=0, clock=0)))
    m = wire.decode(frames)
    assert (m.op, m.get("code")) == ("error", wire.REFUSED)
    assert "NaN or Inf values" in m.get("reason") and "range" not in m.get("reason")
