"""Fuzz targets: every decoder that reads bytes (or values of a decoded message) from a peer.

One `Target` per decoder: the module that owns it, the error types it documents, a
Hypothesis strategy of inputs (mostly mutations of genuine inputs: a real welcome, a real
ciphertext, a real frame; plus random bytes) and a ``check`` that feeds one input to the
decoder.  Every input must either decode or raise one of the documented errors: any other
exception, a hang (``HANG_SECONDS`` per input, SIGALRM) or a crash of the interpreter is a
finding.  Targets marked ``native`` call C++ (SEAL), Go (Lattigo) or Rust (tokenizers) code
on peer bytes; they run in a child process (``python tests/fuzz_targets.py TARGET ...``)
so that a crash kills the child, not pytest, and the child writes each input to a file
before decoding it (the crashing input is left there).

Used by tests/test_fuzz_*.py (``run(name, examples)``: deterministic, a bounded number of
examples) and benchmarks/fuzz_long.py (``run(..., derandomize=False, seconds=...)``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import signal
import socket
import struct
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import numpy as np
from hypothesis import HealthCheck, Phase, given, seed as hseed, settings
from hypothesis import strategies as st

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

HANG_SECONDS = 20.0


class Hang(BaseException):
    """An input took longer than HANG_SECONDS (a BaseException: decoders' ``except
    Exception`` must not swallow it)."""


class Finding(AssertionError):
    """A decoder raised something it does not document (or hung)."""


@dataclasses.dataclass
class Target:
    name: str
    module: str  # where the decoder lives
    errors: Callable[[], tuple]  # the documented error types (imported lazily)
    error_names: str  # as the docs table shows them
    strategy: Callable[[], Any]  # -> a hypothesis strategy
    check: Callable[[Any], Any]  # feeds one input to the decoder
    native: bool = False  # calls native code on peer bytes: run in a child process
    ci_examples: int = 100
    needs: Callable[[], str | None] = lambda: None  # a reason the target cannot run here, or None


TARGETS: dict[str, Target] = {}


def target(name, module, errors, error_names, *, native=False, ci=100, needs=None):
    def deco(fn):
        strategy, check = fn()
        TARGETS[name] = Target(name, module, errors, error_names, strategy, check, native, ci,
                               needs or (lambda: None))
        return fn
    return deco


# =========================================================================== mutators


INTERESTING_U64 = [0, 1, 2, 3, 7, 8, 15, 16, 255, 256, 4096, 8192, 16384, 65535, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1,
                   2 ** 32, 2 ** 48, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1]


@st.composite
def mutated_bytes(draw, seeds: list, *, max_ops: int = 4, keep_prefix: int = 0, fix=None):
    """A genuine blob with 1..max_ops of: byte flips, a byte set, an aligned u64 / u32 / u16
    field rewritten to an interesting value, truncation, extension, a span deleted,
    duplicated or replaced by random bytes.  ``keep_prefix`` bytes are left alone by the
    byte-level edits (e.g. a header whose size field must stay right) where drawn so."""
    b = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, max_ops))):
        n = len(b)
        op = draw(st.sampled_from(["flip", "flip", "set", "word", "word", "truncate", "extend", "delete",
                                   "dup", "random-span"]))
        lo = keep_prefix if n > keep_prefix and draw(st.booleans()) else 0
        if op in ("flip", "set") and n > lo:
            i = draw(st.integers(lo, n - 1))
            b[i] = b[i] ^ draw(st.integers(1, 255)) if op == "flip" else draw(st.integers(0, 255))
        elif op == "word" and n >= 8:
            width = draw(st.sampled_from([8, 8, 4, 2]))
            i = draw(st.integers(0, (n - width) // width)) * width
            v = draw(st.sampled_from(INTERESTING_U64)) & ((1 << (8 * width)) - 1)
            b[i:i + width] = v.to_bytes(width, "little")
        elif op == "truncate":
            del b[draw(st.integers(0, n)):]
        elif op == "extend":
            b += draw(st.binary(min_size=1, max_size=64))
        elif op == "delete" and n:
            i = draw(st.integers(0, n - 1))
            del b[i:i + draw(st.integers(1, 64))]
        elif op == "dup" and n:
            i = draw(st.integers(0, n - 1))
            b[i:i] = b[i:i + draw(st.integers(1, 64))]
        elif op == "random-span" and n:
            i = draw(st.integers(0, n - 1))
            k = min(n - i, draw(st.integers(1, 256)))
            b[i:i + k] = draw(st.binary(min_size=k, max_size=k))
    if fix is not None and draw(st.integers(0, 3)):  # mostly: repair what a first check would refuse at once
        fix(b)
    return bytes(b)


def fix_seal_size(b: bytearray) -> None:
    """Make a SEAL header's size field equal the blob's length again (else the header check
    refuses every length-changing mutation before the body is looked at)."""
    if len(b) >= 16:
        struct.pack_into("<Q", b, 8, len(b))


def small_arrays():
    return st.one_of(
        st.builds(lambda v, dt: np.array(v).astype(dt), st.integers(-3, 3), st.sampled_from(["<i8", "<u1", "<f8"])),
        st.builds(lambda n, dt: np.arange(n).astype(dt), st.integers(0, 4), st.sampled_from(["<i8", "<u1", "<f4"])),
        st.just(np.zeros((2, 0), np.int64)),
    )


WIRE_INTS = st.one_of(st.integers(-5, 70000), st.sampled_from([-(2 ** 63), -1, 2 ** 31, 2 ** 53 + 1, 2 ** 63,
                                                              2 ** 64, 10 ** 30, 2 ** 1000]))
wire_leaves = st.one_of(st.none(), st.booleans(), WIRE_INTS,
                        st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1.0, 1e308]),
                        st.text(max_size=8), st.sampled_from(["", "seal", "lattigo", "error", "welcome", "hello",
                                                              "offload", "2pc", "llama", "bert", "cryptomoe",
                                                              "insecure", "LAN", "coeff", "a" * 64]),
                        st.binary(max_size=16), small_arrays())
wire_values = st.recursive(
    wire_leaves,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)


def _paths(tree, prefix=()):
    yield prefix
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _paths(v, prefix + (i,))


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _retype(v):
    """The same value as another type (what a careless or hostile peer sends)."""
    if isinstance(v, bool):
        return [int(v), np.array(v), str(v)]
    if isinstance(v, int):
        return [float(v), bool(v), str(v), np.array(v % (1 << 63)), np.array([v % (1 << 63)] * 2), [v]]
    if isinstance(v, float):
        return [int(v) if math.isfinite(v) else 0, str(v), np.array(v)]
    if isinstance(v, str):
        return [v.encode(), [v], np.frombuffer(v.encode() or b"\0", np.uint8), v * 2, v[: len(v) // 2]]
    if isinstance(v, bytes):
        return [v.decode("latin-1"), np.frombuffer(v or b"\0", np.uint8), [v]]
    if isinstance(v, list):
        return [tuple(v), {str(i): x for i, x in enumerate(v)}, v * 2, v[:-1], v[::-1]]
    if isinstance(v, dict):
        return [list(v.items()), list(v.values()), {}]
    return [None]


@st.composite
def mutated_tree(draw, seeds: list, *, max_ops: int = 3):
    """A genuine message (dict) with 1..max_ops edits at random places of its tree: a value
    replaced (any wire value, or the same value as another type), a key deleted or added,
    a list element dropped or appended."""
    tree = copy.deepcopy(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, max_ops))):
        paths = list(_paths(tree))
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "retype", "retype", "delete", "add"]))
        if not path and op in ("replace", "retype", "delete"):
            op = "add"
        node = _get(tree, path[:-1]) if path else None
        if op == "replace":
            node[path[-1]] = draw(wire_values)
        elif op == "retype":
            node[path[-1]] = draw(st.sampled_from(_retype(node[path[-1]])))
        elif op == "delete":
            del node[path[-1]]
        else:
            here = _get(tree, path)
            if isinstance(here, dict):
                here[draw(st.sampled_from(list(here) or ["x"]) | st.text(max_size=6))] = draw(wire_values)
            elif isinstance(here, list):
                here.append(draw(wire_values))
    return tree


def over_the_wire(msg):
    """What the peer's dict looks like after `message.encode` / `decode` (tuples become
    lists, NumPy scalars Python scalars, arrays little-endian)."""
    from cipherlm.net import message

    return message.decode(message.encode(msg))


# =========================================================================== net


@target("frame_header", "cipherlm.net.framing.decode_header", lambda: _net_errors()[:1], "FrameError", ci=500)
def _frame_header():
    from cipherlm.net import framing

    good = [framing.encode_header(k, n) for k in (0, 1) for n in (0, 1, 16, 1 << 20, (1 << 30) + 1, 2 ** 64 - 1)]
    strategy = st.one_of(mutated_bytes(good), st.binary(max_size=24))

    def check(h):
        for cap in (framing.DEFAULT_MAX_FRAME, 1 << 16):
            kind, n = framing.decode_header(h, cap)
            assert kind in (0, 1) and 0 <= n <= cap and len(h) == 16
    return strategy, check


def _net_errors():
    from cipherlm.net import ChannelClosed, ChannelTimeout, FrameError

    return (FrameError, ChannelClosed, ChannelTimeout)


def _frames(msgs) -> bytes:
    from cipherlm.net import framing, message

    out = b""
    for m in msgs:
        if isinstance(m, bytes):
            out += framing.encode_header(framing.KIND_BYTES, len(m)) + m
        else:
            p = message.encode(m)
            out += framing.encode_header(framing.KIND_MESSAGE, len(p)) + p
    return out


@target("channel_stream", "cipherlm.net.channel.Channel.recv / recv_bytes", _net_errors,
        "FrameError, ChannelClosed, ChannelTimeout (all ChannelError)", ci=150)
def _channel_stream():
    from cipherlm.net.channel import SocketChannel

    good = [_frames([{"type": "hello", "protocol": 1, "mode": "offload", "model": None}]),
            _frames([{"type": "linear", "group": 0, "cts": [b"\x01" * 40, b"\x02" * 9]}, {"type": "bye"}]),
            _frames([{"a": np.arange(6, dtype=np.int64).reshape(2, 3)}, b"raw bytes"]),
            _frames([b"", {"x": None}])]
    strategy = st.tuples(st.one_of(mutated_bytes(good, max_ops=3), st.binary(max_size=64)),
                         st.sampled_from([None, 1 << 16, 64]), st.booleans())

    def check(x):
        data, cap, raw_first = x
        a, b = socket.socketpair()
        kw = {} if cap is None else {"max_frame": cap}
        chan = SocketChannel(b, timeout=0.5, **kw)
        try:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)  # EOF after the bytes: a receive must end, never wait
            for i in range(8):
                if raw_first and i == 1:
                    out = chan.recv_bytes()
                    assert isinstance(out, bytes)
                else:
                    assert isinstance(chan.recv(), dict)
        except _net_errors():
            pass
        finally:
            chan.close()
            a.close()
    return strategy, check


@target("message", "cipherlm.net.message.decode (its own fuzzer: tests/test_net_message_fuzz.py; here for "
        "the long run)", lambda: _net_errors()[:1], "FrameError", ci=100)
def _message():
    def strategy():
        import test_net_message_fuzz as M

        return st.one_of(M.mutated(), st.binary(max_size=200))

    def check(payload):
        from cipherlm.net import FrameError, message

        for buf in (payload, bytearray(payload)):
            try:
                assert isinstance(message.decode(buf), dict)
            except FrameError:
                pass
    return st.deferred(strategy), check


# =========================================================================== session layer (server side)


def _session_errors():
    from cipherlm.runtime.offload_server import OffloadServer

    return OffloadServer.expected_errors


class _ScriptChannel:
    """A channel whose receives return a script of messages (then ChannelClosed) and
    whose sends are recorded."""

    def __init__(self, msgs):
        self.msgs = list(msgs)
        self.sent = []
        self.max_frame = 0

    def recv(self, timeout=None):
        from cipherlm.net import ChannelClosed

        if not self.msgs:
            raise ChannelClosed("end of script")
        return self.msgs.pop(0)

    def send(self, msg):
        self.sent.append(msg)

    def step(self, label):
        import contextlib

        return contextlib.nullcontext()

    def peer_gone(self):
        return False


class _StubEngine:
    """The offload engine's input checks without HE (the HE loaders are their own targets)."""

    def load_client_keys(self, blob, ring_switch_key=None, input_switch_key=None):
        from cipherlm.he import HEError

        if not isinstance(blob, (bytes, bytearray)):
            raise HEError("galois_keys must be bytes")
        if ring_switch_key is not None:  # a SEAL-like engine: half-ring results not offered
            raise HEError("this server does not offer half-ring results: no ring_switch_key expected")
        if input_switch_key is not None:
            raise HEError("this server's plans take full-ring inputs: no input_switch_key expected")
        return type("K", (), {"he_ops": lambda self: {}})()

    def apply(self, gid, ct, keys):
        from cipherlm.he import HEError

        if not isinstance(ct, (bytes, bytearray)):
            raise HEError("a ciphertext must be bytes")
        return b"r"

    def release(self, keys):
        pass


