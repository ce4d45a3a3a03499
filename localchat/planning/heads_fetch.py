"""Retaining heads for carded models from an official LOCRET release, kept converted in the user cache.

The official releases are whole models with the heads inside; `fetch_heads` reads only the heads' bytes: the
safetensors header of each shard that holds heads, then the heads' byte ranges (hub_ranges.py). The download is
resumable (part files beside the cache directory), locked against a second process, and lands atomically.

What is checked: the repository is pinned to one commit (its files cannot change under a fetch or a resume), every
range answer must start where asked and bring exactly the bytes asked for, and the heads' shapes, dtypes and byte
lengths must fit the card's model. The hub's own digest (the sha256 in X-Linked-Etag) covers a whole shard, which
a fetch of only the heads never has, so it cannot be checked; instead the converted heads' sha256 is recorded at
fetch time (engine/weights_check.py) and checked at every use: damaged heads are fetched again, with a notice.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localchat import paths
from localchat.engine import weights_check
from localchat.engine.cards import ModelCard
from localchat.engine.heads import CONFIG, OFFICIAL_KEY, WEIGHTS, RetainingHeads
from localchat.errors import UserError
from localchat.filelock import Locked
from localchat.planning import hub_ranges
from localchat.planning.hub_ranges import Broken, Offline

Say = Callable[[str], None]
MIB = 1 << 20
# safetensors dtypes a head may come in: torch name, bytes per value
DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def heads_cache_dir(card: ModelCard) -> Path:
    """Where the converted heads of `card`'s model live: <user cache>/heads/<card id>/."""
    return paths.cache_dir() / "heads" / card.id


def cached_heads(card: ModelCard) -> Path | None:
    """The cache directory when it holds complete converted heads (weights and config) that match the sha256
    recorded when they were fetched, else None (then they are fetched again)."""
    directory = heads_cache_dir(card)
    if not ((directory / WEIGHTS).is_file() and (directory / CONFIG).is_file()):
        return None
    return directory if weights_check.problem(directory) is None else None


@dataclass(frozen=True)
class Piece:
    """One head tensor of the release: where its bytes are and what they hold."""

    key: str  # ours: layers.N.fc1.weight
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offsets in `file`
    end: int


def card_head_shape(card: ModelCard) -> dict:
    """The `head_shape` dict of the card's model, from its [shape] table."""
    s = card.shape
    try:
        return {"layers": int(s["layers"]), "q_heads": int(s["q_heads"]), "kv_heads": int(s["kv_heads"]),
                "head_dim": int(s["head_dim"]), "act": str(s.get("activation", "silu"))}
    except KeyError as exc:
        raise UserError(f"the model card of {card.name} lacks shape.{exc.args[0]}") from None


def releases_line() -> str:
    from localchat.engine import cards

    return ", ".join(c.id for c in cards.all_cards() if c.heads_release) or "none"


def offline_message(card: ModelCard, reason: str) -> str:
    return (f"cannot reach the hub for {card.name}'s retaining heads (release {card.heads_release}: {reason}); "
            f"run `localchat heads fetch {card.id}` on a connected machine and copy the directory it prints to "
            f"{heads_cache_dir(card)} here, or pass --heads DIR or choose another --policy")


def fetch_heads(card: ModelCard, *, say: Say = _stderr, endpoint: str | None = None, token: str | bool | None = None,
                revision: str | None = None) -> Path:
    """`heads_cache_dir(card)` holding the heads of the card's official release, fetched and converted once.
    `endpoint` (default HF_ENDPOINT), `token` (default the saved hub token) and `revision` (default main) go to
    huggingface_hub. One-line UserError when there is no release, the hub is out of reach, or it does not fit."""
    if cached_heads(card):
        return heads_cache_dir(card)
    damage = weights_check.problem(heads_cache_dir(card)) if (heads_cache_dir(card) / WEIGHTS).is_file() else None
    if damage:
        say(f"the fetched retaining heads in {heads_cache_dir(card)} are damaged ({damage}); fetching them again")
    if not card.heads_release:
        raise UserError(f"no official LOCRET release holds retaining heads for {card.name}; "
                        f"carded models with one: {releases_line()}")
    if hub_ranges.offline_mode():
        raise UserError(offline_message(card, "HF_HUB_OFFLINE is set"))
    out = heads_cache_dir(card)
    out.parent.mkdir(parents=True, exist_ok=True)
    with Locked(out.parent / f"{card.id}.lock", waiting=say):
        if cached_heads(card):  # another process fetched them while this one waited
            return out
        try:
            return _fetch(card, out, say, endpoint, token, revision or "main")
        except Offline as exc:
            raise UserError(offline_message(card, str(exc))) from None
        except Broken as exc:
            raise UserError(f"the connection broke while fetching {card.name}'s retaining heads ({exc}); what came "
                            f"is kept: run `localchat heads fetch {card.id}` again to resume") from None


