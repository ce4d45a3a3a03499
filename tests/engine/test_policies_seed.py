"""SAGE-KV, OmniKV, RoCo and CORM: each selection rule against a hand-computed reference on small tensors,
and on the tiny random Llama against references built from eager attention / the model's own q and k."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_llama
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from localchat.engine.cache import KVCache
from localchat.engine.events import Done, Error, Notice, Token
from localchat.engine.heads import attention_modules
from localchat.engine.policies import POLICIES, make_policy
from localchat.engine.policies.base import PROTECT, follow
from localchat.engine.policies.corm import important, wanted
from localchat.engine.policies.omnikv import filter_layers, layer_roles, select_tokens, uniform_select
from localchat.engine.policies.omnikv import policy as omnikv
from localchat.engine.policies.roco import Stats, group_mean, roco_priority, seen_counts
from localchat.engine.policies.sagekv import select_middle, split
from localchat.engine.prefill import cache_kwarg, evict_while_decoding, forward, prefill
from localchat.engine.sampling import GenerationSettings
from localchat.session import Session

SEED_POLICIES = ("sagekv", "omnikv", "roco", "corm")


def _ids(n, seed=0):
    return torch.randint(0, 250, (1, n), generator=torch.Generator().manual_seed(seed))


def _model(tok_len=260, layers=2, **kw):
    return tiny_llama(tok_len, layers=layers, q_heads=4, kv_heads=2, **kw)


def _eager_probs(model, ids):
    """Softmax attention `[H_q, n, n]` per layer of a full (unchunked) forward, from transformers' eager path."""
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=ids, output_attentions=True)
    finally:
        model.set_attn_implementation("sdpa")
    return [a[0].float() for a in out.attentions]


def _prefill(model, policy, ids, chunk):
    cache = KVCache(model.config.num_hidden_layers)
    policy.attach(model, cache)
    reports, events = [], []
    gen = prefill(model, cache, ids, chunk=chunk, policy=policy, on_chunk=reports.append)
    try:
        while True:
            events.append(next(gen))
    except StopIteration as stop:
        logits = stop.value
    return cache, reports, events, logits


# --- the generic hooks -------------------------------------------------------------------------------


def test_policies_lists_the_four_seed_methods_next_to_the_others():
    assert {"locret", "full", "streaming", "h2o", "snapkv", "sirllm", "random", *SEED_POLICIES} <= set(POLICIES)
    for name in SEED_POLICIES:
        doc = POLICIES[name].__doc__
        assert "Defaults" in doc and "[" in doc  # shapes and defaults are documented


def test_follow_finds_each_held_unit_by_position():
    then = torch.tensor([[0, 2, 5, 7], [1, 3, 4, 9]])
    now = torch.tensor([[2, 7, 8], [1, 4, 9]])
    idx, found = follow(then, now)
    assert found.tolist() == [[True, True, False], [True, True, True]]
    assert idx[found].tolist() == [1, 3, 0, 2, 3]


def test_existing_policies_keep_the_old_hook_defaults():
    for name in ("locret", "full", "streaming", "h2o", "snapkv", "sirllm", "random"):
        cls = POLICIES[name]
        assert cls.evict_per_chunk and not cls.evict_each_step and not cls.selects
        assert cls.default_positions == "compact"


# --- SAGE-KV -----------------------------------------------------------------------------------------


def test_sagekv_budget_split():
    assert split(16, 2) == (4, 4, 3)  # S = B/4, k = B/(2G), R = B - S - G·k - 1
    assert split(8192, 4) == (2048, 1024, 2047)  # the paper's Llama row (R 2048 incl. the last token)
    assert split(8192, 7) == (2048, 585, 8192 - 2048 - 7 * 585 - 1)


