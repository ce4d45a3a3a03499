"""Label extraction against a brute-force reference: the full attention matrix on a short sequence."""

from __future__ import annotations

import torch
from tiny import tiny_llama
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from localchat.train.labels import extract


def _reference(model, prompt, answer):
    ids = torch.tensor([prompt + answer])
    n_q, n = len(prompt), len(prompt) + len(answer)
    cfg = model.config
    kv, g, d = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.head_dim
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
        pos = torch.arange(n)[None]
        cos, sin = model.model.rotary_emb(hidden[0], pos)
        logit, prob, feats = [], [], []
        for i, layer in enumerate(model.model.layers):
            x = layer.input_layernorm(hidden[i])
            a = layer.self_attn
            q = a.q_proj(x).view(1, n, -1, d).transpose(1, 2)
            k = a.k_proj(x).view(1, n, -1, d).transpose(1, 2)
            feats.append(torch.cat([a.q_proj(x), a.k_proj(x), a.v_proj(x)], -1)[0, :n_q])
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k = k.repeat_interleave(g, dim=1)
            full = (q @ k.transpose(-1, -2))[0] / d**0.5  # [H_q, n, n]: the whole matrix, on purpose
            full = full.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            rows = full[:, n_q:].view(kv, g, len(answer), n)
            logit.append(rows[..., :n_q].amax(dim=(1, 2)))
            prob.append(rows.softmax(-1)[..., :n_q].amax(dim=(1, 2)))
    return torch.stack(logit), torch.stack(prob), torch.stack(feats)


def test_labels_equal_the_brute_force_reference():
    model = tiny_llama(300, layers=3, q_heads=6, kv_heads=2, head_dim=16)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 300, (150,), generator=gen).tolist()
    answer = torch.randint(0, 300, (7,), generator=gen).tolist()
    got = extract(model, prompt, answer, chunk=40)
    logit, prob, feats = _reference(model, prompt, answer)
    assert got.labels["logit"].shape == (3, 2, 150)
    assert torch.allclose(got.labels["logit"], logit, atol=1e-4)
    assert torch.allclose(got.labels["prob"], prob, atol=1e-5)
    assert got.features.dtype == torch.float16 and got.features.shape == (3, 150, (6 + 4) * 16)
    assert torch.allclose(got.features.float(), feats, atol=2e-3)
    assert model.config._attn_implementation == "sdpa"  # restored
    assert not model.model.layers[0].self_attn.q_proj._forward_hooks
