"""The real embedded default model, SmolLM2-135M-Instruct (fetched once into the user cache)."""

from __future__ import annotations

import shutil

import pytest

from localchat.bench.tasks import passkey, score_passkey
from localchat.cli import main
from localchat.engine import default_model
from localchat.engine.cards import default_card
from localchat.errors import ModelError

pytestmark = pytest.mark.model


def test_default_model_is_verified_and_a_corrupt_copy_is_detected(smollm2, tmp_path):
    card = default_card()
    gguf = default_model.ensure_gguf(card)  # already fetched by the fixture: no network here
    default_model.verify_gguf(gguf, card)
    bad = tmp_path / gguf.name
    shutil.copyfile(gguf, bad)
    with open(bad, "r+b") as f:
        f.seek(bad.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ModelError, match="SHA-256"):
        default_model.verify_gguf(bad, card)


def test_default_model_shape_matches_its_card(smollm2):
    cfg, shape = smollm2.model.config, default_card().shape
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        shape["layers"], shape["q_heads"], shape["kv_heads"])
    assert cfg.max_position_embeddings == shape["native_window"] == smollm2.window


def test_ask_finds_the_pass_key_in_a_6k_document(smollm2, tmp_path, capsys):
    sample = passkey(smollm2.tokenizer, 6000, seed=7)
    assert 5500 < sample.n_tokens <= 6000
    doc = tmp_path / "doc.txt"
    doc.write_text(sample.document)
    assert main(["ask", "--file", str(doc), "--max-new-tokens", "24", "What is the pass key?"]) == 0
    out = capsys.readouterr().out
    assert score_passkey(sample, out), out


@pytest.mark.slow  # 90 s: a 20K-token read of the real model; the tiny models cover compact mode in the default run
def test_a_20k_document_past_the_window_reads_in_compact_mode_within_budget(smollm2, tmp_path, capsys):
    sample = passkey(smollm2.tokenizer, 20000, seed=11, depth=0.9)
    assert sample.n_tokens > 2 * smollm2.window
    doc = tmp_path / "long.txt"
    doc.write_text(sample.document)
    argv = ["ask", "--file", str(doc), "--policy", "locret", "--heads", "random", "--budget", "1024",
            "--positions", "compact", "--max-new-tokens", "8", "--stats", "What is the pass key?"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    kept = int(err.split("kept ")[1].split(" units")[0].replace(",", ""))
    assert kept <= 1024 + 96 + 8  # b + n_loc + generated, independent of the 20K prompt
    assert "MiB" in err and "smaller than full" in err


def test_a_local_gguf_file_loads_through_the_conversion_cache(smollm2):
    from localchat.engine.engine import Engine
    from localchat.engine.events import Done

    gguf = default_model.ensure_gguf(default_card())
    engine = Engine.load(str(gguf))  # converted once into the cache (about 30 s), then reused
    assert engine.card is None and engine.model.config.num_hidden_layers == 30
    done = list(engine.chat([{"role": "user", "content": "What is the capital of France?"}]))[-1]
    assert isinstance(done, Done) and "Paris" in done.text
