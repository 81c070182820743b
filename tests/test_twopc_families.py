"""Every dense decoder family in the 2pc mode from its graph (the MoE families: test_twopc_moe.py;
BERT: test_twopc.py), against the plaintext executor on the same weights: Llama with tied
embeddings and biases, Qwen2 (qkv bias), Mistral (sliding window, shorter than the prompt),
GPT-2 (LayerNorm, fused c_attn split, learned positions, GeLU). DeepSeek-V3 is refused."""

import numpy as np
import pytest

from _hf_oracle import build_hf, torch_setup
from cipherlm.models import normalize_weights
from cipherlm.mpc.runner import run_inprocess
from cipherlm.runtime import twopc
from cipherlm.runtime.twopc_executors import make_twopc_executor
from test_compile_graph import _cases
from test_twopc import LOGIT_TOL, plain_decoder

torch_setup()

FAMILIES = ["llama_tied_bias", "qwen2", "mistral", "gpt2"]


@pytest.mark.parametrize("name", FAMILIES)
def test_decoder_family_matches_plaintext(name):
    cfg, cls = _cases()[name]
    _, w = build_hf(cfg, cls, seed=FAMILIES.index(name) + 11)
    config = cfg.to_dict()
    w = normalize_weights(config, w)
    sw = twopc.server_weights(config, w)
    plan = twopc.public_plan(config, sw, embedding="onehot-linear")
    ids = np.array([5, 9, 61, 2, 33, 70])

    def party(ctx):
        ex = make_twopc_executor(ctx, config, sw if ctx.party == 1 else None, plan)
        mine = ids if ctx.party == 0 else None
        cache = ex.new_cache()
        pre = ex.forward(None if mine is None else mine[:5], 5, cache).reveal_float(to=0)
        dec = ex.forward(None if mine is None else mine[5:], 1, cache).reveal_float(to=0)
        return pre, dec

    (pre, dec), (none, _) = run_inprocess(party, timeout=600)
    ref = plain_decoder(config, w).forward(ids)
    assert none is None
    assert np.abs(pre - ref[:5]).max() < LOGIT_TOL, name
    assert np.abs(dec - ref[5:]).max() < LOGIT_TOL, name


def test_deepseek_v3_is_refused_clearly():
    cfg, _ = _cases()["deepseek_v3"]
    with pytest.raises(twopc.TwoPCError, match="deepseek_v3"):
        twopc.model_kind(cfg.to_dict())
