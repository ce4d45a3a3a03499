"""KVzap training: KVzip+ labels against a brute-force reference, the ridge fit against a known linear map, and the
saved release as the engine reads it."""

from __future__ import annotations

import json

import torch
from tiny import tiny_llama, tiny_tokenizer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from localchat.engine.engine import Engine
from localchat.engine.kvzap import check_release
from localchat.engine.kvzap_scorer import KVzapHooks, KVzapScorer
from localchat.train.kvzap import Layout, Moments, evaluate, fit, fold, kvzip_plus, repeat_layout, ridge, train


def _reference(model, layout):
    """KVzip+ from the whole attention matrix of one forward (kvpress's recipe, written out)."""
    ids = torch.tensor([layout.ids[: layout.copy[1]]])
    n = ids.shape[1]
    (t0, t1), (c0, c1) = layout.text, layout.copy
    cfg = model.config
    kv, hq, d = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    g = hq // kv
    scores, feats = [], []
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
        cos, sin = model.model.rotary_emb(hidden[0], torch.arange(n)[None])
        for i, layer in enumerate(model.model.layers):
            x = layer.input_layernorm(hidden[i])[0]  # [n, D]
            a = layer.self_attn
            q = a.q_proj(x).view(n, hq, d).transpose(0, 1)[None]
            k = a.k_proj(x).view(n, kv, d).transpose(0, 1)[None]
            v = a.v_proj(x).view(n, kv, d).transpose(0, 1)  # [H_kv, n, d]
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            logits = (q[0] @ k[0].repeat_interleave(g, 0).transpose(-1, -2)) / d**0.5
            probs = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
            probs = probs / x.norm(dim=-1).view(1, n, 1)  # divided by each query's ||x||
            wo = a.o_proj.weight.view(-1, hq, d)  # [D, H_q, d]
            wov = torch.stack([(v[h // g] @ wo[:, h].T).norm(dim=-1) for h in range(hq)])  # [H_q, n]: ||W_o,h v||
            s = (probs * wov[:, None, :])[:, c0:c1, t0:t1].amax(1).view(kv, g, -1).amax(1).log()
            scores.append(s)
            feats.append(x[t0:t1])
    return torch.stack(scores), torch.stack(feats)


def test_labels_equal_the_brute_force_reference():
    model = tiny_llama(300, layers=3, q_heads=6, kv_heads=2, head_dim=16)
    ids = torch.randint(0, 300, (130,), generator=torch.Generator().manual_seed(0)).tolist()
    layout = Layout(ids, (10, 60), (70, 120))  # a short prefix, the text, a gap, the copy, a tail never run
    got = kvzip_plus(model, layout, chunk=24)  # chunks that cut through the text and the copy
    scores, feats = _reference(model, layout)
    assert got.scores.shape == (3, 2, 50) and got.features.shape == (3, 50, 96)
    assert torch.isfinite(got.scores).all()
    assert torch.allclose(got.scores, scores, atol=1e-4)
    assert torch.allclose(got.features, feats, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert not model.model.layers[0].input_layernorm._forward_hooks


def test_repeat_layout_finds_both_copies():
    tok = tiny_tokenizer()
    engine = Engine(tiny_llama(len(tok)), tok, name="tiny", chunk=64)
    text = "The special magic falcon number is 48213. The sky is blue."
    layout = repeat_layout(engine, "  " + text + "\n")
    (t0, t1), (c0, c1) = layout.text, layout.copy
    assert tok.decode(layout.ids[t0:t1]) == text == tok.decode(layout.ids[c0:c1])
    assert "Repeat the previous context exactly." in tok.decode(layout.ids[t1:c0])


def test_ridge_recovers_a_known_linear_map():
    gen = torch.Generator().manual_seed(1)
    layers, dim, heads = 2, 12, 3
    w_true = torch.randn(layers, heads, dim, generator=gen)
    b_true = torch.randn(layers, heads, generator=gen) * 3
    m, held = Moments(layers, dim, heads), Moments(layers, dim, heads)
    for part in (m, m, m, held):
        x = torch.randn(layers, 200, dim, generator=gen) * 2 + 5  # off-centre: the intercept must absorb the mean
        y = torch.einsum("lhd,lnd->lhn", w_true, x) + b_true.unsqueeze(-1)
        part.add(x, y + 0.01 * torch.randn(y.shape, generator=gen))
    w, b = ridge(m, 1e-3)
    assert torch.allclose(w.float(), w_true, atol=1e-2) and torch.allclose(b.float(), b_true, atol=5e-2)
    ev = evaluate(w, b, held)
    assert (ev["r2"] > 0.999).all() and (ev["corr"] > 0.999).all()
    w_big, b_big = ridge(m, 1e6)  # a huge penalty shrinks the map to the mean
    assert w_big.abs().max() < 0.2 and evaluate(w_big, b_big, held)["r2"].mean() < 0.5
    # the penalty chosen on the validation part is the small one
    w2, b2, report = fit({"train": m, "valid": held}, alphas=(1e-3, 1e6))
    assert report["alpha"] == [1e-3, 1e-3]


def test_folds():
    parts = [fold(i, 4) for i in range(16)]
    assert parts.count("held_out") == 4 and parts[3] == "held_out" and parts[15] == "held_out"
    assert parts.count("valid") == 3 and parts.count("train") == 9


def test_trained_scorer_saves_loads_and_runs(tmp_path):
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), layers=2, q_heads=4, kv_heads=2)
    engine = Engine(model, tok, name="tiny", chunk=64)
    texts = [f"Note {i}: the {w} code is {1000 + 37 * i}. " * (3 + i % 3) for i, w in
             enumerate(["apple", "river", "falcon", "copper", "maple", "violet"])]
    log = train(engine, texts, tmp_path / "s", every_nth=3, say=lambda m: None)
    assert log["samples"] == {"train": 3, "valid": 1, "held_out": 2} and log["tokens"]["train"] > 100
    assert len(log["held_out"]["r2_per_layer"]) == 2 and all(map(isinstance, log["alpha_per_layer"], [float] * 2))
    config = check_release(tmp_path / "s")
    assert config["hidden_dim"] is None and config["input_dim"] == 64 and config["output_dim"] == 2
    assert json.loads((tmp_path / "s" / "train-log.json").read_text())["variant"] == "linear"
    scorer = KVzapScorer.load(tmp_path / "s")
    hooks = KVzapHooks(model, scorer)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([engine.encode(texts[0])]))
        assert hooks.take(1).shape[0] == 2 and torch.isfinite(hooks.take(0)).all()
    finally:
        hooks.close()


def test_train_heads_takes_the_scorer_flag():
    from localchat.cli import build_parser

    parse = lambda *a: build_parser().parse_args(["train-heads", "--out", "D", *a])  # noqa: E731
    assert parse().scorer == "locret" and parse("--scorer", "kvzap").scorer == "kvzap"
