"""The distributed fhe executor (AEGIS sections 4.1-4.4, 5.1.1): one fhe pass over W
workers, each a Ray actor (`aegis_worker.FheWorker`), driven by the model graph.

The driver walks the graph with the same `GraphExecutor` as every other mode; its values
are `DistValue`s (which worker holds which channel block of a value), and for each node
it tells the workers what to run on their blocks and which ciphertexts to send where.
A placement decides the layouts and the collectives:

* ``aegis`` (the paper's placement, `compile.passes.aegis_placement`): every value's
  blocks are split over the workers in contiguous ranges (`split_owners`); projections are
  output-stationary, with the input gathered (AllGather) or the partial outputs reduced
  onto the output blocks' owners (ReduceScatter), as the compile pass's plan chose; norms
  sum locally and exchange one ciphertext per sum (AllReduce); attention is head-local.
  Gathered blocks are refreshed (bootstrapped) by their owner before they travel, so no
  bootstrap is repeated (section 4.4, "send before bootstrapping", docs/aegis.md).
* ``megatron`` (the plaintext-style tensor-parallel baseline, 3.2.3 / 5.1.1): the residual
  stream is replicated on every worker (the client uploads it to each); a projection of a
  replicated input is column-parallel (each worker its own output blocks, no bytes); one of
  a split input is row-parallel, followed by an AllReduce of the full output (every worker
  sends its partial of every block to every other worker); norms and residuals run on every
  worker's full copy.
* ``hydra`` (Hydra's column-wise tensor parallelism as AEGIS 5.1.1 reimplements it): the
  client's input is replicated on every worker; every projection is column-parallel (each
  worker computes its own output blocks from the whole input), so a split input is first
  gathered onto every worker (AllGather); slot-wise and head-local operators run on each
  worker's own blocks (the nonlinear work is distributed by block ownership); at each layer
  boundary (a norm, or the pooling) the stream is gathered onto every worker, which then
  computes the norm on its full copy (no sums exchanged).  Hydra's ASIC-specific tree
  distribution and switch interconnect are, as in AEGIS's own baseline, not reproduced.

Ciphertexts travel between actors through Ray's object store (`export` returns the bytes,
the receiving actor gets them as an argument): the driver counts every byte that crosses
between workers, per collective, with the level of each ciphertext, next to Table 2's
formula (`aegis_placement.ct_bytes`).  The client's upload and the result's download are
not counted (they are the client's bytes, as in the single-worker mode).

Runtimes: `RayRuntime` (``ray.init()`` on this machine, or ``address`` of a Ray cluster: no
cluster code of ours) and `InlineRuntime` (the workers as objects in this process; for a
one-worker reference and fast tests).  A worker that dies or stalls ends the request with
an `HEError` within ``timeout``; `AegisExecutor.recover` starts fresh workers for the next.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from cipherlm.compile.passes import aegis_placement
from cipherlm.compile.passes.aegis_placement import ct_bytes, split_owners
from cipherlm.he.errors import HEError
from cipherlm.protocols.ckks.packing import TokenPacking

from .aegis_worker import FheWorker
from .fhe_executor import FheModel
from .graph_executor import GraphExecutor

PLACEMENTS = ("aegis", "megatron", "hydra")
_REPLICATED_INPUT = ("megatron", "hydra")
DISPATCH = ("async", "sync")
_HE_ERROR_PREFIX = f"{HEError.__module__}.{HEError.__qualname__}: "


# ----------------------------------------------------------------------------- runtimes


class InlineRuntime:
    """The workers as objects in this process, called one after the other."""

    name = "inline"

    def start(self, workers: int, model_args: tuple) -> None:
        self.workers = [FheWorker(w, model_args) for w in range(workers)]

    def call(self, w: int, method: str, *args):
        return getattr(self.workers[w], method)(*args)

    def get(self, refs, timeout: float | None = None):
        return refs

    def share(self, obj):
        return obj

    def kill(self, w: int) -> None:
        raise HEError("the inline runtime's workers cannot be killed")

    def shutdown(self) -> None:
        self.workers = []


class RayRuntime:
    """One Ray actor per worker (`ray.remote(FheWorker)`), on this machine (``ray.init()``)
    or on the Ray cluster at ``address``."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None, threads: int | None = None):
        self.address, self.num_cpus = address, num_cpus
        #: OS threads each worker's Go runtime may run at once (GOMAXPROCS; None: all cores):
        #: one per worker makes W workers on W cores comparable with one worker on one core
        self.threads = threads
        self.actors: list = []

    def start(self, workers: int, model_args: tuple) -> None:
        import ray

        if not ray.is_initialized():
            kw = {"address": self.address} if self.address else {"num_cpus": self.num_cpus or max(workers, 1)}
            ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR", **kw)
        opts = {"num_cpus": 0}  # the HE kernels use their own threads (Go)
        if self.threads:
            opts["runtime_env"] = {"env_vars": {"GOMAXPROCS": str(int(self.threads))}}
        actor = ray.remote(**opts)(FheWorker)
        args_ref = ray.put(model_args)  # one read-only copy of the weights in the object store
        self.actors = [actor.remote(w, args_ref) for w in range(workers)]

    def call(self, w: int, method: str, *args):
        return getattr(self.actors[w], method).remote(*args)

    def get(self, refs, timeout: float | None = None):
        import ray

        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise HEError(f"a worker did not answer within {timeout:g} s (stalled)") from None
        except ray.exceptions.RayActorError as e:
            raise HEError(f"a worker died during the request ({type(e).__name__})") from None
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, HEError):
                msg = str(cause).splitlines()[-1]
                while msg.startswith(_HE_ERROR_PREFIX):
                    msg = msg[len(_HE_ERROR_PREFIX):]
                raise HEError(msg) from None
            raise HEError(f"a worker failed: {type(cause).__name__}") from None

    def share(self, obj):
        import ray

        return ray.put(obj)

    def kill(self, w: int) -> None:
        import ray

        ray.kill(self.actors[w], no_restart=True)

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = []


