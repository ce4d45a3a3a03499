"""A real Open WebUI instance in front of `localchat serve`: a chat with an uploaded file in whole-document mode,
through Open WebUI's own API, reads the document once (in both of its layouts).

Excluded by default (`-m openwebui` runs it). It needs Open WebUI in a virtual environment of its own (about
3 GB, 14 minutes to install here), named by LOCALCHAT_OPEN_WEBUI:

    python3 -m venv /tmp/owui-venv && /tmp/owui-venv/bin/pip install torch==2.13.0 open-webui==0.12.4
    LOCALCHAT_OPEN_WEBUI=/tmp/owui-venv/bin/open-webui python -m pytest -m openwebui tests/server/test_open_webui_instance.py

Open WebUI runs offline (no model hub: its embedding model fails to load, which whole-document mode does not
need), without sign-in, with every file read whole (BYPASS_EMBEDDING_AND_RETRIEVAL)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request

import pytest

pytestmark = pytest.mark.openwebui

DOCUMENT = "\n".join([f"Line {i}: the harbour log notes tide {i % 7} and crew {i % 5}." for i in range(60)]
                     + ["The pass key is 48213."] + [f"Entry {i}: boats leave at {i % 12}." for i in range(40)])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(url: str, token: str | None = None, body: dict | None = None, files: tuple[str, str] | None = None) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None
    if files is not None:  # one multipart field "file"
        name, text = files
        edge = "localchat-test-boundary"
        data = (f"--{edge}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n"
                f"Content-Type: text/plain\r\n\r\n{text}\r\n--{edge}--\r\n").encode()
        headers["Content-Type"] = f"multipart/form-data; boundary={edge}"
    elif body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=600) as r:
        return json.load(r)


@pytest.fixture
def open_webui(tmp_path):
    """`start(openai_url, **env)`: an Open WebUI instance on 127.0.0.1; returns its base URL and an admin token."""
    exe = os.environ.get("LOCALCHAT_OPEN_WEBUI")
    if not exe or not os.access(exe, os.X_OK):
        pytest.fail("set LOCALCHAT_OPEN_WEBUI to an `open-webui` executable (install steps: this file's docstring)")
    running = []

    def start(openai_url: str, **extra) -> tuple[str, str]:
        port = _port()
        env = {**os.environ, "DATA_DIR": str(tmp_path / f"owui-{len(running)}"), "OFFLINE_MODE": "true",
               "HF_HUB_OFFLINE": "1", "WEBUI_AUTH": "False", "ENABLE_OLLAMA_API": "False",
               "OPENAI_API_BASE_URL": openai_url, "OPENAI_API_KEY": "unused", "BYPASS_EMBEDDING_AND_RETRIEVAL": "True",
               "RAG_EMBEDDING_MODEL_AUTO_UPDATE": "False", "WEBUI_SECRET_KEY": "test", "ENABLE_TITLE_GENERATION": "False",
               "ENABLE_FOLLOW_UP_GENERATION": "False", "ENABLE_TAGS_GENERATION": "False",
               "ENABLE_AUTOCOMPLETE_GENERATION": "False", "ENABLE_VERSION_UPDATE_CHECK": "False", **extra}
        (tmp_path / f"owui-{len(running)}").mkdir()
        log = open(tmp_path / f"owui-{len(running)}.log", "w")
        proc = subprocess.Popen([exe, "serve", "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        running.append(proc)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                _call(base + "/health")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, \
                    (tmp_path / f"owui-{len(running) - 1}.log").read_text()[-3000:]
                time.sleep(2)
        token = _call(base + "/api/v1/auths/signin", body={"email": "admin@localhost", "password": "admin"})["token"]
        return base, token

    yield start
    for proc in running:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("system_context", [False, True])
def test_a_chat_with_a_whole_document_reads_it_once(serve, open_webui, capfd, system_context):
    service = serve()
    base, token = open_webui(service.url + "/v1", RAG_SYSTEM_CONTEXT=str(system_context))
    model = _call(base + "/api/models", token)["data"][0]["id"]
    file_id = _call(base + "/api/v1/files/", token, files=("report.txt", DOCUMENT))["id"]
    deadline = time.monotonic() + 120
    while _call(f"{base}/api/v1/files/{file_id}", token)["data"].get("status") != "completed":
        assert time.monotonic() < deadline, "Open WebUI did not finish reading the file"
        time.sleep(1)
    attached = [{"type": "file", "id": file_id, "name": "report.txt", "context": "full"}]

    def chat(messages):
        out = _call(base + "/api/chat/completions", token, {"model": model, "messages": messages, "stream": False,
                                                             "files": attached})
        return out["choices"][0]["message"]["content"], out["usage"]

    first = [{"role": "user", "content": "What is the pass key?"}]
    a1, u1 = chat(first)
    assert u1["prompt_tokens_details"]["cached_tokens"] == 0 and u1["prompt_tokens"] > len(DOCUMENT) // 2
    a2, u2 = chat([*first, {"role": "assistant", "content": a1}, {"role": "user", "content": "When do boats leave?"}])
    assert u2["prompt_tokens_details"]["cached_tokens"] >= u1["prompt_tokens"]
    assert u2["prompt_tokens"] - u2["prompt_tokens_details"]["cached_tokens"] < 80
    names = [c.name for c in service.conversations.store.list()]
    assert len(names) == 1  # one conversation: nothing read twice, no other request stored
    if not system_context:
        assert "goes on without reading it again" in capfd.readouterr().err
