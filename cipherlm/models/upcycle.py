"""Sparse-upcycled SmolLM2-MoE: the real-weight MoE *test fixture* of issue 5 item 1.

No pretrained MoE checkpoint is available offline, so a Mixtral-type MoE is made
from SmolLM2-135M (Llama architecture) by sparse upcycling (Komatsuzaki et al.
2023).  It is a fixture for checking routing and the private protocols on real
weights and real activations; it makes **no claim about quality**.

This module (models layer) holds the construction, its defaults and its public
text data; the ready-made fixture `upcycled_smollm2` and the router calibration
`router_inputs` run the dense model through the plaintext executor, so they live
one layer up, in `cipherlm.runtime.upcycled`.

Construction (`upcycle`, deterministic for a given seed; all randomness from
``numpy.random.default_rng(seed)``, public fixture data, nothing secret):

1. Every tensor of the dense model is kept as is (attention, norms, embeddings,
   tied LM head).
2. In each MoE layer L (default every third layer: 0, 3, ..., 27; the others keep
   their dense FFN), the FFN (gate_proj, up_proj, down_proj) is copied into n
   experts (default 8).  Expert e's copy of a weight matrix W is
   W + noise * std(W) * G, G standard normal drawn independently per expert and
   per matrix (default noise = 0.01, i.e. 1 % of the matrix's own spread).
3. The router of layer L is an (n, d) matrix of random directions g_e (standard
   normal).  With calibration hidden states H_L (the router's input, i.e. the
   post-attention RMSNorm output of layer L, recorded by running the *dense*
   model on a calibration text, `cipherlm.runtime.upcycled.router_inputs`;
   `upcycled_smollm2` uses the first 256 tokens (`calibration_ids`) of
   gensim's news corpus ``lee_background.cor``, disjoint from the Wikipedia
   evaluation prompts), each g_e is first made orthogonal to the mean of H_L
   (otherwise the common direction of all hidden states sends most tokens to
   the same experts) and scaled so that the logits g_e . h have standard
   deviation router_scale over the calibration tokens.  Without calibration
   data: rows router_scale * g_e / ||g_e|| / rms(gamma_L), gamma_L the norm's
   weight (logit std about router_scale for isotropic inputs).  Default
   router_scale = 2.0.
4. The config becomes ``model_type = "mixtral"`` (softmax over n, top-k, the k
   weights renormalised to sum to one; default k = 2) with ``mlp_only_layers``
   listing the dense layers (honoured by cipherlm's plaintext executor), and
   ``cipherlm_upcycle`` recording the parameters.

Because all experts of a layer are near-copies of the same FFN and Mixtral
renormalises the top-k weights, the upcycled model computes nearly the dense
model's function; routing decisions are still real (they depend on the
hidden states through a fixed random router).  Memory: about 85 MB per MoE
layer for n = 8 (float32).

`wiki_prompts` gives the fixed text for the routing ablation: the first
characters of the shipped Wikipedia pages (gensim's test data), crudely cleaned
of wiki markup.
"""

from __future__ import annotations

import bz2
import importlib.util
import re
from pathlib import Path

import numpy as np

DEFAULTS = dict(n_experts=8, top_k=2, every=3, noise=0.01, router_scale=2.0, seed=0)