# ----------------------------------------------------------------------------- values and traffic


@dataclass
class DistValue:
    """A value on the workers: its width, and per block the workers holding it."""

    key: str
    d: int
    holders: list          # per block: tuple of workers
    scores: bool = False   # Q.K^T / softmax output (head-local, never sent)

    def on(self, w: int) -> list[int]:
        return [i for i, h in enumerate(self.holders) if w in h]

    def workers(self) -> list[int]:
        return sorted({w for h in self.holders for w in h})

    def span(self, w: int) -> tuple[int, int]:
        b = self.on(w)
        return (b[0], b[-1] + 1)

    def replicated(self, W: int) -> bool:
        return all(len(h) == W for h in self.holders)


@dataclass
class Collective:
    """What crossed between workers for one purpose (measured), next to Table 2's bytes
    for the same ciphertexts at the same levels."""

    id: int
    kind: str          # AllGather | ReduceScatter | AllReduce | P2P
    form: str          # gather | reduce | norm-sum | relayout | allreduce
    node: str
    part: str          # attention | ffn | other
    layer: int | None
    cts: int = 0
    bytes: int = 0
    formula_bytes: int = 0
    levels: list = field(default_factory=list)
    sends: dict = field(default_factory=lambda: defaultdict(int))   # (src, dst) -> ciphertexts

    def to_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "form": self.form, "node": self.node, "part": self.part,
                "layer": self.layer, "cts": self.cts, "bytes": self.bytes, "formula_bytes": self.formula_bytes,
                "levels": sorted(set(self.levels)), "key": part_key(self.node.split(",")[0]), "sends": {f"{s}->{d}": n for (s, d), n in sorted(self.sends.items())}}


