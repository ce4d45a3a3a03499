#!/usr/bin/env bash
# The planner at real scale on a GPU machine, with random-weight models built from real configs (speed and
# memory only: the answers are noise, and every figure says so). From the repo root, everything under OUT:
#
#   bash tools/gpu/site.sh               # here, once: .site/ (bitsandbytes, a tokenizer); carry it
#   export PYTHONPATH=$PWD/.site TOKENIZER=$PWD/.site/tokenizer
#   bash tools/gpu/planner_8b.sh OUT_DIR
#
# Resumable: a step whose output file exists is skipped, so a short GPU window can run it again and go on. The
# default order puts the 128K read and the decode figures before the plans of every cap.
# Knobs: DRY=1 prints the commands; STEPS="0 1 2 3 4" picks steps; MODELS="llama-3.1-8b-instruct
# phi-3-mini-128k-instruct" (configs in tests/data/configs); MODELS_DIR (default OUT/models); TOKENIZER (a folder: the random models' tokenizer,
# where the default model is not installed); CAPS="24 12 8" (GB, LOCALCHAT_GPU_MEMORY_GB: the
# allocator is capped there to stand for an RTX 4090 / 4070 / 4060); LENGTHS="32768 65536 98304 131072" (full
# attention's failure search); LEN3, LEN6, LEN7 (the lengths of steps 3, 6, 7); WLAYERS (step 10's layers; a
# rehearsal's); BIG; PY (default python3).
#   step 0  environment, nvidia-smi, versions
#   step 1  `localchat bench random-model` per model and SmolLM2-135M (bf16, all layers; ~2-3 min and 16 GB of disk
#           for the 8B)
#   step 2  per model x cap: `plan --json` (the precision and budget chosen) and `plan --verify --json` (one chunk
#           on a full cache: measured peak vs planned)
#   step 3  the 8B at 24 GB: a 128K-token document read end to end by `ask --stats` with `--profile rtx4090` (nf4
#           weights, int8 cache, b=16,384), nvidia-smi sampling the GPU's busy share; the stats line has prefill and
#           decode tok/s and the peak of GPU memory; then gpu_decode.py after a read of that length at those
#           settings (graph replay, the steady rate, step 8's fastest split kernel)
#   step 4  the 8B at 24 GB, --policy full: the first length in LENGTHS that fails (one-line refusal or OOM)
#   step 5  the captured decode step's tests on CUDA (graph replay = eager body; the kernels' tests)
#   step 6  decode after a 32K read at b=16,384 (int8 cache): graph replay (fused ops and not; with the norms and
#           SiLU inside Triton GEMVs where the weights are bf16) vs eager step vs forward
#           with nf4 weights (bench/experiments/gpu_decode.py); the same for SmolLM2-135M (b=1024, bf16 cache); with
#           step 8's fastest split kernel for the cache (gpu_attn.py --best), the default where step 8 did not run
#   step 9  the same through the graph with bf16, int4 (quanto) and int8 (LLM.int8) weights (the planner's speed
#           table)
#   step 8  decode attention alone at the 8B's and SmolLM2's shapes (bench/experiments/gpu_attn.py: the split
#           kernel's ways, split targets, warps a program and the dot way's blocks; KERNELS: other versions of
#           kernels/_qattn_triton.py to time beside the tree's, files in the tree)
#   step 10 one token's weight products alone at the 8B's shape, by precision: bf16, nf4 (bitsandbytes), int4
#           (optimum-quanto: torch's tinygemm), int8 (LLM.int8); GB/s against the device's copy bandwidth
#           (bench/experiments/gpu_weights.py; about a minute, no model needed)
#   step 7  where a 16K (LEN7) LOCRET prefill's GPU time goes, 8B nf4 at b=16,384 (bench/experiments/gpu_prefill_profile.py)

