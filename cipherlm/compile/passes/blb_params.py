"""CKKS parameters per fused block (BLB section 7.1 and Table 6; issue 16 item 2).

BLB evaluates each fused block of `blb_fusion` in CKKS with its own parameters: the
paper takes the ring degree, the prime sizes and the scale of each block from the EVA
compiler under a bound on the mean squared error against plaintext (Table 6: depth 4 at
N = 16384, depths 6-7 at N = 32768, primes of 38-46 bits).  EVA is not available here;
this pass does the same job with an explicit noise analysis, so each choice can be read
and checked.  For every block it gives

* ``depth``: the block's multiplicative depth (`blb_fusion.block_depth`): one rescale per
  level, so the chain holds ``depth`` primes of ``scale_bits`` bits above the output
  modulus;
* ``scale_bits`` s: the smallest scale (Delta = 2^s, and every rescaled prime about
  2^s) whose predicted error at each of the block's outputs, 16 standard deviations
  (`SIGMAS`: the tail of a product of two Gaussians), is at most half a unit in the last
  place of the MPC fixed point, 2^-(f+1) with f = 16, absolute: then the local decoding of
  Algorithm 1, not CKKS, sets the error of the shares the MPC core receives.  One
  exception: a norm's sum of squares of d values, whose consumer rsqrt is relative, is held
  to 2^-(f+1) x d 2^-8, i.e. to half an ulp of the smallest variance rsqrt accepts
  (2^-8, `mpc.nonlinear.norm`'s var_lo);
* ``output_bits``: the modulus left at the output level, at least s + 20 + 2 bits
  (the conversion to Z_2^l needs |m Delta| < q / 2 for every value the MPC library
  accepts, |m| < 2^20 = `mpc.nonlinear.common.COMPARE_BOUND`, with one bit of noise
  margin).  Above 60 bits (the largest prime) the output keeps a second prime;
* ``ring_degree`` N: the smallest of 8192 / 16384 / 32768 with at least ``min_slots``
  slots whose chain (output primes + depth x s + one 60-bit special prime for key
  switching) is within the 128-bit bound of the HomomorphicEncryption.org table, checked
  by `he.params.check_security`.  The noise grows with N, so s is chosen per N.

**Noise model** (standard deviation of one slot's real part, in value units; Delta the
scale; N the ring degree; fresh noise Gaussian with sigma_e = 3.2, a uniform ternary
secret of density 2/3 as Lattigo's default; Costache, Curtis, Hales, Murphy, Player and
Player, "On the precision loss in approximate homomorphic encryption", SAC 2023, for
the canonical-embedding variances):

* a block input (Algorithm 2: both parties' encoding roundings, the client's fresh
  encryption): sqrt(N / 2 (sigma_e^2 + 2 / 12)) / Delta;
* encoding a plaintext (weights, gamma, beta, RoPE's cos / sin, a mean's 1/d):
  E = sqrt(N / 24) / Delta per slot;
* a rescale, a relinearisation or a rotation (key switching with a special prime at
  least as large as every data prime: the mod-down rounding dominates): R = N / 6 /
  Delta (the rounding's e1 s term, sqrt(N/2 (N 2/3) / 12));
* propagation: independent errors add in variance; a product by a plaintext vector
  scales the error by the plaintext's magnitude, a projection by W by the largest row
  norm ||W[j, :]||_2 (each output sums d_in independent input errors), a product of two
  ciphertexts of magnitude <= A over an inner length k by A sqrt(k) per operand, a sum
  of L slots by sqrt(L) (and log2 L rotations).

Every value inside a block is assumed to be at most A = 2^``value_bits`` in magnitude
(default 2^6; the MPC cores' ranges: softmax probabilities <= 1, exp's squarings <= 1,
normalised activations mostly below 10, residual streams of the models here below 64
except rare outliers).  Projections use their real weights' row norms and affines their largest |gamma| when
``params`` (`compile.bind`) are given, otherwise sqrt(d_in) x 0.06 and 4.
The model is checked against Lattigo on circuits of these operations at the chosen
parameters (`tests/test_blb_params.py`): the measured error stays below the predicted
maximum (16 sigma) and within a factor of 24 of it (measured: 2.6-14); and on whole blocks
(`tests/test_blb_block.py`).  A square counts its operand's error twice (2 |a| sigma, one
error), not as two independent ones.

**Against the paper.**  Like Table 6, the deepest block of a layer (MiniLM-L6 with its real
weights: P, P V, the output projection, the residual and the LayerNorm statistics, depth 5)
needs N = 32768 (s = 57, log QP 462 > 438); the other blocks fit N = 16384 (s = 39-53).
SmolLM2-135M's FFN-out block (SiLU out, gate x up, down, residual, RMS statistics) has no
secure set under the worst-case magnitudes: its real weights' row norms times values of
2^6 squared push s above 58.  With its norms whole in MPC (the plan's ``blb_norms``, which
the server sets for SmolLM2: `runtime.twopc.blb_norm_split`) every block has one.  The
magnitudes are the weak point: the measured errors on real blocks are 1e-6 to 1e-2 of the model's (docs/blb.md, "CKKS evaluation of a fused
block"), because real values sit far below 2^6; magnitudes calibrated on real data (the
fhe mode's `calibrate` records the nonlinear inputs only) are the next step, as the paper
took its parameters from EVA runs on real inputs.  The slot count is a parameter
(``min_slots``, default 4096); `cipherlm inspect MODEL --fusion blb` prints the table.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ...he.errors import HEError
from ...he.params import HES_128_CLASSIC_MAX_LOGQ, HEParams, check_security
from ...mpc.nonlinear.common import COMPARE_BOUND
from ..ir import Graph
from ...protocols.ckks import blb_matmul
from .blb_fusion import FUSED_A_MASKS, FUSED_B_MASKS, _shapes, block_depth, core_name, monic_factors

RING_DEGREES = (8192, 16384, 32768)
MAX_PRIME_BITS = 60
SPECIAL_PRIME_BITS = 60
SIGMA_E = 3.2
#: the predicted max error is this many standard deviations: the rescale / key-switch error is,
#: slot by slot, e1(zeta) s(zeta), a product of two Gaussians (the canonical embedding is
#: multiplicative), whose tail is exponential, not Gaussian (kurtosis ~6 measured on Lattigo):
#: P(|e| > 16 sigma) is about 2e-8 per slot
SIGMAS = 16.0
MPC_FRAC = 16
OUT_VALUE_BITS = int(math.log2(COMPARE_BOUND))
VALUE_BITS = 6
WEIGHT_RMS = 0.06
GAMMA_MAX = 4.0
#: the smallest variance the MPC norms' rsqrt accepts (`mpc.nonlinear.norm`, var_lo)
VAR_MIN = 2.0 ** -8
#: magnitude bounds of what the MPC cores hand a block (softmax's exp polynomial and
#: reciprocal of a row sum >= 1, the gates; rsqrt on its contract var >= 2^-8); others: A
CORE_RANGE = {"exp": 1.0, "reciprocal": 1.0, "Phi (gelu gate)": 1.0, "tanh (gelu gate)": 1.0, "sigmoid": 1.0,
              "rsqrt": 16.0}
TOKENS = 128
MIN_SCALE_BITS, MAX_SCALE_BITS = 20, 58


# ------------------------------------------------------------------ noise model (value units)
def fresh_input(n: int, delta: float) -> float:
    """Algorithm 2's ciphertext: two encoding roundings and a fresh encryption."""
    return math.sqrt(n / 2 * (SIGMA_E ** 2 + 2 / 12)) / delta


