"""Elementwise products of shares by BFV batching: one RLWE ciphertext carries N
products (Cheetah, Huang et al., USENIX Security 2022, section 3 and its
``cheetah_mul``; Bumblebee, NDSS 2025, section 3.1 "HE-based multiplication").

The cross terms of x y = x0 y0 + x1 y1 + (x0 y1 + y0 x1) are sums of products
a_j b_j with every a_j held by party 0 and every b_j by party 1.  The
*encryptor* of a ciphertext encrypts its operands, the *evaluator* multiplies by
its own, masks and returns; the encryptor decrypts.  The product is symmetric, so
either party can take either role: with two or more ciphertexts' worth of
elements, party 0 encrypts the first half of the ciphertexts and party 1 the
second half, and each evaluates the other's (the two parties compute at the same
time on two cores, each half the work; uploads cross in one exchange, results
in a second).  With one ciphertext, party 0 encrypts, party 1 evaluates: one
round trip, pipelined by plaintext prime (the m BFV sessions below are
independent): party 0 sends prime i's ciphertexts as soon as they are
encrypted, party 1 evaluates prime i while party 0 encrypts prime i + 1, and
once the last upload is in it returns the primes it has finished before it
evaluates the last, which party 0 decrypts meanwhile.  Either way the bytes are
those of one direction (every ciphertext goes up once and comes back once, plus
frame headers); the exchange flow counts two flights each way in the channel's
accounting (two one-way latencies, as the parties send at the same time).

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
from ..crt import encode_scaled, rescale  # noqa: F401  (mul_he.rescale: the tests' spy point)
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
    with ctx.step("mul-he"):
        res = (_two_way if cts >= 2 else _one_way)(ctx, ses, primes, vals, bits, n, cts)
    return rescale(res[:, :n], primes, bits)


def _halves(cts: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Ciphertext ranges [lo, hi) that parties 0 and 1 encrypt (the other evaluates)."""
    split = cts - cts // 2
    return (0, split), (split, cts)


def _one_way(ctx, ses, primes, vals, bits, n, cts) -> np.ndarray:
    """One ciphertext's worth: party 0 encrypts, party 1 evaluates, pipelined by prime."""
    m = len(primes)
    if ctx.party == 0:
        uploads = _encrypt(ctx, ses, primes, vals, bits, n, 0, cts)
        head = next(uploads)
        for i, blobs in enumerate(uploads):
            ctx.send({"prime": i, "cts": blobs, **(head if i == 0 else {})})
        return _decrypt(ses, (_reply(ctx.recv(), i, cts) for i in range(m)), cts)
    head = ctx.recv()
    sent = []

    def upload(i: int) -> list:
        msg = head if i == 0 else ctx.recv()
        if not isinstance(msg, dict) or msg.get("prime") != i or not isinstance(msg.get("cts"), list):
            raise MPCError(f"HE product: expected the ciphertexts of prime {i}")
        if i == m - 1:  # the last upload is in: return what is finished (one flight)
            for k, c1, c0 in sent:
                ctx.send({"prime": k, "c1": c1, "c0": c0})
        return msg["cts"]

    out = np.zeros((m, cts * N), np.uint64)
    for i, c1, c0, share in _evaluate(ctx, head, upload, ses, primes, vals, bits, n, 0, cts):
        out[i] = share
        sent.append((i, c1, c0))
    ctx.send({"prime": m - 1, "c1": sent[-1][1], "c0": sent[-1][2]})
    return out


def _two_way(ctx, ses, primes, vals, bits, n, cts) -> np.ndarray:
    """Both parties encrypt half of the ciphertexts and evaluate the other half."""
    m = len(primes)
    mine, theirs = _halves(cts)[::1 if ctx.party == 0 else -1]
    uploads = _encrypt(ctx, ses, primes, vals, bits, n, *mine)
    head = next(uploads)
    peer = ctx.exchange({**head, "cts": [b for blobs in uploads for b in blobs]})
    blobs = peer.get("cts") if isinstance(peer, dict) else None
    if not isinstance(blobs, list) or len(blobs) % m:
        raise MPCError(f"HE product: expected ciphertexts for {m} primes")
    per = len(blobs) // m
    out = np.zeros((m, cts * N), np.uint64)
    c1s = np.zeros((m, theirs[1] - theirs[0], RESULT_PRIMES, N), np.uint64)
    c0s = np.zeros_like(c1s)
    for i, c1, c0, share in _evaluate(ctx, peer, lambda i: blobs[i * per:(i + 1) * per], ses, primes, vals, bits,
                                      n, *theirs):
        c1s[i], c0s[i] = c1, c0
        out[i, theirs[0] * N:theirs[1] * N] = share
    count = mine[1] - mine[0]
    c1, c0 = _results(ctx.exchange({"c1": c1s, "c0": c0s}), (m, count, RESULT_PRIMES, N))
    out[:, mine[0] * N:mine[1] * N] = _decrypt(ses, zip(c1, c0), count)
    return out


