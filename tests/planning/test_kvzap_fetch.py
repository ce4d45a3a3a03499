"""`localchat heads fetch` for KVzap scorers against a loopback hub on 127.0.0.1 (kvzap_hub.py) serving repositories
made like NVIDIA's releases: config.json as a plain git file (its ETag the git blob id), model.safetensors in Git
LFS (its sha256 in X-Linked-Etag), kvpress's key names and shapes, random or zero values. Most tests serve a tiny
model's shapes; one serves Qwen3-8B's MLP scorer at its real shapes (36 modules, 4096 -> 512 -> 8, bf16: 151 MB)
through the real card and the real CLI, one Llama-3.1-8B's linear scorer (32 modules, fp32: 4 MB)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from kvzap_hub import Hub, git_blob_id, release_files
from safetensors.torch import load_file

from localchat.engine import cards, kvzap
from localchat.engine.cards import ModelCard
from localchat.engine.weights_check import STAMP
from localchat.errors import UserError
from localchat.planning.heads_fetch import (
    SOURCE,
    cached_kvzap,
    default_kind,
    fetch_kvzap,
    kvzap_cache_dir,
)

REPO, WRONG_REPO, LINEAR_REPO = "test/KVzap-mlp-tiny", "test/KVzap-mlp-other", "test/KVzap-linear-tiny"
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
SHAPE = {"layers": 2, "hidden": 64, "q_heads": 4, "kv_heads": 2, "head_dim": 16, "activation": "silu"}
WIDTH = 16
CARD = ModelCard(id="tiny-kvzap", name="Tiny-KVzap", upstream="test/tiny-qwen3", aliases=(), source={}, shape=SHAPE,
                 policy={"name": "kvzap"}, kvzap={"repo": REPO, "commit": COMMIT, "hidden_dim": WIDTH, "size_mb": 1})
CONFIGS = Path(__file__).parents[1] / "data" / "configs"


@pytest.fixture(scope="module")
def files():
    return release_files(SHAPE["hidden"], SHAPE["kv_heads"], SHAPE["layers"], WIDTH)


@pytest.fixture()
def isolated(tmp_path, monkeypatch):
    """The user cache and huggingface_hub's cache under tmp_path, online, no token."""
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return tmp_path


@pytest.fixture()
def hub(files, isolated):
    wrong = release_files(SHAPE["hidden"], SHAPE["kv_heads"], 3, WIDTH)  # made for a model with 3 layers
    linear = release_files(SHAPE["hidden"], SHAPE["kv_heads"], SHAPE["layers"], None)
    h = Hub({REPO: (COMMIT, files), WRONG_REPO: (COMMIT, wrong), LINEAR_REPO: (COMMIT, linear)})
    yield h
    h.close()


def quiet(msg: str) -> None:
    pass


def hf_files(tmp_path: Path, kind: str) -> list[Path]:
    return sorted(p for p in (tmp_path / "hf-cache").rglob("*") if p.parent.name == kind)


def left_behind(out: Path) -> list[Path]:
    return [p for p in out.parent.iterdir() if p.name not in (out.name, f"{out.name}.lock")] if out.parent.exists() else []


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def use_card(monkeypatch, card: ModelCard) -> None:
    real = cards.find_card
    monkeypatch.setattr(cards, "find_card", lambda name: card if name == card.id else real(name))


# --- the tests --------------------------------------------------------------------------------------------------


