"""A loopback hub on 127.0.0.1 serving repositories made like NVIDIA's KVzap releases (nvidia/KVzap-{linear,mlp}-*),
and the releases themselves: what transformers' `save_pretrained` writes for kvpress's KVzapModel.

As the hub does, a HEAD or GET of /{repo}/resolve/{revision}/{file} answers a plain git file (config.json,
README.md) directly with its git blob id as ETag and X-Repo-Commit, and a Git LFS file (*.safetensors) with a 302
carrying X-Repo-Commit, X-Linked-Etag (the sha256), X-Linked-Size and the pointer's blob id as ETag, and Location:
an absolute CDN address (another port) that serves the bytes with its own ETag. A revision is the commit or
"main", which names it."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import urllib.parse

import torch
from hub_helpers import HubHandler, LoopbackHub, git_blob_id, lfs_pointer
from safetensors.torch import save

LFS = (".safetensors", ".bin")


def release_config(input_dim: int, output_dim: int, n_modules: int, hidden_dim: int | None,
                   dtype: str = "bfloat16") -> bytes:
    """config.json as `KVzapModel.save_pretrained` writes it (transformers' to_json_string: sorted keys, indent 2)."""
    config = {"architectures": ["KVzapModel"], "dtype": dtype, "hidden_dim": hidden_dim, "input_dim": input_dim,
              "model_type": "kvzap", "n_modules": n_modules, "output_dim": output_dim,
              "transformers_version": "4.57.1"}
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def release_tensors(input_dim: int, output_dim: int, n_modules: int, hidden_dim: int | None,
                    dtype: torch.dtype = torch.bfloat16, seed: int | None = 1) -> dict[str, torch.Tensor]:
    """The state dict of a KVzapModel, kvpress's key names and shapes; random values (`seed`), or zeros but for
    one marked value per tensor (`seed` None: quick at the real sizes)."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(n_modules):
        if hidden_dim is None:
            shapes.update({f"layers.{i}.weight": (output_dim, input_dim), f"layers.{i}.bias": (output_dim,)})
        else:
            shapes.update({f"layers.{i}.0.weight": (hidden_dim, input_dim), f"layers.{i}.0.bias": (hidden_dim,),
                           f"layers.{i}.2.weight": (output_dim, hidden_dim), f"layers.{i}.2.bias": (output_dim,)})
    out = {}
    for n, (key, shape) in enumerate(shapes.items()):
        if g is not None:
            out[key] = (torch.randn(shape, generator=g) * 0.02).to(dtype)
        else:
            t = torch.zeros(shape, dtype=dtype)
            t.view(-1)[0] = n + 1
            out[key] = t
    return out


def release_files(input_dim: int, output_dim: int, n_modules: int, hidden_dim: int | None,
                  dtype: torch.dtype = torch.bfloat16, seed: int | None = 1) -> dict[str, bytes]:
    """The repository's files: config.json, model.safetensors (with save_pretrained's metadata), and the rest
    of what the real repositories hold (.gitattributes, README.md), which a fetch does not need."""
    tensors = release_tensors(input_dim, output_dim, n_modules, hidden_dim, dtype, seed)
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}[dtype]
    return {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
            "README.md": b"---\nlicense: apache-2.0\n---\n# KVzap\n",
            "config.json": release_config(input_dim, output_dim, n_modules, hidden_dim, name),
            "model.safetensors": save(tensors, metadata={"format": "pt"})}


class Hub(LoopbackHub):
    """Repositories {repo: (commit, {file: bytes})}; *.safetensors and *.bin are in Git LFS, the rest plain git."""

    def __init__(self, repos: dict[str, tuple[str, dict[str, bytes]]]):
        self.repos = repos
        self.blobs = {hashlib.sha256(d).hexdigest(): d for _, files in repos.values() for d in files.values()}
        self.requests = 0  # every request, to the hub and the CDN
        self.heads = 0  # HEAD requests to /resolve/
        self.sent: dict[str, int] = {}  # body bytes sent, by file name
        self.flip: set[str] = set()  # files sent with one byte changed (the hub's metadata stays right)
        self.etag: dict[str, str] = {}  # file -> the ETag sent in place of the right one (a plain file)
        self.lock = threading.Lock()
        self.serve(Handler)  # the hub, and the CDN on another origin


    def body(self, name: str, data: bytes) -> bytes:
        if name in self.flip:
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 1]) + data[mid + 1:]
        return data


class Handler(HubHandler):
    def send(self, hub: Hub, name: str, data: bytes, body: bool) -> None:
        if not body:
            return
        with hub.lock:  # counted before the write: the client may have read it all before this thread goes on
            hub.sent[name] = hub.sent.get(name, 0) + len(data)
        self.wfile.write(data)

    def route(self, body: bool) -> None:
        path = urllib.parse.unquote(self.path.split("?")[0])
        hub: Hub = self.server.hub
        with hub.lock:
            hub.requests += 1
        if self.server is hub.servers[1]:
            return self.cdn(path.removeprefix("/cdn/"), body)
        m = re.fullmatch(r"/(.+)/resolve/([^/]+)/(.+)", path)
        if not m or m.group(1) not in hub.repos:
            return self.fail(401, "RepoNotFound", "Repository not found")
        repo, revision, name = m.groups()
        commit, files = hub.repos[repo]
        if revision not in ("main", commit):
            return self.fail(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if name not in files:
            return self.fail(404, "EntryNotFound", f"{name} does not exist on \"{revision}\"")
        if not body:
            with hub.lock:
                hub.heads += 1
        data = files[name]
        if not name.endswith(LFS):  # a plain git file: served here, its blob id as ETag
            sent = hub.body(name, data)
            self.send_response(200)
            self.send_header("Content-Length", str(len(sent)))
            self.send_header("ETag", f'"{hub.etag.get(name, git_blob_id(data))}"')
            self.send_header("X-Repo-Commit", commit)
            self.end_headers()
            return self.send(hub, name, sent, body)
        sha = hashlib.sha256(data).hexdigest()
        note = b"Found. Redirecting to the CDN"
        self.send_response(302)
        self.send_header("Location", f"{hub.cdn_url}/cdn/{sha}?name={name}&X-Amz-Expires=3600&X-Amz-Signature=abc")
        self.send_header("X-Repo-Commit", commit)
        self.send_header("X-Linked-Etag", f'"{sha}"')
        self.send_header("X-Linked-Size", str(len(data)))
        self.send_header("ETag", f'"{git_blob_id(lfs_pointer(data))}"')
        self.send_header("Content-Length", str(len(note)))
        self.end_headers()
        if body:
            self.wfile.write(note)

    def cdn(self, sha: str, body: bool) -> None:
        hub: Hub = self.server.hub
        if sha not in hub.blobs:
            return self.fail(403, "AccessDenied", "no such object")
        name = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).get("name", [""])[0]
        data = hub.body(name, hub.blobs[sha])
        start, end, ranged = 0, len(data), self.headers.get("Range")
        if ranged:
            first, last = ranged.removeprefix("bytes=").split("-")
            start, end = int(first), (min(int(last) + 1, len(data)) if last else len(data))
        self.send_response(206 if ranged else 200)
        self.send_header("Content-Length", str(end - start))
        self.send_header("ETag", f'"{hashlib.md5(data).hexdigest()}"')  # the CDN's own
        self.send_header("Accept-Ranges", "bytes")
        if ranged:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        self.send(hub, name, data[start:end], body)
