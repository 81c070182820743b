"""Secure conversions between CKKS ciphertexts and additive shares over Z_{2^64}
(BLB section 6, Algorithms 1 and 2; Appendices A, C.3, C.4).

Roles: the *client* holds the CKKS secret key (party ``1 - server``), the *server*
(party ``server``, default 1 as in `protocols.linear`) evaluates under it.

Backends: SEAL and Lattigo (the fused blocks' backend: `protocols.ckks.blb_matmul`), through
the interface's raw CKKS access (`decrypt_coeffs`, `ntt_forward`, `plaintext_from_coeffs`, ...).
The decode / encode below work in SEAL's slot order (slot j = m(omega^(3^j))); a backend with
another order (Lattigo: 5^j, ``slot_generator``) gets its slots by a public permutation of the
shares (`slot_permutation`), applied locally by each party.

Algorithm 1, CKKS -> MPC (`ckks_to_shares`), for a ciphertext of the message
polynomial m (CKKS scale Delta, slot values z = decode(m) / Delta):

1. Server: mod-switch to the last data level (one prime q; CKKS modulus
   switching drops primes and keeps the scale), re-randomise with a public-key
   encryption of zero (c1 becomes a fresh RLWE sample: it no longer depends on
   the weights), add to c0 a mask polynomial r drawn *uniformly* from R_q =
   Z_q[X]/(X^N + 1) (coefficient domain, every residue; never a CKKS encoding)
   and a flooding polynomial e_f with coefficients uniform in
   [-2^F, 2^F]; send the ciphertext.  Its share is -r mod q.  (`mask_ciphertext`)
2. Client: raw decryption without decoding: m + e + e_f + r mod q, uniform over
   R_q whatever m is (Theorem 1).  (`client_decrypt`)
   Now x_c + x_s = m + e + e_f (mod q): additive shares over the field Z_q.
3. Field -> ring (Appendix C.3, the construction of `mpc.protocols.field.field_to_ring`):
   with u = m + floor(q/2) (party 0 adds the offset), u_0 + u_1 = u + q w.  Since
   |m| < q/4 (one bit more than CKKS decryption needs), u_0 + u_1 is either below
   3q/4 or above 5q/4, and the top 6 bits of each share decide w (`wrap_small`:
   one millionaire on 8 bits instead of ceil(log2 q); `field_to_ring` compares the
   whole shares, exact for any value).  One COT (`b2a_bits`) gives arithmetic
   shares W of w over Z_{2^64}.
4. Local decode (Appendix C.4): slot j is Re m(omega^(e_j)) / Delta,
   omega = exp(i pi / N), e_j = 3^j mod 2N (SEAL's slot order).  Wanted:
   shares of y_j 2^(f+g), g = ``guard`` extra bits.  Writing
   m = (u_0 - floor(q/2)) + u_1 - q w, each party evaluates the embedding of
   its own *integer* vector u_b (known integers in [0, q), not ring shares, so
   a floating-point FFT with 30-bit limbs is accurate to far below one unit
   at scale 2^(f+g)) and rounds, and subtracts G W_b mod 2^64 with the
   integer matrix G_ji = round(q 2^(f+g) cos(pi e_j i / N) / Delta) (an exact
   linear map over Z_{2^64}, so the two results are shares of
   2^(f+g) y_j + (small rounding error)).  This is the "extension to a larger
   ring" of C.4 taken to its limit: the field shares are used as integers (the
   only modular wrap, w, is known in shared form), so nothing overflows.
   With ``complex_slots`` the imaginary parts too (sin in place of cos): N real
   values per ciphertext for the same bytes.
5. Local probabilistic truncation by g bits (SecureML, `trunc_local_bits`):
   the value truncated is only 2^(f+g) |y|, so it fails (off by 2^(64-g))
   with probability about 2^(f+g) |y| / 2^64 per slot; with f = 16, g = 6 and
   |y| < 2^8 that is below 2^-34 (2^-40 for |y| < 4).  Error: +-1 ulp from the
   truncation plus ~0.3 sqrt(N/2) / 2^g ulp from rounding G (0.3 ulp at N = 8192).

Algorithm 2, MPC -> CKKS (`shares_to_ckks`), for shares y of slot values:

1. Both parties locally encode (inverse canonical embedding, fixed point):
   m_i = sum_j A_ij Y_j mod 2^64 with the integer matrix
   A_ij = round(Delta 2^-f (2/N) cos(pi e_j i / N)), Y the shares of y 2^f.
   Exact over the ring (the coefficients must stay below 2^62: Delta max|y| <
   2^62 suffices).  The rounding of A costs about 0.3 (N/2) rms(y) 2^f / Delta
   per slot: 1.5e-4 rms(y) at N = 8192, Delta = 2^40; 1.5e-7 at Delta = 2^50
   (any *integer* linear encode of 2^f-scaled values has this floor: pick Delta
   >= 2^(f + log2 N + 20) when the next block needs ~2^-20 relative precision).
2. Ring -> field (Appendix C.3).  Default, ``ring_to_field="local"``: C.3's local change of
   modulus, with no message at all.  C.3 first extends the shares to a ring much wider than
   the value (SiRNN's extension) so that reading them as signed integers is exact but for a
   small error rate; our ring, 2^64, already is that wide for slot values (|Y| = 2^f |y| <
   2^22 for the blocks' |y| <= 2^6), so each party reads its share Y_b of the *slot values* as
   a signed integer (Y_0 + Y_1 = Y over the integers unless Y_0 falls in a window of |Y|
   values: probability |Y| / 2^64 per value, 2^-42 at |y| <= 2^6, f = 16; a failure puts an
   error of 2^(64-f) into that slot, like C.4's local truncation) and encodes it *exactly
   over the integers*, reduced mod every prime: A Y_b = sum_l 2^(16 l) A L_l over the 16-bit
   limbs L_l of Y_b, each A L_l exact in int64 (|A| 2^16 N < 2^62), combined mod q
   (`encode_mod_primes`).  The sum of the two parties' polynomials is A Y mod every prime.
   ``ring_to_field="wrap"`` (exact, for values too large for that error rate;
   `field.ring_to_field`'s exact method): encode mod 2^64 first, then the wrap
   of the ring shares (mod 2^l, l = 64 or scale_bits + value_bits + 2 given a
   public bound |y| < 2^value_bits; the coefficients must stay below 2^(l-2)) by
   `wrap_small` (one 8-bit millionaire), then one arithmetic COT modulo every prime
   (`mpc.protocols.b2a.b2a_mod_primes`: one correction of ceil(log2 q / 8) bytes per prime
   and coefficient, ALSZ13's C-OT per RNS prime) for its Z_q
   shares; the coefficient shares become shares mod every prime of the level.
3. Client: encrypts its share polynomial (seeded symmetric encryption: half a
   ciphertext on the wire; Lattigo's bit-packs c0, 52 + sum_j ceil(N bitlen(q_j - 1) / 8)
   bytes, `LattigoBackend.seeded_ciphertext_bytes`), sends it; server adds its share as a plaintext
   (one homomorphic addition).  Result: a CKKS ciphertext of y with scale Delta.

Security (Appendix A): the client's view in Algorithm 1 is the masked ciphertext,
whose decryption is uniform over R_q and independent of m and of the CKKS noise
(both hidden by r), plus sub-protocol views (millionaire, COT) that are
simulatable; c1 is re-randomised.  The server sees only OT / millionaire
messages and a fresh encryption (Algorithm 2).  Flooding: ``flood_bits`` F
(default floor(log2 Delta) - f - 12: 12 bits at Delta = 2^40, f = 16) is *not*
needed for the client's view (the uniform mask already makes it independent of
the weights and of the noise); it smudges the CKKS noise e (a few bits after
the public-key re-randomisation) that stays in the output shares, for whatever
the outputs later reveal, at a cost of about 2^-7 ulp per slot.  It is not a
2^-40 statistical flooding: that would need F = log2|e| + 40 bits and, to keep
f fraction bits, Delta >= 2^(F + f + log2 sqrt N), beyond one 60-bit prime.

The MP2ML leak (section 6.2): MP2ML masks with Encode(s) for a uniform slot
vector s; Encode(s) is bell-shaped around 0 with standard deviation about
Delta |s|_max / sqrt(1.5 N), far below q, so the client's decryption m + Encode(s)
reveals the high bits of m (tests/test_ckks_convert.py shows it).

Cost (N = 8192, one prime of 60 bits; docs/blb.md): Algorithm 1 about 1.2 MB
(the 2-polynomial ciphertext, 131 KB, plus per coefficient one 8-bit
millionaire and one COT of 64 bits), 3 rounds; Algorithm 2 with the local ring -> field
step: the seeded ciphertext alone, one message (with ``"wrap"``: about 1.37 MB at two
primes, a seeded ciphertext plus per coefficient one 8-bit millionaire and one
chosen OT of k residues, 3 rounds).  With Ferret silent OT: 281 KB and 462 KB (wrap).
Both directions also take two real-slot ciphertexts per conversion (``paired``: the
imaginary parts of the slots carry the second one), halving them again.  Channel labels:
"ckks2mpc" (the ciphertext),
"mpc2ckks" (the encryption), "ckks_setup" (the public key), and the
sub-protocols' own labels inside (millionaire_leaves, b2a, ...).
Local work: the integer maps G and A are not FFT-structured (rounded twiddles),
but their index pattern (e_j i mod 2N) is: `_wrap_fast` evaluates them exactly in
O(N log N) by Rader-style cyclic correlations over the powers of 3 (bit-equal to
the dense product `_wrap_product`, the reference); BLB evaluates the decode by FFT
with fixed-point twiddles and local truncations.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from ..he.backend import HEBackend, SecretKeys
from ..mpc.protocols.b2a import b2a_bits, b2a_mod_primes
from ..mpc.protocols.millionaire import millionaire
from ..mpc.protocols.trunc import trunc_local_bits
from ..mpc.ring import mask, uniform_mod
from ..mpc.shares import AShare

__all__ = [
    "BATCH_COEFFS",
    "GUARD_BITS",
    "PAIR_SCALE_TOLERANCE",
    "RING_TO_FIELD",
    "WRAP_TOP",
    "CKKSSide",
    "canonical_decode",
    "canonical_encode",
    "batch_size",
    "ckks_to_shares",
    "ckks_to_shares_many",
    "client_decrypt",
    "decode_shares",
    "default_flood_bits",
    "encode_mod_primes",
    "imaginary_signs",
    "encode_shares",
    "mask_ciphertext",
    "setup",
    "shares_to_ckks_many",
    "shares_to_ckks",
    "slot_exponents",
    "slot_permutation",
    "wrap_small",
]

#: Algorithm 2's ring -> field step: "local" (C.3's local change of modulus, no messages; fails
#: with probability |Y| / 2^64 per value) or "wrap" (exact: one millionaire and one COT per prime)
RING_TO_FIELD = ("local", "wrap")
#: relative difference of scales up to which two ciphertexts are paired (`mask_ciphertext`'s
#: ``imag``): the second one's values are then read at the first one's scale, off by that
#: fraction (2^-40 |y|, far below the CKKS error)
PAIR_SCALE_TOLERANCE = 2.0 ** -40
GUARD_BITS = 6  # g: extra fraction bits of the decode, removed by local truncation
#: coefficients converted together by the batched conversions (`batch_size`): 16 ciphertexts at
#: N = 16384, so one message and one set of sub-protocol rounds for a block input of <= 16
BATCH_COEFFS = 1 << 18
_CHUNK = 1 << 21  # entries of a dense wrap-term block (16 MiB of int64)


@dataclasses.dataclass
class CKKSSide:
    """One party's HE state for the conversions: the backend, its context, and the
    client's secret keys (client) or the client's public key (server)."""

    backend: HEBackend
    hectx: Any
    keys: SecretKeys | None = None  # client only
    pk: Any = None  # server only: for re-randomisation
    server: int = 1

    def is_server(self, ctx) -> bool:
        return ctx.party == self.server


def setup(ctx, backend: HEBackend, hectx, keys: SecretKeys | None = None, *, server: int = 1) -> CKKSSide:
    """The client sends its public key (re-randomisation of Algorithm 1), once."""
    side = CKKSSide(backend, hectx, keys, None, server)
    with ctx.step("ckks_setup"):
        if ctx.party == server:
            side.pk = backend.load_public_key(hectx, ctx.recv()["pk"])
        else:
            if keys is None:
                raise ValueError("the client needs its secret keys")
            ctx.send({"pk": keys.public_key_bytes()})
    return side


# ----------------------------------------------------------------------------- the embedding
def slot_exponents(n: int, n_slots: int | None = None, generator: int = 3) -> np.ndarray:
    """e_j = generator^j mod 2N: slot j of a CKKS plaintext is m(omega^(e_j)) / Delta (3:
    SEAL's order, 5: Lattigo's; for real slot values the conjugate root -e_j gives the same
    value)."""
    n_slots = n // 2 if n_slots is None else int(n_slots)
    key = (int(n), int(generator))
    full = _EXPONENTS.get(key)
    if full is None or full.size < n_slots:
        full = np.empty(max(n_slots, n // 2), np.int64)
        x = 1
        for j in range(full.size):
            full[j] = x
            x = x * int(generator) % (2 * n)
        full.flags.writeable = False
        _EXPONENTS[key] = full
    return full[:n_slots].copy()


_EXPONENTS: dict[tuple[int, int], np.ndarray] = {}  # (N, generator) -> its first N/2 (or more) exponents


_PERMS: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def slot_permutation(n: int, generator: int) -> tuple[np.ndarray, np.ndarray]:
    """A backend's slot order against SEAL's: slot j of a backend whose slot j is
    m(omega^(generator^j)) (Lattigo: 5) is slot idx[j] of SEAL's order (3^j), conjugated where
    sign[j] = -1 (generator^j = -3^idx[j] mod 2N; the odd residues mod 2N are +-3^b).  Real
    parts are equal, imaginary parts flip sign with the conjugation.  A public permutation:
    the shares are reordered locally."""
    key = (int(n), int(generator))
    if key not in _PERMS:
        two_n, half = 2 * n, n // 2
        pos = {int(e): b for b, e in enumerate(slot_exponents(n))}
        idx, sign = np.empty(half, np.int64), np.empty(half, np.int64)
        for j, x in enumerate(slot_exponents(n, half, generator).tolist()):
            if x in pos:
                idx[j], sign[j] = pos[x], 1
            else:
                idx[j], sign[j] = pos[(two_n - x) % two_n], -1
        if np.unique(idx).size != half:
            raise ValueError(f"{generator} does not generate the slots of N = {n}")
        _PERMS[key] = (idx, sign)
    return _PERMS[key]


def _twist(n: int) -> np.ndarray:
    return np.exp(1j * np.pi * np.arange(n) / n)


def _odd_evals(a: np.ndarray) -> np.ndarray:
    """sum_i a_i omega^((2k+1) i) for k = 0..N-1 (float FFT of a float vector)."""
    n = a.shape[-1]
    return np.fft.ifft(a * _twist(n), axis=-1) * n


def canonical_decode(coeffs, n_slots: int | None = None, complex_slots: bool = False) -> np.ndarray:
    """Real slot values Re m(omega^(e_j)) of integer coefficients (exact int64 input, any size:
    split into 30-bit limbs so the FFT input is exact); with ``complex_slots`` the real parts
    then the imaginary parts (2 n_slots values)."""
    a = np.asarray(coeffs, np.int64)
    n = a.shape[-1]
    hi = (a >> np.int64(30)).astype(np.float64)
    lo = (a & np.int64((1 << 30) - 1)).astype(np.float64)
    v = _odd_evals(hi) * float(1 << 30) + _odd_evals(lo)
    e = slot_exponents(n, n_slots)
    s = v[..., (e - 1) // 2]
    return np.concatenate([s.real, s.imag], axis=-1) if complex_slots else s.real


def canonical_encode(z, n: int) -> np.ndarray:
    """Real coefficients (float) of the polynomial whose slots are z (real or complex,
    zero-padded to N/2): m_i = (2/N) sum_j Re(z_j) cos(pi e_j i / N) + Im(z_j) sin(pi e_j i / N)."""
    z = np.asarray(z)
    e = slot_exponents(n, z.shape[-1])
    full = np.zeros(n, np.complex128)  # the values at the odd powers omega^(2k+1), k = (e - 1) / 2
    full[(e - 1) // 2] = z
    return (2.0 / n) * (np.conj(_twist(n)) * np.fft.fft(full)).real


def _cos_table(n: int, c: float, fn=np.cos) -> np.ndarray:
    """round(c cos(pi t / N)) (or sin) for t in [0, 2N), symmetric rounding (entry t + N =
    -entry t).  Read-only, cached per (N, c, function): a block converts at a few scales."""
    key = (int(n), float(c), fn.__name__)
    tab = _TABLES.get(key)
    if tab is None:
        if len(_TABLES) >= 64:
            _TABLES.clear()
        tab = np.rint(c * fn(np.pi * np.arange(2 * n) / n)).astype(np.int64)
        tab.flags.writeable = False
        _TABLES[key] = tab
    return tab


_TABLES: dict[tuple[int, float, str], np.ndarray] = {}


def _wrap_product(table: np.ndarray, rows: np.ndarray, cols: np.ndarray, vec) -> np.ndarray:
    """out_r = sum_c table[(rows_r cols_c) mod 2N] vec_c mod 2^64, exact (uint64 wraps), in
    blocks: the dense integer maps of the decode (rows = slot exponents, cols = coefficient
    indices) and of the encode (the other way round)."""
    n2 = table.shape[0]
    tab = table.astype(np.uint64)
    out = np.empty(rows.shape[0], np.uint64)
    step = max(1, _CHUNK // max(1, cols.shape[0]))
    vec = np.asarray(vec, np.uint64)
    for s in range(0, rows.shape[0], step):
        idx = (rows[s:s + step, None] * cols[None, :]) % n2
        out[s:s + step] = tab[idx] @ vec
    return out


def _corr_mod64(H: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Cyclic correlation c_j = sum_b H[(j + b) mod K] X[b] mod 2^64, exact: H (signed int64)
    split into 15-bit limbs (the top one signed, below 2^15), X (uint64) into 16-bit limbs,
    each limb product by float FFT (every partial sum stays below 2^(31 + log2 K), far
    inside float64's exact range for K <= 2^14).  Batched: X (..., K) gives (..., K), H's
    spectra computed once for all rows and every row's limbs in one FFT call."""
    K = H.shape[-1]
    H = np.asarray(H, np.int64)
    top = int(np.abs(H).max()) if H.size else 0
    nl = max(1, -(-(top.bit_length() + 1) // 15))
    Hl = [(H >> np.int64(15 * k)) & np.int64((1 << 15) - 1) for k in range(nl - 1)] + [H >> np.int64(15 * (nl - 1))]
    X = np.asarray(X, np.uint64)
    # the 16-bit limbs of X that are not zero in every row (small X: its top limbs are 0)
    used = [k for k in range(4) if (X >> np.uint64(16 * k)).any()]
    out = np.zeros(X.shape, np.uint64)
    if not used:
        return out
    Xl = np.stack([((X >> np.uint64(16 * k)) & np.uint64(0xFFFF)).astype(np.float64) for k in used])
    FX = np.conj(np.fft.rfft(Xl, axis=-1))  # (limbs, ..., K/2 + 1)
    for p_, h in enumerate(Hl):
        fh = np.fft.rfft(h.astype(np.float64))
        for i, l_ in enumerate(used):
            sh = 15 * p_ + 16 * l_
            if sh >= 64:
                continue
            c = np.rint(np.fft.irfft(fh * FX[i], n=K, axis=-1)).astype(np.int64).astype(np.uint64)
            out += c << np.uint64(sh)
    return out


_GROUPS: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}


def _group(n: int, a: int) -> tuple[np.ndarray, np.ndarray]:
    """For the coefficient indices i = 2^a o (o odd): with M = 2N / 2^a, K = M / 4, the
    residues o = s 3^b mod M (s = +-1, b < K), as the two index rows 2^a (s 3^b mod M)."""
    key = (n, a)
    g = _GROUPS.get(key)
    if g is None:
        M = (2 * n) >> a
        K = M // 4
        p = np.empty(K, np.int64)
        x = 1
        for b in range(K):
            p[b] = x
            x = x * 3 % M
        g = _GROUPS[key] = ((p << a), (((M - p) % M) << a))
    return g


def _wrap_fast(table: np.ndarray, n: int, vec, n_out: int, *, encode: bool) -> np.ndarray:
    """The dense maps of `_wrap_product` in O(N log N), exactly.  decode (encode=False):
    out_j = sum_{i<N} table[(e_j i) mod 2N] vec_i for j < n_out, e_j = 3^j; encode:
    out_i = sum_{j<len(vec)} table[(i e_j) mod 2N] vec_j for i < N.  The odd residues mod
    M = 2N / 2^a are {+-3^b} (Rader): for the indices i = 2^a (+-3^b), i e_j = 2^a (+-3^(b+j)),
    so each 2-adic level a is two cyclic correlations of length K = N / 2^(a+1) over the
    powers of 3 (`_corr_mod64`); i = 0 and i = N/2 directly.  Batched: vec (..., len) gives
    (..., N) (encode) or (..., n_out) (decode), one table for all rows."""
    L = n.bit_length() - 1
    vec = np.asarray(vec, np.uint64)
    lead = vec.shape[:-1]
    tab = np.asarray(table, np.int64)
    two_n = 2 * n
    if encode:
        ns = vec.shape[-1]
        e = slot_exponents(n, ns)
        out = np.zeros(lead + (n,), np.uint64)
        out[..., 0] = (vec * tab[0:1].astype(np.uint64)).sum(axis=-1, dtype=np.uint64)  # arrays: wraps silently
        out[..., n // 2] = vec @ tab[(e * (n // 2)) % two_n].astype(np.uint64)
        for a in range(L - 1):
            K = n >> (a + 1)
            rows = _group(n, a)
            pad = -ns % K  # fold the slots mod K: y_f[b] = sum_{j = b mod K} vec_j (wrapping sums)
            yf = np.concatenate([vec, np.zeros(lead + (pad,), np.uint64)], axis=-1)
            yf = yf.reshape(lead + ((ns + pad) // K, K)).sum(axis=-2, dtype=np.uint64)
            for idx in rows:
                ok = idx < n
                c = _corr_mod64(tab[idx], yf)
                out[..., idx[ok]] = c[..., ok]
        return out
    e = slot_exponents(n, n_out)
    j = np.arange(n_out)
    out = vec[..., 0:1] * tab[0:1].astype(np.uint64)[0]
    out = out + vec[..., n // 2:n // 2 + 1] * tab[(e * (n // 2)) % two_n].astype(np.uint64)
    for a in range(L - 1):
        K = n >> (a + 1)
        for idx in _group(n, a):
            x = np.where(idx < n, vec[..., np.minimum(idx, n - 1)], np.uint64(0))
            out += _corr_mod64(tab[idx], x)[..., j % K]
    return out


# ----------------------------------------------------------------------------- the wrap
WRAP_TOP = 6  # bits of each share the wrap comparison looks at


def wrap_small(ctx, u: np.ndarray, modulus: int, lbits: int) -> np.ndarray:
    """Boolean shares of w = 1{u_0 + u_1 >= modulus} for shares u_b in [0, modulus) of a value
    u = u_0 + u_1 mod modulus that is promised to lie in [modulus/2 - modulus/4,
    modulus/2 + modulus/4] (a centred small value plus half the modulus; ``lbits`` =
    ceil(log2 modulus)).  Then u_0 + u_1 is at most 3/4 modulus (w = 0) or at least 5/4
    modulus (w = 1), so the top WRAP_TOP bits of each share decide: with t = lbits - 6,
    a_b = u_b >> t, w = 1{a_0 + a_1 >= round(modulus / 2^t)} (the dropped low bits move the
    sum by less than 2 * 2^t <= modulus / 16).  One millionaire on 8 bits instead of lbits
    (`field_to_ring` / `ring_to_field` compare whole shares: exact for any value)."""
    t = max(0, int(lbits) - WRAP_TOP)
    a = np.asarray(u, np.uint64) >> np.uint64(t)
    c = (int(modulus) + ((1 << t) >> 1)) >> t  # round(modulus / 2^t)
    K = 1 << WRAP_TOP  # a_b < 2^WRAP_TOP, c <= 2^WRAP_TOP: the inputs below are in [0, 2^(WRAP_TOP+2))
    v = a + np.uint64(K) if ctx.party == 0 else np.uint64(c + K) - a
    lt = millionaire(ctx, v, WRAP_TOP + 2)  # 1{a_0 + a_1 < c} = NOT w
    return lt ^ np.uint8(1) if ctx.party == 0 else lt


# ----------------------------------------------------------------------------- Algorithm 1
def default_flood_bits(scale_bits: float, frac: int) -> int:
    return max(0, math.floor(scale_bits) - frac - 12)


def imaginary_signs(n: int, n_slots: int, generator: int) -> np.ndarray:
    """+1 / -1 per slot j < n_slots: the sign the imaginary part of a `paired` conversion
    carries (slot j of X^(N/2) m is i^(e_j) times slot j of m, e_j = generator^j mod 2N)."""
    return np.where(slot_exponents(n, n_slots, generator) % 4 == 1, 1, -1)


def mask_ciphertext(side: CKKSSide, ct, rng: np.random.Generator, flood_bits: int | None = None,
                    frac: int = 16, imag=None) -> tuple[bytes, np.ndarray, float]:
    """Algorithm 1, server steps: switch to one prime, re-randomise, add the uniform mask r
    and the flooding e_f.  Returns (the ciphertext's bytes, this party's field share -r mod q
    (N,), the scale).  ``imag``: a second ciphertext of real slots at the same scale, added
    times X^(N/2) (its slots become the imaginary parts: two real vectors in one conversion,
    `ckks_to_shares_many`'s ``paired``)."""
    b, hc = side.backend, side.hectx
    lvl = b.level(hc, 1)
    b.mod_switch_to_inplace(hc, ct, lvl)
    scale = b.ciphertext_scale(ct)
    arr = b.ciphertext_to_numpy(ct)
    if arr.shape[:2] != (2, 1):
        raise ValueError(f"expected a 2-polynomial ciphertext at one prime, got {arr.shape}")
    q = int(hc.coeff_moduli[0])
    n = arr.shape[2]
    Q = np.uint64(q)
    ntt = b.is_ntt(ct)
    if imag is not None:
        b.mod_switch_to_inplace(hc, imag, lvl)
        if abs(b.ciphertext_scale(imag) - scale) > PAIR_SCALE_TOLERANCE * scale:
            raise ValueError(f"paired ciphertexts at different scales ({scale} and {b.ciphertext_scale(imag)})")
        other = b.ciphertext_to_numpy(_times_monomial(b, hc, imag, n // 2))  # slot j times i^(e_j)
        if other.shape != arr.shape or b.is_ntt(imag) != ntt:
            raise ValueError("paired ciphertexts of different shapes")
        arr = (arr + other) % Q
    if side.pk is not None:  # re-randomise: + Enc_pk(0) (added as residues: its scale is 1)
        z = b.encrypt_zero(hc, side.pk, lvl)
        if b.is_ntt(z) != ntt:
            (b.to_ntt_inplace if ntt else b.from_ntt_inplace)(hc, z)
        arr = (arr + b.ciphertext_to_numpy(z)) % Q
    r = uniform_mod(rng, (1, n), q)
    F = default_flood_bits(math.log2(scale), frac) if flood_bits is None else int(flood_bits)
    noise = r
    if F > 0:
        ef = rng.integers(-(1 << F), (1 << F) + 1, size=(1, n), dtype=np.int64)
        noise = (r + np.mod(ef, np.int64(q)).astype(np.uint64)) % Q
    add = b.ntt_forward(hc, noise) if ntt else noise
    arr[0] = (arr[0] + add) % Q
    masked = b.numpy_to_ciphertext(hc, arr, level=lvl, ntt=ntt, scale=scale)
    return b.ciphertext_to_bytes(masked), ((Q - r[0]) % Q), scale


def client_decrypt(side: CKKSSide, data: bytes) -> tuple[np.ndarray, float, int]:
    """Algorithm 1, client step: load (validated) and decrypt raw, no decoding.  Returns
    (m + e + e_f + r mod q (N,), the scale, q)."""
    b, hc = side.backend, side.hectx
    lvl = b.level(hc, 1)
    ct = b.ciphertext_from_bytes(hc, data, level=lvl)
    return b.decrypt_coeffs(hc, side.keys, ct)[0], b.ciphertext_scale(ct), int(hc.coeff_moduli[0])


def decode_shares(ctx, x: np.ndarray, q: int, scale, n_slots: int, *, frac: int | None = None,
                  guard: int = GUARD_BITS, complex_slots: bool = False, generator: int = 3) -> AShare:
    """Steps 3-5 of Algorithm 1: this party's Z_q share of a coefficient vector (N,) ->
    AShare over Z_{2^64} (``frac`` fraction bits) of its first ``n_slots`` real slot values
    divided by ``scale`` (with ``complex_slots``: their real parts, then their imaginary
    parts: N real values per ciphertext at n_slots = N/2).  ``generator``: the backend's slot
    order (`slot_permutation`; 3 is SEAL's): every slot is decoded in SEAL's order, then the
    shares are permuted locally.

    Batched: x of shape (m, N) (m ciphertexts' shares, ``scale`` one float or m of them) gives
    an AShare of shape (m, values); the wrap (step 3) of all m vectors is one millionaire and
    one COT batch, so m ciphertexts cost the rounds of one."""
    frac = ctx.ring.frac if frac is None else int(frac)
    x = np.asarray(x, np.uint64)
    rows = x.reshape(-1, x.shape[-1])
    m, n = rows.shape
    scales = np.broadcast_to(np.asarray(scale, np.float64).reshape(-1), (m,))
    Q = np.uint64(q)
    H = q // 2
    lq = int(q - 1).bit_length()
    sh = frac + guard
    with ctx.step("field_to_ring"):
        u = (rows + np.uint64(H)) % Q if ctx.party == 0 else rows
        w = wrap_small(ctx, u.reshape(-1), q, lq)
        W = b2a_bits(ctx, w, 64).reshape(m, n)
    slots = n // 2 if int(generator) != 3 else n_slots  # another slot order: decode all, then permute
    wraps = np.empty((m, slots * (1 + int(complex_slots))), np.uint64)
    for scale_i in np.unique(scales):  # the wrap terms of all rows at one scale in one batch
        rows_i = np.flatnonzero(scales == scale_i)
        c = q * 2.0 ** sh / scale_i
        wraps[rows_i, :slots] = _wrap_fast(_cos_table(n, c), n, W[rows_i], slots, encode=False)
        if complex_slots:
            wraps[rows_i, slots:] = _wrap_fast(_cos_table(n, c, np.sin), n, W[rows_i], slots, encode=False)
    own = u.astype(np.int64) - (np.int64(H) if ctx.party == 0 else np.int64(0))
    P = canonical_decode(own, slots, complex_slots) * (2.0 ** sh / scales)[:, None]
    loc = np.rint(P).astype(np.int64).astype(np.uint64)
    data = trunc_local_bits(ctx, loc - wraps, guard, 64)
    if int(generator) != 3:
        data = np.stack([_from_seal_order(v, n, n_slots, complex_slots, generator) for v in data])
    return AShare(ctx, data if x.ndim > 1 else data[0], 64, frac)


def _from_seal_order(v: np.ndarray, n: int, n_slots: int, complex_slots: bool, generator: int) -> np.ndarray:
    """Shares of all N/2 slots in SEAL's order (real parts, then imaginary parts with
    ``complex_slots``) -> the first ``n_slots`` in the order of ``generator`` (local)."""
    idx, sign = slot_permutation(n, generator)
    out = v[idx[:n_slots]]
    if complex_slots:
        im = v[n // 2:][idx[:n_slots]]
        out = np.concatenate([out, np.where(sign[:n_slots] < 0, np.uint64(0) - im, im)])
    return out


def batch_size(n: int) -> int:
    """Ciphertexts of ring degree n converted together by the ``*_many`` functions: one message
    of ciphertexts and one set of sub-protocol rounds per `BATCH_COEFFS` coefficients."""
    return max(1, BATCH_COEFFS // int(n))


def _peer_ciphertexts(ctx, count: int, sender: str) -> list:
    """The batched conversions' one message of ``count`` serialised ciphertexts from the peer,
    checked for its shape (each blob is validated when it is loaded; the channel hands over
    dicts only)."""
    blobs = ctx.recv().get("cts")
    if not isinstance(blobs, list) or len(blobs) != count:
        raise ValueError(f"expected a list of {count} ciphertexts from the {sender}")
    return blobs


def ckks_to_shares(ctx, ct, side: CKKSSide, *, n_slots: int | None = None, flood_bits: int | None = None,
                   guard: int = GUARD_BITS, complex_slots: bool = False) -> AShare:
    """BLB Algorithm 1.  The server passes its ciphertext (consumed: switched to one prime),
    the client None; both get an AShare (64 bits, the ring's fraction bits) of the first
    ``n_slots`` real slot values.  Promise (public, from the block's parameters): every
    coefficient of the message at the last prime q is below q/4 in absolute value
    (Delta max|y| < q/4 suffices)."""
    y = ckks_to_shares_many(ctx, [ct] if side.is_server(ctx) else None, side, 1, n_slots=n_slots,
                            flood_bits=flood_bits, guard=guard, complex_slots=complex_slots)
    return AShare(ctx, y.data[0], y.bits, y.frac)


def ckks_to_shares_many(ctx, cts, side: CKKSSide, count: int, *, n_slots: int | None = None,
                        flood_bits: int | None = None, guard: int = GUARD_BITS,
                        complex_slots: bool = False, paired: bool = False) -> AShare:
    """Algorithm 1 for ``count`` ciphertexts at once (the server passes them, the client None):
    an AShare of shape (count, values).  Each ciphertext gets its own mask and flooding as in
    `ckks_to_shares`; per `batch_size` ciphertexts the server sends one message and the wraps
    are one millionaire and one COT batch, so the rounds are those of one conversion.

    ``paired``: ``count`` ciphertexts of real slots (at one scale, `PAIR_SCALE_TOLERANCE`) travel two per
    conversion, ct_{2p} + X^(N/2) ct_{2p+1} (`mask_ciphertext`'s ``imag``: the second one's
    slots become the imaginary parts, times the public sign `imaginary_signs`), decoded with
    complex slots and split again locally: half the ciphertexts, millionaires and COTs.  The
    promise of Algorithm 1 then covers both: every coefficient of the pair below q/4, i.e.
    Delta |y| < q/8 (one bit more than for one ciphertext); the caller checks it.  The
    imaginary parts of real-slot ciphertexts (CKKS noise) add to the other ciphertext's values
    at the size of the CKKS error."""
    if paired:
        if complex_slots:
            raise ValueError("paired conversions carry real slots")
        count = int(count)
        pairs = None
        if side.is_server(ctx):
            if len(cts) != count:
                raise ValueError(f"{len(cts)} ciphertexts, {count} announced")
            pairs = [(cts[i], cts[i + 1] if i + 1 < count else None) for i in range(0, count, 2)]
        got = ckks_to_shares_many(ctx, pairs, side, (count + 1) // 2, n_slots=n_slots, flood_bits=flood_bits,
                                  guard=guard, complex_slots=True)
        k = got.data.shape[1] // 2
        signs = imaginary_signs(side.hectx.n, k, side.backend.slot_generator)
        im = np.where(signs < 0, np.uint64(0) - got.data[:, k:], got.data[:, k:])
        data = np.stack([got.data[:, :k], im], axis=1).reshape(-1, k)[:count]
        return AShare(ctx, np.ascontiguousarray(data), got.bits, got.frac)
    frac = ctx.ring.frac
    n = side.hectx.n
    n_slots = n // 2 if n_slots is None else int(n_slots)
    gen = side.backend.slot_generator
    count = int(count)
    server = side.is_server(ctx)
    if server and len(cts) != count:
        raise ValueError(f"{len(cts)} ciphertexts, {count} announced")
    q = int(side.hectx.coeff_moduli[0])
    out = []
    for lo in range(0, count, batch_size(n)):
        hi = min(count, lo + batch_size(n))
        with ctx.step("ckks2mpc"):
            if server:
                pairs = [ct if isinstance(ct, tuple) else (ct, None) for ct in cts[lo:hi]]
                masked = [mask_ciphertext(side, re, ctx.rng, flood_bits, frac, imag=im) for re, im in pairs]
                ctx.send({"cts": [mk[0] for mk in masked]})
                x, scales = np.stack([mk[1] for mk in masked]), [mk[2] for mk in masked]
            else:
                dec = [client_decrypt(side, d) for d in _peer_ciphertexts(ctx, hi - lo, "server")]
                x, scales = np.stack([d[0] for d in dec]), [d[1] for d in dec]
        out.append(decode_shares(ctx, x, q, scales, n_slots, frac=frac, guard=guard,
                                 complex_slots=complex_slots, generator=gen).data)
    data = np.concatenate(out) if out else np.zeros((0, n_slots * (1 + int(complex_slots))), np.uint64)
    return AShare(ctx, data, 64, frac)


# ----------------------------------------------------------------------------- Algorithm 2
def encode_shares(ctx, y: AShare, n: int, scale: float, primes, bits: int = 64,
                  complex_slots: bool = False, generator: int = 3, ring_to_field: str = "local") -> np.ndarray:
    """Steps 1-2 of Algorithm 2: AShare of slot values -> this party's shares (k, N) of the
    CKKS coefficient polynomial round(scale * encode(y)) modulo each prime.
    ``ring_to_field`` (`RING_TO_FIELD`): "local" encodes each share exactly over the integers
    (`encode_mod_primes`; no messages); "wrap" encodes mod 2^64 and removes the wrap by a
    millionaire and a COT per prime.  ``bits`` ("wrap" only): the coefficients are known to lie
    in (-2^(bits-1), 2^(bits-1)) (a public bound): the shares are reduced mod 2^bits locally
    and the wrap costs a millionaire on ``bits`` bits, not 64.
    ``generator``: the slot order of y (`slot_permutation`: permuted locally into SEAL's).
    Batched: y of shape (m, values) gives (m, k, N), the wraps of all m polynomials in one
    millionaire and one OT batch."""
    if ring_to_field not in RING_TO_FIELD:
        raise ValueError(f"ring_to_field must be one of {RING_TO_FIELD}, got {ring_to_field!r}")
    frac = y.frac
    data = np.asarray(y.data, np.uint64)
    Ys = data.reshape(-1, data.shape[-1])
    if ring_to_field == "local":
        res = encode_mod_primes(Ys, n, scale, frac, primes, complex_slots=complex_slots, generator=generator)
        return res if data.ndim > 1 else res[0]
    m_local = _encode_local(Ys, n, scale, frac, complex_slots, generator)
    bits = int(bits)
    mk = mask(bits)
    half = np.uint64(1 << (bits - 1))
    with ctx.step("ring_to_field"):
        u = (((m_local + half) if ctx.party == 0 else m_local) & mk).reshape(-1)
        w = wrap_small(ctx, u, 1 << bits, bits)
        Wk = b2a_mod_primes(ctx, w, primes, factors=[(1 << bits) % int(q) for q in primes])  # 2^l w
        out = []
        for q, Wq in zip(primes, Wk):
            q = int(q)
            Q = np.uint64(q)
            o = (u % Q + Q - Wq) % Q
            if ctx.party == 0:
                o = (o + Q - np.uint64((1 << (bits - 1)) % q)) % Q
            out.append(o.reshape(-1, n))
    res = np.stack(out, axis=1)  # (m, k, N)
    return res if data.ndim > 1 else res[0]


def _shl_mod(a: np.ndarray, bits: int, q: int) -> np.ndarray:
    """(a 2^bits) mod q for uint64 a < q, in steps that keep every product below 2^64."""
    step = 64 - int(q).bit_length()
    if step < 1:
        raise ValueError(f"a prime of {int(q).bit_length()} bits leaves no headroom in 64-bit words")
    Q = np.uint64(q)
    while bits > 0:
        s = min(step, bits)
        a = (a << np.uint64(s)) % Q
        bits -= s
    return a


def encode_mod_primes(Y: np.ndarray, n: int, scale: float, frac: int, primes, *,
                      complex_slots: bool = False, generator: int = 3) -> np.ndarray:
    """Algorithm 2, steps 1-2 with C.3's local change of modulus, on one party's share Y
    (uint64, the ring shares of 2^frac y): its integer encoding A Y_s mod every prime (k, N),
    Y_s = Y read as a signed integer.  No communication: when Y_0 + Y_1 = Y holds over the
    integers (all but probability |Y| / 2^64 per value) the two parties' results add up to
    A Y mod every prime, the CKKS plaintext of y.  Exact: Y_s = sum_l 2^(16 l) L_l with 16-bit
    limbs L_0..L_2 and a signed top limb L_3 (encoded as its positive and negative parts), each
    A L_l computed by the mod-2^64 encode (`_encode_local`) and exact as a signed integer
    because |A L_l| <= (max |A| + 1) 2^16 (values) < 2^62 (checked); the limbs are combined
    mod q by Horner's rule.  Batched: Y (m, values) gives (m, k, N), the five limb encodings
    of all m vectors in one `_encode_local` call."""
    Y = np.asarray(Y, np.uint64)
    c = abs(scale * 2.0 ** (1 - frac) / n)
    if (c + 1) * 2.0 ** 16 * Y.shape[-1] >= 2.0 ** 62:
        raise ValueError(f"scale 2^{math.log2(scale):.1f} at {frac} fraction bits is too large for the "
                         f"exact limb encoding; use ring_to_field='wrap'")
    top = Y.view(np.int64) >> np.int64(48)  # in [-2^15, 2^15)
    parts = np.stack([(Y >> np.uint64(16 * k)) & np.uint64(0xFFFF) for k in range(3)]
                     + [np.maximum(top, 0).astype(np.uint64), np.maximum(-top, 0).astype(np.uint64)])
    enc = _encode_local(parts, n, scale, frac, complex_slots, generator).view(np.int64)  # (5, ..., N)
    limbs = [enc[0], enc[1], enc[2], enc[3] - enc[4]]
    out = np.empty(Y.shape[:-1] + (len(primes), n), np.uint64)
    for i, q in enumerate(primes):
        q = int(q)
        Q = np.uint64(q)
        acc = np.mod(limbs[3], np.int64(q)).astype(np.uint64)
        for k in (2, 1, 0):
            acc = (_shl_mod(acc, 16, q) + np.mod(limbs[k], np.int64(q)).astype(np.uint64)) % Q
        out[..., i, :] = acc
    return out


def _encode_local(Y: np.ndarray, n: int, scale: float, frac: int, complex_slots: bool, generator: int) -> np.ndarray:
    """Step 1 of Algorithm 2 on one party's share vector: the integer inverse embedding
    sum_j A_ij Y_j mod 2^64 (N,), Y permuted from the backend's slot order into SEAL's first.
    Batched: Y (..., values) gives (..., N)."""
    Y = np.asarray(Y, np.uint64)
    lead = Y.shape[:-1]
    if int(generator) != 3:
        idx, sign = slot_permutation(n, generator)
        m = Y.shape[-1] // 2 if complex_slots else Y.shape[-1]
        re = np.zeros(lead + (n // 2,), np.uint64)
        re[..., idx[:m]] = Y[..., :m]
        if complex_slots:
            im = np.zeros(lead + (n // 2,), np.uint64)
            im[..., idx[:m]] = np.where(sign[:m] < 0, np.uint64(0) - Y[..., m:], Y[..., m:])
            re = np.concatenate([re, im], axis=-1)
        Y = re
    c = scale * 2.0 ** (1 - frac) / n
    if complex_slots:  # real parts, then imaginary parts
        if Y.shape[-1] % 2:
            raise ValueError("complex slots take an even count: the real parts, then the imaginary parts")
        h = Y.shape[-1] // 2
        return (_wrap_fast(_cos_table(n, c), n, Y[..., :h], None, encode=True)
                + _wrap_fast(_cos_table(n, c, np.sin), n, Y[..., h:], None, encode=True))
    return _wrap_fast(_cos_table(n, c), n, Y, None, encode=True)


def shares_to_ckks(ctx, y: AShare, side: CKKSSide, *, n_primes: int | None = None, scale_bits: float = 50,
                   value_bits: int | None = None, complex_slots: bool = False, scale: float | None = None,
                   ring_to_field: str = "local"):
    """BLB Algorithm 2.  Both parties pass their AShare of at most N/2 real slot values; the
    server gets a CKKS ciphertext (scale 2^scale_bits, ``n_primes`` primes, default the first
    data level) of them, the client None.  ``ring_to_field``: `RING_TO_FIELD` ("local": no
    messages but the encryption; "wrap": exact).  ``value_bits`` ("wrap" only): a public bound
    |y| < 2^value_bits (then every coefficient is below 2^(scale_bits + value_bits) (one bit
    more with complex slots) and the wrap reduces mod 2^(scale_bits + value_bits + 2 (+1))).
    ``complex_slots``: y holds the real parts then the imaginary parts (up to N values).
    ``scale``: the exact scale (a float, e.g. another ciphertext's Delta^2 / q to add to);
    overrides ``scale_bits``."""
    data = np.asarray(y.data, np.uint64).reshape(1, -1)
    cts = shares_to_ckks_many(ctx, AShare(ctx, data, y.bits, y.frac), side, n_primes=n_primes,
                              scale_bits=scale_bits, value_bits=value_bits, complex_slots=complex_slots,
                              scale=scale, ring_to_field=ring_to_field)
    return cts[0] if cts is not None else None


def shares_to_ckks_many(ctx, y: AShare, side: CKKSSide, *, n_primes: int | None = None, scale_bits: float = 50,
                        value_bits: int | None = None, complex_slots: bool = False,
                        scale: float | None = None, ring_to_field: str = "local", paired: bool = False,
                        conj_keys=None) -> list | None:
    """Algorithm 2 for m ciphertexts at once: y of shape (m, values), one ciphertext per row
    (the server gets the list, the client None); the arguments as `shares_to_ckks`.  Per
    `batch_size` ciphertexts the wraps are one millionaire and one OT batch and the client
    sends one message, so the rounds are those of one conversion.

    ``paired``: rows 2p and 2p + 1 travel as one ciphertext of z = a + i b (complex slots,
    encoded at half the scale; b times the public `imaginary_signs`), and the server splits it
    with one conjugation (``conj_keys``: a key set with the conjugation key): z + conj(z) = 2a,
    (z - conj(z)) X^(3N/2) = 2b (the monomial multiplies slot j by i^(3 e_j)), each read at
    twice the encoding's scale.  Half the client's ciphertexts, for one key switch per pair on
    the server; no level is used."""
    if paired:
        return _shares_to_ckks_paired(ctx, y, side, n_primes=n_primes, scale_bits=scale_bits, scale=scale,
                                      ring_to_field=ring_to_field, conj_keys=conj_keys)
    b, hc = side.backend, side.hectx
    n = hc.n
    rows = np.asarray(y.data, np.uint64)
    if rows.ndim != 2:
        raise ValueError(f"expected (ciphertexts, values) shares, got shape {rows.shape}")
    if rows.shape[1] > (n if complex_slots else n // 2):
        raise ValueError(f"{rows.shape[1]} values do not fit the {n // 2} slots")
    k = len(hc.coeff_moduli) if n_primes is None else int(n_primes)
    lvl = b.level(hc, k)
    primes = hc.coeff_moduli[:k]
    scale = float(2.0 ** scale_bits) if scale is None else float(scale)
    sb = math.ceil(math.log2(scale))
    bits = 64 if value_bits is None else min(64, sb + int(value_bits) + 2 + int(complex_slots))
    server = side.is_server(ctx)
    cts = []
    for lo in range(0, rows.shape[0], batch_size(n)):
        part = AShare(ctx, rows[lo:lo + batch_size(n)], y.bits, y.frac)
        shares = encode_shares(ctx, part, n, scale, primes, bits, complex_slots, b.slot_generator, ring_to_field)
        with ctx.step("mpc2ckks"):
            pts = [b.plaintext_from_coeffs(hc, sh, level=lvl, scale=scale) for sh in shares]
            if not server:
                ctx.send({"cts": [side.keys.encrypt_seeded(pt) for pt in pts]})
                continue
            for data, pt in zip(_peer_ciphertexts(ctx, len(pts), "client"), pts):
                ct = b.ciphertext_from_bytes(hc, data, level=lvl)
                b.add_plain_inplace(hc, ct, pt)
                cts.append(ct)
    return cts if server else None


def _times_monomial(b: HEBackend, hc, ct, power: int):
    """A CKKS ciphertext times X^power (negacyclic: no key, no level, no noise growth), a new
    ciphertext at the same level and scale.  X^power multiplies slot j by zeta^(power e_j),
    zeta = exp(i pi / N): X^(N/2) by i^(e_j), X^(3N/2) by i^(3 e_j)."""
    arr = b.ciphertext_to_numpy(ct)  # (2, k, N)
    ntt = b.is_ntt(ct)
    n = arr.shape[2]
    Qs = np.asarray(hc.coeff_moduli[:arr.shape[1]], np.uint64)[:, None]
    out = np.empty_like(arr)
    for c in range(arr.shape[0]):
        v = b.ntt_inverse(hc, arr[c]) if ntt else arr[c]
        signed = np.concatenate([v, (Qs - v) % Qs], axis=1)  # X^(j + N) = -X^j: period 2N
        v = np.ascontiguousarray(np.roll(signed, int(power) % (2 * n), axis=1)[:, :n])
        out[c] = b.ntt_forward(hc, v) if ntt else v
    return b.numpy_to_ciphertext(hc, out, ntt=ntt, scale=b.ciphertext_scale(ct))


def _shares_to_ckks_paired(ctx, y: AShare, side: CKKSSide, *, n_primes, scale_bits, scale, ring_to_field,
                           conj_keys) -> list | None:
    """`shares_to_ckks_many`'s ``paired``: rows 2p, 2p + 1 as one complex-slot ciphertext,
    split by the server (one conjugation per pair)."""
    b, hc = side.backend, side.hectx
    rows = np.asarray(y.data, np.uint64)
    if rows.ndim != 2:
        raise ValueError(f"expected (ciphertexts, values) shares, got shape {rows.shape}")
    m, v = rows.shape
    if v > hc.n // 2:
        raise ValueError(f"{v} values do not fit the {hc.n // 2} slots")
    server = side.is_server(ctx)
    if server and conj_keys is None:
        raise ValueError("paired conversions need the server's conjugation key")
    if m % 2:
        rows = np.concatenate([rows, np.zeros((1, v), np.uint64)])
    signs = imaginary_signs(hc.n, v, b.slot_generator)
    im = rows[1::2]
    im = np.where(signs < 0, np.uint64(0) - im, im)
    z = np.concatenate([rows[0::2], im], axis=1)  # real parts, then imaginary parts
    full = float(2.0 ** scale_bits) if scale is None else float(scale)
    got = shares_to_ckks_many(ctx, AShare(ctx, z, y.bits, y.frac), side, n_primes=n_primes, scale=full / 2,
                              complex_slots=True, ring_to_field=ring_to_field)
    if not server:
        return None
    out = []
    turn = 3 * hc.n // 2
    for ct in got:
        zc = b.conjugate(hc, ct, conj_keys)
        im = _times_monomial(b, hc, ct, turn)
        b.sub_inplace(hc, im, _times_monomial(b, hc, zc, turn))  # (z - conj z) X^(3N/2) = 2b
        b.add_inplace(hc, ct, zc)  # 2a
        for part in (ct, im):  # at half the scale: read at the full one
            b.scale_message_inplace(hc, part, 2.0)
            out.append(part)
    return out[:m]