def test_sagekv_middle_selection_by_hand():
    logits = torch.tensor([
        [5.0, 1, 0, 2, 0, 4],  # head 0 (KV 0): top-2 {0, 5}
        [0.0, 6, 0, 0, 1, 5],  # head 1 (KV 0): top-2 {1, 5}  -> union {0, 1, 5}; fill 1 by group max: slot 3 (2 > 1)
        [1.0, 2, 3, 4, 5, 6],  # head 2 (KV 1): {4, 5}
        [6.0, 5, 4, 3, 2, 1],  # head 3 (KV 1): {0, 1}  -> union {0, 1, 4, 5}, full
    ])
    assert select_middle(logits, kv_heads=2, k=2).tolist() == [[0, 1, 3, 5], [0, 1, 4, 5]]
    assert select_middle(logits[:, :3], kv_heads=2, k=2).tolist() == [[0, 1, 2], [0, 1, 2]]  # E < G·k: all


def _last_queries(model, ids):
    """Post-RoPE query of the last token `[H_q, d]` and the keys `[H_kv, n, d]` per layer (a plain forward)."""
    grabbed = {}
    mods = attention_modules(model)
    hooks = [m.q_proj.register_forward_hook(lambda mod, a, out, i=i: grabbed.__setitem__(i, out[0, -1]))
             for i, m in enumerate(mods)]
    try:
        out = model(input_ids=ids, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    n, d = ids.shape[1], model.config.head_dim
    q_heads = model.config.num_attention_heads
    cos, sin = model.model.rotary_emb(torch.zeros(1, 1, d), torch.tensor([[n - 1]]))
    result = []
    for i, m in enumerate(mods):
        q = grabbed[i].view(1, q_heads, 1, d)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        result.append((q[0, :, 0], getattr(out, cache_kwarg(model)).layers[i].keys[0], m.scaling))
    return result


def test_sagekv_keeps_sinks_each_heads_top_k_recent_and_last_token():
    model = _model()
    ids = _ids(40)
    policy = make_policy("sagekv", budget=16)
    cache, reports, _, _ = _prefill(model, policy, ids, chunk=16)
    assert [r.evicted for r in reports] == [False, False, False] and reports[-1].kept == 40  # full prefill
    assert cache.get_seq_length() == 16
    for i, (q, keys, scale) in enumerate(_last_queries(model, ids)):
        logits = torch.einsum("hd,hnd->hn", q.float(), keys.float().repeat_interleave(2, dim=0)) * scale
        middle = logits[:, 4:36]  # S = 4, R = 3, last = slot 39
        for kv in range(2):
            union = set(middle[2 * kv].topk(4).indices.tolist()) | set(middle[2 * kv + 1].topk(4).indices.tolist())
            rest = [j for j in middle[2 * kv : 2 * kv + 2].amax(0).argsort(descending=True).tolist() if j not in union]
            chosen = union | set(rest[: 8 - len(union)])
            expected = {0, 1, 2, 3} | {c + 4 for c in chosen} | {36, 37, 38, 39}
            assert set(cache.layers[i].positions[kv].tolist()) == expected
    # decoding: the sinks, selection and last prompt token stay; the recent window slides by one
    fixed = [set(layer.positions[h][layer.scores[h] >= PROTECT].tolist()) for layer in cache.layers for h in range(2)]
    forward(model, cache, _ids(1, seed=9), 40)
    policy.observe(cache, 1, None)
    assert evict_while_decoding(cache, policy) and cache.get_seq_length() == 16
    for f, (layer, h) in zip(fixed, [(layer, h) for layer in cache.layers for h in range(2)]):
        held = set(layer.positions[h].tolist())
        assert f <= held and 36 not in held and {37, 38, 40} <= held
    policy.detach()


# --- OmniKV ------------------------------------------------------------------------------------------


def test_omnikv_layer_schedule_rule():
    assert filter_layers(32) == (2, 8, 18)  # the paper's Llama-3-8B schedule
    assert filter_layers(30) == (2, 8, 17)  # SmolLM2-135M
    assert filter_layers(16) == (1, 4, 9)
    assert layer_roles(6, (1, 3)) == ["dense", "filter", "dense", "filter", "dense", "sparse"]
    assert layer_roles(8, (2,)) == ["dense", "dense", "filter", "dense", "sparse", "sparse", "sparse", "sparse"]


def test_omnikv_selection_softmax_then_max_over_all_heads_by_hand():
    # head 0 sees keys along dim 0, head 1 along dim 1 (scaling 1): logits a = [10, 9.9, 9.8, 0], b = [0, 0, 0, 3]
    query = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 2, 1, 2)
    key = torch.tensor([[10.0, 0], [9.9, 0], [9.8, 0], [0, 3], [100, 100]]).view(1, 1, 5, 2)
    # softmax per head: head 0 ~ [.367, .332, .301, 0], head 1 ~ [.043, .043, .043, .870] -> max: 3 then 0
    assert select_tokens(query, key, prompt=4, k=1, scaling=1.0).tolist() == [3]
    assert select_tokens(query, key, prompt=4, k=2, scaling=1.0).tolist() == [0, 3]
    # the code's variant (max of raw logits, [10, 9.9, 9.8, 3]) ranks differently; slot 4 is past the prompt
    assert select_tokens(query, key, prompt=4, k=2, scaling=1.0, softmax=False).tolist() == [0, 1]
    assert select_tokens(query, key, prompt=4, k=9, scaling=1.0).tolist() == [0, 1, 2, 3]


