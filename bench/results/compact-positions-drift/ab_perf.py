"""Prefill and decode speed of LOCRET at compact positions on SmolLM2-135M-Instruct, for one code tree.

Run it with the tree to measure first on PYTHONPATH; `run_ab.sh` alternates two trees. Per process: load the
model at `weights` (fp32 or bf16), a warm-up answer, then for each length a niah_single prompt (seed 0, the
`bench perf` layout) read in chunks of 512 with b=1024 and random retaining heads, then `decode` greedy
tokens (EOS ignored). Prints one JSON line per length, with wall-clock rates and the rates by this process's CPU
time (`*_cpu_*`: what a core shared with other work still measures fairly).
"""

import json
import sys
import time

import torch

from localchat.bench.perf import _prompt, _run
from localchat.engine.engine import Engine
from localchat.engine.events import Done, Token
from localchat.engine.sampling import GenerationSettings
from localchat.planning.load import policy_for

weights, lengths, decode = sys.argv[1], [int(n) for n in sys.argv[2].split(",")], int(sys.argv[3])
label = sys.argv[4]
torch.manual_seed(0)
engine = Engine.load(None, chunk=512, weights=weights, say=lambda *_: None)
engine.set_policy(policy_for(engine, "locret", budget=1024, heads="random"), "compact")
_run(engine, _prompt(engine, 1500, 0), 4)  # warm-up



def timed(ids, new):
    """Done, CPU seconds to the first token (prefill), CPU seconds from there to the end (decode)."""
    t0 = time.process_time()
    first = None
    for event in engine.generate(ids, GenerationSettings(max_new_tokens=new, ignore_eos=True)):
        if isinstance(event, Token) and first is None:
            first = time.process_time()
        if isinstance(event, Done):
            return event, first - t0, time.process_time() - first


for n in lengths:
    done, cpu_prefill, cpu_decode = timed(_prompt(engine, n, 0), decode)
    print(json.dumps({"tree": label, "weights": weights, "dtype": str(next(engine.model.parameters()).dtype),
                      "length": n, "prompt_tokens": done.prompt_tokens, "prefill_s": round(done.prefill_s, 3),
                      "prefill_tok_s": round(done.prompt_tokens / done.prefill_s, 1), "new_tokens": done.new_tokens,
                      "decode_tok_s": round((done.new_tokens - 1) / done.decode_s, 2), "kv_mib": round(done.kv_bytes / 2**20, 2),
                      "prefill_cpu_tok_s": round(done.prompt_tokens / cpu_prefill, 1),
                      "decode_cpu_tok_s": round((done.new_tokens - 1) / cpu_decode, 2)}),
          flush=True)
