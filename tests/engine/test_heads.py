"""Retaining heads: the scores come from the pre-RoPE q/k/v projections, are computed once, and round-trip."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_llama

from localchat.engine.cache import KVCache
from localchat.engine.heads import HeadScorer, RetainingHeads
from localchat.engine.policies import make_policy
from localchat.engine.prefill import evict, forward, prefill
from localchat.engine.rope import rope_inv_freq
from localchat.errors import UserError


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
    ref = heads.head(1).fc2(torch.nn.functional.silu(heads.head(1).fc1(x))).T
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


def test_decoded_tokens_are_scored_in_one_batch_with_the_same_scores():
    """Decode steps queue their Q, K, V; the batch scores equal each step's own scores, in the right slots,
    and an eviction (or detach) scores the queue first."""
    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    heads = RetainingHeads.random(model, d_r=24, seed=2)
    policy = make_policy("locret", heads=heads, budget=40, stabilizers=8, local=0)
    cache = KVCache(2, positions="compact", inv_freq=rope_inv_freq(model))
    steps: list[dict[int, torch.Tensor]] = []
    attns = [layer.self_attn for layer in model.model.layers]
    hooks = [a.register_forward_pre_hook(lambda m, args, kw, i=i: steps[-1].__setitem__(i, kw["hidden_states"][0]),
                                         with_kwargs=True) for i, a in enumerate(attns)]
    policy.attach(model, cache)
    ids = torch.randint(0, 300, (1, 60))
    with torch.inference_mode():
        steps.append({})
        forward(model, cache, ids, 0)
        policy.observe(cache, 60, ids)
        for t in range(5):
            steps.append({})
            forward(model, cache, ids[:, t:t + 1], 60 + t)
            policy.observe(cache, 1, ids[:, t:t + 1])
        assert policy.scorer.queued() == 5 and cache.layers[0].scores[:, -5:].abs().sum() == 0  # not scored yet
        policy._flush(cache)
    for i, a in enumerate(attns):
        h = torch.cat([s[i] for s in steps[1:]])
        qkv = torch.cat([torch.nn.functional.linear(h, p.weight) for p in (a.q_proj, a.k_proj, a.v_proj)], dim=-1)
        assert torch.allclose(cache.layers[i].scores[:, -5:], heads.head(i)(qkv).T, atol=1e-5)
    with torch.inference_mode():
        forward(model, cache, ids[:, :1], 65)
        policy.observe(cache, 1, ids[:, :1])
        assert evict(cache, policy, last_chunk=True) and policy.scorer.queued() == 0
        forward(model, cache, ids[:, 1:2], 66)
        policy.observe(cache, 1, ids[:, 1:2])
    policy.detach()
    for hook in hooks:
        hook.remove()
    assert policy.scorer.queued() == 0 and cache.layers[1].scores[:, -1].abs().sum() > 0


def test_a_long_answer_is_scored_every_flush_every_tokens():
    """The queue never holds more than FLUSH_EVERY tokens' Q, K, V, however long the answer."""
    from localchat.engine.policies.locret import FLUSH_EVERY

    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    policy = make_policy("locret", heads=RetainingHeads.random(model, d_r=24), budget=400, stabilizers=8, local=0)
    cache = KVCache(2, positions="compact", inv_freq=rope_inv_freq(model))
    policy.attach(model, cache)
    longest = 0
    with torch.inference_mode():
        forward(model, cache, torch.randint(0, 300, (1, 20)), 0)
        policy.observe(cache, 20, None)
        for t in range(3 * FLUSH_EVERY + 5):
            forward(model, cache, torch.randint(0, 300, (1, 1)), 20 + t)
            policy.observe(cache, 1, None)
            longest = max(longest, policy.scorer.queued())
        scored = (cache.layers[0].scores != 0).all(0)
        policy.detach()
    assert longest == FLUSH_EVERY - 1  # the step that brings the queue to FLUSH_EVERY scores it
    assert scored[: 20 + 3 * FLUSH_EVERY].all() and not scored[-5:].any()  # the last 5 wait for detach
    assert (cache.layers[0].scores != 0).all()


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


def test_random_heads_from_a_shape_match_those_from_the_model():
    from localchat.engine.heads import head_shape

    model = tiny_llama(300, layers=2, q_heads=4, kv_heads=2)
    a = RetainingHeads.random(model, d_r=32, seed=3)
    b = RetainingHeads.random(head_shape(model), d_r=32, seed=3)
    assert b.shape == head_shape(model)
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(x, y)