def _decode_query(model, layer_idx):
    grabbed = {}
    mod = attention_modules(model)[layer_idx]
    return grabbed, mod.q_proj.register_forward_hook(lambda m, a, out: grabbed.__setitem__("q", out[0, -1]))


def test_omnikv_sparse_layer_attends_to_the_filter_layers_selection_plus_the_answer():
    model = _model(layers=4)
    ids = _ids(48)
    policy = make_policy("omnikv", budget=8, filters=(1,))  # roles: dense, filter, dense, sparse
    cache, reports, _, _ = _prefill(model, policy, ids, chunk=16)
    assert cache.get_seq_length() == 48 and not any(r.evicted for r in reports)
    reference = cache.clone()
    grabbed, hook = _decode_query(model, 1)
    step = _ids(1, seed=3)
    logits = forward(model, cache, step, 48)
    hook.remove()
    index = policy.selection.index
    policy.detach()
    # the filter layer's choice = softmax over the 48 prompt keys per query head, max over all heads, top-8
    d = model.config.head_dim
    cos, sin = model.model.rotary_emb(torch.zeros(1, 1, d), torch.tensor([[48]]))
    q, _ = apply_rotary_pos_emb(grabbed["q"].view(1, 4, 1, d), grabbed["q"].view(1, 4, 1, d), cos, sin)
    keys = cache.layers[1].keys[0, :, :48].float().repeat_interleave(2, dim=0)
    probs = (torch.einsum("hd,hnd->hn", q[0, :, 0].float(), keys) * d**-0.5).softmax(-1)
    assert index.tolist() == probs.amax(0).topk(8).indices.sort().values.tolist()
    # the same step on a plain cache whose layer 3 holds only the selected units equals OmniKV's logits
    reference.keep(3, index.expand(2, -1))
    expected = forward(model, reference, step, 48)
    assert torch.allclose(logits, expected, atol=1e-5)
    assert not torch.allclose(logits, forward(model, _full_cache(model, ids), step, 48), atol=1e-4)


def _full_cache(model, ids):
    cache = KVCache(model.config.num_hidden_layers)
    forward(model, cache, ids, 0)
    return cache


def test_omnikv_with_a_budget_over_the_prompt_equals_full_attention():
    model = _model(layers=4)
    ids = _ids(30)
    policy = make_policy("omnikv", budget=64, filters=(1,))
    cache, _, _, _ = _prefill(model, policy, ids, chunk=16)
    got = [forward(model, cache, _ids(1, seed=s), 30 + s) for s in range(3)]
    policy.detach()
    full = _full_cache(model, ids)
    want = [forward(model, full, _ids(1, seed=s), 30 + s) for s in range(3)]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))


