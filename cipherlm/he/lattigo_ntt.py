"""Lattigo v6's negacyclic NTT on numpy residues, bit-exact (for the raw CKKS access of the
BLB conversions, `protocols.ckks_convert`: BLB section 6, Algorithms 1-2).

Lattigo keeps CKKS ciphertexts in NTT form (``ring.NTTStandard``): for a prime q = 1 mod 2N,
g is the smallest primitive root mod q that is at least 3 (``ring.PrimitiveRoot`` starts at 3),
psi = g^((q - 1) / 2N) a primitive 2N-th root of unity, and the forward transform is the
Cooley-Tukey butterfly with the twiddles psi^brv(k) (bit-reversed), so output k is a(psi^(2 brv(k)
+ 1)).  The inverse is the Gentleman-Sande butterfly with psi^-brv(k), times N^-1.  Checked
against Lattigo itself in tests/test_blb_attention.py (a ciphertext (c0, 0) decrypts to
INTT(c0) under any key).

Arithmetic: residues below q < 2^61 in uint64; a product mod q splits one factor into 30-bit
halves, and each partial product (below 2^91) is reduced with a float64 quotient (error below
one unit) and one correction, so no 128-bit integer is needed.
"""

from __future__ import annotations

import random
from functools import lru_cache

import numpy as np

__all__ = ["mulmod", "ntt_forward", "ntt_inverse", "psi"]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37):  # deterministic below 3.3e24
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _rho(n: int) -> int:
    """A nontrivial factor of the composite n (Pollard-Brent)."""
    if n % 2 == 0:
        return 2
    rnd = random.Random(n)
    while True:
        y, c, m = rnd.randrange(1, n), rnd.randrange(1, n), 128
        g = r = q = 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(m, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = _gcd(q, n)
                k += m
            r *= 2
        if g == n:
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = _gcd(abs(x - ys), n)
        if g != n:
            return g


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _prime_factors(n: int) -> set[int]:
    out: set[int] = set()
    stack = [n]
    while stack:
        m = stack.pop()
        if m == 1:
            continue
        if _is_prime(m):
            out.add(m)
            continue
        f = _rho(m)
        stack += [f, m // f]
    return out


@lru_cache(maxsize=None)
def psi(q: int, n: int) -> int:
    """Lattigo's primitive 2N-th root of unity mod q."""
    if (q - 1) % (2 * n):
        raise ValueError(f"{q} is not 1 mod 2N = {2 * n}")
    fs = _prime_factors(q - 1)
    g = 3
    while any(pow(g, (q - 1) // f, q) == 1 for f in fs):
        g += 1
    return pow(g, (q - 1) // (2 * n), q)


def _mulmod_small(a: np.ndarray, b: np.ndarray, q: int) -> np.ndarray:
    """a * b mod q for a < q < 2^61, b < 2^31 (uint64 arrays, broadcast)."""
    k = np.floor(a.astype(np.float64) * b.astype(np.float64) / float(q)).astype(np.uint64)
    r = (a * b - k * np.uint64(q)).view(np.int64)  # exact mod 2^64; the true value is in (-2q, 2q)
    r = np.where(r < 0, r + np.int64(q), r)
    r = np.where(r < 0, r + np.int64(q), r)
    r = np.where(r >= np.int64(q), r - np.int64(q), r)
    return r.astype(np.uint64)


def mulmod(a, b, q: int) -> np.ndarray:
    """a * b mod q, elementwise, for residues below q < 2^61."""
    a = np.asarray(a, np.uint64)
    b = np.asarray(b, np.uint64)
    hi = _mulmod_small(a, b >> np.uint64(30), q)
    hi = _mulmod_small(hi, np.uint64(1 << 30), q)
    s = hi + _mulmod_small(a, b & np.uint64((1 << 30) - 1), q)
    return np.where(s >= np.uint64(q), s - np.uint64(q), s)


@lru_cache(maxsize=32)
def _tables(q: int, n: int) -> tuple[np.ndarray, np.ndarray, int]:
    p = psi(q, n)
    pinv = pow(p, q - 2, q)
    logn = n.bit_length() - 1
    brv = [int(format(k, f"0{logn}b")[::-1], 2) if logn else 0 for k in range(n)]
    fwd = np.array([pow(p, b, q) for b in brv], np.uint64)
    inv = np.array([pow(pinv, b, q) for b in brv], np.uint64)
    return fwd, inv, pow(n, q - 2, q)


def ntt_forward(coeffs, q: int) -> np.ndarray:
    """Lattigo's NTT of residues (..., N) mod q (coefficient form -> NTT form)."""
    a = np.array(coeffs, np.uint64, copy=True)
    n = a.shape[-1]
    fwd, _, _ = _tables(int(q), n)
    Q = np.uint64(q)
    lead = a.shape[:-1]
    t, m = n // 2, 1
    while m < n:
        v = a.reshape(*lead, m, 2, t)
        U = v[..., 0, :].copy()
        V = mulmod(v[..., 1, :], fwd[m:2 * m, None], q)
        s = U + V
        v[..., 0, :] = np.where(s >= Q, s - Q, s)
        v[..., 1, :] = np.where(U >= V, U - V, U + Q - V)
        t //= 2
        m *= 2
    return a


def ntt_inverse(vals, q: int) -> np.ndarray:
    """The inverse of `ntt_forward` (NTT form -> coefficient form)."""
    a = np.array(vals, np.uint64, copy=True)
    n = a.shape[-1]
    _, inv, ninv = _tables(int(q), n)
    Q = np.uint64(q)
    lead = a.shape[:-1]
    t, m = 1, n
    while m > 1:
        h = m // 2
        v = a.reshape(*lead, h, 2, t)
        U = v[..., 0, :].copy()
        V = v[..., 1, :].copy()
        s = U + V
        v[..., 0, :] = np.where(s >= Q, s - Q, s)
        v[..., 1, :] = mulmod(np.where(U >= V, U - V, U + Q - V), inv[h:2 * h, None], q)
        t *= 2
        m = h
    return mulmod(a, np.uint64(ninv), q)
