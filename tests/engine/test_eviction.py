"""The evicting cache and LOCRET's Algorithm 1 on a tiny random Llama (GQA: 4 query heads, 2 KV heads)."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_llama

from localchat.engine.cache import KVCache
from localchat.engine.engine import Engine
from localchat.engine.events import Done, Notice, Token
from localchat.engine.heads import RetainingHeads
from localchat.engine.kvzap_scorer import KVzapScorer
from localchat.engine.policies import POLICIES, make_policy
from localchat.engine.policies.base import PROTECT
from localchat.engine.prefill import evict, forward, plan_steps, prefill
from localchat.engine.rope import rope_inv_freq, shift_keys
from localchat.engine.sampling import GenerationSettings


def _run(model, ids, policy, chunk, positions):
    inv = rope_inv_freq(model) if positions == "compact" else None
    cache = KVCache(model.config.num_hidden_layers, positions=positions, inv_freq=inv)
    reports = []
    policy.attach(model, cache)
    gen = prefill(model, cache, ids, chunk=chunk, policy=policy, on_chunk=reports.append)
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        logits = stop.value
    finally:
        policy.detach()
    return cache, reports, logits


@pytest.fixture(scope="module")
def model():
    return tiny_llama(300, layers=3, q_heads=4, kv_heads=2, head_dim=16)


def _ids(n, seed=0):
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def _locret(model, **kw):
    return make_policy("locret", heads=RetainingHeads.random(model, d_r=32), **kw)


@pytest.mark.parametrize("n", [50, 333, 1000, 2047])
def test_cache_stays_within_budget_plus_chunk(model, n):
    policy = _locret(model, budget=128, stabilizers=32, local=20)
    cache, reports, _ = _run(model, _ids(n), policy, chunk=64, positions="compact")
    head = [r for r in reports if r.end <= n - 20]
    assert all(r.kept <= 128 for r in head)  # after each evicting chunk: at most b
    assert max(r.end - r.start for r in reports) <= 64  # so never more than b + B inside a chunk
    assert cache.get_seq_length() == min(n - 20, 128) + 20  # b + n_loc after prefill
    assert cache.layers[0].keys.shape[:2] == (1, 2)  # per KV head, never per query head


def test_the_tail_and_the_stabilizers_are_never_evicted(model):
    n, b, ns, loc = 900, 100, 40, 30
    policy = _locret(model, budget=b, stabilizers=ns, local=loc)
    inv = rope_inv_freq(model)
    cache = KVCache(3, positions="compact", inv_freq=inv)
    policy.attach(model, cache)
    ids = _ids(n)
    steps = plan_steps(n, 64, loc)
    try:
        for start, end, evict_after, last in steps:
            forward(model, cache, ids[:, start:end], start)
            policy.observe(cache, end - start, ids[:, start:end])
            if evict_after:
                evict(cache, policy, last)
                if not last:  # the ns newest units of the concatenated cache all survived, in every head
                    for head in cache.layers[1].positions.tolist():
                        assert set(range(end - ns, end)) <= set(head)
    finally:
        policy.detach()
    tail = cache.layers[2].positions[:, -loc:]
    assert torch.equal(tail, torch.arange(n - loc, n).expand(2, -1))


def test_eviction_equals_a_reference_top_k_per_head(model):
    cache = KVCache(1)
    layer = cache.layers[0]
    k = torch.randn(1, 2, 10, 16)
    layer.update(k, k + 1)
    layer.scores[:] = torch.tensor([[5, 1, 9, 3, 7, 0, 2, 8, 6, 4], [0, 9, 1, 8, 2, 7, 3, 6, 4, 5]], dtype=torch.float32)
    policy = make_policy("random", budget=4)
    evict(cache, policy, last_chunk=True)
    want = [[2, 4, 7, 8], [1, 3, 5, 7]]  # top-4 per head, in temporal order
    assert layer.positions.tolist() == want
    for h in range(2):
        assert torch.equal(layer.keys[0, h], k[0, h, want[h]]) and torch.equal(layer.values[0, h], k[0, h, want[h]] + 1)
    assert layer.scores.tolist() == [[9, 7, 8, 6], [9, 8, 7, 6]]  # the real scores, never the protection


def test_protection_is_on_a_copy(model):
    policy = _locret(model, budget=4, stabilizers=2)
    cache = KVCache(1)
    layer = cache.layers[0]
    layer.update(torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16))
    layer.scores[:] = torch.arange(12, dtype=torch.float32).view(2, 6)
    prio = policy.priority(layer, 0, last_chunk=False)
    assert (prio[:, -2:] == PROTECT).all() and layer.scores.max() == 11
    assert torch.equal(policy.priority(layer, 0, last_chunk=True), layer.scores)


def test_compact_shift_equals_rotating_at_the_new_position(model):
    inv = rope_inv_freq(model)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    raw = torch.randn(1, 2, 5, 16)
    old = torch.tensor([[3, 10, 17, 40, 41], [0, 7, 20, 33, 50]])
    new = torch.arange(5).expand(2, -1)

    def rotate(x, pos):
        cos, sin = model.model.rotary_emb(x, pos.reshape(1, -1))
        cos, sin = cos.view(1, 2, 5, 16), sin.view(1, 2, 5, 16)
        return x * cos + torch.cat([-x[..., 8:], x[..., :8]], -1) * sin

    assert apply_rotary_pos_emb  # the same rotate-half layout transformers uses for Llama
    shifted = shift_keys(rotate(raw, old), new - old, inv)
    assert torch.allclose(shifted, rotate(raw, new), atol=1e-5)


def test_compact_with_a_budget_above_the_prompt_equals_original(model):
    ids = _ids(300)
    out = {}
    for positions in ("compact", "original"):
        policy = _locret(model, budget=1000, stabilizers=10, local=16)
        _, _, out[positions] = _run(model, ids, policy, chunk=64, positions=positions)
    with torch.inference_mode():
        full = model(input_ids=ids).logits[0, -1]
    assert torch.allclose(out["compact"], out["original"], atol=1e-5)
    assert torch.allclose(out["compact"], full, atol=1e-4)


def test_compact_positions_stay_bounded_past_the_window(tiny_tok):
    model = tiny_llama(len(tiny_tok), window=512)
    engine = Engine(model, tiny_tok, chunk=64)
    engine.set_policy(make_policy("streaming", budget=128, local=16), "compact")
    done = list(engine.chat([{"role": "user", "content": "lorem ipsum " * 300}], GenerationSettings(max_new_tokens=8)))[-1]
    assert isinstance(done, Done) and done.prompt_tokens > 3000
    assert done.kv_tokens <= 128 + 16 + 8
    engine.set_policy(make_policy("streaming", budget=128, local=16), "original")
    events = list(engine.chat([{"role": "user", "content": "lorem ipsum " * 300}], GenerationSettings(max_new_tokens=8)))
    assert isinstance(events[-1], Done) and events[-1].kv_tokens <= 128 + 16 + 8  # a new conversation past the window
    assert any(isinstance(e, Notice) and "read at compact positions" in e.message for e in events)
    # A conversation at original positions that grows past the window goes on at compact ones; below the budget
    # nothing was evicted, so it answers as the conversation read at compact positions from the start.
    answers, said = {}, {}
    for positions in ("original", "compact"):
        engine.set_policy(make_policy("streaming", budget=128, local=16), positions)
        cache = engine.new_cache()
        for first, text in ((0, "lorem ipsum " * 30), (200, "dolor sit amet " * 150), (1200, "lorem ipsum " * 20)):
            events = list(engine.continue_on(cache, engine.encode(text), first, GenerationSettings(max_new_tokens=4)))
            assert isinstance(events[-1], Done) and events[-1].kv_tokens <= 128 + 16 + 8
            said.setdefault(positions, []).append([e.message for e in events if isinstance(e, Notice)])
            answers.setdefault(positions, []).append([e.token_id for e in events if isinstance(e, Token)])
        assert cache.positions == "compact"
    assert said["compact"] == [[], [], []]
    assert [len(m) for m in said["original"]] == [0, 1, 0] and "from here on" in said["original"][1][0]
    assert answers["original"] == answers["compact"]
    engine.set_policy(make_policy("full"))
    refused = list(engine.chat([{"role": "user", "content": "lorem ipsum " * 300}]))[-1].message
    assert "an evicting policy at compact positions" in refused


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("positions", ["compact", "original"])
def test_every_policy_runs_on_a_3k_prompt(tiny_tok, name, positions):
    model = tiny_llama(len(tiny_tok))
    engine = Engine(model, tiny_tok, chunk=256)
    extra = {"locret": {"heads": RetainingHeads.random(model, d_r=32)},
             "kvzap": {"heads": KVzapScorer.random(model, hidden_dim=8)}}.get(name, {})
    policy = make_policy(name, budget=256, local=32, **extra)
    engine.set_policy(policy, positions)
    text = "The quick brown fox jumps over the lazy dog. " * 70
    events = list(engine.chat([{"role": "user", "content": text}], GenerationSettings(max_new_tokens=6)))
    done = events[-1]
    assert isinstance(done, Done), done
    assert done.prompt_tokens > 3000
    if policy.evicts:
        assert done.kv_tokens <= 256 + 32 + done.new_tokens
    else:
        assert done.kv_tokens == done.prompt_tokens + done.new_tokens - 1


def test_decode_window_keeps_long_answers_bounded(tiny_tok):
    model = tiny_llama(len(tiny_tok), window=4096)
    engine = Engine(model, tiny_tok, chunk=64)
    policy = make_policy("streaming", budget=96, local=16, decode_window=32)
    engine.set_policy(policy, "compact")
    sizes = []
    real = policy.observe

    def spy(cache, n_new, ids):
        real(cache, n_new, ids)
        sizes.append(cache.get_seq_length())

    policy.observe = spy
    done = list(engine.chat([{"role": "user", "content": "abc " * 100}], GenerationSettings(max_new_tokens=300, ignore_eos=True)))[-1]
    assert done.new_tokens == 300
    assert max(sizes) <= 96 + 2 * 32 and done.kv_tokens <= 96 + 2 * 32
    off = make_policy("streaming", budget=96, local=16)
    engine.set_policy(off, "compact")
    done = list(engine.chat([{"role": "user", "content": "abc " * 100}], GenerationSettings(max_new_tokens=300, ignore_eos=True)))[-1]
    assert done.kv_tokens == 96 + 16 + 299  # without the option the cache grows by one unit per token
