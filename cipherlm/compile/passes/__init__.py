"""Graph passes, one per file (SecretFlow-SPU's compiler layout): each `run(graph, ...)`
returns a new graph (and, for passes that rewrite weights, new parameters); the input
graph is left as it was.

* `group_linears`: the projections that read one value, evaluated as one stacked matrix;
* `fold_norms`: RMSNorm gammas into the projections that read the norm;
* `fold_attention_scale`: the 1/sqrt(head_dim) of Q K^T into what produces Q;
* `moe_blocks`: each MoE layer's subgraph lowered to one ``moe`` node (2pc's CryptoMoE);
* `blb_decompose`: LayerNorm, RMSNorm, softmax, GeLU / SiLU split into linear pieces and
  nonlinear cores (BLB Algorithms 3-5);
* `blb_fusion`: BLB's FineGrainFusion: the linear pieces grouped into fused HE blocks
  (Table 2 types, Table 4 patterns), ``meta["blb_blocks"]``;
* `fhe_levels`: the fhe mode's CKKS depth per node, value levels and greedy bootstrap
  placement (AEGIS sections 2.1, 2.4), ``meta["fhe_levels"]``;
* `aegis_placement`: AEGIS's dependency-aware placement of an fhe graph on W workers and the
  collectives it inserts, with Table 2's predicted bytes (sections 3-4, Figure 9).
"""

from . import (
    aegis_placement,
    blb_decompose,
    blb_fusion,
    fhe_levels,
    fold_attention_scale,
    fold_norms,
    group_linears,
    moe_blocks,
)

__all__ = ["aegis_placement", "blb_decompose", "blb_fusion", "fhe_levels", "fold_attention_scale", "fold_norms",
           "group_linears", "moe_blocks"]
