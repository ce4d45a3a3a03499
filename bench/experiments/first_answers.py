"""Short chat questions answered greedily at each weight precision: does a quantized model write what fp32 writes?

The grid measures retrieval (pass keys, needles) on long documents; a chat's first question is short, and its
first answer token decides the rest of a greedy answer. For each question of QUESTIONS, each `--weights` answers
`--tokens` greedy tokens on the same model (the embedded default unless `--model`); a row records whether the
answer's tokens equal fp32's (all of them, and the first), and fp32's margin for the first token (the gap between
its two best logits: a small margin is an answer any rounding can flip).

    python bench/experiments/first_answers.py --weights fp32,int8,int4 --out OUT.json
Writes OUT.json and OUT.md beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from localchat.engine.engine import Engine
from localchat.engine.events import Done, Error, Token
from localchat.engine.sampling import GenerationSettings

QUESTIONS = (
    "What is the capital of France?",
    "What is two plus two?",
    "Name three colors.",
    "What is water made of?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "How many days are in a week?",
    "What is the largest planet in our solar system?",
    "Give me a synonym for happy.",
    "What do bees make?",
    "Say hello in three words.",
    "What is the boiling point of water in Celsius?",
    "Write one sentence about the sea.",
    "What is the opposite of cold?",
    "Which animal says moo?",
    "What is 10 times 5?",
    "Name a fruit that is yellow.",
    "What language is spoken in Brazil?",
    "What is the first letter of the alphabet?",
    "Suggest a name for a cat.",
)


def answer(engine: Engine, question: str, tokens: int) -> list[int]:
    ids = []
    for event in engine.chat([{"role": "user", "content": question}], GenerationSettings(max_new_tokens=tokens)):
        if isinstance(event, Token):
            ids.append(event.token_id)
        if isinstance(event, Error):
            raise SystemExit(f"error: {event.message}")
        if isinstance(event, Done):
            break
    return ids


def margin(engine: Engine, question: str) -> float:
    """fp32's gap between its two best first-token logits."""
    ids = torch.tensor([engine.encode_chat([{"role": "user", "content": question}])])
    with torch.inference_mode():
        logits = engine.model(ids, logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model id or folder (default: the embedded default)")
    p.add_argument("--weights", default="fp32,int8,int4", help="the first is the reference")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--out", required=True, help="OUT.json; OUT.md beside it")
    args = p.parse_args(argv)
    weights = args.weights.split(",")
    answers: dict[str, list[list[int]]] = {}
    margins = []
    for w in weights:
        engine = Engine.load(args.model, weights=w, say=lambda m: None)
        answers[w] = [answer(engine, q, args.tokens) for q in QUESTIONS]
        if w == weights[0]:
            margins = [margin(engine, q) for q in QUESTIONS]
            tokenizer = engine.tokenizer
        del engine
    ref = answers[weights[0]]
    rows = []
    for i, q in enumerate(QUESTIONS):
        row = {"question": q, "margin": round(margins[i], 3),
               weights[0]: tokenizer.decode(ref[i])}
        for w in weights[1:]:
            got = answers[w][i]
            row[w] = tokenizer.decode(got)
            row[f"{w}_same"] = got == ref[i]
            row[f"{w}_same_first"] = got[:1] == ref[i][:1]
        rows.append(row)
    summary = {w: {"same": sum(r[f"{w}_same"] for r in rows), "same_first": sum(r[f"{w}_same_first"] for r in rows)}
               for w in weights[1:]}
    command = "python bench/experiments/first_answers.py " + " ".join(argv or __import__("sys").argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "tokens": args.tokens, "summary": summary, "rows": rows},
                              indent=2, ensure_ascii=False) + "\n")
    lines = [f"# {len(QUESTIONS)} short questions, {args.tokens} greedy tokens, against {weights[0]}", "",
             f"Command: `{command}`", ""]
    lines += [f"- {w}: the same answer on {s['same']} of {len(rows)}, the same first token on {s['same_first']}"
              for w, s in summary.items()]
    lines += ["", "| question | margin | " + " | ".join(weights) + " |", "|---|---|" + "---|" * len(weights)]
    for r in rows:
        cells = [r[weights[0]]] + [("= " if r[f"{w}_same"] else "") + r[w] for w in weights[1:]]
        lines.append(f"| {r['question']} | {r['margin']} | " + " | ".join(c.replace("\n", " ").replace("|", "/")
                                                                         for c in cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:6 + len(summary)]))


if __name__ == "__main__":
    main()
