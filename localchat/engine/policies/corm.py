"""CORM (Dai et al., 2024, "CORM: Cache Optimization with Recent Message for Large Language Model Inference";
docs/methods/corm.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localchat.engine.policies.attention_stats import Collector, StatsHook, rows_bytes
from localchat.engine.policies.base import Policy, follow


@dataclass
class Messages:
    """Per layer: `rows` `[H_kv, ≤w, n]` bool (did recent query j find unit i important), positions `[H_kv, n]`."""

    rows: torch.Tensor
    positions: torch.Tensor


def important(probs: torch.Tensor, query_positions: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`[H_q, w, n]` probabilities of queries at true positions `[w]` -> `[H_kv, w, n]` bool:
    p >= 1/t with t = position + 1 (the uncompressed length so far), OR over each KV head's query group."""
    h_q, w, n = probs.shape
    t = query_positions.to(probs.device).float() + 1
    hit = probs >= (1.0 / t)[None, :, None]
    return hit.reshape(kv_heads, h_q // kv_heads, w, n).any(dim=1)


def wanted(rows: torch.Tensor, recent: int) -> torch.Tensor:
    """`[H_kv, n]` bool: important to any of the recent queries, or among the `recent` newest keys."""
    keep = rows.any(dim=1)
    if recent > 0:
        keep[:, -recent:] = True
    return keep


@dataclass
class CORM(Policy):
    """Keep the keys that any of the last `window` queries attended to at least uniformly, plus the `recent` newest.

    Every forward, the last min(window, T) queries' fp32 softmax rows `[H_q, w, n]` (over the kept keys)
    are thresholded at 1/t (t = the query's true position + 1) and OR-ed over each KV head's query group;
    the last `window` such rows per unit form the message matrix `[H_kv, ≤w, n]`. The prompt is read whole
    (no eviction while reading: the spec's §2.5 reading, so the last `window` prompt queries, the question
    among them, vote); then once after the prompt and after every decoded token, a KV head wants the units
    marked in any row plus its `recent` newest slots; nothing else. Reading peaks at the whole prompt.
    The cache stays rectangular: every head keeps the largest wanted count over all layers and heads,
    capped at `budget` (heads that want fewer keep their next-best keys by votes, then by their latest
    attention). When the cap binds, the keys with the fewest votes go, and a
    notice says so after prefill. Positions stay absolute. Defaults: window w = 256 (the paper's "256+256"),
    recent None = min(256, budget // 2) (the paper's r = 256, at most half the cap), budget 1024 as the cap,
    local 96 (the engine's question tail).
    Paper: CORM, Dai et al. 2024 (docs/methods/corm.md).
    """

    name = "corm"
    attention_function = True  # attention statistics through SDPA (attention_stats.py)
    summary = "CORM: keep keys any of the last w queries found important (content-sized, capped by the budget)"
    evict_per_chunk = False  # §2.5: the rule runs after the prompt; evicting chunk by chunk loses the needle
    evict_each_step = True
    default_positions = "original"
    window: int = 256
    recent: int | None = None

    @property
    def recent_size(self) -> int:
        return min(256, self.budget // 2) if self.recent is None else self.recent

    def attach(self, model, cache) -> None:
        super().attach(model, cache)
        if getattr(self, "cache_id", None) != id(cache) or cache.get_seq_length() == 0:
            self.messages: dict[int, Messages] = {}  # kept across turns on one cache; realigned by position
        self.cache_id = id(cache)
        self.cache = cache
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (important bits, last row)
        self.largest = 0  # the largest wanted count since the last notice
        self.capped = 0  # evictions where the cap bound since the last notice
        self.hook = StatsHook(model, Collector(self.window, self._collect))

    def _collect(self, layer_idx: int, probs: torch.Tensor) -> None:
        """Reduce this layer's `[H_q, w, n]` fp32 rows at once (holding every layer's until `observe` would
        cost layers x H_q x w x n x 4 bytes): the important-bits `[H_kv, w, n]` and the last row's group max."""
        kv_heads = self.model.config.num_key_value_heads
        w = probs.shape[1]
        queries = self.cache.layers[layer_idx].positions[0, -w:]  # already holds this forward's units
        latest = probs[:, -1].reshape(kv_heads, -1, probs.shape[-1]).amax(dim=1)
        self.pending[layer_idx] = (important(probs, queries, kv_heads), latest)

    def aligned(self, layer_idx: int, layer) -> Messages:
        """The message matrix for the units held now (units it has no column for: never important)."""
        now = layer.positions
        m = self.messages.get(layer_idx)
        if m is not None and m.positions.shape == now.shape and torch.equal(m.positions, now):
            return m
        if m is None:
            rows = torch.zeros((now.shape[0], 0, now.shape[1]), dtype=torch.bool, device=now.device)
        else:
            idx, found = follow(m.positions.to(now.device), now)
            old = m.rows.to(now.device)
            rows = old.gather(2, idx[:, None, :].expand(-1, old.shape[1], -1)) & found[:, None, :]
        m = Messages(rows, now.clone())
        self.messages[layer_idx] = m
        return m

    def observe(self, cache, n_new, ids) -> None:
        for i, layer in cache.governed_layers():
            hit, latest = self.pending.pop(i)  # [H_kv, w, n] bool, [H_kv, n]
            m = self.aligned(i, layer)
            m.rows = torch.cat([m.rows, hit.to(m.rows.device)], dim=1)[:, -self.window :].contiguous()  # frees the rest
            layer.scores.copy_(latest)

    def keep_size(self, cache) -> int:
        sizes = []
        for i, layer in cache.governed_layers():
            m = self.aligned(i, layer)
            if m.rows.shape[1] < self.window:  # not enough observations yet: keep all (up to the cap)
                sizes.append(layer.get_seq_length())
            else:
                sizes.append(int(wanted(m.rows, self.recent_size).sum(dim=-1).max()))
        want = max(sizes)
        self.largest = max(self.largest, want)
        if want > self.budget:
            self.capped += 1
        return min(want, self.budget)

    def score(self, layer, layer_idx):
        """Votes (how many recent queries found the key important) + its latest attention."""
        m = self.aligned(layer_idx, layer)
        return m.rows.sum(dim=1).float() + layer.scores

    def protected_recent(self, last_chunk: bool) -> int:
        return self.recent_size

    def notice(self) -> str | None:
        if not self.capped:
            return None
        note = (f"corm wanted up to {self.largest:,} units per KV head; capped at the budget of {self.budget:,} "
                f"({self.capped} time{'s' if self.capped > 1 else ''})")
        self.capped = self.largest = 0
        return note

    def score_bytes(self, layers, q_heads, kv_heads, chunk, n) -> int:
        w = min(self.window, chunk)
        messages = layers * kv_heads * self.window * n  # kept between forwards, one bool per (row, unit)
        return rows_bytes(q_heads, w, n) + q_heads * w * n + messages  # + the threshold test's bools

    def detach(self) -> None:
        self.hook.close()
        self.pending = {}
        self.cache = None