class _StubOffloadHost:
    name = "tiny"

    def __init__(self):
        from cipherlm.runtime.linear_groups import LinearGroup

        self.groups = [LinearGroup(0, ("q", "k"), 8, (8, 4)), LinearGroup(1, ("lm_head",), 8, (16,))]
        self.engine = _StubEngine()
        self.bundle = {"type": "bundle", "tensors": {"e": np.zeros((2, 2), np.float32)}, "tokenizer": None}

    def welcome(self):
        return {"type": "welcome", "protocol": 1, "model": self.name}


HELLO = {"type": "hello", "protocol": 1, "mode": "offload", "model": None}
OFFLOAD_REQUESTS = [{"type": "get_bundle"}, {"type": "keys", "galois_keys": b"k" * 32},
                    {"type": "linear", "group": 0, "cts": [b"c" * 16, b"d" * 16]},
                    {"type": "linear", "group": 1, "cts": [b"c" * 16]}, {"type": "stats"}, {"type": "bye"}]


@target("offload_server_requests", "cipherlm.runtime.session_server.MessageSession (hello, request loop) + "
        "offload_server.Session handlers", _session_errors,
        "ProtocolError (LimitExceeded), HEError, ChannelClosed", ci=300)
def _offload_requests():
    from cipherlm.runtime.offload_server import Session
    from cipherlm.runtime.session_server import ServerLimits

    scripts = [[HELLO] + OFFLOAD_REQUESTS, [HELLO, OFFLOAD_REQUESTS[1], OFFLOAD_REQUESTS[2], OFFLOAD_REQUESTS[0]]]
    strategy = st.one_of(
        st.tuples(st.sampled_from(scripts), st.integers(0, 6), mutated_tree(OFFLOAD_REQUESTS + [HELLO])),
        st.tuples(st.sampled_from(scripts), st.integers(0, 6), wire_values))
    host = _StubOffloadHost()

    def check(x):
        msgs, at, bad = x
        msgs = [over_the_wire(m) for m in msgs]
        msgs.insert(min(at, len(msgs)), over_the_wire(bad) if isinstance(bad, dict) else bad)
        s = Session(host, _ScriptChannel(msgs))
        s.limits = ServerLimits(max_cts_per_request=4, max_work_per_session=8)
        try:
            s.run()
        except _session_errors():
            pass
    return strategy, check


