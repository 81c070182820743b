#!/usr/bin/env python3
"""SmolLM2, real weights: the offload matmul with packed prefill plans (T=2, as the server picks
them) and one-row decode plans, encoded per call in process (low memory: no server holding both
sets of diagonals), against the plaintext executor (issue 15 item 2):

    .venv/bin/python benchmarks/offload_packed_check.py [N_PROMPTS]
"""
import sys, time
import numpy as np
from cipherlm.he import OFFLOAD_CKKS
from cipherlm.he.matmul import make_context, client_keys, plan_matmul, encode_group, encrypt_input, apply, decrypt_output, load_galois_keys
from cipherlm.runtime.offload_engine import packed_plan
from cipherlm.runtime.linear_groups import operator_class
from cipherlm.models import load_model
from cipherlm.runtime.plain import PlainLinear, make_executor, split_params
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests"))
from test_offload_real import PROMPTS, chat_prompt

BE = "lattigo"
ctx = make_context(OFFLOAD_CKKS, BE); keys = client_keys(ctx)
lm = load_model("smollm2-135m")
cp, sl = split_params(lm.config, lm.weights)
gk_cache = {}
stats = {"packed_calls": 0, "row_calls": 0, "cts": 0}

class HELinear:
    def linear(self, x, names):
        Ws = [sl[n][0] for n in names]; bs = [sl[n][1] for n in names]
        bs = bs if any(b is not None for b in bs) else None
        X = np.asarray(x, dtype=np.float64).reshape(-1, Ws[0].shape[1])
        d_out = sum(w.shape[0] for w in Ws)
        one = plan_matmul(d_out, X.shape[1], ctx.slots, has_bias=bs is not None, splits=[w.shape[0] for w in Ws], backend=BE)
        pk = packed_plan(one, 2, BE) if len(X) > 1 and operator_class(tuple(names)) != "lm_head" else None
        p = pk or one
        enc = encode_group(ctx, Ws, bs, plan=p)
        steps = tuple(p.rotation_steps)
        if steps not in gk_cache:
            gk_cache[steps] = load_galois_keys(ctx, keys.galois_keys_bytes(list(steps)), [p])
        gk = gk_cache[steps]
        if pk is not None:
            stats["packed_calls"] += 1
            ys = [decrypt_output(keys, apply(enc, encrypt_input(keys, X[i:i + 2], pk), gk), pk)[: len(X[i:i + 2])] for i in range(0, len(X), 2)]
            y = np.concatenate(ys); stats["cts"] += len(ys)
        else:
            stats["row_calls"] += 1
            y = np.stack([decrypt_output(keys, apply(enc, encrypt_input(keys, r, one), gk), one) for r in X]); stats["cts"] += len(X)
        y = y.reshape(*np.shape(x)[:-1], d_out)
        return list(np.split(y, np.cumsum([w.shape[0] for w in Ws])[:-1], axis=-1))

ref = make_executor(lm.config, cp, PlainLinear(sl))
he = make_executor(lm.config, cp, HELinear())
for prompt in PROMPTS[: int(sys.argv[1]) if len(sys.argv) > 1 else 1]:
    ids = lm.tokenizer.encode(chat_prompt(lm.tokenizer, prompt, False)).ids
    t0 = time.time()
    got, gl = he.generate(ids, max_new_tokens=3, eos_token_ids=[], return_logits=True)
    want, wl = ref.generate(ids, max_new_tokens=3, eos_token_ids=[], return_logits=True)
    mse = float(np.mean((np.asarray(gl[0], np.float64) - wl[0]) ** 2))
    print(f"{prompt!r}: {len(ids)} prompt tokens; HE {got} plaintext {want} identical={got == want}; first-token logits MSE {mse:.2e}; {time.time() - t0:.0f} s; {stats}", flush=True)
