"""Where a setting came from: a `Source`, whose `kind` code compares and whose text people read (RunSpec.sources,
`profile show`, `plan`)."""

from __future__ import annotations

from enum import Enum


class Kind(Enum):
    """Where a setting came from, by precedence (the value: how a plain one reads)."""

    FLAG = "command line"
    SAVED_CHAT = "saved chat"
    ENV = "environment"
    PROFILE = "profile"
    CONFIG = "config.toml"
    CARD = "model card"
    PLAN = "plan"
    DEFAULT = "default"
    POLICY_DEFAULT = "policy default"
    WINDOW = "chat window"


class Source(str):
    """Where a setting came from: `kind` for code to compare; the text, for people, is what `profile show` and
    `plan` print ("command line", "LOCALCHAT_BUDGET", "profile rtx4090 (built-in)", "plan: ...", "chat 'x'")."""

    kind: Kind

    def __new__(cls, kind: Kind, text: str | None = None) -> Source:
        self = super().__new__(cls, kind.value if text is None else text)
        self.kind = kind
        return self

    @classmethod
    def plan(cls, why: str | None = None) -> Source:
        return cls(Kind.PLAN, f"plan: {why}" if why else None)

    @classmethod
    def default(cls, why: str | None = None) -> Source:
        return cls(Kind.DEFAULT, f"default ({why})" if why else None)

    def noted(self, note: str) -> Source:
        """The same kind, with `note` after the text ("model card, lowered to fit the budget")."""
        return Source(self.kind, f"{self}, {note}")

    def __reduce__(self):
        return Source, (self.kind, str(self))

    def __repr__(self) -> str:
        return f"Source({self.kind.name}, {str(self)!r})"


FLAG, DEFAULT = Source(Kind.FLAG), Source(Kind.DEFAULT)


def kind_of(source: str | None) -> Kind:
    """The kind of a source; none given, or a plain string a caller put there, counts as a default."""
    return source.kind if isinstance(source, Source) else Kind.DEFAULT
