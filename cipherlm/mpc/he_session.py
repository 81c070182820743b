"""Per-session BFV state for the 2pc mode's HE <-> share conversions.

Both parties own a BFV key pair (either can be the *encryptor* of a cross
term: the client for ``x_client @ W``, either party for the cross terms of a
product of two shared matrices).  At first use each party generates its keys
(SEAL's KeyGenerator, seeded from the OS random device) and sends the peer its
public key (seeded serialisation); the secret key never leaves the party.

Parameter set ``TWOPC_BFV`` (Cheetah-style: BFV with a power-of-two plaintext
modulus t = 2^k, Huang et al., USENIX Security 2022, section 3; BLB section
2.3): N = 8192, coefficient modulus 3 x 60 + 38 bits = 218 (the
HomomorphicEncryption.org 128-bit bound for N = 8192), t = 2^59.  Fresh
ciphertexts live at the three 60-bit data primes (the 38-bit prime is SEAL's
special prime, unused: the linear protocol has no key switching).  The
evaluator *re-randomises* every result (adds a public-key encryption of zero
under the encryptor's key, so the ``c1`` half is fresh), *floods* the noise
(adds a uniform integer in [-B_f, B_f) to every coefficient of ``c0`` that
is sent, B_f >= 2^FLOOD_SIGMA x the noise bound), adds the uniform output mask,
and *modulus-switches* down to two primes before sending (Cheetah section 4:
fewer bytes).  SEAL's multiply_plain lifts plaintext coefficients centred
(|w| <= t/2), so a signed operand of magnitude M grows the noise by M per term,
not by t.

Flooding width: per session, not per coefficient.  For one sent coefficient with
weight-dependent noise e (independent of the flooding U, uniform on 2 B_f
integers) the statistical distance between U + e and U is at most
E|e| / (2 B_f) (average of min(1, |e| / 2 B_f) over e); every bound below
(`noise_bound`, the SIMD path's, the embedding's) is >= E|e|, so one coefficient
costs <= 2^-(FLOOD_SIGMA + 1), with no separate tail-failure term.  A hybrid
over the coefficients (each U_j independent of everything else) adds these up:
a session that floods C coefficients is within C 2^-(FLOOD_SIGMA + 1) of one
whose sent c0 values do not depend on the weights.  The product's choice is a
session-level 2^-40: ``FLOOD_SIGMA = 40 + k`` with ``MAX_FLOODED_PER_SESSION =
2^k`` flooded coefficients per session (k = 37, see the constant), enforced by
a per-session counter (`count_flooded`; every flooding site of the 2pc mode,
this module's `HESession.finish` and `protocols.embedding`, calls it), so the
whole session's statistical distance is <= 2^37 2^-78 = 2^-41 <= 2^-40.
With 40 bits per coefficient (the first version) a MiniLM sentence was at
~2^-20 and a SmolLM2 prefill at ~2^-18.

Parameter sets.  ``TWOPC_BFV`` (N = 8192, 180 data bits) holds 77-bit flooding
for products with the server's weights (|w| < 2^19: `linear`, MoE experts) with
~9 bits to spare.  A product whose plaintext operand is a *share* mod t
(|w| < 2^58: attention's Q K^T and P V, MoE dispatch/combine) has noise
>= 2^62.6 per term; 180 data bits leave room for at most ~50 bits of flooding,
so those cross terms use ``TWOPC_BFV_WIDE``: N = 16384, 4 x 60 data bits + a
60-bit special prime = 300 <= 438 (the HomomorphicEncryption.org 128-bit
bound for N = 16384), the same t = 2^59 and the same protocol
(`he_session_wide`; its public keys are exchanged at first use, step
``he-keys``).  Limb-splitting the share (2-3 limbs at N = 8192) was the
alternative: 2-3x the input ciphertexts and products, against ~1.3x input
bytes per coefficient at N = 16384 (docs/linear_2pc.md).

Noise bound (`noise_bound`).  One output coefficient's noise is
sum_i (e_i + eps_i) w_i over n plaintext terms, e_i SEAL's centred binomial
noise (42 coins: sub-Gaussian with variance proxy 10.5) and eps_i the encoding
rounding (|eps| <= 1/2, proxy 1/4), all independent.  Hoeffding/sub-Gaussian
tail: |noise| <= sqrt(2 ln(2^42) 10.75 n) M with probability 1 - 2^-41 (a
correctness bound: the flooded result must still decrypt); as a bound on
E|noise| <= sqrt(10.75 n) M it is 7.6x loose.  That bound plus the
re-randomisation noise (independent of the weights, worst case) is what the
flooding hides.  The budget check also covers the worst case of the modulus
switch rounding, (1 + N) / 2.
"""

