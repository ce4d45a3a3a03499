"""Decode tokens/s on CUDA per KV mode, with cuDNN's SDPA on and off, modes interleaved and repeated.

Speed does not depend on the weights: a randomly initialised model of SmolLM2-135M's shape (30 layers,
9 query / 3 KV heads, d=64, bf16) with random retaining heads, LOCRET b=1024 at compact positions, random
token ids (seeded). Modes: kv none; int4 with the fused attention on Triton; on the torch twin; int4
dequantize-then-SDPA. Run: python scripts/gpu_decode_modes.py OUT.json
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from tiny import tiny_tokenizer  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import localchat.kernels as kernels  # noqa: E402
from localchat.engine.engine import Engine  # noqa: E402
from localchat.engine.events import Done  # noqa: E402
from localchat.engine.policy_setup import policy_for  # noqa: E402
from localchat.engine.sampling import GenerationSettings  # noqa: E402

LENGTH, NEW, REPS = 4096, 32, 2
config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                     rope_theta=100000.0, tie_word_embeddings=True, attn_implementation="sdpa")
torch.manual_seed(0)
model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
engine = Engine(model, tiny_tokenizer(), name="SmolLM2-135M-shaped, random weights", chunk=512)
engine.set_policy(policy_for(engine, "locret", budget=1024, stabilizers=256, heads="random"))
ids = torch.randint(300, 40000, (LENGTH,), generator=torch.Generator().manual_seed(0)).tolist()
MODES = {"none": ("none", False, "torch"), "int4 fused Triton": ("int4", True, "triton"),
         "int4 fused twin": ("int4", True, "torch"), "int4 dequantize+SDPA": ("int4", False, "torch")}


def run(mode: str, new: int) -> Done:
    kv, fused, kind = MODES[mode]
    os.environ["LOCALCHAT_KERNELS"] = kind
    kernels.reset_backend()
    engine.kv, engine.fused_decode = kv, fused
    events = engine.generate(ids, GenerationSettings(max_new_tokens=new, ignore_eos=True))
    return [e for e in events if isinstance(e, Done)][0]


rows = []
for cudnn in (True, False):
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    for mode in MODES:
        run(mode, 8)  # warm-up (Triton compile)
    for rep in range(REPS):
        for mode in MODES:
            done = run(mode, NEW)
            rows.append({"cudnn_sdpa": cudnn, "rep": rep, "mode": mode, "decode_tok_s": round(done.decode_tps, 2),
                         "prefill_tok_s": round(done.prefill_tps, 1)})
            print(rows[-1], flush=True)
result = {"command": "python scripts/gpu_decode_modes.py " + " ".join(sys.argv[1:]), "date": time.strftime("%F"),
          "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "length": LENGTH, "new_tokens": NEW,
          "budget": 1024, "rows": rows}
with open(sys.argv[1], "w") as f:
    json.dump(result, f, indent=1)
