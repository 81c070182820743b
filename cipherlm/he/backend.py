"""The HE backend interface the protocols program against (issue 13, part 3).

``protocols/`` never imports an HE library: it asks `get_backend` for an
`HEBackend` and calls only the operations below.  The list is what the 2pc
protocols (`mpc.he_session`, `linear`, `linear_simd`, `embedding`)
actually use, nothing more:

* parameters / context: `context` (an `HEParams` set -> the backend's public
  context object, which carries ``params``, ``n``, ``coeff_moduli`` (the first
  data level's primes)), `level` (the opaque handle of the data level with k
  primes), `special_modulus`, `primes` (NTT-friendly primes of given sizes);
* keys: `keygen` -> a `SecretKeys` (seeded symmetric encryption, *raw*
  decryption to a plaintext, public-key and Galois-key blobs for the peer), and
  on the other side `load_public_key` + `encrypt_zero` (re-randomisation);
* encoding at a level: `encode_coeffs` (coefficient packing), `encode_slots` /
  `decode_slots` (SIMD batching);
* evaluation: `multiply_plain`, `add_inplace`, `add_plain_inplace`,
  `rotate_rows` / `rotate_rows_inplace` (Galois automorphism by a row
  rotation), `mod_switch_to_inplace`, `to_ntt_inplace` / `from_ntt_inplace` /
  `is_ntt`, and `pack_lwes_stream` (PackLWEs over automorphisms, FastQuery) with
  its public facts `pack_lwes_elements` / `pack_lwes_order` (concrete);
* raw numpy views: `ciphertext_to_numpy` / `numpy_to_ciphertext` (uint64
  (size, k, N)), `plaintext_to_numpy`; for the CKKS <-> MPC conversions (BLB
  section 6, `protocols.ckks_convert`) also `decrypt_coeffs` (raw decryption in
  coefficient form, no decoding), `plaintext_from_coeffs`, `ntt_forward` /
  `ntt_inverse` (residue arrays) and `ciphertext_scale`
  (optional: not abstract);
* serialisation: `ciphertext_to_bytes` / `ciphertext_from_bytes`,
  `galois_keys_from_bytes`, `params_to_bytes` / `params_from_bytes`.  Every
  ``*_from_bytes`` takes untrusted bytes and must validate them fully before the
  library sees them (the SEAL backend uses `he.serialize`'s layout walk);
* cost model: `cost_model`, one `HECostModel` per backend: the machine constants
  every planner's time estimates read, ``twopc`` (`TwoPCCostModel`: the 2pc
  packings, `protocols.linear` / `linear_simd`) and ``offload``
  (`OffloadCostModel`: the offload mode's CKKS matmul, `he.matmul.plan_matmul`,
  `he.parallel`).

Ciphertexts, plaintexts, keys and levels are opaque handles owned by the
backend.

`RingBackend` is the second, smaller interface: raw RLWE arithmetic on numpy
arrays of RNS residues (..., k, N), for a protocol that keeps its ciphertexts as
raw arrays and owns its wire format (the embedding lookup, `protocols.embedding`):
an RNS base (residue arithmetic, modulus switching, BFV decoding), seeded public
uniform polynomials, secret and error sampling, exact negacyclic products through a
transform domain.  These are operations every RLWE library has (SEAL's RNSTool and
NTT tables, Lattigo's ``ring`` package); the ``numpy`` backend
(`cipherlm.he.numpy_rlwe`) is the one implementation so far.

A backend is registered by name with the dotted path of its module
(`register_backend`); `get_backend` imports it on first use (by
``importlib``, so this module imports no HE library and the interface is not
tied to any backend).  docs/he_backend.md: how to add one.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
from typing import Any, Iterable, Iterator

import numpy as np

from .errors import HEError
from .params import HEParams

__all__ = ["HEBackend", "RingBackend", "SecretKeys", "HECostModel", "TwoPCCostModel", "OffloadCostModel",
           "DEFAULT_BACKEND",
           "DEFAULT_RING_BACKEND", "register_backend", "get_backend", "backend_names",
           "backend_unavailable_reason"]


@dataclasses.dataclass(frozen=True)
class TwoPCCostModel:
    """Machine constants (seconds per operation) of one backend, for the planners' time
    estimates.  Measured on the 2-vCPU reference machine with the SEAL backend.

    ``coeff_*``: the coefficient packing (`protocols.linear.plan_blocks`) at N = 8192,
    3 primes (the planner scales them by (N / 8192) (k / 3)).
    ``simd_*``: the SIMD/BSGS packing (`protocols.linear_simd`) at N = 16384, 4 primes
    (fitted to 128x384->1152: 12.4 s measured / 12.8 modelled; 1x576->3072: 2.38 / 2.45).
    ``coeff_time_scale``: the coefficient model is ~1.4x optimistic on this machine
    (128x384->1152: 5.24 s measured / 3.86 modelled; 1x576->3072: 0.54 / 0.31); applied
    when the two packings are compared."""

    coeff_product: float = 1.6e-4   # multiply_plain + add, NTT form
    coeff_encrypt: float = 2.0e-3   # client: encode + seeded encryption of one input
    coeff_finish: float = 6.0e-3    # server: mask, re-randomise, flood, switch; client decrypt
    coeff_encode: float = 6.0e-4    # encode + NTT one weight block (when not cached)
    simd_rotate: float = 1.3e-2     # rotate_rows (key switching), coefficient form
    simd_ntt: float = 1.0e-3        # forward/inverse NTT of one ciphertext
    simd_product: float = 1.0e-3    # multiply_plain + add, NTT form
    simd_encode: float = 2.3e-3     # build + batch-encode + NTT one diagonal plaintext (when not cached)
    simd_encrypt: float = 4.0e-3    # client: batch-encode + seeded encryption of one input
    simd_finish: float = 3.0e-2     # server: mask, public-key zero encryption, flooding, switch, serialise; client decrypt
    coeff_time_scale: float = 1.4


@dataclasses.dataclass(frozen=True)
class OffloadCostModel:
    """Machine constants of the offload mode's CKKS ct x pt matmul (`he.matmul.plan_matmul`,
    `MatmulPlan.cost`, `he.parallel.split_units`): seconds per op at N = 8192, 2 primes,
    and per byte.  Defaults: the SEAL backend's, measured on the dev machine
    (docs/he_matmul.md; `he.matmul.measure_costs` re-measures them).  Was
    ``he.matmul.CostModel`` (still importable under that name)."""

    rotate: float = 1.4e-3
    rotate_low: float = 0.73e-3  # a giant-step rotation after the early rescale (1 prime)
    multiply_plain: float = 0.15e-3
    add: float = 0.03e-3
    rescale: float = 0.3e-3
    decrypt_decode: float = 1.0e-3  # client, per output ciphertext
    byte: float = 80e-9  # 100 Mbit/s: favours fewer down-link ciphertexts (see docs/he_matmul.md)
    galois_key_tiebreak: float = 1e-6  # prefer fewer distinct keys when equal


@dataclasses.dataclass(frozen=True)
class HECostModel:
    """One backend's cost model (`HEBackend.cost_model`): the constants of every planner
    that estimates HE time, so that each backend supplies its own and the planners read
    those of the backend in use.  ``twopc``: the 2pc packings' (`TwoPCCostModel`);
    ``offload``: the offload CKKS matmul's (`OffloadCostModel`)."""

    twopc: TwoPCCostModel = TwoPCCostModel()
    offload: OffloadCostModel = OffloadCostModel()


