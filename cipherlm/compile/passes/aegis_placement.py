"""AEGIS's compile pass (AEGIS section 4.4.2, Figure 9) over the fhe-annotated model graph:
dependency groups (4.1), placement on W workers (4.1-4.3), the collectives section 4.4
inserts, the reordering that overlaps them (4.4.1, Figure 8b), and their bytes by the
formulas of section 3.1 / Table 2.  The output is a deterministic `Plan`; nothing is
executed (the distributed executor on Ray is later work, issue 18 item 2).

Figure 9's three stages, on this project's pieces: stage 1 (application-level token and
head dependencies) is the model graph (`cipherlm.compile.ir`) with the token-group packing
of the fhe executor; stage 2 (HE-operator level: levels, bootstraps, collective insertion,
reordering) is `passes.fhe_levels`'s annotations plus this pass; stage 3 is the `Plan`.

**Packing** (section 3.1).  The fhe executor packs a (T, d) activation channel-major in
token groups (`cipherlm.protocols.ckks.packing.TokenPacking`, restated here because the
compile layer does not import protocols): tp = next_pow2(2T) positions per channel, cpc =
S/tp channels per ciphertext.  In the paper's terms a ciphertext gives s_tok slots to one
token and packs S/s_tok tokens, so s_tok = cpc, S/s_tok = tp and a d-wide value is
c_tok(d) = ceil(d / cpc) ciphertexts (`Packing`).  (packing.py's docstring pairs the names
the other way round, s_tok = tp, c_tok = cpc; with that pairing K_send below would count
about T ciphertexts, so the paper's definitions are followed here.)  tp >= 2T means all T
tokens are in every ciphertext: one token group, K_send(T) = c_tok(d).  A plan with more
token groups (a packing the executor does not have) is refused.

**Table 2** (`ct_bytes`, `k_send`, `p2p_bytes`, `allreduce_bytes`, `allgather_bytes`):
K_send(T) = ceil(T / (S/s_tok)) * c_tok ciphertexts at level l; P2P(T, l) = K_send(T) *
ct(l); AllReduce(T, l) = (G-1) P2P(T, l) and AllGather(T, l) = (G-1) P2P(T/G, l), per
device.  The paper writes ct(l) = 2 * l * 2N * 8 bytes, but its own example ("~40MB
ciphertexts at l=35", N = 2^16) is half of that (2 * 35 * 2^17 * 8 = 73 MB): the "2N"
counts the ring's coefficients in slots (2S = N).  We read ct(l) = 2 polynomials x (l+1)
primes x N coefficients x 8 bytes: a level-l ciphertext has the l+1 primes q_0..q_l
(Lattigo's convention, docs/he_backend.md: level = primes - 1), 37.7 MB at l = 35 and
10.5 MB at the top level 9 of N16QP1546H192H32.  A ReduceScatter (named in 4.3) costs
what an AllGather costs; AllReduce is Table 2's (each device sends its whole partial to
each other device), for the AEGIS norms and the tensor-parallel baseline alike.

Each collective here is a list of sends (source worker, destination worker, ciphertexts)
at one level: ``bytes`` is their sum, the volume crossing between workers, and
``per_device_bytes`` the most any one worker sends, which is Table 2's per-device figure
when the split is even (with uneven splits, that of the busiest worker).

**Dependency groups** (4.1).  Modulus-coherent: a ciphertext with all its RNS limbs and
every key-switching chain that runs on it (the BSGS rotations of a projection, the
rotate-and-sum of a norm, the head windows of Q.K^T) is one group and lives on one
worker: limbs are never split (unlike limb parallelism, 3.2.2), so key switching needs no
communication.  Token-coherent: the blocks that an embedding-wise or token-wise reduction
joins.  The placement unit is therefore a channel block (one ciphertext of one value), and
each op class maps as follows:

=================  ===============================================================
embed (and the     the client's (it embeds, sums and encrypts, section 2.4, and
sums of embeds)    uploads each block to its owner): no bytes between workers
linear             output-stationary (4.2): an output block with its BSGS
                   diagonals is a modulus-coherent group on the block's owner;
                   its input blocks are token-coherent (embedding-wise
                   aggregation), so a split input needs either an AllGather of
                   the input (4.2) or a ReduceScatter of partial outputs (4.2's
                   "AllReduce-like" slot-wise accumulation, 4.3), whichever moves
                   fewer bytes (ties: the gather).  Linears reading one value
                   (q, k, v; gate, up) decide together: one gather serves all.
layer_norm,        token-wise aggregation over all channels (4.1): each worker
rms_norm           sums its blocks (and their squares) locally, then an
                   AllReduce of one ciphertext per sum among the workers holding
                   blocks (4.4 rule 3); the scalar chain variance -> rsqrt (one
                   ciphertext per token group) runs on each of them; each block
                   is normalised by its owner
rope, kv_cache,    head-local: the executor keeps whole heads in one ciphertext
qk, softmax, av    (hd divides cpc, `attention.py` refuses anything else), so the
                   head-wise sums of Q.K^T, softmax's row maxima and sums and P.V
                   stay inside modulus-coherent groups: no collective.  (The
                   paper's 4.3 splits a token's q/k/v across devices and reduces
                   partial scores; with whole heads per ciphertext that case does
                   not arise.)  Grouped K/V heads are expanded to H heads as the
                   executor does at load time, so head h's q, k, v and scores
                   share a block index and an owner.
activation, mul,   slot-wise, on the block's owner
add, sub, clip,
head, rope
split, concat      layout: a linear read only by a split lays its output out part
                   by part, so the split is local; any block that has to change
                   owner moves by P2P ("relayout")
argmax             the client's
MoE ops, BLB's     not placed: listed in ``unsupported`` (the fhe executor has no
decomposed cores   MoE layer either)
=================  ===============================================================

**Placement** (4.1: modulus first, token second).  The blocks of a value of width d are
split contiguously over the workers, the first ``c_tok(d) mod W`` workers taking one
more: complete groups are assigned and never split (4.1: "complete groups are assigned
first"), contiguity keeps a head's blocks and a token's neighbouring channels together,
and one rule per width makes residual additions and the norms' elementwise work local.
With fewer blocks than workers some workers hold none of that value.

**Collective insertion** (4.4).  Communication is inserted only where a reduction joins
blocks of different workers (above).  The three rules:

1. *Send before bootstrapping.*  A ciphertext that goes to one worker (a ReduceScatter's
   partials, a P2P) is sent before the bootstrap the level pass places on it and
   bootstrapped once by its receiver; a norm's sum of x (no product) is sent before the
   norm's input is bootstrapped.  A *gathered* ciphertext is needed by every worker:
   sending it before its bootstrap would make W workers bootstrap it, so a gather of a
   value the level pass bootstraps before the linear follows the owner's bootstrap
   (flagged ``after_bootstrap`` with that reason), unless the reduce form is cheaper.
   The paper is silent on this case; not repeating bootstraps (each about 18 s on CPU,
   docs/he_backend.md) is worth far more than the bytes saved.
2. *Rescale before send.*  Partial outputs are sent after the product's rescale (at the
   linear's output level), a norm's sum of squares after the square's rescale, a
   gathered input at the level the linear reads it (modulus switching is free).
3. *Local reduction before send.*  A worker sends one partial per output block (its
   input blocks' products summed first) and one ciphertext per norm sum (its blocks
   added and rotated-and-summed first).

The norms' scalar chain is the one place work is repeated on purpose: it is sequential
on one ciphertext, so splitting cannot shorten it, and computing it on every holder saves
broadcasting its result.

**Reordering** (4.4.1, Figure 8b).  Each collective names the compute it overlaps: a
gather overlaps the linear's products on the worker's own input blocks, then each
received share in ring order (4.2: "after G rounds of overlapped computation and
communication"); a ReduceScatter computes the partials of the other workers' output
blocks first, staggered (worker w starts with worker w+1's, the paper's "GPU1 computes
the second half while GPU2 computes the first"), sends each as soon as it is rescaled,
and computes its own blocks while they travel; a norm's sum of x travels while the
squares are formed, its sum of squares while s1^2 and the centred blocks are.  The plan
records the order of issue per block (``order``); how much is actually hidden needs the
executor's timings (later work).

**Tensor-parallel baseline** (3.2.3, 5.1.1, Megatron-LM): inputs replicated,
column-parallel q/k/v and up/gate, row-parallel o and down, one AllReduce of the full
d-wide output after each row-parallel linear, at its output level; norms, residuals and
their bootstraps replicated on every worker (no bytes, W times the work).  Same formulas.

**Not modelled**: a packing with several token groups (token-parallel placement and the
attention's sequence-wise collective), the limb-parallel and Hydra baselines, MoE
layers, the executor, measured bytes and timings (issue 18 items 2-4).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from ..ir import Graph, Node
from . import fhe_levels

#: N16QP1546H192H32: 2^15 slots, ring degree 2^16 (docs/he_backend.md)
DEFAULT_SLOTS = 1 << 15
DEFAULT_N = 1 << 16

_CLIENT_OPS = {"embed"}
_LOCAL_OPS = {"activation", "mul", "add", "sub", "clip", "head", "rope", "affine"}
_HEAD_OPS = {"kv_cache", "qk", "softmax", "av"}


# ----------------------------------------------------------------------------- Table 2


def ct_bytes(level: int, n: int = DEFAULT_N) -> int:
    """Bytes of a ciphertext at `level`: 2 polynomials x (level + 1) primes x n coefficients x 8."""
    if level < 0:
        raise ValueError(f"level {level} < 0")
    return 2 * (int(level) + 1) * int(n) * 8


def k_send(tokens: int, d: int, slots: int, s_tok: int) -> int:
    """Table 2's K_send(T) = ceil(T / (S / s_tok)) * ceil(d / s_tok): the ciphertexts of T tokens."""
    per_ct = slots // s_tok
    if per_ct < 1:
        raise ValueError(f"s_tok {s_tok} > {slots} slots")
    return -(-int(tokens) // per_ct) * -(-int(d) // s_tok)


def p2p_bytes(k: int, level: int, n: int = DEFAULT_N) -> int:
    """P2P(T, l) = K_send(T) * ct(l), with k = K_send(T)."""
    return int(k) * ct_bytes(level, n)


def allreduce_bytes(k: int, level: int, workers: int, n: int = DEFAULT_N) -> int:
    """AllReduce(T, l) = (G - 1) P2P(T, l), per device."""
    return (int(workers) - 1) * p2p_bytes(k, level, n)


def allgather_bytes(k_share: int, level: int, workers: int, n: int = DEFAULT_N) -> int:
    """AllGather(T, l) = (G - 1) P2P(T / G, l), per device; k_share = K_send(T / G). (A
    ReduceScatter costs the same.)"""
    return (int(workers) - 1) * p2p_bytes(k_share, level, n)


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclass(frozen=True)
class Packing:
    """Section 3.1's layout: ``tokens_per_ct`` = S / s_tok tokens per ciphertext, s_tok slots
    (channels) of a token per ciphertext."""

    slots: int
    tokens: int
    tokens_per_ct: int

    @classmethod
    def fhe_executor(cls, slots: int, tokens: int) -> "Packing":
        """The fhe executor's `TokenPacking` at offset 0: tp = next_pow2(2T) positions per channel."""
        if tokens < 1:
            raise ValueError("at least one token")
        if slots < 2 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, got {slots}")
        tp = next_pow2(2 * tokens)
        if tp > slots:
            raise ValueError(f"{tokens} tokens need {tp} positions per channel: more than the {slots} slots "
                             f"of a ciphertext")
        return cls(slots, tokens, tp)

    @property
    def s_tok(self) -> int:
        return self.slots // self.tokens_per_ct

    @property
    def token_groups(self) -> int:
        return -(-self.tokens // self.tokens_per_ct)

    def c_tok(self, d: int) -> int:
        return -(-int(d) // self.s_tok)

    def k_send(self, d: int) -> int:
        return k_send(self.tokens, d, self.slots, self.s_tok)


def split_owners(c: int, workers: int) -> tuple[int, ...]:
    """Owner of each of `c` blocks: contiguous ranges, the first c mod W workers one more."""
    q, r = divmod(int(c), int(workers))
    out: list[int] = []
    for w in range(workers):
        out += [w] * (q + (1 if w < r else 0))
    return tuple(out)


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Layout:
    """A value's blocks: its width (channels) and the worker owning each block."""

    width: int
    owners: tuple[int, ...]

    @property
    def workers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.owners)))