def _fetch(card: ModelCard, out: Path, say: Say, endpoint: str | None, token, revision: str) -> Path:
    repo = card.heads_release
    remote, entry = hub_ranges.pin(repo, revision, endpoint, token)
    files = hub_ranges.files_with(remote, entry, lambda key: OFFICIAL_KEY.search(key) is not None)
    pieces = [p for f in files for p in head_pieces(remote, f)]
    if not pieces:
        raise UserError(f"{repo} holds no LOCRET retaining heads (model.layers.N.self_attn.fc1/fc2.weight)")
    shape = card_head_shape(card)
    d_r = check_release(pieces, shape, card, repo)
    part_dir = _part_dir(out, repo, remote.revision)
    runs = coalesce(pieces)
    size = sum(r[2] - r[1] for r in runs)
    say(f"Fetching the retaining heads of {card.name} from {repo} ({len(pieces)} tensors, {size / MIB:,.1f} MiB "
        f"of {len(files)} file(s), only the heads' bytes) into {out} ...")
    done = 0
    for file, start, end in runs:
        hub_ranges.fetch_range(remote, file, start, end, part_dir / f"{file}.{start}-{end}.part")
        if size > 64 * MIB and (done + end - start) * 10 // size > done * 10 // size:  # a line per tenth
            say(f"  {(done + end - start) / MIB:,.0f} of {size / MIB:,.0f} MiB")
        done += end - start
    tensors = read_pieces(pieces, runs, part_dir)
    meta = {"kind": "fetched", "model": card.id,
            "source": {"repo": repo, "revision": revision, "commit": remote.revision, "files": files,
                       "endpoint": remote.endpoint}}
    heads = RetainingHeads(shape, d_r, meta)
    heads.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        heads.save(tmp)
        weights_check.stamp(tmp)  # the bytes as converted, checked whenever they are used (cached_heads)
        if out.exists():  # an incomplete earlier result
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(part_dir, ignore_errors=True)
    return out


def head_pieces(remote: hub_ranges.Remote, file: str) -> list[Piece]:
    """The head tensors one weight file holds, from its safetensors header."""
    header, base = hub_ranges.read_header(remote, file)
    pieces = []
    for name, info in header.items():
        m = OFFICIAL_KEY.search(name)
        if m:
            start, end = info["data_offsets"]
            pieces.append(Piece(f"layers.{m.group(1)}.fc{m.group(2)}.weight", file, info["dtype"],
                                tuple(info["shape"]), base + start, base + end))
    return pieces


def check_release(pieces: list[Piece], shape: dict, card: ModelCard, repo: str) -> int:
    """d_R when the release's heads fit the card's model (every layer, fc1 [d_R, (H_q+2H_kv)·d], fc2 [H_kv, d_R])."""
    keys = {p.key for p in pieces}
    want = {f"layers.{i}.fc{j}.weight" for i in range(shape["layers"]) for j in (1, 2)}
    if keys != want:
        layers = len({k.split(".")[1] for k in keys})
        raise UserError(f"{repo} does not fit {card.name}: it has retaining heads for {layers} layers, "
                        f"the model has {shape['layers']}")
    by_key = {p.key: p for p in pieces}
    d_r = by_key["layers.0.fc1.weight"].shape[0]
    in_dim = (shape["q_heads"] + 2 * shape["kv_heads"]) * shape["head_dim"]
    for p in sorted(pieces, key=lambda p: p.key):
        expected = (d_r, in_dim) if p.key.endswith("fc1.weight") else (shape["kv_heads"], d_r)
        if p.shape != expected:
            raise UserError(f"{repo} does not fit {card.name}: {p.key} is {list(p.shape)}, expected "
                            f"{list(expected)} (heads for another model?)")
        if p.dtype not in DTYPES:
            raise UserError(f"{repo}: {p.key} has dtype {p.dtype}, which localchat cannot read")
        if p.end - p.start != ITEMSIZE[p.dtype] * p.shape[0] * p.shape[1]:
            raise UserError(f"{repo}: the safetensors header of {p.file} is damaged ({p.key} has the wrong byte length)")
    return d_r


def coalesce(pieces: list[Piece]) -> list[tuple[str, int, int]]:
    """Byte ranges (file, start, end) to fetch: touching pieces of one file join into one request."""
    runs: list[list] = []
    for p in sorted(pieces, key=lambda p: (p.file, p.start)):
        if runs and runs[-1][0] == p.file and runs[-1][2] == p.start:
            runs[-1][2] = p.end
        else:
            runs.append([p.file, p.start, p.end])
    return [tuple(r) for r in runs]


def read_pieces(pieces: list[Piece], runs: list[tuple[str, int, int]], part_dir: Path) -> dict:
    """The head tensors, cut out of the downloaded ranges."""
    import torch

    out = {}
    for file, start, end in runs:
        data = bytearray((part_dir / f"{file}.{start}-{end}.part").read_bytes())
        for p in pieces:
            if p.file == file and start <= p.start and p.end <= end:
                dtype = getattr(torch, DTYPES[p.dtype])
                out[p.key] = torch.frombuffer(data[p.start - start:p.end - start], dtype=dtype).reshape(p.shape).clone()
    return out


def _part_dir(out: Path, repo: str, commit: str) -> Path:
    """Where partial downloads wait (kept when a run breaks); emptied when they belong to another commit."""
    part_dir = out.parent / f"{out.name}.partial"
    source = {"repo": repo, "commit": commit}
    stamp = part_dir / "source.json"
    try:
        if json.loads(stamp.read_text(encoding="utf-8")) != source:
            shutil.rmtree(part_dir)
    except (OSError, ValueError):
        shutil.rmtree(part_dir, ignore_errors=True)
    part_dir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(source) + "\n", encoding="utf-8")
    return part_dir
