#!/usr/bin/env bash
# The scheduled benchmark grid (bench/results/grid-smollm2-cpu/README.md) on a GPU machine, in 10-minute calls.
#
#   export PYTHONPATH=WHEELS_DIR           # our wheels (`pip install --target WHEELS_DIR`), as for tools/gpu/session.sh
#   bash tools/gpu/grid.sh OUT_DIR         # then copy OUT_DIR/results.jsonl over $RESULTS/results.jsonl here
#
# Each call picks up where the last one stopped: $RESULTS/results.jsonl (RESULTS, default
# bench/results/grid-smollm2-h100, relative to the repo root) travels with the working tree to the device, the
# runner skips every example that has a row, and the grown file comes back in OUT_DIR. The steps run in order
# until LIMIT_S (default 500) seconds are spent; one model stays resident (--in-process; on CUDA a cell's peak
# memory is torch.cuda.max_memory_allocated, reset per cell). PY: the Python to run (default python3).
# Needs the default model's GGUF in $LOCALCHAT_CACHE_DIR (see tools/gpu/session.sh); converts it once.

set -o pipefail
OUT=${1:?usage: tools/gpu/grid.sh OUT_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.." || exit 1
PY=${PY:-python3}
LIMIT_S=${LIMIT_S:-500}
DIR=${RESULTS:-bench/results/grid-smollm2-h100}
P=full,locret,random,streaming,h2o,snapkv,sirllm,sagekv,omnikv,roco,corm
E=locret,random,streaming,h2o,snapkv,sirllm  # the heads' target rows at original positions
. tools/gpu/env.sh
T0=$(date +%s)
left() { echo $((LIMIT_S - ($(date +%s) - T0))); }

"$PY" -m localchat fetch-model >"$OUT/fetch.log" 2>&1 || { tail -3 "$OUT/fetch.log"; exit 1; }
STEPS=(
    "--tasks passkey,niah_single,niah_multikey --lengths 4k --policies $P --budgets 256,512,1024"
    "--tasks multiturn --lengths 4k --policies $P --budgets 256,512,1024"
    "--tasks passkey,niah_single,niah_multikey,multiturn --lengths 7680 --policies $P --budgets 256,512,1024"
    "--tasks passkey,niah_single,niah_multikey,multiturn --lengths 32k --policies locret,streaming --budgets 256,512,1024"
    "--tasks passkey,niah_single,niah_multikey --lengths 4k,7680 --policies $E --budgets 256,512,1024 --positions original"
)
for step in "${STEPS[@]}"; do
    [ "$(left)" -gt 20 ] || break
    # shellcheck disable=SC2086
    timeout -k 10 "$(left)" "$PY" -m localchat bench $step -n 20 --in-process --out "$DIR" 2>&1 | tail -n 400 >>"$OUT/grid.log"
done
cp "$DIR/results.jsonl" "$OUT/results.jsonl" 2>/dev/null
echo "rows: $(cat "$DIR/results.jsonl" 2>/dev/null | wc -l), seconds: $(($(date +%s) - T0))" | tee "$OUT/summary.txt"
