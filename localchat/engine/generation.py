"""How an answer is generated (length, temperature, top-p, seed, stops): a plain value, read without torch by
the settings (localchat/config.py); engine/sampling.py draws the tokens."""

from __future__ import annotations

from dataclasses import dataclass


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
