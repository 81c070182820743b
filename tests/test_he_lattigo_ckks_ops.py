"""The Lattigo backend's fhe-mode CKKS operations (issue 15 item 1; ABI 5: native/lattigo/
ckks_ops.go, bootstrap.go): ct x ct multiplication with relinearisation, rescale, add / sub,
ct x plaintext and ct x scalar, rotations, level / scale queries, Chebyshev polynomial
evaluation (Lattigo's circuits/ckks/polynomial) and CKKS bootstrapping (Lattigo's
circuits/ckks/bootstrapping: Bossuat et al., EUROCRYPT 2021, with the sparse-secret
encapsulation of eprint 2022/024), each against numpy.

Precision bounds (stated as bits: max |error| <= 2^-bits over all slots, inputs in [-1, 1]):

* leveled ops at N = 2^14, scale 2^40: >= 22 bits (products ~2^-28; rotations ~2^-24: key
  switching with a single 60-bit special prime over a 340-bit Q);
* degree-15 Chebyshev evaluation on [-8, 8] (inputs in [-8, 8]): the encrypted result matches
  numpy's evaluation of the same polynomial to >= 20 bits, and GeLU to the interpolant's own
  approximation error (computed here) + 2^-20;
* bootstrapping at the test preset (N = 2^10, 512 slots): >= 20 bits (Lattigo reports ~25.5
  on uniform [-1, 1] inputs; its test suite's floor is log2(scale) - (logN + 2) = 28 on
  average, we bound the maximum), and at the production preset N16QP1546H192H32 >= 20 bits
  (Lattigo's documented precision for it: 26.6 bits for 2^15 slots).

The bootstrapping tests use `TEST_INSECURE_PRESET` (N = 2^10, INSECURE, test only: the library
refuses it without ``allow_insecure_for_tests=True``).  The production set runs only in the
``slow`` test (deselected by default; a key set is several GB and about a minute).
"""

from __future__ import annotations

import functools
import gc
import importlib
import math
import os
import resource
import time

import numpy as np
import pytest
from _threads import run_threads

from cipherlm.he.errors import HEError
from cipherlm.he.params import check_security_logqp

N = 1 << 14
BITS = (60, 40, 40, 40, 40, 40, 40, 40, 60)  # 400 <= 438: 8 data primes (levels 0..7) + special
BITS_OPS = 22  # leveled ops (rotations: key switching with one 60-bit special prime, ~24 bits)
BITS_POLY = 20
BITS_BTP = 20


def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


@pytest.fixture(scope="module")
def mod():
    m = importlib.import_module("cipherlm.he.lattigo_backend")
    if not m.available():
        pytest.skip(f"Lattigo library {m.library_path()} not built ({m.BUILD_HINT})")
    return m


@pytest.fixture(scope="module")
def lv(mod):
    """A leveled N = 2^14 context with keys: relinearisation + a few rotations."""
    be = mod.LattigoBackend()
    ctx = be.context(mod.ckks_params("lattigo-ckks-ops-16384", N, BITS))
    keys = be.keygen(ctx)
    ev = keys.eval_keys(relin=True, steps=[1, 5, -3])
    return be, ctx, keys, ev


@pytest.fixture(scope="module")
def bt(mod):
    """The insecure test-only bootstrapping preset with its keys."""
    be = mod.LattigoBackend()
    ctx = be.bootstrappable_context(mod.TEST_INSECURE_PRESET, allow_insecure_for_tests=True)
    keys = be.keygen(ctx)
    bk = keys.bootstrapping_keys()
    ev = keys.eval_keys(relin=True)
    yield be, ctx, keys, bk, ev
    bk.close()


def _vec(seed, n, lo=-1.0, hi=1.0):
    return np.random.default_rng(seed).uniform(lo, hi, n)


def _enc(be, ctx, keys, v, level=None):
    return keys.encrypt(be.encode_slots(ctx, v, level=level))


def _dec(be, ctx, keys, ct):
    return be.decode_slots(ctx, keys.decrypt(ct))


def _bits(got, want):
    err = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
    return np.inf if err == 0 else -np.log2(err)