class SecretKeys(abc.ABC):
    """One party's secret key and what it produces.  The secret key itself never leaves."""

    @abc.abstractmethod
    def encrypt_seeded(self, pt) -> bytes:
        """Symmetric encryption of a plaintext, serialised with the PRNG seed in place of
        the uniform half (what goes on the wire)."""

    @abc.abstractmethod
    def encrypt(self, pt):
        """Symmetric encryption, as a local ciphertext."""

    @abc.abstractmethod
    def decrypt(self, ct):
        """Raw decryption: the plaintext (no decoding)."""

    @abc.abstractmethod
    def public_key_bytes(self) -> bytes:
        """Serialised public key (the peer re-randomises results under it)."""

    @abc.abstractmethod
    def galois_keys_bytes(self, steps) -> bytes:
        """Serialised (seeded) Galois keys for row-rotation steps."""

    @abc.abstractmethod
    def galois_keys_bytes_for_elements(self, elements) -> bytes:
        """Serialised (seeded) Galois keys for automorphisms X -> X^g, g in ``elements``."""

    def secret_key_ntt(self) -> np.ndarray:
        """The secret key's NTT-form residues (k, N) at the context's data primes (SEAL's NTT
        convention, as `HEBackend.public_key_to_numpy`), for this
        party's own native encryption and decryption (`_core.bfv_encrypt_symmetric`); it never
        leaves the process.  Not abstract: without it the coefficient-packed 2pc cross term
        (`protocols.linear.cross_matmul`) refuses to run."""
        raise NotImplementedError(f"{type(self).__name__} has no raw secret-key access")


