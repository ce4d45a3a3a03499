"""Why `--weights int8` on CUDA answered with an empty string (bench/results/gpu-h100-smollm2/weights-answers.txt).

Loads the default model with bitsandbytes int8 at bf16 and at fp16 activations (and bf16 without quantization
as the reference), reads one short chat prompt, and prints per setting: NaN/inf in the logits, the first
greedy tokens (ids and text), and the answer. Run on a CUDA machine: python scripts/gpu_int8_check.py
"""

import torch

from localchat.engine import loading
from localchat.engine.engine import Engine
from localchat.engine.events import Done
from localchat.engine.sampling import GenerationSettings

PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]

for weights, dtype in ((None, torch.bfloat16), ("int8", torch.bfloat16), ("int8", torch.float16)):
    loaded = loading.load(None, weights=weights, dtype=dtype)
    engine = Engine(loaded.model, loaded.tokenizer, name=loaded.name, card=loaded.card)
    ids = torch.tensor([engine.encode_chat(PROMPT)], device=engine.device)
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits[0, -1].float()
    top = logits.topk(5)
    done = [e for e in engine.chat(PROMPT, GenerationSettings(max_new_tokens=24)) if isinstance(e, Done)][0]
    print(f"weights={weights} dtype={dtype}: nan={bool(logits.isnan().any())} inf={bool(logits.isinf().any())} "
          f"top5={top.indices.tolist()} {[engine.tokenizer.decode([i]) for i in top.indices.tolist()]} "
          f"answer={done.text!r} ({done.new_tokens} tokens)", flush=True)
    del engine, loaded
    torch.cuda.empty_cache()
