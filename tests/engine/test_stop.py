"""Stop sequences: the answer ends before the first one, streamed text never shows any part of it."""

from __future__ import annotations

import pytest

from localchat.engine.events import Done, Token
from localchat.engine.sampling import GenerationSettings, StopText
from localchat.errors import UserError
from localchat.session import Session


def test_stop_text_holds_back_a_possible_start_and_cuts_at_the_stop():
    s = StopText(("END", "##"))
    assert s.push("hello E") == "hello "  # "E" may start "END"
    assert s.push("x") == "Ex"  # it did not
    assert s.push("ab#") == "ab"
    assert s.push("#tail") == ""
    assert s.hit and s.shown == "hello Exab"


def test_stop_text_flushes_what_it_held_when_no_stop_came():
    s = StopText(("END",))
    assert s.push("the EN") == "the "
    assert s.flush() == "EN"
    assert not s.hit and s.shown == "the EN"


def test_an_empty_stop_sequence_is_refused():
    with pytest.raises(UserError, match="stop sequence is empty"):
        GenerationSettings(stop=("",)).validate()


def _answer(engine, settings, messages):
    events = list(engine.chat(messages, settings))
    done = events[-1]
    assert isinstance(done, Done), done
    return "".join(e.text for e in events if isinstance(e, Token)), done


def test_generation_ends_before_the_stop_sequence(tiny_engine):
    messages = [{"role": "user", "content": "say something long"}]
    free, _ = _answer(tiny_engine, GenerationSettings(max_new_tokens=40, ignore_eos=True), messages)
    stop = free[12:15]
    assert len(stop) == 3
    cut = free[:free.find(stop)]
    streamed, done = _answer(tiny_engine, GenerationSettings(max_new_tokens=40, ignore_eos=True, stop=(stop,)), messages)
    assert streamed == done.text == cut
    assert done.stop_reason == "stop"
    assert done.new_tokens < 40


def test_a_session_keeps_the_answer_cut_at_the_stop(tiny_engine):
    session = Session(tiny_engine)
    free = [e for e in session.send("hello there", settings=GenerationSettings(max_new_tokens=30, ignore_eos=True))][-1]
    stop = free.text[10:12]
    session.clear()
    done = list(session.send("hello there", settings=GenerationSettings(max_new_tokens=30, ignore_eos=True,
                                                                         stop=(stop,))))[-1]
    assert done.stop_reason == "stop"
    assert session.messages[-1]["content"] == free.text[:free.text.find(stop)]
    follow = list(session.send("and then?", settings=GenerationSettings(max_new_tokens=5)))[-1]
    assert isinstance(follow, Done) and len(session.messages) == 4
