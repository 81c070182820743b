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
is sent,
B_f >= 2^40 x the noise bound: statistical distance about 2^-40 per
coefficient, DESIGN.md's 40-bit statistical security), adds the uniform
output mask, and *modulus-switches* down to two primes before sending
(Cheetah section 4: fewer bytes).  SEAL's multiply_plain lifts plaintext
coefficients centred (|w| <= t/2), so a signed operand of magnitude M grows
the noise by M per term, not by t.

Noise bound (`noise_bound`).  One output coefficient's noise is
sum_i (e_i + eps_i) w_i over n plaintext terms, e_i SEAL's centred binomial
noise (42 coins: sub-Gaussian with variance proxy 10.5) and eps_i the encoding
rounding (|eps| <= 1/2, proxy 1/4), all independent.  Hoeffding/sub-Gaussian
tail: |noise| <= sqrt(2 ln(2^42) 10.75 n) M with probability 1 - 2^-41; that
bound (plus the re-randomisation noise, independent of the weights) is what
the flooding hides.  The budget check also covers the worst case of the
modulus switch rounding, (1 + N) / 2.
"""

from __future__ import annotations

import math

import numpy as np
import tenseal.sealapi as seal

from ..he import serialize
from ..he.context import HEContext
from ..he.errors import HEError
from ..he.keys import ClientKeys
from ..he.params import HEParams
from ..mpc.context import MPCError
from ..mpc.ring import mulmod_scalar, new_rng

PLAIN_BITS = 59
TWOPC_BFV = HEParams(name="2pc-bfv-n8192-t59", scheme="bfv", poly_modulus_degree=8192,
                     coeff_modulus_bits=(60, 60, 60, 38), plain_modulus=1 << PLAIN_BITS)
#: primes of the level results are switched down to before sending
RESULT_PRIMES = 2

#: statistical security of the noise flooding (bits)
FLOOD_SIGMA = 40
#: SEAL 4.x samples encryption noise from a centred binomial with 42 coins
#: (sigma 3.19): |e| <= 21; encoding adds a rounding error <= 1/2.
FRESH_NOISE_MAX = 21.5
#: sub-Gaussian variance proxy of e + eps (see the module docstring)
_NOISE_PROXY = 10.5 + 0.25


def noise_bound(terms: int, magnitude: float) -> float:
    """High-probability (1 - 2^-41) bound on the noise of one output coefficient
    summing ``terms`` products of fresh noise with plaintext values |w| <= magnitude."""
    return math.sqrt(2 * math.log(2.0 ** 42) * _NOISE_PROXY * max(1, terms)) * magnitude


class HESession:
    """One party's BFV keys plus the peer's public key; cached on the `Context`."""

    def __init__(self, ctx, params: HEParams = TWOPC_BFV, *, step: str = "he-keys"):
        self.params = params
        self.he = HEContext(params)
        self.n = self.he.n
        self.t = int(params.plain_modulus)
        #: power-of-two t (coefficient packing, `linear`) or a batching prime p = 1 mod 2N
        #: (SIMD packing, `linear_simd`); t_bits rounds log2 t up so budget checks stay conservative
        self.pow2 = self.t & (self.t - 1) == 0
        self.t_bits = int(math.ceil(math.log2(self.t)))
        if not self.pow2 and self.t % (2 * self.n) != 1:
            raise HEError("the 2pc linear protocol needs t = 2^k or a prime t = 1 mod 2N")
        self.batch_encoder = None if self.pow2 else seal.BatchEncoder(self.he.seal)
        self.keys = ClientKeys(self.he)
        self.rng = new_rng()
        self.top = self.he.parms_id_at(len(self.he.coeff_moduli))
        self.bottom = self.he.parms_id_at(RESULT_PRIMES)
        self.q_top_bits = sum(math.log2(q) for q in self.he.coeff_moduli)
        self.q_bottom_bits = sum(math.log2(q) for q in self.he.coeff_moduli[:RESULT_PRIMES])
        with ctx.step(step):
            peer = ctx.exchange({"bfv_params": serialize.params_to_bytes(params),
                                 "public_key": self.keys.public_key_bytes()})
        if serialize.params_from_bytes(bytes(peer["bfv_params"])) != params:
            raise MPCError("peer uses different BFV parameters")
        pk = serialize.public_key_from_bytes(self.he, bytes(peer["public_key"]))
        self._peer_encryptor = seal.Encryptor(self.he.seal, pk)
        self.plain_cache: dict = {}

    def __repr__(self) -> str:
        return f"HESession({self.params.name})"

    # -- noise budget ----------------------------------------------------------
    def flood_bound(self, noise_bound: float) -> int:
        """B_f for a product whose noise is at most ``noise_bound`` (checked against q / 2t)."""
        nb = noise_bound + self.n * FRESH_NOISE_MAX * 2  # + the re-randomising encryption of zero
        b_f = int(2 ** math.ceil(math.log2(nb) + FLOOD_SIGMA))
        if math.log2(2 * (b_f + nb)) >= self.q_top_bits - self.t_bits - 1:
            raise HEError(f"noise bound 2^{math.log2(nb):.1f} too large to flood with {self.params.name}; "
                          "use a smaller block or fewer weight bits")
        # after switching down: flooded noise / q_dropped + rounding (<= (1 + N) / 2)
        rest = self.q_top_bits - self.q_bottom_bits
        after = 2 ** (math.log2(b_f + nb) - rest) + (1 + self.n) / 2
        if math.log2(2 * after) >= self.q_bottom_bits - self.t_bits - 1:
            raise HEError("flooded noise does not survive the modulus switch")
        return b_f

    # -- encryptor side ----------------------------------------------------------
    def encrypt_polys(self, polys: np.ndarray) -> list[bytes]:
        """Seeded symmetric encryptions of coefficient vectors (values mod t)."""
        return [self.keys.encrypt_seeded(serialize.numpy_to_plaintext(self.he, p)) for p in polys]

    def decrypt_compact(self, c1: np.ndarray, c0_sel: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Decrypt a bottom-level result given its full ``c1`` and ``c0`` at ``positions`` only.
        Returns the plaintext coefficients (mod t) at those positions."""
        arr = np.zeros((2, RESULT_PRIMES, self.n), np.uint64)
        arr[1] = c1
        arr[0][:, positions] = c0_sel
        ct = serialize.numpy_to_ciphertext(self.he, arr, parms_id=self.bottom, is_ntt_form=False)
        pt = serialize.plaintext_to_numpy(self.keys.decrypt(ct))
        out = np.zeros(self.n, np.uint64)
        out[: pt.size] = pt
        return out[positions]

    # -- evaluator side -------------------------------------------------------------
    def load_input(self, blob: bytes) -> seal.Ciphertext:
        ct = serialize.ciphertext_from_bytes(self.he, blob, parms_id=self.top)
        if ct.is_ntt_form():
            raise HEError("expected a coefficient-form BFV ciphertext")
        self.he.evaluator.transform_to_ntt_inplace(ct)
        return ct

    def encode_plain(self, coeffs: np.ndarray) -> seal.Plaintext:
        """Signed integer polynomial -> NTT-form plaintext at the top level (centred lift)."""
        pt = serialize.numpy_to_plaintext(self.he, np.asarray(coeffs, np.int64).astype(np.uint64) & np.uint64(self.t - 1))
        self.he.evaluator.transform_to_ntt_inplace(pt, self.top)
        return pt

    def zero_ntt(self) -> seal.Ciphertext:
        """A public-key encryption of zero under the peer's key, NTT form (an all-zero block)."""
        ct = seal.Ciphertext()
        self._peer_encryptor.encrypt_zero(self.top, ct)
        self.he.evaluator.transform_to_ntt_inplace(ct)
        return ct

    def finish(self, acc: seal.Ciphertext, positions: np.ndarray, noise_bound: float, *,
               send_level=None, ntt: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Turn an NTT-form product into what the encryptor may see.

        Adds a uniform mask r (mod t) at ``positions``, re-randomises with a
        public-key encryption of zero, floods the noise, switches to RESULT_PRIMES primes.
        ``send_level`` (a parms_id; default the two-prime level) is for tests that
        inspect the noise before the switch.
        ``ntt``: whether ``acc`` is in NTT form (the SIMD path passes coefficient form).
        Returns (c1, c0 at positions, -r mod t) — the last is this party's share."""
        ev = self.he.evaluator
        if ntt:
            ev.transform_from_ntt_inplace(acc)
        r = self.rng.integers(0, self.t, size=positions.size, dtype=np.uint64)
        mask_poly = np.zeros(self.n, np.uint64)
        mask_poly[positions] = r
        ev.add_plain_inplace(acc, serialize.numpy_to_plaintext(self.he, mask_poly))
        zero = seal.Ciphertext()
        self._peer_encryptor.encrypt_zero(self.top, zero)
        ev.add_inplace(acc, zero)
        arr = serialize.ciphertext_to_numpy(acc)
        b_f = self.flood_bound(noise_bound)
        # only the c0 coefficients at `positions` are ever sent: flood those
        for j, residue in enumerate(self._flood_residues(b_f, positions.size)):
            q = np.uint64(self.he.coeff_moduli[j])
            arr[0, j, positions] = (arr[0, j, positions] + residue) % q
        ct = serialize.numpy_to_ciphertext(self.he, arr, parms_id=self.top, is_ntt_form=False)
        target = self.bottom if send_level is None else send_level
        if list(target) != list(self.top):
            ev.mod_switch_to_inplace(ct, target)
        out = serialize.ciphertext_to_numpy(ct)
        share = (np.uint64(self.t) - r) % np.uint64(self.t)
        return out[1], out[0][:, positions], share


    def _flood_residues(self, b_f: int, count: int) -> list[np.ndarray]:
        """A uniform integer vector u - b_f, u in [0, 2 b_f) (b_f a power of two),
        as residues modulo each data prime; u is drawn as 32-bit limbs."""
        bits = int(b_f).bit_length()  # u has log2(b_f) + 1 bits
        limbs = []
        while bits > 0:
            w = min(32, bits)
            limbs.append((self.rng.integers(0, 1 << w, size=count, dtype=np.uint64), w))
            bits -= w
        out = []
        for q in self.he.coeff_moduli:
            Q = np.uint64(q)
            acc = np.zeros(count, np.uint64)
            for limb, w in limbs:  # most significant first
                acc = (mulmod_scalar(acc, 1 << w, q) + limb % Q) % Q
            out.append((acc + np.uint64(q - (b_f % q))) % Q)
        return out


def he_session(ctx) -> HESession:
    """The context's HE session (created, with a public-key exchange, on first use)."""
    s = getattr(ctx, "_he_session", None)
    if s is None:
        s = HESession(ctx)
        ctx._he_session = s
    return s
