"""Ring arithmetic, fixed point, share types (local ops), share/reveal, runners' error handling."""

import numpy as np
import pytest

from cipherlm.mpc.context import MPCError
from cipherlm.mpc.ring import (RingConfig, fixed_decode, fixed_encode, from_signed, mask, mulmod_scalar, new_rng,
                               reduce, to_signed, uniform, uniform_bits)
from cipherlm.mpc.runner import PartyFailed, MPCTimeout, run_inprocess, run_processes
from cipherlm.mpc.shares import AShare, BShare, concatenate, reveal, share_bits_input, share_input, stack

OT = None  # Context's default: the real cipherlm.mpc.ot.OTSession


@pytest.mark.parametrize("bits", [1, 8, 17, 63, 64])
def test_ring_signed_roundtrip(bits):
    rng = np.random.default_rng(bits)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1)
    s = rng.integers(lo, hi, 1000, dtype=np.int64) if bits < 64 else rng.integers(-2**63, 2**63 - 1, 1000, dtype=np.int64)
    u = from_signed(s, bits)
    assert (u <= mask(bits)).all()
    assert (to_signed(u, bits) == s).all()


def test_ring_bits_validation():
    for bad in (0, 65, -1, 3.5):
        with pytest.raises(ValueError):
            RingConfig(bits=bad)
    with pytest.raises(ValueError):
        RingConfig(bits=16, frac=16)


def test_fixed_point_error():
    rng = np.random.default_rng(0)
    v = rng.uniform(-1000, 1000, 10000)
    for bits, frac in ((64, 16), (64, 12), (32, 12)):
        back = fixed_decode(fixed_encode(v, frac, bits), frac, bits)
        assert np.abs(back - v).max() <= 2.0 ** -(frac + 1) + 1e-12


def test_uniform_and_mulmod():
    rng = new_rng()
    u = uniform(rng, (4, 1000), 8)
    assert u.dtype == np.uint64 and u.max() <= 255 and u.shape == (4, 1000)
    q = (1 << 61) - 1
    a = rng.integers(0, q, 100, dtype=np.uint64)
    c = 123456789012345678
    ref = np.array([(int(x) * c) % q for x in a], dtype=np.uint64)
    assert (mulmod_scalar(a, c, q) == ref).all()
    # bits from every bit of the generator's words: 0/1, the shape asked for (a count not a
    # multiple of 64 too), balanced, no position biased, and each call fresh
    b = uniform_bits(rng, (3, 70001))
    assert b.dtype == np.uint8 and b.shape == (3, 70001) and set(np.unique(b)) == {0, 1}
    assert abs(b.mean() - 0.5) < 0.005
    per_position = b.reshape(-1)[: 64 * 3000].reshape(3000, 64).mean(axis=0)  # bit i of the words
    assert np.all(np.abs(per_position - 0.5) < 0.05)
    assert (uniform_bits(rng, 1000) != uniform_bits(rng, 1000)).any()
    assert uniform_bits(rng, 5).shape == (5,) and uniform_bits(rng, ()).shape == ()


def _local_ops(ctx, X, Y):
    x = share_input(ctx, X if ctx.party == 0 else None, owner=0)
    y = share_input(ctx, Y if ctx.party == 1 else None, owner=1)
    out = {}
    out["add"] = (x + y).reveal_signed()
    out["sub"] = (x - y).reveal_signed()
    out["neg_add_pub"] = (-x + 5).reveal_signed()
    out["sub_pub"] = (x - 7).reveal_signed()
    out["rsub_pub"] = (7 - x).reveal_signed()
    out["mul_pub"] = (x * -3).reveal_signed()
    out["mul_arr"] = (x * np.arange(X.size).reshape(X.shape)).reveal_signed()
    out["T"] = x.T.reveal_signed()
    out["idx"] = x[1:, ::2].reveal_signed()
    out["reshape"] = x.reshape(-1).reveal_signed()
    out["cat"] = concatenate([x, y], axis=1).reveal_signed()
    out["stack"] = stack([x, y]).reveal_signed()
    out["sum"] = x.sum(axis=0).reveal_signed()
    out["to0"] = x.reveal(to=0)
    out["to1"] = x.reveal(to=1)
    f = share_input(ctx, np.array([1.5, -2.25, 3.0]) if ctx.party == 0 else None, owner=0)
    out["fixed"] = f.mul_public_fixed(np.array([2.0, 0.5, -1.25])).reveal_float()
    out["fixed_add"] = f.add_public_fixed(1.0).reveal_float()
    b = share_bits_input(ctx, np.array([0, 1, 1, 0]) if ctx.party == 0 else None, owner=0)
    out["bits"] = (b ^ np.array([1, 1, 0, 0])).reveal()
    out["bits_and_pub"] = (b & np.array([1, 0, 1, 0])).reveal()
    out["bits_not"] = (~b).reveal()
    return out


