# Sourced from the repo root by tools/gpu/grid.sh and tools/gpu/lanes.sh, with PY set: the uninstalled repo
# on PYTHONPATH (in front of whatever PYTHONPATH holds, e.g. a `pip install --target` folder of wheels), no
# network, and pyproject's package-dir mapping (kernels/, models/, profiles/) as links in localchat/.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ! "$PY" -c "import localchat.kernels, localchat.models, localchat.builtin_profiles" 2>/dev/null; then
    for pair in kernels:kernels models:models builtin_profiles:profiles; do
        [ -e "localchat/${pair%%:*}" ] || ln -s "../${pair#*:}" "localchat/${pair%%:*}"
    done
fi
