"""SIMD (BFV batching) linear layers on shares, BOLT-style diagonal packing with
baby-step giant-step; batch ct-pt MatMul across MoE experts (CryptoMoE).

Issue 4 item 1 (the SIMD alternative to `protocols.linear`'s Cheetah coefficient
packing) and issue 5 item 4 (CryptoMoE section 4.4 / appendix D, batch MatMul).

Protocol (same shape as `linear.cross_matmul`, one round trip): the client
(party 0) holds its share X_0 (rows x d1) reduced into Z_p, encodes it in the
BFV slots and sends seeded encryptions; the server multiplies by its plaintext
weight diagonals, rotates, sums, adds a uniform mask R (all N slots uniform
mod p: a uniform plaintext polynomial), re-randomises, floods the noise
(FLOOD_SIGMA = 77 bits: 2^-40 per session, `he_session`), switches down to two primes (the helpers of `he_session.HESession`,
shared with the coefficient path) and returns the whole ciphertexts.  The
client decrypts X_0 W + R, the server keeps -R.  The server's own term X_1 W is
local.  Galois keys are the client's (it owns the secret key): sent once per
session for the rotation steps the plans need (step ``he-galois``).

Packing (BOLT, Pang et al. S&P 2024, section 4.1 "column packing" with
Halevi-Shoup diagonals and BSGS; the BLB paper's appendix C.1 recalls BSGS).
Slots: 2 rows of S = N/2, a row rotation by k moves slot s to s - k (cyclic in
each row).  Choose tp = next power of two >= rows, a column block c (power of
two, L = c tp <= S).  A slot s of a row is (lane, col, tok) with
lane = s // L, p = s % L, col = p // tp, tok = p % tp.  Input ciphertext D_i
holds X[tok, D_i c + col] in every lane of both rows (the input is periodic
with period L, so a row rotation by k tp is a cyclic column shift by k inside
every lane).  Lane l of output ciphertext g computes output block
o = g (N / L) + l, i.e. Y[tok, o c + col] = sum_i sum_k diag_{i,k}[s] *
rot_{k tp}(x_i)[s] with diag_{i,k}[s] = W[i c + (col + k) % c, o c + col].
BSGS, k = u b + j (j < b baby steps, u < g = c / b giant steps):

    y = sum_u rot_{u b tp}( sum_i sum_j rot_{-u b tp}(diag_{i, u b + j}) * rot_{j tp}(x_i) )

so rotations = sum_i (#baby j != 0) + sum_g (#giant u != 0), products = number
of structurally non-zero diagonals.  A diagonal is non-zero iff some
(col, lane) has a valid output column and (col + k) % c a valid input column
(decided by the public shapes only).

Batch MatMul (CryptoMoE section 4.4, appendix D): for n experts with t tokens
each, the n t rows share the ciphertexts (tp = next_pow2(n t)) and the
diagonal entry of slot (col, tok) takes the weight of the expert owning row
tok.  Rotation count: per expert BSGS is n (D (b-1) + G (g-1)) with
c = S / next_pow2(t); batched, one plan with c = S / next_pow2(n t): the
paper's O(n d1) -> O(d1) (diagonal method) and O(n sqrt(t d1 d2 / N)) ->
O(sqrt(n t d1 d2 / N)) (BSGS).

Arithmetic: BFV with a 59-bit batching prime p = 1 mod 2N.  Shares mod 2^64
enter Z_p with the free local conversion (`mpc.protocols.field.ring_to_field`
method "local": each party reduces its signed share mod p; wrong with
probability about |x| / 2^63, negligible for fixed-point values with 14
fraction bits).  Results leave Z_p the way `linear` leaves Z_{2^59}: the
server's share -R is uniform mod p, each party reads its share as a centred
integer and sign-extends it; the sum is y + k p with k != 0 with probability
about |y| 2^28 / p (~ |y| 2^-31), the same failure model as the coefficient
path (docs/linear_2pc.md).

Parameters (``SIMD_BFV``): N = 16384, coefficient modulus 4 x 60 data bits + a
60-bit special prime = 300 bits <= 438 (HomomorphicEncryption.org 128-bit
bound for N = 16384, `he.params.check_security`; SEAL's tc128 check).  With a
slot-encoded plaintext the diagonal polynomials have coefficients up to p / 2,
so one product grows the noise to N (p / 2) (|e| + |e_ks|) in the worst case
(`simd_noise_bound`: fresh noise |e| <= 21.5, key-switching noise of a baby
rotation |e_ks| <= dnum N 21 max(q_i) / P + (1 + N) / 2); that bound times the
number of products summed, plus the giant rotations, is the correctness bound
(2^101-2^103 on the real shapes).  The flooding width is sized from the bound
on the *mean* absolute noise, `simd_noise_mean` (expectation and triangle
inequality only, 2^7 lower: 2^94-2^96), since the statistical distance of one
flooded coefficient is <= E|e| / 2 B_f: B_f = 2^77 x mean (2^171-2^173), and
2 (B_f + worst case) < q / 2p = 2^180 at four primes holds with 6 bits to spare
(`HESession.finish` checks it, and the switch to two primes).  With the
worst-case bound, 77-bit flooding would not fit four primes (it did at 40 bits);
a fifth data prime (360 <= 438 bits) was the alternative, at ~1.25x input bytes
and ~1.5x per rotation.  N = 8192 (218 bits) cannot hold that noise and the
flooding (docs/linear_2pc.md).
"""

