#!/usr/bin/env bash
# Set up the isolated virtual environments of the peers we benchmark against.
#
#   bash benchmarks/setup_peers.sh            # all peers (currently: concrete)
#   bash benchmarks/setup_peers.sh concrete   # Concrete ML 1.9.0 only
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

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(concrete)
for t in "${targets[@]}"; do
    case "$t" in
        concrete) setup_concrete ;;
        *) say "unknown peer '$t' (known: concrete)"; exit 2 ;;
    esac
done
