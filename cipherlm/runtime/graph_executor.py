"""One executor for every model graph (`cipherlm.compile`): the walk over the nodes,
the KV cache and the greedy generate loop, written once.

`GraphExecutor(graph, params, linear=...)` walks `graph.nodes` in order; each node is
evaluated by the backend's method of the same name as its op (`PlainBackend`: numpy,
float64), except

* ``linear``: the projections of one group (`compile.passes.group_linears`) go in one
  `LinearBackend.linear(x, names)` call when the group's first member is reached, so
  a remote backend (the offload mode's RemoteLinear) sees the same calls as with the
  hand-written executors;
* ``kv_cache``: the executor's `KVCache` appends this pass's
  keys and values and hands back all of them;
* a value that is None (an MoE expert no token was routed to) makes every node that
  reads it produce None, and ``combine`` skips it: nothing is evaluated for that expert.

Decoders: `forward(ids, cache, last_only)` -> logits, `generate` (prefill + one token
per step, greedy or temperature / top-k / top-p sampling). Encoders (BERT):
`encode(ids, mask, token_types)` -> (hidden, pooled); a batch of B sentences runs as
one pass over B*T rows (one linear call per group), attention per sentence.

`DecoderExecutor` / `EncoderExecutor` (what `cipherlm.runtime.plain.make_executor`
returns) build the graph from a config and the client-side parameters
(`plain.split_params`), and keep the plaintext executor's surface: a profiler
(`add_seconds(op_class, seconds)` or a callable; op classes from
`cipherlm.compile.ir.OP_CLASS`), MoE balanced routing (`moe_routing`,
`last_routing`, `last_moe_dispatch`), `trace_one_token`, and for encoders the
sentence embedding and the "classifier" head.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable, Protocol, Sequence

import numpy as np

from cipherlm.compile import passes
from cipherlm.compile.ir import OP_CLASS, Graph, Node
from cipherlm.compile.weights import linear_weights

from . import ops

_NO_METER = contextlib.nullcontext()

#: op classes of the graph not timed by the profiler (the plaintext executor never timed them)
_UNTIMED = ("residual", "layout")


# ----------------------------------------------------------------------------- plain pieces


class LinearBackend(Protocol):
    def linear(self, x: np.ndarray, names: Sequence[str]) -> list[np.ndarray]:
        """x: (T, d_in); names share this input. Returns [x @ W.T + b for each name]."""
        ...


class PlainLinear:
    """LinearBackend in the clear. `server_linears[name] = (W (d_out, d_in), b or None)`."""

    def __init__(self, server_linears: dict, dtype=np.float32):
        self.server_linears = server_linears
        self.dtype = np.dtype(dtype)
        self._cache: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}

    def _weights(self, name: str):
        wb = self._cache.get(name)
        if wb is None:
            w, b = self.server_linears[name]
            w = np.asarray(w, dtype=self.dtype)
            b = None if b is None else np.asarray(b, dtype=self.dtype)
            wb = self._cache[name] = (w, b)
        return wb

    def linear(self, x: np.ndarray, names: Sequence[str]) -> list[np.ndarray]:
        xd = np.asarray(x, dtype=self.dtype)
        outs = []
        for name in names:
            w, b = self._weights(name)
            y = xd @ w.T
            if b is not None:
                y = y + b
            outs.append(y.astype(np.float64))
        return outs


class KVCache:
    """Per-layer keys/values (kv_heads, T, head_dim), owned by the client side."""

    def __init__(self, n_layers: int):
        self.k: list[np.ndarray | None] = [None] * n_layers
        self.v: list[np.ndarray | None] = [None] * n_layers
        self.length = 0

    def extend(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = np.concatenate([self.k[layer], k], axis=1)
            self.v[layer] = np.concatenate([self.v[layer], v], axis=1)
        return self.k[layer], self.v[layer]

    def crop(self, length: int) -> None:
        """Forget everything after the first `length` positions."""
        self.length = min(self.length, length)
        for i in range(len(self.k)):
            if self.k[i] is not None:
                self.k[i] = self.k[i][:, :length]
                self.v[i] = self.v[i][:, :length]


def sample_next(logits: np.ndarray, rng: np.random.Generator | None, temperature: float = 0.0,
                top_k: int = 0, top_p: float = 1.0) -> int:
    """Greedy when temperature <= 0, else temperature / top-k / top-p (nucleus) sampling."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature is None or temperature <= 0:
        return int(np.argmax(logits))
    z = logits / temperature
    if top_k and 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = ops.softmax(z)
    if top_p is not None and 0 < top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = cum - p[order] < top_p  # smallest prefix whose mass reaches top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    rng = rng or np.random.default_rng()
    return int(rng.choice(p.size, p=p))


