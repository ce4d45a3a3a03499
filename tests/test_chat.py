"""The plain terminal chat loop, driven through stdin/stdout on a tiny local model."""

from __future__ import annotations

import io

from tiny import save_tiny

from localchat.chat import run_chat
from localchat.documents import load_document
from localchat.engine.sampling import GenerationSettings
from localchat.planning.load import load_engine
from localchat.planning.resolve import resolve
from localchat.render import user_turn


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
    engine = load_engine(resolve({"model": str(model_dir), "chunk": 32, "profile": "none"}))
    assert run_chat(engine, GenerationSettings(max_new_tokens=4), max_bytes=2**20, stdin=io.StringIO(script),
                    stdout=out) == 0
    text = out.getvalue()
    assert "attached my notes.txt: 17 tokens" in text
    assert "error: no such file: /no/such/file.txt" in text
    assert "error: unknown command /bogus" in text
    assert text.count("bot> ") == 2 and text.count("tokens read at") == 2
    read = [int(line.split("(")[1].split()[0].replace(",", "")) for line in text.splitlines() if "tokens read at" in line]
    second = {"role": "user", "content": user_turn("what does it say?", [load_document(str(doc))])}
    alone = engine.count_tokens(engine.render([second]))
    again = engine.count_tokens(engine.render([{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""},
                                               second]))
    assert read[1] < again and read[1] <= alone + 4  # the session keeps turn one cached: turn two reads its own
