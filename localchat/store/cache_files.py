"""A chat's compressed cache on disk: one safetensors file in <data dir>/caches/, written atomically.

The file is written in caches/partial/ (safetensors writes through a temporary file of its own beside its
target, under a name of its own), synced, and renamed into caches/ under a new name; the chat's row then points
at it. It is reused only when its fingerprint (model, heads, policy settings, chunk, positions, library
versions), the hash of the text it holds and its tensors' checksum all match; otherwise the next turn reads
the conversation again, and says why. A file a killed save left behind is collected once ORPHAN_GRACE old.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from localchat import __version__
from localchat.errors import UserError, first_line
from localchat.paths import PARTIAL, SAFETENSORS_TMP, collect_partial
from localchat.store.private import link_error, open_private, room

# torch, safetensors and the engine are imported where a cache is read or written: listing the chats imports none
if TYPE_CHECKING:
    import torch

FORMAT = "localchat-cache-1"
MAX_CACHE_BYTES = 2 << 30  # a larger cache (full attention over a long document) is not saved
# An unreferenced cache file this old was left by a process killed mid-save; a younger one may be another
# process's save in progress (written, waiting for the database, not yet committed).
ORPHAN_GRACE = 300.0
CACHE_NAME = re.compile(r"[0-9a-f]{12}-[0-9a-f]{12}-[0-9]+\.(safetensors|tmp)")  # what CacheFiles.write names


def _quantized_weights(engine) -> str | None:
    """The weights' quantization (int8/int4/nf4) and the layer type that holds it (CPU int4 was quanto's groups of
    128 before it was torch's packed groups of 32: other weights, so another cache), or None: a float dtype is
    already in the fingerprint's `dtype`, so a chat saved before the plan named fp32 explicitly keeps its cache."""
    from localchat.engine.heads import attention_modules

    weights = getattr(engine, "weights", None)
    if weights in (None, "fp32", "bf16", "fp16"):
        return None
    attn = next(m for m in attention_modules(engine.model) if m is not None)
    return f"{weights} {type(getattr(attn, 'q_proj', None) or attn.qkv_proj).__name__}"


def fingerprint(engine) -> str:
    """What a saved cache depends on besides the text: model, policy (incl. heads), versions."""
    import torch
    import transformers

    from localchat.engine.focus import ANSWER_ONLY

    facts = {
        "model": engine.name, "config": engine.model.config.to_json_string(use_diff=False),
        "dtype": str(next(engine.model.parameters()).dtype),
        "settings": {k: v for k, v in settings_of(engine).items() if k not in ANSWER_ONLY},
        "heads": _heads_hash(getattr(engine.policy, "heads", None)), "weights": _quantized_weights(engine),
        "torch": torch.__version__, "transformers": transformers.__version__, "localchat": __version__,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


def _heads_hash(heads) -> str | None:
    """sha256 of the retaining heads' weights (computed once per heads object)."""
    if heads is None:
        return None
    if getattr(heads, "weights_sha256", None) is None:
        h = hashlib.sha256()
        for name, t in sorted(heads.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().float().cpu().numpy().tobytes())
        heads.weights_sha256 = h.hexdigest()
    return heads.weights_sha256


def settings_of(engine) -> dict:
    """The cache settings a chat is answered with (policy and its parameters, positions, chunk, --kv):
    saved next to it, and part of its cache's fingerprint."""
    p = engine.policy
    fields = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "heads"}
    return {"policy": p.name, **fields, "positions": engine.positions, "chunk": engine.chunk,
            "kv": getattr(engine, "kv", "none")}