def _uniform_reference(q, k, earlier, keep, scaling):
    """docs/methods/omnikv.md §2.8 by loops: each chunk row's causal softmax over the keys it sees, max over heads,
    summed."""
    h_q, t, _ = q.shape
    g = h_q // k.shape[0]
    score = torch.zeros(earlier)
    for j in range(t):
        best = torch.full((earlier,), -1.0)
        for h in range(h_q):
            probs = (k[h // g, : earlier + j + 1] @ q[h, j] * scaling).softmax(-1)
            best = torch.maximum(best, probs[:earlier])
        score += best
    return score.topk(keep).indices.sort().values


def test_omnikv_reading_selection_sums_each_rows_max_head_probability_by_hand(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 6, 8, generator=gen), torch.randn(1, 2, 20, 8, generator=gen)
    want = _uniform_reference(q[0], k[0], 14, 5, 0.35)
    assert uniform_select(q, k, 14, 5, 0.35).tolist() == want.tolist()
    monkeypatch.setattr(omnikv, "BLOCK_BYTES", 4 * 4 * 20 * 2)  # two query rows per block: the same choice
    assert uniform_select(q, k, 14, 5, 0.35).tolist() == want.tolist()
    assert uniform_select(q, k, 3, 5, 0.35).tolist() == [0, 1, 2]


def test_omnikv_sparse_layer_reads_a_chunk_over_the_chosen_tokens_and_the_chunk():
    model = _model(layers=4)
    module = attention_modules(model)[3]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, n, 16, generator=gen) for h, n in ((4, 5), (2, 17), (2, 17)))
    sel = omnikv.Selection(["dense", "filter", "dense", "sparse"], 8, True, reading_keep=4,
                           reading_index=torch.tensor([0, 3, 7, 9]))
    idx = torch.tensor([0, 3, 7, 9, 12, 13, 14, 15, 16])
    visible = torch.ones(5, 9, dtype=torch.bool)
    visible[:, 4:] = torch.ones(5, 5, dtype=torch.bool).tril()
    logits = torch.einsum("hqd,hnd->hqn", q[0], k[0, :, idx].repeat_interleave(2, 0)) * 0.25
    want = logits.masked_fill(~visible, float("-inf")).softmax(-1) @ v[0, :, idx].repeat_interleave(2, 0)
    causal = torch.ones(5, 17, dtype=torch.bool).tril(12)[None, None]  # what SDPA's mask says for the chunk
    for mask in (None, causal):
        out, _ = omnikv._sparse_reading(module, sel, q, k, v, mask, 0.25, 0.0)
        assert torch.allclose(out[0].transpose(0, 1), want, atol=1e-5)


def test_omnikv_sparse_prefill_keeps_every_token_and_filters_by_the_chunk(monkeypatch):
    model = _model(layers=4)
    ids = _ids(48)
    policy = make_policy("omnikv", budget=8, filters=(1,), prefill_ratio=0.5)  # keep 8 of the earlier tokens
    grabbed, hook = {}, attention_modules(model)[1].q_proj.register_forward_hook(
        lambda m, a, out: grabbed.__setitem__("q", out[0]))
    chosen, real = [], omnikv.uniform_select
    monkeypatch.setattr(omnikv, "uniform_select", lambda *a, **kw: chosen.append(real(*a, **kw)) or chosen[-1])
    cache, reports, _, logits = _prefill(model, policy, ids, chunk=16)
    hook.remove()
    policy.detach()
    assert cache.get_seq_length() == 48 and not any(r.evicted for r in reports)
    assert len(chosen) == 2 and policy.selection.reading_index is None  # chunks 2 and 3; cleared at the end
    # the filter layer's choice for the last chunk, by hand from its 16 queries and the 48 cached keys
    d = model.config.head_dim
    cos, sin = model.model.rotary_emb(torch.zeros(1, 1, d), torch.arange(32, 48)[None])
    q = grabbed["q"].view(1, 16, 4, d).transpose(1, 2)
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    want = _uniform_reference(q[0].float(), cache.layers[1].keys[0].float(), 32, 8, d**-0.5)
    assert chosen[-1].tolist() == want.tolist()
    # a reading budget over the prompt is full attention; one under it changes the answer's logits
    wide = make_policy("omnikv", budget=8, filters=(1,), prefill_ratio=10)
    _, _, _, wide_logits = _prefill(model, wide, ids, chunk=16)
    wide.detach()
    _, _, _, plain = _prefill(model, make_policy("full"), ids, chunk=16)
    assert torch.allclose(wide_logits, plain, atol=1e-5) and not torch.allclose(logits, plain, atol=1e-4)