def encoding(n: int, delta: float) -> float:
    """One slot of an encoded plaintext: coefficients rounded to integers."""
    return math.sqrt(n / 24) / delta


def key_switch(n: int, delta: float) -> float:
    """A rescale, relinearisation or rotation: the mod-down rounding (e0 + e1 s)."""
    return n / 6 / delta


def _rss(*terms: float) -> float:
    return math.sqrt(sum(t * t for t in terms))


@dataclasses.dataclass(frozen=True)
class NoiseModel:
    """The per-operation rules of the module doc at one ring degree and scale."""

    n: int
    scale_bits: int
    value_bits: int = VALUE_BITS

    @property
    def delta(self) -> float:
        return 2.0 ** self.scale_bits

    @property
    def a(self) -> float:
        return 2.0 ** self.value_bits

    def input(self) -> float:
        return fresh_input(self.n, self.delta)

    def plain_product(self, sigma: float, gain: float, terms: int = 1, rotations: int = 0) -> float:
        """x * p for encoded plaintexts p (a projection: ``terms`` = d_in diagonals, ``gain`` the
        largest row norm; an elementwise product: terms = 1, gain = max |p|), then a rescale;
        ``rotations`` key switches on the way (a BSGS's baby and giant steps)."""
        e, r = encoding(self.n, self.delta), key_switch(self.n, self.delta)
        return _rss(gain * sigma, self.a * math.sqrt(terms) * e, r * math.sqrt(1 + rotations) * max(1.0, gain))

    def ct_product(self, sa: float, sb: float, ma: float | None = None, mb: float | None = None, inner: int = 1,
                   rotations: int = 0, scale: float = 1.0, square: bool = False) -> float:
        """a * b of two ciphertexts with errors sa, sb and magnitudes ma, mb (default A) (elementwise:
        inner = 1; Q K^T / P V: the head dim / keys), relinearised, rescaled, times a public ``scale``.
        ``square``: a * a, one error counted twice (2 |a| sigma, not sqrt(2) |a| sigma)."""
        ma = self.a if ma is None else ma
        mb = self.a if mb is None else mb
        r = key_switch(self.n, self.delta)
        k = scale * math.sqrt(inner)
        operands = (k * mb * sa + k * ma * sb,) if square else (k * mb * sa, k * ma * sb)
        return _rss(*operands, r * math.sqrt(2 + rotations) * max(1.0, k * max(ma, mb)))

    def rotate_sum(self, sigma: float, length: int, scale: float = 1.0) -> float:
        """sum of ``length`` slots by log2 rotations (Figure 6), times ``scale`` (a mean: one
        more plaintext product and rescale)."""
        rot = max(1, math.ceil(math.log2(max(2, length))))
        r = key_switch(self.n, self.delta)
        out = _rss(math.sqrt(length) * sigma, math.sqrt(rot) * r)
        if scale != 1.0:
            out = self.plain_product(out, abs(scale))
        return out


