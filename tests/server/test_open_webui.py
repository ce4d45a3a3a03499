"""Open WebUI's whole-document chats against `localchat serve` (the `openai` client over real HTTP): the document
is read once per conversation in both of its layouts, after a restart too (their shapes: localchat/bench/webui.py)."""

from __future__ import annotations

import openai

from localchat.bench.webui import request
from localchat.server.app import CACHED, HEADER

REPORT = " ".join(f"Line {i}: the harbour log notes tide {i % 7} and crew {i % 5}." for i in range(60)) + \
    " The pass key is 48213. " + " ".join(f"Entry {i}: boats leave at {i % 12} o'clock." for i in range(30))
FILES = [("report.txt", "5f0c8a2e-0d1b-4f8e-9a51-3c2b7e6d4f10", REPORT)]


def ask(service, messages, **kw):
    """(text, usage, conversation, cached-tokens header)."""
    c = openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0)
    raw = c.chat.completions.with_raw_response.create(model="tiny", messages=messages, **kw)
    done = raw.parse()
    return done.choices[0].message.content, done.usage, raw.headers[HEADER], raw.headers.get(CACHED)


def test_the_default_layout_reads_the_document_once(serve):
    """The document moves to the last question each turn; the conversation that read it goes on with the bare
    question, and answers as the same conversation read in place does."""
    service = serve()
    a1, u1, name, _ = ask(service, request([("What is the pass key?", None)], FILES))
    assert u1.prompt_tokens_details.cached_tokens == 0 and u1.prompt_tokens > 400
    a2, u2, again, header = ask(service, request([("What is the pass key?", a1), ("When do boats leave?", None)], FILES))
    assert again == name and int(header) == u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens
    assert u2.prompt_tokens - u2.prompt_tokens_details.cached_tokens < 60  # the question and its turn marks
    a3, u3, again, _ = ask(service, request([("What is the pass key?", a1), ("When do boats leave?", a2),
                                             ("Who keeps the log?", None)], FILES))
    assert again == name and u3.prompt_tokens - u3.prompt_tokens_details.cached_tokens < 60
    _, held = service.conversations.store.messages(name)
    assert [m["content"] for m in held if m["role"] == "user"][1:] == ["When do boats leave?", "Who keeps the log?"]
    # the same conversation read in place, by a plain extension of its messages
    placed = request([("What is the pass key?", None)], FILES)
    b1, _, other, _ = ask(service, placed, extra_body={"conversation": "in-place"})
    b2, _, _, _ = ask(service, [*placed, {"role": "assistant", "content": b1},
                                {"role": "user", "content": "When do boats leave?"}], extra_body={"conversation": "in-place"})
    assert (b1, b2) == (a1, a2)


def test_the_default_layout_goes_on_after_a_restart_and_asked_again(serve):
    service = serve()
    a1, u1, name, _ = ask(service, request([("What is the pass key?", None)], FILES))
    service.stop()
    restarted = serve()
    follow = request([("What is the pass key?", a1), ("When do boats leave?", None)], FILES)
    a2, u2, again, _ = ask(restarted, follow)
    assert again == name and u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens
    r2, r_usage, again, header = ask(restarted, follow)  # "regenerate": the same request once more
    assert again == name and r2 == a2
    assert int(header) == r_usage.prompt_tokens_details.cached_tokens >= u1.prompt_tokens
    _, held = restarted.conversations.store.messages(name)
    assert len(held) == 4  # answered again, not asked twice


def test_the_system_layout_is_a_plain_extension(serve):
    """RAG_SYSTEM_CONTEXT=true: the filled template is the system message, the same every turn."""
    service = serve()
    a1, u1, name, _ = ask(service, request([("What is the pass key?", None)], FILES, system_context=True,
                                           system="Answer briefly."))
    a2, u2, again, _ = ask(service, request([("What is the pass key?", a1), ("When do boats leave?", None)], FILES,
                                            system_context=True, system="Answer briefly."))
    assert again == name and u2.prompt_tokens_details.cached_tokens >= u1.prompt_tokens
    assert u2.prompt_tokens - u2.prompt_tokens_details.cached_tokens < 60


def test_a_document_under_another_history_is_read_again(serve, capfd):
    """The block matches, the earlier messages do not: never answered from that cache; the log says why."""
    service = serve()
    ask(service, request([("What is the pass key?", None)], FILES))
    _, usage, _, _ = ask(service, request([("Something else entirely?", "No."), ("When do boats leave?", None)], FILES))
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert "came again under other messages: it is read again" in capfd.readouterr().err


def test_a_streamed_answer_says_what_came_from_the_cache(serve):
    service = serve()
    a1, u1, _, _ = ask(service, request([("What is the pass key?", None)], FILES))
    c = openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0)
    with c.chat.completions.with_streaming_response.create(
            model="tiny", stream=True, stream_options={"include_usage": True},
            messages=request([("What is the pass key?", a1), ("When do boats leave?", None)], FILES)) as raw:
        chunks = list(raw.parse())
        header = raw.headers.get(CACHED)
    assert int(header) == chunks[-1].usage.prompt_tokens_details.cached_tokens >= u1.prompt_tokens
