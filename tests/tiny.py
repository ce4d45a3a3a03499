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
