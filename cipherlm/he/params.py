"""Named HE parameter sets and the 128-bit security check.

Security follows the HomomorphicEncryption.org standard (Albrecht et al.,
"Homomorphic Encryption Security Standard", 2018), table for ternary (uniform
{-1,0,1}) secrets and 128-bit classical security: the largest total
coefficient-modulus size log q (special key-switching prime included, since
it is part of the key-switching keys' modulus) allowed for each ring degree N.
SEAL's own ``CoeffModulus.MaxBitCount(N, tc128)`` is the same table.

The offload default (``OFFLOAD_CKKS``): CKKS, N = 8192, coeff modulus
[60, 40, 60] bits = 160 <= 218.  The data level holds q0 (60) * q1 (40); the
last 60-bit prime is SEAL's special prime used only for key switching.  A
fresh activation ciphertext lives at {q0, q1}; after ct x pt products the
server rescales by q1 so the result sent back has the single prime q0.
"""

from __future__ import annotations

import dataclasses
import json

from .errors import HEError

#: HomomorphicEncryption.org standard, 128-bit classical, ternary secret: N -> max log2 q.
HES_128_CLASSIC_MAX_LOGQ: dict[int, int] = {
    1024: 27,
    2048: 54,
    4096: 109,
    8192: 218,
    16384: 438,
    32768: 881,
}

#: The same bound (uniform ternary secret, sigma = 3.2, 128-bit classical) extended to N = 2^16
#: for bootstrappable sets (`check_security_logqp`): 1747 bits, from the HE standard's successor,
#: Bossuat et al., "Security Guidelines for Implementing Homomorphic Encryption" (IACR CiC 2024,
#: eprint 2024/463; lattice-estimator figures), also OpenFHE's HEStd_128_classic / HEStd_ternary
#: bound for 65536 (src/core/lib/lattice/stdlatticeparms.cpp).  Kept apart from
#: HES_128_CLASSIC_MAX_LOGQ so `check_security` (SEAL-style HEParams) is unchanged.
HES_128_CLASSIC_MAX_LOGQ_EXTENDED: dict[int, int] = {**HES_128_CLASSIC_MAX_LOGQ, 65536: 1747}


@dataclasses.dataclass(frozen=True)
class HEParams:
    """A named HE parameter set (what both parties must agree on)."""

    name: str
    scheme: str  # "ckks" | "bfv" (this tenseal build has no BGV)
    poly_modulus_degree: int
    coeff_modulus_bits: tuple[int, ...]
    plain_modulus: int | None = None  # BFV/BGV only
    #: default log2 of (scale * max|value|) for client inputs and server weights (CKKS)
    input_scale_bits: int = 45
    weight_scale_bits: int = 40  # a cap; matmul lowers it so n*|x||W| never wraps

    @property
    def slot_count(self) -> int:
        return self.poly_modulus_degree // 2 if self.scheme == "ckks" else self.poly_modulus_degree

    @property
    def total_logq(self) -> int:
        return int(sum(self.coeff_modulus_bits))

    @property
    def data_primes(self) -> int:
        """Primes at the first data level (the special prime excluded)."""
        return len(self.coeff_modulus_bits) - 1 if len(self.coeff_modulus_bits) > 1 else 1

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> HEParams:
        d = json.loads(text)
        d["coeff_modulus_bits"] = tuple(d["coeff_modulus_bits"])
        p = cls(**d)
        check_security(p)
        return p


def check_security(p: HEParams) -> None:
    """Raise HEError unless ``p`` gives 128-bit classical security (HES table)."""
    n = p.poly_modulus_degree
    if n not in HES_128_CLASSIC_MAX_LOGQ:
        raise HEError(
            f"{p.name}: poly_modulus_degree {n} is not in the HomomorphicEncryption.org "
            f"128-bit table ({sorted(HES_128_CLASSIC_MAX_LOGQ)})"
        )
    if p.scheme not in ("ckks", "bfv"):
        raise HEError(f"{p.name}: unknown scheme {p.scheme!r}")
    bits = p.coeff_modulus_bits
    if not bits or any((not isinstance(b, int)) or b < 2 or b > 60 for b in bits):
        raise HEError(f"{p.name}: coeff modulus bit sizes must be integers in [2, 60], got {bits}")
    maxq = HES_128_CLASSIC_MAX_LOGQ[n]
    if p.total_logq > maxq:
        raise HEError(
            f"{p.name}: insecure parameters: log2 q = {p.total_logq} > {maxq} allowed for "
            f"N = {n} at 128-bit classical security (HomomorphicEncryption.org standard)"
        )
    if p.scheme in ("bfv", "bgv") and not p.plain_modulus:
        raise HEError(f"{p.name}: {p.scheme} needs a plain_modulus")


def check_security_logqp(name: str, n: int, log_qp: float, *, secret_hamming_weight: int | None = None) -> None:
    """Raise HEError unless a modulus of ``log_qp`` bits (the largest any key or ciphertext of
    the set lives under, special primes included) is within the table's 128-bit bound for N.

    For a bootstrappable Lattigo preset this is the bootstrapping circuit's QP (1546 bits for
    N16QP1546H192H32 against 1747).  The table's bound is for a uniform ternary secret; a sparse
    secret (``secret_hamming_weight``, e.g. 192) has less margin: Lattigo's sparse presets claim
    128 bits from their authors' lattice-estimator runs for h = 192 and these moduli (Bossuat,
    Troncoso-Pastoriza, Hubaux, ACNS 2022, eprint 2022/024), which this check does not re-derive;
    it only refuses what exceeds even the uniform-ternary bound."""
    if n not in HES_128_CLASSIC_MAX_LOGQ_EXTENDED:
        raise HEError(f"{name}: N = {n} is not in the 128-bit table ({sorted(HES_128_CLASSIC_MAX_LOGQ_EXTENDED)})")
    maxq = HES_128_CLASSIC_MAX_LOGQ_EXTENDED[n]
    if not (log_qp > 0 and log_qp <= maxq):
        raise HEError(f"{name}: insecure parameters: log2(QP) = {log_qp:.1f} > {maxq} allowed for N = {n} at "
                      "128-bit classical security (HE standard / Security Guidelines, uniform ternary secret)")
    if secret_hamming_weight is not None and secret_hamming_weight < 192:
        raise HEError(f"{name}: secret Hamming weight {secret_hamming_weight} < 192 is below the sparsest "
                      "secret this project accepts (Lattigo's h = 192 presets)")


OFFLOAD_CKKS = HEParams("offload-ckks-8192", "ckks", 8192, (60, 40, 60))
PARAM_SETS: dict[str, HEParams] = {p.name: p for p in (OFFLOAD_CKKS,)}


def get_params(name: str = OFFLOAD_CKKS.name) -> HEParams:
    try:
        p = PARAM_SETS[name]
    except KeyError:
        raise HEError(f"unknown HE parameter set {name!r}; known: {sorted(PARAM_SETS)}") from None
    check_security(p)
    return p


def max_logq(n: int) -> int:
    return HES_128_CLASSIC_MAX_LOGQ[n]

