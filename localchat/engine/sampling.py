"""Next-token choice: greedy by default, or temperature + nucleus (top-p) sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False  # benchmarks: always write max_new_tokens

    def validate(self) -> None:
        from localchat.errors import UserError

        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1 (got {self.max_new_tokens})")
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1] (got {self.top_p})")


def pick_token(logits: torch.Tensor, settings: GenerationSettings, gen: torch.Generator | None) -> int:
    """`logits`: `[vocab]` for the last position."""
    if settings.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / settings.temperature, dim=-1)
    if settings.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cut = torch.cumsum(sorted_p, dim=-1) - sorted_p >= settings.top_p  # keep the smallest set reaching top_p
        sorted_p[cut] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if gen is not None and probs.device != gen.device:  # the engine's generator is on the CPU (same draws anywhere)
        probs = probs.to(gen.device)
    return int(torch.multinomial(probs, 1, generator=gen))
