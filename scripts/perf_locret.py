"""LOCRET vs full attention on this machine, side by side in one run (until `localchat bench --perf` lands).

Run:  python scripts/perf_locret.py --out bench/results/perf-locret-smollm2-cpu
Writes OUT.json (every figure and setting) and OUT.md (the tables).

1. A 7.6K-token prompt, chunk 512: `full` (original positions) vs `locret` (b=1024, n_s=256, n_loc=96,
   compact positions): prefill tokens/s, decode tokens/s over 64 tokens, KV bytes held.
2. LOCRET prefill seconds per token at 4K, 8K, 16K and 32K tokens (compact positions).
Speed does not depend on the heads' weights, only on their size: random heads (d_R=1024) are used
until trained heads ship.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import transformers

from localchat.bench.tasks import passkey
from localchat.engine.engine import Engine
from localchat.engine.events import Done
from localchat.engine.policy_setup import policy_for
from localchat.engine.sampling import GenerationSettings


def run(engine: Engine, n_tokens: int, new: int, seed: int) -> Done:
    sample = passkey(engine.tokenizer, n_tokens, seed=seed, depth=0.5)
    messages = [{"role": "user", "content": sample.document + "\n\n" + sample.question}]
    done = list(engine.chat(messages, GenerationSettings(max_new_tokens=new, ignore_eos=True)))[-1]
    assert isinstance(done, Done), done
    return done


def row(policy: str, positions: str, done: Done) -> dict:
    return {
        "policy": policy, "positions": positions, "prompt_tokens": done.prompt_tokens,
        "prefill_s": round(done.prefill_s, 3), "prefill_tok_s": round(done.prefill_tps, 1),
        "prefill_ms_per_token": round(1000 * done.prefill_s / done.prompt_tokens, 3),
        "new_tokens": done.new_tokens, "decode_tok_s": round(done.decode_tps, 2),
        "kv_units_per_head": done.kv_tokens, "kv_mib": round(done.kv_bytes / 2**20, 2),
        "kv_full_mib": round(done.kv_full_bytes / 2**20, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lengths", default="4096,8192,16384,32768")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    engine = Engine.load(None, chunk=512)
    locret = dict(budget=1024, stabilizers=256, local=96, heads="random")
    setup = {
        "model": engine.name, "chunk": 512, "locret": {k: v for k, v in locret.items()}, "seed": args.seed,
        "decode_tokens": 64, "heads": "random init, d_R=1024 (speed only)",
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
        "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
    }
    side = []
    engine.set_policy(policy_for(engine, "full"), "original")
    side.append(row("full", "original", run(engine, 7600, 64, args.seed)))
    engine.set_policy(policy_for(engine, "locret", **locret), "compact")
    side.append(row("locret", "compact", run(engine, 7600, 64, args.seed)))
    scaling = [row("locret", "compact", run(engine, int(n), 16, args.seed)) for n in args.lengths.split(",")]
    full, loc = side
    ratios = {
        "prefill_speedup": round(loc["prefill_tok_s"] / full["prefill_tok_s"], 2),
        "decode_speedup": round(loc["decode_tok_s"] / full["decode_tok_s"], 2),
        "kv_smaller": round(full["kv_mib"] / loc["kv_mib"], 2),
        "ms_per_token_spread": round(
            max(r["prefill_ms_per_token"] for r in scaling) / min(r["prefill_ms_per_token"] for r in scaling) - 1, 3),
    }
    result = {"setup": setup, "side_by_side_7600": side, "locret_scaling": scaling, "ratios": ratios}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    cols = ["policy", "positions", "prompt_tokens", "prefill_tok_s", "prefill_ms_per_token", "decode_tok_s",
            "kv_units_per_head", "kv_mib", "kv_full_mib"]
    table = lambda rows: "\n".join(  # noqa: E731
        ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        + ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows])
    md = [f"# LOCRET vs full attention, {setup['model']}, {setup['cpu']} ({setup['cores']} cores)", "",
          f"Command: `python scripts/perf_locret.py --out {args.out}` ({setup['date']}, torch {setup['torch']}, "
          f"transformers {setup['transformers']}, {setup['torch_threads']} threads, seed {args.seed}).", "",
          f"Setup: chunk 512; LOCRET b=1024, n_s=256, n_loc=96, {setup['heads']}; decode "
          f"{setup['decode_tokens']} tokens (greedy, EOS ignored); passkey filler prompts.", "",
          "## 7.6K-token prompt, side by side", "", table(side), "",
          f"Ratios: prefill {ratios['prefill_speedup']}x, decode {ratios['decode_speedup']}x, "
          f"KV {ratios['kv_smaller']}x smaller.", "",
          "## LOCRET prefill time per token vs prompt length (compact positions)", "", table(scaling), "",
          f"Spread of ms/token (max/min - 1): {ratios['ms_per_token_spread']:.1%}.", ""]
    out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
