"""A tiny random Llama and a byte-level tokenizer with a chat template, built in-process (no download)."""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    tok.add_special_tokens({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>"})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama(vocab_size: int, *, layers: int = 2, q_heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
               window: int = 8192, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=q_heads * head_dim, intermediate_size=4 * q_heads * head_dim,
        num_hidden_layers=layers, num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=window, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    model.requires_grad_(False)
    return model


def save_tiny(directory: Path, **kw) -> Path:
    """Write a tiny model + tokenizer as a local Hugging Face directory."""
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), **kw)
    model.config.eos_token_id = tok.eos_token_id
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


CONFIGS = Path(__file__).parent / "data" / "configs"
ARCHITECTURES = {  # one row per architecture: a real config file, or the model_type of transformers' own config
    "llama": "llama-3.1-8b-instruct.json", "qwen2": "qwen2.5-7b-instruct.json", "phi3": "phi-3-mini-128k-instruct.json",
    "mistral": {"model_type": "mistral", "sliding_window": None}, "qwen3": {"model_type": "qwen3"},
    # hybrids: their real configs, four layers of their layer patterns, windows small enough for a 1.4K document
    "gemma3_text": {"file": "gemma-3-12b-it.json", "tiny": {
        "num_hidden_layers": 4, "sliding_window": 64,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]}},
    "gpt_oss": {"file": "gpt-oss-20b.json", "tiny": {
        "num_hidden_layers": 4, "sliding_window": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
        "experts_per_token": 2, "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                                "full_attention"]}, "attention": "eager"},
    "qwen3_5_text": {"file": "qwen3.6-27b.json", "tiny": {
        "num_hidden_layers": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                                         "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                                                         "mrope_interleaved": True},
        "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"]}},
    "qwen3_next": {"model_type": "qwen3_next", "tiny": {
        "num_hidden_layers": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"]}},
    "smollm3": {"model_type": "smollm3", "tiny": {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0]}},
}
HYBRIDS = ("gemma3_text", "gpt_oss", "qwen3_5_text", "qwen3_next", "smollm3")  # layers of more than one kind (or without RoPE)


def tiny_architecture(name: str, vocab_size: int):
    """A two-layer (hybrids: four-layer) random model of an architecture's real config (its own attention layout
    and RoPE)."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    row = ARCHITECTURES[name]
    row = {"file": row} if isinstance(row, str) else dict(row)
    tiny, attention, file = row.pop("tiny", {}), row.pop("attention", "sdpa"), row.pop("file", None)
    cfg = json.loads((CONFIGS / file).read_text()) if file else {}
    cfg = {**cfg.get("text_config", cfg), **row}  # a multimodal config's text model
    cfg.pop("quantization_config", None)
    cfg.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=vocab_size, max_position_embeddings=4096,
               tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.pop("rope_scaling", None)  # the long-context scalings need the real dimensions; plain RoPE here
    cfg.pop("original_max_position_embeddings", None)
    cfg.pop("auto_map", None)
    cfg.update(tiny)
    config = AutoConfig.for_model(**cfg)
    config._attn_implementation = attention
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config).float().eval()
    m.requires_grad_(False)
    return m


def read_attached(engine, model, ids, chunk: int = 32):
    """`ids` read by chunked prefill into a new cache, with the engine's policy attached (and left attached, so
    decode steps after it are scored); returns (cache, the last logits)."""
    from localchat.engine.prefill import prefill

    cache = engine.new_cache(ids.shape[-1], 16)
    engine.policy.attach(model, cache)
    run = prefill(model, cache, ids, chunk=chunk, policy=engine.policy)
    while True:
        try:
            next(run)
        except StopIteration as stop:
            return cache, stop.value
