"""Per-block CKKS parameters of BLB's fused blocks (issue 16 item 2, `passes.blb_params`):
every set is 128-bit secure by the HE-standard check and meets its error target under the
noise model, and the noise model bounds what Lattigo measures at such parameters."""

import math

import numpy as np
import pytest
import transformers as T

from cipherlm.compile import bind, build_graph
from cipherlm.compile.passes import blb_fusion, blb_params as bp
from cipherlm.he.errors import HEError
from cipherlm.he.params import HES_128_CLASSIC_MAX_LOGQ, HEParams, check_security

from test_blb_fusion import _BERT, _MINILM

_LLAMA = dict(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
_GPT2 = dict(vocab_size=120, n_embd=48, n_layer=2, n_head=4, n_positions=64)


def _configs():
    return {"bert": T.BertConfig(**_BERT).to_dict(), "minilm": T.BertConfig(**_MINILM).to_dict(),
            "llama": T.LlamaConfig(**_LLAMA).to_dict(), "gpt2": T.GPT2Config(**_GPT2).to_dict()}


@pytest.mark.parametrize("name", ["bert", "minilm", "llama", "gpt2"])
def test_every_block_secure_and_within_target(name):
    g = blb_fusion.run(build_graph(_configs()[name]))
    params = bp.run(g, tokens=16)
    blocks = {b["id"]: b for b in g.meta["blb_blocks"]}
    assert [p.block for p in params] == sorted(blocks)
    prod = g.producers()
    for p in params:
        b = blocks[p.block]
        fused = bp.block_fused(g, b, "auto", 16)  # section 5's packing: every attention block (causal too)
        assert fused == (bp.block_attention(g, b) is not None)
        depth = blb_fusion.block_depth([g.node(n) for n in b["nodes"]], prod, fused=fused)[0]
        assert p.depth == depth and len(p.chain) == len(p.output_primes) + p.depth
        assert depth == b["depth"] or fused
        assert p.chain[len(p.output_primes):] == (p.scale_bits,) * p.depth
        assert sum(p.output_primes) >= p.scale_bits + bp.OUT_VALUE_BITS + 2
        assert max(p.chain + p.special) <= 60
        assert p.log_qp <= HES_128_CLASSIC_MAX_LOGQ[p.ring_degree]
        check_security(p.he_params)
        assert p.predicted_std <= p.target
        # the scale is the smallest that meets the target at this ring degree
        if p.scale_bits > bp.MIN_SCALE_BITS:
            err = bp.block_error(g, b, bp.NoiseModel(p.ring_degree, p.scale_bits - 1), tokens=16, fused=fused)
            assert err > p.target


def test_attention_packing_choice_and_fused_depth():
    """"auto" takes the packing that converts fewer ciphertexts (`attention_cts`): the rows at a
    few tokens, section 5's from a few dozen; the fused product's depth is the protocol's
    (`blb_matmul.counts`: 4 from fresh operands, the paper's)."""
    from cipherlm.protocols.ckks import blb_matmul

    assert bp.attention_packing("auto", 4, 12, 64) == "rows"
    assert bp.attention_packing("auto", 128, 12, 64) == "fused"
    assert bp.attention_packing("rows", 128, 12, 64) == "rows"
    # BERT-base at 128 tokens: the pair grid converts 4112 ciphertexts per layer, section 5's 209
    assert (bp.attention_cts("rows", 128, 12, 64), bp.attention_cts("fused", 128, 12, 64)) == (4112, 209)
    with pytest.raises(ValueError, match="attention packing"):
        bp.attention_packing("diagonal", 8, 4, 16)
    assert blb_fusion.FUSED_MATMUL_DEPTH == blb_matmul.counts(8192, 12, 128, 64)["depth"] == 4
    assert blb_fusion.fused_matmul_depth(1, 0) == 4 and blb_fusion.fused_matmul_depth(2, 0) == 5


def test_deeper_blocks_need_more_modulus():
    def needs_2_to_the_30(m):  # an error that meets the target from Delta = 2^30 on, at any N
        return 2.0 ** (30 - m.scale_bits) / bp.SIGMAS * 2.0 ** -17

    small, deep = bp.choose_params(2, needs_2_to_the_30), bp.choose_params(9, needs_2_to_the_30)
    assert small.scale_bits == deep.scale_bits == 30
    assert deep.log_qp == small.log_qp + 7 * 30
    assert (small.ring_degree, deep.ring_degree) == (8192, 16384)


def test_no_secure_parameters_is_a_clear_error():
    with pytest.raises(HEError, match="no secure CKKS parameters"):
        bp.choose_params(60, lambda m: 1e-12, block=7)
    with pytest.raises(HEError, match="no scale"):
        bp.choose_params(2, lambda m: 1.0)


def test_output_modulus_holds_the_mpc_range():
    assert bp.output_primes(30) == (52,)
    assert bp.output_primes(40) == (60, 40)
    with pytest.raises(ValueError):
        bp.run(build_graph(_configs()["bert"]))


def test_real_weights_give_secure_parameters():
    """MiniLM-L6 with its real weights (when installed): the projections' real row norms."""
    from cipherlm.models import list_models, load_model

    if "minilm-l6" not in {m["name"] for m in list_models() if m["available"]}:
        pytest.skip("minilm-l6 not installed")
    lm = load_model("minilm-l6")
    g0 = build_graph(lm.config)
    g = blb_fusion.run(g0)
    gains = bp.gains_of(g, bind(g0, lm.weights))
    assert all(v > 0 for v in gains.values()) and any(n.startswith("L0.") for n in gains)
    params = bp.run(g, params=bind(g0, lm.weights))
    for p in params:
        check_security(p.he_params)
        assert p.predicted_std <= p.target and p.ring_degree <= 32768


# ------------------------------------------------------------------ the noise model against Lattigo
lattigo = pytest.importorskip("cipherlm.he.lattigo_backend")


@pytest.fixture(scope="module")
def lg():
    if not lattigo.available():
        pytest.skip(lattigo.unavailable_reason())
    n, s = 16384, 35
    ctx = lattigo.LattigoContext(HEParams("blb-noise-check", "ckks", n, bp.output_primes(s) + (s,) * 3 + (60,)))
    be = lattigo.LattigoBackend()
    keys = be.keygen(ctx)
    evk = keys.eval_keys(relin=True, steps=[1 << i for i in range(6)])
    return ctx, be, keys, evk, bp.NoiseModel(n, s, 6)


def test_noise_model_bounds_lattigo(lg):
    """Each rule of the model against a measurement at N = 16384, s = 35, |x| <= 2^6 (values at
    the magnitude the model assumes): measured max error over the 8192 slots <= the predicted
    max (16 sigma) <= 24 x measured."""
    ctx, be, keys, evk, m = lg
    rng = np.random.default_rng(5)
    S = ctx.slots
    x, w = rng.uniform(-m.a, m.a, S), rng.uniform(-1, 1, S)

    def enc(v):
        return keys.encrypt(be.encode_slots(ctx, v, scale_bits=m.scale_bits))

    def err(ct, ref, k=S):
        return float(np.abs(be.decode_slots(ctx, keys.decrypt(ct))[:k] - ref[:k]).max())

    def check(measured, sigma):
        assert measured <= bp.SIGMAS * sigma <= 24 * measured, (measured, bp.SIGMAS * sigma)

    ct = enc(x)
    check(err(ct, x), m.input())
    pt = be.encode_slots(ctx, w, level=ct.level, scale_bits=math.log2(ctx.q_moduli[ct.level]))
    c1 = be.multiply_plain(ctx, ct, pt)
    be.rescale_inplace(ctx, c1)
    s1 = m.plain_product(m.input(), 1.0)
    check(err(c1, x * w), s1)
    c2 = be.multiply(ctx, c1, c1, evk)
    be.rescale_inplace(ctx, c2)
    s2 = m.ct_product(s1, s1, m.a, m.a)
    check(err(c2, (x * w) ** 2), s2)
    for i in range(6):
        be.add_inplace(ctx, c2, be.rotate_rows(ctx, c2, 1 << i, evk))
    ref = sum(np.roll((x * w) ** 2, -k) for k in range(64))
    check(err(c2, ref, S - 64), m.rotate_sum(s2, 64))
    # softmax's squarings: values <= 1, three levels
    y = rng.uniform(0, 1, S)
    cy, sy = enc(y), m.input()
    for _ in range(3):
        cy = be.multiply(ctx, cy, cy, evk)
        be.rescale_inplace(ctx, cy)
        y, sy = y * y, m.ct_product(sy, sy, 1.0, 1.0)
    check(err(cy, y), sy)


def test_chosen_parameters_build_on_lattigo():
    if not lattigo.available():
        pytest.skip(lattigo.unavailable_reason())
    g = blb_fusion.run(build_graph(_configs()["minilm"]))
    p = max(bp.run(g, tokens=16), key=lambda q: q.log_qp)
    ctx = lattigo.LattigoContext(p.he_params)  # checks the primes Lattigo picked against the table
    assert ctx.n == p.ring_degree and ctx.max_level == len(p.chain) - 1


def test_shared_sets_cover_every_block_and_stay_secure():
    """`share_sets`: fewer distinct sets (MiniLM's 11 -> 3 at 8 tokens), each block on a set
    with at least its scale and its depth above its output primes, every set 128-bit secure."""
    from cipherlm.models.loader import load_model

    m = load_model("minilm-l6")
    g0 = build_graph(m.config)
    g = blb_fusion.run(g0)
    own = bp.run(g, params=bind(g0, m.weights), tokens=8)
    shared = bp.share_sets(own)
    sets = {(p.ring_degree, p.chain) for p in shared}
    assert len(sets) < len({(p.ring_degree, p.chain) for p in own})
    for a, b in zip(own, shared):
        assert (b.block, b.depth, b.ring_degree) == (a.block, a.depth, a.ring_degree)
        assert b.scale_bits >= a.scale_bits
        assert len(b.chain) - len(b.output_primes) >= a.depth
        assert sum(b.chain) + sum(b.special) <= HES_128_CLASSIC_MAX_LOGQ[b.ring_degree] - 1
        check_security(b.he_params)
