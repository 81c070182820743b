#!/bin/bash
# AEGIS scaling efficiency T1 / (W T_W) on a many-core machine (issue 18's benchmark):
# `cipherlm bench aegis` once per W (aegis placement, one Go thread per worker, a warm-up
# pass then the measured one), each a fresh process, its JSON in $OUT/aegis_W<W>.json, so
# that a deadline keeps the finished rows.  Needs .dev/ from benchmarks/device/bundle.sh.
# usage (from the repository root): OUT=dir .dev/run.sh [WORKLOAD] ["1 2 4 8"] [DEADLINE_S]
# Measured locally (2 vCPUs, quiet): bert-base, W=1: 188 s in all (78.5 s measured pass).
PY=${PY:-python3}
WL=${1:-bert-base}; WS=${2:-"1 2 4 8"}; DL=${3:-540}
T0=$(date +%s)
export PYTHONUNBUFFERED=1
mkdir -p /tmp/site
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .dev/*.whl || exit 3
tar -xJf .dev/ray_slim.tar.xz -C /tmp/site || exit 4
export PYTHONPATH=/tmp/site:$PWD
{ date -u; nproc; lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Socket|MHz'; free -g; uptime
  $PY -c 'import numpy,torch,transformers,ray;print(numpy.__version__,torch.__version__,transformers.__version__,ray.__version__)'; } > $OUT/machine.txt 2>&1
cat $OUT/machine.txt
echo "setup $(( $(date +%s) - T0 )) s"
for W in $WS; do
  left=$(( DL - ($(date +%s) - T0) ))
  [ $left -lt 20 ] && { echo "no time left for W=$W"; break; }
  echo "== W=$W ($left s left) $(uptime)" | tee -a $OUT/log.txt
  timeout $left $PY -m cipherlm bench aegis --workloads $WL --tokens 4 --workers $W --placements aegis \
     --insecure-test-preset --report $OUT/aegis_W$W.json >> $OUT/log.txt 2>&1
  echo "rc=$? after $(( $(date +%s) - T0 )) s" | tee -a $OUT/log.txt
  grep -E "total|W=$W aegis \(" $OUT/log.txt | tail -2
done
uptime | tee -a $OUT/log.txt
