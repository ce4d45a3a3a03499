"""The Policy interface: a policy scores cache units; the cache evicts.

Life cycle during one generation (engine/prefill.py):
  attach(model, cache)            once, before the first forward (hooks, attention statistics)
  observe(cache, n_new, ids)      after every forward: give the n_new newest units their scores
                                  (`layer.scores[:, -n_new:]`) and/or update older units' scores
  priority(layer, i, last_chunk)  before an eviction: a copy of the scores with protected units set
                                  to +inf; the cache keeps the top-`budget` per KV head, in order
  detach()                        after generation
Eviction runs after each prefill chunk while the cache holds more than `budget` units per head, never
on the local tail (`local` tokens), and during decoding only when `decode_window` > 0: then, each time
the cache reaches budget + 2·decode_window, it keeps the newest `decode_window` units plus the
top-`budget` of the rest (long answers stay bounded).

Optional hooks (defaults keep the behaviour above; used by the seed methods other than LOCRET):
  evict_per_chunk = False         prefill keeps every unit; one eviction runs after the whole prompt,
                                  right after prefill_done (SAGE-KV: its peak prefill memory is the cache)
  evict_each_step = True          evict after every decoded token whenever the cache holds more than
                                  keep_size (SAGE-KV's rolling window, CORM's per-step rule)
  keep_size(cache)                units per KV head an eviction keeps; default `budget` (CORM: fewer when
                                  fewer keys are important, capped by the budget)
  prefill_start(cache, chunk)     before a prompt's first chunk, with the chunk size in force
  prefill_done(cache)             once the whole prompt is in the cache, before the first decoded token
  notice()                        a line for the user after prefill (e.g. "the cap bound"), or None
  default_positions               the position mode when the user names none ("compact" or "original")
  selects = True                  keeps every unit (evicts False) but attends to a budget-sized selection
                                  (OmniKV): --budget still applies and the bench sweeps it
Policies with per-unit state beyond `scores` follow the cache's gathers by original position (`follow`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from localchat.engine.offload import unbank_cache

PROTECT = torch.finfo(torch.float32).max  # "+inf" that survives arithmetic (as LOCRET's code does)


@dataclass
class Policy:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    evicts: ClassVar[bool] = True
    evict_per_chunk: ClassVar[bool] = True
    evict_each_step: ClassVar[bool] = False
    selects: ClassVar[bool] = False
    default_positions: ClassVar[str] = "compact"
    budget: int = 1024  # b: units kept per KV head per layer after each chunk
    local: int = 96  # n_loc: last prompt tokens prefilled after the loop, never evicted
    decode_window: int = 0  # > 0: evict during decoding, keeping budget + this many recent units

    def attach(self, model, cache) -> None:
        self.model = model
        unbank_cache(cache)  # a cache OmniKV --offload kept in host memory comes back to the device

    def observe(self, cache, n_new: int, ids: torch.Tensor) -> None:
        """Score the newest `n_new` units of every layer (`ids`: their token ids `[1, n_new]`)."""

    def priority(self, layer, layer_idx: int, last_chunk: bool) -> torch.Tensor:
        return layer.scores.clone()

    def keep_size(self, cache) -> int:
        return self.budget

    def prefill_start(self, cache, chunk: int) -> None:
        pass

    def prefill_done(self, cache) -> None:
        pass

    def notice(self) -> str | None:
        return None

    @classmethod
    def bounded(cls) -> bool:
        """True when the budget bounds the cache while reading (evicting after every chunk); False for the
        policies that keep the whole prompt (full, OmniKV; SAGE-KV until the prompt ends)."""
        return cls.evicts and cls.evict_per_chunk

    def peak_units(self, prompt_tokens: int, chunk: int, max_new: int) -> int:
        """The cache's peak length per KV head for a prompt (what the engine reserves and plans for)."""
        if self.bounded():
            grow = min(max_new, 2 * self.decode_window) if self.decode_window else max_new
            return self.budget + chunk + self.local + grow
        return prompt_tokens + max_new

    def offloaded_layers(self, depth: int) -> int:
        """Layers whose K/V is kept in host memory instead of the device's (OmniKV --offload); reading
        streams up to two of them through the device at a time."""
        return 0

    def score_bytes(self, layers: int, q_heads: int, kv_heads: int, chunk: int, n: int) -> int:
        """Bytes that scoring a chunk of `chunk` queries against `n` cached units adds to the peak, beyond
        SDPA's (the planner's "policy scores" row): attention rows materialised in fp32, kept messages."""
        return 0

    def detach(self) -> None:
        pass


def protect_recent(prio: torch.Tensor, count: int) -> torch.Tensor:
    """Protect the `count` most recent slots of `prio` `[H, n]` (in place; returns it)."""
    if count > 0:
        prio[:, -count:] = PROTECT
    return prio


def protect_first(prio: torch.Tensor, positions: torch.Tensor, count: int) -> torch.Tensor:
    """Protect the units whose original position is among the first `count` tokens."""
    if count > 0:
        prio[positions < count] = PROTECT
    return prio


def follow(then: torch.Tensor, now: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each unit held now sat before: `then` `[H, m]` and `now` `[H, n]` are original positions,
    ascending per head. Returns (slot in `then` `[H, n]`, found `[H, n]` bool)."""
    h, n = now.shape
    if then.shape[-1] == 0:
        return torch.zeros((h, n), dtype=torch.long, device=now.device), torch.zeros((h, n), dtype=torch.bool, device=now.device)
    idx = torch.searchsorted(then.contiguous(), now.contiguous()).clamp_(max=then.shape[-1] - 1)
    return idx, then.gather(1, idx) == now
