"""Small text helpers shared by the chat window's modules."""

from __future__ import annotations


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when empty)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
