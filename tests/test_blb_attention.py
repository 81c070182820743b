"""A BLB attention core on Lattigo ciphertexts (paper sections 5-6, Appendix C.1-C.2), at the
INSECURE N = 2^10 test preset (512 slots, primes 60 + 9 x 40 bits, scale 2^40):

* the raw CKKS access the conversions need on Lattigo (its NTT reproduced in numpy, its slot
  order 5^j against SEAL's 3^j) and Algorithms 1-2 on Lattigo ciphertexts;
* the repack of P inside the softmax's conversion (`blb_repack`): a public permutation of each
  party's shares, no message;
* Enc(Q), Enc(K) -> fused Q K^T -> CKKS->MPC -> (a public scaling by 1/4 on the shares: the
  stand-in for the MPC softmax) -> repack -> MPC->CKKS -> fused P V with Enc(V) -> the output
  projection of Appendix C.2 -> decrypt, against numpy, with every counter as predicted.
"""

from __future__ import annotations

import numpy as np
import pytest

from cipherlm.he import lattigo_ntt
from cipherlm.he.errors import HEError
from cipherlm.he.lattigo_backend import available
from cipherlm.mpc.runner import run_inprocess
from cipherlm.mpc.shares import AShare
from cipherlm.protocols import ckks_convert as cc

pytestmark = pytest.mark.skipif(not available(), reason="the Lattigo library is not built (make lattigo)")

F = 16
ULP = 2.0 ** -F


@pytest.fixture(scope="module")
def env(ckks_toy_keys):
    return ckks_toy_keys


