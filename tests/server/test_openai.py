"""The `openai` package as the client: answers, streaming, usage, and conversations served from the cache."""

from __future__ import annotations

import openai
import pytest

from localchat.server.app import HEADER
from localchat.server.conversations import PREFIX

DOC = "The harbour opens at dawn. " * 12 + "The pass key is 48213. " + "Boats leave at noon. " * 12


def client(service, **kw):
    return openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0, **kw)


def ask(c, messages, **kw):
    """The completion and the name of the conversation that answered it."""
    raw = c.chat.completions.with_raw_response.create(model="tiny", messages=messages, **kw)
    return raw.parse(), raw.headers[HEADER]


def test_models_lists_the_resident_model(serve):
    service = serve()
    assert [m.id for m in client(service).models.list().data] == ["tiny"]


def test_an_answer_streamed_and_not_is_the_same_with_usage(serve):
    service = serve()
    c = client(service)
    messages = [{"role": "user", "content": "Tell me about harbours."}]
    whole, _ = ask(c, messages)
    answer = whole.choices[0].message.content
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 0 and whole.usage.prompt_tokens_details.cached_tokens == 0
    assert whole.usage.completion_tokens > 0
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == answer
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_follow_up_reads_only_the_new_question(serve):
    service = serve()
    c = client(service)
    first_q = [{"role": "user", "content": f"Read this: {DOC}\nWhat is the pass key?"}]
    first, name = ask(c, first_q)
    assert name.startswith(PREFIX)
    history = first_q + [{"role": "assistant", "content": first.choices[0].message.content}]
    second, again = ask(c, history + [{"role": "user", "content": "And when do boats leave?"}])
    assert again == name
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens  # the document came from the cache
    assert second.usage.prompt_tokens - cached < 60  # only the new question (and the template around it) was read
    assert len(service.conversations.store.messages(name)[1]) == 4


def test_a_restarted_server_continues_from_the_saved_cache(serve):
    service = serve()
    first_q = [{"role": "user", "content": f"Read this: {DOC}\nWhat is the pass key?"}]
    first, name = ask(client(service), first_q)
    service.stop()
    restarted = serve()
    follow = first_q + [{"role": "assistant", "content": " " + first.choices[0].message.content + "\n"},
                        {"role": "user", "content": "And when do boats leave?"}]  # spaces around a sent-back answer
    second, again = ask(client(restarted), follow)
    assert again == name
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_unknown_history_is_read_once_then_continued(serve):
    service = serve()
    c = client(service)
    told = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi! How can I help?"}, {"role": "user", "content": "Name a colour."}]
    first, name = ask(c, told)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    system, held = service.conversations.store.messages(name)
    assert system == "Answer briefly." and [m["content"] for m in held[:3]] == ["Hello there", "Hi! How can I help?",
                                                                               "Name a colour."]
    more = told + [{"role": "assistant", "content": first.choices[0].message.content},
                   {"role": "user", "content": "Another one."}]
    second, again = ask(c, more)
    assert again == name and second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_a_pinned_conversation_continues_by_name(serve):
    service = serve()
    c = client(service)
    first, name = ask(c, [{"role": "user", "content": "One"}], extra_body={"conversation": "notes"})
    assert name == PREFIX + "notes"
    second, again = ask(c, [{"role": "user", "content": "One"},
                            {"role": "assistant", "content": first.choices[0].message.content},
                            {"role": "user", "content": "Two"}], extra_body={"conversation": "notes"})
    assert again == name and second.usage.prompt_tokens_details.cached_tokens > 0


def test_stop_sequences_end_the_answer_before_them(serve):
    service = serve()
    c = client(service)
    messages = [{"role": "user", "content": "Count for me."}]
    free, _ = ask(c, messages, max_tokens=30, extra_body={"ignore_eos": True})
    text = free.choices[0].message.content
    stop = text[10:13]
    cut, _ = ask(c, messages, max_tokens=30, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].message.content == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_the_client_sees_one_sentence_errors(serve):
    service = serve()
    with pytest.raises(openai.BadRequestError) as err:
        client(service).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2)
    assert err.value.status_code == 400 and "`n` must be 1" in err.value.message


def test_the_least_recently_used_saved_conversations_go_past_the_bound(serve):
    service = serve(saved=2)
    c = client(service)
    names = [ask(c, [{"role": "user", "content": f"Question {i}"}], max_tokens=2)[1] for i in range(3)]
    held = [info.name for info in service.conversations.store.list()]
    assert sorted(held) == sorted(names[1:])


def test_asking_the_last_question_again_answers_it_from_the_cache_before_it(serve):
    service = serve()
    c = client(service)
    first_q = [{"role": "user", "content": f"Read this: {DOC}\nWhat is the pass key?"}]
    first, name = ask(c, first_q)
    follow = first_q + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "When do boats leave?"}]
    second, _ = ask(c, follow)
    again, again_name = ask(c, follow)  # "regenerate"
    assert again_name == name
    assert again.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens_details.cached_tokens
    assert again.choices[0].message.content == second.choices[0].message.content  # greedy: the same answer
    assert len(service.conversations.store.messages(name)[1]) == 4


def test_a_requests_stops_come_beside_the_models_own():
    """A plain prompt layout (a base model's card) ends its answers at its stop; a request's stops add to it."""
    from localchat.engine.sampling import GenerationSettings
    from localchat.server import turns

    base = GenerationSettings(stop=("\n",))
    assert turns.settings(base).stop == ("\n",)
    assert turns.settings(base, stop=("END", "\n")).stop == ("\n", "END")
    assert turns.settings(GenerationSettings(), stop=("END",)).stop == ("END",)
