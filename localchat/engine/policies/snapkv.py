"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"), run after
every prefill chunk as LOCRET's paper did (docs/methods/locret.md §4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localchat.engine.policies.attention_stats import Collector, StatsHook, group_sum, rows_bytes
from localchat.engine.policies.base import Policy


@dataclass
class SnapKV(Policy):
    """Score of a unit = attention from the chunk's last `window` queries, replaced every forward.

    The window's probabilities `[H_q, w, n]` (fp32, causal) are summed over the window rows and each
    KV head's query group, then smoothed along the sequence by 1-D average pooling (`kernel`, stride 1,
    zero padding kernel // 2, same length): scores `[H_kv, n]`. The newest `window` slots (the
    observation window itself) are always kept. Defaults: budget 1024, local 96, window 32, kernel 5.
    """

    name = "snapkv"
    attention_function = True  # attention statistics through SDPA (attention_stats.py)
    summary = "SnapKV: keep the tokens the last queries of each chunk attend to (pooled)"
    window: int = 32
    kernel: int = 5

    def attach(self, model, cache) -> None:
        super().attach(model, cache)
        self.pending: dict[int, torch.Tensor] = {}
        self.hook = StatsHook(model, Collector(self.window, self._collect))

    def _collect(self, layer_idx: int, probs: torch.Tensor) -> None:
        votes = group_sum(probs, self.model.config.num_key_value_heads)  # [H_kv, n]
        pad = self.kernel // 2
        self.pending[layer_idx] = F.avg_pool1d(votes[:, None], self.kernel, stride=1, padding=pad)[:, 0]

    def observe(self, cache, n_new, ids) -> None:
        for i, layer in cache.governed_layers():
            layer.scores.copy_(self.pending.pop(i))

    def protected_recent(self, last_chunk: bool) -> int:
        return self.window  # the observation window itself

    def score_bytes(self, layers, q_heads, kv_heads, chunk, n) -> int:
        return rows_bytes(q_heads, min(self.window, chunk), n)

    def detach(self) -> None:
        self.hook.close()
