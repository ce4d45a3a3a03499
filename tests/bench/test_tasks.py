"""Task generators: the answer is really in the text, at the stated depth and length, per seed; scoring rules."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from localchat.bench.tasks import (
    MAX_SENTENCE,
    PASSKEY_FILLER,
    TASKS,
    make_sample,
    passkey,
    prompt_messages,
    score,
    score_passkey,
    user_message,
)

NEEDLE_TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "doc_qa", "multiturn"]


def _count(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_passkey_is_deterministic_and_placed(tiny_tok):
    a, b = passkey(tiny_tok, 2000, seed=3), passkey(tiny_tok, 2000, seed=3)
    assert a == b and passkey(tiny_tok, 2000, seed=4).answer != a.answer
    assert a.document.count(a.answer) == 2 and len(a.answer) == 5 and a.answer.isdigit()
    assert 1900 <= a.n_tokens <= 2000
    ids = tiny_tok(a.document, add_special_tokens=False)["input_ids"]
    assert tiny_tok.decode(ids[a.needle_token:]).startswith("The pass key is " + a.answer)
    filler = _count(tiny_tok, PASSKEY_FILLER)
    for depth in (0.0, 0.25, 0.5, 1.0):
        s = passkey(tiny_tok, 1000, seed=1, depth=depth)
        needle = _count(tiny_tok, f"The pass key is {s.answer}. Remember it. {s.answer} is the pass key. ")
        assert abs(s.needle_token - depth * (s.n_tokens - needle)) <= filler


def test_passkey_scoring(tiny_tok):
    s = passkey(tiny_tok, 300, seed=0)
    assert score_passkey(s, f"The pass key is {s.answer}.") and not score_passkey(s, "I do not know.")


@pytest.mark.parametrize("n", [1500, 4000])
@pytest.mark.parametrize("task", list(TASKS))
def test_every_task_is_sized_seeded_and_answerable(tiny_tok, task, n):
    s = make_sample(task, tiny_tok, n, seed=7, depth=0.3)
    assert s == make_sample(task, tiny_tok, n, seed=7, depth=0.3)
    other = make_sample(task, tiny_tok, n, seed=8, depth=0.3)
    assert other.document != s.document and other.answers != s.answers
    assert 0.97 * n <= s.n_tokens <= n and s.n_tokens == _count(tiny_tok, s.document)
    assert s.task == task and s.question and s.answers and all(a in s.document for a in s.answers)
    assert score(s, s.answer) == 1 and score(s, "I could not find it.") == 0


def _needle_texts(tok, sample):
    """The sentence that starts at each needle offset."""
    ids = tok(sample.document, add_special_tokens=False)["input_ids"]
    texts = []
    for offset in sample.needle_tokens:
        text = tok.decode(ids[offset:offset + 300])
        texts.append(text[: text.index(".") + 1])
    return texts


@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("task", NEEDLE_TASKS)
def test_needles_sit_at_their_depth(tiny_tok, task, depth):
    s = make_sample(task, tiny_tok, 4000, seed=11, depth=depth)
    texts = _needle_texts(tiny_tok, s)
    assert s.needle_token == s.needle_tokens[0] and s.depth == depth
    assert s.answers[0] in texts[0]  # the asked needle is where the sample says
    if task == "niah_multivalue":
        assert all(any(v in t for t in texts) for v in s.answers)
    costs = [_count(tiny_tok, " " + t) for t in texts]
    filler = s.n_tokens - sum(costs)
    before = s.needle_token - sum(c for o, c in zip(s.needle_tokens, costs) if o < s.needle_token)
    assert abs(before - depth * filler) <= MAX_SENTENCE // 2 + 2


def test_variable_chain_is_in_document_order(tiny_tok):
    s = make_sample("variable_tracking", tiny_tok, 3000, seed=2, depth=0.2)
    chain = s.needle_tokens[: len(s.answers)]
    assert list(chain) == sorted(chain)
    value = re.search(r"value (\d+)", s.question).group(1)
    assert f"VAR {s.answers[0]} = {value}." in s.document
    for a, b in zip(s.answers, s.answers[1:]):
        assert f"VAR {b} = VAR {a}." in s.document


def test_common_words_are_the_most_common(tiny_tok):
    s = make_sample("common_words", tiny_tok, 3000, seed=5, depth=None)
    counts = Counter(re.findall(r"^\d+\. (\w+)$", s.document, flags=re.M))
    top = {w for w, _ in counts.most_common(len(s.answers))}
    assert top == set(s.answers)
    assert min(counts[w] for w in s.answers) > max(c for w, c in counts.items() if w not in s.answers)
    assert s.depth is None and s.needle_token == -1


def test_multiturn_conversation(tiny_tok):
    s = make_sample("multiturn", tiny_tok, 1500, seed=4, depth=0.5)
    roles = [m["role"] for m in s.messages]
    assert roles == ["user", "assistant"] * 10 + ["user"]  # the document, 9 unrelated turns, the question
    assert s.document in s.messages[0]["content"] and s.answer not in "".join(m["content"] for m in s.messages[1:])
    assert s.messages[-1]["content"] == s.question and prompt_messages(s) == [dict(m) for m in s.messages]
    assert s == make_sample("multiturn", tiny_tok, 1500, seed=4, depth=0.5)


def test_prompt_uses_the_app_layout(tiny_tok):
    s = make_sample("niah_single", tiny_tok, 800, seed=1, depth=0.5)
    (message,) = prompt_messages(s)
    assert message == {"role": "user", "content": user_message(s.question, s.document)}
    assert message["content"].count(s.question) == 2 and '<document name="document.txt">' in message["content"]


def test_needle_scoring(tiny_tok):
    s = make_sample("niah_multikey", tiny_tok, 1500, seed=3, depth=0.5)
    distractor = next(v for v in re.findall(r"is: (\d{7})\.", s.document) if v != s.answer)
    assert score(s, f"It is {s.answer}.") and not score(s, f"It is {distractor}.")
    assert not score(s, f"It is 9{s.answer}.")  # whole digit runs only
    single = make_sample("niah_single", tiny_tok, 1500, seed=3, depth=0.5)
    assert score(single, f"{single.answer}") and not score(single, "1234567")


def test_multivalue_needs_every_value(tiny_tok):
    s = make_sample("niah_multivalue", tiny_tok, 1500, seed=3, depth=0.5)
    assert score(s, " and ".join(reversed(s.answers)))
    assert not score(s, ", ".join(s.answers[:-1]))


def test_variable_tracking_needs_the_exact_set(tiny_tok):
    s = make_sample("variable_tracking", tiny_tok, 1500, seed=3, depth=0.5)
    names = list(s.answers)
    assert score(s, "VAR " + ", VAR ".join(reversed(names)))
    assert not score(s, ", ".join(names[:-1]))
    other = next(n for n in re.findall(r"VAR ([A-Z]{5})", s.document) if n not in names)
    assert not score(s, ", ".join([*names, other]))


def test_common_words_scores_recall(tiny_tok):
    s = make_sample("common_words", tiny_tok, 1500, seed=3, depth=None)
    words = list(s.answers)
    assert score(s, ", ".join(w.upper() for w in words)) == 1.0
    assert score(s, ", ".join(words[:5])) == 0.5 and score(s, "nothing here") == 0.0


def test_doc_qa_scoring(tiny_tok):
    s = make_sample("doc_qa", tiny_tok, 1500, seed=6, depth=0.5)
    assert score(s, f"It is {s.answer.upper()}.") and not score(s, "It is Nowhere.")
    assert s.answer in s.document and s.question.endswith("Answer briefly.")
