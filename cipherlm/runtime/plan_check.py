"""What a client accepts from a server before it runs anything: the welcomes and the 2pc plan.

In the 2pc mode (BLB sections 2-3, CryptoMoE section 2.2's semi-honest setting) the
server's welcome carries the *plan* (`cipherlm.runtime.twopc.public_plan`): the public
structure choices both parties run.  Some of them decide what the client's run reveals:
CryptoMoE's ``insecure`` baseline (`cipherlm.moe.baselines`, CryptoMoE section 3) opens
every token's routing to both parties, so a client that ran whatever variant the server
names could be downgraded by one field.  The client therefore *allow-lists* the plan:

=============  ===========================================================================
key            accepted
=============  ===========================================================================
embedding      a secure lookup: ``onehot-linear`` (the client's one-hot through the linear
               protocol) or one of FastQuery's methods (`cipherlm.protocols.embedding.METHODS`)
               that `twopc.embedding_backend` can choose (``auto`` is resolved by the server
               and never appears in a plan)
linear         ``{packing, network}``: packing in `twopc.LINEAR_PACKINGS`, network a preset of
               `cipherlm.net.netmodel.PRESETS`
moe            MoE decoders only: ``{variant: "cryptomoe", capacity}``, capacity a finite
               positive number; any other variant (``insecure``, the baselines) is refused
classes        encoders only: None or an int in 1..`MAX_CLASSES`
fold_norms     decoders only: a bool
fusion         one of `twopc.FUSIONS` (absent: ``none``)
blb_activation with ``fusion`` ``blb`` only: one of `twopc.BLB_ACTIVATIONS` (absent: ``gate``);
               both choices are secure (the same protocols, placed differently)
blb_norms      with ``fusion`` ``blb`` only: ``split`` or ``whole`` (``auto`` is resolved by the
               server; absent: ``split``); both secure, like ``blb_activation``
blb_exp        with ``fusion`` ``blb`` only: one of `twopc.BLB_EXPS` (absent: ``core``); both
               secure, like ``blb_activation``
blb_value_bits with ``fusion`` ``blb`` only: an int in [12, 20), the public bound 2^b on a
               block input's |value| the conversions encode for (absent: 12)
=============  ===========================================================================

No other key is accepted, and which keys must be there follows from the model config
(encoder / dense decoder / MoE decoder).  The welcome itself is type-checked strictly
(`check_twopc_welcome`, `check_offload_welcome`): a field of the wrong type is a
`ProtocolError`, never a crash later in the run.  Welcome keys the client does not read
are ignored (a newer server may add some); the plan's are not.  Values the caller compares itself
(protocol version, mode, config digest, ring) are only type-checked here.

HE parameter sets: in the offload mode the server proposes them (``he_params``);
`cipherlm.he.serialize.params_from_bytes` and `offload_engine.ClientEngine` check them
at 128-bit security (`cipherlm.he.params.check_security`) before any key is made.  The
2pc mode receives none: its BFV set is fixed (`cipherlm.mpc.he_session.TWOPC_BFV`)
and the embedding's parameters are planned by the client inside the 128-bit table.
"""

from __future__ import annotations

import math

from cipherlm.runtime.offload_protocol import ProtocolError

#: the MoE variants a client runs (CryptoMoE's balanced routing and secure dispatch only)
MOE_VARIANTS = ("cryptomoe",)
#: the largest classifier width a client accepts in a plan
MAX_CLASSES = 1 << 16
#: the largest projection dimension / token limit an offload or 2pc welcome may announce
MAX_DIM = 1 << 24
#: the HE backends an offload welcome may name (``he_backend``; `cipherlm.he.matmul.OFFLOAD_BACKENDS`)
OFFLOAD_HE_BACKENDS = ("seal", "lattigo")
PLAN_KEYS = frozenset({"embedding", "linear", "moe", "classes", "fold_norms", "fusion", "blb_activation", "blb_exp",
                       "blb_norms", "blb_value_bits"})

__all__ = ["check_twopc_plan", "check_twopc_welcome", "check_offload_welcome", "secure_embedding_methods",
           "load_tokenizer", "MOE_VARIANTS", "PLAN_KEYS"]


