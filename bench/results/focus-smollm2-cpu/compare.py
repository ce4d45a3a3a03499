# Per example: LOCRET with --focus against the same cell without it (same documents: same task, length, budget,
# cap, seed and N). usage: python compare.py FOCUS_ROWS.jsonl OTHER_ROWS.jsonl [OTHER ...]
# Prints, per cell, right-with-focus / right-without over the examples both ran, and which examples differ.
import json, sys
from collections import defaultdict

def rows(paths):
    for path in paths:
        for line in open(path):
            r = json.loads(line)
            if r.get("policy") == "locret" and not r.get("error") and r.get("weights") in (None, "fp32"):
                yield r

focus, plain = defaultdict(dict), defaultdict(dict)
for r in rows(sys.argv[1:]):
    cell = (r["task"], r["length"], r["budget"], r.get("max_copies"), r["seed"], r["n"], r.get("turns"))
    (focus if r.get("focus") else plain)[cell].setdefault(r["example"], r["score"])
for cell in sorted(focus):
    both = sorted(set(focus[cell]) & set(plain.get(cell, {})))
    if not both:
        print(cell[:4], f"focus {sum(focus[cell].values()):g} of {len(focus[cell])}, no rows without focus")
        continue
    f, p = (sum(d[e] for e in both) for d in (focus[cell], plain[cell]))
    gained = [e for e in both if focus[cell][e] > plain[cell][e]]
    lost = [e for e in both if focus[cell][e] < plain[cell][e]]
    turns = f" turns={cell[6]}" if cell[6] is not None else ""
    print(f"{cell[0]}{turns} {cell[1]} b={cell[2]} cap={cell[3]}: focus {f:g} of {len(both)}, without {p:g}; "
          f"gained {gained}, lost {lost}")
