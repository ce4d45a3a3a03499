"""Typed events that the engine streams to the TUI, the CLI and the bench."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """Prefill progress after each chunk."""

    done: int
    total: int
    tokens_per_s: float
    eta_s: float | None
    phase: str = "prefill"


@dataclass(frozen=True)
class Token:
    """A piece of streamed answer text (may be empty while a multi-byte character is incomplete)."""

    text: str
    token_id: int


@dataclass(frozen=True)
class Done:
    text: str
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    ttft_s: float
    stop_reason: str  # "eos" | "stop" (a stop sequence) | "length" | "cancelled"
    kv_tokens: int  # cache units per KV head per layer at the end
    kv_bytes: int
    kv_full_bytes: int = 0  # what an uncompressed cache would hold for the same tokens

    @property
    def compression(self) -> float:
        return self.kv_full_bytes / self.kv_bytes if self.kv_bytes else 1.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class Error:
    message: str  # one line, for the user
    exc: BaseException | None = None  # kept for --debug


@dataclass(frozen=True)
class Notice:
    """Something the user should know that is not an error (e.g. "re-reading the conversation")."""

    message: str


Event = Progress | Token | Done | Error | Notice