from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

import numpy as np

from ..he.backend import TwoPCCostModel, get_backend
from ..he.params import HEParams
from ..mpc.context import MPCError
from ..mpc.protocols.field import ring_to_field
from ..mpc.ring import fixed_encode, mask, mulmod_scalar
from ..mpc.shares import AShare
from ..mpc.he_session import FLOOD_SIGMA, FRESH_NOISE_MAX, RESULT_PRIMES, HESession
from .linear_common import _LAN_BYTES_PER_S, IN_FRAC, W_BITS, W_FRAC, _to_in_frac, plan_blocks

SIMD_N = 16384
#: 59-bit prime, p = 1 mod 2N (SEAL's PlainModulus.Batching(16384, 59)); distinct from the 60-bit data primes
SIMD_PRIME = 576460752302473217
SIMD_BFV = HEParams(name="2pc-bfv-simd-n16384-p59", scheme="bfv", poly_modulus_degree=SIMD_N,
                    coeff_modulus_bits=(60, 60, 60, 60, 60), plain_modulus=SIMD_PRIME)

#: cost-model constants (N = 16384 at 4 primes: rotate, NTT, product, encode, encrypt, finish; and the
#: coefficient path's correction when comparing, ``coeff_time_scale``) are the HE backend's
#: (`get_backend().cost_model.twopc`, ``simd_*``; measured on the 2-vCPU reference machine)
#: seeded input ciphertext (c0 at 4 primes) and a result (c0 + c1 at 2 primes), bytes (+ framing)
IN_CT_BYTES = SIMD_N * 4 * 8 + 100
OUT_CT_BYTES = 2 * SIMD_N * RESULT_PRIMES * 8 + 64
#: bandwidth (bytes/s) the SIMD plans are chosen for by default: CryptoMoE's WAN, 400 Mbit/s
#: (SIMD packing is what one picks when bytes matter; `linear(..., network=...)` passes its own)
DEFAULT_BANDWIDTH = 400e6 / 8
#: encoded diagonals are cached (``cache_key``) only up to this many per plan (512 kB each)
CACHE_MAX_PRODUCTS = 256
#: one seeded Galois key: dnum = 4 key-switching pairs, half of each at 5 primes
GALOIS_KEY_BYTES = 4 * SIMD_N * 5 * 8


