"""The fuzzers' findings (tests/test_fuzz_decoders.py), each with the exact input that found
it: every one used to raise an error its decoder does not document (a ValueError from
comparing a NumPy array, SEAL's RuntimeError / TypeError, the tokenizer parser's bare
Exception) and now raises the documented one.  docs/reliability.md, "Fuzzing and fault
injection", lists them."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from cipherlm.he import OFFLOAD_CKKS, HEError
from cipherlm.he.serialize import params_from_bytes, params_to_bytes
from cipherlm.mpc.ot_common import OTError
from cipherlm.mpc.ot_common import expect as ot_expect
from cipherlm.runtime.offload_protocol import PROTOCOL_VERSION, ProtocolError, expect
from cipherlm.runtime.plan_check import check_offload_welcome, load_tokenizer


# --------------------------------------------------------------------------- offload_protocol.expect


@pytest.mark.parametrize("t", [np.array([119, 101, 108, 99, 111, 109, 101], np.uint8),  # found: "welcome" as bytes
                               np.array([1, 2]), np.array([], np.int8), [], {"a": 1}, 1, b"welcome"])
def test_expect_with_a_type_that_is_not_a_str(t):
    with pytest.raises(ProtocolError, match="expected a 'welcome' message"):
        expect({"type": t}, "welcome")


def test_expect_still_reads_errors_and_missing_types():
    from cipherlm.runtime.offload_protocol import RemoteError

    with pytest.raises(RemoteError, match="boom"):
        expect({"type": "error", "message": "boom"}, "welcome")
    with pytest.raises(ProtocolError, match="missing"):
        expect({}, "welcome")
    assert expect({"type": "go"}, "go") == {"type": "go"}


# --------------------------------------------------------------------------- plan_check


def test_offload_welcome_he_backend_array_is_a_protocol_error():
    from test_client_validation import _offload_bundle, _offload_welcome

    w = _offload_welcome(*_offload_bundle())
    assert check_offload_welcome(dict(w, he_backend="seal"), PROTOCOL_VERSION)
    for hb in (np.array([1, 2]), np.frombuffer(b"seal", np.uint8), ["seal"], 1):
        with pytest.raises(ProtocolError, match="HE backend"):
            check_offload_welcome(dict(w, he_backend=hb), PROTOCOL_VERSION)


@pytest.mark.parametrize("text", ["", "{}", "[]", "null", '{"model": 1}',
                                  '{"version":"1.0","model":{"type":"BPE","vocab":{"a":0},"merges":["a zz"]}}'])
def test_load_tokenizer_refuses_with_protocol_error(text):
    with pytest.raises(ProtocolError, match="tokenizer does not load"):
        load_tokenizer(text)


def test_load_tokenizer_types_and_a_good_one():
    for bad in (b"{}", 5, None, ["x"]):
        with pytest.raises(ProtocolError, match="JSON string"):
            load_tokenizer(bad)
    tok = json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, "[UNK]": 1},
                                                   "unk_token": "[UNK]"}})
    assert load_tokenizer(tok).encode("a").ids == [0]


def test_2pc_client_refuses_a_malformed_tokenizer_with_protocol_error():
    """The 2pc client called ``Tokenizer.from_str`` unguarded: a welcome whose tokenizer does
    not parse raised the parser's bare ``Exception`` (and left the channel open)."""
    from test_client_validation import FakeServer
    from test_twopc import llama_model

    from cipherlm.models import LoadedModel
    from cipherlm.runtime.twopc_session import TwoPCClient, TwoPCHost

    config, w = llama_model(seed=4)
    welcome = TwoPCHost("tiny-decoder", lm=LoadedModel("tiny-decoder", config, w)).welcome()
    with FakeServer({"hello": dict(welcome, tokenizer='{"model": 1}')}) as server:
        with pytest.raises(ProtocolError, match="tokenizer does not load"):
            TwoPCClient(*server.address, timeout=30)
    with FakeServer({"hello": welcome}) as server:  # control: the genuine welcome (no tokenizer) is fine
        with TwoPCClient(*server.address, timeout=30) as client:
            assert client.tokenizer is None


# --------------------------------------------------------------------------- he.serialize.params_from_bytes


