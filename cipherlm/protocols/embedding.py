"""Private embedding-table lookup: FastQuery (``fastquery_002``, section 4) and its Cheetah baseline.

The client (party 0) holds token ids, the server (party 1) holds the table
(V x d floats).  Everything happens in the online phase (section 4.2):

1. the client encrypts a one-hot query per token with BFV (coefficient
   packing, Cheetah section 2.4 / Figure 3: block r of the one-hot vector is the
   polynomial sum_a x[r n_i + a] X^a) and sends it (seeded: one polynomial per
   ciphertext);
2. the server multiplies by its quantised, packed table (block (r, c) is the
   polynomial sum_{a,b} W[r n_i + a, c n_o + b] X^{b n_i + n_i - 1 - a}), so the
   coefficient b n_i + n_i - 1 of output c is the looked-up packed value;
3. FastQuery rows: PackLWEs (CDKS 2021 Algorithms 1-2, FastQuery section 2.3 "PackLWEs
   optimization") gathers these coefficients into ceil(n / N) ciphertexts, with one of two
   `PACKERS` the server announces at setup: ``"lattigo"`` (the Go packer of
   ``native/lattigo/pack_lwes.go``, `LattigoBackend.pack_lwes_packer`, a chunk of leaves per
   call on all cores; the default when its library is built) or ``"seal"``
   (`cipherlm.he.packlwe`, one SEAL automorphism per call); the client sends Galois keys in
   that packer's format and refuses a packer it cannot run; Cheetah rows send each output
   ciphertext's c1 and only the useful c0 coefficients (Cheetah's trick);
4. the server re-randomises (adds a fresh public-key encryption of zero, so
   c1 is independent of the table), switches the modulus down to the kept
   primes, subtracts a uniform mask S (mod t) and floods the sent c0
   coefficients with uniform noise in [-F, F], F = 2^lambda * B' (B' the
   documented bound on the table-dependent noise, `embedding_he.plan_params`);
   lambda defaults to the 2pc mode's `he_session.FLOOD_SIGMA` = 77: one
   coefficient's statistical distance is <= E|e| / (2F + 1) <= 2^-(lambda + 1)
   (B' >= E|e|, so its tail probability does not enter), and the server counts
   the flooded coefficients against the session's 2^37 (`he_session.flood_counter`),
   so the lookups and the linear layers together stay within 2^-40 per session;
   77 bits need N = 8192 (docs/embedding.md);
5. the client decrypts u = W - S mod t: (u, S) are additive shares of the
   packed value W;
6. bit-width extension (section 4.2 "Bit-width alignment", SiRNN): each field
   of the packed coefficient keeps one spare (zero) top bit, so the wrap bit of
   the shares of the low part of W is msb(u) OR msb(S) (SiRNN's extension with a
   known-zero MSB); one correlated OT per field gives arithmetic shares of the
   AND, and each channel comes out as a 64-bit fixed-point AShare.

FastQuery's improvements and the rows of the ablation (Table 6):
``cheetah`` (16-bit fixed-point table, plaintext modulus 2^37: Cheetah's ring),
``+quant`` (the section 4.3 channel-wise mixed precision: the third of the
channels with the largest mean |value| at 4 bits, the rest at 3, power-of-two
scales; same HE parameters), ``+accbits`` (one-hot-aware accumulation width:
t = 2^max(13, b_w + 1) and a smaller Q), ``+packing`` (three channels, 4+1, 3+1,
3+1 bits, per 13-bit coefficient, so d / 3 columns), ``fastquery`` (+PackLWEs).
``+blockot`` / ``+blockot2`` / ``+blockot4`` (ours, docs/embedding.md): the query covers a
group of k = 1, 2, 4 blocks (k query ciphertexts per token instead of ceil(V / N)), the server
answers for every group and a 1-of-G OT (`_select_block`) hands the client its group's share.
``exact``: the table at 12 bits per channel (per-channel power-of-two scale),
one channel per coefficient, PackLWEs: the mode for real models where 3/4-bit
quantisation costs accuracy.

The quantisation parameters (bit widths, scales, channel order) are public
(section 4.3: "the quantization parameters, including the scale and bit-width,
are publicly known"); the server sends them at setup.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import secrets

import numpy as np

from ..he.backend import backend_unavailable_reason, get_backend
from . import embedding_he as H
from ..mpc.he_session import FLOOD_SIGMA, flood_counter
from ..mpc.context import MPCError
from ..mpc.shares import AShare

__all__ = [
    "Method",
    "METHODS",
    "ABLATION",
    "QTable",
    "quantize",
    "Layout",
    "make_layout",
    "EmbeddingSetup",
    "setup",
    "lookup",
    "embedding_lookup",
    "quantized_rows",
    "channel_bits",
    "PACKERS",
    "default_packer",
]

#: PackLWEs implementations (`setup`'s ``packer``): the HE backend that runs the tree
PACKERS = ("lattigo", "seal")
#: the Lattigo packer's server prepares its table's weight polynomials once per session
#: (`LattigoPackWeights`, (2 + 4 k) bytes per coefficient: 0.63 GB for a 32000 x 4096 table at
#: N = 4096, 0.23 GB for MiniLM's at N = 8192) when they fit in this many bytes; otherwise each
#: lookup reduces and transforms the weights of the columns it packs
WEIGHT_CACHE_BYTES = 1 << 30


def _packer_unavailable(name: str) -> str | None:
    """None when this process can run the PackLWEs packer ``name``, else why not."""
    if name not in PACKERS:
        return f"unknown PackLWEs packer {name!r}; known: {list(PACKERS)}"
    return backend_unavailable_reason(name)


def default_packer() -> str:
    """The server's PackLWEs packer: ``"lattigo"`` when its library is built, else ``"seal"``."""
    return "lattigo" if _packer_unavailable("lattigo") is None else "seal"


# --------------------------------------------------------------------------- methods
@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    quant: str  # "fixed16" | "mixed433" | "uniform12"
    pack: int  # channels per plaintext coefficient (1 or 3)
    t_bits: int | None  # fixed plaintext modulus (Cheetah: 37) or None: max(13, field bits + 1)
    packlwe: bool
    block_ot: bool = False  # a query over k table blocks per token; the group chosen by OT (ours)
    query_blocks: int = 1  # block_ot: k, the blocks (query ciphertexts) one token's query covers


ABLATION = (
    Method("cheetah", "fixed16", 1, 37, False),
    Method("+quant", "mixed433", 1, 37, False),
    Method("+accbits", "mixed433", 1, None, False),
    Method("+packing", "mixed433", 3, None, False),
    Method("fastquery", "mixed433", 3, None, True),
    Method("+blockot", "mixed433", 3, None, True, block_ot=True),
)
METHODS = {m.name: m for m in ABLATION}
METHODS["exact"] = Method("exact", "uniform12", 1, None, True)
# the block-OT row at k query ciphertexts per token: k x the query bytes, 1/k of the server's leaves
for _k in (2, 4):
    METHODS[f"+blockot{_k}"] = Method(f"+blockot{_k}", "mixed433", 3, None, True, block_ot=True, query_blocks=_k)
ROW_TITLES = {
    "cheetah": "Baseline Cheetah",
    "+quant": "+Quant",
    "+accbits": "+Accumulation bit-width reduction",
    "+packing": "+Low bit-width aware element packing",
    "fastquery": "+PackLWEs (FastQuery)",
    "+blockot": "+1-ct query, block by OT (ours)",
    "+blockot2": "+2-ct query, block pair by OT (ours)",
    "+blockot4": "+4-ct query, 4 blocks by OT (ours)",
    "exact": "exact (12-bit, PackLWEs)",
}


# --------------------------------------------------------------------------- quantisation
@dataclasses.dataclass
class QTable:
    """q[v, c] * 2^exp[c] approximates table[v, c]; q in [-2^(b_c-1), 2^(b_c-1))."""

    q: np.ndarray  # int16 (V, d)
    bits: np.ndarray  # int (d,)
    exp: np.ndarray  # int (d,)

    absmean: np.ndarray | None = None  # per-channel mean |value| (for the channel order)

    def dequantize(self) -> np.ndarray:
        return self.q.astype(np.float64) * np.exp2(self.exp.astype(np.float64))[None, :]


