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

The model's chat template travels beside the bundle, in the welcome of both modes
(``chat_template``: ``{template, bos_token, eos_token}`` or None): `chat_template_meta`
reads it from the model's tokenizer metadata on the server, `check_chat_template` is the
clients' type and size check of what arrived (the proxy then compiles it in the Jinja
sandbox, `cipherlm.runtime.proxy.ChatTemplate`).  It is not part of the digest: the
bundle cache is not touched by it.
"""

from __future__ import annotations

import hashlib
import json
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

#: the longest chat template a server ships and a client accepts (characters); real ones are
#: a few KB (tool-calling templates ~20 KB)
MAX_CHAT_TEMPLATE_CHARS = 1 << 17
#: the longest bos / eos token text in the chat-template metadata
MAX_SPECIAL_TOKEN_CHARS = 256

__all__ = ["bundle_digest", "check_bundle", "store_bundle", "load_bundle", "bundle_dir", "chat_template_meta",
           "check_chat_template", "named_chat_template", "special_token_text", "MAX_CHAT_TEMPLATE_CHARS"]


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


# ----------------------------------------------------------------------------- the chat template


def special_token_text(tok) -> str:
    """A special token as tokenizer_config.json has it: a string or an AddedToken dict."""
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else ""


def named_chat_template(tpl) -> str | None:
    """``chat_template`` as a string, or the ``default`` of a list of {name, template}."""
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    return tpl if isinstance(tpl, str) and tpl.strip() else None


def chat_template_meta(model_dir) -> dict | None:
    """The chat template of a model directory's tokenizer metadata, as the welcome carries it:
    ``{"template", "bos_token", "eos_token"}``, or None when it has none (an encoder) or when
    it is over `MAX_CHAT_TEMPLATE_CHARS` (logged; a client would refuse it).

    The template is ``chat_template.jinja`` when the directory has one (what recent
    transformers versions write, and prefer), else ``chat_template`` of
    ``tokenizer_config.json``; bos / eos come from ``tokenizer_config.json``.  A GGUF model is
    loaded through its converted directory, whose ``tokenizer_config.json`` holds the GGUF
    header's ``tokenizer.chat_template`` and bos / eos tokens (`cipherlm.models.gguf_convert`)."""
    if model_dir is None:
        return None
    d = Path(model_dir)
    if not d.is_dir():
        return None
    cfg: dict = {}
    try:
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
            cfg = cfg if isinstance(cfg, dict) else {}
        jinja = d / "chat_template.jinja"
        if jinja.is_file():
            tpl = jinja.read_text(encoding="utf-8")
        else:
            tpl = named_chat_template(cfg.get("chat_template"))
    except (OSError, ValueError) as exc:
        log.warning("the chat template of %s is unreadable (%s): not shipped", d.name, type(exc).__name__)
        return None
    if not isinstance(tpl, str) or not tpl.strip():
        return None
    if len(tpl) > MAX_CHAT_TEMPLATE_CHARS:
        log.warning("the chat template of %s has %d characters, over the %d a client accepts: not shipped",
                    d.name, len(tpl), MAX_CHAT_TEMPLATE_CHARS)
        return None
    bos, eos = (special_token_text(cfg.get(k))[:MAX_SPECIAL_TOKEN_CHARS] for k in ("bos_token", "eos_token"))
    return {"template": tpl, "bos_token": bos, "eos_token": eos}


def check_chat_template(meta) -> dict | None:
    """A welcome's ``chat_template`` as it came off the wire: None, or a dict whose
    ``template`` is a non-empty string of at most `MAX_CHAT_TEMPLATE_CHARS` characters and
    whose ``bos_token`` / ``eos_token`` are strings (or None) of at most 256.  Returns a
    clean ``{"template", "bos_token", "eos_token"}`` (other keys are dropped, unread); anything
    else raises `ProtocolError`.  This checks types and sizes only: the template is code
    from the server, compiled and rendered in the Jinja sandbox by the proxy."""
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise ProtocolError(f"the welcome's chat_template must be a dict or None, got {type(meta).__name__}")
    tpl = meta.get("template")
    if not isinstance(tpl, str) or not tpl.strip():
        raise ProtocolError("the welcome's chat_template.template must be a non-empty string")
    if len(tpl) > MAX_CHAT_TEMPLATE_CHARS:
        raise ProtocolError(f"the server's chat template has {len(tpl)} characters: this client accepts at most "
                            f"{MAX_CHAT_TEMPLATE_CHARS}")
    out = {"template": tpl}
    for key in ("bos_token", "eos_token"):
        v = meta.get(key)
        if v is None:
            v = ""
        if not isinstance(v, str) or len(v) > MAX_SPECIAL_TOKEN_CHARS:
            raise ProtocolError(f"the welcome's chat_template.{key} must be a string of at most "
                                f"{MAX_SPECIAL_TOKEN_CHARS} characters")
        out[key] = v
    return out
