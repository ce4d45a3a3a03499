"""`localchat heads fetch` against a loopback hub on 127.0.0.1 that serves repositories made like the official
LOCRET releases: `.gitattributes` and one heads-only `.bin` (`torch.save` of a bf16 OrderedDict with the keys
`model.layers.N.self_attn.fc1/fc2.weight`) in Git LFS, at a pinned commit. As the hub does, a HEAD or GET of
/{repo}/resolve/{revision}/{file} answers an LFS file with a 302 carrying X-Repo-Commit, X-Linked-Etag (the
sha256), X-Linked-Size and the repository's ETag, and Location: an absolute CDN address that serves the bytes
with its own ETag and answers Range requests; a plain git file is served directly with its blob id as ETag."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import socket
import threading
import urllib.parse
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hub_helpers import HubHandler, LoopbackHub, git_blob_id, lfs_pointer
from huggingface_hub import constants

from localchat.engine import cards
from localchat.engine.cards import ModelCard
from localchat.engine.heads import RetainingHeads, import_official
from localchat.errors import UserError
from localchat.planning import hub as hub_module
from localchat.planning.heads_fetch import cached_heads, fetch_heads, heads_cache_dir

REPO, WRONG_REPO = "test/Locret-tiny", "test/Locret-wrong"
FILE = "tiny-locret.bin"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
D_R = 256
CUT = 20_000  # where a cut connection stops a body
SHAPE = {"layers": 2, "hidden": 64, "q_heads": 4, "kv_heads": 2, "head_dim": 16, "activation": "silu"}
CARD = ModelCard(
    id="tiny-locret", name="Tiny-Locret", upstream="test/tiny-llama", aliases=(), source={}, shape=SHAPE,
    heads={"repo": REPO, "file": FILE, "commit": COMMIT, "d_r": D_R},
)
GITATTRIBUTES = b"*.bin filter=lfs diff=lfs merge=lfs -text\n*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


# --- the loopback hub -----------------------------------------------------------------------------------------


class Hub(LoopbackHub):
    """Repositories {repo: (commit, {file: bytes})}; files other than .gitattributes are in Git LFS."""

    def __init__(self, repos: dict[str, tuple[str, dict[str, bytes]]]):
        self.repos = repos
        self.blobs = {hashlib.sha256(d).hexdigest(): d for _, files in repos.values() for n, d in files.items()}
        self.sent = 0  # CDN body bytes sent
        self.gets: list[tuple[int, int]] = []  # (start, end) of each CDN GET body
        self.heads = 0  # HEAD requests to /resolve/
        self.cuts = 0  # the next `cuts` CDN bodies longer than CUT stop after CUT bytes (the connection drops)
        self.flip = False  # the CDN sends one byte changed
        self.short = 0  # the CDN sends this many bytes fewer, with a Content-Length that says so
        self.lock = threading.Lock()
        self.serve(Handler)  # the hub, and the CDN on another origin (another port)



class Handler(HubHandler):
    def route(self, body: bool) -> None:
        path = urllib.parse.unquote(self.path.split("?")[0])
        hub: Hub = self.server.hub
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
        if name == ".gitattributes":  # a plain git file: served here
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", f'"{git_blob_id(data)}"')
            self.send_header("X-Repo-Commit", commit)
            self.end_headers()
            if body:
                self.wfile.write(data)
            return
        sha = hashlib.sha256(data).hexdigest()
        note = b"Found. Redirecting to the CDN"
        self.send_response(302)
        self.send_header("Location", f"{hub.cdn_url}/cdn/{sha}?X-Amz-Expires=3600&X-Amz-Signature=abc")
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
        data = hub.blobs[sha]
        if hub.flip:
            data = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1:]
        if hub.short:
            data = data[:-hub.short]
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
        if not body:
            return
        chunk = data[start:end]
        with hub.lock:
            hub.gets.append((start, end))
            cut = hub.cuts > 0 and len(chunk) > CUT
            hub.cuts -= cut
        if cut:  # a connection that breaks mid-body
            chunk = chunk[:CUT]
            self.close_connection = True
        with hub.lock:  # counted before the write: the client may have read it all before this thread goes on
            hub.sent += len(chunk)
        self.wfile.write(chunk)


# --- releases made like the official ones ----------------------------------------------------------------------


def release_tensors(shape: dict, d_r: int, seed: int = 1) -> OrderedDict:
    """A heads-only state dict as the releases hold it: bf16, the official keys, layer by layer."""
    g = torch.Generator().manual_seed(seed)
    in_dim = (shape["q_heads"] + 2 * shape["kv_heads"]) * shape["head_dim"]
    state = OrderedDict()
    for i in range(shape["layers"]):
        state[f"model.layers.{i}.self_attn.fc1.weight"] = (torch.randn(d_r, in_dim, generator=g) * 0.02).bfloat16()
        state[f"model.layers.{i}.self_attn.fc2.weight"] = (torch.randn(shape["kv_heads"], d_r, generator=g) * 0.02).bfloat16()
    return state


def saved(state) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def state():
    return release_tensors(SHAPE, D_R)


@pytest.fixture(scope="module")
def data(state):
    return saved(state)


@pytest.fixture()
def hub(data, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    wrong = saved(release_tensors({**SHAPE, "kv_heads": 3}, D_R))  # heads made for a model with 3 KV heads
    h = Hub({REPO: (COMMIT, {".gitattributes": GITATTRIBUTES, FILE: data}),
             WRONG_REPO: (COMMIT, {".gitattributes": GITATTRIBUTES, FILE: wrong})})
    yield h
    h.close()


def converted(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "heads.safetensors")


def as_ours(state) -> dict[str, torch.Tensor]:
    return {k.replace("model.", "").replace("self_attn.", ""): v for k, v in state.items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def hf_files(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "hf-cache").rglob("*") if p.is_file() or p.is_symlink())


def left_behind(out: Path) -> list[Path]:
    return [p for p in out.parent.iterdir() if p.name != f"{out.name}.lock" and p.name != out.name] if out.parent.exists() else []


# --- the tests --------------------------------------------------------------------------------------------------


def test_a_fetch_equals_import_heads_on_the_same_file_and_a_second_fetch_transfers_nothing(hub, data, state, tmp_path):
    said = []
    out = fetch_heads(CARD, endpoint=hub.url, say=said.append)
    assert out == heads_cache_dir(CARD) == cached_heads(CARD)
    assert hub.sent == len(data) and hub.gets == [(0, len(data))]  # the file, once, whole
    assert len(said) == 1 and REPO in said[0] and FILE in said[0] and COMMIT[:12] in said[0]
    assert same(converted(out), as_ours(state))  # the release's bf16 tensors, exactly
    (tmp_path / "release.bin").write_bytes(data)
    import_official(tmp_path / "release.bin", _tiny_config(), tmp_path / "imported")
    assert same(converted(out), converted(tmp_path / "imported"))
    heads = RetainingHeads.load(out)
    assert heads.d_r == D_R
    meta = json.loads((out / "heads.json").read_text())
    assert meta["kind"] == "fetched" and meta["source"] == {
        "repo": REPO, "commit": COMMIT, "file": FILE, "sha256": hashlib.sha256(data).hexdigest(), "endpoint": hub.url}
    assert left_behind(out) == []
    blobs = [p for p in hf_files(tmp_path) if p.parent.name == "blobs"]  # huggingface_hub's cache holds it
    assert [p.name for p in blobs] == [hashlib.sha256(data).hexdigest()]
    sent, heads_asked = hub.sent, hub.heads
    assert fetch_heads(CARD, endpoint=hub.url, say=said.append) == out
    assert (hub.sent, hub.heads) == (sent, heads_asked) and len(said) == 1  # cached: no request at all


def _tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                       intermediate_size=128, vocab_size=300, head_dim=16)


def test_flipped_bytes_with_the_right_metadata_are_refused_and_leave_nothing(hub, data, state, tmp_path, monkeypatch,
                                                                            capsys):
    from localchat.cli import main

    real = cards.find_card
    monkeypatch.setattr(cards, "find_card", lambda name: CARD if name == CARD.id else real(name))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    hub.flip = True
    assert main(["heads", "fetch", CARD.id]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    line = err[-1]
    assert "damaged" in line and hashlib.sha256(data).hexdigest()[:12] in line and "nothing was installed" in line
    assert "Traceback" not in "\n".join(err)
    assert cached_heads(CARD) is None and not heads_cache_dir(CARD).exists()
    assert left_behind(heads_cache_dir(CARD)) == []
    assert [p for p in hf_files(tmp_path) if p.parent.name in ("blobs", "snapshots") or COMMIT in str(p)] == []
    hub.flip = False  # the next fetch starts clean and succeeds
    sent = hub.sent
    assert main(["heads", "fetch", CARD.id]) == 0
    assert capsys.readouterr().out == f"{heads_cache_dir(CARD)}\n"
    assert hub.sent - sent == len(data) and same(converted(heads_cache_dir(CARD)), as_ours(state))


def test_a_truncated_download_is_refused_in_one_line_and_the_next_fetch_succeeds(hub, data, state):
    hub.short = 1000  # the CDN ends early and says so: fewer bytes than the hub announced
    with pytest.raises(UserError) as err:
        fetch_heads(CARD, endpoint=hub.url, say=lambda m: None)
    message = str(err.value)
    assert "\n" not in message and "broke" in message and "nothing was installed" in message
    assert f"localchat heads fetch {CARD.id}" in message
    assert cached_heads(CARD) is None and not heads_cache_dir(CARD).exists()
    hub.short = 0
    out = fetch_heads(CARD, endpoint=hub.url, say=lambda m: None)
    assert same(converted(out), as_ours(state))


def test_a_cut_connection_resumes_where_it_stopped(hub, data, state, monkeypatch):
    """huggingface_hub writes what came in pieces of DOWNLOAD_CHUNK_SIZE (10 MB: a real release is 403 MB) and
    resumes from the last whole piece; the tiny release here is 135 KB, so the pieces are made 4 KB."""
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    hub.cuts = 1
    out = fetch_heads(CARD, endpoint=hub.url, say=lambda m: None)
    # the first body was cut after CUT bytes; the download asked again from the last whole piece, to the end
    (first, second), kept = hub.gets, CUT // 4096 * 4096
    assert first == (0, len(data)) and second == (kept, len(data)) and kept > 0
    assert hub.sent == CUT + len(data) - kept < 2 * len(data)
    assert same(converted(out), as_ours(state))


def test_two_fetches_at_once_fetch_once(hub, data):
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(fetch_heads(CARD, endpoint=hub.url, say=lambda m: None)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [heads_cache_dir(CARD)] * 2
    assert hub.sent == len(data)


def test_a_release_for_another_shape_is_refused_before_converting(hub):
    card = replace(CARD, id="tiny-wrong", heads={**CARD.heads, "repo": WRONG_REPO})
    with pytest.raises(UserError) as err:
        fetch_heads(card, endpoint=hub.url, say=lambda m: None)
    message = str(err.value)
    assert "\n" not in message and WRONG_REPO in message and "does not fit" in message
    assert "layers.0.fc1.weight" in message and f"[{D_R}, 160]" in message and f"[{D_R}, 128]" in message
    assert cached_heads(card) is None and not heads_cache_dir(card).exists() and left_behind(heads_cache_dir(card)) == []


@pytest.mark.parametrize("change, words", [
    ({"layers": 3}, "heads for 2 layers, the model has 3"),
    ({"d_r": 1024}, f"is [{D_R}, 128], expected [1024, 128]"),
])
def test_a_release_that_does_not_match_the_card_is_refused(hub, change, words):
    card = replace(CARD, id="tiny-other", shape={**SHAPE, **{k: v for k, v in change.items() if k != "d_r"}},
                   heads={**CARD.heads, **{k: v for k, v in change.items() if k == "d_r"}})
    with pytest.raises(UserError, match=re.escape(words)):
        fetch_heads(card, endpoint=hub.url, say=lambda m: None)
    assert not heads_cache_dir(card).exists()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["refused", "HF_HUB_OFFLINE"])
def test_offline_is_one_line_naming_the_ways_on(how, tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    if how == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    with pytest.raises(UserError) as err:
        fetch_heads(CARD, endpoint=f"http://127.0.0.1:{closed_port()}", say=lambda m: None)
    assert time.monotonic() - t0 < 5
    message = str(err.value)
    assert "\n" not in message
    for words in (CARD.name, REPO, "localchat heads fetch tiny-locret", str(heads_cache_dir(CARD)), "--heads DIR",
                  "--policy", "onnect" if how == "refused" else "HF_HUB_OFFLINE"):
        assert words in message


def test_offline_a_copy_in_the_hugging_face_cache_is_checked_and_converted(hub, data, state, tmp_path, monkeypatch):
    """The pinned file already in huggingface_hub's cache (copied from a connected machine) serves offline; its
    bytes are checked against the sha256 its cache entry is named by."""
    out = fetch_heads(CARD, endpoint=hub.url, say=lambda m: None)
    import shutil

    shutil.rmtree(out)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sent = hub.sent
    assert fetch_heads(CARD, endpoint=hub.url, say=lambda m: None) == out and hub.sent == sent
    assert same(converted(out), as_ours(state))
    shutil.rmtree(out)
    blob = next(p for p in hf_files(tmp_path) if p.parent.name == "blobs")
    damaged = bytearray(blob.read_bytes())
    damaged[100] ^= 1
    blob.write_bytes(bytes(damaged))
    with pytest.raises(UserError, match="is damaged"):
        fetch_heads(CARD, endpoint=hub.url, say=lambda m: None)
    assert not blob.exists() and not out.exists()


def test_the_cli_command_end_to_end(hub, data, monkeypatch, capsys):
    from localchat.cli import main

    real = cards.find_card
    monkeypatch.setattr(cards, "find_card", lambda name: CARD if name == CARD.id else real(name))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["heads", "fetch", CARD.id]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "localchat heads fetch tiny-locret" in err
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    assert main(["heads", "fetch", CARD.id]) == 0
    out, err = capsys.readouterr()
    assert out == f"{heads_cache_dir(CARD)}\n" and REPO in err
    sent, asked = hub.sent, hub.heads
    assert main(["heads", "fetch", CARD.id, "--revision", "main"]) == 0  # main names the installed commit
    assert hub.sent == sent and hub.heads == asked + 1
    capsys.readouterr()
    for argv, words in ((["heads", "fetch", "no-such-model"], "no model card for 'no-such-model'"),
                        (["heads", "fetch", "qwen2.5-7b"], "no official LOCRET release"),
                        (["heads", "fetch"], "no official LOCRET release holds retaining heads for SmolLM2"),
                        (["heads", "fetch", CARD.id, "--revision", "v9"], "has no revision 'v9'")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_converted_heads_carry_their_sha256_and_damaged_ones_are_converted_again(hub, state):
    from localchat.engine.weights_check import STAMP

    out = fetch_heads(CARD, endpoint=hub.url, say=lambda m: None)
    stamp = json.loads((out / STAMP).read_text())
    weights = out / "heads.safetensors"
    assert stamp["files"]["heads.safetensors"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    st = weights.stat()
    damaged = bytearray(weights.read_bytes())
    damaged[-10] ^= 0xFF  # a flipped bit in the last tensor, file times set back
    weights.write_bytes(bytes(damaged))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(UserError, match="are damaged") as err:  # never loaded, wherever they are passed from
        RetainingHeads.load(out)
    assert "\n" not in str(err.value)
    assert cached_heads(CARD) is None  # so the next use converts them again
    said, sent = [], hub.sent
    assert fetch_heads(CARD, endpoint=hub.url, say=said.append) == out
    assert hub.sent == sent  # from the Hugging Face cache: the download was whole
    assert "damaged" in said[0] and "fetching them again" in said[0]
    assert same(converted(out), as_ours(state)) and cached_heads(CARD) == out


def test_transport_is_the_library_whose_errors_the_hub_session_raises():
    """hub.py names no HTTP library: it reads it off huggingface_hub's session (httpx2 under huggingface_hub
    2.x, httpx under 1.x; an image may hold either one alone)."""
    from huggingface_hub import get_session

    http = hub_module.transport()
    with pytest.raises(http.ConnectError):
        get_session().get(f"http://127.0.0.1:{closed_port()}/x", timeout=5)
    assert "import httpx" not in Path(hub_module.__file__).read_text()


def test_the_llama_release_at_its_real_size_then_the_rtx4090_profile_goes_on_to_the_model_offline(
        tmp_path, monkeypatch, capsys):
    """The real card, unchanged: `localchat heads fetch llama-3.1-8b-instruct` against a loopback hub serving a
    release of the real shape and size (random bf16 values, 403 MB) at the card's pinned commit. The converted
    heads equal the release tensors; afterwards, offline, `--profile rtx4090 ask` no longer stops at the heads."""
    from localchat.cli import main

    card = cards.find_card("llama-3.1-8b-instruct")
    h = card.heads
    shape = {"layers": card.shape["layers"], "q_heads": card.shape["q_heads"], "kv_heads": card.shape["kv_heads"],
             "head_dim": card.shape["head_dim"]}
    state = OrderedDict()
    g = torch.Generator().manual_seed(3)
    in_dim = (shape["q_heads"] + 2 * shape["kv_heads"]) * shape["head_dim"]
    for i in range(shape["layers"]):
        state[f"model.layers.{i}.self_attn.fc1.weight"] = torch.empty(h["d_r"], in_dim, dtype=torch.bfloat16).normal_(
            0, 0.02, generator=g)
        state[f"model.layers.{i}.self_attn.fc2.weight"] = torch.empty(shape["kv_heads"], h["d_r"],
                                                                      dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
    blob = saved(state)
    assert abs(len(blob) / 1e6 - h["size_mb"]) < 1  # 403 MB, as the card tells users
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert main(["--profile", "rtx4090", "plan"]) == 0
    assert "retaining heads: the official release hyx21/Locret-llama-3.1-8B-instruct/llama-3.1-8B-instruct.bin " \
           "(403 MB), not fetched yet: `localchat heads fetch llama-3.1-8b-instruct`" in capsys.readouterr().out
    server = Hub({h["repo"]: (h["commit"], {".gitattributes": GITATTRIBUTES, h["file"]: blob})})
    try:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        assert main(["heads", "fetch", "llama-3.1-8b-instruct"]) == 0
        out = Path(capsys.readouterr().out.strip())
        assert server.sent == len(blob)
    finally:
        server.close()
    del blob
    assert out == heads_cache_dir(card)
    assert same(converted(out), as_ours(state))
    assert json.loads((out / "heads.json").read_text())["source"]["commit"] == h["commit"]
    assert main(["--profile", "rtx4090", "plan"]) == 0
    assert f"(403 MB), fetched into {out}" in capsys.readouterr().out
    doc = tmp_path / "doc.txt"
    doc.write_text("The pass key is 71432. " * 50)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for extra, words in (([], "nf4 needs a CUDA GPU"), (["--weights", "int4"], "Llama-3.1-8B-Instruct")):
        assert main(["--profile", "rtx4090", *extra, "ask", "--file", str(doc), "What is the pass key?"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        print(err[-1])
        assert words in err[-1] and "retaining heads" not in err[-1] and "Traceback" not in "\n".join(err)