# =========================================================================== client checks


@functools.lru_cache(maxsize=1)
def _offload_welcome_seed() -> dict:
    from test_client_validation import _offload_bundle, _offload_welcome

    tensors, tok = _offload_bundle()
    w = _offload_welcome(tensors, tok)
    w["limits"] = {"max_cts_per_request": 512, "max_work_per_session": 1 << 20, "session_lifetime": 3600.0}
    w["he_backend"] = "seal"
    return w


def _protocol_errors():
    from cipherlm.runtime.offload_protocol import ProtocolError

    return (ProtocolError,)


@target("offload_welcome", "cipherlm.runtime.plan_check.check_offload_welcome", _protocol_errors, "ProtocolError",
        ci=300)
def _offload_welcome():
    def check(w):
        from cipherlm.runtime.offload_protocol import PROTOCOL_VERSION
        from cipherlm.runtime.plan_check import check_offload_welcome

        try:
            check_offload_welcome(over_the_wire(w), PROTOCOL_VERSION)
        except _protocol_errors():
            pass
    return st.deferred(lambda: mutated_tree([_offload_welcome_seed()])), check


@functools.lru_cache(maxsize=1)
def _twopc_welcomes() -> list:
    from test_twopc import bert_model, llama_model
    from test_twopc_moe import _model as moe_model

    from cipherlm.models import LoadedModel
    from cipherlm.runtime import twopc
    from cipherlm.runtime.twopc_session import TwoPCHost

    out = []
    config, w = llama_model(seed=4)
    out.append(TwoPCHost("tiny-decoder", lm=LoadedModel("tiny-decoder", config, w)).welcome())
    config, w = moe_model("mixtral", seed=4)
    out.append(TwoPCHost("tiny-moe", lm=LoadedModel("tiny-moe", config, w)).welcome())
    config, w, cls = bert_model(seed=4)
    out.append(TwoPCHost("tiny-bert", lm=LoadedModel("tiny-bert", config, w), classifier=cls).welcome())
    del twopc
    return [over_the_wire(w) for w in out]


@target("twopc_welcome", "cipherlm.runtime.twopc_session.TwoPCClient._check_welcome (plan_check."
        "check_twopc_welcome, check_twopc_plan)", _protocol_errors, "ProtocolError", ci=200)
def _twopc_welcome():
    def check(w):
        from cipherlm.runtime.twopc_session import TwoPCClient

        try:
            TwoPCClient._check_welcome(over_the_wire(w))
        except _protocol_errors():
            pass
    return st.deferred(lambda: mutated_tree(_twopc_welcomes())), check


@target("twopc_plan", "cipherlm.runtime.plan_check.check_twopc_plan", _protocol_errors, "ProtocolError", ci=200)
def _twopc_plan():
    def check(x):
        from cipherlm.runtime.plan_check import check_twopc_plan

        plan, config = x
        try:
            check_twopc_plan(over_the_wire({"p": plan})["p"], config)
        except _protocol_errors():
            pass
    return st.deferred(lambda: st.tuples(
        mutated_tree([w["plan"] for w in _twopc_welcomes()]),
        st.sampled_from([None] + [w["config"] for w in _twopc_welcomes()]))), check


@target("expect", "cipherlm.runtime.offload_protocol.expect (every reply a client reads: welcome, bundle, "
        "ready, result, go, stats)", lambda: _protocol_errors() + (_remote_error(),),
        "ProtocolError, RemoteError (the server's {type: error})", ci=200)
def _expect():
    seeds = [{"type": "welcome"}, {"type": "error", "message": "x"}, {"type": "result", "cts": [b"x"]}]

    def check(x):
        from cipherlm.runtime.offload_protocol import expect

        msg, kind = x
        try:
            out = expect(over_the_wire(msg) if isinstance(msg, dict) else msg, kind)
            assert out["type"] == kind
        except (_protocol_errors() + (_remote_error(),)):
            pass
    return st.tuples(st.one_of(mutated_tree(seeds), wire_values),
                     st.sampled_from(["welcome", "result", "bundle", "ready", "go"])), check


def _remote_error():
    from cipherlm.runtime.offload_protocol import RemoteError

    return RemoteError


@target("offload_bundle", "cipherlm.runtime.bundle.check_bundle + store_bundle (digest check)", _protocol_errors,
        "ProtocolError", ci=150)
