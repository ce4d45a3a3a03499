"""Trained scorers for carded models from official releases, kept in the user cache: LOCRET retaining heads
(converted) and KVzap scorers (installed verbatim).

A release is one heads-only file in a hub repository (`torch.save` of a bf16 state dict with the keys
`model.layers.N.self_attn.fc1/fc2.weight`). The card pins the repository, the file and the commit; the commit
fixes the file's Git LFS sha256, which the hub reports (X-Linked-Etag). A fetch asks the hub for that sha256,
downloads the file through huggingface_hub (its cache, token, resume and progress bar), checks the bytes against
it, reads it with `torch.load(weights_only=True)`, checks every shape against the card, and converts it into
the user cache atomically (bf16 kept: the tensors are the release's, exactly), recording where it came from.
A damaged download is removed from the Hugging Face cache and nothing is installed; the next fetch starts clean.

A KVzap release (engine/kvzap.py) is a hub repository as `save_pretrained` writes it: config.json, a plain git
file whose hub ETag is its git blob id, and model.safetensors in Git LFS (its sha256 in X-Linked-Etag). The
card's [kvzap] table names the repository and a commit (or a branch: the fetch then asks the hub which commit it
names and records that one). Both files come from that one commit through huggingface_hub, each checked against
the hash the hub gives for it (a file the hub gives no hash for is refused); config.json is checked against the
card before the weights download, and the two files are installed verbatim, with where they came from
(source.json) and the weights' sha256 stamp, in one atomic rename.
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
from localchat.engine import kvzap, weights_check
from localchat.engine.cards import ModelCard
from localchat.engine.heads_files import CONFIG, WEIGHTS
from localchat.errors import UserError
from localchat.filelock import Locked

if TYPE_CHECKING:  # the hub client is imported where a release is fetched: finding cached heads needs none of it
    from localchat.planning.hub import Metadata, Remote

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


# --- KVzap scorers --------------------------------------------------------------------------------------------

SOURCE = "source.json"  # beside a fetched KVzap release: where its two files came from, and their hashes


@dataclass(frozen=True)
class KVzapRelease:
    """The card's [kvzap] table: which repository, at which commit (or branch), and the scorer it holds."""

    repo: str
    revision: str  # the commit the card pins, or a branch ("main") whose commit the hub names at fetch time
    hidden_dim: int | None  # the MLP's width; None: a linear scorer
    size_mb: float | None  # the download, as the card states it

    @classmethod
    def of(cls, card: ModelCard) -> KVzapRelease | None:
        t = card.kvzap
        if not t.get("repo"):
            return None
        revision = t.get("commit") or t.get("revision")
        if not revision:
            raise UserError(f"the model card of {card.name} lacks kvzap.commit (or kvzap.revision)")
        return cls(repo=str(t["repo"]), revision=str(revision),
                   hidden_dim=int(t["hidden_dim"]) if t.get("hidden_dim") is not None else None,
                   size_mb=float(t["size_mb"]) if "size_mb" in t else None)

    def describe(self) -> str:
        size = f" ({self.size_mb:,.0f} MB)" if self.size_mb else ""
        return f"{self.repo}{size}"


def default_kind(card: ModelCard) -> str:
    """Which trained scorer `localchat heads fetch` brings for `card`: "kvzap" where its [policy] is kvzap or it
    has a KVzap release and no LOCRET one, else "locret"."""
    if card.policy.get("name") == "kvzap" or (card.kvzap_release and not card.heads_release):
        return "kvzap"
    return "locret"


def fetch_command(card: ModelCard, kind: str) -> str:
    return f"localchat heads fetch {card.id}" + ("" if kind == default_kind(card) else f" --kind {kind}")


def kvzap_cache_dir(card: ModelCard) -> Path:
    """Where the fetched KVzap scorer of `card`'s model lives: <user cache>/kvzap/<card id>/."""
    return paths.cache_dir() / "kvzap" / card.id


def cached_kvzap(card: ModelCard) -> Path | None:
    """The cache directory when it holds a complete fetched release whose files match the sha256 recorded when
    it was installed, else None (then it is fetched again)."""
    directory = kvzap_cache_dir(card)
    return directory if kvzap_damage(directory) is None else None


def kvzap_damage(directory: Path) -> str | None:
    """None when `directory` holds a fetched KVzap release as installed, else what is wrong (a short phrase)."""
    missing = [n for n in (kvzap.CONFIG, kvzap.WEIGHTS, SOURCE, weights_check.STAMP) if not (directory / n).is_file()]
    if missing:
        return f"{missing[0]} is missing"
    damage = weights_check.problem(directory)
    if damage:
        return damage
    try:
        recorded = json.loads((directory / SOURCE).read_text(encoding="utf-8"))["files"][kvzap.CONFIG]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{SOURCE} is unreadable"
    if weights_check.sha256_of(directory / kvzap.CONFIG) != recorded:
        return f"{kvzap.CONFIG} does not match its sha256"
    return None