@dataclass
class Collective:
    id: int
    block: str
    kind: str                 # P2P | AllGather | ReduceScatter | AllReduce
    form: str                 # gather | reduce | norm-sum | relayout
    node: str                 # the node it serves (several: "L0.q,L0.k,L0.v")
    value: str                # what travels
    level: int
    cts: int                  # ciphertexts sent, all workers together
    ct_bytes: int
    bytes: int                # cts * ct_bytes: the volume between workers
    per_device_bytes: int     # the most one worker sends (Table 2's per-device figure)
    sends: list               # [(source, destination, ciphertexts)]
    formula: str
    rules: dict
    overlap: str
    alternative: dict | None = None   # the other form of a linear: {form, kind, level, cts, bytes}


@dataclass
class BlockPlan:
    block: str
    layer: int | None
    nodes: list = field(default_factory=list)        # [{node, op, group, workers, collective}]
    collectives: list = field(default_factory=list)  # [Collective]
    order: list = field(default_factory=list)        # [(global seq, node / collective / bootstrap, name)]
    bootstraps: list = field(default_factory=list)   # [{value, before, stage, level, by, cts_per_worker, tp_...}]
    bytes: int = 0
    sent_per_worker: list = field(default_factory=list)
    tp_collectives: list = field(default_factory=list)
    tp_bytes: int = 0
    tp_sent_per_worker: list = field(default_factory=list)

    @property
    def per_device_bytes(self) -> int:
        return max(self.sent_per_worker, default=0)

    @property
    def tp_per_device_bytes(self) -> int:
        return max(self.tp_sent_per_worker, default=0)


