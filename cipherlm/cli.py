"""cipherlm command line: models | generate | classify | inspect | serve | proxy | demo | bench.

Every run command accepts ``--report FILE`` (JSON) and ``--plot FILE`` (PNG of
the per-operator-class breakdown).
"""

from __future__ import annotations

import argparse
import sys

from cipherlm import __version__
from cipherlm.launch import DEFAULT_DECODER, DEFAULT_ENCODER, DEFAULT_PROMPT, MODES

#: the client commands' modes: the session modes and fhe (whole blocks on ciphertexts, docs/fhe.md)
RUN_MODES = MODES + ("fhe",)
FHE_PRESETS = ("N16QP1546H192H32", "test-insecure-N1024")


def _network_presets() -> tuple[str, ...]:
    from cipherlm.net.netmodel import PRESETS

    return tuple(PRESETS)


def _add_packing_args(p: argparse.ArgumentParser, where: str) -> None:
    p.add_argument("--linear-packing", default="coeff", choices=("coeff", "simd", "auto"),
                   help=f"{where}: HE packing of the linear layers: coeff (Cheetah coefficient packing, "
                        "fastest here), simd (BOLT-style BSGS, fewer bytes) or auto (per layer by a cost model "
                        "of products, rotations and bytes; the choices go to the report)")
    p.add_argument("--packing-network", default="LAN", choices=_network_presets(),
                   help=f"{where}: network preset the packing cost model, the SIMD plans and (serve) "
                        "--fusion auto assume (LAN / WAN: CryptoMoE's; blb-LAN, blb-WAN1..3: BLB's "
                        "section 7.1; default LAN)")


def _add_report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", metavar="FILE", help="write a JSON report of the run")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of the per-operator breakdown")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: from the OS CSPRNG)")
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the model's chat template")


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """The servers' resource limits (cipherlm.runtime.session_server.ServerLimits; docs/reliability.md).
    Every default is None: the mode's own default applies."""
    p.add_argument("--max-sessions", type=int, default=None,
                   help="sessions open at once; beyond it a client gets 'server busy' (default: offload 16, 2pc 8)")
    p.add_argument("--max-sessions-per-address", type=int, default=None,
                   help="sessions open at once from one client IP address (default 4)")
    p.add_argument("--session-lifetime", type=float, default=None,
                   help="seconds a session may last in all, however active (default: offload 28800, 2pc 86400)")
    p.add_argument("--hello-timeout", type=float, default=None,
                   help="seconds a new connection has to send its hello (default 30)")
    p.add_argument("--pre-hello-max-frame", type=int, default=None,
                   help="largest frame in bytes accepted before the hello (default 65536)")
    p.add_argument("--max-frame", type=int, default=None,
                   help="largest frame in bytes accepted after the hello (default 1 GiB)")
    p.add_argument("--max-cts-per-request", type=int, default=None,
                   help="offload: ciphertexts (token rows) in one linear request (default 512)")
    p.add_argument("--max-work-per-session", type=int, default=None,
                   help="offload: ciphertexts one session may have evaluated in all (default 1048576)")


def _add_fhe_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fhe-preset", default=FHE_PRESETS[0], choices=FHE_PRESETS,
                   help="fhe: the CKKS bootstrapping preset (default N16QP1546H192H32: 128-bit, 2^15 slots, "
                        "bootstrapping keys ~7.9 GB per session; test-insecure-N1024 is INSECURE and needs "
                        "--insecure-test-preset)")
    p.add_argument("--insecure-test-preset", action="store_true",
                   help="fhe: allow the INSECURE test preset (no security at all; for tests only)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="fhe: the most tokens one encrypted pass takes (the Galois keys are made for it; "
                        "default 32)")


def _add_fhe_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--insecure-ok", action="store_true",
                   help="fhe: accept a server on the INSECURE test preset (tests only; refused by default)")
    _add_fhe_refresh_arg(p)


def _add_fhe_refresh_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--refresh", choices=("bootstrap", "client"), default="bootstrap",
                   help="fhe: how ciphertexts that run out of levels are refreshed: bootstrap (default; the "
                        "server bootstraps, nothing travels during a pass; ~7.9 GB of bootstrapping keys per "
                        "session) or client (no bootstrapping keys: the server sends masked ciphertexts for "
                        "the client to re-encrypt, one round trip per refresh; docs/fhe.md)")


