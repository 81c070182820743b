"""RLWE (BFV) arithmetic on raw RNS coefficients for the private embedding lookup.

FastQuery (``fastquery_002``, sections 2.3-2.4 and 4.2) runs a Cheetah-style
coefficient-packed matrix-vector product in the *online* phase: the client
encrypts a one-hot query with BFV, the server multiplies by its packed table,
masks, and sends the result back.  This module holds the polynomial layer of
that protocol, on numpy arrays of RNS residues (the HE backend, `cipherlm.he.backend`,
SEAL by default, is used only for the primes and where key switching is needed:
secret-key generation and PackLWEs, see `cipherlm.he.packlwe`; this module imports
no HE library):

* ring R_Q = Z_Q[X]/(X^N + 1), Q a product of primes below 2^31 (so a
  residue product fits a uint64); N = 4096 by default;
* exact negacyclic products by floating-point FFT with limb splitting (every
  partial convolution stays below 2^46, far inside float64's exact range);
* symmetric BFV encryption whose uniform half comes from a public 32-byte seed
  (SHAKE-256 expansion), so a query ciphertext costs one polynomial on the wire;
* RNS modulus switching (dropping primes, with rounding) before sending;
* decryption from the RNS residues (CRT by fractions, no big integers);
* the noise model that sizes Q, the output modulus and the flooding noise
  (`plan_params`; see docs/embedding.md for the derivation).

Randomness protecting secrets (secret key, encryption noise, masks, flooding)
comes from `cipherlm.mpc.ring.new_rng` (AES-CTR keyed from the OS CSPRNG) per call;
public uniform polynomials from SHAKE-256 of a fresh ``secrets`` seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np

from ..mpc.ring import new_rng  # noqa: F401 (re-exported: the protocols' CSPRNG)

SIGMA = 3.2  # error standard deviation (HomomorphicEncryption.org standard, SEAL's default)
E_MAX = 19  # errors are clipped at 6 sigma (as SEAL does)
TAIL = 7.5  # sub-Gaussian tail factor: P(|X| > 7.5 sigma) <= 2 exp(-7.5^2/2) < 2^-39.6 per coefficient
FFT_SAFE_BITS = 46  # every FFT convolution result stays below 2^46 (float64 exact)

__all__ = [
    "RNS",
    "HEPlan",
    "plan_params",
    "primes_for",
    "new_rng",
    "expand_uniform",
    "sample_ternary",
    "sample_error",
    "negacyclic",
    "conv_small",
    "pack_bits",
    "unpack_bits",
]


# --------------------------------------------------------------------------- FFT products
_TWIST: dict[int, np.ndarray] = {}


def _twist(n: int) -> np.ndarray:
    w = _TWIST.get(n)
    if w is None:
        w = np.exp(1j * np.pi * np.arange(n // 2) / n)
        _TWIST[n] = w
    return w


def fft_fwd(a: np.ndarray) -> np.ndarray:
    """Negacyclic transform of real polynomials (..., N) -> complex (..., N/2): fold
    a mod (X^(N/2) - i) = a_lo + i a_hi, then evaluate at the N/2 roots of X^(N/2) = i,
    omega xi^k with omega = e^(i pi / N) (the conjugate roots carry no more information
    for real polynomials)."""
    h = a.shape[-1] // 2
    z = a[..., :h].astype(np.float64) + 1j * a[..., h:].astype(np.float64)
    z *= _twist(a.shape[-1])
    return np.fft.fft(z, axis=-1)


def fft_inv(A: np.ndarray) -> np.ndarray:
    """Inverse of `fft_fwd` (after pointwise products), rounded to int64 (exact while
    every coefficient stays below 2^46)."""
    h = A.shape[-1]
    z = np.fft.ifft(A, axis=-1)
    z *= _twist(2 * h).conj()
    out = np.empty(A.shape[:-1] + (2 * h,), np.float64)
    np.rint(z.real, out=out[..., :h])
    np.rint(z.imag, out=out[..., h:])
    return out.astype(np.int64)


def split_limbs(x: np.ndarray, nbits: int, limb: int) -> list[np.ndarray]:
    """Unsigned x < 2^nbits -> [x_0, x_1, ...] with x = sum x_i 2^(limb i), each < 2^limb."""
    out = []
    x = x.astype(np.uint64)
    for i in range(max(1, -(-nbits // limb))):
        out.append(((x >> np.uint64(limb * i)) & np.uint64((1 << limb) - 1)).astype(np.int64))
    return out


def negacyclic(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact product in Z[X]/(X^N+1) of small int64 polynomials (reference, tests)."""
    n = a.shape[-1]
    full = np.zeros(2 * n, dtype=object)
    for i in np.nonzero(a)[0]:
        full[i : i + n] += int(a[i]) * b.astype(object)
    return (full[:n] - full[n:]).astype(np.int64)