def part_of(node_name: str) -> str:
    """Which half of a layer a node belongs to (docs/aegis.md's tables): the FFN's nodes and
    its norm, or attention's (with its norm and residual)."""
    if not node_name.startswith("L"):
        return "other"
    return "ffn" if ".ffn" in node_name else "attention"


def part_key(node_name: str) -> str:
    """"L<layer>.<part>" of a layer's node (the bench's rows), "other" outside the layers."""
    layer = _layer_of(node_name)
    return "other" if layer is None else f"L{layer}.{part_of(node_name)}"


def _layer_of(node_name: str) -> int | None:
    head = node_name.split(".", 1)[0]
    return int(head[1:]) if head[:1] == "L" and head[1:].isdigit() else None


# ----------------------------------------------------------------------------- the executor


class AegisExecutor:
    """An fhe pass of `model` over `workers` workers (see the module docstring)."""

    def __init__(self, model: FheModel, workers: int, *, placement: str = "aegis", runtime=None,
                 timeout: float = 600.0, cache_plaintexts: bool = True, dispatch: str = "async"):
        if placement not in PLACEMENTS:
            raise HEError(f"unknown placement {placement!r}: one of {PLACEMENTS}")
        if dispatch not in DISPATCH:
            raise HEError(f"unknown dispatch {dispatch!r}: one of {DISPATCH}")
        if workers < 1:
            raise HEError("at least one worker")
        self.model, self.W, self.placement = model, int(workers), placement
        self.runtime = runtime if runtime is not None else InlineRuntime()
        self.timeout = float(timeout)
        self.cache_plaintexts = cache_plaintexts
        #: "async": the operators' calls are queued without waiting (each actor runs its calls in
        #: submission order, a received ciphertext is an argument that waits for its export), and
        #: the driver waits once per layer half; "sync": it waits for every operator (a barrier
        #: after each node; the A/B reference)
        self.dispatch = dispatch
        self._pending: list = []   # (ref, on_result or None), queued calls not yet waited for
        self._part = None          # the layer half whose calls are queued
        self._names = {n.name: n.attrs["name"] for n in model.graph.linears()}
        self._node_of = {v: k for k, v in self._names.items()}
        self._session = None
        self._start()

    def _start(self) -> None:
        self.runtime.start(self.W, self.model.init_args)
        self._all(lambda w: self.runtime.call(w, "set_cache_plaintexts", self.cache_plaintexts))

    def _all(self, fn, workers: Sequence[int] | None = None) -> list:
        """fn(w) on each worker, waited for (after everything queued before)."""
        self.flush()
        ws = range(self.W) if workers is None else workers
        return self.runtime.get([fn(w) for w in ws], timeout=self.timeout)

    def _each(self, fn, workers: Sequence[int] | None = None) -> None:
        """An operator's fn(w) on each worker: queued (async dispatch) or waited for (sync)."""
        ws = range(self.W) if workers is None else workers
        self._queue([(fn(w), None) for w in ws])

    def _queue(self, calls: list) -> None:
        self._pending += calls
        if self.dispatch == "sync":
            self.flush()

    def flush(self) -> None:
        """Wait for every queued call (a worker's error, death or stall surfaces here as
        HEError); then run their result handlers (the byte accounting)."""
        if not self._pending:
            return
        calls, self._pending = self._pending, []
        got = self.runtime.get([r for r, _h in calls], timeout=self.timeout)
        for (_r, on_result), g in zip(calls, got):
            if on_result is not None:
                on_result(g)

    # ---- sessions

    def open_session(self, preset: str, allow_insecure: bool, blobs: dict, slots: int, n: int,
                     required_steps: Sequence[int] | None = None) -> None:
        """Every worker loads the session's evaluation and bootstrapping keys, once, and checks
        them (`FheWorker.open_session`: HEError for a malformed blob or Galois keys that miss
        one of ``required_steps``).  The session is kept for `recover` only once every worker
        has loaded it."""
        shared = self.runtime.share(dict(blobs))
        steps = None if required_steps is None else [int(s) for s in required_steps]
        self._session = None
        self.pids = self._all(lambda w: self.runtime.call(w, "open_session", preset, allow_insecure, shared,
                                                          steps))
        self._session = (preset, allow_insecure, blobs, int(slots), int(n), steps)

    def close_session(self) -> None:
        self._all(lambda w: self.runtime.call(w, "close_session"))
        self._session = None

    def recover(self) -> None:
        """Replace the workers (after one died or stalled) and reload the session's keys."""
        self.runtime.shutdown()
        self._start()
        if self._session is not None:
            preset, insecure, blobs, slots, n, steps = self._session
            self.open_session(preset, insecure, blobs, slots, n, steps)

    def shutdown(self) -> None:
        self.runtime.shutdown()

    # ---- one pass

    def run(self, x_blobs: Sequence[bytes], packing: TokenPacking, outputs: Sequence[str] = ("hidden",),
            last_only: bool = False, on_layer=None, classify: bool = False) -> dict:
        """The pass's `outputs` from the client's encrypted input blocks (``classify``: the
        classifier's logits of an encoder, as `FheModel.classify`).  Returns {"outputs": {name:
        [ciphertext bytes per block]}, "collectives": [...], "bytes": ..., "workers": [...],
        "seconds": ...}."""
        if self._session is None:
            raise HEError("no session: open_session first")
        t0 = time.perf_counter()
        m = self.model
        self.collectives: list[Collective] = []
        self.part_seconds: dict[str, float] = {}
        self._pending, self._part = [], None  # nothing left from a failed pass
        self._n = self._session[4]
        self._all(lambda w: self.runtime.call(w, "new_pass", packing.offset == 0))
        self._all(lambda w: self.runtime.call(w, "reset_stats"))
        self._forms = self._plan_forms(packing) if self.placement == "aegis" and self.W > 1 else {}
        self._key = 0
        n_blocks = len(x_blobs)
        holders = self._layout(n_blocks, replicated=self.placement in _REPLICATED_INPUT)
        x = DistValue(self._new_key(m.input_value), self._input_width(n_blocks, packing), holders)
        pk = (packing.slots, packing.tokens, packing.tp_min, packing.offset)
        bound = m.bound(m.input_value)
        self._all(lambda w: self.runtime.call(w, "put", x.key, {i: x_blobs[i] for i in x.on(w)}, x.d, pk, bound,
                                              None), x.workers())
        positions = list(range(packing.offset, packing.end))
        ctx = {"pos0": packing.offset, "T": packing.tokens, "positions": positions, "last_only": last_only}
        if m.graph.kind == "encoder":
            ctx["B"] = None
        self._ctx, self._pk = ctx, packing
        want = ("hidden",) if classify else tuple(outputs)
        need = m.executor.needed(m.graph.outputs[r] for r in want)
        client = {nd.name for nd in m.client}
        nodes = [nd for nd in m.graph.nodes if nd.name in need and nd.name not in client]
        walk = _Walk(m.graph, m.params, linear=_DistLinear(self), backend=_DistBackend(self))

        def layer_done(layer, n_layers):
            self._end_part()  # the layer's queued calls are done before its progress is reported
            if on_layer is not None:
                on_layer(layer, n_layers)

        walk.on_layer = layer_done
        vals = walk.run_nodes(nodes, {m.input_value: x}, ctx, _DistCache(self))
        res = {r: vals[m.graph.outputs[r]] for r in want}
        if classify:
            res = {"logits": self.timed("pool", self._classify, res["hidden"])}
        self._end_part()
        out = {r: self._collect(v) for r, v in res.items()}
        stats = self._all(lambda w: self.runtime.call(w, "stats"))
        return {"outputs": out, "collectives": [c.to_dict() for c in self.collectives],
                "bytes": sum(c.bytes for c in self.collectives), "workers": stats,
                "seconds": time.perf_counter() - t0, "part_seconds": dict(self.part_seconds),
                "placement": self.placement, "W": self.W}

    def _input_width(self, n_blocks: int, packing: TokenPacking) -> int:
        from .fhe_executor import client_embedding, client_tensors

        if not hasattr(self, "_d_in"):
            self._d_in = int(client_embedding(self.model.graph, client_tensors(self.model), [0]).shape[1])
        if packing.n_cts(self._d_in) != n_blocks:
            raise HEError(f"the input has {n_blocks} blocks, the model's width {self._d_in} needs "
                          f"{packing.n_cts(self._d_in)}")
        return self._d_in

    def _plan_forms(self, packing: TokenPacking) -> dict:
        """{linear name: "gather" | "reduce"} from the compile pass's plan (AEGIS 4.2)."""
        plan = aegis_placement.run(self.model.graph, self.W, packing.tokens, slots=packing.slots, n=self._n)
        forms = {}
        for c in plan.collectives():
            if c.form in ("gather", "reduce"):
                for node in c.node.split(","):
                    if node in self._names:
                        forms[self._names[node]] = c.form
        return forms

    def _new_key(self, name: str) -> str:
        self._key += 1
        return f"{name}#{self._key}"

    def _layout(self, n_blocks: int, replicated: bool = False) -> list:
        if replicated:
            return [tuple(range(self.W))] * n_blocks
        return [(w,) for w in split_owners(n_blocks, self.W)]

    def timed(self, node_name: str, fn, *args):
        """fn(*args), its wall time added to the node's layer and part (`part_of`).  With async
        dispatch the calls of one layer half are waited for when the next half starts, and
        that wait is booked to the half that queued them."""
        key = part_key(node_name)
        if key != self._part:
            self._end_part()
            self._part = key
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.part_seconds[key] = self.part_seconds.get(key, 0.0) + time.perf_counter() - t0

    def _end_part(self) -> None:
        """Wait for the queued calls, booking the wait to the layer half that queued them."""
        t0 = time.perf_counter()
        try:
            self.flush()
        finally:
            if self._part is not None:
                self.part_seconds[self._part] = self.part_seconds.get(self._part, 0.0) + time.perf_counter() - t0
            self._part = None

    # ---- traffic

    def _collective(self, kind: str, form: str, node: str) -> Collective:
        c = Collective(len(self.collectives) + 1, kind, form, node, part_of(node), _layer_of(node))
        self.collectives.append(c)
        return c

    def _send(self, c: Collective, key: str, moves: dict) -> None:
        """moves: {(src, dst): [blocks]} of value `key`, all at once (each destination
        receives from each source in one message)."""
        calls = []
        for (src, dst), blocks in sorted(moves.items()):
            if not blocks:
                continue
            exp = self.runtime.call(src, "export", key, list(blocks))
            calls.append((self.runtime.call(dst, "receive", key, exp), self._counter(c, src, dst, len(blocks))))
        self._queue(calls)

    def _counter(self, c: Collective, src: int, dst: int, k: int):
        """The handler that books one received message ((bytes, levels) from `receive`)."""
        def book(got) -> None:
            nbytes, levels = got
            c.sends[(src, dst)] += k
            c.cts += k
            c.bytes += int(nbytes)
            c.levels += levels
            c.formula_bytes += sum(ct_bytes(lv, self._n) for lv in levels)
        return book

    def _align(self, v: DistValue, holders: list, node: str, kind: str = "P2P", form: str = "relayout") -> DistValue:
        """`v` with (at least) the given holders per block: the missing copies sent P2P (or
        as the collective ``kind`` / ``form`` the caller names)."""
        moves = defaultdict(list)
        for i, (have, want) in enumerate(zip(v.holders, holders)):
            for w in want:
                if w not in have:
                    moves[(have[0], w)].append(i)
        if moves:
            self._send(self._collective(kind, form, node), v.key, moves)
        return DistValue(v.key, v.d, [tuple(sorted(set(h) | set(t))) for h, t in zip(v.holders, holders)], v.scores)

    # ---- operators

    def local(self, op: str, node, ins: list, n_out: int = 1, scores: bool = False) -> list:
        """A slot-wise or head-local node: each worker on its blocks of the first input (the
        others aligned to it)."""
        first = next(v for v in ins if not v.scores) if any(not v.scores for v in ins) else ins[0]
        ins = [v if v is first or v.scores else self._align(v, first.holders, node.name) for v in ins]
        lay = first.holders
        outs = [DistValue(self._new_key(o), first.d, list(lay), scores) for o in node.outputs[:n_out]]
        ws = sorted({w for h in lay for w in h})
        ctx = self._ctx
        self._each(lambda w: self.runtime.call(w, "local", op, node.name, [v.key for v in ins], [o.key for o in outs],
                                              first.span(w), ctx), ws)
        return outs

    def linear(self, x: DistValue, names: Sequence[str]) -> list[DistValue]:
        P = self._pk
        W = self.W
        outs = []
        if W == 1 or x.replicated(W):  # column-parallel: every worker has the whole input
            form = "gather"
        elif self.placement == "megatron":
            form = "allreduce"
        elif self.placement == "hydra":
            form = "gather"
        else:
            form = self._forms.get(names[0], "gather")
        if form == "gather":
            receivers = set()
            lays = {}
            for name in names:
                d_out = self.model.weights(name)[0].shape[0]
                lays[name] = (d_out, self._layout(P.n_cts(d_out)))
                receivers |= {w for h in lays[name][1] for w in h}
            node = ",".join(self._node_of.get(n, n) for n in names)
            missing = {w: [i for i, h in enumerate(x.holders) if w not in h] for w in receivers}
            if any(missing.values()):
                # the owners refresh first: a gathered block is bootstrapped once, not by every receiver
                need = max(self._linear_levels(n) for n in names)
                self._each(lambda w: self.runtime.call(w, "prepare", x.key, need, node), x.workers())
                moves = defaultdict(list)
                for w, blocks in missing.items():
                    for i in blocks:
                        moves[(x.holders[i][0], w)].append(i)
                self._send(self._collective("AllGather", "gather", node), x.key, moves)
            for name in names:
                d_out, lay = lays[name]
                y = DistValue(self._new_key(name), d_out, lay)
                self._each(lambda w: self.runtime.call(w, "linear_rows", name, x.key, y.key, y.span(w), d_out),
                          y.workers())
                outs.append(y)
            return outs
        for name in names:  # reduce / allreduce: partial outputs from each worker's input blocks
            d_out = self.model.weights(name)[0].shape[0]
            n_out = P.n_cts(d_out)
            node = self._node_of.get(name, name)
            lay = self._layout(n_out, replicated=form == "allreduce")
            part = self._new_key(name + ".partial")
            srcs = x.workers()
            bias = {w: (self._bias_span(lay, w) if form == "reduce" else ((0, n_out) if w == srcs[0] else None))
                    for w in srcs}
            self._each(lambda w: self.runtime.call(w, "linear_partial", name, x.key, f"{part}@{w}", bias[w], d_out),
                      srcs)
            kind = "ReduceScatter" if form == "reduce" else "AllReduce"
            c = self._collective(kind, form, node)
            for src in srcs:
                moves = defaultdict(list)
                for i, h in enumerate(lay):
                    for dst in h:
                        if dst != src:
                            moves[(src, dst)].append(i)
                self._send(c, f"{part}@{src}", moves)
            y = DistValue(self._new_key(name), d_out, lay)
            self._each(lambda w: self.runtime.call(w, "add_partials", y.key, [f"{part}@{s}" for s in srcs], y.span(w)),
                      y.workers())
            outs.append(y)
        return outs

    def _bias_span(self, lay: list, w: int):
        b = [i for i, h in enumerate(lay) if w in h]
        return (b[0], b[-1] + 1) if b else None

    def _linear_levels(self, name: str) -> int:
        b = self.model.bound_of_linear(name)
        from cipherlm.protocols.ckks.evaluator import LEVEL0_MAX_FACTOR, pow2_at_least

        return 1 + (1 if pow2_at_least(b) > LEVEL0_MAX_FACTOR else 0)

    def normalise(self, op: str, node_name: str, x: DistValue) -> DistValue:
        """A norm (or the pooling): local partial sums, their AllReduce among the holders,
        then each holder's own blocks (a replicated input: every worker alone, no bytes).
        Hydra gathers the stream onto every worker first (its layer-boundary aggregation)."""
        if self.placement == "hydra" and self.W > 1 and not x.replicated(self.W):
            x = self._align(x, [tuple(range(self.W))] * len(x.holders), node_name, "AllGather", "boundary")
        ws = x.workers()
        rep = x.replicated(self.W)
        y = DistValue(self._new_key(node_name), x.d, list(x.holders))
        sums = {w: f"{y.key}.sums@{w}" for w in ws}
        self._each(lambda w: self.runtime.call(w, "norm_sums", op, node_name, x.key, sums[w]), ws)
        if not rep and len(ws) > 1:
            c = self._collective("AllReduce", "norm-sum", node_name)
            for src in ws:
                self._send(c, sums[src], {(src, dst): [0, 1] if op == "layer_norm" else [0]
                                          for dst in ws if dst != src})
        keys = (lambda w: [sums[w]]) if rep else (lambda w: [sums[s] for s in ws])
        self._each(lambda w: self.runtime.call(w, "norm_finish", op, node_name, x.key, keys(w), y.key), ws)
        return y

    def _classify(self, h: DistValue) -> DistValue:
        emb = self.normalise("pool", "pool", h)
        return self.linear(emb, ["classifier"])[0]

    def _collect(self, v: DistValue) -> list[bytes]:
        """The result's blocks, from one holder each (the client's download)."""
        by = defaultdict(list)
        for i, h in enumerate(v.holders):
            by[h[0]].append(i)
        got = self.runtime.get([self.runtime.call(w, "export", v.key, b) for w, b in sorted(by.items())],
                               timeout=self.timeout)
        out = {}
        for g in got:
            out.update(g["blobs"])
        return [out[i] for i in range(len(v.holders))]


