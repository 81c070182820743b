"""Private Mixture-of-Experts inference (CryptoMoE, ../shared/papers/cryptomoe_*.txt).

* `routing`   plaintext balanced expert routing (section 4.1-4.2), the reference;
* `dispatch`  Pi_dispatch on shares (Algorithm 1);
* `combine`   Pi_combine on shares (Algorithm 2);
* `experts`   the expert FFNs (SwiGLU) on shares, batched over experts;
* `layer`     one MoE layer in the 2pc mode: gate routing, dispatch, experts, combine;
* `baselines` insecure (routing revealed), dense (all experts) and CipherPrune-style dispatch.

Only `routing` is imported here: the secure modules pull in the HE layer.
The sparse-upcycled SmolLM2-MoE fixture is not part of this (protocol) package:
`cipherlm.models.upcycle` builds it, `cipherlm.runtime.upcycled` calibrates and loads it.
"""

from .routing import BalancedRouting, Dispatch, balanced_dispatch, balanced_moe, capacity, gate_topk

__all__ = ["BalancedRouting", "Dispatch", "balanced_dispatch", "balanced_moe", "capacity", "gate_topk"]
