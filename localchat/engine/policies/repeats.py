"""A cap on the copies of one token that a KV head keeps (LOCRET's `--max-copies`; not in the paper).

LOCRET scores each unit once, from its own pre-RoPE Q, K and V, so a token that recurs through a long document
scores about the same every time. On a 128K-token document, several thousand near-equal copies then fill a
head's budget (bench/results/grid-smollm2-cpu-long/README.md: ~1,800 of 2,048 units in each layer-10
head were one filler word, and SmolLM2-135M lost the pass key). `cap_copies` ranks every unit past the `cap`
best-scored copies of its token id in a head below all others, so those go first; protected units keep their
rank and count toward the cap.

`TokenIds` remembers the token id of each position the cache may still hold (positions arrive in increasing
order; a re-read after out-of-memory truncates first). It forgets positions that no layer holds any more, so it
stays bounded by the cache, not the document. A position it never saw (a cache loaded from disk) counts as a
token of its own.
"""

from __future__ import annotations

import torch

from localchat.engine.policies.base import PROTECT

LOW = torch.finfo(torch.float32).min


class TokenIds:
    def __init__(self) -> None:
        self.pos = torch.empty(0, dtype=torch.long)
        self.ids = torch.empty(0, dtype=torch.long)

    def add(self, positions: torch.Tensor, ids: torch.Tensor) -> None:
        """The new units' true positions `[T]` (increasing) and token ids `[T]`."""
        positions, ids = positions.reshape(-1).long(), ids.reshape(-1).long().to(positions.device)
        if self.pos.device != positions.device:
            self.pos, self.ids = self.pos.to(positions.device), self.ids.to(positions.device)
        keep = self.pos < positions[0] if len(positions) else slice(None)  # a re-read replaces what it covers
        self.pos, self.ids = torch.cat([self.pos[keep], positions]), torch.cat([self.ids[keep], ids])

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """Token ids of `positions` (any shape); an unknown position gets an id of its own (negative)."""
        if len(self.pos) == 0:
            return -1 - positions.long()
        at = torch.searchsorted(self.pos, positions.long().contiguous()).clamp(max=len(self.pos) - 1)
        return torch.where(self.pos[at] == positions, self.ids[at], -1 - positions.long())

    def forget_except(self, held: list[torch.Tensor]) -> None:
        """Drop every position that none of `held` (each layer's `[H, n]` positions) contains."""
        alive = torch.isin(self.pos, torch.cat([h.reshape(-1) for h in held]).to(self.pos.device))
        self.pos, self.ids = self.pos[alive], self.ids[alive]


def cap_copies(prio: torch.Tensor, unit_ids: torch.Tensor, cap: int) -> torch.Tensor:
    """`prio` `[H, n]` with each unit past the `cap` best of its token id (`unit_ids` `[H, n]`) in its row set to
    the lowest value, protected units (PROTECT) excepted. A new tensor."""
    order = prio.argsort(dim=-1, descending=True, stable=True)  # best first
    ranked = order.gather(-1, unit_ids.gather(-1, order).argsort(dim=-1, stable=True))  # by id, best first in each
    same = unit_ids.gather(-1, ranked)
    idx = torch.arange(same.shape[-1], device=prio.device).expand_as(same)
    starts = torch.ones_like(same, dtype=torch.bool)
    starts[:, 1:] = same[:, 1:] != same[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(-1).values  # where each id's run begins
    over = torch.zeros_like(prio, dtype=torch.bool).scatter(-1, ranked, (idx - first) >= cap)
    return torch.where(over & (prio < PROTECT), torch.full_like(prio, LOW), prio)
