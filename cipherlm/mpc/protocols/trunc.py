"""Truncation (right shift) of shared fixed-point values.

`trunc_faithful` (CrypTFlow2 section 5, SiRNN section 3.4 "logical/arithmetic
right shift"): exact floor(x / 2^s) for signed x.  With x_u = x + 2^(l-1)
(party 0 adds), x_u,i = 2^s u_i + lo_i:

    x_u >> s = u_0 + u_1 + c - 2^(l-s) w,
    c = 1{lo_0 + lo_1 >= 2^s}        (millionaire on s bits),
    w = 1{x_u,0 + x_u,1 >= 2^l} = lt_H XOR (eq_H AND c), with lt_H / eq_H =
        1{u_0 + u_1 >= / = 2^(l-s) [- 1]} from one millionaire on the top
        l - s bits (its eq output) and one AND,

c converted with a COT of l bits, w with a COT of s bits (only 2^(l-s) w
mod 2^l matters); finally subtract 2^(l-1-s).  Error: none.
Cost per element: millionaire(l - s) + millionaire(s) + AND + COT(l) + COT(s).

`trunc_local` (SecureML section 3.1, BLB appendix C.4): party 0 computes
x_0 >> s, party 1 computes -((-x_1) >> s); no communication.  The result is
floor(x / 2^s) + {0, 1} except with probability about |x| / 2^(l-1) (a "big"
error of about 2^(l-s)).

`trunc_extend` (BLB appendix C.4, extend-then-truncate): signed-extend x from
l to l' = l + sigma bits (SiRNN, `extend.sext`), truncate locally in
Z_{2^l'}, reduce mod 2^l.  Off by at most one, failure probability below
|x| / 2^(l'-1) = 2^-sigma relative.  Cost: one signed extension
(millionaire(l) + COT(sigma)).

`trunc_known_sign` (Cheetah section 4, known MSB): exact floor when the sign of x
is public (or |x| < 2^(l-2)): the top wrap w from the shares' MSBs with one COT
of s bits, the low carry c as above.  Cost: millionaire(s) + COT(l) + COT(s).

`trunc_one_bit_error` (Cheetah section 4, one-bit error + known MSB): the same w,
no c; floor(x / 2^s) + {0, 1} (an unbiased stochastic rounding).  Cost: one COT
of s bits.  Both take ``out_bits`` n >= l: the same truncation with the result
extended to Z_{2^n} (W needed mod 2^(n-l+s): a COT of n - l bits more).  Derivations and ranges in the two docstrings.
"""

from __future__ import annotations

import numpy as np

from ..ring import mask
from ..shares import AShare, register_kernel
from .b2a import b2a_bits
from .bool_ops import and_bits
from .compare import wrap_bits
from .millionaire import millionaire
from .extend import sext_bits

__all__ = ["trunc_local", "trunc_faithful", "trunc_extend", "trunc_known_sign", "trunc_one_bit_error"]


def _check_shift(s: int, bits: int) -> int:
    s = int(s)
    if not 0 <= s < bits:
        raise ValueError(f"shift {s} must be in 0..{bits - 1}")
    return s


def trunc_local_bits(ctx, x: np.ndarray, s: int, bits: int) -> np.ndarray:
    x = np.asarray(x, np.uint64) & mask(bits)
    sh = np.uint64(s)
    if ctx.party == 0:
        return x >> sh
    neg = (np.uint64(0) - x) & mask(bits)
    return (np.uint64(0) - (neg >> sh)) & mask(bits)


def trunc_local(ctx, x: AShare, s: int) -> AShare:
    """SecureML probabilistic local truncation by s bits (free)."""
    s = _check_shift(s, x.bits)
    return AShare(ctx, trunc_local_bits(ctx, x.data, s, x.bits), x.bits, x.frac - s)


