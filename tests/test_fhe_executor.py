"""The fhe backend of the graph executor (cipherlm/runtime/fhe_executor.py) against the plain
executor on small random configs of the BERT and Llama families, at the INSECURE N = 2^10
test preset: the client embeds and encrypts, the server walks every other node on
ciphertexts (bootstrapping where levels run out), the client decrypts."""

from __future__ import annotations

import numpy as np
import pytest

from cipherlm.he.errors import HEError
from cipherlm.he.lattigo_backend import available
from cipherlm.protocols.ckks.evaluator import CkksEvaluator, CkksTensor

pytestmark = pytest.mark.skipif(not available(), reason="the Lattigo library is not built (make lattigo)")


@pytest.fixture(scope="module")
def keys(ckks_toy_keys):
    return ckks_toy_keys


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory) -> str:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny-bert")
    transformers.BertModel(cfg).eval().save_pretrained(path)
    return str(path)


def _session(keys, model, T, max_tokens):
    be, ctx, sk, bk = keys
    P = model.packing(ctx.slots, T, max_tokens)
    ek = sk.eval_keys(relin=True, steps=model.rotation_steps(model.packing(ctx.slots, max_tokens)))
    return P, CkksEvaluator(be, ctx, ek, bk)


def _encrypt(keys, model, P, ids, positions=None):
    from cipherlm.runtime.fhe_executor import client_embedding, client_tensors

    be, ctx, sk, _ = keys
    x = client_embedding(model.graph, client_tensors(model), ids, positions=positions)
    return CkksTensor([sk.encrypt(be.encode_slots(ctx, r)) for r in P.pack(x)], x.shape[1], P,
                      model.bound(model.input_value))


def _slots(keys, t):
    be, ctx, sk, _ = keys
    return np.stack([be.decode_slots(ctx, sk.decrypt(c)) for c in t.cts]).reshape(-1, t.packing.tp)


def test_bert_hidden_and_classifier(keys, tiny_bert_dir):
    from cipherlm.models import load_model
    from cipherlm.runtime.fhe_executor import calibrated_model, client_nodes
    from cipherlm.runtime.plain import plain_executor

    lm = load_model(tiny_bert_dir)
    rng = np.random.default_rng(2)
    W, b = rng.normal(size=(2, 32)), rng.normal(size=2) * 0.1
    model = calibrated_model(lm, [rng.integers(0, 100, size=10) for _ in range(4)], classifier=(W, b))
    nodes, value = client_nodes(model.graph)
    assert [n.op for n in nodes] == ["embed", "embed", "embed", "add", "add"] and value == "embed_sum"
    ids = rng.integers(0, 100, size=7)
    P, ev = _session(keys, model, len(ids), 12)
    ex = plain_executor(lm, dtype=np.float64)
    hidden = model.run(ev, _encrypt(keys, model, P, ids))["hidden"]
    got = P.unpack(_slots(keys, hidden).reshape(-1, ev.ctx.slots), hidden.d)
    want = ex.forward(ids)
    assert np.abs(got - want).max() < 2e-2
    assert ev.stats.counts["bootstrap"] > 0 and ev.stats.counts["poly"] > 0
    logits = model.classify(ev, _encrypt(keys, model, P, ids))
    s = _slots(keys, logits)
    want_l = ex.sentence_embedding(ids) @ W.T + b
    assert np.abs(s[:2, 0] - want_l).max() < 1e-2
    s[:2, 0] = 0
    assert np.abs(s).max() < 1e-4  # the result holds the logits and nothing else


def test_llama_logits_and_greedy_tokens(keys, tiny_llama_dir):
    from cipherlm.models import load_model
    from cipherlm.runtime.fhe_executor import calibrated_model
    from cipherlm.runtime.plain import plain_executor

    lm = load_model(tiny_llama_dir)
    rng = np.random.default_rng(3)
    model = calibrated_model(lm, [rng.integers(0, 96, size=12) for _ in range(4)])
    ex = plain_executor(lm, dtype=np.float64)
    ids = list(rng.integers(0, 96, size=5))
    P, ev = _session(keys, model, len(ids), 8)
    out = model.logits(ev, _encrypt(keys, model, P, ids))
    s = _slots(keys, out)
    got = s[: out.d, len(ids) - 1]
    want = ex.forward(ids)[-1]
    assert np.abs(got - want).max() < 5e-3
    assert int(np.argmax(got)) == int(np.argmax(want))
    s[: out.d, len(ids) - 1] = 0
    assert np.abs(s).max() < 1e-4  # only the last position's logits
    # greedy decoding with the encrypted KV cache: a prefill pass, then one token per pass
    P, ev = _session(keys, model, len(ids), 8)
    cache = model.new_cache(ev)
    lg = _slots(keys, model.logits(ev, _encrypt(keys, model, P, ids), cache=cache))[: out.d, len(ids) - 1]
    new = [int(np.argmax(lg))]
    assert cache.length == len(ids) and sorted(cache.k) == [0, 1]
    for step in range(2):
        pos = len(ids) + step
        Pn = model.packing(ev.ctx.slots, 1, 8, offset=pos)
        x = _encrypt(keys, model, Pn, [new[-1]], positions=[pos])
        step_logits = _slots(keys, model.logits(ev, x, cache=cache))
        lg = step_logits[: out.d, pos].copy()
        want = ex.forward(list(ids) + new)[-1]
        assert np.abs(lg - want).max() < 5e-3
        step_logits[: out.d, pos] = 0
        assert np.abs(step_logits).max() < 1e-4
        new.append(int(np.argmax(lg)))
    assert cache.length == len(ids) + 2
    assert new == ex.generate(ids, max_new_tokens=3, eos_token_ids=[])
    with pytest.raises(HEError, match="cache holds"):
        model.logits(ev, _encrypt(keys, model, model.packing(ev.ctx.slots, 1, 8, offset=2), [1], positions=[2]),
                     cache=cache)


