"""Safe, explicit serialisation of protocol messages (no pickle).

A message is a ``dict`` with ``str`` keys whose values are ``None``, ``bool``,
``int``, ``float``, ``str``, ``bytes`` (also ``bytearray``/``memoryview``),
``numpy.ndarray`` of a numeric dtype (any shape, any memory layout), or
``list``/``tuple``/``dict`` of these.  NumPy scalars are accepted and sent as the
matching Python scalar.  Tuples come back as lists; ``bytearray`` and
``memoryview`` come back as ``bytes``.

Payload layout::

    offset  size  field
    0       4     header length H (uint32, little-endian)
    4       H     UTF-8 JSON header: the value tree (see below)
    ...           zero padding to a multiple of 8
    ...           blobs, in tree order, each padded with zeros to a multiple of 8

JSON tree nodes are lists tagged by their first element::

    ["N"]                     None
    ["b", true]               bool
    ["i", 123]                int (arbitrary size)
    ["f", "0x1.8p+1"]         float, as float.hex() (exact, incl. inf/nan)
    ["s", "text"]             str
    ["y", n]                  bytes: the next blob, n bytes
    ["a", "<f4", [2, 3]]      ndarray: the next blob, prod(shape)*itemsize bytes,
                              C order, little-endian, dtype from a whitelist
    ["l", [node, ...]]        list
    ["d", [[key, node], ...]] dict (str keys, order preserved)

Decoding validates everything: header length, JSON syntax, node tags and arity,
key types, dtypes (whitelist), shapes (non-negative ints, ndim <= 32, the
product of the non-zero dimensions at most `MAX_ELEMENTS`, so that a zero-size
array with huge dimensions such as ``[0, 2**62, 2**62]`` is refused too), that
every blob lies inside the payload, that the blobs exactly fill the payload,
and the nesting depth (`MAX_DEPTH`).  Anything malformed raises `FrameError`,
never another exception (tests/test_net_message_fuzz.py).

Decoded arrays are zero-copy views of the (writable) receive buffer when the
payload is a ``bytearray`` — they are writable and keep that buffer alive.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from .framing import FrameError

MAX_DEPTH = 64
MAX_NDIM = 32
#: the largest product of an array's non-zero dimensions (its element count when it is
#: not empty): 2^48 elements, times the largest itemsize (16) still far inside numpy's
#: intp limit for any shape, empty or not
MAX_ELEMENTS = 1 << 48
_ALIGN = 8
_U32 = struct.Struct("<I")

# Whitelisted dtypes, by their canonical little-endian `dtype.str`.
_ALLOWED_DTYPES = {
    np.dtype(t).newbyteorder("<").str: np.dtype(t).newbyteorder("<")
    for t in (
        np.bool_,
        np.int8, np.int16, np.int32, np.int64,
        np.uint8, np.uint16, np.uint32, np.uint64,
        np.float16, np.float32, np.float64,
        np.complex64, np.complex128,
    )
}


def _pad(n: int) -> int:
    return (-n) % _ALIGN


# --------------------------------------------------------------------------- encode


def _encode_node(value: Any, blobs: list, depth: int) -> list:
    if depth > MAX_DEPTH:
        raise ValueError(f"message nesting deeper than {MAX_DEPTH}")
    if value is None:
        return ["N"]
    if isinstance(value, (bool, np.bool_)):
        return ["b", bool(value)]
    if isinstance(value, (int, np.integer)):
        return ["i", int(value)]
    if isinstance(value, (float, np.floating)):
        return ["f", float(value).hex()]
    if isinstance(value, str):
        return ["s", value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        mv = memoryview(value).cast("B") if isinstance(value, memoryview) else memoryview(value)
        blobs.append(mv)
        return ["y", mv.nbytes]
    if isinstance(value, np.ndarray):
        dt = _ALLOWED_DTYPES.get(value.dtype.newbyteorder("<").str)
        if dt is None:
            raise TypeError(f"unsupported array dtype {value.dtype!r} (numeric dtypes only)")
        arr = np.asarray(value, dtype=dt, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
        blobs.append(memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b""))
        return ["a", dt.str, [int(s) for s in value.shape]]
    if isinstance(value, (list, tuple)):
        return ["l", [_encode_node(v, blobs, depth + 1) for v in value]]
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"message dict keys must be str, got {type(k).__name__}")
            items.append([k, _encode_node(v, blobs, depth + 1)])
        return ["d", items]
    raise TypeError(f"unsupported message value type {type(value).__name__}")


def encode_parts(msg: dict) -> list:
    """Encode `msg` as a list of buffers whose concatenation is the payload
    (avoids copying large arrays)."""
    if not isinstance(msg, dict):
        raise TypeError(f"a message is a dict, got {type(msg).__name__}")
    blobs: list[memoryview] = []
    tree = _encode_node(msg, blobs, 0)
    header = json.dumps(tree, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
    head = _U32.pack(len(header)) + header
    parts: list = [head + b"\0" * _pad(len(head))]
    for b in blobs:
        if b.nbytes:
            parts.append(b)
        if _pad(b.nbytes):
            parts.append(b"\0" * _pad(b.nbytes))
    return parts


def encode(msg: dict) -> bytes:
    """Encode `msg` to one payload bytes object."""
    return b"".join(bytes(p) if isinstance(p, memoryview) else p for p in encode_parts(msg))


# --------------------------------------------------------------------------- decode


class _Reader:
    def __init__(self, buf: memoryview, base, start: int):
        self.buf = buf
        self.base = base
        self.pos = start

    def take(self, n: int) -> tuple[int, int]:
        if n < 0 or self.pos + n > len(self.buf):
            raise FrameError(f"blob of {n} bytes at offset {self.pos} overruns the {len(self.buf)}-byte payload")
        start = self.pos
        self.pos += n + _pad(n)
        if self.pos > len(self.buf):
            raise FrameError("blob padding overruns the payload")
        return start, n


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_shape(shape) -> int:
    """The element count of a well-formed shape (FrameError otherwise)."""
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(s) and s >= 0 for s in shape):
        raise FrameError(f"bad array shape {str(shape)[:100]}")
    nonzero = 1
    for s in shape:
        if s:
            nonzero *= s
            if nonzero > MAX_ELEMENTS:
                raise FrameError(f"array shape {str(shape)[:100]} has more than {MAX_ELEMENTS} elements")
    return 0 if 0 in shape else nonzero


def _decode_node(node, rd: _Reader, depth: int):
    if depth > MAX_DEPTH:
        raise FrameError(f"message nesting deeper than {MAX_DEPTH}")
    if not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise FrameError("malformed message node")
    tag = node[0]
    if tag == "N" and len(node) == 1:
        return None
    if len(node) == 2:
        v = node[1]
        if tag == "b" and isinstance(v, bool):
            return v
        if tag == "i" and _is_int(v):
            return v
        if tag == "f" and isinstance(v, str):
            try:
                return float.fromhex(v)
            except (ValueError, OverflowError) as e:
                raise FrameError(f"bad float {v!r}") from e
        if tag == "s" and isinstance(v, str):
            return v
        if tag == "y" and _is_int(v):
            start, n = rd.take(v)
            return bytes(rd.buf[start:start + n])
        if tag == "l" and isinstance(v, list):
            return [_decode_node(x, rd, depth + 1) for x in v]
        if tag == "d" and isinstance(v, list):
            out = {}
            for item in v:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
                    raise FrameError("malformed message dict item")
                if item[0] in out:
                    raise FrameError(f"duplicate message key {item[0]!r}")
                out[item[0]] = _decode_node(item[1], rd, depth + 1)
            return out
    if tag == "a" and len(node) == 3:
        dstr, shape = node[1], node[2]
        dt = _ALLOWED_DTYPES.get(dstr) if isinstance(dstr, str) else None
        if dt is None:
            raise FrameError(f"array dtype {dstr!r} not allowed")
        count = _check_shape(shape)
        start, _ = rd.take(count * dt.itemsize)
        try:
            if count == 0:
                return np.zeros(tuple(shape), dtype=dt)
            return np.frombuffer(rd.base, dtype=dt, count=count, offset=start).reshape(tuple(shape))
        except (ValueError, TypeError, OverflowError, MemoryError) as e:  # (the checks above exclude these)
            raise FrameError(f"bad array blob: {e}") from e
    raise FrameError(f"malformed message node with tag {tag!r}")


def decode(payload: bytes | bytearray | memoryview) -> dict:
    """Decode a payload produced by `encode`; raise FrameError if malformed."""
    buf = memoryview(payload)
    if buf.ndim != 1 or buf.itemsize != 1:
        buf = buf.cast("B")
    if len(buf) < 4:
        raise FrameError("message payload shorter than its header length field")
    (hlen,) = _U32.unpack(buf[:4])
    if 4 + hlen > len(buf):
        raise FrameError(f"message header length {hlen} overruns the {len(buf)}-byte payload")
    try:
        tree = json.loads(bytes(buf[4:4 + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FrameError(f"undecodable message header: {e}") from e
    if not (isinstance(tree, list) and tree and tree[0] == "d"):
        raise FrameError("message root must be a dict")
    start = 4 + hlen + _pad(4 + hlen)
    if start > len(buf):
        raise FrameError("message header padding overruns the payload")
    rd = _Reader(buf, payload if isinstance(payload, (bytes, bytearray)) else buf, start)
    try:
        out = _decode_node(tree, rd, 0)
    except RecursionError as e:
        raise FrameError("message nesting too deep") from e
    if rd.pos != len(buf):
        raise FrameError(f"{len(buf) - rd.pos} trailing bytes after the message blobs")
    return out
