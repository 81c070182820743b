"""Every OT-based primitive against numpy on random inputs (in-process), on the
default ring (l = 64) and a narrow one; one primitive set also as two processes."""

import numpy as np
import pytest

from cipherlm.mpc.ring import RingConfig, from_signed, mask, to_signed
from cipherlm.mpc.runner import run_inprocess, run_processes
from cipherlm.mpc.shares import AShare, BShare, share_bits_input, share_input
from cipherlm.mpc.protocols import b2a, bool_ops, compare, extend, field, millionaire, mul, mux, trunc

OT = None  # Context's default: the real cipherlm.mpc.ot.OTSession
N = 2000


def _inputs(bits, n=N, seed=0, mag=None):
    rng = np.random.default_rng(seed)
    mag = mag if mag is not None else bits - 2
    X = rng.integers(-(2 ** mag), 2 ** mag, n, dtype=np.int64)
    Y = rng.integers(-(2 ** mag), 2 ** mag, n, dtype=np.int64)
    # edge values
    X[:6] = [0, -1, 1, 2 ** mag - 1, -(2 ** mag), 0]
    Y[:6] = [0, 0, 1, -(2 ** mag), 2 ** mag - 1, -1]
    return X, Y


def _xy(ctx, X, Y, bits):
    x = share_input(ctx, from_signed(X, bits) if ctx.party == 0 else None, 0, bits=bits)
    y = share_input(ctx, from_signed(Y, bits) if ctx.party == 1 else None, 1, bits=bits)
    return x, y


def _core(ctx, X, Y, bits):
    x, y = _xy(ctx, X, Y, bits)
    o = {}
    o["mul"] = mul.mul(ctx, x, y).reveal_signed()
    o["msb"] = compare.msb(ctx, x).reveal()
    o["drelu"] = compare.drelu(ctx, x).reveal()
    o["lt"] = compare.less_than(ctx, x, y).reveal()
    o["relu"] = compare.relu(ctx, x).reveal_signed()
    b = compare.msb(ctx, y)
    o["mux"] = mux.mux(ctx, b, x).reveal_signed()
    o["b2a"] = b2a.b2a(ctx, b).reveal()
    o["and"] = (compare.msb(ctx, x) & b).reveal()
    d = x - y
    o["eqz"] = BShare(ctx, millionaire.equality(ctx, d.data if ctx.party == 0 else (np.uint64(0) - d.data) & mask(bits), bits)).reveal()
    return o


@pytest.mark.parametrize("bits", [64, 37])
def test_core_primitives(bits):
    X, Y = _inputs(bits)
    Y[100:200] = X[100:200]  # some equal pairs
    a, b = run_inprocess(_core, args0=(X, Y, bits), args1=(X, Y, bits), ring=RingConfig(bits, 12), ot_factory=OT)
    wrap = lambda v: to_signed(from_signed(v, bits), bits)
    for o in (a, b):
        assert (o["mul"] == wrap(X * Y)).all()
        assert (o["msb"] == (X < 0)).all()
        assert (o["drelu"] == (X >= 0)).all()
        assert (o["lt"] == (X < Y)).all()
        assert (o["relu"] == np.maximum(X, 0)).all()
        assert (o["mux"] == np.where(Y < 0, X, 0)).all()
        assert (o["b2a"] == (Y < 0)).all()
        assert (o["and"] == ((X < 0) & (Y < 0))).all()
        assert (o["eqz"] == (X == Y)).all()


def _millionaire(ctx, A, B, bits):
    v = A if ctx.party == 0 else B
    lt, eq = millionaire.millionaire(ctx, v, bits, want_eq=True)
    return BShare(ctx, lt).reveal(), BShare(ctx, eq).reveal()


@pytest.mark.parametrize("bits", [1, 3, 4, 5, 13, 63, 64])
def test_millionaire_private_inputs(bits):
    rng = np.random.default_rng(bits)
    A = rng.integers(0, 2 ** 63, 500, dtype=np.uint64) & mask(bits)
    B = rng.integers(0, 2 ** 63, 500, dtype=np.uint64) & mask(bits)
    if bits == 64:
        A[:250] |= np.uint64(1 << 63)
    B[:50] = A[:50]
    (lt, eq), _ = run_inprocess(_millionaire, args0=(A, B, bits), args1=(A, B, bits), ot_factory=OT)
    assert (lt == (A < B)).all() and (eq == (A == B)).all()


