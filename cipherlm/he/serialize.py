"""(De)serialisation of SEAL objects to bytes, validation of untrusted blobs,
and raw coefficient I/O.

In memory, never through a named file.  ``tenseal.sealapi`` only offers
``save(path)`` / ``load(ctx, path)`` (always with SEAL's default compression,
zstd in this build) and no buffer protocol on coefficient data.  The path
handed to SEAL is ``/proc/self/fd/N`` of an anonymous ``memfd_create`` file:
it lives in the process's memory, has no name in any file system (nothing in
``/dev/shm`` or the temp dir that another process could read, delete or find
left behind), and vanishes with its last descriptor, even when the process
is killed.  Secret keys, shares, masks and weight blocks pass through it.

Untrusted blobs never reach SEAL's stream decompressor.  SEAL's loader throws
``std::ios_failure`` from a place that cannot be caught on some corrupt or
early-ending zstd streams behind a valid header: the process ends in
``std::terminate`` (a fuzzer hit it about once per 6k BFV ciphertexts).  So
every ``*_from_bytes`` that takes a peer's bytes first:

1. checks SEAL's 16-byte header (magic, version, compression mode, size);
2. decompresses the body here (zlib or zstd) with a cap on the output derived
   from the context and the expected object (a zstd bomb stops at the cap);
3. walks the whole known layout of the expected object (below): parms_id
   known to the context and at the expected level, sizes and counts equal to
   the context's, nested headers uncompressed and exactly sized, every
   coefficient reduced modulo its prime, nothing left over;
4. hands SEAL only the validated, *uncompressed* bytes, which SEAL checks
   again (``is_valid_for``).

Encryption parameters from a peer are never loaded at all: the blob must equal,
byte for byte after decompression, the one this side builds from the named
parameter set.  Then the checks here: expected level, ciphertext size, sane
scale, not transparent (a zero ``c1`` would make SEAL's ``multiply_plain``
throw).  A flipped coefficient bit that stays below its prime cannot be
detected (there is no MAC in SEAL's format; the channel's integrity is the
net layer's job).

Seeded symmetric ciphertexts and Galois keys: ``Encryptor.encrypt_symmetric(pt)``
and ``KeyGenerator.create_galois_keys(elts)`` return SEAL ``Serializable``
objects whose ``save`` writes only the PRNG seed in place of each uniformly
random polynomial ("a" half): a 2-prime N=8192 ciphertext is ~117 kB instead
of ~235 kB (measured, both zstd).  They expand on ``load``.

SEAL's binary format (SEAL 4.x, ``Serialization::SEALHeader`` + ``save_members``):

    header (16 B): u16 magic 0xA15E, u8 header size 16, u8 version major,
                   u8 version minor, u8 compr_mode (0 none, 1 zlib, 2 zstd),
                   u16 reserved, u64 total size in bytes (header included)
    Ciphertext body: u64[4] parms_id, u8 is_ntt_form, u64 size,
                   u64 poly_modulus_degree, u64 coeff_modulus_size, f64 scale,
                   u64 correction_factor, DynArray<u64>, and for a seeded
                   ciphertext (DynArray of one polynomial) a
                   UniformRandomGeneratorInfo (header, u8 PRNG type, u64[8] seed)
    PublicKey:     a Ciphertext (size 2) at the key level
    GaloisKeys body: u64[4] parms_id, u64 dim1, then dim1 times
                   (u64 dim2, dim2 PublicKeys each with its own header)
    Plaintext body: u64[4] parms_id, u64 coeff_count, f64 scale, DynArray<u64>
    DynArray: its own uncompressed header (16 B), u64 count, count x u64 data
"""

from __future__ import annotations

import io
import math
import os
import struct
import zlib

import numpy as np
import tenseal.sealapi as seal
import zstandard

from .context import HEContext, encryption_parameters
from .errors import HEError
from .params import HEParams