def test_a_fetch_installs_the_release_verbatim_and_a_second_fetch_makes_no_request(hub, files, isolated):
    said = []
    out = fetch_kvzap(CARD, endpoint=hub.url, say=said.append)
    assert out == kvzap_cache_dir(CARD) == cached_kvzap(CARD) == isolated / "cache" / "kvzap" / CARD.id
    assert sorted(p.name for p in out.iterdir()) == sorted([kvzap.CONFIG, kvzap.WEIGHTS, SOURCE, STAMP])
    for name in (kvzap.CONFIG, kvzap.WEIGHTS):  # byte for byte what the hub serves
        assert (out / name).read_bytes() == files[name]
    assert hub.sent == {kvzap.CONFIG: len(files[kvzap.CONFIG]), kvzap.WEIGHTS: len(files[kvzap.WEIGHTS])}
    assert len(said) == 1 and REPO in said[0] and COMMIT[:12] in said[0] and "once" in said[0]
    assert kvzap.check_release(out)["hidden_dim"] == WIDTH
    source = json.loads((out / SOURCE).read_text())
    config, weights = files[kvzap.CONFIG], files[kvzap.WEIGHTS]
    assert source == {"kind": "fetched", "model": CARD.id, "repo": REPO, "revision": COMMIT, "commit": COMMIT,
                      "endpoint": hub.url, "files": {
                          kvzap.CONFIG: {"size": len(config), "sha256": hashlib.sha256(config).hexdigest(),
                                         "git_sha1": git_blob_id(config)},
                          kvzap.WEIGHTS: {"size": len(weights), "sha256": hashlib.sha256(weights).hexdigest()}}}
    assert left_behind(out) == []
    # huggingface_hub's cache holds both, its blobs named by the hashes the hub gave
    assert sorted(p.name for p in hf_files(isolated, "blobs")) == sorted(
        [git_blob_id(config), hashlib.sha256(weights).hexdigest()])
    requests = hub.requests
    assert fetch_kvzap(CARD, endpoint=hub.url, say=said.append) == out
    assert hub.requests == requests and len(said) == 1  # cached: no request at all


def test_the_scorer_loads_as_kvzap_scorer_reads_it(hub, files):
    from localchat.engine.kvzap_scorer import KVzapScorer

    out = fetch_kvzap(CARD, endpoint=hub.url, say=quiet)
    scorer = KVzapScorer.load(out)
    want = load_file(out / kvzap.WEIGHTS)
    assert scorer.variant == "mlp" and scorer.scored == [0, 1]
    assert torch.equal(scorer.head(1)[2].weight, want["layers.1.2.weight"].float())


def test_heads_fetch_qwen3_8b_fetches_the_real_release_shape_through_the_cli(isolated, monkeypatch, capsys):
    """The real card, unchanged: `localchat heads fetch qwen3-8b` (the card's default scorer is KVzap) against a
    loopback hub serving nvidia/KVzap-mlp-Qwen3-8B at the real shapes (36 modules of Linear(4096, 512), GELU,
    Linear(512, 8); bf16 zeros, one marked value per tensor: 151 MB) at the revision the card names."""
    from localchat.cli import main

    card = cards.find_card("qwen3-8b")
    release = card.kvzap
    assert default_kind(card) == "kvzap" and release["repo"] == "nvidia/KVzap-mlp-Qwen3-8B"
    t0 = time.monotonic()
    real = release_files(4096, 8, 36, 512, torch.bfloat16, seed=None)
    weights = real[kvzap.WEIGHTS]
    assert abs(len(weights) - 75_663_648 * 2) < 20_000  # the scorer's 75.7M parameters at bf16 (plus the header)
    commit = "fedcba9876543210fedcba9876543210fedcba98"
    server = Hub({release["repo"]: (commit, real)})
    try:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        assert main(["heads", "fetch", "qwen3-8b"]) == 0
        out, err = capsys.readouterr()
        assert out == f"{kvzap_cache_dir(card)}\n"
        assert "Fetching the KVzap scorer of Qwen3-8B: nvidia/KVzap-mlp-Qwen3-8B at fedcba987654" in err
        requests = server.requests
        assert main(["heads", "fetch", "Qwen/Qwen3-8B"]) == 0  # cached: no request
        assert capsys.readouterr().out == out and server.requests == requests
    finally:
        server.close()
    print(f"fetch at the real size: {time.monotonic() - t0:.1f} s")
    directory = Path(out.strip())
    assert (directory / kvzap.WEIGHTS).read_bytes() == weights
    config = kvzap.check_release(directory)
    assert config == {**json.loads(real[kvzap.CONFIG]), **card.kvzap_config()}
    source = json.loads((directory / SOURCE).read_text())
    assert (source["revision"], source["commit"]) == (release.get("commit") or release["revision"], commit)
    assert source["files"][kvzap.WEIGHTS]["sha256"] == hashlib.sha256(weights).hexdigest()
    from localchat.engine.kvzap_scorer import KVzapScorer

    scorer = KVzapScorer.load(directory, scored=[35])
    assert scorer.head(35)[0].weight.shape == (512, 4096) and scorer.head(35)[2].weight.shape == (8, 512)