@dataclass
class Plan:
    workers: int
    tokens: int
    slots: int
    n: int
    levels: int
    packing: dict
    placement: dict                      # width -> {cts, owners, ranges}
    heads: dict                          # {heads, head_dim, per_ct, owners}
    blocks: list                         # [BlockPlan]
    unsupported: list

    def collectives(self) -> list[Collective]:
        return [c for b in self.blocks for c in b.collectives]

    def layer_blocks(self) -> list[BlockPlan]:
        return [b for b in self.blocks if b.layer is not None]

    @property
    def bytes(self) -> int:
        return sum(b.bytes for b in self.blocks)

    @property
    def layer_bytes(self) -> int:
        return sum(b.bytes for b in self.layer_blocks())

    @property
    def tp_bytes(self) -> int:
        return sum(b.tp_bytes for b in self.blocks)

    def to_dict(self) -> dict:
        d = asdict(self)
        for b, bd in zip(self.blocks, d["blocks"]):
            bd["per_device_bytes"] = b.per_device_bytes
            bd["tp_per_device_bytes"] = b.tp_per_device_bytes
        d.update(bytes=self.bytes, layer_bytes=self.layer_bytes, tp_bytes=self.tp_bytes)
        return d


# ----------------------------------------------------------------------------- the pass


def _block_name(node: Node, seen_layer: bool) -> str:
    if node.layer is not None:
        return f"layer {node.layer}"
    return "head" if seen_layer else "embed"


def _kv_widths(graph: Graph) -> dict[str, int]:
    """Values on the K and V paths of attention, with the width they have once grouped K/V
    heads are expanded to the query heads (the executor expands K and V at load time)."""
    prod = graph.producers()
    out: dict[str, int] = {}
    for nd in graph.nodes:
        if nd.op not in ("qk", "av"):
            continue
        v, width = nd.inputs[1], int(nd.attrs["heads"]) * int(nd.attrs["head_dim"])
        while v in prod and v not in out:
            out[v] = width
            p = prod[v]
            if p.op == "kv_cache":
                v = p.inputs[p.outputs.index(v)]
            elif p.op in ("rope", "clip", "rms_norm", "layer_norm"):
                v = p.inputs[0]
            else:
                break
    return out