def _params_with(**fields) -> bytes:
    blob = params_to_bytes(OFFLOAD_CKKS)
    (n,) = struct.unpack_from("<I", blob, 6)
    js = json.loads(blob[10:10 + n])
    js.update(fields)
    j = json.dumps(js).encode()
    return blob[:6] + struct.pack("<I", len(j)) + j + blob[10 + n:]


@pytest.mark.parametrize("fields, was", [
    ({"scheme": "bfv", "plain_modulus": 1}, "ValueError: value can be at most 61-bit and cannot be 1"),
    ({"scheme": "bfv", "plain_modulus": 2 ** 61}, "ValueError"),
    ({"scheme": "bfv", "plain_modulus": "7"}, "TypeError: incompatible constructor arguments"),
    ({"coeff_modulus_bits": [2]}, "RuntimeError: failed to find enough qualifying primes"),
])
def test_params_seal_cannot_build_are_heerror(fields, was):
    with pytest.raises(HEError, match="SEAL cannot build the parameter set"):
        params_from_bytes(_params_with(**fields))


def test_params_genuine_still_load():
    assert params_from_bytes(params_to_bytes(OFFLOAD_CKKS)) == OFFLOAD_CKKS


# --------------------------------------------------------------------------- mpc.ot_common.expect


class _Chan:
    def __init__(self, msg):
        self.msg = msg

    def recv(self):
        return self.msg


@pytest.mark.parametrize("msg", [
    {"op": np.array([114, 111, 116], np.uint8), "n": 5, "bits": 64, "u": np.zeros(40, np.uint8)},  # found
    {"op": "rot", "n": np.array([5, 5]), "bits": 64, "u": np.zeros(40, np.uint8)},
    {"op": "rot", "n": [5], "bits": 64, "u": np.zeros(40, np.uint8)},
    {"op": ["rot"], "n": 5, "bits": 64, "u": np.zeros(40, np.uint8)},
])
def test_ot_message_with_arrays_for_scalars_is_an_oterror(msg):
    with pytest.raises(OTError):
        ot_expect(_Chan(msg), "rot", {"u": 40}, n=5, bits=64)


def test_ot_message_genuine_still_accepted():
    msg = {"op": "rot", "n": 5, "bits": 64, "u": np.zeros(40, np.uint8)}
    assert ot_expect(_Chan(msg), "rot", {"u": 40}, n=5, bits=64) is msg


# --------------------------------------------------------------------------- server request loop


@pytest.mark.parametrize("script", [[{"type": []}], [{"type": np.array([1, 2])}], "hello-error"],
                         ids=["type-list", "type-array", "hello-of-type-error"])
def test_server_malformed_request_is_an_expected_error(script):
    """Found by the fuzzer: these ended as "internal error: TypeError / ValueError / RemoteError"
    (a request type that is not a str, a hello that is an error report) instead of a
    ProtocolError; now MessageSession checks both."""
    from fuzz_targets import HELLO, _ScriptChannel, _StubOffloadHost

    from cipherlm.runtime.offload_server import OffloadServer, Session
    from cipherlm.runtime.session_server import ServerLimits

    msgs = [{"type": "error", "message": "x"}] if script == "hello-error" else [HELLO, *script]
    s = Session(_StubOffloadHost(), _ScriptChannel(msgs))
    s.limits = ServerLimits()
    with pytest.raises(OffloadServer.expected_errors):
        s.run()


# --------------------------------------------------------------------------- 2pc client: share messages


@pytest.mark.parametrize("msg, op, was", [
    ({"s": None}, "reveal", "AttributeError: 'NoneType' object has no attribute 'shape'"),
    ({"r": -(2 ** 63)}, "share_input", "OverflowError: Python integer out of bounds for uint64"),
])
def test_2pc_client_malformed_share_message_is_a_remote_error(msg, op, was):
    """A server sending a share message of the wrong kind made the 2pc client raise a bare
    AttributeError / OverflowError (TwoPCClient._run turned only KeyError, TypeError,
    ValueError and MPCError into RemoteError)."""
    from fuzz_targets import TARGETS

    from cipherlm.runtime.offload_protocol import RemoteError

    check = TARGETS["share_messages"].check
    which = {"reveal": 0, "share_input": 2}[op]
    check((msg, which))  # the target's own check: RemoteError / MPCError only
    from cipherlm.mpc.ring import RingConfig
    from cipherlm.mpc.shares import AShare, reveal, share_input
    from cipherlm.runtime.twopc_session import TwoPCClient

    class Ctx:
        party, ring, rng = 0, RingConfig(), np.random.default_rng(0)

        def recv(self):
            return msg

        def step(self, label):
            import contextlib

            return contextlib.nullcontext()

    fn = (lambda: reveal(AShare(Ctx(), np.zeros(4, np.uint64), 64), to=0)) if op == "reveal" else \
        (lambda: share_input(Ctx(), None, owner=1))
    with pytest.raises(RemoteError, match="broke off the computation"):
        TwoPCClient._run(None, fn)


