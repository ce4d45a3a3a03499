"""Training loop for retaining heads (docs/methods/locret.md §3.2-3.3): backbone frozen, heads only.

Loss per sample = mean over layers, KV heads and tokens of SmoothL1(pred, label)
                  + 0.0025 · Σ_layers mean over heads and adjacent token pairs of (pred_k - pred_k+1)²
AdamW (0.9, 0.95), linear warmup then linear decay, gradients clipped by value (0.5, the reference
code's choice). Works on the label files of train/dataset.py, one sample per step.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from localchat.engine.heads import RetainingHeads
from localchat.train.dataset import load

SMOOTH = 0.0025


@dataclass
class Recipe:
    d_r: int = 256
    steps: int = 1500
    lr: float = 5e-4
    warmup: int = 150
    clip: float = 0.5
    label: str = "prob"  # "prob" (what ships for SmolLM2: it won the comparison) or "logit" (the paper's)
    seed: int = 0
    eval_every: int = 250
    checkpoint_every: int = 250


PAPER = Recipe(d_r=1024, steps=3000, lr=5e-4, warmup=2000, label="logit")  # on a GPU, LongAlpaca-sized data


def loss_fn(pred: torch.Tensor, label: torch.Tensor, adjacent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pred`, `label` `[L, H, m]`; `adjacent` `[m]` (1 where token j+1 follows token j). Returns (reg, smooth)."""
    reg = torch.nn.functional.smooth_l1_loss(pred, label)
    pairs = adjacent[:-1].bool()
    diff = (pred[:, :, :-1] - pred[:, :, 1:])[:, :, pairs]
    smooth = diff.pow(2).mean(dim=(1, 2)).sum() if pairs.any() else pred.sum() * 0
    return reg, smooth


def predict(heads: RetainingHeads, features: torch.Tensor) -> torch.Tensor:
    """`features` `[L, m, F]` (every layer) -> scores `[S, H_kv, m]` of the S layers the heads score."""
    return torch.stack([heads.head(i)(features[i].float()).T for i in heads.scored])


def overlap(pred: torch.Tensor, label: torch.Tensor, frac: float = 0.1) -> float:
    """Mean over (layer, head) of |top-frac(pred) ∩ top-frac(label)| / |top-frac|."""
    k = max(1, int(pred.shape[-1] * frac))
    a = pred.topk(k, dim=-1).indices
    b = label.topk(k, dim=-1).indices
    hits = (a[..., :, None] == b[..., None, :]).any(-1).float().sum(-1) / k
    return float(hits.mean())


def evaluate(heads: RetainingHeads, files: list[Path], label: str) -> dict:
    losses, overlaps = [], []
    with torch.no_grad():
        for f in files:
            d = load(f)
            pred, want = predict(heads, d["features"]), d[label][heads.scored]
            reg, smooth = loss_fn(pred, want, d["adjacent"])
            losses.append(float(reg + SMOOTH * smooth))
            overlaps.append(overlap(pred, want))
    return {"loss": sum(losses) / len(losses), "top10_overlap": sum(overlaps) / len(overlaps)}


def _unlist(state):
    """random.Random state back from what torch.load returns (tuples may come back as lists)."""
    return tuple(_unlist(x) for x in state) if isinstance(state, (list, tuple)) else state


def _lr(step: int, r: Recipe) -> float:
    if step < r.warmup:
        return r.lr * (step + 1) / r.warmup
    return r.lr * max(0.0, (r.steps - step) / max(1, r.steps - r.warmup))


def train(shape: dict, train_files: list[Path], eval_files: list[Path], out: Path, recipe: Recipe,
          meta: dict, say=print) -> dict:
    """Train (or resume from `out/checkpoint.pt`); write heads + a JSON log into `out`; return the log."""
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(recipe.seed)
    heads = RetainingHeads(shape, recipe.d_r, meta)
    opt = torch.optim.AdamW(heads.parameters(), lr=recipe.lr, betas=(0.9, 0.95))
    log = {"recipe": asdict(recipe), "train": [], "eval": []}
    step = 0
    ckpt = out / "checkpoint.pt"
    if ckpt.exists():  # our own file, written below: plain tensors and numbers only
        state = torch.load(ckpt, weights_only=True)
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["opt"])
        step, log = state["step"], json.loads(state["log"])
        say(f"resumed at step {step}")
    order = random.Random(recipe.seed)
    if ckpt.exists():
        order.setstate(_unlist(state["order"]))
    t0 = time.perf_counter()
    while step < recipe.steps:
        f = train_files[order.randrange(len(train_files))]
        d = load(f)
        for group in opt.param_groups:
            group["lr"] = _lr(step, recipe)
        pred = predict(heads, d["features"])
        reg, smooth = loss_fn(pred, d[recipe.label][heads.scored], d["adjacent"])
        loss = reg + SMOOTH * smooth
        opt.zero_grad()
        loss.backward()
        loss, reg, smooth = loss.detach(), reg.detach(), smooth.detach()
        torch.nn.utils.clip_grad_value_(heads.parameters(), recipe.clip)
        opt.step()
        step += 1
        if step % 10 == 0 or step == recipe.steps:
            log["train"].append({"step": step, "loss": loss.item(), "reg": reg.item(), "smooth": smooth.item()})
            rate = step / max(time.perf_counter() - t0, 1e-9)
            say(f"step {step}/{recipe.steps} loss {loss.item():.4f} ({rate:.2f} steps/s)")
        if eval_files and (step % recipe.eval_every == 0 or step == recipe.steps):
            log["eval"].append({"step": step, **evaluate(heads, eval_files, recipe.label)})
            say(f"eval @ {step}: {log['eval'][-1]}")
        if step % recipe.checkpoint_every == 0 or step == recipe.steps:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"heads": heads.state_dict(), "opt": opt.state_dict(), "step": step,
                        "log": json.dumps(log), "order": order.getstate()}, tmp)
            tmp.replace(ckpt)
    heads.meta.update(meta, recipe=asdict(recipe), final=log["eval"][-1] if log["eval"] else {})
    heads.save(out)
    (out / "train-log.json").write_text(json.dumps(log, indent=1) + "\n")
    if not math.isfinite(log["train"][-1]["loss"] if log["train"] else 0.0):
        raise RuntimeError("training diverged (loss is not finite)")
    return log