def _pow2(v: int) -> int:
    return 1 << max(0, int(v - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class SimdPlan:
    """BSGS diagonal packing of a (rows x d) @ (d x o) product (module docstring)."""

    m: int      # rows (tokens; all experts' tokens for batch MatMul)
    d: int
    o: int
    n: int      # ring degree
    tp: int     # rows slot stride (power of two >= m)
    c: int      # columns per lane (power of two)
    b: int      # baby steps
    products: int
    baby_rotations: int
    giant_rotations: int
    steps: tuple  # rotation steps (slots) whose Galois keys the plan needs

    @property
    def L(self) -> int:
        return self.c * self.tp

    @property
    def lanes(self) -> int:
        return self.n // self.L

    @property
    def g(self) -> int:
        return -(-self.c // self.b)

    @property
    def D(self) -> int:
        return -(-self.d // self.c)

    @property
    def O(self) -> int:
        return -(-self.o // self.c)

    @property
    def G(self) -> int:
        return -(-self.O // self.lanes)

    @property
    def in_cts(self) -> int:
        return self.D

    @property
    def out_cts(self) -> int:
        return self.G

    @property
    def rotations(self) -> int:
        return self.baby_rotations + self.giant_rotations

    def bytes_estimate(self) -> int:
        return self.in_cts * IN_CT_BYTES + self.out_cts * OUT_CT_BYTES

    def seconds_estimate(self, bandwidth_bytes_per_s: float = 1e9 / 8, encode_weights: bool = True,
                         cost: TwoPCCostModel | None = None) -> float:
        c = get_backend().cost_model.twopc if cost is None else cost
        s = (self.in_cts * (c.simd_encrypt + c.simd_ntt) + self.baby_rotations * (c.simd_rotate + c.simd_ntt)
             + self.giant_rotations * (c.simd_rotate + c.simd_ntt) + self.products * c.simd_product
             + self.out_cts * c.simd_finish + self.bytes_estimate() / bandwidth_bytes_per_s)
        if encode_weights:
            s += self.products * c.simd_encode
        return s

    def nonzero(self, di: int, gi: int) -> np.ndarray:
        """Boolean (c,): which diagonals k of input block di / output group gi are structurally non-zero."""
        return _nonzero(self.c, self.d - di * self.c, self.o - gi * self.lanes * self.c)


def _nonzero(c: int, u: int, v: int) -> np.ndarray:
    """Diagonals k with some col < v (valid output) and (col + k) % c < u (valid input)."""
    u, v = min(max(u, 0), c), min(max(v, 0), c)
    out = np.zeros(c, bool)
    if u == 0 or v == 0:
        return out
    if u + v - 1 >= c:
        out[:] = True
        return out
    ks = np.arange(-(v - 1), u) % c
    out[ks] = True
    return out


def _counts(m, d, o, n, tp, c, b):
    lanes = n // (c * tp)
    D, O = -(-d // c), -(-o // c)
    G = -(-O // lanes)
    g = -(-c // b)
    products = baby = giant = 0
    steps = set()
    for di in range(D):
        used_j = np.zeros(b, bool)
        for gi in range(G):
            nz = np.zeros(g * b, bool)
            nz[:c] = _nonzero(c, d - di * c, o - gi * lanes * c)
            used_j |= nz.reshape(g, b).any(axis=0)
            products += int(nz.sum())
        baby += int(used_j[1:].sum())
        steps.update(int(j * tp) for j in np.nonzero(used_j)[0] if j)
    for gi in range(G):
        used_u = np.zeros(g, bool)
        for di in range(D):
            nz = np.zeros(g * b, bool)
            nz[:c] = _nonzero(c, d - di * c, o - gi * lanes * c)
            used_u |= nz.reshape(g, b).any(axis=1)
        giant += int(used_u[1:].sum())
        steps.update(int(u * b * tp) for u in np.nonzero(used_u)[0] if u)
    return products, baby, giant, tuple(sorted(steps))


@lru_cache(maxsize=4096)
def plan_simd(m: int, d: int, o: int, n: int = SIMD_N, *, bandwidth_bytes_per_s: float = DEFAULT_BANDWIDTH,
              encode_weights: bool = True, c: int | None = None, b: int | None = None) -> SimdPlan:
    """The (c, b) with the lowest modelled time (rotations, products, encryptions,
    finishing, bytes at the given bandwidth).  ``c`` / ``b`` force a choice."""
    if min(m, d, o) < 1:
        raise MPCError(f"empty matrix product {m}x{d} @ {d}x{o}")
    tp = _pow2(m)
    S = n // 2
    if tp > S:
        raise MPCError(f"{m} rows do not fit one SIMD ciphertext (at most {S}); split the rows")
    best = None
    cs = [c] if c is not None else [1 << k for k in range(int(math.log2(S // tp)) + 1)]
    for cc in cs:
        if cc * tp > S:
            continue
        # only block sizes up to the next power of two above max(d, o) can help
        if c is None and cc > 2 * _pow2(max(d, o)):
            continue
        bs = [b] if b is not None else [1 << k for k in range(int(math.log2(cc)) + 1)]
        for bb in bs:
            prod, baby, giant, steps = _counts(m, d, o, n, tp, cc, bb)
            p = SimdPlan(m, d, o, n, tp, cc, bb, prod, baby, giant, steps)
            key = (p.seconds_estimate(bandwidth_bytes_per_s, encode_weights), p.bytes_estimate())
            if best is None or key < best[0]:
                best = (key, p)
    if best is None:
        raise MPCError(f"no SIMD plan for {m}x{d} @ {d}x{o} (c={c}, b={b})")
    return best[1]


@dataclasses.dataclass(frozen=True)
class PackingChoice:
    """The per-layer choice between Cheetah coefficient packing and SIMD/BSGS packing."""

    packing: str          # "coeff" | "simd"
    m: int
    d: int
    o: int
    network: str
    coeff_seconds: float  # modelled: compute + bytes / bandwidth + one round trip
    simd_seconds: float
    coeff_bytes: int
    simd_bytes: int
    simd_rotations: int
    simd_products: int
    coeff_products: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@lru_cache(maxsize=4096)
def choose_packing(m: int, d: int, o: int, network: str = "LAN", *, encode_weights: bool = True) -> PackingChoice:
    """Cost model for the per-layer choice (issue 4 item 1): modelled seconds of each
    packing = server/client compute (products, rotations, encryptions, finishing;
    constants above) + bytes / bandwidth + one round trip, at a `net.netmodel` preset.
    Galois keys are a per-session cost and are not charged to a layer."""
    from ..net.netmodel import get_preset
    from ..mpc.he_session import TWOPC_BFV
    net = get_preset(network)
    bw = net.bandwidth_bits_per_s / 8
    n_c = TWOPC_BFV.poly_modulus_degree
    in_ct = 3 * n_c * 8
    cp = plan_blocks(m, d, o, n_c, encode_weights=encode_weights)
    c_bytes = cp.bytes_estimate(in_ct)
    c_sec = ((cp.seconds_estimate(in_ct, encode_weights) - c_bytes / _LAN_BYTES_PER_S)
             * get_backend().cost_model.twopc.coeff_time_scale
             + net.seconds(c_bytes, 2))
    sp = plan_simd(m, d, o, SIMD_N, bandwidth_bytes_per_s=bw, encode_weights=encode_weights) if m <= SIMD_N // 2 else None
    if sp is None:
        s_sec, s_bytes, s_rot, s_prod = math.inf, 0, 0, 0
    else:
        s_bytes = sp.bytes_estimate()
        s_sec = sp.seconds_estimate(math.inf, encode_weights) + net.seconds(s_bytes, 2)
        s_rot, s_prod = sp.rotations, sp.products
    return PackingChoice("simd" if s_sec < c_sec else "coeff", m, d, o, net.name, c_sec, s_sec, c_bytes, s_bytes,
                         s_rot, s_prod, cp.products)


# ----------------------------------------------------------------------------- slot layout (numpy)
def _slot_index(plan: SimdPlan):
    """Per slot of one ciphertext (both rows): (lane, col, tok), shapes (N,)."""
    return _slot_index_cached(plan.n, plan.L, plan.tp)


@lru_cache(maxsize=64)
def _slot_index_cached(n: int, L: int, tp: int):
    s = np.arange(n)
    lane = s // L          # lanes of row 0 then row 1 (L divides S)
    p = s % L
    out = (lane, p // tp, p % tp)
    for a in out:
        a.setflags(write=False)
    return out


def pack_input(plan: SimdPlan, X: np.ndarray) -> np.ndarray:
    """X (m, d) field elements -> slot vectors (D, N), periodic with period L."""
    _, col, tok = _slot_index(plan)
    out = np.zeros((plan.D, plan.n), np.uint64)
    Xp = np.zeros((plan.tp, plan.D * plan.c), np.uint64)
    Xp[: plan.m, : plan.d] = X
    for di in range(plan.D):
        out[di] = Xp[tok, di * plan.c + col]
    return out


def unpack_output(plan: SimdPlan, slots: np.ndarray) -> np.ndarray:
    """Slot vectors (G, N) -> Y (m, o)."""
    lane, col, tok = _slot_index(plan)
    Y = np.zeros((plan.tp, plan.G * plan.lanes * plan.c), np.uint64)
    for gi in range(plan.G):
        Y[tok, (gi * plan.lanes + lane) * plan.c + col] = slots[gi]
    return Y[: plan.m, : plan.o]


def diagonal(plan: SimdPlan, W: np.ndarray, widx: np.ndarray, di: int, gi: int, k: int) -> np.ndarray:
    """Slot vector of diagonal k (input block di, output group gi), signed int64:
    slot (lane, col, tok) = W[widx[tok]][di c + (col + k) % c, o c + col], o = gi lanes + lane."""
    lane, col, tok = _slot_index(plan)
    i = di * plan.c + (col + k) % plan.c
    j = (gi * plan.lanes + lane) * plan.c + col
    ok = (tok < plan.m) & (i < plan.d) & (j < plan.o)
    out = np.zeros(plan.n, np.int64)
    e = widx[np.minimum(tok, plan.m - 1)]
    out[ok] = W[e[ok], i[ok], j[ok]]
    return out


def row_rotate(v: np.ndarray, steps: int, n: int) -> np.ndarray:
    """What SEAL's rotate_rows(steps) does to slots: new[s] = old[(s + steps) mod S] in each row."""
    S = n // 2
    r = v.reshape(2, S)
    return np.roll(r, -steps, axis=1).reshape(-1)


def simd_matmul_numpy(plan: SimdPlan, X: np.ndarray, W: np.ndarray, widx: np.ndarray, p: int) -> np.ndarray:
    """The packing evaluated on slot vectors in numpy (object ints mod p): checks the
    BSGS bookkeeping without HE (tests)."""
    xs = pack_input(plan, X).astype(object)
    outs = []
    for gi in range(plan.G):
        y = np.zeros(plan.n, object)
        for u in range(plan.g):
            acc = np.zeros(plan.n, object)
            for di in range(plan.D):
                nz = plan.nonzero(di, gi)
                for j in range(plan.b):
                    k = u * plan.b + j
                    if k >= plan.c or not nz[k]:
                        continue
                    dk = row_rotate(diagonal(plan, W, widx, di, gi, k), -u * plan.b * plan.tp, plan.n)
                    acc = acc + dk.astype(object) * row_rotate(xs[di], j * plan.tp, plan.n)
            y = y + row_rotate(acc, u * plan.b * plan.tp, plan.n)
        outs.append(np.array([int(v) % p for v in y], np.uint64))
    return unpack_output(plan, np.stack(outs))


# ----------------------------------------------------------------------------- session
@dataclasses.dataclass
class SimdStats:
    """What the SIMD cross terms did (for reports)."""

    calls: int = 0
    in_cts: int = 0
    out_cts: int = 0
    products: int = 0
    rotations: int = 0
    galois_keys: int = 0
    galois_bytes: int = 0
    #: operations the server actually performed (tests compare them with the plans)
    done_rotations: int = 0
    done_products: int = 0
    plans: list = dataclasses.field(default_factory=list)

    def add(self, plan: SimdPlan) -> None:
        self.calls += 1
        self.in_cts += plan.in_cts
        self.out_cts += plan.out_cts
        self.products += plan.products
        self.rotations += plan.rotations
        if len(self.plans) < 64:
            self.plans.append({"m": plan.m, "d": plan.d, "o": plan.o, "tp": plan.tp, "c": plan.c, "b": plan.b,
                               "rotations": plan.rotations, "products": plan.products})


def simd_stats(ctx) -> SimdStats:
    s = getattr(ctx, "_simd_stats", None)
    if s is None:
        s = ctx._simd_stats = SimdStats()
    return s


def simd_session(ctx) -> HESession:
    """The context's SIMD BFV session (own keys and public-key exchange, step ``he-keys-simd``)."""
    s = getattr(ctx, "_he_simd_session", None)
    if s is None:
        s = HESession(ctx, SIMD_BFV, step="he-keys-simd")
        s.galois_steps = set()
        s.galois_keys = []  # server side: list of (steps, the backend's Galois keys)
        ctx._he_simd_session = s
    return s


def ensure_galois_keys(ctx, he: HESession, steps) -> None:
    """The client sends the Galois keys for the rotation steps not sent yet (once per session)."""
    missing = sorted(set(int(s) for s in steps) - he.galois_steps)
    if not missing:
        return
    with ctx.step("he-galois"):
        if ctx.party == 0:
            blob = he.keys.galois_keys_bytes(missing)
            ctx.send({"galois": blob})
        else:
            msg = ctx.recv()
            blob = msg.get("galois") if isinstance(msg, dict) else None
            if not isinstance(blob, (bytes, bytearray, memoryview)):
                raise MPCError("expected Galois keys")
            gk = he.backend.galois_keys_from_bytes(he.he, bytes(blob), required_steps=missing)
            he.galois_keys.append((set(missing), gk))
    st = simd_stats(ctx)
    st.galois_keys += len(missing)
    st.galois_bytes += len(blob) if ctx.party == 0 else len(bytes(blob))
    he.galois_steps.update(missing)


def _keys_for(he: HESession, step: int):
    for steps, gk in he.galois_keys:
        if step in steps:
            return gk
    raise MPCError(f"no Galois key for rotation step {step}")


def simd_noise_bound(he: HESession, plan: SimdPlan) -> float:
    """Worst-case bound on the noise of one result coefficient before flooding
    (module docstring): products x N (p / 2) (fresh + key-switching noise) + giant rotations.
    The correctness bound (the flooded result must decrypt)."""
    n = he.n
    moduli = he.he.coeff_moduli
    special = he.backend.special_modulus(he.he)
    dnum = len(moduli)
    ks = dnum * n * 21.0 * max(moduli) / special + (1 + n) / 2
    per_term = n * (he.t / 2) * (FRESH_NOISE_MAX + ks)
    terms = plan.D * plan.c  # an upper bound on the products summed into one output
    return terms * per_term + (plan.g + 1) * ks


#: variance of SEAL's centred-binomial noise (42 coins), fresh encryptions and key noise alike
_NOISE_VAR = 10.5


def simd_noise_mean(he: HESession, plan: SimdPlan) -> float:
    """Bound on the *mean* absolute noise of one result coefficient, what the flooding
    width is sized from (`he_session` module docstring: statistical distance <=
    E|e| / 2 B_f).  Linearity of expectation and the triangle inequality only, no
    independence between products: E|(nu * w)_a| <= N (p / 2) max_c E|nu_c| for a noise
    polynomial nu times a plaintext with |w| <= p / 2, and per noise coefficient
    E|nu_c| <= E|e| + 1/2 + E|e_ks| with E|e| <= sqrt(10.5) (fresh) and, for a key
    switch, E|sum_i d_i e_i / P| <= sqrt(10.5 dnum N) max(q_i) / P (digits d_i < q_i,
    key noise independent of them) plus the mod-down rounding taken at its worst,
    (1 + N) / 2.  About 2^7 below `simd_noise_bound`, which stays the correctness bound."""
    n = he.n
    moduli = he.he.coeff_moduli
    special = he.backend.special_modulus(he.he)
    dnum = len(moduli)
    ks = math.sqrt(_NOISE_VAR * dnum * n) * max(moduli) / special + (1 + n) / 2
    per_term = n * (he.t / 2) * (math.sqrt(_NOISE_VAR) + 0.5 + ks)
    terms = plan.D * plan.c
    return terms * per_term + (plan.g + 1) * ks


# ----------------------------------------------------------------------------- the cross term
def cross_matmul_simd(ctx, A: np.ndarray | None, B: np.ndarray | None, widx: np.ndarray, shape: tuple[int, int, int],
                      *, b_bits: int = W_BITS, cache_key=None, plan: SimdPlan | None = None) -> np.ndarray:
    """Additive shares mod p of A @ B[widx] row by row: A (m, d) field elements held by the client
    (party 0); B (E, d, o) signed integers |B| < 2^(b_bits - 1) held by the server; row r uses
    B[widx[r]] (widx public: expert of each row).  Returns this party's share (m, o) mod p."""
    he = simd_session(ctx)
    n, p = he.n, he.t
    m, d, o = (int(v) for v in shape)
    widx = np.asarray(widx, np.int64).reshape(-1)
    if widx.shape != (m,):
        raise MPCError(f"widx has shape {widx.shape}, expected {(m,)}")
    if plan is None:
        plan = plan_simd(m, d, o, n, encode_weights=cache_key is None)
    ensure_galois_keys(ctx, he, plan.steps)
    simd_stats(ctx).add(plan)
    be, hectx = he.backend, he.he
    if ctx.party == 0:
        A = np.asarray(A, np.uint64).reshape(m, d)
        if np.any(A >= np.uint64(p)):
            raise MPCError("inputs must be reduced mod p")
        blobs = []
        for v in pack_input(plan, A):
            blobs.append(he.keys.encrypt_seeded(be.encode_slots(hectx, v)))
        ctx.send({"cts": blobs})
        reply = ctx.recv()
        c1 = np.asarray(reply.get("c1"), np.uint64) if isinstance(reply, dict) else None
        c0 = np.asarray(reply.get("c0"), np.uint64) if isinstance(reply, dict) else None
        want = (plan.out_cts, RESULT_PRIMES, n)
        if c1 is None or c0 is None or c1.shape != want or c0.shape != want:
            raise MPCError(f"SIMD reply has shapes {getattr(c1, 'shape', None)}/{getattr(c0, 'shape', None)}, "
                           f"expected {want}/{want}")
        allpos = np.arange(n)
        slots = []
        for gi in range(plan.out_cts):
            coeffs = he.decrypt_compact(c1[gi], c0[gi], allpos)
            slots.append(_decode(he, coeffs))
        return unpack_output(plan, np.stack(slots))
    # server (evaluator)
    if B is None:
        raise MPCError("the evaluator must hold the plaintext operand")
    B = np.asarray(B)
    if B.ndim != 3 or B.shape[1:] != (d, o) or (m and widx.max() >= B.shape[0]) or widx.min(initial=0) < 0:
        raise MPCError(f"plaintext operand has shape {B.shape}, expected (E, {d}, {o}) for experts {widx.max()}")
    B = B.astype(np.int64)
    if np.abs(B).max(initial=0) >= 1 << (b_bits - 1):
        raise MPCError(f"weights exceed the public bound |W| < 2^{b_bits - 1 - W_FRAC}")
    msg = ctx.recv()
    blobs = msg.get("cts") if isinstance(msg, dict) else None
    if not isinstance(blobs, list) or len(blobs) != plan.in_cts:
        raise MPCError(f"SIMD cross term: expected {plan.in_cts} ciphertexts, got "
                       f"{len(blobs) if isinstance(blobs, list) else type(blobs).__name__}")
    cts = [be.ciphertext_from_bytes(hectx, bytes(bl), level=he.top) for bl in blobs]
    for ct in cts:
        if be.is_ntt(ct):
            raise MPCError("expected coefficient-form BFV ciphertexts")
    st = simd_stats(ctx)
    # baby steps: rot_{j tp}(x_di), NTT form, only the j some diagonal uses
    used = {}
    for di in range(plan.D):
        js = np.zeros(plan.b, bool)
        for gi in range(plan.G):
            nz = np.zeros(plan.g * plan.b, bool)
            nz[: plan.c] = plan.nonzero(di, gi)
            js |= nz.reshape(plan.g, plan.b).any(axis=0)
        for j in sorted((int(j) for j in np.nonzero(js)[0]), reverse=True):  # j = 0 last: in place
            if j == 0:
                r = cts[di]
            else:
                r = be.rotate_rows(hectx, cts[di], j * plan.tp, _keys_for(he, j * plan.tp))
                st.done_rotations += 1
            be.to_ntt_inplace(hectx, r)
            used[(di, j)] = r
    cache = (he.plain_cache.setdefault(("simd", cache_key, plan), {})
             if cache_key is not None and plan.products <= CACHE_MAX_PRODUCTS else None)
    bound = simd_noise_bound(he, plan)
    mean = simd_noise_mean(he, plan)
    allpos = np.arange(n)
    c1s, c0s, shares = [], [], []
    tmp = None  # the product buffer (`multiply_plain(out=)`)
    for gi in range(plan.G):
        y = None
        nzs = [np.concatenate([plan.nonzero(di, gi), np.zeros(plan.g * plan.b - plan.c, bool)]) for di in range(plan.D)]
        for u in range(plan.g):
            acc = None
            for di in range(plan.D):
                for j in range(plan.b):
                    k = u * plan.b + j
                    if not nzs[di][k]:
                        continue
                    pt = _diag_plain(he, plan, B, widx, di, gi, u, j, cache)
                    if pt is None:  # an all-zero diagonal of these weights (SEAL refuses transparent results)
                        continue
                    st.done_products += 1
                    if acc is None:
                        acc = be.multiply_plain(hectx, used[(di, j)], pt)
                    else:
                        tmp = be.multiply_plain(hectx, used[(di, j)], pt, out=tmp)
                        be.add_inplace(hectx, acc, tmp)
            if acc is None:
                continue
            be.from_ntt_inplace(hectx, acc)
            if u:
                step = u * plan.b * plan.tp
                be.rotate_rows_inplace(hectx, acc, step, _keys_for(he, step))
                st.done_rotations += 1
            if y is None:
                y = acc
            else:
                be.add_inplace(hectx, y, acc)
        if y is None:  # structurally empty group: a fresh encryption of zero still hides it
            y = he.zero_ntt()
            be.from_ntt_inplace(hectx, y)
        c1, c0, sh = he.finish(y, allpos, bound, ntt=False, flood_noise=mean)
        c1s.append(c1)
        c0s.append(c0)
        shares.append(_decode(he, sh))
    ctx.send({"c1": np.stack(c1s), "c0": np.stack(c0s)})
    return unpack_output(plan, np.stack(shares))


def _decode(he: HESession, coeffs: np.ndarray) -> np.ndarray:
    """Plaintext coefficients mod p -> slot values (uint64 < p)."""
    return he.backend.decode_slots(he.he, np.asarray(coeffs, np.uint64))


def _diag_plain(he: HESession, plan: SimdPlan, B, widx, di, gi, u, j, cache):
    key = (di, gi, u, j)
    if cache is not None and key in cache:
        return cache[key]
    k = u * plan.b + j
    v = row_rotate(diagonal(plan, B, widx, di, gi, k), -u * plan.b * plan.tp, plan.n)
    if not v.any():
        if cache is not None:
            cache[key] = None
        return None
    v = np.where(v < 0, v + he.t, v).astype(np.uint64)
    pt = he.backend.encode_slots(he.he, v, level=he.top, ntt=True)
    if cache is not None:
        cache[key] = pt
    return pt


# ----------------------------------------------------------------------------- share-level API
def to_field(ctx, x: AShare, p: int = SIMD_PRIME) -> np.ndarray:
    """Ring shares (IN_FRAC fraction bits) -> shares mod p by the free local conversion
    (`ring_to_field` method "local": failure about |x| / 2^63)."""
    return ring_to_field(ctx, x, p, method="local")


def lift_field(ctx, y: np.ndarray, p: int, frac: int, out_frac: int) -> AShare:
    """Shares mod p -> ring shares, locally: each party reads its share as a centred
    integer (correct except with probability about |y| / p), then SecureML local
    truncation from ``frac`` to ``out_frac`` fraction bits (as `linear.lift_local`)."""
    from ..mpc.protocols.trunc import trunc_local
    ring = ctx.ring
    y = np.asarray(y, np.uint64)
    s = np.where(y > np.uint64(p // 2), y.astype(np.int64) - np.int64(p), y.astype(np.int64))
    z = AShare(ctx, s.astype(np.uint64) & mask(ring.bits), ring.bits, frac)
    return trunc_local(ctx, z, frac - out_frac) if frac > out_frac else z


def _quantise_weight(ctx, weight, shape) -> np.ndarray | None:
    if ctx.party != 1:
        return None
    if weight is None:
        raise MPCError("the server must pass the weight")
    weight = np.asarray(weight)
    if weight.shape != shape:
        raise MPCError(f"weight has shape {weight.shape}, expected {shape}")
    return np.round(weight.astype(np.float64) * (1 << W_FRAC)).astype(np.int64)


def _local_term(xf: np.ndarray, Wq: np.ndarray, p: int) -> np.ndarray:
    """(x @ W) mod p for x < p (uint64) and signed |W| < 2^19, exact: x split into 29-bit
    limbs so every int64 partial sum stays below 2^63 (d < 2^14)."""
    if xf.shape[-1] >= 1 << 14:
        raise MPCError("inner dimension too large for the exact local product")
    lo = (xf & np.uint64((1 << 29) - 1)).astype(np.int64)
    hi = (xf >> np.uint64(29)).astype(np.int64)
    W = Wq.astype(np.int64)
    P = np.int64(p)
    r_lo = np.mod(lo @ W, P).astype(np.uint64)
    r_hi = np.mod(hi @ W, P).astype(np.uint64)
    return (mulmod_scalar(r_hi, 1 << 29, p) + r_lo) % np.uint64(p)


def linear_simd(ctx, x: AShare, weight: np.ndarray | None, bias: np.ndarray | None = None, *,
                out_features: int, cache_key=None, plan: SimdPlan | None = None, network: str | None = None) -> AShare:
    """`linear.linear` with SIMD/BSGS packing: x AShare (..., d_in); weight (d_in, d_out)
    and bias at the server (party 1); returns AShare (..., d_out) at the ring's fraction bits."""
    if not isinstance(x, AShare):
        raise TypeError("linear_simd expects an AShare input")
    d, o = int(x.shape[-1]), int(out_features)
    lead = x.shape[:-1]
    he = simd_session(ctx)
    p = he.t
    xi = _to_in_frac(ctx, x).reshape(-1, d)
    m = xi.shape[0]
    xf = to_field(ctx, xi, p)
    Wq = _quantise_weight(ctx, weight, (d, o))
    with ctx.step("linear"):
        if plan is None and m <= he.n // 2:
            plan = plan_simd(m, d, o, he.n, bandwidth_bytes_per_s=_bandwidth(network), encode_weights=cache_key is None)
        y = _rows_in_chunks(ctx, xf, None if Wq is None else Wq[None], np.zeros(m, np.int64), d, o, cache_key, plan)
    if ctx.party == 1:
        y = (y + _local_term(xf, Wq, p)) % np.uint64(p)
    out = lift_field(ctx, y, p, IN_FRAC + W_FRAC, ctx.ring.frac)
    if ctx.party == 1 and bias is not None:
        bias = np.asarray(bias, np.float64).reshape(-1)
        if bias.shape != (o,):
            raise MPCError(f"bias has shape {bias.shape}, expected {(o,)}")
        out.data = (out.data + fixed_encode(bias, ctx.ring.frac, ctx.ring.bits)) & mask(ctx.ring.bits)
    return out.reshape(*lead, o)


def _bandwidth(network: str | None) -> float:
    if network is None:
        return DEFAULT_BANDWIDTH
    from ..net.netmodel import get_preset
    return get_preset(network).bandwidth_bits_per_s / 8


def _rows_in_chunks(ctx, xf, Wq, widx, d, o, cache_key, plan):
    he = simd_session(ctx)
    m = xf.shape[0]
    S = he.n // 2
    if m <= S:
        return cross_matmul_simd(ctx, xf if ctx.party == 0 else None, Wq, widx, (m, d, o),
                                 cache_key=cache_key, plan=plan)
    parts = [cross_matmul_simd(ctx, xf[r:r + S] if ctx.party == 0 else None, Wq, widx[r:r + S],
                               (min(S, m - r), d, o), cache_key=cache_key) for r in range(0, m, S)]
    return np.concatenate(parts)


def batch_linear(ctx, xs: AShare, weights: np.ndarray | None, *, out_features: int, cache_key=None,
                 batched: bool = True) -> AShare:
    """CryptoMoE's batch ct-pt MatMul (section 4.4, appendix D): Y[e] = X[e] @ W[e] for n
    experts, xs AShare (n, t, d1), weights (n, d1, d2) at the server.  ``batched``: all
    experts' n t rows in shared ciphertexts (one BSGS plan); False: one SIMD plan per
    expert (the per-expert packing, for comparison).  Rotation counts are in `simd_stats`."""
    if not isinstance(xs, AShare) or xs.ndim != 3:
        raise MPCError("batch_linear expects shares of shape (n, t, d_in)")
    n_e, t, d = (int(v) for v in xs.shape)
    o = int(out_features)
    he = simd_session(ctx)
    p = he.t
    xf = to_field(ctx, _to_in_frac(ctx, xs), p).reshape(n_e, t, d)
    Wq = _quantise_weight(ctx, weights, (n_e, d, o))
    with ctx.step("linear"):
        if batched:
            widx = np.repeat(np.arange(n_e), t)
            y = _rows_in_chunks(ctx, xf.reshape(n_e * t, d), Wq, widx, d, o, cache_key, None).reshape(n_e, t, o)
        else:
            y = np.stack([_rows_in_chunks(ctx, xf[e], None if Wq is None else Wq[e:e + 1], np.zeros(t, np.int64),
                                          d, o, None if cache_key is None else (cache_key, e), None)
                          for e in range(n_e)])
    if ctx.party == 1:
        y = (y + np.stack([_local_term(xf[e], Wq[e], p) for e in range(n_e)])) % np.uint64(p)
    return lift_field(ctx, y, p, IN_FRAC + W_FRAC, ctx.ring.frac)


def batch_rotation_counts(n_experts: int, t: int, d: int, o: int, n: int = SIMD_N) -> dict:
    """Planned rotations and products: per-expert SIMD packing vs CryptoMoE batch packing."""
    per = plan_simd(t, d, o, n)
    bat = plan_simd(n_experts * t, d, o, n)
    return {"per_expert": {"rotations": n_experts * per.rotations, "products": n_experts * per.products,
                           "in_cts": n_experts * per.in_cts, "out_cts": n_experts * per.out_cts},
            "batched": {"rotations": bat.rotations, "products": bat.products,
                        "in_cts": bat.in_cts, "out_cts": bat.out_cts}}


__all__ = ["SIMD_BFV", "SIMD_PRIME", "SimdPlan", "plan_simd", "cross_matmul_simd", "linear_simd", "batch_linear",
           "simd_session", "simd_stats", "SimdStats", "batch_rotation_counts", "simd_noise_bound", "simd_noise_mean",
           "PackingChoice", "choose_packing", "pack_input", "unpack_output", "diagonal", "row_rotate", "simd_matmul_numpy", "to_field", "lift_field"]
