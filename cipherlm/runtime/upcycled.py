"""The sparse-upcycled SmolLM2-MoE fixture, ready to use (issue 5 item 1).

The construction itself (`upcycle`: experts as perturbed copies of the dense
FFN, random routers, the Mixtral-type config), its defaults and its text data
are in the models layer, `cipherlm.models.upcycle` (see its docstring).  What
needs the plaintext executor is here: `router_inputs` records the routers'
calibration data by running the *dense* model, and `upcycled_smollm2` loads
SmolLM2-135M, calibrates and upcycles it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ..models import load_model
from ..models.upcycle import DEFAULTS, calibration_ids, upcycle
from .graph_executor import DecoderExecutor
from .plain import PlainLinear, split_params


def router_inputs(config: dict, weights: dict, ids, layers) -> dict:
    """{layer: (T, d)} inputs of the FFNs of ``layers`` (the post-attention RMSNorm
    outputs) when the dense model runs on ``ids``: the routers' calibration data."""
    client, server = split_params(config, weights)
    plain = PlainLinear(server)
    want = {f"model.layers.{i}.mlp.gate_proj": i for i in layers}
    seen: dict = {}

    class _Recorder:
        def linear(self, x, names):
            if names and names[0] in want:
                seen[want[names[0]]] = np.array(x, np.float64)
            return plain.linear(x, names)

    DecoderExecutor(config, client, _Recorder()).forward(ids)
    return seen


def upcycled_smollm2(calibrate: bool = True, **kw):
    """`cipherlm.models.LoadedModel`-like object of the upcycled SmolLM2-135M (tokenizer kept);
    ``kw`` overrides `cipherlm.models.upcycle.DEFAULTS`."""
    lm = load_model("smollm2-135m")
    opts = {**DEFAULTS, **kw}
    calib = None
    if calibrate:
        L = lm.config["num_hidden_layers"]
        layers = opts.get("layers") or range(0, L, opts["every"])
        calib = router_inputs(lm.config, lm.weights, calibration_ids(lm.tokenizer), layers)
    cfg, w = upcycle(lm.config, lm.weights, calib=calib, **opts)
    return SimpleNamespace(name="smollm2-135m-upcycled", config=cfg, weights=w, tokenizer=lm.tokenizer)


__all__ = ["router_inputs", "upcycled_smollm2"]
