"""Length-prefixed framing for the one channel every mode uses.

Wire format of one frame (all integers big-endian)::

    offset size  field
    0      4     magic   b"CLMF"
    4      1     version (FRAME_VERSION = 1)
    5      1     kind    (KIND_MESSAGE = 0: a `message.encode` payload, KIND_BYTES = 1: raw bytes)
    6      2     reserved, must be 0
    8      8     payload length in bytes
    16     n     payload

The header is validated (magic, version, kind, reserved bits, and length <=
the receiver's maximum frame size) *before* any payload buffer is allocated, and
the payload buffer then grows only as bytes actually arrive, so a hostile or
broken peer cannot make the receiver allocate memory it did not send.
The maximum is per channel (``Channel.max_frame``, default `DEFAULT_MAX_FRAME`)
and may change during a session: the servers accept only small frames
(``ServerLimits.pre_hello_max_frame``, 64 KiB) until the hello has been
checked, so an unauthenticated peer cannot even announce a large frame.

Errors are specific (all derive from `ChannelError`):

* `ChannelClosed` (also a `ConnectionError`): the peer disconnected, including
  in the middle of a frame, or the channel was closed locally.
* `ChannelTimeout` (also a `TimeoutError`): the peer did not deliver (or accept)
  a whole frame before the deadline.
* `FrameError` (also a `ValueError`): bad magic/version/kind, an oversized or
  truncated frame, or a payload that does not decode.
"""

from __future__ import annotations

import struct

MAGIC = b"CLMF"
FRAME_VERSION = 1
KIND_MESSAGE = 0
KIND_BYTES = 1
_KINDS = (KIND_MESSAGE, KIND_BYTES)

_HEADER = struct.Struct(">4sBBHQ")
HEADER_SIZE = _HEADER.size  # 16
assert HEADER_SIZE == 16

DEFAULT_MAX_FRAME = 1 << 30  # 1 GiB
DEFAULT_TIMEOUT = 120.0  # seconds


class ChannelError(Exception):
    """Base class of every channel error."""


class ChannelClosed(ChannelError, ConnectionError):
    """The peer disconnected (possibly mid-frame) or the channel is closed."""


class ChannelTimeout(ChannelError, TimeoutError):
    """The peer stalled: no complete frame within the timeout."""


class FrameError(ChannelError, ValueError):
    """A malformed frame: bad header, oversized, truncated or undecodable payload."""


def encode_header(kind: int, length: int) -> bytes:
    """The 16-byte header of a frame carrying `length` payload bytes."""
    if kind not in _KINDS:
        raise ValueError(f"unknown frame kind {kind}")
    if not 0 <= length < (1 << 64):
        raise ValueError(f"bad payload length {length}")
    return _HEADER.pack(MAGIC, FRAME_VERSION, kind, 0, length)


def decode_header(header: bytes | bytearray | memoryview, max_frame: int = DEFAULT_MAX_FRAME) -> tuple[int, int]:
    """Validate a 16-byte header; return (kind, payload_length).

    Raises FrameError for a short header, bad magic, unsupported version,
    unknown kind, non-zero reserved bits or a length above `max_frame`.
    """
    if len(header) != HEADER_SIZE:
        raise FrameError(f"truncated frame header: {len(header)} of {HEADER_SIZE} bytes")
    magic, version, kind, reserved, length = _HEADER.unpack(bytes(header))
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {magic!r} (expected {MAGIC!r})")
    if version != FRAME_VERSION:
        raise FrameError(f"unsupported frame version {version} (expected {FRAME_VERSION})")
    if kind not in _KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    if reserved != 0:
        raise FrameError(f"non-zero reserved header bits {reserved:#x}")
    if length > max_frame:
        raise FrameError(f"frame of {length} bytes exceeds the maximum frame size {max_frame}")
    return kind, length
