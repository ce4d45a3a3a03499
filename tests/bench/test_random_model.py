"""`localchat bench random-model`: a model folder of random weights from a real config, with a given tokenizer
(the GPU machine has no default model to take one from)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny import CONFIGS, tiny_tokenizer

from localchat.cli import main


def test_a_two_layer_model_from_a_real_config_with_a_given_tokenizer(tmp_path):
    tok_dir = tmp_path / "tok"
    tiny_tokenizer().save_pretrained(str(tok_dir))
    out = tmp_path / "model"
    assert main(["bench", "random-model", str(CONFIGS / "smollm2-135m-instruct.json"), str(out), "--layers", "2",
                       "--tokenizer", str(tok_dir)]) == 0
    facts = json.loads((out / "localchat-random-model.json").read_text())
    assert facts["layers"] == 2 and facts["dtype"] == "bf16" and "random weights" in facts["note"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out))
    real = json.loads((CONFIGS / "smollm2-135m-instruct.json").read_text())
    assert model.config.hidden_size == real["hidden_size"] and model.config.num_hidden_layers == 2
    assert len(AutoTokenizer.from_pretrained(str(out))) == len(AutoTokenizer.from_pretrained(str(tok_dir)))
    logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, real["vocab_size"]) and torch.isfinite(logits).all()
    assert Path(out / "config.json").exists()
