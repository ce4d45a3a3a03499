"""KVzap scorers: a release folder in kvpress's layout is read as it is, each unit is scored from its layer's
input-norm output, LOCRET's selection keeps the top-scored units, and the threshold rule keeps fewer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from tiny import tiny_architecture, tiny_llama, tiny_tokenizer

from localchat.engine import kvzap
from localchat.engine.cache import KVCache
from localchat.engine.engine import Engine
from localchat.engine.events import Done, Notice
from localchat.engine.heads import RetainingHeads
from localchat.engine.kvzap_scorer import KVzapHooks, KVzapScorer
from localchat.engine.policies import make_policy
from localchat.engine.prefill import forward, prefill
from localchat.engine.sampling import GenerationSettings
from localchat.errors import UserError
from localchat.planning.load import load_scorer
from localchat.session import Session


def release(directory, model, hidden_dim=None, seed=0, n_modules=None):
    """A folder as kvpress's KVzapModel.save_pretrained writes it: its config keys and tensor names, at bf16."""
    cfg = model.config
    d, h, n = cfg.hidden_size, cfg.num_key_value_heads, n_modules or cfg.num_hidden_layers
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(n):
        if hidden_dim is None:
            tensors[f"layers.{i}.weight"] = torch.randn(h, d, generator=g)
            tensors[f"layers.{i}.bias"] = torch.randn(h, generator=g)
        else:
            tensors[f"layers.{i}.0.weight"] = torch.randn(hidden_dim, d, generator=g) / d ** 0.5
            tensors[f"layers.{i}.0.bias"] = torch.randn(hidden_dim, generator=g)
            tensors[f"layers.{i}.2.weight"] = torch.randn(h, hidden_dim, generator=g)
            tensors[f"layers.{i}.2.bias"] = torch.randn(h, generator=g)
    directory.mkdir(parents=True)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    config = {"architectures": ["KVzapModel"], "dtype": "bfloat16", "hidden_dim": hidden_dim, "input_dim": d,
              "model_type": "kvzap", "n_modules": n, "output_dim": h, "transformers_version": "4.57.1"}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return {k: v.to(torch.bfloat16).float() for k, v in tensors.items()}


def by_hand(tensors, i, x, mlp):
    if not mlp:
        return torch.nn.functional.linear(x, tensors[f"layers.{i}.weight"], tensors[f"layers.{i}.bias"])
    y = torch.nn.functional.linear(x, tensors[f"layers.{i}.0.weight"], tensors[f"layers.{i}.0.bias"])
    y = torch.nn.functional.gelu(y)
    return torch.nn.functional.linear(y, tensors[f"layers.{i}.2.weight"], tensors[f"layers.{i}.2.bias"])


@pytest.mark.parametrize("hidden_dim", [None, 12])
def test_a_release_scores_each_token_from_its_input_norm(tmp_path, hidden_dim):
    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    tensors = release(tmp_path / "r", model, hidden_dim)
    scorer = KVzapScorer.load(tmp_path / "r")
    assert scorer.variant == ("linear" if hidden_dim is None else "mlp")
    hooks = KVzapHooks(model, scorer)
    seen = {}
    norm = model.model.layers[1].input_layernorm
    handle = norm.register_forward_hook(lambda m, a, out: seen.update(x=out[0]))
    ids = torch.randint(0, 300, (1, 23))
    with torch.inference_mode():
        model(input_ids=ids)
    handle.remove()
    got = hooks.take(1)
    hooks.close()
    assert not norm._forward_hooks
    assert got.shape == (2, 23)
    assert torch.allclose(got, by_hand(tensors, 1, seen["x"], hidden_dim is not None).T, atol=1e-5)


def test_kvzap_keeps_the_top_scored_units_of_the_document(tmp_path):
    """With no stabilizers, the units kept after reading are each head's top `budget` by the scorer's own
    scores of the whole document (evicting chunk by chunk loses none of them), plus the local tail."""
    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    tensors = release(tmp_path / "r", model, 8, seed=4)
    policy = make_policy("kvzap", heads=KVzapScorer.load(tmp_path / "r"), budget=40, stabilizers=0, local=10)
    inputs = {}
    handles = [layer.input_layernorm.register_forward_hook(
        lambda m, a, out, i=i: inputs.setdefault(i, []).append(out[0])) for i, layer in enumerate(model.model.layers)]
    cache = KVCache(2, positions="original")
    policy.attach(model, cache)
    ids = torch.randint(0, 300, (1, 300))
    for _ in prefill(model, cache, ids, chunk=32, policy=policy):
        pass
    policy.detach()
    for h in handles:
        h.remove()
    for i, layer in enumerate(cache.layers):
        head = torch.cat(inputs[i])[:290]  # the tokens read before the local tail
        scores = by_hand(tensors, i, head, True).T  # [H_kv, 290]
        best = scores.topk(40, dim=-1).values  # the top 40 (near ties may swap: the cache stores scores coarser)
        kept = scores.gather(1, layer.positions[:, :40])
        assert torch.allclose(kept.sort(dim=-1).values, best.sort(dim=-1).values, atol=1e-2)
        assert torch.equal(layer.positions[:, 40:], torch.arange(290, 300).expand(2, -1))


