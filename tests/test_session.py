"""Multi-turn sessions on a tiny random Llama: only new tokens are read, the cache stays bounded,
snapshots restore cancelled / retried / edited turns, and a policy change re-reads once."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny import tiny_llama

from localchat.documents import load_document
from localchat.engine.engine import Engine
from localchat.engine.events import Done, Error, Notice, Progress, Token
from localchat.engine.heads import RetainingHeads
from localchat.engine.policies import make_policy
from localchat.engine.sampling import GenerationSettings
from localchat.session import Session

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _doc(tmp_path, n_words=400, name="doc.txt"):
    path = tmp_path / name
    path.write_text(" ".join(WORDS[i % len(WORDS)] for i in range(n_words)) + ". The pass key is 4711.")
    return load_document(path)


def _locret(engine, budget=48, local=8):
    return make_policy("locret", budget=budget, local=local, stabilizers=8,
                       heads=RetainingHeads.random(engine.model, seed=1))


def _run(events):
    """(events list, answer text, final Done/Error)."""
    evs = list(events)
    final = next((e for e in reversed(evs) if isinstance(e, (Done, Error))), None)
    return evs, "".join(e.text for e in evs if isinstance(e, Token)), final


@pytest.fixture()
def engine(tiny_tok):
    e = Engine(tiny_llama(len(tiny_tok), layers=2), tiny_tok, name="tiny", chunk=32)
    e.set_policy(_locret(e))
    return e


SETTINGS = GenerationSettings(max_new_tokens=12, temperature=1.5, seed=5, ignore_eos=True)  # sampled: equal answers mean equal logits


def test_follow_up_reads_only_the_template_suffix(engine, tmp_path):
    s = Session(engine, system="Be brief.")
    _, _, first = _run(s.send("What is the pass key?", [_doc(tmp_path)], SETTINGS))
    assert isinstance(first, Done) and s.turns == 1
    before = s.cached_text
    _, _, second = _run(s.send("And again?", (), SETTINGS))
    full = engine.render([{"role": "system", "content": "Be brief."}, *s.messages[:-1]])
    suffix = full[len(before):]
    assert full.startswith(before)
    # what was read = the template's new text only, and it tokenizes the same on its own
    assert second.prompt_tokens == len(engine.encode(suffix)) < first.prompt_tokens // 10
    assert engine.encode(before) + engine.encode(suffix) == engine.encode(full)
    assert s.cached_text == full + s.messages[-1]["content"]
    assert s.fed == first.prompt_tokens + first.new_tokens + second.prompt_tokens + second.new_tokens


def test_cache_stays_bounded_over_many_turns(engine, tmp_path):
    s = Session(engine)
    p = engine.policy
    bound = p.budget + p.local + SETTINGS.max_new_tokens
    _run(s.send("Read this.", [_doc(tmp_path, 600)], SETTINGS))
    for i in range(12):
        _, _, done = _run(s.send(f"Question number {i}: tell me more about the words.", (), SETTINGS))
        assert isinstance(done, Done)
        assert s.kv_units <= bound
        for layer in s.cache.layers:
            assert layer.keys.shape[-2] == layer.positions.shape[-1] == s.kv_units
    assert s.fed > 3 * bound  # many more tokens went through than are kept


def test_cancel_restores_the_conversation_and_cache(engine, tmp_path):
    s = Session(engine)
    _run(s.send("Hello there.", (), SETTINGS))
    saved = {k: v.clone() for k, v in s.cache.tensors().items()}
    messages = list(s.messages)
    cancel = threading.Event()
    events = []
    for ev in s.send("Read this long one.", [_doc(tmp_path, 800)], SETTINGS, cancel):
        events.append(ev)
        if isinstance(ev, Progress):
            cancel.set()
    assert isinstance(events[-1], Done) and events[-1].stop_reason == "cancelled"
    assert s.messages == messages and s.turns == 1
    now = s.cache.tensors()
    assert now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in saved)
    # the next answer is the one a session without the cancelled turn gives
    _, got, _ = _run(s.send("Next.", (), SETTINGS))
    fresh = Session(engine)
    _run(fresh.send("Hello there.", (), SETTINGS))
    _, want, _ = _run(fresh.send("Next.", (), SETTINGS))
    assert got == want


def test_retry_gives_the_same_greedy_answer_and_edit_replaces_the_question(engine, tmp_path):
    s = Session(engine)
    _run(s.send("First.", [_doc(tmp_path)], SETTINGS))
    _, answer, _ = _run(s.send("Second?", (), SETTINGS))
    cache_after = {k: v.clone() for k, v in s.cache.tensors().items()}
    _, again, done = _run(s.retry(SETTINGS))
    assert isinstance(done, Done) and again == answer and s.turns == 2
    assert all(torch.equal(cache_after[k], v) for k, v in s.cache.tensors().items())
    assert [a.turn for a in s.attachments] == [0]
    _, edited, done = _run(s.edit_last("Something else entirely?", (), SETTINGS))
    assert isinstance(done, Done) and s.questions == ["First.", "Something else entirely?"] and s.turns == 2
    assert s.messages[-2]["content"] == "Something else entirely?"


def test_nothing_to_retry_and_empty_message_are_errors(engine):
    s = Session(engine)
    assert isinstance(_run(s.retry(SETTINGS))[2], Error)
    assert isinstance(_run(s.send("   ", (), SETTINGS))[2], Error)
    assert s.turns == 0


def test_policy_change_rereads_the_history_once(engine, tmp_path):
    s = Session(engine)
    _, _, first = _run(s.send("Read.", [_doc(tmp_path)], SETTINGS))
    s.set_policy(_locret(engine, budget=64))
    evs, _, done = _run(s.send("Now?", (), SETTINGS))
    assert any(isinstance(e, Notice) and "re-reading" in e.message for e in evs)
    assert done.prompt_tokens > first.prompt_tokens  # the whole conversation
    evs, _, again = _run(s.send("And now?", (), SETTINGS))
    assert not any(isinstance(e, Notice) for e in evs) and again.prompt_tokens < 40


def test_retained_map_follows_the_document(engine, tmp_path):
    s = Session(engine)
    assert s.retained_map() is None
    doc = _doc(tmp_path, 600)
    _run(s.send("Read.", [doc], SETTINGS))
    a = s.attachments[0]
    assert a.tokens == engine.count_tokens(doc.text.strip()) and a.end - a.start == a.tokens
    m = s.retained_map(bins=20)
    assert len(m) == 20 and all(0.0 <= x <= 1.0 for x in m)
    # each head keeps at most `budget` document units: the average share is bounded by it
    assert 0 < sum(m) / len(m) <= engine.policy.budget / a.tokens + 0.05
    engine.set_policy(make_policy("full"))
    s2 = Session(engine)
    _run(s2.send("Read.", [doc], SETTINGS))
    assert s2.retained_map(bins=10) == [1.0] * 10  # full attention keeps everything


def test_export_markdown_has_questions_answers_and_attachments(engine, tmp_path):
    s = Session(engine)
    _run(s.send("What is the key?", [_doc(tmp_path)], SETTINGS))
    md = s.export_markdown()
    assert "## You" in md and "What is the key?" in md and "doc.txt" in md and s.messages[-1]["content"] in md
    assert "alpha beta" not in md  # the document text itself is not pasted into the export


def test_a_turn_abandoned_mid_prefill_leaves_the_session_as_it_was(engine, tmp_path):
    s = Session(engine)
    _run(s.send("Hello there.", (), SETTINGS))
    units, fed = s.kv_units, s.fed
    turn = s.send("Read this long one.", [_doc(tmp_path, 800)], SETTINGS)
    assert isinstance(next(turn), Progress)
    turn.close()  # e.g. the window was closed
    assert (s.turns, s.kv_units, s.fed) == (1, units, fed)
    _, _, done = _run(s.send("Next.", (), SETTINGS))
    assert isinstance(done, Done) and done.prompt_tokens < 60