# ----------------------------------------------------------------------------- leveled ops
def test_mul_relin_rescale(lv):
    be, ctx, keys, ev = lv
    x, y = _vec(1, ctx.slots), _vec(2, ctx.slots)
    a, b = _enc(be, ctx, keys, x), _enc(be, ctx, keys, y)
    top = a.level
    assert top == ctx.max_level == len(BITS) - 2
    p = be.multiply(ctx, a, b, ev)
    assert p.level == top and abs(p.scale_bits - 2 * a.scale_bits) < 1e-6  # no rescale yet
    be.rescale_inplace(ctx, p)
    assert p.level == top - 1 and abs(p.scale_bits - a.scale_bits) < 0.1
    assert _bits(_dec(be, ctx, keys, p), x * y) >= BITS_OPS
    sq = be.multiply(ctx, a, a, ev)  # squaring
    be.rescale_inplace(ctx, sq)
    assert _bits(_dec(be, ctx, keys, sq), x * x) >= BITS_OPS


def test_multiply_sum_relinearises_once(lv):
    """sum_i x_i y_i by `multiply_sum` (degree-2 products summed, one relinearisation) equals
    numpy and the sum of separately relinearised products within the leveled bound, at the
    operands' lowest level; mismatched scales, unequal or empty factor lists are refused."""
    be, ctx, keys, ev = lv
    xs = [_vec(10 + i, ctx.slots) for i in range(5)]
    ys = [_vec(20 + i, ctx.slots) for i in range(5)]
    a = [_enc(be, ctx, keys, v) for v in xs]
    b = [_enc(be, ctx, keys, v) for v in ys]
    b[2] = _enc(be, ctx, keys, ys[2], level=ctx.max_level - 1)  # one factor a level lower
    want = sum(x * y for x, y in zip(xs, ys))
    for c in b:  # the same scale at both levels: the context's default
        assert abs(c.scale_bits - a[0].scale_bits) < 1e-9
    got = be.multiply_sum(ctx, a, b, ev)
    assert got.level == ctx.max_level - 1
    be.rescale_inplace(ctx, got)
    assert _bits(_dec(be, ctx, keys, got), want) >= BITS_OPS
    one = be.multiply(ctx, a[0], b[0], ev)
    be.rescale_inplace(ctx, one)
    single = be.multiply_sum(ctx, a[:1], b[:1], ev)
    be.rescale_inplace(ctx, single)
    assert _bits(_dec(be, ctx, keys, single), _dec(be, ctx, keys, one)) >= BITS_OPS
    half = be.multiply_scalar(ctx, a[1], 0.5)  # scale x 2^40: another product scale
    with pytest.raises(HEError, match="one scale"):
        be.multiply_sum(ctx, [a[0], half], b[:2], ev)
    with pytest.raises(HEError, match="as many"):
        be.multiply_sum(ctx, a[:2], b[:3], ev)
    with pytest.raises(HEError, match="at least one"):
        be.multiply_sum(ctx, [], [], ev)


def test_depth_chain_to_level_zero(lv):
    """x^(2^k) down the whole chain, then a product at level 0 is refused (bootstrap first)."""
    be, ctx, keys, ev = lv
    x = _vec(3, ctx.slots, 0.5, 1.0)
    c, want = _enc(be, ctx, keys, x), x.copy()
    while c.level > 0:
        c = be.multiply(ctx, c, c, ev)
        be.rescale_inplace(ctx, c)
        want = want * want
    assert c.level == 0
    assert _bits(_dec(be, ctx, keys, c), want) >= BITS_OPS - 5  # 7 squarings amplify the error
    with pytest.raises(HEError, match="level 0"):
        be.multiply(ctx, c, c, ev)
    with pytest.raises(HEError, match="level 0"):
        be.rescale_inplace(ctx, c)


