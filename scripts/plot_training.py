"""Training curve of retaining heads: train loss (smoothed), held-out loss and top-10% overlap.

Run: python scripts/plot_training.py RUN_DIR/train-log.json OUT.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(log_path: str, out: str) -> None:
    log = json.load(open(log_path))
    steps = [r["step"] for r in log["train"]]
    loss = [r["loss"] for r in log["train"]]
    k = 10
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


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
