"""Attention probabilities for attention-statistics policies (H2O, SnapKV), next to fast SDPA.

A named attention function, "localchat_stats", is registered with transformers' public
`AttentionInterface` (and `AttentionMaskInterface`, so it gets SDPA's causal masks). It returns
transformers' own SDPA output unchanged and, when a `Collector` is installed on the attention module,
also computes fp32 softmax probabilities for the last `rows` query rows of the chunk against every key:

    query `[1, H_q, T, d]` (post-RoPE), key `[1, H_kv, n, d]` (un-repeated; this chunk's T units last)
    probs `[H_q, w, n]`, w = min(rows, T); row r (slot n - w + r) sees the keys at slots <= n - w + r

One `[H_q, w, n]` fp32 buffer is materialised (the fused softmax writes over its input). Query head h belongs to KV head
h // (H_q // H_kv); `group_sum` reduces probabilities to `[H_kv, n]`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from localchat.engine.attention import AttentionSwitch, sdpa

STATS_IMPL = "localchat_stats"
_ATTR = "_localchat_collector"


@dataclass
class Collector:
    """`rows`: how many last query rows to score (None: all T); `callback(layer_idx, probs [H_q, w, n])`."""

    rows: int | None
    callback: Callable[[int, torch.Tensor], None]
    logits: bool = False  # hand over the masked pre-softmax logits (-inf above the diagonal) instead


def window_probs(query: torch.Tensor, key: torch.Tensor, rows: int | None, scaling: float,
                 softmax: bool = True) -> torch.Tensor:
    """Causal softmax `[H_q, w, n]` (fp32) of the last `rows` queries of `query` against all of `key`
    (with `softmax=False`: the scaled logits, -inf where a query may not look)."""
    h_q, t = query.shape[1], query.shape[2]
    h_kv, n, d = key.shape[1], key.shape[2], key.shape[3]
    w = t if rows is None else min(rows, t)
    q = (query[0, :, t - w :].float() * scaling).reshape(h_kv, h_q // h_kv * w, d)  # one bmm per KV head
    logits = torch.bmm(q, key[0].float().transpose(1, 2)).reshape(h_q, w, n)
    if w > 1:  # only the last w keys (this chunk's own) lie above some row's diagonal
        future = torch.ones(w, w, dtype=torch.bool, device=key.device).triu_(1)
        logits[:, :, n - w :].masked_fill_(future, float("-inf"))
    if not softmax:
        return logits
    # fused softmax written over its input: one [H_q, w, n] buffer (every row sees its own key: max finite)
    return torch.softmax(logits, dim=-1, out=logits)


def rows_bytes(q_heads: int, rows: int, n: int) -> int:
    """Peak bytes of `window_probs` for `rows` queries over `n` keys: the fp32 `[H_q, rows, n]` buffer and
    the causal mask over the last `rows` keys `[rows, rows]`."""
    return 4 * q_heads * rows * n + rows * rows


def group_sum(probs: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum `[H_q, w, n]` over the window rows and each KV head's query group: `[H_kv, n]`."""
    h_q, w, n = probs.shape
    return probs.reshape(kv_heads, h_q // kv_heads, w, n).sum(dim=(1, 2))


def stats_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA output; plus the collector's window probabilities for this layer when one is installed."""
    out = sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    collector: Collector | None = getattr(module, _ATTR, None)
    if collector is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        probs = window_probs(query, key, collector.rows, scale, softmax=not collector.logits)
        collector.callback(module.layer_idx, probs)
    return out


class StatsHook(AttentionSwitch):
    """Switch `model` to "localchat_stats" with `collector` on every layer; `close()` restores the model.

    While switched, attention outputs are SDPA's whatever the previous implementation (eager, flash).
    """

    def __init__(self, model, collector: Collector):
        super().__init__(model, STATS_IMPL, _ATTR, collector, stats_attention)