def test_add_sub_plain_scalar(lv):
    be, ctx, keys, _ev = lv
    x, y = _vec(4, ctx.slots), _vec(5, ctx.slots)
    a, b = _enc(be, ctx, keys, x), _enc(be, ctx, keys, y)
    be.sub_inplace(ctx, a, b)
    assert _bits(_dec(be, ctx, keys, a), x - y) >= BITS_OPS
    be.add_inplace(ctx, a, b)
    assert _bits(_dec(be, ctx, keys, a), x) >= BITS_OPS
    be.sub_plain_inplace(ctx, a, be.encode_slots(ctx, y))
    assert _bits(_dec(be, ctx, keys, a), x - y) >= BITS_OPS
    # ct x plaintext (plaintext at the level's last prime's scale so a rescale restores it)
    c = _enc(be, ctx, keys, x)
    pt = be.encode_slots(ctx, y, scale_bits=40)
    m = be.multiply_plain(ctx, c, pt)
    be.rescale_inplace(ctx, m)
    assert _bits(_dec(be, ctx, keys, m), x * y) >= BITS_OPS
    # non-integer scalar: encoded at the last prime, rescale restores the scale
    s = be.multiply_scalar(ctx, c, -0.3721)
    assert s.level == c.level
    be.rescale_inplace(ctx, s)
    assert abs(s.scale_bits - c.scale_bits) < 0.1
    assert _bits(_dec(be, ctx, keys, s), -0.3721 * x) >= BITS_OPS
    # integer scalar: scale 1, no rescale needed
    i3 = be.multiply_scalar(ctx, c, 3)
    assert i3.level == c.level and abs(i3.scale_bits - c.scale_bits) < 1e-9
    assert _bits(_dec(be, ctx, keys, i3), 3 * x) >= BITS_OPS
    be.add_scalar_inplace(ctx, i3, 0.125)
    assert _bits(_dec(be, ctx, keys, i3), 3 * x + 0.125) >= BITS_OPS


def test_conjugation(lv):
    """`conjugate` with a set's conjugation key: every slot's complex conjugate; `has_steps`
    tells whether a set holds that key; a set without it is refused."""
    be, ctx, keys, ev = lv
    z = _vec(7, ctx.slots) + 1j * _vec(8, ctx.slots)
    c = keys.encrypt(be.encode_slots(ctx, z))
    ck = keys.galois_keys([1], conjugate=True)
    assert ck.has_steps([1], conjugate=True) and ck.has_steps([], conjugate=True)
    assert not ev.has_steps([], conjugate=True)
    got = be.decode_slots(ctx, keys.decrypt(be.conjugate(ctx, c, ck)), complex_out=True)
    assert _bits(got, np.conj(z)) >= BITS_OPS
    with pytest.raises(HEError):
        be.conjugate(ctx, c, ev)
    # seeded for the peer: the same key
    peer = be.galois_keys_from_bytes(ctx, keys.galois_keys_bytes([], conjugate=True), max_keys=1)
    assert peer.has_steps([], conjugate=True)
    assert _bits(be.decode_slots(ctx, keys.decrypt(be.conjugate(ctx, c, peer)), complex_out=True), np.conj(z)) >= BITS_OPS


def test_rotations_with_eval_keys(lv):
    be, ctx, keys, ev = lv
    x = _vec(6, ctx.slots)
    c = _enc(be, ctx, keys, x)
    for k in (1, 5, -3):
        assert _bits(_dec(be, ctx, keys, be.rotate_rows(ctx, c, k, ev)), np.roll(x, -k)) >= BITS_OPS
    assert ev.has_relin and ev.has_steps([1, 5, -3]) and not ev.has_steps([2])
    # a rotation-only set has no relinearisation key; merged with a relin-only one it does both
    rot = keys.galois_keys([2])
    assert not rot.has_relin
    with pytest.raises(HEError, match="relinearisation"):
        be.multiply(ctx, c, c, rot)
    both = rot.merged(keys.eval_keys(relin=True))
    assert both.has_relin and both.has_steps([2])
    p = be.multiply(ctx, be.rotate_rows(ctx, c, 2, both), c, both)
    be.rescale_inplace(ctx, p)
    assert _bits(_dec(be, ctx, keys, p), np.roll(x, -2) * x) >= BITS_OPS
    # keeping some of the rotations: the relinearisation key and those steps stay, the rest go
    four = both.merged(keys.galois_keys([3, 4], conjugate=True))
    kept = four.keeping([4], conjugate=True)
    assert kept.has_relin and kept.has_steps([4], conjugate=True) and not kept.has_steps([2])
    assert not kept.has_steps([3]) and not four.keeping([2]).has_steps([], conjugate=True)
    assert _bits(_dec(be, ctx, keys, be.rotate_rows(ctx, c, 4, kept)), np.roll(x, -4)) >= BITS_OPS
    with pytest.raises(HEError, match="no key for Galois element"):
        kept.keeping([2])


