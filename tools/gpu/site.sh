#!/usr/bin/env bash
# Build `.site/` here: what the GPU machine lacks, small enough to travel with the working tree (the device tool
# carries 64 MiB in all, the repo included). Its image has Python 3.12 with torch, transformers, triton, pytest,
# safetensors, accelerate and huggingface_hub; it has no network. On the GPU machine:
#
#   export PYTHONPATH=$PWD/.site; TOKENIZER=$PWD/.site/tokenizer bash tools/gpu/planner_8b.sh OUT
#
# - what the GPU steps import beyond the image, as Python 3.12 wheels unpacked (`pip install --target`): bitsandbytes,
#   optimum-quanto, platformdirs (the chat window, the server, GGUF and PDF readers are not run there);
# - bitsandbytes with only its CUDA 13.0 library (the image's torch is cu130; the wheel's eight libraries are 129 MB);
# - the default model's tokenizer (tokenizer/): `bench random-model --tokenizer` builds the random-weight models
#   with it (the default model's wheel, 93 MB, cannot travel).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
rm -rf .site && mkdir -p .site
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64"
PLAT="$PLAT --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
"$PY" -m pip install -q --target .site --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
    bitsandbytes==0.50.2 optimum-quanto==0.2.7 platformdirs
find .site/bitsandbytes -name 'libbitsandbytes_*' ! -name 'libbitsandbytes_cuda130.so' -delete
rm -rf .site/bin .site/*.dist-info/RECORD
"$PY" - <<'PY'
from pathlib import Path
import shutil
from localchat.engine.default_model import ensure_default_model
src, out = ensure_default_model(), Path(".site/tokenizer")
out.mkdir()
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    if (src / name).exists():
        shutil.copy(src / name, out / name)
PY
du -sh .site
