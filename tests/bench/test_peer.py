"""The benchmark's peer runs in a child process of its own (localchat/bench/peer.py): a crash there (a native
llama.cpp build segfaults on CPUs with AMX) or a hang becomes a row that says what happened, and the benchmark
goes on. Real child processes: one that dies of a real SIGSEGV, one that hangs, one that answers."""

from __future__ import annotations

import os
import signal
import time

import pytest

from localchat.bench.peer import PeerFailed, PeerProcess, peer_rows, peer_summary
from localchat.bench.perf import median_row


class Answers:
    """A peer that answers like LlamaCpp.run."""

    def __init__(self, scale):
        self.scale = scale

    def run(self, ids, new):
        return {"prompt_tokens": len(ids), "prefill_tok_s": 100.0 * self.scale, "decode_tok_s": 10.0 * self.scale,
                "new_tokens": new, "kv_units_per_head": len(ids) + new - 1}


class Crashes:
    def __init__(self, *args):
        pass

    def run(self, ids, new):
        os.kill(os.getpid(), signal.SIGSEGV)  # what a native build does on the first eval


class Hangs:
    def __init__(self, *args):
        pass

    def run(self, ids, new):
        time.sleep(600)


class WontStart:
    def __init__(self, *args):
        raise RuntimeError("no such GGUF file\nsecond line")


def test_a_peer_that_answers_gives_two_rows_and_medians():
    peer = PeerProcess("test_peer:Answers", (2,), "llama.cpp", timeout=60)
    try:
        runs = [peer_rows(peer, "llama.cpp", list(range(40)), 8, 4) for _ in range(2)]
    finally:
        peer.close()
    rows, measured = peer_summary(runs, "llama.cpp", median_row)
    assert measured and [r["prompt_tokens"] for r in rows] == [40, 8] and rows[0]["decode_tok_s"] == 20.0
    assert not peer.proc.is_alive()


def test_a_peer_that_crashes_becomes_a_row_and_the_benchmark_goes_on():
    peer = PeerProcess("test_peer:Crashes", (), "llama.cpp", timeout=60)
    rows = peer_rows(peer, "llama.cpp", list(range(40)), 8, 4)
    assert len(rows) == 1 and rows[0]["row"] == "llama.cpp: failed"
    note = rows[0]["note"]
    assert "crashed (signal 11 (SIGSEGV)) while reading 40 tokens" in note and "GGML_NATIVE=OFF" in note
    started = time.monotonic()
    assert peer_rows(peer, "llama.cpp", list(range(40)), 8, 4) == rows  # later runs: the same row, at once
    assert time.monotonic() - started < 1
    summary, measured = peer_summary([rows, rows], "llama.cpp", median_row)
    assert summary == rows and not measured
    peer.close()


def test_a_peer_that_hangs_is_stopped_after_its_time():
    peer = PeerProcess("test_peer:Hangs", (), "llama.cpp", timeout=2)
    with pytest.raises(PeerFailed, match="did not answer within 2 s while reading 5 tokens; it was stopped"):
        peer.run(list(range(5)), 1)
    peer.proc.join(10)
    assert not peer.proc.is_alive()


def test_a_peer_that_cannot_start_says_why_in_one_line():
    with pytest.raises(PeerFailed, match=r"llama.cpp failed while starting: could not start: no such GGUF file$"):
        PeerProcess("test_peer:WontStart", (), "llama.cpp", timeout=60)
