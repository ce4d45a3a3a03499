"""Converted weights carry checksums (engine/weights_check.py): damage is one line and a re-conversion, never a
load of garbage; a file that is not a GGUF, or a truncated one, is one line (exit 2) and leaves no lock file."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from localchat.cli import main
from localchat.engine import default_model, loading, weights_check
from localchat.engine.default_model import DONE_MARKER, build_checked
from localchat.errors import ModelError


def _maker(out: Path, calls: list):
    """What convert_gguf does, with small weights: a temp dir with weights, stamp and marker, renamed over `out`."""

    def make() -> Path:
        calls.append(1)
        tmp = out.with_name(out.name + ".tmp")
        tmp.mkdir()
        save_file({"w": torch.arange(4096, dtype=torch.float32)}, str(tmp / "model.safetensors"))
        weights_check.stamp(tmp)
        (tmp / DONE_MARKER).write_text("converted")
        if out.exists():
            import shutil

            shutil.rmtree(out)
        os.replace(tmp, out)
        return out

    return make


def _flip(path: Path, keep_times: bool) -> None:
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    if keep_times:  # mtime set back: only ctime tells
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("damage", ["flip", "flip-keep-mtime", "truncate", "delete", "stamp"])
def test_damaged_converted_weights_are_said_and_converted_again(tmp_path, damage):
    out, calls, said = tmp_path / "hf", [], []
    build_checked(out, _maker(out, calls), said.append)
    assert calls == [1] and said == []
    weights = out / "model.safetensors"
    if damage.startswith("flip"):
        _flip(weights, keep_times=damage == "flip-keep-mtime")
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "delete":
        weights.unlink()
    else:
        (out / weights_check.STAMP).write_text("{not json")
    build_checked(out, _maker(out, calls), said.append)
    assert calls == [1, 1] and len(said) == 1 and "damaged" in said[0] and "\n" not in said[0]
    assert weights_check.problem(out) is None  # whole again
    build_checked(out, _maker(out, calls), said.append)
    assert calls == [1, 1] and len(said) == 1  # and left alone from then on


def test_a_touched_or_copied_file_is_hashed_once_then_trusted(tmp_path, monkeypatch):
    out, calls = tmp_path / "hf", []
    build_checked(out, _maker(out, calls), print)
    hashed = []
    real = weights_check.sha256_of
    monkeypatch.setattr(weights_check, "sha256_of", lambda p: hashed.append(p) or real(p))
    assert weights_check.problem(out) is None and hashed == []  # unchanged: a stat, no hashing
    later = time.time() + 5
    os.utime(out / "model.safetensors", (later, later))
    assert weights_check.problem(out) is None and len(hashed) == 1  # the same bytes: recorded
    assert weights_check.problem(out) is None and len(hashed) == 1
    assert calls == [1]


def test_a_directory_converted_before_checksums_is_trusted_once(tmp_path):
    out, calls = tmp_path / "hf", []
    build_checked(out, _maker(out, calls), print)
    (out / weights_check.STAMP).unlink()
    assert weights_check.problem(out) is None and (out / weights_check.STAMP).exists()
    _flip(out / "model.safetensors", keep_times=False)
    assert "does not match its sha256" in weights_check.problem(out)


def test_the_default_model_and_user_ggufs_are_checked(tmp_path, monkeypatch):
    """Both paths that convert go through build_checked (the wiring, with the conversion faked)."""
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))
    calls, said = [], []

    def convert(gguf, out, say):
        return _maker(out, calls)()

    monkeypatch.setattr(default_model, "convert_gguf", convert)
    monkeypatch.setattr(loading, "convert_gguf", convert)
    monkeypatch.setattr(default_model, "ensure_gguf", lambda card, say: tmp_path / "x.gguf")
    out = default_model.ensure_default_model(say=said.append)
    _flip(out / "model.safetensors", keep_times=True)
    assert default_model.ensure_default_model(say=said.append) == out and len(calls) == 2 and "damaged" in said[0]
    user = tmp_path / "mine.gguf"
    user.write_bytes(b"GGUF" + bytes(64))
    converted = loading._gguf_dir(user, said.append)
    _flip(converted / "model.safetensors", keep_times=False)
    assert loading._gguf_dir(user, said.append) == converted and len(calls) == 4 and len(said) == 2


def test_weights_that_stay_damaged_are_one_line(tmp_path):
    out = tmp_path / "hf"
    build_checked(out, _maker(out, []), print)

    def broken():
        path = _maker(out, [])()
        _flip(path / "model.safetensors", keep_times=False)
        return path

    _flip(out / "model.safetensors", keep_times=False)
    with pytest.raises(ModelError, match="fail their check again") as err:
        build_checked(out, broken, lambda line: None)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("content", [b"hello, not a model\n", b"", b"GGUF", b"GGUF\x03\x00\x00\x00" + bytes(20)])
def test_a_bogus_gguf_is_one_line_and_leaves_no_lock(content, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))
    bogus = tmp_path / "some.gguf"
    bogus.write_bytes(content)
    assert main(["--model", str(bogus), "ask", "q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and str(bogus) in err
    assert ("not a GGUF file" in err) if not content.startswith(b"GGUF") else ("damaged or incomplete GGUF" in err)
    models = tmp_path / "cache" / "models"
    assert not models.exists() or list(models.iterdir()) == []  # no lock, no temp dir, no half conversion


def test_a_truncated_real_gguf_is_one_line(tmp_path, monkeypatch, capsys):
    """A GGUF cut short (a tiny one written with the gguf package, then truncated)."""
    import gguf
    import numpy as np

    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "cut.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((64, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path.write_bytes(path.read_bytes()[:-200])
    assert main(["--model", str(path), "ask", "q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "damaged or incomplete GGUF" in err
    assert list((tmp_path / "cache" / "models").iterdir()) == []