def test_unsupported_graphs_are_refused(tiny_llama_dir):
    from cipherlm.models import load_model
    from cipherlm.runtime.fhe_executor import FheModel

    lm = load_model(tiny_llama_dir)
    cfg = dict(lm.config, model_type="gpt2", n_embd=64, n_layer=1, n_head=4, vocab_size=96, n_positions=64)
    from cipherlm.compile import build_graph

    if "split" not in {n.op for n in build_graph(cfg).nodes}:
        pytest.skip("this gpt2 graph has no fused-QKV split")
    with pytest.raises(HEError, match="does not evaluate"):
        FheModel(cfg, lm.weights, {"bounds": {}, "ranges": {}})


def test_pooled_norm_keeps_a_level_for_rsqrt_bootstrap(keys, tiny_bert_dir):
    """Regression (found running MiniLM at 8 tokens on two workers): the pooled sum of
    squares reached rsqrt at level 0 with a bound above LEVEL0_MAX_FACTOR and could not be
    bootstrapped; the pooled mean now keeps the level that bootstrap needs."""
    from cipherlm.models import load_model
    from cipherlm.runtime.fhe_executor import calibrated_model
    from cipherlm.runtime.plain import plain_executor

    lm = load_model(tiny_bert_dir)
    rng = np.random.default_rng(2)
    W, b = rng.normal(size=(2, 32)), rng.normal(size=2) * 0.1
    model = calibrated_model(lm, [rng.integers(0, 100, size=10) for _ in range(4)], classifier=(W, b))
    lo, _hi = model.calibration["ranges"][("pool", "rsqrt")]
    model.calibration["ranges"][("pool", "rsqrt")] = (lo, 60.0)  # as MiniLM's calibration gave
    ids = rng.integers(0, 100, size=7)
    be, ctx, sk, bk = keys
    P, ev = _session(keys, model, len(ids), 12)
    h = plain_executor(lm, dtype=np.float64).forward(ids)
    x = CkksTensor([sk.encrypt(be.encode_slots(ctx, r, level=2)) for r in P.pack(h)], h.shape[1], P,
                   model.bound(model.graph.outputs["hidden"]))
    mean, sums = model.pool_sums(ev, x)
    emb = model.pool_finish(ev, mean, sums)  # refused before the fix
    got = P.unpack(_slots(keys, emb).reshape(-1, ctx.slots), 32)[0]
    m = h.mean(axis=0)
    assert np.abs(got - m / np.linalg.norm(m)).max() < 1e-2


def test_bench_fhe_rows_file_resume(tmp_path):
    """`cipherlm bench fhe --rows-file`: the rows of the same run come back (those sentences are
    skipped); a file of another run (tokens, preset or refresh) is refused, not mixed in."""
    import json

    from cipherlm.bench.fhe import _resumed_rows

    run = {"workload": "minilm", "tokens": 32, "preset": "N16QP1546H192H32", "refresh": "client"}
    f = tmp_path / "rows.json"
    assert _resumed_rows(None, run) == [] and _resumed_rows(f, run) == []
    f.write_text(json.dumps({**run, "rows": [{"sentence": 0}, {"sentence": 3}]}))
    assert [r["sentence"] for r in _resumed_rows(f, run)] == [0, 3]
    for k, v in (("tokens", 16), ("preset", "other"), ("refresh", "bootstrap")):
        with pytest.raises(SystemExit, match="another run"):
            _resumed_rows(f, {**run, k: v})


def test_projections_run_at_the_levels_their_readers_use(keys, tiny_llama_dir):
    """A projection read only by a residual add runs at most one level above the other operand
    (the sum takes the lower level), one the client decrypts at the lowest level it may:
    fewer primes to encode the diagonals at, with the same values."""
    from cipherlm.models import load_model
    from cipherlm.runtime.fhe_executor import calibrated_model
    from cipherlm.runtime.plain import plain_executor

    lm = load_model(tiny_llama_dir)
    rng = np.random.default_rng(3)
    model = calibrated_model(lm, [rng.integers(0, 96, size=12) for _ in range(4)])
    assert model.level_use == {
        "lm_head": "client",
        "model.layers.0.self_attn.o_proj": "embed", "model.layers.0.mlp.down_proj": "L0.attn_res",
        "model.layers.1.self_attn.o_proj": "L0.ffn_res", "model.layers.1.mlp.down_proj": "L1.attn_res"}
    seen = []
    lin_call = type(model.encoded("lm_head", model.packing(512, 5, 8), None)).__call__

    def spy(self, ev, x, bound=1.0, label="linear", out_level=None):
        y = lin_call(self, ev, x, bound, label, out_level)
        seen.append((label, out_level, y.level))
        return y

    ids = list(rng.integers(0, 96, size=5))
    P, ev = _session(keys, model, len(ids), 8)
    mp = pytest.MonkeyPatch()
    mp.setattr(type(model.encoded("lm_head", P, None)), "__call__", spy)
    try:
        out = model.logits(ev, _encrypt(keys, model, P, ids))
    finally:
        mp.undo()
    capped = [(label, cap, level) for label, cap, level in seen if cap is not None]
    assert {label for label, *_ in capped} == set(model.level_use)
    assert all(level <= cap for _label, cap, level in capped)
    assert out.level == 0  # the LM head at the lowest level (bootstrap path: no refresh floor)
    got = _slots(keys, out)[: out.d, len(ids) - 1]
    assert np.abs(got - plain_executor(lm, dtype=np.float64).forward(ids)[-1]).max() < 5e-3
