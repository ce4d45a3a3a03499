"""A plain line-by-line chat in the terminal (stdin/stdout), until the Textual TUI lands.

Each turn re-reads the whole conversation (the compressed multi-turn session comes with the sessions
issue). Commands: /attach PATH, /new, /help, /quit. A pasted or dropped file path attaches the file.
"""

from __future__ import annotations

import sys
import threading

from localchat.documents import Document, load_document, parse_path_input
from localchat.engine.events import Error
from localchat.errors import UserError
from localchat.render import stream_to, user_turn

HELP = "commands: /attach PATH  /new  /help  /quit   (paste a file path to attach it; Ctrl+C stops an answer)"


def run_chat(args, settings, stdin=sys.stdin, stdout=sys.stdout) -> int:
    from localchat.cli import load_engine

    engine = load_engine(args)
    print(f"localchat — {engine.name} on {engine.device.type}, policy {engine.policy.name}. {HELP}",
          file=stdout, flush=True)
    messages: list[dict] = []
    pending: list[Document] = []
    max_bytes = int(args.max_file_mb * 1024 * 1024)
    while True:
        stdout.write("you> ")
        stdout.flush()
        line = stdin.readline()
        if not line:
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return 0
        if line == "/help":
            print(HELP, file=stdout)
            continue
        if line == "/new":
            messages, pending = [], []
            print("(new conversation)", file=stdout)
            continue
        path = line[len("/attach"):].strip() if line.startswith("/attach") else parse_path_input(line)
        if path is not None:
            try:
                doc = load_document(path, max_bytes=max_bytes)
            except UserError as exc:
                print(f"error: {exc}", file=stdout)
                continue
            pending.append(doc)
            print(f"(attached {doc.name}: {engine.count_tokens(doc.text):,} tokens; now ask about it)", file=stdout)
            continue
        if line.startswith("/"):
            print(f"error: unknown command {line.split()[0]}; {HELP}", file=stdout)
            continue
        turn = {"role": "user", "content": user_turn(line, pending)}
        answer = _answer(engine, [*messages, turn], settings, stdout)
        if answer is not None:  # keep the turn only if it was answered
            messages += [turn, {"role": "assistant", "content": answer}]
            pending = []


def _answer(engine, messages, settings, stdout) -> str | None:
    cancel = threading.Event()
    stdout.write("bot> ")
    final = stream_to(engine.chat(messages, settings, cancel), cancel, stdout)
    if final is None:
        print("\n(stopped)", file=stdout)
        return None
    if isinstance(final, Error):
        print(f"\nerror: {final.message}", file=stdout)
        return None
    print(f"\n({final.prompt_tokens:,} tokens read at {final.prefill_tps:,.0f} tok/s, "
          f"{final.new_tokens} written at {final.decode_tps:,.1f} tok/s)", file=stdout)
    return final.text if final.stop_reason != "cancelled" else None