SEAL_MAGIC = 0xA15E
_HDR = struct.Struct("<HBBBBHQ")
_CT_META = struct.Struct("<4QBQQQdQ")  # 32 + 1 + 8*3 + 8 + 8 = 73
_PT_META = struct.Struct("<4QQd")  # 32 + 8 + 8 = 48
_U64 = struct.Struct("<Q")
_PARMS_ID = struct.Struct("<4Q")
COMPR_NONE, COMPR_ZLIB, COMPR_ZSTD = 0, 1, 2
#: UniformRandomGeneratorInfo after a seeded ciphertext: header + u8 PRNG type + 512-bit seed
_PRNG_INFO_SIZE = _HDR.size + 1 + 64
_PRNG_TYPES = (1, 2)  # blake2xb, shake256 (0 = unknown is refused)
#: SEAL's own bound on a ciphertext's size (number of polynomials)
CIPHERTEXT_SIZE_MAX = 16
#: Galois keys a peer may send in one blob beyond the steps the caller requires (bounds
#: the memory one blob can make a server allocate: ~0.8 MB per key at N = 8192)
DEFAULT_MAX_GALOIS_KEYS = 128


# --------------------------------------------------------------------------- in-memory files
def _memfd() -> int:
    """An anonymous in-memory file (no name in any file system; gone with its last fd)."""
    return os.memfd_create("cipherlm-he", os.MFD_CLOEXEC)


def _save(obj) -> bytes:
    """``obj.save`` into an anonymous memory file; its bytes."""
    fd = _memfd()
    try:
        obj.save(f"/proc/self/fd/{fd}")
        size = os.fstat(fd).st_size
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _load_validated(obj, data: bytes, ctx=None):
    """``obj.load`` from bytes that ``_validated`` produced (uncompressed, checked layout)."""
    fd = _memfd()
    try:
        _write_all(fd, data)
        try:
            if ctx is None:
                obj.load(f"/proc/self/fd/{fd}")
            else:
                obj.load(ctx, f"/proc/self/fd/{fd}")
        except Exception as e:  # SEAL raises std::logic_error / invalid_argument
            raise HEError(f"SEAL rejected the {type(obj).__name__}: {e}") from None
    finally:
        os.close(fd)
    return obj


def parse_header(data: bytes) -> dict:
    if len(data) < _HDR.size:
        raise HEError(f"not a SEAL object: {len(data)} bytes")
    magic, hsize, vmaj, vmin, compr, _res, size = _HDR.unpack_from(data, 0)
    if magic != SEAL_MAGIC or hsize != _HDR.size:
        raise HEError("not a SEAL object (bad magic/header size)")
    if (vmaj, vmin) < (3, 4) or vmaj > 4:
        raise HEError(f"unsupported SEAL serialization version {vmaj}.{vmin}")
    if compr not in (COMPR_NONE, COMPR_ZLIB, COMPR_ZSTD):
        raise HEError(f"unknown SEAL compression mode {compr}")
    if size != len(data):
        raise HEError(f"SEAL object truncated or padded: header says {size} bytes, got {len(data)}")
    return {"version": (vmaj, vmin), "compr_mode": compr, "size": size}


def _header(body_len: int, compr: int = COMPR_NONE, version=(4, 3)) -> bytes:
    return _HDR.pack(SEAL_MAGIC, _HDR.size, version[0], version[1], compr, 0, _HDR.size + body_len)


# --------------------------------------------------------------------------- decompression
def _inflate(raw: bytes, compr: int, cap: int) -> bytes:
    """Decompress a SEAL body; at most ``cap`` bytes of output (HEError beyond)."""
    if compr == COMPR_NONE:
        out = bytes(raw)
    elif compr == COMPR_ZLIB:
        d = zlib.decompressobj()
        try:
            out = d.decompress(raw, cap + 1)
        except zlib.error as e:
            raise HEError(f"corrupted zlib stream in SEAL object: {e}") from None
        if not d.eof and len(out) <= cap:
            raise HEError("truncated zlib stream in SEAL object")
    else:
        chunks, total = [], 0
        try:
            for chunk in zstandard.ZstdDecompressor().read_to_iter(io.BytesIO(raw), write_size=1 << 20):
                total += len(chunk)
                if total > cap:
                    break
                chunks.append(chunk)
        except zstandard.ZstdError as e:
            raise HEError(f"corrupted zstd stream in SEAL object: {e}") from None
        out = b"".join(chunks)
    if len(out) > cap:
        raise HEError(f"SEAL object decompresses to more than the {cap} bytes expected")
    return out


def _body(data: bytes, cap: int = 1 << 34) -> bytes:
    """The uncompressed body of a SEAL blob (trusted local blobs: a large default cap)."""
    h = parse_header(data)
    return _inflate(memoryview(data)[_HDR.size:], h["compr_mode"], cap)


