"""Network layer: the one framed, accounted channel every mode uses, and the
LAN/WAN cost model (DESIGN.md "Network model")."""

from .channel import DEFAULT_STEP, Channel, SocketChannel, TCPChannel, inprocess_pair, listen
from .framing import (
    DEFAULT_MAX_FRAME,
    DEFAULT_TIMEOUT,
    HEADER_SIZE,
    ChannelClosed,
    ChannelError,
    ChannelTimeout,
    FrameError,
)
from .netmodel import PRESETS, NetworkModel, default_presets, get_preset

__all__ = [
    "Channel", "SocketChannel", "TCPChannel", "inprocess_pair", "listen", "DEFAULT_STEP",
    "ChannelError", "ChannelClosed", "ChannelTimeout", "FrameError",
    "DEFAULT_MAX_FRAME", "DEFAULT_TIMEOUT", "HEADER_SIZE",
    "NetworkModel", "PRESETS", "default_presets", "get_preset",
]
