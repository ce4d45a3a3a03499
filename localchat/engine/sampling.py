"""Next-token choice: greedy by default, or temperature + nucleus (top-p) sampling."""

from __future__ import annotations

import torch

from localchat.engine.generation import GenerationSettings


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