from __future__ import annotations

import math

import numpy as np

from cipherlm import _core

from ..he.backend import DEFAULT_BACKEND, HEBackend, get_backend
from ..he.errors import HEError
from ..he.params import HEParams
from . import crt
from .context import MPCError
from .ring import new_rng

PLAIN_BITS = 59
TWOPC_BFV = HEParams(name="2pc-bfv-n8192-t59", scheme="bfv", poly_modulus_degree=8192,
                     coeff_modulus_bits=(60, 60, 60, 38), plain_modulus=1 << PLAIN_BITS)
#: cross terms whose plaintext operand is a share mod t (|w| < 2^58): room for FLOOD_SIGMA
#: bits of flooding on top of noise 2^62.6 sqrt(d o_w) (module docstring); 300 <= 438 bits
TWOPC_BFV_WIDE = HEParams(name="2pc-bfv-n16384-t59", scheme="bfv", poly_modulus_degree=16384,
                          coeff_modulus_bits=(60, 60, 60, 60, 60), plain_modulus=1 << PLAIN_BITS)
#: primes of the level results are switched down to before sending
RESULT_PRIMES = 2

#: log2 of the flooded (sent) coefficients one session may carry.  Estimate (generous):
#: SmolLM2-135M (30 layers, d 576, 9 query / 3 KV heads of 64, FFN 1536, vocab 49152) over
#: its whole 8192-token context: Q K^T 2 x 30 x 9 x 8192^2 = 2^35.08 (both cross terms,
#: prefill of the full context is the worst split between prefill and decode), P V
#: 2 x 30 x 9 x 8192 x 64 = 2^28.1, projections 30 x 5184 x 8192 = 2^30.2, LM head
#: 49152 x 8192 = 2^28.6, embedding 576 x 8192 = 2^22.2: 2^35.15 in all with coefficient
#: packing (counted from the real plans: block padding <= 1.3x on these shapes), 2^35.1
#: with SIMD packing for the projections (all N coefficients of a SIMD result are
#: flooded).  MiniLM (6 layers, d 384, 12 heads, FFN 1536): 2^26.0 over its 512
#: positions (a vocabulary-sized head counted too), 2^20.9 for a 32-token sentence.
#: 2^37 leaves 3.6x on the largest.  (`tests/test_flooding.py::session_flooded` counts them.)
MAX_FLOODED_LOG2 = 37
MAX_FLOODED_PER_SESSION = 1 << MAX_FLOODED_LOG2
#: flooding width (bits over the noise bound): 40 + log2(MAX_FLOODED_PER_SESSION), so a whole
#: session is within MAX_FLOODED_PER_SESSION x 2^-(FLOOD_SIGMA + 1) = 2^-41 (module docstring)
FLOOD_SIGMA = 40 + MAX_FLOODED_LOG2
#: SEAL 4.x samples encryption noise from a centred binomial with 42 coins
#: (sigma 3.19): |e| <= 21; encoding adds a rounding error <= 1/2.
FRESH_NOISE_MAX = 21.5
#: sub-Gaussian variance proxy of e + eps (see the module docstring)
_NOISE_PROXY = 10.5 + 0.25


def noise_bound(terms: int, magnitude: float) -> float:
    """High-probability (1 - 2^-41) bound on the noise of one output coefficient
    summing ``terms`` products of fresh noise with plaintext values |w| <= magnitude
    (also a bound on its mean absolute value, which is what the flooding needs)."""
    return math.sqrt(2 * math.log(2.0 ** 42) * _NOISE_PROXY * max(1, terms)) * magnitude


def session_distance(flooded: int, sigma: int = FLOOD_SIGMA) -> float:
    """Upper bound on the statistical distance of a session that sent ``flooded``
    coefficients flooded with ``sigma`` bits (each <= 2^-(sigma + 1), module docstring)."""
    return flooded * 2.0 ** -(sigma + 1)