# --- RoCo --------------------------------------------------------------------------------------------


def test_roco_counts_means_and_scope_by_hand():
    assert seen_counts(5, 3).tolist() == [3, 3, 3, 2, 1]
    probs = torch.tensor([[[0.2, 0.8]], [[0.4, 0.6]], [[1.0, 0.0]], [[0.0, 1.0]]])  # [H_q 4, T 1, n 2]
    assert torch.allclose(group_mean(probs, 2), torch.tensor([[[0.3, 0.7]], [[0.5, 0.5]]]))
    # one KV head, 6 units: MAS = acc / count, Std = sqrt(acc2 / count - MAS²)
    acc = torch.tensor([[0.9, 0.2, 0.6, 0.1, 0.5, 0.3]])
    count = torch.tensor([[3.0, 2, 3, 1, 2, 1]])
    acc2 = torch.tensor([[0.27, 0.02, 0.30, 0.01, 0.25, 0.09]])
    # MAS = [.3, .1, .2, .1, .25, .3]; Std² = [0, 0, .06, 0, .0625, 0] -> the top-1 Std unit is slot 4
    s = Stats(acc, acc2, count, torch.arange(6)[None])
    prio = roco_priority(s, torch.arange(6)[None], scope_out=1, sinks=1, last=1)
    assert prio[0, [0, 4, 5]].tolist() == [PROTECT] * 3  # sink (position 0), top-Std, last slot
    assert torch.allclose(prio[0, [1, 2, 3]], torch.tensor([0.1, 0.2, 0.1]))


def test_roco_accumulates_mean_attention_across_chunks_like_full_attention():
    model = _model()
    ids = _ids(24)
    policy = make_policy("roco", budget=100, local=0)
    cache, reports, _, _ = _prefill(model, policy, ids, chunk=8)
    assert not any(r.evicted for r in reports)
    for i, probs in enumerate(_eager_probs(model, ids)):
        p = probs.reshape(2, 2, 24, 24).mean(1)  # group mean [H_kv, n, n]
        acc, acc2 = p.sum(1), (p * p).sum(1)
        count = torch.arange(24, 0, -1).float()
        assert torch.allclose(cache.layers[i].scores, acc / count, atol=1e-5)
        st = policy.stats[i]
        assert torch.allclose(st.acc2, acc2, atol=1e-5) and torch.equal(st.count[0], count)
    policy.detach()


def test_roco_evicts_the_lowest_mean_outside_the_std_scope():
    model = _model()
    ids = _ids(16)
    policy = make_policy("roco", budget=10, local=0, scope_out=3, sinks=1, last=2)
    cache, _, _, _ = _prefill(model, policy, ids, chunk=16)
    for i, probs in enumerate(_eager_probs(model, ids)):
        p = probs.reshape(2, 2, 16, 16).mean(1)
        count = torch.arange(16, 0, -1).float()
        mas = p.sum(1) / count
        std = ((p * p).sum(1) / count - mas**2).clamp(min=0).sqrt()
        for h in range(2):
            protected = set(std[h].topk(3).indices.tolist()) | {0, 14, 15}
            rest = [j for j in mas[h].argsort(descending=True).tolist() if j not in protected]
            expected = protected | set(rest[: 10 - len(protected)])
            assert set(cache.layers[i].positions[h].tolist()) == expected
    policy.detach()


