"""One file of a hub repository at one commit, through huggingface_hub: its cache, token, resume and progress bar.

`metadata` asks the hub (one HEAD) what a file is at a revision: the commit, the size and, for a Git LFS file,
its sha256 (X-Linked-Etag), for a plain git file its git blob id (the ETag: sha1 of "blob <size>\\0" + bytes).
`download` brings the file into the Hugging Face cache (`hf_hub_download`), or finds it there offline. The
caller checks the bytes against the sha256 or the blob id (`git_blob_sha1`); `forget` removes a damaged copy
from the cache so the next download starts clean. Hub failures become Offline, Broken or a one-line UserError.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, get_hf_file_metadata, get_session, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from localchat import __version__
from localchat.errors import UserError, first_line

SHA256 = re.compile(r"[0-9a-f]{64}")
GIT_SHA1 = re.compile(r"[0-9a-f]{40}")


class Offline(Exception):
    """The hub cannot be reached: refused, no route, DNS failure, or HF_HUB_OFFLINE."""


class Broken(Exception):
    """A download broke (the connection, or fewer bytes than the hub announced) after huggingface_hub's retries."""


@dataclass(frozen=True)
class Remote:
    """A file of a hub repository at a revision (a commit once the hub has answered)."""

    repo: str
    file: str
    revision: str
    endpoint: str
    token: str | bool | None = None


@dataclass(frozen=True)
class Metadata:
    commit: str
    size: int | None
    sha256: str | None  # None when the file is not in Git LFS (the hub then gives a git blob id)
    blob_sha1: str | None = None  # a plain git file's blob id (its ETag); None for a Git LFS file


def offline_mode() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment says now."""
    now = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper()
    return constants.is_offline_mode() or now in {"1", "ON", "YES", "TRUE"}


def hub_endpoint(endpoint: str | None = None) -> str:
    """`endpoint`, else HF_ENDPOINT as set now, else huggingface_hub's default."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def transport():
    """The HTTP library of huggingface_hub's own session: httpx2 under huggingface_hub 2.x, httpx under 1.x
    (transformers 5 accepts both, and an image may hold either one alone)."""
    return importlib.import_module(type(get_session()).__module__.split(".")[0])


@contextmanager
def hub_calls(remote: Remote) -> Iterator[None]:
    """Hub failures as Offline, Broken, or a one-line UserError naming the repository."""
    repo = remote.repo
    try:
        yield
    except (OfflineModeIsEnabled, LocalEntryNotFoundError) as exc:
        raise Offline(first_line(exc.__cause__, 200) if exc.__cause__ else "HF_HUB_OFFLINE is set") from None
    except GatedRepoError:
        raise UserError(f"{repo} is gated: accept its terms on the hub, then run `hf auth login` (or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise UserError(f"{repo} was not found on {remote.endpoint} (a private repository needs `hf auth login`)") from None
    except RevisionNotFoundError:
        raise UserError(f"{repo} has no revision {remote.revision!r}") from None
    except EntryNotFoundError:
        raise UserError(f"{repo} has no file {remote.file} at {remote.revision[:12]}") from None
    except HfHubHTTPError as exc:
        raise UserError(f"{repo}: the hub answered {first_line(exc, 200)}") from None
    except Exception as exc:
        http = transport()
        if isinstance(exc, (http.ConnectError, http.ConnectTimeout, http.ProxyError)):
            raise Offline(first_line(exc, 200)) from None
        if isinstance(exc, http.TransportError):
            raise Broken(first_line(exc, 200)) from None
        if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
            raise Broken(first_line(exc, 200)) from None
        raise


def metadata(remote: Remote) -> Metadata:
    """What the hub says `remote` is (one HEAD request, not retried: offline is known in seconds)."""
    url = hf_hub_url(remote.repo, remote.file, revision=remote.revision, endpoint=remote.endpoint)
    with hub_calls(remote):
        meta = get_hf_file_metadata(url, token=remote.token, endpoint=remote.endpoint, library_name="localchat",
                                    library_version=__version__)
    etag = (meta.etag or "").strip('"').lower()
    return Metadata(commit=meta.commit_hash or remote.revision, size=meta.size,
                    sha256=etag if SHA256.fullmatch(etag) else None,
                    blob_sha1=etag if GIT_SHA1.fullmatch(etag) else None)


def download(remote: Remote) -> Path:
    """The file in the Hugging Face cache, downloaded there when it is not (resumed within the run when the
    connection breaks; a progress bar on stderr)."""
    with hub_calls(remote):
        return Path(hf_hub_download(remote.repo, remote.file, revision=remote.revision, endpoint=remote.endpoint,
                                    token=remote.token, library_name="localchat", library_version=__version__))


def cached(remote: Remote) -> tuple[Path, str | None] | None:
    """(the file, and the sha256 its cache entry is named by) when the Hugging Face cache holds it at
    `remote.revision` (a commit), else None. No network."""
    found = cache_entry(remote)
    if found is None:
        return None
    path, blob, _ = found
    return path, blob if SHA256.fullmatch(blob) else None


def cache_entry(remote: Remote) -> tuple[Path, str, str] | None:
    """(the file, the name of its blob, the commit of its snapshot) when the Hugging Face cache holds it at
    `remote.revision` (a commit, or a branch the cache recorded the commit of), else None. The cache names a
    blob by the ETag the hub gave: an LFS file's sha256, a plain git file's blob id. No network."""
    try:
        path = Path(hf_hub_download(remote.repo, remote.file, revision=remote.revision, local_files_only=True))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, OSError, ValueError):
        return None
    snapshot = path.parents[len(Path(remote.file).parts) - 1]  # snapshots/<commit>/<file>
    return path, Path(os.path.realpath(path)).name, snapshot.name


def git_blob_sha1(path: Path, block: int = 1 << 22) -> str:
    """The git blob id of a file: sha1 of b"blob <size>\\0" + its bytes (what the hub gives as a plain git
    file's ETag)."""
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def forget(path: Path) -> None:
    """Remove a downloaded file from the Hugging Face cache: its snapshot link and the blob behind it."""
    blob = Path(os.path.realpath(path))
    for p in (path, blob):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