def kvzap_releases_line() -> str:
    from localchat.engine import cards

    return ", ".join(c.id for c in cards.all_cards() if c.kvzap_release) or "none"


def kvzap_offline_message(card: ModelCard, reason: str) -> str:
    release = KVzapRelease.of(card)
    return (f"cannot reach the hub for {card.name}'s KVzap scorer (release {release.repo if release else '?'}: "
            f"{reason}); run `{fetch_command(card, 'kvzap')}` on a connected machine and copy the directory it "
            f"prints to {kvzap_cache_dir(card)} here, or pass --heads DIR or choose another --policy")


@dataclass(frozen=True)
class Digest:
    """What a file must hash to, as the hub attests it: a Git LFS file's sha256, or a plain git file's blob id."""

    kind: str  # "sha256" or "git_sha1"
    value: str
    size: int | None = None

    @classmethod
    def named(cls, name: str, size: int | None = None) -> Digest | None:
        """The digest a Hugging Face cache blob name (the ETag the hub gave) stands for."""
        from localchat.planning.hub import GIT_SHA1, SHA256

        name = name.lower()
        return (cls("sha256", name, size) if SHA256.fullmatch(name) else
                cls("git_sha1", name, size) if GIT_SHA1.fullmatch(name) else None)

    @classmethod
    def given(cls, meta: Metadata, remote: Remote) -> Digest:
        if meta.sha256:
            return cls("sha256", meta.sha256, meta.size)
        if meta.blob_sha1:
            return cls("git_sha1", meta.blob_sha1, meta.size)
        raise UserError(f"{remote.repo}/{remote.file} on {remote.endpoint}: the hub gives neither a Git LFS sha256 "
                        f"nor a git blob id to check it against; localchat does not install unchecked files")

    def of(self, path: Path) -> str:
        from localchat.planning import hub

        return weights_check.sha256_of(path) if self.kind == "sha256" else hub.git_blob_sha1(path)


