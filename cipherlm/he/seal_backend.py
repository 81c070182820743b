"""Microsoft SEAL 4.3 (through ``tenseal.sealapi``) behind the `HEBackend` interface.

A thin wrapper: the context is `he.context.HEContext`, the keys are
`he.keys.ClientKeys`, (de)serialisation, untrusted-blob validation and raw views
are `he.serialize`, PackLWEs is `he.packlwe`; nothing here re-implements them.
Levels are SEAL ``parms_id`` lists.  No SEAL call releases the GIL (DESIGN.md).
"""

from __future__ import annotations

import numpy as np
import tenseal.sealapi as seal

from . import packlwe, serialize
from .backend import HEBackend, HECostModel, OffloadCostModel, TwoPCCostModel
from .context import HEContext
from .keys import ClientKeys
from .params import HEParams

__all__ = ["SealBackend", "SEAL_COSTS"]

#: SEAL's machine constants: the 2pc packings' measured on the 2-vCPU reference machine
#: (docstring of `TwoPCCostModel`), the offload CKKS matmul's on the dev machine
#: (`OffloadCostModel`, docs/he_matmul.md)
SEAL_COSTS = HECostModel(twopc=TwoPCCostModel(), offload=OffloadCostModel())


class SealBackend(HEBackend):
    name = "seal"
    cost_model = SEAL_COSTS

    # -- parameters / context ---------------------------------------------------------
    def context(self, params: HEParams) -> HEContext:
        return HEContext(params)

    def level(self, ctx: HEContext, n_primes: int):
        return ctx.parms_id_at(n_primes)

    def special_modulus(self, ctx: HEContext) -> int:
        return ctx.seal.key_context_data().parms().coeff_modulus()[-1].value()

    def primes(self, n: int, bits: list[int]) -> list[int]:
        return [m.value() for m in seal.CoeffModulus.Create(int(n), [int(b) for b in bits])]

    # -- keys ----------------------------------------------------------------------------
    def keygen(self, ctx: HEContext) -> ClientKeys:
        return ClientKeys(ctx)

    def load_public_key(self, ctx: HEContext, data: bytes):
        return seal.Encryptor(ctx.seal, serialize.public_key_from_bytes(ctx, data))

    def public_key_to_numpy(self, ctx: HEContext, data: bytes) -> np.ndarray:
        pk = serialize.public_key_from_bytes(ctx, data)  # kept alive: data() is a view into it
        key = serialize.ciphertext_to_numpy(pk.data())
        return key[:, : len(ctx.coeff_moduli)].copy()  # SEAL keeps the key at the special prime's level too

    def encrypt_zero(self, ctx: HEContext, pk, level):
        ct = seal.Ciphertext()
        pk.encrypt_zero(list(level), ct)
        return ct

    # -- encoding ------------------------------------------------------------------------
    def encode_coeffs(self, ctx: HEContext, coeffs, *, level=None, ntt: bool = False):
        pt = serialize.numpy_to_plaintext(ctx, np.asarray(coeffs, np.uint64))
        if ntt:
            ctx.evaluator.transform_to_ntt_inplace(pt, list(level if level is not None else ctx.first_parms_id))
        return pt

    def _batch_encoder(self, ctx: HEContext):
        be = getattr(ctx, "_batch_encoder", None)
        if be is None:
            be = ctx._batch_encoder = seal.BatchEncoder(ctx.seal)
        return be

    def encode_slots(self, ctx: HEContext, values, *, level=None, ntt: bool = False):
        pt = seal.Plaintext()
        self._batch_encoder(ctx).encode(np.asarray(values, np.uint64).tolist(), pt)
        if ntt:
            ctx.evaluator.transform_to_ntt_inplace(pt, list(level if level is not None else ctx.first_parms_id))
        return pt

    def decode_slots(self, ctx: HEContext, coeffs) -> np.ndarray:
        pt = serialize.numpy_to_plaintext(ctx, np.asarray(coeffs, np.uint64))
        return np.asarray(self._batch_encoder(ctx).decode_uint64(pt), np.uint64)

    # -- evaluation ----------------------------------------------------------------------
    def multiply_plain(self, ctx: HEContext, ct, pt, out=None):
        if out is None:
            out = seal.Ciphertext()
        ctx.evaluator.multiply_plain(ct, pt, out)
        return out

    def add_inplace(self, ctx: HEContext, a, b) -> None:
        ctx.evaluator.add_inplace(a, b)

    def add_plain_inplace(self, ctx: HEContext, ct, pt) -> None:
        ctx.evaluator.add_plain_inplace(ct, pt)

    def rotate_rows(self, ctx: HEContext, ct, step: int, galois_keys):
        out = seal.Ciphertext()
        ctx.evaluator.rotate_rows(ct, int(step), galois_keys, out)
        return out

    def rotate_rows_inplace(self, ctx: HEContext, ct, step: int, galois_keys) -> None:
        ctx.evaluator.rotate_rows_inplace(ct, int(step), galois_keys)

    def mod_switch_to_inplace(self, ctx: HEContext, ct, level) -> None:
        ctx.evaluator.mod_switch_to_inplace(ct, list(level))

    def to_ntt_inplace(self, ctx: HEContext, obj, level=None) -> None:
        if isinstance(obj, seal.Plaintext):
            ctx.evaluator.transform_to_ntt_inplace(obj, list(level if level is not None else ctx.first_parms_id))
        else:
            ctx.evaluator.transform_to_ntt_inplace(obj)

    def from_ntt_inplace(self, ctx: HEContext, ct) -> None:
        ctx.evaluator.transform_from_ntt_inplace(ct)

    def is_ntt(self, ct) -> bool:
        return bool(ct.is_ntt_form())

    def pack_lwes_stream(self, ctx: HEContext, galois_keys, n_leaves: int, leaves):
        return packlwe.pack_lwes_stream(ctx, galois_keys, n_leaves, leaves)

    def pack_lwes_elements(self, n: int) -> list[int]:
        return packlwe.galois_elements(n)

    def pack_lwes_order(self, n_leaves: int) -> list[int]:
        return packlwe.bitrev(n_leaves)

    # -- raw views -----------------------------------------------------------------------
    def ciphertext_to_numpy(self, ct) -> np.ndarray:
        return serialize.ciphertext_to_numpy(ct)

    def numpy_to_ciphertext(self, ctx: HEContext, arr, *, level=None, ntt: bool = False, scale: float = 1.0):
        return serialize.numpy_to_ciphertext(ctx, arr, parms_id=level, is_ntt_form=ntt, scale=float(scale))

    def plaintext_to_numpy(self, pt) -> np.ndarray:
        return serialize.plaintext_to_numpy(pt)

    # -- CKKS raw coefficient access (BLB section 6) -------------------------------------
    # SEAL keeps CKKS ciphertexts and plaintexts in NTT form, has no NTT for plaintexts at a
    # level and refuses coefficient-form CKKS ciphertexts.  The residues therefore go through
    # a ciphertext (c0 = values, c1 = 1: SEAL refuses transparent ones): the inverse NTT in
    # the CKKS context itself, the forward NTT in a BFV twin context with the same ring
    # degree and primes (SEAL's NTT tables depend only on N and the prime).
    def _bfv_twin(self, ctx: HEContext) -> HEContext:
        twin = getattr(ctx, "_ntt_twin", None)
        if twin is None:
            p = ctx.params
            twin = HEContext(HEParams(p.name + "-ntt-twin", "bfv", p.poly_modulus_degree,
                                      p.coeff_modulus_bits, plain_modulus=65537))
            if twin.coeff_moduli != ctx.coeff_moduli:
                raise RuntimeError("BFV twin context has different primes")
            ctx._ntt_twin = twin
        return twin

    def ntt_forward(self, ctx: HEContext, coeffs, *, level=None) -> np.ndarray:
        """Coefficient-form residues (k, N) -> SEAL's NTT form at the level with k primes."""
        coeffs = np.asarray(coeffs, np.uint64)
        twin = self._bfv_twin(ctx)
        ct = serialize.numpy_to_ciphertext(twin, np.stack([coeffs, np.ones_like(coeffs)]),
                                           parms_id=twin.parms_id_at(coeffs.shape[0]), is_ntt_form=False)
        twin.evaluator.transform_to_ntt_inplace(ct)
        return serialize.ciphertext_to_numpy(ct)[0]

    def ntt_inverse(self, ctx: HEContext, vals, *, level=None) -> np.ndarray:
        """NTT-form residues (k, N) -> coefficient form."""
        vals = np.asarray(vals, np.uint64)
        pid = list(level) if level is not None else ctx.parms_id_at(vals.shape[0])
        ct = serialize.numpy_to_ciphertext(ctx, np.stack([vals, np.ones_like(vals)]), parms_id=pid,
                                           is_ntt_form=True)
        ctx.evaluator.transform_from_ntt_inplace(ct)
        return serialize.ciphertext_to_numpy(ct)[0]

    def decrypt_coeffs(self, ctx: HEContext, keys: ClientKeys, ct) -> np.ndarray:
        if ctx.params.scheme != "ckks":
            raise NotImplementedError("decrypt_coeffs: CKKS only (BFV's decrypt already gives coefficients)")
        if not ct.is_ntt_form():
            raise ValueError("CKKS ciphertexts are in NTT form")
        pt = keys.decrypt(ct)
        return self.ntt_inverse(ctx, serialize.plaintext_to_numpy(pt, ctx), level=list(ct.parms_id()))

    def plaintext_from_coeffs(self, ctx: HEContext, coeffs, *, level=None, scale: float = 1.0):
        if ctx.params.scheme != "ckks":
            raise NotImplementedError("plaintext_from_coeffs: CKKS only (BFV: encode_coeffs)")
        coeffs = np.asarray(coeffs, np.uint64)
        pid = list(level) if level is not None else ctx.parms_id_at(coeffs.shape[0])
        return serialize.numpy_to_plaintext(ctx, self.ntt_forward(ctx, coeffs), parms_id=pid, scale=float(scale))

    def ciphertext_scale(self, ct) -> float:
        return float(ct.scale)

    # -- serialisation -------------------------------------------------------------------
    def ciphertext_to_bytes(self, ct) -> bytes:
        return serialize.ciphertext_to_bytes(ct)

    def ciphertext_from_bytes(self, ctx: HEContext, data: bytes, *, level=None):
        return serialize.ciphertext_from_bytes(ctx, data, parms_id=level)

    def galois_keys_from_bytes(self, ctx: HEContext, data: bytes, *, required_steps=None):
        return serialize.galois_keys_from_bytes(ctx, data, required_steps=required_steps)

    def params_to_bytes(self, params: HEParams) -> bytes:
        return serialize.params_to_bytes(params)

    def params_from_bytes(self, data: bytes) -> HEParams:
        return serialize.params_from_bytes(data)