# ----------------------------------------------------------------------------- the walk


def _heads(x: np.ndarray, H: int) -> np.ndarray:
    """(S, H*hd) -> (H, S, hd); already per-head arrays (from the KV cache) pass through
    (numpy arrays and secret shares alike)."""
    return x.reshape(x.shape[0], H, -1).transpose(1, 0, 2) if x.ndim == 2 else x


def causal_keep(node: Node, pos0: int, T: int, S: int) -> np.ndarray | None:
    """(T, S) public mask of the key positions each of the T queries (at positions pos0..)
    may see: causal, and within the node's sliding window; None when the node is not causal."""
    if not node.attrs.get("causal"):
        return None
    qpos = pos0 + np.arange(T)[:, None]
    kpos = np.arange(S)[None, :]
    keep = kpos <= qpos
    w = node.attrs.get("sliding_window")
    if w is not None:
        keep &= (qpos - kpos) < w
    return keep


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
        if ctx.get("B") is not None:  # encoder batch: rows are B sentences of T tokens, no cache
            B, T = ctx["B"], ctx["T"]
            qh = q.reshape(B, T, H, hd).transpose(0, 2, 1, 3)
            kh = np.repeat(k.reshape(B, T, Hkv, hd).transpose(0, 2, 1, 3), H // Hkv, axis=1)
            s = (qh @ kh.transpose(0, 1, 3, 2)) * node.attrs["scale"]
            if ctx.get("key_mask") is not None:
                s = s + ctx["key_mask"][:, None, None, :]
            return s
        T = q.shape[0]
        k = _heads(k, Hkv)
        S = k.shape[1]
        rep = H // Hkv
        qh = q.reshape(T, H, hd).transpose(1, 0, 2)
        qg = qh.reshape(Hkv, rep * T, hd) if rep > 1 else qh
        s = (qg @ k.transpose(0, 2, 1)).reshape(H, T, S) * node.attrs["scale"]
        keep = causal_keep(node, ctx["pos0"], T, S)
        if keep is not None:
            s = np.where(keep[None], s, -np.inf)
        if ctx.get("key_mask") is not None:
            s = s + ctx["key_mask"][None, None, :]
        return s

    def softmax(self, node, s, ctx):
        return ops.softmax(s, axis=-1)

    def av(self, node, p, v, ctx):
        H, Hkv = node.attrs["heads"], node.attrs["kv_heads"]
        if ctx.get("B") is not None:
            B, T = ctx["B"], ctx["T"]
            vh = np.repeat(v.reshape(B, T, Hkv, -1).transpose(0, 2, 1, 3), H // Hkv, axis=1)
            return (p @ vh).transpose(0, 2, 1, 3).reshape(B * T, -1)
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
        disp = ctx.get("moe_dispatch", {}).get(node.layer)
        if disp is not None:  # balanced routing (cipherlm.moe.routing): the layer's dispatch decides
            e = node.attrs["expert"]
            sel = disp.valid[e]
            if not sel.any():
                return None, None
            rows = disp.token[e, sel]
            return x[rows], (rows, disp.score[e, sel])
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
            return x.reshape(ctx["B"], ctx["T"], -1)[:, 0] if ctx.get("B") is not None else x[:1]
        return x[-1:] if ctx.get("last_only") else x

    def argmax(self, node, logits, ctx):
        return np.argmax(logits, axis=-1)

    # ---- the pieces of compile.passes.blb_decompose (BLB, Algorithms 3-5)

    def reduce_sum(self, node, x, ctx):
        s = np.sum(x, axis=-1, keepdims=True)
        scale = node.attrs.get("scale", 1.0)
        return s * scale if scale != 1.0 else s

    def reduce_max(self, node, x, ctx):
        return np.max(x, axis=-1, keepdims=True)

    def sub(self, node, a, b, ctx):
        return a - b

    def affine(self, node, x, ctx):
        g, b = self._vec(node.attrs.get("gamma")), self._vec(node.attrs.get("beta"))
        y = x * g if g is not None else x
        return y + b if b is not None else y

    def rsqrt(self, node, x, ctx):
        return 1.0 / np.sqrt(x * node.attrs.get("scale", 1.0) + node.attrs.get("eps", 0.0))

    def reciprocal(self, node, x, ctx):
        return 1.0 / x

    def exp(self, node, x, ctx):
        return np.exp(x * node.attrs.get("scale", 1.0))

    def act_gate(self, node, x, ctx):
        fn = node.attrs["fn"]
        if fn == "gelu":
            return 0.5 * (1.0 + ops.erf(x / np.sqrt(2.0)))
        if fn == "gelu_tanh":
            return 0.5 * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))
        if fn == "silu":
            return ops.sigmoid(x)
        raise ValueError(f"{node.name}: no gate form for activation {fn!r}")

    def act_clamp(self, node, x, ctx):
        a = np.abs(x)
        ac = np.minimum(a, float(node.attrs["T"]))
        return x / 2 + (a - ac) / 2, ac * float(node.attrs.get("scale", 1.0))

    def clip_min(self, node, x, ctx):
        return np.maximum(x, float(node.attrs["lo"]))

    def poly(self, node, x, ctx):
        c = node.attrs["coeffs"]
        y = np.full(np.shape(x), float(c[-1]))
        for ck in reversed(c[:-1]):
            y = y * x + float(ck)
        return y


