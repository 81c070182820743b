"""Elementwise products of shares by BFV batching: one RLWE ciphertext carries N
products (Cheetah, Huang et al., USENIX Security 2022, section 3 and its
``cheetah_mul``; Bumblebee, NDSS 2025, section 3.1 "HE-based multiplication").

The cross terms of x y = x0 y0 + x1 y1 + (x0 y1 + y0 x1) are sums of products
a_j b_j with every a_j held by party 0 and every b_j by party 1.  Party 0
encrypts its a_j, party 1 multiplies by its b_j, masks and returns; party 0
decrypts.  One round trip, whatever the number of terms.

Z_{2^k} inside Z_P (Cheetah section 3.1 "from Z_P to Z_{2^k}").  BFV slots hold
values mod a batching prime; a product of two k-bit values needs 2k bits, so the
computation runs modulo P = t_0 ... t_{m-1} (m BFV sessions, one per plaintext
prime t_i = 1 mod 2N, same ring, own keys).  Party 0 encodes a as round(D a) with
D = P / 2^k; party 1 lifts b to a signed integer |b| <= 2^(k-1).  Then
round(D a) b = D (a b mod 2^k) + e (mod P) with |e| <= |b| / 2 per term, because
D 2^k = P.  Party 1 adds a uniform mask R mod P (one mask per prime: a uniform
plaintext polynomial), so the parties hold c0 + c1 = D z + e (mod P), z = sum_j
a_j b_j mod 2^k.  Each party maps its share by c -> round(c 2^k / P) mod 2^k (the
native `crt_rescale_pow2`, CRT then scaling, exact big-integer arithmetic in u128).
The two roundings add to z + delta with delta = e 2^k / P - eps0 - eps1 an integer,
|eps| <= 1/2, so:

* ``exact=False``: P > 2^(2k - 1) T (T terms) keeps |e 2^k / P| < 1 and delta in
  {-1, 0, 1}: a one-unit error in the last place of the product, which the
  truncation after a fixed-point product removes.  k = 64, T = 2: three 43-bit primes
  (P > 2^128.9).
* ``exact=True``: delta != 0 needs the uniform fraction of c0 2^k / P to fall
  within |e 2^k / P| of 1/2: probability <= T 2^(2k - 1) / P <= 2^-40 with four
  43-bit primes (P > 2^171.9).

Circuit privacy (party 0 decrypts something that depends on party 1's b, a share
of a secret): party 1 re-randomises, floods FLOOD_SIGMA = 77 bits over the mean
noise and switches down to one 60-bit prime (`he_session.HESession.finish`, the
2pc mode's per-session 2^-40).  The noise of one result coefficient is
sum_j (e_j + eps_j) * b_j over T N terms: fresh encryption noise e (independent,
variance 10.5) and the encryption's rounding eps (|eps| <= 1/2, taken at its
worst), times plaintext coefficients |b| <= t / 2.  Mean bound sqrt(10.5 T N)
t / 2 + T N t / 4 = 2^55.1 at T = 2, t < 2^43: B_f = 2^133 fits below q / 2t =
2^136 at three 60-bit primes, and 2^13.6 after the switch below 2^16
(`product_noise`, checked by `finish`).  Parameters: N = 8192, coefficient
modulus 3 x 60 + 38 bits (`he_session.TWOPC_BFV`'s, 218 <= 218, the
HomomorphicEncryption.org 128-bit bound; no key switching, so no Galois keys).

Cost per element and prime: T seeded ciphertexts up (3 x 8 bytes per slot) and
one result down (c0 and c1 at one prime, 16 bytes per slot): (24 T + 16) m bytes,
192 for a product with ``exact=False`` (Gilboa over silent OT: ~650), 256 exact;
a square (T = 1) 120.  Whole ciphertexts only: n elements cost ceil(n / N) of them
(`bytes_estimate`), so `mul` picks this protocol where it sends fewer bytes.
Repeated operands travel once (`_UploadCache`): party 1 keeps party 0's encrypted
operands (up to MAX_CACHED_CTS ciphertexts, least recently used dropped first) and
party 0 sends a reference when it multiplies the same share array again, so x^2,
x^3 = x^2 x and x^4 = (x^2)^2 upload x and x^2 once each (GeLU/SiLU: 576 -> 432 bytes
per element), a Newton step's constant factor once for all steps.
"""

from __future__ import annotations

import hashlib
import math
from functools import lru_cache

import numpy as np

from cipherlm import _core

from ..context import MPCError
from ..he_session import HESession, noise_bound
from ..ring import check_bits, mask, to_signed
from ...he.backend import get_backend
from ...he.params import HEParams

