"""A large paste becomes a document (and so a chip) instead of flooding the input."""

from __future__ import annotations

import hashlib
from pathlib import Path

from localchat.documents import Document


def pasted_document(text: str, index: int) -> Document:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    data = text.encode("utf-8")
    name = f"pasted-{index}.txt"
    return Document(path=Path(name), name=name, kind="text", text=text,
                    sha256=hashlib.sha256(data).hexdigest(), n_bytes=len(data))
