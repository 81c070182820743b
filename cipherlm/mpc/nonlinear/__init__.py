"""Nonlinear functions on fixed-point shares (issue 3 item 4), built from the
OT-based primitives in `cipherlm.mpc.protocols`.

Fixed-point products are rescaled with SecureML local truncation by default
(``TRUNC``; free, +-1 ulp, failure probability about |v| 2^(2f) / 2^(l-1) per
product of magnitude |v|): use a ring with headroom (l = 64, f <= 16).
"""

from .common import TRUNC, compare_public, mulf, product, sqf
from .piecewise import abs_clamp, clamped_poly, gelu, gelu_gate, piecewise_poly, silu, silu_gate, swiglu
from .exp import exp_neg, exp_reduced
from .recip import reciprocal, rsqrt
from .softmax import max_last, softmax, softmax_parts
from .norm import layer_norm, normalized_bound, rms_norm
from .select import argmax_last, one_hot, topk_last

__all__ = ["TRUNC", "compare_public", "mulf", "sqf", "product", "piecewise_poly", "gelu", "silu", "swiglu", "gelu_gate",
           "silu_gate", "abs_clamp", "clamped_poly", "exp_neg", "exp_reduced",
           "reciprocal", "rsqrt", "max_last", "softmax", "softmax_parts", "layer_norm", "rms_norm", "normalized_bound",
           "argmax_last", "one_hot", "topk_last"]
