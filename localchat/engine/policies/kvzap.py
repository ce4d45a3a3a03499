"""KVzap (NVIDIA, 2026, "KVzap: Fast, Adaptive, and Faithful KV Cache Pruning", arXiv 2601.07891; NVIDIA's
released scorers, engine/kvzap.py) served as LOCRET is: each unit is scored once, when it enters the cache, by a
trained module, here from the hidden state its layer's attention reads (no question needed: a document read once
is asked about many times); after every chunk the top `budget` per KV head stay, with the stabilizers and the
local tail (policies/locret.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from localchat.engine.policies import locret
from localchat.engine.policies.base import Option
from localchat.errors import UserError


@dataclass
class KVzap(locret.Locret):
    """LOCRET's chunked selection with a KVzap scorer in place of retaining heads.

    `threshold` (kvpress's DMS rule, -4 in its examples): keep only the units scored at least this (log scale),
    never more than the budget, so memory adapts to the document within the plan. The cache stays rectangular:
    every layer and KV head keeps as many units as the one that wants the most (those that want fewer keep their
    next-best units); the protected units (stabilizers, local tail) always stay.
    """

    name = "kvzap"
    summary = ("KVzap: a trained scorer reads each unit's hidden state; keep the top budget (or those "
               "above --threshold)")
    options = {"stabilizers": Option("--stabilizers", int, "LOCRET n_s: newest units protected per chunk"),
               "threshold": Option("--threshold", float, "KVzap: keep only units scored >= T (log scale; kvpress uses "
                                   "-4), at most the budget per KV head", signed=True)}
    threshold: float | None = None

    def validate(self) -> None:
        super().validate()
        if self.threshold is not None and not math.isfinite(self.threshold):
            raise UserError(f"--threshold must be a finite number (got {self.threshold})")

    def attach(self, model, cache) -> None:
        self.model = model
        if self.heads is None:
            raise UserError("kvzap needs a KVzap scorer for this model; pass --heads DIR (a KVzap release folder, "
                            "as nvidia/KVzap-* on the hub), `localchat heads fetch MODEL`, or --heads random")
        from localchat.engine.kvzap_scorer import KVzapHooks

        self.scorer = KVzapHooks(model, self.heads)
        self.cache = cache
        self.largest = getattr(self, "largest", 0)

    def keep_size(self, cache) -> int:
        if self.threshold is None:
            return self.budget
        want = 0
        for i, layer in cache.governed_layers():
            prio = self.priority(layer, i, last_chunk=False)  # the protected units count as wanted
            want = max(want, int((prio >= self.threshold).sum(dim=-1).max()) if prio.numel() else 0)
        self.largest = max(self.largest, want)
        return min(want, self.budget)

    def notice(self) -> str | None:
        if self.threshold is None or not self.largest:
            return None
        note = (f"kvzap --threshold {self.threshold:g}: up to {self.largest:,} units per KV head scored above it"
                + (f"; capped at the budget of {self.budget:,}" if self.largest > self.budget else ""))
        self.largest = 0
        return note

    def qkv_sink(self):
        return None  # the scorer reads the input norm's output, whose hook keeps decoding on a path that calls it

    def unit_heads(self):
        return None
