"""LOCRET (Huang et al., 2024, "Locret: Enhancing Eviction in Long-Context LLM Inference with Trained
Retaining Heads"; docs/methods/locret.md)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from localchat.engine.policies.base import Option, Policy
from localchat.errors import UserError

if TYPE_CHECKING:  # imported where used: planning reads this class without torch
    from localchat.engine.heads import RetainingHeads

FOCUS_WINDOW = 32  # --focus: the question's last tokens whose attention votes (engine/focus.py)
FOCUS_SPREAD = 16  # --focus: a unit takes the vote of the units up to this many tokens before it

FLUSH_EVERY = 32  # decoded tokens queued before they are scored: the queue's Q, K, V stay small


@dataclass
class Locret(Policy):
    """Retaining heads score each unit once, from its own pre-RoPE Q, K, V: `[H_kv, T]` per layer.

    After every chunk but the last, the newest `stabilizers` units are protected (on a copy of the
    scores); the top-`budget` per KV head are kept in temporal order. The last `local` prompt tokens
    skip the loop. Defaults (SmolLM2 card): budget 1024, stabilizers 256, local 96; the paper uses
    b=16384, n_s=2500, n_loc=100 for Llama-3.1-8B.
    """

    name = "locret"
    summary = "LOCRET: trained retaining heads score each unit; keep the top budget (default)"
    options = {"stabilizers": Option("--stabilizers", int, "LOCRET n_s: newest units protected per chunk"),
               "max_copies": Option("--max-copies", int, "LOCRET: keep at most N copies of one token per KV head "
                                    "(0: no cap, the paper's rule; see engine/policies/repeats.py)"),
               "focus": Option("--focus", int, "LOCRET: answer from the N kept units per KV head the question attends "
                               "to most (0: every kept unit, the paper's rule; see engine/focus.py)"),
               "focus_window": Option("--focus-window", int, "LOCRET --focus: the question's last N tokens whose "
                                      f"attention picks the units (default {FOCUS_WINDOW})"),
               "focus_spread": Option("--focus-spread", int, "LOCRET --focus: a unit also takes the vote of the units "
                                      f"up to N tokens before it (default {FOCUS_SPREAD})")}
    stabilizers: int = 256
    max_copies: int = 0  # 0: the paper's rule
    focus: int = 0  # 0: the paper's rule (the answer reads every kept unit)
    focus_window: int = FOCUS_WINDOW
    focus_spread: int = FOCUS_SPREAD
    heads: RetainingHeads | None = field(default=None, repr=False)
    cache = None  # the attached cache (not a field): queued tokens are scored into it
    token_ids = None  # --max-copies: the token id of each position the cache may hold (TokenIds, not a field)

    def validate(self) -> None:
        super().validate()
        if self.stabilizers < 0:
            raise UserError(f"--stabilizers must be >= 0 (got {self.stabilizers})")
        if self.stabilizers >= self.budget:
            raise UserError(f"--stabilizers ({self.stabilizers}) must be below --budget ({self.budget})")
        if self.max_copies < 0:
            raise UserError(f"--max-copies must be >= 0 (0 means no cap; got {self.max_copies})")
        if self.focus < 0:
            raise UserError(f"--focus must be >= 0 (0 reads every kept unit; got {self.focus})")
        if self.focus_window < 1:
            raise UserError(f"--focus-window must be >= 1 (the question's tokens that vote; got {self.focus_window})")
        if self.focus_spread < 0:
            raise UserError(f"--focus-spread must be >= 0 (0: no spread; got {self.focus_spread})")

    @classmethod
    def settle(cls, values, given):
        """n_s from a card or profile that does not fit under the user's budget drops to budget // 4."""
        budget, stab = values.get("budget"), values.get("stabilizers")
        if "stabilizers" not in given and budget is not None and stab is not None and stab >= budget:
            return {**values, "stabilizers": budget // 4}
        return values

    def attach(self, model, cache) -> None:
        super().attach(model, cache)
        if self.heads is None:
            raise UserError("LOCRET needs retaining heads for this model; pass --heads DIR (or --heads random)")
        from localchat.engine.heads import HeadScorer
        from localchat.engine.policies.repeats import TokenIds

        self.scorer = HeadScorer(model, self.heads)
        self.cache = cache
        if self.max_copies > 0 and (self.token_ids is None or self._ids_of() is not cache):
            self.token_ids = TokenIds()  # a new cache; the same one (the next turn) keeps what it knew
            self._ids_of = weakref.ref(cache)

    def observe(self, cache, n_new, ids) -> None:
        if self.token_ids is not None:
            self.token_ids.add(cache.layers[cache.governed[0]].positions[0, -n_new:], ids)
        if n_new == 1:  # a decoded token: the scorer queues it, `_flush` scores the queue in one batch
            if self.scorer.queued() >= FLUSH_EVERY:
                self._flush(cache)
            return
        self._flush(cache, skip=n_new)
        for i, layer in cache.governed_layers():
            layer.scores[:, -n_new:] = self.scorer.take(i)[:, -n_new:]

    def _flush(self, cache, skip: int = 0) -> None:
        """Score the queued single tokens: the units just before the `skip` newest."""
        import torch

        count = self.scorer.queued()
        if count == 0:
            return
        with torch.inference_mode():
            flushed = self.scorer.flush()
            for i, layer in cache.governed_layers():
                scores = flushed[i]
                end = layer.get_seq_length() - skip
                layer.scores[:, end - count:end] = scores

    def score(self, layer, layer_idx):
        if self.cache is not None:  # attached: queued tokens get their scores first
            self._flush(self.cache)
        return layer.scores

    def priority(self, layer, layer_idx, last_chunk):
        prio = super().priority(layer, layer_idx, last_chunk)
        if self.token_ids is None:
            return prio
        from localchat.engine.policies.repeats import cap_copies

        if self.cache is not None and layer_idx == self.cache.governed[0]:  # once per eviction: forget what no layer holds
            self.token_ids.forget_except([held.positions for _, held in self.cache.governed_layers()])
        return cap_copies(prio, self.token_ids.lookup(layer.positions), self.max_copies)

    def focus_units(self) -> int:
        return self.focus

    def qkv_sink(self):
        return self.scorer.take_qkv

    def unit_heads(self):
        return self.scorer.heads

    def protected_recent(self, last_chunk: bool) -> int:
        return 0 if last_chunk else self.stabilizers

    def detach(self) -> None:
        self._flush(self.cache)  # the answer's tokens keep their scores for the next turn
        self.scorer.close()
        self.cache = None
