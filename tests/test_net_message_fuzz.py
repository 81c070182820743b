"""Structure-aware fuzzing of `cipherlm.net.message` (hypothesis).

Valid message trees (nested dicts / lists / tuples, every node kind, arrays of every
whitelisted dtype in odd shapes: 0-d, zero-size, zero-size with huge dimensions,
non-contiguous and big-endian layouts) must round-trip exactly; and after any
mutation of the encoded payload (bytes flipped in the JSON header or the blobs,
shapes / dtypes / lengths / tags / arities rewritten in the JSON tree, a wrong header
length, truncation, extension) `decode` must return a dict or raise `FrameError`,
nothing else.

Deterministic: ``derandomize=True`` and no example database, so CI runs the same
examples every time; the default run takes well under 30 s.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cipherlm.net import FrameError, message  # noqa: E402

DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
          np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128]
DTYPE_STRS = sorted({np.dtype(d).newbyteorder("<").str for d in DTYPES})

FUZZ = settings(max_examples=600, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --------------------------------------------------------------------------- valid trees


@st.composite
def arrays(draw):
    dt = np.dtype(draw(st.sampled_from(DTYPES)))
    kind = draw(st.sampled_from(["small", "0d", "empty", "empty-huge", "strided", "bigendian"]))
    if kind == "0d":
        shape: tuple = ()
    elif kind == "empty":
        shape = tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))) + (0,)
        shape = tuple(draw(st.permutations(shape)))
    elif kind == "empty-huge":
        # a zero dimension next to huge ones: the product of the non-zero dimensions stays
        # within message.MAX_ELEMENTS so the array is valid (numpy can make it)
        budget = 48
        dims = []
        for _ in range(draw(st.integers(1, 3))):
            b = draw(st.integers(0, budget))
            budget -= b
            dims.append(1 << b)
        shape = tuple(draw(st.permutations(dims + [0])))
    else:
        shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    if 0 in shape:
        return np.zeros(shape, dt)
    n = math.prod(shape)
    raw = draw(st.binary(min_size=n * dt.itemsize, max_size=n * dt.itemsize))
    if dt == np.bool_:
        raw = bytes(b & 1 for b in raw)  # numpy bools are 0 / 1 bytes
    arr = np.frombuffer(raw, dt).reshape(shape).copy()
    if kind == "strided" and arr.ndim >= 1:
        arr = np.asfortranarray(arr) if arr.ndim > 1 else np.concatenate([arr, arr])[::2]
    if kind == "bigendian":
        arr = arr.astype(dt.newbyteorder(">"))
    return arr


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(1 << 300), max_value=1 << 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=24),
    st.binary(max_size=8).map(bytearray),
    arrays(),
)

trees = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=6), inner, max_size=4),
    ),
    max_leaves=12,
)

messages = st.dictionaries(st.text(max_size=6), trees, max_size=5)


def assert_same(a, b) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        le = a.dtype.newbyteorder("<")
        assert b.dtype == le and b.shape == a.shape
        assert np.ascontiguousarray(a, dtype=le).tobytes() == b.tobytes()  # bitwise: NaN payloads too
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, bytearray):
        assert type(b) is bytes and b == a
    elif isinstance(a, float):
        assert type(b) is float and (a.hex() == b.hex() or (math.isnan(a) and math.isnan(b)))
    else:
        assert type(a) is type(b) and a == b


@FUZZ
@given(messages)
def test_valid_messages_round_trip(msg):
    payload = message.encode(msg)
    assert len(payload) % 8 == 0
    assert_same(msg, message.decode(payload))
    assert_same(msg, message.decode(bytearray(payload)))  # the zero-copy path
    assert_same(msg, message.decode(memoryview(payload)))


# --------------------------------------------------------------------------- mutations


def _split(payload: bytes) -> tuple[list, bytes]:
    (hlen,) = struct.unpack_from("<I", payload, 0)
    header = json.loads(payload[4:4 + hlen])
    start = 4 + hlen + (-(4 + hlen)) % 8
    return header, payload[start:]


def _join(header, blobs: bytes, hlen_delta: int = 0) -> bytes:
    h = json.dumps(header, separators=(",", ":")).encode()
    head = struct.pack("<I", max(0, len(h) + hlen_delta)) + h
    return head + b"\0" * ((-len(head)) % 8) + blobs


def _nodes(tree, out: list) -> list:
    """Every node (a JSON list) of a message tree, in pre-order."""
    if isinstance(tree, list) and tree:
        out.append(tree)
        if tree[0] == "l" and len(tree) == 2 and isinstance(tree[1], list):
            for x in tree[1]:
                _nodes(x, out)
        elif tree[0] == "d" and len(tree) == 2 and isinstance(tree[1], list):
            for item in tree[1]:
                if isinstance(item, list) and len(item) == 2:
                    _nodes(item[1], out)
    return out


HUGE = [2 ** 31, 2 ** 32 - 1, 2 ** 48, 2 ** 48 + 1, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 10 ** 30]
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.sampled_from(HUGE + [-1, -(2 ** 63)]),
                         st.floats(allow_nan=False), st.text(max_size=6))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4), max_leaves=8)
dims = st.one_of(st.integers(0, 5), st.sampled_from(HUGE), st.integers(-3, -1), st.just(True),
                 st.just(1.0), st.just("2"), st.none(), st.just([1]))


@st.composite
def shapes(draw):
    if draw(st.booleans()):  # zero-size with huge dimensions: no blob bytes needed, numpy may refuse
        base = [0] + draw(st.lists(st.sampled_from(HUGE + [1, 2, 7]), min_size=1, max_size=4))
        return draw(st.permutations(base))
    n = draw(st.sampled_from([0, 1, 2, 3, 4, 32, 33, 40]))
    base = [draw(dims) for _ in range(min(n, 6))] + [draw(st.sampled_from([0, 1, 2 ** 62]))] * max(0, n - 6)
    if draw(st.booleans()):
        base.insert(draw(st.integers(0, len(base))), 0)
    return base


def _rewrite_node(draw, node: list) -> None:
    """Rewrite one node of the JSON tree in place."""
    how = draw(st.sampled_from(["shape", "shape", "dtype", "length", "tag", "arity", "replace", "key", "value"]))
    if how == "shape":
        node[:] = ["a", node[1] if node[0] == "a" and len(node) == 3 else draw(st.sampled_from(DTYPE_STRS)),
                   draw(st.one_of(shapes(), json_values))]
    elif how == "dtype":
        node[:] = ["a", draw(st.one_of(st.sampled_from(DTYPE_STRS + [">f4", "|b1", "<U4", "O", "<f2 ", ""]),
                                       json_scalars)),
                   node[2] if node[0] == "a" and len(node) == 3 else draw(shapes())]
    elif how == "length":
        node[:] = ["y", draw(st.one_of(st.integers(-8, 64), st.sampled_from(HUGE), json_scalars))]
    elif how == "tag":
        node[0] = draw(st.one_of(st.sampled_from(list("NbifsyaldxD") + ["", "aa"]), json_scalars))
    elif how == "arity":
        if draw(st.booleans()) and len(node) > 1:
            del node[draw(st.integers(0, len(node) - 1))]
        else:
            node.append(draw(json_values))
    elif how == "replace":
        node[:] = draw(st.lists(json_values, max_size=3))
    elif how == "key" and node[0] == "d" and len(node) == 2 and isinstance(node[1], list) and node[1]:
        item = node[1][draw(st.integers(0, len(node[1]) - 1))]
        if isinstance(item, list) and item:
            item[0] = draw(json_scalars)
    else:  # the value of a leaf
        if len(node) >= 2:
            node[1] = draw(json_values)


@st.composite
def mutated(draw):
    msg = draw(messages)
    payload = message.encode(msg)
    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(["flip-header", "flip-blobs", "tree", "tree", "hlen", "truncate", "extend"]))
        if what in ("tree", "hlen"):
            try:
                header, blobs = _split(payload)
            except (ValueError, struct.error, UnicodeDecodeError):
                what = "flip-header"  # an earlier byte mutation broke the header: keep mutating bytes
            else:
                if what == "tree":
                    nodes = _nodes(header, [])
                    if nodes:
                        _rewrite_node(draw, nodes[draw(st.integers(0, len(nodes) - 1))])
                    payload = _join(header, blobs)
                else:
                    payload = _join(header, blobs, draw(st.integers(-16, 16)))
                continue
        if what in ("flip-header", "flip-blobs") and payload:
            (hlen,) = struct.unpack_from("<I", payload.ljust(4, b"\0"), 0)
            lo, hi = (0, min(len(payload), 4 + hlen)) if what == "flip-header" else (min(len(payload), 4 + hlen), len(payload))
            if hi <= lo:
                lo, hi = 0, len(payload)
            buf = bytearray(payload)
            for _ in range(draw(st.integers(1, 4))):
                buf[draw(st.integers(lo, hi - 1))] ^= draw(st.integers(1, 255))
            payload = bytes(buf)
        elif what == "truncate":
            payload = payload[:draw(st.integers(0, len(payload)))]
        elif what == "extend":
            payload = payload + draw(st.binary(min_size=1, max_size=24))
    return payload


def _decode_or_frame_error(payload: bytes) -> None:
    for buf in (payload, bytearray(payload)):
        try:
            out = message.decode(buf)
        except FrameError:
            continue
        assert isinstance(out, dict)


@FUZZ
@given(mutated())
def test_mutated_messages_decode_or_raise_frame_error(payload):
    _decode_or_frame_error(payload)


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_frame_error(payload):
    _decode_or_frame_error(payload)


# --------------------------------------------------------------------------- the regression


def _array_payload(dtype: str, shape) -> bytes:
    return _join(["d", [["x", ["a", dtype, shape]]]], b"")


@pytest.mark.parametrize("dtype", DTYPE_STRS)
@pytest.mark.parametrize("shape", [[0, 2 ** 62, 2 ** 62], [0, 2 ** 63], [2 ** 64, 0], [0, 2 ** 31, 2 ** 31],
                                   [0, 2 ** 48 + 1], [0] + [2 ** 2] * 25, [0] * 33, [0, 10 ** 40]])
def test_zero_size_arrays_with_huge_dims_raise_frame_error(dtype, shape):
    with pytest.raises(FrameError):
        message.decode(_array_payload(dtype, shape))


@pytest.mark.parametrize("dtype", DTYPE_STRS)
@pytest.mark.parametrize("shape", [[0], [0] * 32, [0, 2 ** 48], [2 ** 24, 0, 2 ** 24], [3, 0, 5]])
def test_zero_size_arrays_within_bounds_decode(dtype, shape):
    out = message.decode(_array_payload(dtype, shape))["x"]
    assert out.shape == tuple(shape) and out.size == 0 and out.dtype.str == dtype
