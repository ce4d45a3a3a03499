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
    stop: tuple[str, ...] = ()  # the answer ends before the first of these strings (which is not shown)

    def validate(self) -> None:
        from localchat.errors import UserError

        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1 (got {self.max_new_tokens})")
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if any(not s for s in self.stop):
            raise UserError("a stop sequence is empty; give non-empty strings")


class StopText:
    """Streamed answer text cut before the first stop sequence: `push(piece)` returns what may be shown now and
    holds back a tail that could be the start of a stop sequence; `hit` says one was found."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.held = ""
        self.shown = ""
        self.hit = False

    def push(self, piece: str) -> str:
        text = self.held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self.held = True, ""
            return self._show(text[:min(found)])
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(text)) + 1) if text.endswith(s[:k])),
                   default=0)
        self.held = text[len(text) - keep:]
        return self._show(text[:len(text) - keep])

    def flush(self) -> str:
        """The text held back, once the answer has ended without a stop sequence."""
        rest, self.held = self.held, ""
        return self._show(rest)

    def _show(self, text: str) -> str:
        self.shown += text
        return text


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
