"""What each policy is, without importing it (or torch): the command line, `localchat policies`, profiles and
`localchat sessions` read this table; the policy classes declare the same facts, and
tests/planning/test_catalog.py keeps the two equal. Adding a policy: its module, and one row here."""

from __future__ import annotations

from dataclasses import dataclass, field

from localchat.engine.policies.base import Option


@dataclass(frozen=True)
class Entry:
    """A policy's declarations: `module` under policies/, and what its class says of itself."""

    name: str
    module: str
    summary: str
    evicts: bool = True
    selects: bool = False
    heads: bool = False  # reads retaining heads (a `heads` field, --heads)
    hybrid: bool = True  # serves models with window or linear-attention layers (Policy.hybrid)
    attention_function: bool = False  # replaces the model's attention function (Policy.attention_function)
    options: dict[str, Option] = field(default_factory=dict)  # dataclass field -> how users set it

    def uses_budget(self) -> bool:
        """True when --budget means something (Policy.uses_budget)."""
        return self.evicts or self.selects


ROWS = (  # in the order `localchat policies` lists them
    Entry("locret", "locret", "LOCRET: trained retaining heads score each unit; keep the top budget (default)",
          heads=True, options={
              "stabilizers": Option("--stabilizers", int, "LOCRET n_s: newest units protected per chunk"),
              "max_copies": Option("--max-copies", int, "LOCRET: keep at most N copies of one token per KV head "
                                   "(0: no cap, the paper's rule; see engine/policies/repeats.py)"),
              "focus": Option("--focus", int, "LOCRET: answer from the N kept units per KV head the question "
                              "attends to most (0: every kept unit, the paper's rule; see engine/focus.py)"),
              "focus_window": Option("--focus-window", int, "LOCRET --focus: the question's last N tokens whose "
                                     "attention picks the units (default 32)"),
              "focus_spread": Option("--focus-spread", int, "LOCRET --focus: a unit also takes the vote of the "
                                     "units up to N tokens before it (default 16)")}),
    Entry("kvzap", "kvzap", "KVzap: a trained scorer reads each unit's hidden state; keep the top budget (or those "
                            "above --threshold)", heads=True, options={
              "stabilizers": Option("--stabilizers", int, "LOCRET n_s: newest units protected per chunk"),
              "threshold": Option("--threshold", float, "KVzap: keep only units scored >= T (log scale; kvpress uses "
                                  "-4), at most the budget per KV head", signed=True)}),
    Entry("full", "full", "no eviction: the whole KV cache (memory grows with the document)", evicts=False),
    Entry("streaming", "streaming", "StreamingLLM: attention sinks + the most recent tokens"),
    Entry("h2o", "h2o", "H2O: keep heavy hitters (most accumulated attention) + recent tokens",
          attention_function=True),
    Entry("snapkv", "snapkv", "SnapKV: keep the tokens the last queries of each chunk attend to (pooled)",
          attention_function=True),
    Entry("sirllm", "sirllm", "SirLLM: keep start tokens, high-entropy (surprising) tokens and recent tokens"),
    Entry("random", "random", "keep a random budget of units per head (lower bound)"),
    Entry("sagekv", "sagekv", "SAGE-KV: full prefill, then one top-k per head from the last token's attention + "
                              "sinks + recent", attention_function=True),
    Entry("omnikv", "omnikv", "OmniKV: keep everything; filter layers pick the tokens later layers attend to, "
                              "every step", evicts=False, selects=True, hybrid=False, attention_function=True, options={
              "offload": Option("--offload", bool, "OmniKV on a GPU: keep the sparse layers' K/V in host memory and "
                                "copy in what they attend to", cuda_only=True),
              "prefill_ratio": Option("--sparse-prefill", float, "OmniKV: while reading, filter layers pick R x chunk "
                                      "earlier tokens for the later layers (the paper's R = 2; default off: full "
                                      "attention)")}),
    Entry("roco", "roco", "RoCo: keep the highest mean attention; units with unsettled (high-std) attention are "
                          "protected", attention_function=True),
    Entry("corm", "corm", "CORM: keep keys any of the last w queries found important (content-sized, capped by the "
                          "budget)", attention_function=True),
)
CATALOG: dict[str, Entry] = {row.name: row for row in ROWS}


def options() -> dict[str, Option]:
    """Every policy's own options by flag (the first policy to name a flag wins)."""
    out: dict[str, Option] = {}
    for row in ROWS:
        for opt in row.options.values():
            out.setdefault(opt.flag, opt)
    return out


def option_owners(field_name: str) -> list[str]:
    """The policies that take the option held in `field_name`."""
    return [row.name for row in ROWS if field_name in row.options]
