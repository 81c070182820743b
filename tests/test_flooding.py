"""Noise flooding of the 2pc mode is sized per session (security review finding 7).

`cipherlm.mpc.he_session`: FLOOD_SIGMA = 40 + log2(MAX_FLOODED_PER_SESSION), one
flooded coefficient costs <= 2^-(FLOOD_SIGMA + 1) of statistical distance, so a session
that sends at most MAX_FLOODED_PER_SESSION of them is within 2^-40.  Checked here: the
arithmetic; that the bound covers the real models' sessions (counted from the real
plans); that the flooding fits every parameter set for the real layer shapes (coefficient
and SIMD packing, both sessions, the embedding); that the counter is enforced; and that
the flooding really is that wide (noise budget) and results still decrypt.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cipherlm.he.context import HEContext
from cipherlm.he.errors import HEError
from cipherlm.he.params import check_security
from cipherlm.mpc.runner import run_inprocess
from cipherlm.protocols import embedding as E
from cipherlm.mpc import he_session as HS
from cipherlm.protocols import linear as L
from cipherlm.protocols import linear_simd as S

SMOLLM2 = dict(layers=30, d=576, heads=9, kv_heads=3, head_dim=64, ffn=1536, vocab=49152, context=8192,
               projections=[(576, 960), (576, 576), (576, 3072), (1536, 576)])
MINILM = dict(layers=6, d=384, heads=12, kv_heads=12, head_dim=32, ffn=1536, vocab=30522, context=512,
              projections=[(384, 1152), (384, 384), (384, 1536), (1536, 384)])


def _data_primes(params) -> tuple[float, int]:
    moduli = HEContext(params).coeff_moduli
    return sum(math.log2(q) for q in moduli), len(moduli)


def _max_terms(params, magnitude: float) -> float:
    """`HESession.max_flood_terms` without a session."""
    qbits, _ = _data_primes(params)
    n = params.poly_modulus_degree
    limit = 2.0 ** (qbits - math.ceil(math.log2(params.plain_modulus)) - 4 - HS.FLOOD_SIGMA) - 2 * n * HS.FRESH_NOISE_MAX
    return (limit / HS.noise_bound(1, magnitude)) ** 2 if limit > 0 else 0.0


def _coeff_flooded(params, batch, m, d, o, magnitude) -> int:
    """Flooded (sent) c0 coefficients of one cross term, from the plan `cross_matmul` makes."""
    n = params.poly_modulus_degree
    _, k = _data_primes(params)
    p = L.plan_blocks(m, d, o, n, batch, max_noise_terms=float(_max_terms(params, magnitude)),
                      in_ct_bytes=k * n * 8, encode_weights=True, op_scale=(n / 8192) * (k / 3))
    return p.out_cts * p.mw * p.ow


def session_flooded(model: dict, simd: bool = False) -> int:
    """Flooded coefficients of a whole session over the model's full context: prefill of
    all ``context`` tokens (the worst split for attention: 2 cross terms per shared
    product over the full T x T scores), every token also through the projections as a
    decode step (one row, the plans with the most padding) and the LM head, and the
    embedding lookup (exact method: one coefficient per channel, PackLWEs fills whole
    ciphertexts)."""
    T, Lyr = model["context"], model["layers"]
    w_mag, s_mag = float(1 << (L.W_BITS - 1)), float(1 << 58)
    rep = model["heads"] // model["kv_heads"]
    hd, kv = model["head_dim"], model["kv_heads"]
    wide = HS.TWOPC_BFV_WIDE
    att = 2 * (_coeff_flooded(wide, kv, rep * T, hd, T, s_mag) + _coeff_flooded(wide, kv, rep * T, T, hd, s_mag))
    proj = 0
    for d, o in model["projections"]:
        if simd:
            proj += S.plan_simd(1, d, o).out_cts * S.SIMD_N
        else:
            proj += max(_coeff_flooded(HS.TWOPC_BFV, 1, 1, d, o, w_mag) * T,
                        _coeff_flooded(HS.TWOPC_BFV, 1, T, d, o, w_mag))
    head = _coeff_flooded(HS.TWOPC_BFV, 1, 1, model["d"], model["vocab"], w_mag) * T
    emb = -(-T * model["d"] // 8192) * 8192
    return Lyr * (att + proj) + head + emb


def test_flooding_width_gives_2_to_minus_40_per_session():
    assert HS.FLOOD_SIGMA == 40 + HS.MAX_FLOODED_LOG2
    assert HS.MAX_FLOODED_PER_SESSION == 2 ** HS.MAX_FLOODED_LOG2
    # union bound over the session: count x per-coefficient distance (<= 2^-(sigma + 1), and
    # even the product's plainer count x 2^-sigma)
    assert HS.session_distance(HS.MAX_FLOODED_PER_SESSION) <= 2.0 ** -40
    assert HS.MAX_FLOODED_PER_SESSION * 2.0 ** -HS.FLOOD_SIGMA <= 2.0 ** -40
    # one flooded coefficient: U uniform on 2 B_f integers, |e| <= bound: SD(U + e, U) = |e| / 2 B_f
    he = object.__new__(HS.HESession)  # the budget arithmetic only, no keys
    he.n, he.q_top_bits, he.q_bottom_bits, he.t_bits, he.params = 8192, 180.0, 120.0, 59, HS.TWOPC_BFV
    nb = HS.noise_bound(1536 * 16, 2.0 ** 19)
    b_f = he.flood_bound(nb)
    assert (nb + he.n * HS.FRESH_NOISE_MAX * 2) / (2 * b_f) <= 2.0 ** -(HS.FLOOD_SIGMA + 1)
    # the 40-bit flooding of the first version was per coefficient only
    assert HS.session_distance(session_flooded(MINILM), sigma=40) > 2.0 ** -30


@pytest.mark.parametrize("model,simd", [(SMOLLM2, False), (SMOLLM2, True), (MINILM, False)],
                         ids=["smollm2-coeff", "smollm2-simd", "minilm"])
def test_real_sessions_fit_the_bound(model, simd):
    c = session_flooded(model, simd)
    assert c <= HS.MAX_FLOODED_PER_SESSION / 2, math.log2(c)  # with room to spare ("generous")
    assert HS.session_distance(c) <= 2.0 ** -40


def test_parameter_sets_are_secure():
    for p in (HS.TWOPC_BFV, HS.TWOPC_BFV_WIDE, S.SIMD_BFV):
        check_security(p)


def _budget_party(ctx):
    """Both sessions: flood_bound (which checks decryption at the top level and after the
    switch) for every real cross-term shape, and which session `cross_session` picks."""
    narrow = HS.he_session(ctx)
    wide = HS.he_session_wide(ctx)
    out = []
    w_mag, s_mag = float(1 << (L.W_BITS - 1)), float(1 << 58)
    for model in (SMOLLM2, MINILM):
        for d, o in model["projections"] + [(model["d"], model["vocab"])]:
            for m in (1, 128, model["context"]):
                assert L.cross_session(ctx, d, L.W_BITS) is narrow
                p = L.plan_blocks(m, d, o, narrow.n, 1, max_noise_terms=float(narrow.max_flood_terms(w_mag)))
                out.append(narrow.flood_bound(HS.noise_bound(d * p.ow, w_mag)))
        hd, T = model["head_dim"], model["context"]
        for d, o in ((hd, T), (T, hd)):
            assert L.cross_session(ctx, d, 59) is wide
            p = L.plan_blocks(T, d, o, wide.n, 1, max_noise_terms=float(wide.max_flood_terms(s_mag)),
                              in_ct_bytes=4 * wide.n * 8)
            out.append(wide.flood_bound(HS.noise_bound(d * p.ow, s_mag)))
    # a share operand does not fit the N = 8192 set even for one term
    assert narrow.max_flood_terms(s_mag) < 1
    return min(out), max(out)


def test_flooding_fits_both_coefficient_sessions_for_real_shapes():
    lo, hi = run_inprocess(_budget_party, timeout=300)[0]
    assert math.log2(lo) >= HS.FLOOD_SIGMA


def _simd_party(ctx):
    he = S.simd_session(ctx)
    widths = []
    for model in (SMOLLM2, MINILM):
        for d, o, ms in [(d, o, (1, 128)) for d, o in model["projections"]] + [(model["d"], model["vocab"], (1,))]:
            for m in ms:  # the noise depends on d (D c terms) and the giant steps, not on m
                plan = S.plan_simd(m, d, o)
                mean, worst = S.simd_noise_mean(he, plan), S.simd_noise_bound(he, plan)
                assert mean < worst / 64
                b_f = he.flood_bound(mean)
                he.check_budget(b_f, worst)  # the result decrypts with the worst-case noise
                widths.append(math.log2(b_f) - math.log2(mean))
    return min(widths)


def test_flooding_fits_the_simd_session_for_real_shapes():
    assert run_inprocess(_simd_party, timeout=300)[0] >= HS.FLOOD_SIGMA


@pytest.mark.parametrize("vocab,dim", [(30522, 384), (49152, 576)])
@pytest.mark.parametrize("method", ["exact", "fastquery", "+blockot", "cheetah"])
def test_embedding_plans_with_session_flooding(vocab, dim, method):
    m = E.METHODS[method]
    rng = np.random.default_rng(0)
    table = rng.normal(size=(vocab, dim)).astype(np.float32) * 0.05
    qt = E.quantize(table, m.quant, 16)
    lay = E.make_layout(qt.bits, qt.absmean, m)
    shape, plan = E._plan_any_n(m, lay, vocab, None, HS.FLOOD_SIGMA)
    assert plan.n <= 8192
    assert plan.flood >= 2 ** HS.FLOOD_SIGMA * plan.bound_out
    assert sum(plan.in_bits) + (plan.special_bits or 0) <= {4096: 109, 8192: 218}[plan.n]


def test_counter_is_enforced():
    c = HS.FloodCounter()
    c.add(HS.MAX_FLOODED_PER_SESSION - 5)
    c.add(5)
    with pytest.raises(HEError, match="start a new session"):
        c.add(1)
    assert c.count == HS.MAX_FLOODED_PER_SESSION


def _count_party(ctx):
    from cipherlm.mpc.shares import share_input

    rng = np.random.default_rng(3)
    a = share_input(ctx, rng.normal(size=(2, 5, 4)) if ctx.party == 0 else None, owner=0)
    b = share_input(ctx, rng.normal(size=(2, 4, 3)) if ctx.party == 1 else None, owner=1)
    L.matmul_shared(ctx, a, b)
    x = share_input(ctx, rng.normal(size=(3, 8)) if ctx.party == 0 else None, owner=0)
    L.linear(ctx, x, rng.normal(size=(8, 6)) if ctx.party == 1 else None, out_features=6)
    return HS.flood_counter(ctx).count


def test_every_cross_term_is_counted():
    """Each party counts what it floods: the client one cross term of the shared product,
    the server the other one and the linear layer's."""
    c0, c1 = run_inprocess(_count_party, timeout=300)
    wide = dict(max_noise_terms=float(_max_terms(HS.TWOPC_BFV_WIDE, 2.0 ** 58)), in_ct_bytes=4 * 16384 * 8,
                op_scale=8 / 3)
    p = L.plan_blocks(5, 4, 3, 16384, 2, **wide)
    q = L.plan_blocks(3, 8, 6, 8192, 1, max_noise_terms=float(_max_terms(HS.TWOPC_BFV, 2.0 ** 19)))
    assert c0 == p.out_cts * p.mw * p.ow
    assert c1 == c0 + q.out_cts * q.mw * q.ow


