"""Ollama's API: /api/chat and /api/generate (NDJSON lines when streaming, its default), /api/tags, /api/show,
/api/version.

Fields read in /api/chat: model, messages, stream, options (num_predict, temperature, top_p, seed, stop), and our
`conversation`; format, keep_alive and think are accepted and ignored; tools and images are refused (text only).
Errors are Ollama's shape, {"error": "one sentence"}, which its clients read.
"""

from __future__ import annotations

import hashlib
import time
from datetime import datetime, timezone

from localchat.engine.events import Done
from localchat.engine.sampling import GenerationSettings
from localchat.server import turns
from localchat.server.turns import MAX_NEW, BadRequest, Turn


def parse(body: dict, defaults: GenerationSettings) -> Turn:
    """/api/chat."""
    return _turn(body, defaults, turns.messages(body, parts=False))


def parse_generate(body: dict, defaults: GenerationSettings) -> Turn:
    """/api/generate: `prompt` (and `system`) as a one-question conversation."""
    prompt = turns.get(body, "prompt", str, "a string")
    if not prompt or not prompt.strip():
        raise BadRequest("`prompt` must be a non-empty string", "prompt", "invalid_value")
    turns.text(prompt, "prompt")
    if body.get("images"):
        raise BadRequest("`images` is not supported: this server reads text only", "images", "unsupported")
    system = turns.get(body, "system", str, "a string")
    if system:
        turns.text(system, "system")
    return _turn(body, defaults, [*([{"role": "system", "content": system}] if system else []),
                                  {"role": "user", "content": prompt}])


def _turn(body: dict, defaults: GenerationSettings, messages: list[dict]) -> Turn:
    turns.get(body, "model", str, "a string")
    if turns.get(body, "tools", list, "a list"):
        raise BadRequest("`tools` is not supported: this server has no tool calls", "tools", "unsupported")
    stream = turns.get(body, "stream", bool, "a boolean")
    options = turns.get(body, "options", dict, "an object") or {}
    max_new = turns.number(options, "num_predict", -2, MAX_NEW, "options.num_predict", integer=True)
    settings = turns.settings(
        defaults, max_new=max_new if max_new is not None and max_new > 0 else None,
        temperature=turns.number(options, "temperature", 0, 2, "options.temperature"),
        top_p=turns.number(options, "top_p", 0, 1, "options.top_p", open_low=True),
        seed=turns.number(options, "seed", -2**63, 2**63 - 1, "options.seed", integer=True),
        stop=turns.stops(options.get("stop"), "options.stop"))
    if max_new == 0:
        raise BadRequest("`options.num_predict` must be positive, or -1 for the server's limit", "options.num_predict",
                         "invalid_value")
    return Turn(messages, settings, stream is not False, turns.conversation(body))


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _text(text: str, generate: bool) -> dict:
    return {"response": text} if generate else {"message": {"role": "assistant", "content": text}}


def line(model: str, text: str, generate: bool = False) -> dict:
    return {"model": model, "created_at": now(), **_text(text, generate), "done": False}


def final(model: str, done: Done, text: str, started: float, generate: bool = False) -> dict:
    ns = 1_000_000_000
    return {"model": model, "created_at": now(), **_text(text, generate), "done": True,
            "done_reason": "length" if done.stop_reason == "length" else "stop",
            "total_duration": int((time.perf_counter() - started) * ns), "load_duration": 0,
            "prompt_eval_count": done.prompt_tokens, "prompt_eval_duration": int(done.prefill_s * ns),
            "eval_count": done.new_tokens, "eval_duration": int(done.decode_s * ns)}


class Facts:
    """What /api/tags and /api/show say of the one resident model."""

    def __init__(self, engine, name: str):
        config = engine.model.config
        params = list(engine.model.parameters())
        self.name = name
        self.family = getattr(config, "model_type", "unknown")
        self.count = sum(p.numel() for p in params)
        self.size = sum(p.numel() * p.element_size() for p in params)
        self.digest = hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()
        self.level = (engine.weights or str(params[0].dtype).removeprefix("torch.")).upper()
        self.window = engine.window or 0
        self.template = getattr(engine.tokenizer, "chat_template", None) or ""
        self.modified = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")

    def details(self) -> dict:
        size = f"{self.count / 1e9:.1f}B" if self.count >= 1e9 else f"{self.count / 1e6:.0f}M"
        return {"parent_model": "", "format": "safetensors", "family": self.family, "families": [self.family],
                "parameter_size": size, "quantization_level": self.level}

    def tags(self) -> dict:
        return {"models": [{"name": self.name, "model": self.name, "modified_at": self.modified, "size": self.size,
                            "digest": self.digest, "details": self.details()}]}

    def show(self) -> dict:
        return {"modelfile": f"# served by localchat\nFROM {self.name}\n", "parameters": "", "template": self.template,
                "details": self.details(), "modified_at": self.modified, "capabilities": ["completion"],
                "model_info": {"general.architecture": self.family, "general.parameter_count": self.count,
                               f"{self.family}.context_length": self.window}}