def needed(producers: dict, outputs: Iterable[str]) -> set[str]:
    """Names of the nodes the values `outputs` depend on (``producers``: value -> node, as
    `Graph.producers` gives it)."""
    todo, seen = list(outputs), set()
    while todo:
        n = producers.get(todo.pop())
        if n is None or n.name in seen:
            continue
        seen.add(n.name)
        todo.extend(n.inputs)
    return seen


class GraphExecutor:
    """Walks a graph over a backend; `linear` is any `LinearBackend` (default: `PlainLinear`
    over the bound weights). `profiler`: an object with `add_seconds(op_class, seconds)` or
    a callable `(op_class, seconds)`. `moe_routing`: None (the model's own top-k routing) or
    a `cipherlm.moe.routing.BalancedRouting` (CryptoMoE: each expert takes exactly t of a
    pass's T tokens, dummies padded, the rest dropped)."""

    def __init__(self, graph: Graph, params: dict[str, np.ndarray], linear=None, backend=None,
                 dtype=np.float32, profiler=None, moe_routing=None, meter=None):
        #: `runtime.meter.Meter` (bytes, flights, seconds per op class and graph node), or None
        self.meter = meter
        if "linear_groups" not in graph.meta:
            graph = passes.group_linears.run(graph)
        self.graph = graph
        self.params = params
        self.groups = [names for names, _, _ in graph.meta["linear_groups"]]
        self.linear = linear if linear is not None else PlainLinear(linear_weights(graph, params), dtype=dtype)
        self.backend = backend if backend is not None else PlainBackend(params)
        self.config = graph.config
        self.moe_routing = moe_routing
        self.last_routing: dict[int, np.ndarray] = {}  # layer -> (T, top_k) expert ids of the last pass
        self.last_moe_dispatch: dict = {}  # layer -> routing.Dispatch of the last pass (balanced only)
        self._set_profiler(profiler)
        self._producer = graph.producers()
        arch = graph.meta.get("arch") or {}
        self.max_positions = int(arch.get("max_positions") or 1 << 62)

    @classmethod
    def from_hf(cls, config: dict, weights: dict[str, np.ndarray], **kw) -> "GraphExecutor":
        from cipherlm.compile import bind, build_graph
        g = build_graph(config)
        return cls(g, bind(g, weights), **kw)

    # ---- profiling

    def _set_profiler(self, profiler) -> None:
        if profiler is None:
            self._sink = None
        elif hasattr(profiler, "add_seconds"):
            self._sink = profiler.add_seconds
        elif callable(profiler):
            self._sink = profiler
        else:
            raise TypeError("profiler must have add_seconds(op_class, seconds) or be callable")
        self.profiler = profiler

    def _time(self, op_class: str, t0: float) -> None:
        if self._sink is not None and op_class not in _UNTIMED:
            self._sink(op_class, time.perf_counter() - t0)

    # ---- the walk

    def needed(self, outputs: Iterable[str]) -> set[str]:
        """Names of the nodes the values `outputs` depend on."""
        return needed(self._producer, outputs)

    def run_nodes(self, nodes: Iterable[Node], vals: dict, ctx: dict, cache: KVCache | None = None,
                  keep: Iterable[str] | None = None) -> dict:
        """Evaluate `nodes` in order over `vals` (value name -> array, updated in place).
        ``keep`` (value names): every other value is dropped from `vals` after the last node
        that reads it (a pass on ciphertexts would otherwise hold every layer's scores and
        activations to the end: GBs per layer at 128 tokens)."""
        group_out: dict[int, dict[str, np.ndarray]] = {}
        sink = self._sink
        meter = self.meter
        layer = None
        nodes = list(nodes)
        last_read: dict[str, int] = {}
        if keep is not None:
            kept = set(keep)
            last_read = {v: i for i, n in enumerate(nodes) for v in n.inputs if v not in kept}
        for step, node in enumerate(nodes):
            if layer is not None and node.layer != layer:
                self._layer_done(layer, ctx)
            layer = node.layer
            ins = [vals[v] for v in node.inputs]
            t0 = time.perf_counter() if sink is not None else 0.0
            if node.op != "combine" and any(x is None for x in ins):
                res = (None,) * len(node.outputs)
            elif node.op == "linear":
                gi = node.attrs["group"]
                if gi not in group_out:
                    names = self.groups[gi]
                    with (meter("linear", node.name) if meter is not None else _NO_METER):
                        group_out[gi] = dict(zip(names, self.linear.linear(ins[0], list(names))))
                    self._time("linear", t0)
                res = (group_out[gi].pop(node.attrs["name"]),)  # read once: `keep` can drop it
                t0 = None
            elif node.op == "kv_cache":
                if hasattr(cache, "append_node"):  # a cache of non-array values (the fhe mode's ciphertexts)
                    res = cache.append_node(node, *ins)
                else:
                    Hkv = node.attrs["kv_heads"]
                    k, v = (_heads(t, Hkv) for t in ins)
                    res = cache.extend(node.attrs["layer"], k, v)
            else:
                with (meter(OP_CLASS[node.op], node.name) if meter is not None else _NO_METER):
                    r = getattr(self.backend, node.op)(node, *ins, ctx=ctx)
                res = r if len(node.outputs) > 1 else (r,)
                if node.op == "topk":
                    self._routed(node, res[0], res[1], ctx)
            if t0 is not None and sink is not None:
                self._time(OP_CLASS[node.op], t0)
            for name, value in zip(node.outputs, res):
                vals[name] = value
            for v in node.inputs:
                if last_read.get(v) == step:
                    vals.pop(v, None)
        if layer is not None:
            self._layer_done(layer, ctx)
        return vals

    def _layer_done(self, layer: int, ctx: dict) -> None:
        """Called after the last node of each layer a pass ran (progress output)."""

    def _routed(self, node: Node, top: np.ndarray, w: np.ndarray, ctx: dict) -> None:
        layer = node.layer
        self.last_routing[layer] = top
        r = self.moe_routing
        if r is None:
            return
        from cipherlm.moe.routing import balanced_dispatch

        T, k, n = top.shape[0], node.attrs["k"], node.attrs["n_experts"]
        rng = np.random.default_rng([r.seed, layer, T]) if r.selection == "random" else None
        disp = balanced_dispatch(top, w, n, r.capacity(T, k, n), r.selection, rng)
        self.last_moe_dispatch[layer] = disp
        ctx.setdefault("moe_dispatch", {})[layer] = disp

    def run(self, inputs: dict, ctx: dict, cache: KVCache | None = None, outputs: Sequence[str] | None = None) -> dict:
        """The graph's outputs (only the roles in `outputs`, and only the nodes they need, if given)."""
        roles = list(self.graph.outputs) if outputs is None else list(outputs)
        nodes = self.graph.nodes
        if outputs is not None:
            need = self.needed(self.graph.outputs[r] for r in roles)
            nodes = [n for n in nodes if n.name in need]
        vals = self.run_nodes(nodes, dict(inputs), ctx, cache)
        return {role: vals[self.graph.outputs[role]] for role in roles}

    # ---- layers

    def layer_io(self, i: int) -> tuple[str, str]:
        """(value entering layer i (the residual stream), value leaving it)."""
        nodes = [n for n in self.graph.nodes if n.layer == i]
        made = {v for n in nodes for v in n.outputs}
        ext = {v for n in nodes for v in n.inputs if v not in made and v not in self.graph.inputs}
        if len(ext) != 1:
            raise ValueError(f"layer {i} reads {sorted(ext)}: not one residual input")
        return ext.pop(), nodes[-1].out

    def run_layers(self, x: np.ndarray, layers: Iterable[int], cache: KVCache | None = None, pos0: int = 0,
                   attention_mask=None) -> np.ndarray:
        """Hidden states (T, d) through `layers` (decoders: a fresh KV cache unless given)."""
        x = np.asarray(x, np.float64)
        T = x.shape[0]
        ctx = {"pos0": pos0, "T": T, "positions": np.arange(pos0, pos0 + T)}
        if self.graph.kind == "encoder":
            mask = np.ones((1, T)) if attention_mask is None else np.asarray(attention_mask, np.float64).reshape(1, T)
            ctx.update(B=1, key_mask=np.where(mask > 0, 0.0, np.finfo(np.float32).min))
        elif cache is None:
            cache = self.new_cache()
        return self.walk_layers(x, layers, ctx, cache)

    def walk_layers(self, x, layers: Iterable[int], ctx: dict, cache=None):
        """`x` (the residual stream entering the first of `layers`) through `layers`."""
        for i in layers:
            src, dst = self.layer_io(i)
            x = self.run_nodes([n for n in self.graph.nodes if n.layer == i], {src: x}, ctx, cache)[dst]
        return x

    # ---- decoders

    def new_cache(self) -> KVCache:
        return KVCache(self.graph.n_layers)

    def _decode_pass(self, ids, cache: KVCache | None, last_only: bool, outputs=("logits", "next_token")) -> dict:
        if self.graph.kind != "decoder":
            raise ValueError("forward/generate are for decoders; use encode() for encoders")
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("empty input")
        cache = self.new_cache() if cache is None else cache
        pos0, T = cache.length, ids.size
        positions = np.arange(pos0, pos0 + T)
        ctx = {"pos0": pos0, "T": T, "positions": positions, "last_only": last_only}
        out = self.run({"ids": ids, "positions": positions}, ctx, cache, outputs=outputs)
        cache.length = pos0 + T
        return out

    def forward(self, ids: Sequence[int], cache: KVCache | None = None, last_only: bool = False) -> np.ndarray:
        """Logits (T, vocab) of `ids` after what `cache` holds ((1, vocab) with last_only: in a
        private mode the LM head is the costliest projection, and generation needs no more)."""
        return self._decode_pass(ids, cache, last_only, outputs=("logits",))["logits"]

    def trace_one_token(self, token_id: int = 0) -> np.ndarray:
        """One-token forward on a fresh cache."""
        return self.forward([token_id], self.new_cache())

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 32, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 eos_token_ids: Iterable[int] | int | None = None, on_token: Callable[[int], None] | None = None,
                 return_logits: bool = False, greedy: bool | None = None):
        """Prefill the prompt, then decode one token at a time with the KV cache (`generate_loop`).

        Greedy if temperature <= 0 (or greedy=True); sampling otherwise (`plain.sample_next`:
        temperature / top-k / top-p), reproducible with `seed`. Stops after max_new_tokens or
        at an EOS id (included in the output). `on_token(id)` is called for each new token.
        Returns new ids, or (new ids, [logits of each step]) with return_logits."""
        if greedy:
            temperature = 0.0
        if eos_token_ids is None:
            eos = self.config.get("eos_token_id")
            eos_token_ids = [] if eos is None else eos
        eos = {int(eos_token_ids)} if isinstance(eos_token_ids, (int, np.integer)) else {int(e) for e in eos_token_ids}
        ids = list(prompt_ids)
        if not ids:
            raise ValueError("empty prompt")
        rng = np.random.default_rng(seed)
        logits = []

        def pick(ids, n, cache):
            lg = self._decode_pass(ids, cache, last_only=True, outputs=("logits",))["logits"][-1]
            t0 = time.perf_counter()
            tok = sample_next(lg, rng, temperature, top_k, top_p)
            self._time("sampling", t0)
            if return_logits:
                logits.append(lg)
            return tok

        out = self.generate_loop(ids, len(ids), max_new_tokens, pick, lambda tok, more: tok not in eos, on_token)
        return (out, logits) if return_logits else out

    def generate_loop(self, ids, n: int, max_new_tokens: int, pick, go_on, on_token=None) -> list[int]:
        """The generate loop of every mode: a pass over the `n` prompt tokens `ids`, then one
        pass per new token, with one KV cache; stops at `max_new_tokens`, before the cache
        would outgrow the model's positions, or when `go_on(token, more)` says so.

        `pick(ids, n, cache)` runs a pass and returns the new token (None where this party
        does not learn it: the 2pc server); `go_on(token, more)` (``more``: the budget is
        not spent) decides whether to go on (plain: the token is not EOS; 2pc: the client
        tells the server). Returns the tokens this party learnt."""
        cache = self.new_cache()
        out: list[int] = []
        for step in range(int(max_new_tokens)):
            if cache.length + n > self.max_positions:
                break
            tok = pick(ids, n, cache)
            if tok is not None:
                out.append(tok)
                if on_token is not None:
                    on_token(tok)
            if not go_on(tok, step + 1 < max_new_tokens):
                break
            ids, n = (None if tok is None else [tok]), 1
        return out

    # ---- encoders

    def _encoder_ctx(self, ids, attention_mask, token_type_ids):
        if self.graph.kind != "encoder":
            raise ValueError("encode() is for encoders")
        ids = np.asarray(ids, np.int64)
        single = ids.ndim == 1
        ids = ids[None] if single else ids
        B, T = ids.shape
        mask = np.ones((B, T)) if attention_mask is None else np.asarray(attention_mask, np.float64).reshape(B, T)
        tt = np.zeros((B, T), np.int64) if token_type_ids is None else np.asarray(token_type_ids).reshape(B, T)
        ctx = {"pos0": 0, "B": B, "T": T, "positions": np.arange(T),
               "key_mask": np.where(mask > 0, 0.0, np.finfo(np.float32).min)}
        inputs = {"ids": ids.reshape(-1), "positions": np.tile(np.arange(T), B), "token_types": tt.reshape(-1)}
        return single, B, T, ctx, inputs

    def encode(self, ids, attention_mask=None, token_type_ids=None, pooled: bool = True):
        """(hidden (B, T, d), pooled (B, d)) for (B, T) ids ((T, d), (d,) for (T,) ids); only
        the hidden states (no pooler) with pooled=False."""
        single, B, T, ctx, inputs = self._encoder_ctx(ids, attention_mask, token_type_ids)
        out = self.run(inputs, ctx, outputs=("hidden", "pooled") if pooled else ("hidden",))
        hid = out["hidden"].reshape(B, T, -1)
        if not pooled:
            return hid[0] if single else hid
        pool = out["pooled"].reshape(B, -1)
        return (hid[0], pool[0]) if single else (hid, pool)