def _reply(reply, i: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """One-way: the evaluator's reply for prime i, checked: (c1, c0), (count, RESULT_PRIMES, N) each."""
    if not isinstance(reply, dict) or reply.get("prime") != i:
        raise MPCError(f"HE product: expected the reply for prime {i}")
    return _results(reply, (count, RESULT_PRIMES, N))


def _results(reply, want: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The reply's (c1, c0) as uint64 arrays, each of shape ``want``, or MPCError."""
    c1, c0 = (None if not isinstance(reply, dict) or reply.get(k) is None else np.asarray(reply[k], np.uint64)
              for k in ("c1", "c0"))
    if c1 is None or c0 is None or c1.shape != want or c0.shape != want:
        raise MPCError(f"HE product reply has shapes {getattr(c1, 'shape', None)}/{getattr(c0, 'shape', None)}, "
                       f"expected {want}")
    return c1, c0


class _UploadCache:
    """This party's encrypted operands (as encryptor) that the peer still holds, least
    recently used first.

    The encryptor keys an operand by (ring bits, primes, a hash of its share); a repeated
    operand (x in x^2 and then x^3 = x^2 x, the constant factor of a Newton step, ...)
    is sent as a reference instead of ciphertexts.  The encryptor alone decides: it names
    the ids to store and to drop in each message, so the evaluator's store follows
    without a policy of its own.  What the evaluator learns, that the encryptor
    multiplies the same share array again, follows from the public program (shares of different values are
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


def _key(a: np.ndarray, bits: int, m: int, lo: int):
    return bits, m, lo, a.size, hashlib.blake2b(np.ascontiguousarray(a).view(np.uint8), digest_size=32).digest()


def _encrypt(ctx, ses, primes, vals, bits, n, lo: int, hi: int):
    """Encryptor: a generator that yields first the operand references ({"ops", "drop"},
    `_UploadCache`) and then, per prime, the seeded ciphertexts [lo, hi) of this call's
    new operands (encrypted as the caller asks for them)."""
    m, count = len(primes), hi - lo
    cache = getattr(ctx, "_he_mul_uploads", None)
    if cache is None:
        cache = ctx._he_mul_uploads = _UploadCache()
    ops, drops, encoded = [], [], []
    part = [(a & mask(bits))[lo * N:hi * N] for a in vals]
    keys = [_key(a, bits, m, lo) for a in part]
    for a, key in zip(part, keys):
        hit = cache.lookup(key)
        if hit is not None:
            ops.append([hit[0], 0])
            continue
        oid, drop = cache.add(key, m * count, keep=keys)
        drops += drop
        ops.append([oid, 1])
        enc = np.zeros((m, count * N), np.uint64)
        enc[:, :a.size] = encode_scaled(a, primes, bits)
        encoded.append(enc)
    yield {"ops": ops, "drop": drops}
    for i, s in enumerate(ses):
        yield [s.keys.encrypt_seeded(s.backend.encode_slots(s.he, enc[i, c * N:(c + 1) * N]))
               for enc in encoded for c in range(count)]


def _decrypt(ses, replies, count: int) -> np.ndarray:
    """Encryptor: the decrypted slots (m, count N) of the checked replies, prime by prime."""
    allpos = np.arange(N)
    out = np.zeros((len(ses), count * N), np.uint64)
    for i, (s, (c1, c0)) in enumerate(zip(ses, replies)):
        for c in range(count):
            coeffs = s.decrypt_compact(c1[c], c0[c], allpos)
            out[i, c * N:(c + 1) * N] = s.backend.decode_slots(s.he, coeffs)
    return out


def _evaluate(ctx, head, upload, ses, primes, vals, bits, n, lo: int, hi: int):
    """Evaluator of ciphertexts [lo, hi): ``head`` carries the operand references,
    ``upload(i)`` returns prime i's blobs (called in prime order, each right before that
    prime is evaluated); yields (i, c1s, c0s, this party's share) per prime."""
    m, terms, count = len(primes), len(vals), hi - lo
    store, refs = _operand_refs(ctx, head, terms)
    signed = [to_signed(v[lo * N:min(hi * N, n)] & mask(bits), bits) for v in vals]
    for i, s in enumerate(ses):
        inputs = _operands_at(upload(i), store, refs, ses, i, m, count, terms)
        yield (i, *_evaluate_prime(s, inputs, signed, primes[i], count, terms))


def _operand_refs(ctx, head, terms: int) -> tuple[dict, list[tuple[int, bool]]]:
    """Evaluator: the stored-operand table and this call's references from the first
    message (drops applied), validated."""
    store = getattr(ctx, "_he_mul_store", None)
    if store is None:
        store = ctx._he_mul_store = {}
    ops, drops = (head.get(k) if isinstance(head, dict) else None for k in ("ops", "drop"))
    if not isinstance(ops, list) or not isinstance(drops, list) or len(ops) != terms:
        raise MPCError(f"HE product: expected ciphertexts and {terms} operand references")
    try:
        refs = [(int(oid), bool(new)) for oid, new in ops]
        drops = [int(d) for d in drops]
    except (TypeError, ValueError) as e:
        raise MPCError(f"HE product: malformed operand references ({e})") from None
    for d in drops:
        store.pop(d, None)
    return store, refs


def _operands_at(blobs: list, store: dict, refs, ses, i: int, m: int, cts: int, terms: int) -> list:
    """Evaluator: the encrypted operands of this call at prime ``i`` (per operand a list
    over ciphertexts): the new ones' prime-i ciphertexts loaded from ``blobs`` and
    stored, the others from the store."""
    new = sum(1 for _, is_new in refs if is_new)
    if len(blobs) != new * cts:
        raise MPCError(f"HE product: expected {new * cts} ciphertexts for prime {i}, got {len(blobs)}")
    it = iter(blobs)
    out = []
    for oid, is_new in refs:
        if is_new:
            if i == 0:
                if oid in store:
                    raise MPCError(f"HE product: operand {oid} sent twice")
                store[oid] = (m, cts, [None] * m)
            store[oid][2][i] = [ses[i].load_input(bytes(next(it))) for _ in range(cts)]
        got = store.get(oid)
        if got is None or got[0] != m or got[1] != cts or got[2][i] is None:
            raise MPCError(f"HE product: no stored operand {oid} for {m} primes x {cts} ciphertexts")
        out.append(got[2][i])
    if i == 0 and sum(e[0] * e[1] for e in store.values()) > MAX_CACHED_CTS + terms * m * cts:
        raise MPCError("HE product: the peer keeps more stored operands than the protocol allows")
    return out


def _evaluate_prime(s, inputs, signed, t: int, count: int, terms: int):
    """Evaluator, one prime: the products of ``count`` ciphertexts, masked, re-randomised,
    flooded and switched down: (c1s, c0s (count, RESULT_PRIMES, N), this party's share)."""
    be, he = s.backend, s.he
    correct, mean = product_noise(t, terms)
    allpos = np.arange(N)
    plain = np.zeros((terms, count * N), np.uint64)
    for j, b in enumerate(signed):
        plain[j, :b.size] = np.mod(b, np.int64(t)).astype(np.uint64)
    c1s = np.zeros((count, RESULT_PRIMES, N), np.uint64)
    c0s = np.zeros_like(c1s)
    share = np.zeros(count * N, np.uint64)
    tmp = None
    for c in range(count):
        acc = None
        for j in range(terms):
            v = plain[j, c * N:(c + 1) * N]
            if not v.any():  # a zero operand adds nothing (SEAL refuses transparent results)
                continue
            pt = be.encode_slots(he, v, level=s.top, ntt=True)
            if acc is None:
                acc = be.multiply_plain(he, inputs[j][c], pt)
            else:
                tmp = be.multiply_plain(he, inputs[j][c], pt, out=tmp)
                be.add_inplace(he, acc, tmp)
        if acc is None:  # every operand zero: a fresh encryption of zero hides it the same way
            acc = s.zero_ntt()
        c1s[c], c0s[c], r = s.finish(acc, allpos, correct, flood_noise=mean)
        share[c * N:(c + 1) * N] = be.decode_slots(he, r)
    return c1s, c0s, share


def setup(ctx, exact: bool = True) -> None:
    """Create the sessions (key generation and public-key exchange) ahead of use."""
    sessions(ctx, primes_needed(64, MAX_TERMS, exact))


__all__ = ["cross_products", "bytes_estimate", "primes_needed", "plain_primes", "setup", "encode_scaled",
           "rescale", "product_noise", "N"]
