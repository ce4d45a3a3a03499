"""The settings of a run, as one immutable value: `RunSpec` (model, precision, chunk, generation) with a
`PolicySpec` (the KV-cache policy and its parameters).

It is resolved once, before the model loads (localchat/planning/resolve.py: flags > a saved chat's settings > LOCALCHAT_* environment >
profile > model card > plan), and then read by everything: `plan` and `profile show` print it (with the source
of each field), the CLI, the chat window and the bench load the engine from it (planning/load.py), and a
saved chat records it. Change a setting with `dataclasses.replace`, never in place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localchat.engine.cards import DEFAULT_CHUNK
from localchat.engine.generation import GenerationSettings
from localchat.engine.policies import Policy, policy_class
from localchat.engine.policies.catalog import CATALOG
from localchat.planning.sources import DEFAULT, Source

if TYPE_CHECKING:
    from localchat.engine.cards import ModelCard
    from localchat.planning.planner import Plan


@dataclass(frozen=True)
class PolicySpec:
    """A KV-cache policy and its settings. `params` holds the policy's own fields (LOCRET's stabilizers,
    OmniKV's offload, ...) as (name, value) pairs; `heads` is LOCRET's heads directory, `random`, or None for
    the heads that ship for the model."""

    name: str
    budget: int | None = None  # None: the policy has no budget (full attention)
    local: int = 0
    positions: str = "original"
    decode_window: int = 0
    heads: str | None = None
    params: tuple[tuple[str, Any], ...] = ()

    def settings(self) -> dict[str, Any]:
        """The policy's dataclass fields to build it with (heads as the user named them)."""
        out = {"local": self.local, "decode_window": self.decode_window, **dict(self.params)}
        if self.budget is not None:
            out["budget"] = self.budget
        if self.heads is not None:
            out["heads"] = self.heads
        return out

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    @cached_property
    def cls(self) -> type[Policy]:
        """The policy's class, looked up once (an unknown name raises the one-line error)."""
        return policy_class(self.name)

    def has_heads(self) -> bool:
        """Whether the policy reads retaining heads (LOCRET and its kin)."""
        row = CATALOG.get(self.name)
        return row.heads if row is not None else "heads" in self.cls.fields()  # an unknown name: its one-line error


@dataclass(frozen=True)
class RunSpec:
    """Everything a run is set to. `sources` says where each field came from (a `Source`: its kind, and the text
    "command line", "LOCALCHAT_BUDGET", "profile rtx4090 (built-in)", "model card", "plan", "default"); `plan` is the
    memory plan behind the budget and chunk (None where none was made: an unbounded policy, or a model whose shape
    was unknown)."""

    policy: PolicySpec
    model: str | None = None  # None: the embedded default model
    chunk: int = DEFAULT_CHUNK
    threads: int | None = None  # CPU threads; None: torch's default (one per core)
    weights: str | None = None  # None: the device's dtype (fp32 on a CPU, bf16 on a GPU)
    kv: str = "none"  # retained cache: none | int8 | int4 | int2
    margin_mib: int | None = None
    generation: GenerationSettings = GenerationSettings()
    profile: str | None = None  # the device profile in force
    asked: tuple[tuple[str, Any], ...] = ()  # the policy settings the user gave (flag key, value), for /policy X
    sources: dict[str, Source] = field(default_factory=dict, compare=False)
    plan: Plan | None = field(default=None, compare=False, repr=False)
    card: ModelCard | None = field(default=None, compare=False, repr=False)  # the model's card, looked up once
    heads_dir: Path | str | None = field(default=None, compare=False, repr=False)  # found once by load: a folder, "random"

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON): what `plan --json` prints and a saved chat records."""
        return {"model": self.model, "chunk": self.chunk, "weights": self.weights, "kv": self.kv,
                "margin_mib": self.margin_mib, "profile": self.profile, "policy": {
                    **{k: v for k, v in asdict(self.policy).items() if k != "params"}, **dict(self.policy.params)},
                "generation": {k: v for k, v in asdict(self.generation).items() if k != "stop"}}  # a request's own

    def rows(self) -> list[tuple[str, Any, str]]:
        """(setting, value, source) for `profile show`, in a fixed order."""
        p = self.policy
        values = [("model", self.model or "default"), ("policy", p.name), ("positions", p.positions),
                  ("budget", p.budget), ("chunk", self.chunk), ("local", p.local), ("decode_window", p.decode_window),
                  ("heads", p.heads), *p.params, ("weights", self.weights or "device dtype"), ("kv", self.kv),
                  ("threads", self.threads or "one per core"),
                  ("margin_mib", self.margin_mib if self.margin_mib is not None else "auto"),
                  ("max_new_tokens", self.generation.max_new_tokens)]
        return [(k, v, self.sources.get(k, DEFAULT)) for k, v in values]
