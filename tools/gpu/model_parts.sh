#!/usr/bin/env bash
# The default model's GGUF (98 MB) to a lent GPU machine in parts: one `device` call carries at most 64 MiB, and the
# repo's tracked tree is ~44 MiB of it (less with the big results files moved out for those calls).
#
#   bash tools/gpu/model_parts.sh split [MIB]   # here: .gpu-model/K/part-NN, one part of MIB (default 20) per folder
#   # then one warm call per folder: carry [".gpu-model/K"] (and `.whl` in the first), and run
#   bash tools/gpu/model_parts.sh stash         # there: the carried parts -> $STASH (default /root/model-parts)
#   bash tools/gpu/model_parts.sh join          # there, after the last: the GGUF into $LOCALCHAT_CACHE_DIR, checked
#
# The machine keeps /root between warm calls (30 s idle). `join` checks the SHA-256 the model card names, so a
# missing or damaged part fails there with a one-line message, before any benchmark starts.

set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
PARTS=.gpu-model
STASH=${STASH:-/root/model-parts}
CACHE=${LOCALCHAT_CACHE_DIR:-$HOME/.cache/localchat}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
DEST=$CACHE/models/smollm2-135m-instruct
SHA=$(sed -n 's/^sha256 = "\(.*\)"/\1/p' models/smollm2-135m-instruct.toml)

case "${1:-}" in
split)
    src=$DEST/$GGUF
    [ -f "$src" ] || { echo "no $src: run \`localchat fetch-model\` here first"; exit 1; }
    rm -rf "$PARTS" && mkdir -p "$PARTS"
    split -b "${2:-20}M" -d "$src" "$PARTS/part-"
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
    mkdir -p "$DEST" && cat "$STASH"/part-* >"$DEST/$GGUF.part" || exit 1
    got=$(sha256sum "$DEST/$GGUF.part" | cut -d' ' -f1)
    if [ "$got" != "$SHA" ]; then
        echo "the joined GGUF's SHA-256 ${got:0:12} is not the card's ${SHA:0:12}: a part is missing or damaged ($(ls "$STASH" | tr '\n' ' '))"
        exit 1
    fi
    mv "$DEST/$GGUF.part" "$DEST/$GGUF" && echo "joined $DEST/$GGUF"
    ;;
*)
    echo "usage: tools/gpu/model_parts.sh split [MIB] | stash | join"; exit 2
    ;;
esac
