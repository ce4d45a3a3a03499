"""Median prefill and decode tokens/s per (weights, length, tree) of ab.jsonl, and after / before: by CPU time
(`*_cpu_tok_s`) when the rows have it, else by wall clock."""

import json
import statistics
import sys
from collections import defaultdict

rows = [json.loads(line) for line in open(sys.argv[1])]
cpu = all("prefill_cpu_tok_s" in r for r in rows)
P, D = ("prefill_cpu_tok_s", "decode_cpu_tok_s") if cpu else ("prefill_tok_s", "decode_tok_s")
groups = defaultdict(list)
for r in rows:
    groups[(r["weights"], r["length"], r["tree"])].append(r)
print(f"Medians by {'CPU time' if cpu else 'wall clock'}.\n")
print("| weights | length | runs | prefill tok/s before | after | after/before | decode tok/s before | after | after/before | KV MiB before | after |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for weights, length in sorted({(w, n) for w, n, _ in groups}):
    b, a = groups[(weights, length, "before")], groups[(weights, length, "after")]
    med = lambda rs, key: statistics.median(r[key] for r in rs)  # noqa: E731
    pb, pa, db, da = med(b, P), med(a, P), med(b, D), med(a, D)
    print(f"| {weights} | {length} | {len(b)}+{len(a)} | {pb:.1f} | {pa:.1f} | {pa / pb:.3f} | {db:.2f} | {da:.2f} | "
          f"{da / db:.3f} | {b[0]['kv_mib']} | {a[0]['kv_mib']} |")
