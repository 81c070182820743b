"""The offload mode's client bundle: its digest, and the client's cache of verified bundles.

The small parameters an offload client needs (embedding table, norm weights, position
embeddings, tokenizer; `cipherlm.runtime.plain.split_params`) come from the server once
per model (``fhe_offload_llama_003`` section 4: the client runs everything but the
projections) and are cached under ``<cache_dir>/bundles/<digest>/``
(`cipherlm.models.cache.cache_dir`, ``$CIPHERLM_CACHE``).

The digest names the bundle's content, so the client never trusts a digest it has not
computed: `store_bundle` hashes what the server sent and refuses (`ProtocolError`, nothing
written) a bundle that does not match the digest of the welcome, and `load_bundle`
hashes a cached bundle again before it is used (a cache entry that does not match its
name is ignored, and the client downloads the bundle again).  Without this a server could
write any tensors under another model's digest and poison that model's sessions with
other servers.

`bundle_digest` is sha256 over an unambiguous encoding (each field length-prefixed, so
no two bundles share an encoding), server and client alike::

    b"cipherlm-bundle-v1\\0"
    per tensor, by sorted name: u64 len(name) | name (UTF-8) | u64 len(dtype) | dtype
                                (little-endian numpy str, e.g. "<f4") | u64 ndim |
                                u64 per dim | u64 nbytes | the C-order bytes
    tokenizer: b"\\0" if None, else b"\\1" | u64 len | the UTF-8 JSON
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import struct
from pathlib import Path

import numpy as np

from cipherlm.runtime.offload_protocol import ProtocolError

log = logging.getLogger("cipherlm.bundle")

_DOMAIN = b"cipherlm-bundle-v1\0"
_U64 = struct.Struct("<Q")
#: what a bundle's tensors may be (the server sends float32; the others would also load)
_DTYPE_KINDS = "fiub"

__all__ = ["bundle_digest", "check_bundle", "store_bundle", "load_bundle", "bundle_dir"]


def _canonical(v) -> np.ndarray:
    a = np.asarray(v)
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))


def bundle_digest(tensors: dict, tokenizer_json: str | None) -> str:
    """sha256 (hex) of a client bundle: tensors (name -> array) and the tokenizer's JSON."""
    h = hashlib.sha256(_DOMAIN)

    def field(b) -> None:
        h.update(_U64.pack(memoryview(b).nbytes))
        h.update(b)

    for name in sorted(tensors):
        a = _canonical(tensors[name])
        field(name.encode("utf-8"))
        field(a.dtype.str.encode("ascii"))
        h.update(_U64.pack(a.ndim))
        for d in a.shape:
            h.update(_U64.pack(d))
        field(a.reshape(-1).view(np.uint8))
    if tokenizer_json is None:
        h.update(b"\0")
    else:
        h.update(b"\1")
        field(tokenizer_json.encode("utf-8"))
    return h.hexdigest()


def check_bundle(tensors, tokenizer_json) -> tuple[dict, str | None]:
    """Type-check a bundle as it came off the wire (ProtocolError if malformed)."""
    if not isinstance(tensors, dict) or not tensors:
        raise ProtocolError("the bundle's tensors must be a non-empty dict")
    for k, v in tensors.items():
        if not isinstance(k, str) or not k or not isinstance(v, np.ndarray) or v.dtype.kind not in _DTYPE_KINDS:
            raise ProtocolError("the bundle's tensors must map names to numeric arrays")
    if tokenizer_json is not None and not isinstance(tokenizer_json, str):
        raise ProtocolError("the bundle's tokenizer must be None or a JSON string")
    return tensors, tokenizer_json


def bundle_dir(digest: str) -> Path:
    """The cache directory of the bundle named `digest` (64 lowercase hex digits)."""
    from cipherlm.models.cache import cache_dir

    if not isinstance(digest, str) or len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        raise ProtocolError("server sent a malformed bundle digest")
    return cache_dir() / "bundles" / digest


def _write_atomic(path: Path, data: bytes | None = None, writer=None) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        if writer is not None:
            writer(str(tmp))
        else:
            tmp.write_bytes(data)
        tmp.replace(path)
    finally:
        if tmp.exists():
            tmp.unlink()


def store_bundle(digest: str, tensors: dict, tokenizer_json: str | None) -> None:
    """Cache a bundle under `digest` after checking that it *is* that bundle.

    A bundle whose sha256 differs from `digest` raises ProtocolError and nothing is
    written.  Each file is replaced atomically; a reader that meets a half-replaced
    entry sees a digest mismatch (`load_bundle` -> None), never a mixed bundle."""
    from safetensors.numpy import save_file

    tensors, tokenizer_json = check_bundle(tensors, tokenizer_json)
    d = bundle_dir(digest)
    got = bundle_digest(tensors, tokenizer_json)
    if got != digest:
        raise ProtocolError(f"the bundle's sha256 {got[:16]}... does not match the digest the server "
                            f"announced ({digest[:16]}...): refused, nothing cached")
    d.mkdir(parents=True, exist_ok=True)
    tok = d / "tokenizer.json"
    if tokenizer_json is not None:
        _write_atomic(tok, tokenizer_json.encode("utf-8"))
    elif tok.exists():
        tok.unlink()
    arrays = {k: _canonical(v) for k, v in tensors.items()}
    _write_atomic(d / "tensors.safetensors", writer=lambda p: save_file(arrays, p))


def load_bundle(digest: str) -> tuple[dict, str | None] | None:
    """The cached bundle named `digest` as (tensors, tokenizer JSON or None), after
    hashing it again; None when it is not cached or does not match its digest (a
    tampered or damaged entry is never used)."""
    from safetensors.numpy import load_file

    d = bundle_dir(digest)
    path = d / "tensors.safetensors"
    if not path.exists():
        return None
    try:
        tensors = load_file(str(path))
        tok_path = d / "tokenizer.json"
        tok = tok_path.read_bytes().decode("utf-8") if tok_path.exists() else None
        ok = bundle_digest(tensors, tok) == digest
    except Exception as exc:  # an unreadable entry is a miss, like a mismatching one
        log.warning("cached bundle %s... unreadable (%s): ignored", digest[:16], type(exc).__name__)
        return None
    if not ok:
        log.warning("cached bundle %s... does not match its digest: ignored", digest[:16])
        return None
    return tensors, tok