def test_the_llama_card_fetches_its_linear_scorer_with_kind_kvzap(isolated, monkeypatch, capsys):
    """Llama-3.1-8B-Instruct has both releases: LOCRET stays the default, `--kind kvzap` brings the linear
    scorer (32 modules of Linear(4096, 8), fp32 as on the hub: 4 MB, as the card says)."""
    from localchat.cli import main

    card = cards.find_card("llama-3.1-8b-instruct")
    assert default_kind(card) == "locret" and card.heads_release and card.kvzap_release
    real = release_files(4096, 8, 32, None, torch.float32)
    assert round(len(real[kvzap.WEIGHTS]) / 1e6) == card.kvzap["size_mb"]
    commit = "0011223344556677889900112233445566778899"
    server = Hub({card.kvzap["repo"]: (commit, real)})
    try:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        assert main(["heads", "fetch", "llama-3.1-8b", "--kind", "kvzap"]) == 0
        out = Path(capsys.readouterr().out.strip())
    finally:
        server.close()
    assert out == kvzap_cache_dir(card) and kvzap.check_release(out)["hidden_dim"] is None
    assert (out / kvzap.WEIGHTS).read_bytes() == real[kvzap.WEIGHTS]


def test_kind_kvzap_for_a_card_without_a_release_is_one_line(isolated, capsys):
    from localchat.cli import main

    assert main(["heads", "fetch", "qwen2.5-7b", "--kind", "kvzap"]) == 2
    err = capsys.readouterr().err
    assert "no released KVzap scorer for Qwen2.5-7B-Instruct" in err and "qwen3-8b" in err and err.count("\n") == 1
    assert main(["heads", "fetch", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no model card for 'no-such-model'" in err and "with a KVzap release: " in err and err.count("\n") == 1


@pytest.mark.parametrize("how", ["refused", "HF_HUB_OFFLINE"])
def test_offline_with_nothing_cached_is_one_line_naming_the_ways_on(how, isolated, monkeypatch, capsys):
    from localchat.cli import main

    if how == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    t0 = time.monotonic()
    assert main(["heads", "fetch", "qwen3-8b"]) == 2
    assert time.monotonic() - t0 < 10
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    card = cards.find_card("qwen3-8b")
    for words in ("Qwen3-8B's KVzap scorer", "nvidia/KVzap-mlp-Qwen3-8B", "`localchat heads fetch qwen3-8b` on a "
                  "connected machine", str(kvzap_cache_dir(card)), "--heads DIR", "another --policy",
                  "onnect" if how == "refused" else "HF_HUB_OFFLINE"):
        assert words in err
    assert not kvzap_cache_dir(card).exists()


def test_the_offline_line_names_kind_kvzap_where_locret_is_the_default(isolated, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="`localchat heads fetch llama-3.1-8b-instruct --kind kvzap` on a connected"):
        fetch_kvzap(cards.find_card("llama-3.1-8b-instruct"), say=quiet)


@pytest.mark.parametrize("how", ["refused", "HF_HUB_OFFLINE"])
def test_offline_the_copies_in_the_hugging_face_cache_are_checked_and_installed(how, hub, files, isolated,
                                                                               monkeypatch):
    """Both files already in huggingface_hub's cache (copied from a connected machine) serve offline, at the
    card's branch too; each is checked against the hash its cache entry is named by."""
    card = replace(CARD, kvzap={**CARD.kvzap, "commit": None, "revision": "main"})
    out = fetch_kvzap(card, endpoint=hub.url, say=quiet)
    shutil.rmtree(out)
    endpoint = hub.url
    if how == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        endpoint = f"http://127.0.0.1:{closed_port()}"
    requests = hub.requests
    assert fetch_kvzap(card, endpoint=endpoint, say=quiet) == out and hub.requests == requests
    assert (out / kvzap.WEIGHTS).read_bytes() == files[kvzap.WEIGHTS]
    assert json.loads((out / SOURCE).read_text())["commit"] == COMMIT
    shutil.rmtree(out)
    blob = next(p for p in hf_files(isolated, "blobs") if p.name == git_blob_id(files[kvzap.CONFIG]))
    blob.write_bytes(blob.read_bytes().replace(b'"n_modules": 2', b'"n_modules": 3'))
    with pytest.raises(UserError, match="config.json is damaged") as err:
        fetch_kvzap(card, endpoint=endpoint, say=quiet)
    assert "git blob id" in str(err.value) and "nothing was installed" in str(err.value)
    assert not blob.exists() and not out.exists() and left_behind(out) == []


@pytest.mark.parametrize("name, what", [(kvzap.WEIGHTS, "sha256"), (kvzap.CONFIG, "git blob id")])
def test_damaged_bytes_with_the_right_metadata_are_removed_and_nothing_is_installed(name, what, hub, files, isolated,
                                                                                    monkeypatch, capsys):
    from localchat.cli import main

    use_card(monkeypatch, CARD)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    hub.flip = {name}
    assert main(["heads", "fetch", CARD.id]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    line = err[-1]
    right = hashlib.sha256(files[name]).hexdigest() if name == kvzap.WEIGHTS else git_blob_id(files[name])
    assert f"{REPO}/{name} is damaged ({what} " in line and f"the hub lists {right[:12]}" in line
    assert "nothing was installed" in line and f"`localchat heads fetch {CARD.id}` again" in line
    assert "Traceback" not in "\n".join(err)
    out = kvzap_cache_dir(CARD)
    assert cached_kvzap(CARD) is None and not out.exists() and left_behind(out) == []
    assert right not in [p.name for p in hf_files(isolated, "blobs")]  # the damaged download is gone
    assert list((isolated / "hf-cache").rglob(name)) == []  # its snapshot link too
    if name == kvzap.CONFIG:  # checked before the weights are asked for
        assert hub.sent.get(kvzap.WEIGHTS, 0) == 0
    hub.flip = set()  # the next fetch starts clean and succeeds
    assert main(["heads", "fetch", CARD.id]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    assert (out / name).read_bytes() == files[name]


def test_a_file_the_hub_gives_no_hash_for_is_refused(hub, isolated):
    hub.etag[kvzap.CONFIG] = "W/not-a-hash"
    with pytest.raises(UserError) as err:
        fetch_kvzap(CARD, endpoint=hub.url, say=quiet)
    message = str(err.value)
    assert "\n" not in message and f"{REPO}/config.json" in message and "does not install unchecked" in message
    assert not kvzap_cache_dir(CARD).exists() and hub.sent == {}


def test_a_release_for_another_model_is_refused_before_the_weights_download(hub, isolated):
    card = replace(CARD, id="tiny-other", kvzap={**CARD.kvzap, "repo": WRONG_REPO})
    with pytest.raises(UserError) as err:
        fetch_kvzap(card, endpoint=hub.url, say=quiet)
    message = str(err.value)
    assert "\n" not in message and WRONG_REPO in message and "was made for another model" in message
    assert "n_modules 3 (the model: 2)" in message
    assert hub.sent.get(kvzap.WEIGHTS, 0) == 0
    out = kvzap_cache_dir(card)
    assert cached_kvzap(card) is None and not out.exists() and left_behind(out) == []


@pytest.mark.parametrize("repo, width, words", [
    (LINEAR_REPO, WIDTH, "is linear (hidden_dim None); the model card of Tiny-KVzap names an MLP of width 16"),
    (REPO, None, "is mlp (hidden_dim 16); the model card of Tiny-KVzap names a linear scorer"),
])
def test_a_release_of_another_variant_than_the_card_names_is_refused(hub, repo, width, words):
    card = replace(CARD, kvzap={"repo": repo, "commit": COMMIT, **({"hidden_dim": width} if width else {})})
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
        fetch_kvzap(card, endpoint=hub.url, say=quiet)
    assert not kvzap_cache_dir(card).exists()


@pytest.mark.parametrize("name, how", [(kvzap.WEIGHTS, "flip"), (kvzap.CONFIG, "flip"), (SOURCE, "remove"),
                                       (STAMP, "remove")])
def test_a_damaged_or_incomplete_installed_copy_is_fetched_again(name, how, hub, files):
    out = fetch_kvzap(CARD, endpoint=hub.url, say=quiet)
    path = out / name
    if how == "flip":
        st = path.stat()
        damaged = bytearray(path.read_bytes())
        damaged[-10] ^= 0x01  # one flipped bit, file times set back
        path.write_bytes(bytes(damaged))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:
        path.unlink()
    assert cached_kvzap(CARD) is None
    said, sent = [], dict(hub.sent)
    assert fetch_kvzap(CARD, endpoint=hub.url, say=said.append) == out
    assert "damaged" in said[0] and name in said[0] and "fetching it again" in said[0]
    assert hub.sent == sent  # from the Hugging Face cache: the downloads were whole
    assert cached_kvzap(CARD) == out
    for n in (kvzap.CONFIG, kvzap.WEIGHTS):
        assert (out / n).read_bytes() == files[n]


def test_a_revision_that_names_the_installed_commit_downloads_nothing(hub):
    out = fetch_kvzap(CARD, endpoint=hub.url, say=quiet)
    sent, heads = dict(hub.sent), hub.heads
    assert fetch_kvzap(CARD, endpoint=hub.url, say=quiet, revision="main") == out
    assert hub.sent == sent and hub.heads == heads + 2  # asked what main is: both files' metadata, no body
    with pytest.raises(UserError, match="has no revision 'v9'"):
        fetch_kvzap(CARD, endpoint=hub.url, say=quiet, revision="v9")


def test_two_fetches_at_once_fetch_once(hub, files):
    import threading

    results: list = []
    threads = [threading.Thread(target=lambda: results.append(fetch_kvzap(CARD, endpoint=hub.url, say=quiet)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [kvzap_cache_dir(CARD)] * 2
    assert hub.sent[kvzap.WEIGHTS] == len(files[kvzap.WEIGHTS])


def test_import_heads_copies_a_kvzap_release_folder_after_checking_it_fits(files, tmp_path, capsys):
    from localchat.cli import main

    release = tmp_path / "release"
    release.mkdir()
    for name, data in files.items():
        (release / name).write_bytes(data)
    model = tmp_path / "model"
    model.mkdir()
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "head_dim": 16,
              "intermediate_size": 128, "vocab_size": 300}
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert main(["import-heads", str(release), "--out", str(out), "--model", str(model)]) == 0
    assert capsys.readouterr().out == f"{out}\n"
    for name in (kvzap.CONFIG, kvzap.WEIGHTS):
        assert (out / name).read_bytes() == files[name]
    assert not (out / "README.md").exists() and (out / STAMP).is_file()
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    assert main(["import-heads", str(release), "--out", str(tmp_path / "other"), "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert "was made for another model: n_modules 2 (the model: 3)" in err and err.count("\n") == 1
    assert not (tmp_path / "other").exists()


def test_the_qwen3_8b_card_matches_the_published_config():
    from localchat.planning import memory as m

    card = cards.find_card("qwen3-8b")
    config = json.loads((CONFIGS / "qwen3-8b.json").read_text())
    s = card.shape
    assert (s["layers"], s["hidden"], s["q_heads"], s["kv_heads"], s["head_dim"], s["vocab"], s["intermediate"],
            s["tied"], s["attn_bias"], s["model_type"], s["native_window"]) == (
        config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
        config["num_key_value_heads"], config["head_dim"], config["vocab_size"], config["intermediate_size"],
        config["tie_word_embeddings"], config["attention_bias"], config["model_type"],
        config["max_position_embeddings"])
    assert m.Shape.from_config(m.read_config(CONFIGS / "qwen3-8b.json"), name="q").total_params() == 8_190_735_360
    assert card.policy == {"name": "kvzap", "budget": 16384, "stabilizers": 2500, "local": 100, "positions": "compact"}
    assert card.kvzap_config() == {"model_type": "kvzap", "input_dim": 4096, "output_dim": 8, "hidden_dim": 512,
                                   "n_modules": 36}
    assert kvzap.parameters(card.kvzap_config()) == 75_663_648
    assert round(kvzap.parameters(card.kvzap_config()) * 4 / 1e6) == card.kvzap["size_mb"]  # fp32, see the card
    for c in (card, cards.find_card("llama-3.1-8b-instruct")):  # a full commit, or a branch the fetch resolves
        pinned = c.kvzap.get("commit")
        assert (pinned and len(pinned) == 40 and int(pinned, 16) >= 0) or c.kvzap.get("revision") == "main"