# --------------------------------------------------------------------------- type helpers


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(v, what: str, lo: int = 0, hi: int = MAX_DIM) -> int:
    if not _is_int(v) or not lo <= v <= hi:
        raise ProtocolError(f"{what} must be an integer in {lo}..{hi}, got {_short(v)}")
    return v


def _str(v, what: str) -> str:
    if not isinstance(v, str):
        raise ProtocolError(f"{what} must be a string, got {type(v).__name__}")
    return v


def _dict(v, what: str) -> dict:
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise ProtocolError(f"{what} must be a dict with string keys, got {type(v).__name__}")
    return v


def _list(v, what: str) -> list:
    if not isinstance(v, list):
        raise ProtocolError(f"{what} must be a list, got {type(v).__name__}")
    return v


def _short(v) -> str:
    return repr(v)[:80]


def _json_only(v, what: str, depth: int = 0) -> None:
    """`v` holds only JSON values (a model config: no bytes, no arrays)."""
    if depth > 64:
        raise ProtocolError(f"{what} is nested too deeply")
    if v is None or isinstance(v, (bool, int, str)):
        return
    if isinstance(v, float):
        return
    if isinstance(v, list):
        for x in v:
            _json_only(x, what, depth + 1)
        return
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise ProtocolError(f"{what} has a non-string key")
            _json_only(x, what, depth + 1)
        return
    raise ProtocolError(f"{what} holds a {type(v).__name__}: only JSON values are allowed")


def _labels(v, what: str = "labels") -> list | None:
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v) or len(v) > MAX_CLASSES:
        raise ProtocolError(f"{what} must be None or a list of strings")
    return v


# --------------------------------------------------------------------------- the 2pc plan


def secure_embedding_methods() -> frozenset:
    """The embedding methods a client runs: the dense one-hot baseline, and FastQuery's
    methods that `twopc.embedding_backend` may resolve to (all of them private lookups)."""
    from cipherlm.runtime import twopc

    methods = {"onehot-linear"}
    try:
        from cipherlm.protocols import embedding as E
    except ImportError:
        return frozenset(methods)
    return frozenset(methods | {m for m in twopc.EMBEDDING_METHODS if m != "auto" and m in E.METHODS})


def _model_kind(config: dict) -> tuple[str, bool]:
    """("encoder" | "decoder", has MoE layers) of a model config, as the executor sees it."""
    from cipherlm.runtime import twopc

    try:
        kind, has_moe, _ = twopc.model_kind(config)
    except Exception as exc:  # a config the 2pc executor cannot run
        raise ProtocolError(f"the server's model config cannot run in the 2pc mode: {type(exc).__name__}: "
                            f"{str(exc)[:200]}") from None
    return kind, has_moe


