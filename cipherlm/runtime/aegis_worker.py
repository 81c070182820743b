"""One worker of the distributed fhe executor (AEGIS sections 4.1-4.4; the driver is
`runtime.aegis_executor`): it holds some channel blocks of each value, its share of the
pre-encoded projections, and the session's evaluation keys, loaded once.

A value's blocks are the ciphertexts of the token-group packing (`protocols.ckks.packing`:
block i holds channels i*cpc .. (i+1)*cpc - 1 of all tokens).  Every operator a worker runs
reads and writes a contiguous range of blocks, as a `CkksTensor` of the range's channels:

* slot-wise operators (activations, products, residual additions) and the head-local ones
  (RoPE, Q.K^T, softmax, P.V, the KV cache): the fhe executor's own `FheBackend` on the
  range, since whole heads sit in a block (the packing's cpc is a multiple of the head
  dimension) and nothing crosses blocks;
* a projection, output-stationary (4.2): the rows of the worker's output blocks, on all
  input blocks (``gather`` form: the driver has brought the other workers' blocks), or the
  partial outputs of all blocks from the columns of its own input blocks (``reduce`` form:
  the driver sends each partial to its block's owner, `add_partials`);
* a norm or the classifier's pooling: `norm_sums` over its blocks (the partial channel
  sums, one ciphertext each), then, once the driver has exchanged the partials,
  `norm_finish` on its blocks (the scalar chain, rsqrt, is repeated by every holder).

The class is plain Python: the driver runs it as a Ray actor (`ray.remote(FheWorker)`), or
in its own process for one worker and in tests (`InlineRuntime`).  Ciphertexts leave a
worker only as bytes (`export`), so the driver counts exactly what crosses between
workers.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cipherlm.he.errors import HEError
from cipherlm.protocols.ckks import linear as lin
from cipherlm.protocols.ckks import norm
from cipherlm.protocols.ckks.evaluator import CkksEvaluator, CkksTensor
from cipherlm.protocols.ckks.packing import TokenPacking

from .fhe_executor import FheBackend, FheModel


@dataclass
class Blocks:
    """The blocks of one value that a worker holds: {block index: ciphertext}, and what a
    `CkksTensor` of a range of them needs."""

    cts: dict
    d: int                # the value's width (all blocks)
    packing: TokenPacking
    bound: float
    position: int | None = None

    def tensor(self, start: int, stop: int) -> CkksTensor:
        missing = [i for i in range(start, stop) if i not in self.cts]
        if missing:
            raise HEError(f"blocks {missing} are not on this worker")
        cpc = self.packing.cpc
        d = min(self.d, stop * cpc) - start * cpc
        return CkksTensor([self.cts[i] for i in range(start, stop)], d, self.packing, self.bound, self.position)


def _span(blocks) -> tuple[int, int]:
    b = sorted(blocks)
    if not b or b != list(range(b[0], b[-1] + 1)):
        raise HEError(f"a worker's blocks must be a contiguous range, got {b}")
    return b[0], b[-1] + 1


class FheWorker:
    """See the module docstring.  ``model_args``: (config, weights, calibration, classifier),
    as `FheModel` takes them (the driver shares one copy through Ray's object store)."""

    def __init__(self, rank: int, model_args: tuple):
        self.rank = int(rank)
        self.model = FheModel(*model_args)
        self.nodes = {n.name: n for n in self.model.graph.nodes}
        self._enc: dict[tuple, lin.EncodedLinear] = {}
        self.ev: CkksEvaluator | None = None
        self.vals: dict[str, Blocks] = {}
        self.objs: dict[str, tuple[int, int, object]] = {}   # Scores (head-local, never sent)
        self.cache = None
        self.busy = 0.0

    # ---- session

    def open_session(self, preset: str, allow_insecure: bool, blobs: dict,
                     required_steps: Sequence[int] | None = None) -> int:
        """Load the session's keys (relin, galois, bootstrap blobs as the client sent them):
        once per worker and session.  The keys are untrusted input: the loaders check them
        (HEError), the Galois keys against ``required_steps`` (the model's rotation steps, no
        more keys than steps), so the server need not parse them itself.  The previous
        session's keys are dropped first (a failed load leaves no session).  Returns the
        process id (for fault tests)."""
        import os

        from cipherlm.he import get_backend

        self.close_session()
        be = get_backend("lattigo")
        ctx = be.bootstrappable_context(preset, allow_insecure_for_tests=allow_insecure)
        relin = be.relin_keys_from_bytes(ctx, blobs["relin"])
        if required_steps is None:
            galois = be.galois_keys_from_bytes(ctx, blobs["galois"])
        else:
            galois = be.galois_keys_from_bytes(ctx, blobs["galois"], required_steps=list(required_steps),
                                               max_keys=len(required_steps))
        boot = be.bootstrapping_keys_from_bytes(ctx, blobs["bootstrap"])
        self.ev = CkksEvaluator(be, ctx, relin.merged(galois), boot)
        self.vals.clear()
        self.objs.clear()
        self.cache = self.model.new_cache(self.ev)
        return os.getpid()

    def close_session(self) -> None:
        self.vals.clear()
        self.objs.clear()
        self.cache = None
        if self.ev is not None and self.ev.bootstrap_keys is not None:
            self.ev.bootstrap_keys.close()
        self.ev = None

    def new_pass(self, new_cache: bool = False) -> None:
        """Forget the previous pass's values (the KV cache stays, unless ``new_cache``: a pass
        at offset 0 starts a new one)."""
        self.vals.clear()
        self.objs.clear()
        if new_cache and self.ev is not None:
            self.cache = self.model.new_cache(self.ev)

    def _need_session(self) -> CkksEvaluator:
        if self.ev is None:
            raise HEError(f"worker {self.rank}: no session keys")
        return self.ev

    # ---- values in and out

    def put(self, key: str, blobs: dict, d: int, packing: tuple, bound: float, position=None) -> int:
        """Store blocks {index: ciphertext bytes} of value `key` (the client's upload)."""
        ev = self._need_session()
        P = TokenPacking(*packing)
        cts = {int(i): ev.be.ciphertext_from_bytes(ev.ctx, b) for i, b in blobs.items()}
        self._merge(key, cts, d, P, bound, position)
        return sum(len(b) for b in blobs.values())

    def _merge(self, key, cts, d, P, bound, position):
        v = self.vals.get(key)
        if v is None:
            self.vals[key] = Blocks(dict(cts), int(d), P, float(bound), position)
        else:
            v.cts.update(cts)

    def export(self, key: str, blocks) -> dict:
        """{block: ciphertext bytes} of `key`: what leaves this worker, and all that does."""
        ev = self._need_session()
        v = self.vals[key]
        return {"blobs": {int(i): ev.be.ciphertext_to_bytes(v.cts[int(i)]) for i in blocks},
                "levels": {int(i): int(v.cts[int(i)].level) for i in blocks},
                "d": v.d, "packing": (v.packing.slots, v.packing.tokens, v.packing.tp_min, v.packing.offset),
                "bound": v.bound, "position": v.position}

    def receive(self, key: str, sent: dict) -> tuple[int, list[int]]:
        """Store blocks another worker exported; (bytes received, each ciphertext's level)."""
        ev = self._need_session()
        cts = {int(i): ev.be.ciphertext_from_bytes(ev.ctx, b) for i, b in sent["blobs"].items()}
        self._merge(key, cts, sent["d"], TokenPacking(*sent["packing"]), sent["bound"], sent["position"])
        return sum(len(b) for b in sent["blobs"].values()), [int(c.level) for c in cts.values()]

    def prepare(self, key: str, levels: int, label: str) -> None:
        """Refresh this worker's blocks of `key` to `levels` before they are sent (a gathered
        block is then bootstrapped once, by its owner)."""
        return self._timed(self._prepare, key, levels, label)

    def _prepare(self, key, levels, label):
        ev = self._need_session()
        v, s, x = self._mine(key)
        self._keep(key, s, ev.refresh(x, levels, label), v.d)

    def drop(self, keys) -> None:
        for k in keys:
            self.vals.pop(k, None)
            self.objs.pop(k, None)

    def held(self, key: str) -> list[int]:
        return sorted(self.vals[key].cts) if key in self.vals else []

    def level(self, key: str) -> int:
        return min(c.level for c in self.vals[key].cts.values())

    # ---- operators

    def _timed(self, fn, *a):
        t0 = time.process_time()
        try:
            return fn(*a)
        finally:
            self.busy += time.process_time() - t0

    def local(self, op: str, node_name: str, in_keys: list, out_keys: list, blocks: tuple, ctx: dict) -> None:
        """Run `op` (a `FheBackend` method, or "kv_cache") on blocks [start, stop) of its inputs."""
        return self._timed(self._local, op, node_name, in_keys, out_keys, blocks, ctx)

    def _arg(self, key, start, stop):
        if key in self.objs:
            s, e, obj = self.objs[key]
            if (s, e) != (start, stop):
                raise HEError(f"{key}: scores of blocks {s}-{e}, asked for {start}-{stop}")
            return obj
        return self.vals[key].tensor(start, stop)

    def _local(self, op, node_name, in_keys, out_keys, blocks, ctx):
        ev = self._need_session()
        node = self.nodes[node_name]
        start, stop = blocks
        args = [self._arg(k, start, stop) for k in in_keys]
        width = next((self.vals[k].d for k in in_keys if k in self.vals), None)
        ctx = dict(ctx)
        if "positions" in ctx:
            ctx["positions"] = np.asarray(ctx["positions"])
        if op == "kv_cache":
            outs = self.cache.append_node(node, *args)
        else:
            outs = (getattr(FheBackend(self.model, ev), op)(node, *args, ctx),)
        for key, t in zip(out_keys, outs):
            if isinstance(t, CkksTensor):  # same width as its inputs: slot-wise or head-local
                self._keep(key, start, t, width)
            else:  # Q.K^T's and softmax's scores: stay where they are made
                self.objs[key] = (start, stop, t)

    def _encoded(self, name, packing, position, rows=None, cols=None, bias_rows=None) -> lin.EncodedLinear:
        key = (name, packing, position, rows, cols, bias_rows)
        e = self._enc.get(key)
        if e is None:
            w, b = self.model.weights(name)
            if b is not None and bias_rows is not None:
                keep = np.zeros_like(b)
                keep[bias_rows[0]:bias_rows[1]] = 1.0
                b = b * keep
            if cols is not None:
                w = w[:, cols[0]:cols[1]]
            if rows is not None:
                w, b = w[rows[0]:rows[1]], (None if b is None else b[rows[0]:rows[1]])
            mask = None
            if position is not None:
                mask = np.zeros(packing.tp)
                mask[position] = 1.0
            e = self._enc[key] = lin.EncodedLinear(w, b, packing, positions=mask, cache=self.model.cache_plaintexts)
        return e

    def linear_rows(self, name: str, in_key: str, out_key: str, out_blocks: tuple, d_out: int) -> None:
        """Gather form: output blocks [a, b) of projection `name` from all input blocks."""
        return self._timed(self._linear_rows, name, in_key, out_key, out_blocks, d_out)

    def _linear_rows(self, name, in_key, out_key, out_blocks, d_out):
        ev = self._need_session()
        v = self.vals[in_key]
        x = v.tensor(0, v.packing.n_cts(v.d))
        a, b = out_blocks
        cpc = v.packing.cpc
        e = self._encoded(name, v.packing, v.position, rows=(a * cpc, min(d_out, b * cpc)))
        y = e(ev, x, bound=self.model.bound_of_linear(name), label=name)
        y.position = v.position
        self._keep(out_key, a, y, d_out)

    def linear_partial(self, name: str, in_key: str, out_key: str, bias_blocks: tuple | None, d_out: int) -> None:
        """Reduce form: the partial outputs (every block) from this worker's input blocks, the
        bias only on output blocks [a, b) (so the partials sum to one bias)."""
        return self._timed(self._linear_partial, name, in_key, out_key, bias_blocks, d_out)

    def _linear_partial(self, name, in_key, out_key, bias_blocks, d_out):
        ev = self._need_session()
        v, s, x = self._mine(in_key)
        cpc = v.packing.cpc
        bias = (0, 0) if bias_blocks is None else (bias_blocks[0] * cpc, min(d_out, bias_blocks[1] * cpc))
        enc = self._encoded(name, v.packing, v.position, cols=(s * cpc, s * cpc + x.d), bias_rows=bias)
        y = enc(ev, x, bound=self.model.bound_of_linear(name), label=name)
        y.position = v.position
        self._keep(out_key, 0, y, d_out)

    def add_partials(self, out_key: str, keys: list, blocks: tuple) -> None:
        """Sum the partials `keys` (received, and this worker's own) on blocks [a, b)."""
        return self._timed(self._add_partials, out_key, keys, blocks)

    def _add_partials(self, out_key, keys, blocks):
        self._need_session()
        a, b = blocks
        first = self.vals[keys[0]]
        self.vals[out_key] = Blocks({i: self._summed(keys, i) for i in range(a, b)}, first.d, first.packing,
                                    first.bound, first.position)

    def norm_sums(self, op: str, node_name: str, in_key: str, sums_key: str) -> None:
        """A norm's (or the pooling's) partial channel sums over this worker's blocks: stored
        as blocks 0.. of `sums_key`; the refreshed input replaces `in_key`."""
        return self._timed(self._norm_sums, op, node_name, in_key, sums_key)

    def _norm_sums(self, op, node_name, in_key, sums_key):
        ev = self._need_session()
        v, s, x = self._mine(in_key)
        if op == "pool":
            x, sums = self.model.pool_sums(ev, x)
        else:
            x, sums = norm.norm_sums(ev, x, op == "layer_norm", node_name)
        self._keep(in_key, s, x, v.d)
        self.vals[sums_key] = Blocks(dict(enumerate(sums)), v.packing.cpc, v.packing, 1.0, None)

    def norm_finish(self, op: str, node_name: str, in_key: str, sums_keys: list, out_key: str) -> None:
        """The norm of this worker's blocks from every holder's partial sums."""
        return self._timed(self._norm_finish, op, node_name, in_key, sums_keys, out_key)

    def _norm_finish(self, op, node_name, in_key, sums_keys, out_key):
        ev = self._need_session()
        v, s, x = self._mine(in_key)
        sums = [self._summed(sums_keys, j) for j in sorted(self.vals[sums_keys[0]].cts)]
        cpc = v.packing.cpc
        ch = slice(s * cpc, s * cpc + x.d)
        if op == "pool":
            y = self.model.pool_finish(ev, x, sums)
        else:
            node = self.nodes[node_name]
            gamma = self._slice(node.attrs.get("gamma"), ch)
            approx, bound = self.model.approx(node, "rsqrt"), self.model.bound(node.out)
            if op == "layer_norm":
                y = norm.layer_norm_finish(ev, x, sums, v.d, gamma, self._slice(node.attrs.get("beta"), ch),
                                           node.attrs["eps"], approx, bound, node_name)
            else:
                y = norm.rms_norm_finish(ev, x, sums, v.d, gamma, node.attrs["eps"], approx, bound, node_name)
            y.position = x.position
        self._keep(out_key, s, y, v.d)

    def _mine(self, key: str) -> tuple[Blocks, int, CkksTensor]:
        """(the value, its first block here, a tensor of this worker's blocks of it)."""
        v = self.vals[key]
        s, e = _span(v.cts)
        return v, s, v.tensor(s, e)

    def _keep(self, key: str, start: int, t: CkksTensor, d: int) -> None:
        """Store tensor `t` as blocks start.. of value `key` (width d)."""
        self.vals[key] = Blocks({start + i: c for i, c in enumerate(t.cts)}, int(d), t.packing, t.bound, t.position)

    def _summed(self, keys: list, i: int):
        """Block i of the sum of the values `keys` (partials from every worker)."""
        acc = self.vals[keys[0]].cts[i]
        for k in keys[1:]:
            acc = self.ev.add_ct(acc, self.vals[k].cts[i])
        return acc

    def _slice(self, name, ch):
        return None if name is None else np.asarray(self.model.params[name], np.float64)[ch]

    # ---- measurement

    def stats(self) -> dict:
        """This worker's counters: operations, seconds of CPU in operators, peak RSS."""
        ev = self.ev
        return {"rank": self.rank, "busy_s": round(self.busy, 3),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "counts": {} if ev is None else dict(ev.stats.counts),
                "bootstraps": 0 if ev is None else int(ev.stats.counts.get("bootstrap", 0))}

    def reset_stats(self) -> None:
        self.busy = 0.0
        if self.ev is not None:
            from collections import Counter

            self.ev.stats.counts = Counter()
            self.ev.stats.seconds = Counter()
            self.ev.stats.refreshes = []

    def set_cache_plaintexts(self, keep: bool) -> None:
        """Keep encoded projections between passes (False at 2^15 slots: GBs per level)."""
        self.model.cache_plaintexts = bool(keep)

    def ping(self) -> int:
        return self.rank
