"""The fhe mode (AEGIS, ../shared/papers/aegis_001_*.txt; DESIGN.md "fhe"): compile-time pieces.

* `approx`: Chebyshev approximations of the nonlinear operators (GeLU, SiLU, exp, 1/x,
  1/sqrt(x)) with their range, degree, Newton steps, CKKS depth and measured error
  (AEGIS section 2.4: "nonlinear functions are approximated by high-degree polynomials");
* `calibrate`: the input ranges of those operators observed on real inputs by the
  plain executor (a runtime-layer module: it loads models and runs the executor);
* the level pass is `cipherlm.compile.passes.fhe_levels`.

Nothing here encrypts yet: the encrypted executor, packing and serving are not built
(docs/fhe.md).  This ``__init__`` imports nothing, so the compile-layer modules
(`approx`) never pull in the runtime-layer `calibrate`.
"""
