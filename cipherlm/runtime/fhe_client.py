"""fhe-mode client: keeps the secret key, embeds, encrypts, uploads, waits, decrypts.

Client side of the fhe protocol (messages in :mod:`cipherlm.runtime.fhe_protocol`).  The
client looks its tokens up in the embedding tables (the client bundle, cached by digest
like the offload mode's, `cipherlm.runtime.bundle`), packs the (T, d) sum in the
token-group layout and encrypts it; the server evaluates every Transformer block on the
ciphertexts with bootstrapping and answers once.  Between the upload and the result the
client sends nothing and receives nothing (`FheClient.last_infer_traffic` holds the
channel's counters of the last request: one message each way).

Set-up, once per session: the welcome's types are checked (`check_fhe_welcome`); the
preset decides security, not the server's word: a server on the INSECURE test preset is
refused unless ``insecure_ok=True``; the client makes a secret key for the preset,
Galois keys for exactly the welcome's rotation steps, a relinearisation key and the
bootstrapping keys (~7.9 GB and about a minute at the production preset), checks their
sizes against the welcome's and uploads them in ``keys_part`` chunks.

``refresh="client"`` (the client-aided refresh, `protocols.ckks.refresh`) makes and sends
no bootstrapping keys; the server then sends masked ciphertexts during a pass and the
client answers each with fresh encryptions (`FheClient.last_infer_traffic` then counts
one more message each way per refresh).  Decoders keep their keys and values in the
server's encrypted KV cache: `FheClient.generate` sends the prompt once and then one
token per step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Iterable, Sequence

import numpy as np

from cipherlm.net.channel import TCPChannel
from cipherlm.runtime.bundle import check_bundle, load_bundle, store_bundle
from cipherlm.runtime.fhe_protocol import (
    KEY_CHUNK,
    MAX_REFRESH_CTS,
    MODE,
    PROTOCOL_VERSION,
    REFRESH_PATHS,
    TASKS,
    ProtocolError,
    expect,
    key_blobs,
)
from cipherlm.runtime.session_server import SessionClient

#: how long the client waits for one ``infer`` result by default (a pass at the production
#: preset takes minutes; the server sends nothing meanwhile)
DEFAULT_INFER_TIMEOUT = 6 * 3600.0


class InsecureServerError(ProtocolError):
    """The server runs an INSECURE test preset and the client was not told to accept it."""


def _is_int(v, lo: int = 0) -> bool:
    return type(v) is int and v >= lo


def check_fhe_welcome(w: dict) -> dict:
    """Type-check an fhe welcome (ProtocolError on anything malformed); returns it."""
    if type(w.get("protocol")) is not int or w["protocol"] != PROTOCOL_VERSION:  # type first: an array
        raise ProtocolError(f"the server speaks fhe protocol {w.get('protocol')!r}, this client {PROTOCOL_VERSION}")
    for k in ("model", "preset", "bundle_digest"):
        if not isinstance(w.get(k), str):
            raise ProtocolError(f"welcome: {k} must be a string")
    if not isinstance(w.get("kind"), str) or w["kind"] not in ("encoder", "decoder"):
        raise ProtocolError("welcome: kind must be 'encoder' or 'decoder'")
    if not isinstance(w.get("config"), dict):
        raise ProtocolError("welcome: config must be a dict")
    if not isinstance(w.get("insecure"), bool):
        raise ProtocolError("welcome: insecure must be a bool")
    for k in ("slots", "d", "max_tokens", "key_chunk"):
        if not _is_int(w.get(k), 1):
            raise ProtocolError(f"welcome: {k} must be a positive integer")
    slots = w["slots"]
    if slots & (slots - 1):
        raise ProtocolError("welcome: slots must be a power of two")
    steps = w.get("rotation_steps")
    if not isinstance(steps, list) or not all(_is_int(s, 1) and s < slots for s in steps) or len(set(steps)) != len(steps):
        raise ProtocolError("welcome: rotation_steps must be distinct integers in 1..slots-1")
    labels = w.get("labels")
    if labels is not None and (not isinstance(labels, list) or not labels or not all(isinstance(x, str) for x in labels)):
        raise ProtocolError("welcome: labels must be None or a non-empty list of strings")
    tasks = w.get("tasks")
    if not isinstance(tasks, list) or not all(isinstance(t, str) and t in TASKS for t in tasks):
        raise ProtocolError(f"welcome: tasks must be a list out of {list(TASKS)}")
    ks = w.get("key_sizes")
    if not isinstance(ks, dict) or not all(_is_int(ks.get(k), 1) for k in ("relin", "galois_max", "bootstrap")):
        raise ProtocolError("welcome: key_sizes must give positive relin, galois_max and bootstrap sizes")
    refresh = w.setdefault("refresh", ["bootstrap"])  # servers before the client-aided refresh
    if not isinstance(refresh, list) or not refresh or not all(isinstance(r, str) and r in REFRESH_PATHS
                                                              for r in refresh):
        raise ProtocolError(f"welcome: refresh must be a non-empty list out of {list(REFRESH_PATHS)}")
    return w


class FheKeys:
    """A secret key for a preset and the key blobs a server needs (relinearisation key, seeded
    Galois keys for `steps`, and for ``refresh="bootstrap"`` the bootstrapping keys).
    Reusable for several sessions with servers of the same preset and steps (the tests make
    one and share it)."""

    def __init__(self, preset: str, steps: Sequence[int], insecure_ok: bool = False, refresh: str = "bootstrap"):
        from cipherlm.he import get_backend

        t0 = time.perf_counter()
        self.be = get_backend("lattigo")
        test_only = self.be.bootstrap_presets().get(preset, False)
        self.preset = preset
        self.refresh = refresh
        self.blob_names = key_blobs(refresh)
        self.steps = sorted(int(s) for s in steps)
        self.ctx = self.be.bootstrappable_context(preset, allow_insecure_for_tests=bool(test_only and insecure_ok))
        self.sk = self.be.keygen(self.ctx)
        blobs = {"relin": self.sk.relin_key_bytes(), "galois": self.sk.galois_keys_bytes(self.steps)}
        if "bootstrap" in self.blob_names:
            bk = self.sk.bootstrapping_keys()
            try:
                blobs["bootstrap"] = bk.to_bytes()
            finally:
                bk.close()  # the client never bootstraps: only the bytes are kept, for the upload
        self.blobs: dict | None = blobs
        self.seconds = time.perf_counter() - t0

    def matches(self, preset: str, steps: Sequence[int], refresh: str = "bootstrap") -> bool:
        return (self.blobs is not None and preset == self.preset and refresh == self.refresh
                and sorted(int(s) for s in steps) == self.steps)

    def sizes(self) -> dict:
        return {b: len(self.blobs[b]) for b in self.blob_names}

    def parts(self, chunk: int) -> list[tuple[str, memoryview]]:
        """The upload's ``keys_part`` data: each blob cut in pieces of at most `chunk` bytes."""
        out = []
        for b in self.blob_names:
            mv = memoryview(self.blobs[b])
            out += [(b, mv[i:i + chunk]) for i in range(0, len(mv), chunk)]
        return out

    def drop_blobs(self) -> None:
        """Forget the uploaded blobs (GBs at the production preset); the secret key stays."""
        self.blobs = None

    def encrypt_rows(self, rows: np.ndarray) -> list[bytes]:
        """Seeded symmetric encryptions (about half the bytes of a full ciphertext) of slot rows."""
        return [self.sk.encrypt_seeded(self.be.encode_slots(self.ctx, r)) for r in rows]

    def decrypt(self, blob: bytes) -> np.ndarray:
        ct = self.be.ciphertext_from_bytes(self.ctx, blob)
        return np.asarray(self.be.decode_slots(self.ctx, self.sk.decrypt(ct)), np.float64)

    def reencrypt(self, blobs: list) -> list[bytes]:
        """The client's half of a client-aided refresh (`protocols.ckks.refresh`)."""
        from cipherlm.protocols.ckks.refresh import reencrypt_blobs

        return reencrypt_blobs(self.be, self.ctx, self.sk, blobs)


