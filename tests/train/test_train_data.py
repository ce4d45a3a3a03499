"""Training data: samples carry their answers, windows cover the needles, label files are written once."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
from tiny import tiny_llama

from localchat.bench.corpus import split_of
from localchat.engine.engine import Engine
from localchat.train import dataset
from localchat.train.data import KINDS, make_sample, make_samples
from localchat.train.sources import _files, source_text


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


def test_an_interrupted_label_write_leaves_nothing_in_the_folder_and_the_next_run_redoes_it(tmp_path, tiny_tok,
                                                                                             monkeypatch):
    engine = Engine(tiny_llama(len(tiny_tok), layers=2), tiny_tok, name="tiny", chunk=128)
    samples = [make_sample("code", tiny_tok, 300, 1)]
    real_save = dataset.save_file

    def killed_after_the_write(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        raise KeyboardInterrupt  # the run stops between writing the file and renaming it into place

    monkeypatch.setattr(dataset, "save_file", killed_after_the_write)
    with pytest.raises(KeyboardInterrupt):
        dataset.build(engine, samples, tmp_path, keep=128, window=32, say=lambda m: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["partial"]  # no half or stray file where files are read
    left = tmp_path / "partial" / "sample-00000.safetensors"
    assert left.exists()

    monkeypatch.setattr(dataset, "save_file", real_save)
    notes = []
    dataset.build(engine, samples, tmp_path, keep=128, window=32, say=notes.append)
    assert len(notes) == 1  # the interrupted sample is computed again, and nothing is left behind
    assert not any((tmp_path / "partial").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["partial", "sample-00000.safetensors"]
    assert dataset.load(tmp_path / "sample-00000.safetensors")["features"].shape[0] == 2


def test_collect_leftovers_removes_only_old_partial_files(tmp_path):
    old = time.time() - dataset.LEFTOVER_AGE - 60
    scratch = tmp_path / "partial"
    scratch.mkdir()
    planted = {
        tmp_path / "sample-00007.tmp": True,  # an earlier version's own temporary name
        tmp_path / ".tmpAbC123": True,  # safetensors' temporary file, beside the target before partial/
        scratch / "sample-00002.safetensors": True,
        scratch / ".tmpXyZ789": False,  # young: a write in progress
        tmp_path / "notes.tmp": False,  # the user's, not a name we write
        tmp_path / "sample-00001.safetensors": False,  # a finished label file
    }
    for path, is_old in planted.items():
        path.write_bytes(b"x")
        if is_old or path.name != ".tmpXyZ789":
            os.utime(path, (old, old))
    (scratch / "kept-dir").mkdir()
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"y")
    os.utime(target, (old, old))
    (scratch / "link").symlink_to(target)

    assert dataset.collect_leftovers(tmp_path) == 3
    assert {p for p in planted if p.exists()} == {p for p, is_old in planted.items() if not is_old}
    assert (scratch / "kept-dir").is_dir() and (scratch / "link").is_symlink() and target.exists()


def test_a_hybrid_models_heads_are_trained_for_its_global_layers_only(tmp_path, tiny_tok):
    """Gemma 3's sliding layers keep their window whatever the policy: heads are trained, saved and used for the
    layers whose cache grows (head_shape's `scored`), from labels of a real read, and LOCRET reads with them."""
    from safetensors.torch import load_file
    from tiny import tiny_architecture

    from localchat.engine.events import Done
    from localchat.engine.heads import RetainingHeads, head_shape
    from localchat.engine.policies import make_policy
    from localchat.engine.sampling import GenerationSettings
    from localchat.train.loop import Recipe, train

    model = tiny_architecture("gemma3_text", len(tiny_tok))
    engine = Engine(model, tiny_tok, name="tiny", chunk=64)
    shape = head_shape(model)
    grows = [i for i, kind in enumerate(engine.kinds) if kind.grows]
    assert shape["scored"] == grows and 0 < len(grows) < shape["layers"]
    samples = [make_sample("code", tiny_tok, 300, seed) for seed in range(3)]
    files = dataset.build(engine, samples, tmp_path / "data", keep=128, window=32, say=lambda m: None)
    recipe = Recipe(d_r=16, steps=20, warmup=2, eval_every=10, checkpoint_every=10)
    log = train(shape, files[:2], files[2:], tmp_path / "heads", recipe, {"model": "tiny"}, say=lambda m: None)
    assert log["eval"] and all(torch.isfinite(torch.tensor(e["loss"])) for e in log["eval"])
    saved = load_file(tmp_path / "heads" / "heads.safetensors")
    assert {int(name.split(".")[1]) for name in saved} == set(grows)
    heads = RetainingHeads.load(tmp_path / "heads")
    assert [i for i in range(shape["layers"]) if heads.head(i) is not None] == grows
    engine.set_policy(make_policy("locret", heads=heads, budget=64, stabilizers=8, local=16))
    done = list(engine.chat([{"role": "user", "content": "lorem ipsum " * 200}], GenerationSettings(max_new_tokens=4)))[-1]
    assert isinstance(done, Done) and done.prompt_tokens > 300 and done.kv_tokens <= 64 + 16 + 64
