"""Bad input gets a 4xx with one sentence that names the field, in OpenAI's error shape (Ollama's under /api)."""

from __future__ import annotations

import httpx
import pytest
from tiny import tiny_llama

from localchat.cli import main
from localchat.engine.engine import Engine
from localchat.engine.policies import policy_class

QUESTION = [{"role": "user", "content": "hi"}]


def _post(service, body, path="/v1/chat/completions", **kw) -> httpx.Response:
    if isinstance(body, dict):
        kw["json"] = body
    else:
        kw["content"] = body
    return httpx.post(service.url + path, timeout=60, **kw)


def _refused(r: httpx.Response, status: int, param, words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"]
    assert error["message"].count(". ") == 0 and "\n" not in error["message"]  # one sentence


@pytest.mark.parametrize("body, param, words", [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "must be a JSON object"),
    ({"model": "tiny"}, "messages", "`messages` must be a non-empty list"),
    ({"messages": "hello"}, "messages", "`messages` must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "must be one of system, user, assistant"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be a string (got a number)"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]", "text part"),
    ({"messages": QUESTION + [{"role": "assistant", "content": "yo"}]}, "messages[1].role", "must be a user message"),
    ({"messages": [{"role": "user", "content": "  "}]}, "messages[0].content", "is empty"),
    ({"messages": QUESTION, "temperature": "hot"}, "temperature", "`temperature` must be a number (got a string)"),
    ({"messages": QUESTION, "temperature": 7}, "temperature", "from 0 to 2"),
    ({"messages": QUESTION, "max_tokens": 1.5}, "max_tokens", "must be an integer"),
    ({"messages": QUESTION, "max_tokens": 0}, "max_tokens", "from 1 to"),
    ({"messages": QUESTION, "top_p": 0}, "top_p", "above 0"),
    ({"messages": QUESTION, "seed": True}, "seed", "must be an integer (got a boolean)"),
    ({"messages": QUESTION, "stop": [1]}, "stop", "a string or a list of strings"),
    ({"messages": QUESTION, "stream": "yes"}, "stream", "must be a boolean"),
    ({"messages": QUESTION, "n": 2}, "n", "`n` must be 1"),
    ({"messages": QUESTION, "tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"messages": QUESTION, "conversation": "../../etc"}, None, ""),  # a name, never a path: accepted
])
def test_malformed_requests_are_refused_in_one_sentence(serve, body, param, words):
    r = _post(serve(), body)
    if not words:
        assert r.status_code == 200 and r.headers["X-Localchat-Conversation"] == "serve-../../etc"
        return
    _refused(r, 400, param, words)


def test_an_oversized_body_is_refused(serve):
    r = _post(serve(max_body=4096), {"messages": [{"role": "user", "content": "x" * 5000}]})
    _refused(r, 413, None, "larger than")


def test_a_prompt_no_plan_can_hold_is_refused_before_reading(serve, tiny_tok):
    engine = Engine(tiny_llama(len(tiny_tok), window=256), tiny_tok, name="tiny", chunk=128,
                    policy=policy_class("full")())
    r = _post(serve(engine), {"messages": [{"role": "user", "content": "word " * 200}]})
    _refused(r, 400, "messages", "reads at most 256")
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_ollama_routes_answer_in_ollama_shape(serve):
    service = serve()
    r = _post(service, b"{", "/api/chat")
    assert r.status_code == 400 and list(r.json()) == ["error"] and "not valid JSON" in r.json()["error"]
    r = _post(service, {"model": "tiny", "messages": QUESTION, "options": {"num_predict": "many"}}, "/api/chat")
    assert r.status_code == 400 and r.json()["error"] == "`options.num_predict` must be an integer (got a string)"


def test_an_api_key_is_required_when_set(serve):
    service = serve(api_key="s3cret")
    assert httpx.get(service.url + "/v1/models").status_code == 401
    assert httpx.get(service.url + "/api/tags", headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = _post(service, {"messages": QUESTION}, headers={"Authorization": "Bearer s3cret"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"


def test_listening_beyond_this_machine_needs_an_api_key(capsys):
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("localchat: error: --host 0.0.0.0 is reachable from other machines") and "\n" not in err
    assert main(["serve", "--api-key", " "]) == 2


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'),
    ("/api/chat", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800"}]}'),
    ("/api/generate", b'{"model": "tiny", "prompt": "hi \\ud800"}'),
])
def test_text_that_is_not_unicode_is_refused_in_one_line(serve, path, body):
    r = _post(serve(), body, path, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    message = r.json()["error"] if path.startswith("/api/") else r.json()["error"]["message"]
    assert "is not valid text" in message and "\n" not in message


def test_a_client_gone_mid_request_is_one_line_in_the_log(serve, capfd):
    import socket
    import time

    service = serve()
    capfd.readouterr()
    with socket.create_connection((service.host, service.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{")
        time.sleep(0.3)
    time.sleep(1.0)
    assert _post(service, {"messages": QUESTION}).status_code == 200  # the server goes on
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ClientDisconnect" not in err
    assert [line for line in err.splitlines() if line.strip()] == [
        "localchat: a client went away while sending its request to /v1/chat/completions"]


def test_an_engine_failure_is_a_500_in_one_sentence_and_one_log_line(serve, capfd, monkeypatch):
    service = serve()

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded\nat line 3")
        yield  # pragma: no cover - a generator

    monkeypatch.setattr(service.conversations.engine, "continue_on", broken)
    capfd.readouterr()
    r = _post(service, {"messages": QUESTION})
    assert r.status_code == 500 and r.json()["error"]["message"] == "the engine failed: kernel exploded"
    assert r.json()["error"]["code"] == "server_error"
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and "kernel exploded" in err
