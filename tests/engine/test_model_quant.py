"""SmolLM2 with a quantized retained cache and 4-bit weights (CPU)."""

from __future__ import annotations

import pytest
import torch

from localchat.bench.tasks import make_sample, prompt_messages, score
from localchat.engine.engine import Engine
from localchat.engine.events import Done
from localchat.engine.sampling import GenerationSettings
from localchat.planning.load import policy_for

pytestmark = pytest.mark.model


def _answer(engine, messages, n=12) -> Done:
    *_, done = engine.chat(messages, GenerationSettings(max_new_tokens=n))
    assert isinstance(done, Done), done
    return done


@pytest.mark.slow  # four 1K-token reads: about a minute on a shared CPU
def test_int8_kv_scores_like_no_kv_quantization_on_passkeys(smollm2):
    engine = smollm2
    engine.set_policy(policy_for(engine, "locret", budget=256, stabilizers=64))
    samples = [make_sample("passkey", engine.tokenizer, 1000, seed, depth) for seed, depth in ((1, 0.3), (2, 0.7))]
    results = {}
    try:
        for kv in ("none", "int8"):
            engine.kv = kv
            results[kv] = [_answer(engine, prompt_messages(s)) for s in samples]
    finally:
        engine.kv = "none"
    right = {kv: [bool(score(s, d.text)) for s, d in zip(samples, done)] for kv, done in results.items()}
    assert right["int8"] == right["none"] and any(right["none"])  # the same passkeys found
    # int8 codes + fp16 scale/zero per 64 values: ~1.06 bytes per value against 4 (fp32, CPU) or 2 (bf16, CUDA);
    # the local tail and the answer stay in full precision
    bound = 0.55 if engine.model.dtype == torch.float32 else 0.8
    for a, b in zip(results["none"], results["int8"]):
        assert b.kv_tokens == a.kv_tokens and b.kv_bytes < bound * a.kv_bytes


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_packed_weights_answer_like_fp32_on_cpu(weights):
    """torch's packed int8/int4 kernels (kernels/packed.py) on the real model: the same answer as fp32, and the
    decoder's weights in a quarter (int8) or a sixth (int4) of the bytes. (The GGUF is already 4-bit, groups of
    32 with a scale and a minimum: int4 in groups of 32 re-quantizes it almost exactly.)"""
    from localchat.engine.quantize import weight_bytes

    engine = Engine.load(None, weights=weights)
    q = engine.model.model.layers[0].self_attn.q_proj
    assert type(q).__name__ == "PackedLinear" and q.bits == (8 if weights == "int8" else 4)
    question = [{"role": "user", "content": "What is the capital city of France? Answer in one word."}]
    assert "Paris" in _answer(engine, question, n=8).text
    from localchat.planning import memory
    from localchat.planning.resolve import model_facts

    planned = memory.weight_bytes(model_facts(None)[0], weights, act="fp32", kind="cpu")
    assert abs(planned / weight_bytes(engine.model) - 1) < 0.03  # the planner's model of these weights
    decoder = sum(weight_bytes(layer) for layer in engine.model.model.layers)
    fp32 = sum(p.numel() * 4 for p in Engine.load(None).model.model.layers.parameters())
    assert decoder < (0.27 if weights == "int8" else 0.17) * fp32