class _DistLinear:
    def __init__(self, ex: AegisExecutor):
        self.ex = ex

    def linear(self, x, names):
        return self.ex.timed(self.ex._node_of.get(names[0], names[0]), self.ex.linear, x, names)


class _DistBackend:
    """The graph's non-projection operators, distributed."""

    def __init__(self, ex: AegisExecutor):
        self.ex = ex

    def layer_norm(self, node, x, ctx):
        return self.ex.timed(node.name, self.ex.normalise, "layer_norm", node.name, x)

    def rms_norm(self, node, x, ctx):
        return self.ex.timed(node.name, self.ex.normalise, "rms_norm", node.name, x)

    def qk(self, node, q, k, ctx):
        return self.ex.timed(node.name, self.ex.local, "qk", node, [q, k], 1, True)[0]

    def softmax(self, node, s, ctx):
        return self.ex.timed(node.name, self.ex.local, "softmax", node, [s], 1, True)[0]

    def __getattr__(self, op):
        if op.startswith("_"):
            raise AttributeError(op)
        return lambda node, *ins, ctx: self.ex.timed(node.name, self.ex.local, op, node, list(ins))[0]


class _DistCache:
    def __init__(self, ex: AegisExecutor):
        self.ex = ex

    def append_node(self, node, k, v):
        return tuple(self.ex.timed(node.name, self.ex.local, "kv_cache", node, [k, v], 2))


class _Walk(GraphExecutor):
    on_layer = None

    def _layer_done(self, layer, ctx) -> None:
        if self.on_layer is not None and layer is not None:
            self.on_layer(layer, self.graph.n_layers)
