"""`localchat heads fetch` against a fake hub on 127.0.0.1: a sharded checkpoint in the official LOCRET layout
(a tiny random Llama with heads inside, padded so that a whole shard is megabytes) served with HEAD, GET and
Range. Only the heads' bytes travel, a cut connection resumes, the result equals `import_official` on the whole
files, a release for another shape is refused, and offline is one line."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import urllib.parse
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save
from tiny import tiny_llama, tiny_tokenizer

from localchat.engine import cards
from localchat.engine.cards import ModelCard
from localchat.engine.heads import RetainingHeads, import_official
from localchat.errors import UserError
from localchat.planning import hub_ranges
from localchat.planning.heads_fetch import cached_heads, fetch_heads, heads_cache_dir

REPO, WRONG_REPO = "test/Locret-tiny", "test/Locret-wrong"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
D_R, PAD = 256, 4 << 20  # head width; dummy bytes per shard (what a fetch of only the heads must not touch)
CUT = 20_000  # where a cut connection stops a body
CARD = ModelCard(
    id="tiny-locret", name="Tiny-Locret", upstream="test/tiny-llama", aliases=("tiny-locret-alias",), source={},
    shape={"layers": 2, "hidden": 64, "q_heads": 4, "kv_heads": 2, "head_dim": 16, "activation": "silu"},
    heads={"repo": REPO, "naming": "official"},
)


# --- the fake hub ---------------------------------------------------------------------------------------------


class Hub:
    """Repositories of files at /{repo}/resolve/{revision}/{file}, with the headers huggingface_hub reads."""

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.sent = 0  # body bytes sent
        self.gets: list[tuple[str, int, int]] = []  # (file, start, end) of each ranged GET
        self.cuts = 0  # the next `cuts` ranged bodies longer than CUT stop after CUT bytes
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.hub = self
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.serve(body=False)

    def do_GET(self) -> None:
        self.serve(body=True)

    def fail(self, code: int, error: str) -> None:
        self.send_response(code)
        self.send_header("X-Error-Code", error)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def serve(self, body: bool) -> None:
        hub: Hub = self.server.hub
        m = re.fullmatch(r"/(.+)/resolve/([^/]+)/(.+)", urllib.parse.unquote(self.path.split("?")[0]))
        if not m or m.group(1) not in hub.repos:
            return self.fail(404, "RepoNotFound")
        repo, revision, name = m.groups()
        if revision not in ("main", COMMIT):
            return self.fail(404, "RevisionNotFound")
        if name not in hub.repos[repo]:
            return self.fail(404, "EntryNotFound")
        data = hub.repos[repo][name]
        start, end, ranged = 0, len(data), self.headers.get("Range")
        if ranged and body:
            first, last = ranged.removeprefix("bytes=").split("-")
            start, end = int(first), min(int(last) + 1, len(data))
        self.send_response(206 if ranged and body else 200)
        self.send_header("Content-Length", str(end - start))
        self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Accept-Ranges", "bytes")
        if ranged and body:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        chunk = data[start:end]
        with hub.lock:
            if ranged:
                hub.gets.append((name, start, end))
            cut = bool(ranged) and hub.cuts > 0 and len(chunk) > CUT
            hub.cuts -= cut
        if cut:  # a connection that breaks mid-body
            chunk = chunk[:CUT]
            self.close_connection = True
        self.wfile.write(chunk)
        with hub.lock:
            hub.sent += len(chunk)


# --- a synthetic release in the official layout ---------------------------------------------------------------


def release(kv_heads: int = 2, layers: int = 2, sharded: bool = True) -> dict[str, bytes]:
    """model-0000N-of-00002.safetensors + index (or one model.safetensors): a tiny Llama with heads
    `model.layers.N.self_attn.fc1/fc2.weight` (bf16, as trained) and a PAD-byte dummy tensor in each shard."""
    model = tiny_llama(len(tiny_tokenizer()))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    in_dim = (4 + 2 * kv_heads) * 16
    for i in range(layers):
        weights[f"model.layers.{i}.self_attn.fc1.weight"] = torch.randn(D_R, in_dim, generator=g).bfloat16()
        weights[f"model.layers.{i}.self_attn.fc2.weight"] = torch.randn(kv_heads, D_R, generator=g).bfloat16()
    if not sharded:
        return {"model.safetensors": save({**weights, "model.padding": torch.zeros(PAD // 4)})}
    shards: dict[str, dict] = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for key, value in weights.items():
        second = ".layers.1." in key or not key.startswith("model.layers.")
        shards[sorted(shards)[second]][key] = value
    for n, shard in enumerate(shards.values()):
        shard[f"model.padding_{n}"] = torch.zeros(PAD // 4)
    files = {name: save(tensors) for name, tensors in shards.items()}
    index = {"metadata": {"total_size": sum(map(len, files.values()))},
             "weight_map": {k: name for name, tensors in shards.items() for k in tensors}}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    return files


@pytest.fixture(scope="module")
def files():
    return release()


@pytest.fixture(scope="module")
def wrong_files():
    return release(kv_heads=3, sharded=False)  # heads made for a model with 3 KV heads, in one file


@pytest.fixture()
def hub(files, wrong_files, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    h = Hub({REPO: files, WRONG_REPO: wrong_files})
    yield h
    h.close()


def header_bytes(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def heads_bytes(files: dict[str, bytes]) -> int:
    total = 0
    for name, data in files.items():
        if name.endswith(".safetensors"):
            header = json.loads(data[8:header_bytes(data)])
            total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if ".fc" in k)
    return total


def reference(files, tmp_path) -> dict[str, torch.Tensor]:
    """`import_official` on the whole files, saved and read back as `localchat import-heads` leaves them."""
    src = tmp_path / "whole"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    import_official(src, tiny_llama(len(tiny_tokenizer())).config).save(tmp_path / "imported")
    return RetainingHeads.load(tmp_path / "imported").state_dict()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- the tests --------------------------------------------------------------------------------------------------


def test_only_the_heads_bytes_travel_and_the_result_equals_import_heads(hub, files, tmp_path):
    said = []
    out = fetch_heads(CARD, endpoint=hub.url, say=said.append)
    shards = {n: d for n, d in files.items() if n.endswith(".safetensors")}
    index = len(files["model.safetensors.index.json"])
    expected = heads_bytes(files) + sum(header_bytes(d) for d in shards.values()) + index
    print(f"\nserved {hub.sent:,} bytes (heads {heads_bytes(files):,}) of {sum(map(len, shards.values())):,}")
    assert out == heads_cache_dir(CARD) == cached_heads(CARD)
    assert hub.sent == expected and hub.sent * 50 < sum(map(len, shards.values()))
    assert len(hub.gets) == 2 * 2 + 2  # per shard: header length, header, one range holding fc1 + fc2
    assert len(said) == 1 and REPO in said[0]
    heads = RetainingHeads.load(out)
    assert same(heads.state_dict(), reference(files, tmp_path))
    heads.check_fits(tiny_llama(len(tiny_tokenizer())))
    meta = json.loads((out / "heads.json").read_text())
    assert meta["source"]["repo"] == REPO and meta["source"]["commit"] == COMMIT
    assert meta["source"]["files"] == sorted(shards) and meta["kind"] == "fetched"
    assert not list(out.parent.glob("*.partial")) and not list(out.parent.glob("*.tmp*"))
    sent = hub.sent
    assert fetch_heads(CARD, endpoint=hub.url) == out and hub.sent == sent  # cached: no network


def test_a_cut_connection_resumes_where_it_stopped(hub, files, tmp_path):
    hub.cuts = 1
    out = fetch_heads(CARD, endpoint=hub.url, say=lambda m: None)
    resumed = [(s, e) for _, s, e in hub.gets if e - s > CUT]  # the heads' ranges asked for, in order
    # the first was cut after CUT bytes and asked again from there, to the same end: no byte sent twice
    assert resumed[1] == (resumed[0][0] + CUT, resumed[0][1])
    sent = CUT + sum(e - s for s, e in resumed[1:])
    print(f"\nheads: {heads_bytes(files):,} bytes needed, {sent:,} sent with one cut (a restart: "
          f"{heads_bytes(files) + CUT:,}); {hub.sent:,} in all")
    assert sent == heads_bytes(files) < heads_bytes(files) + CUT
    assert hub.sent * 50 < sum(map(len, files.values()))
    assert same(RetainingHeads.load(out).state_dict(), reference(files, tmp_path))


def test_a_run_that_breaks_leaves_its_part_and_the_next_run_continues(hub, files, tmp_path, monkeypatch):
    monkeypatch.setattr(hub_ranges, "RETRIES", 0)
    hub.cuts = 1
    with pytest.raises(UserError) as err:
        fetch_heads(CARD, endpoint=hub.url, say=lambda m: None)
    assert "\n" not in str(err.value) and "again to resume" in str(err.value)
    assert cached_heads(CARD) is None and not heads_cache_dir(CARD).exists()
    parts = list(heads_cache_dir(CARD).parent.glob("*.partial/*.part"))
    assert [p.stat().st_size for p in parts] == [CUT]
    hub.sent, hub.gets = 0, []
    out = fetch_heads(CARD, endpoint=hub.url, say=lambda m: None)
    body = sum(end - start for _, start, end in hub.gets if end - start > CUT)
    assert body == heads_bytes(files) - CUT  # the second run fetched only what the first did not
    assert same(RetainingHeads.load(out).state_dict(), reference(files, tmp_path))


def test_two_fetches_at_once_fetch_once(hub, files):
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(fetch_heads(CARD, endpoint=hub.url, say=lambda m: None)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [heads_cache_dir(CARD)] * 2
    assert sum(e - s for _, s, e in hub.gets if e - s > CUT) == heads_bytes(files)


def test_a_release_for_another_shape_is_refused_in_one_line(hub):
    card = replace(CARD, id="tiny-wrong", heads={"repo": WRONG_REPO, "naming": "official"})
    with pytest.raises(UserError) as err:
        fetch_heads(card, endpoint=hub.url, say=lambda m: None)
    message = str(err.value)
    assert "\n" not in message and WRONG_REPO in message and "does not fit" in message
    assert "layers.0.fc1.weight" in message and "[256, 160]" in message
    assert hub.sent < 4096  # the header only: no head data came before the refusal
    assert cached_heads(card) is None


def test_a_release_missing_a_layer_is_refused(hub, files):
    card = replace(CARD, id="tiny-deep", shape={**CARD.shape, "layers": 3})
    with pytest.raises(UserError, match="heads for 2 layers, the model has 3"):
        fetch_heads(card, endpoint=hub.url, say=lambda m: None)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["refused", "HF_HUB_OFFLINE"])
def test_offline_is_one_line_naming_the_ways_on(how, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))
    if how == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as err:
        fetch_heads(CARD, endpoint=f"http://127.0.0.1:{closed_port()}", say=lambda m: None)
    message = str(err.value)
    assert "\n" not in message
    for words in (CARD.name, REPO, "localchat heads fetch tiny-locret", str(heads_cache_dir(CARD)), "--heads DIR",
                  "--policy", "Connection refused" if how == "refused" else "HF_HUB_OFFLINE"):
        assert words in message


def test_the_cli_command_end_to_end(hub, files, monkeypatch, capsys):
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
    for argv, words in ((["heads", "fetch", "no-such-model"], "no model card for 'no-such-model'"),
                        (["heads", "fetch", "qwen2.5-7b"], "no official LOCRET release"),
                        (["heads", "fetch"], "no official LOCRET release holds retaining heads for SmolLM2")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_fetched_heads_carry_their_sha256_and_damaged_ones_are_fetched_again(hub, files, tmp_path):
    """The hub's digest covers whole shards, which a fetch of only the heads never has; the converted heads' sha256
    is recorded at fetch time and checked at every use."""
    import os

    from localchat.engine.weights_check import STAMP

    out = fetch_heads(CARD, endpoint=hub.url, say=lambda m: None)
    stamp = json.loads((out / STAMP).read_text())
    weights = out / "heads.safetensors"
    assert stamp["files"]["heads.safetensors"]["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF  # a flipped bit in the last tensor, file times set back
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(UserError, match="are damaged") as err:  # never loaded, wherever they are passed from
        RetainingHeads.load(out)
    assert "\n" not in str(err.value)
    assert cached_heads(CARD) is None  # so the next use fetches them again
    said, sent = [], hub.sent
    assert fetch_heads(CARD, endpoint=hub.url, say=said.append) == out and hub.sent > sent
    assert "damaged" in said[0] and "fetching them again" in said[0]
    assert same(RetainingHeads.load(out).state_dict(), reference(files, tmp_path))
    assert cached_heads(CARD) == out


def test_transport_is_the_library_whose_errors_the_hub_session_raises():
    """hub_ranges names no HTTP library: it reads it off huggingface_hub's session (httpx2 under huggingface_hub
    2.x, httpx under 1.x; the lent GPU's image had 1.x and no httpx2, and LOCRET failed to load there)."""
    from huggingface_hub import get_session

    from localchat.planning import hub_ranges

    http = hub_ranges.transport()
    with pytest.raises(http.ConnectError):
        get_session().get(f"http://127.0.0.1:{closed_port()}/x", timeout=5)
    assert "import httpx" not in Path(hub_ranges.__file__).read_text()
