"""One executor for every model graph (`cipherlm.compile`): the walk over the nodes,
the KV cache and the greedy generate loop, written once.

`GraphExecutor(graph, params, linear=...)` walks `graph.nodes` in order; each node is
evaluated by the backend's method of the same name as its op (`PlainBackend`: numpy,
float64), except

* ``linear``: the projections of one group (`compile.passes.group_linears`) go in one
  `LinearBackend.linear(x, names)` call when the group's first member is reached, so
  a remote backend (the offload mode's RemoteLinear) sees the same calls as with the
  hand-written executors;
* ``kv_cache``: the executor's `KVCache` (the plaintext executor's) appends this pass's
  keys and values and hands back all of them;
* a value that is None (an MoE expert no token was routed to) makes every node that
  reads it produce None, and ``combine`` skips it: nothing is evaluated for that expert.

Decoders: `forward(ids, cache, last_only)` -> logits, `generate` (prefill + one token
per step). Encoders (BERT): `encode(ids, mask, token_types)` -> (hidden, pooled).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from cipherlm.compile import passes
from cipherlm.compile.ir import Graph, Node
from cipherlm.compile.weights import linear_weights

from . import ops
from .plain import KVCache, PlainLinear


def _heads(x: np.ndarray, H: int) -> np.ndarray:
    """(S, H*hd) -> (H, S, hd); already per-head arrays (from the KV cache) pass through."""
    return x.reshape(x.shape[0], H, -1).transpose(1, 0, 2) if x.ndim == 2 else x


class PlainBackend:
    """The non-linear operators in numpy (float64); `params` are the bound graph tensors."""

    def __init__(self, params: dict[str, np.ndarray]):
        self.p = params
        self._f64: dict[str, np.ndarray] = {}

    def _vec(self, name: str | None):
        if name is None:
            return None
        v = self._f64.get(name)
        if v is None:
            v = self._f64[name] = np.asarray(self.p[name], np.float64)
        return v

    # ---- ops (one method per op of cipherlm.compile.ir.OPS, except linear / kv_cache)

    def embed(self, node: Node, ids, ctx):
        table = self.p[node.weights[0]]
        ids = np.asarray(ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
            raise ValueError(f"{node.name}: index out of range 0..{table.shape[0] - 1}")
        return np.asarray(table[ids], np.float64)

    def layer_norm(self, node, x, ctx):
        return ops.layer_norm(x, self._vec(node.attrs["gamma"]), self._vec(node.attrs.get("beta")), node.attrs["eps"])

    def rms_norm(self, node, x, ctx):
        g = self._vec(node.attrs.get("gamma"))
        return ops.rms_norm(x, 1.0 if g is None else g, node.attrs["eps"])

    def rope(self, node, x, ctx):
        H, hd = node.attrs["heads"], node.attrs["head_dim"]
        T = x.shape[0]
        h = x.reshape(T, H, hd).transpose(1, 0, 2)
        if node.attrs.get("interleave"):  # pairs (2j, 2j+1) -> halves, as HF's *_interleave rope
            h = h.reshape(H, T, hd // 2, 2).transpose(0, 1, 3, 2).reshape(H, T, hd)
        h = ops.apply_rope(h, ctx["positions"], ops.rope_inv_freq(hd, node.attrs["theta"]))
        return h.transpose(1, 0, 2).reshape(T, H * hd)

    def qk(self, node, q, k, ctx):
        H, Hkv, hd = node.attrs["heads"], node.attrs["kv_heads"], node.attrs["head_dim"]
        T = q.shape[0]
        k = _heads(k, Hkv)
        S = k.shape[1]
        rep = H // Hkv
        qh = q.reshape(T, H, hd).transpose(1, 0, 2)
        qg = qh.reshape(Hkv, rep * T, hd) if rep > 1 else qh
        s = (qg @ k.transpose(0, 2, 1)).reshape(H, T, S) * node.attrs["scale"]
        if node.attrs.get("causal"):
            qpos = ctx["pos0"] + np.arange(T)[:, None]
            kpos = np.arange(S)[None, :]
            mask = kpos > qpos
            w = node.attrs.get("sliding_window")
            if w is not None:
                mask |= (qpos - kpos) >= w
            s = np.where(mask[None], -np.inf, s)
        if ctx.get("key_mask") is not None:
            s = s + ctx["key_mask"][None, None, :]
        return s

    def softmax(self, node, s, ctx):
        return ops.softmax(s, axis=-1)

    def av(self, node, p, v, ctx):
        H, Hkv = node.attrs["heads"], node.attrs["kv_heads"]
        _, T, S = p.shape
        v = _heads(v, Hkv)
        rep = H // Hkv
        pg = p.reshape(Hkv, rep * T, S) if rep > 1 else p
        out = (pg @ v).reshape(H, T, v.shape[-1])
        return out.transpose(1, 0, 2).reshape(T, -1)

    _ACT = {"sigmoid": ops.sigmoid, "tanh": np.tanh, "gelu_tanh": ops.gelu_tanh}

    def activation(self, node, x, ctx):
        fn = node.attrs["fn"]
        return (self._ACT.get(fn) or ops.activation(fn))(x)

    def mul(self, node, a, b, ctx):
        return a * b

    def add(self, node, a, b, ctx):
        return a + b

    def clip(self, node, x, ctx):
        c = node.attrs["c"]
        return np.clip(x, -c, c)

    def split(self, node, x, ctx):
        sizes, H = node.attrs["sizes"], node.attrs.get("heads")
        if H:  # per head: (T, H, sum sizes) -> parts (T, H * size)
            h = x.reshape(x.shape[0], H, sum(sizes))
            cuts = np.cumsum(sizes)[:-1]
            return tuple(p.reshape(x.shape[0], -1) for p in np.split(h, cuts, axis=-1))
        return tuple(np.split(x, np.cumsum(sizes)[:-1], axis=-1))

    def concat(self, node, *xs, ctx):
        H = node.attrs.get("heads")
        if not H:
            return np.concatenate(xs, axis=-1)
        T = xs[0].shape[0]
        bc = node.attrs.get("broadcast") or (False,) * len(xs)
        parts = [np.broadcast_to(x.reshape(T, 1, -1), (T, H, x.shape[-1] // 1)) if b else x.reshape(T, H, -1)
                 for x, b in zip(xs, bc)]
        return np.concatenate(parts, axis=-1).reshape(T, -1)

    def topk(self, node, logits, ctx):
        a = node.attrs
        k = a["k"]
        if a["scoring"] == "softmax":
            probs = ops.softmax(logits, axis=-1)
            top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
            w = np.take_along_axis(probs, top, axis=-1)
            if a["norm_topk_prob"]:
                w = w / w.sum(axis=-1, keepdims=True)
            return top, w
        # DeepSeek-V3: sigmoid scores; choice by score + correction bias within the best groups
        scores = ops.sigmoid(logits)
        choice = scores + self._vec(a["score_bias"])[None]
        T, n = choice.shape
        G = a["n_group"]
        grp = np.sort(choice.reshape(T, G, n // G), axis=-1)[..., -2:].sum(-1)
        keep_g = np.argsort(-grp, axis=-1, kind="stable")[:, : a["topk_group"]]
        gmask = np.zeros((T, G), bool)
        np.put_along_axis(gmask, keep_g, True, axis=-1)
        choice = np.where(np.repeat(gmask, n // G, axis=-1), choice, 0.0)
        top = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
        w = np.take_along_axis(scores, top, axis=-1)
        if a["norm_topk_prob"]:
            w = w / (w.sum(axis=-1, keepdims=True) + 1e-20)
        return top, w * a["routed_scale"]

    def dispatch(self, node, x, top, w, ctx):
        rows, slot = np.nonzero(top == node.attrs["expert"])
        if rows.size == 0:
            return None, None
        return x[rows], (rows, w[rows, slot])

    def combine(self, node, *ys, ctx):
        out = None
        for y, sel in zip(ys[0::2], ys[1::2]):
            if y is None:
                continue
            if out is None:
                out = np.zeros((ctx["T"], y.shape[1]))
            rows, w = sel
            np.add.at(out, rows, w[:, None] * y)
        return out if out is not None else np.zeros((ctx["T"], node.shape[-1]))

    def head(self, node, x, ctx):
        sel = node.attrs["select"]
        if sel == "first":
            return x[:1]
        return x[-1:] if ctx.get("last_only") else x

    def argmax(self, node, logits, ctx):
        return np.argmax(logits, axis=-1)


class GraphExecutor:
    """Walks a graph over a backend; `linear` is any `LinearBackend` (default: `PlainLinear`
    over the bound weights)."""

    def __init__(self, graph: Graph, params: dict[str, np.ndarray], linear=None, backend=None,
                 dtype=np.float32):
        if "linear_groups" not in graph.meta:
            graph = passes.group_linears.run(graph)
        self.graph = graph
        self.params = params
        self.groups = [names for names, _, _ in graph.meta["linear_groups"]]
        self.linear = linear if linear is not None else PlainLinear(linear_weights(graph, params), dtype=dtype)
        self.backend = backend if backend is not None else PlainBackend(params)
        self.config = graph.config

    @classmethod
    def from_hf(cls, config: dict, weights: dict[str, np.ndarray], **kw) -> "GraphExecutor":
        from cipherlm.compile import bind, build_graph
        g = build_graph(config)
        return cls(g, bind(g, weights), **kw)

    # ---- the walk

    def run(self, inputs: dict, ctx: dict, cache: KVCache | None = None) -> dict:
        vals = dict(inputs)
        group_out: dict[int, dict[str, np.ndarray]] = {}
        for node in self.graph.nodes:
            ins = [vals[v] for v in node.inputs]
            if node.op != "combine" and any(x is None for x in ins):
                res = (None,) * len(node.outputs)
            elif node.op == "linear":
                gi = node.attrs["group"]
                if gi not in group_out:
                    names = self.groups[gi]
                    group_out[gi] = dict(zip(names, self.linear.linear(ins[0], list(names))))
                res = (group_out[gi][node.attrs["name"]],)
            elif node.op == "kv_cache":
                Hkv = node.attrs["kv_heads"]
                k, v = (_heads(t, Hkv) for t in ins)
                res = cache.extend(node.attrs["layer"], k, v)
            else:
                r = getattr(self.backend, node.op)(node, *ins, ctx=ctx)
                res = r if len(node.outputs) > 1 else (r,)
            for name, value in zip(node.outputs, res):
                vals[name] = value
        return {role: vals[v] for role, v in self.graph.outputs.items()}

    # ---- decoders

    def new_cache(self) -> KVCache:
        return KVCache(self.graph.n_layers)

    def _decode_pass(self, ids, cache: KVCache | None, last_only: bool) -> dict:
        if self.graph.kind != "decoder":
            raise ValueError("forward/generate are for decoders; use encode() for encoders")
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("empty input")
        cache = self.new_cache() if cache is None else cache
        pos0, T = cache.length, ids.size
        positions = np.arange(pos0, pos0 + T)
        ctx = {"pos0": pos0, "T": T, "positions": positions, "last_only": last_only}
        out = self.run({"ids": ids, "positions": positions}, ctx, cache)
        cache.length = pos0 + T
        return out

    def forward(self, ids: Sequence[int], cache: KVCache | None = None, last_only: bool = False) -> np.ndarray:
        """Logits (T, vocab) of `ids` after what `cache` holds ((1, vocab) with last_only)."""
        return self._decode_pass(ids, cache, last_only)["logits"]

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 32,
                 eos_token_ids: Iterable[int] | int | None = None, return_logits: bool = False):
        """Greedy: prefill the prompt, then one token per step with the KV cache."""
        if eos_token_ids is None:
            eos = self.config.get("eos_token_id")
            eos_token_ids = [] if eos is None else eos
        eos = {int(eos_token_ids)} if isinstance(eos_token_ids, (int, np.integer)) else {int(e) for e in eos_token_ids}
        cache = self.new_cache()
        ids, out, logits = list(prompt_ids), [], []
        for _ in range(max_new_tokens):
            res = self._decode_pass(ids, cache, last_only=True)
            tok = int(res["next_token"][-1])
            out.append(tok)
            logits.append(res["logits"][-1])
            if tok in eos:
                break
            ids = [tok]
        return (out, logits) if return_logits else out

    # ---- encoders

    def encode(self, ids, attention_mask=None, token_type_ids=None) -> tuple[np.ndarray, np.ndarray]:
        """(hidden (B, T, d), pooled (B, d)) for (B, T) ids ((T, d), (d,) for (T,) ids)."""
        if self.graph.kind != "encoder":
            raise ValueError("encode() is for encoders")
        ids = np.asarray(ids, np.int64)
        single = ids.ndim == 1
        ids = ids[None] if single else ids
        B, T = ids.shape
        mask = np.ones((B, T)) if attention_mask is None else np.asarray(attention_mask, np.float64).reshape(B, T)
        tt = np.zeros((B, T), np.int64) if token_type_ids is None else np.asarray(token_type_ids).reshape(B, T)
        hid, pooled = [], []
        for r in range(B):
            ctx = {"pos0": 0, "T": T, "positions": np.arange(T),
                   "key_mask": np.where(mask[r] > 0, 0.0, np.finfo(np.float32).min)}
            out = self.run({"ids": ids[r], "positions": np.arange(T), "token_types": tt[r]}, ctx)
            hid.append(out["hidden"])
            pooled.append(out["pooled"][0])
        hid, pooled = np.stack(hid), np.stack(pooled)
        return (hid[0], pooled[0]) if single else (hid, pooled)
