"""`localchat bench plot-training LOG.json OUT.png`: the training curve of retaining heads.

Left: train loss (the mean of the last 10 logged steps) and held-out loss against the step, on a log axis (the
prob label's losses are ~1e-4: linear axes flatten them). Right: the held-out top-10% overlap. LOG is the
`train-log.json` that `localchat train-heads` writes into its --out directory. Needs matplotlib (the `plot` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

from localchat.errors import UserError

SMOOTH = 10  # train-loss logs averaged per point


def plot(log: dict, out: Path) -> Path:
    """Draw `log` (train-log.json's content) into the PNG `out`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plot-training needs matplotlib: pip install 'localchat[plot]'") from None
    steps = [r["step"] for r in log["train"]]
    loss = [r["loss"] for r in log["train"]]
    k = SMOOTH
    smooth = [sum(loss[max(0, i - k + 1): i + 1]) / len(loss[max(0, i - k + 1): i + 1]) for i in range(len(loss))]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(steps, smooth, label="train (mean of 10 logs)")
    a.plot([r["step"] for r in log["eval"]], [r["loss"] for r in log["eval"]], "o-", label="held-out")
    a.set_xlabel("step")
    a.set_yscale("log")  # the prob label's losses are ~1e-4: linear axes flatten them
    a.set_ylabel("SmoothL1 + 0.0025 smoothness (log)")
    a.legend()
    b.plot([r["step"] for r in log["eval"]], [r["top10_overlap"] for r in log["eval"]], "o-")
    b.set_xlabel("step")
    b.set_ylabel("held-out top-10% overlap")
    fig.suptitle(f"retaining heads, recipe {log['recipe']}", fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(args) -> int:
    """`localchat bench plot-training`: read the log, write the PNG, print its path."""
    try:
        log = json.loads(Path(args.log).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read the training log {args.log}: {exc}") from None
    print(plot(log, Path(args.out)))
    return 0
