"""Messages of the fhe mode's protocol: whole blocks on ciphertexts, no interaction.

The server evaluates every node of the model graph after the embedding on CKKS
ciphertexts (`cipherlm.runtime.fhe_executor.FheModel`), bootstrapping where the levels
run out; the client embeds its tokens in the clear, encrypts the (T, d) sum, uploads it
and, after the server's single answer, decrypts the result.  Between the upload and the
result the server sends nothing and the client sends nothing (the default refresh path,
"bootstrap").  A session that chose the client-aided refresh ("client", with its keys)
instead gets ``refresh`` messages in between, one per refresh, each answered by the client
(`protocols.ckks.refresh`).  One session on one channel:

==========  ==============================================  ======================================
step        client -> server                                server -> client
==========  ==============================================  ======================================
hello       ``{type: hello, protocol, mode: "fhe", model}``  ``{type: welcome, protocol, model, kind,
                                                             config, preset, insecure, slots, d,
                                                             max_tokens, rotation_steps, labels,
                                                             key_sizes, key_chunk, bundle_digest,
                                                             limits}``
bundle      ``{type: get_bundle}`` (only if not cached;      ``{type: bundle, tensors, tokenizer}``
            at most once per session)
keys        ``{type: keys, refresh, sizes: {relin,           (nothing until the last part)
            galois[, bootstrap]}, parts: K}``, then K x
            ``{type: keys_part, index, total, blob, data}``  ``{type: ready}``
infer       ``{type: infer, task, tokens, offset, cts}``     (nothing until the result)
(refresh    ``{type: refreshed, cts: [bytes]}``              ``{type: refresh, cts: [bytes]}``
client)                                                      (zero or more, each answered)
                                                             ``{type: result, task, d, cts: [bytes],
                                                             stats}``
stats       ``{type: stats}``                                ``{type: stats, seconds, counts, work,
                                                             infers}``
bye         ``{type: bye}``                                  (connection closed)
==========  ==============================================  ======================================

The welcome: ``kind`` "encoder" or "decoder"; ``preset`` the Lattigo bootstrapping
parameter set (`LattigoContext.from_preset`); ``insecure`` True only for the INSECURE
test preset (a client refuses such a server unless told otherwise, and decides from the
preset's name, not from this flag); ``slots`` per ciphertext; ``d`` the width of the
encrypted input (the embedding sum); ``max_tokens`` the most tokens one ``infer`` takes;
``rotation_steps`` exactly the slot rotations a pass of up to ``max_tokens`` tokens needs
(the client makes Galois keys for these and no others); ``labels`` the classifier's
labels (encoders with a classifier head) or None; ``key_sizes`` ``{relin, galois_max,
bootstrap}`` in bytes (relin and bootstrap exact for the preset, galois an upper bound);
``refresh`` the refresh paths it serves (["bootstrap", "client"]);
``key_chunk`` the largest ``keys_part`` data the server takes; ``bundle_digest`` the
sha256 of the client bundle (`cipherlm.runtime.bundle`: the embedding tables the client
needs, `fhe_executor.client_tensors`, and the tokenizer).

Keys: the bootstrapping keys are ~7.9 GB at the production preset, over the 1 GiB frame
limit, so the three key blobs (relinearisation key "CLGR", seeded Galois keys for the
welcome's steps, bootstrapping keys "CLGB") go in ``keys_part`` messages, in that order
(``blob``: "relin", "galois", "bootstrap"; ``index`` 0..K-1, ``total`` K; each ``data``
non-empty and at most ``key_chunk`` bytes, inside its blob).  The announced sizes are
checked against the preset's before any part is taken; the parts are reassembled, then
parsed and validated (`LattigoBackend.*_from_bytes`); the keys are held for the session
and dropped when it ends.  A second ``keys`` message is an error.  ``refresh`` (default
"bootstrap") fixes the session's refresh path: "client" sends no bootstrapping keys (the
``bootstrap`` size and blob are left out: `key_blobs`).

Client-aided refresh: where a value runs out of levels the server sends ``{type: refresh,
cts}``, the value's ciphertexts masked (`protocols.ckks.refresh`: the client learns
nothing, statistically); the client answers ``{type: refreshed, cts}``, as many fresh
ciphertexts at the top level, within the session's timeout.  The result's ``stats`` say
which path ran (``refresh``) and how many rounds it took (``client_refreshes``).

``infer``: ``task`` "classify" (encoders with a classifier head: the classifier's logits
of the pooled, normalised last hidden states, at position 0 of each output channel) or
"logits" (decoders: the LM head's logits of the last position, offset + T - 1);
``tokens`` T in 1..max_tokens; ``offset`` (default 0; "logits" only) the position of the
first token: 0 starts a new encrypted KV cache for this session (`FheKVCache`: keys and
values of every layer stay on the server), > 0 is a decoding step and must equal the
positions the cache holds (offset + T <= max_tokens); ``cts`` exactly ``ceil(d / cpc)``
ciphertexts of the token-group packing of T tokens at positions offset.. for a session of
``max_tokens`` (`FheModel.packing(slots, T, max_tokens, offset)`, `protocols.ckks.packing`).  The result's
``stats``: ``{counts, seconds, refreshes, levels, layers}`` (operation counts and seconds
per kind from the evaluator, the output levels, the refresh path and its rounds).

The hello is strict as in every mode (`session_server.MessageSession.check_hello`).  Any
request the server cannot serve is answered ``{type: error, message}`` and ends that
session only; the server goes on serving others.
"""