def _tp_split(graph: Graph) -> set[str]:
    """The values a Megatron placement splits over the workers: the outputs of the column-
    parallel linears and everything computed from them up to the row-parallel ones (o, down,
    followed by their AllReduce); the rest (the residual stream, the norms) is replicated."""
    split: set[str] = set()
    for nd in graph.nodes:
        if nd.op == "linear":
            row = nd.layer is not None and nd.name in (f"L{nd.layer}.o", f"L{nd.layer}.ffn.down")
            if not row:
                split.update(nd.outputs)
        elif nd.op not in ("add", "layer_norm", "rms_norm", "embed") and any(v in split for v in nd.inputs):
            split.update(nd.outputs)
    return split


def _kind(sends: Counter, form: str) -> str:
    if len({s for s, _ in sends}) == 1 or len({d for _, d in sends}) == 1:
        return "P2P"   # one sender (a fan-out) or one receiver (a fan-in)
    return {"gather": "AllGather", "reduce": "ReduceScatter", "norm-sum": "AllReduce"}.get(form, "P2P")


def _mb(b: float) -> str:
    return f"{b / 1e6:.1f} MB"


class _Planner:
    def __init__(self, graph: Graph, workers: int, pk: Packing, n: int):
        self.g, self.W, self.pk, self.n = graph, workers, pk, n
        self.layout: dict[str, Layout] = {}
        self.client: set[str] = set(graph.inputs)
        self.replicas: dict[str, tuple[frozenset, int]] = {}  # value -> (workers holding every block, level)
        self.kv = _kv_widths(graph)
        self.consumers = graph.consumers()
        self.points: dict[str, list[dict]] = {}
        for bt in graph.meta["fhe_levels"]["bootstrap_points"]:
            self.points.setdefault(bt["before"], []).append(bt)
        self.blocks: dict[str, BlockPlan] = {}
        self.unsupported: list[str] = []
        self.next_id = 1
        self.widths: dict[int, tuple[int, ...]] = {}
        self.steps: list = []
        self.tp_split = _tp_split(graph)

    # -- layouts

    def canonical(self, width: int) -> Layout:
        owners = split_owners(self.pk.c_tok(width), self.W)
        self.widths.setdefault(int(width), owners)
        return Layout(int(width), owners)

    def width_of(self, node: Node, value: str) -> int:
        if value in self.kv:
            return self.kv[value]
        return int(node.shape[-1])

    def out_layout(self, node: Node) -> Layout:
        """A linear read only by a split lays its output out part by part."""
        v = node.out
        cons = self.consumers.get(v, [])
        if node.op == "linear" and len(cons) == 1 and cons[0].op == "split" and "sizes" in cons[0].attrs:
            heads = int(cons[0].attrs.get("heads", 1))
            owners: tuple[int, ...] = ()
            for size in cons[0].attrs["sizes"]:
                owners += self.canonical(int(size) * heads).owners
            return Layout(int(node.attrs["d_out"]), owners)
        return self.canonical(self.width_of(node, v))

    # -- bookkeeping

    def step(self, bp: BlockPlan, kind: str, name) -> None:
        """One step of the order of issue; the sequence number is global over the blocks."""
        bp.order.append((len(self.steps), kind, name))
        self.steps.append((kind, name))

    def block(self, node: Node, seen_layer: bool) -> BlockPlan:
        name = _block_name(node, seen_layer)
        if name not in self.blocks:
            self.blocks[name] = BlockPlan(name, node.layer)
        return self.blocks[name]

    def collective(self, bp: BlockPlan, form: str, node: str, value: str, level: int, sends: Counter,
                   rules: dict, overlap: str, alternative: dict | None = None, kind: str | None = None) -> Collective:
        cb = ct_bytes(level, self.n)
        per_src = Counter()
        for (s, _), k in sends.items():
            per_src[s] += k
        cts = sum(sends.values())
        kind = kind or _kind(sends, form)
        most = max(per_src.values(), default=0)
        if kind != "P2P" and self.W > 1 and most % (self.W - 1) == 0:
            share = "P2P(T)" if kind == "AllReduce" else "P2P(T/W)"
            formula = f"{kind}: (W-1) x {share} = {self.W - 1} x {most // (self.W - 1)} ct x {_mb(cb)} per device"
        else:
            formula = f"{kind}: {cts} ct x {_mb(cb)}, the busiest worker sends {most}"
        c = Collective(self.next_id, bp.block, kind, form, node, value, int(level), cts, cb, cts * cb,
                       most * cb, sorted((s, d, k) for (s, d), k in sends.items()),
                       formula, rules, overlap, alternative)
        self.next_id += 1
        bp.collectives.append(c)
        self.step(bp, "collective", c.id)
        return c

    def relayout(self, bp: BlockPlan, node: Node, value: str, src: Layout, dst: Layout, level: int) -> int | None:
        """P2P moves so that `dst`'s owners hold the blocks of `src` they need (the same block
        index for equal widths; every block for a broadcast operand)."""
        sends = Counter()
        for b, w in enumerate(dst.owners):
            need = [b] if src.width == dst.width and b < len(src.owners) else range(len(src.owners))
            for j in need:
                if src.owners[j] != w:
                    sends[(src.owners[j], w)] += 1
        if not sends:
            return None
        return self.collective(bp, "relayout", node.name, value, level, sends,
                               {"rescaled": True, "local_reduction": None, "bootstrap": None},
                               f"{node.name}: its work on the blocks already local").id

    # -- ops

    def run(self) -> None:
        seen_layer = False
        for nd in self.g.nodes:
            seen_layer = seen_layer or nd.layer is not None
            bp = self.block(nd, seen_layer)
            entry = {"node": nd.name, "op": nd.op, "group": "", "workers": [], "collective": None}
            client = nd.op in _CLIENT_OPS or nd.op == "argmax"
            if client or (nd.op == "add" and all(v in self.client for v in nd.inputs)):
                self.client.update(nd.outputs)
                if nd.op != "argmax":
                    for v in nd.outputs:
                        self.layout[v] = self.canonical(self.width_of(nd, v))
                entry["group"] = "client"
                bp.nodes.append(entry)
                continue
            pre = [bt for bt in self.points.get(nd.name, []) if bt["stage"] == "input"]
            inner = [bt for bt in self.points.get(nd.name, []) if bt["stage"] != "input"]
            if nd.op in ("layer_norm", "rms_norm"):
                self.norm(bp, nd, pre, inner, entry)
            else:
                for bt in pre:
                    self.bootstrap(bp, nd, bt)
                if nd.op == "linear":
                    self.linear(bp, nd, entry)
                elif nd.op in _LOCAL_OPS or nd.op in _HEAD_OPS:
                    self.local(bp, nd, entry)
                elif nd.op in ("split", "concat"):
                    self.layout_op(bp, nd, entry)
                else:
                    self.unsupported.append(f"{nd.name} ({nd.op})")
                    for v in nd.outputs:
                        if len(nd.shape) == 2 and isinstance(nd.shape[-1], int):
                            self.layout[v] = self.canonical(nd.shape[-1])
                    entry["group"] = "not placed (unsupported)"
                    self.step(bp, "node", nd.name)
                for bt in inner:
                    self.bootstrap(bp, nd, bt)
            bp.nodes.append(entry)

    def bootstrap(self, bp: BlockPlan, nd: Node, bt: dict) -> None:
        """A bootstrap point of the level pass: who runs it and how many blocks each worker
        bootstraps, here and under the tensor-parallel baseline (replicated values on every
        worker)."""
        per, tp = [0] * self.W, [0] * self.W

        def add(value: str | None, lay: Layout | None) -> None:
            if lay is None:
                return
            if value is not None and value not in self.tp_split:   # replicated under tensor parallelism
                for w in range(self.W):
                    tp[w] += len(lay.owners)
            for w in lay.owners:
                per[w] += 1
                if value is None or value in self.tp_split:
                    tp[w] += 1

        if bt["stage"] == "input":
            by = "owners"
            add(bt["value"], self.layout.get(bt["value"]))
            self.replicas.pop(bt["value"], None)
        elif nd.op in ("layer_norm", "rms_norm"):
            lay = self.layout[nd.inputs[0]]
            by = "every holder (the variance chain, one ciphertext per token group)"
            for w in lay.workers:
                per[w] += self.pk.token_groups
            for w in range(self.W):
                tp[w] += self.pk.token_groups
            if bt["stage"] == "norm.scale":
                by += " and the owners (their centred blocks)"
                add(nd.inputs[0], lay)
        else:
            by = "owners"
            add(nd.inputs[0], self.layout.get(nd.inputs[0]))
        bp.bootstraps.append({"value": bt["value"], "before": nd.name, "stage": bt["stage"], "level": bt["level"],
                              "by": by, "cts_per_worker": per, "tp_cts_per_worker": tp})
        self.step(bp, "bootstrap", f"{bt['value']}@{nd.name}")

    def local(self, bp: BlockPlan, nd: Node, entry: dict) -> None:
        lvl = nd.attrs["fhe"]["level_in"]
        if nd.op in ("qk", "softmax", "av", "kv_cache", "rope"):
            first = self.layout[nd.inputs[0]]
            for v in nd.inputs[1:]:
                if self.layout[v] != first:
                    entry["collective"] = self.relayout(bp, nd, v, self.layout[v], first, lvl)
            if nd.op == "kv_cache":
                for v_in, v_out in zip(nd.inputs, nd.outputs):
                    self.layout[v_out] = self.layout[v_in]
            elif nd.op == "av":
                self.layout[nd.out] = self.canonical(self.width_of(nd, nd.out))
            else:
                self.layout[nd.out] = first
            entry["group"] = "head-local (whole heads per ciphertext)"
            entry["workers"] = list(first.workers)
        else:
            out = self.canonical(self.width_of(nd, nd.out))
            for v in nd.inputs:
                if v in self.layout and self.layout[v] != out:
                    entry["collective"] = self.relayout(bp, nd, v, self.layout[v], out, lvl)
            self.layout[nd.out] = out
            entry["group"] = "slot-wise (on each block's owner)"
            entry["workers"] = list(out.workers)
        self.step(bp, "node", nd.name)

    def layout_op(self, bp: BlockPlan, nd: Node, entry: dict) -> None:
        """split / concat: blocks keep their owner where the layouts agree (a linear read only by
        a split is laid out part by part, `out_layout`); other blocks move by P2P."""
        lvl = nd.attrs["fhe"]["level_in"]
        heads = int(nd.attrs.get("heads", 1))
        s = self.pk.s_tok
        if nd.op == "split":
            src = self.layout[nd.inputs[0]]
            parts = [(v, int(size) * heads) for v, size in zip(nd.outputs, nd.attrs["sizes"])]
            segmented = len(src.owners) == sum(self.pk.c_tok(w) for _, w in parts)
            off_b = off_c = 0
            for v, width in parts:
                want = self.canonical(width)
                if segmented:
                    got = src.owners[off_b:off_b + len(want.owners)]
                else:   # the block holding each part block's first channel
                    got = tuple(src.owners[min((off_c + j * s) // s, len(src.owners) - 1)]
                                for j in range(len(want.owners)))
                off_b += len(want.owners)
                off_c += width
                if got != want.owners:
                    entry["collective"] = self.relayout(bp, nd, v, Layout(width, got), want, lvl)
                self.layout[v] = want
        else:
            out = self.canonical(self.width_of(nd, nd.out))
            sends = Counter()
            off = 0
            for v in nd.inputs:
                lay = self.layout[v]
                for j, u in enumerate(lay.owners):   # input block j: output channels off + j s ...
                    lo, hi = off + j * s, off + min((j + 1) * s, lay.width)
                    for b in range(lo // s, (hi - 1) // s + 1):
                        if out.owners[b] != u:
                            sends[(u, out.owners[b])] += 1
                off += lay.width
            if sends:
                entry["collective"] = self.collective(
                    bp, "relayout", nd.name, nd.out, lvl, sends,
                    {"rescaled": True, "local_reduction": None, "bootstrap": None},
                    f"{nd.name}: its work on the blocks already local").id
            self.layout[nd.out] = out
        entry["group"] = "layout"
        self.step(bp, "node", nd.name)

    def linear(self, bp: BlockPlan, nd: Node, entry: dict) -> None:
        f = nd.attrs["fhe"]
        x = nd.inputs[0]
        lin = self.layout[x]
        out = self.out_layout(nd)
        self.layout[nd.out] = out
        entry["workers"] = list(out.workers)
        lvl_in, lvl_out = f["level_in"], f["level_out"]
        have = self.replicas.get(x)
        if have and lvl_in <= have[1] and set(out.workers) <= have[0]:
            entry["group"] = "output-stationary (input already gathered)"
            self.step(bp, "node", nd.name)
            return
        # linears reading x at the same level decide together (one gather serves them all)
        group = [c for c in self.consumers.get(x, []) if c.op == "linear" and c.attrs["fhe"]["level_in"] == lvl_in]
        outs = {c.name: (out if c is nd else self.out_layout(c)) for c in group}
        receivers = sorted(set().union(*(set(o.workers) for o in outs.values())))
        gather = Counter()
        for w in receivers:
            for u in lin.owners:
                if u != w:
                    gather[(u, w)] += 1
        reduces = {}
        for c in group:
            r = Counter()
            for u in lin.workers:
                for w in outs[c.name].owners:
                    if w != u:
                        r[(u, w)] += 1
            reduces[c.name] = (r, c.attrs["fhe"]["level_out"])
        g_bytes = sum(gather.values()) * ct_bytes(lvl_in, self.n)
        r_bytes = sum(sum(r.values()) * ct_bytes(lv, self.n) for r, lv in reduces.values())
        if not gather and not r_bytes:
            entry["group"] = "output-stationary (input and output blocks on one worker)"
            self.step(bp, "node", nd.name)
            return
        names = ",".join(c.name for c in group)
        booted = any(bt["stage"] == "input" and bt["value"] == x for bt in self.points.get(nd.name, []))
        if g_bytes <= r_bytes:
            alt = {"form": "reduce", "level": lvl_out, "cts": sum(sum(r.values()) for r, _ in reduces.values()),
                   "bytes": r_bytes}
            rules = {"rescaled": True, "local_reduction": None,
                     "bootstrap": ("after_bootstrap: the gathered blocks are needed by every worker; bootstrapping "
                                   "them after the gather would repeat each bootstrap W times") if booted else None}
            c = self.collective(bp, "gather", names, x, lvl_in, gather, rules,
                                f"{names}: products over the worker's own input blocks while the others arrive, "
                                f"then each received share in ring order ({self.W - 1} round(s), AEGIS 4.2)", alt)
            self.replicas[x] = (frozenset(receivers), lvl_in)
            entry["group"] = "output-stationary, input gathered"
            entry["collective"] = c.id
            self.step(bp, "node", nd.name)
            return
        # reduce form: each member sends its partial outputs after its own rescale
        alt = {"form": "gather", "level": lvl_in, "cts": sum(gather.values()), "bytes": g_bytes}
        self.step(bp, "node", nd.name)
        r, lv = reduces[nd.name]
        entry["group"] = "output-stationary, partial outputs reduced"
        if r:
            later = any(bt["value"] == nd.out for pts in self.points.values() for bt in pts)
            rules = {"rescaled": True,
                     "local_reduction": "one partial per output block (own input blocks summed first)",
                     "bootstrap": "before_bootstrap: the receiver bootstraps the reduced block" if later else None}
            c = self.collective(bp, "reduce", nd.name, f"{nd.out} (partials)", lv, r, rules,
                                f"{nd.name}: the other workers' output blocks first, staggered (worker w starts with "
                                f"worker w+1's), each sent once rescaled; own blocks computed while they travel "
                                f"(AEGIS 4.4.1, Figure 8b)", alt)
            entry["collective"] = c.id

    def norm(self, bp: BlockPlan, nd: Node, pre: list, inner: list, entry: dict) -> None:
        f = nd.attrs["fhe"]
        x = nd.inputs[0]
        lay = self.layout[x]
        self.layout[nd.out] = lay
        entry["workers"] = list(lay.workers)
        holders = lay.workers
        split = len(holders) > 1
        entry["group"] = ("token-wise sums reduced across workers" if split else "token-wise sums on one worker")

        def sums(level: int, label: str, overlap: str, booted_later: bool) -> int | None:
            if not split:
                return None
            sends = Counter()
            for u in holders:
                for w in holders:
                    if u != w:
                        sends[(u, w)] += self.pk.token_groups
            rules = {"rescaled": True, "local_reduction": "one ciphertext per sum (own blocks added and "
                                                          "rotated-and-summed first)",
                     "bootstrap": "before_bootstrap: sent before the norm's bootstraps" if booted_later else None}
            return self.collective(bp, "norm-sum", nd.name, f"{nd.name}:{label}", level, sends, rules, overlap,
                                   kind="AllReduce").id

        ids = []
        layer_norm = nd.op == "layer_norm"
        if layer_norm:   # s1 = sum x needs no product: sent before the input's bootstrap (rule 1)
            lvl1 = min((bt["level"] for bt in pre), default=f["level_in"])
            ids.append(sums(lvl1, "s1", f"{nd.name}: the squares of the own blocks and their local sum",
                            bool(pre or inner)))
        for bt in pre:
            self.bootstrap(bp, nd, bt)
        ids.append(sums(f["level_in"] - 1, "s2",
                        f"{nd.name}: " + ("s1^2 and the centred, gamma-scaled own blocks" if layer_norm
                                          else "the gamma-scaled own blocks"), bool(inner)))
        entry["collective"] = [i for i in ids if i is not None] or None
        self.step(bp, "node", nd.name)
        for bt in inner:
            self.bootstrap(bp, nd, bt)

    # -- the tensor-parallel baseline

    def tensor_parallel(self) -> None:
        for bp in self.blocks.values():
            if bp.layer is None or self.W == 1:
                continue
            for nd in self.g.nodes:
                row = nd.layer is not None and nd.name in (f"L{nd.layer}.o", f"L{nd.layer}.ffn.down")
                if nd.layer != bp.layer or nd.op != "linear" or not row:
                    continue
                lvl = nd.attrs["fhe"]["level_out"]
                k = self.pk.k_send(int(nd.attrs["d_out"]))
                cb = ct_bytes(lvl, self.n)
                sends = sorted((u, w, k) for u in range(self.W) for w in range(self.W) if u != w)
                c = Collective(0, bp.block, "AllReduce", "row-parallel", nd.name, nd.out, lvl, len(sends) * k, cb,
                               len(sends) * k * cb, (self.W - 1) * k * cb, sends,
                               f"AllReduce: (W-1) x P2P(T) = {self.W - 1} x {k} ct x {_mb(cb)}",
                               {}, "")
                bp.tp_collectives.append(c)

    def totals(self) -> None:
        for bp in self.blocks.values():
            for attr, cs in (("", bp.collectives), ("tp_", bp.tp_collectives)):
                per = [0] * self.W
                for c in cs:
                    for s, _, k in c.sends:
                        per[s] += k * c.ct_bytes
                setattr(bp, attr + "bytes", sum(c.bytes for c in cs))
                setattr(bp, attr + "sent_per_worker", per)


def run(graph: Graph, workers: int, tokens: int, slots: int = DEFAULT_SLOTS, n: int = DEFAULT_N,
        levels: int = fhe_levels.DEFAULT_LEVELS, approximations=None) -> Plan:
    """The AEGIS plan of `graph` on `workers` workers for a pass of `tokens` tokens (see the
    module docstring).  `graph`: the output of `passes.fhe_levels` (run here with `levels` and
    `approximations` when ``meta["fhe_levels"]`` is missing); `slots` and `n`: the CKKS
    slots and ring degree (the packing and the ciphertext size).  Deterministic: the same
    arguments give the same plan."""
    W = int(workers)
    if W < 1:
        raise ValueError("at least one worker")
    if slots > n // 2:
        raise ValueError(f"{slots} slots need a ring degree >= {2 * slots}, got {n}")
    pk = Packing.fhe_executor(int(slots), int(tokens))
    if pk.token_groups != 1:   # not reachable with the executor's packing (tp >= 2T)
        raise NotImplementedError("placement over several token groups is not modelled")
    if "fhe_levels" not in graph.meta:
        graph = fhe_levels.run(graph, levels=levels, approximations=approximations)
    for nd in graph.nodes:
        if nd.op == "qk" and pk.s_tok % int(nd.attrs["head_dim"]):
            raise ValueError(f"{nd.name}: head dim {nd.attrs['head_dim']} does not divide the {pk.s_tok} channels per "
                             f"ciphertext of {tokens} tokens (the fhe executor needs whole heads per ciphertext)")
    p = _Planner(graph, W, pk, int(n))
    p.run()
    p.tensor_parallel()
    p.totals()
    heads = {}
    for nd in graph.nodes:
        if nd.op == "qk":
            H, hd = int(nd.attrs["heads"]), int(nd.attrs["head_dim"])
            per = pk.s_tok // hd
            owners = p.canonical(H * hd).owners
            heads = {"heads": H, "head_dim": hd, "per_ct": per, "owners": [owners[h // per] for h in range(H)]}
            break
    placement = {}
    for width in sorted(p.widths):
        owners = p.widths[width]
        placement[width] = {"cts": len(owners), "owners": list(owners),
                            "ranges": {w: [owners.index(w), len(owners) - 1 - owners[::-1].index(w)]
                                       for w in sorted(set(owners))}}
    return Plan(W, int(tokens), int(slots), int(n), int(graph.meta["fhe_levels"]["levels"]),
                {"tokens_per_ct": pk.tokens_per_ct, "s_tok": pk.s_tok, "token_groups": pk.token_groups},
                placement, heads, list(p.blocks.values()), p.unsupported)


# ----------------------------------------------------------------------------- text


def _short_overlap(c: Collective) -> str:
    """The table's one-line form of `Collective.overlap` (the plan keeps the sentence)."""
    if c.form == "gather":
        return "own input blocks' products, then the ring's shares"
    if c.form == "reduce":
        return "own output blocks (others' partials first, staggered)"
    if c.form == "norm-sum":
        if c.value.endswith(":s1"):
            return "squares of own blocks, local sum"
        return "gamma-scaling (centring) of own blocks"
    return "work on the local blocks"


def format_plan(plan: Plan) -> str:
    """The plan as text: the packing and placement, per block each collective (kind, node,
    level, ciphertexts, bytes, the busiest worker's bytes, what it overlaps), and per block
    the bytes beside the tensor-parallel baseline's."""
    pk = plan.packing
    lines = [(f"aegis placement (AEGIS 4.1-4.4, docs/aegis.md): {plan.workers} worker(s), {plan.tokens} tokens, "
              f"N = {plan.n}, {plan.slots} slots: {pk['tokens_per_ct']} positions x {pk['s_tok']} channels per "
              f"ciphertext (s_tok = {pk['s_tok']}), ct(l) = 2 (l+1) N 8 B = {_mb(ct_bytes(plan.levels, plan.n))} "
              f"at the top level {plan.levels}")]
    for width, p in plan.placement.items():
        rng = ", ".join(f"w{w}: {a}" + (f"-{b}" if b != a else "") for w, (a, b) in p["ranges"].items())
        lines.append(f"  width {width:>6}: {p['cts']:>3} ct  ({rng})")
    if plan.heads:
        h = plan.heads
        runs: dict[int, list[int]] = {}
        for i, w in enumerate(h["owners"]):
            runs.setdefault(w, []).append(i)
        rng = ", ".join(f"w{w}: {v[0]}" + (f"-{v[-1]}" if len(v) > 1 else "") for w, v in runs.items())
        lines.append(f"  heads: {h['heads']} of {h['head_dim']} channels, {h['per_ct']} per ciphertext ({rng}); "
                     f"attention is head-local")
    lines.append(f"  {'block':<9} {'#':>3} {'kind':<13} {'form':<9} {'node':<26} {'level':>5} {'cts':>4} "
                 f"{'bytes':>10} {'busiest':>10}  overlapped with")
    for b in plan.blocks:
        for c in b.collectives:
            node = c.node if len(c.node) <= 26 else c.node[:23] + "..."
            lines.append(f"  {b.block:<9} {c.id:>3} {c.kind:<13} {c.form:<9} {node:<26} {c.level:>5} {c.cts:>4} "
                         f"{_mb(c.bytes):>10} {_mb(c.per_device_bytes):>10}  {_short_overlap(c)}")
    if not plan.collectives():
        lines.append("  (no collectives: " + ("one worker)" if plan.workers == 1 else "every reduction is local)"))
    lines.append(f"  {'block':<9} {'AEGIS':>10} {'busiest':>10} {'tensor-par.':>12} {'busiest':>10} {'AEGIS/TP':>8}"
                 f"  bootstrapped ciphertexts per worker: AEGIS | tensor-par.")
    for b in plan.blocks:
        ratio = f"{b.bytes / b.tp_bytes:.2f}" if b.tp_bytes else "-"
        boots = [sum(bt["cts_per_worker"][w] for bt in b.bootstraps) for w in range(plan.workers)]
        tboots = [sum(bt["tp_cts_per_worker"][w] for bt in b.bootstraps) for w in range(plan.workers)]
        lines.append(f"  {b.block:<9} {_mb(b.bytes):>10} {_mb(b.per_device_bytes):>10} {_mb(b.tp_bytes):>12} "
                     f"{_mb(b.tp_per_device_bytes):>10} {ratio:>8}  {boots} | {tboots}")
    ratio = f"{plan.layer_bytes / plan.tp_bytes:.2f}" if plan.tp_bytes else "-"
    lines.append(f"  {'layers':<9} {_mb(plan.layer_bytes):>10} {'':>10} {_mb(plan.tp_bytes):>12} {'':>10} {ratio:>8}")
    lines.append("  (bytes: sent between workers, Table 2's formulas, MB = 10^6 B; busiest: the most one worker sends; "
                 "tensor-par.: Megatron, an AllReduce after o and down)")
    if plan.unsupported:
        lines.append(f"  not placed: {', '.join(plan.unsupported)}")
    return "\n".join(lines)
