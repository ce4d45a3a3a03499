"""The plain terminal chat loop, driven through stdin/stdout on a tiny local model."""

from __future__ import annotations

import argparse
import io

from localchat.chat import run_chat
from localchat.engine.sampling import GenerationSettings
from tiny import save_tiny


def test_chat_attaches_answers_and_survives_bad_input(tmp_path):
    model_dir = save_tiny(tmp_path / "m")
    doc = tmp_path / "my notes.txt"
    doc.write_text("alpha beta gamma\n")
    script = "\n".join([
        "hello",
        f"'{doc}'",  # a dropped file arrives as a quoted path
        "/attach /no/such/file.txt",
        "/bogus",
        "what does it say?",
        "/quit",
    ]) + "\n"
    out = io.StringIO()
    args = argparse.Namespace(model=str(model_dir), chunk=32, max_file_mb=1.0, policy=None, budget=None,
                              stabilizers=None, local=None, positions=None, heads=None,
                              decode_window=None)
    assert run_chat(args, GenerationSettings(max_new_tokens=4), stdin=io.StringIO(script), stdout=out) == 0
    text = out.getvalue()
    assert "attached my notes.txt: 17 tokens" in text
    assert "error: no such file: /no/such/file.txt" in text
    assert "error: unknown command /bogus" in text
    assert text.count("bot> ") == 2 and text.count("tokens read at") == 2