# ------------------------------------------------------------------ per block
def _row_norm(w: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(w, dtype=np.float64), axis=1).max())


def gains_of(graph: Graph, params: dict[str, np.ndarray] | None) -> dict[str, float]:
    """{node name: gain}: a projection's largest row norm ||W[j, :]||_2, an affine's max |gamma|
    (``params`` as `compile.bind` gives them; nodes without weights get the defaults)."""
    out = {}
    for n in graph.nodes if params else ():
        if n.op == "linear" and f"{n.attrs['name']}.weight" in params:
            out[n.name] = _row_norm(params[f"{n.attrs['name']}.weight"])
        elif n.op == "affine" and n.attrs.get("gamma") and n.weights and n.weights[0] in params:
            out[n.name] = float(np.abs(params[n.weights[0]]).max())
    return out


def product_magnitude(node, ma: float, mb: float, producers: dict) -> float:
    """|a b| <= |a| |b|, except a norm's scaling (a factor from the rsqrt core): |x - mean| /
    sigma and x / rms are at most sqrt(d) whatever the input's size."""
    d = node.shape[-1]
    if isinstance(d, int) and any(getattr(producers.get(v), "op", None) == "rsqrt" for v in node.inputs):
        return math.sqrt(d)
    return ma * mb


def poly_error(model: NoiseModel, coeffs, sigma: float, bound: float) -> tuple[float, float]:
    """(error std, magnitude bound) of sum_k c_k x^k for |x| <= ``bound`` with error ``sigma``,
    evaluated as `runtime.blb_block._Eval.poly` does: a monic one by its factors
    (`blb_fusion.monic_factors`: squares of x + H, then products), any other by the powers
    x^k = x^(2^j) x^(k - 2^j) (2^j the highest power of two below k), each term times c_k by
    one plaintext product."""
    factors = monic_factors(coeffs)
    if factors is not None:
        parts = []
        for h, k in factors:
            m = bound + abs(h)
            if k is None:
                parts.append((sigma, m))
            else:
                parts.append((model.ct_product(sigma, sigma, m, m, square=True), m * m + abs(k)))
        while len(parts) > 1:
            parts = [(model.ct_product(parts[i][0], parts[i + 1][0], parts[i][1], parts[i + 1][1]),
                      parts[i][1] * parts[i + 1][1]) if i + 1 < len(parts) else parts[i]
                     for i in range(0, len(parts), 2)]
        return parts[0]
    sig, mag = {1: sigma}, {1: bound}
    for k in range(2, len(coeffs)):
        h = 1 << ((k - 1).bit_length() - 1)
        sig[k] = model.ct_product(sig[h], sig[k - h], mag[h], mag[k - h], square=h == k - h)
        mag[k] = mag[h] * mag[k - h]
    terms = [model.plain_product(sig[k], abs(float(c))) for k, c in enumerate(coeffs) if k and c]
    size = sum(abs(float(c)) * (mag[k] if k else 1.0) for k, c in enumerate(coeffs))
    return _rss(*terms, encoding(model.n, model.delta)), size


