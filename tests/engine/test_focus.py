"""LOCRET's --focus (engine/focus.py): the answer reads the kept units the question attends to most, the cache
itself stays whole, and a chat's next turn starts from it with the answer fed in."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_llama

from localchat.engine import focus
from localchat.engine.cache import KVCache
from localchat.engine.engine import Engine, peak_units
from localchat.engine.events import Done, Token
from localchat.engine.heads import RetainingHeads
from localchat.engine.policies import make_policy
from localchat.engine.policies.locret import FOCUS_SPREAD, FOCUS_WINDOW
from localchat.engine.qcache import QuantizedKVCache
from localchat.engine.rope import rope_inv_freq
from localchat.engine.sampling import GenerationSettings
from localchat.errors import UserError
from localchat.session import Session

SETTINGS = GenerationSettings(max_new_tokens=10, temperature=1.5, seed=3, ignore_eos=True)  # sampled: equal text, equal logits


def _dense_spread(votes, positions, after):
    gap = positions[:, :, None] - positions[:, None, :]
    near = (gap >= 0) & (gap <= after)
    return torch.where(near, votes[:, None, :], torch.zeros(())).amax(dim=-1)


@pytest.mark.parametrize("seed", [0, 1])
def test_spread_equals_a_dense_reference(seed):
    g = torch.Generator().manual_seed(seed)
    votes = torch.rand(3, 300, generator=g)
    steps = torch.randint(1, 9, (3, 300), generator=g)  # gaps of 1-8 tokens: some units have no neighbour in reach
    positions = steps.cumsum(dim=-1)
    got = focus.spread(votes, positions, 16)
    assert torch.equal(got, _dense_spread(votes, positions, 16))
    assert (got >= votes).all() and (got > votes).any()


def test_a_needle_value_inherits_its_key_vote():
    votes = torch.zeros(1, 40)
    votes[0, 10] = 1.0  # the question points at the key (slot 10)
    positions = torch.arange(40)[None] * 2  # tokens 20, 22, ... : the value sits 2-16 tokens after the key
    picked = focus.picks(votes, positions, 12, 16)[0].tolist()
    assert picked[:2] == [0, 1]  # the first 4 positions (slots 0 and 1 here) always
    assert set(range(10, 19)) <= set(picked)  # the key and the 8 units within 16 tokens after it
    assert 9 not in focus.picks(votes, positions, 11, 16)[0].tolist()  # what comes before the key gets nothing


def _filled(cache_cls, **kw):
    model = tiny_llama(200, layers=2, q_heads=4, kv_heads=2, head_dim=16)
    cache = cache_cls(2, positions="compact", inv_freq=rope_inv_freq(model), **kw)
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        layer.pending_positions = torch.arange(200)
        layer.update(torch.randn(1, 2, 200, 16, generator=g), torch.randn(1, 2, 200, 16, generator=g))
    return cache


@pytest.mark.parametrize("kind", ["plain", "int8"])
def test_view_holds_the_picks_as_a_cache_that_kept_them_would(kind):
    cache = _filled(KVCache) if kind == "plain" else _filled(QuantizedKVCache, bits=8)
    votes = {i: torch.rand(2, 180, generator=torch.Generator().manual_seed(i)) for i in range(2)}
    view = focus.view(cache, votes, held=180, k=12, reserve=30, after=16)
    reference = cache.clone()
    for i, layer in enumerate(reference.layers):
        reference.keep(i, focus.picks(votes[i], layer.positions[:, :180], 12, 16))
    assert type(view) is type(cache) and view.get_seq_length() == 12
    for got, want in zip(view.layers, reference.layers):
        assert torch.equal(got.positions, want.positions) and (got.positions < 180).all()
        mine, theirs = got.tensors(), want.tensors()
        assert mine.keys() == theirs.keys() and all(torch.allclose(mine[n].float(), theirs[n].float()) for n in mine)
    assert cache.get_seq_length() == 200  # the cache is untouched
    buffers = view.layers[0]._k if kind == "plain" else view.layers[0]._q["qk"]
    assert buffers.shape[-2] < 180  # the view's own size, not the cache's


@pytest.fixture()
def engine(tiny_tok):
    e = Engine(tiny_llama(len(tiny_tok), layers=2), tiny_tok, name="tiny", chunk=32)
    return e


def _locret(engine, local=8, **kw):
    return make_policy("locret", budget=48, local=local, stabilizers=8, heads=RetainingHeads.random(engine.model, seed=1), **kw)


def _answer(engine, ids, cache=None, keep_last=False):
    cache = cache or engine.new_cache(len(ids), SETTINGS.max_new_tokens)
    events = list(engine.continue_on(cache, ids, 0, SETTINGS, keep_last=keep_last))
    done = events[-1]
    assert isinstance(done, Done), done
    return "".join(e.text for e in events if isinstance(e, Token)), cache, done


def test_focus_changes_what_the_answer_reads_not_what_the_cache_keeps(engine):
    ids = engine.encode("alpha beta gamma delta " * 60)
    engine.set_policy(_locret(engine))
    plain_text, plain_cache, _ = _answer(engine, ids, keep_last=True)
    engine.set_policy(_locret(engine, focus=16))
    text, cache, done = _answer(engine, ids, keep_last=True)
    assert text != plain_text  # 16 of ~56 units read: other logits
    assert done.kv_tokens == cache.get_seq_length() == plain_cache.get_seq_length()  # prompt and answer, as without
    for got, want in zip(cache.layers, plain_cache.layers):
        n_prompt = len(ids) + SETTINGS.max_new_tokens - 8 - SETTINGS.max_new_tokens  # units before the tail
        assert torch.equal(got.positions[:, :n_prompt], want.positions[:, :n_prompt])  # the same units kept
        assert got.positions[0, -1] == len(ids) + SETTINGS.max_new_tokens - 1  # the answer's last token fed
    assert engine.model.config._attn_implementation == "sdpa"  # the probe's attention switch is undone


def test_focus_on_every_kept_unit_answers_as_without(engine):
    ids = engine.encode("alpha beta gamma delta " * 60)
    engine.set_policy(_locret(engine))
    plain, _, _ = _answer(engine, ids)
    engine.set_policy(_locret(engine, focus=4096))  # more than the cache holds: nothing to narrow
    assert _answer(engine, ids)[0] == plain


def test_a_short_follow_up_is_focused_too_and_the_chat_goes_on(engine, tmp_path, monkeypatch):
    from localchat.documents import load_document

    path = tmp_path / "doc.txt"
    path.write_text("alpha beta gamma delta epsilon " * 80 + "The pass key is 4711.")
    views = []
    real_view = focus.view
    monkeypatch.setattr(focus, "view", lambda cache, votes, held, k, reserve, **kw: views.append((held, k)) or
                        real_view(cache, votes, held, k, reserve, **kw))
    engine.set_policy(_locret(engine, local=40, focus=16))
    s = Session(engine)
    list(s.send("What is the pass key?", [load_document(path)], SETTINGS))
    events = list(s.send("Again?", (), SETTINGS))
    assert isinstance(events[-1], Done) and events[-1].prompt_tokens <= 40  # all of it within the tail
    assert len(views) == 2 and all(k == 16 and held >= 48 for held, k in views)  # both answers read a view
    assert s.fed == s.cache.layers[0].positions[0, -1] + 1  # every answer token reached the cache
    assert s.kv_units <= 48 + 40 + SETTINGS.max_new_tokens


def test_window_and_spread_reach_the_probe_and_the_view(engine, monkeypatch):
    seen, held = [], []
    real_probe, real_view = focus.Probe, focus.view

    def view(*a, after, **kw):
        out = real_view(*a, after=after, **kw)
        held.append(torch.cat([layer.positions for layer in out.layers]))
        return out

    monkeypatch.setattr(focus, "Probe", lambda model, held, window: seen.append(window) or
                        real_probe(model, held, window))
    monkeypatch.setattr(focus, "view", lambda *a, after, **kw: seen.append(after) or view(*a, after=after, **kw))
    ids = engine.encode("alpha beta gamma delta " * 60)
    for kw in ({}, {"focus_window": 2, "focus_spread": 0}):
        engine.set_policy(_locret(engine, focus=16, **kw))
        _answer(engine, ids)
    assert seen == [FOCUS_WINDOW, FOCUS_SPREAD, 2, 0]  # LOCRET's defaults, then the options given
    assert not torch.equal(held[0], held[1])  # another vote: other units in the view


def test_focus_is_validated_and_planned(engine):
    with pytest.raises(UserError, match="--focus must be >= 0"):
        _locret(engine, focus=-1)
    with pytest.raises(UserError, match="--focus-window must be >= 1"):
        _locret(engine, focus=8, focus_window=0)
    with pytest.raises(UserError, match="--focus-spread must be >= 0"):
        _locret(engine, focus=8, focus_spread=-1)
    p = _locret(engine, focus=200)
    assert peak_units(p, 10_000, 32, 10) == 48 + 8 + 10 + 200 + 8  # the view outgrows a chunk
    assert peak_units(_locret(engine, focus=8), 10_000, 32, 10) == peak_units(_locret(engine), 10_000, 32, 10)


def test_a_saved_chat_stays_valid_when_only_focus_changes(engine):
    from localchat.store import fingerprint

    engine.set_policy(_locret(engine))
    plain = fingerprint(engine)
    engine.set_policy(_locret(engine, focus=16))
    assert fingerprint(engine) == plain  # the cache it holds is the same
    engine.set_policy(_locret(engine, focus=16, focus_window=8, focus_spread=4))
    assert fingerprint(engine) == plain
    engine.set_policy(_locret(engine, max_copies=4))
    assert fingerprint(engine) != plain  # the cap changes what is kept


@pytest.mark.slow
def test_smollm2_reads_a_4k_needle_through_the_focused_view(smollm2):
    from localchat.bench.cell import Cell, sample_for
    from localchat.bench.tasks import prompt_messages, score
    from localchat.planning.load import policy_for

    cell = Cell(task="niah_single", length=4096, policy="locret", budget=1024, n=20, seed=0, model_spec=None,
                heads=None, chunk=512, positions="compact", max_new_tokens=24)
    smollm2.set_policy(policy_for(smollm2, "locret", budget=1024, max_copies=0, focus=256))  # the shipped heads
    sample = sample_for(cell, smollm2.tokenizer, 5)
    text = "".join(e.text for e in smollm2.chat(prompt_messages(sample), GenerationSettings(max_new_tokens=24))
                   if isinstance(e, Token))
    assert score(sample, text), text