def trunc_faithful(ctx, x: AShare, s: int) -> AShare:
    """Exact arithmetic shift floor(x / 2^s) of signed x (|x| < 2^(l-1))."""
    bits = x.bits
    s = _check_shift(s, bits)
    if s == 0:
        return x
    half = np.uint64(1 << (bits - 1))
    xs = x.data.reshape(-1)
    with ctx.step("trunc"):
        xu = (xs + half) & mask(bits) if ctx.party == 0 else xs
        lo = xu & mask(s)
        hi = xu >> np.uint64(s)
        c = wrap_bits(ctx, lo, s)
        # w = 1{hi0 + hi1 >= 2^(l-s)} XOR (c AND 1{hi0 + hi1 = 2^(l-s) - 1}): a millionaire on
        # the top l - s bits only (with its eq output) and one AND (SiRNN section 3.4)
        vh = (mask(bits - s) - hi) if ctx.party == 0 else hi
        lt_h, eq_h = millionaire(ctx, vh, bits - s, want_eq=True)
        w = lt_h ^ and_bits(ctx, eq_h, c)
        C = b2a_bits(ctx, c, bits)
        W = b2a_bits(ctx, w, s)
        out = (xu >> np.uint64(s)) + C - (W << np.uint64(bits - s))
        if ctx.party == 0:
            out = out - np.uint64(1 << (bits - 1 - s))
    return AShare(ctx, (out & mask(bits)).reshape(x.shape), bits, x.frac - s)


def trunc_extend(ctx, x: AShare, s: int, sigma: int | None = None) -> AShare:
    """BLB extend-then-truncate: sext to l + sigma bits (default up to 64), local shift, mod 2^l."""
    bits = x.bits
    s = _check_shift(s, bits)
    if bits >= 64:
        raise ValueError("extend-then-truncate needs a ring narrower than 64 bits")
    big = 64 if sigma is None else min(64, bits + int(sigma))
    with ctx.step("trunc_extend"):
        y = sext_bits(ctx, x.data.reshape(-1), bits, big)
        t = trunc_local_bits(ctx, y, s, big)
    return AShare(ctx, (t & mask(bits)).reshape(x.shape), bits, x.frac - s)


# ------------------------------------------------------------------ fewer bits (issue 14, item 3)

def _sign_arg(sign, bits: int, s: int):
    if sign is not None and sign not in (0, 1):
        raise ValueError(f"sign must be 0 (x >= 0), 1 (x < 0) or None (|x| < 2^(l-2)), got {sign!r}")
    if sign is None and not (bits >= 3 and s <= bits - 2):
        raise ValueError(f"sign=None shifts x by 2^(l-2): needs l >= 3 and s <= l - 2 (l={bits}, s={s})")
    return sign


def _wrap_known_msb(ctx, xu: np.ndarray, bits: int, s: int, m: int) -> np.ndarray:
    """This party's share mod 2^s of w + m, where w = 1{xu_0 + xu_1 >= 2^bits} and
    m = MSB(xu_0 + xu_1 mod 2^bits) is public: one COT of s bits (see trunc_known_sign)."""
    msb = (xu >> np.uint64(bits - 1)) & np.uint64(1)
    with ctx.step("wrap_msb"):
        # p = msb_0 * msb_1: party 0 sends the correlation msb_0, party 1 chooses with msb_1
        if ctx.party == 0:
            r = np.asarray(ctx.ot.send_cot(msb, s), np.uint64)
            p = np.uint64(0) - r
        else:
            p = np.asarray(ctx.ot.recv_cot(msb.astype(bool), s), np.uint64)
    if m == 0:  # w = msb_0 OR msb_1 = msb_0 + msb_1 - msb_0 msb_1
        out = msb - p
    else:       # w + 1 = (msb_0 AND msb_1) + 1
        out = p + np.uint64(1) if ctx.party == 0 else p
    return out & mask(s)


def _out_bits(out_bits, bits: int) -> int:
    n = bits if out_bits is None else int(out_bits)
    if not bits <= n <= 64:
        raise ValueError(f"out_bits must be in {bits}..64 (the input ring has {bits} bits), got {out_bits!r}")
    return n


