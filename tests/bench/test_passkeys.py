"""passkeys: five labelled keys at fixed depths of one document, read once and asked one per turn."""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest

from localchat.bench.cli import parse_length
from localchat.bench.report import keys_table, load_rows, write_report
from localchat.bench.runner import RESULTS, BenchConfig, check, run
from localchat.bench.tasks import (
    PASSKEY_DEPTHS,
    PASSKEY_FILLER,
    PASSKEY_LABELS,
    make_sample,
    passkeys,
    score,
    score_turn,
)
from localchat.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")  # fixtures in conftest.py


@pytest.fixture(scope="module")
def smol_tok():
    """SmolLM2's own tokenizer (a real BPE: the filler's spaces join the next word), without its weights."""
    from transformers import AutoTokenizer

    from localchat.engine.default_model import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _rows(out):
    return [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]


def _check_layout(tok, n):
    s = passkeys(tok, n, seed=5)
    ids = _ids(tok, s.document)
    assert s.n_tokens == len(ids) and 0.97 * n <= s.n_tokens <= n  # counted without tokenizing it whole
    assert len(set(s.answers)) == 5 and all(len(k) == 5 and s.document.count(k) == 2 for k in s.answers)
    assert s.needle_token == s.needle_tokens[0] and list(s.needle_tokens) == sorted(s.needle_tokens)
    needle = [len(_ids(tok, f" The pass key of the {label} is {key}. Remember it. {key} is the pass key of the {label}."))
              for label, key in zip(PASSKEY_LABELS, s.answers)]
    filler = s.n_tokens - sum(needle)
    per_filler = len(_ids(tok, PASSKEY_FILLER * 4)) - len(_ids(tok, PASSKEY_FILLER * 3))
    for i, (label, key, at, depth) in enumerate(zip(PASSKEY_LABELS, s.answers, s.needle_tokens, PASSKEY_DEPTHS)):
        said = tok.decode(ids[at:at + 120]).strip()
        assert said.startswith(f"The pass key of the {label} is {key}. Remember it. {key} is the pass key of the {label}.")
        before = at - sum(needle[:i])  # filler tokens before the needle
        assert abs(before - depth * filler) <= 1.5 * per_filler + 5
    return s


@pytest.mark.model
@pytest.mark.parametrize("n", [1500, 20000])
def test_keys_sit_at_their_depths_with_smollm2s_tokenizer(smol_tok, n):
    _check_layout(smol_tok, n)


@pytest.mark.parametrize("n", [1500, 8000])
def test_keys_sit_at_their_depths_with_a_byte_tokenizer(tiny_tok, n):
    _check_layout(tiny_tok, n)


def test_one_conversation_asks_each_key(tiny_tok):
    s = make_sample("passkeys", tiny_tok, 2000, seed=3, depth=0.8)
    assert s == make_sample("passkeys", tiny_tok, 2000, seed=3, depth=None)  # the depth is not used
    assert s.depth == PASSKEY_DEPTHS[0] and s.answer == ", ".join(s.answers)
    users = [m["content"] for m in s.messages if m["role"] == "user"]
    assert [m["role"] for m in s.messages] == ["user", "assistant"] * 4 + ["user"]
    assert s.document in users[0] and s.question in users[0] and all(s.document not in u for u in users[1:])
    assert [u.split("pass key of the ")[-1].split("?")[0] for u in users] == list(PASSKEY_LABELS)
    outputs = [f"It is {k}." for k in s.answers]
    assert all(score_turn(s, i, o) for i, o in enumerate(outputs))
    assert not score_turn(s, 1, outputs[0]) and not score_turn(s, 0, s.answers[0] + "1")  # whole digit runs
    assert score(s, " ".join(s.answers[:2])) == pytest.approx(0.4)


