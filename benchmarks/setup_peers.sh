#!/usr/bin/env bash
# Set up the isolated virtual environments of the peers we benchmark against.
#
#   bash benchmarks/setup_peers.sh            # all peers (concrete, spu)
#   bash benchmarks/setup_peers.sh concrete   # Concrete ML 1.9.0 only
#   bash benchmarks/setup_peers.sh spu        # SecretFlow-SPU 0.9.5 only
#
# Each peer gets its own venv under .peers/ (gitignored). Nothing of a peer is
# ever installed into the project's main .venv. Idempotent: a venv whose
# packages already import at the pinned version is left alone.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PEERS="$ROOT/.peers"
PY="${PEERS_PYTHON:-python3.11}"

say() { printf '[setup_peers] %s\n' "$*"; }

setup_concrete() {
    local venv="$PEERS/concrete"
    local want="1.9.0"
    if [ -x "$venv/bin/python" ] &&
        "$venv/bin/python" - "$want" <<'EOF' 2>/dev/null; then
import sys, importlib.metadata as md
import concrete.ml, torch, requests  # noqa: F401
sys.exit(0 if md.version("concrete-ml") == sys.argv[1] else 1)
EOF
        say "concrete: $venv already has concrete-ml==$want (+ torch, requests); nothing to do"
        return 0
    fi
    command -v "$PY" >/dev/null || { say "ERROR: $PY not found (set PEERS_PYTHON)"; exit 1; }
    if [ ! -x "$venv/bin/python" ]; then
        say "concrete: creating venv $venv with $($PY --version 2>&1)"
        mkdir -p "$PEERS"
        "$PY" -m venv "$venv"
    else
        say "concrete: reusing existing venv $venv"
    fi
    say "concrete: upgrading pip"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    # concrete-ml pins its own torch version; pip resolves it from the registry.
    say "concrete: pip install concrete-ml==$want requests (pulls torch, concrete-python, ...; large)"
    "$venv/bin/python" -m pip install "concrete-ml==$want" requests
    say "concrete: installed versions:"
    "$venv/bin/python" - <<'EOF'
import importlib.metadata as md
for p in ("concrete-ml", "concrete-python", "torch", "numpy", "requests"):
    try:
        print(f"  {p}=={md.version(p)}")
    except md.PackageNotFoundError:
        print(f"  {p}: not installed")
EOF
    say "concrete: done. Run: $venv/bin/python benchmarks/concrete_ml_peer.py 64x64"
}

setup_spu() {
    # SecretFlow-SPU, the 2PC peer of `cipherlm bench mpc` (benchmarks/bench_mpc_spu.py).
    # It pins numpy<2 and jax 0.4.34, hence its own venv.
    local venv="$PEERS/spu"
    local want="0.9.5"
    if [ -x "$venv/bin/python" ] &&
        "$venv/bin/python" - "$want" <<'EOF' 2>/dev/null; then
import sys, importlib.metadata as md
import spu, spu.libspu.link, jax  # noqa: F401
sys.exit(0 if md.version("spu") == sys.argv[1] else 1)
EOF
        say "spu: $venv already has spu==$want; nothing to do"
        return 0
    fi
    command -v "$PY" >/dev/null || { say "ERROR: $PY not found (set PEERS_PYTHON)"; exit 1; }
    if [ ! -x "$venv/bin/python" ]; then
        say "spu: creating venv $venv with $($PY --version 2>&1)"
        mkdir -p "$PEERS"
        "$PY" -m venv "$venv"
    else
        say "spu: reusing existing venv $venv"
    fi
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    say "spu: pip install spu==$want (pulls jax, jaxlib, numpy<2; large)"
    "$venv/bin/python" -m pip install "spu==$want"
    say "spu: installed versions:"
    "$venv/bin/python" - <<'EOF'
import importlib.metadata as md
for p in ("spu", "jax", "jaxlib", "numpy"):
    try:
        print(f"  {p}=={md.version(p)}")
    except md.PackageNotFoundError:
        print(f"  {p}: not installed")
EOF
    say "spu: done. Run: .venv/bin/python benchmarks/bench_mpc_spu.py"
}

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(concrete spu)
for t in "${targets[@]}"; do
    case "$t" in
        concrete) setup_concrete ;;
        spu) setup_spu ;;
        *) say "unknown peer '$t' (known: concrete, spu)"; exit 2 ;;
    esac
done