class FloodCounter:
    """Flooded coefficients this party has sent in the session (one per `Context`)."""

    def __init__(self):
        self.count = 0

    def add(self, n: int) -> None:
        n = int(n)
        if self.count + n > MAX_FLOODED_PER_SESSION:
            raise HEError(
                f"this session would send {self.count + n} flooded coefficients, more than the "
                f"2^{MAX_FLOODED_LOG2} its {FLOOD_SIGMA}-bit flooding is sized for (statistical "
                "distance 2^-40 per session); start a new session")
        self.count += n

    @property
    def distance(self) -> float:
        return session_distance(self.count)


def flood_counter(ctx) -> FloodCounter:
    """The session's (the context's) flooded-coefficient counter."""
    c = getattr(ctx, "_flood_counter", None)
    if c is None:
        c = ctx._flood_counter = FloodCounter()
    return c


def count_flooded(ctx, n: int) -> None:
    """Record ``n`` more flooded coefficients sent in this session; HEError beyond
    MAX_FLOODED_PER_SESSION (the bound FLOOD_SIGMA was sized for)."""
    flood_counter(ctx).add(n)


class HESession:
    """One party's BFV keys plus the peer's public key; cached on the `Context`.

    Every HE operation goes through ``self.backend`` (`cipherlm.he.backend.HEBackend`,
    SEAL by default); ``self.he`` is that backend's context."""

    def __init__(self, ctx, params: HEParams = TWOPC_BFV, *, step: str = "he-keys",
                 backend: str | HEBackend = DEFAULT_BACKEND, result_primes: int = RESULT_PRIMES):
        self.params = params
        self.backend = be = get_backend(backend) if isinstance(backend, str) else backend
        self.he = be.context(params)
        self.n = self.he.n
        self.t = int(params.plain_modulus)
        #: power-of-two t (coefficient packing, `linear`) or a batching prime p = 1 mod 2N
        #: (SIMD packing, `linear_simd`); t_bits rounds log2 t up so budget checks stay conservative
        self.pow2 = self.t & (self.t - 1) == 0
        self.t_bits = int(math.ceil(math.log2(self.t)))
        if not self.pow2 and self.t % (2 * self.n) != 1:
            raise HEError("the 2pc linear protocol needs t = 2^k or a prime t = 1 mod 2N")
        self.keys = be.keygen(self.he)
        self.rng = new_rng()
        self.top = be.level(self.he, len(self.he.coeff_moduli))
        #: primes the results are switched down to before sending (`finish`)
        self.result_primes = int(result_primes)
        if not 1 <= self.result_primes <= len(self.he.coeff_moduli):
            raise HEError(f"result_primes must be in 1..{len(self.he.coeff_moduli)}")
        self.bottom = be.level(self.he, self.result_primes)
        self.q_top_bits = sum(math.log2(q) for q in self.he.coeff_moduli)
        self.q_bottom_bits = sum(math.log2(q) for q in self.he.coeff_moduli[:self.result_primes])
        with ctx.step(step):
            peer = ctx.exchange({"bfv_params": be.params_to_bytes(params),
                                 "public_key": self.keys.public_key_bytes()})
        if be.params_from_bytes(bytes(peer["bfv_params"])) != params:
            raise MPCError("peer uses different BFV parameters")
        self._peer_pk = be.load_public_key(self.he, bytes(peer["public_key"]))
        try:  # the keys as residues, for the native cross-term kernels (`native`)
            self._peer_pk_ntt = be.public_key_to_numpy(self.he, bytes(peer["public_key"]))
            self._sk_ntt = self.keys.secret_key_ntt()
        except NotImplementedError:
            self._peer_pk_ntt = self._sk_ntt = None
        self._moduli = [int(q) for q in self.he.coeff_moduli]
        q_all = math.prod(self._moduli)
        #: round(q m / t) = delta m + floor((q_mod_t m + floor((t + 1) / 2)) / t), per prime
        self._delta = [(q_all // self.t) % q for q in self._moduli]
        self._q_mod_t = q_all % self.t
        self.plain_cache: dict = {}
        self.flooded = flood_counter(ctx)

    def __repr__(self) -> str:
        return f"HESession({self.params.name})"

    # -- noise budget ----------------------------------------------------------
    def flood_bound(self, noise_bound: float) -> int:
        """B_f for a product whose weight-dependent noise has mean absolute value at most
        ``noise_bound``: 2^FLOOD_SIGMA x (that + the re-randomisation noise), a power of two,
        checked to fit below q / 2t (`check_budget` with the same bound)."""
        nb = noise_bound + self.n * FRESH_NOISE_MAX * 2  # + the re-randomising encryption of zero
        b_f = int(2 ** math.ceil(math.log2(nb) + FLOOD_SIGMA))
        self.check_budget(b_f, noise_bound)
        return b_f

    def check_budget(self, b_f: int, noise_bound: float) -> None:
        """HEError unless a result with flooding b_f and noise <= ``noise_bound`` (+ the
        re-randomisation) decrypts at the top level and after the switch to RESULT_PRIMES."""
        nb = noise_bound + self.n * FRESH_NOISE_MAX * 2
        if math.log2(2 * (b_f + nb)) >= self.q_top_bits - self.t_bits - 1:
            raise HEError(f"noise bound 2^{math.log2(nb):.1f} too large to flood with {FLOOD_SIGMA} bits "
                          f"in {self.params.name}; use a smaller block or fewer weight bits")
        # after switching down: flooded noise / q_dropped + rounding (<= (1 + N) / 2)
        rest = self.q_top_bits - self.q_bottom_bits
        after = 2 ** (math.log2(b_f + nb) - rest) + (1 + self.n) / 2
        if math.log2(2 * after) >= self.q_bottom_bits - self.t_bits - 1:
            raise HEError("flooded noise does not survive the modulus switch")

    def max_flood_terms(self, magnitude: float) -> float:
        """The most plaintext terms (d o_w) one output may sum with |w| <= magnitude so
        that FLOOD_SIGMA-bit flooding still fits (0 when not even one fits)."""
        limit = 2.0 ** (self.q_top_bits - self.t_bits - 4 - FLOOD_SIGMA) - 2 * self.n * FRESH_NOISE_MAX
        if limit <= 0:
            return 0.0
        return (limit / noise_bound(1, magnitude)) ** 2

    # -- encryptor side ----------------------------------------------------------
    def encrypt_polys(self, polys: np.ndarray) -> list[bytes]:
        """Seeded symmetric encryptions of coefficient vectors (values mod t)."""
        return [self.keys.encrypt_seeded(self.backend.encode_coeffs(self.he, p)) for p in polys]

    def decrypt_compact(self, c1: np.ndarray, c0_sel: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Decrypt a bottom-level result given its full ``c1`` and ``c0`` at ``positions`` only.
        Returns the plaintext coefficients (mod t) at those positions."""
        arr = np.zeros((2, self.result_primes, self.n), np.uint64)
        arr[1] = c1
        arr[0][:, positions] = c0_sel
        ct = self.backend.numpy_to_ciphertext(self.he, arr, level=self.bottom, ntt=False)
        pt = self.backend.plaintext_to_numpy(self.keys.decrypt(ct))
        out = np.zeros(self.n, np.uint64)
        out[: pt.size] = pt
        return out[positions]

    # -- evaluator side -------------------------------------------------------------
    def load_input(self, blob: bytes):
        be = self.backend
        ct = be.ciphertext_from_bytes(self.he, blob, level=self.top)
        if be.is_ntt(ct):
            raise HEError("expected a coefficient-form BFV ciphertext")
        be.to_ntt_inplace(self.he, ct)
        return ct

    def encode_plain(self, coeffs: np.ndarray):
        """Signed integer polynomial -> NTT-form plaintext at the top level (centred lift)."""
        return self.backend.encode_coeffs(
            self.he, np.asarray(coeffs, np.int64).astype(np.uint64) & np.uint64(self.t - 1), level=self.top, ntt=True)

    def zero_ntt(self):
        """A public-key encryption of zero under the peer's key, NTT form (an all-zero block)."""
        ct = self.backend.encrypt_zero(self.he, self._peer_pk, self.top)
        self.backend.to_ntt_inplace(self.he, ct)
        return ct

    def finish(self, acc, positions: np.ndarray, noise_bound: float, *,
               send_level=None, ntt: bool = True, flood_noise: float | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Turn an NTT-form product into what the encryptor may see.

        Adds a uniform mask r (mod t) at ``positions``, re-randomises with a
        public-key encryption of zero, floods the noise, switches to RESULT_PRIMES primes.
        ``send_level`` (a parms_id; default the two-prime level) is for tests that
        inspect the noise before the switch.
        ``ntt``: whether ``acc`` is in NTT form (the SIMD path passes coefficient form).
        ``flood_noise``: a bound on the mean absolute noise to size the flooding from when
        it is tighter than ``noise_bound`` (the SIMD path's worst case); ``noise_bound``
        is then only the correctness bound.  Counts ``positions.size`` flooded coefficients
        against the session's MAX_FLOODED_PER_SESSION.
        Returns (c1, c0 at positions, -r mod t) — the last is this party's share."""
        be, he = self.backend, self.he
        if ntt:
            be.from_ntt_inplace(he, acc)
        r = self.rng.integers(0, self.t, size=positions.size, dtype=np.uint64)
        mask_poly = np.zeros(self.n, np.uint64)
        mask_poly[positions] = r
        be.add_plain_inplace(he, acc, be.encode_coeffs(he, mask_poly))
        be.add_inplace(he, acc, be.encrypt_zero(he, self._peer_pk, self.top))
        arr = be.ciphertext_to_numpy(acc)
        b_f = self.flood_bound(noise_bound if flood_noise is None else flood_noise)
        if flood_noise is not None:
            self.check_budget(b_f, noise_bound)
        self.flooded.add(positions.size)
        # only the c0 coefficients at `positions` are ever sent: flood those
        for j, residue in enumerate(self._flood_residues(b_f, positions.size)):
            q = np.uint64(self.he.coeff_moduli[j])
            arr[0, j, positions] = (arr[0, j, positions] + residue) % q
        ct = be.numpy_to_ciphertext(he, arr, level=self.top, ntt=False)
        target = self.bottom if send_level is None else send_level
        if target != self.top:
            be.mod_switch_to_inplace(he, ct, target)
        out = be.ciphertext_to_numpy(ct)
        share = (np.uint64(self.t) - r) % np.uint64(self.t)
        return out[1], out[0][:, positions], share


    @property
    def native(self) -> bool:
        """Whether the native cross-term kernels apply (`encrypt_native`, `load_native`,
        `finish_native`, `decrypt_native`): coefficient packing (t a power of two) and a
        backend that gives the keys as residues in SEAL's NTT convention."""
        return self.pow2 and self._peer_pk_ntt is not None

    # -- native encryptor side (`_core.bfv_encrypt_symmetric`, `bfv_decrypt_positions`) --
    def encrypt_native(self, polys: np.ndarray) -> dict:
        """Seeded symmetric encryptions of coefficient vectors (values mod t) in NTT form:
        {"c0": bit-packed c_0 of each, "seeds": 32 bytes each} (`_core.bfv_encrypt_symmetric`)."""
        polys = np.ascontiguousarray(polys, np.uint64).reshape(-1, self.n) & np.uint64(self.t - 1)
        c0, seeds = _core.bfv_encrypt_symmetric(u64_bytes_view(polys), u64_bytes_view(self._sk_ntt), self._delta,
                                                self._q_mod_t, self.t, self._moduli, self.n)
        return {"c0": bytes(c0), "seeds": bytes(seeds)}

    def decrypt_native(self, c1: np.ndarray, c0_sel: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """`decrypt_compact` for a batch: c1 (r, RESULT_PRIMES, N), c0 at positions
        (r, RESULT_PRIMES, P) -> plaintext values (r, P) mod t.  Residues not below their
        primes (the peer's bytes) raise HEError."""
        kr = self.result_primes
        primes = tuple(self._moduli[:kr])
        try:
            res = _core.bfv_decrypt_positions(u64_bytes_view(c1), u64_bytes_view(c0_sel), u64_bytes_view(self._sk_ntt),
                                              [int(v) for v in positions], list(primes), self.n)
        except ValueError as e:
            raise HEError(f"cross term reply: {e}") from None
        r, p = c1.shape[0], positions.size
        res = np.frombuffer(res, np.uint64).reshape(r, kr, p).transpose(1, 0, 2).reshape(kr, r * p)
        return crt.rescale(res, primes, self.t_bits).reshape(r, p)

    # -- native evaluator side ------------------------------------------------------------
    def load_native(self, msg: dict, count: int) -> np.ndarray:
        """The encryptor's {"c0", "seeds"} as NTT-form ciphertexts (count, 2, k, N)
        (`_core.bfv_expand_seeded`: c_0 checked below its primes, c_1 from the seed).
        Malformed ciphertext bytes raise HEError."""
        c0, seeds = msg.get("c0"), msg.get("seeds")
        if not isinstance(c0, (bytes, bytearray)) or not isinstance(seeds, (bytes, bytearray)) \
                or len(seeds) != 32 * count:
            raise HEError(f"cross term: expected c0 bytes and {count} 32-byte seeds")
        try:
            out = _core.bfv_expand_seeded(bytes(c0), bytes(seeds), self._moduli, self.n)
        except ValueError as e:
            raise HEError(f"cross term input: {e}") from None
        return np.frombuffer(out, np.uint64).reshape(count, 2, len(self._moduli), self.n)

    def finish_native(self, sums: np.ndarray, positions: np.ndarray, noise_bound: float, *,
                      keep: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`finish` for a batch of NTT-form products ``sums`` (n_out, 2, k, N) at the top level,
        in one native call (`_core.bfv_finish`: every core, no backend objects): the same
        mask (encoded as round(q r / t), as SEAL's `add_plain`), re-randomisation (a
        public-key encryption of zero drawn natively from a CSPRNG), flooding (drawn here, as
        in `finish`) and switch to RESULT_PRIMES.
        ``keep`` (default RESULT_PRIMES) is for tests that inspect the noise before the switch.
        Returns (c1 (n_out, keep, N), c0 at positions (n_out, keep, P), -r mod t (n_out, P)),
        the last being this party's shares."""
        if not self.native:
            raise HEError("finish_native needs t = 2^k and the keys as residues")
        sums = np.ascontiguousarray(sums, np.uint64)
        n_out, k, p = sums.shape[0], len(self.he.coeff_moduli), positions.size
        if sums.shape[1:] != (2, k, self.n):
            raise HEError(f"expected (n, 2, {k}, {self.n}) products, got {sums.shape}")
        moduli = self._moduli
        r = self.rng.integers(0, self.t, size=(n_out, p), dtype=np.uint64)
        b_f = self.flood_bound(noise_bound)
        self.flooded.add(n_out * p)
        flood = np.stack(self._flood_residues(b_f, n_out * p)).reshape(k, n_out, p).transpose(1, 0, 2)
        keep = self.result_primes if keep is None else int(keep)
        c1, c0 = _core.bfv_finish(u64_bytes_view(sums), u64_bytes_view(self._peer_pk_ntt), u64_bytes_view(r),
                                  [int(v) for v in positions], u64_bytes_view(flood), self._delta, self._q_mod_t, self.t,
                                  moduli, self.n, keep)
        c1 = np.frombuffer(c1, np.uint64).reshape(n_out, keep, self.n)
        c0 = np.frombuffer(c0, np.uint64).reshape(n_out, keep, p)
        return c1, c0, (np.uint64(self.t) - r) % np.uint64(self.t)

    def _flood_residues(self, b_f: int, count: int) -> list[np.ndarray]:
        """A uniform integer vector u - b_f, u in [0, 2 b_f) (b_f a power of two),
        as residues modulo each data prime; u is drawn as 64-bit words from the
        session's CSPRNG and reduced natively (`_core.multiword_residues`)."""
        bits = int(b_f).bit_length()  # u has log2(b_f) + 1 bits
        w = -(-bits // 64)
        words = self.rng.bit_generator.random_raw(count * w).astype(np.uint64).reshape(count, w)
        if bits % 64:
            words[:, -1] &= np.uint64((1 << (bits % 64)) - 1)
        moduli = [int(q) for q in self.he.coeff_moduli]
        out = _core.multiword_residues(np.ascontiguousarray(words).view(np.uint8).reshape(-1), w, moduli,
                                       [b_f % q for q in moduli])
        return list(np.frombuffer(out, np.uint64).reshape(len(moduli), count))


def u64_bytes_view(a: np.ndarray) -> np.ndarray:
    """A uint64 array as the flat C-contiguous uint8 view the native kernels take."""
    return np.ascontiguousarray(a, np.uint64).reshape(-1).view(np.uint8)


def he_session(ctx) -> HESession:
    """The context's HE session (created, with a public-key exchange, on first use)."""
    s = getattr(ctx, "_he_session", None)
    if s is None:
        s = HESession(ctx)
        ctx._he_session = s
    return s


def he_session_wide(ctx) -> HESession:
    """The context's ``TWOPC_BFV_WIDE`` session (cross terms with a share as plaintext
    operand; own keys, public keys exchanged at first use under step ``he-keys``)."""
    s = getattr(ctx, "_he_session_wide", None)
    if s is None:
        s = HESession(ctx, TWOPC_BFV_WIDE)
        ctx._he_session_wide = s
    return s
