"""Lattigo v6 (Go) behind the `HEBackend` interface: CKKS (issue 15, first part).

The library is ``native/lattigo`` built with ``go build -buildmode=c-shared``
(``make install`` does it when ``go`` is on PATH) into
``native/lattigo/build/libclattigo.so``; ``CIPHERLM_LATTIGO_LIB`` overrides the
path.  It is loaded with ctypes on first use, so importing this module never
fails; a missing library raises `HEError` with the build command when the
backend is used.  Go objects stay in Go behind integer handles (freed when the
Python wrapper is collected); numpy arrays cross the boundary as pointers (no
per-value Python loop) and ctypes releases the GIL for every call (Lattigo
v6.2.0's evaluators and encoders may be called concurrently).  The Go runtime
does not survive ``fork()``: a forked child refuses to call the library
(`HEError`); worker processes must use the ``spawn`` context.

What it does (CKKS only, parameters from an `HEParams` set with
``scheme="ckks"``: the last prime of ``coeff_modulus_bits`` is the special
key-switching prime, the others the data chain, q0 first; uniform ternary
secret and sigma = 3.2 error, i.e. the HomomorphicEncryption.org setting that
`params.check_security` checks):

* `context`, `level` (level handle = number of primes - 1, an int),
  `special_modulus`, `primes`;
* `keygen` -> `LattigoSecretKeys` (encrypt, decrypt, public key bytes, Galois
  key bytes for slot rotations; `galois_keys` gives a local key set);
  `load_public_key`, `encrypt_zero` (public-key encryption of zero);
* `encode_slots(ctx, values, level=, scale_bits=)` (real or complex values) and
  `decode_slots(ctx, pt, n=)` (a decrypted plaintext -> slot values);
* `multiply_plain` (no rescale; ``out=`` reuses a ciphertext), `add_inplace`,
  `add_plain_inplace`, `rotate_rows` / `rotate_rows_inplace` (CKKS slot
  rotation to the left: CKKS has one row of N/2 slots), `rotate_hoisted`
  (several rotations of one ciphertext sharing one decomposition of c1:
  Lattigo's ``RotateHoisted``), `linear_transform_encode` / `linear_transform`
  (a matrix by its diagonals, Lattigo's BSGS ``lintrans`` with hoisted baby
  steps), `bsgs_matrix` / `bsgs_apply` (the offload matmul of
  `cipherlm.he.matmul`: its pre-rotated diagonals encoded once, in Montgomery
  form, and a request evaluated in one call: hoisted baby steps, products,
  rescale, giant and chunk-sum rotations, over goroutines), `rescale_inplace`,
  `mod_switch_to_inplace`
  (drop primes without dividing, as SEAL's CKKS mod switch), `is_ntt` (always
  True);
* `ciphertext_to_numpy` / `numpy_to_ciphertext` (NTT-form RNS coefficients);
* `ciphertext_to_bytes` / `ciphertext_from_bytes`, `galois_keys_from_bytes`,
  `load_public_key`, `params_to_bytes` / `params_from_bytes`.  Peer bytes use
  ``native/lattigo``'s own fixed layouts (clattigo.go): the expected length
  follows from the parameters and is checked before anything is allocated,
  every coefficient must be reduced, and Lattigo's own parsers never see a
  peer's bytes.  Galois keys go out seeded (Lattigo's compressed keys: a seed
  in place of the uniform halves, about half the bytes).  Any malformed blob gives `HEError`; a Go panic is recovered
  on the Go side and also becomes `HEError`.

Not implemented (raise NotImplementedError): BFV (the conformance suite of
tests/test_he_backend.py and the 2pc protocols are BFV with SEAL's
coefficient-level conventions), `encode_coeffs`, `to_ntt_inplace` /
`from_ntt_inplace` (Lattigo keeps CKKS ciphertexts in NTT form),
`pack_lwes_stream` (see `pack_lwes_packer`), `plaintext_to_numpy`.

PackLWEs for FastQuery's embedding lookup (ABI 12, ``native/lattigo/pack_lwes.go``; CDKS 2021
Algorithms 1-2, FastQuery section 2.3): `pack_context` (`LattigoContext.from_primes`: a context
with explicit primes, e.g. the plan's), `secret_keys_from_ternary` (a secret key from the
client's numpy ternary secret), `LattigoGaloisKeys.has_elements`, and `pack_lwes_packer` ->
`LattigoPackLWEs` (push chunks of coefficient-form leaves, finish: the packed ciphertext; the
tree's subtrees on goroutines).  ABI 13: `LattigoPackLWEs.set_query` / `push_products` (the
leaves of FastQuery's PackLWEs rows made in Go from the query and weight polynomials) and
`LattigoGaloisKeys.keeping` (a key set without the rotation keys a server drops).  ABI 14:
`pack_weights` -> `LattigoPackWeights` (a table's weight polynomials reduced and transformed once
per session) and `LattigoPackLWEs.push_cached` (product leaves from them).

Raw CKKS access for BLB's conversions (section 6, `protocols.ckks_convert`; issue 16):
`decrypt_coeffs`, `ntt_forward` / `ntt_inverse` (Lattigo's own NTT, `clg_ntt`; reproduced bit-exactly in
numpy, `lattigo_ntt`), `ciphertext_scale`, `plaintext_from_coeffs` (a `LattigoRawPlaintext`
on the Python side, taken by `add_plain_inplace` and `encrypt_seeded`), and the slot order
(`slot_generator` = 5: slot j is m(omega^(5^j)), SEAL's is 3^j).

fhe-mode operations (ABI 5-6, ``native/lattigo/ckks_ops.go`` and ``bootstrap.go``; issue 15
item 1, for the fhe mode of issue 17 and BLB's CKKS blocks of issue 16): evaluation key sets
with a relinearisation key (`LattigoSecretKeys.eval_keys`, `relin_key_bytes`,
`relin_keys_from_bytes`), `multiply` (ct x ct with relinearisation), `sub_inplace`,
`sub_plain_inplace`, `multiply_scalar`, `add_scalar_inplace`, `evaluate_chebyshev` (a
polynomial given by its Chebyshev coefficients on [a, b], Lattigo's
``circuits/ckks/polynomial``; `chebyshev_coefficients` interpolates a function) and CKKS
bootstrapping (Lattigo's ``circuits/ckks/bootstrapping``: Bossuat et al., "Efficient
Bootstrapping for Approximate Homomorphic Encryption with Non-Sparse Keys", EUROCRYPT 2021,
with the sparse-secret encapsulation of eprint 2022/024): a bootstrappable context from a
preset (`LattigoContext.from_preset`: ``"N16QP1546H192H32"``, or the INSECURE test-only
`TEST_INSECURE_PRESET` that needs ``allow_insecure_for_tests=True``),
`LattigoSecretKeys.bootstrapping_keys` -> `LattigoBootstrapKeys` (``close()`` frees the GBs at
once; ``to_bytes`` / `bootstrapping_keys_from_bytes` in a validated layout), `bootstrap`.
`encrypt_seeded` sends a 32-byte seed in place of the uniform half (the
receiver expands it with the same code) and c0 bit-packed, each prime's row with
the prime's bit length per coefficient (`seeded_ciphertext_bytes` gives the
size).  `cost_model` is `LATTIGO_COSTS`: its offload constants are measured
here, its 2pc ones are SEAL's (the 2pc planners do not run on this backend).

Registered in ``backend._REGISTRY`` as ``"lattigo"`` with ``schemes = ("ckks",)``
(the BFV conformance suite of tests/test_he_backend.py skips it).  Only modules
in ``cipherlm/he/`` may import this one.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import ClassVar, Self

import numpy as np

from .backend import (
    HEBackend,
    HECostModel,
    OffloadCostModel,
    SecretKeys,
    TwoPCCostModel,
)
from .errors import HEError
from .params import HEParams, check_security, check_security_logqp, max_logq

__all__ = [
    "BUILD_HINT",
    "LATTIGO_COSTS",
    "TEST_INSECURE_PRESET",
    "LattigoBSGSMatrix",
    "LattigoBackend",
    "LattigoBootstrapKeys",
    "LattigoContext",
    "LattigoEvalKeys",
    "LattigoLinearTransform",
    "LattigoPackLWEs",
    "LattigoPackWeights",
    "LattigoSecretKeys",
    "available",
    "chebyshev_coefficients",
    "ckks_params",
    "library_path",
    "release_memory",
    "packed_row_bytes",
    "seeded_ciphertext_bytes",
]

_ROOT = Path(__file__).resolve().parents[2]
BUILD_HINT = ("build it with `make lattigo` (or `cd native/lattigo && go build -buildmode=c-shared "
              "-o build/libclattigo.so .`; Go >= 1.24, e.g. /usr/local/go/bin)")
_ABI_VERSION = 17
#: the N = 2^10 bootstrapping preset: INSECURE, for the test suite only
TEST_INSECURE_PRESET = "test-insecure-N1024"
_PARAMS_MAGIC = b"CLGPARAMS1"
_CT_HEADER = struct.Struct("<4sBBBBB3sd")  # see clattigo.go
#: clattigo.go's wireVersion (the version byte of every blob it writes; 2: seeded c0 bit-packed)
_WIRE_VERSION = 2
_SEED_BYTES = 32
_ERRLEN = 1024

_i64 = ctypes.c_int64
_p_i64 = ctypes.POINTER(ctypes.c_int64)
_int = ctypes.c_int
_p_int = ctypes.POINTER(ctypes.c_int)
_dbl = ctypes.c_double
_p_dbl = ctypes.POINTER(ctypes.c_double)
_p_u64 = ctypes.POINTER(ctypes.c_uint64)
_p_u8 = ctypes.POINTER(ctypes.c_ubyte)
_pp_u8 = ctypes.POINTER(_p_u8)
_err = (ctypes.c_char_p, _int)

#: name -> argument types before the (errbuf, errlen) pair every one of these takes
_SIGNATURES: dict[str, tuple] = {
    "clg_primes": (_int, _p_i64, _int, _p_u64),
    "clg_ckks_new": (_int, _p_i64, _int, _p_i64, _int, _int, _p_i64),
    "clg_ctx_info": (_i64, _p_i64, _p_int, _p_int, _p_int, _p_u64, _int),
    "clg_keygen": (_i64, _p_i64, _p_i64),
    "clg_gen_rotation_keys": (_i64, _p_i64, _int, _int, _p_i64),
    "clg_evk_has_steps": (_i64, _p_i64, _int, _int, _p_int),
    "clg_conjugate": (_i64, _i64, _p_i64),
    "clg_gen_galois_keys": (_i64, _p_u64, _int, _p_i64),
    "clg_steps_to_elements": (_i64, _p_i64, _int, _int, _p_u64, _int, _p_int),
    "clg_galois_keys_compressed": (_i64, _p_u64, _int, _pp_u8, _p_i64),
    "clg_lt_new": (_i64, _p_i64, _int, _p_dbl, _int, _dbl, _int, _p_i64),
    "clg_lt_galois_elements": (_i64, _p_u64, _int, _p_int),
    "clg_lt_eval": (_i64, _i64, _i64, _p_i64),
    "clg_encode": (_i64, _p_dbl, _p_dbl, _i64, _int, _dbl, _int, _p_i64),
    "clg_decode": (_i64, _p_dbl, _p_dbl, _i64),
    "clg_encrypt_sk": (_i64, _i64, _p_i64),
    "clg_encrypt_pk": (_i64, _i64, _int, _p_i64),
    "clg_decrypt": (_i64, _i64, _p_i64),
    "clg_mul_plain": (_i64, _i64, _i64, _p_i64),
    "clg_add": (_i64, _i64, _int),
    "clg_rescale": (_i64,),
    "clg_ct_scale_by": (_i64, _dbl),
    "clg_ct_add_mask": (_i64, _p_u8, _int, _int, _int, _dbl),
    "clg_ct_refresh_plaintext": (_i64, _i64, _p_i64),
    "clg_ct_scale": (_i64, _p_dbl),
    "clg_pt_coeffs": (_i64, _p_u64, _i64),
    "clg_tg_linear": (_i64, _p_i64, _int, _p_dbl, _int, _p_dbl, _int, _int, _int, _p_i64, _p_i64),
    "clg_drop_level": (_i64, _int),
    "clg_rotate": (_i64, _i64, _i64, _p_i64),
    "clg_rotate_hoisted": (_i64, _i64, _p_i64, _int, _p_i64),
    "clg_copy": (_i64, _p_i64),
    "clg_bsgs_new": (_i64, _int, _int, _int, _int, _p_i64, _int, _int, _dbl, _p_i64),  # ABI 17: input parts
    "clg_bsgs_set": (_i64, _int, _p_dbl, _p_dbl, _int, _p_u8, _int),  # ABI 17: the diagonals' width
    "clg_bsgs_plaintexts": (_i64, _p_i64),
    "clg_bsgs_compress": (_i64, _int),
    "clg_bsgs_words": (_i64, _p_i64),
    "clg_bsgs_eval": (_i64, _p_i64, _int, _i64, _int, _p_i64, _p_i64),  # ABI 17: several inputs
    "clg_ct_info": (_i64, _int, _p_int, _p_int, _p_dbl, _p_int),
    "clg_ct_coeffs": (_i64, _p_u64, _i64),
    "clg_ct_to_bytes": (_i64, _pp_u8, _p_i64),
    "clg_encrypt_seeded": (_i64, _i64, _pp_u8, _p_i64),
    "clg_ct_from_bytes": (_i64, _p_u8, _i64, _int, _p_i64),
    "clg_pk_to_bytes": (_i64, _pp_u8, _p_i64),
    "clg_pk_from_bytes": (_i64, _p_u8, _i64, _p_i64),
    "clg_pk_of_sk": (_i64, _p_i64),
    "clg_evk_to_bytes": (_i64, _pp_u8, _p_i64),
    "clg_evk_from_bytes": (_i64, _p_u8, _i64, _int, _p_i64),
    # ckks_ops.go (ABI 5)
    "clg_gen_eval_keys": (_i64, _int, _p_i64, _int, _int, _p_i64),
    "clg_evk_has_relin": (_i64, _p_int),
    "clg_evk_merge": (_i64, _i64, _p_i64),
    "clg_mul_relin": (_i64, _i64, _i64, _p_i64),
    "clg_mul_sum": (_i64, _p_i64, _p_i64, _int, _p_i64),  # ABI 11
    "clg_sub": (_i64, _i64, _int),
    "clg_mul_scalar": (_i64, _dbl, _dbl, _p_i64),
    "clg_add_scalar": (_i64, _dbl, _dbl),
    "clg_poly_levels": (_int, _dbl, _dbl, _p_int),
    "clg_poly_eval": (_i64, _i64, _p_dbl, _int, _dbl, _dbl, _p_i64),
    "clg_relin_to_bytes": (_i64, _pp_u8, _p_i64),
    "clg_relin_from_bytes": (_i64, _p_u8, _i64, _p_i64),
    # bootstrap.go (ABI 5)
    "clg_ckks_new_preset": (_int, _int, _p_i64),
    "clg_btp_ctx_info": (_i64, _p_dbl, _p_int, _p_int, _p_int, _p_int),
    "clg_btp_keygen": (_i64, _p_i64),
    "clg_btp_info": (_i64, _p_int, _p_int, _p_i64, _p_int),
    "clg_btp_free": (_i64,),
    "clg_bootstrap": (_i64, _i64, _p_i64),
    "clg_btp_keys_to_bytes": (_i64, _pp_u8, _p_i64),
    "clg_btp_keys_from_bytes": (_i64, _p_u8, _i64, _p_i64),
    # refresh.go (ABI 8)
    "clg_ntt": (_i64, _p_u64, _int, _int),
    # blb_linear.go (ABI 10)
    "clg_blb_linear": (_i64, _p_i64, _int, _int, _int, _p_dbl, _int, _int, _int, _p_i64, _dbl, _int, _p_i64,
                       _p_i64),
    # pack_lwes.go (ABI 12)
    "clg_ctx_new_primes": (_int, _p_u64, _int, _p_u64, _int, _p_i64),
    "clg_sk_from_ternary": (_i64, _p_i64, _i64, _p_i64),
    "clg_evk_has_elements": (_i64, _p_u64, _int, _p_int),
    "clg_packlwe_new": (_i64, _i64, _int, _p_i64),
    "clg_packlwe_push": (_i64, _p_u64, _i64, _p_u8, _i64),
    "clg_packlwe_finish": (_i64, _p_u64, _i64),
    # ckks_ops.go (ABI 13)
    "clg_evk_keep_steps": (_i64, _p_i64, _int, _int, _p_i64),
    # pack_lwes.go (ABI 13)
    "clg_packlwe_set_query": (_i64, _p_u64, _i64, _int, _int),
    "clg_packlwe_push_products": (_i64, _p_i64, _i64, _int, _p_i64, _p_i64, _p_u8, _i64),
    # pack_lwes.go (ABI 14)
    "clg_packlwe_weights_new": (_i64, _i64, _int, _p_i64),
    "clg_packlwe_weights_add": (_i64, _p_i64, _i64, _int),
    "clg_packlwe_push_cached": (_i64, _i64, _p_i64, _p_i64, _p_u8, _i64),
    # ring_switch.go (ABI 16: half rings of either kind and level; half-ring inputs)
    "clg_ctx_half_ring": (_i64, _int, _int, _p_i64),
    "clg_ring_switch_keygen": (_i64, _i64, _p_i64, _pp_u8, _p_i64),
    "clg_ring_switch_key_from_bytes": (_i64, _i64, _p_u8, _i64, _p_i64),
    "clg_ring_switch": (_i64, _i64, _p_i64),
    "clg_input_switch_keygen": (_i64, _i64, _p_i64, _pp_u8, _p_i64),
    "clg_input_switch_key_from_bytes": (_i64, _i64, _p_u8, _i64, _p_i64),
    "clg_real_to_complex": (_i64, _i64, _p_i64),
    "clg_ct_to_bytes_packed": (_i64, _pp_u8, _p_i64),
}

_lib = None
_lib_pid = 0
_lib_lock = threading.Lock()


def library_path() -> Path:
    env = os.environ.get("CIPHERLM_LATTIGO_LIB")
    return Path(env) if env else _ROOT / "native" / "lattigo" / "build" / "libclattigo.so"


def _load():
    global _lib, _lib_pid
    if _lib is not None:
        if _lib_pid != os.getpid():  # the Go runtime's threads do not survive fork(): calls would hang
            raise HEError("the Lattigo library was loaded before this process was forked; "
                          "use the 'spawn' multiprocessing context")
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if not path.is_file():
            raise HEError(f"the Lattigo backend library {path} is not built; {BUILD_HINT}")
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise HEError(f"cannot load the Lattigo backend library {path}: {e}") from None
        lib.clg_abi_version.restype = _int
        lib.clg_abi_version.argtypes = []
        if lib.clg_abi_version() != _ABI_VERSION:
            raise HEError(f"{path}: ABI version {lib.clg_abi_version()} != {_ABI_VERSION}; rebuild it")
        for name, args in _SIGNATURES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise HEError(f"{path} lacks {name}: an old build; {BUILD_HINT}") from None
            fn.argtypes = list(args) + list(_err)
            fn.restype = _int
        lib.clg_free.argtypes, lib.clg_free.restype = [_i64], None
        lib.clg_free_buf.argtypes, lib.clg_free_buf.restype = [_p_u8], None
        lib.clg_live_objects.argtypes, lib.clg_live_objects.restype = [], _i64
        try:
            lib.clg_release_memory.argtypes, lib.clg_release_memory.restype = [], None
        except AttributeError:
            raise HEError(f"{path} lacks clg_release_memory: an old build; {BUILD_HINT}") from None
        _lib, _lib_pid = lib, os.getpid()
        return lib


def release_memory() -> None:
    """Return the Go heap that freed objects left to the OS now (`clg_release_memory`: a
    collection, then `debug.FreeOSMemory`); a no-op when the library was never loaded here."""
    if _lib is not None and _lib_pid == os.getpid():
        _lib.clg_release_memory()


def available() -> bool:
    """Whether the shared library is built and loads."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """None when the shared library is built and loads, else why not (the `HEError`'s
    message: not built, does not load, an old ABI; it names `make lattigo`)."""
    try:
        _load()
        return None
    except HEError as e:
        return str(e)


def _call(name: str, *args) -> None:
    lib = _load()
    err = ctypes.create_string_buffer(_ERRLEN)
    rc = getattr(lib, name)(*args, err, _ERRLEN)
    if rc != 0:
        raise HEError(f"lattigo {name[4:]}: {err.value.decode(errors='replace')}")


def _new(name: str, *args) -> int:
    """Call a function whose last argument is an out handle; return the handle."""
    h = _i64(0)
    _call(name, *args, ctypes.byref(h))
    return h.value


def _bytes_out(name: str, *handles: int) -> bytes:
    lib = _load()
    p, n = _p_u8(), _i64(0)
    _call(name, *handles, ctypes.byref(p), ctypes.byref(n))
    try:
        return ctypes.string_at(p, n.value)
    finally:
        lib.clg_free_buf(p)


def _in_buf(data) -> tuple:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise HEError(f"expected bytes, got {type(data).__name__}")
    b = bytes(data)
    return ctypes.cast(ctypes.c_char_p(b), _p_u8), len(b), b  # keep b alive


def _i64_array(values: Iterable[int]) -> tuple:
    arr = np.ascontiguousarray(np.asarray(list(values), dtype=np.int64).reshape(-1))
    return arr, arr.ctypes.data_as(_p_i64), int(arr.size)


# ----------------------------------------------------------------------------- handles
class _Handle:
    """A Go object; freed when collected."""

    __slots__ = ("__weakref__", "ctx", "h")

    def __init__(self, h: int, ctx: LattigoContext | None):
        self.h = h
        self.ctx = ctx

    def __del__(self):
        lib = _lib
        if lib is not None and self.h and _lib_pid == os.getpid():
            try:
                lib.clg_free(self.h)
            except Exception:  # noqa: BLE001, S110 (interpreter shutdown)
                pass
            self.h = 0


class LattigoPlaintext(_Handle):
    __slots__ = ()

    def _info(self):
        lvl, deg, ls, ntt = _int(), _int(), _dbl(), _int()
        _call("clg_ct_info", self.h, 1, ctypes.byref(lvl), ctypes.byref(deg), ctypes.byref(ls), ctypes.byref(ntt))
        return lvl.value, ls.value

    @property
    def level(self) -> int:
        return self._info()[0]

    @property
    def scale_bits(self) -> float:
        return self._info()[1]

    def coefficients(self) -> np.ndarray:
        """The polynomial's RNS coefficients, (level + 1, N) uint64, coefficient form."""
        k = self.level + 1
        out = np.zeros((k, self.ctx.n), np.uint64)
        _call("clg_pt_coeffs", self.h, out.ctypes.data_as(_p_u64), out.size)
        return out


