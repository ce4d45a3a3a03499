"""Chunked prefill and decoding steps on a KVCache, with progress and cancellation.

Positions are always passed explicitly (`position_ids`); transformers 5 derives the causal mask from
the cache length, so the current chunk's queries see every cached unit plus their own causal prefix.
Only the last position's logits are computed (`logits_to_keep=1`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from localchat.engine.cache import KVCache
from localchat.engine.events import Progress


class Cancelled(Exception):
    """Raised inside the loops when the cancel event is set; the engine turns it into Done(cancelled)."""


@dataclass
class ChunkReport:
    """What one prefill step did (for tests and diagnostics)."""

    start: int
    end: int


def forward(model, cache: KVCache, ids: torch.Tensor, first_pos: int) -> torch.Tensor:
    """Run `ids` (`[1, T]`) at positions first_pos.. on top of the cache; return last-position logits `[vocab]`."""
    t = ids.shape[-1]
    position_ids = torch.arange(first_pos, first_pos + t, device=ids.device).unsqueeze(0)
    out = model(input_ids=ids, past_key_values=cache, position_ids=position_ids, use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


def prefill(
    model,
    cache: KVCache,
    ids: torch.Tensor,
    *,
    chunk: int,
    first_pos: int = 0,
    cancel: threading.Event | None = None,
    on_chunk: Callable[[ChunkReport], None] | None = None,
) -> Generator[Progress, None, torch.Tensor]:
    """Feed `ids` (`[1, n]`) in chunks; yield Progress after each chunk; return the last logits `[vocab]`.

    Raises Cancelled between chunks when `cancel` is set.
    """
    n = ids.shape[-1]
    if n == 0:
        raise ValueError("prefill needs at least one token")
    t0 = time.perf_counter()
    logits = None
    for start in range(0, n, chunk):
        if cancel is not None and cancel.is_set():
            raise Cancelled
        end = min(start + chunk, n)
        logits = forward(model, cache, ids[:, start:end], first_pos + start)
        if on_chunk is not None:
            on_chunk(ChunkReport(start, end))
        elapsed = time.perf_counter() - t0
        tps = end / elapsed if elapsed > 0 else 0.0
        yield Progress(done=end, total=n, tokens_per_s=tps, eta_s=(n - end) / tps if tps > 0 else None)
    return logits
