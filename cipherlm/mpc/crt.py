"""Scaling between Z_P (P a product of primes, values as residues) and Z_2^k, natively
(`_core.crt_encode_scaled`, `_core.crt_rescale_pow2`): Cheetah's encoding of Z_2^k inside
Z_P (SPU's `ModulusSwitchHelper`).  Used by the HE elementwise product
(`protocols.mul_he`) and by BFV decryption with t = 2^k (`he_session.HESession.decrypt_native`:
round(t c / q) mod t is `rescale` with P = q)."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from cipherlm import _core


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