class LattigoCiphertext(_Handle):
    __slots__ = ()

    def _info(self):
        lvl, deg, ls, ntt = _int(), _int(), _dbl(), _int()
        _call("clg_ct_info", self.h, 0, ctypes.byref(lvl), ctypes.byref(deg), ctypes.byref(ls), ctypes.byref(ntt))
        return lvl.value, deg.value, ls.value, bool(ntt.value)

    @property
    def level(self) -> int:
        return self._info()[0]

    @property
    def n_primes(self) -> int:
        return self._info()[0] + 1

    @property
    def scale_bits(self) -> float:
        """log2 of the CKKS scale."""
        return self._info()[2]

    @property
    def scale(self) -> float:
        """The CKKS scale (the float64 its serialisation carries)."""
        v = _dbl()
        _call("clg_ct_scale", self.h, ctypes.byref(v))
        return v.value

    def _replace(self, h: int) -> None:
        """Take over Go object ``h`` (in-place operations that allocate a result)."""
        old, self.h = self.h, h
        if old and _lib is not None and _lib_pid == os.getpid():
            _lib.clg_free(old)


class LattigoRawPlaintext:
    """A plaintext given by its residues (`LattigoBackend.plaintext_from_coeffs`, BLB Algorithm
    2): kept on the Python side in Lattigo's NTT form, with its level and CKKS scale; taken by
    `LattigoBackend.add_plain_inplace` and `LattigoSecretKeys.encrypt_seeded`."""

    __slots__ = ("level", "ntt", "scale")

    def __init__(self, ntt: np.ndarray, level: int, scale: float):
        self.ntt, self.level, self.scale = ntt, int(level), float(scale)


