"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks")."""

from dataclasses import dataclass

from localchat.engine.policies.base import Policy


@dataclass
class Streaming(Policy):
    """Keep the first `sinks` tokens and the most recent `budget - sinks` units.

    Score of a unit = its original position `[H_kv, n]` (newer is better); sinks are protected.
    Defaults: budget 1024, sinks 4 (RoCo's and CORM's setting), local 96. Use with compact positions
    for the paper's pos-shift.
    """

    name = "streaming"
    summary = "StreamingLLM: attention sinks + the most recent tokens"
    sinks: int = 4

    def score(self, layer, layer_idx):
        return layer.positions.float()

    def protected_first(self) -> int:
        return self.sinks
