"""BLB's fused ct-ct MatMul (cipherlm/protocols/ckks/blb_matmul.py; paper section 5, Appendix
C.1) at the INSECURE N = 2^10 test preset (512 slots): Q K^T and P V for 2 heads on Lattigo
ciphertexts against numpy, the measured rotations / products against `counts`, and BSGS
against the naive schedule."""

from __future__ import annotations

import numpy as np
import pytest

from cipherlm.he.lattigo_backend import available
from cipherlm.protocols.ckks import blb_matmul as M
from cipherlm.protocols.ckks.evaluator import CkksEvaluator

pytestmark = pytest.mark.skipif(not available(), reason="the Lattigo library is not built (make lattigo)")

H = 2
#: CKKS noise at this preset after depth 4 is ~1e-8 here; a wrong diagonal, head or
#: transposition gives errors of order 1 (the entries are of order 1)
TOL = 1e-5


@pytest.fixture(scope="module")
def env(ckks_toy_keys):
    return ckks_toy_keys


def evaluator(env, layout, variants=((True, None), (False, None))):
    be, ctx, sk, bk = env
    steps = set()
    for bsgs, baby in variants:
        steps |= M.rotation_steps(layout, bsgs, baby)
    return CkksEvaluator(be, ctx, sk.eval_keys(relin=True, steps=sorted(steps)), bk)


def encrypt(env, vecs):
    be, ctx, sk, _ = env
    return [sk.encrypt(be.encode_slots(ctx, v)) for v in vecs]


def decrypt(env, cts):
    be, ctx, sk, _ = env
    return np.stack([be.decode_slots(ctx, sk.decrypt(c)) for c in cts])


def run(env, ev, a, b, layout, bsgs, baby=None, pool=None):
    """Encrypt, multiply, check the counters against `counts`; the decrypted slot vectors."""
    a_ct, b_ct = encrypt(env, a), encrypt(env, b)
    top = a_ct[0].level
    ev.stats.counts.clear()
    out = M.fused_matmul(ev, a_ct, b_ct, layout, bsgs=bsgs, baby=baby, pool=pool, workers=3 if pool else 1)
    want = M.counts(layout.slots, layout.heads, layout.n, layout.k, layout.groups, bsgs=bsgs, baby=baby)
    got = ev.stats.counts
    assert {k: got.get(k, 0) for k in ("rotate", "mul", "mul_plain", "rescale")} == \
        {k: want[k] for k in ("rotate", "mul", "mul_plain", "rescale")}
    assert set(got) <= {"rotate", "mul", "mul_plain", "rescale"}
    assert len(out) == layout.n_out
    assert min(c.level for c in out) == top - want["depth"]
    return decrypt(env, out), want


@pytest.mark.parametrize("groups", [1, 2, 8])
@pytest.mark.parametrize("bsgs", [False, True])
@pytest.mark.parametrize("threads", [False, True])
def test_qk_multi_head(env, groups, bsgs, threads):
    """Q K^T for 2 heads, 8 tokens, head dim 8, with 1, 2 and 8 reduce indices per ciphertext
    (step 1 and step 3 only exist for c > 1); sequential and on a thread pool of 3 workers (the
    same counts and results: Lattigo's evaluator may be called concurrently)."""
    import concurrent.futures

    rng = np.random.default_rng(groups + 10 * bsgs)
    n, d = 8, 8
    Q, K = rng.normal(size=(H, n, d)) / 2, rng.normal(size=(H, n, d)) / 2
    L = M.make_layout(512, H, n, d, groups)
    assert L.groups == groups
    ev = evaluator(env, L)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        vecs, _ = run(env, ev, M.pack_columns(Q, L), M.pack_columns(K, L), L, bsgs, pool=pool if threads else None)
    want = Q @ K.transpose(0, 2, 1)
    got = M.unpack_diagonals(vecs, L)
    assert np.abs(got - want).max() < TOL
    assert np.abs(got - want.transpose(0, 2, 1)).max() > 100 * TOL  # K Q^T would fail
    assert np.abs(vecs[:, groups * H * n:]).max() < TOL  # unused slots stay 0


@pytest.mark.parametrize("bsgs", [False, True])
def test_av_padded_and_chained_after_qk(env, bsgs):
    """P V with V (8 x 4) padded to 8 x 8 columns (section 5.2), P = Q K^T / 4 without softmax:
    computed on ciphertexts, decrypted and repacked spatial-first (what the conversion to and
    from MPC does around the softmax in the paper), then multiplied by V on ciphertexts."""
    rng = np.random.default_rng(7 + bsgs)
    n, d = 8, 4
    Q, K, V = (rng.normal(size=(H, n, d)) / 2 for _ in range(3))
    Lqk = M.make_layout(512, H, n, d, 2)
    ev = evaluator(env, Lqk)
    vecs, _ = run(env, ev, M.pack_columns(Q, Lqk), M.pack_columns(K, Lqk), Lqk, bsgs)
    S = M.unpack_diagonals(vecs, Lqk)
    assert np.abs(S - Q @ K.transpose(0, 2, 1)).max() < TOL
    P = S / 4
    Lav = M.make_layout(512, H, n, n, 2)  # reduce over the n key positions
    ev = evaluator(env, Lav)
    vecs, _ = run(env, ev, M.pack_columns(P, Lav), M.pack_rows(V, Lav), Lav, bsgs)
    Y = M.unpack_diagonals(vecs, Lav)
    want = (Q @ K.transpose(0, 2, 1) / 4) @ V
    assert np.abs(Y[:, :, :d] - want).max() < TOL
    assert np.abs(Y[:, :, d:]).max() < TOL  # the padding columns
    assert np.abs(M.unpack_diagonals(vecs, Lav, cols=d) - want).max() < TOL
    assert np.abs(Y[:, :, :d] - P.transpose(0, 2, 1) @ V).max() > 100 * TOL


