"""Terminal rendering for the headless CLI: a one-line progress bar and the prompt layout of documents."""

from __future__ import annotations

import sys
from typing import TextIO

from localchat.documents import Document
from localchat.engine.events import Done, Error, Notice, Progress, Token
from localchat.errors import UserError


def user_turn(question: str, documents: list[Document]) -> str:
    """One user message: the question, the documents, then the question again.

    Small models answer from a long document far more reliably when the question both precedes and
    follows it (SmolLM2-135M on 6K-token pass-key documents: 0/6 with the question only after, 6/6 with
    it on both sides; bench/results/prompt-layout-smollm2-6k.txt).
    """
    question = question.strip()
    if not documents:
        return question
    names = ", ".join(d.name for d in documents)
    what = "document" if len(documents) == 1 else "documents"
    parts = [f'<document name="{d.name}">\n{d.text.strip()}\n</document>' for d in documents]
    return "\n\n".join([f"Read the {what} {names} below, then answer: {question}", *parts, f"Question: {question}"])


def _seconds(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class ProgressBar:
    """`[#####.....] 3072/6144 tokens  1234 tok/s  ETA 3s`, redrawn in place; silent unless a terminal."""

    def __init__(self, stream: TextIO | None = None, width: int = 30):
        self.stream = stream or sys.stderr
        self.width = width
        self.enabled = self.stream.isatty()
        self.drawn = False

    def update(self, p: Progress) -> None:
        if not self.enabled:
            return
        filled = int(self.width * p.done / max(p.total, 1))
        bar = "#" * filled + "." * (self.width - filled)
        line = f"\rreading [{bar}] {p.done}/{p.total} tokens  {p.tokens_per_s:,.0f} tok/s  ETA {_seconds(p.eta_s)} "
        self.stream.write(line)
        self.stream.flush()
        self.drawn = True

    def clear(self) -> None:
        if self.drawn:
            self.stream.write("\r" + " " * (self.width + 70) + "\r")
            self.stream.flush()
            self.drawn = False


class OutputClosed(UserError):
    def __init__(self):
        super().__init__("the output was closed before the answer ended (the reader of the pipe stopped), so the "
                         "answer stopped there; a saved chat is left as it was")


def stream_to(events, cancel, out: TextIO) -> Done | Error | None:
    """Draw prefill progress, write answer tokens to `out`; return the final Done or Error.

    Ctrl+C sets `cancel`, lets the engine stop at its next chunk or token, and returns None.
    """
    bar = ProgressBar()
    midline = False  # answer text written since the last line break on the terminal
    try:
        for ev in events:
            if isinstance(ev, Progress):
                bar.update(ev)
                continue
            bar.clear()
            if isinstance(ev, Notice):  # e.g. the chunk was halved after running out of memory
                print(("\n" if midline else "") + f"localchat: {ev.message}", file=sys.stderr)
                midline = False
                continue
            if isinstance(ev, Token):
                midline = True
                out.write(ev.text)
                out.flush()
            else:
                return ev
    except KeyboardInterrupt:
        cancel.set()
        for _ in events:
            pass
    except BrokenPipeError:  # `| head`: the reader is gone; stop at the next token, keep nothing of the turn
        cancel.set()
        for _ in events:
            pass
        raise OutputClosed() from None
    finally:
        bar.clear()
    return None