def tensors_hash(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, shapes, dtypes and bytes, in name order (a saved cache's checksum)."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save_file(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """safetensors' save_file, imported when a cache is first written."""
    from safetensors.torch import save_file as save

    save(tensors, path, metadata=metadata)


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class CacheFiles:
    """The cache files in `directory` (<data dir>/caches, 0700)."""

    def __init__(self, directory: Path):
        self.directory = room(directory)

    def write(self, session) -> str | None:
        """Write `session`'s cache as a new file; its name (None when there is nothing worth saving)."""
        cache = session.cache
        if cache is None or not session.messages or session.stale or session.kv_bytes > MAX_CACHE_BYTES:
            return None
        tensors = {k: v.contiguous() for k, v in cache.tensors().items()}
        meta = {"fingerprint": fingerprint(session.engine), "text": text_hash(session.cached_text),
                "fed": str(session.fed), "positions": cache.positions, "layers": str(len(cache.layers)),
                "format": FORMAT, "sha256": tensors_hash(tensors)}
        stem = hashlib.sha256(session.name.encode()).hexdigest()[:12]
        final = self.directory / f"{stem}-{meta['text'][:12]}-{time.time_ns()}.safetensors"
        tmp = room(self.directory / PARTIAL) / final.with_suffix(".tmp").name
        try:
            save_file(tensors, str(tmp), metadata=meta)
            fd = open_private(tmp, os.O_RDONLY)
            try:
                os.fchmod(fd, 0o600)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk: give back what it took
            raise
        return final.name

    def read(self, session, name: str | None, fed: int) -> str | None:
        """Continue `session` (its messages restored) from the cache file `name`; None when it did, else why not.
        UserError for a link, which is never followed."""
        from safetensors import safe_open

        engine = session.engine
        if not name:
            return "no cache was saved with it"
        text = session.saved_text()
        try:
            path = self.path(name)
            if path is None:
                return "its file name is not one localchat writes"
            kind = path.lstat().st_mode
            if stat.S_ISLNK(kind):
                raise link_error(path)
            if not stat.S_ISREG(kind):
                return f"{path.name} in {self.directory} is not a file (a folder or a device is in its place)"
            with safe_open(str(path), framework="pt", device=str(engine.device)) as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    return "the file is not a localchat cache"
                if meta.get("fingerprint") != fingerprint(engine):
                    return "it was made with another model, policy, heads or library version"
                if meta.get("text") != text_hash(text) or int(meta.get("fed", -1)) != fed:
                    return "it does not match the saved messages"
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            if meta.get("sha256") != tensors_hash(tensors):  # flipped bytes would read as a wrong cache, silently
                return "the file is damaged: its tensors do not match their checksum"
        except FileNotFoundError:
            return "its file is missing"
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - a damaged file: say so, re-read
            return f"the file is damaged: {first_line(exc)}"
        saved_at = meta.get("positions")  # an evicting policy reads a conversation past the window at compact ones
        cache = engine.new_cache(positions="compact" if saved_at == "compact" and engine.policy.bounded() else None)
        if int(meta.get("layers", -1)) != len(cache.layers) or saved_at != cache.positions:
            return "its shape does not fit this model"
        try:
            cache.load_tensors(tensors)
        except (KeyError, RuntimeError) as exc:
            return f"the file is damaged: {exc}"
        session.restore_cache(cache, fed)
        return None

    def path(self, name: str | None) -> Path | None:
        """The file a row names, only when it is a plain name of a file in this directory (a damaged or hostile
        row naming `../x` or an absolute path is never read or deleted)."""
        if not name or Path(name).name != name or not name.endswith(".safetensors"):
            return None
        return self.directory / name

    def remove(self, name: str | None) -> None:
        """Remove a file a row named, when it is one (never a directory, a link's target, or a failure)."""
        path = self.path(name)
        if path is None:
            return
        try:
            if stat.S_ISREG(path.lstat().st_mode):
                path.unlink()
        except OSError:  # gone already; or not removable: collect() tries again later
            pass

    def collect(self, referenced: set[str], grace: float | None = None) -> int:
        """Remove the files no chat references that are older than `grace` seconds (ORPHAN_GRACE): what a process
        killed while writing (caches/partial/), between writing and committing, or between committing and
        removing the old file left behind. Only regular files in caches/partial/ or with names localchat (or
        safetensors, for it) writes, never through a link. Returns how many went."""

        def ours(name: str) -> bool:  # our names, and safetensors' temporary files of earlier versions
            return name not in referenced and bool(CACHE_NAME.fullmatch(name) or SAFETENSORS_TMP.fullmatch(name))

        return collect_partial(self.directory, ours, ORPHAN_GRACE if grace is None else grace)
