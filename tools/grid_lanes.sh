#!/usr/bin/env bash
# The CPU grid's steps (bench/results/grid-smollm2-cpu/README.md) in several processes sharing one results file.
#
#   bash tools/grid_lanes.sh [LANES] [LOG_DIR]   # default: one lane per core, logs in $TMPDIR/grid-lanes (/tmp)
#   pkill -f "localchat bench --tasks"           # stop every lane (an example in flight is lost, nothing else)
#
# Environment: RESULTS (default bench/results/grid-smollm2-cpu, relative to the repo root) is the results
# directory the lanes share; BIN (default .venv/bin/localchat) the command they run. LOG_DIR gets lane.sh (the
# step list every lane runs) and one laneN.log per lane.
#
# Each lane runs every step in order (step 7's compact 4K/7,680 cells first, before step 6: they settle the most
# targets per hour) with one torch thread and returns at once (setsid). Lanes claim each example before running it
# (localchat/bench/lanes.py), so they split the cells between them and none is run twice; a finished step costs a
# lane only the reading of the results file.

LANES=${1:-$(nproc)}
LOGS=${2:-${TMPDIR:-/tmp}/grid-lanes}
cd "$(dirname "$0")/.." || exit 1
BIN=${BIN:-.venv/bin/localchat}
OUT=${RESULTS:-bench/results/grid-smollm2-cpu}
P=full,locret,random,streaming,h2o,snapkv,sirllm,sagekv,omnikv,roco,corm
E=locret,random,streaming,h2o,snapkv,sirllm  # the heads' target rows at original positions
T3=passkey,niah_single,niah_multikey
STEPS=(
    "--tasks $T3,multiturn --lengths 7680 --policies $P --budgets 256,512,1024"                        # 4
    "--tasks $T3,multiturn --lengths 32k --policies locret,streaming --budgets 256,512,1024"          # 5
    "--tasks $T3 --lengths 4k,7680 --policies locret --heads random --budgets 256,512,1024"           # 7 (first)
    "--tasks $T3 --lengths 4k,7680 --policies $E --budgets 256,512,1024 --positions original"         # 6
    "--tasks $T3 --lengths 4k,7680 --policies locret --heads random --budgets 256,512,1024 --positions original"
    "--tasks $T3 --lengths 32k --policies locret --heads random --budgets 256,512,1024"
    "--tasks $T3 --lengths 32k --policies h2o,snapkv,sirllm,random --budgets 256,512,1024"           # 8
)
mkdir -p "$LOGS"
script="$LOGS/lane.sh"
{
    echo "export OMP_NUM_THREADS=1"
    for step in "${STEPS[@]}"; do echo "$BIN bench $step -n 20 --out $OUT"; done
} >"$script"
for i in $(seq 1 "$LANES"); do
    setsid nohup bash "$script" >>"$LOGS/lane$i.log" 2>&1 </dev/null &
    echo "lane $i: $LOGS/lane$i.log"
done