class FheClient(SessionClient):
    """A session with an fhe server: set-up (keys uploaded), then `classify`, `next_logits`,
    `generate`; each request is one upload and one result, nothing in between.

    ``insecure_ok``: accept a server on the INSECURE test preset (tests only).  ``keys``: an
    `FheKeys` to reuse (made here when None or when it does not fit the server).
    ``refresh``: "bootstrap" (the server bootstraps; nothing travels during a pass) or
    "client" (no bootstrapping keys; the client re-encrypts masked ciphertexts during a
    pass, `protocols.ckks.refresh`).
    ``progress``: a callable taking one status line (e.g. printing to stderr)."""

    def __init__(self, host: str, port: int, model: str | None = None, insecure_ok: bool = False,
                 keys: FheKeys | None = None, timeout: float = 600.0,
                 infer_timeout: float | None = DEFAULT_INFER_TIMEOUT, progress: Callable[[str], None] | None = None,
                 refresh: str = "bootstrap"):
        self.t_start = time.perf_counter()
        key_blobs(refresh)  # ProtocolError for an unknown path, before connecting
        self.refresh = refresh
        self.client_refreshes = 0
        self.insecure_ok = bool(insecure_ok)
        self.infer_timeout = infer_timeout
        self.progress = progress or (lambda s: None)
        self.seconds: dict[str, float] = defaultdict(float)  # client compute per kind
        self.server_seconds: dict[str, float] = defaultdict(float)  # server compute per kind (from results)
        self.server_counts: dict[str, int] = defaultdict(int)
        self.infer_stats: list[dict] = []
        self.last_infer_traffic: dict | None = None
        self.chan = TCPChannel.connect(host, port, timeout=timeout)
        try:
            self._setup(model, keys)
        except BaseException:
            self.chan.close()
            raise
        self.setup_seconds = time.perf_counter() - self.t_start

    # ---- set-up

    def _setup(self, model: str | None, keys: FheKeys | None) -> None:
        from cipherlm.compile import build_graph
        from cipherlm.he import get_backend

        with self.chan.step("setup"):
            self.chan.send({"type": "hello", "protocol": PROTOCOL_VERSION, "mode": MODE, "model": model})
            w = check_fhe_welcome(expect(self.chan.recv(), "welcome"))
        known = get_backend("lattigo").bootstrap_presets()
        if w["preset"] not in known:
            raise ProtocolError(f"the server's preset {w['preset']!r} is not one this client knows")
        insecure = known[w["preset"]] or w["insecure"]
        if insecure and not self.insecure_ok:
            raise InsecureServerError(f"the server runs the INSECURE test preset {w['preset']!r} (no security): "
                                      "refused (insecure_ok=True / --insecure-ok is for tests only)")
        self.welcome = w
        self.model, self.kind, self.config = w["model"], w["kind"], w["config"]
        self.preset, self.insecure = w["preset"], insecure
        self.slots, self.d, self.max_tokens = w["slots"], w["d"], w["max_tokens"]
        self.rotation_steps = list(w["rotation_steps"])
        self.labels, self.tasks = w["labels"], list(w["tasks"])
        self.graph = build_graph(self.config)
        self._bundle(w["bundle_digest"])
        self._keys(keys)

    def _bundle(self, digest: str) -> None:
        self.bundle_from_cache = True
        cached = load_bundle(digest)  # hashed again: a tampered cache entry is a miss
        if cached is None:
            self.bundle_from_cache = False
            self.progress("downloading the client bundle (embedding tables, tokenizer; once per model)")
            with self.chan.step("setup"):
                self.chan.send({"type": "get_bundle"})
                bundle = expect(self.chan.recv(), "bundle")
            cached = check_bundle(bundle.get("tensors"), bundle.get("tokenizer"))
            store_bundle(digest, *cached)  # sha256 checked against the digest first
        tensors, tokenizer_json = cached
        self.tensors = dict(tensors)
        self.tokenizer = None
        if tokenizer_json is not None:
            from tokenizers import Tokenizer

            try:
                self.tokenizer = Tokenizer.from_str(tokenizer_json)
            except Exception as exc:
                raise ProtocolError(f"the bundle's tokenizer does not load: {type(exc).__name__}") from None
        x = self.embed([0])
        if x.shape[1] != self.d:
            raise ProtocolError(f"the bundle embeds to width {x.shape[1]}, the welcome says {self.d}")

    def _keys(self, keys: FheKeys | None) -> None:
        w = self.welcome
        if self.refresh not in w["refresh"]:
            raise ProtocolError(f"the server does not offer the {self.refresh!r} refresh (it offers {w['refresh']})")
        own = keys is None or not keys.matches(self.preset, self.rotation_steps, self.refresh)
        if own:
            what = (f"bootstrapping keys, {w['key_sizes']['bootstrap'] / 1e9:.2f} GB" if self.refresh == "bootstrap"
                    else "no bootstrapping keys: client-aided refresh")
            self.progress(f"making keys for {self.preset} ({len(self.rotation_steps)} rotation keys and {what}) ...")
            keys = FheKeys(self.preset, self.rotation_steps, insecure_ok=self.insecure_ok, refresh=self.refresh)
            self.seconds["keygen"] += keys.seconds
        self.keys = keys
        sizes = keys.sizes()
        ks = w["key_sizes"]
        if (sizes["relin"] != ks["relin"] or sizes.get("bootstrap", ks["bootstrap"]) != ks["bootstrap"]
                or sizes["galois"] > ks["galois_max"]):
            raise ProtocolError(f"the server expects keys of other sizes ({ks}) than this preset's ({sizes})")
        parts = keys.parts(min(int(w["key_chunk"]), KEY_CHUNK))
        self.progress(f"uploading keys ({sum(sizes.values()) / 1e6:.1f} MB in {len(parts)} parts) ...")
        with self.chan.step("setup"):
            self.chan.send({"type": "keys", "refresh": self.refresh, "sizes": sizes, "parts": len(parts)})
            for i, (blob, data) in enumerate(parts):
                self.chan.send({"type": "keys_part", "index": i, "total": len(parts), "blob": blob, "data": data})
            expect(self.chan.recv(), "ready")
        if own:
            keys.drop_blobs()

    # ---- one request

    def packing(self, tokens: int, offset: int = 0):
        """The layout of `tokens` tokens at positions offset.. in this session (the server's
        `FheModel.packing`)."""
        from cipherlm.runtime.fhe_executor import FheModel

        return FheModel.packing(self.slots, tokens, self.max_tokens, offset)

    def embed(self, ids, offset: int = 0) -> np.ndarray:
        """The (T, d) embedding sum of token ids at positions offset.., in the clear
        (`fhe_executor.client_embedding`)."""
        from cipherlm.runtime.fhe_executor import client_embedding

        return client_embedding(self.graph, self.tensors, ids, positions=np.arange(offset, offset + len(ids)))

    def _ids(self, ids) -> list[int]:
        if isinstance(ids, str):
            if self.tokenizer is None:
                raise ValueError("the server's model has no tokenizer: give token ids")
            ids = self.tokenizer.encode(ids).ids
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("no tokens")
        if len(ids) > self.max_tokens:
            raise ValueError(f"{len(ids)} tokens: this server takes at most {self.max_tokens} per pass")
        vocab = int(self.config.get("vocab_size") or 0)
        if vocab and not all(0 <= i < vocab for i in ids):
            raise ValueError(f"token ids must be in 0..{vocab - 1}")
        return ids

    def infer(self, task: str, ids, offset: int = 0) -> tuple[np.ndarray, int]:
        """One request: the decrypted result (channels x positions) and its width d.  ``offset``
        > 0 ("logits" only): a decoding step after the `offset` positions the server's KV cache
        of this session holds (0 starts a new cache)."""
        if task not in self.tasks:
            raise ValueError(f"the server's {self.kind} model has no {task!r} task (it serves {self.tasks})")
        ids = self._ids(ids)
        T = len(ids)
        if offset + T > self.max_tokens:
            raise ValueError(f"positions up to {offset + T}: this server takes at most {self.max_tokens}")
        P = self.packing(T, offset)
        self.seconds_refresh_last = 0.0
        refreshes_before = self.client_refreshes
        t0 = time.perf_counter()
        x = self.embed(ids, offset)
        self.seconds["embed"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        cts = self.keys.encrypt_rows(P.pack(x))
        self.seconds["encrypt"] += time.perf_counter() - t0
        before = self.chan.totals()
        with self.chan.step("fhe"):
            self.chan.send({"type": "infer", "task": task, "tokens": T, "cts": cts, "offset": int(offset)})
            t_wait = time.perf_counter()
            reply = self.chan.recv(timeout=self.infer_timeout)
            while (self.refresh == "client" and isinstance(reply, dict) and isinstance(reply.get("type"), str)
                   and reply["type"] == "refresh"):
                self._answer_refresh(reply)
                reply = self.chan.recv(timeout=self.infer_timeout)
            reply = expect(reply, "result")
            wait = time.perf_counter() - t_wait - self.seconds_refresh_last
        after = self.chan.totals()
        self.last_infer_traffic = {k: after[k] - before[k] for k in after}
        out, d, st = reply.get("cts"), reply.get("d"), reply.get("stats")
        if reply.get("task") != task or not _is_int(d, 1):
            raise ProtocolError("the result does not answer this request")
        if not isinstance(out, list) or len(out) != P.n_cts(d) or not all(isinstance(b, bytes) for b in out):
            raise ProtocolError(f"the result must hold {P.n_cts(d)} ciphertexts")
        t0 = time.perf_counter()
        slots = np.stack([self.keys.decrypt(b) for b in out])
        self.seconds["decrypt"] += time.perf_counter() - t0
        if isinstance(st, dict):
            self.infer_stats.append({"task": task, "tokens": T, "wait_seconds": wait, **st,
                                     "refresh_rounds_answered": self.client_refreshes - refreshes_before})
            for k, v in (st.get("seconds") or {}).items():
                if isinstance(k, str) and isinstance(v, (int, float)):
                    self.server_seconds[k] += float(v)
            for k, v in (st.get("counts") or {}).items():
                if isinstance(k, str) and _is_int(v):
                    self.server_counts[k] += v
        return slots.reshape(-1, P.cpc, P.tp).reshape(-1, P.tp)[:d], d

    def _answer_refresh(self, msg: dict) -> None:
        """One client-aided refresh: the server's masked ciphertexts re-encrypted at the top
        level (`protocols.ckks.refresh`; what this client sees is statistically independent
        of the values)."""
        blobs = msg.get("cts")
        if not isinstance(blobs, list) or not 1 <= len(blobs) <= MAX_REFRESH_CTS:
            raise ProtocolError(f"refresh: cts must be a list of 1..{MAX_REFRESH_CTS} ciphertexts")
        t0 = time.perf_counter()
        fresh = self.keys.reencrypt(blobs)  # HEError for a blob that does not parse
        dt = time.perf_counter() - t0
        self.seconds["refresh"] += dt
        self.seconds_refresh_last += dt
        self.client_refreshes += 1
        self.chan.send({"type": "refreshed", "cts": fresh})

    def classify(self, text_or_ids) -> np.ndarray:
        """Class logits (len(labels),) of a sentence (text or token ids): the classifier head on
        the pooled, normalised last hidden states, read at position 0."""
        grid, d = self.infer("classify", text_or_ids)
        if self.labels is not None and d != len(self.labels):
            raise ProtocolError(f"{d} class logits for {len(self.labels)} labels")
        return grid[:, 0].copy()

    def next_logits(self, ids, offset: int = 0) -> np.ndarray:
        """Decoders: the logits (vocab,) of the token after `ids` (at positions offset..: after
        what the server's KV cache holds; 0 starts a new cache), read at the last position."""
        ids = self._ids(ids)
        grid, _ = self.infer("logits", ids, offset)
        return grid[:, offset + len(ids) - 1].copy()

    def generate(self, ids, max_new_tokens: int, eos_ids: Iterable[int] = (),
                 on_token: Callable[[int], None] | None = None) -> tuple[list[int], list[np.ndarray]]:
        """Greedy generation: (new ids, logits of each step).  One encrypted pass over the prompt,
        then one pass per new token over that token alone: the keys and values of the earlier
        positions stay encrypted in the server's KV cache.  Stops at an EOS id (included), after
        `max_new_tokens`, or when the positions would exceed the server's max_tokens."""
        ids = self._ids(ids)
        eos = {int(e) for e in eos_ids}
        new: list[int] = []
        logits: list[np.ndarray] = []
        step, offset = ids, 0
        for _ in range(int(max_new_tokens)):
            if offset + len(step) > self.max_tokens:
                break
            lg = self.next_logits(step, offset)
            offset += len(step)
            tok = int(np.argmax(lg))
            logits.append(lg)
            new.append(tok)
            step = [tok]
            if on_token is not None:
                on_token(tok)
            if tok in eos:
                break
        return new, logits

    def close(self) -> None:
        super().close()
        if getattr(self, "keys", None) is not None and self.keys.blobs is None:
            self.keys = None