def test_threshold_keeps_only_what_scores_above_it(tmp_path):
    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    release(tmp_path / "r", model, None, seed=5)
    scorer = KVzapScorer.load(tmp_path / "r")
    ids = torch.randint(0, 300, (1, 200))
    kept = {}
    for threshold in (None, 1e9):
        policy = make_policy("kvzap", heads=scorer, budget=64, stabilizers=8, local=8, threshold=threshold)
        cache = KVCache(2, positions="original")
        policy.attach(model, cache)
        notes = [e.message for e in prefill(model, cache, ids, chunk=32, policy=policy) if isinstance(e, Notice)]
        kept[threshold] = cache.get_seq_length()
        policy.detach()
    assert kept[None] == 64 + 8
    assert kept[1e9] == 8 + 8  # nothing scores above it: the stabilizers and the local tail stay
    assert notes == ["kvzap --threshold 1e+09: up to 8 units per KV head scored above it"]


def test_decoded_tokens_are_scored_like_read_ones(tmp_path):
    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    tensors = release(tmp_path / "r", model, 8, seed=6)
    policy = make_policy("kvzap", heads=KVzapScorer.load(tmp_path / "r"), budget=200, stabilizers=8, local=0)
    cache = KVCache(2, positions="original")
    policy.attach(model, cache)
    ids = torch.randint(0, 300, (1, 40))
    inputs = []
    handle = model.model.layers[0].input_layernorm.register_forward_hook(lambda m, a, out: inputs.append(out[0]))
    with torch.inference_mode():
        forward(model, cache, ids, 0)
        policy.observe(cache, 40, ids)
        for t in range(3):
            forward(model, cache, ids[:, t:t + 1], 40 + t)
            policy.observe(cache, 1, ids[:, t:t + 1])
    policy.detach()
    handle.remove()
    want = by_hand(tensors, 0, torch.cat(inputs), True).T
    assert torch.allclose(cache.layers[0].scores, want, atol=1e-5)


def test_the_wrong_scorer_is_one_line(tmp_path):
    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    release(tmp_path / "other", tiny_llama(300, layers=3, q_heads=4, kv_heads=2), None)
    with pytest.raises(UserError, match=r"made for another model: n_modules 3 \(the model: 2\)"):
        load_scorer("kvzap", tmp_path / "other", model)
    RetainingHeads.random(model, d_r=8).save(tmp_path / "heads")
    with pytest.raises(UserError, match="holds no KVzap scorer"):
        load_scorer("kvzap", tmp_path / "heads", model)
    release(tmp_path / "ok", model, None)
    with pytest.raises(UserError, match="holds a KVzap scorer, not LOCRET retaining heads; add --policy kvzap"):
        load_scorer("locret", tmp_path / "ok", model)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    save_file({"layers.0.weight": torch.zeros(2, 64)}, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(UserError, match="not the KVzap scorer its config.json describes"):
        load_scorer("kvzap", tmp_path / "bad", model)


def test_save_writes_the_release_layout(tmp_path):
    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    scorer = KVzapScorer.random(model, hidden_dim=6)
    scorer.save(tmp_path / "s")
    assert kvzap.is_kvzap(tmp_path / "s")
    config = kvzap.check_release(tmp_path / "s")
    assert config["hidden_dim"] == 6 and config["n_modules"] == 2
    back = KVzapScorer.load(tmp_path / "s")
    for a, b in zip(scorer.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_a_document_past_the_budget_is_answered_and_followed_up(tmp_path, arch):
    """A tiny model with a scorer in the release layout reads a document past its budget, answers, and a
    follow-up reads only its own tokens; on a hybrid only the growing layers have modules."""
    tok = tiny_tokenizer()
    model = tiny_architecture(arch, len(tok))
    release(tmp_path / "r", model, 8)
    scorer = load_scorer("kvzap", tmp_path / "r", model)
    engine = Engine(model, tok, chunk=128)
    if arch == "gemma3_text":
        assert len(scorer.scored) < model.config.num_hidden_layers
    engine.set_policy(make_policy("kvzap", heads=scorer, budget=96, stabilizers=24, local=16))
    session = Session(engine)
    settings = GenerationSettings(max_new_tokens=4, ignore_eos=True)
    first = list(session.send("The quick brown fox jumps over the lazy dog. " * 32 + "\nWhat jumps?",
                              settings=settings))[-1]
    assert isinstance(first, Done) and first.prompt_tokens > 1400
    assert first.kv_tokens <= 96 + 16 + 4
    second = list(session.send("And then?", settings=settings))[-1]
    assert isinstance(second, Done) and second.prompt_tokens < 40