def test_full_ciphertext_layout(env):
    """c H n = S (4 groups x 2 heads x 64 tokens = 512 slots): the two group shifts of step 3
    are one rotation mod S, and the prediction counts them once."""
    rng = np.random.default_rng(3)
    n, d = 64, 8
    Q, K = rng.normal(size=(H, n, d)) / 2, rng.normal(size=(H, n, d)) / 2
    L = M.make_layout(512, H, n, d, 4)
    assert L.full and L.n_cts == 2
    ev = evaluator(env, L, ((True, None),))
    vecs, want = run(env, ev, M.pack_columns(Q, L), M.pack_columns(K, L), L, True)
    assert np.abs(M.unpack_diagonals(vecs, L) - Q @ K.transpose(0, 2, 1)).max() < TOL
    naive = M.counts(512, H, n, d, 4, bsgs=False)
    assert want["rotate"] < naive["rotate"] and want["mul"] == naive["mul"] == n * L.n_cts


@pytest.mark.parametrize("heads,n,d", [(2, 5, 3), (1, 300, 1)])
def test_odd_shapes_and_coinciding_steps(env, heads, n, d):
    """5 tokens (no power of two) and 300 tokens in 512 slots, where the inner rotations'
    steps r - n and r' = r + S - n coincide mod S: the hoisted call rotates once, and
    `counts` predicts it (598 steps, 511 distinct)."""
    rng = np.random.default_rng(n)
    Q, K = rng.normal(size=(heads, n, d)), rng.normal(size=(heads, n, d))
    L = M.make_layout(512, heads, n, d)
    assert L.groups == 1
    ev = evaluator(env, L, ((False, None),))
    vecs, want = run(env, ev, M.pack_columns(Q, L), M.pack_columns(K, L), L, False)
    assert np.abs(M.unpack_diagonals(vecs, L) - Q @ K.transpose(0, 2, 1)).max() < TOL
    if n == 300:
        assert want["rotate"] == 511 < 2 * (n - 1)


def test_bsgs_uses_fewer_rotations(env):
    """Appendix C.1: with BSGS, step 2 rotates each ciphertext O(sqrt n) times instead of
    O(n).  P V for 16 tokens with one key position per ciphertext (J = 16 ciphertexts per
    operand, where the paper's saving shows): measured on ciphertexts for both schedules."""
    rng = np.random.default_rng(5)
    n, d = 16, 4
    P, V = rng.normal(size=(H, n, n)) / 4, rng.normal(size=(H, n, d))
    L = M.make_layout(512, H, n, n, 1)
    ev = evaluator(env, L)
    a, b = M.pack_columns(P, L), M.pack_rows(V, L)
    measured = {}
    for bsgs in (False, True):
        vecs, want = run(env, ev, a, b, L, bsgs)
        measured[bsgs] = ev.stats.counts["rotate"], ev.stats.counts["mul"]
        assert np.abs(M.unpack_diagonals(vecs, L, cols=d) - P @ V).max() < TOL
    assert measured[True][0] < measured[False][0] / 2
    assert measured[True][1] == measured[False][1] == n * n


