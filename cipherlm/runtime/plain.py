"""Plaintext reference pieces (numpy): the oracle of every private mode.

Every model runs from its graph (`cipherlm.compile`, walked by
`cipherlm.runtime.graph_executor`); `make_executor(config, client_params, backend)`
returns that executor (`DecoderExecutor` / `EncoderExecutor`, also importable from
here). This module holds what the executors and the private modes share (the first
two items are defined next to the graph walk, in runtime/graph_executor.py, and
re-exported here):

* `split_params`: the client-side parameters (embeddings, position embeddings, norms,
  q/k norms, router biases) and the server linears (every projection, the MoE routers
  and experts, the pooler, a "classifier" head, "lm_head");
* `LinearBackend` / `PlainLinear`: the projections, in the clear (float32 by default,
  the weights' precision, or float64 when asked); a private mode swaps the backend;
* `KVCache`, `sample_next` (greedy / temperature / top-k / top-p). (Every mode reads
  a config through the architecture table, `cipherlm.compile.arch`: no config parsing
  here.)

Operator classes, for profiling: `cipherlm.compile.ir.OP_CLASSES` (every mode's
vocabulary: embedding, linear, norm, rope, attention_matmul, softmax, activation, moe,
sampling, ...). A profiler is any object
with `add_seconds(op_class, seconds)` (e.g. `cipherlm.report.RunReport`, `runtime.meter.Meter`)
or a callable `(op_class, seconds)`.
"""

from __future__ import annotations

import re

import numpy as np

from cipherlm.compile import FAMILIES

from .graph_executor import (  # noqa: F401  (re-exported: the executors and their plain pieces)
    DecoderExecutor, EncoderExecutor, GraphExecutor, KVCache, LinearBackend, PlainLinear, sample_next,
)

from cipherlm.compile.ir import OP_CLASSES  # noqa: E402,F401  (the one vocabulary of every mode)

DECODER_TYPES = ("llama", "mistral", "qwen2", "gpt2", "qwen2_moe", "olmoe", "mixtral")
ENCODER_TYPES = ("bert",)
MOE_TYPES = ("qwen2_moe", "olmoe", "mixtral")


# --------------------------------------------------------------------------- profiling


# --------------------------------------------------------------------------- params


def _gpt2_conv1d(name: str) -> bool:
    return bool(re.search(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj|attn\.q_attn)\.weight$", name))


def split_params(config: dict, weights: dict[str, np.ndarray]):
    """(client_params, server_linears).

    client_params: embeddings, position embeddings, norms (incl. OLMoE q/k norms).
    server_linears: {prefix: (W (d_out, d_in) float32, b or None)} for every projection,
    the MoE routers (`...mlp.gate`, `...mlp.shared_expert_gate`), each expert
    (`...mlp.experts.{e}.gate_proj/up_proj/down_proj`), the pooler, a "classifier" head,
    and "lm_head" (the embedding matrix itself when tied). GPT-2 Conv1D weights are
    transposed to (d_out, d_in).
    """
    mt = config.get("model_type", "")
    client: dict[str, np.ndarray] = {}
    server: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
    embed_names = {
        "model.embed_tokens.weight",
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
    }
    tie = lm_head_tied(config)
    for name, w in weights.items():
        if name == "lm_head.weight":
            continue
        if name in embed_names:
            client[name] = w
            continue
        m = re.match(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if m and w.ndim == 3:
            base = m.group(1)
            for e in range(w.shape[0]):
                if m.group(2) == "gate_up_proj":
                    half = w.shape[1] // 2
                    server[f"{base}.{e}.gate_proj"] = (w[e, :half], None)
                    server[f"{base}.{e}.up_proj"] = (w[e, half:], None)
                else:
                    server[f"{base}.{e}.down_proj"] = (w[e], None)
            continue
        if name.endswith(".weight") and w.ndim == 2:
            prefix = name[: -len(".weight")]
            bias = weights.get(prefix + ".bias")
            if mt == "gpt2" and _gpt2_conv1d(name):
                w = np.ascontiguousarray(w.T)
            server[prefix] = (w, bias)
            continue
        if name.endswith(".bias") and weights.get(name[: -len(".bias")] + ".weight") is not None and \
                weights[name[: -len(".bias")] + ".weight"].ndim == 2:
            continue  # bias of a server linear
        client[name] = w
    if mt in DECODER_TYPES or getattr(FAMILIES.get(mt), "kind", None) == "decoder":
        emb = weights["transformer.wte.weight"] if mt == "gpt2" else weights["model.embed_tokens.weight"]
        head = weights.get("lm_head.weight")
        if tie or head is None:
            head = emb
        server["lm_head"] = (head, weights.get("lm_head.bias"))
    return client, server


def tied_head_tensor(client_params: dict, server_linears: dict) -> str | None:
    """The client tensor that is a decoder's LM head (`split_params` serves the embedding matrix
    itself as "lm_head" when the head is tied: the same array, no bias), or None."""
    head = server_linears.get("lm_head")
    if head is None or head[1] is not None:
        return None
    return next((name for name, w in client_params.items() if w is head[0]), None)


def lm_head_tied(config: dict) -> bool:
    """Whether the config ties the LM head to the token embeddings (`split_params`'s rule; a
    checkpoint without ``lm_head.weight`` is tied as well, which only its weights show)."""
    return bool(config.get("tie_word_embeddings", config.get("model_type", "") == "gpt2"))


# --------------------------------------------------------------------------- factories


def make_executor(config: dict, client_params: dict, backend: LinearBackend, profiler=None):
    """The model graph's executor (`cipherlm.runtime.graph_executor`: `DecoderExecutor` or
    `EncoderExecutor` for the config's model_type) over `backend`'s projections."""
    if config.get("model_type") in ENCODER_TYPES:
        return EncoderExecutor(config, client_params, backend, profiler=profiler)
    return DecoderExecutor(config, client_params, backend, profiler=profiler)


def plain_executor(lm, profiler=None, dtype=np.float32):
    """Executor with a PlainLinear backend for a LoadedModel (or anything with .config/.weights)."""
    client, server = split_params(lm.config, lm.weights)
    return make_executor(lm.config, client, PlainLinear(server, dtype=dtype), profiler=profiler)


def polarity_classifier(lm=None, profiler=None, retrain: bool = False):
    """(executor, tokenizer, probe): MiniLM encoder whose server linears include the
    polarity probe as the "classifier" head (`executor.classify(ids, mask)`)."""
    from cipherlm.models import load_model
    from cipherlm.models.probe import get_polarity_probe

    lm = lm or load_model("minilm-l6")
    client, server = split_params(lm.config, lm.weights)
    backend = PlainLinear(server)
    base = EncoderExecutor(lm.config, client, backend)
    probe = get_polarity_probe(lambda texts: base.embed_texts(lm.tokenizer, texts), model_name=lm.name,
                               retrain=retrain)
    server = dict(server) | probe.as_linear()
    ex = EncoderExecutor(lm.config, client, PlainLinear(server), profiler=profiler)
    return ex, lm.tokenizer, probe
