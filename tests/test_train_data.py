"""Training data: samples carry their answers, windows cover the needles, label files are written once."""

from __future__ import annotations

import random

import torch

from localchat.bench.corpus import split_of
from localchat.engine.engine import Engine
from localchat.train import dataset
from localchat.train.data import KINDS, make_sample, make_samples
from localchat.train.sources import _files, source_text
from tiny import tiny_llama


def test_every_kind_hides_its_answer_in_the_document(tiny_tok):
    for i, kind in enumerate(KINDS):
        s = make_sample(kind, tiny_tok, 1500, seed=i)
        n = len(tiny_tok(s.document, add_special_tokens=False)["input_ids"])
        assert 1200 <= n <= 1700, (kind, n)
        assert all(needle in s.document for needle in s.needles), kind
        if s.answer is not None:
            value = s.answer.rstrip(".").split()[-1]
            assert value in s.document, kind
        assert s.question in s.message()["content"] and s.document.strip() in s.message()["content"]
    assert make_sample("needle", tiny_tok, 900, 3) == make_sample("needle", tiny_tok, 900, 3)
    assert len({s.kind for s in make_samples(tiny_tok, 12, 0, 500, 900)}) == len(KINDS)


def test_source_code_comes_only_from_training_modules():
    files = _files("train")
    def module(path: str) -> str:
        parts = path.removesuffix(".py").split("/")
        return parts[-2] if parts[-1] == "__init__" else parts[-1]

    assert files and all(split_of(module(f)) == "train" for f in files)
    text = source_text("train", 5000, 1)
    assert 4000 < len(text) <= 5000 and text == source_text("train", 5000, 1)


def test_windows_cover_needles_tail_and_budget():
    rng = random.Random(0)
    importance = torch.zeros(1000)
    importance[500:510] = 5.0
    pos = dataset.choose_windows(1000, importance, [(130, 140)], window=64, keep=384, rng=rng)
    assert torch.equal(pos, pos.sort().values) and len(set(pos.tolist())) == len(pos)
    got = set(pos.tolist())
    assert set(range(130, 140)) <= got and set(range(500, 510)) <= got and 999 in got
    assert 384 - 64 <= len(pos) <= 448


def test_build_writes_label_files_once(tmp_path, tiny_tok):
    engine = Engine(tiny_llama(len(tiny_tok), layers=2), tiny_tok, name="tiny", chunk=128)
    samples = [make_sample("code", tiny_tok, 400, 1), make_sample("natural", tiny_tok, 300, 2)]
    notes = []
    files = dataset.build(engine, samples, tmp_path, keep=128, window=32, say=notes.append)
    assert len(notes) == 2 and all(f.exists() for f in files)
    d = dataset.load(files[0], ("features", "logit", "prob", "adjacent", "positions", "full_logit"))
    m = len(d["positions"])
    assert d["features"].shape == (2, m, (4 + 2 * 2) * 16) and d["features"].dtype == torch.float16
    assert d["logit"].shape == (2, 2, m) and d["full_logit"].shape[-1] > m
    assert torch.equal(d["logit"], d["full_logit"][:, :, d["positions"]])
    assert d["adjacent"][:-1].bool().any() and d["adjacent"][-1] == 0
    dataset.build(engine, samples, tmp_path, keep=128, window=32, say=notes.append)
    assert len(notes) == 2  # nothing recomputed
