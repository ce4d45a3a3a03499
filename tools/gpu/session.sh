#!/usr/bin/env bash
# One GPU run for localchat (the quantization rows on CUDA, LOCRET vs full speed, the planner's CUDA check, the
# quantization / planner model tests), from the repo root, everything written under OUT:
#
#   export PYTHONPATH=WHEELS_DIR         # where `pip install --target WHEELS_DIR` put our wheels
#   bash tools/gpu/session.sh OUT_DIR
#
# The repo is not pip-installed: the script puts the repo on PYTHONPATH and, when localchat.kernels /
# localchat.models / localchat.builtin_profiles are not importable (pyproject maps them from kernels/, models/
# and profiles/ at install time), links them into localchat/ (kept afterwards; CLEAN_LINKS=1 removes them).
# The default model's GGUF must already be at
#   $LOCALCHAT_CACHE_DIR/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf (default ~/.cache/localchat):
# step 0 converts it to safetensors once (no network is needed or tried).
#
# Knobs (environment): DRY=1 prints the commands instead of running them; STEPS="0 1 2 3 4 5 6 7" picks steps;
# PY (default python3); N (default 6) / N32 (default 2): examples per bench cell at 4K+8K / at 32K;
# ASK_WEIGHTS (default "default nf4 int8"); CLEAN_LINKS=1; LATE32 (default 330) / LATE_EXTRA (default 420):
# the 32K rows / the extras of step 6 start only before that many seconds since the start.
#
# Time on the H100, estimated from the CPU runs in bench/results and a launch-bound 135M model (~20 ms per
# decoded token, ~30-50 ms per 512-token prefill chunk with LOCRET's eviction; +30-50 % with nf4 weights
# (bitsandbytes) or the int4 cache; ~15-20 s per process for imports, CUDA init, load and warm-up):
#   step 0  env, GGUF -> safetensors once, plan ... ~60 s (~30 s of it the one-time conversion, on the CPU)
#   step 1  ask at default (bf16) / nf4 / int8 ..... ~45 s (a fresh process each)
#   step 2  bench 4K+8K, N=6 (2 weights x 2 kv x 2 tasks x 2 lengths = 96 answers) ~120 s;
#           32K, N32=2 (16 answers, ~3-4 s each) ~90 s; report ~10 s
#   step 3  bench perf (7.6K side by side + LOCRET 4K..32K) ~40 s
#   step 4  plan --verify, budget 1024 / chunk 512 .. ~15 s
#   step 5  pytest -m model on test_model_quant.py and test_planner.py ~70 s
#   total   ~7.5 min. N cut from 10 to 6 and 32K at N32=2 to stay under 8 minutes (raise them if step 2 ran
#           fast: the bench resumes, rows already in quant-gpu/results.jsonl are not run again).
#   step 6  extras, each only if started before LATE_EXTRA: plan --verify at budget/chunk 512/256, 2048/1024,
#           4096/2048 (~15 s each), tests/kernels/test_kernels.py on CUDA (~30 s), `bench kernels` if it exists,
#           the int4-weights model test on the CPU (~45 s).
#   step 7  OmniKV --offload vs in memory: two-turn chats at 7,680 tokens, N=5 x 2 tasks, same answers?
#           peak GPU memory, speed (tools/gpu/offload_check.py; ~60-90 s)
#
# Every step's output goes to its own log in OUT; summary.txt has each command's exit code and seconds. The
# throw-away config and data directories (no config.toml, no saved chats) are made with `mktemp -d` under
# $TMPDIR (default /tmp) and removed at exit.
# A failing command never stops the script.

set -x
set -o pipefail