def packed_row_bytes(n: int, q: int) -> int:
    """Bytes of one bit-packed row of n residues modulo q in a seeded ciphertext ("CLGS"):
    ceil(n b / 8) with b = bit length of q - 1."""
    return (int(n) * (int(q) - 1).bit_length() + 7) // 8


def seeded_ciphertext_bytes(n: int, primes, level: int) -> int:
    """The exact length of `LattigoSecretKeys.encrypt_seeded`'s blob at ``level``: the 20-byte
    header, the 32-byte seed and c0's rows 0..level bit-packed (`packed_row_bytes`)."""
    if not 0 <= int(level) < len(primes):
        raise HEError(f"level {level} outside the {len(primes)} primes")
    return _CT_HEADER.size + _SEED_BYTES + sum(packed_row_bytes(n, q) for q in list(primes)[: int(level) + 1])


def _pack_row(row: np.ndarray, q: int) -> bytes:
    """One row of residues < q bit-packed as clattigo.go's appendPacked writes it."""
    w = (int(q) - 1).bit_length()
    bits = np.unpackbits(np.ascontiguousarray(row, "<u8").view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
    return np.packbits(bits[:, :w].ravel(), bitorder="little").tobytes()


def _unpack_row(buf: bytes, n: int, q: int) -> np.ndarray:
    """The n residues of a row `_pack_row` wrote (the inverse; the blob came from this process)."""
    w = (int(q) - 1).bit_length()
    bits = np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little")[: n * w].reshape(n, w)
    full = np.zeros((n, 64), np.uint8)
    full[:, :w] = bits
    return np.packbits(full, axis=1, bitorder="little").view("<u8").reshape(n).astype(np.uint64)


def _add_residues(a: np.ndarray, b: np.ndarray, primes) -> np.ndarray:
    """(a + b) mod each prime, row by row ((k, N) uint64 residues)."""
    qs = np.asarray([int(q) for q in primes[: a.shape[0]]], np.uint64)[:, None]
    s = a + b
    return np.where(s >= qs, s - qs, s)


class LattigoPublicKey(_Handle):
    __slots__ = ()


class LattigoGaloisKeys(_Handle):
    __slots__ = ()

    def has_steps(self, steps: Iterable[int], *, conjugate: bool = False) -> bool:
        """Whether the set holds the keys of slot rotations by ``steps`` (and of the
        conjugation, with ``conjugate``)."""
        _arr, p, n = _i64_array(steps)
        if n == 0 and not conjugate:
            return True
        ok = _int(0)
        _call("clg_evk_has_steps", self.h, p, n, int(conjugate), ctypes.byref(ok))
        return bool(ok.value)

    def has_elements(self, elements: Iterable[int]) -> bool:
        """Whether the set holds the keys of the automorphisms X -> X^g, g in ``elements``."""
        els = np.ascontiguousarray(np.asarray(list(elements), dtype=np.uint64).reshape(-1))
        if els.size == 0:
            return True
        ok = _int(0)
        _call("clg_evk_has_elements", self.h, els.ctypes.data_as(_p_u64), els.size, ctypes.byref(ok))
        return bool(ok.value)

    def to_bytes(self) -> bytes:
        """The whole (expanded) keys; `LattigoSecretKeys.galois_keys_bytes` sends seeded ones."""
        return _bytes_out("clg_evk_to_bytes", self.h)

    @property
    def has_relin(self) -> bool:
        """Whether the set holds a relinearisation key (ct x ct products, polynomials)."""
        ok = _int(0)
        _call("clg_evk_has_relin", self.h, ctypes.byref(ok))
        return bool(ok.value)

    def relin_key_bytes(self) -> bytes:
        """The set's relinearisation key in the "CLGR" layout (`LattigoBackend.relin_keys_from_bytes`)."""
        return _bytes_out("clg_relin_to_bytes", self.h)

    def merged(self, other: LattigoGaloisKeys) -> LattigoGaloisKeys:
        """A new set with the keys of both (e.g. a peer's relinearisation key + its Galois keys)."""
        return LattigoGaloisKeys(_new("clg_evk_merge", self.h, other.h), self.ctx)

    def keeping(self, steps: Iterable[int], *, conjugate: bool = False) -> LattigoGaloisKeys:
        """A new set with this one's relinearisation key and only the rotation keys of ``steps``
        (and the conjugation's, with ``conjugate``); each must be here.  The keys left out are
        freed once no other set holds them."""
        _arr, p, n = _i64_array(steps)
        return LattigoGaloisKeys(_new("clg_evk_keep_steps", self.h, p if n else None, n, int(conjugate)), self.ctx)


#: An evaluation key set (relinearisation and/or Galois keys): the same Go object as Galois keys.
LattigoEvalKeys = LattigoGaloisKeys


class LattigoRingSwitchKey(_Handle):
    """A peer's key switching level-0 ciphertexts of a context to one of its half rings (server
    side); ``small`` is that half ring (`LattigoContext.half_ring`)."""

    __slots__ = ("small",)


class LattigoInputSwitchKey(_Handle):
    """A peer's key taking ciphertexts of a context's conjugate-invariant input ring
    (`LattigoContext.half_ring` ``"real"`` at all data primes) to the context (server side)."""

    __slots__ = ("small",)


class LattigoPackLWEs(_Handle):
    """A streaming PackLWEs packer in Go (``native/lattigo/pack_lwes.go``; Chen, Dai, Kim, Song,
    ACNS 2021, Algorithms 1-2, as FastQuery section 2.3 "PackLWEs optimization" uses it): the
    same tree, leaf order and output as `cipherlm.he.packlwe.pack_lwes_stream`, with leaves and
    result as coefficient-form residues.  `push` the leaves in `HEBackend.pack_lwes_order`
    order, a chunk at a time, then `finish` once (`LattigoBackend.pack_lwes_packer`)."""

    __slots__ = ("k", "n_leaves")

    def __init__(self, h: int, ctx: LattigoContext, n_leaves: int):
        super().__init__(h, ctx)
        self.k = len(ctx.q_moduli)
        self.n_leaves = int(n_leaves)

    def push(self, leaves, present=None) -> None:
        """The next m leaves: ``leaves`` (m, 2, k, N) uint64 coefficient-form residues modulo
        the k data primes (each must be reduced), ``present`` (m,) bools (False: an absent,
        zero leaf; default all present)."""
        a = np.ascontiguousarray(leaves, dtype=np.uint64)
        if a.ndim != 4 or a.shape[1:] != (2, self.k, self.ctx.n) or a.shape[0] < 1:
            raise HEError(f"expected (m, 2, {self.k}, {self.ctx.n}) leaf residues, got {a.shape}")
        m = a.shape[0]
        pres = np.ones(m, np.uint8) if present is None else np.ascontiguousarray(present, dtype=bool).astype(np.uint8)
        if pres.shape != (m,):
            raise HEError(f"expected {m} presence flags, got shape {pres.shape}")
        _call("clg_packlwe_push", self.h, a.ctypes.data_as(_p_u64), a.size, pres.ctypes.data_as(_p_u8), m)

    def set_query(self, query) -> None:
        """For `push_products`: the query ciphertexts, (T, B, 2, k, N) uint64 coefficient-form
        residues (reduced), before the first leaf."""
        a = np.ascontiguousarray(query, dtype=np.uint64)
        if a.ndim != 5 or a.shape[2:] != (2, self.k, self.ctx.n):
            raise HEError(f"expected (T, B, 2, {self.k}, {self.ctx.n}) query residues, got {a.shape}")
        _call("clg_packlwe_set_query", self.h, a.ctypes.data_as(_p_u64), a.size, a.shape[0], a.shape[1])

    def push_products(self, w, tok, col, present) -> None:
        """The next m leaves, made in Go from the query (`set_query`) and weight polynomials, for
        FastQuery's PackLWEs rows (``native/lattigo/pack_lwes.go``, "product leaves"): leaf i is
        -N^-1 X sum_b (query of token tok[i], block b) * w[col[i], b] (its c0 part reduced to the
        constant, which is all the trace keeps).  ``w`` (C, B, N) int64 the weight polynomials of
        the chunk's columns (|w| < 2^32); ``tok``, ``col``, ``present`` (m,)."""
        w = np.ascontiguousarray(w, dtype=np.int64)
        tok = np.ascontiguousarray(tok, dtype=np.int64).reshape(-1)
        col = np.ascontiguousarray(col, dtype=np.int64).reshape(-1)
        pres = np.ascontiguousarray(present, dtype=bool).astype(np.uint8).reshape(-1)
        m = pres.size
        if w.ndim != 3 or w.shape[2] != self.ctx.n or tok.size != m or col.size != m:
            raise HEError(f"expected weights (C, B, {self.ctx.n}) and {m} tokens and columns; got {w.shape}, "
                          f"{tok.size}, {col.size}")
        _call("clg_packlwe_push_products", self.h, w.ctypes.data_as(_p_i64), w.size, w.shape[0],
              tok.ctypes.data_as(_p_i64), col.ctypes.data_as(_p_i64), pres.ctypes.data_as(_p_u8), m)

    def push_cached(self, weights: "LattigoPackWeights", tok, col, present) -> None:
        """`push_products` with the weight polynomials of a prepared table (`pack_weights`,
        complete, with the query's blocks): ``col`` (m,) columns of the whole table."""
        tok = np.ascontiguousarray(tok, dtype=np.int64).reshape(-1)
        col = np.ascontiguousarray(col, dtype=np.int64).reshape(-1)
        pres = np.ascontiguousarray(present, dtype=bool).astype(np.uint8).reshape(-1)
        m = pres.size
        if tok.size != m or col.size != m:
            raise HEError(f"expected {m} tokens and columns; got {tok.size}, {col.size}")
        _call("clg_packlwe_push_cached", self.h, weights.h, tok.ctypes.data_as(_p_i64), col.ctypes.data_as(_p_i64),
              pres.ctypes.data_as(_p_u8), m)

    def finish(self) -> np.ndarray:
        """The packed ciphertext, (2, k, N) uint64 coefficient-form residues."""
        out = np.empty((2, self.k, self.ctx.n), np.uint64)
        _call("clg_packlwe_finish", self.h, out.ctypes.data_as(_p_u64), out.size)
        return out


class LattigoPackWeights(_Handle):
    """A table's weight polynomials for `LattigoPackLWEs.push_cached`, prepared once per session
    (``native/lattigo/pack_lwes.go``, "weights made once"): the signed weights as int16 and their
    transforms modulo each data prime as uint32, (2 + 4 k) bytes per coefficient.  `add` the
    columns in order, then push."""

    __slots__ = ("n_cols", "blocks")

    def __init__(self, h: int, ctx: LattigoContext, n_cols: int, blocks: int):
        super().__init__(h, ctx)
        self.n_cols, self.blocks = int(n_cols), int(blocks)

    def add(self, w) -> None:
        """The next columns' weight polynomials, (c, blocks, N) signed ints with |w| < 2^15."""
        w = np.ascontiguousarray(w, dtype=np.int64)
        if w.ndim != 3 or w.shape[1:] != (self.blocks, self.ctx.n):
            raise HEError(f"expected weights (c, {self.blocks}, {self.ctx.n}), got {w.shape}")
        _call("clg_packlwe_weights_add", self.h, w.ctypes.data_as(_p_i64), w.size, w.shape[0])


class LattigoBootstrapKeys(_Handle):
    """CKKS bootstrapping keys (Lattigo's ``bootstrapping.EvaluationKeys``: relinearisation key,
    the circuit's Galois keys, the sparse-secret encapsulation keys) with their evaluator.
    Several GB at N = 2^16: `close` (or the context manager) frees them at once and returns the
    memory to the OS; collection frees them too."""

    __slots__ = ()

    def _info(self):
        lvl, depth, nbytes, ng = _int(), _int(), _i64(), _int()
        _call("clg_btp_info", self.h, ctypes.byref(lvl), ctypes.byref(depth), ctypes.byref(nbytes), ctypes.byref(ng))
        return lvl.value, depth.value, nbytes.value, ng.value

    @property
    def output_level(self) -> int:
        """The level of a bootstrapped ciphertext (the residual parameters' top level)."""
        return self._info()[0]

    @property
    def depth(self) -> int:
        """Levels of the bootstrapping circuit (beyond the residual chain)."""
        return self._info()[1]

    @property
    def size_bytes(self) -> int:
        """The keys' size in Lattigo's binary serialisation (the "CLGB" layout is the same words)."""
        return self._info()[2]

    @property
    def n_galois_keys(self) -> int:
        return self._info()[3]

    def to_bytes(self) -> bytes:
        """The keys in the "CLGB" layout (expanded; GBs at N = 2^16) for
        `LattigoBackend.bootstrapping_keys_from_bytes`."""
        return _bytes_out("clg_btp_keys_to_bytes", self.h)

    def close(self) -> None:
        if self.h and _lib is not None and _lib_pid == os.getpid():
            _call("clg_btp_free", self.h)
            self.h = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LattigoLinearTransform(_Handle):
    """A slots x slots matrix encoded by its diagonals for Lattigo's BSGS evaluation."""

    __slots__ = ()

    def galois_elements(self) -> list[int]:
        """The automorphisms X -> X^g its evaluation needs (keys: `galois_keys_for_elements`)."""
        n = _int(0)
        _call("clg_lt_galois_elements", self.h, None, 0, ctypes.byref(n))
        out = np.zeros(max(n.value, 1), np.uint64)
        _call("clg_lt_galois_elements", self.h, out.ctypes.data_as(_p_u64), out.size, ctypes.byref(n))
        return [int(g) for g in out[: n.value]]


class LattigoBSGSMatrix(_Handle):
    """A matrix encoded for the offload matmul (`cipherlm.he.matmul`): per output block its
    pre-rotated diagonals as plaintexts (`LattigoBackend.bsgs_matrix`), evaluated in one call
    (`LattigoBackend.bsgs_apply`) on ``parts`` input ciphertexts."""

    __slots__ = ("n_blocks", "parts")

    def __init__(self, h: int, ctx, n_blocks: int, parts: int = 1):
        super().__init__(h, ctx)
        self.n_blocks = n_blocks
        self.parts = parts

    @property
    def n_plaintexts(self) -> int:
        n = _i64(0)
        _call("clg_bsgs_plaintexts", self.h, ctypes.byref(n))
        return int(n.value)

    @property
    def nbytes(self) -> int:
        """Memory of the stored diagonals' residues (a compressed diagonal keeps 1/T of them)."""
        n = _i64(0)
        _call("clg_bsgs_words", self.h, ctypes.byref(n))
        return 8 * int(n.value)


# ----------------------------------------------------------------------------- context
class LattigoContext:
    """Public state for one CKKS parameter set (a Go ``ckks.Parameters`` + encoder + evaluator)."""

    def __init__(self, params: HEParams):
        if params.scheme != "ckks":
            raise NotImplementedError(
                f"the Lattigo backend implements CKKS only ({params.name} is {params.scheme}); "
                "use the SEAL backend for BFV")
        check_security(params)
        bits = list(params.coeff_modulus_bits)
        if len(bits) < 2:
            raise HEError(f"{params.name}: need at least one data prime and the special prime")
        n = params.poly_modulus_degree
        log_n = n.bit_length() - 1
        if n != 1 << log_n:
            raise HEError(f"{params.name}: N = {n} is not a power of two")
        self.params = params
        self.n = n
        self.slots = n // 2
        self.default_scale_bits = bits[-2] if len(bits) > 2 else min(bits[0] - 10, 40)
        _q_arr, q_p, q_n = _i64_array(bits[:-1])
        _p_arr, p_p, p_n = _i64_array(bits[-1:])
        self._h = _Handle(_new("clg_ckks_new", log_n, q_p, q_n, p_p, p_n, self.default_scale_bits), None)
        self.handle = self._h.h
        self._read_info()
        if self.n != n:
            raise HEError(f"Lattigo built N = {self.n}, expected {n}")
        # Lattigo picks primes near 2^b, possibly just above: check the actual log2(QP) too
        log_qp = sum(math.log2(q) for q in self.q_moduli + self.p_moduli)
        if log_qp > max_logq(n):
            raise HEError(f"{params.name}: Lattigo's primes give log2(QP) = {log_qp:.3f} > {max_logq(n)} "
                          f"allowed for N = {n} at 128-bit classical security")

    def _read_info(self) -> None:
        """N, slots, max level and the primes Lattigo holds for this context (``clg_ctx_info``);
        ``coeff_moduli`` is the first data level's primes (the interface's)."""
        nn, ml, nq, np_ = _i64(), _int(), _int(), _int()
        mod = (ctypes.c_uint64 * 64)()
        _call("clg_ctx_info", self.handle, ctypes.byref(nn), ctypes.byref(ml), ctypes.byref(nq),
              ctypes.byref(np_), mod, 64)
        self.n, self.slots, self.max_level = nn.value, nn.value // 2, ml.value
        self.q_moduli = [int(mod[i]) for i in range(nq.value)]
        self.p_moduli = [int(mod[nq.value + i]) for i in range(np_.value)]
        self.coeff_moduli = list(self.q_moduli)

    #: bootstrappable presets (`LattigoBackend.bootstrappable_context`): name -> (Go preset id, test only)
    PRESETS: ClassVar[dict[str, tuple[int, bool]]] = {"N16QP1546H192H32": (1, False),
                                                     TEST_INSECURE_PRESET: (0, True)}

    @classmethod
    def from_preset(cls, preset: str, *, allow_insecure_for_tests: bool = False) -> LattigoContext:
        """A bootstrappable context from one of Lattigo's bootstrapping parameter sets
        (`PRESETS`).  ``"N16QP1546H192H32"``: Lattigo v6.2.0's default (residual Q 60 + 9 x 40
        bits, P 5 x 61, secret of Hamming weight 192, 2^15 slots; the bootstrapping circuit's
        modulus QP is 1546 bits), checked with `params.check_security_logqp`.
        `TEST_INSECURE_PRESET` (N = 2^10) is INSECURE, for tests only: refused unless
        ``allow_insecure_for_tests=True``."""
        if preset not in cls.PRESETS:
            raise HEError(f"unknown bootstrapping preset {preset!r}; known: {sorted(cls.PRESETS)}")
        pid, test_only = cls.PRESETS[preset]
        if test_only and allow_insecure_for_tests is not True:
            raise HEError(f"{preset} is an insecure test-only parameter set (allow_insecure_for_tests=True "
                          "is for the test suite only)")
        h = _Handle(_new("clg_ckks_new_preset", pid, int(bool(test_only))), None)
        self = cls.__new__(cls)
        self._h, self.handle = h, h.h
        self._read_info()
        logqp, hw, eph, lslots, tst = _dbl(), _int(), _int(), _int(), _int()
        _call("clg_btp_ctx_info", self.handle, ctypes.byref(logqp), ctypes.byref(hw), ctypes.byref(eph),
              ctypes.byref(lslots), ctypes.byref(tst))
        self.bootstrap_log_qp = logqp.value
        self.secret_hamming_weight = hw.value or None
        self.ephemeral_hamming_weight = eph.value
        self.bootstrap_slots = 1 << lslots.value
        self.test_only = bool(tst.value)
        self.default_scale_bits = 40  # both presets: LogDefaultScale 40
        bits = tuple(m.bit_length() for m in self.q_moduli + self.p_moduli)
        self.params = HEParams(preset, "ckks", self.n, bits, input_scale_bits=40, weight_scale_bits=40)
        if not self.test_only:
            check_security_logqp(preset, self.n, self.bootstrap_log_qp, secret_hamming_weight=hw.value or None)
        return self

    @classmethod
    def from_primes(cls, n: int, q_moduli: Sequence[int], p_moduli: Sequence[int]) -> LattigoContext:
        """A context whose data primes are exactly ``q_moduli`` (q0 first) and whose key-switching
        primes are ``p_moduli`` (NTT-friendly for 2N; e.g. the primes a SEAL context chose),
        checked against the HE-standard bound on log2(QP) for N (`params.max_logq`).  Only
        the ring layer is meant to be used (PackLWEs, `LattigoBackend.pack_lwes_packer`)."""
        n = int(n)
        log_n = n.bit_length() - 1
        if n != 1 << log_n:
            raise HEError(f"N = {n} is not a power of two")
        qs = np.ascontiguousarray([int(q) for q in q_moduli], dtype=np.uint64)
        ps = np.ascontiguousarray([int(p) for p in p_moduli], dtype=np.uint64)
        log_qp = sum(math.log2(int(m)) for m in list(qs) + list(ps))
        if log_qp > max_logq(n):
            raise HEError(f"log2(QP) = {log_qp:.3f} > {max_logq(n)} allowed for N = {n} at 128-bit classical security")
        h = _Handle(_new("clg_ctx_new_primes", log_n, qs.ctypes.data_as(_p_u64), qs.size,
                         ps.ctypes.data_as(_p_u64), ps.size), None)
        self = cls.__new__(cls)
        self._h, self.handle = h, h.h
        self._read_info()
        if self.q_moduli != [int(q) for q in qs] or self.p_moduli != [int(p) for p in ps]:
            raise HEError("Lattigo did not keep the given primes")
        bits = tuple(m.bit_length() for m in self.q_moduli + self.p_moduli)
        self.default_scale_bits = max(1, min(bits) - 2)  # a placeholder (clg_ctx_new_primes)
        self.params = HEParams(f"primes-{n}-{sum(bits)}", "ckks", n, bits)
        return self

    #: half-ring kinds (`half_ring`): "real", the conjugate-invariant ring (N/2 real slots);
    #: "even", the standard ring of degree N/2 (N/4 complex slots)
    HALF_RING_KINDS: ClassVar[tuple[str, ...]] = ("real", "even")

    def half_ring(self, kind: str = "real", levels: int = 1) -> LattigoContext:
        """A ring of degree N/2 over this context's first ``levels`` data primes (no special
        prime), made once per (kind, levels):
        - ``"real"``: the conjugate-invariant ring, N/2 real slots; at one prime it holds
          half-ring results of complex-input plans, at all data primes half-ring inputs
          (`LattigoSecretKeys.input_switch_key`);
        - ``"even"``: the standard ring of degree N/2, N/4 complex slots; at one prime it holds
          the even-folded results of real-input plans.
        docs/offload.md "Half-ring results".  Only the client's secrets are of these rings; their
        ciphertexts (the sum of the primes' bits) are checked against the 128-bit bound for
        degree N/2."""
        if kind not in self.HALF_RING_KINDS:
            raise HEError(f"unknown half-ring kind {kind!r}; known: {self.HALF_RING_KINDS}")
        levels = int(levels)
        if not 1 <= levels <= len(self.q_moduli):
            raise HEError(f"a half ring of {levels} primes for a context of {len(self.q_moduli)}")
        cache = self.__dict__.setdefault("_half_rings", {})
        half = cache.get((kind, levels))
        if half is not None:
            return half
        h = _Handle(_new("clg_ctx_half_ring", self.handle, int(kind == "real"), levels), None)
        half = LattigoContext.__new__(LattigoContext)
        half._h, half.handle = h, h.h
        half._read_info()
        if kind == "real":
            half.slots = half.n  # conjugate-invariant: N/2 real slots, as many as the full ring's complex ones
        if half.n * 2 != self.n or half.q_moduli != self.q_moduli[:levels] or half.p_moduli:
            raise HEError(f"Lattigo built a half ring that is not (N/2, the first {levels} primes)")
        log_q = sum(math.log2(q) for q in half.q_moduli)
        if log_q > max_logq(half.n):
            raise HEError(f"half ring: log2(Q) = {log_q:.3f} > {max_logq(half.n)} allowed for N = {half.n} at "
                          "128-bit classical security")
        half.default_scale_bits = self.default_scale_bits
        half.params = HEParams(f"{self.params.name}-half-{kind}-{levels}", "ckks", half.n,
                               tuple(q.bit_length() for q in half.q_moduli),
                               input_scale_bits=self.params.input_scale_bits,
                               weight_scale_bits=self.params.weight_scale_bits)
        half.half_kind = kind
        cache[(kind, levels)] = half
        return half

    @property
    def bootstrappable(self) -> bool:
        return hasattr(self, "bootstrap_log_qp")

    def __repr__(self) -> str:
        return (f"LattigoContext({self.params.name}, N={self.n}, Q={[m.bit_length() for m in self.q_moduli]} "
                f"bits, P={[m.bit_length() for m in self.p_moduli]} bits)")


class LattigoSecretKeys(SecretKeys):
    """A CKKS secret key (kept in Go) with its encryptor / decryptor and public key."""

    def __init__(self, ctx: LattigoContext):
        sk, pk = _i64(0), _i64(0)
        _call("clg_keygen", ctx.handle, ctypes.byref(sk), ctypes.byref(pk))
        self.ctx = ctx
        self._sk = _Handle(sk.value, ctx)
        self.public_key = LattigoPublicKey(pk.value, ctx)

    @classmethod
    def from_ternary(cls, ctx: LattigoContext, s) -> LattigoSecretKeys:
        """The secret key with the given ternary coefficients (N values in {-1, 0, 1}; e.g. a
        numpy RLWE secret, so that numpy and Lattigo encrypt and decrypt under one key)."""
        a = np.ascontiguousarray(np.asarray(s).reshape(-1), dtype=np.int64)
        if a.size != ctx.n:
            raise HEError(f"{a.size} secret coefficients for N = {ctx.n}")
        self = cls.__new__(cls)
        self.ctx = ctx
        self._sk = _Handle(_new("clg_sk_from_ternary", ctx.handle, a.ctypes.data_as(_p_i64), a.size), ctx)
        self.public_key = LattigoPublicKey(_new("clg_pk_of_sk", self._sk.h), ctx)
        return self

    def encrypt(self, pt: LattigoPlaintext) -> LattigoCiphertext:
        return LattigoCiphertext(_new("clg_encrypt_sk", self._sk.h, pt.h), self.ctx)

    def encrypt_seeded(self, pt: LattigoPlaintext | LattigoRawPlaintext) -> bytes:
        """Symmetric encryption serialised with a 32-byte seed in place of the uniform half
        (about half the bytes of `ciphertext_to_bytes`); `ciphertext_from_bytes` loads it.
        A `LattigoRawPlaintext` (BLB Algorithm 2) is encrypted as a seeded encryption of zero
        at its level whose c0 gets the residues added (c0 travels in NTT form) and whose
        header gets the plaintext's scale."""
        if isinstance(pt, LattigoRawPlaintext):
            zero = LattigoBackend().encode_slots(self.ctx, np.zeros(1), level=pt.level)
            b = _bytes_out("clg_encrypt_seeded", self._sk.h, zero.h)
            n, qs = self.ctx.n, [int(q) for q in self.ctx.q_moduli[: pt.level + 1]]
            if len(b) != seeded_ciphertext_bytes(n, qs, pt.level):
                raise HEError(f"seeded blob of {len(b)} bytes, expected {seeded_ciphertext_bytes(n, qs, pt.level)}")
            off = _CT_HEADER.size + _SEED_BYTES
            out = [b[:_CT_HEADER.size - 8], struct.pack("<d", float(pt.scale)), b[_CT_HEADER.size:off]]
            for j, q in enumerate(qs):  # c0 row j (+ the residues, in NTT form), re-packed
                rl = packed_row_bytes(n, q)
                c0 = _unpack_row(b[off:off + rl], n, q)
                out.append(_pack_row(_add_residues(c0[None], np.asarray(pt.ntt[j], np.uint64)[None], [q])[0], q))
                off += rl
            return b"".join(out)
        return _bytes_out("clg_encrypt_seeded", self._sk.h, pt.h)

    def decrypt(self, ct: LattigoCiphertext) -> LattigoPlaintext:
        return LattigoPlaintext(_new("clg_decrypt", self._sk.h, ct.h), self.ctx)

    def refresh_plaintext(self, ct: LattigoCiphertext) -> LattigoPlaintext:
        """The client's half of the client-aided refresh (`protocols.ckks.refresh`), up to the
        encryption: ``ct`` decrypted to its integer polynomial (exact, centred modulo the
        primes of its level), scaled by default scale / its scale, as a plaintext at the top
        level with the default scale.  Fails only for coefficients too large for the top
        modulus, never because of what they encode."""
        return LattigoPlaintext(_new("clg_ct_refresh_plaintext", self._sk.h, ct.h), self.ctx)

    def public_key_bytes(self) -> bytes:
        return _bytes_out("clg_pk_to_bytes", self.public_key.h)

    def galois_keys(self, steps: Iterable[int], *, conjugate: bool = False) -> LattigoGaloisKeys:
        """A local Galois key set for slot rotations by ``steps`` (left, |step| < N/2)."""
        _arr, p, n = _i64_array(steps)
        return LattigoGaloisKeys(_new("clg_gen_rotation_keys", self._sk.h, p, n, int(conjugate)), self.ctx)

    def galois_keys_bytes(self, steps, *, conjugate: bool = False) -> bytes:
        """Seeded (compressed, about half-size) Galois keys for slot rotations by ``steps``
        (and the conjugation, with ``conjugate``), for the peer
        (`LattigoBackend.galois_keys_from_bytes` expands them)."""
        _arr, p, n = _i64_array(steps)
        els = np.zeros(max(n, 1) + 2, np.uint64)
        k = _int(0)
        _call("clg_steps_to_elements", self.ctx.handle, p, n, int(conjugate), els.ctypes.data_as(_p_u64), els.size,
              ctypes.byref(k))
        return self.galois_keys_bytes_for_elements(els[: k.value])

    def galois_keys_for_elements(self, elements: Iterable[int]) -> LattigoGaloisKeys:
        """A local Galois key set for the automorphisms X -> X^g (e.g. a linear transform's
        `LattigoLinearTransform.galois_elements`)."""
        els = np.ascontiguousarray(np.asarray(list(elements), dtype=np.uint64).reshape(-1))
        return LattigoGaloisKeys(_new("clg_gen_galois_keys", self._sk.h, els.ctypes.data_as(_p_u64), els.size),
                                 self.ctx)

    def galois_keys_bytes_for_elements(self, elements) -> bytes:
        """Seeded (compressed) Galois keys for the automorphisms X -> X^g."""
        els = np.ascontiguousarray(np.asarray(list(elements), dtype=np.uint64).reshape(-1))
        return _bytes_out("clg_galois_keys_compressed", self._sk.h, els.ctypes.data_as(_p_u64), els.size)

    def _half_ring_keygen(self, fn: str, small: LattigoContext) -> tuple[LattigoSecretKeys, bytes]:
        h = _i64(0)
        p, n = _p_u8(), _i64(0)
        _call(fn, self._sk.h, small.handle, ctypes.byref(h), ctypes.byref(p), ctypes.byref(n))
        try:
            blob = ctypes.string_at(p, n.value)
        finally:
            _load().clg_free_buf(p)
        keys = LattigoSecretKeys.__new__(LattigoSecretKeys)
        keys.ctx, keys._sk, keys.public_key = small, _Handle(h.value, small), None
        return keys, blob

    def ring_switch_key(self, kind: str = "real") -> tuple[LattigoSecretKeys, bytes]:
        """A fresh secret s' of the half ring ``kind`` at one prime (`LattigoContext.half_ring`)
        and, for the peer, the seeded key that switches a level-0 ciphertext under s to s'
        (unfolded to degree N, or s'(X^2) for ``"even"``) (`LattigoBackend.ring_switch_key_from_bytes`,
        `LattigoBackend.ring_switch`).  The returned keys decrypt half-ring results; they have
        no public key."""
        return self._half_ring_keygen("clg_ring_switch_keygen", self.ctx.half_ring(kind))

    def input_switch_key(self) -> tuple[LattigoSecretKeys, bytes]:
        """A fresh secret s'' of the conjugate-invariant half ring at all data primes
        (`LattigoContext.half_ring` ``"real"``) and, for the peer, the seeded key that takes a
        ciphertext under s'' to one under s at the top level (`LattigoBackend.real_to_complex`).
        The returned keys encrypt half-ring inputs (real slot values, half the bytes)."""
        return self._half_ring_keygen("clg_input_switch_keygen", self.ctx.half_ring("real", len(self.ctx.q_moduli)))

    def eval_keys(self, *, relin: bool = True, steps: Iterable[int] = (), conjugate: bool = False) -> LattigoEvalKeys:
        """A local evaluation key set: a relinearisation key (``relin``; for `multiply`,
        `evaluate_chebyshev`) and Galois keys for the rotations ``steps``."""
        _arr, p, n = _i64_array(steps)
        return LattigoEvalKeys(_new("clg_gen_eval_keys", self._sk.h, int(bool(relin)), p if n else None, n,
                                    int(conjugate)), self.ctx)

    def relin_key_bytes(self) -> bytes:
        """A fresh relinearisation key for the peer ("CLGR" layout; `LattigoBackend.relin_keys_from_bytes`)."""
        return self.eval_keys(relin=True).relin_key_bytes()

    def bootstrapping_keys(self) -> LattigoBootstrapKeys:
        """The bootstrapping keys of this secret key (a context from `LattigoContext.from_preset`).
        At N = 2^16 (N16QP1546H192H32): several GB and about a minute."""
        if not getattr(self.ctx, "bootstrappable", False):
            raise HEError("bootstrapping keys need a bootstrappable context (LattigoContext.from_preset)")
        return LattigoBootstrapKeys(_new("clg_btp_keygen", self._sk.h), self.ctx)


# ----------------------------------------------------------------------------- backend
#: Lattigo's machine constants.  ``offload``: per op at N = 8192, primes (60, 40 | 60), measured
#: with benchmarks/bench_he_backends.py on the 2-vCPU reference machine on 2026-11-24 (load 2.5-4,
#: medians, the wrapper's Python cost included; the SEAL defaults of `OffloadCostModel` are from
#: the dev machine); ``twopc``: SEAL's (the 2pc packings are BFV and do not run on this backend).
LATTIGO_COSTS = HECostModel(
    twopc=TwoPCCostModel(),
    offload=OffloadCostModel(rotate=1.9e-3, rotate_low=0.9e-3, multiply_plain=0.06e-3, add=0.02e-3,
                             rescale=0.42e-3, decrypt_decode=0.24e-3),
)


class LattigoBackend(HEBackend):
    """CKKS on Lattigo v6 (module docstring: what is implemented and what raises
    NotImplementedError: BFV, encode_coeffs, to_ntt_inplace / from_ntt_inplace,
    pack_lwes_stream (PackLWEs is `pack_lwes_packer`), plaintext_to_numpy)."""

    name = "lattigo"
    schemes = ("ckks",)
    cost_model = LATTIGO_COSTS
    slot_generator = 5  # Lattigo's CKKS encoder: slot j is m(omega^(5^j))

    # -- parameters / context ---------------------------------------------------------
    def context(self, params: HEParams) -> LattigoContext:
        return LattigoContext(params)

    def level(self, ctx: LattigoContext, n_primes: int) -> int:
        if not 1 <= n_primes <= ctx.max_level + 1:
            raise HEError(f"no level with {n_primes} primes (1..{ctx.max_level + 1})")
        return int(n_primes) - 1

    def seeded_ciphertext_bytes(self, ctx: LattigoContext, level: int) -> int:
        """The exact length of a seeded ciphertext (`LattigoSecretKeys.encrypt_seeded`) at
        ``level``: 52 + sum over its primes q_j of ceil(N bitlen(q_j - 1) / 8)."""
        return seeded_ciphertext_bytes(ctx.n, ctx.q_moduli, level)

    def special_modulus(self, ctx: LattigoContext) -> int:
        return ctx.p_moduli[-1]

    def primes(self, n: int, bits: list[int]) -> list[int]:
        log_n = int(n).bit_length() - 1
        if n != 1 << log_n:
            raise HEError(f"N = {n} is not a power of two")
        _arr, p, k = _i64_array(bits)
        out = np.zeros(k, np.uint64)
        _call("clg_primes", log_n, p, k, out.ctypes.data_as(_p_u64))
        return [int(x) for x in out]

    # -- keys ----------------------------------------------------------------------------
    def keygen(self, ctx: LattigoContext) -> LattigoSecretKeys:
        return LattigoSecretKeys(ctx)

    def load_public_key(self, ctx: LattigoContext, data: bytes) -> LattigoPublicKey:
        p, n, _keep = _in_buf(data)
        return LattigoPublicKey(_new("clg_pk_from_bytes", ctx.handle, p, n), ctx)

    def encrypt_zero(self, ctx: LattigoContext, pk: LattigoPublicKey, level) -> LattigoCiphertext:
        return LattigoCiphertext(_new("clg_encrypt_pk", pk.h, 0, int(level)), ctx)

    def encrypt_public(self, ctx: LattigoContext, pk: LattigoPublicKey, pt: LattigoPlaintext) -> LattigoCiphertext:
        return LattigoCiphertext(_new("clg_encrypt_pk", pk.h, pt.h, 0), ctx)

    # -- encoding ------------------------------------------------------------------------
    def encode_coeffs(self, ctx, coeffs, *, level=None, ntt: bool = False):
        raise NotImplementedError("Lattigo backend: coefficient packing is a BFV operation (CKKS only here)")

    def encode_slots(self, ctx: LattigoContext, values, *, level=None, ntt: bool = True,
                     scale_bits: float | None = None, tile: bool = False) -> LattigoPlaintext:
        """CKKS-encode up to N/2 real or complex values (the rest are zero) at ``level``
        (default: the top), with scale 2^``scale_bits`` (default: the context's).  ``ntt`` is
        ignored: Lattigo's CKKS plaintexts are always in NTT form.  ``tile``: the values (a
        power-of-two count) repeated over all N/2 slots, encoded at that sparse dimension:
        the same plaintext as encoding ``np.tile(values, N / 2 / len(values))``, with an FFT of
        len(values) points instead of N/2."""
        v = np.asarray(values)
        if v.ndim != 1 or not 1 <= v.size <= ctx.slots:
            raise HEError(f"expected 1..{ctx.slots} slot values, got shape {v.shape}")
        if tile and v.size & (v.size - 1):
            raise HEError(f"a tiled encoding takes a power-of-two count of values, got {v.size}")
        lvl = ctx.max_level if level is None else int(level)
        re = np.ascontiguousarray(v.real, dtype=np.float64)
        if not np.all(np.isfinite(re)):
            raise HEError("slot values must be finite")
        im_p = None
        if np.iscomplexobj(v):
            im = np.ascontiguousarray(v.imag, dtype=np.float64)
            im_p = im.ctypes.data_as(_p_dbl)
        sb = 0.0 if scale_bits is None else float(scale_bits)
        h = _new("clg_encode", ctx.handle, re.ctypes.data_as(_p_dbl), im_p, int(v.size), lvl, sb, int(bool(tile)))
        return LattigoPlaintext(h, ctx)

    def decode_slots(self, ctx: LattigoContext, pt: LattigoPlaintext, *, n: int | None = None,
                     complex_out: bool = False) -> np.ndarray:
        """A CKKS plaintext (e.g. a decryption) -> its first ``n`` slot values (float64, or
        complex128 with ``complex_out``)."""
        if not isinstance(pt, LattigoPlaintext):
            raise HEError("the Lattigo backend decodes plaintexts (keys.decrypt(ct)), not coefficient arrays")
        k = ctx.slots if n is None else int(n)
        re = np.zeros(k, np.float64)
        im = np.zeros(k, np.float64) if complex_out else None
        _call("clg_decode", pt.h, re.ctypes.data_as(_p_dbl), None if im is None else im.ctypes.data_as(_p_dbl), k)
        return re + 1j * im if complex_out else re

    # -- evaluation ----------------------------------------------------------------------
    def multiply_plain(self, ctx, ct: LattigoCiphertext, pt: LattigoPlaintext, out=None) -> LattigoCiphertext:
        """ct * pt at min(level) (no rescale: the result's scale is the product)."""
        if out is not None:
            _new("clg_mul_plain", ct.h, pt.h, out.h)
            return out
        return LattigoCiphertext(_new("clg_mul_plain", ct.h, pt.h, 0), ctx)

    def add_inplace(self, ctx, a: LattigoCiphertext, b: LattigoCiphertext) -> None:
        _call("clg_add", a.h, b.h, 0)

    def add_plain_inplace(self, ctx, ct: LattigoCiphertext, pt: LattigoPlaintext | LattigoRawPlaintext) -> None:
        """ct + pt at the same scale (a `LattigoRawPlaintext`: its residues added to c0, at the
        ciphertext's level and scale)."""
        if isinstance(pt, LattigoRawPlaintext):
            arr = self.ciphertext_to_numpy(ct)
            if pt.level != arr.shape[1] - 1:
                raise HEError(f"a plaintext at level {pt.level} added to a ciphertext at level {arr.shape[1] - 1}")
            arr[0] = _add_residues(arr[0], pt.ntt, ctx.q_moduli)
            new = self.numpy_to_ciphertext(ctx, arr, scale=ct.scale)
            ct._replace(new.h)
            new.h = 0
            return
        _call("clg_add", ct.h, pt.h, 1)

    def rotate_rows(self, ctx, ct: LattigoCiphertext, step: int, galois_keys: LattigoGaloisKeys) -> LattigoCiphertext:
        """Slots rotated left by ``step`` (CKKS: one row of N/2 slots)."""
        return LattigoCiphertext(_new("clg_rotate", galois_keys.h, ct.h, int(step)), ctx)

    def rotate_rows_inplace(self, ctx, ct: LattigoCiphertext, step: int, galois_keys: LattigoGaloisKeys) -> None:
        ct._replace(_new("clg_rotate", galois_keys.h, ct.h, int(step)))

    def conjugate(self, ctx, ct: LattigoCiphertext, galois_keys: LattigoGaloisKeys) -> LattigoCiphertext:
        """Every slot's complex conjugate (the key set's conjugation key)."""
        return LattigoCiphertext(_new("clg_conjugate", galois_keys.h, ct.h), ctx)

    def rotate_hoisted(self, ctx, ct: LattigoCiphertext, steps: Sequence[int],
                       galois_keys: LattigoGaloisKeys) -> list[LattigoCiphertext]:
        """Rotations of ``ct`` by each step (left), one shared decomposition of c1
        (Lattigo's RotateHoisted); step 0 gives a copy."""
        _arr, p, n = _i64_array(steps)
        if n == 0:
            return []
        out = np.zeros(n, np.int64)
        _call("clg_rotate_hoisted", galois_keys.h, ct.h, p, n, out.ctypes.data_as(_p_i64))
        return [LattigoCiphertext(int(h), ctx) for h in out]

    def linear_transform_encode(self, ctx: LattigoContext, diagonals, *, level=None,
                                scale_bits: float | None = None,
                                log_bsgs_ratio: int = 1) -> LattigoLinearTransform:
        """Encode a slots x slots matrix M from its non-zero diagonals: ``{d: v}`` with
        ``v[i] = M[i][(i + d) % slots]`` (length N/2 each; a (k, N/2) array plus a list of k
        indices also works as ``(indices, array)``), at ``level`` (default: the top), with
        plaintext scale 2^``scale_bits`` (default: the level's last prime, so `rescale_inplace`
        restores the input's scale).  ``log_bsgs_ratio``: log2 of baby steps / giant steps
        (-1: no BSGS)."""
        if isinstance(diagonals, tuple):
            idx, vals = diagonals
        else:
            idx, vals = list(diagonals.keys()), [diagonals[k] for k in diagonals]
        arr = np.ascontiguousarray(np.asarray(vals, dtype=np.float64))
        if arr.ndim != 2 or arr.shape[1] != ctx.slots or arr.shape[0] != len(idx) or not arr.shape[0]:
            raise HEError(f"expected k diagonals of {ctx.slots} values, got {arr.shape} for {len(idx)} indices")
        if not np.all(np.isfinite(arr)):
            raise HEError("diagonal values must be finite")
        _a, ip, n = _i64_array(idx)
        lvl = ctx.max_level if level is None else int(level)
        sb = 0.0 if scale_bits is None else float(scale_bits)
        h = _new("clg_lt_new", ctx.handle, ip, n, arr.ctypes.data_as(_p_dbl), lvl, sb, int(log_bsgs_ratio))
        return LattigoLinearTransform(h, ctx)

    def linear_transform(self, ctx, ct: LattigoCiphertext, lt: LattigoLinearTransform,
                         galois_keys: LattigoGaloisKeys) -> LattigoCiphertext:
        """M(ct) by Lattigo's BSGS with hoisted baby steps (no rescale: the result's scale is
        the input's times the transform's)."""
        return LattigoCiphertext(_new("clg_lt_eval", galois_keys.h, ct.h, lt.h), ctx)

    def bsgs_matrix(self, ctx: LattigoContext, diagonals: np.ndarray, *, g: int, chunk_steps: Sequence[int],
                    scale: float, level=None, workers: int = 2, repeat: int = 1, parts: int = 1) -> LattigoBSGSMatrix:
        """The offload matmul's encoded matrix (`cipherlm.he.matmul.encode_matrix`): ``diagonals``
        complex (n_blocks, parts m, W), the pre-rotated diagonals of each output block (input
        p's m at p m; all-zero ones are not stored) over the W = slots slots, or over one period
        W of diagonals whose slot vectors repeat every W slots (W a power of two: encoded
        sparse, the whole vector being the row repeated slots / W times), encoded at ``level`` (default: the top) with
        plaintext scale ``scale``; ``g`` baby steps, giant steps of g slots, ``chunk_steps`` the
        chunk sum's rotations; ``parts`` input ciphertexts whose products every block sums
        (`bsgs_apply`).  ``workers`` goroutines encode.  ``repeat`` T > 1 (a power of two): a
        diagonal whose residues come in runs of up to T equal values (period S / T in the slots,
        e.g. a packed plan's with one chunk) is stored one value per run, 1/T of the memory, with
        the same results (`clg_bsgs_compress`); the others are stored whole."""
        d = np.asarray(diagonals)
        if d.ndim != 3 or not d.shape[0] or not d.shape[1] or d.shape[1] % parts or not 1 <= d.shape[2] <= ctx.slots \
                or ctx.slots % d.shape[2] or d.shape[2] & (d.shape[2] - 1):
            raise HEError(f"expected diagonals (n_blocks, {parts} m, a power of two dividing {ctx.slots}), got {d.shape}")
        if not (scale > 0 and math.isfinite(scale)):
            raise HEError(f"bad plaintext scale {scale}")
        n_blocks, m = int(d.shape[0]), int(d.shape[1]) // parts
        lvl = ctx.max_level if level is None else int(level)
        _c, cp, cn = _i64_array(chunk_steps)
        h = _new("clg_bsgs_new", ctx.handle, n_blocks, m, int(g), int(parts), cp if cn else None, cn, lvl,
                 math.log2(scale))
        mat = LattigoBSGSMatrix(h, ctx, n_blocks, parts)
        if repeat != 1:
            _call("clg_bsgs_compress", h, int(repeat))
        for o in range(n_blocks):
            blk = d[o]
            re = np.ascontiguousarray(blk.real, dtype=np.float64)
            im = np.ascontiguousarray(blk.imag, dtype=np.float64)
            if not (np.all(np.isfinite(re)) and np.all(np.isfinite(im))):
                raise HEError("diagonal values must be finite")
            nz = np.ascontiguousarray(np.any(blk != 0, axis=1), dtype=np.uint8)
            _call("clg_bsgs_set", h, o, re.ctypes.data_as(_p_dbl), im.ctypes.data_as(_p_dbl), int(d.shape[2]),
                  nz.ctypes.data_as(_p_u8), int(workers))
        return mat

    def bsgs_apply(self, ctx, ct: LattigoCiphertext | Sequence[LattigoCiphertext], mat: LattigoBSGSMatrix,
                   galois_keys: LattigoGaloisKeys, *, workers: int = 1
                   ) -> tuple[list[LattigoCiphertext | None], dict[str, int]]:
        """The offload matmul of one input (``mat.parts`` ciphertexts, a sequence when more than
        one; one scale) in one call (``workers`` goroutines): hoisted baby steps of every input,
        per (block, giant step) the products summed over the inputs, a rescale and the giant
        rotation, then the chunk sum.  Returns each block's result (None: all-zero block; one
        level below the input) and the op counts."""
        cts = list(ct) if isinstance(ct, (list, tuple)) else [ct]
        if len(cts) != mat.parts:
            raise HEError(f"the matrix takes {mat.parts} input ciphertexts, got {len(cts)}")
        hs = np.ascontiguousarray([c.h for c in cts], np.int64)
        out = np.zeros(mat.n_blocks, np.int64)
        cnt = np.zeros(4, np.int64)
        _call("clg_bsgs_eval", galois_keys.h, hs.ctypes.data_as(_p_i64), len(cts), mat.h, int(workers),
              out.ctypes.data_as(_p_i64), cnt.ctypes.data_as(_p_i64))
        res = [LattigoCiphertext(int(h), ctx) if h else None for h in out]
        return res, {"rotations": int(cnt[0]), "multiply_plain": int(cnt[1]), "add": int(cnt[2]),
                     "rescale": int(cnt[3])}

    def token_group_linear(self, ctx, cts: Sequence[LattigoCiphertext], w, mask, *, tp: int, g: int,
                           keys: LattigoEvalKeys, workers: int = 2) -> tuple[list, dict[str, int]]:
        """The fhe mode's projection in one call (native/lattigo/tg_linear.go): the padded
        matrix ``w`` (n_out cpc x n_in cpc) times the token-group packed ciphertexts ``cts``
        (one level; cpc = slots / tp channels each), positions weighted by ``mask`` (tp
        values), by diagonals over the channels with ``g`` hoisted baby steps of tp slots and
        giant steps of g tp, the diagonals encoded on the fly at the input's level by
        ``workers`` goroutines.  Returns each output block (None: all-zero; one level below,
        rescaled) and the op counts (rotations, products, rescales)."""
        W = np.ascontiguousarray(w, dtype=np.float64)
        m = np.ascontiguousarray(mask, dtype=np.float64).reshape(-1)
        cpc = ctx.slots // int(tp)
        if W.ndim != 2 or W.shape[1] != len(cts) * cpc or W.shape[0] % cpc or m.size != int(tp):
            raise HEError(f"matrix {W.shape} / mask {m.size} do not fit {len(cts)} inputs of {cpc} channels x {tp}")
        n_out = W.shape[0] // cpc
        hs = np.asarray([c.h for c in cts], np.int64)
        out = np.zeros(n_out, np.int64)
        cnt = np.zeros(3, np.int64)
        _call("clg_tg_linear", keys.h, hs.ctypes.data_as(_p_i64), len(cts), W.ctypes.data_as(_p_dbl), n_out,
              m.ctypes.data_as(_p_dbl), int(tp), int(g), int(workers), out.ctypes.data_as(_p_i64),
              cnt.ctypes.data_as(_p_i64))
        return ([LattigoCiphertext(int(h), ctx) if h else None for h in out],
                {"rotate": int(cnt[0]), "mul_plain": int(cnt[1]), "rescale": int(cnt[2])})

    def blb_linear(self, ctx, babies: np.ndarray, w, *, period: int, plans, scale_bits: float,
                   keys: LattigoEvalKeys, workers: int = 2) -> tuple[np.ndarray, dict[str, int]]:
        """BLB's stacked-row projection in one call (native/lattigo/blb_linear.go): ``babies``
        an object array (rows, input chunks, B) of the input's hoisted rotations rot(x, i),
        ``w`` the d_out x d_in matrix, ``plans`` (b, g, k0) per output chunk of ``period``
        slots (`runtime.blb_block.linear_plan`), the diagonals encoded at the inputs' level
        with scale 2^``scale_bits``.  Returns the (rows, output chunks) ciphertexts, rescaled
        once (None: an all-zero block), and the counts (products, giant rotations)."""
        W = np.ascontiguousarray(w, dtype=np.float64)
        if babies.ndim != 3 or W.ndim != 2:
            raise HEError(f"baby steps {babies.shape} / matrix {W.shape}: expected (rows, chunks, B) and 2-D")
        m, k_in, nb = babies.shape
        pl = np.ascontiguousarray(np.asarray(plans, np.int64).reshape(-1, 3))
        if len(pl) != -(-W.shape[0] // int(period)):  # the library reads one plan per output chunk
            raise HEError(f"{len(pl)} plans for {W.shape[0]} outputs in chunks of {period}")
        hs = np.ascontiguousarray([c.h for c in babies.reshape(-1)], np.int64)
        out = np.zeros(m * len(pl), np.int64)
        cnt = np.zeros(2, np.int64)
        _call("clg_blb_linear", keys.h, hs.ctypes.data_as(_p_i64), m, k_in, nb, W.ctypes.data_as(_p_dbl),
              W.shape[0], W.shape[1], int(period), pl.ctypes.data_as(_p_i64), float(scale_bits), int(workers),
              out.ctypes.data_as(_p_i64), cnt.ctypes.data_as(_p_i64))
        res = np.empty((m, len(pl)), object)
        for idx, h in zip(np.ndindex(m, len(pl)), out):
            res[idx] = LattigoCiphertext(int(h), ctx) if h else None
        return res, {"ct_pt": int(cnt[0]), "rotations": int(cnt[1])}

    # -- fhe-mode operations (ABI 5: ckks_ops.go, bootstrap.go) ---------------------------
    @staticmethod
    def bootstrap_presets() -> dict[str, bool]:
        """The bootstrapping presets `bootstrappable_context` knows: name -> INSECURE (tests only)."""
        return {k: bool(v[1]) for k, v in LattigoContext.PRESETS.items()}

    def bootstrappable_context(self, preset: str = "N16QP1546H192H32", *,
                               allow_insecure_for_tests: bool = False) -> LattigoContext:
        """`LattigoContext.from_preset` (the test preset only with ``allow_insecure_for_tests``)."""
        return LattigoContext.from_preset(preset, allow_insecure_for_tests=allow_insecure_for_tests)

    def multiply(self, ctx, a: LattigoCiphertext, b: LattigoCiphertext, keys: LattigoEvalKeys) -> LattigoCiphertext:
        """a * b (ciphertexts; a is b squares), relinearised, no rescale (scale = product):
        `rescale_inplace` next.  Needs level >= 1 and a relinearisation key."""
        return LattigoCiphertext(_new("clg_mul_relin", keys.h, a.h, b.h), ctx)

    def multiply_sum(self, ctx, xs: Sequence[LattigoCiphertext], ys: Sequence[LattigoCiphertext],
                     keys: LattigoEvalKeys) -> LattigoCiphertext:
        """sum_i xs[i] * ys[i] relinearised once (the degree-2 products summed first), no
        rescale; at the operands' lowest level, all products at one scale."""
        if len(xs) != len(ys) or not xs:
            raise HEError(f"{len(xs)} and {len(ys)} factors: expected as many, at least one")
        a = np.ascontiguousarray([c.h for c in xs], np.int64)
        b = np.ascontiguousarray([c.h for c in ys], np.int64)
        return LattigoCiphertext(_new("clg_mul_sum", keys.h, a.ctypes.data_as(_p_i64), b.ctypes.data_as(_p_i64),
                                      len(xs)), ctx)

    def sub_inplace(self, ctx, a: LattigoCiphertext, b: LattigoCiphertext) -> None:
        _call("clg_sub", a.h, b.h, 0)

    def sub_plain_inplace(self, ctx, ct: LattigoCiphertext, pt: LattigoPlaintext) -> None:
        _call("clg_sub", ct.h, pt.h, 1)

    def multiply_scalar(self, ctx, ct: LattigoCiphertext, c: complex) -> LattigoCiphertext:
        """ct * c: a non-integer constant is encoded at the scale of the level's last prime, so
        `rescale_inplace` restores the input's scale; an integer at scale 1 (no rescale needed)."""
        c = complex(c)
        return LattigoCiphertext(_new("clg_mul_scalar", ct.h, c.real, c.imag), ctx)

    def add_scalar_inplace(self, ctx, ct: LattigoCiphertext, c: complex) -> None:
        c = complex(c)
        _call("clg_add_scalar", ct.h, c.real, c.imag)

    @staticmethod
    def chebyshev_levels(degree: int, interval: tuple[float, float] = (-1.0, 1.0)) -> int:
        """Levels `evaluate_chebyshev` consumes: ceil(log2(degree + 1)), plus one for the change
        of variable when the interval is not [-1, 1]."""
        a, b = interval
        out = _int(0)
        _call("clg_poly_levels", int(degree), float(a), float(b), ctypes.byref(out))
        return out.value

    def evaluate_chebyshev(self, ctx, ct: LattigoCiphertext, coeffs, interval: tuple[float, float],
                           keys: LattigoEvalKeys) -> LattigoCiphertext:
        """p(ct) slot-wise for p(x) = sum_k coeffs[k] T_k((2x - a - b) / (b - a)) on
        interval = (a, b), T_k the Chebyshev polynomials of the first kind (Lattigo's
        ``circuits/ckks/polynomial``: baby-step giant-step evaluation in the Chebyshev basis).
        The result is at the input's scale, `chebyshev_levels` levels lower.  Coefficients:
        e.g. `chebyshev_coefficients`."""
        c = np.ascontiguousarray(np.asarray(coeffs, dtype=np.float64).reshape(-1))
        a, b = interval
        return LattigoCiphertext(_new("clg_poly_eval", keys.h, ct.h, c.ctypes.data_as(_p_dbl), int(c.size),
                                      float(a), float(b)), ctx)

    def bootstrap(self, ctx, ct: LattigoCiphertext, keys: LattigoBootstrapKeys) -> LattigoCiphertext:
        """A re-encryption of ``ct`` at the top level (`LattigoBootstrapKeys.output_level`) and
        the context's default scale (Lattigo's CKKS bootstrapping: Bossuat et al., EUROCRYPT
        2021, with sparse-secret encapsulation, eprint 2022/024).  One call at a time per key set.
        The message must be small (|values| about 1): a too-large message is not detected and
        comes back wrong (docs/he_backend.md)."""
        if not keys.h:
            raise HEError("bootstrapping keys already closed")
        return LattigoCiphertext(_new("clg_bootstrap", keys.h, ct.h), ctx)

    def relin_keys_from_bytes(self, ctx: LattigoContext, data: bytes) -> LattigoEvalKeys:
        """A peer's relinearisation key ("CLGR"; validated: length, header, every word reduced)."""
        p, n, _keep = _in_buf(data)
        return LattigoEvalKeys(_new("clg_relin_from_bytes", ctx.handle, p, n), ctx)

    def bootstrapping_keys_from_bytes(self, ctx: LattigoContext, data: bytes) -> LattigoBootstrapKeys:
        """A peer's bootstrapping keys ("CLGB"; validated: exact length for the preset, header,
        exactly the circuit's Galois elements, every word reduced)."""
        p, n, _keep = _in_buf(data)
        return LattigoBootstrapKeys(_new("clg_btp_keys_from_bytes", ctx.handle, p, n), ctx)

    def rescale_inplace(self, ctx, ct: LattigoCiphertext) -> None:
        """Divide by the last prime of the ciphertext's level (scale / q_l, one level down)."""
        _call("clg_rescale", ct.h)

    def scale_message_inplace(self, ctx, ct: LattigoCiphertext, factor: float) -> None:
        """Read ``ct`` as encrypting its message / ``factor``: the scale is multiplied by
        ``factor``, the coefficients are untouched (no level used; CKKS precision is unchanged
        in absolute terms, so the quotient has about log2(factor) fewer correct bits)."""
        _call("clg_ct_scale_by", ct.h, float(factor))

    def add_mask_inplace(self, ctx, ct: LattigoCiphertext, seed: bytes, bits: int, *, sign: int = 1,
                         from_scale: float | None = None) -> None:
        """The server's half of the client-aided refresh (`protocols.ckks.refresh`): add (sign
        +1) or subtract (-1) the integer polynomial u the 32-byte ``seed`` expands to
        (coefficients uniform in [-2^bits, 2^bits)), multiplied by scale(ct) / ``from_scale``
        and rounded (None: by 1, and the scale is first rounded to the float64 the wire
        carries).  ``2^(bits + 2)`` must not exceed the modulus at the ciphertext's level."""
        if not isinstance(seed, (bytes, bytearray)) or len(seed) != 32:
            raise HEError("the mask seed must be 32 bytes")
        buf = (ctypes.c_ubyte * 32).from_buffer_copy(bytes(seed))
        _call("clg_ct_add_mask", ct.h, ctypes.cast(buf, _p_u8), 32, int(bits), int(sign),
              float(from_scale) if from_scale is not None else 0.0)

    def mod_switch_to_inplace(self, ctx, ct: LattigoCiphertext, level) -> None:
        """Drop primes down to ``level`` without dividing (CKKS: the scale is unchanged)."""
        cur = ct.level
        if int(level) > cur:
            raise HEError(f"cannot switch up from level {cur} to {level}")
        if int(level) < cur:
            _call("clg_drop_level", ct.h, cur - int(level))

    def to_ntt_inplace(self, ctx, obj, level=None) -> None:
        raise NotImplementedError("Lattigo backend: CKKS objects are always in NTT form")

    def from_ntt_inplace(self, ctx, ct) -> None:
        raise NotImplementedError("Lattigo backend: CKKS objects are always in NTT form")

    def is_ntt(self, ct) -> bool:
        return True

    def pack_lwes_stream(self, ctx, galois_keys, n_leaves: int, leaves):
        raise NotImplementedError("Lattigo backend: PackLWEs over numpy leaves is pack_lwes_packer")

    def pack_context(self, n: int, q_moduli: Sequence[int], p_moduli: Sequence[int]) -> LattigoContext:
        """`LattigoContext.from_primes`: a context with exactly these primes (for PackLWEs)."""
        return LattigoContext.from_primes(n, q_moduli, p_moduli)

    def secret_keys_from_ternary(self, ctx: LattigoContext, s) -> LattigoSecretKeys:
        """`LattigoSecretKeys.from_ternary`: the secret key with coefficients ``s``."""
        return LattigoSecretKeys.from_ternary(ctx, s)

    def pack_lwes_packer(self, galois_keys: LattigoGaloisKeys, n_leaves: int, *, workers: int = 0) -> LattigoPackLWEs:
        """A streaming PackLWEs packer (`LattigoPackLWEs`) of ``n_leaves`` (1..N) leaves with the
        Galois keys for X -> X^(2^k + 1), k = 1..log2 N (`pack_lwes_elements`), on ``workers``
        goroutines (0: GOMAXPROCS)."""
        ctx = galois_keys.ctx
        return LattigoPackLWEs(_new("clg_packlwe_new", galois_keys.h, int(n_leaves), int(workers)), ctx, n_leaves)

    @staticmethod
    def pack_weights_nbytes(n: int, k: int, n_cols: int, blocks: int) -> int:
        """Memory of a `pack_weights` table of ``n_cols`` columns x ``blocks`` blocks (ring
        degree n, k data primes)."""
        return n_cols * blocks * n * (2 + 4 * k)

    def pack_weights(self, galois_keys: LattigoGaloisKeys, n_cols: int, blocks: int) -> LattigoPackWeights:
        """An empty `LattigoPackWeights` for ``n_cols`` columns of ``blocks`` weight polynomials
        each, in the context of ``galois_keys`` (the packer's); every data prime must be below
        2^32."""
        ctx = galois_keys.ctx
        return LattigoPackWeights(_new("clg_packlwe_weights_new", galois_keys.h, int(n_cols), int(blocks)), ctx,
                                  n_cols, blocks)

    # -- raw views -----------------------------------------------------------------------
    def ciphertext_to_numpy(self, ct: LattigoCiphertext) -> np.ndarray:
        """RNS coefficients (2, n_primes, N) uint64, NTT form, a copy."""
        lvl, deg, _ls, _ntt = ct._info()
        arr = np.empty((deg + 1, lvl + 1, ct.ctx.n), np.uint64)
        _call("clg_ct_coeffs", ct.h, arr.ctypes.data_as(_p_u64), arr.size)
        return arr

    def numpy_to_ciphertext(self, ctx: LattigoContext, arr, *, level=None, ntt: bool = True,
                            scale_bits: float | None = None, scale: float | None = None) -> LattigoCiphertext:
        """A ciphertext from (2, n_primes, N) uint64 NTT-form coefficients (checked reduced), at
        scale 2^``scale_bits`` or ``scale`` (default: the context's)."""
        a = np.ascontiguousarray(arr, dtype=np.uint64)
        if a.ndim != 3 or a.shape[0] != 2 or a.shape[2] != ctx.n:
            raise HEError(f"expected (2, k, {ctx.n}) coefficients, got {a.shape}")
        if not ntt:
            raise NotImplementedError("Lattigo backend: CKKS ciphertexts are in NTT form")
        lvl = a.shape[1] - 1
        if level is not None and int(level) != lvl:
            raise HEError(f"{a.shape[1]} primes do not match level {level}")
        sb = ctx.default_scale_bits if scale_bits is None else float(scale_bits)
        sc = 2.0 ** sb if scale is None else float(scale)
        hdr = _CT_HEADER.pack(b"CLGC", _WIRE_VERSION, 1, max(lvl, 0), 1, ctx.slots.bit_length() - 1, b"\0\0\0", sc)
        return self.ciphertext_from_bytes(ctx, hdr + a.tobytes(), level=lvl)

    def plaintext_to_numpy(self, pt) -> np.ndarray:
        raise NotImplementedError("Lattigo backend: CKKS plaintexts are read with decode_slots")

    # -- CKKS raw coefficient access (BLB section 6: `protocols.ckks_convert`) --------------
    # The NTT is Lattigo's own (`clg_ntt`; `lattigo_ntt` is its numpy reference, checked
    # against it in the tests); ciphertexts stay in NTT form, so a mask or a share polynomial is
    # transformed once and added to c0.
    def decrypt_coeffs(self, ctx: LattigoContext, keys: LattigoSecretKeys, ct: LattigoCiphertext) -> np.ndarray:
        """c0 + c1 s in coefficient form, (n_primes, N) uint64 residues (no decoding)."""
        return keys.decrypt(ct).coefficients()

    def _ntt(self, ctx: LattigoContext, rows, inverse: bool) -> np.ndarray:
        a = np.array(rows, np.uint64, order="C", copy=True)  # transformed in place by Go: a copy
        if a.ndim != 2 or a.shape[1] != ctx.n:
            raise HEError(f"expected (k, {ctx.n}) residues, got {a.shape}")
        _call("clg_ntt", ctx.handle, a.ctypes.data_as(_p_u64), a.shape[0], int(inverse))
        return a

    def ntt_forward(self, ctx: LattigoContext, coeffs, *, level=None) -> np.ndarray:
        """Lattigo's NTT of (k, N) coefficient-form residues (row i modulo prime i)."""
        return self._ntt(ctx, coeffs, False)

    def ntt_inverse(self, ctx: LattigoContext, vals, *, level=None) -> np.ndarray:
        """The inverse of `ntt_forward`."""
        return self._ntt(ctx, vals, True)

    def ciphertext_scale(self, ct: LattigoCiphertext) -> float:
        return ct.scale

    def plaintext_from_coeffs(self, ctx: LattigoContext, coeffs, *, level=None, scale: float = 1.0) -> LattigoRawPlaintext:
        """A `LattigoRawPlaintext` from coefficient-form residues (n_primes, N)."""
        a = np.asarray(coeffs, np.uint64)
        if a.ndim != 2 or a.shape[1] != ctx.n:
            raise HEError(f"expected (k, {ctx.n}) residues, got {a.shape}")
        lvl = a.shape[0] - 1 if level is None else int(level)
        if lvl != a.shape[0] - 1:
            raise HEError(f"{a.shape[0]} primes do not match level {lvl}")
        qs = np.asarray(ctx.q_moduli[: a.shape[0]], np.uint64)[:, None]
        if (a >= qs).any():
            raise HEError("residues not reduced")
        return LattigoRawPlaintext(self.ntt_forward(ctx, a), lvl, scale)

    # -- serialisation -------------------------------------------------------------------
    def ciphertext_to_bytes(self, ct: LattigoCiphertext, *, packed: bool = False) -> bytes:
        """``packed``: every row bit-packed at its prime's bit length ("CLGP"; the offload
        results), else 64-bit words; `ciphertext_from_bytes` reads both."""
        return _bytes_out("clg_ct_to_bytes_packed" if packed else "clg_ct_to_bytes", ct.h)

    def ciphertext_from_bytes(self, ctx: LattigoContext, data: bytes, *, level=None) -> LattigoCiphertext:
        p, n, _keep = _in_buf(data)
        want = -1 if level is None else int(level)
        return LattigoCiphertext(_new("clg_ct_from_bytes", ctx.handle, p, n, want), ctx)

    def ring_switch_key_from_bytes(self, ctx: LattigoContext, data: bytes, kind: str = "real") -> LattigoRingSwitchKey:
        """A peer's switching key from ``ctx``'s secret to the half ring ``kind``'s
        (`LattigoSecretKeys.ring_switch_key`), checked and expanded; malformed bytes raise HEError."""
        p, n, _keep = _in_buf(data)
        small = ctx.half_ring(kind)
        key = LattigoRingSwitchKey(_new("clg_ring_switch_key_from_bytes", ctx.handle, small.handle, p, n), ctx)
        key.small = small
        return key

    def ring_switch(self, ct: LattigoCiphertext, key: LattigoRingSwitchKey) -> LattigoCiphertext:
        """A level-0 ciphertext of ``key``'s context re-encrypted in its half ring: conjugate-
        invariant, the real parts of the slots z of ``ct``; even, ``ct``'s even part (its slots
        j < N/4 are z_j when the slots have period N/4); half the bytes (docs/offload.md
        "Half-ring results")."""
        return LattigoCiphertext(_new("clg_ring_switch", key.h, ct.h), key.small)

    def input_switch_key_from_bytes(self, ctx: LattigoContext, data: bytes) -> LattigoInputSwitchKey:
        """A peer's input switching key (`LattigoSecretKeys.input_switch_key`), checked and
        expanded; malformed bytes raise HEError."""
        p, n, _keep = _in_buf(data)
        small = ctx.half_ring("real", len(ctx.q_moduli))
        key = LattigoInputSwitchKey(_new("clg_input_switch_key_from_bytes", ctx.handle, small.handle, p, n), ctx)
        key.small = small
        return key

    def real_to_complex(self, ct: LattigoCiphertext, key: LattigoInputSwitchKey) -> LattigoCiphertext:
        """A half-ring input (a ciphertext of ``key.small`` at its top level, N/2 real slots)
        as a ciphertext of ``key``'s context at the same level and scale, whose N/2 complex
        slots hold those values (one key switch; docs/offload.md "Real inputs in the half ring")."""
        return LattigoCiphertext(_new("clg_real_to_complex", key.h, ct.h), key.ctx)

    def galois_keys_from_bytes(self, ctx: LattigoContext, data: bytes, *, required_steps=None,
                               max_keys: int = 256, conjugate: bool = False) -> LattigoGaloisKeys:
        """The peer's Galois keys, checked to hold the rotations ``required_steps`` and, with
        ``conjugate``, the conjugation."""
        p, n, _keep = _in_buf(data)
        gk = LattigoGaloisKeys(_new("clg_evk_from_bytes", ctx.handle, p, n, int(max_keys)), ctx)
        if (required_steps is not None or conjugate) and not gk.has_steps(required_steps or (), conjugate=conjugate):
            raise HEError(f"Galois keys lack some of the {len(set(required_steps or ()))} required rotation steps"
                          + (" or the conjugation" if conjugate else ""))
        return gk

    def params_to_bytes(self, params: HEParams) -> bytes:
        return _PARAMS_MAGIC + params.to_json().encode()

    def params_from_bytes(self, data: bytes) -> HEParams:
        if not isinstance(data, (bytes, bytearray)) or bytes(data[:len(_PARAMS_MAGIC)]) != _PARAMS_MAGIC \
                or len(data) > 4096:
            raise HEError("not a Lattigo-backend parameter blob")
        try:
            p = HEParams.from_json(bytes(data[len(_PARAMS_MAGIC):]))  # security-checked
        except HEError:
            raise
        except (ValueError, TypeError, KeyError, json.JSONDecodeError) as e:
            raise HEError(f"malformed parameter blob: {e}") from None
        if p.scheme != "ckks":
            raise HEError(f"{p.name}: the Lattigo backend takes CKKS parameters only")
        return p




def chebyshev_coefficients(f, degree: int, interval: tuple[float, float]) -> np.ndarray:
    """Coefficients c_0..c_degree of the Chebyshev interpolant of ``f`` (vectorised) at the
    degree + 1 Chebyshev nodes of the first kind on interval = (a, b), for
    `LattigoBackend.evaluate_chebyshev`."""
    a, b = (float(x) for x in interval)
    d = int(degree)
    k = np.arange(d + 1)
    t = np.cos(np.pi * (k + 0.5) / (d + 1))  # nodes on [-1, 1]
    y = np.asarray(f((b - a) / 2 * t + (a + b) / 2), dtype=np.float64)
    # c_j = (2 - [j == 0]) / (d + 1) * sum_k y_k T_j(t_k)
    c = (2.0 / (d + 1)) * np.cos(np.outer(np.arange(d + 1), np.pi * (k + 0.5) / (d + 1))) @ y
    c[0] /= 2
    return c


def ckks_params(name: str, n: int, bits: Sequence[int]) -> HEParams:
    """A CKKS `HEParams` (security-checked); the last prime is the special prime."""
    p = HEParams(name, "ckks", int(n), tuple(int(b) for b in bits))
    check_security(p)
    return p

