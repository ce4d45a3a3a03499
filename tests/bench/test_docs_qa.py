"""docs_qa: questions about real reference text (standard-library docstrings of the eval split), answers read
from the objects themselves, placed at the asked depth, sized in tokens, scored."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import re
import subprocess
import sys

import pytest

from localchat.bench import tasks
from localchat.bench.corpus import split_of
from localchat.bench.tasks import FACT_KINDS, MAX_SECTION, Sample, _first_sentence, docs_qa, reference, score


def _count(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


def _resolve(dotted: str):
    """The object a section's dotted name stands for, imported afresh by name."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise AssertionError(f"cannot import {dotted}")


def _asked_header(tok, sample) -> str:
    """The header line of the section that starts at the sample's needle offset."""
    ids = tok(sample.document, add_special_tokens=False)["input_ids"]
    text = tok.decode(ids[sample.needle_token:])
    assert text.startswith("## ")
    return text[3:].split("\n", 1)[0]


@pytest.mark.parametrize("kind", FACT_KINDS)
def test_deterministic_sized_and_from_the_eval_split(tiny_tok, kind):
    for n in (4000, 16000):
        s = docs_qa(tiny_tok, n, seed=3, depth=0.5, kind=kind)
        assert s == docs_qa(tiny_tok, n, seed=3, depth=0.5, kind=kind)
        assert docs_qa(tiny_tok, n, seed=4, depth=0.5, kind=kind).document != s.document
        assert 0.97 * n <= s.n_tokens <= n and s.n_tokens == _count(tiny_tok, s.document)
        headers = re.findall(r"^## (?:class |module )?([\w.]+)", s.document, flags=re.M)
        assert len(headers) == len(set(headers)) > 5  # no section twice
        assert all(split_of(h.split(".")[0]) == "eval" for h in headers)
    kinds = {docs_qa(tiny_tok, 1500, seed=seed).answer.isidentifier() for seed in range(8)}
    assert kinds == {True, False}  # the seed draws both kinds


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", FACT_KINDS)
def test_the_answer_sits_at_the_needle_and_only_there(tiny_tok, kind, seed):
    s = docs_qa(tiny_tok, 4000, seed=seed, depth=0.6, kind=kind)
    header = _asked_header(tiny_tok, s)
    name = re.match(r"(?:class )?([\w.]+)", header).group(1)
    if kind == "default":
        assert s.answer in header and name in s.question
    else:
        assert name.rsplit(".", 1)[1] == s.answer and s.answer not in s.question
    key = " ".join(re.findall(r"[a-z0-9]+", s.answer.lower()))
    sections = s.document.split("\n\n## ")
    holding = [sec for sec in sections if f" {key} " in " " + " ".join(re.findall(r"[a-z0-9]+", sec.lower())) + " "]
    assert len(holding) == 1 and holding[0].removeprefix("## ").split("\n", 1)[0] == header


def test_every_default_is_what_inspect_reads():
    facts = reference().facts["default"]
    assert len(facts) >= 10
    for fact in facts:
        name, param = re.search(r"parameter (\w+) of ([\w.]+)\?", fact.question).group(2, 1)
        obj = _resolve(name)
        assert repr(inspect.signature(obj).parameters[param].default) == fact.answer, fact.question
        assert reference().sections[fact.section].name == name


def test_names_and_first_sentences_are_the_objects_own():
    ref = reference()
    facts = ref.facts["name"]
    assert len(facts) >= 200
    for fact in facts[::25]:
        section = ref.sections[fact.section]
        doc = inspect.cleandoc(_resolve(section.name).__doc__)
        sentence = re.search(r'begins: "(.+)" Answer', fact.question).group(1)
        assert section.name.endswith("." + fact.answer) and section.doc == doc
        assert _first_sentence(doc) == sentence and doc.startswith(sentence.split(" ")[0])


@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
def test_the_asked_section_sits_at_its_depth(tiny_tok, depth):
    s = docs_qa(tiny_tok, 16000, seed=5, depth=depth)
    before = s.document[:s.document.index("## " + _asked_header(tiny_tok, s))]
    after = s.document[len(before):]
    asked, _, rest = after.removeprefix("\n\n").partition("\n\n## ")
    filler = s.n_tokens - _count(tiny_tok, "\n\n" + asked)
    neighbours = [before.split("\n\n## ")[-1] if before else "", rest.split("\n\n## ")[0]]
    slack = max(_count(tiny_tok, text) for text in neighbours) // 2 + 8
    assert s.depth == depth and abs(s.needle_token - depth * filler) <= slack
    assert max(map(len, s.document.split("\n\n## "))) <= MAX_SECTION


def _asking(test) -> Sample:
    """A docs_qa sample (no document: scoring reads only the answer) for the first default fact whose answer
    passes `test`."""
    answer = next(f.answer for f in reference().facts["default"] if test(f.answer))
    return Sample("docs_qa", "", "", answer, 0, -1, None, answers=(answer,))


def test_scoring(tiny_tok):
    text = _asking(lambda a: a[0] == "'")
    value = text.answer.strip("'")
    assert score(text, text.answer) and score(text, f"The default is {value.upper()}.") and score(text, f'"{value}"')
    other = next(f.answer for f in reference().facts["default"] if f.answer != text.answer)
    assert not score(text, other) and not score(text, value + "x") and not score(text, "None")
    number = _asking(lambda a: a[0] != "'" and not a.startswith("-") and "e" not in a)
    assert score(number, number.answer) and score(number, f"It is {number.answer}.")
    assert score(number, f"= {number.answer}.0")
    for wrong in ("-" + number.answer, number.answer + "1", number.answer[:-1], "v" + number.answer, "None"):
        assert not score(number, f"It is {wrong}."), wrong
    negative = _asking(lambda a: a.startswith("-"))
    assert score(negative, f"timeout={negative.answer}") and not score(negative, negative.answer[1:])
    tiny = _asking(lambda a: "e-" in a)  # 1e-09
    assert score(tiny, tiny.answer.replace("e-0", "e-")) and not score(tiny, tiny.answer.replace("e-0", "e-1"))
    name = docs_qa(tiny_tok, 1500, seed=2, depth=0.5, kind="name")
    assert score(name, name.answer) and score(name, f"It is module.{name.answer.upper()}().")
    assert not score(name, name.answer + "_plus") and not score(name, "x" + name.answer)
    assert not score(name, "I could not find it.")


def test_bad_input(tiny_tok, monkeypatch):
    with pytest.raises(ValueError, match="kind"):
        docs_qa(tiny_tok, 4000, seed=1, kind="colour")
    with pytest.raises(ValueError, match="cannot hold"):
        docs_qa(tiny_tok, 40, seed=1)
    ref = reference()
    few = tasks.Reference(ref.sections[:80], ref.normed[:80],
                          {k: tuple(f for f in fs if f.section < 80) for k, fs in ref.facts.items()})
    monkeypatch.setattr(tasks, "reference", lambda: few)
    assert 0.97 * 4000 <= docs_qa(tiny_tok, 4000, seed=1, kind="name").n_tokens <= 4000
    with pytest.raises(ValueError, match="reference text fills only"):
        docs_qa(tiny_tok, 40_000, seed=1, kind="name")  # more than these sections hold without repeating one


def test_sections_are_the_same_in_a_fresh_process():
    code = ("import hashlib; from localchat.bench.tasks import reference; r = reference(); "
            "print(hashlib.sha256(repr((r.sections, r.facts)).encode()).hexdigest())")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # set reprs would differ
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    ref = reference()
    assert out.stdout.strip() == hashlib.sha256(repr((ref.sections, ref.facts)).encode()).hexdigest()
