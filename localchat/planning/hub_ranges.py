"""Byte ranges of files in a hub repository, read through huggingface_hub (its URLs, auth token and HTTP session).

A repository is pinned to one commit first, so every later read sees the same files. Safetensors headers are
read with two small Range requests (the 8-byte little-endian length, then the JSON header); chosen byte ranges
are downloaded into part files, and a broken connection continues from the end of its part file.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, get_hf_file_metadata, get_session, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

from localchat import __version__
from localchat.errors import UserError

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
RETRIES = 3  # resumes of one range within a call after the connection breaks
MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one


class Offline(Exception):
    """The hub cannot be reached: refused, no route, DNS failure, or HF_HUB_OFFLINE."""


class Broken(Exception):
    """A download broke more often than RETRIES allows; its part file stays for the next run."""


def offline_mode() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub read it at import, or as the environment says now."""
    now = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper()
    return constants.is_offline_mode() or now in {"1", "ON", "YES", "TRUE"}


def hub_endpoint(endpoint: str | None = None) -> str:
    """`endpoint`, else HF_ENDPOINT as set now, else huggingface_hub's default."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


@dataclass(frozen=True)
class Remote:
    """One repository at one revision (a commit once pinned)."""

    repo: str
    revision: str
    endpoint: str
    token: str | bool | None = None

    def url(self, filename: str) -> str:
        return hf_hub_url(self.repo, filename, revision=self.revision, endpoint=self.endpoint)

    def headers(self, **extra: str) -> dict[str, str]:
        return {**build_hf_headers(token=self.token, library_name="localchat", library_version=__version__), **extra}


@contextmanager
def hub_calls(remote: Remote) -> Iterator[None]:
    """Hub failures as Offline, Broken, or a one-line UserError naming the repository."""
    repo = remote.repo
    try:
        yield
    except OfflineModeIsEnabled:
        raise Offline("HF_HUB_OFFLINE is set") from None
    except GatedRepoError:
        raise UserError(f"{repo} is gated: accept its terms on the hub, then run `hf auth login` (or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise UserError(f"{repo} was not found on {remote.endpoint} (a private repository needs `hf auth login`)") from None
    except RevisionNotFoundError:
        raise UserError(f"{repo} has no revision {remote.revision!r}") from None
    except HfHubHTTPError as exc:
        raise UserError(f"{repo}: the hub answered {_first_line(exc)}") from None
    except Exception as exc:
        http = transport()
        if isinstance(exc, (http.ConnectError, http.ConnectTimeout, http.ProxyError)):
            raise Offline(_first_line(exc) or type(exc).__name__) from None
        if isinstance(exc, http.TransportError):
            raise Broken(_first_line(exc) or type(exc).__name__) from None
        raise


def transport():
    """The HTTP library of huggingface_hub's own session: httpx2 under huggingface_hub 2.x, httpx under 1.x
    (transformers 5 accepts both, and an image may hold either one alone)."""
    return importlib.import_module(type(get_session()).__module__.split(".")[0])


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def pin(repo: str, revision: str, endpoint: str | None, token: str | bool | None) -> tuple[Remote, str]:
    """(the repository pinned to the commit `revision` names, and its weights entry: INDEX or SINGLE)."""
    remote = Remote(repo, revision, hub_endpoint(endpoint), token)
    with hub_calls(remote):
        for entry in (INDEX, SINGLE):
            try:
                meta = get_hf_file_metadata(remote.url(entry), token=token, endpoint=remote.endpoint,
                                            headers=remote.headers())
            except RemoteEntryNotFoundError:
                continue
            return Remote(repo, meta.commit_hash or revision, remote.endpoint, token), entry
    raise UserError(f"{repo} holds no safetensors weights (neither {INDEX} nor {SINGLE})")


def get_bytes(remote: Remote, filename: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file, in one Range request (small reads: headers, the index)."""
    with hub_calls(remote):
        response = get_session().get(remote.url(filename), headers=remote.headers(Range=f"bytes={start}-{end - 1}"),
                                     timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
        hf_raise_for_status(response)
    _check_partial(response, remote, filename, start)
    if len(response.content) != end - start:
        raise Broken(f"{filename}: {len(response.content)} bytes came for a range of {end - start}")
    return response.content


def get_file(remote: Remote, filename: str) -> bytes:
    """A small file whole (the shard index)."""
    with hub_calls(remote):
        response = get_session().get(remote.url(filename), headers=remote.headers(),
                                     timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
        hf_raise_for_status(response)
    return response.content


def files_with(remote: Remote, entry: str, wanted: Callable[[str], bool]) -> list[str]:
    """The weight files holding a tensor whose name `wanted` accepts (the index's weight map, or SINGLE)."""
    if entry == SINGLE:
        return [SINGLE]
    try:
        weight_map = json.loads(get_file(remote, INDEX))["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{remote.repo}: {INDEX} is not a safetensors index ({exc})") from None
    return sorted({f for key, f in weight_map.items() if wanted(key)})


def read_header(remote: Remote, filename: str) -> tuple[dict, int]:
    """(a safetensors file's JSON header, without __metadata__; where its data starts)."""
    (size,) = struct.unpack("<Q", get_bytes(remote, filename, 0, 8))
    if not 0 < size <= MAX_HEADER:
        raise UserError(f"{remote.repo}/{filename} is not a safetensors file (header length {size})")
    try:
        header = json.loads(get_bytes(remote, filename, 8, 8 + size))
    except ValueError as exc:
        raise UserError(f"{remote.repo}/{filename} has a damaged safetensors header ({exc})") from None
    header.pop("__metadata__", None)
    return header, 8 + size


def fetch_range(remote: Remote, filename: str, start: int, end: int, part: Path) -> None:
    """Bytes [start, end) of a file into `part`, continuing from what `part` already holds; a broken
    connection is resumed RETRIES times, then Broken is raised with the part file kept."""
    url, want, last = remote.url(filename), end - start, ""
    for _ in range(RETRIES + 1):
        have = part.stat().st_size if part.exists() else 0
        if have > want:  # not ours: start over
            part.unlink()
            have = 0
        if have == want:
            return
        try:
            with hub_calls(remote), get_session().stream(
                "GET", url, headers=remote.headers(Range=f"bytes={start + have}-{end - 1}"),
                timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT,
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    hf_raise_for_status(response)
                _check_partial(response, remote, filename, start + have)
                with open(part, "ab") as f:
                    for chunk in response.iter_bytes():  # as it arrives: a break keeps all that came
                        f.write(chunk)
        except (Broken, Offline) as exc:  # refused on a resume counts as broken too: the next run continues
            last = str(exc)
    if part.exists() and part.stat().st_size == want:
        return
    raise Broken(f"{filename}: {last}")


def _check_partial(response, remote: Remote, filename: str, start: int) -> None:
    """A 206 answer that starts where asked; a server that ignores Range would send the whole checkpoint."""
    got = response.headers.get("Content-Range", "")
    if response.status_code != 206 or not got.startswith(f"bytes {start}-"):
        raise UserError(f"{remote.endpoint} ignored a byte-range request for {remote.repo}/{filename} "
                        f"(status {response.status_code}); it cannot serve only the retaining heads")
