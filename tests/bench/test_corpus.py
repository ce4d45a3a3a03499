"""Natural text from standard-library docstrings: splits disjoint by module, deterministic, sized."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from localchat.bench.corpus import clean, modules, natural_text, paragraphs, sections, split_of


def test_splits_are_disjoint_by_module_and_by_paragraph():
    train, evals = modules("train"), modules("eval")
    assert len(train) > 50 and len(evals) > 50 and not set(train) & set(evals)
    assert all(split_of(m) == "train" for m in train) and all(split_of(m) == "eval" for m in evals)
    assert not set(paragraphs("train")) & set(paragraphs("eval"))
    assert sum(map(len, paragraphs("eval"))) > 100_000


def test_text_is_deterministic_sized_and_seeded():
    a = natural_text("eval", 5000, seed=3)
    assert a == natural_text("eval", 5000, seed=3) and a != natural_text("eval", 5000, seed=4)
    assert 4000 <= len(a) <= 5000 and a.endswith(".") and "\n\n" in a
    assert natural_text("train", 5000, seed=3) != a
    big = natural_text("eval", 2 * sum(map(len, paragraphs("eval"))), seed=1)  # more than the split holds
    assert len(big) > sum(map(len, paragraphs("eval")))
    with pytest.raises(ValueError):
        natural_text("test", 100, 0)


def test_text_is_the_same_in_a_fresh_process():
    code = ("import hashlib; from localchat.bench.corpus import natural_text; "
            "print(hashlib.sha256(natural_text('eval', 20000, 9).encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == hashlib.sha256(natural_text("eval", 20000, 9).encode()).hexdigest()


def test_cleaning_keeps_prose_only():
    doc = ("Return the sum of the values in the given list of numbers.\n\n"
           ">>> total([1, 2])\n3\n\n"
           "Parameters:\n    values -- the numbers\n\n"
           "See :func:`math.fsum` for a more accurate way to add floating point numbers.\n\n"
           "x = {a: b for a, b in pairs if a_b[c] == d_e}  # code-like text.\n\n"
           "Too short.")
    assert clean(doc) == ["Return the sum of the values in the given list of numbers.",
                          "See math.fsum for a more accurate way to add floating point numbers."]


def test_reference_sections_stay_in_their_split():
    evals = sections("eval")
    assert len(evals) > 1000 and {s.kind for s in evals} == {"module", "class", "function"}
    assert all(split_of(s.name.split(".")[0]) == "eval" for s in evals)
    assert len({s.doc for s in evals}) == len(evals)  # no docstring twice
    train = set(paragraphs("train"))
    assert not any(p in train for s in evals for p in clean(s.doc))
    assert not any(" at 0x" in s.header for s in evals)  # defaults with an address show as ...
    quote = next(s for s in evals if s.name == "shlex.quote")
    assert quote.text.startswith("## shlex.quote(s)\nReturn a shell-escaped version of the string *s*.")
