"""Every model family in the offload mode from its graph, over TCP, against the plaintext
executor on the same weights (small random Hugging Face models saved to disk, the
table of tests/test_compile_graph.py): the server evaluates each projection group on
CKKS ciphertexts, the client walks the graph."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from _hf_oracle import torch_setup
from test_compile_graph import _cases

torch = torch_setup()

from cipherlm.runtime.offload_client import OffloadClient  # noqa: E402
from cipherlm.runtime.offload_server import ModelHost, OffloadServer  # noqa: E402

FAMILIES = ["gpt2", "qwen2", "mistral", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "bert"]


def _bert_case():
    import transformers as T

    return T.BertConfig(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=96, max_position_embeddings=64, initializer_range=0.1), T.BertModel


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("CIPHERLM_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


@pytest.mark.parametrize("name", FAMILIES)
def test_family_offload_matches_plaintext(name, tmp_path, cache_dir):
    from cipherlm.models import load_model
    from cipherlm.runtime.plain import PlainLinear, make_executor, split_params

    cfg, cls = _bert_case() if name == "bert" else _cases()[name]
    torch.manual_seed(FAMILIES.index(name))
    model = cls(cfg).eval()
    model.save_pretrained(tmp_path)
    lm = load_model(str(tmp_path))
    cp, sl = split_params(lm.config, lm.weights)
    ref_ex = make_executor(lm.config, cp, PlainLinear(sl, dtype=np.float64))
    ids = np.array([3, 17, 42, 5, 9, 30])
    srv = OffloadServer(ModelHost(str(tmp_path)), "127.0.0.1", 0, session_timeout=60.0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        with OffloadClient(*srv.address) as client:
            ex = client.executor()
            if name == "bert":
                got, ref = ex.forward(ids[None]), ref_ex.forward(ids[None])
            else:
                got, ref = ex.forward(ids, ex.new_cache()), ref_ex.forward(ids, ref_ex.new_cache())
    finally:
        srv.shutdown()
    err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert err < 1e-4, (name, err)
