"""`localchat chat`: a plain line-by-line chat in the terminal (stdin/stdout), for terminals without the window.

A `Session` carries the compressed cache from turn to turn, as in the chat window: a follow-up reads only
its own tokens. Commands: /attach PATH, /new, /help, /quit. A pasted or dropped file path attaches the file.
"""

from __future__ import annotations

import sys
import threading

from localchat.documents import DEFAULT_MAX_BYTES, Document, load_document, parse_path_input
from localchat.engine.events import Error, Notice
from localchat.engine.sampling import GenerationSettings
from localchat.errors import UserError, check_text
from localchat.render import stream_to
from localchat.session import Session
from localchat.turn import answer

HELP = "commands: /attach PATH  /new  /help  /quit   (paste a file path to attach it; Ctrl+C stops an answer)"


def run_chat(engine, settings: GenerationSettings | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
             stdin=sys.stdin, stdout=sys.stdout) -> int:
    print(f"localchat — {engine.name} on {engine.device.type}, policy {engine.policy.name}. {HELP}",
          file=stdout, flush=True)
    if settings is None and engine.spec is not None:
        settings = engine.spec.generation
    session = Session(engine)
    pending: list[Document] = []
    while True:
        stdout.write("you> ")
        stdout.flush()
        line = stdin.readline()
        if not line:
            return 0
        line = line.strip()
        if not line:
            continue
        try:
            check_text(line, "the line")
        except UserError as exc:
            print(f"error: {exc}", file=stdout)
            continue
        if line in ("/quit", "/exit"):
            return 0
        if line == "/help":
            print(HELP, file=stdout)
            continue
        if line == "/new":
            session.clear()
            pending = []
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
        if _answer(session, line, pending, settings, stdout):
            pending = []  # the documents now belong to the conversation


def _answer(session: Session, question: str, documents: list[Document], settings, stdout) -> bool:
    """Stream one turn; True when it was answered (a stopped or failed turn leaves the session as it was)."""
    cancel = threading.Event()
    stdout.write("bot> ")

    def events():
        for ev in answer(session, question, documents, settings, cancel):
            if isinstance(ev, Notice):
                print(f"({ev.message})", file=stdout)
            else:
                yield ev

    final = stream_to(events(), cancel, stdout)
    if final is None:
        print("\n(stopped)", file=stdout)
        return False
    if isinstance(final, Error):
        print(f"\nerror: {final.message}", file=stdout)
        return False
    print(f"\n({final.prompt_tokens:,} tokens read at {final.prefill_tps:,.0f} tok/s, "
          f"{final.new_tokens} written at {final.decode_tps:,.1f} tok/s)", file=stdout)
    return final.stop_reason != "cancelled"