class DecoderExecutor(GraphExecutor):
    """A decoder's graph over a `LinearBackend` holding the projections (the plaintext
    executor's constructor: config, client-side parameters from `plain.split_params`)."""

    def __init__(self, config: dict, client_params: dict, backend, profiler=None, moe_routing=None):
        graph, params = client_graph(config, client_params)
        if graph.kind != "decoder":
            raise ValueError(f"{config.get('model_type')!r} is not a decoder")
        super().__init__(graph, params, linear=backend, profiler=profiler, moe_routing=moe_routing)


class EncoderExecutor(GraphExecutor):
    """BERT: hidden states, pooler, sentence embeddings, a linear "classifier" head (a server
    linear outside the graph, on the sentence embedding)."""

    def __init__(self, config: dict, client_params: dict, backend, profiler=None):
        graph, params = client_graph(config, client_params)
        if graph.kind != "encoder":
            raise ValueError(f"unsupported encoder model_type {config.get('model_type')!r}")
        super().__init__(graph, params, linear=backend, profiler=profiler)

    def forward(self, ids, attention_mask=None, token_type_ids=None) -> np.ndarray:
        """Last hidden states: (B, T, d) for (B, T) ids, (T, d) for (T,) ids."""
        return self.encode(ids, attention_mask, token_type_ids, pooled=False)

    def pooled(self, hidden: np.ndarray) -> np.ndarray:
        """BertModel's pooler output: tanh(dense(hidden[:, 0]))."""
        h = hidden if hidden.ndim == 3 else hidden[None]
        B, T, d = h.shape
        src = self.graph.outputs["hidden"]
        need = self.needed([self.graph.outputs["pooled"]]) - self.needed([src])
        nodes = [n for n in self.graph.nodes if n.name in need]
        vals = self.run_nodes(nodes, {src: h.reshape(B * T, d)}, {"B": B, "T": T})
        return vals[self.graph.outputs["pooled"]].reshape(B, -1)

    def sentence_embedding(self, ids, attention_mask=None, normalize: bool = True) -> np.ndarray:
        """Mean pooling over the attention mask, then L2 normalisation (sentence-transformers)."""
        ids = np.asarray(ids, dtype=np.int64)
        single = ids.ndim == 1
        if single:
            ids = ids[None]
        mask = np.ones(ids.shape) if attention_mask is None else np.asarray(attention_mask, np.float64).reshape(ids.shape)
        hidden = self.forward(ids, mask)
        t0 = time.perf_counter()
        emb = (hidden * mask[..., None]).sum(axis=1) / np.maximum(mask.sum(axis=1, keepdims=True), 1e-9)
        if normalize:
            emb = emb / np.maximum(np.linalg.norm(emb, axis=-1, keepdims=True), 1e-12)
        self._time("norm", t0)
        return emb[0] if single else emb

    def classify(self, ids, attention_mask=None) -> np.ndarray:
        """Logits of the "classifier" linear head on the sentence embedding."""
        emb = self.sentence_embedding(ids, attention_mask)
        t0 = time.perf_counter()
        out = self.linear.linear(np.atleast_2d(emb), ["classifier"])[0]
        self._time("linear", t0)
        return out

    def trace_one_token(self, token_id: int = 101) -> np.ndarray:
        names = getattr(self.linear, "server_linears", None)
        hidden = self.encode(np.array([[token_id]]), pooled=names is None or "pooler.dense" in names)
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        if names is not None and "classifier" in names:
            self.linear.linear(hidden.mean(axis=1), ["classifier"])
        return hidden

    # ---- text helpers

    @staticmethod
    def batch_encode(tokenizer, texts: Sequence[str], max_length: int = 256):
        """(ids (B, T), mask (B, T)) padded with 0 to the longest text."""
        encs = [tokenizer.encode(t) for t in texts]
        seqs = [e.ids[:max_length] for e in encs]
        T = max(len(s) for s in seqs)
        ids = np.zeros((len(seqs), T), dtype=np.int64)
        mask = np.zeros((len(seqs), T), dtype=np.float64)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1
        return ids, mask

    def embed_texts(self, tokenizer, texts: Sequence[str], batch_size: int = 16) -> np.ndarray:
        """Sentence embeddings (N, d) of raw texts."""
        out = []
        for j in range(0, len(texts), batch_size):
            ids, mask = self.batch_encode(tokenizer, texts[j : j + batch_size])
            out.append(self.sentence_embedding(ids, mask))
        return np.concatenate(out, axis=0)


def client_graph(config: dict, client_params: dict) -> tuple[Graph, dict[str, np.ndarray]]:
    """The config's graph and its non-projection tensors (embeddings, norms, router biases)
    from the client-side parameters (`plain.split_params`); the projections stay with the
    `LinearBackend`."""
    from cipherlm.compile import build_graph

    graph = build_graph(config)
    server = {t for n in graph.linears() for t in n.weights}
    params = {}
    for name, t in graph.tensors.items():
        if name in server:
            continue
        if t.source not in client_params:
            raise KeyError(f"client parameters lack {t.source!r} (graph tensor {name})")
        params[name] = client_params[t.source]
    return graph, params
