"""The host's share of a captured decode step (engine/graph_step.py): what a decoded token costs the CPU besides
the replay. On a GPU the host's work and the replay run one after the other (the next token needs the last one's
logits), so this time adds to the GPU's time per token.

The step's body (`GraphStep.body`: the layers, the replay on CUDA) is replaced by fixed logits in a subclass:
what is left is the engine's loop (sampling, streaming, the policy's bookkeeping, eviction while decoding), the
step's room for the new unit in every layer, and the inputs' write. The buffers' check that precedes every replay
(`GraphStep.buffers`) is timed apart, since a step without capture (a CPU) skips it.

    python bench/experiments/host_step.py [--model default] [--kv none,int8] [--tokens 400] [--out DIR]
Writes DIR/host_step.json and DIR/host_step.md; prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import timeit
from pathlib import Path

import torch

import localchat  # noqa: F401  (before torch: the app's thread settings)
from localchat.engine.engine import Decoding, Engine
from localchat.engine.events import Done
from localchat.engine.graph_step import GraphStep
from localchat.engine.heads import RetainingHeads
from localchat.engine.policies import make_policy
from localchat.engine.sampling import GenerationSettings


def _done(events) -> Done:
    return next(e for e in events if isinstance(e, Done))


class HostSide(GraphStep):
    """The captured step with fixed logits for its body: no model work, the host's side alone."""

    def __init__(self, model, cache, heads, logits: torch.Tensor):
        super().__init__(model, cache, heads)
        self.logits, self.calls = logits, 0

    def body(self) -> torch.Tensor:
        self.calls += 1
        return self.logits


def measure(model: str | None, kv: str, length: int, tokens: int, budget: int) -> dict:
    engine = Engine.load(model, weights="fp32" if model is None else None, kv=kv)
    engine.set_policy(make_policy("locret", budget=budget, heads=RetainingHeads.random(engine.model, d_r=1024)),
                      "compact")
    cache = engine.new_cache(length, 2 * tokens)
    ids = torch.randint(3, engine.model.config.vocab_size // 2, (length,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    settings = GenerationSettings(max_new_tokens=1, ignore_eos=True)
    _done(engine.continue_on(cache, ids, 0, settings, keep_last=True))
    logits = torch.zeros(engine.model.config.vocab_size, device=engine.device)
    logits[engine.model.config.vocab_size // 2] = 1.0
    steps = []  # the engine builds the step for this cache: the host side, on this device too

    def make(model, cache, heads) -> HostSide:
        steps.append(HostSide(model, cache, heads, logits))
        return steps[-1]

    engine.configure(decoding=Decoding(graph_devices=(engine.device.type,), make_step=make))
    at = length + 1
    _done(engine.continue_on(cache, [5], at, GenerationSettings(max_new_tokens=20, ignore_eos=True)))
    done = _done(engine.continue_on(cache, [5], at + 21, GenerationSettings(max_new_tokens=tokens, ignore_eos=True)))
    step = steps[-1] if steps else None
    if step is None or step.calls < done.new_tokens - 1:
        raise SystemExit("the engine decoded without the host-side step")
    check_us = 1e6 * timeit.timeit(step.buffers, number=2000) / 2000
    loop_ms = 1000 * done.decode_s / max(done.new_tokens - 1, 1)
    return {"kv": kv, "layers": len(cache.layers), "units": done.kv_tokens, "tokens": done.new_tokens,
            "loop_ms_per_token": round(loop_ms, 4), "buffers_check_us": round(check_us, 1),
            "host_ms_per_token": round(loop_ms + check_us / 1000, 4)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help="a model folder or hub id; default: the embedded SmolLM2")
    p.add_argument("--kv", default="none,int8", help="comma-separated --kv values")
    p.add_argument("--length", type=int, default=3000)
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = [measure(None if args.model == "default" else args.model, kv, args.length, args.tokens, args.budget)
            for kv in args.kv.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cols = list(rows[0])
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    table += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    print("\n".join(table))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {"rows": rows, "setup": vars(args), "commit": commit, "torch": torch.__version__,
                  "threads": torch.get_num_threads()}
        (out / "host_step.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "host_step.md").write_text(f"Command: `python bench/experiments/host_step.py "
                                          f"{' '.join(argv or __import__('sys').argv[1:])}` (commit {commit})\n\n"
                                          + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
