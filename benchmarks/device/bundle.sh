#!/bin/bash
# Build .dev/, what a bare Python 3.12 machine with numpy, torch and transformers (the
# 16-core accelerator machine lent to some sessions) needs beside the working tree to run
# `cipherlm bench aegis` on Ray: Ray 2.60.0 without its Java jars, dashboard client and
# libraries (data, serve, train, tune, rllib, llm), xz-compressed (79 MB wheel -> 28 MB),
# and the cp312 wheels of the other packages cipherlm imports that such a machine lacks.
# The built Lattigo library (native/lattigo/build) and the Rust core (cipherlm/_core.abi3.so)
# travel as they are (x86-64, glibc 2.36, abi3).
#   benchmarks/device/bundle.sh          # then carry .dev, cipherlm/_core.abi3.so, native/lattigo/build
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
pick=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p .dev
$PY -m pip download -q "${pick[@]}" -d "$tmp" ray==2.60.0
mkdir "$tmp/x"
(cd "$tmp/x" && $PY -m zipfile -e "$tmp"/ray-*.whl .)
rm -rf "$tmp"/x/ray/{jars,rllib,data,serve,train,tune,llm,dashboard/client}
tar -cJf .dev/ray_slim.tar.xz -C "$tmp/x" .
$PY -m pip download -q "${pick[@]}" -d .dev jsonschema jsonschema-specifications referencing rpds-py \
    tenseal==0.3.18 randomgen zstandard gguf
cp benchmarks/device/aegis_scaling.sh .dev/run.sh
du -sh .dev