# --------------------------------------------------------------------------- layout checks
class _Layout:
    """A cursor over an uncompressed SEAL body that checks each field as it reads."""

    def __init__(self, body: bytes, ctx: HEContext):
        self.body = body
        self.ctx = ctx
        self.pos = 0

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.body):
            raise HEError("SEAL object ends early")
        start = self.pos
        self.pos += n
        return start

    def u64(self) -> int:
        return _U64.unpack_from(self.body, self.take(8))[0]

    def nested_header(self) -> int:
        """An uncompressed nested header; returns the size it announces for its body."""
        magic, hsize, vmaj, vmin, compr, res, size = _HDR.unpack_from(self.body, self.take(_HDR.size))
        if magic != SEAL_MAGIC or hsize != _HDR.size or compr != COMPR_NONE or res != 0 or (vmaj, vmin) < (3, 4):
            raise HEError("bad nested header inside SEAL object")
        if size < _HDR.size or self.pos + size - _HDR.size > len(self.body):
            raise HEError("nested SEAL object overruns its parent")
        return size - _HDR.size

    def moduli(self, pid) -> np.ndarray:
        try:
            return np.array(self.ctx.moduli_of(pid), dtype=np.uint64)
        except HEError:
            raise HEError("SEAL object is for parameters this context does not know") from None

    def coefficients(self, polys: int, moduli: np.ndarray) -> None:
        """A DynArray of ``polys`` polynomials, every coefficient reduced mod its prime."""
        body_len = self.nested_header()
        count = self.u64()
        n = self.ctx.n
        if count != polys * len(moduli) * n or body_len != 8 + 8 * count:
            raise HEError("coefficient count does not match the parameters")
        arr = np.frombuffer(self.body, dtype="<u8", count=count, offset=self.take(8 * count))
        if np.any(arr.reshape(polys, len(moduli), n) >= moduli[None, :, None]):
            raise HEError("coefficient not reduced modulo its prime")

    def ciphertext(self, *, parms_id=None, size=None) -> None:
        """One Ciphertext body (full or seeded) at ``parms_id`` with ``size`` polynomials."""
        *pid, ntt, ct_size, n, k, scale, correction = _CT_META.unpack_from(self.body, self.take(_CT_META.size))
        moduli = self.moduli(pid)
        if parms_id is not None and list(pid) != list(parms_id):
            raise HEError("ciphertext is at the wrong parameters/level")
        if ntt not in (0, 1) or n != self.ctx.n or k != len(moduli):
            raise HEError("ciphertext metadata does not match the parameters")
        if not 2 <= ct_size <= CIPHERTEXT_SIZE_MAX or (size is not None and ct_size != size):
            raise HEError(f"ciphertext has size {ct_size}, expected {size or '2..16'}")
        if not math.isfinite(scale) or correction == 0:
            raise HEError("ciphertext scale / correction factor invalid")
        count = _U64.unpack_from(self.body, self.pos + _HDR.size)[0] if self.pos + _HDR.size + 8 <= len(self.body) else -1
        seeded = ct_size == 2 and count == k * n
        self.coefficients(1 if seeded else ct_size, moduli)
        if seeded:
            if self.nested_header() != _PRNG_INFO_SIZE - _HDR.size:
                raise HEError("bad PRNG seed record in seeded ciphertext")
            if self.body[self.take(1)] not in _PRNG_TYPES:
                raise HEError("unknown PRNG type in seeded ciphertext")
            self.take(64)

    def end(self) -> None:
        if self.pos != len(self.body):
            raise HEError(f"{len(self.body) - self.pos} unexpected trailing bytes in SEAL object")


def _validated(data: bytes, ctx: HEContext, cap: int, walk) -> bytes:
    """Header check, capped decompression, ``walk(layout)`` over the whole body, and the
    uncompressed blob SEAL may load."""
    body = _inflate(memoryview(data)[_HDR.size:], parse_header(data)["compr_mode"], cap)
    lay = _Layout(body, ctx)
    try:
        walk(lay)
    except struct.error:
        raise HEError("SEAL object ends early") from None
    lay.end()
    return _header(len(body)) + body