@pytest.mark.parametrize("t", [np.frombuffer(b"get_bundle", np.uint8), np.zeros((2, 0), np.int64)],
                         ids=["type-uint8-array", "type-empty-array"])
def test_server_hello_with_an_array_type_is_an_expected_error(t):
    """The long run's input: a first message ``{"type": array([103, 101, 116, ...])}``
    ("get_bundle" as bytes) or an empty array: was ValueError ("internal error"), now a
    ProtocolError (check_hello tests the type is a str first)."""
    from fuzz_targets import _ScriptChannel, _StubOffloadHost

    from cipherlm.runtime.offload_server import OffloadServer, Session
    from cipherlm.runtime.session_server import ServerLimits

    s = Session(_StubOffloadHost(), _ScriptChannel([{"type": t}]))
    s.limits = ServerLimits()
    with pytest.raises(OffloadServer.expected_errors):
        s.run()


# --------------------------------------------------------------------------- 2pc welcome (found by the long run)


@pytest.mark.parametrize("key, value", [("protocol", np.array([1, 1])), ("mode", np.zeros((2, 0), np.int64)),
                                        ("mode", np.frombuffer(b"2pc", np.uint8)), ("protocol", np.array(1))])
def test_2pc_welcome_protocol_or_mode_array_is_a_protocol_error(key, value):
    """benchmarks/fuzz_long.py's inputs: ``protocol: array([1, 1])`` and ``mode: array([],
    shape=(2, 0))`` made TwoPCClient._check_welcome raise ValueError (truth value of an array)."""
    from fuzz_targets import _twopc_welcomes

    from cipherlm.runtime.twopc_session import TwoPCClient

    w = dict(_twopc_welcomes()[0])
    TwoPCClient._check_welcome(w)  # control: the genuine welcome passes
    with pytest.raises(ProtocolError):
        TwoPCClient._check_welcome(dict(w, **{key: value}))


# --------------------------------------------------------------------------- fhe_client.check_fhe_welcome


@pytest.mark.parametrize("field,value", [("protocol", np.array([1, 1])),  # found: the protocol as an array
                                         ("kind", np.array([1, 2])), ("kind", ["decoder"])])
def test_fhe_welcome_arrays_are_protocol_errors(field, value):
    from fuzz_targets import _fhe_welcome_seed

    from cipherlm.runtime.fhe_client import check_fhe_welcome

    assert check_fhe_welcome(_fhe_welcome_seed())["refresh"] == ["bootstrap", "client"]
    with pytest.raises(ProtocolError):
        check_fhe_welcome(dict(_fhe_welcome_seed(), **{field: value}))


# --------------------------------------------------------------------------- fhe_server.Session


@pytest.mark.parametrize("field", ["type", "blob"])  # found: keys_part's type / blob as arrays
def test_fhe_key_part_arrays_are_protocol_errors(field):
    pytest.importorskip("cipherlm.he.lattigo_backend")
    from cipherlm.he import lattigo_backend

    if not lattigo_backend.available():
        pytest.skip("the Lattigo library is not built")
    from fuzz_targets import _fhe_server_state, _ScriptChannel

    from cipherlm.runtime.fhe_server import Session

    script = list(_fhe_server_state()["scripts"][0])
    script[2] = dict(script[2], **{field: np.array([1, 2])})
    s = Session(_fhe_server_state()["host"], _ScriptChannel(script), None)
    with pytest.raises(ProtocolError, match="keys_part"):
        s.run()
    s.close()
