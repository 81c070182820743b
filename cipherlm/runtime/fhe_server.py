"""fhe-mode server: whole Transformer blocks on CKKS ciphertexts, bootstrapping, no interaction.

Implements the server side of the fhe protocol (messages in
:mod:`cipherlm.runtime.fhe_protocol`): the client uploads its keys once per session
(relinearisation, Galois keys for the welcome's rotation steps, bootstrapping keys, in
chunks), then each ``infer`` request carries the encrypted embedding sum of T tokens; the
server runs every node after the embedding on the ciphertexts
(`cipherlm.runtime.fhe_executor.FheModel`) and answers once with the encrypted result.
Between the upload and the result it sends nothing.

`FheHost` holds one model: the graph, the weights, the ranges from a calibration pass over
fixed built-in inputs (tokenised sentences / prompts for a model with a tokenizer, seeded
random token ids otherwise), the classifier head of an encoder (MiniLM: the polarity
probe, as in the offload mode) and the Lattigo context of the preset.  One `FheModel` serves
every session; each session has its own keys and evaluator.

Sessions run in threads of the server process (Lattigo's Go code releases the GIL; a
process with Go threads must not be forked, so `session_workers` processes are not used).
After each layer a pass checks the session's liveness (`MessageSession.check_alive`): a
client that leaves stops the work within one layer and the server goes on serving.  Log
lines name sessions, tasks, token counts and layer progress, never values, keys or tokens.

Limits (`ServerLimits`): an fhe session holds its bootstrapping keys (~7.9 GB at the
production preset) for its whole life, so the defaults allow fewer sessions than the
offload mode; ``max_cts_per_request`` caps the ciphertexts of one ``infer`` and
``max_work_per_session`` the input ciphertexts of a session, all requests together.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections import Counter

import numpy as np

from cipherlm.he import HEError
from cipherlm.runtime.fhe_protocol import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_PRESET,
    KEY_CHUNK,
    REFRESH_PATHS,
    MIN_KEY_CHUNK,
    MODE,
    PROTOCOL_VERSION,
    TASKS,
    TEST_PRESET,
    ProtocolError,
    expect,
    key_blobs,
    max_key_parts,
)
from cipherlm.protocols.ckks.refresh import ClientRefresher
from cipherlm.runtime.session_server import LimitExceeded, MessageSession, ServerLimits, SessionServer

log = logging.getLogger("cipherlm.serve")

DEFAULT_TIMEOUT = 600.0  # seconds a session may stay silent (the per-frame idle timeout)
#: an fhe session holds GBs of keys: fewer sessions at once than the offload mode
DEFAULT_LIMITS = ServerLimits(max_sessions=4, max_sessions_per_address=2)

#: calibration inputs of a model with a tokenizer (besides the polarity sentences for encoders)
CALIBRATION_TEXTS = (
    "What is the capital of France?",
    "The quick brown fox jumps over the lazy dog.",
    "I loved this movie, the acting was wonderful and the story kept me hooked.",
    "This was a dull, badly written film and I want my money back.",
    "Write a short poem about the sea.",
    "Explain how a transformer language model predicts the next token.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10",
    "Hello! How are you today?",
)
CALIBRATION_SEED = 20261125
N_RANDOM_CALIBRATION = 8


def _calibration_inputs(lm, max_tokens: int, encoder: bool) -> list[np.ndarray]:
    """Fixed inputs of the calibration pass: tokenised built-in texts (truncated to max_tokens),
    or seeded random id lists of lengths up to max_tokens for a model without a tokenizer."""
    tok = lm.tokenizer
    out = []
    if tok is not None:
        texts = list(CALIBRATION_TEXTS)
        if encoder:
            try:
                from cipherlm.models.data import load_polarity

                texts += [t for t, _ in load_polarity()[:24]]
            except Exception:  # the polarity data is an optional extra here
                pass
        chat = tok.token_to_id("<|im_start|>") is not None
        for t in texts:
            if chat and not encoder:
                t = f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n"
            ids = tok.encode(t).ids[:max_tokens]
            if ids:
                out.append(np.asarray(ids, np.int64))
    if not out:
        vocab = int(lm.config.get("vocab_size") or 2)
        rng = np.random.default_rng(CALIBRATION_SEED)
        for k in range(N_RANDOM_CALIBRATION):
            n = max(1, max_tokens - k * max(1, max_tokens // (2 * N_RANDOM_CALIBRATION)))
            out.append(rng.integers(0, vocab, size=n))
    return out


def expected_bootstrap_key_bytes(be, ctx) -> int:
    """The exact size of a bootstrapping key blob for this preset: the Lattigo loader checks
    the length first and names the size it expects (nothing is allocated for the keys)."""
    try:
        be.bootstrapping_keys_from_bytes(ctx, b"")
    except HEError as exc:
        m = re.search(r"expected (\d+)", str(exc))
        if m:
            return int(m.group(1))
        raise
    raise HEError("an empty bootstrapping key blob was accepted")


def peak_rss_mb() -> float:
    """This process's peak resident memory in MB (`resource.getrusage`; Linux reports KB)."""
    import resource

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kb / (1 << 20) if sys.platform == "darwin" else kb / 1024, 1)


