"""Chunked prefill with eviction (LOCRET's Algorithm 1 for any policy) and decoding steps.

Positions are always passed explicitly: each forward tells the cache the true positions of its
tokens (stored per unit) and gives the model `position_ids` = the true positions (`original`) or
the slots the tokens land in (`compact`). transformers 5 derives the causal mask from the cache
length, so a chunk's queries see every kept unit plus their own causal prefix. Only the last
position's logits are computed (`logits_to_keep=1`).
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch
from transformers.cache_utils import LinearAttentionLayer

from localchat.engine.cache import KVCache
from localchat.engine.events import Notice, Progress
from localchat.engine.policies.base import Policy, protect_recent
from localchat.kernels.evict import select


class Cancelled(Exception):
    """Raised between chunks or tokens when the cancel event is set."""


@dataclass
class ChunkReport:
    """What one prefill step did (for tests and diagnostics)."""

    start: int
    end: int
    evicted: bool
    kept: int  # units per KV head per layer after this step


def cache_kwarg(model) -> str:
    """The forward argument that takes the cache: `cache` from transformers 5.24, `past_key_values` before."""
    return _cache_kwarg(type(model))


@functools.cache
def _cache_kwarg(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def forward(model, cache: KVCache, ids: torch.Tensor, true_first: int) -> torch.Tensor:
    """Run `ids` (`[1, T]`) whose true positions start at `true_first`; return last logits `[vocab]`."""
    t = ids.shape[-1]
    cache.set_pending_positions(torch.arange(true_first, true_first + t, device=ids.device))
    first = cache.next_position(true_first)
    position_ids = torch.arange(first, first + t, device=ids.device).unsqueeze(0)
    out = model(input_ids=ids, position_ids=position_ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
    cache.settle()
    return out.logits[0, -1]


EVICT_RANGE = "localchat.evict"  # the profiler's name for an eviction (bench/experiments/gpu_prefill_profile.py)


def evict(cache: KVCache, policy: Policy, last_chunk: bool, recent: int = 0) -> bool:
    """Keep the top-`keep_size` (normally `budget`) units per KV head of every governed layer (plus the `recent`
    newest), in temporal order. True if it evicted; the eviction is a profiler range named `EVICT_RANGE`."""
    keep_n = policy.keep_size(cache) + recent
    if cache.get_seq_length() <= keep_n:
        return False
    with torch.profiler.record_function(EVICT_RANGE):
        prios = [protect_recent(policy.priority(layer, i, last_chunk), recent) for i, layer in cache.governed_layers()]
        cache.keep_units(select(prios, keep_n))  # one batched top-k over the layers (kernels/evict.py)
    return True


def evict_while_decoding(cache: KVCache, policy: Policy) -> bool:
    """The decode-time option: at budget + 2·window units, keep the top-budget plus the newest window."""
    if policy.evicts and policy.evict_each_step:  # SAGE-KV's rolling window, CORM's per-step rule
        return evict(cache, policy, last_chunk=True)
    w = policy.decode_window
    if w <= 0 or not policy.evicts or cache.get_seq_length() < policy.budget + 2 * w:
        return False
    return evict(cache, policy, last_chunk=True, recent=w)


def plan_steps(n: int, chunk: int, local: int) -> list[tuple[int, int, bool, bool]]:
    """(start, end, evict_after, last_chunk) for a prompt of n tokens: chunks of the head, then the tail."""
    head_end = max(0, n - local)
    steps = [(s, min(s + chunk, head_end), True, min(s + chunk, head_end) >= head_end) for s in range(0, head_end, chunk)]
    steps += [(s, min(s + chunk, n), False, False) for s in range(head_end, n, chunk)]
    return steps


def _rollback(cache: KVCache, lengths: list[int]) -> None:
    """Drop what a failed forward appended: every layer back to its length before the chunk (a linear layer's
    state cannot go back: the failure stands)."""
    if any(n is None for n in lengths):
        raise torch.OutOfMemoryError("out of memory in a chunk of a model with linear-attention layers")
    for layer, n in zip(cache.layers, lengths):
        extra = layer.get_seq_length() - n
        if extra > 0:
            layer.crop(-extra)
    if cache.extension is not None:  # drop what was copied in for the failed chunk
        cache.extension.rollback()


def _free_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def prefill(
    model,
    cache: KVCache,
    ids: torch.Tensor,
    *,
    chunk: int,
    policy: Policy | None = None,
    first_pos: int = 0,
    cancel: threading.Event | None = None,
    on_chunk: Callable[[ChunkReport], None] | None = None,
    on_oom: Callable[[int], None] | None = None,
) -> Generator[Progress | Notice, None, torch.Tensor]:
    """Feed `ids` (`[1, n]`) in chunks, evicting after each chunk of the head when the policy evicts.

    Yields Progress after each step; returns the last logits `[vocab]`. Raises Cancelled between steps.
    Out of memory in a chunk's forward: the chunk's units are dropped, memory is freed, the chunk size is
    halved (`on_oom(new_chunk)` is told) and the same tokens are read again; a Notice says so. Steps are
    those of plan_steps at the chunk size in force.
    """
    n = ids.shape[-1]
    if n == 0:
        raise ValueError("prefill needs at least one token")
    evicting = policy is not None and policy.evicts
    head_end = max(0, n - (policy.local if evicting else 0))
    if policy is not None:
        policy.prefill_start(cache, chunk)
    t0 = time.perf_counter()
    logits = None
    start = 0
    while start < n:
        if cancel is not None and cancel.is_set():
            raise Cancelled
        in_head = start < head_end
        end = min(start + chunk, head_end if in_head else n)
        last = in_head and end >= head_end
        piece = ids[:, start:end]
        lengths = [None if isinstance(layer, LinearAttentionLayer) else layer.get_seq_length() for layer in cache.layers]
        try:
            logits = forward(model, cache, piece, first_pos + start)
        except torch.OutOfMemoryError:
            if chunk <= 1:
                raise
            _rollback(cache, lengths)
            _free_memory(ids.device)
            old, chunk = chunk, max(1, chunk // 2)
            if on_oom is not None:
                on_oom(chunk)
            yield Notice(f"out of memory reading a chunk of {old:,} tokens; freed it and reading in chunks of {chunk:,}")
            continue
        if policy is not None:
            policy.observe(cache, end - start, piece)
        evicted = evicting and in_head and policy.evict_per_chunk and evict(cache, policy, last)
        if on_chunk is not None:
            on_chunk(ChunkReport(start, end, evicted, cache.get_seq_length()))
        elapsed = time.perf_counter() - t0
        tps = end / elapsed if elapsed > 0 else 0.0
        yield Progress(done=end, total=n, tokens_per_s=tps, eta_s=(n - end) / tps if tps > 0 else None)
        start = end
    if policy is not None:
        policy.prefill_done(cache)
        if evicting and not policy.evict_per_chunk:  # one selection after the whole prompt (SAGE-KV)
            evict(cache, policy, last_chunk=True)
        note = policy.notice()
        if note:
            yield Notice(note)
    return logits