class HEBackend(abc.ABC):
    """Operations the protocols use (module docstring).  Stateless: per-parameter state
    lives in the context object `context` returns, which every call takes first."""

    name: str = "?"
    #: the schemes this backend implements ("bfv": the 2pc protocols' coefficient and
    #: batch encodings; "ckks": offload, BLB's fused blocks); the conformance suite
    #: (tests/test_he_backend.py) runs on the BFV backends
    schemes: tuple[str, ...] = ("bfv", "ckks")
    #: the backend's machine constants (`HECostModel`); a backend measures and sets its own
    #: (the default is the SEAL backend's numbers)
    cost_model: HECostModel = HECostModel()
    #: CKKS slot order: slot j is m(omega^(g^j mod 2N)), omega = exp(i pi / N), for this
    #: generator g (SEAL: 3; Lattigo: 5); the BLB conversions (`protocols.ckks_convert`) decode
    #: and encode in this order
    slot_generator: int = 3

    # -- parameters / context ---------------------------------------------------------
    @abc.abstractmethod
    def context(self, params: HEParams) -> Any:
        """Public context for ``params`` (attributes ``params``, ``n``, ``coeff_moduli``)."""

    @abc.abstractmethod
    def level(self, ctx, n_primes: int) -> Any:
        """Handle of the data level with ``n_primes`` primes."""

    @abc.abstractmethod
    def special_modulus(self, ctx) -> int:
        """The key-switching (special) prime."""

    @abc.abstractmethod
    def primes(self, n: int, bits: list[int]) -> list[int]:
        """Distinct NTT-friendly primes q = 1 mod 2n of the given bit sizes, in order."""

    # -- keys ----------------------------------------------------------------------------
    @abc.abstractmethod
    def keygen(self, ctx) -> SecretKeys:
        """A fresh secret key (from the OS CSPRNG) for this context."""

    @abc.abstractmethod
    def load_public_key(self, ctx, data: bytes) -> Any:
        """Validate and load a peer's public key (untrusted bytes)."""

    @abc.abstractmethod
    def encrypt_zero(self, ctx, pk, level) -> Any:
        """A public-key encryption of zero at ``level``, coefficient form."""

    # -- encoding ------------------------------------------------------------------------
    @abc.abstractmethod
    def encode_coeffs(self, ctx, coeffs: np.ndarray, *, level=None, ntt: bool = False) -> Any:
        """Plaintext with these coefficients (uint64 mod t, length <= N); with ``ntt``, in NTT
        form at ``level`` (for multiply_plain)."""

    @abc.abstractmethod
    def encode_slots(self, ctx, values: np.ndarray, *, level=None, ntt: bool = False) -> Any:
        """Batch-encode slot values (uint64 mod t, BFV with t = 1 mod 2N)."""

    @abc.abstractmethod
    def decode_slots(self, ctx, coeffs: np.ndarray) -> np.ndarray:
        """Plaintext coefficients mod t -> slot values (uint64)."""

    # -- evaluation ----------------------------------------------------------------------
    @abc.abstractmethod
    def multiply_plain(self, ctx, ct, pt, out=None) -> Any:
        """ct * pt (both NTT form, same level), into ``out`` when given (a ciphertext of this
        backend to overwrite: saves an allocation per product in the accumulation loops),
        else a new ciphertext; returns it."""

    @abc.abstractmethod
    def add_inplace(self, ctx, a, b) -> None:
        """a += b."""

    @abc.abstractmethod
    def add_plain_inplace(self, ctx, ct, pt) -> None:
        """ct += pt (coefficient form)."""

    @abc.abstractmethod
    def rotate_rows(self, ctx, ct, step: int, galois_keys) -> Any:
        """Rotate both slot rows by ``step`` (coefficient form), as a new ciphertext."""

    @abc.abstractmethod
    def rotate_rows_inplace(self, ctx, ct, step: int, galois_keys) -> None:
        """Rotate in place."""

    def conjugate(self, ctx, ct, galois_keys) -> Any:
        """Every slot's complex conjugate (CKKS; a key set with the conjugation key)."""
        raise NotImplementedError(f"backend {self.name!r} has no slot conjugation")

    @abc.abstractmethod
    def mod_switch_to_inplace(self, ctx, ct, level) -> None:
        """Switch the modulus down to ``level`` (BFV: divide and round)."""

    @abc.abstractmethod
    def to_ntt_inplace(self, ctx, obj, level=None) -> None:
        """A ciphertext, or a coefficient plaintext (then at ``level``), into NTT form."""

    @abc.abstractmethod
    def from_ntt_inplace(self, ctx, ct) -> None:
        """A ciphertext out of NTT form."""

    @abc.abstractmethod
    def is_ntt(self, ct) -> bool:
        """Whether ``ct`` is in NTT form."""

    @abc.abstractmethod
    def pack_lwes_stream(self, ctx, galois_keys, n_leaves: int, leaves: Iterable) -> Any:
        """PackLWEs (CDKS Algorithm 1 + field trace, `he.packlwe`) over lazily supplied
        coefficient-form leaves in bit-reversed order (None = zero)."""

    def pack_lwes_elements(self, n: int) -> list[int]:
        """The automorphisms X -> X^g `pack_lwes_stream` and its trace need at ring degree
        ``n`` (the Galois keys the client sends): g = 2^k + 1, k = 1..log2 n."""
        logn = int(n).bit_length() - 1
        return [(1 << k) + 1 for k in range(1, logn + 1)]

    def pack_lwes_order(self, n_leaves: int) -> list[int]:
        """The slot of each leaf in the order `pack_lwes_stream` consumes them (bit-reversed
        indices over the next power of two of ``n_leaves``)."""
        logn = max(0, (n_leaves - 1).bit_length())
        return [int(format(r, f"0{logn}b")[::-1], 2) if logn else 0 for r in range(1 << logn)]

    # -- raw views -----------------------------------------------------------------------
    @abc.abstractmethod
    def ciphertext_to_numpy(self, ct) -> np.ndarray:
        """Coefficients (size, n_primes, N) uint64, a copy."""

    @abc.abstractmethod
    def numpy_to_ciphertext(self, ctx, arr: np.ndarray, *, level=None, ntt: bool = False) -> Any:
        """A ciphertext from (size, n_primes, N) uint64 coefficients, each reduced mod its
        prime (checked); ``level`` defaults to the level with n_primes primes."""

    @abc.abstractmethod
    def plaintext_to_numpy(self, pt) -> np.ndarray:
        """Plaintext coefficients, flat (coefficient form: up to N values mod t)."""

    def public_key_to_numpy(self, ctx, data: bytes) -> np.ndarray:
        """A peer's public key (untrusted bytes, validated as `load_public_key` does) as its
        NTT-form residues (2, k, N) at the context's k data primes, in SEAL's NTT convention
        (`_core.ntt_rows`, which the native kernels share): what the native cross-term
        finishing (`_core.bfv_finish`) re-randomises with.  Not abstract: without it the
        coefficient-packed 2pc cross term (`protocols.linear.cross_matmul`) refuses to run."""
        raise NotImplementedError(f"backend {self.name!r} has no raw public-key access")

    # -- CKKS raw coefficient access (BLB section 6: `protocols.ckks_convert`) ----------
    # Not abstract: a backend without them cannot run the CKKS <-> MPC conversions.
    def decrypt_coeffs(self, ctx, keys: SecretKeys, ct) -> np.ndarray:
        """Raw decryption *without decoding*: c0 + c1 s, coefficient form, (n_primes, N)
        uint64 residues (BLB Algorithm 1, the client's step).  Either NTT form of ``ct``."""
        raise NotImplementedError(f"backend {self.name!r} has no raw CKKS coefficient decryption")

    def plaintext_from_coeffs(self, ctx, coeffs: np.ndarray, *, level=None, scale: float = 1.0) -> Any:
        """A plaintext from coefficient-form residues (n_primes, N) at ``level`` (default: the
        level with n_primes primes) carrying the CKKS ``scale``, in the form ``encrypt`` and
        ``add_plain_inplace`` take for this scheme (BLB Algorithm 2)."""
        raise NotImplementedError(f"backend {self.name!r} has no raw CKKS plaintexts")

    def ntt_forward(self, ctx, coeffs: np.ndarray, *, level=None) -> np.ndarray:
        """Residues (n_primes, N) from coefficient form into the backend's NTT (evaluation)
        form, the form its CKKS ciphertexts hold (a uniform polynomial stays uniform: the
        NTT is a bijection)."""
        raise NotImplementedError(f"backend {self.name!r} has no residue NTT")

    def ntt_inverse(self, ctx, vals: np.ndarray, *, level=None) -> np.ndarray:
        """The inverse of `ntt_forward`."""
        raise NotImplementedError(f"backend {self.name!r} has no residue NTT")

    def ciphertext_scale(self, ct) -> float:
        """The CKKS scale a ciphertext carries (1.0 for BFV)."""
        raise NotImplementedError(f"backend {self.name!r} does not expose ciphertext scales")

    # -- serialisation -------------------------------------------------------------------
    @abc.abstractmethod
    def ciphertext_to_bytes(self, ct) -> bytes:
        """Serialise a ciphertext."""

    @abc.abstractmethod
    def ciphertext_from_bytes(self, ctx, data: bytes, *, level=None) -> Any:
        """Validate (layout, level, size, reduced coefficients, not transparent) and load
        a peer's ciphertext."""

    @abc.abstractmethod
    def galois_keys_from_bytes(self, ctx, data: bytes, *, required_steps=None) -> Any:
        """Validate and load a peer's Galois keys (a bounded number; the required steps
        must be there)."""

    @abc.abstractmethod
    def params_to_bytes(self, params: HEParams) -> bytes:
        """The parameter set as both sides compare it."""

    @abc.abstractmethod
    def params_from_bytes(self, data: bytes) -> HEParams:
        """Parse and security-check a peer's parameter blob."""