class FheHost:
    """One model served in the fhe mode: the calibrated `FheModel`, its client bundle, the
    preset's context, the rotation steps of a pass of up to ``max_tokens`` tokens and the
    exact sizes of the keys a client uploads (built once)."""

    def __init__(self, model_name: str, preset: str = DEFAULT_PRESET, max_tokens: int = DEFAULT_MAX_TOKENS,
                 insecure_test_preset: bool = False, classifier=None, labels=None, workers: int = 1,
                 ray_address: str | None = None, runtime=None):
        from cipherlm.compile import build_graph
        from cipherlm.he import get_backend
        from cipherlm.models import load_model
        from cipherlm.runtime.bundle import bundle_digest
        from cipherlm.runtime.fhe_executor import calibrated_model, client_embedding, client_tensors

        t0 = time.perf_counter()
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        self.be = get_backend("lattigo")
        known = self.be.bootstrap_presets()
        if preset not in known:
            raise ValueError(f"unknown fhe preset {preset!r}; known: {sorted(known)}")
        self.insecure = known[preset]
        if self.insecure and insecure_test_preset is not True:
            raise ValueError(f"{preset} is an INSECURE test-only preset: it needs --insecure-test-preset")
        self.ctx = self.be.bootstrappable_context(preset, allow_insecure_for_tests=self.insecure)
        self.preset = preset
        self.slots = self.ctx.slots
        self.max_tokens = max_tokens

        lm = load_model(model_name)
        self.name = lm.name
        self.config = lm.config
        encoder = "logits" not in build_graph(lm.config).outputs
        self.labels = None if labels is None else [str(x) for x in labels]
        if classifier is None and lm.config.get("model_type") == "bert" and lm.tokenizer is not None:
            # the encoder's classifier head: the polarity probe, as the offload server serves it
            from cipherlm.runtime.plain import polarity_classifier

            _, _, probe = polarity_classifier(lm)
            classifier = probe.as_linear()["classifier"]
            self.labels = list(probe.labels)
        if classifier is not None:
            w, b = classifier
            classifier = (np.asarray(w, np.float64), None if b is None else np.asarray(b, np.float64))
            if self.labels is None:
                self.labels = [f"class{i}" for i in range(classifier[0].shape[0])]
            if len(self.labels) != classifier[0].shape[0]:
                raise ValueError(f"{len(self.labels)} labels for a classifier of {classifier[0].shape[0]} outputs")
        inputs = _calibration_inputs(lm, max_tokens, encoder)
        self.model = calibrated_model(lm, inputs, classifier=classifier)
        self.kind = "decoder" if "logits" in self.model.graph.outputs else "encoder"
        self.tasks = (("logits",) if self.kind == "decoder" else ()) + (("classify",) if classifier is not None else ())
        tensors = client_tensors(self.model)
        self.d = int(client_embedding(self.model.graph, tensors, [0]).shape[1])
        self.n_layers = int(self.model.graph.n_layers)
        self.rotation_steps = [int(s) for s in self.model.rotation_steps(self.model.packing(self.slots, max_tokens))]
        self.bundle = {
            "type": "bundle",
            "tensors": {k: np.ascontiguousarray(v) for k, v in tensors.items()},
            "tokenizer": lm.tokenizer.to_str() if lm.tokenizer is not None else None,
        }
        self.bundle_digest = bundle_digest(self.bundle["tensors"], self.bundle["tokenizer"])
        self.key_sizes = self._key_sizes()
        del lm
        #: several workers (AEGIS, `runtime.aegis_executor`): one pass spread over W Ray actors,
        #: shared by the sessions one pass at a time (each session's keys loaded on them in turn)
        self.workers = int(workers)
        self.executor = None
        self.executor_lock = threading.Lock()
        self.executor_session = None
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers!r}")
        if self.workers > 1:
            from cipherlm.runtime.aegis_executor import AegisExecutor, RayRuntime

            self.executor = AegisExecutor(self.model, self.workers,
                                          runtime=runtime if runtime is not None else RayRuntime(ray_address))
        self.startup_seconds = time.perf_counter() - t0

    @property
    def refresh_paths(self) -> tuple[str, ...]:
        """The client-aided refresh needs the client inside a worker's pass: one worker only."""
        return REFRESH_PATHS if self.executor is None else ("bootstrap",)

    def _key_sizes(self) -> dict:
        """{relin, galois_max, bootstrap} in bytes: relin and bootstrap exact for the preset
        (a throwaway key of this server's own measures the relinearisation key), galois the
        size of seeded keys for every rotation step (one key per step at most)."""
        junk = self.be.keygen(self.ctx)
        relin = len(junk.relin_key_bytes())
        one, two = len(junk.galois_keys_bytes([1])), len(junk.galois_keys_bytes([1, 2]))
        per_key = two - one
        galois_max = (one - per_key) + per_key * len(self.rotation_steps)
        return {"relin": relin, "galois_max": galois_max,
                "bootstrap": expected_bootstrap_key_bytes(self.be, self.ctx)}

    def packing(self, tokens: int, offset: int = 0):
        return self.model.packing(self.slots, tokens, self.max_tokens, offset)

    def welcome(self) -> dict:
        return {
            "type": "welcome",
            "protocol": PROTOCOL_VERSION,
            "model": self.name,
            "kind": self.kind,
            "config": self.config,
            "preset": self.preset,
            "insecure": self.insecure,
            "slots": self.slots,
            "d": self.d,
            "max_tokens": self.max_tokens,
            "rotation_steps": list(self.rotation_steps),
            "labels": self.labels,
            "tasks": list(self.tasks),
            "key_sizes": dict(self.key_sizes),
            "key_chunk": KEY_CHUNK,
            "refresh": list(self.refresh_paths),
            "workers": self.workers,
            "bundle_digest": self.bundle_digest,
        }