def output_errors(graph: Graph, block: dict, model: NoiseModel, gains: dict[str, float] | None = None,
                  tokens: int = TOKENS, fused: bool = False) -> dict[str, tuple[float, float, float]]:
    """{output value: (predicted std, absolute; its magnitude bound; its floor)}: the module
    doc's rules walked over the block's nodes in order (``tokens`` = T = S for the symbolic
    lengths).  The floor is 1, except for a norm's sum of squares of d values: d VAR_MIN, its
    smallest value in rsqrt's contract; the target is 2^-(f+1) max(1, floor).

    ``fused``: Q K^T / P V in section 5's packing (`blb_fusion.block_depth`): an operand
    computed in the block in the row layout, and a product read in the block, pass through a
    conversion round trip (its error plus a fresh input's); the product is preceded by the
    masked inner rotations of one operand and followed by step 3's masked rotations (two
    plaintext products by 0 / 1 masks; `blb_fusion.FUSED_A_MASKS`)."""
    names = set(block["nodes"])
    prod = graph.producers()
    shapes = _shapes(graph)
    sig: dict[str, float] = {}
    mag: dict[str, float] = {}
    floor: dict[str, float] = {}
    gains = gains or {}

    def inside(v: str) -> bool:
        p = prod.get(v)
        return p is not None and p.name in names

    def s(v: str) -> float:
        if not inside(v):
            return model.input()
        if fused and prod[v].op in ("qk", "av"):  # back in the row layout through the conversions
            return _rss(sig[v], model.input())
        return sig[v]

    def relaid(v: str) -> float:
        """An operand of a fused product: re-packed through the conversions if computed in
        the row layout in the block (not a product of slot-wise values already in its packing)."""
        if fused and inside(v) and prod[v].op not in ("mul", "add", "sub"):
            return _rss(s(v), model.input())
        return s(v)

    def m(v: str) -> float:
        if v not in mag:
            p = prod.get(v)
            if p is None:
                mag[v] = model.a
            elif p.op == "mul":
                mag[v] = product_magnitude(p, m(p.inputs[0]), m(p.inputs[-1]), prod)
            elif p.op == "clip_min":
                mag[v] = float(p.attrs["bound"])
            elif p.op == "poly" and "out_bound" in p.attrs:  # also when computed in another block
                mag[v] = float(p.attrs["out_bound"])
            elif p.op == "act_clamp":  # (lin, ac): ac = min(|x|, T)
                mag[v] = float(p.attrs["T"]) * float(p.attrs.get("scale", 1.0)) if v == p.outputs[1] else model.a
            else:
                mag[v] = CORE_RANGE.get(core_name(p), model.a)
        return mag[v]

    for name in block["nodes"]:
        n = graph.node(name)
        ins = [s(v) for v in n.inputs]
        op = n.op
        size = model.a
        if op == "linear":
            d_in = int(n.attrs["d_in"])
            g = gains.get(n.name, math.sqrt(d_in) * WEIGHT_RMS)
            rot = 2 * math.ceil(math.sqrt(d_in))
            out = model.plain_product(ins[0], g, terms=d_in, rotations=rot)
        elif op in ("qk", "av") and fused:
            inner = int(n.attrs["head_dim"]) if op == "qk" else tokens
            sa, sb = relaid(n.inputs[0]), relaid(n.inputs[1])
            for _ in range(FUSED_B_MASKS):  # step 1's and the baby steps' masked inner rotations
                sb = model.plain_product(sb, 1.0, rotations=2)
            for _ in range(FUSED_A_MASKS):  # the giant steps' masked inner rotations
                sa = model.plain_product(sa, 1.0, rotations=2)
            out = model.ct_product(sa, sb, m(n.inputs[0]), m(n.inputs[1]), inner,
                                   scale=float(n.attrs.get("scale", 1.0)))
            out = model.plain_product(out, 1.0, terms=4, rotations=4)  # step 3: up to 4 masked rotations
        elif op in ("qk", "av"):
            inner = int(n.attrs["head_dim"]) if op == "qk" else tokens
            rot = 2 * math.ceil(math.sqrt(inner))
            out = model.ct_product(ins[0], ins[1], m(n.inputs[0]), m(n.inputs[1]), inner, rotations=rot,
                                   scale=float(n.attrs.get("scale", 1.0)))
        elif op == "mul":
            ma, mb = m(n.inputs[0]), m(n.inputs[-1])
            out = model.ct_product(ins[0], ins[-1], ma, mb, square=n.inputs[0] == n.inputs[-1])
            size = product_magnitude(n, ma, mb, prod)
        elif op == "poly":
            out, size = poly_error(model, n.attrs["coeffs"], ins[0], m(n.inputs[0]))
            size = min(size, float(n.attrs.get("out_bound", size)))
        elif op == "rope":
            out = _rss(*(model.plain_product(ins[0], 1.0, rotations=1) for _ in range(2)))
        elif op == "affine":
            out = ins[0]
            if n.attrs.get("gamma"):
                out = model.plain_product(out, gains.get(name, GAMMA_MAX))
            if n.attrs.get("beta"):
                out = _rss(out, encoding(model.n, model.delta))
        elif op == "reduce_sum":
            length = shapes[n.inputs[0]][-1]
            length = tokens if not isinstance(length, int) else length
            out = model.rotate_sum(ins[0], length, float(n.attrs.get("scale", 1.0)))
            size = m(n.inputs[0]) * length * float(n.attrs.get("scale", 1.0))
            p = prod.get(n.inputs[0])
            if p is not None and p.op == "mul" and p.inputs[0] == p.inputs[-1]:  # a norm's sum of squares
                floor[n.out] = length * float(n.attrs.get("scale", 1.0)) * VAR_MIN
        elif op in ("add", "sub"):
            out = _rss(*ins)
        else:  # layout, kv_cache, head: no arithmetic
            out = max(ins) if ins else model.input()
        for v in n.outputs:
            sig[v] = out
            mag.setdefault(v, size)
    outs = [o["value"] for o in block["outputs"]] or list(sig)
    return {v: (sig[v], mag[v], floor.get(v, 1.0)) for v in outs if v in sig}


