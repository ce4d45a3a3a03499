"""Load over real HTTP: a client that goes away stops its answer and keeps nothing of it; a full queue answers 503;
eight clients at once on eight documents each get their own conversation."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from localchat.server.app import HEADER

LONG = {"max_tokens": 8000, "ignore_eos": True}  # an answer that runs until it is stopped


def _wait(what, seconds: float = 60.0) -> None:
    end = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < end, "the server did not get there"
        time.sleep(0.05)


def _post(service, body: dict) -> httpx.Response:
    return httpx.post(service.url + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=120)


def _first_chunk_then_leave(service, body: dict) -> None:
    """Open a streamed answer, read its first piece, and disconnect."""
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", service.url + "/v1/chat/completions",
                         json={"model": "tiny", "stream": True, **body}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)


def test_a_disconnect_stops_the_answer_and_the_conversation_is_unchanged(serve):
    service = serve()
    first_q = [{"role": "user", "content": "Remember the word lantern."}]
    r = _post(service, {"messages": first_q})
    name, answer = r.headers[HEADER], r.json()["choices"][0]["message"]["content"]
    follow = first_q + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Say it again."}]
    _first_chunk_then_leave(service, {"messages": follow, **LONG})
    _wait(lambda: service.worker.current is None)  # 8000 tokens would take minutes: it stopped
    assert len(service.conversations.store.messages(name)[1]) == 2  # nothing of the abandoned turn was saved
    again = _post(service, {"messages": follow, "max_tokens": 4})
    assert again.headers[HEADER] == name and again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert len(service.conversations.store.messages(name)[1]) == 4


def test_a_full_queue_answers_503_with_retry_after(serve):
    service = serve(waiting=1)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", service.url + "/v1/chat/completions",
                         json={"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "Talk."}],
                               **LONG}) as running:
            lines = running.iter_lines()
            next(lines)  # it runs
            waiting = ThreadPoolExecutor(1).submit(_post, service, {"messages": [{"role": "user", "content": "Hi"}],
                                                                    "max_tokens": 2})
            _wait(lambda: service.worker.jobs.qsize() == 1)  # it waits
            refused = _post(service, {"messages": [{"role": "user", "content": "Me too"}]})
            assert refused.status_code == 503 and int(refused.headers["Retry-After"]) > 0
            assert refused.json()["error"]["type"] == "server_busy"
            with pytest.raises(openai.APIStatusError) as err:
                openai_client(service).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
            assert err.value.status_code == 503
        assert waiting.result().status_code == 200  # served once the running one was abandoned


def openai_client(service):
    return openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0)


def test_eight_clients_on_eight_documents_each_get_their_own_conversation(serve):
    service = serve(waiting=8, keep=3)  # fewer in memory than clients: some continue from the store
    keys = [f"{41000 + 137 * i}" for i in range(8)]

    def client(i: int) -> tuple[str, str, dict]:
        c = openai_client(service)
        doc = f"Log {i}. " + "Nothing happened today. " * 6 + f"The pass key is {keys[i]}. " + "The end. " * 4
        q = [{"role": "user", "content": f"{doc}\nWhat is the pass key?"}]
        raw = c.chat.completions.with_raw_response.create(model="tiny", messages=q, max_tokens=6)
        first = raw.parse()
        follow = q + [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": f"Client {i}: repeat it."}]
        raw2 = c.chat.completions.with_raw_response.create(model="tiny", messages=follow, max_tokens=6)
        return raw.headers[HEADER], raw2.headers[HEADER], raw2.parse().usage.model_dump()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(client, range(8)))
    names = [first for first, _, _ in results]
    assert len(set(names)) == 8
    for i, (first, second, usage) in enumerate(results):
        assert second == first  # the follow-up continued its own conversation
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        _, held = service.conversations.store.messages(first)
        assert len(held) == 4 and f"The pass key is {keys[i]}." in held[0]["content"]
        assert held[2]["content"] == f"Client {i}: repeat it."
        assert all(keys[j] not in held[0]["content"] for j in range(8) if j != i)
