"""Offload-mode client: keeps the keys, runs everything but the projections.

Client side of the client-aided offload protocol (``fhe_offload_llama_003``
sections 4-6, messages in :mod:`cipherlm.runtime.offload_protocol`).  The
client runs the same executor as the plaintext reference, with a
:class:`RemoteLinear` backend: each projection group's input rows are
encrypted, sent in one message, evaluated by the server under CKKS, returned,
decrypted.  Norms, RoPE, attention, softmax, activations, sampling and the KV
cache stay on the client, in the clear, never sent.

The small parameters the client needs (embedding table, norm weights,
position embeddings, tokenizer) come from the server once per model as a
*client bundle*, cached under the user cache directory by its digest
(`cipherlm.runtime.bundle`).  The client checks what the server sends before
it uses it: the welcome's types (`plan_check.check_offload_welcome`), the HE
parameters at 128-bit security (`offload_engine.ClientEngine`), and the
bundle's sha256 against the welcome's digest, on download (a mismatch is a
`ProtocolError` and nothing is cached) and again when it is read from the
cache (a tampered entry is not used: the bundle is downloaded again).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Sequence

import numpy as np

from cipherlm.net.channel import TCPChannel
from cipherlm.progress import Progress
from cipherlm.runtime import offload_engine
from cipherlm.runtime.bundle import check_bundle, check_chat_template, load_bundle, store_bundle
from cipherlm.runtime.linear_groups import LinearGroup
from cipherlm.runtime.offload_protocol import PROTOCOL_VERSION, ProtocolError, expect
from cipherlm.runtime.plan_check import check_offload_welcome
from cipherlm.runtime.session_server import SessionClient


class OffloadClient(SessionClient):
    """A session with an offload server: set-up, then a LinearBackend for the executor."""

    def __init__(self, host: str, port: int, model: str | None = None, timeout: float = 300.0, progress=None):
        self.t_start = time.perf_counter()
        self.chan = TCPChannel.connect(host, port, timeout=timeout)
        self.seconds = defaultdict(float)  # client compute per operator class
        try:
            self._setup(model, progress)
        except BaseException:
            self.chan.close()
            raise
        self.setup_seconds = time.perf_counter() - self.t_start
        self.backend = RemoteLinear(self)

    def _setup(self, model: str | None, progress) -> None:
        with self.chan.step("setup"):
            self.chan.send({"type": "hello", "protocol": PROTOCOL_VERSION, "mode": "offload", "model": model})
            welcome = check_offload_welcome(expect(self.chan.recv(), "welcome"), PROTOCOL_VERSION)
        self.model = welcome["model"]
        self.config = welcome["config"]
        self.labels = welcome.get("labels")
        # the model's chat template (None or {template, bos_token, eos_token}): types and sizes checked
        # here; it is code from the server, compiled and rendered in the Jinja sandbox by the proxy
        self.chat_template = check_chat_template(welcome.get("chat_template"))
        self.groups = [
            LinearGroup(i, tuple(g["names"]), g["d_in"], tuple(g["d_outs"]))
            for i, g in enumerate(welcome["groups"])
        ]
        self._group_of = {g.names: g for g in self.groups}
        digest = welcome["bundle_digest"]
        self.bundle_from_cache = True
        cached = load_bundle(digest)  # hashed again: a tampered cache entry is a miss
        if cached is None:
            self.bundle_from_cache = False
            if progress:
                progress("downloading the client bundle (once per model)")
            with self.chan.step("setup"):
                self.chan.send({"type": "get_bundle"})
                bundle = expect(self.chan.recv(), "bundle")
            cached = check_bundle(bundle.get("tensors"), bundle.get("tokenizer"))
            store_bundle(digest, *cached)  # sha256 checked against the digest first; mismatch: nothing cached
        tensors, tokenizer_json = cached
        self.client_params = dict(tensors)
        # a tied LM head: the bundle's embedding matrix, computed here in the clear
        self.client_lm_head = None
        head = welcome.get("client_lm_head")
        if head is not None:
            from cipherlm.runtime.plain import PlainLinear

            E = self.client_params.get(head)
            vocab = self.config.get("vocab_size")
            if E is None or np.ndim(E) != 2 or ("lm_head",) in self._group_of or (
                    isinstance(vocab, int) and np.shape(E)[0] != vocab):
                raise ProtocolError(f"the server's client_lm_head {head[:60]!r} is not a matrix of the bundle "
                                    "(or the server serves lm_head too)")
            self.client_lm_head = PlainLinear({"lm_head": (E, None)})
        self.tokenizer = None
        if tokenizer_json is not None:
            from tokenizers import Tokenizer

            try:
                self.tokenizer = Tokenizer.from_str(tokenizer_json)
            except Exception as exc:
                raise ProtocolError(f"the bundle's tokenizer does not load: {type(exc).__name__}") from None
        t0 = time.perf_counter()
        self.engine = offload_engine.ClientEngine(welcome, self.groups)
        msg = self.engine.keys_message()
        self.seconds["setup"] += time.perf_counter() - t0
        with self.chan.step("setup"):
            self.chan.send(msg)
            expect(self.chan.recv(), "ready")

    def executor(self, profiler=None):
        from cipherlm.runtime.plain import make_executor

        return make_executor(self.config, self.client_params, self.backend, profiler=profiler)



class RemoteLinear:
    """LinearBackend whose projections run on the server under CKKS.

    A forward pass over several token rows (prompt prefill, an encoder
    sentence) shows a progress line over the projection groups on stderr.
    """

    def __init__(self, client: OffloadClient, show_progress: bool = True):
        self.client = client
        self.show_progress = show_progress
        self._bar = None
        self._calls = 0

    def linear(self, x: np.ndarray, names: Sequence[str]) -> list[np.ndarray]:
        c = self.client
        if c.client_lm_head is not None and tuple(names) == ("lm_head",):
            t0 = time.perf_counter()  # the tied head: the embedding matrix, in the clear
            y = c.client_lm_head.linear(x, names)
            c.seconds["lm_head"] += time.perf_counter() - t0
            return y
        group = c._group_of.get(tuple(names))
        if group is None:
            raise ProtocolError(f"the server offers no projection group {tuple(names)}")
        rows = np.asarray(x, dtype=np.float64).reshape(-1, group.d_in)
        # several rows (a prefill): T rows per ciphertext where the server offers a packed plan
        per_ct = c.engine.packed_rows(group.index) if len(rows) > 1 else 1
        packs = [rows[i : i + per_ct] for i in range(0, len(rows), per_ct)] if per_ct > 1 else None
        t0 = time.perf_counter()
        if packs is None:
            cts = [c.engine.encrypt(group.index, row) for row in rows]
        else:
            cts = [c.engine.encrypt_packed(group.index, pack) for pack in packs]
        c.seconds["encrypt"] += time.perf_counter() - t0
        msg = {"type": "linear", "group": group.index, "cts": cts}
        if packs is not None:
            msg["packed"] = True
        with c.chan.step(group.op_class):
            c.chan.send(msg)
            reply = expect(c.chan.recv(), "result")
        out_cts = reply.get("cts")
        if not isinstance(out_cts, list) or len(out_cts) != len(cts):
            raise ProtocolError("server returned the wrong number of results")
        t0 = time.perf_counter()
        if packs is None:
            y = np.stack([c.engine.decrypt(group.index, ct) for ct in out_cts])
        else:
            y = np.concatenate([c.engine.decrypt_packed(group.index, ct, len(pack))
                                for ct, pack in zip(out_cts, packs)])
        c.seconds["decrypt"] += time.perf_counter() - t0
        self._progress(group, len(rows))
        y = y.reshape(*np.shape(x)[:-1], group.d_out)
        splits = np.cumsum(group.d_outs)[:-1]
        return list(np.split(y, splits, axis=-1))

    def _progress(self, group: LinearGroup, n_rows: int) -> None:
        if not self.show_progress:
            return
        if group.index == 0:
            self._calls = 0
            if self._bar is not None:
                self._bar.__exit__()
            self._bar = Progress(f"encrypted forward pass, {n_rows} tokens") if n_rows > 1 else None
        self._calls += 1
        if self._bar is not None:
            total = len(self.client.groups)
            self._bar.update(min(self._calls, total), total)
            if self._calls >= total:
                self._bar.__exit__()
                self._bar = None