def block_error(graph: Graph, block: dict, model: NoiseModel, gains: dict[str, float] | None = None,
                tokens: int = TOKENS, fused: bool = False) -> float:
    """The largest predicted std over the block's outputs, each relative to max(1, its floor)
    (`output_errors`): what `choose_params` holds below the target."""
    return max(s / max(1.0, f) for s, _, f in output_errors(graph, block, model, gains, tokens, fused).values())


# ------------------------------------------------------------------ attention packing
#: how Q K^T and P V are packed in a block (docs/blb.md): "rows", the stacked rows on a pair grid
#: (`runtime.blb_block`); "fused", section 5's multi-head packing with the fused MatMul
#: (`protocols.ckks.blb_matmul`); "auto", the one that converts fewer ciphertexts (`attention_packing`)
ATTENTION_PACKINGS = ("auto", "rows", "fused")
#: the slots `attention_packing` counts at (N = 16384, the blocks' usual ring)
REFERENCE_SLOTS = 8192


def attention_mh_layouts(slots: int, tokens: int, heads: int, head_dim: int):
    """(Q K^T's, P V's) `blb_matmul.MHLayout` in section 5's packing: Q K^T n = T, k = head_dim;
    P V n = k = max(T, head_dim), so that V's head_dim columns fit the n x n output (section
    5.2's zero padding)."""
    n = max(int(tokens), int(head_dim))
    return (blb_matmul.make_layout(slots, heads, int(tokens), head_dim), blb_matmul.make_layout(slots, heads, n, n))