def fetch_kvzap(card: ModelCard, *, say: Say = _stderr, endpoint: str | None = None, token: str | bool | None = None,
                revision: str | None = None) -> Path:
    """`kvzap_cache_dir(card)` holding the card's released KVzap scorer, fetched once. `endpoint` (default
    HF_ENDPOINT), `token` (default the saved hub token) and `revision` (default the card's commit or branch; the
    hub is asked which commit a branch names) go to huggingface_hub. One-line UserError when there is no
    release, the hub is out of reach, a download is damaged, or the release does not fit the card."""
    from localchat.planning import hub
    from localchat.planning.hub import Broken, Offline, Remote

    out = kvzap_cache_dir(card)
    if revision is None and cached_kvzap(card):
        return out
    if out.exists():
        damage = kvzap_damage(out)
        if damage:
            say(f"the fetched KVzap scorer in {out} is damaged ({damage}); fetching it again")
    release = KVzapRelease.of(card)
    if release is None:
        raise UserError(f"no released KVzap scorer for {card.name}; carded models with one: {kvzap_releases_line()}")
    command = fetch_command(card, "kvzap")
    out.parent.mkdir(parents=True, exist_ok=True)
    with Locked(out.parent / f"{card.id}.lock", waiting=say):
        if revision is None and cached_kvzap(card):  # another process fetched it while this one waited
            return out
        first = Remote(release.repo, kvzap.CONFIG, revision or release.revision, hub.hub_endpoint(endpoint), token)
        tmp: Path | None = None
        try:
            files = _locate_kvzap(first)
            commit = files[0][0].revision
            if cached_kvzap(card) and _installed_kvzap_commit(out) == commit:
                return out
            if any(path is None for _, _, path in files):
                sizes = [d.size for _, d, _ in files]
                size = f"{sum(sizes) / 1e6:,.0f} MB" if all(sizes) else "size unknown"
                say(f"Fetching the KVzap scorer of {card.name}: {release.repo} at {commit[:12]} ({size}, once) ...")
            tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
            source = {"kind": "fetched", "model": card.id, "repo": release.repo, "revision": first.revision,
                      "commit": commit, "endpoint": first.endpoint, "files": {}}
            where = f"{release.repo} at {commit[:12]}"
            for remote, digest, path in files:
                if path is None and remote.file == first.file and first.revision != commit:
                    # asked by the branch, so that huggingface_hub's cache records the commit it names (offline,
                    # the branch then finds these files there); the hub must still name the same commit
                    path = hub.download(first)
                    if path.parent.name != commit:
                        raise UserError(f"{release.repo} moved from {commit[:12]} to {path.parent.name[:12]} during "
                                        f"the fetch; nothing was installed: run `{command}` again")
                path = path or hub.download(remote)
                source["files"][remote.file] = _install_checked(path, digest, tmp / remote.file, remote, command)
                if remote.file == kvzap.CONFIG:  # before the weights download: a release made for another model
                    _check_kvzap_fits(kvzap.read_config(tmp), card, release, where)
            config = kvzap.check_release(tmp, where)
            _check_kvzap_fits(config, card, release, where)
            (tmp / SOURCE).write_text(json.dumps(source, indent=1) + "\n", encoding="utf-8")
            weights_check.stamp(tmp)  # the weights' sha256, checked whenever they are used (cached_kvzap)
            if out.exists():  # an incomplete or damaged earlier copy
                shutil.rmtree(out)
            os.replace(tmp, out)
        except Offline as exc:
            raise UserError(kvzap_offline_message(card, str(exc))) from None
        except Broken as exc:
            raise UserError(f"the download of {card.name}'s KVzap scorer broke ({exc}); nothing was installed: "
                            f"run `{command}` again") from None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def _installed_kvzap_commit(out: Path) -> str | None:
    try:
        return json.loads((out / SOURCE).read_text(encoding="utf-8"))["commit"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _locate_kvzap(first: Remote) -> list[tuple[Remote, Digest, Path | None]]:
    """config.json and model.safetensors, each pinned to the commit the hub names for `first.revision`, with the
    digest it must have and, when only the Hugging Face cache can serve it, the file. Offline, copies that cache
    holds at that revision serve, checked against the digests their cache entries are named by."""
    from localchat.planning import hub
    from localchat.planning.hub import Offline

    names = (kvzap.CONFIG, kvzap.WEIGHTS)
    try:
        if hub.offline_mode():
            raise Offline("HF_HUB_OFFLINE is set")
        meta = hub.metadata(first)
        pinned = replace(first, revision=meta.commit)
        found = [(pinned, Digest.given(meta, pinned), None)]
        for name in names[1:]:
            remote = replace(pinned, file=name)
            found.append((remote, Digest.given(hub.metadata(remote), remote), None))
        return found
    except Offline as exc:
        found, revision = [], first.revision
        for name in names:
            entry = hub.cache_entry(replace(first, file=name, revision=revision))
            digest = Digest.named(entry[1]) if entry else None
            if entry is None or digest is None:
                raise Offline(str(exc)) from None
            revision = entry[2]  # the commit the cache holds the first file at: the others from the same one
            found.append((replace(first, file=name, revision=revision), digest, entry[0]))
        return found


def _install_checked(path: Path, digest: Digest, target: Path, remote: Remote, command: str) -> dict:
    """Copy the downloaded file to `target` and check the copy against `digest`; a mismatch removes the download
    from the Hugging Face cache and installs nothing. What source.json records of the file."""
    from localchat.planning import hub

    shutil.copyfile(path, target)
    got = digest.of(target)
    if got != digest.value:
        hub.forget(path)
        what = "sha256" if digest.kind == "sha256" else "git blob id"
        raise UserError(f"the download of {remote.repo}/{remote.file} is damaged ({what} {got[:12]}…, the hub lists "
                        f"{digest.value[:12]}… for commit {remote.revision[:12]}); it was removed and nothing was "
                        f"installed: run `{command}` again")
    record = {"size": target.stat().st_size}
    record["sha256"] = got if digest.kind == "sha256" else weights_check.sha256_of(target)
    if digest.kind == "git_sha1":
        record["git_sha1"] = got
    return record


def _check_kvzap_fits(config: dict, card: ModelCard, release: KVzapRelease, where: str) -> None:
    """The release was made for the card's model (hidden size, KV heads, layers) and is the variant the card
    names (linear, or an MLP of the card's width)."""
    s = card.shape
    try:
        hidden, kv_heads, layers = int(s["hidden"]), int(s["kv_heads"]), int(s["layers"])
    except KeyError as exc:
        raise UserError(f"the model card of {card.name} lacks shape.{exc.args[0]}") from None
    kvzap.check_fits(config, hidden, kv_heads, layers, where)
    if config.get("hidden_dim") != release.hidden_dim:
        said = f"an MLP of width {release.hidden_dim}" if release.hidden_dim else "a linear scorer"
        raise UserError(f"the KVzap scorer in {where} is {kvzap.variant(config)} (hidden_dim "
                        f"{config.get('hidden_dim')}); the model card of {card.name} names {said}")