def _ciphertext_cap(ctx: HEContext, size: int | None) -> int:
    k = len(ctx.coeff_moduli) + 1  # the key level has one prime more than the first data level
    return (size or CIPHERTEXT_SIZE_MAX) * k * ctx.n * 8 + 4 * _HDR.size + _CT_META.size + _PRNG_INFO_SIZE + 64


def _parse_dynarray(body: bytes, off: int) -> tuple[np.ndarray, int]:
    """A DynArray<u64> of a trusted (locally saved) body."""
    magic, hsize, _vmaj, _vmin, compr, _r, size = _HDR.unpack_from(body, off)
    if magic != SEAL_MAGIC or compr != COMPR_NONE:
        raise HEError("bad DynArray header inside SEAL object")
    (count,) = struct.unpack_from("<Q", body, off + _HDR.size)
    start = off + _HDR.size + 8
    if size != _HDR.size + 8 + 8 * count or start + 8 * count > len(body):
        raise HEError("DynArray size mismatch inside SEAL object")
    return np.frombuffer(body, dtype="<u8", count=count, offset=start), start + 8 * count


def _dynarray_bytes(arr: np.ndarray) -> bytes:
    flat = np.ascontiguousarray(arr, dtype="<u8").reshape(-1)
    return _header(8 + 8 * flat.size) + struct.pack("<Q", flat.size) + flat.tobytes()


# --------------------------------------------------------------------------- ciphertexts
def ciphertext_to_bytes(ct) -> bytes:
    """Serialise a Ciphertext, or a seeded ``Serializable`` from encrypt_symmetric."""
    return _save(ct)


def ciphertext_from_bytes(
    ctx: HEContext, data: bytes, *, n_primes: int | None = None, parms_id=None, size: int | None = 2,
    allow_transparent: bool = False,
) -> seal.Ciphertext:
    """Validate and load a peer's ciphertext: layout, expected level / size / scale,
    not transparent unless ``allow_transparent`` (module docstring)."""
    if parms_id is None and n_primes is not None:
        parms_id = ctx.parms_id_at(n_primes)
    blob = _validated(data, ctx, _ciphertext_cap(ctx, size),
                      lambda lay: lay.ciphertext(parms_id=parms_id, size=size))
    ct = _load_validated(seal.Ciphertext(), blob, ctx.seal)
    if not allow_transparent and ct.is_transparent():
        raise HEError("transparent ciphertext (its c1 is zero): refused")
    if ctx.params.scheme == "ckks":
        if not ct.is_ntt_form():
            raise HEError("CKKS ciphertext not in NTT form")
        sc = ct.scale
        total = sum(math.log2(q) for q in ctx.moduli_of(ct.parms_id()))
        if not (math.isfinite(sc) and sc >= 1.0 and math.log2(sc) < total):
            raise HEError(f"ciphertext scale {sc!r} out of range")
    return ct


def plaintext_to_bytes(pt) -> bytes:
    return _save(pt)


def _plaintext_layout(lay: _Layout, parms_id) -> None:
    *pid, count, scale = _PT_META.unpack_from(lay.body, lay.take(_PT_META.size))
    if parms_id is not None and list(pid) != list(parms_id):
        raise HEError("plaintext is at the wrong parameters/level")
    if not math.isfinite(scale):
        raise HEError("plaintext scale invalid")
    if any(pid):  # NTT form at a level: k x N coefficients mod the level's primes
        moduli = lay.moduli(pid)
        if count != len(moduli) * lay.ctx.n:
            raise HEError("plaintext coefficient count does not match the parameters")
        lay.coefficients(1, moduli)
        return
    t = lay.ctx.params.plain_modulus
    if t is None or count > lay.ctx.n:  # coefficient form exists for BFV/BGV only
        raise HEError("plaintext coefficient count does not match the parameters")
    body_len = lay.nested_header()
    if lay.u64() != count or body_len != 8 + 8 * count:
        raise HEError("plaintext coefficient count mismatch")
    arr = np.frombuffer(lay.body, dtype="<u8", count=count, offset=lay.take(8 * count))
    if np.any(arr >= np.uint64(t)):
        raise HEError("plaintext coefficient not reduced modulo t")


