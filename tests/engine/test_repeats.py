"""LOCRET's `--max-copies` (engine/policies/repeats.py): at most N copies of one token per KV head survive an
eviction, the best-scored ones, protected units untouched; positions' token ids stay bounded by the cache."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_llama

from localchat.engine.cache import KVCache
from localchat.engine.heads import RetainingHeads
from localchat.engine.policies import make_policy
from localchat.engine.policies.base import PROTECT
from localchat.engine.policies.repeats import LOW, TokenIds, cap_copies
from localchat.engine.prefill import prefill
from localchat.engine.rope import rope_inv_freq
from localchat.errors import UserError


def _reference(prio, ids, cap):
    out = prio.clone()
    for h in range(prio.shape[0]):
        seen: dict[int, int] = {}
        for j in sorted(range(prio.shape[1]), key=lambda j: -float(prio[h, j])):
            tok = int(ids[h, j])
            seen[tok] = seen.get(tok, 0) + 1
            if seen[tok] > cap and prio[h, j] < PROTECT:
                out[h, j] = LOW
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cap_copies_equals_a_per_head_reference(seed):
    g = torch.Generator().manual_seed(seed)
    prio = torch.randn(3, 200, generator=g)  # distinct scores: one order
    ids = torch.randint(0, 6, (3, 200), generator=g)
    prio[:, -10:] = PROTECT  # protected units keep their rank, even past the cap
    got = cap_copies(prio, ids, 4)
    assert torch.equal(got, _reference(prio, ids, 4))
    assert (got[:, -10:] == PROTECT).all() and (got == LOW).sum() > 400  # most of 6 ids x 200 units are over


def test_token_ids_lookup_reread_and_forget():
    t = TokenIds()
    t.add(torch.arange(0, 5), torch.tensor([9, 8, 7, 6, 5]))
    t.add(torch.arange(5, 8), torch.tensor([1, 2, 3]))
    assert t.lookup(torch.tensor([[0, 6], [7, 2]])).tolist() == [[9, 2], [3, 7]]
    t.add(torch.arange(6, 8), torch.tensor([4, 4]))  # a chunk read again (out of memory): replaces positions 6, 7
    assert t.lookup(torch.tensor([5, 6, 7])).tolist() == [1, 4, 4] and t.pos.tolist() == list(range(8))
    t.forget_except([torch.tensor([[0, 6]]), torch.tensor([[7]])])
    assert t.pos.tolist() == [0, 6, 7]
    assert t.lookup(torch.tensor([3, 100])).tolist() == [-4, -101]  # unknown: an id of its own


@pytest.fixture(scope="module")
def model():
    return tiny_llama(300, layers=3, q_heads=4, kv_heads=2, head_dim=16)


def _read(model, ids, **kw):
    policy = make_policy("locret", heads=RetainingHeads.random(model, d_r=32), budget=96, stabilizers=16, local=8, **kw)
    cache = KVCache(3, positions="compact", inv_freq=rope_inv_freq(model))
    policy.attach(model, cache)
    try:
        for _ in prefill(model, cache, ids, chunk=64, policy=policy):
            pass
    finally:
        policy.detach()
    return cache, policy


def _most_copies(cache, ids, end):
    worst = 0
    for layer in cache.layers:
        for head in layer.positions:
            toks = ids[0, head[head < end]].tolist()
            worst = max(worst, max(toks.count(t) for t in set(toks)))
    return worst


def test_a_repeated_token_floods_the_budget_and_the_cap_bounds_it(model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (1, 1500), generator=g)
    ids[0, ::2] = 7  # every other token the same: in layer 0 its copies score alike
    end = 1500 - 8  # the evicted part (the local tail is appended without eviction)
    plain, _ = _read(model, ids)
    capped, policy = _read(model, ids, max_copies=5)
    assert _most_copies(plain, ids, end) > 40  # the flood, without the cap
    assert _most_copies(capped, ids, end) <= 5
    assert capped.get_seq_length() == plain.get_seq_length() == 96 + 8  # still b units, plus the tail
    assert len(policy.token_ids.pos) <= len(torch.unique(torch.cat([layer.positions.reshape(-1) for layer in capped.layers]))) + 64


def test_max_copies_must_not_be_negative(model):
    with pytest.raises(UserError, match="--max-copies must be >= 0"):
        make_policy("locret", heads=RetainingHeads.random(model, d_r=32), max_copies=-1)


@pytest.mark.parametrize(("option", "card_value", "given"), [("max_copies", 64, 8), ("focus", 256, 16)])
def test_a_cards_locret_options_reach_the_app_but_not_a_bench_cell_without_them(tiny_tok, option, card_value, given):
    """SmolLM2's card sets max_copies and focus; the app's LOCRET takes them (a flag overrides them), while a bench
    cell without --max-copies / --focus runs the paper's rule, so that its row's field (null) says what ran."""
    from dataclasses import replace

    from localchat.bench.cell import Cell, use_policy
    from localchat.engine.cards import default_card
    from localchat.engine.engine import Engine
    from localchat.planning.load import policy_for

    assert default_card().locret[option] == card_value
    card = replace(default_card(), locret={**default_card().locret, "budget": 64, "stabilizers": 16})
    engine = Engine(tiny_llama(len(tiny_tok)), tiny_tok, name="tiny", card=card, chunk=64)
    assert getattr(policy_for(engine, "locret", heads="random"), option) == card_value
    assert getattr(policy_for(engine, "locret", heads="random", **{option: 0}), option) == 0
    cell = Cell(task="passkey", length=512, policy="locret", budget=64, n=1, seed=0, model_spec=None,
                heads="random", chunk=64, positions="compact", max_new_tokens=4)
    use_policy(engine, cell)
    assert getattr(engine.policy, option) == 0
    use_policy(engine, replace(cell, **{option: given}))
    assert getattr(engine.policy, option) == given
    use_policy(engine, replace(cell, policy="h2o", heads=None))  # a policy without the option is not handed one
    assert engine.policy.name == "h2o"
