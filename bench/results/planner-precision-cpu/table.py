"""Print the measured-vs-planned table of this folder's verify-*.json (plan --verify --json outputs)."""
import json
from pathlib import Path

here = Path(__file__).parent
print("| run | weights | KV cache | budget | chunk | KV cache + copy (planned) | predicted peak | measured peak | error |")
print("|---|---|---|---|---|---|---|---|---|")
for f in sorted(here.glob("verify-*.json")):
    try:
        d = json.loads(f.read_text())
    except ValueError:
        continue
    b = d["bytes"]
    kv = b.get("KV cache", 0) + b.get("KV copy (1 layer)", 0)
    err = (d["predicted_used"] - d["measured_peak"]) / d["measured_peak"]
    gib = 2**30
    print(f"| {f.stem[len('verify-'):]} | {d['weights_dtype']} | {d['kv']} | {d['budget']:,} | {d['chunk']:,} | "
          f"{kv / gib:.3f} GiB | {d['predicted_used'] / gib:.3f} GiB | {d['measured_peak'] / gib:.3f} GiB | {err:+.1%} |")
