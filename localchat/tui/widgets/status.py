"""The status line: model, policy, budget use, KV MiB, compression, device memory, last speeds."""

from __future__ import annotations

import os

from textual.widgets import Static

MIB = 1024 * 1024


def device_memory(device) -> int:
    """Bytes in use: torch.cuda.memory_allocated() on CUDA, the process RSS elsewhere."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return torch.cuda.memory_allocated(device)
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def status_text(engine, session, memory: int | None) -> str:
    if engine is None:
        return "no model loaded"
    parts = [engine.name, engine.policy.name]
    if session is not None:
        budget = session.budget
        parts.append(f"kept {session.kv_units:,}/{budget:,}" if budget else f"kept {session.kv_units:,} (no budget)")
        last = session.last
        ratio = f" ({last.compression:.1f}x smaller)" if last else ""  # no ratio before the first answer
        parts.append(f"KV {session.kv_bytes / MIB:,.1f} MiB{ratio}")
    mem = f"{memory / MIB:,.0f} MiB" if memory is not None else "?"
    parts.append(f"{'GPU' if engine.device.type == 'cuda' else 'RAM'} {mem}")
    if session is not None and session.last is not None:
        parts.append(f"prefill {session.last.prefill_tps:,.0f} tok/s")
        parts.append(f"decode {session.last.decode_tps:,.1f} tok/s")
    else:
        parts.append("prefill - tok/s")
        parts.append("decode - tok/s")
    return " · ".join(parts)


class StatusLine(Static):
    def __init__(self, **kw) -> None:
        super().__init__("", markup=False, **kw)