def check_twopc_plan(plan, config: dict | None = None) -> dict:
    """Allow-list a 2pc plan from a server (see the module docstring); return a clean copy.

    With `config` the plan's keys must also match the model: ``classes`` for an encoder,
    ``fold_norms`` (and ``moe`` exactly when the model has MoE layers) for a decoder.
    Anything else raises `ProtocolError`."""
    from cipherlm.net.netmodel import PRESETS
    from cipherlm.runtime import twopc

    plan = _dict(plan, "the plan")
    unknown = sorted(set(plan) - PLAN_KEYS)
    if unknown:
        raise ProtocolError(f"the plan has unknown keys {[k[:40] for k in unknown[:5]]}")
    out: dict = {}

    emb = plan.get("embedding")
    allowed = secure_embedding_methods()
    if not isinstance(emb, str) or emb not in allowed:
        raise ProtocolError(f"the plan's embedding method {_short(emb)} is not one this client runs "
                            f"({sorted(allowed)})")
    out["embedding"] = emb

    lin = _dict(plan.get("linear"), "the plan's linear settings")
    if set(lin) != {"packing", "network"}:
        raise ProtocolError(f"the plan's linear settings must be {{packing, network}}, got {sorted(lin)[:5]}")
    if not isinstance(lin["packing"], str) or lin["packing"] not in twopc.LINEAR_PACKINGS:
        raise ProtocolError(f"unknown linear packing {_short(lin['packing'])}; one of {twopc.LINEAR_PACKINGS}")
    if not isinstance(lin["network"], str) or lin["network"] not in PRESETS:
        raise ProtocolError(f"unknown network preset {_short(lin['network'])}")
    out["linear"] = {"packing": lin["packing"], "network": lin["network"]}

    if "moe" in plan:
        moe = _dict(plan["moe"], "the plan's MoE settings")
        if set(moe) != {"variant", "capacity"}:
            raise ProtocolError(f"the plan's MoE settings must be {{variant, capacity}}, got {sorted(moe)[:5]}")
        if not isinstance(moe["variant"], str) or moe["variant"] not in MOE_VARIANTS:
            raise ProtocolError(f"MoE variant {_short(moe['variant'])} refused: this client runs "
                                f"{MOE_VARIANTS} only (the others open the routing or are benchmarks)")
        c = moe["capacity"]
        if not isinstance(c, (int, float)) or isinstance(c, bool) or not (math.isfinite(c) and c > 0):
            raise ProtocolError(f"MoE capacity must be a finite positive number, got {_short(c)}")
        out["moe"] = {"variant": moe["variant"], "capacity": float(c)}

    if "classes" in plan:
        c = plan["classes"]
        if c is not None:
            _int(c, "the plan's classes", 1, MAX_CLASSES)
        out["classes"] = c
    if "fold_norms" in plan:
        if not isinstance(plan["fold_norms"], bool):
            raise ProtocolError(f"the plan's fold_norms must be a bool, got {_short(plan['fold_norms'])}")
        out["fold_norms"] = plan["fold_norms"]

    if "fusion" in plan:  # absent: "none" (plans of servers before BLB)
        f = plan["fusion"]
        if not isinstance(f, str) or f not in twopc.FUSIONS:
            raise ProtocolError(f"unknown fusion {_short(f)}; one of {twopc.FUSIONS}")
        if f == "blb" and "fold_norms" in out:
            raise ProtocolError("BLB fusion in a decoder plan (this client runs it for encoders only)")
        out["fusion"] = f
    # absent with BLB: "gate" / "split" (plans of servers before the choice)
    for key, what, choices in (("blb_activation", "activation split", twopc.BLB_ACTIVATIONS),
                               ("blb_norms", "norm split", twopc.BLB_NORM_SPLITS),
                               ("blb_exp", "exp split", twopc.BLB_EXPS)):
        if key in plan:
            a = plan[key]
            if out.get("fusion") != "blb":
                raise ProtocolError(f"a BLB {what} in a plan without BLB fusion")
            if not isinstance(a, str) or a not in choices:
                raise ProtocolError(f"unknown BLB {what} {_short(a)}; one of {choices}")
            out[key] = a
    if "blb_value_bits" in plan:  # absent with BLB: 12 (plans of servers before the bound)
        from cipherlm.compile.passes.blb_params import OUT_VALUE_BITS

        b = plan["blb_value_bits"]
        if out.get("fusion") != "blb":
            raise ProtocolError("a BLB value bound in a plan without BLB fusion")
        if type(b) is not int or not twopc.BLB_MIN_VALUE_BITS <= b < OUT_VALUE_BITS:
            raise ProtocolError(f"BLB value bits {_short(b)} not an int in [{twopc.BLB_MIN_VALUE_BITS}, "
                                f"{OUT_VALUE_BITS})")
        out["blb_value_bits"] = b

    if config is None:
        if ("classes" in out) == ("fold_norms" in out):
            raise ProtocolError("a plan has either classes (encoder) or fold_norms (decoder)")
        if "moe" in out and "fold_norms" not in out:
            raise ProtocolError("MoE settings in an encoder plan")
        return out
    kind, moe_model = _model_kind(_dict(config, "the model config"))
    want = {"embedding", "linear"} | ({"classes"} if kind == "encoder" else {"fold_norms"})
    if moe_model:
        want.add("moe")
    blb_keys = {"fusion", "blb_activation", "blb_norms", "blb_exp", "blb_value_bits"}
    if set(out) - blb_keys != want or (out.get("fusion") == "blb" and kind != "encoder"):
        raise ProtocolError(f"the plan's keys {sorted(out)} do not fit this {'MoE ' if moe_model else ''}{kind} "
                            f"(expected {sorted(want)})")
    return out


