"""The fhe backend of the graph executor: the server walks the model graph on CKKS
ciphertexts, with no client interaction between the upload and the result (AEGIS
sections 2.1-2.4; DESIGN.md "Three security modes", fhe).

Split of the work (`client_nodes`):

* the **client** looks its tokens up in the embedding tables (the embedding nodes and the
  additions of their outputs: word + position + token type), packs the (T, d) sum in the
  token-group layout (`protocols.ckks.packing`) and encrypts it;
* the **server** runs every other node of the graph on ciphertexts (`FheBackend`,
  `FheLinear`, over `protocols.ckks`): norms, projections, RoPE, attention, activations,
  residuals, the final norm and the head, bootstrapping where levels run out;
* the client decrypts the result: the logits of the last position (decoders) or of the
  sentence embedding's classifier (encoders, `FheModel.classify`), or the last hidden
  states.

What the server needs besides the weights comes from a plain calibration pass
(`cipherlm.fhe.calibrate.fhe_ranges`): a bound per value (the bootstrapping's input
scaling) and the input range of each approximation (`cipherlm.fhe.approx`: GeLU/SiLU,
exp, inverse, inverse square root).

Grouped-query attention: the K and V projections of a model with fewer key/value heads
are expanded at load time (each kv head's rows repeated for its query heads), so Q.K^T
and P.V see one K and V head per query head.

Decoders keep an encrypted KV cache on the server (`FheKVCache`): keys (after RoPE) and
values of every layer, packed by absolute position, so a decoding step encrypts only its
new token (at position offset = the cache's length, `TokenPacking.offset`).

Not yet: the encrypted maximum of softmax (a calibrated bound instead), MoE routing,
GPT-2's fused QKV split.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from cipherlm.compile import bind, build_graph
from cipherlm.compile.ir import Graph, Node
from cipherlm.fhe.approx import approximation, max_degree_within
from cipherlm.he.errors import HEError
from cipherlm.protocols.ckks import attention as attn
from cipherlm.protocols.ckks import linear as lin
from cipherlm.protocols.ckks import norm
from cipherlm.protocols.ckks.evaluator import CkksEvaluator, CkksTensor
from cipherlm.protocols.ckks.packing import TokenPacking

from .graph_executor import GraphExecutor

#: error targets of the approximations (absolute for activations and exp, relative for inv
#: and rsqrt: `cipherlm.fhe.approx`)
TARGETS = {"gelu": 1e-3, "silu": 1e-3, "tanh": 1e-3, "exp": 1e-5, "inv": 1e-4, "rsqrt": 1e-4}
_ACT_KIND = {"gelu": "gelu", "gelu_tanh": "gelu", "silu": "silu", "tanh": "tanh"}
#: ops the client runs (table lookups and their sums)
CLIENT_OPS = ("embed",)
#: ops the fhe backend evaluates on ciphertexts
SUPPORTED_OPS = {"linear", "layer_norm", "rms_norm", "rope", "qk", "softmax", "av", "activation", "mul",
                 "add", "head", "embed"}


def client_nodes(graph: Graph) -> tuple[list[Node], str]:
    """(the nodes the client evaluates in the clear, the value it encrypts): the embedding
    lookups and the additions of their outputs."""
    mine: list[Node] = []
    made: set[str] = set()
    for n in graph.nodes:
        if n.op in CLIENT_OPS or (n.op == "add" and all(v in made for v in n.inputs)):
            mine.append(n)
            made.update(n.outputs)
        else:
            break
    if not mine:
        raise ValueError("the graph has no embedding nodes")
    return mine, mine[-1].out


def _kv_linears(graph: Graph) -> dict[str, tuple[int, int, int]]:
    """{linear name: (kv heads, repeat, head dim)} of the K and V projections of grouped-query
    attention (followed back from each qk / av node through rope and the KV cache)."""
    producer = graph.producers()
    out = {}
    for n in graph.nodes:
        if n.op not in ("qk", "av"):
            continue
        H, Hkv, hd = n.attrs["heads"], n.attrs["kv_heads"], n.attrs.get("head_dim")
        if H == Hkv:
            continue
        v = n.inputs[1]
        while True:
            p = producer[v]
            if p.op == "linear":
                break
            v = p.inputs[0] if p.op in ("rope",) else p.inputs[-1 if p.op == "kv_cache" and v == p.outputs[1] else 0]
        if hd is None:
            hd = p.attrs["d_out"] // Hkv
        out[p.attrs["name"]] = (Hkv, H // Hkv, hd)
    return out


class FheLinear:
    """The graph's projections on ciphertexts (`protocols.ckks.linear.EncodedLinear`, one per
    projection and token count), K/V expanded for grouped-query attention."""

    def __init__(self, model: "FheModel", ev: CkksEvaluator):
        self.model, self.ev = model, ev
        #: the walk's values so far (`_FheWalk.run_nodes`): where a residual add's other operand is
        self.vals: dict = {}

    def out_level(self, name: str) -> int | None:
        """The highest level projection ``name``'s output is any use at (`FheModel.level_use`):
        0 for what the client decrypts, the other operand's level for a residual add (the sum
        takes the lower of the two), None: no cap."""
        use = self.model.level_use.get(name)
        if use is None:
            return None
        if use == "client":
            return 0
        other = self.vals.get(use)
        return other.level if isinstance(other, CkksTensor) else None

    def linear(self, x: CkksTensor, names: Sequence[str]) -> list[CkksTensor]:
        ev = self.ev
        pos = x.position
        outs = []
        for name in names:
            e = self.model.encoded(name, x.packing, pos)
            y = e(ev, x, bound=self.model.bound_of_linear(name), label=name, out_level=self.out_level(name))
            if pos is not None:
                y.position = pos
            outs.append(y)
        return outs


def level_use(graph: Graph, classifier: bool = False) -> dict[str, str]:
    """Projections whose output is of use at a capped level (`FheLinear.out_level`): name ->
    "client" when the client decrypts it (the LM head, a classifier head), or the value name
    of the other operand when its only reader is an ``add`` (a residual connection: the sum
    is at the lower level of the two, so a higher one would be spent encoding the
    projection's diagonals at more primes for nothing).  Projections in groups of several
    (q, k, v; gate, up) are left uncapped."""
    readers: dict[str, list[Node]] = {}
    for n in graph.nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(n)
    outputs = set(graph.outputs.values())
    by_group: dict[int, int] = {}
    for n in graph.linears():
        by_group[n.attrs["group"]] = by_group.get(n.attrs["group"], 0) + 1
    use = {"classifier": "client"} if classifier else {}
    for n in graph.linears():
        if by_group[n.attrs["group"]] != 1:
            continue
        rs = readers.get(n.out, [])
        if n.out in outputs and all(r.op == "argmax" for r in rs):
            use[n.attrs["name"]] = "client"
        elif len(rs) == 1 and rs[0].op == "add" and n.out not in outputs:
            others = [v for v in rs[0].inputs if v != n.out]
            if len(others) == 1:
                use[n.attrs["name"]] = others[0]
    return use


def _keep(x: CkksTensor, y: CkksTensor) -> CkksTensor:
    y.position = x.position
    return y


class FheBackend:
    """The graph's non-projection operators on ciphertexts (method per op, as `PlainBackend`)."""

    def __init__(self, model: "FheModel", ev: CkksEvaluator):
        self.m, self.ev = model, ev

    def _vec(self, name):
        return None if name is None else np.asarray(self.m.params[name], np.float64)

    def layer_norm(self, node, x, ctx):
        return _keep(x, norm.layer_norm(self.ev, x, self._vec(node.attrs["gamma"]), self._vec(node.attrs.get("beta")),
                               node.attrs["eps"], self.m.approx(node, "rsqrt"), self.m.bound(node.out), node.name))

    def rms_norm(self, node, x, ctx):
        return _keep(x, norm.rms_norm(self.ev, x, self._vec(node.attrs.get("gamma")), node.attrs["eps"],
                                      self.m.approx(node, "rsqrt"), self.m.bound(node.out), node.name))

    def rope(self, node, x, ctx):
        return attn.rope(self.ev, x, ctx["positions"], node.attrs["head_dim"], node.attrs["theta"],
                         bool(node.attrs.get("interleave")), node.name)

    def qk(self, node, q, k, ctx):
        return attn.scores(self.ev, q, k, node.attrs["head_dim"], node.attrs["scale"], self.m.bound(node.out),
                           bool(node.attrs.get("causal")), node.name)

    def softmax(self, node, s, ctx):
        qk = self.m.producer[node.inputs[0]]
        causal, window = bool(qk.attrs.get("causal")), qk.attrs.get("sliding_window")
        e_iv, i_iv = attn.softmax_intervals(s.bound, causal or window is not None, s.head_dim, s.keys, len(s.cts))
        return attn.softmax(self.ev, s, approximation("exp", *e_iv, TARGETS["exp"]),
                            approximation("inv", *i_iv, TARGETS["inv"]), causal=causal, window=window,
                            label=node.name)

    def av(self, node, p, v, ctx):
        return attn.attend(self.ev, p, v, self.m.bound(node.out), node.name)

    def activation(self, node, x, ctx):
        kind = _ACT_KIND.get(node.attrs["fn"])
        if kind is None:
            raise HEError(f"{node.name}: no polynomial for activation {node.attrs['fn']!r}")
        # the deepest series one refreshed ciphertext holds (`CkksEvaluator.poly`): top - floor
        # levels less the reserve, + 1 on the client-refresh path, whose refresh does the change
        # of variable for free (8 there: its floor of 2 leaves 7 levels)
        ev = self.ev
        levels = ev.top - ev.floor - ev.reserve(self.m.bound(node.out)) + (ev.refresher is not None)
        return self.ev.poly(x, self.m.approx(node, kind, max_depth=levels), node.name, bound=self.m.bound(node.out))

    def mul(self, node, a, b, ctx):
        need = 1 + self.ev.reserve(self.m.bound(node.out))
        a, b = self.ev.refresh(a, need, node.name), self.ev.refresh(b, need, node.name)
        return a.with_cts([self.ev.mul_ct(x, y) for x, y in zip(a.cts, b.cts)], bound=self.m.bound(node.out))

    def add(self, node, a, b, ctx):
        return self.ev.add(a, b, bound=self.m.bound(node.out))

    def head(self, node, x, ctx):
        """Decoders: only the last position goes on (the LM head's diagonals keep that
        position alone, so the client's result holds nothing else)."""
        if node.attrs["select"] == "first":
            raise HEError(f"{node.name}: the pooler head is not an fhe output (use FheModel.classify)")
        if ctx.get("last_only"):
            y = x.with_cts(x.cts)
            y.position = x.packing.end - 1
            return y
        return x


class FheModel:
    """The server's side of the fhe mode for one model: the graph, the weights, the ranges
    from calibration (`calibrate`), and the encoded projections (shared by every session).
    Each pass takes the session's evaluator (its keys): `run(ev, x_enc, positions)`,
    `logits(ev, ...)`, `classify(ev, ...)`; `packing(slots, T, max_tokens)` and
    `rotation_steps(packing)` tell the client which Galois keys to make."""

    def __init__(self, config: dict, weights: dict[str, np.ndarray], calibration: dict,
                 classifier: tuple[np.ndarray, np.ndarray | None] | None = None):
        #: what rebuilds this model in another process (the distributed executor's workers)
        self.init_args = (config, weights, calibration, classifier)
        self.graph = build_graph(config)
        bad = sorted({n.op for n in self.graph.nodes} - SUPPORTED_OPS - {"kv_cache", "argmax"})  # the client argmaxes
        if bad:
            raise HEError(f"the fhe mode does not evaluate {bad} yet ({config.get('model_type')})")
        self.params = bind(self.graph, weights)
        self.calibration = calibration
        self.producer = self.graph.producers()
        self.client, self.input_value = client_nodes(self.graph)
        self._kv = _kv_linears(self.graph)
        self._lin_out = {n.attrs["name"]: n.out for n in self.graph.linears()}
        self.classifier = classifier
        self.executor = GraphExecutor(self.graph, self.params, linear=object(), backend=object())
        self.graph = self.executor.graph  # with the linear groups
        #: activations whose approximation missed `TARGETS` to fit the levels (`approx`)
        self.below_target: dict[str, float] = {}
        #: projections whose output level is capped (`level_use`)
        self.level_use = level_use(self.graph, classifier is not None)
        self._enc: dict[tuple, lin.EncodedLinear] = {}
        #: keep the projections' encoded plaintexts between passes (False: encode on every use;
        #: a model at 2^15 slots would otherwise hold GBs of plaintexts per level it meets)
        self.cache_plaintexts = True

    def encoded(self, name: str, packing: TokenPacking, position: int | None) -> lin.EncodedLinear:
        """The projection `name` encoded for `packing` (only `position` kept, if given); cached."""
        key = (name, packing, position)
        e = self._enc.get(key)
        if e is None:
            w, b = self.weights(name)
            mask = None
            if position is not None:
                mask = np.zeros(packing.tp)
                mask[position] = 1.0
            e = self._enc[key] = lin.EncodedLinear(w, b, packing, positions=mask, cache=self.cache_plaintexts)
        return e

    def _executor(self, ev: CkksEvaluator, on_layer=None) -> GraphExecutor:
        ex = _FheWalk(self.graph, self.params, linear=FheLinear(self, ev), backend=FheBackend(self, ev))
        ex.on_layer = on_layer
        return ex

    # ---- weights and ranges

    def weights(self, name: str) -> tuple[np.ndarray, np.ndarray | None]:
        if name == "classifier":
            if self.classifier is None:
                raise HEError("no classifier head")
            return self.classifier
        w = np.asarray(self.params[f"{name}.weight"], np.float64)
        b = self.params.get(f"{name}.bias")
        b = None if b is None else np.asarray(b, np.float64)
        if name in self._kv:
            Hkv, rep, hd = self._kv[name]
            w = np.repeat(w.reshape(Hkv, hd, -1), rep, axis=0).reshape(Hkv * rep * hd, -1)
            b = None if b is None else np.repeat(b.reshape(Hkv, hd), rep, axis=0).reshape(-1)
        return w, b

    def bound(self, value: str) -> float:
        b = self.calibration["bounds"].get(value)
        if b is None:
            raise HEError(f"no calibrated bound for {value!r}")
        return float(b)

    def bound_of_linear(self, name: str) -> float:
        if name == "classifier":
            return float(self.calibration.get("classifier_bound", 64.0))
        return self.bound(self._lin_out[name])

    def approx(self, node: Node, kind: str, max_depth: int | None = None):
        """The approximation of `kind` on node's calibrated range at `TARGETS`' error.  With
        ``max_depth`` (gelu, silu, tanh): at most that many levels; where the target needs more
        (a wide range: SmolLM2's layer 28 SiLU on [-41, 66] needs degree 134, depth 9), the
        deepest series that fits, its error recorded in `below_target` (node -> max abs error)."""
        r = self.calibration["ranges"].get((node.name, kind))
        if r is None:
            raise HEError(f"{node.name}: no calibrated range for {kind}")
        lo, hi = float(r[0]), float(r[1])
        if max_depth is None:
            return approximation(kind, lo, hi, TARGETS[kind])
        a = approximation(kind, lo, hi, TARGETS[kind], max_degree=max_degree_within(max_depth, (lo, hi)),
                          best_effort=True)
        if a.max_abs_error > TARGETS[kind]:
            self.below_target[node.name] = a.max_abs_error
        return a

    # ---- keys the client must send

    def rotation_steps(self, packing: TokenPacking) -> list[int]:
        """Every slot rotation a pass over T tokens needs (linear BSGS steps, channel sums,
        attention shifts and head windows, RoPE partners, token sums of the pooled head)."""
        steps = set(lin.rotation_steps(packing))
        for n in self.graph.nodes:
            if n.op == "qk":
                steps |= attn.rotation_steps(packing, n.attrs["head_dim"], causal=bool(n.attrs.get("causal")))
            if n.op == "rope":
                hd = n.attrs["head_dim"]
                p = 1 if n.attrs.get("interleave") else hd // 2
                steps |= {(p * packing.tp) % packing.slots, (-p * packing.tp) % packing.slots}
        k = 1
        while k < packing.cpc:
            steps.add(k * packing.tp)
            k *= 2
        k = 1
        while k < packing.tp:
            steps.add(k)
            k *= 2
        return sorted(s for s in steps if s % packing.slots)

    # ---- passes

    @staticmethod
    def packing(slots: int, tokens: int, max_tokens: int | None = None, offset: int = 0) -> TokenPacking:
        """The layout of `tokens` tokens at positions offset.. in a session whose keys cover up
        to `max_tokens` positions."""
        if max_tokens is not None and offset + tokens > max_tokens:
            raise HEError(f"positions up to {offset + tokens} exceed the session's {max_tokens}")
        return TokenPacking(slots, tokens, tp_min=TokenPacking(slots, max_tokens or tokens).tp, offset=offset)

    def new_cache(self, ev: CkksEvaluator) -> "FheKVCache":
        return FheKVCache(ev)

    def _ctx(self, T: int, positions, last_only: bool) -> dict:
        ctx = {"pos0": int(positions[0]), "T": T, "positions": np.asarray(positions), "last_only": last_only}
        if self.graph.kind == "encoder":
            ctx["B"] = None
        return ctx

    def run(self, ev: CkksEvaluator, x: CkksTensor, outputs: Sequence[str] = ("hidden",),
            last_only: bool = False, on_layer=None, cache: "FheKVCache | None" = None) -> dict:
        """The graph's `outputs` from the encrypted input value (the client's embedding sum,
        packed at positions x.packing.offset..; decoders: after what `cache` holds, a fresh
        cache if None).  ``on_layer(layer, n_layers)`` is called after each layer (progress, a
        session's liveness check: an exception there stops the pass)."""
        T = x.packing.tokens
        if cache is not None and cache.length != x.packing.offset:
            raise HEError(f"the pass starts at position {x.packing.offset}, the cache holds {cache.length}")
        cache = self.new_cache(ev) if cache is None else cache
        positions = np.arange(x.packing.offset, x.packing.end)
        need = self.executor.needed(self.graph.outputs[r] for r in outputs)
        client = {n.name for n in self.client}
        nodes = [n for n in self.graph.nodes if n.name in need and n.name not in client]
        want = [self.graph.outputs[r] for r in outputs]
        vals = self._executor(ev, on_layer).run_nodes(nodes, {self.input_value: x},
                                                       self._ctx(T, positions, last_only), cache, keep=want)
        cache.length = x.packing.end
        return {r: vals[self.graph.outputs[r]] for r in outputs}

    def logits(self, ev: CkksEvaluator, x: CkksTensor, on_layer=None, cache: "FheKVCache | None" = None) -> CkksTensor:
        """Decoders: the logits of the pass's last position (valid there only)."""
        return self.run(ev, x, ("logits",), last_only=True, on_layer=on_layer, cache=cache)["logits"]

    def classify(self, ev: CkksEvaluator, x: CkksTensor, on_layer=None) -> CkksTensor:
        """Encoders with a classifier head: logits (valid at position 0) of the classifier on
        the L2-normalised mean of the last hidden states (sentence-transformers pooling)."""
        h = self.run(ev, x, on_layer=on_layer)["hidden"]
        mean, sums = self.pool_sums(ev, h)
        return FheLinear(self, ev).linear(self.pool_finish(ev, mean, sums), ["classifier"])[0]

    def pool_sums(self, ev: CkksEvaluator, h: CkksTensor) -> tuple[CkksTensor, list]:
        """(the mean over tokens of the blocks of `h`, [their sum of squares over channels]):
        partial sums when `h` holds only some of the blocks (the distributed executor adds
        the holders' partials)."""
        P, T = h.packing, h.packing.tokens
        h = ev.refresh(h, 1, "pool")
        with ev.timer("pool"):
            cts = [ev.mul_scalar_ct(ev.window_sum(c, P.tp // 2, 1), 1.0 / T) for c in h.cts]
        mean = h.with_cts(cts, bound=self.calibration["bounds"]["pool.mean"])
        # the sum of squares goes into rsqrt's bootstrap with rsqrt's interval as its bound
        mean = ev.refresh(mean, 1 + ev.reserve(self.calibration["ranges"][("pool", "rsqrt")][1]), "pool.norm")
        return mean, [ev.channel_sum(mean.with_cts([ev.mul_ct(c, c) for c in mean.cts]))]

    def pool_finish(self, ev: CkksEvaluator, mean: CkksTensor, sums: list) -> CkksTensor:
        """The L2-normalised mean (valid at position 0) from `pool_sums` over all channels."""
        P = mean.packing
        r = ev.poly(CkksTensor([sums[0]], P.cpc, P, self.calibration["ranges"][("pool", "rsqrt")][1]),
                    self.approx(_POOL, "rsqrt"), "pool.rsqrt")
        mean = ev.refresh(mean, 1, "pool.scale")
        r = ev.refresh(r, 1, "pool.scale")
        emb = mean.with_cts([ev.mul_ct(c, r.cts[0]) for c in mean.cts], bound=1.01)
        emb.position = 0
        return emb


class FheKVCache:
    """A decoder session's KV cache on the server: per layer the keys (after RoPE) and the
    values of every position so far, encrypted, packed by absolute position (offset 0).  A
    pass's new keys sit at its own positions and zeros elsewhere, so appending is a
    ciphertext addition.  The cache is refreshed when it would otherwise be bootstrapped by
    every later step (kept with the levels Q.K^T and P.V consume)."""

    def __init__(self, ev: CkksEvaluator):
        self.ev = ev
        self.k: dict[int, CkksTensor] = {}
        self.v: dict[int, CkksTensor] = {}
        self.length = 0

    def _append(self, old: CkksTensor | None, new: CkksTensor, need: int, label: str) -> CkksTensor:
        P = new.packing
        if old is not None and old.packing.end != P.offset:
            raise HEError(f"{label}: cached positions end at {old.packing.end}, the pass starts at {P.offset}")
        whole = TokenPacking(P.slots, P.end, tp_min=P.tp)
        if old is None:
            t = CkksTensor(new.cts, new.d, whole, new.bound)
        else:
            t = CkksTensor([self.ev.add_ct(a, b) for a, b in zip(old.cts, new.cts)], new.d, whole,
                           max(old.bound, new.bound))
        return self.ev.refresh(t, need + self.ev.reserve(t.bound), label)

    def append_node(self, node: Node, k: CkksTensor, v: CkksTensor) -> tuple[CkksTensor, CkksTensor]:
        layer = node.attrs["layer"]
        self.k[layer] = self._append(self.k.get(layer), k, 2, f"{node.name}.k")
        self.v[layer] = self._append(self.v.get(layer), v, 1, f"{node.name}.v")
        return self.k[layer], self.v[layer]


class _FheWalk(GraphExecutor):
    """The graph walk with a per-layer callback."""

    on_layer = None

    def run_nodes(self, nodes, vals: dict, ctx: dict, cache=None, keep=None) -> dict:
        self.linear.vals = vals  # updated in place by the walk: the projections' level caps read it
        return super().run_nodes(nodes, vals, ctx, cache, keep)

    def _layer_done(self, layer, ctx) -> None:
        if self.on_layer is not None and layer is not None:
            self.on_layer(layer, self.graph.n_layers)


class _PoolNode:
    name = "pool"


_POOL = _PoolNode()


def pooled_ranges(hidden: Sequence[np.ndarray], margin: float = 0.25) -> dict:
    """Calibration entries of `FheModel.classify`'s pooling from plain last hidden states
    (T, d): the mean's bound and the range of its squared norm."""
    means = [np.asarray(h, np.float64).mean(axis=0) for h in hidden]
    n2 = np.array([float(m @ m) for m in means])
    return {"bounds": {"pool.mean": float(max(np.abs(m).max() for m in means)) * (1 + margin)},
            "ranges": {("pool", "rsqrt"): (float(n2.min()) / (1 + margin), float(n2.max()) * (1 + margin))}}


def client_tensors(model: FheModel) -> dict[str, np.ndarray]:
    """The graph tensors the client's nodes read (the embedding tables): what a server sends
    its fhe clients."""
    return {w: np.asarray(model.params[w]) for n in model.client for w in n.weights}


def client_embedding(graph: Graph, tensors: dict[str, np.ndarray], ids, token_types=None,
                     positions=None) -> np.ndarray:
    """The client's part of a pass: the (T, d) embedding sum of token ids `ids` (at `positions`,
    default 0..T-1; token types 0 unless given), in the clear, from the embedding tables."""
    from .graph_executor import PlainBackend

    ids = np.asarray(ids, np.int64).reshape(-1)
    T = ids.size
    nodes, out = client_nodes(graph)
    inputs = {"ids": ids, "positions": np.arange(T) if positions is None else np.asarray(positions, np.int64),
              "token_types": np.zeros(T, np.int64) if token_types is None else np.asarray(token_types, np.int64)}
    be = PlainBackend(tensors)
    vals = dict(inputs)
    for n in nodes:
        vals[n.out] = getattr(be, n.op)(n, *[vals[v] for v in n.inputs], ctx={})
    return vals[out]


def calibrated_model(lm, inputs, classifier=None, margin: float = 0.25) -> FheModel:
    """An `FheModel` of a loaded model (`cipherlm.models.load_model`) with its ranges measured by
    plain passes over token id lists `inputs` (`cipherlm.fhe.calibrate.fhe_ranges`); with a
    ``classifier`` (W, b) head, also the pooling's and the head's ranges."""
    from cipherlm.fhe.calibrate import _plain_pass, fhe_ranges

    from .plain import plain_executor

    ex = plain_executor(lm, dtype=np.float64)
    inputs = [np.asarray(i, np.int64) for i in inputs]
    cal = fhe_ranges(ex, inputs, margin)
    if classifier is not None:
        hidden = [_plain_pass(ex, i)[0][ex.graph.outputs["hidden"]] for i in inputs]
        pr = pooled_ranges(hidden, margin)
        cal["bounds"].update(pr["bounds"])
        cal["ranges"].update(pr["ranges"])
        w, b = classifier
        embs = [h.mean(0) / np.linalg.norm(h.mean(0)) for h in hidden]
        logits = np.array([e @ np.asarray(w, np.float64).T + (0 if b is None else b) for e in embs])
        cal["classifier_bound"] = float(np.abs(logits).max()) * (1 + margin) + 1.0
    return FheModel(lm.config, lm.weights, cal, classifier)