class _WorkerCache:
    """The length of a session's KV cache when it lives on the workers (`_infer_workers`)."""

    def __init__(self, length: int):
        self.length = length


class FheServer(SessionServer):
    """Accepts sessions on a TCP port and serves one :class:`FheHost` (sessions in threads)."""

    expected_errors = SessionServer.expected_errors + (HEError,)
    thread_name = "fhe-session"
    default_limits = DEFAULT_LIMITS
    default_timeout = DEFAULT_TIMEOUT
    log_name = log.name

    def __init__(self, host: FheHost, address: str = "127.0.0.1", port: int = 0, session_timeout=None,
                 limits: ServerLimits | None = None):
        super().__init__(host, address, port, session_timeout=session_timeout, limits=limits, processes=1)
        self.infers_done = 0

    def new_session(self, chan) -> "Session":
        return Session(self.host, chan, self)


class Session(MessageSession):
    """Server side of one fhe session (see fhe_protocol for the message flow)."""

    mode = MODE
    protocol_version = PROTOCOL_VERSION

    def __init__(self, host: FheHost, chan, server: FheServer | None = None):
        self.host = host
        self.chan = chan
        self.server = server
        try:
            peer = chan.sock.getpeername()
            self.sid = f"{peer[0]}:{peer[1]}"
        except (AttributeError, OSError):
            self.sid = "?"
        self.eval_keys = None
        self.bootstrap_keys = None
        self.key_blobs = None  # several workers: the key blobs, loaded on the workers in turn
        self.refresh = "bootstrap"  # the session's refresh path, chosen with its keys
        self.kv = None  # the decoder's encrypted KV cache (runtime.fhe_executor.FheKVCache)
        self.keys_received = False
        self.bundle_sent = False
        self.work_done = 0
        self.infers = 0
        self.seconds: Counter = Counter()
        self.counts: Counter = Counter()

    def close(self) -> None:
        """Drop this session's keys (the bootstrapping keys' GBs are freed at once) and its KV cache."""
        bk, self.bootstrap_keys, self.eval_keys, self.kv = self.bootstrap_keys, None, None, None
        self.key_blobs = None
        if bk is not None:
            bk.close()
        host = self.host
        if host.executor is not None:
            with host.executor_lock:
                if host.executor_session is self:
                    host.executor_session = None
                    try:
                        host.executor.close_session()
                    except HEError as e:
                        log.warning("session %s: closing the workers' session failed: %s", self.sid, e)

    def welcome(self) -> dict:
        lim = self.limits
        return {**self.host.welcome(),
                "limits": {"max_cts_per_request": lim.max_cts_per_request,
                           "max_work_per_session": lim.max_work_per_session,
                           "session_lifetime": lim.session_lifetime}}

    def _get_bundle(self, msg: dict) -> None:
        if self.bundle_sent:
            raise LimitExceeded("the client bundle is sent once per session")
        self.bundle_sent = True
        with self.chan.step("setup"):
            self.chan.send(self.host.bundle)

    # ---- keys

    def _check_sizes(self, msg: dict, blobs: tuple[str, ...]) -> tuple[dict, int]:
        sizes, parts = msg.get("sizes"), msg.get("parts")
        if not isinstance(sizes, dict) or set(sizes) != set(blobs):
            raise ProtocolError(f"keys: sizes must give the bytes of {list(blobs)} (refresh {self.refresh!r})")
        for b in blobs:
            v = sizes[b]
            if type(v) is not int or v < 1:
                raise ProtocolError(f"keys: the {b} size must be a positive integer")
        want = self.host.key_sizes
        if sizes["relin"] != want["relin"]:
            raise ProtocolError(f"keys: a relinearisation key of {sizes['relin']} bytes, this preset's is "
                                f"{want['relin']}")
        if sizes["galois"] > want["galois_max"]:
            raise ProtocolError(f"keys: Galois keys of {sizes['galois']} bytes, at most {want['galois_max']} "
                                "for the welcome's rotation steps")
        if "bootstrap" in blobs and sizes["bootstrap"] != want["bootstrap"]:
            raise ProtocolError(f"keys: bootstrapping keys of {sizes['bootstrap']} bytes, this preset's are "
                                f"{want['bootstrap']}")
        if type(parts) is not int or not 1 <= parts <= max_key_parts(sizes):
            raise ProtocolError(f"keys: parts must be an integer in 1..{max_key_parts(sizes)}")
        return sizes, parts

    def _keys(self, msg: dict) -> None:
        if self.keys_received:
            raise ProtocolError("keys were already sent in this session")
        self.keys_received = True
        refresh = msg.get("refresh", "bootstrap")
        if not isinstance(refresh, str):
            raise ProtocolError("keys: refresh must be a string")
        blobs_order = key_blobs(refresh)  # ProtocolError for an unknown path
        if refresh not in self.host.refresh_paths:
            raise ProtocolError(f"this server refreshes by {list(self.host.refresh_paths)} only "
                                f"({self.host.workers} workers)")
        self.refresh = refresh
        sizes, parts = self._check_sizes(msg, blobs_order)
        t0 = time.perf_counter()
        chunks: dict[str, list] = {b: [] for b in blobs_order}
        got = dict.fromkeys(blobs_order, 0)
        blob_i = 0
        with self.chan.step("setup"):
            for i in range(parts):
                self.check_lifetime()
                part = self.chan.recv()
                if isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] == "error":
                    # the client's report, not ours
                    raise ProtocolError(f"keys_part {i}: the client sent an error report instead")
                part = expect(part, "keys_part")
                if type(part.get("index")) is not int or part["index"] != i:
                    raise ProtocolError(f"keys_part {i}: index {part.get('index')!r} out of order")
                if type(part.get("total")) is not int or part["total"] != parts:
                    raise ProtocolError(f"keys_part {i}: total {part.get('total')!r}, announced {parts}")
                blob, data = part.get("blob"), part.get("data")
                while blob_i < len(blobs_order) and got[blobs_order[blob_i]] == sizes[blobs_order[blob_i]]:
                    blob_i += 1
                if blob_i == len(blobs_order) or not isinstance(blob, str) or blob != blobs_order[blob_i]:
                    raise ProtocolError(f"keys_part {i}: blob {blob!r} where "
                                        f"{blobs_order[blob_i] if blob_i < len(blobs_order) else 'nothing'!r} "
                                        "was expected")
                if not isinstance(data, bytes) or not 0 < len(data) <= KEY_CHUNK:
                    raise ProtocolError(f"keys_part {i}: data must be 1..{KEY_CHUNK} bytes")
                left = sizes[blob] - got[blob]
                if len(data) > left:
                    raise ProtocolError(f"keys_part {i}: {len(data)} bytes, {left} left in the {blob} blob")
                if len(data) < min(MIN_KEY_CHUNK, left):
                    raise ProtocolError(f"keys_part {i}: parts below {MIN_KEY_CHUNK} bytes end a blob")
                chunks[blob].append(data)
                got[blob] += len(data)
        short = [b for b in blobs_order if got[b] != sizes[b]]
        if short:
            raise ProtocolError(f"keys: the parts end before the {short[0]} blob is complete")
        be, ctx = self.host.be, self.host.ctx
        blobs = {}
        for b in blobs_order:
            blobs[b] = b"".join(chunks[b])
            chunks[b] = None
        if self.host.executor is not None:
            # loaded and checked by every worker (`_on_workers`: the same loaders and step check
            # as below, HEError for bad keys); not parsed here too, which at N = 2^16 would hold
            # GBs of keys in this process only to drop them.  The blobs stay with the session.
            self.key_blobs = blobs
            self._on_workers()
            self.eval_keys = True
        else:
            relin = be.relin_keys_from_bytes(ctx, blobs["relin"])
            galois = be.galois_keys_from_bytes(ctx, blobs["galois"], required_steps=self.host.rotation_steps,
                                               max_keys=len(self.host.rotation_steps))
            self.eval_keys = relin.merged(galois)
            del relin, galois
            if "bootstrap" in blobs:
                self.bootstrap_keys = be.bootstrapping_keys_from_bytes(ctx, blobs.pop("bootstrap"))
            blobs.clear()
        self.seconds["keys"] += time.perf_counter() - t0
        log.info("session %s: keys loaded (%.1f MB in %d parts, %.1f s; refresh %s)", self.sid,
                 sum(sizes.values()) / 1e6, parts, time.perf_counter() - t0, refresh)
        with self.chan.step("setup"):
            self.chan.send({"type": "ready"})

    # ---- inference

    def _parse_infer(self, msg: dict):
        if self.eval_keys is None:
            raise ProtocolError("infer before keys")
        if "refresh" in msg and (not isinstance(msg["refresh"], str) or msg["refresh"] != self.refresh):
            raise ProtocolError(f"this session refreshes by {self.refresh!r} (chosen with its keys), not "
                                f"{msg['refresh']!r}")
        task = msg.get("task")
        if not isinstance(task, str) or task not in TASKS:
            raise ProtocolError(f"unknown task {task!r} (one of {list(TASKS)})")
        if task not in self.host.tasks:
            raise ProtocolError(f"this server's {self.host.kind} model has no {task!r} task "
                                f"(it serves {list(self.host.tasks)})")
        T = msg.get("tokens")
        if type(T) is not int or not 1 <= T <= self.host.max_tokens:
            raise LimitExceeded(f"tokens must be an integer in 1..{self.host.max_tokens} (this server's "
                                "max_tokens)")
        offset = msg.get("offset", 0)
        if type(offset) is not int or offset < 0 or (offset and task != "logits"):
            raise ProtocolError("offset must be an integer >= 0, and > 0 only for 'logits' (a decoding step)")
        if offset + T > self.host.max_tokens:
            raise LimitExceeded(f"positions up to {offset + T}: this server takes at most {self.host.max_tokens}")
        held = 0 if self.kv is None else self.kv.length
        if offset and offset != held:
            raise ProtocolError(f"a decoding step at position {offset}, but this session's KV cache holds {held} "
                                "positions (offset 0 starts a new one)")
        P = self.host.packing(T, offset)
        n = P.n_cts(self.host.d)
        cts = msg.get("cts")
        if not isinstance(cts, list) or len(cts) != n:
            raise ProtocolError(f"cts must be a list of {n} ciphertexts for {T} tokens of width {self.host.d}")
        cap = self.limits.max_cts_per_request
        if n > cap:
            raise LimitExceeded(f"{n} ciphertexts in one request: this server takes at most {cap}")
        budget = self.limits.max_work_per_session
        if self.work_done + n > budget:
            raise LimitExceeded(f"this request would go past the session's work budget of {budget} ciphertexts")
        be, ctx = self.host.be, self.host.ctx
        parsed = []
        for i, b in enumerate(cts):
            if not isinstance(b, bytes):
                raise ProtocolError(f"ciphertext {i} is not a byte blob")
            parsed.append(be.ciphertext_from_bytes(ctx, b))  # HEError on a malformed blob
        return task, T, P, parsed

    def _infer(self, msg: dict) -> None:
        from cipherlm.protocols.ckks.evaluator import CkksEvaluator, CkksTensor

        task, T, P, cts = self._parse_infer(msg)
        host = self.host
        if host.executor is not None:
            return self._infer_workers(msg, task, T, P, cts)
        self.work_done += len(cts)
        log.info("session %s: infer %s, %d tokens, %d ciphertexts, refresh %s", self.sid, task, T, len(cts),
                 self.refresh)
        if self.refresh == "client":
            ev = CkksEvaluator(host.be, host.ctx, self.eval_keys,
                               refresher=ClientRefresher(host.be, host.ctx, self._client_refresh))
        else:
            ev = CkksEvaluator(host.be, host.ctx, self.eval_keys, self.bootstrap_keys)
        x = CkksTensor(cts, host.d, P, host.model.bound(host.model.input_value))
        t0 = time.perf_counter()
        layers = [0]

        def on_layer(layer, n_layers):
            layers[0] = layer + 1
            log.info("session %s: layer %d of %d done (%.1f s, %d refreshes by %s)", self.sid, layer + 1, n_layers,
                     time.perf_counter() - t0, len(ev.stats.refreshes), ev.refresh_path)
            self.check_alive(f"after layer {layer + 1} of {n_layers}")

        if task == "classify":
            out = host.model.classify(ev, x, on_layer=on_layer)
        else:
            cache = host.model.new_cache(ev) if P.offset == 0 else self.kv
            cache.ev = ev
            self.kv = None  # a pass that fails leaves no half-extended cache behind
            out = host.model.logits(ev, x, on_layer=on_layer, cache=cache)
            self.kv = cache
        seconds = time.perf_counter() - t0
        result = [host.be.ciphertext_to_bytes(c) for c in out.cts]
        st = ev.stats.as_dict()
        st.update(levels=[int(c.level) for c in out.cts], layers=layers[0], seconds_total=round(seconds, 4),
                  refresh=self.refresh, client_refreshes=ev.refresher.rounds if ev.refresher is not None else 0)
        self.seconds.update(ev.stats.seconds)
        self.counts.update(ev.stats.counts)
        self.infers += 1
        if self.server is not None:
            self.server.infers_done += 1
        log.info("session %s: %s done in %.1f s (%d refreshes by %s, %d rotations)", self.sid, task, seconds,
                 st["refreshes"], self.refresh, st["counts"].get("rotate", 0))
        with self.chan.step("fhe"):
            self.chan.send({"type": "result", "task": task, "d": int(out.d), "cts": result, "stats": st})

    def _on_workers(self) -> None:
        """Load this session's keys on the workers unless they hold them (caller: no lock)."""
        with self.host.executor_lock:
            if self.host.executor_session is not self:
                self._load_on_workers()

    def _load_on_workers(self) -> None:
        """Load (and so check) this session's keys on every worker (caller: holds the
        executor lock).  Until the load succeeds no session owns the workers."""
        host = self.host
        host.executor_session = None
        host.executor.open_session(host.preset, host.insecure, self.key_blobs, host.slots, host.ctx.n,
                                   required_steps=host.rotation_steps)
        host.executor_session = self

    def _infer_workers(self, msg: dict, task: str, T: int, P, cts: list) -> None:
        """One pass on the workers (AEGIS): the session's keys loaded there if another
        session used them last (then a decoder's cached keys and values are gone)."""
        host = self.host
        self.work_done += len(cts)
        log.info("session %s: infer %s, %d tokens, %d ciphertexts on %d workers", self.sid, task, T, len(cts),
                 host.workers)
        blobs = [host.be.ciphertext_to_bytes(c) for c in cts]
        t0 = time.perf_counter()
        layers = [0]

        def on_layer(layer, n_layers):
            layers[0] = layer + 1
            log.info("session %s: layer %d of %d done (%.1f s)", self.sid, layer + 1, n_layers,
                     time.perf_counter() - t0)
            self.check_alive(f"after layer {layer + 1} of {n_layers}")

        with host.executor_lock:
            if host.executor_session is not self:
                if P.offset:
                    raise ProtocolError("another session used the workers since this session's last pass: its "
                                        "encrypted KV cache is gone (start again at offset 0)")
                self._load_on_workers()
            try:
                res = host.executor.run(blobs, P, outputs=("logits",), last_only=True, on_layer=on_layer,
                                        classify=task == "classify")
            except HEError as e:
                # a worker died, stalled or refused: fresh workers for the next request
                host.executor_session = None
                log.warning("session %s: the pass failed on the workers (%s); restarting them", self.sid, e)
                try:
                    host.executor.recover()
                except Exception as r:  # noqa: BLE001 - the client still gets the pass's error
                    log.error("restarting the workers failed: %s", type(r).__name__)
                raise
        self.kv = _WorkerCache(P.end) if task == "logits" else None
        seconds = time.perf_counter() - t0
        result = res["outputs"]["logits"]
        levels = [int(host.be.ciphertext_from_bytes(host.ctx, b).level) for b in result]
        counts = Counter()
        for w in res["workers"]:
            counts.update(w["counts"])
        st = {"counts": dict(counts), "seconds": {}, "refreshes": int(counts.get("bootstrap", 0)), "levels": levels,
              "layers": layers[0], "seconds_total": round(seconds, 4), "refresh": self.refresh, "client_refreshes": 0,
              "workers": host.workers, "bytes_between_workers": res["bytes"],
              "collectives": len(res["collectives"])}
        self.counts.update(counts)
        self.infers += 1
        if self.server is not None:
            self.server.infers_done += 1
        log.info("session %s: %s done in %.1f s on %d workers (%.1f MB between workers)", self.sid, task, seconds,
                 host.workers, res["bytes"] / 1e6)
        d = host.model.weights("classifier")[0].shape[0] if task == "classify" else \
            host.model.weights(host.model.graph.linears()[-1].attrs["name"])[0].shape[0]
        with self.chan.step("fhe"):
            self.chan.send({"type": "result", "task": task, "d": int(d), "cts": result, "stats": st})

    def _client_refresh(self, blobs: list[bytes]) -> list:
        """One round of the client-aided refresh: the masked ciphertexts down, the client's
        fresh ones back (checked by `ClientRefresher`); the session's timeouts apply."""
        self.check_lifetime()
        with self.chan.step("fhe"):
            self.chan.send({"type": "refresh", "cts": blobs})
            reply = self.chan.recv()
        if isinstance(reply, dict) and isinstance(reply.get("type"), str) and reply["type"] == "error":
            raise ProtocolError("the client sent an error report instead of the refreshed ciphertexts")
        cts = expect(reply, "refreshed").get("cts")
        if not isinstance(cts, list):
            raise ProtocolError("refreshed: cts must be a list of ciphertexts")
        return cts

    def _stats(self, msg: dict) -> None:
        self.chan.send({"type": "stats", "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
                        "counts": dict(self.counts), "infers": self.infers, "peak_rss_mb": peak_rss_mb(),
                        "work": {"cts": self.work_done, "budget": self.limits.max_work_per_session}})

    handlers = {"get_bundle": _get_bundle, "keys": _keys, "infer": _infer, "stats": _stats}


