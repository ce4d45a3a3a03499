"""SirLLM (Yao et al., 2024, "SirLLM: Streaming Infinite Retentive LLM"), run after every prefill
chunk as LOCRET's paper did (docs/methods/locret.md §4; docs/methods/README.md §2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localchat.engine.policies.base import Policy


@dataclass
class SirLLM(Policy):
    """Score of token i = its entropy h_i = -log p(x_i | x_<i) under the model's own logits.

    One score per token, the same for every layer and KV head (`[H_kv, n]` rows all equal). The engine
    keeps only the last logits, so a forward hook on `model.model.norm` takes the final hidden states
    `[1, T, hidden]` and `lm_head` + log-softmax run over them in `slice_rows` rows at a time; token i
    uses position i - 1 (the previous chunk's last hidden row for a chunk's first token). The very first
    token has no prediction and scores 0; the `start` sinks keep it. Eviction keeps the first `start`
    tokens, the `recent` newest slots and the highest-entropy rest. Defaults: budget 1024, local 96,
    start 4 (the paper's), recent None = budget // 8 (LOCRET ran start 4 + recent 1000 + entropy 6000,
    about 1/7 of the cache recent; the `local` tail already keeps the question).
    """

    name = "sirllm"
    summary = "SirLLM: keep start tokens, high-entropy (surprising) tokens and recent tokens"
    start: int = 4
    recent: int | None = None
    slice_rows: int = 128

    @property
    def recent_size(self) -> int:
        return self.budget // 8 if self.recent is None else self.recent

    def attach(self, model, cache) -> None:
        super().attach(model, cache)
        self.hidden: torch.Tensor | None = None  # [T, hidden] of the last forward
        self.prev: torch.Tensor | None = None  # [1, hidden]: the row that predicts the next token
        self.handle = model.model.norm.register_forward_hook(self._grab)

    def _grab(self, module, args, out) -> None:
        self.hidden = out[0]

    def entropies(self, ids: torch.Tensor) -> torch.Tensor:
        """-log p of each id of `ids` `[1, T]` given the hidden rows of the last forward: `[T]` fp32."""
        hidden = self.hidden
        ids = ids[0].to(hidden.device)
        first = self.prev if self.prev is not None else hidden[:1]  # placeholder row for token 0
        rows = torch.cat([first, hidden[:-1]])  # row j predicts ids[j]
        out = torch.empty(ids.shape[0], dtype=torch.float32, device=hidden.device)
        for s in range(0, ids.shape[0], self.slice_rows):
            logp = torch.log_softmax(self.model.lm_head(rows[s : s + self.slice_rows]).float(), dim=-1)
            out[s : s + self.slice_rows] = -logp.gather(1, ids[s : s + self.slice_rows, None])[:, 0]
        if self.prev is None:
            out[0] = 0.0  # the very first token: nothing predicts it
        self.prev = hidden[-1:]
        self.hidden = None
        return out

    def observe(self, cache, n_new, ids) -> None:
        h = self.entropies(ids)
        for _, layer in cache.governed_layers():
            layer.scores[:, -n_new:] = h.to(layer.scores.device)

    def protected_first(self) -> int:
        return self.start

    def protected_recent(self, last_chunk: bool) -> int:
        return self.recent_size

    def detach(self) -> None:
        self.handle.remove()
        self.hidden = self.prev = None