def upcycle(config: dict, weights: dict, *, n_experts: int = 8, top_k: int = 2, layers=None, every: int = 3,
            noise: float = 0.01, router_scale: float = 2.0, seed: int = 0,
            calib: dict | None = None) -> tuple[dict, dict]:
    """(config, weights) of the upcycled Mixtral-type model (module docstring).

    ``layers``: the MoE layer indices (default every ``every``-th layer from 0);
    ``calib``: {layer: (T, d) router inputs of the dense model} for the router scaling."""
    if config.get("model_type") not in ("llama", "mistral"):
        raise ValueError(f"upcycling expects a Llama/Mistral model, got model_type {config.get('model_type')!r}")
    L = int(config["num_hidden_layers"])
    d = int(config["hidden_size"])
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"need 1 <= top_k <= n_experts, got top_k={top_k}, n_experts={n_experts}")
    if noise < 0 or router_scale <= 0 or every < 1:
        raise ValueError("need noise >= 0, router_scale > 0 and every >= 1")
    moe = sorted(set(range(0, L, every) if layers is None else (int(i) for i in layers)))
    if any(not 0 <= i < L for i in moe):
        raise ValueError(f"MoE layers must lie in [0, {L})")
    rng = np.random.default_rng(seed)
    out = {k: v for k, v in weights.items()
           if not any(k.startswith(f"model.layers.{i}.mlp.") for i in moe)}
    for i in moe:
        p = f"model.layers.{i}.mlp"
        for e in range(n_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                W = np.asarray(weights[f"{p}.{proj}.weight"], np.float32)
                G = rng.standard_normal(W.shape, dtype=np.float32)
                out[f"{p}.experts.{e}.{proj}.weight"] = W + np.float32(noise * W.std()) * G
        g = rng.standard_normal((n_experts, d))
        if calib is not None and i in calib:
            H = np.asarray(calib[i], np.float64)
            mu = H.mean(axis=0)
            u = mu / (np.linalg.norm(mu) or 1.0)
            g = g - np.outer(g @ u, u)                      # orthogonal to the mean hidden state
            std = (H @ g.T).std(axis=0)
            router = router_scale * g / np.where(std > 0, std, 1.0)[:, None]
        else:
            gamma = np.asarray(weights[f"model.layers.{i}.post_attention_layernorm.weight"], np.float64)
            rms = float(np.sqrt(np.mean(gamma ** 2))) or 1.0
            router = router_scale * g / np.linalg.norm(g, axis=1, keepdims=True) / rms
        out[f"{p}.gate.weight"] = router.astype(np.float32)
    cfg = dict(config)
    cfg.update(model_type="mixtral", num_local_experts=int(n_experts), num_experts_per_tok=int(top_k),
               mlp_only_layers=[i for i in range(L) if i not in moe], sliding_window=None,
               router_jitter_noise=0.0, output_router_logits=False,
               architectures=["MixtralForCausalLM"],
               cipherlm_upcycle=dict(source=config.get("_name_or_path") or config.get("model_type"),
                                     n_experts=int(n_experts), top_k=int(top_k), moe_layers=moe,
                                     noise=float(noise), router_scale=float(router_scale), seed=int(seed),
                                     calibrated=calib is not None))
    return cfg, out


def calibration_ids(tokenizer, tokens: int = 256) -> list[int]:
    """The first ``tokens`` tokens of gensim's news corpus lee_background.cor."""
    path = _wiki_path().parent / "lee_background.cor"
    text = path.read_text(encoding="latin-1")[: 8 * tokens]
    return tokenizer.encode(text).ids[:tokens]


def _wiki_path() -> Path:
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the gensim wheel (test data with Wikipedia pages) is not installed")
    d = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data"
    hits = sorted(d.glob("enwiki-*shortened.bz2"))
    if not hits:
        raise FileNotFoundError(f"no enwiki-*-shortened.bz2 under {d}")
    return hits[0]


def _clean(text: str) -> str:
    for _ in range(3):
        text = re.sub(r"\{\{[^{}]*\}\}", " ", text)              # templates
    text = re.sub(r"<ref[^>]*/>|<ref[^>]*>.*?</ref>", " ", text, flags=re.S)
    text = re.sub(r"<[^>]+>", " ", text)
    text = re.sub(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]", r"\1", text)  # [[a|b]] -> b
    text = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", text)
    text = re.sub(r"'{2,}|={2,}|&[a-z]+;", " ", text)
    text = re.sub(r"\{\|.*?\|\}", " ", text, flags=re.S)          # tables
    return re.sub(r"\s+", " ", text).strip()


def wiki_prompts(count: int = 16, chars: int = 400) -> list[str]:
    """The first ``chars`` characters of the first ``count`` article pages with at least
    that much clean text (file order; deterministic)."""
    raw = bz2.open(_wiki_path(), "rt", encoding="utf-8").read()
    out = []
    for m in re.finditer(r"<text[^>]*>(.*?)</text>", raw, flags=re.S):
        body = m.group(1)
        if body.lstrip().upper().startswith("#REDIRECT"):
            continue
        body = body.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&amp;", "&")
        t = _clean(body)
        if len(t) >= chars:
            out.append(t[:chars])
        if len(out) == count:
            break
    return out


__all__ = ["upcycle", "calibration_ids", "wiki_prompts", "DEFAULTS"]
