"""`localchat bench serve`: time to first token through the HTTP API, first question against follow-ups.

Each server runs as a child process on 127.0.0.1 and is asked, with streamed chat completions: a question about a
long pass-key document (the app's prompt layout), a follow-up in the same conversation, then, after the server
is stopped and started again, a second follow-up. Time to first token is measured at the client, from sending the
request to the first piece of answer text; peak memory is the server process's peak RSS (VmHWM). The peer is
llama.cpp's server (llama-cpp-python's `server` extra) on the same GGUF the embedded default model comes from; it
keeps the last prompt's KV cache in memory, so its follow-up reuses it, and its follow-up after a restart reads the
whole conversation again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from localchat.bench import machine
from localchat.errors import UserError

QUESTIONS = ("What is the pass key?", "Say the pass key once more, digits only.", "What was the pass key again?")
TURNS = ("first question", "follow-up", "follow-up after restart")


@dataclass
class ServeConfig:
    out: Path
    model: str | None = None
    length: int = 7600
    answer_tokens: int = 16
    seed: int = 0
    peer: str | None = None
    extra: tuple[str, ...] = ()  # further `localchat serve` flags (policy, budget, weights ...)
    layouts: tuple[str, ...] = ("app",)  # where the client puts the document (LAYOUTS)
    command: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    """A server process; `url` once it listens."""

    def __init__(self, argv: list[str], env: dict, ready: str, timeout: float = 900.0):
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.url = None
        self.log: list[str] = []
        deadline = time.monotonic() + timeout
        while self.url is None:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise UserError(f"{argv[2]} did not start: {' | '.join(self.log[-3:])[:400]}")
            self.log.append(line.strip())
            found = re.search(ready, line)
            self.url = found.group(1) if found else None

    def peak_mib(self) -> float | None:
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        found = re.search(r"VmHWM:\s+(\d+) kB", status)
        return round(int(found.group(1)) / 1024, 1) if found else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _localchat(config: ServeConfig, data: Path) -> Child:
    argv = [sys.executable, "-m", "localchat", *(["--model", config.model] if config.model else []), "serve",
            "--port", "0", "--max-new-tokens", str(config.answer_tokens), *config.extra]
    env = {**os.environ, "LOCALCHAT_DATA_DIR": str(data)}
    return Child(argv, env, r"at (http://127\.0\.0\.1:\d+):")


def _llama_cpp(gguf: Path, n_ctx: int) -> Child:
    port, threads = _free_port(), str(os.cpu_count() or 1)
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_ctx", str(n_ctx), "--host",
            "127.0.0.1", "--port", str(port), "--n_threads", threads, "--n_threads_batch", threads, "--n_batch", "512"]
    return Child(argv, dict(os.environ), r"Uvicorn running on (http://127\.0\.0\.1:\d+)")


def ask(url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat completion: time to the first text, the text, and the usage when the server gives it."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    t0 = time.perf_counter()
    ttft, pieces, usage = None, [], None
    stream = client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            pieces.append(chunk.choices[0].delta.content)
        if getattr(chunk, "usage", None):
            usage = chunk.usage.model_dump()
    return {"ttft_s": round(ttft if ttft is not None else time.perf_counter() - t0, 3),
            "total_s": round(time.perf_counter() - t0, 3), "answer": "".join(pieces), "usage": usage}


LAYOUTS = {  # where a client puts the document: the messages of the request for turns [(question, answer | None)]
    "app": "the document in the first question, as the chat window lays it out; follow-ups after it",
    "open-webui": "Open WebUI's whole-document mode: its RAG template with the document in front of the last "
                  "question every turn, bare questions in the history",
    "open-webui-system": "Open WebUI with RAG_SYSTEM_CONTEXT=true: the filled template is the system message",
    "in-place": "Open WebUI's first request, then the document stays where it was read (a plain extension)",
}
FILE_ID = "5f0c8a2e-0d1b-4f8e-9a51-3c2b7e6d4f10"  # an Open WebUI file id (any uuid)


def layout_messages(layout: str, document: str, turns: list[tuple[str, str | None]]) -> list[dict]:
    """The request's messages for the last of `turns` (its answer None) in `layout`."""
    from localchat.bench import webui
    from localchat.bench.tasks import as_document
    from localchat.render import user_turn

    files = [("report.txt", FILE_ID, document)]
    if layout in ("open-webui", "open-webui-system"):
        return webui.request(turns, files, system_context=layout == "open-webui-system")
    first = user_turn(turns[0][0], [as_document(document)]) if layout == "app" else \
        webui.request([(turns[0][0], None)], files)[-1]["content"]
    messages = [{"role": "user", "content": first}]
    for (_, answer), (question, _) in zip(turns, turns[1:]):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
    return messages


