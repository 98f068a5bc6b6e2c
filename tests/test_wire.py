import msgpack
import numpy as np
import pytest
import torch
import zmq

from psgd import wire

pytestmark = pytest.mark.unit


def roundtrip(frames):
    return wire.decode([bytes(f) for f in frames])


def test_roundtrip_arrays_and_fields():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = torch.arange(5, dtype=torch.int64)
    msg = roundtrip(wire.encode("push", id=7, rank=2, clock=9, arrays=[a, b], read_version=4))
    assert (msg.op, msg.id, msg.rank, msg.clock) == ("push", 7, 2, 9)
    assert msg.get("read_version") == 4
    np.testing.assert_array_equal(msg.arrays[0], a)
    np.testing.assert_array_equal(msg.arrays[1], b.numpy())
    assert msg.arrays[1].dtype == np.int64


def test_decode_does_not_copy_payload():
    a = np.arange(1000, dtype=np.float32)
    frames = [bytes(f) for f in wire.encode("push", arrays=[a, a[:0]], read_version=0)]
    payload = bytearray(frames[1])
    msg = wire.decode([frames[0], payload])   # (the empty array has no frame)
    assert np.shares_memory(msg.arrays[0], np.frombuffer(payload, np.uint8))  # a view of the received buffer
    payload[0:4] = np.float32(42).tobytes()
    assert msg.arrays[0][0] == 42
    # the same for a ZeroMQ frame, as a socket hands it over with copy=False
    frame = zmq.Frame(frames[1])
    msg = wire.decode([frames[0], frame, b""])   # (as older senders sent it: an empty frame for the empty array)
    assert np.shares_memory(msg.arrays[0], np.frombuffer(frame.buffer, np.uint8))
    np.testing.assert_array_equal(msg.arrays[0], a)


def test_empty_array_and_reply():
    req = roundtrip(wire.encode("pull", id=3, rank=1, clock=2))
    rep = roundtrip(wire.reply(req, arrays=[np.zeros(0, np.float32)], version=5, live={"0": 1}))
    assert rep.op == "reply" and rep.id == 3 and rep.get("version") == 5
    assert rep.arrays[0].shape == (0,)


def test_error_reply_raises_remote_error():
    msg = roundtrip(wire.error(4, wire.BAD_SHAPE, "no"))
    with pytest.raises(wire.RemoteError) as e:
        wire.raise_if_error(msg, "peer")
    assert e.value.code == wire.BAD_SHAPE


def header(**over):
    h = {"v": wire.PROTOCOL_VERSION, "op": "pull", "id": 1, "rank": 0, "clock": 0, "arrays": []}
    h.update(over)
    return msgpack.packb(h)


@pytest.mark.parametrize("frames,code", [
    ([], wire.BAD_HEADER),
    ([b"\xc1garbage"], wire.BAD_HEADER),
    ([msgpack.packb([1, 2])], wire.BAD_HEADER),
    ([header(v=99)], wire.BAD_VERSION),
    ([header(v=True)], wire.BAD_VERSION),   # (a review: equal to 1, as is 1.0, and taken)
    ([header(v=float(wire.PROTOCOL_VERSION))], wire.BAD_VERSION),
    ([header(op="format_disk")], wire.UNKNOWN_OP),
    ([header(id="x")], wire.BAD_HEADER),
    ([header(id=-5)], wire.BAD_HEADER),
    ([header(id=-1)], wire.BAD_HEADER),    # -1 is a rank's or a clock's "none", never a request's id
    ([header(rank=True)], wire.BAD_HEADER),
    ([header(evil=1)], wire.BAD_FIELD),
    ([header(table=5)], wire.BAD_FIELD),
    ([header(op="push")], wire.BAD_FIELD),  # read_version required
    ([header(op="push", read_version=True)], wire.BAD_FIELD),  # a bool is no int here
    ([header(arrays=[["float32", [2]]])], wire.BAD_HEADER),  # frame missing
    ([header(arrays=[["object", [1]]]), b"x"], wire.BAD_DTYPE),
    ([header(arrays=[["float32", [-1]]]), b""], wire.BAD_SHAPE),
    ([header(arrays=[["float32", [1] * 9]]), b"1234"], wire.BAD_SHAPE),
    ([header(arrays=[["float32", [3]]]), b"12345678"], wire.BAD_LENGTH),
    ([header(arrays=[["float32", [1]]]), b"12345678"], wire.BAD_LENGTH),   # longer than its spec, too
    ([b"\x00" * (wire.MAX_HEADER + 1)], wire.TOO_LARGE),
    ([header()] + [b""] * (wire.MAX_FRAMES + 1), wire.TOO_LARGE),
])
def test_invalid_messages_are_refused_with_a_code(frames, code):
    with pytest.raises(wire.WireError) as e:
        wire.decode(frames)
    assert e.value.code == code
    assert e.value.reason


