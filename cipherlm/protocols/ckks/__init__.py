"""CKKS operators of the fhe mode (AEGIS sections 2.1-2.4) on token-group packed
ciphertexts: `packing` (the layout), `evaluator` (encrypted tensors, levels,
bootstrapping, arithmetic, polynomial approximations), `linear` (ct x pt products by BSGS
diagonals), `attention` (RoPE, Q.K^T by score diagonals, softmax, P.V), `norm`
(LayerNorm, RMSNorm).  The graph executor's fhe backend (`runtime.fhe_executor`) walks a
model graph over them."""
