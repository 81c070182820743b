"""PackLWEs (Chen, Dai, Kim, Song, ACNS 2021, Algorithms 1-2) on SEAL BFV ciphertexts.

FastQuery (``fastquery_002`` section 2.3, "PackLWEs optimization", and Table 6's
last row) packs the n useful output coefficients of n RLWE ciphertexts (one per
packed table column) into ceil(n / N) ciphertexts.  Input: RLWE ciphertexts
whose *constant* coefficient carries the value (the other coefficients are
garbage).  With n = 2^l (zero-padded):

    PackLWEs(ct_0..ct_{2^l-1}):
        l = 0: return ct_0
        ct_e = PackLWEs(ct_0, ct_2, ...),  ct_o = PackLWEs(ct_1, ct_3, ...)
        return (ct_e + X^{N/2^l} ct_o) + tau_{2^l+1}(ct_e - X^{N/2^l} ct_o)

followed by the field trace ct <- ct + tau_{2^k+1}(ct) for k = log2 N .. l+1,
which zeroes every coefficient that is not a multiple of N/n.  The result holds
N * m_j at coefficient j N/n.  The caller removes the factor N exactly by
pre-multiplying the inputs by N^-1 mod Q (an odd Q is invertible; the plaintext
modulus 2^13 is not, so the factor cannot be removed in the plaintext space).

tau_g: X -> X^g is SEAL's ``Evaluator.apply_galois`` with the client's Galois
keys for the elements 2^k + 1, k = 1..log2 N (`galois_elements`).  SEAL
requires BFV ciphertexts in coefficient (non-NTT) form for key switching.
Cost: n - 1 + log2(N/n) automorphisms (key switches) and n - 1 monomial
products.
"""

from __future__ import annotations

import numpy as np
import tenseal.sealapi as seal

from . import serialize
from .errors import HEError

__all__ = ["galois_elements", "pack_lwes", "pack_lwes_stream", "bitrev", "monomial"]


def galois_elements(n: int) -> list[int]:
    """The automorphism indices PackLWEs and the trace need: 2^k + 1, k = 1..log2 N."""
    logn = int(n).bit_length() - 1
    return [(1 << k) + 1 for k in range(1, logn + 1)]


_MONO: dict[tuple[int, int], seal.Plaintext] = {}


def monomial(hectx, d: int) -> seal.Plaintext:
    """The plaintext X^d (coefficient form)."""
    key = (id(hectx), d)
    pt = _MONO.get(key)
    if pt is None:
        m = np.zeros(hectx.n, np.uint64)
        m[d] = 1
        pt = serialize.numpy_to_plaintext(hectx, m)
        _MONO[key] = pt
    return pt


def _combine(hectx, gk, ev, ce, co, level: int):
    n = hectx.n
    g = (1 << level) + 1
    if co is None:
        if ce is None:
            return None
        # ct_e + tau(ct_e)
        tmp = seal.Ciphertext()
        ev.apply_galois(ce, g, gk, tmp)
        out = seal.Ciphertext()
        ev.add(ce, tmp, out)
        return out
    shifted = seal.Ciphertext()
    ev.multiply_plain(co, monomial(hectx, n >> level), shifted)
    if ce is None:
        # X^k ct_o + tau(-X^k ct_o)
        neg = seal.Ciphertext()
        ev.negate(shifted, neg)
        tmp = seal.Ciphertext()
        ev.apply_galois(neg, g, gk, tmp)
        out = seal.Ciphertext()
        ev.add(shifted, tmp, out)
        return out
    s = seal.Ciphertext()
    d = seal.Ciphertext()
    ev.add(ce, shifted, s)
    ev.sub(ce, shifted, d)
    tmp = seal.Ciphertext()
    ev.apply_galois(d, g, gk, tmp)
    ev.add_inplace(s, tmp)
    return s


def bitrev(n_leaves: int) -> list[int]:
    """Slots in the order the PackLWEs tree consumes its leaves (bit-reversed indices):
    the recursion splits on the lowest index bit first, so leaves j and j + n/2 meet
    at the bottom."""
    logn = max(0, (n_leaves - 1).bit_length())
    return [int(format(r, f"0{logn}b")[::-1], 2) if logn else 0 for r in range(1 << logn)]


def pack_lwes_stream(hectx, gk: seal.GaloisKeys, n_leaves: int, leaves) -> seal.Ciphertext:
    """PackLWEs over ``n_leaves`` (<= N) slots with leaves supplied lazily, in `bitrev`
    order (``leaves`` yields a Ciphertext or None per slot of ``bitrev(n_leaves)``), so at
    most log2 n partial results are alive at once (memory O(log n) ciphertexts).
    Same result as the recursion of CDKS Algorithm 1 followed by the field trace."""
    n = hectx.n
    if n_leaves < 1 or n_leaves > n:
        raise HEError(f"PackLWEs packs 1..{n} ciphertexts, got {n_leaves}")
    logn = max(0, (n_leaves - 1).bit_length())
    ev = hectx.evaluator
    stack: list[tuple[int, object]] = []
    count = 0
    for leaf in leaves:
        count += 1
        h, cur = 0, leaf
        while stack and stack[-1][0] == h:
            _h, ce = stack.pop()
            cur = _combine(hectx, gk, ev, ce, cur, h + 1)
            h += 1
        stack.append((h, cur))
    if count != 1 << logn or len(stack) != 1:
        raise HEError(f"PackLWEs got {count} leaves, expected {1 << logn}")
    ct = stack[0][1]
    if ct is None:
        raise HEError("PackLWEs of zero ciphertexts only")
    for k in range(int(n).bit_length() - 1, logn, -1):  # field trace Tr_{K/K_n}
        tmp = seal.Ciphertext()
        ev.apply_galois(ct, (1 << k) + 1, gk, tmp)
        ev.add_inplace(ct, tmp)
    return ct


def pack_lwes(hectx, gk: seal.GaloisKeys, cts: list) -> seal.Ciphertext:
    """Pack len(cts) <= N ciphertexts (None = an encryption of zero) into one whose
    coefficient j * N / n' holds N times the constant coefficient of cts[j]
    (n' = len(cts) rounded up to a power of two)."""
    if not cts:
        raise HEError("PackLWEs of an empty list")
    order = bitrev(len(cts))
    return pack_lwes_stream(hectx, gk, len(cts), (cts[j] if j < len(cts) else None for j in order))
