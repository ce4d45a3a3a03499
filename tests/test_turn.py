"""One turn path (localchat/turn.py): every front end answers through `answer()`, and a failure is reported the same
way wherever it happens (exit code, HTTP status, a line in the chat)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tiny import save_tiny

from localchat.cli import main
from localchat.engine.events import Done, Error, Token
from localchat.errors import TooLong, UserError, check_text
from localchat.session import Session
from localchat.turn import Failure, Unsaved, answer, failure


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("tiny-turn")))


def test_failure_kinds_map_to_one_exit_code_and_status_each() -> None:
    import torch

    cases = [(UserError("bad flag"), "input", 2, 400, "invalid_value"),
             (TooLong("too long"), "too_long", 2, 400, "context_length_exceeded"),
             (torch.OutOfMemoryError("CUDA out of memory"), "memory", 1, 503, "out_of_memory"),
             (RuntimeError("boom\nsecond line"), "engine", 1, 500, "server_error")]
    for exc, kind, code, status, api in cases:
        found = failure(exc)
        assert (found.kind, found.exit_code, found.http_status, found.code) == (kind, code, status, api)
        assert "\n" not in found.message
    assert failure(RuntimeError("boom\nsecond line")).message == "the engine failed: boom"
    assert failure(Error("the message is empty: type a question")) == Failure("input",
                                                                               "the message is empty: type a question")


def test_text_that_cannot_be_encoded_is_named() -> None:
    assert check_text("hi there", "the question") == "hi there"
    with pytest.raises(UserError, match=r"the question is not valid text: character 4"):
        check_text("hi \udcff there", "the question")


def test_answer_streams_saves_and_ends_with_done(tiny_engine) -> None:
    session, saved = Session(tiny_engine), []
    events = list(answer(session, "  what is it?  ", settings=None, save=saved.append))
    assert isinstance(events[-1], Done) and any(isinstance(e, Token) for e in events)
    assert saved == [session] and session.questions == ["what is it?"] and session.turns == 1


def test_a_failed_save_is_said_and_the_answer_stands(tiny_engine) -> None:
    def save(_):
        raise UserError("chat 'x' is saved, but not its cache")

    session = Session(tiny_engine)
    events = list(answer(session, "q", save=save))
    unsaved = [e for e in events if isinstance(e, Unsaved)]
    assert len(unsaved) == 1 and "not its cache" in unsaved[0].message and isinstance(events[-1], Done)
    assert session.turns == 1


def test_an_engine_failure_ends_the_turn_with_one_line_and_the_session_as_before(tiny_engine, monkeypatch) -> None:
    session = Session(tiny_engine)
    list(answer(session, "first"))

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded\nat line 3")
        yield  # pragma: no cover - a generator

    monkeypatch.setattr(tiny_engine, "continue_on", broken)
    events = list(answer(session, "second"))
    assert isinstance(events[-1], Error) and events[-1].message == "the engine failed: kernel exploded"
    assert session.turns == 1 and session.questions == ["first"]


def test_an_empty_or_broken_question_is_refused_before_the_engine(tiny_engine, monkeypatch) -> None:
    monkeypatch.setattr(tiny_engine, "continue_on", lambda *a, **k: pytest.fail("the engine was asked"))
    for question, words in (("   ", "question is empty"), ("hi \ud800", "not valid text")):
        events = list(answer(Session(tiny_engine), question))
        assert len(events) == 1 and isinstance(events[0], Error) and words in events[0].message
        assert failure(events[0]).exit_code == 2


@pytest.mark.parametrize("session", [False, True], ids=["one-off", "saved chat"])
def test_ask_reports_an_engine_failure_the_same_way_with_or_without_a_session(tiny_dir, monkeypatch, capsys,
                                                                              session, tmp_path) -> None:
    from localchat.engine.engine import Engine

    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(tmp_path / "data"))  # a chat of its own: no other test's "s"
    def broken(self, *args, **kwargs):
        raise RuntimeError("kernel exploded")
        yield  # pragma: no cover - a generator

    monkeypatch.setattr(Engine, "continue_on", broken)
    argv = ["--model", tiny_dir, "--max-new-tokens", "2", "ask", *(["--session", "s"] if session else []), "q"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == "localchat: failed: the engine failed: kernel exploded (run with --debug for details)\n"


def test_ask_with_bytes_that_are_not_utf8_exits_2_before_the_model_loads(tmp_path) -> None:
    """A real process, argv as the shell passes `$'hi \\xff there'`: one line, exit 2, no model read (the model
    path does not exist, so loading it would fail with another message)."""
    run = subprocess.run([sys.executable, "-m", "localchat", "--model", str(tmp_path / "none"), "ask",
                          b"hi \xff there"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1 and "the question is not valid text: character 4" in run.stderr


def test_a_long_document_turns_the_default_full_attention_to_a_bounded_policy(tiny_engine, tmp_path,
                                                                              monkeypatch) -> None:
    """Where full attention was only the default and the memory found cannot hold the document, the turn reads it
    with the bounded policy without heads and says so first."""
    from localchat.config import PolicySpec, RunSpec
    from localchat.documents import load_document
    from localchat.engine.policies import NO_HEADS_POLICY
    from localchat.planning import load, memory

    path = tmp_path / "long.txt"
    path.write_text("The sky is blue and the grass is green. " * 300)
    tokens = tiny_engine.count_tokens(path.read_text())
    unit = memory.kv_unit_bytes(memory.Shape.from_config(tiny_engine.model.config), "fp32")
    device = memory.Device("cpu", "test", 2**40, 512 * memory.MIB + unit * tokens // 2)  # half the document's K/V
    monkeypatch.setattr(memory, "detect", lambda kind=None: device)
    tiny_engine.configure(spec=RunSpec(policy=PolicySpec("full"), sources={"policy": "default"}))
    monkeypatch.setattr(tiny_engine, "admit", load.admit)
    session = Session(tiny_engine)
    events = list(answer(session, "what colour is the sky?", [load_document(str(path))]))
    notes = [e.message for e in events if type(e).__name__ == "Notice"]
    assert notes and f"reading it with {NO_HEADS_POLICY}" in notes[0]
    assert isinstance(events[-1], Done) and tiny_engine.policy.name == NO_HEADS_POLICY
    assert tiny_engine.spec.policy.name == NO_HEADS_POLICY


@pytest.mark.model
def test_a_one_off_turn_answers_as_the_engine_alone_does(smollm2, tmp_path) -> None:
    """`ask` without a chat goes through the turn path: the real model's answer, token for token, and the tokens
    read are those of the engine answering the same messages on its own."""
    from localchat.documents import load_document
    from localchat.engine.sampling import GenerationSettings
    from localchat.render import user_turn

    path = tmp_path / "notes.txt"
    path.write_text("Remember this: the pass key is 48213. " + "The grass is green and the sky is blue. " * 60)
    docs, question = [load_document(str(path))], "What is the pass key?"
    settings = GenerationSettings(max_new_tokens=16)
    alone = list(smollm2.chat([{"role": "user", "content": user_turn(question, docs)}], settings))[-1]
    turn = list(answer(Session(smollm2), question, docs, settings))[-1]
    assert isinstance(alone, Done) and isinstance(turn, Done)
    assert turn.text == alone.text and turn.prompt_tokens == alone.prompt_tokens and turn.new_tokens == alone.new_tokens