def quantize(table: np.ndarray, quant: str, frac: int = 16) -> QTable:
    """Per-channel symmetric uniform quantiser with power-of-two scales (section 5.1).

    ``mixed433`` (section 4.3): the ceil(d/3) channels with the largest mean |value|
    get 4 bits, the others 3.  ``fixed16`` / ``uniform12``: 16 / 12 bits everywhere.
    Scale 2^e_c with e_c = ceil(log2(max_c / (2^(b-1) - 1/2))) (so the largest value
    rounds inside the range), at least 2^-frac (the fixed-point resolution).
    Error: |q 2^e - w| <= 2^(e-1) per entry."""
    w = np.asarray(table)
    if w.ndim != 2:
        raise ValueError(f"embedding table must be 2-D (V, d), got shape {w.shape}")
    if w.dtype.kind != "f":
        w = w.astype(np.float64)
    V, d = w.shape
    rows = max(1, (1 << 24) // max(1, d))  # work in row chunks (big tables)
    absmean = np.zeros(d, np.float64)
    mx = np.zeros(d, np.float64)
    for r in range(0, V, rows):
        blk = np.abs(w[r : r + rows].astype(np.float64))
        if not np.all(np.isfinite(blk)):
            raise ValueError("embedding table has non-finite values")
        absmean += blk.sum(axis=0)
        mx = np.maximum(mx, blk.max(axis=0))
    absmean /= V
    if quant == "mixed433":
        bits = np.full(d, 3, np.int64)
        order = np.argsort(-absmean, kind="stable")
        bits[order[: -(-d // 3)]] = 4
    elif quant == "fixed16":
        bits = np.full(d, 16, np.int64)
    elif quant == "uniform12":
        bits = np.full(d, 12, np.int64)
    else:
        raise ValueError(f"unknown quantisation {quant!r}")
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(mx / (2.0 ** (bits - 1) - 0.5)))
    e = np.where(np.isfinite(e), e, -frac).astype(np.int64)
    e = np.maximum(e, -frac)
    q = np.empty((V, d), np.int16)
    inv = np.exp2(-e.astype(np.float64))[None, :]
    lo, hi = -(2 ** (bits - 1))[None, :], (2 ** (bits - 1) - 1)[None, :]
    for r in range(0, V, rows):
        q[r : r + rows] = np.clip(np.rint(w[r : r + rows].astype(np.float64) * inv), lo, hi)
    qt = QTable(q, bits, e)
    qt.absmean = absmean
    return qt


def channel_bits(layout: "Layout", dim: int) -> np.ndarray:
    """Bit width of every channel, read from the (public) layout."""
    bits = np.zeros(dim, np.int64)
    for s in range(layout.chan.shape[1]):
        ch = layout.chan[:, s]
        ok = ch >= 0
        bits[ch[ok]] = layout.width[ok, s]
    return bits


def quantized_rows(rows: np.ndarray, st: "EmbeddingSetup") -> np.ndarray:
    """What `lookup` returns for these table rows (the quantised values, as floats)."""
    bits = channel_bits(st.layout, st.dim)
    e = st.exp.astype(np.float64)
    q = np.clip(np.rint(np.asarray(rows, np.float64) * np.exp2(-e)[None, :]),
                -(2.0 ** (bits - 1))[None, :], (2.0 ** (bits - 1) - 1)[None, :])
    return q * np.exp2(e)[None, :]


# --------------------------------------------------------------------------- packing layout
@dataclasses.dataclass
class Layout:
    """Channel -> (coefficient, field) map.  ``chan[j, s]``: channel in field s of
    coefficient j (-1: empty); ``width[j, s]``: its bit width; field s starts at
    bit ``off[j, s]`` and is followed by one spare (zero) bit."""

    chan: np.ndarray  # (n_coeff, slots) int64
    width: np.ndarray  # (n_coeff, slots) int64
    t_bits: int

    @property
    def n_coeff(self) -> int:
        return self.chan.shape[0]

    @property
    def off(self) -> np.ndarray:
        w1 = self.width + 1
        return np.concatenate([np.zeros((self.n_coeff, 1), np.int64), np.cumsum(w1, axis=1)[:, :-1]], axis=1)

    @property
    def end(self) -> np.ndarray:
        """Upper end of each field's region (the carry position): next field's offset, or t_bits."""
        e = self.off + self.width + 1
        e[:, -1] = self.t_bits
        return e

    @property
    def used_bits(self) -> int:
        """Bits of the largest packed value (top spare bit excluded)."""
        return int((self.off[:, -1] + self.width[:, -1]).max())

    @property
    def centre(self) -> int:
        """Plaintexts are sent as W - centre, so |W - centre| <= centre (noise)."""
        return 1 << (self.used_bits - 1)

    def pack(self, qt: QTable) -> np.ndarray:
        """Packed coefficients W (V, n_coeff) int64: sum_s (q + 2^(b-1)) 2^off."""
        V = qt.q.shape[0]
        W = np.zeros((V, self.n_coeff), np.int32)
        off = self.off
        for s in range(self.chan.shape[1]):
            c = self.chan[:, s]
            ok = c >= 0
            field = qt.q[:, c[ok]].astype(np.int32) + (1 << (self.width[ok, s] - 1)).astype(np.int32)[None, :]
            W[:, ok] += field << off[ok, s].astype(np.int32)[None, :]
        return W

    def to_msg(self) -> dict:
        return {"chan": self.chan, "width": self.width, "t_bits": np.array([self.t_bits])}

    @classmethod
    def from_msg(cls, m: dict) -> "Layout":
        return cls(np.asarray(m["chan"], np.int64), np.asarray(m["width"], np.int64), int(m["t_bits"][0]))


def make_layout(bits: np.ndarray, absmean: np.ndarray | None, method: Method) -> Layout:
    """Section 4.3: with 3 fields per coefficient, order the channels so each 13-bit
    coefficient holds one 4-bit channel (largest mean |value| first) and two 3-bit ones."""
    d = bits.shape[0]
    if method.pack == 1:
        chan = np.arange(d, dtype=np.int64)[:, None]
        width = bits.astype(np.int64)[:, None]
    else:
        four = np.nonzero(bits == 4)[0]
        three = np.nonzero(bits == 3)[0]
        if absmean is not None:
            four = four[np.argsort(-absmean[four], kind="stable")]
            three = three[np.argsort(-absmean[three], kind="stable")]
        n = -(-d // 3)
        if four.size != n or np.any((bits != 3) & (bits != 4)):
            raise ValueError("element packing expects the 4,3,3 mixed-precision table")
        chan = -np.ones((n, 3), np.int64)
        chan[:, 0] = four
        t3 = np.concatenate([three, -np.ones(2 * n - three.size, np.int64)])
        chan[:, 1] = t3[0::2]
        chan[:, 2] = t3[1::2]
        width = np.array([[4, 3, 3]] * n, np.int64)
    lay = Layout(chan, width, 0)
    need = int((lay.off[:, -1] + lay.width[:, -1]).max()) + 1
    lay.t_bits = method.t_bits if method.t_bits is not None else max(13, need)
    if lay.t_bits < need:
        raise ValueError(f"plaintext modulus 2^{lay.t_bits} too small for {need}-bit packed values")
    return lay


# --------------------------------------------------------------------------- matvec shape
def partition(vocab: int, n_cols: int, n: int, packlwe: bool, plan_fn) -> tuple[int, int]:
    """Cheetah's block shape (n_i rows x n_o columns per polynomial, n_i n_o <= N):
    PackLWEs rows use (N, 1); otherwise the shape with the fewest modelled bytes."""
    if packlwe:
        return n, 1
    best = None
    ni = n
    while ni >= 1:
        no = n // ni
        if no <= max(1, n_cols):
            b = plan_fn(ni, no)
            if b is not None and (best is None or b[0] < best[0]):
                best = (b[0], ni, no)
        ni //= 2
    if best is None:
        raise ValueError("no feasible Cheetah partition")
    return best[1], best[2]


@dataclasses.dataclass
class Shape:
    vocab: int
    n_cols: int
    n_i: int
    n_o: int

    @property
    def blocks(self) -> int:
        return -(-self.vocab // self.n_i)

    @property
    def col_blocks(self) -> int:
        return -(-self.n_cols // self.n_o)


def _plan(method: Method, layout: Layout, vocab: int, n: int, flood_bits: int, n_cols: int | None = None):
    n_cols = layout.n_coeff if n_cols is None else n_cols
    w_abs = layout.centre

    def for_shape(ni, no):
        sh = Shape(vocab, n_cols, ni, no)
        if method.packlwe:
            out_c0, outn = n, -(-n_cols // n)
        else:
            out_c0, outn = no, sh.col_blocks
        try:
            p = H.plan_params(n=n, t_bits=layout.t_bits, w_abs=w_abs, nnz=min(n, ni * no),
                              blocks=sh.blocks, packlwe=method.packlwe, flood_bits=flood_bits,
                              in_count=sh.blocks, out_count=outn, out_c0=out_c0)
        except ValueError:
            return None
        size = sh.blocks * n * p.logq + outn * (n * p.k1_bits + out_c0 * p.k0_bits)
        return size, p

    ni, no = partition(vocab, n_cols, n, method.packlwe, for_shape)
    found = for_shape(ni, no)
    if found is None:
        raise ValueError(f"no parameters at N = {n} for {method.name} with {flood_bits}-bit flooding")
    return Shape(vocab, n_cols, ni, no), found[1]


def _plan_any_n(method: Method, layout: Layout, vocab: int, n: int | None, flood_bits: int):
    """N = 4096 (the paper's) when feasible, else 8192, else 16384 (Cheetah's t = 2^37
    with 40-bit flooding needs more than the 109 bits N = 4096 allows; so does every
    method with the 2pc mode's FLOOD_SIGMA = 77-bit flooding: N = 8192, docs/embedding.md).

    ``block_ot`` rows plan the reshaped table (`_block_table`): k N rows (the position
    inside a group of k blocks) by ceil(B / k) groups x the packed columns, B = ceil(V / N)."""

    def one(n):
        if method.block_ot:
            k = method.query_blocks
            groups = -(-vocab // (k * n))
            return _plan(method, layout, k * n, n, flood_bits, n_cols=groups * layout.n_coeff)
        return _plan(method, layout, vocab, n, flood_bits)

    if n is not None:
        return one(n)
    for cand in (4096, 8192):
        try:
            return one(cand)
        except ValueError:
            pass
    return one(16384)


def _block_table(W: np.ndarray, n: int, k: int = 1) -> np.ndarray:
    """(V, c) -> (k N, G c), G = ceil(V / (k N)) groups of k blocks: row r, column g c + j
    holds W[g k N + r, j] (zero past V), so the product with a one-hot over the k N
    positions of a group gives that position's row in every group at once (`lookup` with
    ``block_ot``; k = 1: a block's N positions, every block)."""
    V, c = W.shape
    G = -(-V // (k * n))
    out = np.zeros((G * k * n, c), W.dtype)
    out[:V] = W
    return np.ascontiguousarray(out.reshape(G, k * n, c).transpose(1, 0, 2).reshape(k * n, G * c))


# --------------------------------------------------------------------------- setup
@dataclasses.dataclass
class EmbeddingSetup:
    """One party's state after `setup` (public parameters; the client also its keys,
    the server its packed table)."""

    method: Method
    layout: Layout
    exp: np.ndarray  # per-channel scale exponents (public)
    shape: Shape
    plan: H.HEPlan
    rns: H.RNS
    dim: int
    frac: int
    vocab: int = 0  # the table's rows (``shape.vocab`` is N for block_ot rows)
    sel_blocks: int = 1  # block_ot: G = ceil(V / (k N)), the groups of k blocks the 1-of-G OT chooses from
    # client
    s: np.ndarray | None = None
    s_hat: np.ndarray | None = None
    # server
    W: np.ndarray | None = None  # centred packed plaintexts (V, n_coeff) int64
    pk: tuple | None = None  # (pk0, pk1) residues (k, N)
    hectx: object = None
    galois: object = None
    weights: object = None  # the Lattigo packer's prepared table (`_prepare_weights`), or None
    flood_counter: object = None  # the session's flooded-coefficient counter (`he_session.flood_counter`)
    setup_bytes: int = 0
    packer: str = ""  # PackLWEs rows: the packer the server announced (`PACKERS`); "" for the others


def _check_ids(ids, vocab):
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"ids must be a 1-D array of token ids, got shape {ids.shape}")
    if ids.size == 0:
        raise ValueError("ids is empty")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"ids must be integers, got dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"token id out of range [0, {vocab}): min {ids.min()}, max {ids.max()}")
    return ids.astype(np.int64)


def _he_context(plan: H.HEPlan, rns: H.RNS):
    """An HE backend's BFV context whose data level is exactly our primes (for PackLWEs)."""
    from ..he.params import HEParams

    p = HEParams(f"fastquery-{plan.n}-{plan.logq}", "bfv", plan.n, tuple(plan.in_bits) + (plan.special_bits,),
                 plain_modulus=1 << plan.t_bits)
    ctx = get_backend().context(p)
    if tuple(ctx.coeff_moduli) != rns.primes:
        raise MPCError("the HE backend chose other primes than the plan's")
    return ctx


def _lattigo_context(plan: H.HEPlan, rns: H.RNS):
    """A Lattigo context whose data primes are exactly ours and whose key-switching prime is
    the plan's special prime (the ``"lattigo"`` packer)."""
    _primes_q, special = _primes(plan)
    if special is None:
        raise MPCError("PackLWEs needs the plan's special prime")
    return get_backend("lattigo").pack_context(plan.n, rns.primes, [special])


def _primes(plan: H.HEPlan) -> tuple[tuple[int, ...], int | None]:
    primes, special = H.primes_for(list(plan.in_bits), plan.n, with_special=plan.special_bits)
    return tuple(primes), special


def setup(ctx, table=None, *, vocab_size: int, dim: int, method: str = "fastquery", frac: int | None = None,
          flood_bits: int = FLOOD_SIGMA, n: int | None = None, packer: str | None = None,
          weight_cache_bytes: int | None = None) -> EmbeddingSetup:
    """Per-session setup (not counted as online): the server quantises and packs the
    table and sends the public quantisation metadata; the client creates its keys
    and sends its public key (for re-randomisation) and, for PackLWEs, Galois keys.

    ``packer`` (PackLWEs rows): the server's PackLWEs implementation, one of `PACKERS`
    (default `default_packer`); the server announces it with the metadata and the client
    follows (its own ``packer``, if given, must agree) or refuses with `MPCError` one it
    cannot run.  ``"lattigo"``: the client's numpy ternary secret imported into Lattigo
    makes Galois keys in Lattigo's seeded layout; ``"seal"``: SEAL's keys, its secret read back.

    ``weight_cache_bytes`` (server, Lattigo packer): the most memory its table's prepared
    weight polynomials may take (default `WEIGHT_CACHE_BYTES`; 0: none, each lookup transforms
    the weights it packs).

    ``flood_bits``: the flooding's statistical security per coefficient; the default is
    the 2pc mode's `he_session.FLOOD_SIGMA` (40 + log2 of the flooded coefficients a
    session may send, so the whole session stays within 2^-40; the server counts the
    coefficients it floods against the same per-session bound)."""
    if method not in METHODS:
        raise ValueError(f"unknown embedding method {method!r}; known: {sorted(METHODS)}")
    m = METHODS[method]
    frac = ctx.ring.frac if frac is None else int(frac)
    if not (0 < vocab_size and 0 < dim):
        raise ValueError("vocab_size and dim must be positive")
    if flood_bits < 0 or flood_bits > 120:
        raise ValueError("flood_bits must be in 0..120")
    before = ctx.chan.totals()
    with ctx.step("embedding.setup"):
        if ctx.party == 1:
            if table is None:
                raise ValueError("the server (party 1) must pass the table")
            table = np.asarray(table)
            if table.shape != (vocab_size, dim):
                raise ValueError(f"table has shape {table.shape}, expected (vocab_size, dim) = {(vocab_size, dim)}")
            qt = quantize(table, m.quant, frac)
            lay = make_layout(qt.bits, qt.absmean, m)
            msg = dict(lay.to_msg(), exp=qt.exp.astype(np.int64), method=np.frombuffer(m.name.encode(), np.uint8),
                       flood=np.array([flood_bits]))
            if m.packlwe:
                packer = default_packer() if packer is None else packer
                why = _packer_unavailable(packer)
                if why is not None:
                    raise ValueError(f"PackLWEs packer {packer!r} cannot run here: {why}")
                msg["packer"] = np.frombuffer(packer.encode(), np.uint8)
            ctx.send(msg)
            W = lay.pack(qt)
            W -= np.int32(lay.centre)
            exp = qt.exp
            del qt
        else:
            if table is not None:
                raise ValueError("the client (party 0) must not pass a table")
            msg = ctx.recv()
            lay = Layout.from_msg(msg)
            exp = np.asarray(msg["exp"], np.int64)
            if bytes(np.asarray(msg["method"], np.uint8)).decode() != m.name or int(msg["flood"][0]) != flood_bits:
                raise MPCError("client and server disagree on the embedding method / flooding")
            if exp.shape != (dim,) or lay.chan.max() >= dim:
                raise MPCError("server's quantisation metadata does not match dim")
            if m.packlwe:
                try:
                    announced = bytes(np.asarray(msg["packer"], np.uint8)).decode()
                except (KeyError, ValueError, TypeError):
                    raise MPCError("the server did not announce a valid PackLWEs packer") from None
                why = _packer_unavailable(announced)
                if why is not None:
                    raise MPCError(f"the server packs with {announced!r}, which this client cannot run: {why}")
                if packer is not None and packer != announced:
                    raise MPCError(f"the server packs with {announced!r}, the client asked for {packer!r}")
                packer = announced
            W = None
        shape, plan = _plan_any_n(m, lay, vocab_size, n, flood_bits)
        primes, _special = _primes(plan)
        n = plan.n
        rns = H.RNS(primes, n)
        sel = -(-vocab_size // (m.query_blocks * n)) if m.block_ot else 1
        if W is not None and m.block_ot:
            W = _block_table(W, n, m.query_blocks)
        st = EmbeddingSetup(m, lay, exp, shape, plan, rns, dim, frac, vocab=vocab_size, sel_blocks=sel, W=W)
        if m.packlwe:
            st.packer = packer
        seed = b""
        if ctx.party == 0:
            rng = H.new_rng()
            if m.packlwe and st.packer == "lattigo":
                be = get_backend("lattigo")
                st.s = H.sample_ternary(rng, n)
                keys = be.secret_keys_from_ternary(_lattigo_context(plan, rns), st.s)
                gk_bytes = keys.galois_keys_bytes_for_elements(be.pack_lwes_elements(n))
            elif m.packlwe:
                hectx = _he_context(plan, rns)
                keys = get_backend().keygen(hectx)
                st.s = _secret_from_keys(hectx, keys, rns, plan)
                gk_bytes = keys.galois_keys_bytes_for_elements(get_backend().pack_lwes_elements(n))
            else:
                st.s = H.sample_ternary(rng, n)
                gk_bytes = b""
            st.s_hat = H.fft_fwd(st.s)
            seed = secrets.token_bytes(32)
            a = H.expand_uniform(seed, b"pk", rns, 1)[0]
            pk0 = rns.add(rns.neg(H.conv_small(a, st.s_hat, rns.q)), rns.from_signed(H.sample_error(rng, n)))
            ctx.send({"pk_seed": np.frombuffer(seed, np.uint8),
                      "pk0": np.frombuffer(H.pack_bits(pk0, rns.bits), np.uint8),
                      "galois": np.frombuffer(gk_bytes, np.uint8)})
        else:
            msg = ctx.recv()
            seed = bytes(np.asarray(msg["pk_seed"], np.uint8))
            pk0 = H.unpack_bits(bytes(np.asarray(msg["pk0"], np.uint8)), rns.bits, (), n)
            pk1 = H.expand_uniform(seed, b"pk", rns, 1)[0]
            st.pk = (pk0, pk1)
            st.flood_counter = flood_counter(ctx)
            gk_bytes = bytes(np.asarray(msg["galois"], np.uint8))
            if m.packlwe and st.packer == "lattigo":
                be = get_backend("lattigo")
                els = be.pack_lwes_elements(n)
                st.hectx = _lattigo_context(plan, rns)
                st.galois = be.galois_keys_from_bytes(st.hectx, gk_bytes, max_keys=len(els))
                if not st.galois.has_elements(els):
                    raise MPCError("the client's Galois keys lack some of the PackLWEs automorphisms")
                st.weights = _prepare_weights(st, WEIGHT_CACHE_BYTES if weight_cache_bytes is None
                                              else int(weight_cache_bytes))
            elif m.packlwe:
                st.hectx = _he_context(plan, rns)
                st.galois = get_backend().galois_keys_from_bytes(st.hectx, gk_bytes)
        if st.sel_blocks > 1:
            ctx.ot.setup(kk13=True)  # base OTs (IKNP and the selection's KK13): set-up, not online
        else:
            ctx.ot  # noqa: B018 (create the OT session; its base OTs run on first use)
    after = ctx.chan.totals()
    st.setup_bytes = (after["bytes_sent"] + after["bytes_received"]) - (before["bytes_sent"] + before["bytes_received"])
    return st


def _prepare_weights(st: EmbeddingSetup, budget: int):
    """The Lattigo packer's table prepared once (`LattigoPackWeights`: every column's weight
    polynomials reduced and transformed, as `push_products` would per lookup), or None when it
    would exceed ``budget`` bytes or a weight is beyond int16."""
    sh, n = st.shape, st.plan.n
    lat = get_backend("lattigo")
    if lat.pack_weights_nbytes(n, st.rns.k, sh.n_cols, sh.blocks) > budget:
        return None
    if st.W.size and int(np.abs(st.W).max()) >= 1 << 15:
        return None
    try:
        pw = lat.pack_weights(st.galois, sh.n_cols, sh.blocks)
    except ValueError:  # HEError: primes beyond 32 bits or its int64 dot products; per lookup then
        return None
    step = max(1, (1 << 26) // (8 * sh.blocks * n))  # ~64 MiB of int64 weight polynomials per call
    for c0 in range(0, sh.n_cols, step):
        pw.add(_weight_polys(st.W, sh, n, np.arange(c0, min(sh.n_cols, c0 + step))).transpose(1, 0, 2))
    return pw


def _secret_from_keys(hectx, keys, rns: H.RNS, plan: H.HEPlan) -> np.ndarray:
    """The client's own ternary secret key as int64 coefficients: the backend decrypts the
    crafted ciphertext (0, round(Q/t)) to s mod t (raw decryption)."""
    be = get_backend()
    t = 1 << plan.t_bits
    delta = rns.Q // t
    arr = np.zeros((2, rns.k, plan.n), np.uint64)
    arr[1, :, 0] = rns.from_int(delta)
    ct = be.numpy_to_ciphertext(hectx, arr, ntt=False)
    raw = be.plaintext_to_numpy(keys.decrypt(ct)).astype(np.int64)
    s = np.zeros(plan.n, np.int64)
    s[: raw.size] = raw
    s = np.where(s > t // 2, s - t, s)
    if np.any(np.abs(s) > 1):
        raise MPCError("could not read the ternary secret key back from the HE backend")
    return s


# --------------------------------------------------------------------------- online: client
def _encrypt_queries(st: EmbeddingSetup, ids: np.ndarray, rng) -> tuple[bytes, bytes]:
    """One-hot queries, block r = sum_a x[r n_i + a] X^a; symmetric BFV, uniform half
    from a fresh public seed.  Returns (seed, packed c0)."""
    rns, sh, n = st.rns, st.shape, st.plan.n
    T, B = ids.size, sh.blocks
    seed = secrets.token_bytes(32)
    c1 = H.expand_uniform(seed, b"query", rns, T * B).reshape(T, B, rns.k, n)
    e = H.sample_error(rng, (T, B, n))
    body = rns.from_signed(e)  # (T, B, k, N)
    delta = rns.from_int(round(rns.Q / (1 << st.plan.t_bits)))
    blk, pos = ids // sh.n_i, ids % sh.n_i
    tt = np.arange(T)
    body[tt, blk, :, pos] = (body[tt, blk, :, pos] + delta[None, :]) % rns.q[None, :]
    c0 = rns.sub_(body, H.conv_small(c1, st.s_hat, rns.q))
    return seed, H.pack_bits(c0, rns.bits)


def _response_parts(st: EmbeddingSetup, msg: dict, lead: tuple, m0: int) -> tuple[np.ndarray, np.ndarray]:
    """(c0 mod 2^k0 (lead + (m0,)), c1 * s mod 2^k1 (lead + (N,))) from the response."""
    plan, n = st.plan, st.plan.n
    c0 = H.unpack_bits(bytes(np.asarray(msg["c0"], np.uint8)), [plan.k0_bits], lead, m0)[..., 0, :]
    c1 = H.unpack_bits(bytes(np.asarray(msg["c1"], np.uint8)), [plan.k1_bits], lead, n)[..., 0, :]
    if np.any(c0 >> np.uint64(plan.k0_bits)) or np.any(c1 >> np.uint64(plan.k1_bits)):
        raise MPCError("response coefficient out of range")
    return c0, H.conv_pow2(c1, st.s_hat, plan.k1_bits)


def _packed_positions(total: int, n: int) -> list[tuple[int, int, int]]:
    """(group, count, stride): PackLWEs group g holds its count values at multiples of stride."""
    out = []
    for g in range(-(-total // n)):
        cnt = min(n, total - g * n)
        out.append((g, cnt, n >> max(0, (cnt - 1).bit_length())))
    return out


def _slot_items(T: int, n_cols: int, n: int) -> list[tuple[int, int, int, np.ndarray]]:
    """Where each (token, column) value lands in the PackLWEs output.  Items are numbered
    column-major, item = col * T + tok (so consecutive leaves share a column and the
    server computes each column's weight transform once for all tokens); group g takes
    items g N .. g N + cnt - 1 and gives its k-th item the k-th valid slot in the tree's
    (bit-reversed) consumption order.  Returns (g, cnt, stride, slots) per group, slots
    (cnt,) in item order; the value sits at coefficient slots[k] * stride."""
    bitrev = get_backend().pack_lwes_order
    out = []
    for g, cnt, stride in _packed_positions(T * n_cols, n):
        br = np.array(bitrev(cnt), np.int64)
        out.append((g, cnt, stride, br[br < cnt]))
    return out


def _gather_items(vals: np.ndarray, T: int, n_cols: int, n: int) -> np.ndarray:
    """(G, N) packed coefficients -> (T, n_cols) per (token, column) (see `_slot_items`)."""
    flat = np.concatenate([vals[g, slots * stride] for g, _cnt, stride, slots in _slot_items(T, n_cols, n)])
    return flat.reshape(n_cols, T).T.copy()


def _decrypt(st: EmbeddingSetup, msg: dict, T: int) -> np.ndarray:
    """u = W - S mod t per (token, packed column)."""
    plan, n, sh = st.plan, st.plan.n, st.shape
    if st.method.packlwe:
        groups = _packed_positions(T * sh.n_cols, n)
        c0, c1s = _response_parts(st, msg, (len(groups),), n)
        vals = H.decode_pow2(c0, c1s, plan.k0_bits, plan.k1_bits, plan.t_bits)  # (G, N)
        return _gather_items(vals, T, sh.n_cols, n)
    C = sh.col_blocks
    c0, c1s = _response_parts(st, msg, (T, C), sh.n_o)
    pos = np.arange(sh.n_o) * sh.n_i + sh.n_i - 1
    vals = H.decode_pow2(c0, c1s[..., pos], plan.k0_bits, plan.k1_bits, plan.t_bits).reshape(T, C * sh.n_o)
    return vals[:, : sh.n_cols]


# --------------------------------------------------------------------------- online: server
def _limb_plan(blocks: int, nnz: int, w_abs: int, abits: int = 31) -> tuple[int, int]:
    """(input limb bits, weight limbs) keeping every FFT product sum below 2^46."""
    room = H.FFT_SAFE_BITS - 1 - math.ceil(math.log2(blocks * nnz))
    wb = math.ceil(math.log2(w_abs)) + 1
    if room - wb >= 8:
        return min(abits, room - wb), 1
    return 8, 2


def _weight_polys(W: np.ndarray, sh: Shape, n: int, cblocks: np.ndarray) -> np.ndarray:
    """Weight polynomials for the given column blocks: (B, len(cblocks), N) int64."""
    V = W.shape[0]
    B = sh.blocks
    cc = len(cblocks)
    idx = (np.asarray(cblocks, np.int64)[:, None] * sh.n_o + np.arange(sh.n_o)[None, :]).reshape(-1)
    ok = idx < sh.n_cols
    cols = np.zeros((B * sh.n_i, cc * sh.n_o), np.int64)
    cols[:V, ok] = W[:, idx[ok]]  # int32 -> int64
    blk = cols.reshape(B, sh.n_i, cc, sh.n_o)[:, ::-1]  # a -> n_i - 1 - a
    poly = blk.transpose(0, 2, 3, 1).reshape(B, cc, sh.n_o * sh.n_i)
    if poly.shape[-1] < n:
        poly = np.concatenate([poly, np.zeros((B, cc, n - poly.shape[-1]), np.int64)], axis=-1)
    return poly


@dataclasses.dataclass
class _QuerySpectra:
    """What `_products` needs of one query, whatever the columns: computed once per
    response (PackLWEs rows ask for the products a chunk of columns at a time)."""
    comps: list[int]  # ciphertext parts multiplied as polynomials
    c0_limbs: np.ndarray | None  # PackLWEs rows: 16-bit limbs of c0 over the vocabulary, (2 T k, V) float64
    la: int  # input limb bits
    nw: int  # weight limbs
    n_limbs: int
    A_hat: np.ndarray  # FFT of the input limbs, (N/2, P, B)


def _query_spectra(st: EmbeddingSetup, ct: np.ndarray) -> _QuerySpectra:
    rns, sh, n = st.rns, st.shape, st.plan.n
    T, B = ct.shape[:2]
    comps, c0_limbs = [0, 1], None
    if st.method.packlwe:
        comps, c0_limbs = [1], _c0_limbs(st, ct)
    la, nw = _limb_plan(B, min(n, sh.n_i * sh.n_o), st.layout.centre)
    a_limbs = H.split_limbs(ct[:, :, comps], 31, la)  # each (T, B, m, k, N)
    A = np.stack(a_limbs, axis=0)  # (L, T, B, m, k, N)
    A = A.transpose(2, 0, 1, 3, 4, 5).reshape(B, len(a_limbs) * T * len(comps) * rns.k, n)
    A_hat = H.fft_fwd(A).transpose(2, 1, 0).copy()  # (N/2, P, B)
    return _QuerySpectra(comps, c0_limbs, la, nw, len(a_limbs), A_hat)


def _c0_limbs(st: EmbeddingSetup, ct: np.ndarray) -> np.ndarray:
    """PackLWEs rows: the query's c0 parts over the vocabulary as 16-bit limbs, (2 T k, V) float64
    (`_c0_dots`)."""
    rns, sh, n = st.rns, st.shape, st.plan.n
    T, B = ct.shape[:2]
    c0 = ct[:, :, 0].transpose(0, 2, 1, 3).reshape(T, rns.k, B * n)[..., : sh.vocab]
    limbs = np.stack([(c0 & np.uint64(0xFFFF)), (c0 >> np.uint64(16))], axis=0).astype(np.float64)
    return limbs.reshape(2 * T * rns.k, -1)


def _c0_dots(st: EmbeddingSetup, c0_limbs: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """PackLWEs rows (n_i = N, n_o = 1): coefficient N-1 of the products' c0 parts, the dot
    products c0 . W[:, c] over the vocabulary for the columns ``cols``, exact: (T, k, C) uint64
    residues (the trace removes the other coefficients)."""
    rns, sh = st.rns, st.shape
    T, C = c0_limbs.shape[0] // (2 * rns.k), len(cols)
    Wsel = st.W[:, cols]  # n_o = 1: column block = column
    # float64 BLAS with 16-bit limbs: |limb W| sums < 2^16 2^16 2^14 = 2^46 per chunk: exact
    acc = np.zeros((2, T, rns.k, C), np.int64)
    q64 = rns.q.astype(np.int64)[None, None, :, None]
    rows = 1 << max(0, min(14, 46 - 16 - max(1, st.layout.centre.bit_length())))
    for r0 in range(0, sh.vocab, rows):
        part = c0_limbs[:, r0 : r0 + rows] @ Wsel[r0 : r0 + rows].astype(np.float64)
        acc = np.mod(acc + np.mod(np.rint(part).astype(np.int64).reshape(2, T, rns.k, C), q64), q64)
    qk = rns.q[None, :, None]
    sh16 = (np.uint64(1 << 16) % rns.q)[None, :, None]
    return (acc[0].astype(np.uint64) + (acc[1].astype(np.uint64) * sh16) % qk) % qk


def _products(st: EmbeddingSetup, ct: np.ndarray, cblocks=None, spectra: _QuerySpectra | None = None,
              chunk_bytes: int = 1 << 27) -> np.ndarray:
    """sum_r ct_r * w_{r,c} for the column blocks c in ``cblocks`` (default all):
    ct (T, B, 2, k, N) -> (T, len(cblocks), 2, k, N).
    Exact float-FFT products (limb split) accumulated over the blocks in the frequency domain.
    PackLWEs rows (n_i = N, n_o = 1) only use coefficient N-1 of the c0 part (the trace
    removes the others), which is the plain dot product c0 . W[:, c] over the vocabulary:
    computed exactly in int64 and put there; the other c0 coefficients are left zero.
    ``spectra``: `_query_spectra(st, ct)`, when the caller asks for several column sets."""
    rns, sh, n = st.rns, st.shape, st.plan.n
    T, B = ct.shape[:2]
    sp = _query_spectra(st, ct) if spectra is None else spectra
    cblocks = np.arange(sh.col_blocks) if cblocks is None else np.asarray(cblocks, np.int64)
    C = len(cblocks)
    out = np.zeros((T, 2, rns.k, C, n), np.uint64)
    comps, la, nw, L, m, A_hat = sp.comps, sp.la, sp.nw, sp.n_limbs, len(sp.comps), sp.A_hat
    if st.method.packlwe:
        out[:, 0, :, :, n - 1] = _c0_dots(st, sp.c0_limbs, cblocks)
    P = A_hat.shape[1]
    per_col = B * n * 8 * nw + P * n * 24
    cc = max(1, min(C, chunk_bytes // per_col))
    wl = 14
    qq = rns.q[:, None, None]
    for c0_ in range(0, C, cc):
        c1_ = min(C, c0_ + cc)
        wp = _weight_polys(st.W, sh, n, cblocks[c0_:c1_])  # (B, cc, N)
        wparts = [wp] if nw == 1 else [wp & ((1 << wl) - 1), wp >> wl]
        acc = np.zeros((T, m, rns.k, c1_ - c0_, n), np.uint64)
        for wi, part in enumerate(wparts):
            W_hat = H.fft_fwd(part).transpose(2, 0, 1)  # (N/2, B, cc)
            R = np.matmul(A_hat, W_hat)  # (N/2, P, cc)
            r = H.fft_inv(R.transpose(1, 2, 0)).reshape(L, T, m, rns.k, c1_ - c0_, n)
            for li in range(L):
                shift = la * li + wl * wi
                mult = np.array([pow(2, shift, q) for q in rns.primes], np.uint64)[:, None, None]
                v = np.mod(r[li], qq.astype(np.int64)).astype(np.uint64)  # (T, m, k, cc, N)
                acc += (v * mult) % qq
                acc %= qq
        out[:, comps, :, c0_:c1_] = acc
    return out.transpose(0, 3, 1, 2, 4)


def _rerandomise(st: EmbeddingSetup, ct: np.ndarray, rng) -> np.ndarray:
    """ct (..., 2, k, N) + a fresh public-key encryption of zero (pk0 u + e1, pk1 u + e2)."""
    rns, n = st.rns, st.plan.n
    lead = ct.shape[:-3]
    M = int(np.prod(lead)) if lead else 1
    u = H.sample_ternary(rng, (M, n))
    u_hat = H.fft_fwd(u)[:, None, :]  # (M, 1, N/2)
    pk0, pk1 = st.pk
    z0 = H.conv_small(np.broadcast_to(pk0, (M, rns.k, n)), u_hat, rns.q)
    z1 = H.conv_small(np.broadcast_to(pk1, (M, rns.k, n)), u_hat, rns.q)
    z0 = rns.add(z0, rns.from_signed(H.sample_error(rng, (M, n))))
    z1 = rns.add(z1, rns.from_signed(H.sample_error(rng, (M, n))))
    z = np.stack([z0, z1], axis=1).reshape(lead + (2, rns.k, n))
    return (ct + z) % rns.q[:, None]


def _mask_and_flood(st: EmbeddingSetup, out: H.RNS, c0: np.ndarray, S: np.ndarray, rng) -> np.ndarray:
    """c0 (..., k', M) + round(q' (centre - S) / t) + uniform flooding in [-F, F]."""
    t_bits = st.plan.t_bits
    qp = out.Q
    v = (st.layout.centre - S.astype(object)) % (1 << t_bits)
    enc = (v * qp + (1 << (t_bits - 1))) >> t_bits  # round(q' v / t)
    res = np.empty(S.shape[:-1] + (out.k, S.shape[-1]), np.uint64)
    for i, p in enumerate(out.primes):
        res[..., i, :] = np.array((enc % p).reshape(-1).tolist(), dtype=np.uint64).reshape(S.shape)
    c0 = out.add(c0, res)
    F = st.plan.flood
    if F > 0:
        counter = getattr(st, "flood_counter", None)
        if counter is not None:  # the server's per-session bound (he_session.MAX_FLOODED_PER_SESSION)
            counter.add(S.size)
    if 0 < F < 1 << 62:
        fl = rng.integers(-F, F + 1, size=S.shape, dtype=np.int64)
        c0 = out.add(c0, out.from_signed(fl))
    elif F > 0:
        # uniform on [-F', F') with F' = M 2^(l-1) >= F: u = top 2^l + low, top uniform on
        # [0, M), M = ceil((2F + 1) / 2^l) < 2^62, low on [0, 2^l) from <= 32-bit limbs
        # (F' - F < 2^(l-1) <= F 2^-61: the plan's correctness margin covers it)
        if max(out.primes) >= 1 << 31:
            raise MPCError("wide flooding expects primes below 2^31")
        lbits = (2 * F + 1).bit_length() - 62
        M = -(-(2 * F + 1) >> lbits)
        if M >= 1 << 62:
            raise MPCError("flooding bound too large")
        top = rng.integers(0, M, size=S.shape, dtype=np.int64).astype(np.uint64)
        limbs, left = [], lbits
        while left > 0:
            w = min(32, left)
            limbs.append((rng.integers(0, 1 << w, size=S.shape, dtype=np.int64).astype(np.uint64), w))
            left -= w
        Fp = M << (lbits - 1)
        for i, p in enumerate(out.primes):
            q = np.uint64(p)
            v = top % q
            for limb, w in limbs:  # Horner, most significant limb first; products < 2^62
                v = (v * np.uint64((1 << w) % p) + limb % q) % q
            v = (v + np.uint64((-Fp) % p)) % q
            c0[..., i, :] = (c0[..., i, :] + v) % q
    return c0


def _pack_all(st: EmbeddingSetup, ct: np.ndarray, T: int, chunk: int = 256, overlap: bool = True) -> np.ndarray:
    """PackLWEs rows: the T * n_cols product ciphertexts, made chunk by chunk in the order the
    PackLWEs tree consumes them (so memory stays at one chunk plus log2 N partial results; items
    column-major, `_slot_items`), packed into ceil(T n_cols / N) ciphertexts (G, 2, k, N) by the
    setup's packer (``st.packer``).  The Go packer makes the leaves itself from the query and
    each chunk's weight polynomials (`LattigoPackLWEs.push_products`: the c1 parts as NTT-domain
    products, one weight transform per column; the c0 constants as exact dot products) and packs
    them; ``overlap``: a worker thread runs one chunk (the GIL released) while numpy gathers the
    next one's weights.  With the table prepared at set-up (``st.weights``, `_prepare_weights`)
    Go reads the columns' transforms from it (`LattigoPackLWEs.push_cached`): nothing to gather.  With SEAL the
    leaves are made here (`_products`, exact float FFTs) and packed a ciphertext per tree node."""
    rns, sh, n = st.rns, st.shape, st.plan.n
    ninv = pow(n, -1, rns.Q)
    groups = _packed_positions(T * sh.n_cols, n)
    packed = np.empty((len(groups), 2, rns.k, n), np.uint64)
    if st.packer == "lattigo" and st.weights is None:
        # a chunk's weights modulo each prime and their transforms (2 x C columns x B blocks x
        # k primes x N words) stay near 64 MiB
        while chunk > 16 and 2 * (chunk // T + 2) * sh.blocks * rns.k * n * 8 > 1 << 26:
            chunk //= 2
    for g, cnt, _stride in groups:
        br = np.array(get_backend().pack_lwes_order(cnt), np.int64)

        def slots():
            """Per chunk of slots: (present (m,), token and column-index of each present leaf,
            the chunk's distinct columns)."""
            k = g * n  # next item (column-major: item = col * T + tok)
            for p0 in range(0, br.size, chunk):
                valid = br[p0 : p0 + chunk] < cnt
                items = k + np.arange(int(valid.sum()))
                k += items.size
                cols, toks = np.divmod(items, T)
                ucols, cidx = np.unique(cols, return_inverse=True)
                yield valid, toks, cidx, ucols

        if st.packer == "lattigo":
            packer = get_backend("lattigo").pack_lwes_packer(st.galois, cnt)
            packer.set_query(ct)

            def chunks():
                for valid, toks, cidx, ucols in slots():
                    tok, col = np.zeros(valid.size, np.int64), np.zeros(valid.size, np.int64)
                    if st.weights is not None:  # the prepared table: columns of the whole table
                        if toks.size:
                            tok[valid], col[valid] = toks, ucols[cidx]
                        yield packer.push_cached, (st.weights, tok, col, valid)
                        continue
                    w = np.zeros((1, sh.blocks, n), np.int64)
                    if toks.size:
                        tok[valid], col[valid] = toks, cidx
                        w = _weight_polys(st.W, sh, n, ucols).transpose(1, 0, 2)
                    yield packer.push_products, (w, tok, col, valid)

            if overlap and st.weights is None:
                with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="packlwes") as pool:
                    pending = None
                    for push, args in chunks():
                        if pending is not None:
                            pending.result()
                        pending = pool.submit(push, *args)
                    if pending is not None:
                        pending.result()
            else:
                for push, args in chunks():
                    push(*args)
            packed[g] = packer.finish()
        else:
            be = get_backend()
            spectra = _query_spectra(st, ct)
            # move coefficient N-1 to 0 (times -X) and scale by N^-1 mod Q in one product:
            # np.roll, then coefficient 0 times N^-1 and the others times -N^-1
            shift_scale = np.empty((rns.k, n), np.uint64)
            shift_scale[:, 0] = rns.from_int(ninv)
            shift_scale[:, 1:] = rns.from_int(-ninv)[:, None]

            def leaves():
                for valid, toks, cidx, ucols in slots():
                    leaf = np.zeros((valid.size, 2, rns.k, n), np.uint64)
                    if toks.size:
                        leaf[valid] = _products(st, ct, ucols, spectra)[toks, cidx]  # (T, C, 2, k, N)
                    x = (np.roll(leaf, 1, axis=-1) * shift_scale) % rns.q[:, None]  # residues < 2^31: no overflow
                    for i in range(valid.size):
                        yield be.numpy_to_ciphertext(st.hectx, x[i], ntt=False) if valid[i] else None

            packed[g] = be.ciphertext_to_numpy(be.pack_lwes_stream(st.hectx, st.galois, cnt, leaves()))
    return packed


def _server_respond(st: EmbeddingSetup, msg: dict, rng) -> tuple[dict, np.ndarray]:
    rns, sh, plan, n = st.rns, st.shape, st.plan, st.plan.n
    T = int(np.asarray(msg["n"]).reshape(-1)[0])
    if T <= 0 or T > 1 << 20:
        raise MPCError(f"bad number of tokens {T}")
    B = sh.blocks
    seed = bytes(np.asarray(msg["seed"], np.uint8))
    if len(seed) != 32:
        raise MPCError("query seed must be 32 bytes")
    c0 = H.unpack_bits(bytes(np.asarray(msg["c0"], np.uint8)), rns.bits, (T, B), n)
    if np.any(c0 >= rns.q[:, None]):
        raise MPCError("query coefficient not reduced modulo its prime")
    c1 = H.expand_uniform(seed, b"query", rns, T * B).reshape(T, B, rns.k, n)
    ct = np.stack([c0, c1], axis=2)  # (T, B, 2, k, N)
    out = rns.sub(plan.out_k)
    t = 1 << plan.t_bits
    if st.method.packlwe:
        packed = _pack_all(st, ct, T)
        G = packed.shape[0]
        packed = _rerandomise(st, packed, rng)
        sw = rns.switch_to(packed.reshape(G * 2, rns.k, n), plan.out_k).reshape(G, 2, out.k, n)
        S = rng.integers(0, t, size=(G, n), dtype=np.int64)
        c0 = _mask_and_flood(st, out, sw[:, 0], S, rng)
        # server's share per (token, column): S at the packed positions
        return _response(plan, out, c0, sw[:, 1]), _gather_items(S, T, sh.n_cols, n)
    C = sh.col_blocks
    prod = _rerandomise(st, _products(st, ct), rng)  # (T, C, 2, k, N)
    sw = rns.switch_to(prod.reshape(T * C * 2, rns.k, n), plan.out_k).reshape(T, C, 2, out.k, n)
    pos = np.arange(sh.n_o) * sh.n_i + sh.n_i - 1
    S = rng.integers(0, t, size=(T, C, sh.n_o), dtype=np.int64)
    c0 = _mask_and_flood(st, out, sw[:, :, 0][..., pos], S, rng)
    return _response(plan, out, c0, sw[:, :, 1]), S.reshape(T, C * sh.n_o)[:, : sh.n_cols]


def _response(plan: H.HEPlan, out: H.RNS, c0: np.ndarray, c1: np.ndarray) -> dict:
    """After flooding: switch c0 to 2^k0 and c1 to 2^k1 (only what decoding needs) and pack."""
    r0 = out.to_pow2(c0, plan.k0_bits)[..., None, :]
    r1 = out.to_pow2(c1, plan.k1_bits)[..., None, :]
    return {"c0": np.frombuffer(H.pack_bits(r0, [plan.k0_bits]), np.uint8),
            "c1": np.frombuffer(H.pack_bits(r1, [plan.k1_bits]), np.uint8)}


# --------------------------------------------------------------------------- extension
def _extend(ctx, st: EmbeddingSetup, share: np.ndarray) -> np.ndarray:
    """Shares (u, S) mod t of the packed coefficients -> uint64 fixed-point shares of
    every channel (T, dim).  Field s of W: w_s = (u mod 2^e >> o) + (S mod 2^e >> o)
    + c_{s-1} - 2^(e-o) c_s with c_s = msb_{e-1}(u) OR msb_{e-1}(S) (the spare bit
    of W is zero; SiRNN's extension with known MSB); a AND b from one correlated OT
    (client = sender with correlation a, server chooses with b)."""
    lay = st.layout
    T = share.shape[0]
    x = share.astype(np.uint64)  # (T, n_coeff)
    off, end, width = lay.off, lay.end, lay.width
    slots = lay.chan.shape[1]
    msb = np.stack([(x >> (end[:, s] - 1).astype(np.uint64)[None, :]) & np.uint64(1) for s in range(slots)], -1)
    with ctx.step("embedding.extend"):
        if ctx.party == 0:
            r = np.asarray(ctx.ot.send_cot(msb.reshape(-1), 64), np.uint64).reshape(msb.shape)
            prod = np.uint64(0) - r
        else:
            prod = np.asarray(ctx.ot.recv_cot(msb.reshape(-1).astype(bool), 64), np.uint64).reshape(msb.shape)
    carry = msb - prod  # share of c_s = a + b - ab (each party its own bit)
    out = np.zeros((T, st.dim), np.uint64)
    prev = np.zeros((T, lay.n_coeff), np.uint64)
    for s in range(slots):
        o = off[:, s].astype(np.uint64)[None, :]
        e = end[:, s].astype(np.uint64)[None, :]
        local = (x & ((np.uint64(1) << e) - np.uint64(1))) >> o
        w = local + prev - (carry[..., s] << (e - o))
        prev = carry[..., s]
        ch = lay.chan[:, s]
        ok = ch >= 0
        if ctx.party == 0:  # remove the field offset 2^(b-1)
            w = w - (np.uint64(1) << (width[:, s].astype(np.uint64) - np.uint64(1)))[None, :]
        sc = (st.exp[ch[ok]] + st.frac).astype(np.uint64)
        out[:, ch[ok]] = w[:, ok] << sc[None, :]
    return out


# --------------------------------------------------------------------------- online
def _uniform_mod_pow2(key: bytes, count: int, bits: int) -> np.ndarray:
    """``count`` uniform values mod 2^bits from AES-CTR keyed by the 16-byte ``key``."""
    from .. import _core

    raw = np.frombuffer(bytes(_core.aes_prg(key, 8 * count)), dtype="<u8")
    return raw & np.uint64((1 << bits) - 1)


def _select_block(ctx, st: EmbeddingSetup, share: np.ndarray, blk: np.ndarray | None) -> np.ndarray:
    """``block_ot`` rows: shares of the packed row in every block (with k query blocks: in
    every group of k blocks, "block" below) -> shares of the row in the client's block,
    which stays hidden from the server.

    After the response, the client holds u_b = W_b[a] - S_b (mod t) for every block b
    (``share`` (T, B c)) and the server the masks S_b.  The server draws a fresh
    uniform R (its new share) and offers m_b = S_b - R for b = 0 .. B-1 by a 1-out-of-B
    OT of 128-bit keys (KK13, `OTSession.send_1ofN`, two 64-bit words per key) and the
    strings m_b + AES-CTR(k_b) mod t; the client learns k_blk only and takes
    u_blk + m_blk = W[id] - R.  Client's view: u_b (uniform through S_b), m_blk
    (uniform through R) and one-time-padded strings; server's view: the OT
    receiver's messages only.  Wire: B c t_bits bits + 2 KK13 OTs per token."""
    T, B = share.shape[0], st.sel_blocks
    c, tb = st.layout.n_coeff, st.plan.t_bits
    mask = np.uint64((1 << tb) - 1)
    with ctx.step("embedding.select"):
        if ctx.party == 0:
            keys = ctx.ot.recv_1ofN(np.repeat(blk, 2), B, 64).reshape(T, 2)
            data = bytes(np.asarray(ctx.recv().get("m", np.zeros(0, np.uint8)), np.uint8))
            try:
                enc = H.unpack_bits(data, [tb], (T, B), c)[..., 0, :]
            except ValueError as e:
                raise MPCError(f"block selection message: {e}") from None
            pad = np.stack([_uniform_mod_pow2(keys[j].astype("<u8").tobytes(), c, tb) for j in range(T)])
            u = share.reshape(T, B, c)[np.arange(T), blk].astype(np.uint64)
            return (u + enc[np.arange(T), blk] - pad) & mask
        keys = np.frombuffer(secrets.token_bytes(16 * T * B), dtype="<u8").reshape(T, B, 2)
        ctx.ot.send_1ofN(keys.transpose(0, 2, 1).reshape(2 * T, B), 64)
        R = _uniform_mod_pow2(secrets.token_bytes(16), T * c, tb).reshape(T, c)
        S = share.reshape(T, B, c).astype(np.uint64)
        pads = np.stack([np.stack([_uniform_mod_pow2(keys[j, b].tobytes(), c, tb) for b in range(B)])
                         for j in range(T)])
        enc = (S - R[:, None, :] + pads) & mask
        ctx.send({"m": np.frombuffer(H.pack_bits(enc[..., None, :], [tb]), np.uint8)})
        return R


def lookup(ctx, st: EmbeddingSetup, ids=None, *, n_ids: int | None = None) -> AShare:
    """Online phase: 64-bit fixed-point AShare (len(ids), dim) of the quantised table[ids]."""
    rng = H.new_rng()
    n = st.plan.n
    blk = None
    if ctx.party == 0:
        if ids is None:
            raise ValueError("the client (party 0) must pass ids")
        ids = _check_ids(ids, st.vocab or st.shape.vocab)
        T = ids.size
        if st.method.block_ot:  # query the position inside the group of k blocks; the group goes by OT
            group = st.method.query_blocks * n
            blk, ids = ids // group, ids % group
        with ctx.step("embedding.query"):
            seed, c0 = _encrypt_queries(st, ids, rng)
            ctx.send({"n": np.array([T], np.int64), "seed": np.frombuffer(seed, np.uint8),
                      "c0": np.frombuffer(c0, np.uint8)})
        with ctx.step("embedding.response"):
            msg = ctx.recv()
        share = _decrypt(st, msg, T)
    else:
        if ids is not None:
            raise ValueError("the server (party 1) must not pass ids")
        with ctx.step("embedding.query"):
            msg = ctx.recv()
        T = int(np.asarray(msg.get("n", [0])).reshape(-1)[0])
        if n_ids is not None and n_ids != T:
            raise MPCError(f"client sent {T} ids, expected {n_ids}")
        resp, share = _server_respond(st, msg, rng)
        with ctx.step("embedding.response"):
            ctx.send(resp)
    if st.sel_blocks > 1:
        share = _select_block(ctx, st, share, blk)
    data = _extend(ctx, st, share)
    return AShare(ctx, data, 64, st.frac)


def embedding_lookup(ctx, ids: np.ndarray | None, table: np.ndarray | None, *, vocab_size: int, dim: int,
                     method: str = "fastquery", frac: int | None = None, flood_bits: int = FLOOD_SIGMA,
                     n_ids: int | None = None, packer: str | None = None) -> AShare:
    """Private lookup of table[ids] (FastQuery, section 4; or ``method="cheetah"`` /
    ``"exact"`` and the intermediate ablation rows, see `METHODS`).

    Party 0 passes ``ids`` (1-D ints) and ``table=None``; party 1 passes the float
    table (vocab_size, dim) and ``ids=None`` (the number of ids travels with the
    query; ``n_ids`` lets the server check it).  Returns a 64-bit AShare
    (len(ids), dim) with ``frac`` fraction bits (default ``ctx.ring.frac``) of
    the *quantised* table rows (`quantize`: error <= half a quantisation step
    per entry).  ``flood_bits``: statistical circuit privacy per coefficient (default
    `he_session.FLOOD_SIGMA`, 2^-40 per session; 0 disables flooding).  ``packer``: `setup`'s."""
    st = setup(ctx, table, vocab_size=vocab_size, dim=dim, method=method, frac=frac, flood_bits=flood_bits,
               packer=packer)
    return lookup(ctx, st, ids, n_ids=n_ids)
