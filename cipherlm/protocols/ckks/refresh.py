"""The client-aided refresh of the fhe mode: the server's ciphertext goes to the client,
masked, and comes back as a fresh encryption at the top level; for servers or sessions that
cannot hold CKKS bootstrapping keys (DESIGN.md, "Three security modes": "refresh of the
modulus chain either by bootstrapping ... or by a client-aided refresh"; AEGIS section 2.1:
bootstrapping replenishes the chain, the step this replaces).

Protocol, per ciphertext ct at level l >= `MIN_LEVEL` with scale s and a public bound B on
its slot values (the server's calibration, `fhe_calibrate`):

1. server: u <- integer polynomial with coefficients uniform in [-2^b, 2^b), expanded from
   a fresh 32-byte seed (a CSPRNG: `secrets`; expansion: Lattigo's keyed BLAKE2b PRNG);
   ct' = ct + (u, 0), i.e. the message polynomial m + e becomes m + e + u (no level used);
   ct' is sent to the client.
2. client: decrypts ct' exactly to the integers v = m + e + u (centred modulo Q_l: no
   wrap-around, 2^(b + 2) <= Q_l), scales them to the default scale (v' = round(v Delta /
   s)) and encrypts v' afresh under its secret key at the top level (seeded: a 32-byte seed
   in place of the uniform half); sends it back.  (`LattigoSecretKeys.refresh_plaintext`)
3. server: subtracts round(u Delta / s) (same code, same rounding): a fresh encryption
   of m + e at the top level, error <= 1 unit of the new scale (plus the fresh noise).

**What each party learns.**
* Client: for each refreshed ciphertext, the coefficients m + e + u.  Every coefficient of
  Delta m + e is at most 2 s (B + 1) in magnitude (the coefficients of a CKKS message are
  bounded by its largest slot value times the scale; the factor 2 and the +1 leave room for
  CKKS noise and for values somewhat above the calibrated bound), and b = ceil(log2(2 s (B +
  1))) + `STATISTICAL_BITS`, so each coefficient is within statistical distance
  2^-(STATISTICAL_BITS + 1) of u's, and a ciphertext of N coefficients within N 2^-81
  (2^-65 at N = 2^16): the client's view is simulatable from public values alone.  The
  noise e, which depends on the server's weights, is hidden with the message.  What is
  public: the number of refreshes, when they happen, how many ciphertexts each, their level
  and scale (all fixed by the model graph, the calibration and T, which the server's welcome
  and the packing already reveal).
* Server: fresh symmetric encryptions under the client's key (IND-CPA), nothing else.  The
  client's answer never depends on the decrypted values (re-encryption succeeds for any
  polynomial that fits the modulus, and a masked ciphertext always fits), so a server that
  deviates gets no decryption oracle from success or failure.  A server that skips the mask
  would show its own intermediate values to the client: the semi-honest model assumed here
  (DESIGN.md) protects the server from that by the protocol it runs, not by the client.

Secure choice where the design is silent: masking in the coefficient domain over the
integers (not slot-wise with a real-valued mask, which loses precision in float64 decoding
and hides only what its range covers), and refreshing at level >= 2 so the modulus leaves
room for an 80-bit statistical mask: the evaluator keeps `MIN_LEVEL` levels unused in this
path (7 usable levels per refresh at N16QP1546H192H32, against 9 after a bootstrap).

Costs: one round trip per refresh (the ciphertexts down, fresh ones up), client time one
decryption and one encryption per ciphertext; no bootstrapping keys (7.87 GB at
N16QP1546H192H32) anywhere.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Callable

from cipherlm.he.errors import HEError

#: lambda: each masked coefficient is within 2^-(lambda + 1) of uniform (statistical distance)
STATISTICAL_BITS = 80
#: the lowest level a ciphertext is refreshed from (Q_2 of the N16QP1546H192H32 residual
#: chain is 2^140: room for an 80-bit mask over values of bound up to ~2^17 at scale 2^40)
MIN_LEVEL = 2


def mask_bits(scale: float, bound: float) -> int:
    """Bits b of the mask for a ciphertext of this scale whose slot values have this bound:
    its message coefficients are below 2 s (B + 1), and b is that many bits plus lambda."""
    if not (scale > 0 and math.isfinite(scale)) or not (bound >= 0 and math.isfinite(bound)):
        raise HEError(f"bad scale {scale!r} or bound {bound!r} for a refresh mask")
    return math.ceil(math.log2(2.0 * scale * (float(bound) + 1.0))) + STATISTICAL_BITS


def fits(ctx, level: int, bits: int) -> bool:
    """Whether a b-bit mask fits the modulus at `level` (2^(b + 2) <= Q_level)."""
    return bits + 2 <= sum(math.log2(q) for q in ctx.q_moduli[: level + 1])


@dataclass(frozen=True)
class Mask:
    """What the server keeps of one masked ciphertext: the seed, the mask's bits, the scale."""

    seed: bytes
    bits: int
    scale: float


