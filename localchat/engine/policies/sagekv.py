"""SAGE-KV (SambaNova, 2025, "LLMs Know What to Drop: Self-Attention Guided KV Cache Eviction for Efficient
Long-Context Inference", arXiv 2503.08879; docs/methods/sage-kv.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localchat.engine.policies.attention_stats import Collector, StatsHook
from localchat.engine.policies.base import PROTECT, Policy


def split(budget: int, group: int) -> tuple[int, int, int]:
    """(sinks S, per-query-head k, recent R) for budget B and query-group size G (docs/methods/sage-kv.md §2.4):
    S = B/4, k = B/(2G), R = B - S - G·k - 1 (the last prompt token is the +1, counted inside B)."""
    sinks = budget // 4
    k = budget // (2 * group)
    return sinks, k, max(0, budget - sinks - group * k - 1)


def select_middle(logits: torch.Tensor, kv_heads: int, k: int) -> torch.Tensor:
    """The middle units each KV head keeps: `[H_kv, min(G·k, E)]` slot indices into the middle, ascending.

    `logits` `[H_q, E]`: the last prompt token's scaled q·k over the middle segment, per query head.
    Every query head takes its own top-k (the paper's rule); the cache holds units per KV head, so a KV
    head keeps the union of its G heads' picks and fills the rest of its G·k slots with the next-best
    units by the group's max logit (the spec's §2.5 union variant).
    """
    h_q, e = logits.shape
    g = h_q // kv_heads
    k = min(k, e)
    picked = torch.zeros((h_q, e), dtype=torch.bool, device=logits.device)
    picked.scatter_(1, logits.topk(k, dim=-1).indices, True)
    union = picked.reshape(kv_heads, g, e).any(dim=1)  # [H_kv, E]
    rank = logits.reshape(kv_heads, g, e).amax(dim=1).masked_fill(union, float("inf"))
    return rank.topk(min(g * k, e), dim=-1).indices.sort(dim=-1).values


@dataclass
class SageKV(Policy):
    """Full prefill, then one top-k per query head from the last prompt token's attention; a rolling recent window.

    Prefill keeps every unit (its peak is the whole cache: `peak_units` says so to the engine and planner).
    After the prompt, per layer: the last token's post-RoPE query `[H_q, d]` scores the middle segment
    (slots S .. n-R-2) of the cache `[H_kv, n, d]` by scaled q·k (softmax is monotone within a head);
    the sinks (first S slots), the selection and the last prompt token are fixed (score PROTECT, carried
    with every gather); the R newest slots form the recent window, which slides by one unit per
    decoded token. Positions stay absolute ("original"). Defaults: budget 1024, G from the model,
    S = B/4, k = B/(2G), R = B - S - G·k - 1; local 0 (the recent window holds the question).
    In a multi-turn chat the selection is re-run at the end of each turn's prompt over the whole cache.
    GQA: the cache holds units per KV head, so a KV head keeps the union of its G query heads' top-k,
    filled to G·k by the group's max logit (the spec's §2.5 variant; `select_middle`).
    Paper: SAGE-KV, arXiv 2503.08879 (docs/methods/sage-kv.md).
    """

    name = "sagekv"
    attention_function = True  # attention statistics through SDPA (attention_stats.py)
    summary = "SAGE-KV: full prefill, then one top-k per head from the last token's attention + sinks + recent"
    evict_per_chunk = False
    evict_each_step = True
    default_positions = "original"
    local: int = 0

    def attach(self, model, cache) -> None:
        super().attach(model, cache)
        self.last: dict[int, torch.Tensor] = {}
        self.hook = StatsHook(model, Collector(1, self._collect, logits=True))

    def _collect(self, layer_idx: int, logits: torch.Tensor) -> None:
        self.last[layer_idx] = logits[:, -1]  # [H_q, n]: the chunk's last query row

    def prefill_done(self, cache) -> None:
        kv_heads = self.model.config.num_key_value_heads
        group = self.model.config.num_attention_heads // kv_heads
        sinks, k, recent = split(self.budget, group)
        for i, layer in cache.governed_layers():
            logits = self.last.pop(i).to(layer.scores.device)
            n = layer.get_seq_length()
            fixed = torch.zeros_like(layer.scores, dtype=torch.bool)
            fixed[:, : min(sinks, n)] = True
            fixed[:, n - 1] = True
            end = n - recent - 1  # the middle is slots [sinks, end)
            if end > sinks:
                chosen = select_middle(logits[:, sinks:end], kv_heads, k) + sinks
                fixed.scatter_(1, chosen, True)
            layer.scores.copy_(fixed.float() * PROTECT)
        self.last.clear()

    def score(self, layer, layer_idx):
        """Fixed units first, then the newest (the recent window)."""
        return layer.positions.float().masked_fill_(layer.scores >= PROTECT, PROTECT)

    def detach(self) -> None:
        self.hook.close()
        self.last = {}