def attention_cts(packing: str, tokens: int, heads: int, head_dim: int, slots: int = REFERENCE_SLOTS) -> int:
    """Ciphertexts one layer's attention core converts (both directions) in ``packing``:

    * rows: Q K^T's scores and P V's probabilities on the pair grid (nq^2 U each, R = slots / P
      rows per ciphertext, U the row shifts), the reciprocal (nq);
    * fused: Q and K out of the row layout and into section 5's (2 nq + 2 J_qk), the scores in
      diagonal packing (T / c), the probabilities and V in P V's packing (2 J_av, n = max(T,
      head_dim) so that V's columns fit), the reciprocal (1: the same in every column), P V's
      output out and back (n / c + nq)."""
    T, P = int(tokens), 1 << max(0, math.ceil(math.log2(heads * head_dim)))
    R = max(1, slots // P)
    nq = -(-T // R)
    if packing == "rows":
        U = R if T >= R else min(R, 2 * T - 1)
        return 2 * nq * nq * U + nq
    if packing != "fused":
        raise ValueError(f"attention packing {packing!r}: one of rows, fused")
    qk, av = attention_mh_layouts(slots, T, heads, head_dim)
    return 2 * nq + 2 * qk.n_cts + qk.n_out + 2 * av.n_cts + 1 + av.n_out + nq


def attention_packing(choice: str, tokens: int, heads: int, head_dim: int) -> str:
    """``choice`` resolved: "auto" -> the packing with fewer converted ciphertexts at
    `REFERENCE_SLOTS` (`attention_cts`; rows at a few tokens, fused from a few dozen)."""
    if choice not in ATTENTION_PACKINGS:
        raise ValueError(f"attention packing {choice!r}: one of {', '.join(ATTENTION_PACKINGS)}")
    if choice != "auto":
        return choice
    try:
        fused = attention_cts("fused", tokens, heads, head_dim)
    except ValueError:  # the heads of one token row do not fit the slots
        return "rows"
    return "fused" if fused < attention_cts("rows", tokens, heads, head_dim) else "rows"


def block_attention(graph: Graph, block: dict) -> tuple[int, int] | None:
    """(heads, head_dim) of the block's Q K^T / P V, or None."""
    for name in block["nodes"]:
        n = graph.node(name)
        if n.op in ("qk", "av"):
            return int(n.attrs["heads"]), int(n.attrs["head_dim"])
    return None


def block_fused(graph: Graph, block: dict, attention: str, tokens: int) -> bool:
    """Whether the block's attention products run in section 5's packing (a decoder's causal
    scores too: every pair is computed and the public mask applies at the output)."""
    hh = block_attention(graph, block)
    if hh is None:
        return False
    return attention_packing(attention, tokens, *hh) == "fused"


@dataclasses.dataclass(frozen=True)
class BlockParams:
    block: int
    depth: int
    ring_degree: int
    scale_bits: int
    output_primes: tuple[int, ...]
    chain: tuple[int, ...]            # Lattigo's LogQ: output primes, then depth primes of s bits
    special: tuple[int, ...]          # LogP
    predicted_std: float              # at the block's output, value units
    target: float                     # 2^-(f+1) / SIGMAS

    @property
    def start_level(self) -> int:
        """The level the block's inputs need: its own depth above the output primes (below the
        top of a shared set's chain, `share_sets`)."""
        return len(self.output_primes) - 1 + self.depth

    @property
    def log_qp(self) -> int:
        return sum(self.chain) + sum(self.special)

    @property
    def he_params(self) -> HEParams:
        return HEParams(f"blb-block{self.block}-N{self.ring_degree}", "ckks", self.ring_degree,
                        self.chain + self.special)

    def as_dict(self) -> dict:
        return {"block": self.block, "depth": self.depth, "N": self.ring_degree, "scale_bits": self.scale_bits,
                "logQ": list(self.chain), "logP": list(self.special), "logQP": self.log_qp,
                "predicted_max_error": SIGMAS * self.predicted_std, "target_max_error": SIGMAS * self.target}


def output_primes(scale_bits: int, out_value_bits: int = OUT_VALUE_BITS) -> tuple[int, ...]:
    """The modulus left at the output level: >= s + value bits + 2 (sign, noise), in primes
    of at most 60 bits."""
    need = scale_bits + out_value_bits + 2
    if need <= MAX_PRIME_BITS:
        return (need,)
    return (MAX_PRIME_BITS, max(need - MAX_PRIME_BITS, scale_bits))


def choose_params(depth: int, error_of, *, block: int = 0, min_slots: int = 4096,
                  frac: int = MPC_FRAC, value_bits: int = VALUE_BITS) -> BlockParams:
    """The smallest secure (N, chain) for a block of ``depth`` whose predicted output std
    (``error_of(NoiseModel)``) meets the target; HEError if no ring degree of the table can."""
    target = 2.0 ** -(frac + 1) / SIGMAS
    tried = []
    for n in RING_DEGREES:
        if n // 2 < min_slots:
            continue
        s = next((b for b in range(MIN_SCALE_BITS, MAX_SCALE_BITS + 1)
                  if error_of(NoiseModel(n, b, value_bits)) <= target), None)
        if s is None:
            tried.append(f"N={n}: no scale up to 2^{MAX_SCALE_BITS} meets the target")
            continue
        chain = output_primes(s) + (s,) * depth
        p = BlockParams(block, depth, n, s, output_primes(s), chain, (SPECIAL_PRIME_BITS,),
                        error_of(NoiseModel(n, s, value_bits)), target)
        # one bit of margin: Lattigo's primes of b bits lie just above or below 2^b, so a chain
        # of nominal bits equal to the bound can exceed it (a set at 438.000 > 438 at N = 16384)
        if p.log_qp > HES_128_CLASSIC_MAX_LOGQ[n] - 1:
            tried.append(f"N={n}: log QP = {p.log_qp} > {HES_128_CLASSIC_MAX_LOGQ[n]} - 1 (margin)")
            continue
        check_security(p.he_params)
        return p
    raise HEError(f"block {block} (depth {depth}): no secure CKKS parameters ({'; '.join(tried)})")


def share_sets(params: list[BlockParams | None]) -> list[BlockParams | None]:
    """Fewer distinct parameter sets (each costs the client a key set, the server its rotation
    keys in memory): per ring degree, blocks taken by increasing depth join one set while the
    set that covers them all (their largest scale, their largest depth) stays within the
    128-bit bound (one bit of margin); each block then runs on its set's chain (more levels
    and a larger scale than its own: the error only shrinks; it starts at the top and ends
    above the set's output primes).  ``depth`` and the predictions stay the block's own."""
    out = list(params)
    by_n: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        if p is not None:
            by_n.setdefault(p.ring_degree, []).append(i)

    def cover(idx):
        s = max(params[i].scale_bits for i in idx)
        d = max(params[i].depth for i in idx)
        return s, output_primes(s) + (s,) * d

    for n, idx in by_n.items():
        idx.sort(key=lambda i: (params[i].depth, params[i].scale_bits))
        groups, cur = [], []
        for i in idx:
            s, chain = cover(cur + [i])
            if not cur or sum(chain) + SPECIAL_PRIME_BITS <= HES_128_CLASSIC_MAX_LOGQ[n] - 1:
                cur.append(i)
            else:
                groups.append(cur)
                cur = [i]
        groups.append(cur)
        for grp in groups:
            s, chain = cover(grp)
            for i in grp:
                out[i] = dataclasses.replace(params[i], scale_bits=s, output_primes=output_primes(s), chain=chain)
    return out


def run(graph: Graph, *, params: dict[str, np.ndarray] | None = None, tokens: int = TOKENS,
        min_slots: int = 4096, value_bits: int = VALUE_BITS, frac: int = MPC_FRAC,
        strict: bool = True, attention: str = "auto") -> list[BlockParams | None]:
    """Parameters for every fused block of a `blb_fusion` graph (``params``: the bound weights,
    `compile.bind`, for the projections' and gammas' real gains; without them the defaults
    sqrt(d_in) WEIGHT_RMS and GAMMA_MAX).  A block with no secure set raises HEError, or is
    None with ``strict=False``.  ``attention``: the packing of Q K^T / P V
    (`ATTENTION_PACKINGS`; a block in section 5's packing has its depth and noise from
    ``block_depth(..., fused=True)`` / ``output_errors(..., fused=True)``)."""
    if "blb_blocks" not in graph.meta:
        raise ValueError("run passes.blb_fusion first")
    gains = gains_of(graph, params)
    prod = graph.producers()
    out = []
    for b in graph.meta["blb_blocks"]:
        fused = block_fused(graph, b, attention, tokens)
        depth = block_depth([graph.node(n) for n in b["nodes"]], prod, fused=True)[0] if fused else b["depth"]
        try:
            out.append(choose_params(depth, lambda m, b=b, f=fused: block_error(graph, b, m, gains, tokens, f),
                                     block=b["id"], min_slots=min_slots, frac=frac, value_bits=value_bits))
        except HEError:
            if strict:
                raise
            out.append(None)
    return out


def format_params(graph: Graph, params: list[BlockParams | None], all_layers: bool = False,
                  value_bits: int = VALUE_BITS) -> str:
    """The per-block parameters as a table (prologue, layer 0, epilogue unless ``all_layers``;
    ``params`` in block order, None for a block with no secure set)."""
    blocks = {b["id"]: b for b in graph.meta["blb_blocks"]}
    params = [p if p is not None else b["id"] for p, b in zip(params, graph.meta["blb_blocks"])]
    lines = [f"CKKS parameters per block (BLB Table 6; 128-bit HE standard; target: {SIGMAS:g} sigma <= "
             "2^-17, a sum of squares relative to d 2^-8):",
             f"  {'block':<6} {'where':<9} {'depth':>5} {'N':>6} {'scale':>5} {'logQ':<28} {'logQP':>5} "
             f"{'predicted max err':>17}"]
    for p in params:
        b = blocks[p if isinstance(p, int) else p.block]
        if not all_layers and b["layer"] not in (None, 0):
            continue
        where = b["role"] if b["layer"] is None else f"L{b['layer']}"
        if isinstance(p, int):
            lines.append(f"  {p:<6} {where:<9} {b['depth']:>5}  none: no secure set meets the target with values "
                         f"<= 2^{value_bits} (worst-case model; calibrated magnitudes are the next step)")
            continue
        q = "+".join(str(x) for x in p.output_primes) + f"+{p.depth}x{p.scale_bits}"
        lines.append(f"  {p.block:<6} {where:<9} {p.depth:>5} {p.ring_degree:>6} {'2^' + str(p.scale_bits):>5} "
                     f"{q:<28} {p.log_qp:>5} {SIGMAS * p.predicted_std:>17.2e}")
    return "\n".join(lines)