def test_an_empty_array_of_impossible_dimensions_is_a_bad_shape_of_its_request():
    """[0, 2**39, 2**39] holds nothing, but numpy cannot make it (ValueError): refused as a
    bad shape with the request's id, so that the error reaches the caller."""
    with pytest.raises(wire.WireError) as e:
        wire.decode([header(id=77, arrays=[["float32", [0, 1 << 39, 1 << 39]]]), b""])
    assert (e.value.code, e.value.request_id) == (wire.BAD_SHAPE, 77)
    assert wire.decode([header(op="init", arrays=[["float32", [0, 5]]]), b""]).arrays[0].shape == (0, 5)


def test_ops_that_carry_no_arrays_are_refused_with_arrays():
    """A pull with arrays was parked with them: memory that `max_parked` (a count) did not
    bound. Every op in NO_ARRAYS is refused when arrays come, before any handler."""
    for op in sorted(wire.NO_ARRAYS - {"error"}):
        frames = [bytes(f) for f in wire.encode(op, id=9, arrays=[np.ones(4, np.float32)],
                                                **({"role": "worker"} if op in ("register", "heartbeat") else {}),
                                                **({"accuracy": 0.5, "loss": 1.0} if op == "eval" else {}),
                                                **({"round": 1, "owner": 0} if op == "get_model" else {}))]
        with pytest.raises(wire.WireError) as e:
            wire.decode(frames)
        assert (e.value.code, e.value.request_id) == (wire.BAD_FIELD, 9) and "carries no arrays" in e.value.reason
    assert len(wire.decode([bytes(f) for f in wire.encode("init", arrays=[np.ones(4, np.float32)])]).arrays) == 1


def test_a_finite_tensor_whose_sum_overflows_is_finite():
    assert wire.finite(torch.full((4,), 3e38)) and not wire.finite(torch.tensor([3e38, float("nan")]))


def test_size_limit():
    frames = [bytes(f) for f in wire.encode("push", arrays=[np.zeros(100, np.float32)], read_version=0)]
    with pytest.raises(wire.WireError) as e:
        wire.decode(frames, max_bytes=200)
    assert e.value.code == wire.TOO_LARGE


def test_expect_array_checks_registered_shape_and_dtype():
    msg = roundtrip(wire.encode("push", arrays=[np.zeros(4, np.float32)], read_version=0))
    assert wire.expect_array(msg, 0, "float32", (4,)).shape == (4,)
    with pytest.raises(wire.WireError, match="shape"):
        wire.expect_array(msg, 0, "float32", (5,))
    with pytest.raises(wire.WireError) as e:
        wire.expect_array(msg, 0, "float64", (4,))
    assert e.value.code == wire.BAD_DTYPE
    with pytest.raises(wire.WireError):
        wire.expect_array(msg, 1, "float32", (4,))
    square = roundtrip(wire.encode("push", arrays=[np.zeros((2, 2), np.float32)], read_version=0))
    with pytest.raises(wire.WireError) as e:   # as many values, but not the registered shape
        wire.expect_array(square, 0, "float32", (4,))
    assert e.value.code == wire.BAD_SHAPE


def test_encode_refuses_unknown_dtype_and_op():
    with pytest.raises(wire.WireError):
        wire.encode("push", arrays=[np.zeros(2, np.complex64)], read_version=0)
    with pytest.raises(wire.WireError):
        wire.encode("nope")


