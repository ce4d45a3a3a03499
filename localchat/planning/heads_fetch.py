"""Retaining heads for carded models from an official LOCRET release, kept converted in the user cache.

A release is one heads-only file in a hub repository (`torch.save` of a bf16 state dict with the keys
`model.layers.N.self_attn.fc1/fc2.weight`). The card pins the repository, the file and the commit; the commit
fixes the file's Git LFS sha256, which the hub reports (X-Linked-Etag). A fetch asks the hub for that sha256,
downloads the file through huggingface_hub (its cache, token, resume and progress bar), checks the bytes against
it, reads it with `torch.load(weights_only=True)`, checks every shape against the card, and converts it into
the user cache atomically (bf16 kept: the tensors are the release's, exactly), recording where it came from.
A damaged download is removed from the Hugging Face cache and nothing is installed; the next fetch starts clean.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from localchat import paths
from localchat.engine import weights_check
from localchat.engine.cards import ModelCard
from localchat.engine.heads_files import CONFIG, WEIGHTS
from localchat.errors import UserError
from localchat.filelock import Locked

if TYPE_CHECKING:  # the hub client is imported where a release is fetched: finding cached heads needs none of it
    from localchat.planning.hub import Remote

Say = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Release:
    """The card's [heads] table: which file of which repository, at which commit, and its stated width."""

    repo: str
    file: str
    commit: str
    d_r: int | None
    size_mb: int | None  # the download, as the card states it (what users are told before fetching)

    @classmethod
    def of(cls, card: ModelCard) -> Release | None:
        h = card.heads
        if not h.get("repo"):
            return None
        try:
            return cls(repo=str(h["repo"]), file=str(h["file"]), commit=str(h["commit"]),
                       d_r=int(h["d_r"]) if "d_r" in h else None,
                       size_mb=int(h["size_mb"]) if "size_mb" in h else None)
        except KeyError as exc:
            raise UserError(f"the model card of {card.name} lacks heads.{exc.args[0]}") from None

    def describe(self) -> str:
        size = f" ({self.size_mb:,} MB)" if self.size_mb else ""
        return f"{self.repo}/{self.file}{size}"


def heads_cache_dir(card: ModelCard) -> Path:
    """Where the converted heads of `card`'s model live: <user cache>/heads/<card id>/."""
    return paths.cache_dir() / "heads" / card.id


def cached_heads(card: ModelCard) -> Path | None:
    """The cache directory when it holds complete converted heads (weights and config) that match the sha256
    recorded when they were converted, else None (then they are fetched again)."""
    directory = heads_cache_dir(card)
    if not ((directory / WEIGHTS).is_file() and (directory / CONFIG).is_file()):
        return None
    return directory if weights_check.problem(directory) is None else None


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
    `endpoint` (default HF_ENDPOINT), `token` (default the saved hub token) and `revision` (default the card's
    commit; when given, the hub is asked which commit it names) go to huggingface_hub. One-line UserError when
    there is no release, the hub is out of reach, the download is damaged, or the release does not fit the card."""
    from localchat.planning import hub
    from localchat.planning.hub import Broken, Offline, Remote

    out = heads_cache_dir(card)
    if revision is None and cached_heads(card):
        return out
    if (out / WEIGHTS).is_file():
        damage = weights_check.problem(out)
        if damage:
            say(f"the fetched retaining heads in {out} are damaged ({damage}); fetching them again")
    release = Release.of(card)
    if release is None:
        raise UserError(f"no official LOCRET release holds retaining heads for {card.name}; "
                        f"carded models with one: {releases_line()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with Locked(out.parent / f"{card.id}.lock", waiting=say):
        if revision is None and cached_heads(card):  # another process fetched them while this one waited
            return out
        remote = Remote(release.repo, release.file, revision or release.commit, hub.hub_endpoint(endpoint), token)
        try:
            remote, expected, path = _locate(remote)
            if cached_heads(card) and installed_commit(out) == remote.revision:
                return out
            if path is None:
                size = f"{expected.size / 1e6:,.0f} MB" if expected.size else "size unknown"
                say(f"Fetching the retaining heads of {card.name}: {remote.repo}/{remote.file} at "
                    f"{remote.revision[:12]} ({size}, once) ...")
                path = hub.download(remote)
        except Offline as exc:
            raise UserError(offline_message(card, str(exc))) from None
        except Broken as exc:
            raise UserError(f"the download of {card.name}'s retaining heads broke ({exc}); nothing was installed: "
                            f"run `localchat heads fetch {card.id}` again") from None
        got = weights_check.sha256_of(path)
        if got != expected.value:
            hub.forget(path)
            raise UserError(f"the download of {release.repo}/{release.file} is damaged (sha256 {got[:12]}…, the hub "
                            f"lists {expected.value[:12]}… for commit {remote.revision[:12]}); it was removed and nothing "
                            f"was installed: run `localchat heads fetch {card.id}` again")
        source = {"repo": release.repo, "commit": remote.revision, "file": release.file, "sha256": expected.value,
                  "endpoint": remote.endpoint}
        _install(path, card, release, source, out)
    return out


@dataclass(frozen=True)
class Expected:
    value: str  # the sha256 the file must have
    size: int | None


def installed_commit(out: Path) -> str | None:
    try:
        return json.loads((out / CONFIG).read_text(encoding="utf-8"))["source"]["commit"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _locate(remote: Remote) -> tuple[Remote, Expected, Path | None]:
    """(the file pinned to the commit the hub names, the sha256 it must have, the file when only the Hugging
    Face cache can serve it). Offline, a copy that cache holds at the pinned commit serves, checked against the
    sha256 its cache entry is named by."""
    from localchat.planning import hub
    from localchat.planning.hub import Offline

    try:
        if hub.offline_mode():
            raise Offline("HF_HUB_OFFLINE is set")
        meta = hub.metadata(remote)
    except Offline as exc:
        found = hub.cached(remote)
        if found is None or found[1] is None:
            raise Offline(str(exc)) from None
        return remote, Expected(found[1], None), found[0]
    if meta.sha256 is None:
        raise UserError(f"{remote.repo}/{remote.file} is not a Git LFS file on {remote.endpoint}, so the hub gives no "
                        f"sha256 to check it against; localchat does not install unchecked heads")
    return replace(remote, revision=meta.commit), Expected(meta.sha256, meta.size), None


def _install(path: Path, card: ModelCard, release: Release, source: dict, out: Path) -> None:
    """Read the checked file, check every shape against the card, and convert it into `out` atomically."""
    from localchat.engine.heads import check_official, read_official, save_heads

    found = read_official(path)
    shape = card_head_shape(card)
    d_r = check_official(found, shape, f"{release.repo}/{release.file}", release.d_r)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        save_heads(tmp, found, shape, d_r, {"kind": "fetched", "model": card.id, "source": source})
        weights_check.stamp(tmp)  # the bytes as converted, checked whenever they are used (cached_heads)
        if out.exists():  # an incomplete or damaged earlier result
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