def _offload_bundle():
    from test_client_validation import _offload_bundle as make

    tensors, tok = make()
    seed = {"type": "bundle", "tensors": tensors, "tokenizer": tok}

    def check(b):
        import tempfile

        from cipherlm.runtime.bundle import bundle_digest, check_bundle, store_bundle

        b = over_the_wire(b)
        try:
            t, tok = check_bundle(b.get("tensors"), b.get("tokenizer"))
        except _protocol_errors():
            return
        digest = bundle_digest(tensors, seed["tokenizer"])
        old = os.environ.get("CIPHERLM_CACHE")
        with tempfile.TemporaryDirectory() as d:
            os.environ["CIPHERLM_CACHE"] = d
            try:
                store_bundle(digest, t, tok)
            except _protocol_errors():
                pass
            finally:
                if old is None:
                    del os.environ["CIPHERLM_CACHE"]
                else:
                    os.environ["CIPHERLM_CACHE"] = old
    return mutated_tree([seed]), check


# =========================================================================== 2pc session (server side) and control


def _twopc_server_errors():
    from cipherlm.runtime.twopc_session import TwoPCServer

    return TwoPCServer.expected_errors


@target("twopc_server_requests", "cipherlm.runtime.twopc_session.ServerSession (hello, generate / classify "
        "fields)", _twopc_server_errors, "ProtocolError, MPCError, ChannelClosed", ci=300)
def _twopc_requests():
    from cipherlm.runtime.session_server import ServerLimits
    from cipherlm.runtime.twopc_session import ServerSession

    class Host:
        name, kind, max_tokens, plan = "tiny", "decoder", 64, {"classes": None}

        def welcome(self):
            return {"type": "welcome"}

    class Session(ServerSession):
        def __init__(self, host, chan):
            self.host, self.chan, self.requests = host, chan, 0
            self.meter = type("M", (), {"seconds": {}, "stats": lambda self: {}})()

        def _go(self):  # a checked request: the 2PC run itself is not fuzzed here
            self.requests += 1
            return type("E", (), {"generate": lambda *a: None, "classify": lambda *a: None})()

    hello = {"type": "hello", "protocol": 1, "mode": "2pc", "model": None}
    reqs = [{"type": "generate", "n_prompt": 3, "max_new_tokens": 2}, {"type": "classify", "n_tokens": 4},
            {"type": "stats"}, {"type": "bye"}]
    strategy = st.tuples(st.sampled_from(["decoder", "encoder"]), st.integers(0, 4),
                         st.one_of(mutated_tree(reqs + [hello]), wire_values))

    def check(x):
        kind, at, bad = x
        msgs = [over_the_wire(m) for m in [hello] + reqs]
        msgs.insert(at, over_the_wire(bad) if isinstance(bad, dict) else bad)
        host = Host()
        host.kind = kind
        host.plan = {"classes": 2 if kind == "encoder" else None}
        s = Session(host, _ScriptChannel(msgs))
        s.limits = ServerLimits()
        try:
            s.run()
        except _twopc_server_errors():
            pass
    return strategy, check


def _mpc_errors():
    from cipherlm.mpc.context import MPCError

    return (MPCError,)


@target("twopc_control", "cipherlm.runtime.twopc.TwoPCExecutor._agree (the client's continue message)",
        _mpc_errors, "TwoPCError (an MPCError)", ci=100)
def _twopc_control():
    import contextlib

    from cipherlm.runtime.twopc import TwoPCExecutor

    class Ctx:
        party = 1

        def __init__(self, msg):
            self.msg = msg

        def recv(self):
            return self.msg

        def step(self, label):
            return contextlib.nullcontext()

    class Ex:
        def meter(self, cls):
            return contextlib.nullcontext()

    def check(msg):
        ex = Ex()
        ex.ctx = Ctx(over_the_wire(msg) if isinstance(msg, dict) else msg)
        try:
            assert TwoPCExecutor._agree(ex, None, set(), True) in (True, False)
        except _mpc_errors():
            pass
    return st.one_of(mutated_tree([{"continue": True}, {"continue": False}]), wire_values), check


# =========================================================================== MPC


@target("share_messages", "cipherlm.mpc.shares (reveal, share_input, bool exchange) as the 2pc client runs them "
        "(TwoPCClient._run)", lambda: (_remote_error(),) + _mpc_errors(),
        "RemoteError (TwoPCClient._run), MPCError", ci=150)
def _share_messages():
    import contextlib

    from cipherlm.mpc.ring import RingConfig
    from cipherlm.mpc.shares import AShare, reveal, share_input

    class Ctx:
        party = 0
        ring = RingConfig()
        rng = np.random.default_rng(0)

        def __init__(self, msg):
            self.msg = msg

        def recv(self):
            return self.msg

        def send(self, msg):
            pass

        def exchange(self, msg):
            return self.msg

        def step(self, label):
            return contextlib.nullcontext()

    seeds = [{"s": np.arange(4, dtype=np.uint64)}, {"r": np.arange(6, dtype=np.uint64).reshape(2, 3)}]

    def check(x):
        from cipherlm.runtime.twopc_session import TwoPCClient

        msg, which = x
        ctx = Ctx(over_the_wire(msg) if isinstance(msg, dict) else msg)
        ops = [lambda: reveal(AShare(ctx, np.zeros(4, np.uint64), 64), to=0),
               lambda: reveal(AShare(ctx, np.zeros(4, np.uint64), 64)),
               lambda: share_input(ctx, None, owner=1).data + 1]
        try:
            TwoPCClient._run(None, ops[which])
        except (_remote_error(),) + _mpc_errors():
            pass
    return st.tuples(st.one_of(mutated_tree(seeds), st.dictionaries(st.sampled_from(["s", "r", "x"]), wire_values,
                                                                    max_size=2)),
                     st.integers(0, 2)), check


def _ot_errors():
    from cipherlm.mpc.ot_common import OTError

    return (OTError,)


@target("ot_message", "cipherlm.mpc.ot_common.expect (every IKNP / KK13 / Ferret message)", _ot_errors,
        "OTError", ci=200)
def _ot_message():
    seeds = [{"op": "rot", "n": 5, "bits": 64, "u": np.zeros(40, np.uint8)},
             {"op": "cot_y", "y": np.zeros(16, np.uint8)}, {"op": "base", "a": np.zeros(32, np.uint8), "n": 128}]

    class Chan:
        def __init__(self, m):
            self.m = m

        def recv(self):
            return self.m

    def check(x):
        from cipherlm.mpc.ot_common import expect

        msg, which = x
        op, arrays, fields = [("rot", {"u": 40}, {"n": 5, "bits": 64}), ("cot_y", {"y": None}, {}),
                              ("base", {"a": 32}, {"n": 128})][which]
        try:
            out = expect(Chan(over_the_wire(msg) if isinstance(msg, dict) else msg), op, arrays, **fields)
            assert out["op"] == op
        except _ot_errors():
            pass
    return st.tuples(st.one_of(mutated_tree(seeds), wire_values), st.integers(0, 2)), check