def conv_small(a: np.ndarray, s_hat: np.ndarray, q: np.ndarray, abits: int = 31) -> np.ndarray:
    """(a * s) mod q for residues a (..., k, N) < 2^abits and a ternary/small s given as
    fft_fwd(s) (N,); q (k,) uint64.  Exact: limbs keep N * 2^limb * |s| < 2^46."""
    n = a.shape[-1]
    limb = min(abits, FFT_SAFE_BITS - int(math.log2(n)) - 3)
    qq = q.astype(np.uint64)[:, None]
    acc = None
    for i, x in enumerate(split_limbs(a, abits, limb)):
        r = np.mod(fft_inv(fft_fwd(x) * s_hat), qq.astype(np.int64)).astype(np.uint64)
        if i:
            r = (r * ((np.uint64(1) << np.uint64(limb * i)) % qq)) % qq
        acc = r if acc is None else (acc + r) % qq
    return acc


def conv_pow2(a: np.ndarray, s_hat: np.ndarray, K: int) -> np.ndarray:
    """(a * s) mod 2^K for a (..., N) uint64 < 2^K and a ternary s given as fft_fwd(s)."""
    n = a.shape[-1]
    limb = FFT_SAFE_BITS - int(math.log2(n)) - 3
    acc = np.zeros(a.shape, np.uint64)
    for i, x in enumerate(split_limbs(a, K, limb)):
        r = fft_inv(fft_fwd(x) * s_hat).astype(np.uint64)  # two's complement wrap is fine mod 2^K
        acc += r << np.uint64(limb * i)
    return acc & np.uint64((1 << K) - 1)


def decode_pow2(c0: np.ndarray, c1s: np.ndarray, k0: int, k1: int, t_bits: int) -> np.ndarray:
    """u = round(t (c0 / 2^k0 + c1 s / 2^k1)) mod t, with c1s = c1 * s mod 2^k1 (k1 >= k0)."""
    ph = ((c0 << np.uint64(k1 - k0)) + c1s) & np.uint64((1 << k1) - 1)
    sh = k1 - t_bits
    return (((ph + np.uint64(1 << (sh - 1))) >> np.uint64(sh)) & np.uint64((1 << t_bits) - 1)).astype(np.int64)


