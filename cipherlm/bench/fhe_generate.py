"""Greedy generation in the fhe mode, resumable layer by layer (issue 17's SmolLM2 acceptance
run: "greedy generation of 2 tokens in fhe mode").

Client and server run in this process, as in `cipherlm.bench.fhe`: the client embeds and
encrypts the prompt, the server walks the decoder's layers on ciphertexts (`FheModel`: token
group packing, polynomial nonlinearities, refreshes where levels run out, the KV cache kept
encrypted), the client decrypts the last position's logits and picks the argmax, which is the
next pass's input (one token at the next position, against the encrypted cache).  The same
passes the served mode runs (`runtime.fhe_server`), split at layer boundaries.

Why resumable: SmolLM2-135M's 30 layers take several minutes each on this 2-core machine
(docs/fhe.md), hours per pass, longer than a working session.  After every layer the
checkpoint directory receives, atomically (write, then rename):

* ``p{pass}_h{layer}.ct``: the encrypted residual stream leaving the layer;
* ``p{pass}_kv{layer}.ct``: the layer's encrypted KV cache after the pass;
* ``meta.json``: the run's parameters, the layers done, per-layer seconds and op counts, and
  each finished pass's token and logits error.

A later call with the same directory and parameters continues after the last finished layer
(another run's directory is refused).  ``secret.npy`` (mode 0600) holds the *client's* secret
key, a ternary polynomial of the preset's Hamming weight drawn with `secrets` (a CSPRNG), so
that a resumed run decrypts what an earlier process encrypted; the evaluation keys are made
again from it.  The directory therefore belongs to the client: in a deployment the server
would keep the ciphertexts and the client the secret.  Nothing else about the keys is stored.

Checked against the plain executor (float64): the same greedy tokens, and the max absolute
error of the decrypted logits per pass, next to the plain top-1 / top-2 margin.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from cipherlm.he.errors import HEError

#: the file names in a checkpoint directory
META, SECRET = "meta.json", "secret.npy"


def ternary_secret(n: int, hamming_weight: int | None) -> np.ndarray:
    """A ternary secret of N coefficients from the CSPRNG: exactly ``hamming_weight`` of them
    +-1 (the sparse secrets of the bootstrapping presets, e.g. H = 192), or every coefficient
    uniform in {-1, 0, 1} when None."""
    rnd = secrets.SystemRandom()
    s = np.zeros(n, np.int8)
    if hamming_weight is None:
        s[:] = [rnd.randrange(3) - 1 for _ in range(n)]
    else:
        for i in rnd.sample(range(n), int(hamming_weight)):
            s[i] = 1 if rnd.randrange(2) else -1
    return s


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Checkpoint:
    """A resumable run's directory (see the module docstring)."""

    def __init__(self, root, run: dict, backend, ctx):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.be, self.ctx = backend, ctx
        meta = self.root / META
        if meta.exists():
            self.meta = json.loads(meta.read_text())
            if self.meta.get("run") != run:
                raise HEError(f"{self.root} holds another run ({self.meta.get('run')}); this one is {run}: "
                              "pick another directory")
        else:
            self.meta = {"run": run, "layers_done": {}, "layers": [], "passes": []}

    # -- the client's secret
    def secret(self, hamming_weight: int | None) -> np.ndarray:
        path = self.root / SECRET
        if path.exists():
            s = np.load(path)
            if s.shape != (self.ctx.n,) or not np.isin(s, (-1, 0, 1)).all():
                raise HEError(f"{path} is not a ternary secret of N = {self.ctx.n}")
            return s
        s = ternary_secret(self.ctx.n, hamming_weight)
        fd = os.open(path.with_name(SECRET + ".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            np.save(f, s)
        os.replace(path.with_name(SECRET + ".tmp"), path)
        return s

    # -- encrypted tensors
    def save_tensor(self, name: str, t) -> int:
        """``t`` (a `CkksTensor`) as ``name``.ct: a JSON header (channels, bound, packing,
        position, ciphertext sizes), then the serialised ciphertexts.  Returns the bytes."""
        blobs = [self.be.ciphertext_to_bytes(c) for c in t.cts]
        P = t.packing
        head = json.dumps({"d": t.d, "bound": t.bound, "position": t.position, "sizes": [len(b) for b in blobs],
                           "packing": [P.slots, P.tokens, P.tp_min, P.offset]}).encode()
        data = len(head).to_bytes(4, "little") + head + b"".join(blobs)
        _write_atomic(self.root / f"{name}.ct", data)
        return len(data)

    def load_tensor(self, name: str):
        from cipherlm.protocols.ckks.evaluator import CkksTensor
        from cipherlm.protocols.ckks.packing import TokenPacking

        data = (self.root / f"{name}.ct").read_bytes()
        n = int.from_bytes(data[:4], "little")
        head = json.loads(data[4:4 + n])
        cts, off = [], 4 + n
        for size in head["sizes"]:
            cts.append(self.be.ciphertext_from_bytes(self.ctx, data[off:off + size]))
            off += size
        if off != len(data):
            raise HEError(f"{name}.ct: {len(data) - off} bytes after its ciphertexts")
        slots, tokens, tp_min, offset = head["packing"]
        return CkksTensor(cts, head["d"], TokenPacking(slots, tokens, tp_min=tp_min, offset=offset),
                          head["bound"], head["position"])

    def remove(self, name: str) -> None:
        (self.root / f"{name}.ct").unlink(missing_ok=True)

    # -- progress
    def done(self, p: int) -> int:
        """Layers of pass ``p`` finished."""
        return int(self.meta["layers_done"].get(str(p), 0))

    def commit(self, **changes) -> None:
        """Update meta.json (after the files it refers to are written)."""
        self.meta.update(changes)
        _write_atomic(self.root / META, json.dumps(self.meta, indent=1, default=float).encode())


def _stats_delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


def generate(lm, ids: Sequence[int], new_tokens: int, checkpoint, *, calibration: Sequence[Sequence[int]],
             preset: str = "N16QP1546H192H32", insecure: bool = False, refresh: str = "client",
             max_layers: int | None = None, progress: Callable[[str], None] = print) -> dict:
    """Greedy generation of ``new_tokens`` tokens after prompt ``ids`` in the fhe mode,
    checkpointed in directory ``checkpoint`` after every layer and resumed from it.

    ``calibration``: the token id lists the approximation ranges are measured on (not the
    prompt).  ``refresh``: "client" (the client-aided refresh, no bootstrapping keys) or
    "bootstrap".  ``max_layers``: stop after this many layers in this call (the rest in a later
    call).  Returns the report: ``complete``, the fhe and plain tokens, per pass the logits
    error and the plain margin, per layer seconds (in all and by kind) and op counts."""
    from cipherlm.he import get_backend
    from cipherlm.protocols.ckks.evaluator import CkksEvaluator, CkksTensor
    from cipherlm.protocols.ckks.refresh import ClientRefresher, reencrypt_blobs
    from cipherlm.runtime.fhe_executor import calibrated_model, client_embedding, client_tensors
    from cipherlm.runtime.plain import plain_executor

    if refresh not in ("client", "bootstrap"):
        raise HEError(f"refresh must be 'client' or 'bootstrap', got {refresh!r}")
    ids = [int(i) for i in ids]
    if not ids or new_tokens < 1:
        raise HEError("a prompt of at least one token and at least one new token")
    model = calibrated_model(lm, [np.asarray(c, np.int64) for c in calibration])
    model.cache_plaintexts = preset.startswith("test-insecure")
    graph = model.graph
    if graph.kind != "decoder":
        raise HEError("greedy generation needs a decoder")
    be = get_backend("lattigo")
    ctx = be.bootstrappable_context(preset, allow_insecure_for_tests=insecure)
    run = {"model": lm.name, "prompt": ids, "new_tokens": int(new_tokens), "preset": preset, "refresh": refresh,
           "calibration": _digest([[int(t) for t in c] for c in calibration])}
    ck = Checkpoint(checkpoint, run, be, ctx)
    max_tokens = len(ids) + new_tokens - 1  # the last new token never goes through the model
    t0 = time.perf_counter()
    sk = be.secret_keys_from_ternary(ctx, ck.secret(getattr(ctx, "secret_hamming_weight", None)))
    steps = list(model.rotation_steps(model.packing(ctx.slots, max_tokens)))
    ek = sk.eval_keys(relin=True, steps=steps)
    bk = sk.bootstrapping_keys() if refresh == "bootstrap" else None
    refresh_bytes = {"down": 0, "up": 0}

    def exchange(blobs):  # the round trip to the client, in process
        refresh_bytes["down"] += sum(map(len, blobs))
        back = reencrypt_blobs(be, ctx, sk, blobs)
        refresh_bytes["up"] += sum(map(len, back))
        return back

    ev = (CkksEvaluator(be, ctx, ek, bk) if bk is not None
          else CkksEvaluator(be, ctx, ek, refresher=ClientRefresher(be, ctx, exchange)))
    progress(f"fhe generate: keys in {time.perf_counter() - t0:.1f} s ({len(steps)} rotation keys, "
             f"{'bootstrapping keys' if bk is not None else 'client refresh'})")

    need = model.executor.needed([graph.outputs["logits"]])
    client = {n.name for n in model.client}
    nodes = [n for n in graph.nodes if n.name in need and n.name not in client]
    by_layer = [[n for n in nodes if n.layer == i] for i in range(graph.n_layers)]
    tail = [n for n in nodes if n.layer is None]
    walker = model._executor(ev)
    tokens = [int(p["token"]) for p in ck.meta["passes"]]
    ran = 0
    try:
        for p in range(len(tokens), new_tokens):
            inp = ids if p == 0 else [tokens[-1]]
            offset = 0 if p == 0 else len(ids) + p - 1
            P = model.packing(ctx.slots, len(inp), max_tokens, offset=offset)
            positions = np.arange(offset, offset + len(inp))
            pctx = model._ctx(len(inp), positions, True)
            start = ck.done(p)
            if start == 0:
                emb = client_embedding(graph, client_tensors(model), inp, positions=positions)
                x = CkksTensor([sk.encrypt(be.encode_slots(ctx, r)) for r in P.pack(emb)], emb.shape[1], P,
                               model.bound(model.input_value))
            else:
                x = ck.load_tensor(f"p{p}_h{start - 1}")
            cache = model.new_cache(ev)
            cache.length = offset
            for i in range(start, graph.n_layers):
                if max_layers is not None and ran >= max_layers:
                    progress(f"fhe generate: stopping after {ran} layers in this call (pass {p}, layer {i} next)")
                    return _report(ck, lm, ids, new_tokens, complete=False, refresh_bytes=refresh_bytes)
                if p > 0:
                    cache.k[i] = ck.load_tensor(f"p{p - 1}_k{i}")
                    cache.v[i] = ck.load_tensor(f"p{p - 1}_v{i}")
                src, dst = model.executor.layer_io(i)
                before, before_s = dict(ev.stats.counts), dict(ev.stats.seconds)
                t1 = time.perf_counter()
                x = walker.run_nodes(by_layer[i], {src: x}, pctx, cache)[dst]
                sec = time.perf_counter() - t1
                ck.save_tensor(f"p{p}_h{i}", x)
                ck.save_tensor(f"p{p}_k{i}", cache.k[i])
                ck.save_tensor(f"p{p}_v{i}", cache.v[i])
                layers = ck.meta["layers"] + [{"pass": p, "layer": i, "seconds": round(sec, 2),
                                               "level_out": x.level,
                                               "counts": _stats_delta(before, dict(ev.stats.counts)),
                                               "seconds_by_kind": {k: round(v, 2) for k, v in _stats_delta(
                                                   before_s, dict(ev.stats.seconds)).items()}}]
                ck.commit(layers_done={**ck.meta["layers_done"], str(p): i + 1}, layers=layers)
                for old in ([f"p{p}_h{i - 1}"] if i > 0 else []) + ([f"p{p - 1}_k{i}", f"p{p - 1}_v{i}"] if p else []):
                    ck.remove(old)
                ran += 1
                progress(f"fhe generate: pass {p + 1}/{new_tokens} layer {i + 1}/{graph.n_layers} in {sec:.0f} s "
                         f"(level {x.level}, {ev.stats.counts.get('bootstrap', 0)} bootstraps, "
                         f"{len(ev.stats.refreshes)} refreshes in this call)")
            t1 = time.perf_counter()
            src = model.executor.layer_io(graph.n_layers - 1)[1]
            logits_t = walker.run_nodes(tail, {src: x}, pctx, cache)[graph.outputs["logits"]]
            s = np.stack([be.decode_slots(ctx, sk.decrypt(c)) for c in logits_t.cts]).reshape(-1, logits_t.packing.tp)
            logits = s[: logits_t.d, offset + len(inp) - 1].real
            tok = int(np.argmax(logits))
            np.save(ck.root / f"logits_p{p}.npy", logits)
            tokens.append(tok)
            ck.commit(passes=ck.meta["passes"] + [{"pass": p, "token": tok, "head_seconds":
                                                   round(time.perf_counter() - t1, 2)}])
            progress(f"fhe generate: pass {p + 1}/{new_tokens}: token {tok}")
    finally:
        if bk is not None:
            bk.close()
    return _report(ck, lm, ids, new_tokens, complete=True, refresh_bytes=refresh_bytes,
                   plain=plain_executor(lm, dtype=np.float64))


def _digest(obj) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


def _report(ck: Checkpoint, lm, ids, new_tokens: int, *, complete: bool, refresh_bytes: dict, plain=None) -> dict:
    m = ck.meta
    out = {"workload": "fhe-generate", **m["run"], "complete": complete,
           "tokens": [p["token"] for p in m["passes"]], "layers": m["layers"],
           "layer_seconds_total": round(sum(r["seconds"] for r in m["layers"]), 1),
           "refresh_bytes_this_call": dict(refresh_bytes),
           "peak_rss_bytes_this_call": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if plain is not None:
        want = plain.generate(list(ids), max_new_tokens=new_tokens, eos_token_ids=[])
        out["plain_tokens"] = [int(t) for t in want]
        out["identical"] = out["tokens"] == out["plain_tokens"]
        rows = []
        for p in m["passes"]:
            ref = np.asarray(plain.forward(list(ids) + out["tokens"][:p["pass"]])[-1], np.float64)
            got = np.load(ck.root / f"logits_p{p['pass']}.npy")
            top = np.sort(ref)[-2:]
            rows.append({**p, "plain_token": int(np.argmax(ref)), "max_abs_logit_error": float(np.abs(got - ref).max()),
                         "plain_margin": float(top[1] - top[0])})
        out["passes"] = rows
    return out
