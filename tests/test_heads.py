"""Retaining heads: the scores come from the pre-RoPE q/k/v projections, are computed once, and round-trip."""

from __future__ import annotations

import pytest
import torch

from localchat.engine.cache import KVCache
from localchat.engine.heads import HeadScorer, RetainingHeads
from localchat.engine.policies import make_policy
from localchat.engine.prefill import evict, forward, prefill
from localchat.engine.rope import rope_inv_freq
from localchat.errors import UserError
from tiny import tiny_llama


def test_scores_are_the_head_of_pre_rope_qkv():
    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    heads = RetainingHeads.random(model, d_r=24, seed=1)
    scorer = HeadScorer(model, heads)
    ids = torch.randint(0, 300, (1, 17))
    captured = {}
    attn = model.model.layers[1].self_attn
    hook = attn.register_forward_pre_hook(lambda m, args, kwargs: captured.update(h=kwargs["hidden_states"]),
                                          with_kwargs=True)
    with torch.inference_mode():
        model(input_ids=ids)
    hook.remove()
    got = scorer.take(1)
    assert scorer.take(1) is None  # taken once
    scorer.close()
    assert not model.model.layers[0].self_attn.q_proj._forward_hooks
    h = captured["h"][0]
    x = torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], dim=-1)
    ref = heads.layers[1].fc2(torch.nn.functional.silu(heads.layers[1].fc1(x))).T
    assert got.shape == (2, 17) and torch.allclose(got, ref, atol=1e-6)


def test_each_unit_is_scored_once_when_it_enters():
    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    policy = make_policy("locret", heads=RetainingHeads.random(model, d_r=24), budget=64, stabilizers=8, local=0)
    cache = KVCache(2, positions="compact", inv_freq=rope_inv_freq(model))
    seen: dict[tuple[int, int], float] = {}
    policy.attach(model, cache)
    ids = torch.randint(0, 300, (1, 400))
    for start in range(0, 400, 50):
        forward(model, cache, ids[:, start:start + 50], start)
        policy.observe(cache, 50, ids[:, start:start + 50])
        layer = cache.layers[0]
        for h in range(2):
            for p, s in zip(layer.positions[h].tolist(), layer.scores[h].tolist()):
                assert seen.setdefault((h, p), s) == s  # a kept unit keeps the score it entered with
        evict(cache, policy, last_chunk=False)
    policy.detach()


def test_save_load_round_trip_and_mismatch(tmp_path):
    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    heads = RetainingHeads.random(model, d_r=24, seed=3)
    heads.save(tmp_path / "h")
    back = RetainingHeads.load(tmp_path / "h")
    assert back.d_r == 24 and back.shape == heads.shape and back.meta["kind"] == "random"
    for a, b in zip(heads.state_dict().values(), back.state_dict().values()):
        assert torch.equal(a.half().float(), b)  # shipped as fp16
    other = tiny_llama(300, layers=3, q_heads=4, kv_heads=2)
    with pytest.raises(UserError, match="made for shape"):
        HeadScorer(other, back)
    with pytest.raises(UserError, match="cannot read"):
        RetainingHeads.load(tmp_path / "missing")


def test_locret_through_prefill_keeps_b_plus_tail():
    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    policy = make_policy("locret", heads=RetainingHeads.random(model, d_r=24), budget=50, stabilizers=10, local=12)
    cache = KVCache(2, positions="original")
    policy.attach(model, cache)
    gen = prefill(model, cache, torch.randint(0, 300, (1, 500)), chunk=40, policy=policy)
    for _ in gen:
        pass
    policy.detach()
    assert cache.get_seq_length() == 62