def plaintext_from_bytes(ctx: HEContext, data: bytes, *, parms_id=None) -> seal.Plaintext:
    """Validate and load a plaintext (coefficient form mod t, or NTT form at a level)."""
    cap = (len(ctx.coeff_moduli) + 1) * ctx.n * 8 + 2 * _HDR.size + _PT_META.size + 8
    blob = _validated(data, ctx, cap, lambda lay: _plaintext_layout(lay, parms_id))
    return _load_validated(seal.Plaintext(), blob, ctx.seal)


# --------------------------------------------------------------------------- keys / params
def public_key_to_bytes(pk) -> bytes:
    """Serialise a PublicKey or the seeded ``Serializable`` from create_public_key."""
    return _save(pk)


def public_key_from_bytes(ctx: HEContext, data: bytes) -> seal.PublicKey:
    """Validate and load a peer's public key (a size-2 ciphertext at the key level)."""
    key_pid = list(ctx.seal.key_parms_id())
    blob = _validated(data, ctx, _ciphertext_cap(ctx, 2), lambda lay: lay.ciphertext(parms_id=key_pid, size=2))
    return _load_validated(seal.PublicKey(), blob, ctx.seal)


def galois_keys_to_bytes(gk) -> bytes:
    """Serialise GaloisKeys or the seeded ``Serializable`` from create_galois_keys."""
    return _save(gk)


def _galois_layout(lay: _Layout, max_keys: int) -> None:
    key_pid = list(lay.ctx.seal.key_parms_id())
    if list(_PARMS_ID.unpack_from(lay.body, lay.take(_PARMS_ID.size))) != key_pid:
        raise HEError("Galois keys belong to other parameters")
    dim1 = lay.u64()
    if dim1 > lay.ctx.n:
        raise HEError("Galois key table larger than the ring allows")
    decomposition = len(lay.moduli(key_pid)) - 1
    present = 0
    for _ in range(dim1):
        dim2 = lay.u64()
        if dim2 == 0:
            continue
        present += 1
        if dim2 != decomposition or present > max_keys:
            raise HEError(f"Galois key table malformed or holding more than {max_keys} keys")
        for _ in range(dim2):
            lay.nested_header()
            lay.ciphertext(parms_id=key_pid, size=2)


def galois_keys_from_bytes(ctx: HEContext, data: bytes, *, required_steps=None,
                           max_keys: int | None = None) -> seal.GaloisKeys:
    """Validate and load a peer's Galois keys: at most ``max_keys`` keys (default: the
    larger of DEFAULT_MAX_GALOIS_KEYS and the required steps' count), each checked
    like a public key; then the required steps must all be there."""
    if max_keys is None:
        max_keys = max(DEFAULT_MAX_GALOIS_KEYS, len(set(required_steps or ())))
    k = len(ctx.coeff_moduli) + 1
    cap = ctx.n * 8 + 64 + max_keys * (k - 1) * (_ciphertext_cap(ctx, 2) + 2 * _HDR.size)
    blob = _validated(data, ctx, cap, lambda lay: _galois_layout(lay, max_keys))
    gk = _load_validated(seal.GaloisKeys(), blob, ctx.seal)
    if list(gk.parms_id()) != list(ctx.seal.key_parms_id()):
        raise HEError("Galois keys belong to other parameters")
    if required_steps is not None:
        missing = [s for s, e in zip(required_steps, ctx.galois_elts(required_steps)) if not gk.has_key(e)]
        if missing:
            raise HEError(f"Galois keys lack rotation steps {missing[:8]}{'...' if len(missing) > 8 else ''}")
    return gk


_PARAMS_MAGIC = b"CLHEP1"
#: an EncryptionParameters body is a few hundred bytes
_PARAMS_CAP = 1 << 12


def params_to_bytes(p: HEParams) -> bytes:
    """Named parameter set (JSON) followed by SEAL's own EncryptionParameters blob."""
    js = p.to_json().encode()
    return _PARAMS_MAGIC + struct.pack("<I", len(js)) + js + _save(encryption_parameters(p))


