"""The memory model of hybrid models (Gemma 3, gpt-oss, Qwen3.5): only the global layers' cache grows with the
document, a window layer holds its window and the chunk being read, a linear-attention layer a fixed state; MoE
experts and linear-attention projections counted as transformers builds them. From the published configs (no
downloads) and the model cards made from them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from localchat.cli import main
from localchat.engine.cards import find_card
from localchat.engine.layer_kinds import summary
from localchat.planning import memory as m
from localchat.planning.planner import Request, make_plan

CONFIGS = Path(__file__).parents[1] / "data" / "configs"
HYBRIDS = ("gemma-3-12b-it", "gpt-oss-20b", "qwen3.6-27b")


def shape(name: str) -> m.Shape:
    return m.Shape.from_config(m.read_config(CONFIGS / f"{name}.json"), name=name)


def unit(s: m.Shape, dtype_bytes: int = 2, compact: bool = False) -> int:
    """One unit in one layer, every KV head, of a plain cache: K + V, an fp32 score, an int64 position (and in
    compact positions at 16 bits the key's int8 remainder)."""
    return s.kv_heads * (2 * s.head_dim * dtype_bytes + 4 + 8 + (s.head_dim if compact else 0))


def full_request(**kw) -> Request:
    return Request(**{**dict(local=100, max_new=512, weights="nf4", kv="bf16", act="bf16", holds_prompt="full",
                             compact=False), **kw})


# --- the layers and the weights ------------------------------------------------------------------------------------


def test_the_layers_by_kind_of_the_published_configs():
    assert summary(list(shape("gemma-3-12b-it").kinds)) == "8 global, 40 window (1024)"
    assert summary(list(shape("gpt-oss-20b").kinds)) == "12 global, 12 window (128)"
    assert summary(list(shape("qwen3.6-27b").kinds)) == "16 global, 48 state"
    assert [k.kind for k in shape("gemma-3-12b-it").kinds[:6]] == ["window"] * 5 + ["global"]
    assert [k.kind for k in shape("qwen3.6-27b").kinds[:4]] == ["state"] * 3 + ["global"]
    assert shape("llama-3.1-8b-instruct").kinds == () and shape("llama-3.1-8b-instruct").global_layers == 32


def _meta_params(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied weights once


@pytest.mark.parametrize("name", HYBRIDS)
def test_parameter_counts_are_the_models_transformers_builds(name):
    """Gemma 3's vision tower (its causal-LM class is the multimodal one), gpt-oss's 32 experts with their biases
    and its sinks, Qwen3.5's gated queries and Gated DeltaNet projections: the count is what transformers builds."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(CONFIGS / f"{name}.json")
    if getattr(config, "quantization_config", None):
        del config.quantization_config  # MXFP4 needs its kernels to build; the shapes do not change
    s = shape(name)
    assert s.total_params() == _meta_params(config)
    assert m.Shape.from_config(config, name=name) == s  # a loaded model's config reads as its file does
    published = {"gpt-oss-20b": 20_914_757_184}  # OpenAI's model card: 20.91B
    assert s.total_params() == published.get(name, s.total_params())


TINY = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=300)
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_conv_kernel_dim=4)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)


@pytest.mark.parametrize(("model_type", "fields"), [
    ("qwen3_next", {**LINEAR, **MOE, "intermediate_size": 96, "mlp_only_layers": [1, 5]}),  # two dense MLPs
    ("qwen3_next", {**LINEAR, **MOE, "intermediate_size": 96, "decoder_sparse_step": 2}),
    ("qwen3_5_moe_text", {**LINEAR, **MOE}),
    ("qwen3_5_text", {**LINEAR, "intermediate_size": 96}),
    ("gpt_oss", {"intermediate_size": 48, "num_local_experts": 6, "num_experts_per_tok": 2, "sliding_window": 16}),
    ("mixtral", {"intermediate_size": 48, "num_local_experts": 6, "num_experts_per_tok": 2}),
    ("gemma3_text", {"intermediate_size": 96, "sliding_window": 16}),
    ("qwen3", {"intermediate_size": 96}),
])
def test_moe_and_linear_attention_counts_on_tiny_configs(model_type, fields):
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type](**{**TINY, **fields})
    assert m.Shape.from_config(config.to_dict()).total_params() == _meta_params(config)


@pytest.mark.parametrize("model_type", list(m.CONFIG_DEFAULTS))
def test_the_defaults_a_sparse_config_falls_back_on_are_transformers_own(model_type):
    from transformers import CONFIG_MAPPING

    own = CONFIG_MAPPING[model_type]().to_dict()
    assert {k: own[k] for k in m.CONFIG_DEFAULTS[model_type]} == m.CONFIG_DEFAULTS[model_type]


@pytest.mark.parametrize("name", HYBRIDS)
def test_each_card_has_the_shape_of_its_published_config(name):
    card = find_card(name)
    assert m.Shape.from_card(card) == replace(shape(name), name=card.name)


# --- what each kind of layer holds ----------------------------------------------------------------------------------


def test_the_linear_state_is_what_transformers_keeps(monkeypatch):
    """A tiny Qwen3.5 reads 37 tokens and then 5 with transformers' own cache: its linear-attention layers hold
    exactly state_bytes (a recurrent state in fp32, a convolution state at the activations' dtype)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING["qwen3_5_text"](**{**TINY, **LINEAR, "num_hidden_layers": 4, "intermediate_size": 96})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 300, (1, 37))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        cache = model(ids[:, :5], past_key_values=cache, use_cache=True).past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for states in
               (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {}))
               for t in states.values() if t is not None)
    assert held == m.state_bytes(m.Shape.from_config(config.to_dict()), "bf16") > 0
    # Qwen3.6-27B: 48 layers x (48 x 128 x 128 fp32 + (2 x 16 x 128 + 48 x 128) x 4 at bf16)
    assert m.state_bytes(shape("qwen3.6-27b"), "bf16") == 48 * (48 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) * 4 * 2)