@pytest.mark.model
def test_a_million_tokens_is_quick(smol_tok):
    tracemalloc.start()
    t0 = time.perf_counter()
    s = passkeys(smol_tok, parse_length("1m"), seed=1)
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert 0.99 * 2**20 <= s.n_tokens <= 2**20 and s.needle_tokens[-1] > 0.89 * s.n_tokens
    assert took < 5 and peak < 20 * len(s.document)  # a few copies of the text, no token lists


def test_lengths_parse_and_only_the_pass_key_tasks_reach_a_million():
    assert [parse_length(t) for t in ("1m", "1M", "1000k", "32k")] == [2**20, 2**20, 1_024_000, 32768]
    config = BenchConfig(tasks=["passkeys", "passkey"], lengths=[2**20], policies=["full"], budgets=[], n=1, out=None)
    check(config)
    config.tasks = ["passkeys", "niah_single"]
    with pytest.raises(UserError, match="out of range"):
        check(config)
    config.tasks, config.lengths = ["passkeys"], [2**20 + 1]
    with pytest.raises(UserError, match="out of range for passkeys"):
        check(config)


def test_the_document_is_read_once_and_every_key_scored(tiny_dir, tmp_path):
    config = BenchConfig(tasks=["passkeys"], lengths=[1200], policies=["full", "streaming"], budgets=[48], n=1,
                         out=tmp_path, model=tiny_dir, chunk=64, answer_tokens=3, in_process=True)
    run(config, say=lambda line: None)
    rows = {r["policy"]: r for r in _rows(tmp_path)}
    for row in rows.values():
        keys = row["keys"]
        assert row["error"] is None and [k["depth"] for k in keys] == list(PASSKEY_DEPTHS)
        assert [k["answer"] for k in keys] == row["expected"] and [k["turn"] for k in keys] == [1, 2, 3, 4, 5]
        assert [k["found"] for k in keys] == [k["answer"] in k["output"] for k in keys]
        assert row["score"] == sum(k["found"] for k in keys) / 5 and row["correct"] == all(k["found"] for k in keys)
        assert row["output"] == "\n".join(k["output"] for k in keys)
        # the first turn reads the document and gives the row's timings; the others read only their question
        assert row["prompt_tokens"] == keys[0]["prompt_tokens"] > row["n_tokens"]
        assert all(k["prompt_tokens"] < keys[0]["prompt_tokens"] / 4 for k in keys[1:]) and row["prefill_tps"] > 0
        assert row["conversation_tokens"] >= sum(k["prompt_tokens"] for k in keys)
    assert [k["needle_kept"] for k in rows["full"]["keys"]] == [1.0] * 5  # full attention keeps every unit
    # StreamingLLM keeps sinks + a recent window: the middle key is gone when it is asked
    assert rows["streaming"]["keys"][2]["needle_kept"] == 0.0
    assert rows["streaming"]["kv_tokens"] < rows["full"]["kv_tokens"]

    table = keys_table(load_rows(tmp_path))
    assert table[0].split(" | ")[-5:] == ["depth 0.1", "depth 0.3", "depth 0.5", "depth 0.7", "depth 0.9 |"]
    assert len(table) == 4 and all(line.startswith("| passkeys | ") for line in table[2:])
    assert "## Pass keys by depth" in write_report(tmp_path, say=lambda line: None).read_text()


@pytest.mark.model
def test_smollm2_answers_each_key_in_its_turn(smollm2, tmp_path):
    """The real default model, full attention, a 1K-token document: the keys are found turn by turn."""
    config = BenchConfig(tasks=["passkeys"], lengths=[1024], policies=["full"], budgets=[], n=1, out=tmp_path,
                         in_process=True)
    config.engines[(None, smollm2.chunk, None)] = smollm2  # reuse the session's engine (the runner's key)
    run(config, say=lambda line: None)
    (row,) = _rows(tmp_path)
    found = [k["found"] for k in row["keys"]]
    assert row["score"] == sum(found) / 5 and sum(found) >= 3, [k["output"] for k in row["keys"]]
