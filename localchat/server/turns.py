"""A chat request as one value, whichever API it came through, and the checks its fields share."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from localchat.engine.sampling import GenerationSettings
from localchat.errors import UserError, check_text

ROLES = ("system", "user", "assistant")
MAX_NEW = 32768  # the longest answer a request may ask for
MAX_STOPS = 16


class BadRequest(Exception):
    """A request the server refuses: `status`, and one sentence that names the field (`param`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


@dataclass
class Turn:
    """Messages (the last one the user's question) and how to answer them."""

    messages: list[dict]
    settings: GenerationSettings
    stream: bool
    conversation: str | None = None  # a name that pins the conversation (the `conversation` field)
    usage_in_stream: bool = False  # OpenAI's stream_options.include_usage

    @property
    def question(self) -> str:
        return self.messages[-1]["content"]


def refusal(problem) -> BadRequest:
    """An exception, or the engine's Error event, as the request's answer (localchat/turn.py's one mapping)."""
    from localchat.turn import failure

    if isinstance(problem, BadRequest):
        return problem
    found = failure(problem)
    param = "messages" if found.kind in ("input", "too_long") else None
    return BadRequest(found.message[:300], param, found.code, found.http_status)


def text(value: str, param: str) -> str:
    """`value` when it is text that can be read (no lone surrogate, as a JSON escape such as \\ud800 gives)."""
    try:
        return check_text(value, f"`{param}`")
    except UserError as exc:
        raise BadRequest(str(exc), param, "invalid_value") from None


def _kind(value) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def wrong(param: str, want: str, value) -> BadRequest:
    return BadRequest(f"`{param}` must be {want} (got {_kind(value)})", param, "invalid_type")


def get(body: dict, name: str, want: type | tuple, what: str, param: str | None = None):
    """body[name] when present and not null, checked against `want`; None when absent."""
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, want) and not (isinstance(value, bool) and bool not in (want if isinstance(want, tuple) else (want,)))
    if not ok:
        raise wrong(param or name, what, value)
    return value


def number(body: dict, name: str, low: float, high: float, param: str | None = None, *, integer: bool = False,
           open_low: bool = False):
    """A number field in [low, high] ((low, high] with `open_low`), or None when absent."""
    param = param or name
    value = get(body, name, int if integer else (int, float), "an integer" if integer else "a number", param)
    if value is None:
        return None
    if not math.isfinite(value) or value < low or value > high or (open_low and value == low):
        span = f"{'above' if open_low else 'from'} {low:g} {'up ' if open_low else ''}to {high:g}"
        raise BadRequest(f"`{param}` must be {span} (got {value})", param, "invalid_value")
    return value


def text_of(content, param: str) -> str:
    """A message's text: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return text(content, param)
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"`{param}[{i}]` must be a text part ({{\"type\": \"text\", \"text\": ...}}); "
                                 f"this server reads text only", f"{param}[{i}]", "invalid_value")
            parts.append(text(part["text"], f"{param}[{i}].text"))
        return "".join(parts)
    raise wrong(param, "a string", content)


def messages(body: dict, *, parts: bool) -> list[dict]:
    """The `messages` list as [{"role", "content"}], checked: known roles, text content, the last one a user's."""
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise BadRequest("`messages` must be a non-empty list of messages", "messages",
                         "invalid_type" if not isinstance(value, list) else "invalid_value")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise wrong(where, "an object with `role` and `content`", m)
        role = m.get("role")
        if role not in ROLES:
            raise BadRequest(f"`{where}.role` must be one of {', '.join(ROLES)} (got {str(role)[:40]!r})",
                             f"{where}.role", "invalid_value")
        if m.get("images") or m.get("tool_calls"):
            name = "images" if m.get("images") else "tool_calls"
            raise BadRequest(f"`{where}.{name}` is not supported: this server reads text only", f"{where}.{name}",
                             "unsupported")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        out.append({"role": role, "content": text_of(content, f"{where}.content") if parts else
                    _plain(content, f"{where}.content")})
    if out[-1]["role"] != "user":
        raise BadRequest(f"`messages[{len(out) - 1}]` must be a user message: the last message is the question",
                         f"messages[{len(out) - 1}].role", "invalid_value")
    if not out[-1]["content"].strip():
        raise BadRequest(f"`messages[{len(out) - 1}].content` is empty: give a question",
                         f"messages[{len(out) - 1}].content", "invalid_value")
    return out


def _plain(content, param: str) -> str:
    if not isinstance(content, str):
        raise wrong(param, "a string", content)
    return text(content, param)


def stops(value, param: str) -> tuple[str, ...]:
    """`stop`: a string or a list of strings."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise wrong(param, "a string or a list of strings", value)
    if len(items) > MAX_STOPS or any(not s for s in items):
        raise BadRequest(f"`{param}` must hold 1 to {MAX_STOPS} non-empty strings", param, "invalid_value")
    return tuple(items)


def settings(base: GenerationSettings, *, max_new=None, temperature=None, top_p=None, seed=None, stop=(),
             ignore_eos=None) -> GenerationSettings:
    """The server's defaults with what the request set. The request's stops come beside the defaults' (a plain
    prompt layout's answer ends where its card says, whatever the client asks)."""
    given = {"max_new_tokens": max_new, "temperature": temperature, "top_p": top_p, "seed": seed,
             "ignore_eos": ignore_eos}
    stops = tuple(dict.fromkeys((*base.stop, *stop)))
    return replace(base, stop=stops, **{k: v for k, v in given.items() if v is not None})


def conversation(body: dict) -> str | None:
    """The optional `conversation` field: a name that pins the conversation this request continues."""
    name = get(body, "conversation", str, "a string")
    if name is not None and not (0 < len(name) <= 64 and name.isprintable() and name.strip() == name):
        raise BadRequest("`conversation` must be 1 to 64 printable characters, without spaces around them",
                         "conversation", "invalid_value")
    return name