def test_chebyshev_gelu_degree15(mod, lv):
    be, ctx, keys, ev = lv
    a, b = -8.0, 8.0
    coeffs = mod.chebyshev_coefficients(gelu, 15, (a, b))
    grid = np.linspace(a, b, 20001)
    approx_err = float(np.max(np.abs(np.polynomial.chebyshev.chebval(grid / 8, coeffs) - gelu(grid))))
    assert approx_err < 0.05  # the degree-15 interpolant itself (measured ~0.02)
    x = _vec(7, ctx.slots, a, b)
    c = _enc(be, ctx, keys, x)
    need = be.chebyshev_levels(15, (a, b))
    assert need == 5  # 1 (change of variable) + ceil(log2(16))
    r = be.evaluate_chebyshev(ctx, c, coeffs, (a, b), ev)
    assert r.level == c.level - need
    assert abs(r.scale_bits - c.scale_bits) < 0.1
    got = _dec(be, ctx, keys, r)
    assert _bits(got, np.polynomial.chebyshev.chebval(x / 8, coeffs)) >= BITS_POLY
    assert np.max(np.abs(got - gelu(x))) <= approx_err + 2.0**-BITS_POLY
    # on [-1, 1] no change of variable: degree 7, 3 levels
    assert be.chebyshev_levels(7) == 3
    y = _vec(8, ctx.slots)
    c7 = mod.chebyshev_coefficients(np.exp, 7, (-1, 1))
    r7 = be.evaluate_chebyshev(ctx, _enc(be, ctx, keys, y), c7, (-1, 1), ev)
    assert _bits(_dec(be, ctx, keys, r7), np.polynomial.chebyshev.chebval(y, c7)) >= BITS_POLY
    assert _bits(_dec(be, ctx, keys, r7), np.exp(y)) >= 14  # degree-7 interpolant error ~2^-18


def test_ops_concurrent_threads(mod, lv):
    """ct x ct products and polynomial evaluations from 4 Python threads on one key set
    (ctypes releases the GIL; the calls share the Go evaluator): all correct."""
    be, ctx, keys, ev = lv
    coeffs = mod.chebyshev_coefficients(gelu, 15, (-8, 8))
    xs = [_vec(60 + i, ctx.slots, -8, 8) for i in range(4)]
    cts = [_enc(be, ctx, keys, x) for x in xs]

    def work(i):
        p = be.multiply(ctx, cts[i], cts[i], ev)
        be.rescale_inplace(ctx, p)
        return p, be.evaluate_chebyshev(ctx, cts[i], coeffs, (-8, 8), ev)

    res = run_threads([functools.partial(work, i) for i in range(4)])
    for x, (p, g) in zip(xs, res, strict=True):
        assert _bits(_dec(be, ctx, keys, p) / 64, x * x / 64) >= BITS_OPS - 2
        assert _bits(_dec(be, ctx, keys, g), np.polynomial.chebyshev.chebval(x / 8, coeffs)) >= BITS_POLY


def test_chebyshev_levels_match_consumption(mod, lv):
    """`chebyshev_levels` is what an evaluation really consumes (ceil(log2(d + 1)), + 1 off
    [-1, 1]), powers of two included; the result is right for each degree."""
    be, ctx, keys, ev = lv
    x = _vec(70, ctx.slots)
    for d in (1, 2, 3, 4, 7, 8, 16, 31, 32):
        c = mod.chebyshev_coefficients(np.tanh, d, (-1, 1))
        ct = _enc(be, ctx, keys, x)
        r = be.evaluate_chebyshev(ctx, ct, c, (-1, 1), ev)
        assert ct.level - r.level == be.chebyshev_levels(d) == int(d).bit_length(), d
        assert _bits(_dec(be, ctx, keys, r), np.polynomial.chebyshev.chebval(x, c)) >= BITS_POLY, d
    assert be.chebyshev_levels(16, (-8, 8)) == 6


