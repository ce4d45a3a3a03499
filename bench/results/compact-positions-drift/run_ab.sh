#!/bin/sh
# Alternate the tree before the change (BASE) and after (NEW), fp32 then bf16, REPS times; one JSON line per run.
# Usage: [LENGTHS=4096,8192 DECODE=64] BASE=/path/to/old/tree NEW=/path/to/new/tree REPS=3 sh run_ab.sh > ab.jsonl
PY=${PY:-python}
HERE=$(dirname "$0")
for rep in $(seq "${REPS:-3}"); do
  for weights in fp32 bf16; do
    for tree in "$BASE" "$NEW"; do
      label=$([ "$tree" = "$BASE" ] && echo before || echo after)
      OMP_NUM_THREADS=1 PYTHONPATH="$tree" "$PY" "$HERE/ab_perf.py" "$weights" ${LENGTHS:-4096,8192} ${DECODE:-64} "$label" | sed "s/^{/{\"rep\": $rep, /"
    done
  done
done
