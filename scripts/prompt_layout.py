"""Which prompt layout lets SmolLM2-135M find a pass key in a 6K-token document (full attention, greedy)?

Run: python scripts/prompt_layout.py A C   (output kept in bench/results/prompt-layout-smollm2-6k.txt)
A = the document, then the question; C = localchat.render.user_turn (question, document, question).
"""

import sys
from pathlib import Path

from localchat.bench.tasks import passkey
from localchat.documents import Document
from localchat.engine.engine import Engine
from localchat.engine.sampling import GenerationSettings
from localchat.render import user_turn

QUESTION = "What is the pass key?"


def layout_a(text: str, q: str) -> str:
    return f'<document name="doc.txt">\n{text.strip()}\n</document>\n\n{q}'


def layout_c(text: str, q: str) -> str:
    return user_turn(q, [Document(Path("doc.txt"), "doc.txt", "text", text, "", len(text))])


def main() -> None:
    engine = Engine.load(None)
    for name in sys.argv[1:]:
        build = {"A": layout_a, "C": layout_c}[name]
        ok = 0
        for seed, depth in [(7, 0.95), (1, 0.1), (2, 0.3), (3, 0.5), (4, 0.7), (5, 0.85)]:
            s = passkey(engine.tokenizer, 6000, seed, depth)
            messages = [{"role": "user", "content": build(s.document, QUESTION)}]
            done = list(engine.chat(messages, GenerationSettings(max_new_tokens=24)))[-1]
            hit = s.answer in done.text
            ok += hit
            print(name, seed, depth, hit, repr(done.text[:60]), flush=True)
        print(name, "total", ok, flush=True)


if __name__ == "__main__":
    main()