def test_chebyshev_errors(mod, lv):
    be, ctx, keys, ev = lv
    c = _enc(be, ctx, keys, _vec(9, 8), level=3)
    coeffs = mod.chebyshev_coefficients(gelu, 15, (-8, 8))
    with pytest.raises(HEError, match="needs 5 levels"):
        be.evaluate_chebyshev(ctx, c, coeffs, (-8, 8), ev)
    c = _enc(be, ctx, keys, _vec(9, 8))
    with pytest.raises(HEError, match="relinearisation"):
        be.evaluate_chebyshev(ctx, c, coeffs, (-8, 8), keys.galois_keys([1]))
    for bad in [((-8, 8), [1.0]), ((8, -8), coeffs), ((-8, np.inf), coeffs), ((-8, 8), [0.0, np.nan, 1.0])]:
        with pytest.raises(HEError):
            be.evaluate_chebyshev(ctx, c, bad[1], bad[0], ev)
    with pytest.raises(HEError):
        be.chebyshev_levels(0)


def test_relin_key_roundtrip_and_malformed(mod, lv):
    be, ctx, keys, ev = lv
    blob = keys.relin_key_bytes()
    # N = 2^14, 8 Q primes, 1 P prime: 8 gadget rows x 2 polys x (8 + 1) rows x N words
    assert len(blob) == 8 + 8 * 8 * 2 * 9 * N
    peer = be.relin_keys_from_bytes(ctx, blob)
    assert peer.has_relin
    x, y = _vec(10, ctx.slots), _vec(11, ctx.slots)
    p = be.multiply(ctx, _enc(be, ctx, keys, x), _enc(be, ctx, keys, y), peer)
    be.rescale_inplace(ctx, p)
    assert _bits(_dec(be, ctx, keys, p), x * y) >= BITS_OPS
    assert ev.relin_key_bytes() != blob  # a fresh key each time (random)
    bad = [blob[:-1], blob + b"\0", b"", b"CLGR", b"XLGR" + blob[4:], blob[:5] + b"\1" + blob[6:],
           blob[:8] + b"\xff" * 8 + blob[16:]]  # the last: an unreduced word
    for i in range(8):  # every header byte flipped
        m = bytearray(blob)
        m[i] ^= 0xFF
        bad.append(bytes(m))
    for b in bad:
        with pytest.raises(HEError):
            be.relin_keys_from_bytes(ctx, b)
    with pytest.raises(HEError):
        be.relin_keys_from_bytes(ctx, "not bytes")


def test_bad_handles_and_contexts(mod, lv, bt):
    be, ctx, keys, ev = lv
    c = _enc(be, ctx, keys, _vec(13, 8))
    bogus = mod.LattigoCiphertext(10**12, ctx)
    for f in (lambda: be.multiply(ctx, c, bogus, ev), lambda: be.multiply_scalar(ctx, bogus, 2.5),
              lambda: be.sub_inplace(ctx, c, bogus), lambda: be.add_scalar_inplace(ctx, bogus, 1.0),
              lambda: be.evaluate_chebyshev(ctx, bogus, [0.0, 1.0], (-1, 1), ev),
              lambda: be.multiply(ctx, c, c, mod.LattigoEvalKeys(10**12, ctx)),
              lambda: be.multiply(ctx, c, c, c)):  # a ciphertext where keys belong
        with pytest.raises(HEError):
            f()
    bogus.h = 0
    with pytest.raises(HEError):
        be.multiply_scalar(ctx, c, float("nan"))
    # objects of another context
    bbe, bctx, bkeys, bk, _bev = bt
    other = _enc(bbe, bctx, bkeys, _vec(14, 8))
    with pytest.raises(HEError, match="context"):
        be.multiply(ctx, c, other, ev)
    with pytest.raises(HEError, match="context"):
        be.bootstrap(ctx, c, bk)
    with pytest.raises(HEError, match="bootstrappable"):
        keys.bootstrapping_keys()