@target("ring_ciphertext", "cipherlm.protocols.embedding_he.unpack_bits (FastQuery's bit-packed RLWE "
        "ciphertexts, numpy ring backend)", lambda: (ValueError,), "ValueError", ci=200)
def _ring_ciphertext():
    from cipherlm.protocols import embedding_he as H

    cases = [([31, 31], (), 64), ([20], (3,), 32), ([31, 30, 29], (2, 2), 16)]
    rng = np.random.default_rng(0)
    seeds = []
    for bits, lead, n in cases:
        a = np.stack([rng.integers(0, 1 << b, size=tuple(lead) + (n,), dtype=np.uint64) for b in bits], axis=-2)
        seeds.append(H.pack_bits(a, bits))

    def check(x):
        data, which = x
        bits, lead, n = cases[which]
        try:
            out = H.unpack_bits(data, bits, lead, n)
            assert out.shape == tuple(lead) + (len(bits), n)
        except ValueError:
            pass
    return st.tuples(st.one_of(mutated_bytes(seeds), st.binary(max_size=300)), st.integers(0, 2)), check


@target("offload_ct_list", "cipherlm.he.matmul.unpack_cts (a multi-part request / result)",
        lambda: (_he_error(),), "HEError", ci=200)
def _ct_list():
    from cipherlm.he.matmul import pack_cts, unpack_cts

    seeds = [pack_cts([b"a" * 10, b"bb"]), pack_cts([b""]), pack_cts([b"x" * 40] * 3)]

    def check(x):
        data, expected = x
        try:
            out = unpack_cts(data, expected)
            assert all(isinstance(b, bytes) for b in out)
        except _he_error():
            pass
    return st.tuples(st.one_of(mutated_bytes(seeds), st.binary(max_size=64)), st.sampled_from([None, 1, 3])), check


def _he_error():
    from cipherlm.he import HEError

    return HEError


# =========================================================================== native: SEAL, Lattigo, tokenizers


@functools.lru_cache(maxsize=None)
def _seal_state(scheme: str) -> dict:
    import seal_corpus

    from cipherlm.he import HEContext, serialize

    ctx = HEContext(seal_corpus.params(scheme))
    legit = seal_corpus.legit_blobs(scheme)
    seeds = {}
    for kind, blobs in legit.items():
        out = []
        for b in blobs:
            body = serialize._body(b)
            out += [b, serialize._header(len(body)) + body,  # uncompressed: mutations reach the layout
                    serialize._header(len(zlib.compress(body)), serialize.COMPR_ZLIB) + zlib.compress(body)]
        seeds[kind] = out + [b for _, s, k, b in seal_corpus.crashers() if s == scheme and k == kind]
    return {"ctx": ctx, "seeds": seeds}


def _seal_target(scheme: str, kind: str):
    def strategy():
        return st.deferred(lambda: mutated_bytes(_seal_state(scheme)["seeds"][kind], max_ops=3, fix=fix_seal_size))

    def check(blob):
        from cipherlm.he import HEError, serialize

        ctx = _seal_state(scheme)["ctx"]
        try:
            if kind == "ciphertext":
                serialize.ciphertext_from_bytes(ctx, blob, size=None)
            elif kind == "public_key":
                serialize.public_key_from_bytes(ctx, blob)
            else:
                serialize.galois_keys_from_bytes(ctx, blob, required_steps=[1])
        except HEError:
            pass
    return strategy, check


for _scheme, _kind, _who in (("ckks", "ciphertext", "offload server (inputs) and client (results)"),
                             ("ckks", "galois_keys", "offload server"),
                             ("bfv", "ciphertext", "2pc linear layers (both parties)"),
                             ("bfv", "public_key", "2pc HE session (both parties)"),
                             ("bfv", "galois_keys", "2pc packing (PackLWEs)")):
    _s, _c = _seal_target(_scheme, _kind)
    TARGETS[f"seal_{_scheme}_{_kind}"] = Target(
        f"seal_{_scheme}_{_kind}", f"cipherlm.he.serialize.{_kind}_from_bytes ({_scheme.upper()}; {_who})",
        lambda: (_he_error(),), "HEError", _s, _c, native=True, ci_examples=60 if _kind == "galois_keys" else 120)


@functools.lru_cache(maxsize=1)
def _params_seeds() -> list:
    from cipherlm.he import OFFLOAD_CKKS, serialize
    from cipherlm.mpc.he_session import TWOPC_BFV

    out = []
    for p in (OFFLOAD_CKKS, TWOPC_BFV):
        blob = serialize.params_to_bytes(p)
        out.append(blob)
        js = json.loads(blob[10:10 + struct.unpack_from("<I", blob, 6)[0]])
        for key, vals in (("poly_modulus_degree", [1024, 2048, 4096, 16384, 3, 0]),
                          ("coeff_modulus_bits", [[20, 20], [60] * 14, [2], [61], []]),
                          ("plain_modulus", [0, 1, 2, 3, 65537, 2 ** 61, "7", None]),
                          ("scheme", ["bgv", "bfv", "ckks", 1])):
            for v in vals:
                j = json.dumps(dict(js, **{key: v})).encode()
                out.append(blob[:6] + struct.pack("<I", len(j)) + j + blob[10 + len(json.dumps(js).encode()):])
    return out


@target("seal_params", "cipherlm.he.serialize.params_from_bytes (the offload welcome's he_params; 2pc BFV "
        "parameter exchange)", lambda: (_he_error(),), "HEError", native=True, ci=150)
def _seal_params():
    def check(blob):
        from cipherlm.he import HEError, serialize

        try:
            serialize.params_from_bytes(blob)
        except HEError:
            pass
    return st.deferred(lambda: st.one_of(st.sampled_from(_params_seeds()), mutated_bytes(_params_seeds(), max_ops=2))), check