#: ring degree and the plaintext primes' width (module docstring: t < 2^43 for the flooding)
N = 8192
PRIME_BITS = 43
#: 60-bit data primes and SEAL's special prime: `he_session.TWOPC_BFV`'s coefficient modulus
COEFF_BITS = (60, 60, 60, 38)
DATA_PRIMES = 3
#: primes the results are switched down to
RESULT_PRIMES = 1
MAX_TERMS = 2
#: failure exponent of ``exact=True`` (probability <= 2^-EXACT_SIGMA per element)
EXACT_SIGMA = 40
#: per-ciphertext framing overhead of a seeded blob (SEAL header + seed), bytes
SEEDED_OVERHEAD = 240
VAR_FRESH = 10.5


@lru_cache(maxsize=None)
def plain_primes(count: int) -> tuple[int, ...]:
    """The first ``count`` plaintext primes: 43-bit, = 1 mod 2N, largest first."""
    return tuple(sorted((int(p) for p in get_backend().primes(N, [PRIME_BITS] * count)), reverse=True))


def primes_needed(bits: int, terms: int, exact: bool) -> int:
    """Smallest m with P = t_0 ... t_{m-1} large enough (module docstring)."""
    need = 2 * bits - 1 + math.log2(terms) + (EXACT_SIGMA if exact else 0)
    m = 1
    while sum(math.log2(p) for p in plain_primes(m)) <= need:
        m += 1
    return m


def params_for(t: int) -> HEParams:
    return HEParams(name=f"2pc-bfv-mul-n{N}-t{t}", scheme="bfv", poly_modulus_degree=N,
                    coeff_modulus_bits=COEFF_BITS, plain_modulus=t)


def product_noise(t: int, terms: int) -> tuple[float, float]:
    """(correctness bound, mean bound) of one result coefficient's noise before flooding
    (module docstring): fresh noise times |b| <= t / 2 over ``terms`` N products, plus the
    encryption rounding (<= 1/2) at its worst."""
    rounding = terms * N * (t / 2) * 0.5
    correct = noise_bound(terms * N, t / 2) + rounding
    mean = math.sqrt(VAR_FRESH * terms * N) * (t / 2) + rounding
    return correct, mean


def sessions(ctx, count: int) -> list[HESession]:
    """This context's product sessions for the first ``count`` primes (keys exchanged at
    first use, step ``he-keys-mul``)."""
    have = getattr(ctx, "_he_mul_sessions", None)
    if have is None:
        have = ctx._he_mul_sessions = []
    primes = plain_primes(max(count, len(have)))
    if tuple(s.t for s in have) != primes[:len(have)]:
        raise MPCError("plaintext primes changed within a session")
    for t in primes[len(have):count]:
        have.append(HESession(ctx, params_for(t), step="he-keys-mul", result_primes=RESULT_PRIMES))
    return have[:count]