# ----------------------------------------------------------------------------- bootstrapping
def test_presets_and_security(mod):
    be = mod.LattigoBackend()
    with pytest.raises(HEError, match="insecure"):
        be.bootstrappable_context(mod.TEST_INSECURE_PRESET)
    with pytest.raises(HEError, match="insecure"):
        be.bootstrappable_context(mod.TEST_INSECURE_PRESET, allow_insecure_for_tests=1)  # only True
    with pytest.raises(HEError, match="unknown"):
        be.bootstrappable_context("N17")
    # the production set: context only (its key set is the slow test's)
    ctx = be.bootstrappable_context("N16QP1546H192H32")
    assert ctx.n == 1 << 16 and ctx.max_level == 9 and not ctx.test_only
    assert [round(math.log2(q)) for q in ctx.q_moduli] == [60] + [40] * 9  # Lattigo: primes near 2^b
    assert 1545 < ctx.bootstrap_log_qp <= 1747  # Lattigo's "QP1546"; bound: 2^16 uniform ternary
    assert ctx.secret_hamming_weight == 192 and ctx.ephemeral_hamming_weight == 32
    assert ctx.bootstrap_slots == 1 << 15
    check_security_logqp("x", 1 << 16, 1747.0)
    with pytest.raises(HEError, match="insecure"):
        check_security_logqp("x", 1 << 16, 1747.5)
    with pytest.raises(HEError, match="insecure"):
        check_security_logqp("x", 1 << 15, 1546.0)
    with pytest.raises(HEError, match="Hamming"):
        check_security_logqp("x", 1 << 16, 1546.0, secret_hamming_weight=64)


def test_bootstrap_test_preset(bt):
    be, ctx, keys, bk, _ev = bt
    assert ctx.test_only and ctx.n == 1024 and ctx.max_level == 9
    assert bk.output_level == ctx.max_level and bk.depth > 0 and bk.n_galois_keys > 0
    x = _vec(20, ctx.slots)
    c = _enc(be, ctx, keys, x, level=0)
    assert c.level == 0
    t = time.perf_counter()
    r = be.bootstrap(ctx, c, bk)
    assert time.perf_counter() - t < 10
    assert r.level == bk.output_level > c.level
    assert abs(r.scale_bits - 40) < 1e-6
    assert _bits(_dec(be, ctx, keys, r), x) >= BITS_BTP
    # a level-0 input whose scale leaves too little room under q0: refused, not garbage
    with pytest.raises(HEError, match="Scale"):
        be.bootstrap(ctx, _enc_scaled(be, ctx, keys, x, 50), bk)


def _enc_scaled(be, ctx, keys, v, bits):
    return keys.encrypt(be.encode_slots(ctx, v, level=0, scale_bits=bits))


def test_bootstrap_after_polynomial_then_continue(mod, bt):
    """GeLU (degree 15 on [-8, 8], 5 levels) uses up the chain from level 5, bootstrap, then
    a ct x ct product."""
    be, ctx, keys, bk, ev = bt
    x = _vec(21, ctx.slots, -8, 8)
    coeffs = mod.chebyshev_coefficients(gelu, 15, (-8, 8))
    want = np.polynomial.chebyshev.chebval(x / 8, coeffs)
    g = be.evaluate_chebyshev(ctx, _enc(be, ctx, keys, x, level=5), coeffs, (-8, 8), ev)
    assert g.level == 0
    with pytest.raises(HEError, match="level 0"):
        be.multiply(ctx, g, g, ev)  # no prime left: it needs bootstrapping
    r = be.bootstrap(ctx, g, bk)
    assert r.level == ctx.max_level
    assert _bits(_dec(be, ctx, keys, r), want) >= BITS_BTP - 4  # |GeLU| <= 8 = 2^3 on [-8, 8]
    p = be.multiply(ctx, r, r, ev)
    be.rescale_inplace(ctx, p)
    assert _bits(_dec(be, ctx, keys, p), want * want) >= BITS_BTP - 9  # |y^2| <= 64


def test_bootstrap_keys_roundtrip_and_malformed(bt):
    be, ctx, keys, bk, _ev = bt
    blob = bk.to_bytes()
    assert abs(len(blob) - bk.size_bytes) < 0.01 * bk.size_bytes  # the same words as Lattigo's format
    peer = be.bootstrapping_keys_from_bytes(ctx, blob)
    try:
        x = _vec(22, ctx.slots)
        r = be.bootstrap(ctx, _enc(be, ctx, keys, x, level=0), peer)
        assert r.level == ctx.max_level and _bits(_dec(be, ctx, keys, r), x) >= BITS_BTP
    finally:
        peer.close()
    bad = [blob[:-8], blob + b"\0" * 8, b"", b"CLGB", b"CLGK" + blob[4:], blob[:5] + b"\0" + blob[6:],
           blob[:8] + b"\x00\x00\x00\x00" + blob[12:], blob[:12] + b"\xff" * 8 + blob[20:]]
    for b in bad:
        with pytest.raises(HEError):
            be.bootstrapping_keys_from_bytes(ctx, b)
    # keys of a leveled context
    lvctx = be.context(importlib.import_module("cipherlm.he.lattigo_backend").ckks_params(
        "c", 8192, (60, 40, 60)))
    with pytest.raises(HEError, match="bootstrappable"):
        be.bootstrapping_keys_from_bytes(lvctx, blob)