set -o pipefail
OUT=${1:?usage: tools/gpu/planner_8b.sh OUT_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/../.." || exit 1
PY=${PY:-python3}
. tools/gpu/env.sh
DRY=${DRY:-0}
STEPS=${STEPS:-"0 8 1 3 6 10 7 5 9 2 4"}
MODELS=${MODELS:-"llama-3.1-8b-instruct phi-3-mini-128k-instruct"}
CAPS=${CAPS:-"24 12 8"}
LENGTHS=${LENGTHS:-"32768 65536 98304 131072"}
MODELS_DIR=${MODELS_DIR:-$OUT/models}  # the random models (16 GB for the 8B): outside OUT where OUT travels back
BIG=${BIG:-llama-3.1-8b-instruct}  # the model of steps 3, 4, 7, 8, 9 (a small one for a rehearsal on a CPU)
SMALL=smollm2-135m-instruct
LC="$PY -m localchat"
export LOCALCHAT_CONFIG_DIR=${LOCALCHAT_CONFIG_DIR:-$OUT/config}  # no user profile interferes
mkdir -p "$LOCALCHAT_CONFIG_DIR"

run() {  # run OUTFILE CMD...: skip when OUTFILE exists; stdout to OUTFILE, stderr to OUTFILE.err
    local out=$1; shift
    if [ -s "$out" ]; then echo "skip (done): $out"; return 0; fi
    echo "+ $*  > $out"
    [ "$DRY" = 1 ] && return 0
    local t0=$SECONDS
    "$@" > "$out.part" 2> "$out.err"; local rc=$?
    mv "$out.part" "$out"
    echo "$rc $((SECONDS - t0))s $*" >> "$OUT/summary.txt"
}

doc() {  # doc TOKENS: a plain-text document of about TOKENS tokens (sentences with numbers, no repetition)
    local f="$OUT/doc-$1.txt"
    [ -s "$f" ] || "$PY" - "$1" "$f" <<'EOF'
import random, sys
n, path = int(sys.argv[1]), sys.argv[2]
rng = random.Random(n)
words = "the river city report engine budget summer window cache model reader answer table field".split()
out, count = [], 0
while count < n:
    s = " ".join(rng.choice(words) for _ in range(12)) + f" {rng.randrange(10**6)}."
    out.append(s.capitalize())
    count += 21  # about 21 tokens a sentence for the random models' tokenizer (16 gave 171,724 for 131,072)
open(path, "w").write("\n".join(out) + "\n")
EOF
    echo "$f"
}

for step in $STEPS; do case $step in
0) run "$OUT/env.txt" bash -c "nvidia-smi; $PY -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'" ;;
1) for m in $MODELS $SMALL; do
       [ -s "$MODELS_DIR/$m/localchat-random-model.json" ] && { echo "skip (done): model $m"; continue; }
       run "$OUT/build-$m.txt" $LC bench random-model "tests/data/configs/$m.json" "$MODELS_DIR/$m" \
           ${TOKENIZER:+--tokenizer "$TOKENIZER"}
   done ;;
2) for m in $MODELS; do for cap in $CAPS; do
       run "$OUT/plan-$m-${cap}gb.json" env LOCALCHAT_GPU_MEMORY_GB=$cap $LC --model "$MODELS_DIR/$m" --heads random plan --json
       run "$OUT/verify-$m-${cap}gb.json" env LOCALCHAT_GPU_MEMORY_GB=$cap $LC --model "$MODELS_DIR/$m" --heads random plan --verify --json
   done; done ;;
3) f=$(doc ${LEN3:-131072})
   [ "$DRY" = 1 ] || { nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -lms 200 > "$OUT/gpu-busy-128k.csv" & }
   SMI=$!
   run "$OUT/read-128k-$BIG-rtx4090.txt" env LOCALCHAT_GPU_MEMORY_GB=24 $LC --profile rtx4090 --model "$MODELS_DIR/$BIG" \
       --heads random --max-new-tokens 64 ask --file "$f" --stats "What is the last number in the document?"
   [ "$DRY" = 1 ] || kill $SMI
   # decode after a read of the same length at the same settings: the steady rate, without ask's one capture
   run "$OUT/decode-128k-$BIG-nf4.txt" env LOCALCHAT_GPU_MEMORY_GB=24 $PY bench/experiments/gpu_decode.py \
       --length ${LEN3:-131072} --tokens 128 --model "$MODELS_DIR/$BIG" --weights nf4 --ways graph \
       --budget 16384 --chunk 4096 --kv int8 $($PY bench/experiments/gpu_attn.py --best "$OUT/attn-$BIG.json" --bits 8) \
       --out "$OUT/decode-128k-$BIG-nf4" ;;
