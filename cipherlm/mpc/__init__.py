"""2PC engine: shares over Z_2^l, OT sessions, CrypTFlow2/SiRNN primitives
(`cipherlm.mpc.protocols`), nonlinear library (`cipherlm.mpc.nonlinear`).

The share operators that need a protocol (``a * b``, ``a & b``,
``mul_public_fixed``) look their implementation up in `shares`' kernel registry;
the protocol modules imported here register them (`shares.register_kernel`).
"""

from .protocols import bool_ops as _bool_ops, mul as _mul, trunc as _trunc  # noqa: F401  (register the share kernels)