def test_encode_refuses_what_decode_would_refuse_without_the_request_id():
    # the peer's refusal of an unreadable header carries id 0: the sender waited, resending
    with pytest.raises(wire.WireError, match="register: a header of .* at most 1048576 bytes") as e:
        wire.encode("register", id=7, role="worker", layout=[["t" * 100, [4]]] * 20_000)
    assert e.value.code == wire.TOO_LARGE
    with pytest.raises(wire.WireError, match="65 arrays"):
        wire.encode("push", arrays=[np.zeros(1, np.float32)] * (wire.MAX_FRAMES + 1), read_version=0)
    assert len(wire.encode("push", arrays=[np.zeros(1, np.float32)] * wire.MAX_FRAMES, read_version=0)) == 65


def test_big_endian_input_is_sent_little_endian():
    a = np.arange(4, dtype=">f4")
    msg = roundtrip(wire.encode("push", arrays=[a], read_version=0))
    np.testing.assert_array_equal(msg.arrays[0], a.astype("<f4"))


def test_no_pickle_anywhere_in_the_package():
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1]
    for folder in ("psgd", "servers", "workers"):
        for path in (root / folder).rglob("*.py"):
            text = path.read_text()
            for bad in ("import pickle", "pickle.loads", "recv_pyobj", "send_pyobj", "weights_only=False"):
                assert bad not in text, f"{path}: {bad}"


def test_pack_header_is_msgpack_packb_on_a_reused_packer():
    header = {"v": 1, "op": "reply", "id": 1 << 40, "rank": -40, "clock": 300, "arrays": [["float32", [3, 4]]],
              "f": 0.5, "s": "é" * 40, "b": True, "n": None, "d": {"k": [1, -1]}}
    assert wire.pack_header(header) == msgpack.packb(header, use_bin_type=True)
    with pytest.raises(TypeError):
        wire.pack_header({"bad": object()})
    assert wire.pack_header(header) == msgpack.packb(header, use_bin_type=True)   # nothing left of the failure


@pytest.mark.parametrize("over,reason", [
    ({"id": "x", "rank": "y"}, "header field 'id' must be an int >= -1, got 'x'"),   # the first of them is named
    ({"rank": -2, "clock": None}, "header field 'rank' must be an int >= -1, got -2"),
    ({"clock": 1 << 62}, f"header field 'clock' must be an int >= -1, got {1 << 62}"),
    ({"clock": False}, "header field 'clock' must be an int >= -1, got False"),
    ({"arrays": [["float32", [True]]]}, "array 0: bad shape [True]"),
    ({"arrays": [["float32", [1 << 40]]]}, f"array 0: bad shape [{1 << 40}]"),
    ({"arrays": [["float64", [0]]]}, "array 0: bad shape [0]"),   # an empty vector, but of an itemsize over max_bytes
])
def test_header_checks_name_what_they_refuse(over, reason):
    """The header's checks (a step's answer takes a shorter way through them: `_decode`)
    refuse as they always did, with the same reason."""
    with pytest.raises(wire.WireError) as e:
        wire.decode([header(**over)] + [b""] * len(over.get("arrays", [])), max_bytes=4)
    assert e.value.reason == reason


def test_a_decoded_message_holds_its_own_fields_in_order():
    h = {"v": 1, "version": 3, "op": "reply", "id": 5, "push": {"staleness": 0}, "rank": 2, "clock": 7,
         "arrays": [["float32", [0]], ["float32", [2]]], "z": [1]}
    msg = wire.decode([msgpack.packb(h), b"", np.ones(2, np.float32).tobytes()])
    assert (msg.op, msg.id, msg.rank, msg.clock) == ("reply", 5, 2, 7)
    assert list(msg.fields.items()) == [("version", 3), ("push", {"staleness": 0}), ("z", [1])]
    assert [a.tolist() for a in msg.arrays] == [[], [1.0, 1.0]] and msg.dtypes == ["float32", "float32"]
