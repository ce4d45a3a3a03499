#!/usr/bin/env bash
# Run the chat window in tmux as a person would, on the real default model:
# drop (bracketed-paste) a 20K-token pass-key file's quoted path, ask for the key, watch the progress
# bar, read the streamed answer, ask a follow-up that must not re-read the document. Screens are
# captured with capture-pane into one text file.
#
#   tools/tui_tmux.sh [OUT]        (default OUT: bench/results/tui-tmux-capture.txt)
#
# Needs tmux and the repo's .venv (PY, default .venv/bin/python; the chat runs as .venv/bin/localchat).
# The document, the chat's data and config directories live in a `mktemp -d` directory, removed at exit.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/bench/results/tui-tmux-capture.txt}
PY=${PY:-$ROOT/.venv/bin/python}
WORK=$(mktemp -d)
S=localchat-tui-$$
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
trap 'tmux kill-session -t "$S" 2>/dev/null || true; rm -rf "$WORK"' EXIT

DOC="$WORK/pass key notes.txt"   # a space in the name: the drop arrives quoted
KEY=$("$PY" - "$DOC" <<'EOF'
import sys
from localchat.bench.tasks import passkey
from localchat.engine.loading import load
sample = passkey(load(None, say=lambda *a, **k: None).tokenizer, 20000, seed=7, depth=0.4)
open(sys.argv[1], "w").write(sample.document)
print(sample.answer)
EOF
)

capture() {  # capture() TITLE: append the screen to OUT
  { echo "=== $1 ($(date +%T))"; tmux capture-pane -p -t "$S"; echo; } >>"$OUT"
}

wait_for() {  # wait_for REGEX SECONDS: until the screen matches
  local end=$((SECONDS + $2))
  while ((SECONDS < end)); do
    tmux capture-pane -p -t "$S" | grep -Eq "$1" && return 0
    sleep 0.5
  done
  capture "TIMEOUT waiting for /$1/"
  echo "timed out waiting for /$1/; see $OUT" >&2
  exit 1
}

: >"$OUT"
echo "# tools/tui_tmux.sh on $(uname -m), OMP_NUM_THREADS=$OMP_NUM_THREADS; hidden pass key $KEY" >>"$OUT"
tmux new-session -d -s "$S" -x 140 -y 40 \
  "cd '$ROOT' && LOCALCHAT_DATA_DIR='$WORK/data' LOCALCHAT_CONFIG_DIR='$WORK/config' .venv/bin/localchat --max-new-tokens 48"
wait_for "policy locret\. Paste" 180
capture "started"

# A terminal drop is a bracketed paste of the shell-quoted path.
tmux set-buffer -b drop "'$DOC'"
tmux paste-buffer -p -b drop -t "$S"
wait_for "attached pass key notes.txt" 60
capture "after dropping the file"

tmux send-keys -t "$S" -l "What is the pass key? Answer with the number only."
tmux send-keys -t "$S" Enter
wait_for "reading [0-9,]+/[0-9,]+ tokens" 120
sleep 3
capture "reading the document"
tmux send-keys -t "$S" -l "typed while reading"   # keys are handled during prefill
sleep 1
capture "typed during prefill"
tmux send-keys -t "$S" C-u
wait_for "read [0-9,]+ new tokens in" 900
sleep 1
capture "first answer"
tmux capture-pane -p -t "$S" | grep -q "$KEY" && echo "# the answer names the pass key $KEY" >>"$OUT" \
  || echo "# the pass key $KEY is not on the screen" >>"$OUT"

tmux send-keys -t "$S" C-r   # the retained map
sleep 1
capture "retained map"
tmux send-keys -t "$S" C-r

tmux send-keys -t "$S" -l "Thanks. Say it again, please."
tmux send-keys -t "$S" Enter
start=$SECONDS
# done when a stats line shows a read of under 1,000 new tokens: the 20K document was not read again
until tmux capture-pane -p -t "$S" | grep -Eq "read [0-9]{1,3} new tokens"; do
  ((SECONDS - start < 600)) || { capture "TIMEOUT waiting for the follow-up"; exit 1; }
  sleep 0.5
done
sleep 1
capture "follow-up ($((SECONDS - start)) s after Enter)"
tmux capture-pane -p -t "$S" | grep -o "read [0-9,]* new tokens in [0-9.]* s" | sed 's/^/# /' >>"$OUT"
tmux send-keys -t "$S" C-q
sleep 1
echo "wrote $OUT"
