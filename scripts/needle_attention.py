"""Where the answer's attention goes: the share each layer puts on the needle's units, and on the first token.

    python scripts/needle_attention.py --positions original --budget 512 --examples 3,5,6 [--length 7680]

Runs bench passkey examples (the grid's samples: seed 0, N=20 depths) with LOCRET and the shipped heads, records
each forward's last-query attention (fp32 softmax over the cache) and reports, at the decode step that
reads " is" and must write the key's first digit: per layer, the largest share any query head puts on the units of
the key's tokens (mean and max over layers), and for the layer and head with the most, that share and the share on
position 0 (the attention sink). One line per example, after the answer.
"""

from __future__ import annotations

import argparse

import torch

from localchat.bench.cell import Cell, answer_tokens, load_engine, sample_for, use_policy
from localchat.bench.tasks import prompt_messages
from localchat.engine.events import Done
from localchat.engine.policies.attention_stats import Collector, StatsHook
from localchat.engine.sampling import GenerationSettings

NEW_TOKENS = 6  # "The pass key is" and the first digit: the prompt's last forward writes one, decode forwards the rest
READ_STEP = 3  # decode forwards 0-3 read "The", " pass", " key", " is": forward 3 picks the first digit


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", choices=("compact", "original"), required=True)
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--examples", required=True, help="comma-separated example indices (0-19)")
    ap.add_argument("--length", type=int, default=7680)
    args = ap.parse_args()
    cell = Cell(task="passkey", length=args.length, policy="locret", budget=args.budget, n=20, seed=0, model_spec=None,
                heads=None, chunk=512, positions=args.positions, max_new_tokens=NEW_TOKENS)
    engine = load_engine(cell)
    use_policy(engine, cell)
    config = engine.model.config
    group = config.num_attention_heads // config.num_key_value_heads
    for example in (int(x) for x in args.examples.split(",")):
        sample = sample_for(cell, engine.tokenizer, example)
        text = engine.render(prompt_messages(sample))
        ids = engine.encode(text)
        key = torch.tensor(answer_tokens(engine.tokenizer, text, ids, sample.answers))
        rows: list[tuple[int, torch.Tensor]] = []  # (layer, [H_q, n]): each forward's last query, every layer
        cache = engine.new_cache(len(ids), NEW_TOKENS)
        hook = StatsHook(engine.model, Collector(1, lambda i, p: rows.append((i, p[:, 0].clone()))))
        try:
            done = next(e for e in engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=NEW_TOKENS))
                        if isinstance(e, Done))
        finally:
            hook.close()
        layers = len(cache.layers)
        steps = NEW_TOKENS - 1  # decode forwards, the last ones recorded
        decode = [rows[i:i + layers] for i in range(len(rows) - steps * layers, len(rows), layers)]
        best = (-1.0, 0, 0, 0.0)  # (share on the key, layer, head, share on position 0)
        per_layer = []
        for layer, probs in decode[READ_STEP]:
            positions = cache.layers[layer].positions.repeat_interleave(group, 0)  # [H_q, units]
            n = min(positions.shape[1], probs.shape[1])
            on_key = (probs[:, :n] * torch.isin(positions[:, :n], key)).sum(-1)
            on_sink = (probs[:, :n] * (positions[:, :n] == 0)).sum(-1)
            head = int(on_key.argmax())
            per_layer.append(float(on_key[head]))
            best = max(best, (float(on_key[head]), layer, head, float(on_sink[head])))
        shares = torch.tensor(per_layer)
        print(f"{args.positions} b={args.budget} #{example} {done.text!r}: key share mean {shares.mean():.3f} max "
              f"{shares.max():.3f}; layer {best[1]} head {best[2]}: key {best[0]:.3f}, position 0 {best[3]:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
