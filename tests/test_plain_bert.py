"""BERT encoder executor vs transformers' BertModel (random weights), pooling, classifier head."""

import numpy as np

from _hf_oracle import build_hf, rel_err, torch_setup
from cipherlm.models import normalize_weights
from cipherlm.runtime.meter import Meter
from cipherlm.runtime.plain import EncoderExecutor, PlainLinear, split_params

torch = torch_setup()
import transformers as T  # noqa: E402


def _model(prefixed=False):
    cfg = T.BertConfig(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=96, max_position_embeddings=64, initializer_range=0.1)
    cfg._attn_implementation = "eager"
    model, w = build_hf(cfg, T.BertModel, seed=5)
    if prefixed:
        w = {"bert." + k: v for k, v in w.items()}
    config = cfg.to_dict()
    return model, config, normalize_weights(config, w)


def test_bert_hidden_pooler_and_mask_match_hf():
    model, config, w = _model(prefixed=True)  # checkpoint keys with "bert." are normalised
    assert "embeddings.word_embeddings.weight" in w
    client, server = split_params(config, w)
    assert "encoder.layer.0.attention.self.query" in server and "pooler.dense" in server
    timer = Meter()
    ex = EncoderExecutor(config, client, PlainLinear(server, dtype=np.float64), profiler=timer)
    ids = np.array([[2, 17, 33, 90, 5, 3, 0, 0], [2, 8, 9, 10, 11, 12, 13, 3]])
    mask = np.array([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8])
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask))
    ref = out.last_hidden_state.double().numpy()
    hid = ex.forward(ids, mask)
    assert rel_err(hid[0, :6], ref[0, :6]) < 1e-4
    assert rel_err(hid[1], ref[1]) < 1e-4
    assert rel_err(ex.pooled(hid), out.pooler_output.double().numpy()) < 1e-4
    # padding does not change the unpadded sentence
    assert rel_err(ex.forward(ids[0, :6]), hid[0, :6]) < 1e-9
    emb = ex.sentence_embedding(ids, mask)
    m = mask[..., None]
    ref_emb = (ref * m).sum(1) / m.sum(1)
    ref_emb /= np.linalg.norm(ref_emb, axis=-1, keepdims=True)
    assert rel_err(emb, ref_emb) < 1e-4
    assert np.allclose(np.linalg.norm(emb, axis=-1), 1.0)
    for op in ("embedding", "norm", "linear", "attention_matmul", "softmax", "activation"):
        assert timer.seconds[op] > 0


def test_classifier_head_is_a_server_linear():
    model, config, w = _model()
    client, server = split_params(config, w)
    rng = np.random.default_rng(0)
    W, b = rng.normal(size=(2, 48)).astype(np.float32), rng.normal(size=2).astype(np.float32)
    server["classifier"] = (W, b)
    ex = EncoderExecutor(config, client, PlainLinear(server, dtype=np.float64))
    ids = np.array([[2, 5, 6, 3]])
    logits = ex.classify(ids)
    assert logits.shape == (1, 2)
    assert np.allclose(logits, ex.sentence_embedding(ids) @ W.T + b, atol=1e-5)
