#!/usr/bin/env bash
# The heads issue's (#4) grid cells that the 2-core CPU would need days for, on a lent GPU, in several lanes.
#
#   export PYTHONPATH=WHEELS_DIR LOCALCHAT_CACHE_DIR=DIR   # our wheels; the default GGUF in DIR (tools/gpu/session.sh)
#   LANES=12 LIMIT_S=1500 bash tools/gpu/heads_cells.sh RESULTS_DIR   # defaults: LANES 8, LIMIT_S 1500, PY python3
#
# Rows use `--weights fp32`, the dtype of the CPU grid's rows (bench/results/grid-smollm2-cpu), so they differ
# from those only by hardware; `fp32` is part of each row's key, so the two files never mix by accident.
# A 135M model keeps an H100 busy for a few percent of each step, so LANES processes (one torch thread each)
# share the GPU and claim examples from one results file (localchat/bench/lanes.py). Steps, in order:
#   a. cross-check: cells the CPU grid already has (LOCRET at 32K b=1024, full at 7,680), same examples, so the
#      answers compare one to one (`localchat bench cross-check`)
#   b. step 7 at 32K: LOCRET with random heads;  c. step 8: H2O, SnapKV, SirLLM, random eviction at 32K
#   d. step 7 at original positions (4K, 7,680);  e. step 6 (original positions)
# Every lane stops after LIMIT_S seconds (the example in flight is lost; rerun to resume). Rows go to
# RESULTS_DIR/results.jsonl, each lane's log to RESULTS_DIR/laneN.log.

set -o pipefail
DIR=${1:?usage: tools/gpu/heads_cells.sh RESULTS_DIR}
cd "$(dirname "$0")/../.." || exit 1
PY=${PY:-python3}
LANES=${LANES:-8}
LIMIT_S=${LIMIT_S:-1500}
. tools/gpu/env.sh
export OMP_NUM_THREADS=1
mkdir -p "$DIR"
"$PY" -m localchat fetch-model >"$DIR/fetch.log" 2>&1 || { tail -3 "$DIR/fetch.log"; exit 1; }

T3=passkey,niah_single,niah_multikey
E=locret,random,streaming,h2o,snapkv,sirllm
STEPS=(
    "--tasks $T3 --lengths 32k --policies locret --budgets 1024"                                        # a
    "--tasks niah_single,passkey --lengths 7680 --policies full"                                        # a
    "--tasks $T3 --lengths 32k --policies locret --heads random --budgets 256,512,1024"                 # b
    "--tasks $T3 --lengths 32k --policies h2o,snapkv,sirllm,random --budgets 256,512,1024"              # c
    "--tasks $T3 --lengths 4k,7680 --policies locret --heads random --budgets 256,512,1024 --positions original"
    "--tasks $T3 --lengths 4k,7680 --policies $E --budgets 256,512,1024 --positions original"           # e
)
lane() {
    for step in "${STEPS[@]}"; do
        # shellcheck disable=SC2086
        "$PY" -m localchat bench $step -n 20 --weights fp32 --in-process --out "$DIR" || return
    done
}
for i in $(seq 1 "$LANES"); do
    timeout -k 10 "$LIMIT_S" bash -c "$(declare -p STEPS PY DIR); $(declare -f lane); lane" >"$DIR/lane$i.log" 2>&1 &
    sleep 2  # staggered starts: the lanes claim different examples from the first cell on
done
wait
echo "rows: $(wc -l <"$DIR/results.jsonl")"