def _server_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cipherlm", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"cipherlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("models", help="list the models available on this machine")

    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("prompt")
    g.add_argument("--mode", choices=RUN_MODES, default="plain")
    g.add_argument("--model", default=DEFAULT_DECODER, help="model name or path (plain mode)")
    g.add_argument("--server", type=_server_address, help="HOST:PORT of a `cipherlm serve` (offload / 2pc / fhe mode)")
    _add_fhe_client_args(g)
    g.add_argument("--compare", action="store_true", help="also run the plaintext executor and report agreement")
    _add_sampling_args(g)
    _add_report_args(g)

    c = sub.add_parser("classify", help="classify sentences with a BERT model and its linear probe")
    c.add_argument("sentences", nargs="*", help="sentences to classify (default: the 200 polarity sentences)")
    c.add_argument("--mode", choices=RUN_MODES, default="plain")
    c.add_argument("--model", default=DEFAULT_ENCODER)
    c.add_argument("--server", type=_server_address)
    _add_fhe_client_args(c)
    c.add_argument("--limit", type=int, default=0, help="only the first N polarity sentences")
    c.add_argument("--compare", action="store_true", help="also run the plaintext executor and report agreement")
    _add_report_args(c)

    i = sub.add_parser("inspect", help="print a model's graph (nodes, shapes, parameter counts) and, with --mode, its plan and predicted costs")
    i.add_argument("model", help="model name (see `cipherlm models`) or path to an HF directory / .gguf file")
    i.add_argument("--all", action="store_true", help="every node (default: the nodes outside the layers and layer 0)")
    i.add_argument("--groups", action="store_true", help="also the projection groups (group_linears pass)")
    i.add_argument("--mode", choices=MODES + ("fhe",), default="plain",
                   help="also the mode's plan (offload: matmul plans and Galois key steps; 2pc: the public plan "
                        "and packing per layer) and the predicted bytes, rounds and HE operations per operator class; "
                        "fhe: CKKS levels and bootstraps per block and the polynomial approximations (docs/fhe.md)")
    i.add_argument("--fhe-levels", type=int, default=9,
                   help="fhe: the top level after a bootstrap (default 9: Lattigo's N16QP1546H192H32)")
    i.add_argument("--workers", type=int, default=None, metavar="W",
                   help="fhe: also the AEGIS placement on W workers for --tokens tokens: dependency groups, the "
                        "collectives inserted and their predicted bytes beside tensor parallelism (docs/aegis.md)")
    i.add_argument("--tokens", type=int, default=16, help="prompt tokens the prediction assumes (default 16)")
    i.add_argument("--linear-packing", default="coeff", choices=("coeff", "simd", "auto"),
                   help="2pc: linear layers' packing the prediction assumes")
    i.add_argument("--he-backend", choices=("auto", "seal", "lattigo"), default="auto",
                   help="offload: the server's HE backend the plan and bytes are for (default auto: what "
                        "`cipherlm serve` picks here, lattigo where its library is built, else seal)")
    i.add_argument("--json", metavar="FILE", help="write the plan and the prediction as JSON")
    i.add_argument("--fusion", choices=("none", "blb"), default="none", help="blb: also the BLB fused blocks per layer (FineGrainFusion passes, docs/blb.md)")
    i.add_argument("--blb-norms", choices=("split", "whole"), default="split",
                   help="with --fusion blb: the norms split into HE statistics and an rsqrt core (Algorithm 3), or "
                        "whole in MPC (what a server picks for models with massive activations, e.g. SmolLM2)")

    s = sub.add_parser("serve", help="serve a model to private-inference clients")
    s.add_argument("--mode", choices=("offload", "2pc", "fhe"), default="offload")
    s.add_argument("--model", default=DEFAULT_DECODER)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=7070, help="0 picks a free port (printed on stdout)")
    s.add_argument("--timeout", type=float, default=None,
                   help="seconds a session may stay silent (default: offload 300, 2pc 600)")
    _add_limit_args(s)
    s.add_argument("--workers", type=int, default=None,
                   help="offload: on Lattigo goroutines per request (default: one per core), on SEAL HE worker "
                        "processes that share each request (default 1: SEAL holds the GIL); fhe: Ray actors one "
                        "pass is spread over (AEGIS placement, docs/aegis.md; default 1)")
    s.add_argument("--ray-address", default=None,
                   help="fhe with --workers > 1: the Ray cluster to run the workers on (default: ray.init() "
                        "on this machine)")
    s.add_argument("--session-processes", type=int, default=None,
                   help="worker processes the sessions run in, so N sessions use N cores (default: one per "
                        "core; 1: threads of the server process; the Lattigo backend and --workers > 1 "
                        "use threads)")
    s.add_argument("--he-backend", choices=("auto", "seal", "lattigo"), default=None,
                   help="offload: the HE library the projections run on (default $CIPHERLM_OFFLOAD_HE_BACKEND, "
                        "else auto: lattigo where `make lattigo` has built its library, else seal, logged); "
                        "on lattigo --workers are goroutines in the server process and sessions run in "
                        "threads; the client follows the server")
    s.add_argument("--embedding", default="auto",
                   help="2pc: private embedding lookup (auto = FastQuery protocol with a 12-bit table; "
                        "onehot-linear, exact, fastquery, cheetah, ...)")
    s.add_argument("--moe-capacity", type=float, default=2.0,
                   help="2pc, MoE models: CryptoMoE capacity factor c (each expert takes "
                        "ceil(c m k / n) of a pass's m tokens; public)")
    _add_packing_args(s, "2pc")
    s.add_argument("--fusion", choices=("auto", "none", "blb"), default="auto",
                   help="2pc, encoders: blb runs BLB's fused blocks in CKKS between secure conversions "
                        "(docs/blb.md; public, in the plan; a decoder is refused: no generation with BLB "
                        "yet); none: layer by layer; auto (default): blb for an encoder when "
                        "--packing-network is at most 100 Mbps (blb-WAN2, blb-WAN3: where BLB measured "
                        "faster), else none")
    _add_fhe_serve_args(s)

    x = sub.add_parser("proxy", help="an OpenAI-compatible HTTP API on this machine, in front of a `cipherlm serve` "
                                     "(the keys stay in the proxy; docs/proxy.md)")
    x.add_argument("--server", type=_server_address, action="append", required=True,
                   help="HOST:PORT of a `cipherlm serve` (repeat for several models, e.g. a chat model "
                        "and an embedding model)")
    x.add_argument("--mode", choices=("offload", "2pc"), required=True, help="the servers' mode")
    x.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on (default 127.0.0.1)")
    x.add_argument("--port", type=int, default=8080)
    x.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer TOKEN' on /v1 (or set CIPHERLM_PROXY_API_KEY)")
    x.add_argument("--chat-template", default=None, metavar="FILE",
                   help="the chat template: a tokenizer_config.json or a Jinja file (default: the model's own "
                        "when it is on this machine, else the one the server sends, else ChatML)")
    x.add_argument("--compare-plaintext", action="store_true",
                   help="allow 'compare with plaintext' (the chat page's box, or compare_plaintext: true in a "
                        "request) for models that are on this machine: runs the plaintext model too")

    d = sub.add_parser("demo", help="server and client as two processes on loopback, short generation")
    d.add_argument("--mode", choices=RUN_MODES, default="offload")
    d.add_argument("--model", default=None,
                   help=f"default {DEFAULT_DECODER} ({DEFAULT_ENCODER} in the fhe mode, which classifies the prompt)")
    d.add_argument("--prompt", default=DEFAULT_PROMPT)
    d.add_argument("--max-new-tokens", type=int, default=None, help="default 8 (offload), 2 (2pc), 1 (fhe)")
    _add_fhe_serve_args(d)
    _add_fhe_refresh_arg(d)
    _add_report_args(d)

    b = sub.add_parser("bench", help="benchmarks")
    b.add_argument("what", choices=("offload", "mpc", "embedding", "moe", "2pc", "fhe", "aegis", "blb"),
                   help="which benchmark")
    b.add_argument("--elements", type=int, default=1 << 16, help="elements per 2PC primitive (bench mpc)")
    b.add_argument("--rows", type=int, default=128,
                   help="rows of the nonlinear shapes (bench mpc; softmax 128x128, GeLU 128x3072, ...)")
    b.add_argument("--only", help="comma-separated operation names (bench mpc; default all)")
    b.add_argument("--processes", action="store_true",
                   help="bench mpc: the two parties as two OS processes over TCP (default: two threads)")
    b.add_argument("--workloads", default=None,
                   help="bench 2pc: comma-separated (minilm: MiniLM's encoder layers; smollm-block: one SmolLM2 "
                        "block; bert-base: BERT-base shape, random weights, extrapolated from --layers; default "
                        "all three); bench fhe: minilm (polarity classification) and/or bert-base (one layer, "
                        "random weights) and/or smollm-generate (SmolLM2 greedy generation, resumable: --prompt-tokens, --max-new-tokens, --checkpoint); default minilm; bench blb: minilm, bert-base, gpt2 (GPT2-base shape, "
                        "random weights, the layers and the final norm), tiny, tiny-gpt2; default minilm,gpt2)")
    b.add_argument("--layers", type=int, default=None,
                   help="bench 2pc: layers to run (default: minilm all 6, bert-base 1 of 12); bench blb: "
                        "default 1")
    _add_packing_args(b, "bench 2pc")
    b.add_argument("--vocab", type=int, default=32000, help="bench embedding: table rows (LLaMA-7B: 32000)")
    b.add_argument("--dim", type=int, default=4096, help="bench embedding: table columns (LLaMA-7B: 4096)")
    b.add_argument("--methods", help="bench embedding: comma-separated rows (default the Table 6 ablation)")
    b.add_argument("--tokens", type=int, default=None,
                   help="bench embedding: token ids per query (default 1); bench 2pc: tokens (default 128, "
                        "smollm-block 64); bench fhe: tokens per inference (default 32); bench blb: default 8 "
                        "(tiny 4)")
    b.add_argument("--sentences", type=int, default=1, help="bench fhe: MiniLM polarity sentences (default 1)")
    b.add_argument("--rows-file", default=None, metavar="FILE",
                   help="bench fhe: MiniLM's per-sentence rows, written to FILE as each finishes; the sentences "
                        "already in FILE are skipped (a long run can stop and go on)")
    b.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="bench fhe --workloads smollm-generate: the run's directory, written after every layer and "
                        "resumed when it exists (it holds the client's secret key: keep it private)")
    b.add_argument("--max-layers", type=int, default=None,
                   help="bench fhe --workloads smollm-generate: stop after this many layers (resume later)")
    b.add_argument("--fhe-preset", default=FHE_PRESETS[0], choices=FHE_PRESETS,
                   help="bench fhe: the CKKS bootstrapping preset (test-insecure-N1024 needs --insecure-test-preset)")
    b.add_argument("--insecure-test-preset", action="store_true",
                   help="bench fhe: allow the INSECURE test preset (checks the circuits quickly; no security)")
    _add_fhe_refresh_arg(b)
    b.add_argument("--flood-bits", default="40", help="bench embedding: flooding bits, e.g. 40 or 40,0")
    b.add_argument("--seed", type=int, default=0, help="bench embedding / moe: random table / weights seed")
    b.add_argument("--shape", default="reduced", choices=("reduced", "olmoe", "qwen"),
                   help="bench moe: one MoE layer at a reduced shape (default, ~5-10 min) or OLMoE / Qwen1.5-MoE's")
    b.add_argument("--variants", help="bench moe: comma-separated rows (insecure,dense,cipherprune,cryptomoe; "
                                      "default all five); bench blb: BFV+MPC,BLB,BLB+fused (default all three)")
    b.add_argument("--blb-activation", choices=("whole", "gate", "poly"), default=None,
                   help="bench blb: GeLU / SiLU as one MPC core (whole), as x * g(x) with the gate in MPC and "
                        "the product in HE (gate, the paper's Algorithm 4), or GeLU's clamped form with its "
                        "polynomial in HE (poly) (default: the 2pc plan's; docs/blb.md)")
    b.add_argument("--blb-exp", choices=("core", "poly"), default=None,
                   help="bench blb: the softmax's exp as one MPC core (core) or its clip in MPC and its "
                        "polynomial in HE (poly) (default: the 2pc plan's; docs/blb.md)")
    b.add_argument("--expert-sample", type=int, default=None,
                   help="bench moe: run the expert FFNs of this many experts and extrapolate by n/s "
                        "(default: all for reduced, 2 for the full shapes; 0 = all)")
    b.add_argument("--tokens-moe", type=int, default=None, help="bench moe: tokens m (default 32 reduced, 64 full)")
    b.add_argument("--ablation", action="store_true",
                   help="bench moe: also the routing ablation (agreement with the unbalanced MoE) on the "
                        "sparse-upcycled SmolLM2-MoE over Wikipedia prompts (plaintext)")
    b.add_argument("--workers", default=None,
                   help="bench aegis: comma-separated worker counts (default 1,2); the plot then shows "
                        "bytes per layer half and T1 / (W T_W)")
    b.add_argument("--placements", default=None, help="bench aegis: comma-separated placements among aegis, megatron, hydra (default aegis,megatron)")
    b.add_argument("--runtime", choices=("ray", "inline"), default="ray",
                   help="bench aegis: Ray actors (default) or the workers in this process (no parallelism)")
    b.add_argument("--ray-address", default=None, help="bench aegis: a Ray cluster (default: ray.init() here)")
    b.add_argument("--dispatch", default=None,
                   help="bench aegis: comma-separated dispatch modes run one after the other on the same workers "
                        "for W > 1: async (default: queued calls, one wait per layer half) and/or sync (a barrier "
                        "after every operator), e.g. async,sync for an A/B of the overlap")
    b.add_argument("--model", default=DEFAULT_DECODER)
    b.add_argument("--prompt-tokens", type=int, default=None,
                   help="bench offload: default 8; bench fhe smollm-generate: default 7 (8 positions in all)")
    b.add_argument("--max-new-tokens", type=int, default=None,
                   help="bench offload: default 16; bench fhe smollm-generate: default 2")
    _add_report_args(b)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from cipherlm import commands

    try:
        return commands.dispatch(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except commands.UserError as exc:
        print(f"cipherlm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
