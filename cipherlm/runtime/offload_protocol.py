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
                                                         bundle_digest, limits}``
bundle     ``{type: get_bundle}`` (only if not cached;  ``{type: bundle, tensors, tokenizer}``
           at most once per session)
keys       ``{type: keys, galois_keys[,                ``{type: ready}``
           ring_switch_key][, input_switch_key]}``
linear     ``{type: linear, group, cts: [bytes]}``      ``{type: result, cts: [bytes]}``
stats      ``{type: stats}``                            ``{type: stats, seconds, he_ops, work}``
bye        ``{type: bye}``                              (connection closed)
=========  ===========================================  ======================================

A server on the Lattigo HE backend adds ``he_backend: "lattigo"`` to the welcome
(absent: SEAL, so a SEAL server's welcome is as it was) and sends Lattigo's own
parameter blob in ``he_params``; the ciphertexts and Galois keys are then that
backend's layouts.  The client checks the name
(`cipherlm.runtime.plan_check.check_offload_welcome`) and parses the blob with
that backend's parser only.

Half-ring results (issue 15, bytes down): a Lattigo server adds ``half_ring_results: true``
to the welcome (unless ``$CIPHERLM_OFFLOAD_HALF_RING=0``); a client that answers with a
``ring_switch_key`` (`LattigoSecretKeys.ring_switch_key`: a seeded key from its secret s to
a fresh secret s' of the conjugate-invariant ring of degree N/2, ~123 kB once) then gets
every result as a half-ring ciphertext under s' (the real parts of its slots), half the
bytes each.  Without the key every result is in the full ring, as before.

Real inputs in the half ring (issue 15, bytes up; the Lattigo default since 2026-11-30,
``$CIPHERLM_OFFLOAD_HALF_RING=results`` for the mode above): the welcome's plans carry
``real_input: true`` and ``half_ring_results: "even"``.  The client encrypts each input's real
values in the conjugate-invariant ring of degree N/2 under a fresh secret s'' and sends, once,
``input_switch_key`` (`LattigoSecretKeys.input_switch_key`, s'' -> s at both data primes,
~328 kB), which the server then requires; its ``ring_switch_key`` is to a secret of the
standard ring of degree N/2 (results even-folded, `cipherlm.he.matmul` "real inputs").

Packed prefill (issue 15 item 2): a server whose engine has packed plans adds
``packed: {tokens: T, plans, groups}`` to the welcome (``groups[i]``: the index of
group i's packed plan, -1 for none; each packed plan packs ``plan.tokens`` <= T rows per
ciphertext, `cipherlm.he.matmul`); a ``linear`` request of several rows may then carry
``packed: true`` and ceil(rows / plan.tokens) ciphertexts, each holding up to that many
rows (the result: one per ciphertext).  Such a ciphertext counts as ``plan.tokens`` rows
against the server's limits.  Without the field (or with ``$CIPHERLM_OFFLOAD_PREFILL_PACK=1``
on the server) every row is its own ciphertext, as before.

The hello is strict: ``protocol`` an int equal to `PROTOCOL_VERSION`,
``mode`` the str ``"offload"``, ``model`` None or a str.  The welcome's
``limits`` (``max_cts_per_request``, ``max_work_per_session``,
``session_lifetime``) are the server's work limits for this session
(`cipherlm.runtime.session_server.ServerLimits`); ``work`` in the stats is
``{cts: evaluated so far, budget}``.

Any request the server cannot serve is answered ``{type: error, message}``
and ends that session only; the server goes on serving others.  A connection
beyond the server's session limits gets ``{type: error, message: "server
busy: ..."}`` at once and is closed.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1
MAX_TOKENS_PER_REQUEST = 4096  # the protocol's ceiling; a server's own cap (ServerLimits.max_cts_per_request) is lower


class ProtocolError(RuntimeError):
    """The peer sent something this protocol does not allow."""


class RemoteError(RuntimeError):
    """The server reported an error for this session."""


def expect(msg: dict, kind: str) -> dict:
    """Check that ``msg`` is a message of type ``kind`` (or raise the server's error)."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"expected a message, got {type(msg).__name__}")
    got = msg.get("type")
    if not isinstance(got, str):  # (an array here would make the comparisons below raise ValueError)
        raise ProtocolError(f"expected a {kind!r} message, got a message whose type is "
                            f"{'missing' if got is None else 'a ' + type(got).__name__}")
    if got == "error" and kind != "error":
        raise RemoteError(str(msg.get("message", "unknown server error")))
    if got != kind:
        raise ProtocolError(f"expected a {kind!r} message, got {got!r}")
    return msg
