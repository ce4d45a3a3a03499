#!/usr/bin/env bash
# The default model's GGUF (98 MB) to a GPU machine in parts: one `device` call carries at most 64 MiB, and the
# repo's tracked tree is ~44 MiB of it (less with the big results files moved out for those calls).
#
#   bash tools/gpu/model_parts.sh split [MIB]   # here: .gpu-model/K/part-NN, one part of MIB (default 20) per folder
#   # then one warm call per folder: carry [".gpu-model/K"] (and `.whl` in the first), and run
#   bash tools/gpu/model_parts.sh stash         # there: the carried parts -> $STASH (default /root/model-parts)
#   bash tools/gpu/model_parts.sh join          # there, after the last: the GGUF into $LOCALCHAT_CACHE_DIR, checked
# split and join read the GGUF's place and digest from the model card with PY (default python3; there, with our
# wheels on PYTHONPATH); stash needs no Python.
#
# The machine keeps /root between warm calls (30 s idle). `join` checks the SHA-256 the model card names, so a
# missing or damaged part fails there with a one-line message, before any benchmark starts.

set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
PY=${PY:-python3}
PARTS=.gpu-model
STASH=${STASH:-/root/model-parts}
card() {  # GGUF, SHA: the GGUF's place in the cache and its digest, as the engine reads them from the model card
    . tools/gpu/env.sh
    read -r GGUF SHA < <("$PY" -c "from localchat.engine.cards import default_card
from localchat.engine.default_model import gguf_path
card = default_card(); print(gguf_path(card), card.source['sha256'])") || exit 1
}

case "${1:-}" in
split)
    card
    [ -f "$GGUF" ] || { echo "no $GGUF: run \`localchat fetch-model\` here first"; exit 1; }
    rm -rf "$PARTS" && mkdir -p "$PARTS"
    split -b "${2:-20}M" -d "$GGUF" "$PARTS/part-"
    k=0
    for part in "$PARTS"/part-*; do
        k=$((k + 1)) && mkdir "$PARTS/$k" && mv "$part" "$PARTS/$k/"
    done
    ls -lR "$PARTS"
    ;;
stash)
    mkdir -p "$STASH" && cp "$PARTS"/*/part-* "$STASH"/ && ls "$STASH"
    ;;
join)
    card
    mkdir -p "$(dirname "$GGUF")" && cat "$STASH"/part-* >"$GGUF.part" || exit 1
    got=$(sha256sum "$GGUF.part" | cut -d' ' -f1)
    if [ "$got" != "$SHA" ]; then
        echo "the joined GGUF's SHA-256 ${got:0:12} is not the card's ${SHA:0:12}: a part is missing or damaged ($(ls "$STASH" | tr '\n' ' '))"
        exit 1
    fi
    mv "$GGUF.part" "$GGUF" && echo "joined $GGUF"
    ;;
*)
    echo "usage: tools/gpu/model_parts.sh split [MIB] | stash | join"; exit 2
    ;;
esac