# --- CORM --------------------------------------------------------------------------------------------


def test_corm_threshold_or_over_group_and_recent_by_hand():
    probs = torch.tensor([
        [[0.5, 0.5, 0.0], [0.1, 0.3, 0.6]],  # q head 0: rows at positions 1 (t=2: >= .5), 2 (t=3: >= 1/3)
        [[0.4, 0.6, 0.0], [0.2, 0.2, 0.6]],  # q head 1 (same KV head)
        [[1.0, 0.0, 0.0], [0.3, 0.3, 0.4]],  # q head 2 (KV 1)
        [[0.0, 1.0, 0.0], [0.2, 0.5, 0.3]],  # q head 3 (KV 1)
    ])
    hit = important(probs, torch.tensor([1, 2]), kv_heads=2)
    assert hit.tolist() == [
        [[True, True, False], [False, False, True]],
        [[True, True, False], [False, True, True]],
    ]
    assert wanted(hit, recent=0).tolist() == [[True, True, True], [True, True, True]]
    lone = torch.tensor([[[False, False, False, True]], [[True, False, False, False]]])
    assert wanted(lone, recent=1).tolist() == [[False, False, False, True], [True, False, False, True]]


def _corm_reference(model, ids, window, recent):
    """Per layer and KV head, the positions CORM wants after one prompt of n tokens."""
    n = ids.shape[1]
    t = torch.arange(n - window, n).float() + 1
    sets = []
    for probs in _eager_probs(model, ids):
        hit = (probs[:, -window:] >= (1 / t)[None, :, None]).reshape(2, 2, window, n).any(1).any(1)
        hit[:, n - recent :] = True
        sets.append([set(torch.nonzero(hit[h]).flatten().tolist()) for h in range(2)])
    return sets


def _peaked(model, factor=8.0):
    """Sharper attention than a random init gives (so that most keys are minor)."""
    for m in attention_modules(model):
        m.q_proj.weight.mul_(factor)
        m.k_proj.weight.mul_(factor)
    return model


def test_corm_keeps_what_the_last_w_queries_found_important():
    model = _peaked(_model(), 16.0)
    ids = _ids(48)
    policy = make_policy("corm", budget=64, local=0, window=4, recent=4)
    cache, _, events, _ = _prefill(model, policy, ids, chunk=48)
    sets = _corm_reference(model, ids, 4, 4)
    size = max(len(s) for layer in sets for s in layer)
    assert size < 32 and cache.get_seq_length() == size  # content-sized, below the budget
    for i, layer_sets in enumerate(sets):
        for h, want in enumerate(layer_sets):
            assert want <= set(cache.layers[i].positions[h].tolist())
    assert not any(isinstance(e, Notice) for e in events)
    policy.detach()


def test_corm_reads_the_whole_prompt_before_its_rule_runs():
    """Spec §2.5: the last w prompt queries vote once the prompt is in; a chunked read keeps what they want
    (evicting chunk by chunk dropped keys minor to the earlier chunks' queries before the last ones came)."""
    assert not POLICIES["corm"].bounded()  # reading peaks at the whole prompt, as SAGE-KV's does
    model = _peaked(_model(), 16.0)
    ids = _ids(48)
    policy = make_policy("corm", budget=64, local=0, window=4, recent=4)
    cache, _, _, _ = _prefill(model, policy, ids, chunk=8)
    sets = _corm_reference(model, ids, 4, 4)
    assert cache.get_seq_length() == max(len(s) for layer in sets for s in layer)
    for i, layer_sets in enumerate(sets):
        for h, want in enumerate(layer_sets):
            assert want <= set(cache.layers[i].positions[h].tolist())
    policy.detach()


