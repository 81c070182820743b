"""Predicted bytes, rounds and HE operations per operator class, before anything runs.

`predict(config, mode, tokens, phase=...)` walks the model graph (`cipherlm.compile`:
nodes, shapes, projection groups) and prices each operator class with the existing
cost models:

* **offload**: every projection group is planned exactly as `ServerEngine` plans it
  (`offload_engine.input_parts` + `he.matmul.plan_matmul`, one worker); one token row
  of a group costs one input ciphertext per part and ``n_blocks`` result ciphertexts
  per part (`MatmulPlan.op_counts`), one message each way (2 one-way flights per group
  call).  Classes are `linear_groups.operator_class` names (attn_qkv, attn_out, ffn_in,
  ffn_out, lm_head, pooler, moe_router), the same keys as the client's / server's
  `HEOpCounter`s in a run report.  The HE backend (``he_backend``: "seal", "lattigo" or
  "auto", the default, resolved as ``cipherlm serve`` resolves it:
  `he.matmul.resolve_offload_backend`) sets the plans (each backend's cost model picks
  its own baby/giant split, so op counts and Galois steps differ) and the ciphertext
  sizes (`CT_BYTES`).  SEAL: a result ciphertext is sent uncompressed (one 60-bit
  prime, 2 x N x 8 bytes + SEAL header = `CT_OUT_BYTES`, exact); an input ciphertext is
  seeded and zstd-compressed, its size varies by a few percent around `CT_IN_BYTES`
  (measured 113.9-117.7 kB at N = 8192).  Lattigo: both sizes are exact
  (`LATTIGO_CT_OUT_BYTES`, `LATTIGO_CT_IN_BYTES`: native/lattigo's fixed layout, a seeded
  input's polynomial bit-packed at its primes' bit lengths, no compression); a one-row result is
  a half-ring ciphertext (`LATTIGO_CT_OUT_HALF_BYTES`) and a one-row input a half-ring one
  (`LATTIGO_CT_IN_HALF_BYTES`), as ``$CIPHERLM_OFFLOAD_HALF_RING`` says (default: both).
  `MSG_OVERHEAD` per message covers the framing.
* **2pc**: linear classes from `linear_simd.choose_packing` (the per-layer cost model
  of both packings: `plan_blocks` bytes for Cheetah's coefficient packing, `plan_simd`
  for SIMD), one round trip per call; attention products from `plan_blocks` in the
  wide session (two cross terms per product, rough); the nonlinear classes from the
  per-element bytes and per-call flights that `cipherlm.mpc.costs` / `cipherlm bench
  mpc` measured (docs/mpc.md), times the graph's element counts.  Class names are the
  2pc meter's (`runtime.meter.Meter`: linear, attention_matmul, softmax, activation, norm, rope, sampling).
  Not predicted: embedding (its protocol's set-up dominates), setup, control and the
  MoE layers (CryptoMoE, class moe: router, experts and shared expert are skipped).

The result is ``{op_class: {"bytes", "rounds", "he_ops"}}`` (rounds = one-way flights,
as in `cipherlm.report`); `plan_offload` / `plan_twopc` give the plans it is based on.
"""

from __future__ import annotations

import math
from collections import defaultdict

from cipherlm.compile import build_graph, passes

from .linear_groups import operator_class

