"""The commands that load no model start without torch or transformers: --help, plan (a profile's, --json, a
config.json directory's, a hybrid model's card), sessions (list, --show, --delete), profile list / show and
policies. Each runs in a fresh interpreter, as a user's does, with its config, data and cache directories in tmp."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest

CHECK = """
import sys
from localchat.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print("EXIT", code, "HEAVY", ",".join(heavy) or "-", file=sys.stderr)
"""

CONFIG = {"model_type": "llama", "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 8,
          "num_hidden_layers": 16, "vocab_size": 32000, "intermediate_size": 8192, "max_position_embeddings": 8192}


@pytest.fixture
def dirs(tmp_path):
    env = {**os.environ, "LOCALCHAT_CONFIG_DIR": str(tmp_path / "config"), "LOCALCHAT_DATA_DIR": str(tmp_path / "data"),
           "LOCALCHAT_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIG))
    return env, model


def _run(env, *argv) -> tuple[int, str, str]:
    out = subprocess.run([sys.executable, "-c", CHECK, *argv], env=env, capture_output=True, text=True, timeout=120)
    last = out.stderr.strip().splitlines()[-1].split()
    assert last[0] == "EXIT", out.stderr
    return int(last[1]), last[3], out.stdout


def _save_chat(env, name: str, monkeypatch) -> None:
    """A saved chat with its settings, written as the store writes one (no model needed)."""
    from localchat.args import flags
    from localchat.planning.resolve import resolve
    from localchat.store import Store, rows

    for key in ("LOCALCHAT_CONFIG_DIR", "LOCALCHAT_DATA_DIR"):
        monkeypatch.setenv(key, env[key])
    spec = resolve(flags(argparse.Namespace(policy="sirllm", budget=512)), plan=False, quiet=True)
    store = Store()
    now = time.time()
    row = {"title": "notes", "model": "tiny", "policy": "sirllm", "system": None, "created": now, "updated": now,
           "fed": 0, "kept_units": 0, "kept_bytes": 0, "cache_file": None,
           "settings": json.dumps({"budget": 512, "spec": spec.to_dict()})}
    rows.write(store.db, name, row, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
               [], None)


COMMANDS = [
    ["--help"],
    ["--profile", "rtx4090", "plan"],
    ["--profile", "rtx4090", "plan", "--json"],
    ["plan"],
    ["plan", "--model", "{model}"],
    ["plan", "--model", "{model}", "--policy", "locret", "--heads", "random", "--json"],
    ["plan", "--model", "qwen3.6-27b", "--memory-gb", "24", "--device", "cuda"],  # a hybrid card
    ["profile", "list"],
    ["profile", "show"],
    ["--profile", "rtx4090", "profile", "show"],
    ["policies"],
    ["sessions"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_a_command_without_a_model_imports_no_torch(dirs, argv):
    env, model = dirs
    code, heavy, out = _run(env, *[a.format(model=model) for a in argv])
    assert code == 0 and out.strip()
    assert heavy == "-", f"localchat {' '.join(argv)} imported {heavy}"


def test_sessions_show_and_delete_import_no_torch(dirs, monkeypatch):
    env, _ = dirs
    _save_chat(env, "notes", monkeypatch)
    code, heavy, out = _run(env, "sessions")
    assert (code, heavy) == (0, "-") and "notes" in out and "sirllm b=512" in out
    code, heavy, out = _run(env, "sessions", "--show", "notes")
    assert (code, heavy) == (0, "-") and "policy" in out and "sirllm" in out and "512" in out
    code, heavy, out = _run(env, "sessions", "--delete", "notes")
    assert (code, heavy) == (0, "-") and out.strip() == "deleted notes"
    assert "notes" not in _run(env, "sessions")[2]


def test_a_policy_outside_the_light_path_still_plans(dirs):
    """A policy whose module imports torch is planned as before (its class is imported then)."""
    env, model = dirs
    code, _, out = _run(env, "plan", "--model", str(model), "--policy", "h2o", "--budget", "300")
    assert code == 0 and "budget       300 units" in out