class RingBackend(abc.ABC):
    """Raw RLWE arithmetic on numpy arrays of RNS residues (module docstring).  Arrays are
    uint64 residues (..., k, N) mod the primes of an RNS base (each below 2^31), or int64
    coefficient arrays (..., N) for small polynomials.  Stateless.  The results must be
    exact (bit-identical across backends): a protocol's bytes on the wire are built from
    them."""

    name: str = "?"
    #: the error distribution: rounded Gaussian of this standard deviation, clipped at
    #: +-error_bound (SEAL's default, 3.2 and 6 sigma); the protocols' noise models use it
    error_sigma: float = 3.2
    error_bound: int = 19
    #: products in the transform domain are exact while every coefficient of the
    #: (limb-split) convolution stays below 2^exact_bits
    exact_bits: int = 46

    @abc.abstractmethod
    def rns(self, primes, n: int = 4096) -> Any:
        """An RNS base Q = prod(primes) at ring degree n.  The object has ``primes``, ``q``
        (uint64 array), ``Q``, ``bits``, ``k``, ``n``, ``logq``, and the residue operations
        ``sub(k)`` (the base of the first k primes), ``from_int``, ``from_signed``,
        ``mul_scalar``, ``add``, ``sub_``, ``neg``, ``drop_last`` / ``switch_to(a, k)``
        (modulus switching: divide and round by the dropped primes), ``to_pow2(a, K)``
        (round(x 2^K / Q) mod 2^K) and ``decode_top(a, t)`` (round(t x / Q) mod t)."""

    @abc.abstractmethod
    def expand_uniform(self, seed: bytes, label: bytes, rns, count: int) -> np.ndarray:
        """``count`` public uniform polynomials (count, k, N) mod Q from (seed, label)
        (both parties derive the same ones: part of the wire format)."""

    @abc.abstractmethod
    def sample_ternary(self, rng: np.random.Generator, shape) -> np.ndarray:
        """Uniform coefficients in {-1, 0, 1} (int64) from ``rng``."""

    @abc.abstractmethod
    def sample_error(self, rng: np.random.Generator, shape) -> np.ndarray:
        """Errors (int64) from the distribution of ``error_sigma`` / ``error_bound``."""

    @abc.abstractmethod
    def transform(self, a: np.ndarray) -> np.ndarray:
        """Forward negacyclic transform of integer polynomials (..., N): pointwise products
        of transforms are products in Z[X]/(X^N + 1)."""

    @abc.abstractmethod
    def inverse_transform(self, A: np.ndarray) -> np.ndarray:
        """Inverse of `transform` after pointwise products: int64 (..., N), exact while the
        coefficients stay below 2^exact_bits."""

    @abc.abstractmethod
    def split_limbs(self, x: np.ndarray, nbits: int, limb: int) -> list[np.ndarray]:
        """Unsigned x < 2^nbits -> [x_0, x_1, ...] (int64), x = sum x_i 2^(limb i)."""

    @abc.abstractmethod
    def mul_small(self, a: np.ndarray, s_hat: np.ndarray, q: np.ndarray, abits: int = 31) -> np.ndarray:
        """(a * s) mod q for residues a (..., k, N) < 2^abits and a small s given as
        transform(s); q (k,) the primes."""

    @abc.abstractmethod
    def mul_small_pow2(self, a: np.ndarray, s_hat: np.ndarray, K: int) -> np.ndarray:
        """(a * s) mod 2^K for a (..., N) < 2^K and a ternary s given as transform(s)."""

    @abc.abstractmethod
    def decode_pow2(self, c0: np.ndarray, c1s: np.ndarray, k0: int, k1: int, t_bits: int) -> np.ndarray:
        """BFV decoding of (c0 mod 2^k0, c1 s mod 2^k1): round(t (c0/2^k0 + c1 s/2^k1)) mod t,
        t = 2^t_bits (int64)."""

    @abc.abstractmethod
    def negacyclic(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Reference product in Z[X]/(X^N + 1) of small int64 polynomials (schoolbook, exact)."""


# ----------------------------------------------------------------------------- registry
#: name -> (module path, class name); imported on first `get_backend`
_REGISTRY: dict[str, tuple[str, str]] = {"seal": ("cipherlm.he.seal_backend", "SealBackend"),
                                         "lattigo": ("cipherlm.he.lattigo_backend", "LattigoBackend")}
#: name -> "he" (an `HEBackend`) or "ring" (a `RingBackend`); "he" when absent
_KINDS: dict[str, str] = {}
_INTERFACES = {"he": HEBackend, "ring": RingBackend}
_INSTANCES: dict[str, HEBackend | RingBackend] = {}
DEFAULT_BACKEND = "seal"
DEFAULT_RING_BACKEND = "numpy"


def register_backend(name: str, module: str, cls: str, *, kind: str = "he") -> None:
    """Register a backend class ``cls`` of module ``module`` (dotted path) under ``name``;
    ``kind`` "he" (an `HEBackend`) or "ring" (a `RingBackend`)."""
    if kind not in _INTERFACES:
        raise HEError(f"unknown backend kind {kind!r}; known: {sorted(_INTERFACES)}")
    _REGISTRY[name] = (module, cls)
    _KINDS[name] = kind
    _INSTANCES.pop(name, None)


def backend_names(kind: str = "he") -> list[str]:
    """Names of the registered backends of one kind ("he" or "ring")."""
    return sorted(n for n in _REGISTRY if _KINDS.get(n, "he") == kind)


def get_backend(name: str = DEFAULT_BACKEND) -> HEBackend | RingBackend:
    """The (shared, stateless) backend registered under ``name``."""
    b = _INSTANCES.get(name)
    if b is None:
        try:
            module, cls = _REGISTRY[name]
        except KeyError:
            raise HEError(f"unknown HE backend {name!r}; known: {sorted(_REGISTRY)}") from None
        b = getattr(importlib.import_module(module), cls)()
        want = _INTERFACES[_KINDS.get(name, "he")]
        if not isinstance(b, want):
            raise HEError(f"backend {name!r} ({module}.{cls}) is not a {want.__name__}")
        _INSTANCES[name] = b
    return b


def backend_unavailable_reason(name: str) -> str | None:
    """None when the backend ``name`` can run on this machine, else why not (a backend module
    may define ``unavailable_reason()``, e.g. Lattigo's when its shared library is not built)."""
    try:
        module, _cls = _REGISTRY[name]
    except KeyError:
        return f"unknown HE backend {name!r}; known: {sorted(_REGISTRY)}"
    check = getattr(importlib.import_module(module), "unavailable_reason", None)
    return check() if check is not None else None


def iter_backends(kind: str = "he") -> Iterator[HEBackend | RingBackend]:
    for name in backend_names(kind):
        yield get_backend(name)


register_backend("numpy", "cipherlm.he.numpy_rlwe", "NumpyRLWEBackend", kind="ring")
