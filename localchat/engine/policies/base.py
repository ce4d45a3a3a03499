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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

PROTECT = torch.finfo(torch.float32).max  # "+inf" that survives arithmetic (as LOCRET's code does)


@dataclass
class Policy:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    evicts: ClassVar[bool] = True
    budget: int = 1024  # b: units kept per KV head per layer after each chunk
    local: int = 96  # n_loc: last prompt tokens prefilled after the loop, never evicted
    decode_window: int = 0  # > 0: evict during decoding, keeping budget + this many recent units

    def attach(self, model, cache) -> None:
        self.model = model

    def observe(self, cache, n_new: int, ids: torch.Tensor) -> None:
        """Score the newest `n_new` units of every layer (`ids`: their token ids `[1, n_new]`)."""

    def priority(self, layer, layer_idx: int, last_chunk: bool) -> torch.Tensor:
        return layer.scores.clone()

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