def test_counts_closed_forms_and_paper_shapes():
    """The closed forms of the module docstring (generic case) and the ordering of Table 7:
    BLB < Powerformer < BOLT in rotations at BERT-base and the paper's two shapes."""
    S, n, k, c = 8192, 128, 64, 4
    L = M.make_layout(S, 12, n, k, c)
    J = L.n_cts
    naive = M.counts(S, 12, n, k, c, bsgs=False)
    step3 = (n - n // c) * 2
    assert naive["rotate"] == J * 2 * (c - 1) + J * 2 * (n - 1) + step3
    assert naive["mul_plain"] == J * (2 * c - 1) + J * 2 * (n - 1) + step3
    assert naive["mul"] == n * J and naive["depth"] == 4
    for (model, tokens, heads, hd), row in M.TABLE7.items():
        for slots in (8192, 16384):
            blb = M.counts(slots, heads, tokens, hd)
            assert blb["rotate"] < M.powerformer_counts(tokens, heads, hd)["rotate"] < M.bolt_counts(tokens, heads, hd)["rotate"]
        bolt = M.bolt_counts(tokens, heads, hd)["rotate"]
        assert all(abs(v - bolt) / bolt < 0.01 for v in row["BOLT"])
        pf = M.powerformer_counts(tokens, heads, hd)["rotate"]
        assert all(abs(v - pf) / pf < 0.1 for v in row["Powerformer"])


# ------------------------------------------------- Appendix C.2: the output projection
@pytest.mark.parametrize("n,d,groups,cols,per_ct,dense", [(8, 4, 2, 12, None, True), (8, 4, 1, 20, 8, False),
                                                          (8, 2, 2, 10, None, True), (5, 3, 1, 7, None, False)])
@pytest.mark.parametrize("bsgs", [False, True])
def test_outproj_diagonal_to_spatial(env, n, d, groups, cols, per_ct, dense, bsgs):
    """Appendix C.2 on P V's diagonal-packed output: O = concat_h(P_h V_h) W with W in the
    clear, the result in spatial-first packing (columns of n consecutive slots), against
    numpy; the counters equal `blb_diag_matmul.counts`, one level used.  n = 8: S / n = 64
    segments, cyclic offsets (one output ciphertext of 12 columns; or 20 columns at 8 per
    ciphertext: 3 of them); n = 5: 512 is no multiple of 5, non-cyclic offsets.  ``dense``:
    Figure 15 (b)'s folding of the padded diagonals (n = 2 d_h and n = 4 d_h)."""
    from cipherlm.protocols.ckks import blb_diag_matmul as C2

    rng = np.random.default_rng(n + cols + bsgs)
    P, V = rng.normal(size=(H, n, n)) / 2, rng.normal(size=(H, n, d))
    W = rng.normal(size=(H * d, cols)) / 2
    Lav = M.make_layout(512, H, n, n, groups)
    Lo = C2.make_diag_layout(Lav, d, cols, per_ct, dense)
    assert Lo.cyclic == (n == 8) and Lo.n_in == Lav.n_out // (n // d if dense else 1)
    steps = M.rotation_steps(Lav, True) | C2.rotation_steps(Lo, bsgs)
    be, ctx, sk, bk = env
    ev = CkksEvaluator(be, ctx, sk.eval_keys(relin=True, steps=sorted(steps)), bk)
    x = M.fused_av(ev, encrypt(env, M.pack_columns(P, Lav)), encrypt(env, M.pack_rows(V, Lav)), Lav)
    lvl = min(c.level for c in x)
    ev.stats.counts.clear()
    out = C2.outproj(ev, x, W, Lo, bsgs=bsgs)
    want = C2.counts(Lo, bsgs)
    got = ev.stats.counts
    assert {k: got.get(k, 0) for k in ("rotate", "mul", "mul_plain", "rescale")} == \
        {k: want[k] for k in ("rotate", "mul", "mul_plain", "rescale")}
    assert len(out) == Lo.n_out == want["out_cts"] and min(c.level for c in out) == lvl - want["depth"]
    vecs = decrypt(env, out)
    O = C2.unpack_spatial(vecs, Lo)
    Xcat = np.concatenate(list(P @ V), axis=1)  # (n, H d): head-major features
    assert np.abs(O - Xcat @ W).max() < TOL
    feature_major = (P @ V).transpose(1, 2, 0).reshape(n, H * d)  # the other concatenation order
    assert np.abs(O - feature_major @ W).max() > 100 * TOL
    for m in range(Lo.n_out):  # slots beyond the output columns stay 0
        assert np.abs(vecs[m, Lo.out_cols(m) * n:]).max() < TOL


def test_outproj_bsgs_and_counts_closed_form():
    """C.2's counts at BERT-base's shape (128 tokens, 12 heads, head dim 64, D = 768, S = 8192
    and 16384): ct-pt = J_in sum_m |U_m|, BSGS rotates less than the all-baby schedule with the
    same products; and a hand count at a small cyclic shape."""
    from cipherlm.protocols.ckks import blb_diag_matmul as C2

    for S in (8192, 16384):
        Lav = M.make_layout(S, 12, 128, 128)
        Lo = C2.make_diag_layout(Lav, 64, 768)
        naive, bsgs = C2.counts(Lo, False), C2.counts(Lo, True)
        assert naive["mul_plain"] == bsgs["mul_plain"] == Lo.n_in * sum(len(Lo.offsets(m)) for m in range(Lo.n_out))
        assert bsgs["rotate"] < naive["rotate"] / 2
        sparse = C2.counts(C2.make_diag_layout(Lav, 64, 768, dense=False), True)
        assert Lo.dense and 2 * bsgs["mul_plain"] == sparse["mul_plain"]  # Figure 15 (b): n = 2 d_h
    # S = 512, n = 8 (64 segments, cyclic), c = 2, H = 2: 4 input segments; 12 output columns
    for dense, cts in ((False, 4), (True, 2)):
        Lo = C2.make_diag_layout(M.make_layout(512, 2, 8, 8, 2), 4, 12, dense=dense)
        c = C2.counts(Lo, False)
        # offsets sigma' - sigma mod 64, sigma' < 4, sigma < 12: -11..3, 15 of them, 14 nonzero
        assert c["mul_plain"] == cts * 15 and c["rotate"] == cts * 14
