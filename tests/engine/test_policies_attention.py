"""H2O, SnapKV and SirLLM on a tiny random Llama: the stats attention function, scores, eviction bounds."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from tiny import tiny_llama

from localchat.engine.cache import KVCache
from localchat.engine.engine import Engine
from localchat.engine.events import Done
from localchat.engine.policies import make_policy
from localchat.engine.policies.attention_stats import Collector, StatsHook
from localchat.engine.policies.h2o import H2O
from localchat.engine.policies.sirllm import SirLLM
from localchat.engine.policies.snapkv import SnapKV
from localchat.engine.prefill import cache_kwarg, prefill
from localchat.engine.sampling import GenerationSettings

VOCAB, N, FIRST = 300, 40, 24  # a short two-chunk prompt: chunk 1 = 24 tokens, chunk 2 = 16


def _drain(gen):
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def _ids(n=N, seed=1):
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB, layers=2, q_heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def eager_attn(model):
    """Brute force: the eager softmax(QK^T·scale + causal mask) of the whole prompt, per layer `[H_q, N, N]`."""
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model(input_ids=_ids(), output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    return [a[0].float() for a in out.attentions]


def _run(model, policy, ids=None, chunk=FIRST):
    """Prefill `ids` with `policy` attached (no eviction when its budget is large); return (cache, logits)."""
    ids = _ids() if ids is None else ids
    cache = KVCache(model.config.num_hidden_layers)
    with torch.inference_mode():
        if policy is not None:
            policy.attach(model, cache)
        try:
            logits = _drain(prefill(model, cache, ids, chunk=chunk, policy=policy))
        finally:
            if policy is not None:
                policy.detach()
    return cache, logits


def test_stats_attention_keeps_the_model_output(model):
    _, ref = _run(model, None, chunk=16)
    _, got = _run(model, H2O(budget=10_000, local=0), chunk=16)  # collector active on every layer
    assert torch.allclose(got, ref, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"


def test_window_probabilities_match_brute_force(model, eager_attn):
    """GQA (4 query heads, 2 KV heads), second chunk with 24 cached units: the last 8 query rows."""
    seen = {}
    cache = KVCache(2)
    ids = _ids()
    with torch.inference_mode():
        model(input_ids=ids[:, :FIRST], use_cache=True, **{cache_kwarg(model): cache})
        hook = StatsHook(model, Collector(8, lambda i, p: seen.__setitem__(i, p)))
        try:
            model(input_ids=ids[:, FIRST:], use_cache=True, **{cache_kwarg(model): cache})
        finally:
            hook.close()
    assert model.config._attn_implementation == "sdpa"
    for i, ref in enumerate(eager_attn):
        assert seen[i].shape == (4, 8, N) and seen[i].dtype == torch.float32
        assert torch.allclose(seen[i], ref[:, -8:], atol=1e-6)


def test_h2o_accumulates_attention_over_chunks(model, eager_attn):
    cache, _ = _run(model, H2O(budget=10_000, local=0))
    for layer, attn in zip(cache.layers, eager_attn):
        # chunk 1's queries reach only chunk 1's keys, so the two chunks' sums = the column sums of the full map
        hand = attn.reshape(2, 2, N, N).sum(dim=(1, 2))
        assert torch.allclose(layer.scores, hand, atol=1e-5)


def test_snapkv_scores_are_pooled_window_attention(model, eager_attn):
    cache, _ = _run(model, SnapKV(budget=10_000, local=0, window=8))
    for layer, attn in zip(cache.layers, eager_attn):
        votes = attn[:, -8:].reshape(2, 2, 8, N).sum(dim=(1, 2))  # [H_kv, N]
        padded = F.pad(votes, (2, 2))
        hand = torch.stack([padded[:, j : j + 5].sum(-1) / 5 for j in range(N)], dim=-1)
        assert torch.allclose(layer.scores, hand, atol=1e-5)


def test_sirllm_entropies_match_full_logits(model):
    ids = _ids()
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    hand = torch.cat([torch.zeros(1), -logp[:-1].gather(1, ids[0, 1:, None])[:, 0]])
    cache, _ = _run(model, SirLLM(budget=10_000, local=0, slice_rows=5), chunk=7)
    for layer in cache.layers:
        assert torch.allclose(layer.scores, hand.expand(2, -1), atol=1e-4)


def test_defaults_and_registry():
    assert H2O(budget=256).recent_size == 128 and SirLLM(budget=256).recent_size == 32
    assert SnapKV().window == 32 and SnapKV().kernel == 5 and SirLLM().start == 4
    assert isinstance(make_policy("h2o", budget=64, stabilizers=3), H2O)
    assert isinstance(make_policy("snapkv"), SnapKV) and isinstance(make_policy("sirllm"), SirLLM)


def test_priorities_protect_recent_window_and_start():
    from localchat.engine.cache import KVLayer
    from localchat.engine.policies.base import PROTECT

    layer = KVLayer()
    x = torch.zeros(1, 2, 20, 4)
    layer.update(x, x)
    layer.scores.copy_(torch.rand(2, 20))

    def protected(policy):
        return (policy.priority(layer, 0, False) == PROTECT).all(0).nonzero()[:, 0].tolist()

    assert protected(H2O(budget=10)) == list(range(15, 20))  # recent = budget // 2
    assert protected(SnapKV(window=3)) == [17, 18, 19]
    assert protected(SirLLM(budget=16, start=2)) == [0, 1, 18, 19]  # start + recent = budget // 8
    assert not (layer.scores == PROTECT).any()  # protection goes on a copy


BUDGET, CHUNK = 256, 256
POLICIES = [H2O, SnapKV, SirLLM]


def _prose(n_chars=3000, seed=0):
    rng = random.Random(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "while", "rain", "fell", "over", "old", "town", "42"]
    text = ""
    while len(text) < n_chars:
        text += rng.choice(words) + rng.choice([" ", " ", ", ", ". "])
    return text


@pytest.mark.parametrize("cls", POLICIES)
@pytest.mark.parametrize("positions", ["compact", "original"])
def test_engine_chat_with_each_policy(tiny_tok, cls, positions):
    """~3000-token prompt, budget 256, chunk 256: the cache never holds more than budget + chunk per head."""
    model = tiny_llama(len(tiny_tok))
    engine = Engine(model, tiny_tok, name="tiny", chunk=CHUNK)
    policy = cls(budget=BUDGET)
    engine.set_policy(policy, positions)
    lengths: list[int] = []  # cache length at each observe: after a forward, before its eviction
    observe = policy.observe

    def watch(cache, n_new, ids):
        lengths.append(cache.get_seq_length())
        observe(cache, n_new, ids)
        assert all(torch.isfinite(layer.scores).all() for layer in cache.layers)

    policy.observe = watch
    settings = GenerationSettings(max_new_tokens=6)
    events = list(engine.chat([{"role": "user", "content": _prose()}], settings))
    done = events[-1]
    assert isinstance(done, Done), done
    assert done.prompt_tokens > 2900 and done.new_tokens > 0
    assert max(lengths) <= BUDGET + CHUNK and lengths.count(BUDGET + CHUNK) >= 10  # evicted after each chunk
    assert done.kv_tokens <= BUDGET + policy.local + done.new_tokens
    assert model.config._attn_implementation == "sdpa"  # restored after generation
    assert not any(hasattr(layer.self_attn, "_localchat_collector") for layer in model.model.layers)