def test_bootstrap_concurrent_threads(bt):
    """Two threads on one key set: serialised inside (one bootstrap at a time), both correct."""
    be, ctx, keys, bk, _ev = bt
    xs = [_vec(30 + i, ctx.slots) for i in range(4)]
    cts = [_enc(be, ctx, keys, x, level=0) for x in xs]
    out = run_threads([functools.partial(be.bootstrap, ctx, ct, bk) for ct in cts])
    for x, r in zip(xs, out, strict=True):
        assert _bits(_dec(be, ctx, keys, r), x) >= BITS_BTP


def test_bootstrap_keys_close_frees(mod, bt):
    be, ctx, keys, _bk, _ev = bt
    lib = mod._load()
    gc.collect()
    before = lib.clg_live_objects()
    bk = keys.bootstrapping_keys()
    assert lib.clg_live_objects() == before + 1
    with bk:
        pass
    assert lib.clg_live_objects() == before
    with pytest.raises(HEError, match="closed"):
        be.bootstrap(ctx, _enc(be, ctx, keys, _vec(40, 8), level=0), bk)
    bk.close()  # idempotent


# ----------------------------------------------------------------------------- production set
def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB -> GB (Linux)


@pytest.mark.slow
def test_bootstrap_production_N16QP1546H192H32(mod):
    """One bootstrap at Lattigo's default N16QP1546H192H32 (2^15 slots).  Several GB: run it
    alone (`pytest -m slow -s tests/test_he_lattigo_ckks_ops.py -k production`)."""
    be = mod.LattigoBackend()
    ctx = be.bootstrappable_context("N16QP1546H192H32")
    keys = be.keygen(ctx)
    rss0 = _rss_gb()
    t = time.perf_counter()
    bk = keys.bootstrapping_keys()
    t_keygen = time.perf_counter() - t
    x = _vec(50, ctx.slots)
    c = _enc(be, ctx, keys, x, level=0)
    t = time.perf_counter()
    r = be.bootstrap(ctx, c, bk)
    t_btp = time.perf_counter() - t
    bits = _bits(_dec(be, ctx, keys, r), x)
    mean_bits = -np.log2(np.mean(np.abs(_dec(be, ctx, keys, r) - x)))
    info = {"keygen_s": round(t_keygen, 1), "bootstrap_s": round(t_btp, 1), "peak_rss_gb": round(_rss_gb(), 2),
                "rss_before_keys_gb": round(rss0, 2), "key_bytes": bk.size_bytes, "galois_keys": bk.n_galois_keys,
                "out_level": r.level, "depth": bk.depth, "min_bits": round(bits, 2), "mean_bits": round(mean_bits, 2),
                "pid": os.getpid()}
    print("\nPRODUCTION BOOTSTRAP", info)
    bk.close()
    assert r.level == ctx.max_level == 9
    assert bits >= BITS_BTP


def test_scale_message_brings_a_large_value_through_bootstrapping(bt):
    """|x| <= 30 is too large for the bootstrapping's EvalMod; read as x / 32 (scale metadata,
    no level), bootstrapped, and multiplied back by the integer 32 (no level), it survives."""
    be, ctx, keys, bk, _ev = bt
    x = _vec(23, ctx.slots, -30, 30)
    c = _enc(be, ctx, keys, x, level=0)
    be.scale_message_inplace(ctx, c, 32.0)
    assert c.level == 0 and abs(c.scale_bits - 45.0) < 1e-9
    r = be.multiply_scalar(ctx, be.bootstrap(ctx, c, bk), 32)
    assert r.level == ctx.max_level
    assert _bits(_dec(be, ctx, keys, r), x) >= BITS_BTP - 6  # 32 = 2^5 times the absolute error
    with pytest.raises(HEError, match="scale factor"):
        be.scale_message_inplace(ctx, c, 0.0)
    with pytest.raises(HEError, match="scale factor"):
        be.scale_message_inplace(ctx, c, float("nan"))