# --------------------------------------------------------------------------- the tokenizer


def load_tokenizer(text):
    """A `tokenizers.Tokenizer` from the JSON a server sent (the 2pc welcome's ``tokenizer``,
    the offload bundle's); anything that does not load is a `ProtocolError`.  The Rust
    parser's errors are plain ``Exception``s, and a panic inside it is pyo3's
    ``PanicException``, a ``BaseException``: both are turned into `ProtocolError`."""
    from tokenizers import Tokenizer

    if not isinstance(text, str):
        raise ProtocolError(f"the tokenizer must be a JSON string, got {type(text).__name__}")
    try:
        return Tokenizer.from_str(text)
    except Exception as exc:
        raise ProtocolError(f"the server's tokenizer does not load: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:120] if str(exc) else ''}") from None
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":  # KeyboardInterrupt, SystemExit, ... pass
            raise
        raise ProtocolError("the server's tokenizer does not load: the parser panicked") from None


# --------------------------------------------------------------------------- welcomes


def check_twopc_welcome(w) -> dict:
    """Type-check a 2pc welcome strictly and allow-list its plan (`check_twopc_plan`).

    Returns the welcome with the checked plan.  Keys beyond the known ones are ignored
    (the client reads none); ``limits`` must hold int ``max_tokens`` / ``max_new_tokens``
    and numbers only."""
    w = _dict(w, "the welcome")
    if not _is_int(w.get("protocol")):
        raise ProtocolError(f"the welcome's protocol must be an int, got {_short(w.get('protocol'))}")
    _str(w.get("mode"), "the welcome's mode")
    _str(w.get("model"), "the model name")
    cfg = _dict(w.get("config"), "the model config")
    _json_only(cfg, "the model config")
    if not isinstance(cfg.get("model_type"), str):
        raise ProtocolError("the model config has no model_type")
    _str(w.get("config_digest"), "the config digest")
    ring = _dict(w.get("ring"), "the ring")
    if set(ring) != {"bits", "frac"} or not all(_is_int(v) for v in ring.values()):
        raise ProtocolError("the ring must be {bits: int, frac: int}")
    plan = check_twopc_plan(w.get("plan"), cfg)
    labels = _labels(w.get("labels"))
    if labels is not None and plan.get("classes") is not None and len(labels) != plan["classes"]:
        raise ProtocolError(f"{len(labels)} labels for {plan['classes']} classes")
    if w.get("tokenizer") is not None:
        _str(w.get("tokenizer"), "the tokenizer")
    limits = _limits(w.get("limits"))
    for key in ("max_tokens", "max_new_tokens"):
        _int(limits.get(key), f"limits.{key}", 1)
    return dict(w, plan=plan)


def _limits(v) -> dict:
    """A welcome's ``limits``: a dict of numbers (None: no limit; the server's own limits,
    `session_server.ServerLimits`, may add fields the client only reports)."""
    limits = _dict(v, "the limits")
    for key, x in limits.items():
        if x is not None and (not isinstance(x, (int, float)) or isinstance(x, bool)
                              or (isinstance(x, float) and not math.isfinite(x)) or x < 0):
            raise ProtocolError(f"limits.{key[:40]} must be a non-negative number or None")
    return limits


def _check_matmul_plan(d, what: str) -> dict:
    import dataclasses

    from cipherlm.he.matmul import MatmulPlan

    d = _dict(d, what)
    names = {f.name for f in dataclasses.fields(MatmulPlan)}
    required = names - {"splits", "tokens", "real_input", "in_cts"}
    if not required <= set(d) or not set(d) <= names:
        raise ProtocolError(f"{what} must have the fields {sorted(required)} (and splits)")
    for k, v in d.items():
        if k in ("has_bias", "real_input"):
            if not isinstance(v, bool):
                raise ProtocolError(f"{what}.{k} must be a bool")
        elif k == "splits":
            for s in _list(v, f"{what}.splits"):
                _int(s, f"{what}.splits[]", 1)
        else:
            _int(v, f"{what}.{k}", 0)
    return d