def _noise_party(ctx, flood, wide):
    """Encryptor: the noise budget left in one result (all of c0 sent, before the switch)."""
    import tenseal.sealapi as seal

    from cipherlm.he import serialize

    he = HS.he_session_wide(ctx) if wide else HS.he_session(ctx)
    plan = L.plan_blocks(2, 8, 4, he.n)
    if ctx.party == 0:
        ctx.send({"cts": he.encrypt_polys(L._pack_lhs(plan, np.zeros((1, 2, 8), np.uint64)).reshape(-1, he.n))})
        reply = ctx.recv()
        arr = np.stack([reply["c0"], reply["c1"]])
        ct = serialize.numpy_to_ciphertext(he.he, arr, parms_id=he.top, is_ntt_form=False)
        return he.keys._decryptor.invariant_noise_budget(ct)
    if not flood:
        he.flood_bound = lambda bound: 1
    ct = he.load_input(bytes(ctx.recv()["cts"][0]))
    acc = seal.Ciphertext()
    mag = (1 << 58) if wide else 3
    w = np.random.default_rng(1).integers(-mag, mag, he.n)
    he.he.evaluator.multiply_plain(ct, he.encode_plain(w), acc)
    c1, c0, _ = he.finish(acc, np.arange(he.n), L.noise_bound(he.n, mag), send_level=he.top)
    ctx.send({"c1": c1, "c0": c0})
    return None


@pytest.mark.parametrize("wide", [False, True], ids=["n8192", "n16384-share-operand"])
def test_flooding_is_session_wide_and_results_decrypt(wide):
    """The flooding costs >= FLOOD_SIGMA bits of noise budget (a share operand's too,
    in the wide set) and the flooded result still decrypts."""
    budgets = [run_inprocess(_noise_party, args0=(f, wide), args1=(f, wide), timeout=300)[0] for f in (False, True)]
    assert budgets[0] - budgets[1] >= HS.FLOOD_SIGMA, budgets
    assert budgets[1] > 0, budgets