def conversation(start, document: str, key: str, answer_tokens: int, say, layout: str = "app") -> dict:
    """First question, follow-up, restart, follow-up; `start()` starts the server anew."""
    rows, peaks, turns = [], [], []
    server = start()
    try:
        for i, question in enumerate(QUESTIONS):
            if i == 2:  # the restart
                peaks.append(server.peak_mib())
                server.stop()
                server = start()
            turns.append((question, None))
            row = ask(server.url, layout_messages(layout, document, turns), answer_tokens)
            row["has_key"] = key in row["answer"]
            say(f"  {TURNS[i]}: first token after {row['ttft_s']:.2f} s")
            rows.append(row)
            turns[-1] = (question, row["answer"])
        peaks.append(server.peak_mib())
    finally:
        server.stop()
    return {"turns": rows, "peak_mib": max((p for p in peaks if p is not None), default=None)}


def run(config: ServeConfig, say=lambda s: None) -> Path:
    from transformers import AutoTokenizer

    from localchat.bench import peer as peers
    from localchat.bench.tasks import as_document, passkey
    from localchat.engine.default_model import ensure_default_model
    from localchat.render import user_turn

    if config.peer is not None:
        peers.check_peer(config.peer, config.model)
    if config.model is not None and config.model.endswith(".gguf"):
        gguf = Path(config.model).expanduser()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    else:
        gguf = None
        tokenizer = AutoTokenizer.from_pretrained(config.model or str(ensure_default_model()))
    sample = passkey(tokenizer, config.length, seed=config.seed, depth=0.5)
    document = user_turn(QUESTIONS[0], [as_document(sample.document)])
    doc_tokens = len(tokenizer(document, add_special_tokens=False)["input_ids"])
    config.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for layout in config.layouts:
        name = "localchat" if layout == "app" else f"localchat, {layout}"
        say(f"localchat serve, a {doc_tokens:,}-token question, {layout} layout")
        with tempfile.TemporaryDirectory(prefix="localchat-serve-") as data:  # the server's store: scratch
            results[name] = conversation(lambda d=data: _localchat(config, Path(d)), sample.document, sample.answer,
                                         config.answer_tokens, say, layout)
        results[name]["layout"] = layout
    if config.peer is not None:
        if not peers.available():
            results[config.peer] = {"missing": f"not installed; to measure it: {peers.INSTALL}"}
        else:
            gguf = gguf or peers.default_gguf()
            say(f"{config.peer} server on {gguf.name}")
            n_ctx = doc_tokens + 4 * config.answer_tokens + 256
            results[config.peer] = conversation(lambda: _llama_cpp(gguf, n_ctx), sample.document, sample.answer,
                                                config.answer_tokens, say)
    report = {"command": config.command, "document_tokens": doc_tokens, "answer_tokens": config.answer_tokens,
              "questions": list(QUESTIONS), "pass_key": sample.answer, "results": results,
              "hardware": machine.hardware(), "versions": machine.versions()}
    (config.out / "serve.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    path = config.out / "serve.md"
    path.write_text(markdown(report), encoding="utf-8")
    return path


def markdown(r: dict) -> str:
    hw, v = r["hardware"], r["versions"]
    lines = [f"# Time to first token through the HTTP API: {r['document_tokens']:,}-token document", "",
             f"`{r['command']}`", "",
             f"{hw['cpu']}, {hw['cores']} cores; torch {v['torch']}, localchat {v['localchat']} ({v['commit']})", "",
             "| server | first question | follow-up | follow-up after restart | peak RSS | pass key in answers |",
             "|---|---|---|---|---|---|"]
    for name, res in r["results"].items():
        if "missing" in res:
            lines.append(f"| {name} | {res['missing']} | | | | |")
            continue
        t = res["turns"]
        first = t[0]["ttft_s"]
        cells = [f"{first:.2f} s"] + [f"{x['ttft_s']:.2f} s ({x['ttft_s'] / first:.3f}x)" for x in t[1:]]
        peak = f"{res['peak_mib']:,.0f} MiB" if res["peak_mib"] else "?"
        lines.append(f"| {name} | {' | '.join(cells)} | {peak} | {sum(x['has_key'] for x in t)} of {len(t)} |")
    lines += ["", "Time to first token at the client, streamed; the follow-ups continue the same conversation "
              "(the answers sent back as text). Peak RSS of the server process over its two runs (the larger)."]
    used = [res["layout"] for res in r["results"].values() if "layout" in res]
    lines += [""] + [f"- {layout}: {LAYOUTS[layout]}" for layout in used]
    answers = {res["layout"]: [t["answer"] for t in res["turns"]] for res in r["results"].values() if "layout" in res}
    if "in-place" in answers and "open-webui" in answers:  # the system layout is its own in-place conversation
        same = sum(a == b for a, b in zip(answers["open-webui"], answers["in-place"]))
        lines.append(f"- open-webui: {same} of {len(answers['open-webui'])} answers the same as in-place's")
    for name, res in r["results"].items():
        for i, x in enumerate(res.get("turns", [])):
            if x.get("usage") and x["usage"].get("prompt_tokens_details"):
                u = x["usage"]
                lines.append(f"- {name}, question {i + 1}: {u['prompt_tokens']:,} prompt tokens, "
                             f"{u['prompt_tokens_details']['cached_tokens']:,} of them from the cache")
    return "\n".join(lines) + "\n"
