"""(De)serialisation of SEAL objects to bytes, and raw coefficient I/O.

``tenseal.sealapi`` only offers ``save(path)`` / ``load(ctx, path)``, always
with SEAL's default compression (zstd in this build), and no buffer protocol
on coefficient data (``Ciphertext.data()`` returns the first coefficient's
*value*, not a pointer).  So the route is a tmpfs file (``/dev/shm`` where it
exists): save -> read bytes; write bytes -> load.  Loading always goes through
SEAL's own validity checks (``is_valid_for``: parms_id known to the context,
every coefficient reduced mod its prime, sizes consistent), then the checks
here (expected parms_id/level, ciphertext size 2, sane scale).  A flipped
coefficient bit that stays below its prime cannot be detected (there is no
MAC in SEAL's format; the channel's integrity is the net layer's job).

Seeded symmetric ciphertexts and Galois keys: ``Encryptor.encrypt_symmetric(pt)``
and ``KeyGenerator.create_galois_keys(elts)`` return SEAL ``Serializable``
objects whose ``save`` writes only the PRNG seed in place of each uniformly
random polynomial ("a" half): a 2-prime N=8192 ciphertext is ~117 kB instead
of ~235 kB (measured, both zstd).  They expand on ``load``.

Raw coefficient I/O parses SEAL's documented binary format (SEAL 4.x,
``Serialization::SEALHeader`` + ``save_members``):

    header (16 B): u16 magic 0xA15E, u8 header size 16, u8 version major,
                   u8 version minor, u8 compr_mode (0 none, 1 zlib, 2 zstd),
                   u16 reserved, u64 total size in bytes (header included)
    Ciphertext body: u64[4] parms_id, u8 is_ntt_form, u64 size,
                   u64 poly_modulus_degree, u64 coeff_modulus_size, f64 scale,
                   u64 correction_factor, DynArray<u64>
    Plaintext body: u64[4] parms_id, u64 coeff_count, f64 scale, DynArray<u64>
    DynArray: its own uncompressed header (16 B), u64 count, count x u64 data

Writing builds this format with compr_mode none and lets SEAL load it (so the
result is validated by SEAL).  Reading a body that SEAL compressed needs zlib
(stdlib) or zstd (``zstandard``/``pyzstd`` if importable, else the system
``libzstd`` through ctypes).  No faster route exists in this build (see
above), so none is offered.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import struct
import tempfile
import zlib

import numpy as np
import tenseal.sealapi as seal

from .context import HEContext, encryption_parameters
from .errors import HEError
from .params import HEParams

SEAL_MAGIC = 0xA15E
_HDR = struct.Struct("<HBBBBHQ")
_CT_META = struct.Struct("<4QBQQQdQ")  # 32 + 1 + 8*3 + 8 + 8 = 73
_PT_META = struct.Struct("<4QQd")  # 32 + 8 + 8 = 48
COMPR_NONE, COMPR_ZLIB, COMPR_ZSTD = 0, 1, 2

_TMPDIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


# --------------------------------------------------------------------------- files
def _save(obj) -> bytes:
    fd, path = tempfile.mkstemp(prefix="cipherlm-he-", dir=_TMPDIR)
    os.close(fd)
    try:
        obj.save(path)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def _load(obj, data: bytes, ctx=None):
    fd, path = tempfile.mkstemp(prefix="cipherlm-he-", dir=_TMPDIR)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            if ctx is None:
                obj.load(path)
            else:
                obj.load(ctx, path)
        except Exception as e:  # SEAL raises std::logic_error / invalid_argument
            raise HEError(f"SEAL rejected the {type(obj).__name__}: {e}") from None
    finally:
        os.unlink(path)
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


# --------------------------------------------------------------------------- zstd
class _ZstdIn(ctypes.Structure):
    _fields_ = [("src", ctypes.c_void_p), ("size", ctypes.c_size_t), ("pos", ctypes.c_size_t)]


class _ZstdOut(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_void_p), ("size", ctypes.c_size_t), ("pos", ctypes.c_size_t)]


def _zstd_decompressor():
    try:
        import zstandard  # type: ignore

        return lambda b: zstandard.ZstdDecompressor().decompressobj().decompress(b)
    except ImportError:
        pass
    try:
        import pyzstd  # type: ignore

        return pyzstd.decompress
    except ImportError:
        pass
    name = ctypes.util.find_library("zstd") or "libzstd.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    lib.ZSTD_createDStream.restype = ctypes.c_void_p
    lib.ZSTD_freeDStream.argtypes = [ctypes.c_void_p]
    lib.ZSTD_decompressStream.restype = ctypes.c_size_t
    lib.ZSTD_decompressStream.argtypes = [ctypes.c_void_p, ctypes.POINTER(_ZstdOut), ctypes.POINTER(_ZstdIn)]
    lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
    lib.ZSTD_isError.restype = ctypes.c_uint

    def decompress(b: bytes) -> bytes:
        ds = lib.ZSTD_createDStream()
        try:
            src = ctypes.create_string_buffer(b, len(b))
            inb = _ZstdIn(ctypes.cast(src, ctypes.c_void_p), len(b), 0)
            chunks = []
            cap = max(1 << 16, 4 * len(b))
            while True:
                dst = ctypes.create_string_buffer(cap)
                outb = _ZstdOut(ctypes.cast(dst, ctypes.c_void_p), cap, 0)
                r = lib.ZSTD_decompressStream(ds, ctypes.byref(outb), ctypes.byref(inb))
                if lib.ZSTD_isError(r):
                    raise HEError("corrupted zstd stream in SEAL object")
                chunks.append(dst.raw[: outb.pos])
                if r == 0 and inb.pos == inb.size:
                    return b"".join(chunks)
                if outb.pos == 0 and inb.pos == inb.size:
                    raise HEError("truncated zstd stream in SEAL object")
                cap *= 2
        finally:
            lib.ZSTD_freeDStream(ds)

    return decompress


_ZSTD = _zstd_decompressor()


def _body(data: bytes) -> bytes:
    h = parse_header(data)
    raw = data[_HDR.size :]
    if h["compr_mode"] == COMPR_NONE:
        return raw
    if h["compr_mode"] == COMPR_ZLIB:
        try:
            return zlib.decompress(raw)
        except zlib.error as e:
            raise HEError(f"corrupted zlib stream in SEAL object: {e}") from None
    if _ZSTD is None:
        raise HEError("SEAL object is zstd-compressed and no zstd decoder is available")
    try:
        return _ZSTD(raw)
    except HEError:
        raise
    except Exception as e:
        raise HEError(f"corrupted zstd stream in SEAL object: {e}") from None


def _parse_dynarray(body: bytes, off: int) -> tuple[np.ndarray, int]:
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
    ctx: HEContext, data: bytes, *, n_primes: int | None = None, parms_id=None, size: int = 2
) -> seal.Ciphertext:
    """Load and validate a ciphertext: SEAL validity + expected level / size / scale."""
    parse_header(data)
    ct = _load(seal.Ciphertext(), data, ctx.seal)
    if parms_id is None and n_primes is not None:
        parms_id = ctx.parms_id_at(n_primes)
    if parms_id is not None and list(ct.parms_id()) != list(parms_id):
        raise HEError(
            f"ciphertext is at the wrong parameters/level: {ct.coeff_modulus_size()} primes, "
            f"parms_id {list(ct.parms_id())[:1]}... != expected {list(parms_id)[:1]}..."
        )
    if size is not None and ct.size() != size:
        raise HEError(f"ciphertext has size {ct.size()}, expected {size}")
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


def plaintext_from_bytes(ctx: HEContext, data: bytes, *, parms_id=None) -> seal.Plaintext:
    parse_header(data)
    pt = _load(seal.Plaintext(), data, ctx.seal)
    if parms_id is not None and list(pt.parms_id()) != list(parms_id):
        raise HEError("plaintext is at the wrong parameters/level")
    return pt


# --------------------------------------------------------------------------- keys / params
def public_key_to_bytes(pk) -> bytes:
    """Serialise a PublicKey or the seeded ``Serializable`` from create_public_key."""
    return _save(pk)


def public_key_from_bytes(ctx: HEContext, data: bytes) -> seal.PublicKey:
    """Load and validate (SEAL's checks) a peer's public key."""
    parse_header(data)
    return _load(seal.PublicKey(), data, ctx.seal)


def galois_keys_to_bytes(gk) -> bytes:
    """Serialise GaloisKeys or the seeded ``Serializable`` from create_galois_keys."""
    return _save(gk)


def galois_keys_from_bytes(ctx: HEContext, data: bytes, *, required_steps=None) -> seal.GaloisKeys:
    parse_header(data)
    gk = _load(seal.GaloisKeys(), data, ctx.seal)
    if list(gk.parms_id()) != list(ctx.seal.key_parms_id()):
        raise HEError("Galois keys belong to other parameters")
    if required_steps is not None:
        missing = [s for s, e in zip(required_steps, ctx.galois_elts(required_steps)) if not gk.has_key(e)]
        if missing:
            raise HEError(f"Galois keys lack rotation steps {missing[:8]}{'...' if len(missing) > 8 else ''}")
    return gk


_PARAMS_MAGIC = b"CLHEP1"


def params_to_bytes(p: HEParams) -> bytes:
    """Named parameter set (JSON) followed by SEAL's own EncryptionParameters blob."""
    js = p.to_json().encode()
    return _PARAMS_MAGIC + struct.pack("<I", len(js)) + js + _save(encryption_parameters(p))


def params_from_bytes(data: bytes) -> HEParams:
    """Parse, security-check, and cross-check the SEAL blob against the named set."""
    if data[:6] != _PARAMS_MAGIC or len(data) < 10:
        raise HEError("not a cipherlm HE parameter blob")
    (n,) = struct.unpack_from("<I", data, 6)
    try:
        p = HEParams.from_json(data[10 : 10 + n])
    except HEError:
        raise
    except Exception as e:
        raise HEError(f"bad HE parameter JSON: {e}") from None
    blob = data[10 + n :]
    parse_header(blob)
    got = _load(seal.EncryptionParameters(seal.SCHEME_TYPE.CKKS), blob)
    if got.poly_modulus_degree() != p.poly_modulus_degree or [
        m.value() for m in got.coeff_modulus()
    ] != [m.value() for m in encryption_parameters(p).coeff_modulus()]:
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
    return ciphertext_from_bytes(ctx, data, parms_id=pid, size=size)


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
