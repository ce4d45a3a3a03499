"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
Language Models"), in its chunked-prefill form (docs/methods/locret.md §4, docs/methods/README.md §2 "H2O+")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localchat.engine.policies.attention_stats import Collector, StatsHook, group_sum, rows_bytes
from localchat.engine.policies.base import Policy


@dataclass
class H2O(Policy):
    """Score of a unit = the accumulated sum of softmax attention it has received so far.

    Every forward, all T queries of the chunk attend (fp32, causal) to cache + chunk; the probabilities
    `[H_q, T, n]` are summed over the queries and over each KV head's query group and added to the
    scores `[H_kv, n]` (new units start at what this chunk gave them; decoded tokens add too). Eviction
    keeps the `recent` newest slots plus the heaviest hitters. Defaults: budget 1024, local 96,
    recent None = budget // 2 (RoCo's r = B/2 setting of H2O).
    """

    name = "h2o"
    attention_function = True  # attention statistics through SDPA (attention_stats.py)
    summary = "H2O: keep heavy hitters (most accumulated attention) + recent tokens"
    recent: int | None = None

    @property
    def recent_size(self) -> int:
        return self.budget // 2 if self.recent is None else self.recent

    def attach(self, model, cache) -> None:
        super().attach(model, cache)
        self.pending: dict[int, torch.Tensor] = {}
        self.hook = StatsHook(model, Collector(None, self._collect))

    def _collect(self, layer_idx: int, probs: torch.Tensor) -> None:
        kv_heads = self.model.config.num_key_value_heads
        self.pending[layer_idx] = group_sum(probs, kv_heads)

    def observe(self, cache, n_new, ids) -> None:
        for i, layer in cache.governed_layers():
            layer.scores.add_(self.pending.pop(i).to(layer.scores.device))

    def protected_recent(self, last_chunk: bool) -> int:
        return self.recent_size

    def score_bytes(self, layers, q_heads, kv_heads, chunk, n) -> int:
        return rows_bytes(q_heads, chunk, n)  # every query of the chunk

    def detach(self) -> None:
        self.hook.close()
