"""Full attention: keep every unit (the reference; its memory grows with the document)."""

from dataclasses import dataclass

from localchat.engine.policies.base import Policy


@dataclass
class Full(Policy):
    """No eviction. Shapes: the cache is `[1, H_kv, n, d]` for the whole prompt. No hyperparameters."""

    name = "full"
    summary = "no eviction: the whole KV cache (memory grows with the document)"
    evicts = False
    local: int = 0