def params_from_bytes(data: bytes) -> HEParams:
    """Parse and security-check the named set; the SEAL blob must be exactly the one this
    side builds from it (it is compared, never loaded)."""
    if data[:6] != _PARAMS_MAGIC or len(data) < 10:
        raise HEError("not a cipherlm HE parameter blob")
    (n,) = struct.unpack_from("<I", data, 6)
    try:
        p = HEParams.from_json(data[10 : 10 + n])
    except HEError:
        raise
    except Exception as e:
        raise HEError(f"bad HE parameter JSON: {e}") from None
    got = _body(bytes(data[10 + n :]), cap=_PARAMS_CAP)
    try:
        want = _body(_save(encryption_parameters(p)))
    except HEError:
        raise
    except Exception as e:  # SEAL refuses a set the table allows: no such primes, a plain modulus of 1 or a str
        raise HEError(f"SEAL cannot build the parameter set: {type(e).__name__}: {str(e)[:120]}") from None
    if got != want:
        raise HEError("SEAL parameters do not match the named parameter set")
    return p


# --------------------------------------------------------------------------- raw coefficients
def ciphertext_to_numpy(ct) -> np.ndarray:
    """Coefficients of ``ct`` as uint64 (size, n_primes, N), parsed from SEAL's format."""
    body = _body(_save(ct))
    *pid, _ntt, size, n, k, _scale, _cf = _CT_META.unpack_from(body, 0)
    arr, _ = _parse_dynarray(body, _CT_META.size)
    if arr.size != size * k * n:
        raise HEError("seeded/compact ciphertexts have no full coefficient data; load them first")
    return arr.reshape(size, k, n).copy()


def ciphertext_meta(ct) -> dict:
    return {
        "parms_id": list(ct.parms_id()),
        "is_ntt_form": bool(ct.is_ntt_form()),
        "scale": float(ct.scale),
        "size": ct.size(),
        "n_primes": ct.coeff_modulus_size(),
    }


def numpy_to_ciphertext(
    ctx: HEContext, arr: np.ndarray, *, parms_id=None, scale: float = 1.0, is_ntt_form: bool = True
) -> seal.Ciphertext:
    """Build a Ciphertext from (size, n_primes, N) uint64 coefficients (validated by SEAL)."""
    arr = np.asarray(arr)
    if arr.ndim != 3 or arr.shape[2] != ctx.n:
        raise HEError(f"expected (size, n_primes, {ctx.n}) coefficients, got {arr.shape}")
    size, k, n = arr.shape
    pid = list(parms_id) if parms_id is not None else ctx.parms_id_at(k)
    moduli = np.array(ctx.moduli_of(pid), dtype=np.uint64)
    if len(moduli) != k:
        raise HEError(f"{k} primes given, parms_id has {len(moduli)}")
    if np.any(arr >= moduli[None, :, None]):
        raise HEError("coefficient not reduced modulo its prime")
    body = _CT_META.pack(*pid, int(is_ntt_form), size, n, k, float(scale), 1) + _dynarray_bytes(arr)
    data = _header(len(body)) + body
    return ciphertext_from_bytes(ctx, data, parms_id=pid, size=size, allow_transparent=True)


def plaintext_to_numpy(pt, ctx: HEContext | None = None) -> np.ndarray:
    """Plaintext coefficients: (n_primes, N) for NTT-form (CKKS) plaintexts when ``ctx``
    is given, else the flat (coeff_count,) array."""
    body = _body(_save(pt))
    *pid, count, _scale = _PT_META.unpack_from(body, 0)
    arr, _ = _parse_dynarray(body, _PT_META.size)
    if arr.size != count:
        raise HEError("plaintext coefficient count mismatch")
    arr = arr.copy()
    if ctx is not None and pt.is_ntt_form():
        return arr.reshape(len(ctx.moduli_of(pid)), ctx.n)
    return arr


def numpy_to_plaintext(ctx: HEContext, arr: np.ndarray, *, parms_id=None, scale: float = 1.0) -> seal.Plaintext:
    """Build a Plaintext; (n_primes, N) -> NTT form at that level, (N,) -> coefficient form."""
    arr = np.asarray(arr)
    if arr.ndim == 2:
        k = arr.shape[0]
        pid = list(parms_id) if parms_id is not None else ctx.parms_id_at(k)
        moduli = np.array(ctx.moduli_of(pid), dtype=np.uint64)
        if np.any(arr >= moduli[:, None]):
            raise HEError("coefficient not reduced modulo its prime")
    else:
        pid = [0, 0, 0, 0]
    body = _PT_META.pack(*pid, arr.size, float(scale)) + _dynarray_bytes(arr)
    return plaintext_from_bytes(ctx, _header(len(body)) + body)