OUT=${1:?usage: tools/gpu/session.sh OUT_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO" || exit 1
exec > >(tee -a "$OUT/script.log") 2>&1

PY=${PY:-python3}
DRY=${DRY:-0}
STEPS=${STEPS:-"0 1 2 3 4 5 6 7"}
N=${N:-6}
N32=${N32:-2}
ASK_WEIGHTS=${ASK_WEIGHTS:-"default nf4 int8"}
LATE32=${LATE32:-330}
LATE_EXTRA=${LATE_EXTRA:-420}
SUMMARY=$OUT/summary.txt
T0=$(date +%s)

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 PIP_NO_INDEX=1  # no network there
export LOCALCHAT_CACHE_DIR=${LOCALCHAT_CACHE_DIR:-$HOME/.cache/localchat}
LOCALCHAT_CONFIG_DIR=$(mktemp -d "${TMPDIR:-/tmp}/localchat-config.XXXXXX")  # no config.toml: no default profile
LOCALCHAT_DATA_DIR=$(mktemp -d "${TMPDIR:-/tmp}/localchat-data.XXXXXX")
export LOCALCHAT_CONFIG_DIR LOCALCHAT_DATA_DIR
unset LOCALCHAT_PROFILE LOCALCHAT_MODEL LOCALCHAT_POLICY LOCALCHAT_POSITIONS LOCALCHAT_BUDGET LOCALCHAT_CHUNK \
      LOCALCHAT_STABILIZERS LOCALCHAT_LOCAL LOCALCHAT_WEIGHTS LOCALCHAT_KV LOCALCHAT_MARGIN_MIB
GGUF=$LOCALCHAT_CACHE_DIR/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # models/smollm2-135m-instruct.toml

elapsed() { echo $(($(date +%s) - T0)); }
want() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
# on_time LIMIT WHAT: true if less than LIMIT seconds have gone by, else a "skipped" line in summary.txt
on_time() { [ "$(elapsed)" -lt "$1" ] || { echo "skipped (t=$(elapsed)s >= $1 s): $2" | tee -a "$SUMMARY"; return 1; }; }

# run LOG LIMIT_S CMD...: run CMD under `timeout`, its output appended to LOG (and shown); the exit code and
# seconds go to LOG and summary.txt. Returns CMD's exit code; the script goes on either way.
run() {
    local log=$1 limit=$2 rc t1 secs
    shift 2
    printf '\n$ %s\n' "$(printf '%q ' "$@")" >>"$log"
    t1=$(date +%s.%N)
    if [ "$DRY" = 1 ]; then
        echo "DRY: timeout $limit $(printf '%q ' "$@")"
        rc=0
    else
        timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
        rc=${PIPESTATUS[0]}
    fi
    secs=$(awk -v a="$t1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    printf '[rc=%s, %ss]\n' "$rc" "$secs" >>"$log"
    printf '%-24s rc=%-4s %7ss  t=%4ss  %s\n' "$(basename "$log")" "$rc" "$secs" "$(elapsed)" "$*" >>"$SUMMARY"
    return "$rc"
}

echo "# tools/gpu/session.sh $(date -u +%FT%TZ) repo $REPO commit $(git rev-parse --short HEAD 2>/dev/null) DRY=$DRY" >>"$SUMMARY"
git status --short >"$OUT/git-status.txt" 2>&1

# --- the package layout without installing (pyproject's package-dir) ---------------------------------------
LINKS=()
if ! "$PY" -c "import localchat.kernels, localchat.models, localchat.builtin_profiles" 2>/dev/null; then
    for pair in kernels:kernels models:models builtin_profiles:profiles; do
        name=${pair%%:*} target=${pair#*:}
        if [ ! -e "localchat/$name" ]; then
            if [ "$DRY" = 1 ]; then echo "DRY: ln -s ../$target localchat/$name"; else ln -s "../$target" "localchat/$name" && LINKS+=("localchat/$name"); fi
        fi
    done
fi
echo "links made: ${LINKS[*]:-none}" >>"$SUMMARY"

MON=
if [ "$DRY" != 1 ] && command -v nvidia-smi >/dev/null; then  # GPU use once a second, for the whole session
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 1 >"$OUT/gpu-monitor.csv" 2>&1 &
    MON=$!
fi
cleanup() {
    [ -n "$MON" ] && kill "$MON" 2>/dev/null
    [ "${CLEAN_LINKS:-0}" = 1 ] && [ ${#LINKS[@]} -gt 0 ] && rm -f "${LINKS[@]}"
    rm -rf "$LOCALCHAT_CONFIG_DIR" "$LOCALCHAT_DATA_DIR"
}
trap cleanup EXIT

cat >"$OUT/versions.py" <<'EOF'  # what step 0 imports and prints (a file, so that `set -x` stays readable)
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "transformers", "bitsandbytes", "triton", "optimum.quanto", "accelerate", "gguf",
             "safetensors", "tokenizers", "huggingface_hub", "platformdirs", "pypdf", "localchat"):
    try:
        m = importlib.import_module(name)
        print("%-16s %-14s %s" % (name, getattr(m, "__version__", "?"), m.__file__))
    except Exception as exc:
        print("%-16s NOT IMPORTABLE: %s: %s" % (name, type(exc).__name__, exc))
import torch
print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available(), "threads", torch.get_num_threads())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0),
          "bf16", torch.cuda.is_bf16_supported(), "free/total GiB",
          [round(x / 2**30, 1) for x in torch.cuda.mem_get_info()])
import localchat.builtin_profiles, localchat.kernels, localchat.models
print("localchat.kernels backend:", localchat.kernels.backend())
EOF

# --- step 0: environment, the model once, the planner's CUDA view (~60 s) ----------------------------------
if want 0; then
    E=$OUT/env.txt
    run "$E" 30 nvidia-smi
    run "$E" 120 "$PY" "$OUT/versions.py"
    run "$E" 30 bash -c "ls -la '$GGUF' && sha256sum '$GGUF' && echo 'want    $GGUF_SHA'"
    run "$E" 300 "$PY" -m localchat fetch-model  # verifies the GGUF, converts it once (~30 s), prints the dir
    run "$E" 90 "$PY" -m localchat plan --profile none --json
    run "$E" 90 "$PY" -m localchat plan --profile none
fi

# --- step 1: load at nf4 / int8 / default (bf16 on CUDA) and answer (~45 s) ---------------------------------
if want 1; then
    A=$OUT/weights-answers.txt
    QUESTION="What is the capital of France? Answer in one sentence."
    for w in $ASK_WEIGHTS; do
        flags=()
        [ "$w" != default ] && flags=(--weights "$w")
        run "$A" 150 "$PY" -m localchat ask "${flags[@]}" --max-new-tokens 48 --stats "$QUESTION"
    done
fi

# --- step 2: the quantization rows on CUDA (~120 s at 4K+8K with N=6; ~90 s at 32K with N32=2) -----------------------
# --in-process: one model load per invocation instead of one fresh process per cell (~10-15 s each, 8 cells
# per weight); on CUDA the peak is torch.cuda.max_memory_allocated per example either way. One invocation
# per weight so that only one model is resident (in-process keeps every engine it loaded, and a CUDA peak
# would count the other model's weights too).
if want 2; then
    QG=$OUT/quant-gpu
    for w in bf16 nf4; do
        run "$OUT/bench-$w-4k8k.log" 300 "$PY" -m localchat bench --tasks passkey,niah_single --lengths 4k,8k \
            --policies locret --budgets 1024 --kv none,int4 --weights "$w" -n "$N" --in-process --out "$QG"
    done
    for w in bf16 nf4; do  # 32K, compact positions: LOCRET reads past the 8K window
        on_time "$LATE32" "32K $w" && run "$OUT/bench-$w-32k.log" 180 "$PY" -m localchat bench --tasks passkey,niah_single \
            --lengths 32k --policies locret --budgets 1024 --positions compact --kv none,int4 --weights "$w" \
            -n "$N32" --in-process --out "$QG"
    done
    run "$OUT/bench-report.log" 120 "$PY" -m localchat bench report "$QG"
fi

# --- step 3: LOCRET vs full speed on the GPU (~40 s) --------------------------------------------------------
if want 3; then
    run "$OUT/perf-gpu.log" 240 "$PY" -m localchat bench perf --out "$OUT/perf-gpu"
fi

# --- step 4: the planner, predicted vs measured peak (torch.cuda.max_memory_allocated) (~15 s) ---------------
if want 4; then
    run "$OUT/planner-gpu.log" 150 bash -c "'$PY' -m localchat plan --verify --profile none --json > '$OUT/planner-gpu.json'"
fi

# --- step 5: the model tests for quantization and the planner (~70 s) ---------------------------------------
# `-m model` replaces pyproject's `-m 'not slow'`, so the slow int8-KV test runs too (seconds on a GPU);
# one pytest per file so that a failure in one (-x) does not hide the other. Not here:
# test_int4_weights_load_and_answer_on_cpu: on a CUDA machine it loads int4 (optimum-quanto) on the GPU, where
# quanto's bf16 int4 path (TinyGemm) unpacks through its CUDA extension, built with nvcc at first use (AWQ and
# Marlin sources: minutes). Step 6 runs it as meant, on the CPU (CUDA hidden), if there is time.
INT4_TEST=tests/engine/test_model_quant.py::test_int4_weights_load_and_answer_on_cpu
if want 5; then
    P=$OUT/pytest-model.txt
    run "$P" 240 "$PY" -m pytest -m model -x -q -p no:cacheprovider tests/engine/test_model_quant.py --deselect "$INT4_TEST"
    run "$P" 240 "$PY" -m pytest -m model -x -q -p no:cacheprovider tests/planning/test_planner.py
fi

# --- step 6: extras, each only if it starts before LATE_EXTRA -----------------------------------------------
if want 6; then
    for bc in 512:256 2048:1024 4096:2048; do  # the other rows of bench/results/planner-smollm2-cpu.md (~15 s each)
        on_time "$LATE_EXTRA" "plan --verify b/c $bc" && run "$OUT/planner-gpu.log" 150 bash -c \
            "'$PY' -m localchat plan --verify --profile none --budget ${bc%:*} --chunk ${bc#*:} --json > '$OUT/planner-gpu-b${bc%:*}-c${bc#*:}.json'"
    done
    # the Triton kernels against their torch twins on real CUDA tensors (the CPU runs them interpreted) (~30 s)
    on_time "$LATE_EXTRA" "tests/kernels/test_kernels.py" &&
        run "$OUT/kernels-gpu.txt" 240 "$PY" -m pytest -x -q -p no:cacheprovider tests/kernels/test_kernels.py
    if on_time "$LATE_EXTRA" "bench kernels" && "$PY" -m localchat bench kernels --help >/dev/null 2>&1; then
        run "$OUT/kernels-gpu.txt" 240 "$PY" -m localchat bench kernels --out "$OUT/kernels-gpu"
    fi
    # the int4-weights test on the CPU, as its name says (quanto builds its small C++ unpack extension once, ~30 s)
    on_time "$LATE_EXTRA" "$INT4_TEST on the CPU" &&
        run "$OUT/pytest-model.txt" 240 env CUDA_VISIBLE_DEVICES= "$PY" -m pytest -m model -x -q -p no:cacheprovider "$INT4_TEST"
fi

# --- step 7: OmniKV --offload on CUDA (pinned host pages, side-stream copies): answers, memory, speed --------
if want 7; then
    run "$OUT/offload-gpu.log" 300 "$PY" tools/gpu/offload_check.py "$OUT/offload-gpu" --lengths 7680 -n 5
fi

echo "# done in $(elapsed) s" >>"$SUMMARY"
cat "$SUMMARY"