4) for n in $LENGTHS; do
       f=$(doc "$n")
       run "$OUT/full-$n-$BIG-24gb.txt" env LOCALCHAT_GPU_MEMORY_GB=24 $LC --model "$MODELS_DIR/$BIG" --policy full \
           --max-new-tokens 8 ask --file "$f" --stats "What is the last number in the document?"
       grep -q "^[1-9]" <(tail -1 "$OUT/summary.txt" 2>/dev/null) && break  # the first failure is the answer
   done ;;
5) run "$OUT/tests-graph-step.txt" $PY -m pytest -q -p no:cacheprovider -m "not model and not slow" tests/engine/test_graph_step.py \
       tests/kernels/test_kernels.py tests/kernels/test_fused.py ;;
6) GD="$PY bench/experiments/gpu_decode.py --length ${LEN6:-32768} --tokens 128"
   BEST="$PY bench/experiments/gpu_attn.py --best"  # step 8's fastest split kernel per cache, when it ran
   for m in $MODELS; do  # the 8B, and Phi-3-mini when MODELS names it
       run "$OUT/decode-$m-nf4.txt" $GD --model "$MODELS_DIR/$m" --weights nf4 --budget 16384 --kv int8 \
           --ways "graph,graph-unfused,eager step,forward" $($BEST "$OUT/attn-$BIG.json" --bits 8) \
           --out "$OUT/decode-$m-nf4"  # graph-gemv: the same as graph with nf4 weights
   done
   run "$OUT/decode-$SMALL.txt" $GD --model "$MODELS_DIR/$SMALL" --weights bf16 --budget 1024 --kv none \
       $($BEST "$OUT/attn-$SMALL.json" --bits 0) --out "$OUT/decode-$SMALL" ;;
8) run "$OUT/attn-$BIG.txt" $PY bench/experiments/gpu_attn.py --programs 264,528,1056 --dot-blocks 32,64 --warps 4,8 \
       --caches 8r,0 ${KERNELS:+--kernels $KERNELS} --out "$OUT/attn-$BIG.json"
   run "$OUT/attn-$SMALL.txt" $PY bench/experiments/gpu_attn.py --units 1167 --q-heads 9 --kv-heads 3 --head-dim 64 \
       --layers 30 --programs 132,264,528 --dot-blocks 32,64 --warps 4,8 --caches 0 ${KERNELS:+--kernels $KERNELS} \
       --out "$OUT/attn-$SMALL.json" ;;
9) run "$OUT/decode-$BIG-bf16-int4-int8.txt" $PY bench/experiments/gpu_decode.py --length ${LEN6:-32768} --tokens 128 \
       --model "$MODELS_DIR/$BIG" --weights bf16,int4,int8 --ways graph --budget 16384 --kv int8 \
       $($PY bench/experiments/gpu_attn.py --best "$OUT/attn-$BIG.json" --bits 8) --out "$OUT/decode-$BIG-bf16-int4-int8" ;;
10) run "$OUT/weights-$BIG.txt" $PY bench/experiments/gpu_weights.py --config "tests/data/configs/$BIG.json" \
       --weights bf16,nf4,int4,int8 ${WLAYERS:+--layers $WLAYERS} --out "$OUT/weights-$BIG.json" ;;
7) run "$OUT/prefill-profile-$BIG.txt" $PY bench/experiments/gpu_prefill_profile.py --model "$MODELS_DIR/$BIG" \
       --weights nf4 --kv int8 --budget 16384 --length ${LEN7:-16384} --out "$OUT/prefill-profile-$BIG" ;;
esac; done
echo "done: $OUT (summary.txt: exit code, seconds, command)"
