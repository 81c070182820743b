"""The numpy RLWE engine: raw RLWE arithmetic on numpy arrays of RNS residues,
behind the `RingBackend` interface (`cipherlm.he.backend`), registered as
``"numpy"``.

Moved here from ``protocols/embedding_he.py`` (issue 13, part 3), unchanged: the
polynomial layer of FastQuery's private embedding lookup (``fastquery_002``,
sections 2.3-2.4 and 4.2), which keeps its ciphertexts as raw residue arrays and
owns its wire format:

* ring R_Q = Z_Q[X]/(X^N + 1), Q a product of primes below 2^31 (so a
  residue product fits a uint64); `RNS` is one such base (residue arithmetic,
  RNS modulus switching by dropping primes with rounding, switching to a
  power-of-two modulus, BFV decoding by fractions, no big integers);
* exact negacyclic products by floating-point FFT with limb splitting (every
  partial convolution stays below 2^46 = 2^FFT_SAFE_BITS, far inside float64's
  exact range);
* public uniform polynomials from a seed (SHAKE-256 expansion), ternary secrets,
  the clipped rounded Gaussian error (sigma 3.2, SEAL's default).

Randomness protecting secrets is the caller's ``rng`` (the protocols pass
`cipherlm.mpc.ring.new_rng`, AES-CTR keyed from the OS CSPRNG); this module
imports nothing from the package but the interface.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np

from .backend import RingBackend

SIGMA = 3.2  # error standard deviation (HomomorphicEncryption.org standard, SEAL's default)
E_MAX = 19  # errors are clipped at 6 sigma (as SEAL does)
FFT_SAFE_BITS = 46  # every FFT convolution result stays below 2^46 (float64 exact)

__all__ = [
    "NumpyRLWEBackend",
    "RNS",
    "SIGMA",
    "E_MAX",
    "FFT_SAFE_BITS",
    "fft_fwd",
    "fft_inv",
    "split_limbs",
    "negacyclic",
    "conv_small",
    "conv_pow2",
    "decode_pow2",
    "expand_uniform",
    "sample_ternary",
    "sample_error",
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


# --------------------------------------------------------------------------- the backend
class NumpyRLWEBackend(RingBackend):
    """The functions above as a `RingBackend` (stateless)."""

    name = "numpy"
    error_sigma = SIGMA
    error_bound = E_MAX
    exact_bits = FFT_SAFE_BITS

    def rns(self, primes, n: int = 4096) -> RNS:
        return RNS(tuple(primes), n)

    def expand_uniform(self, seed: bytes, label: bytes, rns: RNS, count: int) -> np.ndarray:
        return expand_uniform(seed, label, rns, count)

    def sample_ternary(self, rng, shape) -> np.ndarray:
        return sample_ternary(rng, shape)

    def sample_error(self, rng, shape) -> np.ndarray:
        return sample_error(rng, shape)

    def transform(self, a: np.ndarray) -> np.ndarray:
        return fft_fwd(a)

    def inverse_transform(self, A: np.ndarray) -> np.ndarray:
        return fft_inv(A)

    def split_limbs(self, x: np.ndarray, nbits: int, limb: int) -> list[np.ndarray]:
        return split_limbs(x, nbits, limb)

    def mul_small(self, a: np.ndarray, s_hat: np.ndarray, q: np.ndarray, abits: int = 31) -> np.ndarray:
        return conv_small(a, s_hat, q, abits)

    def mul_small_pow2(self, a: np.ndarray, s_hat: np.ndarray, K: int) -> np.ndarray:
        return conv_pow2(a, s_hat, K)

    def decode_pow2(self, c0: np.ndarray, c1s: np.ndarray, k0: int, k1: int, t_bits: int) -> np.ndarray:
        return decode_pow2(c0, c1s, k0, k1, t_bits)

    def negacyclic(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return negacyclic(a, b)
