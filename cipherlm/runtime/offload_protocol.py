"""Messages of the client-aided HE offload protocol.

The system of ``fhe_offload_llama_003`` (sections 4-6): the client keeps the
secret key, the norms, RoPE, attention scores/softmax, activations and the KV
cache; the server evaluates every linear projection (and the LM head) on CKKS
ciphertexts of the activations.  One session on one channel:

=========  ===========================================  ======================================
step       client -> server                             server -> client
=========  ===========================================  ======================================
hello      ``{type: hello, protocol, mode, model}``     ``{type: welcome, model, config, groups,
                                                         he_params, plans, rotation_steps,
                                                         bundle_digest}``
bundle     ``{type: get_bundle}`` (only if not cached)  ``{type: bundle, tensors, tokenizer}``
keys       ``{type: keys, galois_keys}``                ``{type: ready}``
linear     ``{type: linear, group, cts: [bytes]}``      ``{type: result, cts: [bytes]}``
stats      ``{type: stats}``                            ``{type: stats, seconds, he_ops}``
bye        ``{type: bye}``                              (connection closed)
=========  ===========================================  ======================================

Any request the server cannot serve is answered ``{type: error, message}``
and ends that session only; the server goes on serving others.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1
MAX_TOKENS_PER_REQUEST = 4096


class ProtocolError(RuntimeError):
    """The peer sent something this protocol does not allow."""


class RemoteError(RuntimeError):
    """The server reported an error for this session."""


def expect(msg: dict, kind: str) -> dict:
    """Check that ``msg`` is a message of type ``kind`` (or raise the server's error)."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"expected a message, got {type(msg).__name__}")
    got = msg.get("type")
    if got == "error" and kind != "error":
        raise RemoteError(str(msg.get("message", "unknown server error")))
    if got != kind:
        raise ProtocolError(f"expected a {kind!r} message, got {got!r}")
    return msg