from __future__ import annotations

from cipherlm.runtime.offload_protocol import ProtocolError, RemoteError, expect

PROTOCOL_VERSION = 1
MODE = "fhe"
TASKS = ("classify", "logits")
#: the order of the key blobs in the ``keys_part`` stream
KEY_BLOBS = ("relin", "galois", "bootstrap")
#: how a session refreshes ciphertexts that run out of levels: the server bootstraps, or the
#: client re-encrypts masked ciphertexts (`protocols.ckks.refresh`)
REFRESH_PATHS = ("bootstrap", "client")
#: the most ciphertexts one ``refresh`` message carries (a value of the widest activation)
MAX_REFRESH_CTS = 4096
#: the largest ``keys_part`` data a server takes (and the size a client cuts)
KEY_CHUNK = 64 << 20
#: the smallest part a client may send, except for the last part of a blob (caps the
#: number of parts of an upload)
MIN_KEY_CHUNK = 1 << 20
#: the production preset (128-bit) and the INSECURE one for tests
DEFAULT_PRESET = "N16QP1546H192H32"
TEST_PRESET = "test-insecure-N1024"
#: tokens one pass takes by default (the Galois keys are made for this many)
DEFAULT_MAX_TOKENS = 32

__all__ = ["PROTOCOL_VERSION", "MODE", "TASKS", "KEY_BLOBS", "KEY_CHUNK", "MIN_KEY_CHUNK", "DEFAULT_PRESET",
           "TEST_PRESET", "DEFAULT_MAX_TOKENS", "REFRESH_PATHS", "MAX_REFRESH_CTS", "ProtocolError", "RemoteError",
           "expect", "key_blobs", "max_key_parts"]


def key_blobs(refresh: str) -> tuple[str, ...]:
    """The key blobs a session of this refresh path uploads, in stream order."""
    if refresh not in REFRESH_PATHS:
        raise ProtocolError(f"unknown refresh path {refresh!r} (one of {list(REFRESH_PATHS)})")
    return KEY_BLOBS if refresh == "bootstrap" else KEY_BLOBS[:2]


def max_key_parts(sizes: dict) -> int:
    """The most ``keys_part`` messages an upload of blobs of these sizes may take."""
    return sum(-(-int(sizes[b]) // MIN_KEY_CHUNK) for b in KEY_BLOBS if b in sizes)