#: offload: one result ciphertext (1 prime, N = 8192: 2 x 8192 x 8 + 16-byte SEAL header
#: + 112 bytes of nested headers), as measured; exact
CT_OUT_BYTES = 131_200
#: offload: one seeded, zstd-compressed input ciphertext (2 primes); varies +-2% per encryption
CT_IN_BYTES = 116_000
#: Lattigo (native/lattigo/clattigo.go's layout, never compressed; measured from serialised
#: ciphertexts at OFFLOAD_CKKS, every one the same size, checked by tests/test_inspect.py):
#: a result, 20-byte header + 2 polynomials x 1 prime x 8192 x 8 bytes
LATTIGO_CT_OUT_BYTES = 131_092
#: a half-ring result (the conjugate-invariant ring of degree N/2, the default on Lattigo): 20-byte
#: header + 2 polynomials x 1 prime x 4096 coefficients bit-packed at q0's 60 bits
LATTIGO_CT_OUT_HALF_BYTES = 20 + 2 * (-(-4096 * 60 // 8))
#: a seeded input, 20-byte header + 32-byte seed + 1 polynomial of 8192 coefficients per prime,
#: bit-packed at the prime's bit length (wire version 2: the 60- and 40-bit primes Lattigo
#: generates for OFFLOAD_CKKS): 102,452 bytes
LATTIGO_CT_IN_BYTES = 20 + 32 + sum(-(-8192 * bits // 8) for bits in (60, 40))
#: a seeded half-ring input (a real-input plan's: the conjugate-invariant ring of degree N/2 at
#: both data primes, the Lattigo default): 1 polynomial of 4096 coefficients per prime: 51,252 bytes
LATTIGO_CT_IN_HALF_BYTES = 20 + 32 + sum(-(-4096 * bits // 8) for bits in (60, 40))
#: per offload HE backend: (result ciphertext, input ciphertext) bytes
CT_BYTES = {"seal": (CT_OUT_BYTES, CT_IN_BYTES), "lattigo": (LATTIGO_CT_OUT_BYTES, LATTIGO_CT_IN_BYTES)}
#: framing of one offload message (frame header, message keys, blob lengths and padding)
MSG_OVERHEAD = 96
#: `he.matmul.pack_cts`: a u32 count, then a u64 length per ciphertext
PACK_HEADER = 4
#: the ``packed: true`` field of a packed prefill request (16-24 bytes with the framing's
#: padding), split over the call's two messages
PACKED_FLAG_BYTES = 10
PACK_PER_CT = 8

#: 2pc nonlinear costs per element (bytes, both directions) and one-way flights per call in
#: the default configuration, for calls large enough that the products run on the HE
#: product (>= 8192 elements: `cipherlm bench mpc`, 2026-11-27, docs/benchmarks.md "HE
#: products"); argmax ~ one round of top-8-of-64
MPC_PER_ELEM = {
    "softmax": (962, 195),
    "gelu": (430, 43),
    "gelu_tanh": (430, 43),
    "silu": (429, 37),
    "mul": (192, 2),
    "layer_norm": (245, 121),
    "rms_norm": (246, 96),
    "argmax": (758 / 8, 624 // 8),
    "tanh": (430, 43),
    "relu": (86, 15),
    "sigmoid": (429, 37),
}
#: the same for small calls (decode steps), whose products stay on Gilboa over Ferret COTs:
#: the earlier default's measurement (docs/benchmarks.md "The default configuration since
#: 2026-11-27"), an upper bound now that comparisons run on fewer bits
MPC_PER_ELEM_SMALL = {
    "softmax": (3598, 275),
    "gelu": (1561, 89),
    "gelu_tanh": (1561, 89),
    "silu": (1562, 75),
    "mul": (656, 15),
    "layer_norm": (1007, 217),
    "rms_norm": (1007, 189),
    "argmax": (1063 / 8, 624 // 8),
    "tanh": (1561, 89),
    "relu": (104, 13),
    "sigmoid": (1562, 75),
}
#: elements from which a call's products run on the HE product (one 8192-slot ciphertext;
#: `mpc.protocols.mul.choose_method` switches at ~2,300, the table's two regimes bracket it)
HE_PRODUCT_ELEMENTS = 8192


def _mpc_cost(op: str, elements: int) -> tuple[float, int]:
    table = MPC_PER_ELEM if elements >= HE_PRODUCT_ELEMENTS else MPC_PER_ELEM_SMALL
    return table.get(op, table["gelu"])


def _graph(config: dict):
    return passes.group_linears.run(build_graph(config))


def _rows(graph, tokens: int, phase: str) -> dict[str, int]:
    """Rows (tokens) of every value for one pass: T = tokens (prefill) or 1 (decode);
    a `head` node keeps one row (the last for generation, the first for the pooler)."""
    T = 1 if phase == "decode" else int(tokens)
    rows = {v: T for v in graph.inputs}
    for n in graph.nodes:
        r = max((rows.get(v, T) for v in n.inputs), default=T)
        if n.op == "head":
            r = 1
        for v in n.outputs:
            rows[v] = r
    return rows


def _elements(shape, rows: int, keys: int) -> int:
    out = 1
    for k, s in enumerate(shape):
        out *= rows if s == "T" else keys if s == "S" else int(s)
    return out


def _in_moe(name: str) -> bool:
    """A node of an MoE layer's FFN (router, experts, shared expert): the 2pc mode runs
    the whole layer as one CryptoMoE protocol (class "moe", not predicted here)."""
    return ".moe." in name or ".shared." in name


def _is_decoder(graph) -> bool:
    return "logits" in graph.outputs


# ----------------------------------------------------------------------------- offload


def offload_backend(he_backend: str | None = "auto") -> str:
    """The offload HE backend a prediction is for: "seal" or "lattigo" as given, "auto"
    (or None) as ``cipherlm serve`` resolves it on this machine (Lattigo where its library
    is built, else SEAL); "lattigo" without the library is fine here (nothing runs)."""
    from cipherlm.he.matmul import OFFLOAD_BACKENDS, resolve_offload_backend

    if he_backend in OFFLOAD_BACKENDS:
        return he_backend
    return resolve_offload_backend(he_backend)[0]


def plan_offload(config: dict, graph=None, he_backend: str | None = "auto",
                 prefill_tokens: int | None = None) -> list[dict]:
    """Per projection group: names, d_in, d_outs, op class and the part plans
    (`MatmulPlan`s) `ServerEngine` makes (OFFLOAD_CKKS, one worker) on HE backend
    ``he_backend`` (`offload_backend`), and ``packed``: the group's plan for several prefill
    rows per ciphertext (`offload_engine.packed_plan`, up to ``prefill_tokens`` rows, None:
    ``$CIPHERLM_OFFLOAD_PREFILL_PACK`` or 1), or None (rows one by one)."""
    from cipherlm.he import OFFLOAD_CKKS, plan_matmul

    from .offload_engine import client_head_from_env, half_ring_mode, input_parts, packed_plan, prefill_tokens_from_env
    from .plain import lm_head_tied

    tokens = prefill_tokens_from_env(prefill_tokens)

    backend = offload_backend(he_backend)
    real = backend == "lattigo" and half_ring_mode() == "inputs"  # as ServerEngine plans
    g = graph or _graph(config)
    slots = OFFLOAD_CKKS.poly_modulus_degree // 2
    bias = {n.attrs["name"]: bool(n.attrs.get("bias")) for n in g.nodes if n.op == "linear"}
    out = []
    client_head = lm_head_tied(config) and client_head_from_env()  # as ModelHost serves it
    for names, d_in, d_outs in g.meta["linear_groups"]:
        if client_head and tuple(names) == ("lm_head",):
            continue  # the tied LM head: the client computes it in the clear
        has_bias = any(bias.get(nm, False) for nm in names)
        plans = []
        for k, cols in enumerate(input_parts(d_in, has_bias, slots, real)):
            plans.append(plan_matmul(sum(d_outs), cols.stop - cols.start, slots,
                                     has_bias=k == 0 and has_bias, splits=tuple(d_outs), backend=backend,
                                     real_input=real))
        op_class = operator_class(names)
        packed = packed_plan(plans[0], tokens, backend) if len(plans) == 1 and op_class != "lm_head" else None
        out.append({"names": tuple(names), "d_in": d_in, "d_outs": tuple(d_outs),
                    "op_class": op_class, "plans": plans, "packed": packed})
    return out


def galois_steps(groups: list[dict]) -> list[int]:
    """The rotation steps of every plan (the Galois keys an offload client creates)."""
    from .offload_engine import rotation_steps

    return rotation_steps([p for g in groups for p in g["plans"]] + [g["packed"] for g in groups if g.get("packed")])


def _group_calls(config, g, groups, rows) -> dict[int, float]:
    """Per group: expected token rows in one pass and the probability it is called
    (MoE experts: top-k of n routed, uniformly; every other group: its rows, 1)."""
    from cipherlm.compile import arch_from_config

    v = arch_from_config(config).values
    n_exp, k = int(v.get("n_experts") or 0), int(v.get("top_k") or 0)
    node_of = {n.attrs["name"]: n for n in g.nodes if n.op == "linear"}
    out = {}
    for i, grp in enumerate(groups):
        n = node_of[grp["names"][0]]
        r = rows[n.inputs[0]]
        called = 1.0
        if "expert" in n.attrs and n_exp and k:
            # each token picks k of n experts (uniform routing assumed): expected rows, and
            # the probability that any token reaches this expert (a call at all)
            called = 1.0 - (1.0 - k / n_exp) ** r
            r = r * k / n_exp
        out[i] = (r, called)
    return out


def _predict_offload(config, tokens, phase, graph=None, groups=None, he_backend: str | None = "auto",
                     prefill_tokens: int | None = None) -> dict:
    from .offload_engine import half_ring_mode

    backend = offload_backend(he_backend)
    ct_out_full, ct_in_full = CT_BYTES[backend]
    half_ring = backend == "lattigo" and half_ring_mode() != "off"

    def ct_out_bytes(p) -> int:
        """One result ciphertext of plan p: in the half ring on Lattigo (one-row plans; a packed
        plan's results are in the full ring)."""
        return LATTIGO_CT_OUT_HALF_BYTES if half_ring and p.tokens == 1 else ct_out_full

    def ct_in_bytes(p) -> int:
        """One input ciphertext of plan p: a real-input plan's is in the half ring."""
        return LATTIGO_CT_IN_HALF_BYTES if p.real_input else ct_in_full

    g = graph or _graph(config)
    groups = groups or plan_offload(config, g, backend, prefill_tokens)
    rows = _rows(g, tokens, phase)
    calls = _group_calls(config, g, groups, rows)
    out: dict = {}
    for i, grp in enumerate(groups):
        r, called = calls[i]
        if r <= 0:
            continue
        e = out.setdefault(grp["op_class"], {"bytes": 0, "rounds": 0, "he_ops": defaultdict(int)})
        parts = grp["plans"]
        pk = grp.get("packed")
        if pk is not None and r / called > 1:
            # a prefill call: ceil(rows / T) packed ciphertexts, each through the packed plan
            n_ct = math.ceil(r / called / pk.tokens) * called
            # (a plan with several input ciphertexts sends them framed as one blob)
            ct_in = pk.in_cts * ct_in_bytes(pk) + (PACK_HEADER + PACK_PER_CT * pk.in_cts if pk.in_cts > 1 else 0)
            e["bytes"] += n_ct * (ct_in + pk.n_blocks * ct_out_bytes(pk) + PACK_HEADER + PACK_PER_CT * pk.n_blocks) \
                + 2 * (MSG_OVERHEAD + PACKED_FLAG_BYTES) * called
            e["rounds"] += 2 * called
            h = e["he_ops"]
            oc = pk.op_counts()
            for k in ("rotations", "multiply_plain", "rescale"):
                h[k] += n_ct * oc[k]
            h["encode"] += n_ct * pk.in_cts
            h["encrypt"] += n_ct * pk.in_cts
            h["decrypt"] += n_ct * pk.n_blocks
            h["ciphertexts_in"] += n_ct * pk.in_cts
            h["ciphertexts_out"] += n_ct * pk.n_blocks
            continue
        multi = len(parts) > 1
        ct_in = len(parts)
        per_row_in = sum(ct_in_bytes(p) for p in parts) + (PACK_HEADER + PACK_PER_CT * ct_in if multi else 0)
        per_row_out = sum(p.n_blocks * ct_out_bytes(p) for p in parts) + sum(PACK_HEADER + PACK_PER_CT * p.n_blocks for p in parts) \
            + (PACK_HEADER + PACK_PER_CT * len(parts) if multi else 0)
        # a group call (one message each way) carries every row of the pass
        e["bytes"] += r * (per_row_in + per_row_out) + 2 * MSG_OVERHEAD * called
        e["rounds"] += 2 * called
        h = e["he_ops"]
        for p in parts:
            oc = p.op_counts()
            h["rotations"] += r * oc["rotations"]
            h["multiply_plain"] += r * oc["multiply_plain"]
            h["rescale"] += r * oc["rescale"]
            h["encode"] += r
            h["encrypt"] += r
            h["decrypt"] += r * p.n_blocks
            h["ciphertexts_in"] += r
            h["ciphertexts_out"] += r * p.n_blocks
            if half_ring:
                h["ring_switch"] += r * p.n_blocks
            if p.real_input:
                h["input_switch"] += r
    return _finish(out)


# ----------------------------------------------------------------------------- 2pc


def plan_twopc(config: dict, tokens: int = 1, embedding: str = "auto", moe_capacity: float = 2.0,
               linear_packing: str = "coeff", network: str = "LAN", graph=None, phase: str = "prefill") -> dict:
    """The 2pc public plan (`twopc.public_plan`, without the server's weights: folded
    norms / classifier width unknown) and, per projection group, the packing choice of
    `linear_simd.choose_packing` at this pass's rows (`linear_packing_report` rows)."""
    from cipherlm.protocols.linear_simd import choose_packing

    from . import twopc

    g = graph or _graph(config)
    plan = twopc.public_plan(config, None, embedding=embedding, moe_capacity=moe_capacity,
                             linear_packing=linear_packing, network=network)
    rows = _rows(g, tokens, phase)
    node_of = {n.attrs["name"]: n for n in g.nodes if n.op == "linear"}
    choices = []
    for names, d_in, d_outs in g.meta["linear_groups"]:
        n = node_of[names[0]]
        if _in_moe(n.name):
            continue
        m = rows[n.inputs[0]]
        c = choose_packing(m, d_in, sum(d_outs), network, encode_weights=m != 1).to_dict()
        c["used"] = c["packing"] if linear_packing == "auto" else linear_packing
        c["names"] = list(names)
        c["op_class"] = operator_class(names)
        choices.append(c)
    plan["linear"]["choices"] = choices
    return plan


def _predict_twopc(config, tokens, phase, graph=None, plan=None, **kw) -> dict:
    from cipherlm.protocols.linear import plan_blocks

    g = graph or _graph(config)
    plan = plan or plan_twopc(config, tokens, graph=g, phase=phase, **kw)
    rows = _rows(g, tokens, phase)
    keys = int(tokens) + (1 if phase == "decode" else 0) if _is_decoder(g) else int(tokens)
    out: dict = {}

    def add(cls, nbytes, rounds, **ops):
        e = out.setdefault(cls, {"bytes": 0, "rounds": 0, "he_ops": defaultdict(int)})
        e["bytes"] += nbytes
        e["rounds"] += rounds
        for k, v in ops.items():
            e["he_ops"][k] += v

    for c in plan["linear"]["choices"]:
        if c["used"] == "simd":
            add("linear", c["simd_bytes"], 2, multiply_plain=c["simd_products"], rotations=c["simd_rotations"])
        else:
            add("linear", c["coeff_bytes"], 2, multiply_plain=c["coeff_products"])
    for n in g.nodes:
        if _in_moe(n.name):
            continue
        r = rows[n.outputs[0]] if n.outputs else 1
        if n.op in ("qk", "av"):
            H, Hkv, hd = n.attrs["heads"], n.attrs["kv_heads"], n.attrs["head_dim"]
            m = (H // Hkv) * r
            d, o = (hd, keys) if n.op == "qk" else (keys, hd)
            nn = 16384
            bp = plan_blocks(m, d, o, nn, Hkv, in_ct_bytes=4 * nn * 8, op_scale=2 * 4 / 3)
            # two cross terms (one per direction), each one message each way
            add("attention_matmul", 2 * bp.bytes_estimate(4 * nn * 8), 4, multiply_plain=2 * bp.products)
        elif n.op in ("softmax", "layer_norm", "rms_norm"):
            e = _elements(n.shape, r, keys)
            b, f = _mpc_cost(n.op, e)
            cls = "softmax" if n.op == "softmax" else "norm"
            add(cls, b * e, f)
        elif n.op == "activation" or (n.op == "mul" and n.name.endswith("ffn.mul")):
            e = _elements(n.shape, r, keys)
            b, f = _mpc_cost(n.attrs.get("fn", "mul"), e)
            add("activation", b * e, f)
        elif n.op == "argmax":
            e = r * int(g.meta.get("vocab_size") or _vocab(g))
            b, f = _mpc_cost("argmax", e)
            add("sampling", b * e, f)
        elif n.op == "rope":
            add("rope", 0, 0)
    return _finish(out)


def _vocab(g) -> int:
    for n in g.nodes:
        if n.op == "linear" and n.attrs["name"].endswith("lm_head"):
            return int(n.attrs["d_out"])
    return 0


# ----------------------------------------------------------------------------- entry point


def _finish(out: dict) -> dict:
    res = {}
    for cls, e in out.items():
        res[cls] = {"bytes": int(round(e["bytes"])), "rounds": int(round(e["rounds"])),
                    "he_ops": {k: int(round(v)) for k, v in e["he_ops"].items() if v}}
    return res


def total(pred: dict) -> dict:
    """Sum over the classes: {bytes, rounds}."""
    return {"bytes": sum(e["bytes"] for e in pred.values()), "rounds": sum(e["rounds"] for e in pred.values())}


def predict(config: dict, mode: str, tokens: int = 1, *, phase: str = "prefill", graph=None,
            he_backend: str | None = "auto", prefill_tokens: int | None = None, **kw) -> dict:
    """{op_class: {"bytes", "rounds", "he_ops"}} for one pass of the model in ``mode``.

    ``phase="prefill"``: one pass over ``tokens`` tokens (a decoder's LM head on the last
    row only, as `generate` does; an encoder's whole input).  ``phase="decode"``: one
    decode token after ``tokens`` cached positions (decoders).  ``he_backend`` (offload):
    "seal", "lattigo", or "auto" (`offload_backend`: what ``cipherlm serve`` picks on this
    machine); ``prefill_tokens`` (offload): the most rows per packed prefill ciphertext
    (the welcome's, `ClientEngine.prefill_tokens`; None: ``$CIPHERLM_OFFLOAD_PREFILL_PACK``
    or 1, as a server started here).  ``kw`` (2pc): embedding, moe_capacity, linear_packing, network.  Plain
    mode: nothing leaves the machine ({})."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be prefill or decode, not {phase!r}")
    if int(tokens) < 1:
        raise ValueError("tokens must be at least 1")
    if mode == "plain":
        return {}
    g = graph or _graph(config)
    if mode == "offload":
        return _predict_offload(config, tokens, phase, g, he_backend=he_backend, prefill_tokens=prefill_tokens)
    if mode == "2pc":
        return _predict_twopc(config, tokens, phase, g, **kw)
    raise ValueError(f"unknown mode {mode!r}")
