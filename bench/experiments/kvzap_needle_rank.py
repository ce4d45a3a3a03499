"""Where a needle's tokens rank among its document's tokens: by the KVzip+ label and by a trained KVzap scorer.

    python bench/experiments/kvzap_needle_rank.py bench/results/kvzap-smollm2-cpu/scorer --tokens 1800 \
        > bench/results/kvzap-smollm2-cpu/needle_rank.txt

For three passkey and three niah_single documents of N tokens (the bench's generators, seeds 1-3, needle at depth
0.5), laid out as the app lays out a document: "pct" is the needle value's tokens' mean percentile rank per layer and
KV head (1 = the top unit), "top-share" their share in the top 1,024 units, "corr" the correlation of the scorer's
output with the label over the whole document.
"""

from __future__ import annotations

import argparse
import bisect

import torch

from localchat.bench import tasks
from localchat.documents import Document
from localchat.engine.engine import Engine
from localchat.engine.kvzap_scorer import KVzapScorer
from localchat.render import user_turn
from localchat.train.kvzap import REPEAT, kvzip_plus, repeat_layout


def rank(x: torch.Tensor, idx: torch.Tensor) -> tuple[float, float]:
    """(mean percentile rank of the units `idx`, their share in the top 1,024), over layers and KV heads."""
    r = x.argsort(-1).argsort(-1).float() / (x.shape[-1] - 1)
    return float(r[..., idx].mean()), float((r[..., idx] > 1 - 1024 / x.shape[-1]).float().mean())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="where needles rank by the KVzip+ label and by a KVzap scorer")
    p.add_argument("scorer", help="a KVzap release folder for the default model")
    p.add_argument("--tokens", type=int, default=1800, help="document length (default 1800)")
    args = p.parse_args(argv)
    engine = Engine.load(None)
    scorer = KVzapScorer.load(args.scorer).eval()
    n_tokens = args.tokens
    for task in ("passkey", "niah_single"):
        for seed in (1, 2, 3):
            s = getattr(tasks, task)(engine.tokenizer, n_tokens, seed, 0.5)
            doc = Document(path=None, name="document.txt", kind="text", text=s.document, sha256="", n_bytes=0)
            content = user_turn(s.question, [doc])
            layout = repeat_layout(engine, content)
            lab = kvzip_plus(engine.model, layout, chunk=512)
            rendered = engine.render([{"role": "user", "content": f"{content}\n\n{REPEAT}"},
                                      {"role": "assistant", "content": content}], add_generation_prompt=False)
            enc = engine.tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
            starts = [a for a, _ in enc["offset_mapping"]]
            c = rendered.find(s.answer, rendered.find("<document"))
            t0 = bisect.bisect_right(starts, c) - 1
            t1 = bisect.bisect_left(starts, c + len(s.answer))
            idx = torch.arange(t0, t1) - layout.text[0]
            with torch.no_grad():
                pred = torch.stack([scorer.layers[str(i)](lab.features[i]).T for i in range(len(scorer.layers))])
            corr = float(torch.corrcoef(torch.stack([lab.scores.flatten(), pred.flatten()]))[0, 1])
            (lp, lt), (sp, st) = rank(lab.scores, idx), rank(pred, idx)
            print(f"{task} {seed} needle tokens {t1 - t0} {engine.tokenizer.decode(layout.ids[t0:t1])!r} "
                  f"label pct {lp:.2f} top-share {lt:.2f} | scorer pct {sp:.2f} top-share {st:.2f} | corr {corr:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