def test_share_local_ops_inprocess():
    rng = np.random.default_rng(5)
    X = rng.integers(-1000, 1000, (3, 4))
    Y = rng.integers(-1000, 1000, (3, 4))
    a, b = run_inprocess(_local_ops, args0=(X, Y), args1=(X, Y), ot_factory=OT)
    for o in (a, b):
        assert (o["add"] == X + Y).all() and (o["sub"] == X - Y).all()
        assert (o["neg_add_pub"] == -X + 5).all() and (o["sub_pub"] == X - 7).all() and (o["rsub_pub"] == 7 - X).all()
        assert (o["mul_pub"] == X * -3).all() and (o["mul_arr"] == X * np.arange(12).reshape(3, 4)).all()
        assert (o["T"] == X.T).all() and (o["idx"] == X[1:, ::2]).all() and (o["reshape"] == X.reshape(-1)).all()
        assert (o["cat"] == np.concatenate([X, Y], 1)).all() and (o["stack"] == np.stack([X, Y])).all()
        assert (o["sum"] == X.sum(0)).all()
        assert np.abs(o["fixed"] - np.array([3.0, -1.125, -3.75])).max() <= 2 * 2.0 ** -16
        assert np.abs(o["fixed_add"] - np.array([2.5, -1.25, 4.0])).max() == 0
        assert (o["bits"] == [1, 0, 1, 0]).all() and (o["bits_and_pub"] == [0, 0, 1, 0]).all()
        assert (o["bits_not"] == [1, 0, 0, 1]).all()
    assert (to_signed(a["to0"], 64) == X).all() and a["to1"] is None
    assert b["to0"] is None and (to_signed(b["to1"], 64) == X).all()


def test_small_ring_shares():
    ring = RingConfig(bits=8, frac=3)

    def f(ctx):
        x = share_input(ctx, np.array([100, 200, 255]) if ctx.party == 0 else None, owner=0)
        assert x.bits == 8 and int(x.data.max()) <= 255
        return (x + x).reveal()

    a, _ = run_inprocess(f, ring=ring, ot_factory=OT)
    assert (a == np.array([200, 144, 254])).all()


def test_bad_input_shapes_and_kinds():
    def f(ctx):
        x = share_input(ctx, np.zeros(3, np.uint64) if ctx.party == 0 else None, owner=0)
        y = share_input(ctx, np.zeros(4, np.uint64) if ctx.party == 0 else None, owner=0)
        errs = []
        for fn in (lambda: x + y, lambda: x * y, lambda: x * 1.5,
                   lambda: x + AShare(ctx, np.zeros(3, np.uint64), 32),
                   lambda: x + BShare(ctx, np.zeros(3, np.uint64))):
            try:
                fn()
                errs.append(None)
            except (ValueError, TypeError, MPCError) as e:
                errs.append(type(e).__name__)
        return errs

    a, b = run_inprocess(f, ot_factory=OT)
    assert None not in a and None not in b


def _fail_party1(ctx):
    if ctx.party == 1:
        raise ValueError("boom in party 1")
    return ctx.recv()


def _stall_party1(ctx):
    if ctx.party == 1:
        import time
        time.sleep(1.5)
        return None
    return ctx.recv()


def test_error_in_one_party_surfaces():
    with pytest.raises(PartyFailed, match="party 1 failed: ValueError: boom in party 1"):
        run_inprocess(_fail_party1, timeout=10)


def test_peer_stall_times_out():
    with pytest.raises(PartyFailed, match="ChannelTimeout"):
        run_inprocess(_stall_party1, timeout=10, chan_timeout=0.5)
    with pytest.raises(MPCTimeout):
        run_inprocess(_stall_party1, timeout=0.5, chan_timeout=30)


def test_error_in_one_process_surfaces():
    with pytest.raises(PartyFailed, match="party 1 failed: ValueError: boom in party 1"):
        run_processes(_fail_party1, timeout=60)


def _die_party1(ctx):
    if ctx.party == 1:
        import os
        os._exit(3)
    return ctx.recv()


def test_process_that_dies_is_reported():
    with pytest.raises(PartyFailed, match="party 1 failed: process exited with code 3"):
        run_processes(_die_party1, timeout=60)


def test_new_rng_is_aes_ctr_keyed_from_the_os():
    """Masks and shares come from AES-CTR (a CSPRNG), not numpy's predictable PCG64; each
    generator has its own fresh key."""
    a, b = new_rng(), new_rng()
    assert type(a.bit_generator).__name__ == "AESCounter"
    assert not np.array_equal(a.integers(0, 2**63, 8), b.integers(0, 2**63, 8))
