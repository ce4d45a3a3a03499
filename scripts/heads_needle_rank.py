"""Where trained heads rank the planted needle, on held-out label files: a seconds-long check before a 32K bench.

    python scripts/heads_needle_rank.py DATA_DIR HEADS_DIR [HEADS_DIR ...]     # e.g. /work/heads-run/data
    (a HEADS_DIR of `random` is the bench's `--heads random`: untrained, d_R 1024, seed 0, the previous heads' shape)

For each held-out sample (every 10th file, as `localchat train-heads` holds them out) with one planted needle
(natural-text and multi-key samples are skipped), and for each (layer, KV head): the share of the document's
kept tokens (the last 128 tokens excluded) that score above the needle's best token. Prints the mean share and how often the needle is in the top 2 % and 5 %, for the heads'
predictions and for the prob label itself. At 32K tokens and b=1024 a needle must be in about the top 2 %.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from localchat.engine.heads import RetainingHeads
from localchat.train.dataset import split
from localchat.train.loop import predict


def shares(score: torch.Tensor, needle: torch.Tensor, body: torch.Tensor) -> torch.Tensor:
    """`score` `[L, H, m]` -> `[L, H]`: share of body tokens (not needle) scoring above the needle's best."""
    best = score[:, :, needle].max(-1).values
    return (score[:, :, body & ~needle] > best[..., None]).float().mean(-1)


def held_out(data: Path) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(features, prob label, needle mask, body mask) of each held-out sample with a needle span."""
    out = []
    for f in split(sorted(data.glob("sample-*.safetensors")))[1]:
        with safe_open(str(f), "pt") as s:
            meta = s.metadata()
            feats, pos, prob = s.get_tensor("features"), s.get_tensor("positions"), s.get_tensor("prob")
        spans = json.loads(meta["spans"])
        if meta["kind"] in ("natural", "multikey") or len(spans) != 1:  # no planted needle, or several
            continue
        a, b = spans[0]
        needle = (pos >= a) & (pos < b)
        if needle.any():
            out.append((feats, prob.float(), needle, pos < int(meta["n_tokens"]) - 128))
    return out


def main(data: str, heads_dirs: list[str]) -> None:
    samples = held_out(Path(data))
    label = torch.stack([shares(p, n, b) for _, p, n, b in samples])
    print(f"prob label: share above the needle {label.mean():.3f}, top 2 % {(label < 0.02).float().mean():.3f}, "
          f"top 5 % {(label < 0.05).float().mean():.3f} ({len(samples)} samples)")
    heads = None
    for d in heads_dirs:
        if d == "random" and heads is None:
            sys.exit("name a trained heads directory before `random` (it takes that shape)")
        heads = RetainingHeads.random(heads.shape) if d == "random" else RetainingHeads.load(d)
        with torch.no_grad():
            s = torch.stack([shares(predict(heads, f), n, b) for f, _, n, b in samples])
        print(f"{d}: share above the needle {s.mean():.3f}, top 2 % {(s < 0.02).float().mean():.3f}, "
              f"top 5 % {(s < 0.05).float().mean():.3f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