@functools.lru_cache(maxsize=1)
def _offload_client_state() -> dict:
    import tenseal.sealapi as seal

    from cipherlm.he import serialize
    from cipherlm.runtime.linear_groups import LinearGroup
    from cipherlm.runtime.offload_engine import ClientEngine

    w = _offload_welcome_seed()
    groups = [LinearGroup(i, tuple(g["names"]), g["d_in"], tuple(g["d_outs"])) for i, g in enumerate(w["groups"])]
    eng = ClientEngine(w, groups)
    ctx = eng.ctx
    pt = seal.Plaintext()
    ctx.encoder.encode([0.25] * ctx.slots, 2.0 ** 40, pt)
    ct = eng.keys.encrypt(pt)
    ctx.evaluator.mod_switch_to_inplace(ct, ctx.parms_id_at(1))
    result = serialize.ciphertext_to_bytes(ct)
    body = serialize._body(result)
    seeds = [result, serialize._header(len(body)) + body, eng.encrypt(0, np.ones(64))]
    return {"engine": eng, "seeds": seeds, "welcome": w, "groups": groups}


@target("offload_result", "cipherlm.runtime.offload_engine.ClientEngine.decrypt (the client's check of a "
        "result ciphertext)", lambda: (_he_error(),), "HEError", native=True, ci=120)
def _offload_result():
    def check(blob):
        from cipherlm.he import HEError

        try:
            out = _offload_client_state()["engine"].decrypt(0, blob)
            assert out.shape == (256,)
        except HEError:
            pass
    return st.deferred(lambda: mutated_bytes(_offload_client_state()["seeds"], max_ops=3, fix=fix_seal_size)), check


@target("offload_client_engine", "cipherlm.runtime.offload_engine.ClientEngine (the welcome's HE parameters, "
        "plans and parts, after check_offload_welcome)", lambda: _protocol_errors() + (_he_error(),),
        "ProtocolError (welcome types), HEError (parameters, plans)", native=True, ci=60)
def _offload_client_engine():
    def check(w):
        from cipherlm.he import HEError
        from cipherlm.runtime.linear_groups import LinearGroup
        from cipherlm.runtime.offload_engine import ClientEngine
        from cipherlm.runtime.offload_protocol import ProtocolError
        from cipherlm.runtime.plan_check import check_offload_welcome

        try:
            w = check_offload_welcome(over_the_wire(w), 1)
            groups = [LinearGroup(i, tuple(g["names"]), g["d_in"], tuple(g["d_outs"]))
                      for i, g in enumerate(w["groups"])]
            ClientEngine(w, groups)
        except (ProtocolError, HEError):
            pass

    def strategy():
        w = _offload_welcome_seed()
        return st.one_of(
            mutated_tree([w]),
            st.builds(lambda he: dict(w, he_params=he), mutated_bytes(_params_seeds(), max_ops=2)))
    return st.deferred(strategy), check


@functools.lru_cache(maxsize=1)
def _tokenizer_seeds() -> list:
    from test_client_validation import _offload_bundle

    _, tok = _offload_bundle()
    bpe = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2},
                                                   "merges": ["a b"]},
                      "pre_tokenizer": {"type": "Whitespace"}, "normalizer": {"type": "Lowercase"},
                      "decoder": {"type": "BPEDecoder"}})
    return [tok, bpe]


@target("tokenizer_json", "cipherlm.runtime.plan_check.load_tokenizer (the 2pc welcome's tokenizer; "
        "tokenizers.Tokenizer.from_str, Rust)", _protocol_errors, "ProtocolError", native=True, ci=150)
def _tokenizer():
    def check(text):
        from cipherlm.runtime.offload_protocol import ProtocolError
        from cipherlm.runtime.plan_check import load_tokenizer

        try:
            load_tokenizer(text)
        except ProtocolError:
            pass

    def strategy():
        seeds = [s.encode() for s in _tokenizer_seeds()]
        return st.one_of(mutated_bytes(seeds, max_ops=3).map(lambda b: b.decode("utf-8", "replace")),
                         mutated_tree([json.loads(s) for s in _tokenizer_seeds()]).map(
                             lambda t: json.dumps(t, default=lambda o: repr(o))))
    return st.deferred(strategy), check


def _lattigo_needs():
    from cipherlm.he import lattigo_backend

    return None if lattigo_backend.available() else "the Lattigo library is not built (make install)"


@functools.lru_cache(maxsize=1)
def _lattigo_state() -> dict:
    from cipherlm.he import OFFLOAD_CKKS, get_backend
    from cipherlm.he import lattigo_backend  # noqa: F401

    be = get_backend("lattigo")
    ctx = be.context(OFFLOAD_CKKS)
    keys = be.keygen(ctx)
    pt = be.encode_slots(ctx, np.full(16, 0.5), level=ctx.max_level)
    seeds = {"ciphertext": [keys.encrypt_seeded(pt), be.ciphertext_to_bytes(keys.encrypt(pt)),
                            be.ciphertext_to_bytes(keys.encrypt(pt), packed=True)],
             "public_key": [keys.public_key_bytes()],
             "galois_keys": [keys.galois_keys_bytes([1])],
             "ring_switch_key": [keys.ring_switch_key()[1], keys.ring_switch_key("even")[1]],
             "input_switch_key": [keys.input_switch_key()[1]],
             "params": [be.params_to_bytes(OFFLOAD_CKKS)]}
    return {"be": be, "ctx": ctx, "seeds": seeds}


def _lattigo_target(kind: str, ci: int):
    def strategy():
        return st.deferred(lambda: mutated_bytes(_lattigo_state()["seeds"][kind], max_ops=3))

    def check(blob):
        from cipherlm.he import HEError

        s = _lattigo_state()
        be, ctx = s["be"], s["ctx"]
        try:
            if kind == "ciphertext":
                be.ciphertext_from_bytes(ctx, blob)
            elif kind == "public_key":
                be.load_public_key(ctx, blob)
            elif kind == "galois_keys":
                be.galois_keys_from_bytes(ctx, blob, required_steps=[1])
            elif kind == "ring_switch_key":
                be.ring_switch_key_from_bytes(ctx, blob)
                be.ring_switch_key_from_bytes(ctx, blob, "even")
            elif kind == "input_switch_key":
                be.input_switch_key_from_bytes(ctx, blob)
            else:
                be.params_from_bytes(blob)
        except HEError:
            pass
    TARGETS[f"lattigo_{kind}"] = Target(
        f"lattigo_{kind}", f"cipherlm.he.lattigo_backend.LattigoBackend."
        f"{ {'public_key': 'load_public_key', 'params': 'params_from_bytes'}.get(kind, kind + '_from_bytes') }",
        lambda: (_he_error(),), "HEError", strategy, check, native=True, ci_examples=ci, needs=_lattigo_needs)


for _kind, _ci in (("ciphertext", 120), ("public_key", 80), ("galois_keys", 40), ("ring_switch_key", 40),
                  ("input_switch_key", 40), ("params", 150)):
    _lattigo_target(_kind, _ci)


# ---- the fhe mode (docs/fhe.md): the client's welcome check and its half of the client-aided refresh


