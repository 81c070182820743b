"""SEAL context built from an ``HEParams`` set (both parties build the same one).

``HEContext`` holds only public objects (SEALContext, encoder, evaluator); the
secret key lives in ``keys.ClientKeys`` on the client only.
"""

from __future__ import annotations

import tenseal.sealapi as seal

from .errors import HEError
from .params import HEParams, check_security

_SCHEMES = {"ckks": seal.SCHEME_TYPE.CKKS, "bfv": seal.SCHEME_TYPE.BFV}
if hasattr(seal.SCHEME_TYPE, "BGV"):
    _SCHEMES["bgv"] = seal.SCHEME_TYPE.BGV


def encryption_parameters(p: HEParams) -> seal.EncryptionParameters:
    check_security(p)
    parms = seal.EncryptionParameters(_SCHEMES[p.scheme])
    parms.set_poly_modulus_degree(p.poly_modulus_degree)
    parms.set_coeff_modulus(seal.CoeffModulus.Create(p.poly_modulus_degree, list(p.coeff_modulus_bits)))
    if p.scheme != "ckks":
        parms.set_plain_modulus(seal.Modulus(p.plain_modulus))
    return parms


class HEContext:
    """Public HE state for one parameter set: SEALContext, encoder, evaluator."""

    def __init__(self, params: HEParams):
        self.params = params
        self.parms = encryption_parameters(params)
        # SEAL checks 128-bit security again (its own copy of the HES table).
        self.seal = seal.SEALContext(self.parms, True, seal.SEC_LEVEL_TYPE.TC128)
        if not self.seal.parameters_set():
            raise HEError(f"SEAL rejected {params.name}: {self.seal.parameters_error_message()}")
        self.evaluator = seal.Evaluator(self.seal)
        self.encoder = seal.CKKSEncoder(self.seal) if params.scheme == "ckks" else None
        self.n = params.poly_modulus_degree
        self.slots = params.slot_count
        first = self.seal.first_context_data()
        self.first_parms_id = list(self.seal.first_parms_id())
        self.coeff_moduli = [m.value() for m in first.parms().coeff_modulus()]
        self.galois_tool = self.seal.key_context_data().galois_tool()

    # -- levels -------------------------------------------------------------
    def parms_id_at(self, n_primes: int) -> list[int]:
        """parms_id of the data level with ``n_primes`` primes."""
        cd = self.seal.first_context_data()
        while cd is not None:
            if len(cd.parms().coeff_modulus()) == n_primes:
                return list(cd.parms_id())
            cd = cd.next_context_data()
        raise HEError(f"no level with {n_primes} primes in {self.params.name}")

    def moduli_of(self, parms_id) -> list[int]:
        cd = self.seal.get_context_data(list(parms_id))
        if cd is None:
            raise HEError("parms_id does not belong to this context")
        return [m.value() for m in cd.parms().coeff_modulus()]

    def galois_elts(self, steps) -> list[int]:
        return list(self.galois_tool.get_elts_from_steps([int(s) for s in steps]))