@pytest.mark.parametrize("bits,m", [(1, 3), (5, 3), (63, 3), (64, 3), (64, 4), (13, 8), (64, 1)])
def test_comparison_leaf_kernels_against_numpy(bits, m):
    """The Rust core's digit split and leaf message tables (`millionaire._blocks`,
    `_core.cmp_leaf_msgs`) equal the numpy expressions they replace; bad arguments are refused."""
    from cipherlm import _core

    rng = np.random.default_rng(bits * 10 + m)
    v = rng.integers(0, 2 ** 63, 3000, dtype=np.uint64) | (rng.integers(0, 2, 3000, dtype=np.uint64) << np.uint64(63))
    q, N = -(-bits // m), 1 << m
    shifts = np.arange(q, dtype=np.uint64) * np.uint64(m)
    ref = (((v & mask(bits))[:, None] >> shifts) & np.uint64(N - 1)).astype(np.uint8)
    blocks = millionaire._blocks(v, bits, m)
    np.testing.assert_array_equal(blocks, ref)
    lt0, eq0 = rng.integers(0, 2, (2, 3000, q), dtype=np.uint8)
    k = np.arange(N, dtype=np.uint8)
    eq_tab = (ref[:, :, None] == k).view(np.uint8) ^ eq0[:, :, None]
    full = ((ref[:, :, None] < k).view(np.uint8) ^ lt0[:, :, None]) | (eq_tab << 1)
    for want_lt, want in ((True, full), (False, eq_tab)):
        got = np.frombuffer(_core.cmp_leaf_msgs(ref.reshape(-1), lt0.reshape(-1), eq0.reshape(-1), N, want_lt), np.uint8)
        np.testing.assert_array_equal(got, want.reshape(-1))
    if N < 256:  # a digit of N does not fit a byte at m = 8
        with pytest.raises(ValueError, match="digits must be"):
            _core.cmp_leaf_msgs(np.full(4, N, np.uint8), np.zeros(4, np.uint8), np.zeros(4, np.uint8), N, True)
    with pytest.raises(ValueError, match="shares 0 or 1"):
        _core.cmp_leaf_msgs(np.zeros(4, np.uint8), np.full(4, 2, np.uint8), np.zeros(4, np.uint8), N, True)
    with pytest.raises(ValueError, match="lt shares"):
        _core.cmp_leaf_msgs(np.zeros(4, np.uint8), np.zeros(3, np.uint8), np.zeros(4, np.uint8), N, True)
    with pytest.raises(ValueError, match="digits of 9 bits"):
        _core.digit_blocks(v.view(np.uint8), bits, 9)
    with pytest.raises(ValueError, match="bits must be in"):
        _core.digit_blocks(v.view(np.uint8), 65, m)


def _trunc(ctx, X, bits, s):
    x = share_input(ctx, from_signed(X, bits) if ctx.party == 0 else None, 0, bits=bits)
    o = {"faithful": trunc.trunc_faithful(ctx, x, s).reveal_signed(),
         "local": trunc.trunc_local(ctx, x, s).reveal_signed()}
    if bits < 64:
        o["extend"] = trunc.trunc_extend(ctx, x, s).reveal_signed()
    return o


@pytest.mark.parametrize("bits,s", [(64, 16), (64, 1), (32, 12), (20, 19)])
def test_truncation(bits, s):
    X, _ = _inputs(bits, mag=bits - 2)
    a, _ = run_inprocess(_trunc, args0=(X, bits, s), args1=(X, bits, s), ot_factory=OT)
    assert (a["faithful"] == X >> s).all()
    # local: off by at most 1 except with probability ~|x|/2^(l-1) (big error)
    d = a["local"] - (X >> s)
    ok = (d == 0) | (d == 1)
    assert ok.mean() > 0.5 and ((~ok).mean() < 0.5)
    small = np.abs(X) < 2 ** (bits - 12)
    assert ok[small].mean() > 0.99
    if bits < 64:
        d = a["extend"] - (X >> s)
        assert set(np.unique(d)) <= {0, 1}  # failure < 2^-(64-bits) per element


def _extend(ctx, X, m, n):
    x = share_input(ctx, from_signed(X, m) if ctx.party == 0 else None, 0, bits=m)
    return extend.sext(ctx, x, n).reveal_signed(), extend.zext(ctx, x, n).reveal()


@pytest.mark.parametrize("m,n", [(8, 64), (32, 64), (16, 17), (63, 64)])
def test_extension(m, n):
    X, _ = _inputs(m, mag=m - 1)
    (s, z), _ = run_inprocess(_extend, args0=(X, m, n), args1=(X, m, n), ot_factory=OT)
    assert (s == X).all()
    assert (z == from_signed(X, m)).all()


def _field(ctx, X, q):
    x = share_input(ctx, from_signed(X, 64) if ctx.party == 0 else None, 0)
    o = {"exact": field.ring_to_field(ctx, x, q), "local": field.ring_to_field(ctx, x, q, method="local")}
    o["back"] = field.field_to_ring(ctx, o["exact"], q).reveal_signed()
    x32 = share_input(ctx, from_signed(X, 24) if ctx.party == 0 else None, 0, bits=24)
    o["extend"] = field.ring_to_field(ctx, x32, q, method="extend")
    return o


@pytest.mark.parametrize("q", [65537, (1 << 59) - 55])
def test_field_ring_conversion(q):
    X, _ = _inputs(64, mag=22)
    a, b = run_inprocess(_field, args0=(X, q), args1=(X, q), ot_factory=OT)
    Xq = np.mod(X, q).astype(np.uint64)
    Q = np.uint64(q)
    for k in ("exact", "local", "extend"):
        assert (a[k] < Q).all() and (b[k] < Q).all()
        assert ((a[k] + b[k]) % Q == Xq).all(), k
    signed = np.where(Xq > q // 2, Xq.astype(np.int64) - q, Xq.astype(np.int64))
    assert (a["back"] == signed).all()


def _fixed(ctx, U, V):
    x = share_input(ctx, U if ctx.party == 0 else None, 0)
    y = share_input(ctx, V if ctx.party == 1 else None, 1)
    return mul.mul_fixed(ctx, x, y).reveal_float(), mul.mul_fixed(ctx, x, y, trunc="local").reveal_float()


def test_fixed_point_mul_error_bound():
    rng = np.random.default_rng(3)
    U, V = rng.uniform(-100, 100, N), rng.uniform(-100, 100, N)
    (ff, fl), _ = run_inprocess(_fixed, args0=(U, V), args1=(U, V), ot_factory=OT)
    f = 16
    # encoding error of each operand 2^-(f+1), times |other| (<= 100), plus one ulp of truncation
    bound = 2 * 100 * 2.0 ** -(f + 1) + 2.0 ** -(2 * f + 2) + 2.0 ** -f
    assert np.abs(ff - U * V).max() <= bound
    assert np.abs(fl - U * V).max() <= bound + 2.0 ** -f


def test_bad_shapes_raise():
    def f(ctx):
        x = share_input(ctx, np.zeros(3, np.uint64) if ctx.party == 0 else None, 0)
        y = share_input(ctx, np.zeros(4, np.uint64) if ctx.party == 0 else None, 0)
        out = []
        for fn in (lambda: mul.mul(ctx, x, y), lambda: mux.mux(ctx, compare.msb(ctx, y), x),
                   lambda: trunc.trunc_faithful(ctx, x, 64), lambda: extend.sext(ctx, x, 32)):
            try:
                fn()
                out.append("no error")
            except ValueError as e:
                out.append(str(e))
        return out

    a, b = run_inprocess(f, ot_factory=OT, timeout=30)
    assert all(m != "no error" for m in a + b), (a, b)


def test_core_two_processes():
    X, Y = _inputs(64, n=300, seed=7)
    a, b, (t0, t1) = run_processes(_core, args0=(X, Y, 64), args1=(X, Y, 64), ot_factory=OT, timeout=120, stats=True)
    assert (a["mul"] == X * Y).all() and (b["lt"] == (X < Y)).all() and (a["relu"] == np.maximum(X, 0)).all()
    assert t0["bytes_sent"] == t1["bytes_received"] and t0["bytes_received"] == t1["bytes_sent"]


def test_msb_on_the_bits_that_matter():
    """msb / drelu on x mod 2^k (mixed bit widths) give the sign of every |x| < 2^(k-1),
    with fewer bytes than on all l bits; a bad width is refused."""
    rng = np.random.default_rng(11)
    X = rng.integers(-(1 << 36), 1 << 36, 2000)
    k = compare.range_bits(2.0 ** 20, 16, 64)
    assert k == 38 and compare.range_bits(1e9, 16, 64) == 48 and compare.range_bits(1e15, 16, 64) == 64

    def f(ctx):
        x = share_input(ctx, from_signed(X, 64) if ctx.party == 0 else None, 0, frac=0)
        out = {}
        for bits in (None, k):
            ctx.chan.reset_stats()
            out[bits] = (compare.msb(ctx, x, bits).reveal(), compare.drelu(ctx, x, bits).reveal())
            t = ctx.chan.totals()
            out[(bits, "bytes")] = t["bytes_sent"] + t["bytes_received"]
        try:
            compare.msb(ctx, x, 65)
            out["bad"] = "no error"
        except ValueError as e:
            out["bad"] = str(e)
        return out

    a, _ = run_inprocess(f, ot_factory=OT, timeout=120)
    for bits in (None, k):
        assert (a[bits][0] == (X < 0)).all() and (a[bits][1] == (X >= 0)).all()
    assert a[(k, "bytes")] < 0.8 * a[(None, "bytes")]
    assert "bits must be in" in a["bad"]
