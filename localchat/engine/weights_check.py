"""Checksums of converted weights (the default model and user GGUFs, dequantized into safetensors once).

The conversion records each weights file's sha256 and size in STAMP, with the file's identity (size, mtime,
ctime, inode) when it was last hashed. A later start re-hashes a file only when that identity changed: hashing
the default model's 538 MB took 0.5 to 1.6 s on a busy 2-core CPU, two to five times the 0.3 s from_pretrained
takes to load it, while the stat check takes 0.14 ms. Any write to the file, truncation, replacement or copy changes its ctime or
inode (ctime cannot be set back by a user), so damage done through the file system is caught; bits that rot on
the disk without a write are not. A directory converted before checksums were kept is hashed once and trusted
from then on.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

STAMP = "localchat-weights.json"


def sha256_of(path: Path, block: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def _identity(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _write(directory: Path, stamp: dict) -> None:
    """Write STAMP atomically; a read-only directory just means hashing again next time."""
    tmp = directory / (STAMP + ".tmp")
    try:
        tmp.write_text(json.dumps(stamp, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, directory / STAMP)
    except OSError:
        tmp.unlink(missing_ok=True)


def stamp(directory: Path) -> None:
    """Record the sha256 of every *.safetensors file in `directory` (right after converting into it)."""
    files = {}
    for path in sorted(directory.glob("*.safetensors")):
        files[path.name] = {"sha256": sha256_of(path), "size": path.stat().st_size, "checked": _identity(path)}
    _write(directory, {"format": "localchat-weights-1", "files": files})


def problem(directory: Path) -> str | None:
    """None when the weights in `directory` match their recorded checksums, else what is wrong (a short phrase)."""
    try:
        recorded = json.loads((directory / STAMP).read_text(encoding="utf-8"))
        files = recorded["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError
    except FileNotFoundError:  # converted before checksums were kept: trust it once, check it from now on
        stamp(directory)
        return None
    except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError):
        return f"its checksum record {STAMP} is unreadable"
    changed = False
    for name, rec in files.items():
        path = directory / name
        if not isinstance(rec, dict) or Path(name).name != name:
            return f"its checksum record {STAMP} is unreadable"
        try:
            now = _identity(path)
        except OSError:
            return f"{name} is missing"
        if now == rec.get("checked"):
            continue
        if now[0] != rec.get("size"):
            return f"{name} is {now[0]:,} bytes, not {rec.get('size'):,}" if isinstance(rec.get("size"), int) \
                else f"its checksum record {STAMP} is unreadable"
        if sha256_of(path) != rec.get("sha256"):
            return f"{name} does not match its sha256"
        rec["checked"], changed = now, True  # the same bytes (a copy, a touch): no need to hash again
    if changed:
        _write(directory, recorded)
    return None
