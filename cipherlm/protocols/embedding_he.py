"""Protocol-side HE pieces of the private embedding lookup: parameters, noise model,
wire packing.

FastQuery (``fastquery_002``, sections 2.3-2.4 and 4.2) runs a Cheetah-style
coefficient-packed matrix-vector product in the *online* phase: the client
encrypts a one-hot query with BFV, the server multiplies by its packed table,
masks, and sends the result back.  The protocol keeps its ciphertexts as raw
arrays of RNS residues and owns its wire format.  The arithmetic on those arrays
(exact negacyclic products, the RNS base and its modulus switching and decoding,
seeded public polynomials, secret and error sampling) is a `RingBackend`
(`cipherlm.he.backend`; the ``numpy`` one, `cipherlm.he.numpy_rlwe`, by default:
`RING_BACKEND`, `ring`); the primes, secret-key generation and PackLWEs come from
the `HEBackend` (SEAL by default).  This module imports only the interface.  It holds:

* the noise model that sizes Q, the output modulus and the flooding noise
  (`plan_params`, `HEPlan`, `response_bits`; see docs/embedding.md for the
  derivation), and `primes_for`;
* the wire packing of residue arrays (`pack_bits`, `unpack_bits`, `packed_size`:
  ceil(log2 q_i) bits per coefficient);
* for the protocol and its tests, the ring backend's operations under their
  historical names (`RNS`, `fft_fwd`, `fft_inv`, `split_limbs`, `conv_small`,
  `conv_pow2`, `decode_pow2`, `negacyclic`, `expand_uniform`, `sample_ternary`,
  `sample_error`, `SIGMA`, `E_MAX`, `FFT_SAFE_BITS`): bound methods and attributes
  of `ring()`.

Randomness protecting secrets (secret key, encryption noise, masks, flooding)
comes from `cipherlm.mpc.ring.new_rng` (AES-CTR keyed from the OS CSPRNG) per call;
public uniform polynomials from the ring backend's seeded expansion of a fresh
``secrets`` seed.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..he.backend import DEFAULT_RING_BACKEND, RingBackend, get_backend
from ..mpc.ring import new_rng  # noqa: F401 (re-exported: the protocols' CSPRNG)

#: the ring backend of the embedding protocol's raw-array arithmetic
RING_BACKEND = DEFAULT_RING_BACKEND


def ring() -> RingBackend:
    """The `RingBackend` the embedding protocol computes with (`RING_BACKEND`)."""
    return get_backend(RING_BACKEND)


_R = ring()
# the ring backend's operations and constants under the names the protocol uses
RNS = _R.rns
fft_fwd = _R.transform
fft_inv = _R.inverse_transform
split_limbs = _R.split_limbs
negacyclic = _R.negacyclic
conv_small = _R.mul_small
conv_pow2 = _R.mul_small_pow2
decode_pow2 = _R.decode_pow2
expand_uniform = _R.expand_uniform
sample_ternary = _R.sample_ternary
sample_error = _R.sample_error
SIGMA = _R.error_sigma  # error standard deviation (3.2, SEAL's default)
E_MAX = _R.error_bound  # errors are clipped at 6 sigma
FFT_SAFE_BITS = _R.exact_bits  # transform-domain products are exact below 2^46
TAIL = 7.5  # sub-Gaussian tail factor: P(|X| > 7.5 sigma) <= 2 exp(-7.5^2/2) < 2^-39.6 per coefficient

__all__ = [
    "RING_BACKEND",
    "ring",
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


def primes_for(bits: list[int], n: int = 4096, *, with_special: int | None = None) -> tuple[list[int], int | None]:
    """NTT-friendly primes (q = 1 mod 2N) of the given sizes, distinct, from the HE
    backend (`HEBackend.primes`: SEAL's CoeffModulus.Create) so that its context for
    PackLWEs has the same ones (the special prime, if any, last)."""
    sizes = list(bits) + ([with_special] if with_special else [])
    mods = get_backend().primes(n, sizes)
    return (mods[: len(bits)], mods[-1] if with_special else None)


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