def signed(x, q):
    x = np.asarray(x, np.uint64)
    return np.where(x > np.uint64(q // 2), x.astype(np.int64) - np.int64(q), x.astype(np.int64))


def reveal(y0, y1):
    return (np.asarray(y0, np.uint64) + np.asarray(y1, np.uint64)).view(np.int64) / 2.0 ** F


# ----------------------------------------------------------------------- raw access on Lattigo
@pytest.mark.parametrize("level", [0, 2])
def test_lattigo_ntt_is_lattigos(env, level):
    """ntt_inverse / ntt_forward equal Lattigo's own transform: a ciphertext (c0, 0) decrypts to
    INTT(c0) whatever the key."""
    be, ctx, sk, _ = env
    rng = np.random.default_rng(level)
    qs = ctx.q_moduli[: level + 1]
    X = np.stack([rng.integers(0, q, ctx.n, dtype=np.uint64) for q in qs])
    arr = np.zeros((2, level + 1, ctx.n), np.uint64)
    arr[0] = X
    coeffs = be.decrypt_coeffs(ctx, sk, be.numpy_to_ciphertext(ctx, arr, level=level))
    assert (be.ntt_inverse(ctx, X) == coeffs).all()
    assert (be.ntt_forward(ctx, coeffs) == X).all()
    assert not (be.ntt_forward(ctx, coeffs[:, ::-1]) == X).all()
    # the backend's NTT is Go's (`clg_ntt`); the numpy reference `lattigo_ntt` gives the same words
    assert all((lattigo_ntt.ntt_forward(coeffs[i], q) == X[i]).all() for i, q in enumerate(qs))
    assert all((lattigo_ntt.ntt_inverse(X[i], q) == coeffs[i]).all() for i, q in enumerate(qs))


def test_lattigo_ntt_refuses_bad_rows(env):
    be, ctx, _sk, _ = env
    with pytest.raises(HEError, match="not reduced"):
        be.ntt_forward(ctx, np.full((1, ctx.n), ctx.q_moduli[0], np.uint64))
    with pytest.raises(HEError, match="residue rows"):
        be.ntt_forward(ctx, np.zeros((len(ctx.q_moduli) + 1, ctx.n), np.uint64))
    with pytest.raises(HEError, match="expected"):
        be.ntt_inverse(ctx, np.zeros((1, ctx.n // 2), np.uint64))


def test_lattigo_slot_order(env):
    """Lattigo's slot j is m(omega^(5^j)): SEAL-order decode (3^j) permuted by
    `slot_permutation(N, 5)` gives Lattigo's slots; the identity order does not."""
    be, ctx, sk, _ = env
    z = np.random.default_rng(2).uniform(-4, 4, ctx.slots)
    m = be.decrypt_coeffs(ctx, sk, sk.encrypt(be.encode_slots(ctx, z, level=0)))[0]
    dec = cc.canonical_decode(signed(m, ctx.q_moduli[0])) / 2.0 ** 40
    idx, sign = cc.slot_permutation(ctx.n, be.slot_generator)
    assert np.abs(dec[idx] - z).max() < 1e-6
    assert np.abs(dec - z).max() > 1
    assert sorted(idx) == list(range(ctx.slots)) and set(sign) == {-1, 1}


@pytest.mark.parametrize("complex_slots", [False, True])
def test_conversions_on_lattigo(env, complex_slots):
    """Algorithm 1 on a Lattigo ciphertext below the top level (complex slots: the real parts,
    then the imaginary parts, conjugated slots' signs flipped), Algorithm 2 back to the top
    level, decrypted by Lattigo."""
    be, ctx, sk, _ = env
    rng = np.random.default_rng(3)
    z = rng.uniform(-4, 4, ctx.slots)
    if complex_slots:
        z = z + 1j * rng.uniform(-4, 4, ctx.slots)
    ct = sk.encrypt(be.encode_slots(ctx, z, level=3))

    def party(c):
        side = cc.setup(c, be, ctx, sk if c.party == 0 else None)
        y = cc.ckks_to_shares(c, ct if c.party == 1 else None, side, complex_slots=complex_slots)
        return y.data, cc.shares_to_ckks(c, y, side, scale_bits=40, complex_slots=complex_slots)

    (y0, none), (y1, out) = run_inprocess(party, timeout=300)
    assert none is None
    want = np.concatenate([z.real, z.imag]) if complex_slots else z
    assert np.abs(reveal(y0, y1) - want).max() < 4 * ULP
    assert out.level == ctx.max_level and out.scale == 2.0 ** 40
    back = be.decode_slots(ctx, sk.decrypt(out), complex_out=complex_slots)
    # Algorithm 2's rounding of the encode matrix: ~0.3 (N/2) rms(y) 2^f / Delta per slot
    assert np.abs(back - z).max() < 5e-4


def test_paired_conversion_on_lattigo(env):
    """`ckks_to_shares_many(..., paired=True)` on Lattigo ciphertexts (slot order 5^j: every
    imaginary sign +1), three real ciphertexts below the top level in two conversions."""
    be, ctx, sk, _ = env
    rng = np.random.default_rng(4)
    z = rng.uniform(-4, 4, (3, ctx.slots))
    cts = [sk.encrypt(be.encode_slots(ctx, v, level=2)) for v in z]

    def party(c):
        side = cc.setup(c, be, ctx, sk if c.party == 0 else None)
        return cc.ckks_to_shares_many(c, cts if c.party == 1 else None, side, 3, paired=True).data

    y0, y1 = run_inprocess(party, timeout=300)
    assert y0.shape == (3, ctx.slots)
    assert np.abs(reveal(y0, y1) - z).max() < 4 * ULP


@pytest.mark.parametrize("m", [2, 3])
def test_paired_algorithm2_on_lattigo(env, m):
    """`shares_to_ckks_many(..., paired=True)`: m rows in ceil(m / 2) encryptions of complex
    slots, split by the server with one conjugation each; every ciphertext decrypts to its row
    at the requested level and scale."""
    be, ctx, sk, _ = env
    ck = sk.galois_keys([], conjugate=True)
    rng = np.random.default_rng(6)
    Z = np.rint(rng.uniform(-4, 4, (m, ctx.slots)) * 2 ** F).astype(np.int64)
    s0 = rng.integers(0, 2 ** 64, Z.shape, dtype=np.uint64)
    s1 = Z.astype(np.uint64) - s0

    def party(c):
        side = cc.setup(c, be, ctx, sk if c.party == 0 else None)
        mine = AShare(c, s1 if c.party == 1 else s0, 64, F)
        out = cc.shares_to_ckks_many(c, mine, side, n_primes=3, scale_bits=40, paired=True,
                                     conj_keys=ck if c.party == 1 else None)
        return out, c.chan.stats().get("mpc2ckks", {})

    (none, st0), (cts, _) = run_inprocess(party, timeout=300)
    assert none is None and len(cts) == m
    for ct, want in zip(cts, Z / 2 ** F):
        assert ct.level == 2 and ct.scale == 2.0 ** 40
        assert np.abs(be.decode_slots(ctx, sk.decrypt(ct)) - want).max() < 2e-3
    one = len(sk.encrypt_seeded(be.encode_slots(ctx, np.zeros(ctx.slots), level=2)))
    assert st0["messages_sent"] == 1 and st0["bytes_sent"] < ((m + 1) // 2) * one + 256


# ----------------------------------------------------------------------------- the repack of P
def diagonal_packing(P, L):
    """Q K^T's output packing written from its definition (`blb_matmul` docstring): ciphertext
    q, slot (g H + h) n + t = P_h[t, (t + q c + g) mod n]."""
    H, n, _ = P.shape
    out = np.zeros((L.n_out, L.slots))
    t = np.arange(n)
    for q in range(L.n_out):
        for g in range(L.groups):
            for h in range(H):
                out[q, L.slot(g, h, 0) + t] = P[h, t, (t + q * L.groups + g) % n]
    return out

@pytest.mark.parametrize("n,c_qk,c_av", [(8, 2, 2), (8, 1, 4), (6, 3, 2), (5, 1, 1)])
def test_repack_is_the_packing_change(n, c_qk, c_av):
    """`repack_plain` takes Q K^T's diagonal packing of any matrices to `pack_columns` of P V's
    layout (other groups per ciphertext on either side, 5 and 6 tokens included); each source
    slot lands once, P V's padding reads nothing."""
    from cipherlm.protocols.ckks import blb_matmul as M
    from cipherlm.protocols.ckks import blb_repack as R

    H = 2
    P = np.random.default_rng(n + c_qk).normal(size=(H, n, n))
    src, dst = M.make_layout(512, H, n, c_qk, c_qk), M.make_layout(512, H, n, n, c_av)
    diag = diagonal_packing(P, src)
    assert np.allclose(M.unpack_diagonals(diag, src), P)
    assert (R.repack_plain(diag, src, dst) == M.pack_columns(P, dst)).all()
    idx = R.repack_index(src, dst)
    used = idx[idx >= 0]
    assert used.size == H * n * n == np.unique(used).size


def test_repack_of_shares_is_local(env):
    """Inside the softmax's conversion: each party's output share is its own input share
    permuted by the public `repack_index` (0 at padding), nothing is sent or received, and the
    shares reconstruct to P in P V's packing."""
    from cipherlm.protocols.ckks import blb_matmul as M
    from cipherlm.protocols.ckks import blb_repack as R
    from cipherlm.mpc.shares import AShare

    H, n = 2, 8
    P = np.random.default_rng(9).uniform(-2, 2, size=(H, n, n))
    src, dst = M.make_layout(512, H, n, 4, 2), M.make_layout(512, H, n, n, 4)
    diag = diagonal_packing(P, src)
    fixed = np.rint(diag.reshape(-1) * 2.0 ** F).astype(np.int64).astype(np.uint64)
    r = np.random.default_rng(10).integers(0, 2 ** 64, fixed.size, dtype=np.uint64)
    shares = (r, fixed - r)

    def party(ctx):
        before = ctx.chan.stats()
        x = AShare(ctx, shares[ctx.party], 64, F)
        y = R.repack_shares(x, src, dst)
        return x.data.copy(), y.data.copy(), before, ctx.chan.stats()

    (x0, y0, b0, a0), (x1, y1, b1, a1) = run_inprocess(party, timeout=60)
    assert a0 == b0 and a1 == b1  # no message either way
    idx = R.repack_index(src, dst)
    for x, y in ((x0, y0), (x1, y1)):
        assert (y[idx >= 0] == x[idx[idx >= 0]]).all() and (y[idx < 0] == 0).all()
    got = reveal(y0, y1).reshape(dst.n_cts, dst.slots)
    assert np.abs(got - M.pack_columns(P, dst)).max() <= ULP


# ----------------------------------------------------------------------------- end to end
def test_attention_core_end_to_end(env):
    """The BLB attention core of one layer on ciphertexts, 2 heads, 8 tokens, head dim 4,
    output projection to 12 columns (S = 512 slots):

    server: Enc(Q), Enc(K) -> fused Q K^T (section 5, BSGS, c = 2: 4 ciphertexts in diagonal
    packing) -> Algorithm 1 per ciphertext -> both parties: S / 4 by local truncation of their
    shares (the stand-in for the MPC softmax) -> repack (local permutation) -> Algorithm 2 per
    ciphertext of P V's packing -> server: fused P V with Enc(V) -> Appendix C.2 with W in the
    clear -> client: decrypt.

    Against numpy: O = concat_h((Q_h K_h^T / 4) V_h) W.  Error bound, from the pieces' own
    bounds: P's entries carry e_P <= 2 ulp (Algorithm 1 + the truncation) + 5e-4 (Algorithm 2 at
    Delta = 2^40, N = 2^10: tests above), and O's error is at most
    e_P * n max|V| * H d_h max|W| (+ 1e-5 of CKKS noise); a wrong packing anywhere gives errors
    of the size of O itself.  Every HE counter equals the predicted counts of the three
    protocols; one masked ciphertext per Q K^T ciphertext and one encryption per P ciphertext
    cross the channel."""
    from cipherlm.protocols.ckks import blb_diag_matmul as C2
    from cipherlm.protocols.ckks import blb_matmul as M
    from cipherlm.protocols.ckks import blb_repack as R
    from cipherlm.protocols.ckks.evaluator import CkksEvaluator
    from cipherlm.mpc.protocols.trunc import trunc_local_bits
    from cipherlm.mpc.shares import AShare

    be, ctx, sk, bk = env
    H, n, d, D, S = 2, 8, 4, 12, ctx.slots
    rng = np.random.default_rng(16)
    Q, K, V = (rng.normal(size=(H, n, d)) / 2 for _ in range(3))
    W = rng.normal(size=(H * d, D)) / 2
    Lqk, Lav = M.make_layout(S, H, n, d, 2), M.make_layout(S, H, n, n, 2)
    Lo = C2.make_diag_layout(Lav, d, D)
    steps = M.rotation_steps(Lqk) | M.rotation_steps(Lav) | C2.rotation_steps(Lo)
    ev = CkksEvaluator(be, ctx, sk.eval_keys(relin=True, steps=sorted(steps)), bk)

    def enc(vecs):
        return [sk.encrypt(be.encode_slots(ctx, v)) for v in vecs]

    q_ct, k_ct = enc(M.pack_columns(Q, Lqk)), enc(M.pack_columns(K, Lqk))
    v_ct = enc(M.pack_rows(V, Lav))
    measured = {}

    def phase(name, fn):
        ev.stats.counts.clear()
        out = fn()
        measured[name] = {k: ev.stats.counts.get(k, 0) for k in ("rotate", "mul", "mul_plain", "rescale")}
        assert set(ev.stats.counts) <= {"rotate", "mul", "mul_plain", "rescale"}
        return out

    def party(c):
        server = c.party == 1
        side = cc.setup(c, be, ctx, None if server else sk)
        base = c.chan.stats()
        s_ct = phase("qk", lambda: M.fused_qk(ev, q_ct, k_ct, Lqk)) if server else [None] * Lqk.n_out
        parts = [cc.ckks_to_shares(c, ct, side) for ct in s_ct]  # Algorithm 1, per ciphertext
        y = AShare(c, np.concatenate([p.data for p in parts]), 64, F)
        y = AShare(c, trunc_local_bits(c, y.data, 2, 64), 64, F)  # the softmax's stand-in: S / 4
        p = R.repack_shares(y, Lqk, Lav)  # local permutation
        p_ct = [cc.shares_to_ckks(c, AShare(c, p.data[j * S:(j + 1) * S], 64, F), side, scale_bits=40)
                for j in range(Lav.n_cts)]  # Algorithm 2, per ciphertext of P V's packing
        st = c.chan.stats()
        sent = {k: v["messages_sent"] - base.get(k, {}).get("messages_sent", 0) for k, v in st.items()}
        if not server:
            return sent
        x = phase("av", lambda: M.fused_av(ev, p_ct, v_ct, Lav))
        return sent, phase("outproj", lambda: C2.outproj(ev, x, W, Lo))

    sent_c, (sent_s, out) = run_inprocess(party, timeout=600)
    assert sent_s["ckks2mpc"] == Lqk.n_out and sent_c["mpc2ckks"] == Lav.n_cts
    want_counts = {"qk": M.counts(S, H, n, d, 2), "av": M.counts(S, H, n, n, 2), "outproj": C2.counts(Lo)}
    for name, w in want_counts.items():
        assert measured[name] == {k: w[k] for k in ("rotate", "mul", "mul_plain", "rescale")}, name
    assert len(out) == Lo.n_out and out[0].level == ctx.max_level - want_counts["av"]["depth"] - 1
    O = C2.unpack_spatial(np.stack([be.decode_slots(ctx, sk.decrypt(c)) for c in out]), Lo)
    P = Q @ K.transpose(0, 2, 1) / 4
    want = np.concatenate(list(P @ V), axis=1) @ W
    # |error of O[t, j]| <= e_P sum_(h, i) |W[h d + i, j]| sum_k |V_h[k, i]|  (+ CKKS noise)
    e_p = 2 * ULP + 5e-4
    bound = e_p * (np.abs(V).sum(axis=1).reshape(-1) @ np.abs(W)).max() + 1e-5
    err = np.abs(O - want).max()
    assert err < bound, (err, bound)
    for wrong in (np.concatenate(list(P.transpose(0, 2, 1) @ V), axis=1) @ W,  # K Q^T
                  (P @ V).transpose(1, 2, 0).reshape(n, H * d) @ W):  # features concatenated the other way
        assert np.abs(O - wrong).max() > 10 * bound
