"""OpenAI's chat completions: the request's fields, and chat.completion / chat.completion.chunk objects.

Fields read: model, messages (text, or lists of text parts), stream, stream_options.include_usage, max_tokens or
max_completion_tokens, temperature, top_p, seed, stop, n (1 only), user; two of our own, `conversation` (pins a
conversation by name) and `ignore_eos` (as llama.cpp's server has it). Other fields are ignored, except `tools`,
which is refused: this server has no tool calls.
"""

from __future__ import annotations

import time
import uuid

from localchat.engine.events import Done
from localchat.engine.sampling import GenerationSettings
from localchat.server import turns
from localchat.server.turns import MAX_NEW, BadRequest, Turn

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def parse(body: dict, defaults: GenerationSettings) -> Turn:
    turns.get(body, "model", str, "a string")
    turns.get(body, "user", str, "a string")
    n = turns.number(body, "n", 1, 128, integer=True)
    if n is not None and n != 1:
        raise BadRequest(f"`n` must be 1: this server writes one answer per request (got {n})", "n", "invalid_value")
    if turns.get(body, "tools", list, "a list"):
        raise BadRequest("`tools` is not supported: this server has no tool calls", "tools", "unsupported")
    stream = bool(turns.get(body, "stream", bool, "a boolean"))
    options = turns.get(body, "stream_options", dict, "an object") or {}
    usage = turns.get(options, "include_usage", bool, "a boolean", "stream_options.include_usage")
    max_new = turns.number(body, "max_completion_tokens", 1, MAX_NEW, integer=True)
    if max_new is None:
        max_new = turns.number(body, "max_tokens", 1, MAX_NEW, integer=True)
    settings = turns.settings(
        defaults, max_new=max_new, temperature=turns.number(body, "temperature", 0, 2),
        top_p=turns.number(body, "top_p", 0, 1, open_low=True), seed=turns.number(body, "seed", -2**63, 2**63 - 1, integer=True),
        stop=turns.stops(body.get("stop"), "stop"), ignore_eos=turns.get(body, "ignore_eos", bool, "a boolean"))
    return Turn(turns.messages(body, parts=True), settings, stream, turns.conversation(body), bool(usage))


def new_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def usage(prompt: int, cached: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion(cid: str, model: str, done: Done, use: dict) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                         "logprobs": None, "finish_reason": FINISH.get(done.stop_reason, "stop")}],
            "usage": use}


def chunk(cid: str, model: str, delta: dict, finish: str | None = None, with_usage: bool = False) -> dict:
    out = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if with_usage:
        out["usage"] = None
    return out


def usage_chunk(cid: str, model: str, use: dict) -> dict:
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [], "usage": use}


def models(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "localchat"}]}


def error(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
