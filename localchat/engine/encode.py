"""Tokenizing a long text in pieces, with the same ids as one call.

A fast tokenizer keeps, for every token of a call, its string, offsets and masks beside the id: a 1M-token
document took 620 MB more at its peak than the ids themselves (a 128K one 40 MB). So a text of more than
2 x PIECE characters is cut about every PIECE characters, before a space between two words, and each piece is
encoded alone. A cut is kept only where it changes no token: the WINDOW characters on either side, encoded
together, give the ids of the two halves encoded apart (a BPE's merges stay within the pre-tokenizer's words,
which are far shorter than the window). A text with no such cut in reach is encoded in one call.
"""

from __future__ import annotations

PIECE = 65_536  # characters per piece, about 16K tokens of English
WINDOW = 256  # characters each side of a cut that must tokenize the same cut or not


def ids(tokenizer, text: str) -> list[int]:
    """The token ids of `text` without special tokens."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode(tokenizer, text: str) -> list[int]:
    """ids(tokenizer, text), computed piece by piece for a long text."""
    if len(text) <= 2 * PIECE:
        return ids(tokenizer, text)
    out: list[int] = []
    start = 0
    for cut in cuts(tokenizer, text):
        out += ids(tokenizer, text[start:cut])
        start = cut
    return out + ids(tokenizer, text[start:])


def cuts(tokenizer, text: str):
    """Positions to cut `text` at, each about PIECE characters after the last, where cutting changes no token."""
    at = PIECE
    while at < len(text) - PIECE:
        cut = _cut_near(tokenizer, text, at)
        if cut is None:
            at += PIECE
            continue
        yield cut
        at = cut + PIECE


def _cut_near(tokenizer, text: str, at: int, tries: int = 8) -> int | None:
    """The first cut from `at` on (before a space between two non-spaces) that changes no token, within PIECE / 2
    characters and `tries` candidates; None if there is none."""
    end = min(len(text) - WINDOW, at + PIECE // 2)
    c = text.find(" ", at, end)
    for _ in range(tries):
        if c < 0:
            return None
        if not text[c - 1].isspace() and not text[c + 1].isspace() and _same(tokenizer, text, c):
            return c
        c = text.find(" ", c + 1, end)
    return None


def _same(tokenizer, text: str, c: int) -> bool:
    left, right = text[c - WINDOW:c], text[c:c + WINDOW]
    return ids(tokenizer, left + right) == ids(tokenizer, left) + ids(tokenizer, right)
