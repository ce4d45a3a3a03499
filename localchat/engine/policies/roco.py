"""RoCo (Ren & Zhu, 2024, "On the Efficacy of Eviction Policy for Key-Value Constrained Generative Language
Model Inference", arXiv 2402.06262; EasyKV defaults marked [code]; docs/methods/roco.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localchat.engine.policies.attention_stats import Collector, StatsHook, rows_bytes
from localchat.engine.policies.base import PROTECT, Policy, follow, protect_first, protect_recent


@dataclass
class Stats:
    """Per layer, aligned with the cache's slots: Acc, AccSq, Count `[H_kv, n]` fp32, positions `[H_kv, n]`."""

    acc: torch.Tensor
    acc2: torch.Tensor
    count: torch.Tensor
    positions: torch.Tensor


def group_mean(probs: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`[H_q, T, n]` -> `[H_kv, T, n]`: the mean over each KV head's query group (RoCo's GQA rule)."""
    h_q, t, n = probs.shape
    return probs.reshape(kv_heads, h_q // kv_heads, t, n).mean(dim=1)


def seen_counts(n: int, t: int, device=None) -> torch.Tensor:
    """`[n]`: how many of a chunk's t queries (the last t slots, causal) attended to each of n keys."""
    counts = torch.full((n,), float(t), device=device)
    counts[n - t :] = torch.arange(t, 0, -1, device=device, dtype=torch.float32)
    return counts


def mean_and_std(s: Stats) -> tuple[torch.Tensor, torch.Tensor]:
    """MAS = Acc/Count and Std = sqrt(max(AccSq/Count - MAS², 0)), `[H_kv, n]`."""
    mas = s.acc / s.count
    return mas, (s.acc2 / s.count - mas * mas).clamp_(min=0).sqrt_()


def scoped_mas(s: Stats, scope_out: int) -> torch.Tensor:
    """MAS `[H_kv, n]` with the `scope_out` highest-Std units of each head out of the eviction scope (PROTECT)."""
    mas, std = mean_and_std(s)
    prio = mas.clone()
    r = min(scope_out, std.shape[-1])
    if r > 0:
        prio.scatter_(1, std.topk(r, dim=-1).indices, PROTECT)
    return prio


def roco_priority(s: Stats, positions: torch.Tensor, scope_out: int, sinks: int, last: int) -> torch.Tensor:
    """MAS, with the `scope_out` highest-Std units, the first `sinks` positions and the `last` slots protected."""
    return protect_recent(protect_first(scoped_mas(s, scope_out), positions, sinks), last)


@dataclass
class RoCo(Policy):
    """Mean attention received (MAS) ranks units; the highest-Std units are out of the eviction scope.

    Every forward (each prefill chunk = one block of RoCo's block-wise evict-and-encode, and each decoded
    token), the new queries' fp32 softmax probabilities `[H_q, T, n]` over cache + chunk are averaged over
    each KV head's query group (`[H_kv, T, n]`) and accumulated per unit: Acc += Σ p, AccSq += Σ p²,
    Count += the number of queries that saw the unit. After a chunk over budget, per KV head: protect
    the `scope_out` units of largest Std, the first `sinks` positions and the `last` slots, and keep the
    top-`budget` by MAS (= evict the lowest-MAS units in scope). The scores shown for a unit are its MAS.
    Positions stay absolute. Defaults: budget 1024, local 96 (the engine's question tail), scope_out
    None = budget // 2 (the paper's r = B/2), sinks 4 and last 10 ([code], EasyKV's prefill setting).
    While answering, units are scored but not evicted unless `decode_window` is set (the engine's rule for
    every policy: the question tail and the answer stay whole); the spec evicts at every step past B.
    Paper: RoCo, arXiv 2402.06262 (docs/methods/roco.md).
    """

    name = "roco"
    attention_function = True  # attention statistics through SDPA (attention_stats.py)
    summary = "RoCo: keep the highest mean attention; units with unsettled (high-std) attention are protected"
    default_positions = "original"
    scope_out: int | None = None
    sinks: int = 4
    last: int = 10

    @property
    def scope_out_size(self) -> int:
        return self.budget // 2 if self.scope_out is None else self.scope_out

    def attach(self, model, cache) -> None:
        super().attach(model, cache)
        if getattr(self, "cache_id", None) != id(cache) or cache.get_seq_length() == 0:
            self.stats: dict[int, Stats] = {}  # kept across turns on one cache; realigned to it by position
        self.cache_id = id(cache)
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.hook = StatsHook(model, Collector(None, self._collect))

    def _collect(self, layer_idx: int, probs: torch.Tensor) -> None:
        p = group_mean(probs, self.model.config.num_key_value_heads)  # [H_kv, T, n]
        self.pending[layer_idx] = (p.sum(dim=1), (p * p).sum(dim=1), p.shape[1])

    def aligned(self, layer_idx: int, layer) -> Stats:
        """This layer's statistics for the units the cache holds now; units it has none for start from their
        stored score (MAS) seen once."""
        now = layer.positions
        s = self.stats.get(layer_idx)
        if s is not None and s.positions.shape == now.shape and torch.equal(s.positions, now):
            return s
        score = layer.scores.float()
        fresh = Stats(score.clone(), score * score, torch.ones_like(score), now.clone())
        if s is not None:
            idx, found = follow(s.positions.to(now.device), now)
            for name in ("acc", "acc2", "count"):
                old = getattr(s, name).to(now.device).gather(1, idx)
                setattr(fresh, name, torch.where(found, old, getattr(fresh, name)))
        self.stats[layer_idx] = fresh
        return fresh

    def observe(self, cache, n_new, ids) -> None:
        for i, layer in cache.governed_layers():
            add, add2, t = self.pending.pop(i)
            n = layer.get_seq_length()
            s = self.aligned(i, layer)
            new = slice(n - n_new, n)
            s.acc[:, new] = 0.0
            s.acc2[:, new] = 0.0
            s.count[:, new] = 0.0
            s.acc += add.to(s.acc.device)
            s.acc2 += add2.to(s.acc.device)
            s.count += seen_counts(n, t, s.acc.device)
            layer.scores.copy_(s.acc / s.count)

    def score(self, layer, layer_idx):
        return scoped_mas(self.aligned(layer_idx, layer), self.scope_out_size)

    def protected_first(self) -> int:
        return self.sinks

    def protected_recent(self, last_chunk: bool) -> int:
        return self.last

    def score_bytes(self, layers, q_heads, kv_heads, chunk, n) -> int:
        return rows_bytes(q_heads, chunk, n) + 2 * 4 * kv_heads * chunk * n  # + the group mean and its square

    def detach(self) -> None:
        self.hook.close()
        self.pending = {}