# --------------------------------------------------------------------------- RNS base
@dataclasses.dataclass
class RNS:
    """An RNS modulus Q = prod(q_i), primes below 2^31."""

    primes: tuple[int, ...]
    n: int = 4096

    def __post_init__(self):
        self.primes = tuple(int(p) for p in self.primes)
        if any(p >= 1 << 31 or p < 3 or p % 2 == 0 for p in self.primes):
            raise ValueError(f"RNS primes must be odd and below 2^31: {self.primes}")
        self.q = np.array(self.primes, dtype=np.uint64)
        self.Q = math.prod(self.primes)
        self.bits = [p.bit_length() for p in self.primes]

    @property
    def k(self) -> int:
        return len(self.primes)

    @property
    def logq(self) -> float:
        return math.log2(self.Q)

    def sub(self, k: int) -> "RNS":
        """The first k primes (what is left after dropping the last ones)."""
        return RNS(self.primes[:k], self.n)

    def from_int(self, v: int) -> np.ndarray:
        """The residues (k,) of an integer (any sign)."""
        return np.array([v % p for p in self.primes], dtype=np.uint64)

    def from_signed(self, x: np.ndarray) -> np.ndarray:
        """int64 array (..., N) -> residues (..., k, N)."""
        x = np.asarray(x, dtype=np.int64)
        return np.mod(x[..., None, :], self.q.astype(np.int64)[:, None]).astype(np.uint64)

    def mul_scalar(self, a: np.ndarray, v: int) -> np.ndarray:
        """a (..., k, N) times an integer, mod each prime."""
        r = self.from_int(v)[:, None]
        return (a * r) % self.q[:, None]

    def add(self, a, b):
        return (a + b) % self.q[:, None]

    def sub_(self, a, b):
        return (a + self.q[:, None] - b) % self.q[:, None]

    def neg(self, a):
        return (self.q[:, None] - a) % self.q[:, None]

    # ----------------------------------------------------------------- modulus switching
    def drop_last(self, a: np.ndarray) -> np.ndarray:
        """Divide-and-round by the last prime: residues mod q_0..q_{k-2} of round(x / q_{k-1}).
        a (..., k, N) -> (..., k-1, N).  (The RNS rescale of BFV/CKKS modulus switching.)"""
        ql = self.primes[-1]
        last = a[..., -1, :].astype(np.int64)
        # centred remainder r in (-ql/2, ql/2]: x - r is divisible by ql
        r = np.where(last > ql // 2, last - ql, last)
        rest = self.q[:-1]
        out = np.empty(a.shape[:-2] + (self.k - 1, a.shape[-1]), np.uint64)
        for i, qi in enumerate(rest):
            qi = int(qi)
            inv = pow(ql, -1, qi)
            d = (a[..., i, :].astype(np.int64) - np.mod(r, qi)) % qi
            out[..., i, :] = (d.astype(np.uint64) * np.uint64(inv)) % np.uint64(qi)
        return out

    def switch_to(self, a: np.ndarray, k: int) -> np.ndarray:
        cur = self
        while cur.k > k:
            a = cur.drop_last(a)
            cur = cur.sub(cur.k - 1)
        return a

    def to_pow2(self, a: np.ndarray, K: int) -> np.ndarray:
        """Modulus switch to 2^K: round(x 2^K / Q) mod 2^K (uint64) for x given by its
        residues (..., k, M).  x/Q = frac(sum_i y_i / q_i), y_i = x_i (Q/q_i)^-1 mod q_i,
        in extended precision (64-bit mantissa: error ~ k 2^(K-64) units, K <= 50)."""
        if not 1 <= K <= 50:
            raise ValueError("power-of-two response modulus must be 2^1..2^50")
        acc = np.zeros(a.shape[:-2] + a.shape[-1:], np.longdouble)
        for i, qi in enumerate(self.primes):
            inv = pow((self.Q // qi) % qi, -1, qi)
            y = (a[..., i, :] * np.uint64(inv)) % np.uint64(qi)
            acc += y.astype(np.longdouble) / np.longdouble(qi)
        acc -= np.floor(acc)
        v = np.rint(acc * np.longdouble(2.0**K)).astype(np.uint64)
        return v & np.uint64((1 << K) - 1)

    # ----------------------------------------------------------------- decoding
    def decode_top(self, phase: np.ndarray, t: int) -> np.ndarray:
        """round(t x / Q) mod t for x given by its residues (..., k, N) (BFV decoding).
        x / Q = frac(sum_i y_i / q_i) with y_i = x_i (Q/q_i)^-1 mod q_i; in float64 the
        error is about k t 2^-52, far below the decoding margin the parameters keep."""
        acc = np.zeros(phase.shape[:-2] + phase.shape[-1:], np.float64)
        for i, qi in enumerate(self.primes):
            inv = pow((self.Q // qi) % qi, -1, qi)
            y = (phase[..., i, :] * np.uint64(inv)) % np.uint64(qi)
            acc += y.astype(np.float64) / qi
        frac = acc - np.floor(acc)
        return np.mod(np.rint(frac * t).astype(np.int64), t)


def primes_for(bits: list[int], n: int = 4096, *, with_special: int | None = None) -> tuple[list[int], int | None]:
    """NTT-friendly primes (q = 1 mod 2N) of the given sizes, distinct, from the HE
    backend (`HEBackend.primes`: SEAL's CoeffModulus.Create) so that its context for
    PackLWEs has the same ones (the special prime, if any, last)."""
    from ..he.backend import get_backend

    sizes = list(bits) + ([with_special] if with_special else [])
    mods = get_backend().primes(n, sizes)
    return (mods[: len(bits)], mods[-1] if with_special else None)


# --------------------------------------------------------------------------- sampling
def expand_uniform(seed: bytes, label: bytes, rns: RNS, count: int) -> np.ndarray:
    """``count`` public uniform polynomials mod Q (count, k, N) from SHAKE-256(seed || label)."""
    n, k = rns.n, rns.k
    raw = hashlib.shake_256(seed + b"|" + label).digest(8 * count * k * n)
    w = np.frombuffer(raw, dtype="<u8").reshape(count, k, n)
    # 64-bit words reduced mod q < 2^31: statistical distance < 2^-33 per coefficient
    return w % rns.q[None, :, None]


def sample_ternary(rng: np.random.Generator, shape) -> np.ndarray:
    return rng.integers(-1, 2, size=shape, dtype=np.int64)


def sample_error(rng: np.random.Generator, shape) -> np.ndarray:
    """Rounded Gaussian, sigma 3.2, clipped at 6 sigma (SEAL's clipped normal)."""
    e = np.rint(rng.normal(0.0, SIGMA, size=shape)).astype(np.int64)
    return np.clip(e, -E_MAX, E_MAX)


# --------------------------------------------------------------------------- wire packing
def pack_bits(a: np.ndarray, bits: list[int]) -> bytes:
    """Residues (..., k, N) -> bytes with ceil(log2 q_i) bits per coefficient of prime i."""
    a = np.asarray(a, dtype=np.uint64)
    parts = []
    for i, b in enumerate(bits):
        v = np.ascontiguousarray(a[..., i, :]).reshape(-1)
        bitsarr = np.unpackbits(v.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")[:, :b]
        parts.append(np.packbits(bitsarr.reshape(-1), bitorder="little"))
    return b"".join(p.tobytes() for p in parts)


def unpack_bits(data: bytes, bits: list[int], lead: tuple, n: int) -> np.ndarray:
    """Inverse of `pack_bits` for an array of shape lead + (k, n)."""
    count = int(np.prod(lead)) * n if lead else n
    out = np.empty(tuple(lead) + (len(bits), n), np.uint64)
    buf = np.frombuffer(data, dtype=np.uint8)
    off = 0
    for i, b in enumerate(bits):
        nbytes = (count * b + 7) // 8
        if off + nbytes > buf.size:
            raise ValueError("ciphertext message too short")
        bitsarr = np.unpackbits(buf[off : off + nbytes], bitorder="little")[: count * b].reshape(count, b)
        full = np.zeros((count, 64), np.uint8)
        full[:, :b] = bitsarr
        out[..., i, :] = np.packbits(full, axis=1, bitorder="little").reshape(-1).view("<u8").reshape(tuple(lead) + (n,))
        off += nbytes
    if off != buf.size:
        raise ValueError(f"ciphertext message has {buf.size - off} trailing bytes")
    return out


def packed_size(count: int, bits: list[int]) -> int:
    return sum((count * b + 7) // 8 for b in bits)


# --------------------------------------------------------------------------- parameters
@dataclasses.dataclass(frozen=True)
class HEPlan:
    """Public HE parameters of one lookup configuration (both parties derive the same)."""

    n: int  # ring degree N
    t_bits: int  # plaintext modulus t = 2^t_bits
    in_bits: tuple[int, ...]  # sizes of the query primes (the modulus Q the server computes in)
    out_k: int  # primes kept after modulus switching (the response modulus q')
    special_bits: int | None  # SEAL's key-switching prime (PackLWEs only)
    flood_bits: int  # statistical security lambda of the flooding (0: no flooding)
    flood: int  # flooding bound F: uniform noise in [-F, F] added to every sent c0 coefficient
    bound_pre: float  # documented bound on |noise| at Q before flooding (prob. 2^-40 per coeff.)
    bound_out: float  # bound on the weight-dependent noise at q' (B')
    ks_var: float  # variance of the PackLWEs key-switching noise at Q (0 without PackLWEs)
    k0_bits: int = 0  # the response's c0 is sent mod 2^k0_bits (switched down from q' after flooding)
    k1_bits: int = 0  # ... and its c1 mod 2^k1_bits

    @property
    def logq(self) -> int:
        return sum(self.in_bits)

    @property
    def out_bits(self) -> int:
        return sum(self.in_bits[: self.out_k])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _noise(n, t_bits, w_abs, nnz, blocks, packlwe, in_bits, special_bits, out_k):
    """Variance proxies (sub-Gaussian) of the noise terms; see docs/embedding.md.

    * client encryption e (sigma 3.2) times the server's plaintext w, summed over
      `blocks` input ciphertexts and at most `nnz` non-zero coefficients each:
      V_mul <= blocks * nnz * sigma^2 * w_abs^2  (worst case over any table);
    * PackLWEs (Chen-Dai-Kim-Song 2021): inputs pre-multiplied by N^-1 mod Q, so
      the message noise passes unchanged; each key switch adds
      V_ks <= (sum_i N q_i^2 sigma^2) / P^2 + (1 + N)/4 and the log2 N levels that
      follow multiply a level's variance by 4 each: total V_ks (4^L - 1)/3;
    * re-randomisation with a fresh public-key encryption of zero:
      V_pk <= sigma^2 (2N + 1);
    * modulus switching Q -> q' scales these by (q'/Q)^2 and adds the rounding
      term V_round <= (1 + N)/4.
    """
    v_mul = blocks * nnz * SIGMA**2 * float(w_abs) ** 2
    v_ks = 0.0
    if packlwe:
        P = 2.0 ** special_bits
        per = sum(n * (2.0 ** b) ** 2 * SIGMA**2 for b in in_bits) / P**2 + (1 + n) / 4
        L = int(math.log2(n))
        v_ks = per * (4.0**L - 1) / 3
    v_pk = SIGMA**2 * (2 * n + 1)
    v_q = v_mul + v_ks + v_pk
    scale = 2.0 ** (sum(in_bits[:out_k]) - sum(in_bits))
    v_out = scale**2 * v_q + (1 + n) / 4
    det = scale * 2.0 ** t_bits  # BFV Delta rounding (r_t(Q)/t * |m w| <= t), deterministic
    return v_q, v_ks, TAIL * math.sqrt(v_q), TAIL * math.sqrt(v_out) + det + 1


def response_bits(n: int, t_bits: int) -> tuple[int, int]:
    """(k0, k1): after flooding at q' the server switches c0 to 2^k0 and c1 to 2^k1.
    The client decodes round(t (c0/2^k0 + c1 s/2^k1)); the extra rounding is
    t 2^-(k0+1) <= 1/16 for c0 and t 7.5 sqrt(N/12) 2^-k1 <= 1/16 for c1 (s ternary),
    and the plan keeps (B' + F) / q' < 1/(4t): 1/4 + 1/16 + 1/16 < 1/2.  Post-processing
    of the flooded ciphertext, so the flooding argument is unchanged."""
    k0 = t_bits + 3
    k1 = t_bits + 4 + math.ceil(math.log2(TAIL * math.sqrt(n / 12)))
    return k0, k1


def plan_params(*, n: int = 4096, t_bits: int, w_abs: int, nnz: int, blocks: int, packlwe: bool,
                flood_bits: int = 40, max_logq: int | None = None, in_count: int = 1,
                out_count: int = 1, out_c0: int | None = None) -> HEPlan:
    """Smallest (in bytes) parameters meeting correctness and the flooding requirement.

    Search over the query modulus size log Q (split into primes of <= 30 bits; with
    PackLWEs a special prime P fills the security budget, log Q + log P <= 109 at
    N = 4096) and the kept primes q'.  Requirements, with B' the bound on the
    weight-dependent noise after switching and F = 2^lambda B' the flooding bound:
    B' + F < q' / (4t) (`response_bits` uses the other quarter).  Bytes: in_count
    query polynomials at log Q bits per coefficient + out_count responses of N c1
    coefficients at k1 bits and out_c0 c0 coefficients at k0 bits."""
    from ..he.params import HES_128_CLASSIC_MAX_LOGQ

    maxq = max_logq or HES_128_CLASSIC_MAX_LOGQ[n]
    out_c0 = out_c0 if out_c0 is not None else n
    k0, k1 = response_bits(n, t_bits)

    def split(total):  # primes of at most 30 bits, as even as possible
        k = -(-total // 30)
        b = total // k
        return [b + (1 if i < total - b * k else 0) for i in range(k)]

    best = None
    for qout in range(t_bits + 4, maxq + 1):
        outp = split(qout)
        if min(outp) < 17:
            continue
        for ldrop in [0] + list(range(17, maxq - qout + 1)):  # 0: no prime dropped (q' = Q)
            logq = qout + ldrop
            special = None
            if packlwe:
                special = min(60, maxq - logq)
                if special < 20:
                    break
            cand = tuple(outp + (split(ldrop) if ldrop else []))
            if min(cand) < 17:
                continue
            v_q, v_ks, pre, bout = _noise(n, t_bits, w_abs, nnz, blocks, packlwe, cand, special, len(outp))
            F = math.ceil(2.0 ** flood_bits * bout) if flood_bits > 0 else 0
            if pre >= 2.0 ** (logq - t_bits - 1 - 0.2 * len(cand)):
                continue
            # primes are a little below 2^bits: keep 0.2 bit per prime of margin
            if bout + F >= 2.0 ** (qout - 2 - t_bits - 0.2 * len(outp)):
                continue
            size = in_count * logq * n + out_count * (n * k1 + out_c0 * k0)
            if best is None or size < best[0] or (size == best[0] and qout < best[1].out_bits):
                best = (size, HEPlan(n, t_bits, cand, len(outp), special, flood_bits, F, pre, bout, v_ks, k0, k1))
            break  # a larger drop only costs more
    if best is None:
        raise ValueError(
            f"no {maxq}-bit modulus at N = {n} gives correct decryption with {flood_bits}-bit flooding "
            f"(t = 2^{t_bits}, |w| <= {w_abs}, {blocks} blocks); use a larger N or fewer flooding bits")
    return best[1]
