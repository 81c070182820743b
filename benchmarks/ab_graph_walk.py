"""A/B helper: the client-side graph walk of the offload mode, timed as the plain SmolLM2
executor's decode step (8-token prefill, then 12 steps; median, best of 3). Run it against
two trees in turns as benchmarks/ab_twopc_cpu.py says. Used for the issue 13 A/B in
docs/benchmarks.md."""
import sys, time, json
import numpy as np
from cipherlm.models import load_model
from cipherlm.runtime.plain import PlainLinear, make_executor, split_params
lm = load_model("smollm2-135m")
cp, sl = split_params(lm.config, lm.weights)
ex = make_executor(lm.config, cp, PlainLinear(sl))
ids = [1, 504, 3458, 314, 4649, 28, 253, 1345]
out = []
for rep in range(3):
    cache = ex.new_cache()
    ex.forward(ids, cache, last_only=True)
    t = []
    tok = 42
    for _ in range(12):
        t0 = time.perf_counter(); lg = ex.forward([tok], cache, last_only=True); t.append(time.perf_counter() - t0)
        tok = int(np.argmax(lg[-1]))
    out.append(float(np.median(t)))
print(json.dumps({"median_decode_s": min(out), "tok": tok}))