def mask(backend, ctx, ct, bound: float):
    """(a masked copy of ct, its `Mask`) -- step 1.  HEError if the ciphertext's level is
    too low for the mask (the caller refreshes from `MIN_LEVEL` or above)."""
    out = backend.multiply_scalar(ctx, ct, 1)  # a copy (an integer product: no level)
    scale = out.scale
    bits = mask_bits(scale, bound)
    if not fits(ctx, out.level, bits):
        raise HEError(f"a refresh at level {out.level} cannot hide values of bound {bound:g} with a "
                      f"{bits}-bit mask: refresh from level {MIN_LEVEL} or above")
    seed = secrets.token_bytes(32)
    backend.add_mask_inplace(ctx, out, seed, bits)
    return out, Mask(seed, bits, out.scale)


def unmask(backend, ctx, fresh, m: Mask):
    """Step 3: the client's fresh ciphertext with the mask taken off, in place."""
    backend.add_mask_inplace(ctx, fresh, m.seed, m.bits, sign=-1, from_scale=m.scale)
    return fresh


class ClientRefresher:
    """The server's refresher for `CkksEvaluator(refresher=...)`: ``(cts, bound) -> fresh
    cts at the top level``.  ``exchange(list of masked ciphertext bytes) -> list of bytes``
    is the round trip to the client (the session's channel); what comes back is parsed as
    untrusted input: exactly as many ciphertexts, each at the top level."""

    def __init__(self, backend, ctx, exchange: Callable[[list[bytes]], list]):
        self.be, self.ctx, self.exchange = backend, ctx, exchange
        self.rounds = 0

    def __call__(self, cts: list, bound: float, factor: float = 1.0) -> list:
        """Fresh ciphertexts of the values of ``cts`` (|values| <= ``bound``) times ``factor``:
        the factor is folded into the masked ciphertext's scale (no level; the client's
        re-encryption at the default scale applies it)."""
        if not (math.isfinite(factor) and factor > 0):
            raise HEError(f"refresh factor {factor!r} must be positive and finite")
        masks, blobs = [], []
        for ct in cts:
            masked, m = mask(self.be, self.ctx, ct, bound)
            if factor != 1.0:
                self.be.scale_message_inplace(self.ctx, masked, 1.0 / factor)
                m = Mask(m.seed, m.bits, masked.scale)
            masks.append(m)
            blobs.append(self.be.ciphertext_to_bytes(masked))
        back = self.exchange(blobs)
        self.rounds += 1
        if not isinstance(back, list) or len(back) != len(blobs):
            raise HEError(f"the client refreshed {len(back) if isinstance(back, list) else '?'} ciphertexts, "
                          f"{len(blobs)} were sent")
        out = []
        for i, (b, m) in enumerate(zip(back, masks)):
            if not isinstance(b, bytes):
                raise HEError(f"refreshed ciphertext {i} is not a byte blob")
            fresh = self.be.ciphertext_from_bytes(self.ctx, b, level=self.ctx.max_level)
            out.append(unmask(self.be, self.ctx, fresh, m))
        return out


def reencrypt_blobs(backend, ctx, secret_key, blobs: list) -> list[bytes]:
    """Step 2, the client's side: each masked ciphertext (untrusted bytes from the server)
    decrypted and encrypted afresh at the top level."""
    out = []
    for i, b in enumerate(blobs):
        if not isinstance(b, bytes):
            raise HEError(f"masked ciphertext {i} is not a byte blob")
        ct = backend.ciphertext_from_bytes(ctx, b)
        out.append(secret_key.encrypt_seeded(secret_key.refresh_plaintext(ct)))  # half-size: seed + c0
    return out
