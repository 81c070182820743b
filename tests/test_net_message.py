"""Message encoding: round trips and validation of malformed payloads."""

import json
import struct

import numpy as np
import pytest

from cipherlm.net import FrameError, message

DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
          np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128]


def sample_message():
    rng = np.random.default_rng(0)
    m = {
        "none": None, "t": True, "f": False, "i": -(3 ** 80), "zero": 0,
        "x": 1.5, "nan": float("nan"), "inf": float("-inf"), "tiny": 5e-324,
        "s": "héllo ✓ \x00", "empty_s": "", "y": b"\x00\xffabc", "empty_y": b"",
        "list": [1, "a", [None, 2.0, {"deep": b"z"}]], "tuple": (1, 2),
        "nested": {"a": {"b": {"c": [np.arange(3)]}}},
        "scalar0d": np.array(7.25), "empty_arr": np.zeros((0, 5), np.float32),
        "fortran": np.asfortranarray(rng.standard_normal((3, 4))),
        "strided": np.arange(20)[::3], "bigendian": np.arange(6, dtype=">i4").reshape(2, 3),
        "npscalars": [np.int64(5), np.float32(0.5), np.bool_(True)],
    }
    for dt in DTYPES:
        m[f"arr_{np.dtype(dt).name}"] = (rng.standard_normal((2, 3, 4)) * 50).astype(dt)
    return m


def assert_same(a, b):
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert b.dtype == a.dtype.newbyteorder("<") and b.shape == a.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b
    elif isinstance(a, np.generic):
        assert b == a.item() and type(b) is type(a.item())
    else:
        assert type(a) is type(b) and a == b


def test_round_trip_every_type():
    m = sample_message()
    out = message.decode(message.encode(m))
    assert_same(m, out)


def test_decoded_arrays_are_writable_views_of_a_bytearray():
    out = message.decode(bytearray(message.encode({"a": np.arange(4.0)})))
    out["a"][0] = 9.0
    assert out["a"][0] == 9.0


@pytest.mark.parametrize("bad", [
    {"k": object()}, {"k": np.array(["str"])}, {"k": np.array([1], dtype=object)},
    {1: "non-str key"}, {"k": {2: 3}}, {"k": {1, 2}},
])
def test_encode_rejects_unsupported(bad):
    with pytest.raises((TypeError, ValueError)):
        message.encode(bad)


def test_encode_requires_dict():
    with pytest.raises(TypeError):
        message.encode([1, 2])


def _payload(tree, blobs=b""):
    h = json.dumps(tree).encode()
    head = struct.pack("<I", len(h)) + h
    head += b"\0" * ((-len(head)) % 8)
    return head + blobs


@pytest.mark.parametrize("payload", [
    b"", b"\x01\x00",
    struct.pack("<I", 100) + b"{}",                       # header length overruns
    struct.pack("<I", 2) + b"\xff\xfe",                    # not UTF-8
    struct.pack("<I", 3) + b"{x}",                         # not JSON
    _payload(["l", []]),                                   # root not a dict
    _payload({"d": []}),
    _payload(["d", [["k", ["?", 1]]]]),                    # unknown tag
    _payload(["d", [["k", ["i", "1"]]]]),                  # wrong value type
    _payload(["d", [["k", ["i", True]]]]),                 # bool is not an int
    _payload(["d", [["k", ["f", "zz"]]]]),                 # bad float
    _payload(["d", [[1, ["N"]]]]),                         # non-str key
    _payload(["d", [["k", ["N"]], ["k", ["N"]]]]),         # duplicate key
    _payload(["d", [["k", ["y", 16]]]], b"\0" * 8),        # blob overruns
    _payload(["d", [["k", ["y", -1]]]]),
    _payload(["d", [["k", ["y", 4]]]], b"abcd" + b"\0" * 12),  # trailing bytes
    _payload(["d", [["k", ["a", "|O", [1]]]]], b"\0" * 8),     # dtype not allowed
    _payload(["d", [["k", ["a", "<U1", [1]]]]], b"\0" * 8),
    _payload(["d", [["k", ["a", "<f8", [-1]]]]]),             # negative dim
    _payload(["d", [["k", ["a", "<f8", [2, 2]]]]], b"\0" * 16),  # shape/bytes mismatch
    _payload(["d", [["k", ["a", "<f8", [1 << 40, 1 << 40]]]]]),  # absurd shape
    _payload(["d", [["k", ["a", "<f8", [1] * 40]]]], b"\0" * 8),  # too many dims
])
def test_decode_rejects_malformed(payload):
    with pytest.raises(FrameError):
        message.decode(payload)


def test_nesting_depth_limit():
    tree = ["N"]
    for _ in range(message.MAX_DEPTH + 5):
        tree = ["l", [tree]]
    with pytest.raises(FrameError):
        message.decode(_payload(["d", [["k", tree]]]))
    deep = None
    for _ in range(100000):  # deeper than Python's JSON recursion allows
        deep = [deep]
    h = ("[" * 100000 + "]" * 100000).encode()
    with pytest.raises(FrameError):
        message.decode(struct.pack("<I", len(h)) + h)
    with pytest.raises(ValueError):
        message.encode({"k": deep})


def test_fuzz_truncations_and_bitflips_never_crash():
    enc = message.encode({"a": np.arange(10, dtype=np.int32), "s": "x", "l": [1, b"yy"]})
    for cut in range(len(enc)):
        with pytest.raises(FrameError):
            message.decode(enc[:cut])
    rng = np.random.default_rng(1)
    for _ in range(300):
        b = bytearray(enc)
        b[rng.integers(len(b))] ^= 1 << int(rng.integers(8))
        try:
            message.decode(b)
        except FrameError:
            pass
