#!/usr/bin/env bash
# Measured peak vs planned, on this CPU, for the plain and the quantized retained cache (issue #38 item 3).
# From the repo root: bash bench/results/planner-precision-cpu/run.sh [RANDOM_MODEL_DIR]
# One process per row (`plan --verify --json`: load, run a chunk on a full cache, read the peak RSS above the
# baseline taken just before the weights load). OMP_NUM_THREADS=1; the other core ran a benchmark lane.
set -u
OUT=bench/results/planner-precision-cpu
PHI=${1:-/tmp/rm-phi3-2l}
export OMP_NUM_THREADS=1 LOCALCHAT_CONFIG_DIR=$(mktemp -d)
[ -d "$PHI" ] || localchat bench random-model tests/data/configs/phi-3-mini-128k-instruct.json "$PHI" --layers 2 --dtype fp32
for kv in none int8 int4 int2; do
    f=$OUT/verify-smollm2-b7000-c512-$kv.json
    [ -s "$f" ] || localchat plan --verify --json --profile none --kv $kv --budget 7000 --chunk 512 > "$f"
done
for kv in none int8 int4; do
    f=$OUT/verify-phi3shape2l-b16384-c1024-$kv.json
    [ -s "$f" ] || localchat --model "$PHI" --heads random plan --verify --json --profile none --kv $kv --budget 16384 --chunk 1024 > "$f"
done
