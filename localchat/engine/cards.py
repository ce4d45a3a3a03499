"""Model cards: models/*.toml shipped inside the package as localchat.models."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

from localchat.toml import toml


DEFAULT_CHUNK = 512  # tokens read per prefill step, where neither a flag, a profile, a plan nor a card says


def card_chunk(card: "ModelCard | None") -> int:
    """The chunk a model reads in by default: its card's, else DEFAULT_CHUNK."""
    return int((card.locret.get("chunk") if card else 0) or DEFAULT_CHUNK)


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

    def held_weights(self, kind: str) -> tuple[str, ...]:
        """The quantized weights whose answers were measured to hold against full precision for this model on
        device `kind` ("cpu", "cuda"): the plan may pick the fastest of them."""
        return tuple(self.precision.get(f"{kind}_held", ()))

    @property
    def heads_release(self) -> str | None:
        """The hub repository of an official LOCRET release holding heads for this model, if there is one."""
        return self.heads.get("repo")

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