def _fhe_welcome_seed() -> dict:
    """A welcome as `fhe_server.FheHost.welcome` + `Session.welcome` send it (test preset)."""
    return {"type": "welcome", "protocol": 1, "model": "tiny", "kind": "decoder",
            "config": {"model_type": "llama", "hidden_size": 64}, "preset": "test-insecure-N1024",
            "insecure": True, "slots": 512, "d": 64, "max_tokens": 8, "rotation_steps": [1, 2, 4, 8, 64, 128],
            "labels": None, "tasks": ["logits"],
            "key_sizes": {"relin": 1_000_000, "galois_max": 3_000_000, "bootstrap": 51_000_000},
            "key_chunk": 64 << 20, "refresh": ["bootstrap", "client"], "bundle_digest": "ab" * 32,
            "limits": {"max_cts_per_request": 64, "max_work_per_session": 1000, "session_lifetime": None}}


@target("fhe_welcome", "cipherlm.runtime.fhe_client.check_fhe_welcome", _protocol_errors, "ProtocolError", ci=300)
def _fhe_welcome():
    def check(w):
        from cipherlm.runtime.fhe_client import check_fhe_welcome

        try:
            check_fhe_welcome(over_the_wire(w))
        except _protocol_errors():
            pass
    return st.deferred(lambda: mutated_tree([_fhe_welcome_seed()])), check


@functools.lru_cache(maxsize=1)
def _fhe_refresh_state() -> dict:
    from cipherlm.he import get_backend
    from cipherlm.protocols.ckks import refresh

    be = get_backend("lattigo")
    ctx = be.bootstrappable_context("test-insecure-N1024", allow_insecure_for_tests=True)
    sk = be.keygen(ctx)
    ct = sk.encrypt(be.encode_slots(ctx, np.full(ctx.slots, 0.5)))
    be.mod_switch_to_inplace(ctx, ct, 3)
    masked, _m = refresh.mask(be, ctx, ct, 1.0)
    return {"be": be, "ctx": ctx, "sk": sk, "seeds": [be.ciphertext_to_bytes(masked)]}


@target("fhe_client_refresh", "cipherlm.protocols.ckks.refresh.reencrypt_blobs (the fhe client's answer to a "
        "server's masked ciphertexts)", lambda: (_he_error(),), "HEError", native=True, ci=60, needs=_lattigo_needs)
def _fhe_client_refresh():
    def check(blob):
        from cipherlm.he import HEError
        from cipherlm.protocols.ckks import refresh

        s = _fhe_refresh_state()
        try:
            refresh.reencrypt_blobs(s["be"], s["ctx"], s["sk"], [blob])
        except HEError:
            pass
    return st.deferred(lambda: mutated_bytes(_fhe_refresh_state()["seeds"], max_ops=3)), check


def _fhe_server_errors():
    from cipherlm.runtime.fhe_server import FheServer

    return FheServer.expected_errors


class _StubFheModel:
    """Stands in for `FheModel` past the request checks (the evaluation is not what is fuzzed)."""

    input_value = "embed_sum"

    def classify(self, ev, x, on_layer=None):
        from cipherlm.he import HEError

        raise HEError("stub model: the request passed every check")

    logits = run = classify

    def bound(self, value):
        return 1.0

    def new_cache(self, ev):
        return type("Cache", (), {"length": 0})()


@functools.lru_cache(maxsize=1)
def _fhe_server_state() -> dict:
    """A stub `FheHost` with the real Lattigo context of the test preset, and a genuine session
    script (hello, keys for the client refresh in parts, an infer)."""
    from cipherlm.he import get_backend
    from cipherlm.protocols.ckks.packing import TokenPacking
    from cipherlm.runtime.fhe_protocol import REFRESH_PATHS

    be = get_backend("lattigo")
    ctx = be.bootstrappable_context("test-insecure-N1024", allow_insecure_for_tests=True)
    sk = be.keygen(ctx)
    relin, galois = sk.relin_key_bytes(), sk.galois_keys_bytes([1, 2])

    class Host:
        name, kind, d, max_tokens, tasks = "tiny", "encoder", 8, 4, ("classify",)
        rotation_steps = [1, 2]
        key_sizes = {"relin": len(relin), "galois_max": len(galois) + 1000, "bootstrap": 51_000_000}
        refresh_paths = REFRESH_PATHS  # one worker: both refresh paths
        workers, executor = 1, None
        bundle = {"type": "bundle", "tensors": {"e": np.zeros((2, 2), np.float32)}, "tokenizer": None}
        model = _StubFheModel()

        def __init__(self):
            self.be, self.ctx, self.slots = be, ctx, ctx.slots

        def packing(self, tokens, offset=0):
            return TokenPacking(ctx.slots, tokens, tp_min=8, offset=offset)

        def welcome(self):
            return {"type": "welcome", "protocol": 1, "model": self.name}

    host = Host()
    P = host.packing(3)
    x = np.zeros((3, host.d))
    cts = [sk.encrypt_seeded(be.encode_slots(ctx, r)) for r in P.pack(x)]
    hello = {"type": "hello", "protocol": 1, "mode": "fhe", "model": None}
    keys = [{"type": "keys", "refresh": "client", "sizes": {"relin": len(relin), "galois": len(galois)}, "parts": 2},
            {"type": "keys_part", "index": 0, "total": 2, "blob": "relin", "data": relin},
            {"type": "keys_part", "index": 1, "total": 2, "blob": "galois", "data": galois}]
    infer = {"type": "infer", "task": "classify", "tokens": 3, "offset": 0, "cts": cts}
    return {"host": host, "scripts": [[hello] + keys + [infer, {"type": "stats"}, {"type": "bye"}],
                                      [hello, {"type": "get_bundle"}, infer] + keys]}


@target("fhe_server_requests", "cipherlm.runtime.fhe_server.Session (hello, keys and keys_part, infer, stats; "
        "the Lattigo key and ciphertext loaders on what arrives)", _fhe_server_errors,
        "ProtocolError (LimitExceeded), HEError, ChannelClosed", native=True, ci=60, needs=_lattigo_needs)
def _fhe_server_requests():
    def strategy():
        scripts = _fhe_server_state()["scripts"]
        flat = [m for sc in scripts for m in sc]
        return st.one_of(st.tuples(st.sampled_from(scripts), st.integers(0, 7), mutated_tree(flat, max_ops=2)),
                         st.tuples(st.sampled_from(scripts), st.integers(0, 7), wire_values))

    def check(x):
        from cipherlm.runtime.fhe_server import Session
        from cipherlm.runtime.session_server import ServerLimits

        msgs, at, bad = x
        msgs = list(msgs)
        msgs.insert(min(at, len(msgs)), over_the_wire(bad) if isinstance(bad, dict) else bad)
        s = Session(_fhe_server_state()["host"], _ScriptChannel(msgs), None)
        s.limits = ServerLimits(max_cts_per_request=4, max_work_per_session=8)
        try:
            s.run()
        except _fhe_server_errors():
            pass
        finally:
            s.close()
    return st.deferred(strategy), check


