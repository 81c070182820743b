"""2pc mode executor: whole Transformers on secret shares (prompt and weights private).

The system of BLB (``blb_004``) sections 2-3 in its Bumblebee-style "BFV + MPC"
form (BLB Table 11's baseline), with CryptoMoE section 2.2's threat model:
semi-honest client (party 0) and server (party 1); the client holds the
prompt and learns only the output (the argmax token, or a classifier's
logits); the server holds every weight and learns nothing.  Activations live
as additive shares over Z_2^64 with ``f = 16`` fraction bits (`cipherlm.mpc`).

Who does what (BLB section 2.3, Figure 2):

* **linear** (every projection, the LM head, the probe): HE cross term of the
  client's share with the server's weight plus the server's local term, then
  extend-then-truncate back into the ring (`cipherlm.protocols.linear.linear`).
* **attention matmul** (Q K^T, P V, both operands secret; GQA by grouping the
  query heads that share a KV head): `cipherlm.protocols.linear.matmul_shared`.
* **embedding**: the client's one-hot times the server's table, either through
  FastQuery's private lookup (`cipherlm.protocols.embedding.embedding_lookup`,
  when present) or through `linear` with the one-hot as the client's share and
  0 as the server's (the Cheetah baseline of FastQuery Table 6).  BERT's
  position and token-type rows are the server's and public-position-indexed:
  the server adds them to its own share (free).
* **RoPE**: a public linear map (cos/sin of public positions, rotate-half is a
  permutation), applied locally to each share: free.
* **norm**: LayerNorm / RMSNorm statistics and 1/sqrt on shares
  (`cipherlm.mpc.nonlinear`).  The server's gamma (and the public constant of
  the row mean) are folded into the weights of the projections that consume the
  norm (pre-norm Llama: exact); when the residual stream needs gamma and beta
  themselves (post-norm BERT) the server's private gamma multiplies the shares
  with one Gilboa cross term (the client's share times the server's vector,
  CrypTFlow2 section 4.1) and beta is added to the server's share.
* **softmax** (public causal / padding mask), **activation** (GeLU, SwiGLU):
  `cipherlm.mpc.nonlinear`.
* **MoE** (Qwen2-MoE, OLMoE, Mixtral; dense layers and shared experts as their
  configs say): CryptoMoE (``cryptomoe_000`` sections 4.1-4.3) through
  `cipherlm.moe.layer.moe_layer`: gate routing on shares, balanced routing with
  a public capacity factor c from the plan (each expert takes exactly
  t = ceil(c m k / n) of a pass's m tokens, so no count per expert is revealed),
  secure dispatch / expert SwiGLU / combine.  With c = n / k nothing is dropped
  and the layer computes the model's own top-k function.  OLMoE's q/k RMSNorm
  runs on shares with the server's gamma as a private product.
* **argmax**: comparison tree on the logit shares; only the index is opened,
  and only to the client (``reveal(to=0)``).  The server never opens anything.

The KV cache is held in shares (each party keeps its share of every layer's
K and V); prefill processes the prompt in one pass, decode one token per pass.

Weights are mapped exactly as in the plaintext executor: `split_params` and
`DecoderSpec` are reused; the server side of `TwoPCDecoder` / `TwoPCEncoder`
is built by `server_weights` from the same dictionaries.

Accounting: `OpMeter` records, per operator class, the bytes, messages and
flights that crossed this party's channel and the seconds spent, as deltas of
the channel counters around each block.  Inside a linear / attention-matmul /
embedding block the HE traffic (steps ``linear``, ``matmul-shared``) stays in
the class and the rest (sign extension of the 40-bit HE results, its
millionaires and OTs) is reported as ``conversions`` (BLB section 3's HE<->MPC
conversion); first-use set-up (base OTs, BFV public keys) is ``setup``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from cipherlm.mpc import nonlinear as nl
from cipherlm.mpc.context import MPCError
from cipherlm.mpc.protocols.mul import cross_term, square
from cipherlm.mpc.protocols.trunc import trunc_faithful, trunc_local
from cipherlm.mpc.ring import fixed_encode, mask
from cipherlm.mpc.shares import AShare, concatenate
from cipherlm.moe.layer import MoEShape, MoEWeights
from cipherlm.runtime import ops
from cipherlm.runtime.plain import ENCODER_TYPES, DecoderSpec, split_params

OP_CLASSES = ("embedding", "linear", "attention_matmul", "softmax", "activation", "norm", "rope", "moe", "argmax",
              "conversions", "setup", "control")

#: channel steps that carry the HE products themselves (everything else inside a
#: linear-type block is the share conversion after it)
HE_STEPS = frozenset({"linear", "matmul-shared"})
SETUP_STEPS = frozenset({"he-keys", "ot.base"})
_LINEAR_CLASSES = frozenset({"linear", "attention_matmul"})

#: "onehot-linear": the client's one-hot through `linear` (dense Cheetah baseline);
#: the others are `cipherlm.protocols.embedding.METHODS` (FastQuery and its ablation rows;
#: "exact" = 12-bit table with PackLWEs, the one that keeps real models' accuracy)
EMBEDDING_METHODS = ("auto", "onehot-linear", "exact", "fastquery", "cheetah", "+quant", "+accbits", "+packing")
#: the linear layers' packing (`cipherlm.protocols.linear.linear`): "coeff" (Cheetah
#: coefficient packing; the default, fastest here), "simd" (BOLT-style BSGS, fewer bytes),
#: "auto" (per layer, `linear_simd.choose_packing`'s cost model at the plan's network preset;
#: the choices are in `linear_packing_report`)
LINEAR_PACKINGS = ("coeff", "simd", "auto")
SUPPORTED_DECODERS = ("llama", "mistral", "qwen2", "qwen2_moe", "olmoe", "mixtral")
#: MoE layers (Qwen2-MoE, OLMoE, Mixtral) run CryptoMoE (`cipherlm.moe.layer.moe_layer`)
#: with balanced routing; the capacity factor c is public (t = ceil(c m k / n) tokens
#: per expert per pass, `cipherlm.moe.routing.capacity`)
DEFAULT_MOE_CAPACITY = 2.0

#: fraction bits of the RMSNorm statistics (row mean of squares and its 1/sqrt):
#: more than the ring's 16 so that 1/sqrt of LLaMA's massive-activation rows
#: (mean square ~1e6 in SmolLM2) keeps ~1e-3 relative precision
NORM_FRAC = 20
#: RMSNorm: rsqrt range of the mean square (covers SmolLM2's 0.008 .. 1.1e6)
RMS_LO, RMS_HI = 2.0 ** -12, 2.0 ** 22
#: LayerNorm (BERT): variance range (MiniLM: 0.0034 .. 130)
LN_VAR_LO, LN_VAR_HI = 2.0 ** -10, 2.0 ** 12


class TwoPCError(MPCError):
    """The model or the request cannot run in the 2pc mode."""


# ----------------------------------------------------------------------------- accounting


def _new_counter() -> dict[str, int]:
    return {"bytes_sent": 0, "bytes_received": 0, "messages_sent": 0, "messages_received": 0,
            "rounds": 0, "flights_received": 0}


class OpMeter:
    """Bytes / messages / flights / seconds per operator class for one party.

    ``with meter("softmax"): ...``: the channel's counters before and after the
    block are compared; nested blocks count towards the outermost one.  `stats`
    returns the traffic in `Channel.stats` format keyed by operator class (so
    `RunReport.add_channel_stats` takes it as is); `seconds` the wall time.
    """

    def __init__(self, chan):
        self.chan = chan
        self.traffic: dict[str, dict[str, int]] = defaultdict(_new_counter)
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._active = False

    @contextlib.contextmanager
    def __call__(self, op_class: str):
        if self._active:
            yield
            return
        self._active = True
        before = self.chan.stats()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            after = self.chan.stats()
            self._active = False
            self.seconds[op_class] += dt
            self.calls[op_class] += 1
            for label, c in after.items():
                b = before.get(label, {})
                delta = {k: int(v) - int(b.get(k, 0)) for k, v in c.items()}
                if not any(delta.values()):
                    continue
                cls = self._classify(op_class, label)
                acc = self.traffic[cls]
                for k, v in delta.items():
                    acc[k] = acc.get(k, 0) + v

    @staticmethod
    def _classify(op_class: str, label: str) -> str:
        if label in SETUP_STEPS or label.endswith(".setup"):
            return "setup"
        if op_class == "embedding":
            if label in HE_STEPS or (label.startswith("embedding.") and not label.endswith(".extend")):
                return "embedding"
            return "conversions"
        if op_class in _LINEAR_CLASSES and label not in HE_STEPS:
            return "conversions"
        return op_class

    def stats(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in self.traffic.items()}

    def summary(self) -> dict:
        """JSON-able: {op_class: {bytes, flights, seconds, calls}}."""
        out = {}
        for k in sorted(set(self.traffic) | set(self.seconds)):
            t = self.traffic.get(k, _new_counter())
            out[k] = {"bytes": t["bytes_sent"] + t["bytes_received"], "bytes_sent": t["bytes_sent"],
                      "flights": t["rounds"] + t["flights_received"], "seconds": self.seconds.get(k, 0.0),
                      "calls": self.calls.get(k, 0)}
        return out


def linear_packing_report(ctx, plan: dict) -> dict:
    """The linear layers' packing for a report: the plan's setting and, with "auto", each
    distinct layer shape's choice (`linear_simd.PackingChoice`: modelled seconds and
    bytes of both packings, SIMD rotations) and how many calls took each packing."""
    from ..protocols.linear import linear_stats

    lin = dict(plan.get("linear") or {"packing": "coeff", "network": "LAN"})
    choices = linear_stats(ctx).packings
    if choices:
        shapes: dict = {}
        for c in choices:
            shapes.setdefault((c["m"], c["d"], c["o"]), c)
        lin["choices"] = list(shapes.values())
        lin["calls"] = {p: sum(c["packing"] == p for c in choices) for p in ("coeff", "simd")}
    return lin


class _NoMeter:
    @contextlib.contextmanager
    def __call__(self, op_class):
        yield


# ----------------------------------------------------------------------------- share helpers


def add_private(ctx, x: AShare, v, owner: int = 1) -> AShare:
    """x + v where v (a real array broadcastable to x) is known to `owner` only: it adds
    v to its own share (free)."""
    if ctx.party != owner:
        return x
    enc = fixed_encode(np.broadcast_to(np.asarray(v, np.float64), x.shape), x.frac, x.bits)
    return AShare(ctx, (x.data + enc) & mask(x.bits), x.bits, x.frac)


def scale_private(ctx, x: AShare, v, owner: int = 1) -> AShare:
    """x * v elementwise, v real (broadcast over x) known to `owner` only.

    x v = x_owner v + x_other v: the first term is local, the second one Gilboa
    cross term (correlated OT, `mpc.protocols.mul.cross_term`, CrypTFlow2
    section 4.1) with the owner as OT sender; then SecureML local truncation."""
    bits, f = x.bits, x.frac
    flat = x.data.reshape(-1)
    if ctx.party == owner:
        enc = fixed_encode(np.broadcast_to(np.asarray(v, np.float64), x.shape), f, bits).reshape(-1)
        out = flat * enc + cross_term(ctx, enc, bits, sender=owner)
    else:
        out = cross_term(ctx, flat, bits, sender=owner)
    prod = AShare(ctx, (out & mask(bits)).reshape(x.shape), bits, 2 * f)
    return trunc_local(ctx, prod, f)


def client_one_hot(ctx, ids: np.ndarray | None, n: int, vocab: int) -> AShare:
    """The client's tokens as a shared one-hot (n, vocab): the client's share is the one-hot
    at the ring's scale, the server's is 0 (no message: the client's input stays in its share)."""
    ring = ctx.ring
    data = np.zeros((n, vocab), np.uint64)
    if ctx.party == 0:
        ids = _check_ids(ids, n, vocab)
        data[np.arange(n), ids] = np.uint64(1 << ring.frac)
    return AShare(ctx, data, ring.bits, ring.frac)


def _check_ids(ids, n: int, vocab: int) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size != n:
        raise TwoPCError(f"expected {n} token ids, got {ids.size}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise TwoPCError(f"token id out of range 0..{vocab - 1}")
    return ids


def _rms_factor(d: int) -> tuple[int, float]:
    """d = 2^k c with c in [1, 2): the row mean of squares is taken as sum / 2^k (exact shift)."""
    k = int(math.floor(math.log2(d)))
    return k, d / 2.0 ** k


def rms_statistic(ctx, x: AShare, eps: float) -> AShare:
    """x * rsqrt(sum(x^2)/2^k + c eps), so that RMSNorm(x) = this * sqrt(c) * gamma (d = 2^k c).

    Squares in the ring at 14 fraction bits (exact, no truncation), row sums
    exact, one faithful truncation per row (CrypTFlow2 section 5) to the mean at
    ``NORM_FRAC`` bits, rsqrt by bracket + Newton (`nonlinear.rsqrt`) on
    [RMS_LO, RMS_HI], one fixed-point product per element (Bumblebee section 4.3)."""
    d = x.shape[-1]
    k, c = _rms_factor(d)
    x14 = trunc_local(ctx, x, x.frac - 14) if x.frac > 14 else x
    s = square(ctx, x14).sum(axis=-1, keepdims=True)  # frac 28
    ms = trunc_faithful(ctx, s, 28 - NORM_FRAC + k)
    ms = AShare(ctx, ms.data, ms.bits, NORM_FRAC).add_public_fixed(c * eps)
    r = nl.rsqrt(ctx, ms, RMS_LO, RMS_HI)
    return nl.mulf(ctx, x, r.broadcast_to(x.shape))


def rope_shares(ctx, x: AShare, positions: np.ndarray, inv_freq: np.ndarray) -> AShare:
    """RoPE (rotate-half convention) on shares, x (H, T, hd): x cos + rot(x) sin with public
    cos/sin; both products accumulate before one local truncation (free)."""
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :]
    emb = np.concatenate([ang, ang], axis=-1)
    f = x.frac
    cos = fixed_encode(np.cos(emb), f, x.bits)
    sin = fixed_encode(np.sin(emb), f, x.bits)
    half = x.shape[-1] // 2
    rot = np.concatenate([np.uint64(0) - x.data[..., half:], x.data[..., :half]], axis=-1)
    prod = AShare(ctx, (x.data * cos + rot * sin) & mask(x.bits), x.bits, 2 * f)
    return trunc_local(ctx, prod, f)


def _linear_fns():
    from cipherlm.protocols.linear import linear, matmul_shared
    return linear, matmul_shared


def embedding_backend(method: str = "auto") -> str:
    """Resolve the embedding method: "auto" is FastQuery's protocol with the 12-bit table
    ("exact") when `cipherlm.protocols.embedding` is present, else "onehot-linear"."""
    if method not in EMBEDDING_METHODS:
        raise TwoPCError(f"unknown embedding method {method!r}; one of {EMBEDDING_METHODS}")
    if method == "onehot-linear":
        return method
    try:
        from cipherlm.protocols import embedding as E
    except ImportError:
        if method != "auto":
            raise TwoPCError("the FastQuery embedding protocol (cipherlm.protocols.embedding) is not available")
        return "onehot-linear"
    m = "exact" if method == "auto" else method
    if m not in E.METHODS:
        raise TwoPCError(f"embedding method {m!r} unknown to cipherlm.protocols.embedding")
    return m


# ----------------------------------------------------------------------------- server weights


@dataclass
class Proj:
    """A projection as the 2pc linear protocol takes it: W (d_in, d_out), bias (d_out,) or None."""

    w: np.ndarray
    b: np.ndarray | None

    @property
    def d_out(self) -> int:
        return int(self.w.shape[1])


def _stack(server_linears: dict, names: Sequence[str], scale_in=None, scale_out=None) -> Proj:
    """Projections sharing an input as one (d_in, sum d_out) matrix; scale_in (d_in,) folds a
    norm's gamma into the rows, scale_out[i] a scalar into projection i's columns and bias."""
    ws, bs = [], []
    any_bias = any(server_linears[n][1] is not None for n in names)
    for i, n in enumerate(names):
        w, b = server_linears[n]
        wt = np.asarray(w, np.float64).T
        bb = np.zeros(wt.shape[1]) if b is None else np.asarray(b, np.float64)
        if scale_out is not None and scale_out[i] != 1.0:
            wt, bb = wt * scale_out[i], bb * scale_out[i]
        ws.append(wt)
        bs.append(bb)
    w = np.concatenate(ws, axis=1)
    if scale_in is not None:
        w = w * np.asarray(scale_in, np.float64)[:, None]
    return Proj(np.ascontiguousarray(w), np.concatenate(bs) if any_bias else None)


def weight_bound() -> float:
    """The linear protocol's public bound on |W| (weights are encoded with W_FRAC bits in W_BITS)."""
    from cipherlm.protocols.linear import W_BITS, W_FRAC
    return 2.0 ** (W_BITS - 1 - W_FRAC) - 2.0 ** -W_FRAC


def server_weights(config: dict, weights: dict[str, np.ndarray], classifier: tuple | None = None,
                   fold_norms: bool | None = None) -> dict:
    """The server's tensors for the 2pc executors, from the Hugging Face weights (via
    `split_params`, exactly as the plaintext executor maps them).

    Decoders: {"embed", "layers": [{qkv, o, gu, down, g1, g2}], "head", "gf", "fold_norms"}:
    with ``fold_norms`` (default: when every folded weight stays within the linear
    protocol's bound) RMSNorm's gamma * sqrt(c) is folded into q/k/v, gate/up and the
    LM head (g1, g2, gf are then None); the attention scale 1/sqrt(hd) is folded into q.
    Encoders: {"word", "pos", "type0", "emb_ln", "layers": [{qkv, o, ln1, inter, out, ln2}],
    "classifier"}."""
    mt = config.get("model_type")
    if mt not in ENCODER_TYPES:
        _decoder_spec(config)  # a clear error for unsupported decoders before touching weights
    client, server = split_params(config, weights)
    if mt in ENCODER_TYPES:
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise TwoPCError("only absolute position embeddings are supported")
        n_layers, d, H = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
        scale = (d // H) ** -0.5
        out = {
            "word": np.asarray(client["embeddings.word_embeddings.weight"], np.float64),
            "pos": np.asarray(client["embeddings.position_embeddings.weight"], np.float64),
            "type0": np.asarray(client["embeddings.token_type_embeddings.weight"][0], np.float64),
            "emb_ln": (client["embeddings.LayerNorm.weight"], client["embeddings.LayerNorm.bias"]),
            "layers": [],
            "classifier": None,
        }
        for i in range(n_layers):
            p = f"encoder.layer.{i}"
            a = f"{p}.attention"
            out["layers"].append({
                "qkv": _stack(server, [f"{a}.self.query", f"{a}.self.key", f"{a}.self.value"],
                              scale_out=[scale, 1.0, 1.0]),
                "o": _stack(server, [f"{a}.output.dense"]),
                "ln1": (client[f"{a}.output.LayerNorm.weight"], client[f"{a}.output.LayerNorm.bias"]),
                "inter": _stack(server, [f"{p}.intermediate.dense"]),
                "out": _stack(server, [f"{p}.output.dense"]),
                "ln2": (client[f"{p}.output.LayerNorm.weight"], client[f"{p}.output.LayerNorm.bias"]),
            })
        if classifier is not None:
            out["classifier"] = _stack({"classifier": classifier}, ["classifier"])
        elif "classifier" in server:
            out["classifier"] = _stack(server, ["classifier"])
        return out
    spec = _decoder_spec(config)
    _, c = _rms_factor(spec.d_model)
    rc = math.sqrt(c)
    scale = spec.head_dim ** -0.5
    layers = []
    for i in range(spec.n_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        g1 = np.asarray(client[f"{p}.input_layernorm.weight"], np.float64) * rc
        g2 = np.asarray(client[f"{p}.post_attention_layernorm.weight"], np.float64) * rc
        L = {"g1": g1, "g2": g2, "o": _stack(server, [f"{a}.o_proj"])}
        if spec.qk_norm:
            # OLMoE: RMSNorm over the whole q (and k) row after the projection; its gamma
            # (and, for q, the attention scale) is a server-private product after it
            L["qkv"] = _stack(server, [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"])
            L["qn"] = np.asarray(client[f"{a}.q_norm.weight"], np.float64) * math.sqrt(_rms_factor(spec.n_heads * spec.head_dim)[1]) * scale
            L["kn"] = np.asarray(client[f"{a}.k_norm.weight"], np.float64) * math.sqrt(_rms_factor(spec.n_kv_heads * spec.head_dim)[1])
        else:
            L["qkv"] = _stack(server, [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"], scale_out=[scale, 1.0, 1.0])
        if i in spec.moe_layers:
            L["moe"] = MoEWeights.from_server_linears(server, f"{p}.mlp", MoEShape.from_config(config))
        else:
            L["gu"] = _stack(server, [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"])
            L["down"] = _stack(server, [f"{p}.mlp.down_proj"])
        layers.append(L)
    gf = np.asarray(client["model.norm.weight"], np.float64) * rc
    head = _stack(server, ["lm_head"])
    bound = weight_bound()

    def fits(g, proj):
        return float(np.max(np.abs(proj.w * g[:, None]))) <= bound

    def ffn_fits(L):
        return fits(L["g2"], L["gu"]) if "gu" in L else _moe_max_folded(L["moe"], L["g2"]) <= bound

    if fold_norms is None:
        fold_norms = all(fits(L["g1"], L["qkv"]) and ffn_fits(L) for L in layers) and fits(gf, head)
    if fold_norms:
        for L in layers:
            L["qkv"] = Proj(L["qkv"].w * L["g1"][:, None], L["qkv"].b)
            if "gu" in L:
                L["gu"] = Proj(L["gu"].w * L["g2"][:, None], L["gu"].b)
            else:
                L["moe"] = _moe_fold_input(L["moe"], L["g2"])
            L["g1"] = L["g2"] = None
        head = Proj(head.w * gf[:, None], head.b)
        gf = None
    return {"embed": np.asarray(client["model.embed_tokens.weight"], np.float64), "layers": layers,
            "head": head, "gf": gf, "fold_norms": bool(fold_norms)}


#: MoE weights whose input side an RMSNorm gamma scales (rows of the (d_in, d_out) arrays)
_MOE_INPUT_SIDE = ("router", "gate", "up", "shared_gate", "shared_up", "shared_router")


def _moe_max_folded(w: MoEWeights, g: np.ndarray) -> float:
    return max(float(np.max(np.abs(np.asarray(a, np.float64) * g[:, None])))
               for a in (getattr(w, n) for n in _MOE_INPUT_SIDE) if a is not None)


def _moe_fold_input(w: MoEWeights, g: np.ndarray) -> MoEWeights:
    """gamma folded into every input-side MoE weight (router, experts' gate/up, shared expert)."""
    out = dataclasses.replace(w)
    for n in _MOE_INPUT_SIDE:
        a = getattr(w, n)
        if a is not None:
            setattr(out, n, (np.asarray(a, np.float64) * g[:, None]).astype(np.float32))
    return out


def _decoder_spec(config: dict) -> DecoderSpec:
    spec = DecoderSpec.from_config(config)
    if spec.family not in SUPPORTED_DECODERS:
        raise TwoPCError(f"the 2pc executor runs Llama-family decoders ({', '.join(SUPPORTED_DECODERS)}); "
                         f"got {config.get('model_type')!r}")
    if spec.clip_qkv is not None:
        raise TwoPCError("clip_qkv is not supported by the 2pc executor (OLMoE configs with clip_qkv: null are)")
    if spec.act not in ("silu", "swish"):
        raise TwoPCError(f"unsupported decoder activation {spec.act!r} (SwiGLU only)")
    return spec


def public_plan(config: dict, server: dict | None = None, embedding: str = "auto",
                moe_capacity: float = DEFAULT_MOE_CAPACITY, linear_packing: str = "coeff",
                network: str = "LAN") -> dict:
    """What both parties must agree on beyond the config: the structure choices that
    depend on the server's weights (folded norms, classifier width), the MoE
    capacity factor and the linear layers' packing (with the network preset its
    cost model and the SIMD plans assume). JSON-able."""
    from ..net.netmodel import PRESETS

    if linear_packing not in LINEAR_PACKINGS:
        raise TwoPCError(f"unknown linear packing {linear_packing!r}; one of {LINEAR_PACKINGS}")
    if network not in PRESETS:
        raise TwoPCError(f"unknown network preset {network!r}; one of {sorted(PRESETS)}")
    plan = {"embedding": embedding_backend(embedding), "linear": {"packing": linear_packing, "network": network}}
    if config.get("model_type") not in ENCODER_TYPES and _decoder_spec(config).moe_layers:
        c = float(moe_capacity)
        if not (math.isfinite(c) and c > 0):
            raise TwoPCError(f"MoE capacity factor must be a positive number, got {moe_capacity!r}")
        plan["moe"] = {"variant": "cryptomoe", "capacity": c}
    if config.get("model_type") in ENCODER_TYPES:
        cls = None if server is None else server.get("classifier")
        plan["classes"] = None if cls is None else cls.d_out
    else:
        plan["fold_norms"] = None if server is None else bool(server["fold_norms"])
    return plan


# ----------------------------------------------------------------------------- executors


class _SharesExecutor:
    """Common plumbing: the context, the meter, the linear protocol, the embedding."""

    #: (linear, matmul_shared) implementation; None = `cipherlm.protocols.linear`
    linear_impl = None
    #: which products keep their HE-encoded weights between calls (`linear`'s cache_key):
    #: "decode" = single-row passes only (per-token decode reuses them; a multi-row pass
    #: packs fewer weights per plaintext, ~2 GB per SmolLM2 layer at 24 rows, so it encodes
    #: afresh), "all", or "none"
    cache_weights = "decode"

    def __init__(self, ctx, config: dict, server: dict | None, plan: dict, meter=None, progress=None):
        if (ctx.party == 1) != (server is not None):
            raise TwoPCError("the server (party 1) passes the weights, the client (party 0) passes None")
        self.ctx = ctx
        self.config = config
        self.server = server
        self.plan = dict(plan)
        self.meter = meter if meter is not None else _NoMeter()
        self.progress = progress
        self._linear, self._matmul = self.linear_impl or _linear_fns()
        lin = self.plan.get("linear") or {"packing": "coeff"}
        # only non-default packings are passed on (custom `linear_impl`s need not know them)
        self._packing = {} if lin["packing"] == "coeff" else {"packing": lin["packing"], "network": lin["network"]}
        self._emb_setup = None

    # -- operators
    def _cache_key(self, key: str, rows: int):
        # both parties decide alike (the plan depends on whether the weights are cached)
        if self.cache_weights == "all" or (self.cache_weights == "decode" and rows == 1):
            return key
        return None

    def linear(self, x: AShare, proj: Proj | None, d_out: int, key: str, op_class: str = "linear") -> AShare:
        with self.meter(op_class):
            w = None if proj is None else proj.w
            b = None if proj is None else proj.b
            rows = int(np.prod(x.shape[:-1], dtype=np.int64))
            return self._linear(self.ctx, x, w, b, out_features=d_out, cache_key=self._cache_key(key, rows),
                                **self._packing)

    def matmul(self, a: AShare, b: AShare) -> AShare:
        with self.meter("attention_matmul"):
            return self._matmul(self.ctx, a, b)

    def embed(self, ids, n: int, table: np.ndarray | None, vocab: int, dim: int) -> AShare:
        with self.meter("embedding"):
            if self.ctx.party == 0:
                ids = _check_ids(ids, n, vocab)
            method = self.plan["embedding"]
            if method != "onehot-linear":
                from cipherlm.protocols import embedding as E

                if self._emb_setup is None:  # once per executor: quantised, encoded table and keys
                    self._emb_setup = E.setup(self.ctx, table, vocab_size=vocab, dim=dim, method=method)
                return E.lookup(self.ctx, self._emb_setup, ids if self.ctx.party == 0 else None, n_ids=n)
            x = client_one_hot(self.ctx, ids, n, vocab)
            return self._linear(self.ctx, x, table, None, out_features=dim, cache_key=self._cache_key("embed", n))

    def _tick(self, done: int, total: int, note: str = "") -> None:
        if self.progress is not None:
            self.progress(done, total, note)


class ShareKVCache:
    """Per-layer shares of K and V (kv_heads, S, head_dim); each party holds its own shares."""

    def __init__(self, n_layers: int):
        self.k: list[AShare | None] = [None] * n_layers
        self.v: list[AShare | None] = [None] * n_layers
        self.length = 0

    def extend(self, layer: int, k: AShare, v: AShare) -> tuple[AShare, AShare]:
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = concatenate([self.k[layer], k], axis=1)
            self.v[layer] = concatenate([self.v[layer], v], axis=1)
        return self.k[layer], self.v[layer]


class TwoPCDecoder(_SharesExecutor):
    """Llama-family decoders (SmolLM2) on shares: prefill, per-token decode with a KV cache
    in shares, argmax opened to the client only."""

    def __init__(self, ctx, config: dict, server: dict | None, plan: dict | None = None, meter=None, progress=None):
        self.spec = _decoder_spec(config)
        plan = plan or public_plan(config, server)
        if plan.get("fold_norms") is None:
            raise TwoPCError("the plan must say whether the norms are folded (public_plan on the server)")
        super().__init__(ctx, config, server, plan, meter, progress)
        self.inv_freq = ops.rope_inv_freq(self.spec.head_dim, self.spec.rope_theta)
        self.max_positions = int(self.spec.max_positions)
        self.moe_shape = MoEShape.from_config(config) if self.spec.moe_layers else None
        if self.moe_shape is not None and not isinstance(self.plan.get("moe"), dict):
            raise TwoPCError("an MoE model's plan must carry the MoE settings (public_plan on the server)")
        #: per MoE layer: the routing capacity t and the bytes/seconds of each CryptoMoE phase
        #: (gate, dispatch, experts, combine, shared) of the last pass
        self.moe_phases: dict[int, dict] = {}

    def new_cache(self) -> ShareKVCache:
        return ShareKVCache(self.spec.n_layers)

    def _W(self, i, name):
        return None if self.server is None else self.server["layers"][i][name]

    def _norm(self, x: AShare, gamma_key: tuple | None) -> AShare:
        with self.meter("norm"):
            y = rms_statistic(self.ctx, x, self.spec.eps)
            if not self.plan["fold_norms"]:
                g = None
                if self.server is not None:
                    g = self.server["gf"] if gamma_key is None else self.server["layers"][gamma_key[0]][gamma_key[1]]
                y = scale_private(self.ctx, y, g)
            return y

    def forward(self, ids, n: int, cache: ShareKVCache | None = None, last_only: bool = False) -> AShare:
        """Logit shares (n or 1, vocab) for `n` tokens (ids: the client's, None at the server)
        appended after what `cache` holds."""
        s = self.spec
        n = int(n)
        if n < 1:
            raise TwoPCError("at least one token is needed")
        cache = cache if cache is not None else self.new_cache()
        pos0 = cache.length
        if pos0 + n > self.max_positions:
            raise TwoPCError(f"sequence longer than {self.max_positions} positions")
        positions = np.arange(pos0, pos0 + n)
        x = self.embed(ids, n, None if self.server is None else self.server["embed"], s.vocab_size, s.d_model)
        for i in range(s.n_layers):
            x = self._block(i, x, cache, pos0, positions)
            self._tick(i + 1, s.n_layers, f"{n} token(s)")
        cache.length = pos0 + n
        h = self._norm(x[-1:] if last_only else x, None)
        return self.linear(h, None if self.server is None else self.server["head"], s.vocab_size, "head")

    def _block(self, i, x, cache, pos0, positions):
        s = self.spec
        T, H, Hkv, hd = x.shape[0], s.n_heads, s.n_kv_heads, s.head_dim
        h = self._norm(x, (i, "g1"))
        qkv = self.linear(h, self._W(i, "qkv"), (H + 2 * Hkv) * hd, f"L{i}.qkv")
        q = qkv[:, : H * hd].reshape(T, H, hd).transpose(1, 0, 2)
        k = qkv[:, H * hd:(H + Hkv) * hd].reshape(T, Hkv, hd).transpose(1, 0, 2)
        v = qkv[:, (H + Hkv) * hd:].reshape(T, Hkv, hd).transpose(1, 0, 2)
        if s.qk_norm:
            q, k = self._qk_norm(i, q, k)
        with self.meter("rope"):
            q = rope_shares(self.ctx, q, positions, self.inv_freq)
            k = rope_shares(self.ctx, k, positions, self.inv_freq)
        k_all, v_all = cache.extend(i, k, v)
        S = k_all.shape[1]
        rep = H // Hkv
        qg = q.reshape(Hkv, rep * T, hd)
        scores = self.matmul(qg, k_all.transpose(0, 2, 1)).reshape(H, T, S)
        qpos = pos0 + np.arange(T)[:, None]
        kpos = np.arange(S)[None, :]
        keep = kpos <= qpos
        if s.sliding_window is not None:
            keep &= (qpos - kpos) < s.sliding_window
        with self.meter("softmax"):
            p = nl.softmax(self.ctx, scores, None if keep.all() else keep[None])
        ctx_ = self.matmul(p.reshape(Hkv, rep * T, S), v_all).reshape(H, T, hd).transpose(1, 0, 2).reshape(T, H * hd)
        x = x + self.linear(ctx_, self._W(i, "o"), s.d_model, f"L{i}.o")
        h = self._norm(x, (i, "g2"))
        if i in s.moe_layers:
            return x + self._moe(i, h)
        inter = (self.server["layers"][i]["gu"].d_out if self.server is not None else 2 * self.config["intermediate_size"])
        gu = self.linear(h, self._W(i, "gu"), inter, f"L{i}.gu")
        half = inter // 2
        with self.meter("activation"):
            a = nl.swiglu(self.ctx, gu[:, :half], gu[:, half:])
        return x + self.linear(a, self._W(i, "down"), s.d_model, f"L{i}.down")

    def _qk_norm(self, i, q: AShare, k: AShare) -> tuple[AShare, AShare]:
        """OLMoE's RMSNorm over each token's whole q (H hd) and k (Hkv hd), gammas
        server-private; q, k as (heads, T, hd)."""
        out = []
        for t, name in ((q, "qn"), (k, "kn")):
            heads, T, hd = t.shape
            row = t.transpose(1, 0, 2).reshape(T, heads * hd)
            with self.meter("norm"):
                y = scale_private(self.ctx, rms_statistic(self.ctx, row, self.spec.eps), self._W(i, name))
            out.append(y.reshape(T, heads, hd).transpose(1, 0, 2))
        return out[0], out[1]

    def _moe(self, i, h: AShare) -> AShare:
        """CryptoMoE layer (balanced routing, secure dispatch / combine; `cipherlm.moe`)."""
        from cipherlm.moe.layer import moe_layer

        moe = self.plan["moe"]
        with self.meter("moe"):
            r = moe_layer(self.ctx, h, self._W(i, "moe"), self.moe_shape, variant=moe["variant"],
                          c=float(moe["capacity"]), key=self._cache_key(f"L{i}.moe", h.shape[0]))
        self.moe_phases[i] = {"t": r.t, "phases": r.phases}
        return r.y

    # -- outputs
    def argmax_to_client(self, logits: AShare) -> np.ndarray | None:
        """Argmax of each row of the logit shares, opened to the client only (None at the server)."""
        with self.meter("argmax"):
            _, idx = nl.argmax_last(self.ctx, logits)
            out = idx.reveal(to=0)
        return None if out is None else out.reshape(-1).astype(np.int64)

    def logits_to_client(self, logits: AShare) -> np.ndarray | None:
        """The logits themselves, opened to the client only (diagnostics: the accuracy benchmark)."""
        with self.meter("argmax"):
            return logits.reveal_float(to=0)

    def generate(self, prompt_ids, n_prompt: int, max_new_tokens: int, eos_ids: Iterable[int] = (),
                 on_token: Callable[[int], None] | None = None) -> list[int] | None:
        """Greedy generation: prefill, then one decode pass per token with the shared KV cache.

        The client learns each argmax token and tells the server whether to go on (EOS or
        the budget reached): the server learns the number of generated tokens, as the
        length of the exchange shows anyway. Returns the new ids at the client, None at
        the server."""
        ctx = self.ctx
        eos = {int(e) for e in eos_ids}
        cache = self.new_cache()
        out: list[int] = []
        ids, n = prompt_ids, int(n_prompt)
        for step in range(int(max_new_tokens)):
            if cache.length + n > self.max_positions:
                break
            logits = self.forward(ids, n, cache, last_only=True)
            tok = self.argmax_to_client(logits)
            with self.meter("control"), ctx.step("control"):
                if ctx.party == 0:
                    t = int(tok[-1])
                    out.append(t)
                    if on_token is not None:
                        on_token(t)
                    go = t not in eos and step + 1 < max_new_tokens
                    ctx.send({"continue": bool(go)})
                else:
                    msg = ctx.recv()
                    go = msg.get("continue") if isinstance(msg, dict) else None
                    if not isinstance(go, bool):
                        raise TwoPCError("malformed control message from the client")
            if not go:
                break
            ids, n = ([out[-1]] if ctx.party == 0 else None), 1
        return out if ctx.party == 0 else None


class TwoPCEncoder(_SharesExecutor):
    """BERT encoders (MiniLM) on shares: embeddings, post-norm layers, mean pooling,
    L2 normalisation and the linear probe; class logits opened to the client only."""

    def __init__(self, ctx, config: dict, server: dict | None, plan: dict | None = None, meter=None, progress=None):
        if config.get("model_type") not in ENCODER_TYPES:
            raise TwoPCError(f"not an encoder: {config.get('model_type')!r}")
        plan = plan or public_plan(config, server)
        super().__init__(ctx, config, server, plan, meter, progress)
        self.n_layers = config["num_hidden_layers"]
        self.d = config["hidden_size"]
        self.H = config["num_attention_heads"]
        self.hd = self.d // self.H
        self.inter = config["intermediate_size"]
        self.vocab = config["vocab_size"]
        self.eps = config.get("layer_norm_eps", 1e-12)
        self.max_positions = config.get("max_position_embeddings", 512)
        act = config.get("hidden_act", "gelu")
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise TwoPCError(f"unsupported encoder activation {act!r}")

    def _layer_norm(self, x: AShare, gb) -> AShare:
        with self.meter("norm"):
            y = nl.layer_norm(self.ctx, x, None, None, self.eps, var_lo=LN_VAR_LO, var_hi=LN_VAR_HI)
            g, b = (None, None) if gb is None else gb
            y = scale_private(self.ctx, y, g)
            return add_private(self.ctx, y, b)

    def _L(self, i, name):
        return None if self.server is None else self.server["layers"][i][name]

    def forward(self, ids, n: int) -> AShare:
        """Last hidden-state shares (n, d) of one sentence of n tokens (no padding)."""
        n = int(n)
        if not 1 <= n <= self.max_positions:
            raise TwoPCError(f"sentence length must be 1..{self.max_positions}, got {n}")
        x = self.embed(ids, n, None if self.server is None else self.server["word"], self.vocab, self.d)
        with self.meter("embedding"):
            if self.server is not None:
                x = add_private(self.ctx, x, self.server["pos"][:n] + self.server["type0"][None])
        x = self._layer_norm(x, None if self.server is None else self.server["emb_ln"])
        for i in range(self.n_layers):
            x = self._layer(i, x)
            self._tick(i + 1, self.n_layers, f"{n} tokens")
        return x

    def _layer(self, i, x):
        T, H, hd, d = x.shape[0], self.H, self.hd, self.d
        qkv = self.linear(x, self._L(i, "qkv"), 3 * d, f"L{i}.qkv")
        q = qkv[:, :d].reshape(T, H, hd).transpose(1, 0, 2)
        k = qkv[:, d:2 * d].reshape(T, H, hd).transpose(1, 0, 2)
        v = qkv[:, 2 * d:].reshape(T, H, hd).transpose(1, 0, 2)
        scores = self.matmul(q, k.transpose(0, 2, 1))
        with self.meter("softmax"):
            p = nl.softmax(self.ctx, scores)
        c = self.matmul(p, v).transpose(1, 0, 2).reshape(T, d)
        a = self.linear(c, self._L(i, "o"), d, f"L{i}.o")
        x = self._layer_norm(a + x, self._L(i, "ln1"))
        f = self.linear(x, self._L(i, "inter"), self.inter, f"L{i}.inter")
        with self.meter("activation"):
            f = nl.gelu(self.ctx, f)
        o = self.linear(f, self._L(i, "out"), d, f"L{i}.out")
        return self._layer_norm(o + x, self._L(i, "ln2"))

    def sentence_embedding(self, hidden: AShare) -> AShare:
        """Mean pooling (public length) and L2 normalisation (sentence-transformers), (1, d)."""
        with self.meter("norm"):
            T = hidden.shape[0]
            e = hidden.sum(axis=0, keepdims=True).mul_public_fixed(1.0 / T)
            ss = nl.sqf(self.ctx, e, how="faithful").sum(axis=-1, keepdims=True)
            r = nl.rsqrt(self.ctx, ss, 2.0 ** -8, 2.0 ** 12)
            return nl.mulf(self.ctx, e, r.broadcast_to(e.shape))

    def classify(self, ids, n: int) -> np.ndarray | None:
        """Class logits (n_classes,) opened to the client (None at the server)."""
        C = self.plan.get("classes")
        if not C:
            raise TwoPCError("this model has no classifier head")
        e = self.sentence_embedding(self.forward(ids, n))
        logits = self.linear(e, None if self.server is None else self.server["classifier"], C, "classifier")
        with self.meter("argmax"):
            out = logits.reveal_float(to=0)
        return None if out is None else out.reshape(-1)


def make_twopc_executor(ctx, config: dict, server: dict | None, plan: dict | None = None, meter=None, progress=None):
    if config.get("model_type") in ENCODER_TYPES:
        return TwoPCEncoder(ctx, config, server, plan, meter=meter, progress=progress)
    return TwoPCDecoder(ctx, config, server, plan, meter=meter, progress=progress)


__all__ = ["OP_CLASSES", "OpMeter", "TwoPCDecoder", "TwoPCEncoder", "ShareKVCache", "TwoPCError",
           "server_weights", "public_plan", "make_twopc_executor", "embedding_backend", "add_private",
           "scale_private", "rms_statistic", "rope_shares", "client_one_hot"]