def run_server(model: str, host: str, port: int, timeout: float | None = None, limits: ServerLimits | None = None,
               preset: str = DEFAULT_PRESET, insecure_test_preset: bool = False,
               max_tokens: int = DEFAULT_MAX_TOKENS, workers: int = 1, ray_address: str | None = None) -> None:
    """Entry point of ``cipherlm serve --mode fhe`` (`timeout` None: `DEFAULT_TIMEOUT`; `limits`
    None: `DEFAULT_LIMITS`; the INSECURE test preset only with ``insecure_test_preset``)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if preset == TEST_PRESET or insecure_test_preset:
        print("WARNING: " + ("the fhe server runs the INSECURE test preset " + TEST_PRESET +
                             ": no security at all, for tests only" if preset == TEST_PRESET else
                             "--insecure-test-preset given, but the preset is " + preset),
              file=sys.stderr, flush=True)
    log.info("calibrating %s for the fhe mode (preset %s, up to %d tokens) ...", model, preset, max_tokens)
    fhe_host = FheHost(model, preset=preset, max_tokens=max_tokens, insecure_test_preset=insecure_test_preset,
                       workers=workers, ray_address=ray_address)
    server = FheServer(fhe_host, host, port, session_timeout=timeout, limits=limits)
    h, p = server.address
    log.info("model %s (%s, %d layers) ready in %.1f s: preset %s, %d slots, %d rotation keys, "
             "bootstrapping keys %.2f GB per session, sessions in threads, %d worker(s)", fhe_host.name, fhe_host.kind,
             fhe_host.n_layers, fhe_host.startup_seconds, preset, fhe_host.slots, len(fhe_host.rotation_steps),
             fhe_host.key_sizes["bootstrap"] / 1e9, fhe_host.workers)
    print(f"LISTENING {h}:{p}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
