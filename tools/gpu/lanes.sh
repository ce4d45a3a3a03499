#!/usr/bin/env bash
# Benchmark cells that the 2-core CPU would need days for, on a GPU machine, in several lanes.
#
#   export PYTHONPATH=WHEELS_DIR LOCALCHAT_CACHE_DIR=DIR   # our wheels; the default GGUF in DIR (tools/gpu/session.sh)
#   LANES=12 LIMIT_S=540 bash tools/gpu/lanes.sh CELLS RESULTS_DIR   # defaults: LANES 8, LIMIT_S 1500, PY python3
#
# CELLS: a file of `localchat bench` argument lists, one per line (`#` comments), run in order by every lane:
#   tools/gpu/cells/heads.txt   the retaining heads' grid cells (run: bench/results/grid-smollm2-h100-fp32)
#   tools/gpu/cells/long.txt    the 64K/128K cells
# Rows use `--weights $WEIGHTS` (default fp32, the dtype of the CPU grid's rows) unless a line names its own;
# the weights are part of each row's key, so GPU and CPU rows never mix by accident.
# A 135M model keeps a GPU busy for a few percent of each step, so LANES processes (one torch thread each)
# share it and claim examples from one results file (localchat/bench/lanes.py). Every lane stops LIMIT_S seconds
# after this script starts, the model check and the staggered starts included (the example in flight is lost; rerun
# to resume: finished examples are skipped). A step that fails is logged and the lane goes on with the next one.
# Rows go to RESULTS_DIR/results.jsonl, each lane's log to RESULTS_DIR/laneN.log.

set -o pipefail
CELLS=${1:?usage: tools/gpu/lanes.sh CELLS RESULTS_DIR}
DIR=${2:?usage: tools/gpu/lanes.sh CELLS RESULTS_DIR}
CELLS=$(cd "$(dirname "$CELLS")" && pwd)/$(basename "$CELLS")
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd)
cd "$(dirname "$0")/../.." || exit 1
PY=${PY:-python3}
LANES=${LANES:-8}
LIMIT_S=${LIMIT_S:-1500}
WEIGHTS=${WEIGHTS:-fp32}
. tools/gpu/env.sh
export OMP_NUM_THREADS=1
T0=$(date +%s)
"$PY" -m localchat fetch-model >"$DIR/fetch.log" 2>&1 || { tail -3 "$DIR/fetch.log"; exit 1; }

mapfile -t STEPS < <(grep -v '^[[:space:]]*\(#\|$\)' "$CELLS")
lane() {
    for step in "${STEPS[@]}"; do
        # shellcheck disable=SC2086
        "$PY" -m localchat bench --weights "$WEIGHTS" $step --in-process --out "$DIR" ||
            echo "lanes.sh: step failed (exit $?), going on with the next: $step"
    done
}
for i in $(seq 1 "$LANES"); do
    left=$((LIMIT_S - ($(date +%s) - T0)))  # one deadline for all lanes
    [ "$left" -gt 0 ] || break
    timeout -k 10 "$left" bash -c "$(declare -p STEPS PY DIR WEIGHTS); $(declare -f lane); lane" >"$DIR/lane$i.log" 2>&1 &
    sleep 2  # staggered starts: the lanes claim different examples from the first cell on
done
wait
echo "rows: $(wc -l <"$DIR/results.jsonl"), seconds: $(($(date +%s) - T0))" | tee "$DIR/summary.txt"
