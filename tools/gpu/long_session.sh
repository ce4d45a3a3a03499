#!/usr/bin/env bash
# The 64K/128K cells on a GPU machine in one `device` call, once the GGUF's first part is stashed there
# (tools/gpu/model_parts.sh; the call carries .whl and the last part):
#
#   DEADLINE_S=570 LANES=14 bash tools/gpu/long_session.sh [CELLS] [RESULTS_DIR]
#
# 1. our wheels (.whl) into /tmp/site; 2. the carried part stashed, the GGUF joined and its SHA-256 checked;
# 3. the eviction kernels' tests on the real GPU (tests/kernels/test_kernels.py -k gather_rotate: the bf16 remainder
# kernel has only run under Triton's interpreter): if they fail, the lanes run the torch twins
# (LOCALCHAT_KERNELS=torch) and the log says so; 4. the lanes (tools/gpu/lanes.sh) until DEADLINE_S seconds
# after the start, less MARGIN_S (default 25) for the copy; 5. rows, logs and nvidia-smi to $OUT.
set -o pipefail
T0=$(date +%s)
CELLS=${1:-tools/gpu/cells/long.txt}
DIR=${2:-bench/results/grid-smollm2-gpu-long}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" "$DIR"
cd "$(dirname "$0")/../.." || exit 1
exec > >(tee -a "$OUT/session.log") 2>&1
export LOCALCHAT_CACHE_DIR=${LOCALCHAT_CACHE_DIR:-/root/cache} PY=${PY:-python3}
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
bash tools/gpu/model_parts.sh stash && bash tools/gpu/model_parts.sh join || exit 1
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
echo "setup done at $(($(date +%s) - T0)) s"
(
    . tools/gpu/env.sh
    timeout 150 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels/test_kernels.py -k gather_rotate
) >"$OUT/kernels.log" 2>&1
rc=$?
tail -3 "$OUT/kernels.log"
if [ "$rc" != 0 ]; then
    export LOCALCHAT_KERNELS=torch
    echo "kernel tests failed (exit $rc): the lanes run the torch twins"
fi
echo "kernels checked at $(($(date +%s) - T0)) s"
LIMIT_S=$((${DEADLINE_S:-570} - ${MARGIN_S:-25} - ($(date +%s) - T0)))
echo "lanes: ${LANES:-14} for $LIMIT_S s"
LANES=${LANES:-14} LIMIT_S=$LIMIT_S bash tools/gpu/lanes.sh "$CELLS" "$DIR"
cp "$DIR"/results.jsonl "$DIR"/lane1.log "$DIR"/summary.txt "$OUT"/ 2>/dev/null
grep -h "step failed\|Error\|error:" "$DIR"/lane*.log | sort | uniq -c | head -20
echo "done at $(($(date +%s) - T0)) s"