# =========================================================================== the runner


def _alarm(signum, frame):
    raise Hang(f"no answer within {HANG_SECONDS} s")


def _guarded(t: Target, x, counter: list, record: Path | None):
    counter[0] += 1
    if record is not None:  # a crash leaves the input that caused it
        record.write_bytes(x if isinstance(x, bytes) else repr(x).encode())
    allowed = t.errors()
    main = threading.current_thread() is threading.main_thread()
    if main:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, HANG_SECONDS)
    try:
        t.check(x)
    except Hang:
        raise Finding(f"{t.name}: hang (> {HANG_SECONDS} s) on {_short(x)}") from None
    except allowed:  # (checks swallow these themselves; kept for safety)
        pass
    except Finding:
        raise
    except AssertionError as e:
        raise Finding(f"{t.name}: wrong result {e!r} on {_short(x)}") from e
    except BaseException as e:  # noqa: BLE001 - this is what the fuzzer looks for
        raise Finding(f"{t.name}: {type(e).__name__}: {str(e)[:200]} on {_short(x)}") from e
    finally:
        if main:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def _short(x) -> str:
    return repr(x)[:400]


def run(name: str, examples: int, *, derandomize: bool = True, seed_value: int | None = None,
        record: Path | None = None, shrink: bool = True) -> dict:
    """Run one target for ``examples`` inputs; raises the (shrunk) Finding if one is found.
    Returns {examples}: how many inputs were decoded."""
    t = TARGETS[name]
    why = t.needs()
    if why:
        raise RuntimeError(f"{name} cannot run here: {why}")
    counter = [0]
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    cfg = settings(max_examples=examples, derandomize=derandomize, database=None, deadline=None,
                   phases=phases, suppress_health_check=list(HealthCheck))

    strategy = t.strategy() if callable(t.strategy) else t.strategy

    @cfg
    @given(strategy)
    def fuzz(x):
        _guarded(t, x, counter, record)

    if seed_value is not None and not derandomize:
        fuzz = hseed(seed_value)(fuzz)
    try:
        fuzz()
    except BaseExceptionGroup as eg:  # several distinct failures
        raise Finding(" | ".join(f"{type(e).__name__}: {str(e)[:600]}" for e in eg.exceptions)) from eg
    return {"examples": counter[0]}


def run_budget(name: str, seconds: float, *, batch: int = 500, record: Path | None = None) -> dict:
    """Random (not derandomized) batches of one target until ``seconds`` have passed;
    findings are collected, not raised."""
    t0 = time.monotonic()
    total, findings, i = 0, [], 0
    while time.monotonic() - t0 < seconds:
        try:
            total += run(name, batch, derandomize=False, seed_value=i, record=record, shrink=False)["examples"]
        except Exception as e:  # noqa: BLE001 - a Finding, or one wrapped by hypothesis
            text = str(e)[:600] if isinstance(e, Finding) else f"{type(e).__name__}: {str(e)[:600]}"
            if not any(text[:120] == f[:120] for f in findings):  # the same finding again: counted once
                findings.append(text)
            total += batch  # (approximately: the batch ran up to its finding)
        i += 1
    return {"target": name, "examples": total, "seconds": time.monotonic() - t0, "findings": findings}


def run_in_child(name: str, examples: int | None = None, *, seconds: float | None = None, timeout: float = 300,
                 record: Path | None = None) -> dict:
    """`run` (or `run_budget`) in a child process: {returncode, result (the child's JSON or None),
    stderr tail, crash_input (the last input fed, when the child died)}."""
    import subprocess
    import tempfile

    native = TARGETS[name].native
    rec = record if (record is not None and native) else (
        Path(tempfile.mkstemp(prefix=f"fuzz-{name}-", suffix=".last")[1]) if native else None)
    cmd = [sys.executable, str(Path(__file__).resolve()), name] + (["--record", str(rec)] if rec else [])
    cmd += ["--examples", str(examples)] if seconds is None else ["--seconds", str(seconds)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        return {"returncode": None, "result": None, "stderr": str(e.stderr)[-2000:],
                "crash_input": rec.read_bytes()[:2000] if rec and rec.exists() else None}
    result = None
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            result = json.loads(line)
            break
    out = {"returncode": proc.returncode, "result": result, "stderr": proc.stderr[-3000:],
           "crash_input": rec.read_bytes()[:2000] if rec and proc.returncode not in (0, 1) and rec.exists() else None}
    if record is None and rec is not None:
        rec.unlink(missing_ok=True)
    return out


def run_in_child_many(names: list, *, examples: int | None = None, timeout: float = 300) -> dict:
    """Several targets (each its ``ci_examples``, or ``examples``) in one child process:
    {returncode, results: {name: {examples, findings}}, stderr, crash_input}.  A target
    missing from ``results`` did not finish (the child crashed or timed out in it or before)."""
    import subprocess
    import tempfile

    fd, rec = tempfile.mkstemp(prefix="fuzz-", suffix=".last")
    os.close(fd)
    rec = Path(rec)
    cmd = [sys.executable, str(Path(__file__).resolve()), *names, "--record", str(rec)]
    if examples is not None:
        cmd += ["--examples", str(examples)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    results = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["target"]] = r
    crash = rec.read_bytes()[:2000] if rc not in (0, 1) and rec.exists() else None
    rec.unlink(missing_ok=True)
    return {"returncode": rc, "results": results, "stderr": stderr[-3000:], "crash_input": crash}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", choices=sorted(TARGETS) + ["all"], nargs="+")
    ap.add_argument("--examples", type=int)
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--record", type=Path)
    a = ap.parse_args(argv)
    names = sorted(TARGETS) if "all" in a.target else a.target
    rc = 0
    for name in names:
        t0 = time.monotonic()
        if a.seconds is not None:
            res = run_budget(name, a.seconds, record=a.record)
            print(json.dumps(res), flush=True)
            continue
        try:
            res = run(name, a.examples or TARGETS[name].ci_examples, record=a.record)
            print(json.dumps({"target": name, "examples": res["examples"], "findings": [],
                              "seconds": round(time.monotonic() - t0, 2)}), flush=True)
        except Finding as e:
            print(json.dumps({"target": name, "examples": None, "findings": [str(e)[:2000]]}), flush=True)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