def _trunc_msb(ctx, x: AShare, s: int, sign, exact: bool, step: str, out_bits: int) -> AShare:
    bits, n = x.bits, out_bits
    xs = x.data.reshape(-1) & mask(bits)
    off = 0 if sign is not None else 1 << (bits - 2)  # sign=None: x + 2^(l-2) has MSB 0
    m = 0 if sign is None else sign
    with ctx.step(step):
        xu = (xs + np.uint64(off)) & mask(bits) if ctx.party == 0 else xs
        # 2^(l-s) (w + m) matters mod 2^n: W mod 2^(n-l+s) (mod 2^s without the extension)
        W = _wrap_known_msb(ctx, xu, bits, n - bits + s, m)
        out = (xu >> np.uint64(s)) - (W << np.uint64(bits - s))
        if s == 0:
            pass  # a pure extension (n > l): no low carry, exact
        elif exact:
            c = wrap_bits(ctx, xu & mask(s), s)  # carry of the low s bits: millionaire(s)
            out = out + b2a_bits(ctx, c, n)
        elif ctx.party == 0:
            out = out + np.uint64(1)  # floor + 1 - c: error in {0, +1}, unbiased rounding
        if ctx.party == 0 and off:
            out = out - np.uint64(off >> s)
    return AShare(ctx, (out & mask(n)).reshape(x.shape), n, x.frac - s)


def trunc_known_sign(ctx, x: AShare, s: int, sign: int | None = 0, out_bits: int | None = None) -> AShare:
    """Exact floor(x / 2^s) when the sign (MSB) of x is public (Cheetah, Huang et al.,
    USENIX Security 2022, section 4, truncation with a known most significant bit;
    the low carry as in SiRNN section 3.4 / CrypTFlow2 section 5).

    sign = 0: the caller guarantees 0 <= x < 2^(l-1) (after ReLU, exp, a square, a
    softmax numerator); sign = 1: -2^(l-1) <= x < 0; sign = None: the sign is unknown
    but |x| < 2^(l-2) -- party 0 adds 2^(l-2), which makes the MSB 0, truncates with
    sign = 0 and subtracts 2^(l-2-s) (needs s <= l - 2).  A wrong promise gives a
    result off by a multiple of 2^(l-s) (the parties' views do not change).

    Derivation.  Shares x_0 + x_1 = X mod 2^l (X the ring value of x, unsigned);
    write x_i = 2^(l-1) msb_i + x'_i and x_i = 2^s u_i + lo_i.  As integers

        x_0 + x_1 = X + 2^l w,      w = 1{x_0 + x_1 >= 2^l},
        x_0 + x_1 = 2^(l-1) (msb_0 + msb_1 + k) + (x'_0 + x'_1 - 2^(l-1) k),
                    k = 1{x'_0 + x'_1 >= 2^(l-1)},

    so msb_0 + msb_1 + k = MSB(X) + 2 w: MSB(X) = msb_0 XOR msb_1 XOR k and w is the
    majority of (msb_0, msb_1, k).  With m = MSB(X) public, k = m XOR msb_0 XOR msb_1,
    and the majority is msb_0 where msb_0 = msb_1, and k = 1 - m where they differ:

        m = 0:  w = msb_0 OR msb_1 = msb_0 + msb_1 - msb_0 msb_1,
        m = 1:  w = msb_0 AND msb_1 = msb_0 msb_1.

    No comparison: the product msb_0 msb_1 of two private bits is one COT (party 0
    sends the correlation msb_0, party 1 chooses with msb_1).  Next,

        X = 2^s (u_0 + u_1 + c) + (lo_0 + lo_1 - 2^s c) - 2^l w,   c = 1{lo_0 + lo_1 >= 2^s},
        floor(X / 2^s) = u_0 + u_1 + c - 2^(l-s) w,

    and the signed shift is floor(x / 2^s) = floor(X / 2^s) - 2^(l-s) m.  So the output
    shares are u_i + C_i - 2^(l-s) W_i with C an arithmetic sharing of c mod 2^l (the
    millionaire on s bits of `compare.wrap_bits`, then B2A of l bits) and W one of
    w + m, needed mod 2^s only (2^(l-s) W mod 2^l): the COT carries s-bit messages.

    ``out_bits`` = n > l extends the result to Z_{2^n} in the same protocol (SiRNN
    section 3.1's extension with the known-MSB wrap instead of a millionaire): the
    output shares u_i + C_i - 2^(l-s) W_i are read mod 2^n, so W is needed mod
    2^(n-l+s) and C mod 2^n.  The only extra cost is n - l bits on the COT of W;
    s = 0 is then a pure (exact) extension.  Used after products computed in a
    narrow ring (`nonlinear.common.mulf` with a bound).

    Error: none (exact floor).  Input range: as promised by ``sign`` (above).
    Cost per element: millionaire(s) + COT(l) + COT(s), against trunc_faithful's
    millionaire(l - s) + millionaire(s) + AND + COT(l) + COT(s); with IKNP/KK13 and
    l = 64, s = 16: about 4 x (256 + 32) + 3 x (256 + 6) + (128 + 64) + (128 + 16)
    = 2274 bits (284 B), against 1109 B.
    """
    bits = x.bits
    s = _check_shift(s, bits)
    sign = _sign_arg(sign, bits, s)
    n = _out_bits(out_bits, bits)
    if s == 0 and n == bits:
        return x
    return _trunc_msb(ctx, x, s, sign, True, "trunc_known_sign", n)


