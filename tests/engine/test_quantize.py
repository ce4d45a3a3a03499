"""Quantized weights and the quantized cache through the engine and the command line, on the tiny random Llama."""

from __future__ import annotations

import pytest
import torch
from tiny import save_tiny, tiny_llama

from localchat.args import load_engine
from localchat.cli import build_parser, main
from localchat.engine import loading
from localchat.engine.engine import Engine
from localchat.engine.events import Done
from localchat.engine.heads import RetainingHeads
from localchat.engine.policies import make_policy
from localchat.engine.qcache import QuantizedKVCache
from localchat.engine.quantize import weight_bytes
from localchat.engine.sampling import GenerationSettings
from localchat.errors import UserError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model", head_dim=32)


def _done(engine, ids, n=8) -> Done:
    *_, done = engine.generate(ids, GenerationSettings(max_new_tokens=n, ignore_eos=True))
    assert isinstance(done, Done), done
    return done


@pytest.mark.parametrize("weights,ratio", [("int8", 0.5), ("int4", 0.4)])
def test_quantized_weights_load_smaller_and_answer_like_fp32(tiny_dir, weights, ratio):
    full = loading.load(str(tiny_dir), weights="fp32")
    quant = loading.load(str(tiny_dir), weights=weights)
    linear = [m for n, m in quant.model.named_modules() if n.endswith("q_proj")][0]
    assert type(linear).__name__ == "PackedLinear" and linear.bits == (8 if weights == "int8" else 4)
    assert type(quant.model.lm_head).__name__ == "PackedLinear" and quant.model.lm_head.bits == 8  # CPU: int8 head
    assert quant.model.model.embed_tokens.weight.dtype == torch.float32  # the table for the lookups stays
    lin_full = sum(p.numel() * 4 for n, p in full.model.named_parameters() if "layers." in n and "proj" in n)
    lin_quant = weight_bytes(quant.model) - (weight_bytes(full.model) - lin_full)
    assert lin_quant < ratio * lin_full  # packed data + scales of the linear layers
    ids = torch.arange(3, 60)[None]
    with torch.inference_mode():
        a = full.model(input_ids=ids).logits[0, -1]
        b = quant.model(input_ids=ids).logits[0, -1]
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > (0.99 if weights == "int8" else 0.9)


def test_quantized_model_round_trips_through_the_engine_with_heads_and_int4_kv(tiny_dir):
    engine = Engine.load(str(tiny_dir), chunk=32, weights="int4", kv="int4")
    heads = RetainingHeads.random(engine.model)  # the heads hook the (quantized) q/k/v projections
    engine.set_policy(make_policy("locret", budget=24, stabilizers=4, local=8, heads=heads))
    ids = engine.encode("a tiny document " * 12)
    cache = engine.new_cache(len(ids), 8)
    assert isinstance(cache, QuantizedKVCache) and cache.bits == 4
    events = list(engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=6, ignore_eos=True)))
    done = events[-1]
    assert isinstance(done, Done) and done.new_tokens == 6
    assert done.kv_tokens == cache.get_seq_length() <= 24 + 8 + 6
    assert 0 < done.kv_bytes == cache.nbytes()
    assert cache.layers[0].nq == 24  # evicted chunks live quantized; the local tail and the answer do not yet
    assert done.kv_full_bytes > done.kv_bytes * 3


def test_int8_kv_answers_like_the_full_precision_cache(tiny_tok):
    model = tiny_llama(len(tiny_tok), head_dim=32)
    ids = list(range(3, 200))
    answers, caches = {}, {}
    for kv in ("none", "int8", "int4"):
        engine = Engine(model, tiny_tok, chunk=48, kv=kv, policy=make_policy("streaming", budget=64, local=8))
        caches[kv] = engine.new_cache(len(ids), 12)
        *_, answers[kv] = engine.continue_on(caches[kv], ids, 0, GenerationSettings(max_new_tokens=12,
                                                                                        ignore_eos=True))
    assert answers["int8"].text == answers["none"].text
    # the same units are kept (streaming keeps by position); int8 holds them within a small error
    ref, q = caches["none"].layers[1], caches["int8"].layers[1]
    assert torch.equal(ref.positions, q.positions)
    keys, _ = q.dequantized(torch.float32)
    assert (keys - ref.keys[:, :, : q.nq]).abs().max() < 0.02 * ref.keys.abs().max()
    assert answers["int4"].kv_bytes < answers["none"].kv_bytes / 2.5  # 19 newest units still fp32


def test_bad_kv_and_weights_are_one_line_errors(tiny_dir, capsys):
    assert main(["--model", str(tiny_dir), "--kv", "int3", "ask", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "int3" in err and "int4" in err
    assert main(["--model", str(tiny_dir), "--weights", "nf4", "ask", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nf4" in err and "CUDA" in err and "int4" in err
    with pytest.raises(UserError, match="int9"):
        Engine(tiny_llama(300), None, kv="int9")


def test_kv_and_weights_follow_cli_over_env_over_profile(tiny_dir, monkeypatch):
    monkeypatch.setenv("LOCALCHAT_KV", "int2")
    monkeypatch.setenv("LOCALCHAT_WEIGHTS", "int8")
    args = build_parser().parse_args(["--model", str(tiny_dir), "--policy", "full", "--profile", "none"])
    engine = load_engine(args)
    assert engine.kv == "int2" and type(engine.model.model.layers[0].mlp.up_proj).__name__ == "PackedLinear"
    args = build_parser().parse_args(["--model", str(tiny_dir), "--policy", "full", "--kv", "none",
                                      "--weights", "fp32", "--profile", "none"])
    engine = load_engine(args)
    assert engine.kv == "none" and type(engine.model.model.layers[0].mlp.up_proj).__name__ == "Linear"
    monkeypatch.setenv("LOCALCHAT_KV", "fp16")  # a profile-style float name means the unquantized cache
    engine = load_engine(build_parser().parse_args(["--model", str(tiny_dir), "--policy", "full",
                                                    "--profile", "none"]))
    assert engine.kv == "none"


def test_load_dtype_follows_the_choice_and_int8_on_cuda_loads_at_fp16():
    from localchat.engine.quantize import load_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert load_dtype("bf16", torch.float32, cpu) == torch.bfloat16
    assert load_dtype(None, torch.bfloat16, cuda) == torch.bfloat16
    assert load_dtype("int8", torch.float32, cpu) == torch.float32  # packed int8 keeps the CPU's fp32 activations
    assert load_dtype("int8", torch.bfloat16, cuda) == torch.float16  # bitsandbytes int8 computes in fp16
    assert load_dtype("nf4", torch.bfloat16, cuda) == torch.bfloat16  # nf4 computes in bf16 (bnb_config)