def test_corm_cap_binds_at_the_budget_and_says_so():
    model = _model()
    ids = _ids(32)
    policy = make_policy("corm", budget=6, local=0, window=8, recent=2)
    cache, _, events, _ = _prefill(model, policy, ids, chunk=32)
    assert cache.get_seq_length() == 6
    notes = [e.message for e in events if isinstance(e, Notice)]
    assert len(notes) == 1 and "capped at the budget of 6" in notes[0]
    for layer in cache.layers:
        assert layer.positions[:, -2:].tolist() == [[30, 31], [30, 31]]  # the recent keys stay
    policy.detach()


# --- through the engine and a two-turn session ---------------------------------------------------------


@pytest.mark.parametrize("name", SEED_POLICIES)
def test_each_seed_policy_answers_two_turns_of_a_session(tiny_tok, name):
    from localchat.engine.engine import Engine

    engine = Engine(_model(len(tiny_tok), layers=4), tiny_tok, name="tiny", chunk=32)
    extra = {"filters": (1,)} if name == "omnikv" else {"window": 16} if name == "corm" else {}
    engine.set_policy(make_policy(name, budget=48, local=8, **extra))
    assert engine.positions == "original"
    s = Session(engine)
    settings = GenerationSettings(max_new_tokens=6, ignore_eos=True)
    for question in ("alpha beta gamma " * 40 + "What comes after beta?", "And before it?"):
        events = list(s.send(question, (), settings))
        assert not any(isinstance(e, Error) for e in events), events[-1]
        done = events[-1]
        assert isinstance(done, Done) and done.new_tokens == 6
        if name != "omnikv":
            assert s.kv_units <= 48 + 8 + 6
    if name == "omnikv":
        assert s.kv_units == s.fed  # nothing is ever dropped


def test_corm_cap_that_binds_while_answering_is_reported(tiny_tok):
    from localchat.engine.engine import Engine

    engine = Engine(_model(len(tiny_tok)), tiny_tok, name="tiny", chunk=64)
    engine.set_policy(make_policy("corm", budget=6, local=0, window=4, recent=2))
    events = list(engine.chat([{"role": "user", "content": "hello " * 12}], GenerationSettings(max_new_tokens=8)))
    done = events[-1]
    assert isinstance(done, Done) and done.new_tokens == 8 and done.kv_tokens <= 6
    notes = [e.message for e in events if isinstance(e, Notice)]
    assert notes[-1].startswith("corm wanted up to") and notes[-1].endswith("while answering")
    assert events.index(next(e for e in events if isinstance(e, Notice) and e.message == notes[-1])) > max(
        i for i, e in enumerate(events) if isinstance(e, Token))


def test_omnikv_filters_are_sorted_and_checked_against_the_depth(tiny_tok):
    from localchat.engine.engine import Engine

    assert make_policy("omnikv", filters=(3, 1, 3)).schedule(6) == (1, 3)
    engine = Engine(_model(len(tiny_tok), layers=4), tiny_tok, name="tiny", chunk=32)
    engine.set_policy(make_policy("omnikv", budget=8, filters=(1, 4)))
    events = list(engine.chat([{"role": "user", "content": "hello " * 8}], GenerationSettings(max_new_tokens=2)))
    assert isinstance(events[-1], Error) and "must lie in 0..3" in events[-1].message


def test_sparse_prefill_flag_is_omnikvs(tiny_engine):
    from localchat.errors import UserError
    from localchat.planning.load import policy_for

    assert policy_for(tiny_engine, "omnikv", sparse_prefill=2).prefill_ratio == 2
    assert policy_for(tiny_engine, "omnikv").prefill_ratio == 0
    with pytest.raises(UserError, match="applies to --policy omnikv"):
        policy_for(tiny_engine, "streaming", sparse_prefill=2)
    with pytest.raises(UserError, match="must be 0 .off. or more"):
        policy_for(tiny_engine, "omnikv", sparse_prefill=-1)
