"""Which 2pc executor runs a plan: the layer-by-layer `twopc.TwoPCEncoder` /
`twopc.TwoPCDecoder`, or, with the plan's ``fusion`` "blb", BLB's fused blocks
(`twopc_blb.BLBEncoder`, encoders only so far).  Its own module because it sits above
both (`twopc_blb` builds on `twopc`)."""

from __future__ import annotations

from .twopc import ENCODER_TYPES, FUSIONS, ServerModel, TwoPCDecoder, TwoPCEncoder, TwoPCError, TwoPCExecutor
from .twopc_blb import BLBDecoder, BLBEncoder


def make_twopc_executor(ctx, config: dict, server: ServerModel | None, plan: dict | None = None, meter=None,
                        progress=None, attention: str = "auto") -> TwoPCExecutor:
    """The executor of ``plan`` (`twopc.public_plan`) for this party (server: its `ServerModel`;
    client: None).  ``attention``: BLB's packing of Q K^T / P V (the server's choice,
    `compile.passes.blb_params.ATTENTION_PACKINGS`; the client follows the server's headers)."""
    cls = TwoPCEncoder if config.get("model_type") in ENCODER_TYPES else TwoPCDecoder
    fusion = (plan or {}).get("fusion", "none")
    if fusion not in FUSIONS:
        raise TwoPCError(f"unknown fusion {fusion!r} in the plan; one of {FUSIONS}")
    if fusion == "blb":
        blb = BLBEncoder if cls is TwoPCEncoder else BLBDecoder
        return blb(ctx, config, server, plan, meter=meter, progress=progress, attention=attention)
    return cls(ctx, config, server, plan, meter=meter, progress=progress)


__all__ = ["make_twopc_executor"]
