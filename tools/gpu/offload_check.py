"""OmniKV with and without --offload on the same samples: same answers? what peak GPU memory and speed?

    python tools/gpu/offload_check.py OUT_DIR [--lengths 7680] [-n 5] [--budget 1024] [--model M]

Step 7 of tools/gpu/session.sh runs it on CUDA; bench/results/omnikv-offload-smollm2-cpu/ is its CPU run.

For each sample (bench tasks passkey and niah_single, seeded as the bench seeds them) it holds a two-turn
chat (the document and question, then a short follow-up that reads only its own tokens) with `omnikv` in
memory and with `omnikv` offloaded (`--offload`: OmniKV's context bank in host memory). It writes one JSON row
per chat to OUT_DIR/offload.jsonl (both answers, the score, peak memory, prefill and decode speed, the settings) plus
OUT_DIR/summary.md. Peak memory is torch.cuda.max_memory_allocated on CUDA; on a CPU the offload moves
nothing (the run only checks that the answers match) and the peak is the process's max RSS.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from localchat.bench import machine
from localchat.bench.cell import example_seed
from localchat.bench.tasks import depth_for, make_sample, prompt_messages, score
from localchat.engine.engine import Engine
from localchat.engine.events import Done, Error
from localchat.engine.policies import make_policy
from localchat.engine.sampling import GenerationSettings
from localchat.session import Session

FOLLOWUP = "Repeat that answer once more, nothing else."


def chat(engine, sample, max_new: int) -> dict:
    """The sample's question, then FOLLOWUP, in one Session: both answers and their timings."""
    settings = GenerationSettings(max_new_tokens=max_new)
    s = Session(engine)
    out = {}
    for name, text in (("", prompt_messages(sample)[-1]["content"]), ("followup_", FOLLOWUP)):
        done = [e for e in s.send(text, (), settings) if isinstance(e, (Done, Error))][-1]
        if isinstance(done, Error):
            return {**out, "score": 0.0, "error": done.message}
        out.update({f"{name}output": done.text, f"{name}prompt_tokens": done.prompt_tokens,
                    f"{name}prefill_s": round(done.prefill_s, 4), f"{name}decode_tps": round(done.decode_tps, 2),
                    f"{name}kv_tokens": done.kv_tokens})
    return {**out, "score": float(score(sample, out["output"])), "error": None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", default="7680")
    ap.add_argument("--tasks", default="passkey,niah_single")
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    engine = Engine.load(args.model, say=lambda line: print(line, file=sys.stderr))
    cuda = engine.device.type == "cuda"
    rows = []
    with (args.out / "offload.jsonl").open("w", encoding="utf-8") as f:
        for length in map(int, args.lengths.split(",")):
            for task in args.tasks.split(","):
                for example in range(args.n):
                    seed = example_seed(0, task, length, example)
                    sample = make_sample(task, engine.tokenizer, length, seed, depth_for(example, args.n))
                    for offload in (False, True):
                        engine.set_policy(make_policy("omnikv", budget=args.budget, offload=offload))
                        if cuda:
                            torch.cuda.reset_peak_memory_stats()
                        result = chat(engine, sample, args.max_new_tokens)
                        peak = torch.cuda.max_memory_allocated() if cuda else machine.max_rss_bytes()
                        row = {"task": task, "length": length, "example": example, "offload": offload,
                               "budget": args.budget, "model": engine.name, "device": engine.device.type,
                               "hardware": machine.hardware(), "peak_memory_bytes": peak, **result,
                               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
                        rows.append(row)
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                        print(f"{task} {length} #{example} offload={offload}: score {row['score']} {row['error'] or ''}, "
                              f"peak {peak / 2**20:,.1f} MiB, decode {row.get('decode_tps')} tok/s", flush=True)
    (args.out / "summary.md").write_text(summary(rows, " ".join(sys.argv)), encoding="utf-8")
    return 0


def summary(rows: list[dict], command: str) -> str:
    pairs = {}
    for r in rows:
        pairs.setdefault((r["task"], r["length"], r["example"]), {})[r["offload"]] = r
    same = sum(p[False].get("output") == p[True].get("output") for p in pairs.values())
    same_followup = sum(p[False].get("followup_output") == p[True].get("followup_output") for p in pairs.values())
    lines = [f"# OmniKV with and without --offload ({rows[0]['model']}, {rows[0]['device']}, "
             f"{rows[0]['hardware'].get('gpu') or rows[0]['hardware'].get('cpu')})", "",
             f"Command: `{command}`", "", f"Same first answer in {same} of {len(pairs)} pairs, same follow-up answer in {same_followup}.", "",
             "| task | length | offload | score (mean) | peak memory MiB (median) | prefill s (median) | decode tok/s (median) "
             "| follow-up prefill s (median) |", "|---|---|---|---|---|---|---|---|"]
    for task, length in sorted({(t, n) for t, n, _ in pairs}):
        for offload in (False, True):
            cell = [p[offload] for (t, n, _), p in pairs.items() if (t, n) == (task, length) and not p[offload]["error"]]
            if not cell:
                lines.append(f"| {task} | {length} | {offload} | every chat failed: see offload.jsonl |||||")
                continue
            med = lambda key, cell=cell: sorted(r[key] for r in cell)[len(cell) // 2]  # noqa: E731
            lines.append(f"| {task} | {length} | {offload} | {sum(r['score'] for r in cell) / len(cell):.2f} | "
                         f"{med('peak_memory_bytes') / 2**20:,.1f} | {med('prefill_s'):.2f} | {med('decode_tps'):.1f} "
                         f"| {med('followup_prefill_s'):.2f} |")
    if rows[0]["device"] == "cpu":
        lines += ["", "On a CPU the offload moves nothing (host memory is the device's), so only the answers compare; "
                  "the peak column is the process's max RSS since it started, which grows over the run."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
