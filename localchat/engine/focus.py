"""Focus: answer from the kept units the question points at (LOCRET's `--focus K`; docs/methods/locret.md §2.9).

LOCRET keeps the top-`budget` units per KV head without knowing the question. With a 128x-compressed natural-text
document, SmolLM2-135M misses a needle that is in the cache while ~1,000 other units sit beside it, and reads it
with ~10 (bench/results/grid-smollm2-cpu-long, "What limits it"). Focus narrows what the answer reads, not what
the cache keeps:

1. While the prompt's tail (its last `local` tokens: the question) is read over the kept units, the attention of
   its last `window` queries (LOCRET's `--focus-window`, 32) to every unit held before the tail is summed over
   those rows and each KV head's query group (SnapKV's vote, here over LOCRET's cache).
2. A unit's vote is raised to the largest vote of the units up to `after` tokens (`--focus-spread`, 16) before it
   (same layer and KV head): the question points at a needle's key, and its value follows the key.
3. A view holds, per layer and KV head, the top-K units by that vote (the first `SINKS` positions always), moved
   to slots 0..K-1 (`KVCache.keep`); the tail is read again over the view and the answer is decoded on it.

The cache itself is not narrowed: a chat's next question starts from every kept unit (in a chat, `keep_last`, the
engine feeds the answer into it afterwards). The view costs K + local + answer units beside the cache.
"""

from __future__ import annotations

import torch

from localchat.engine.cache import KVCache
from localchat.engine.policies.attention_stats import Collector, StatsHook, group_sum

SINKS = 4  # the first positions, always in the view
# LOCRET's options that change what an answer reads, not what the cache holds (a saved cache stays valid)
ANSWER_ONLY = ("focus", "focus_window", "focus_spread")


class Probe:
    """Collects each layer's votes `[H_kv, held]` over the first `held` units while installed on `model`."""

    def __init__(self, model, held: int, window: int):
        self.held = held
        self.votes: dict[int, torch.Tensor] = {}
        self.kv_heads = model.config.num_key_value_heads
        self.hook = StatsHook(model, Collector(window, self._collect))

    def _collect(self, layer_idx: int, probs: torch.Tensor) -> None:
        self.votes[layer_idx] = group_sum(probs[:, :, : self.held], self.kv_heads)

    def close(self) -> None:
        if self.hook is not None:
            self.hook.close()
            self.hook = None


def spread(votes: torch.Tensor, positions: torch.Tensor, after: int) -> torch.Tensor:
    """`votes` `[H, n]` raised, per unit, to the largest vote among the same head's units whose original position
    is at most `after` tokens before its own (`positions` `[H, n]`, ascending per head as the cache holds them,
    so those units are among the `after` slots before it)."""
    out = votes.clone()
    for j in range(1, min(after, votes.shape[-1] - 1) + 1):
        near = positions[:, j:] - positions[:, :-j] <= after
        out[:, j:] = torch.maximum(out[:, j:], torch.where(near, votes[:, :-j], out[:, j:]))
    return out


def picks(votes: torch.Tensor, positions: torch.Tensor, k: int, after: int) -> torch.Tensor:
    """Slots `[H, min(k, n)]` (ascending per head) of the top-k units by vote spread `after` tokens, the first
    SINKS positions first."""
    score = spread(votes, positions, after)
    score[positions < SINKS] = float("inf")
    return score.topk(min(k, score.shape[-1]), dim=-1).indices.sort(dim=-1).values


def first_units(t: dict[str, torch.Tensor], held: int) -> dict[str, torch.Tensor]:
    """A layer's `tensors()` cut to its first `held` units (a quantized layer's packed part comes first, then its
    full-precision tail `tk`/`tv`)."""
    nq = t["qk"].shape[-2] if "qk" in t else None
    out = {}
    for name, x in t.items():
        if name in ("s", "p"):
            out[name] = x[:, :held]
        elif name in ("tk", "tv"):
            out[name] = x[:, :, : max(0, held - nq)]
        else:
            out[name] = x[:, :, : held if nq is None else min(held, nq)]
    return out


def view(cache: KVCache, votes: dict[int, torch.Tensor], held: int, k: int, reserve: int, after: int) -> KVCache:
    """A new cache of `cache`'s kind holding, per layer and KV head, the k picked units among its first `held`
    (none of the units after them: the tail is read again over the view), with room for `reserve` units. Built a
    layer at a time, so beside the view it copies at most one layer's `held` units at once."""
    out = cache.empty(reserve)
    for i, (src, dst) in enumerate(zip(cache.layers, out.layers)):
        dst.hold(first_units(src.tensors(), held))
        out.keep(i, picks(votes[i], dst.positions, k, after))
        dst.hold({name: x.clone() for name, x in dst.tensors().items()})  # its buffers back to the view's size
    return out
