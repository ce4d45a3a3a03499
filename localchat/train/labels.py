"""Labels for retaining heads (docs/methods/locret.md §3.1) and the features they are trained on.

For every prompt token k, layer l and KV head j:
    logit[l, j, k] = max over answer rows p and the query heads of j's GQA group of q_p·k_k/√d
                     (post-RoPE at true positions, full attention, no eviction)   <- the paper's label
    prob[l, j, k]  = the same max over softmax probabilities (a variant we compare)
Only the answer rows are computed against the keys (never the n×n matrix). Features are the pre-RoPE
[Q | K | V] projections of the prompt tokens, captured by forward hooks during the prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localchat.engine.cache import KVCache
from localchat.engine.heads import attention_modules, head_shape, hook_qkv
from localchat.engine.policies.attention_stats import Collector, StatsHook
from localchat.engine.prefill import forward

VARIANTS = ("logit", "prob")


@dataclass
class Labels:
    features: torch.Tensor  # [L, n_q, F] float16, F = (H_q + 2·H_kv)·d
    labels: dict[str, torch.Tensor]  # variant -> [L, H_kv, n_q] float32


class _QKVCapture:
    """Keeps the pre-RoPE q|k|v rows of every layer (fp16, on the CPU) while `on` is set."""

    def __init__(self, model):
        self.on = True
        self.rows: list[list[torch.Tensor]] = [[] for _ in attention_modules(model)]
        self.handles = hook_qkv(model, self._keep)

    def _keep(self, i: int, qkv: torch.Tensor) -> None:
        if self.on:
            self.rows[i].append(qkv.to(torch.float16).cpu())

    def features(self) -> torch.Tensor:
        return torch.stack([torch.cat(r, dim=0) for r in self.rows])

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@torch.inference_mode()
def extract(model, prompt_ids: list[int], answer_ids: list[int], chunk: int = 1024) -> Labels:
    """Prefill the prompt (full cache, true positions), then run the answer once and take the labels."""
    shape = head_shape(model)
    n_q, kv, g = len(prompt_ids), shape["kv_heads"], shape["q_heads"] // shape["kv_heads"]
    device = next(model.parameters()).device
    cache = KVCache(shape["layers"], reserve=n_q + len(answer_ids))
    capture = _QKVCapture(model)
    try:
        ids = torch.tensor([prompt_ids], device=device)
        for start in range(0, n_q, chunk):
            forward(model, cache, ids[:, start : start + chunk], start)
        capture.on = False
        out = {v: torch.empty(shape["layers"], kv, n_q) for v in VARIANTS}

        def take(layer_idx: int, logits: torch.Tensor) -> None:  # logits [H_q, n_a, n] (-inf = masked)
            n_a = logits.shape[1]
            grouped = logits.view(kv, g, n_a, -1)
            out["logit"][layer_idx] = grouped[..., :n_q].amax(dim=(1, 2)).cpu()
            out["prob"][layer_idx] = grouped.softmax(dim=-1)[..., :n_q].amax(dim=(1, 2)).cpu()

        hook = StatsHook(model, Collector(rows=None, callback=take, logits=True))
        try:
            forward(model, cache, torch.tensor([answer_ids], device=device), n_q)
        finally:
            hook.close()
        return Labels(features=capture.features(), labels=out)
    finally:
        capture.close()