def check_offload_welcome(w, protocol_version: int) -> dict:
    """Type-check an offload welcome strictly (``fhe_offload_llama_003`` sections 4-6's
    set-up message, `cipherlm.runtime.offload_server.ModelHost.welcome`).

    The HE parameters stay bytes here: `offload_engine.ClientEngine` parses them and checks
    128-bit security before it makes a key; the plans' consistency with the groups is
    checked there as well."""
    w = _dict(w, "the welcome")
    p = w.get("protocol")
    if not _is_int(p) or p != protocol_version:
        raise ProtocolError(f"server speaks protocol {_short(p)}, this client {protocol_version}")
    _str(w.get("model"), "the model name")
    cfg = _dict(w.get("config"), "the model config")
    _json_only(cfg, "the model config")
    groups = _list(w.get("groups"), "groups")
    if not groups:
        raise ProtocolError("the server offers no projection groups")
    for i, g in enumerate(groups):
        g = _dict(g, f"groups[{i}]")
        if set(g) != {"names", "d_in", "d_outs"}:
            raise ProtocolError(f"groups[{i}] must be {{names, d_in, d_outs}}")
        names = _list(g["names"], f"groups[{i}].names")
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ProtocolError(f"groups[{i}].names must be a non-empty list of names")
        _int(g["d_in"], f"groups[{i}].d_in", 1)
        d_outs = _list(g["d_outs"], f"groups[{i}].d_outs")
        if len(d_outs) != len(names):
            raise ProtocolError(f"groups[{i}] has {len(names)} names and {len(d_outs)} output sizes")
        for d in d_outs:
            _int(d, f"groups[{i}].d_outs[]", 1)
    digest = _str(w.get("bundle_digest"), "the bundle digest")
    if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        raise ProtocolError("server sent a malformed bundle digest")
    _labels(w.get("labels"))
    hb = w.get("he_backend")  # absent: SEAL (a SEAL server's welcome has no such field)
    if hb is not None and (not isinstance(hb, str) or hb not in OFFLOAD_HE_BACKENDS):
        raise ProtocolError(f"the server's HE backend {_short(hb)} is not one of {OFFLOAD_HE_BACKENDS}")
    if not isinstance(w.get("he_params"), bytes):
        raise ProtocolError("he_params must be bytes")
    head = w.get("client_lm_head")  # absent: the server serves the LM head (or there is none)
    if head is not None:
        _str(head, "client_lm_head")
    hr = w.get("half_ring_results")  # absent: every result in the full ring
    if hr is not None and (not (hr is True or hr == "even") or hb != "lattigo"):
        raise ProtocolError('half_ring_results must be true or "even", and only from a Lattigo server')
    plans = _list(w.get("plans"), "plans")
    for i, d in enumerate(plans):
        _check_matmul_plan(d, f"plans[{i}]")
    for i, ids in enumerate(_list(w.get("parts"), "parts")):
        for pid in _list(ids, f"parts[{i}]"):
            _int(pid, f"parts[{i}][]", 0, max(0, len(plans) - 1))
    for s in _list(w.get("rotation_steps"), "rotation_steps"):
        _int(s, "rotation_steps[]", -MAX_DIM, MAX_DIM)
    if w.get("packed") is not None:  # the prefill's packed plans (absent: rows one by one)
        pk = _dict(w["packed"], "packed")
        if set(pk) != {"tokens", "plans", "groups"}:
            raise ProtocolError("packed must be {tokens, plans, groups}")
        tokens = _int(pk["tokens"], "packed.tokens", 2, 4096)
        if tokens & (tokens - 1):
            raise ProtocolError("packed.tokens must be a power of two")
        pplans = _list(pk["plans"], "packed.plans")
        for i, d in enumerate(pplans):
            t = _check_matmul_plan(d, f"packed.plans[{i}]").get("tokens")
            if not (_is_int(t) and 2 <= t <= tokens and not t & (t - 1)):
                raise ProtocolError(f"packed.plans[{i}] must pack a power of two of 2..{tokens} tokens")
        for k in _list(pk["groups"], "packed.groups"):
            _int(k, "packed.groups[]", -1, max(0, len(pplans) - 1))
    if w.get("limits") is not None:
        _limits(w["limits"])
    return w