def trunc_one_bit_error(ctx, x: AShare, s: int, sign: int | None = None, out_bits: int | None = None) -> AShare:
    """floor(x / 2^s) + e, e in {0, 1}: the top wrap w only, no low carry c (Cheetah,
    Huang et al., USENIX Security 2022, section 4, truncation with one-bit error
    combined with the known-MSB wrap; SiRNN section 3.4 for the decomposition).

    With the notation of `trunc_known_sign`, floor(X / 2^s) = u_0 + u_1 + c - 2^(l-s) w.
    This protocol outputs u_0 + u_1 + 1 - 2^(l-s) (w + m) (party 0 adds the 1), i.e.
    floor(x / 2^s) + 1 - c: the error 1 - c is 0 or 1.  With uniformly random shares
    c = 1{lo_0 > lo}, lo = X mod 2^s, so Pr[e = 1] = (lo + 1) / 2^s and the mean of
    the output is x / 2^s + 2^-s: a stochastic rounding, not a biased floor.  (Dropping
    c without the +1 would give floor - {0, 1}, biased by about -1/2 ulp.)

    The wrap w comes from the MSBs of the shares and a public MSB of x (one COT of s
    bits, no comparison at all):
      sign = 0 or 1: x >= 0, resp. x < 0, over the whole half range (as in
        `trunc_known_sign`);
      sign = None (default): the sign is unknown but |x| < 2^(l-2); party 0 adds
        2^(l-2) (MSB 0) and removes 2^(l-2-s) after the shift (needs s <= l - 2).
    A broken range promise gives an error of a multiple of 2^(l-s).

    ``out_bits``: the output ring, as in `trunc_known_sign` (the COT carries
    n - l + s bits).  s = 0 with n > l is an exact extension (no rounding to add).

    Error: e in {0, +1} (one ulp of the output), mean 2^-s.  Cost per element: one
    COT of s bits (IKNP: 128 + s bits; l = 64, s = 16: 144 bits = 18 B against
    trunc_faithful's 1109 B), 2 flights.  For the full range |x| < 2^(l-1) with no
    known sign there is no cheap w: use trunc_faithful (or trunc_extend).
    """
    bits = x.bits
    s = _check_shift(s, bits)
    sign = _sign_arg(sign, bits, s)
    n = _out_bits(out_bits, bits)
    if s == 0 and n == bits:
        return x
    return _trunc_msb(ctx, x, s, sign, False, "trunc_one_bit_error", n)


register_kernel("trunc_local", trunc_local)  # AShare.mul_public_fixed (cipherlm.mpc.shares)