def test_window_layers_hold_their_window_and_the_chunk():
    g = shape("gemma-3-12b-it")
    assert m.window_units(g, 512) == 40 * (1023 + 512)
    assert m.window_bytes(g, "bf16", 512) == 40 * (1023 + 512) * unit(g)
    assert m.kv_unit_bytes(g, "bf16") == 8 * unit(g)  # what the budget multiplies: the 8 global layers
    assert m.kv_unit_bytes(replace(g, kinds=()), "bf16") == 48 * unit(g)  # counted as if every layer grew
    o = shape("gpt-oss-20b")
    assert m.window_bytes(o, "bf16", 1024) == 12 * (127 + 1024) * unit(o)


@pytest.mark.parametrize("name", HYBRIDS)
def test_full_attention_at_8k_and_128k_differs_by_the_global_layers_alone(name):
    """A policy that keeps every token: from an 8K to a 128K document only the global layers' cache (and the
    attention over it) grows; the windows and the linear state stay as they were."""
    s, chunk = shape(name), 1024

    def peak(tokens: int) -> m.Estimate:
        return m.estimate(s, budget=tokens, chunk=chunk, local=100, max_new=512, weights="nf4", kv="bf16", act="bf16")

    short, long = peak(8192), peak(131072)
    assert (short.window, short.state, short.weights, short.activations) == \
        (long.window, long.state, long.weights, long.activations)
    assert long.kv - short.kv == (131072 - 8192) * m.kv_unit_bytes(s, "bf16")
    assert long.total - short.total == (long.kv - short.kv) + (long.scratch - short.scratch)
    assert short.window + short.state > 0


@pytest.mark.parametrize("name", HYBRIDS)
def test_an_evicting_plan_does_not_grow_with_the_document(name):
    """LOCRET-style eviction: the budget bounds the global layers, so an 8K and a 128K document plan the same peak;
    only the chunk moves the window layers' share."""
    s = shape(name)
    req = Request(local=100, max_new=512, weights="nf4", kv="bf16", act="bf16", budget=4096, chunk=512)
    short = make_plan(s, 24 * m.GIB, replace(req, doc_tokens=8192), kind="cuda")
    long = make_plan(s, 24 * m.GIB, replace(req, doc_tokens=131072), kind="cuda")
    assert short.estimate == long.estimate and long.max_document() is None
    wider = make_plan(s, 24 * m.GIB, replace(req, chunk=1024), kind="cuda")
    assert wider.estimate.window - short.estimate.window == len(s.of_kind("window")) * 512 * unit(s, compact=True)
    assert wider.estimate.state == short.estimate.state


def test_a_hybrid_holds_a_far_longer_document_with_full_attention():
    """Only the global layers grow: at 24 GiB Gemma 3 12B holds its whole 128K window, over three times what it
    would hold if all 48 layers grew; Qwen3.6-27B nearly three times (the attention over the document grows too)."""
    for name, factor in (("gemma-3-12b-it", 3), ("qwen3.6-27b", 2.5)):
        s = shape(name)
        hybrid = make_plan(s, 24 * m.GIB, full_request(chunk=1024), kind="cuda")
        flat = make_plan(replace(s, kinds=()), 24 * m.GIB, full_request(chunk=1024), kind="cuda")
        assert hybrid.max_document() > factor * flat.max_document() > 0, name


# --- the plan command -----------------------------------------------------------------------------------------------


def test_plan_for_the_qwen_card_shows_the_layers_and_the_longest_document(capsys):
    assert main(["--model", "qwen3.6-27b", "plan", "--memory-gb", "24", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "layers       16 global, 48 state: only the global layers' cache grows" in out
    assert "KV cache (global)" in out and "linear state" in out and "(fits)" in out
    doc = int(out.split("documents    up to ")[1].split(" tokens")[0].replace(",", ""))
    assert 32768 < doc < 262144
    assert main(["--model", "qwen3.6-27b", "plan", "--memory-gb", "24", "--device", "cuda", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["max_document"] == doc and data["bytes"]["linear state"] == m.state_bytes(shape("qwen3.6-27b"), "bf16")


def test_plan_for_the_gpt_oss_card_counts_its_window_layers(capsys):
    assert main(["--model", "gpt-oss-20b", "plan", "--memory-gb", "24", "--device", "cuda", "--policy", "sirllm"]) == 0
    out = capsys.readouterr().out
    assert "layers       12 global, 12 window (128)" in out and "KV cache (window)" in out
    assert "units in each global layer, so a 128K-token document fits" in out


def test_the_gemma_plan_shows_its_layers_and_the_longest_document():
    """What `plan` prints for the card, planned from it directly (whether or not the engine runs gemma3 yet)."""
    s = m.Shape.from_card(find_card("gemma-3-12b-it"))
    text = "\n".join(make_plan(s, 24 * m.GIB, full_request(), kind="cuda").lines())
    assert "layers       8 global, 40 window (1024): only the global layers' cache grows" in text
    assert "KV cache (window)" in text and "only its 8 global layers grow with it" in text
    doc = int(text.split("documents    up to ")[1].split(" tokens")[0].replace(",", ""))
    assert doc == s.window - 512  # 24 GiB holds more than the 128K window: the window bounds it