@lru_cache(maxsize=None)
def _scale_constants(primes: tuple[int, ...], bits: int):
    """Python big-integer constants of the native CRT kernels (`_core.crt_*`)."""
    P = math.prod(primes)
    a, b = divmod(P, 1 << bits)
    enc = ([a % t for t in primes], b)
    inv = [pow(P // t, -1, t) for t in primes]
    q = [(1 << bits) // t for t in primes]
    r = [(1 << bits) % t for t in primes]
    return enc, (inv, q, r)


def encode_scaled(a: np.ndarray, primes: tuple[int, ...], bits: int) -> np.ndarray:
    """round(P a / 2^bits) mod t_i, shape (len(primes), a.size)."""
    (a_mod, b_low), _ = _scale_constants(primes, bits)
    a = np.ascontiguousarray(a, np.uint64).reshape(-1)
    out = _core.crt_encode_scaled(a.view(np.uint8), list(primes), a_mod, b_low, bits)
    return np.frombuffer(out, np.uint64).reshape(len(primes), a.size)


def rescale(residues: np.ndarray, primes: tuple[int, ...], bits: int) -> np.ndarray:
    """round(c 2^bits / P) mod 2^bits for c in Z_P given by its residues (len(primes), n)."""
    _, (inv, q, r) = _scale_constants(primes, bits)
    res = np.ascontiguousarray(residues, np.uint64)
    out = _core.crt_rescale_pow2(res.view(np.uint8).reshape(-1), list(primes), inv, q, r, bits)
    return np.frombuffer(out, np.uint64).copy()


def bytes_estimate(n: int, bits: int = 64, terms: int = 2, exact: bool = False) -> int:
    """Bytes both ways of one call on n elements (payload + ciphertext framing)."""
    m = primes_needed(bits, terms, exact)
    cts = -(-n // N)
    up = terms * (DATA_PRIMES * 8 * N + SEEDED_OVERHEAD)
    down = 2 * RESULT_PRIMES * 8 * N
    return cts * m * (up + down)


def cross_products(ctx, ops: list[np.ndarray], bits: int, *, exact: bool) -> np.ndarray:
    """Additive shares mod 2^bits of sum_j a_j * b_j (elementwise), where party 0 passes
    ``ops`` = [a_0, a_1, ...] and party 1 ``ops`` = [b_0, b_1, ...] (same count and size,
    ring elements mod 2^bits).  ``exact=False`` allows an error of -1, 0 or +1 (module
    docstring)."""
    bits = check_bits(bits)
    terms = len(ops)
    if not 1 <= terms <= MAX_TERMS:
        raise MPCError(f"cross_products takes 1..{MAX_TERMS} terms, got {terms}")
    vals = [np.asarray(v, np.uint64).reshape(-1) for v in ops]
    n = vals[0].size
    if any(v.size != n for v in vals):
        raise MPCError("cross_products: operands of different sizes")
    if n == 0:
        return np.zeros(0, np.uint64)
    m = primes_needed(bits, terms, exact)
    primes = plain_primes(m)
    ses = sessions(ctx, m)
    cts = -(-n // N)
    padded = cts * N
    with ctx.step("mul-he"):
        if ctx.party == 0:
            res = _encryptor(ctx, ses, primes, vals, bits, n, cts, padded)
        else:
            res = _evaluator(ctx, ses, primes, vals, bits, n, cts, padded)
    return rescale(res[:, :n], primes, bits)


class _UploadCache:
    """Party 0's encrypted operands that party 1 still holds, least recently used first.

    Party 0 keys an operand by (ring bits, primes, a hash of its share); a repeated
    operand (x in x^2 and then x^3 = x^2 x, the constant factor of a Newton step, ...)
    is sent as a reference instead of ciphertexts.  Party 0 alone decides: it names the
    ids to store and to drop in each message, so party 1's store follows without a
    policy of its own.  What party 1 learns, that party 0 multiplies the same share
    array again, follows from the public program (shares of different values are
    independent uniform arrays), so the references leak nothing beyond it."""

    def __init__(self):
        self.entries: dict = {}  # key -> (id, ciphertexts)
        self.next_id = 0

    def lookup(self, key):
        hit = self.entries.pop(key, None)
        if hit is not None:
            self.entries[key] = hit  # most recent last
        return hit

    def add(self, key, size: int, keep=()) -> tuple[int, list[int]]:
        """Store a new operand of ``size`` ciphertexts: (its id, ids to drop first); the
        least recently used go first, never those in ``keep`` (this call's operands)."""
        drop = []
        for k in list(self.entries):
            if sum(c for _, c in self.entries.values()) + size <= MAX_CACHED_CTS:
                break
            if k not in keep:
                drop.append(self.entries.pop(k)[0])
        oid, self.next_id = self.next_id, self.next_id + 1
        self.entries[key] = (oid, size)
        return oid, drop


#: ciphertexts party 1 keeps for repeated operands (x 3 x 64 bits x 2 x 8192 = 393 kB each)
MAX_CACHED_CTS = 384


def _key(a: np.ndarray, bits: int, m: int):
    return bits, m, a.size, hashlib.blake2b(np.ascontiguousarray(a).view(np.uint8), digest_size=32).digest()


def _encryptor(ctx, ses, primes, vals, bits, n, cts, padded) -> np.ndarray:
    m = len(primes)
    cache = getattr(ctx, "_he_mul_uploads", None)
    if cache is None:
        cache = ctx._he_mul_uploads = _UploadCache()
    blobs, ops, drops = [], [], []
    vals = [a & mask(bits) for a in vals]
    keys = [_key(a, bits, m) for a in vals]
    for a, key in zip(vals, keys):
        hit = cache.lookup(key)
        if hit is not None:
            ops.append([hit[0], 0])
            continue
        oid, drop = cache.add(key, m * cts, keep=keys)
        drops += drop
        ops.append([oid, 1])
        enc = np.zeros((m, padded), np.uint64)
        enc[:, :n] = encode_scaled(a, primes, bits)
        for i, s in enumerate(ses):
            for c in range(cts):
                pt = s.backend.encode_slots(s.he, enc[i, c * N:(c + 1) * N])
                blobs.append(s.keys.encrypt_seeded(pt))
    ctx.send({"cts": blobs, "ops": ops, "drop": drops})
    reply = ctx.recv()
    want = (m, cts, RESULT_PRIMES, N)
    c1 = np.asarray(reply.get("c1"), np.uint64) if isinstance(reply, dict) else None
    c0 = np.asarray(reply.get("c0"), np.uint64) if isinstance(reply, dict) else None
    if c1 is None or c0 is None or c1.shape != want or c0.shape != want:
        raise MPCError(f"HE product reply has shapes {getattr(c1, 'shape', None)}/{getattr(c0, 'shape', None)}, "
                       f"expected {want}")
    allpos = np.arange(N)
    out = np.zeros((m, padded), np.uint64)
    for i, s in enumerate(ses):
        for c in range(cts):
            coeffs = s.decrypt_compact(c1[i, c], c0[i, c], allpos)
            out[i, c * N:(c + 1) * N] = s.backend.decode_slots(s.he, coeffs)
    return out


def _operands(ctx, msg, ses, m: int, cts: int, terms: int) -> list:
    """Party 1: the encrypted operands of this call (new ones loaded and stored, the others
    from the store), per operand a list over primes of lists over ciphertexts."""
    store = getattr(ctx, "_he_mul_store", None)
    if store is None:
        store = ctx._he_mul_store = {}
    blobs, ops, drops = (msg.get(k) if isinstance(msg, dict) else None for k in ("cts", "ops", "drop"))
    if not isinstance(blobs, list) or not isinstance(ops, list) or not isinstance(drops, list) or len(ops) != terms:
        raise MPCError(f"HE product: expected ciphertexts and {terms} operand references")
    try:
        refs = [(int(oid), bool(new)) for oid, new in ops]
        drops = [int(d) for d in drops]
    except (TypeError, ValueError) as e:
        raise MPCError(f"HE product: malformed operand references ({e})") from None
    new = sum(1 for _, is_new in refs if is_new)
    if len(blobs) != new * m * cts:
        raise MPCError(f"HE product: expected {new * m * cts} ciphertexts, got {len(blobs)}")
    for d in drops:
        store.pop(d, None)
    it = iter(blobs)
    out = []
    for oid, is_new in refs:
        if is_new:
            if oid in store:
                raise MPCError(f"HE product: operand {oid} sent twice")
            store[oid] = (m, cts, [[ses[i].load_input(bytes(next(it))) for _ in range(cts)] for i in range(m)])
        got = store.get(oid)
        if got is None or got[0] != m or got[1] != cts:
            raise MPCError(f"HE product: no stored operand {oid} for {m} primes x {cts} ciphertexts")
        out.append(got[2])
    if sum(e[0] * e[1] for e in store.values()) > MAX_CACHED_CTS + terms * m * cts:
        raise MPCError("HE product: the peer keeps more stored operands than the protocol allows")
    return out


def _evaluator(ctx, ses, primes, vals, bits, n, cts, padded) -> np.ndarray:
    m, terms = len(primes), len(vals)
    inputs = _operands(ctx, ctx.recv(), ses, m, cts, terms)
    signed = [to_signed(v & mask(bits), bits) for v in vals]
    allpos = np.arange(N)
    c1s = np.zeros((m, cts, RESULT_PRIMES, N), np.uint64)
    c0s = np.zeros_like(c1s)
    out = np.zeros((m, padded), np.uint64)
    for i, s in enumerate(ses):
        be, he, t = s.backend, s.he, primes[i]
        correct, mean = product_noise(t, terms)
        plain = np.zeros((terms, padded), np.uint64)
        for j, b in enumerate(signed):
            plain[j, :n] = np.mod(b, np.int64(t)).astype(np.uint64)
        tmp = None
        for c in range(cts):
            acc = None
            for j in range(terms):
                v = plain[j, c * N:(c + 1) * N]
                if not v.any():  # a zero operand adds nothing (SEAL refuses transparent results)
                    continue
                pt = be.encode_slots(he, v, level=s.top, ntt=True)
                if acc is None:
                    acc = be.multiply_plain(he, inputs[j][i][c], pt)
                else:
                    tmp = be.multiply_plain(he, inputs[j][i][c], pt, out=tmp)
                    be.add_inplace(he, acc, tmp)
            if acc is None:  # every operand zero: a fresh encryption of zero hides it the same way
                acc = s.zero_ntt()
            c1, c0, share = s.finish(acc, allpos, correct, flood_noise=mean)
            c1s[i, c], c0s[i, c] = c1, c0
            out[i, c * N:(c + 1) * N] = be.decode_slots(he, share)
    ctx.send({"c1": c1s, "c0": c0s})
    return out


def setup(ctx, exact: bool = True) -> None:
    """Create the sessions (key generation and public-key exchange) ahead of use."""
    sessions(ctx, primes_needed(64, MAX_TERMS, exact))


__all__ = ["cross_products", "bytes_estimate", "primes_needed", "plain_primes", "setup", "encode_scaled",
           "rescale", "product_noise", "N"]
