"""A prefill chunk's attention on the CPU (kernels/cpu_prefill.h `chunk_attention`, engine/attention.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from localchat.engine import attention
from localchat.kernels import cpu_decode


def _kernel():
    native = cpu_decode.kernels()
    assert native is not None, cpu_decode.reason()
    if not hasattr(native, "chunk_attention"):
        pytest.skip("this CPU has no AVX512-BF16 dot products: chunks attend through SDPA")
    return native.chunk_attention


def _bf16(*ts):
    return [t.bfloat16().float() for t in ts]


def _causal(q_len: int, kv_len: int) -> torch.Tensor:
    mask = torch.ones(q_len, kv_len, dtype=torch.bool)
    mask[:, kv_len - q_len:] = torch.tril(torch.ones(q_len, q_len, dtype=torch.bool))
    return mask


@pytest.mark.parametrize("heads,kv_heads,q_len,kv_len,d", [(9, 3, 300, 1100, 64), (4, 1, 37, 300, 256),
                                                            (16, 8, 65, 129, 128), (2, 2, 70, 70, 64)])
@pytest.mark.parametrize("mask_kind", ["causal", "holes", "window", "none"])
def test_chunk_attention_is_sdpa_on_bf16_inputs(heads, kv_heads, q_len, kv_len, d, mask_kind):
    """The kernel computes softmax(q k^T * scale + mask) v with q, k and v rounded to bf16 and the softmax's
    weights rounded to bf16 before they multiply v: within that rounding of SDPA on the same bf16 values, for
    grouped heads, head sizes 64-256, any bool mask (holes, a sliding window whose first blocks no row sees) and
    no mask (causal, the queries being the last keys)."""
    kernel = _kernel()
    g = torch.Generator().manual_seed(q_len)
    q = torch.randn(1, heads, q_len, d, generator=g) * 2
    k = torch.randn(1, kv_heads, kv_len, d, generator=g) * 2
    v = torch.randn(1, kv_heads, kv_len, d, generator=g)
    mask = _causal(q_len, kv_len)
    if mask_kind == "holes":
        mask[:, 3:40] = False
        mask[::7, kv_len - q_len - 5:kv_len - q_len] = False
    elif mask_kind == "window":
        rows = torch.arange(q_len)[:, None] + kv_len - q_len
        mask &= rows - torch.arange(kv_len)[None, :] < 100
    want = F.scaled_dot_product_attention(*_bf16(q, k, v), attn_mask=mask, scale=0.1, enable_gqa=True)
    given = torch.empty(0, dtype=torch.bool) if mask_kind == "none" else mask[None, None]
    out = kernel(q, k, v, given, 0.1)
    assert out.shape == (1, q_len, heads, d)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=0, atol=0.01)  # the weights' bf16 rounding
    exact = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.1, enable_gqa=True).transpose(1, 2)
    assert (out - exact).abs().max() > 1e-4  # bf16 arithmetic: not fp32's result


def test_chunk_attention_reads_strided_keys_and_values():
    """A cache's keys are views into larger buffers: a row stride other than d."""
    kernel = _kernel()
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 6, 80, 64, generator=g)
    big_k, big_v = torch.randn(1, 3, 500, 64, generator=g), torch.randn(1, 3, 500, 64, generator=g)
    k, v = big_k[:, :, :300], big_v[:, :, :300]
    mask = _causal(80, 300)[None, None]
    want = kernel(q, k.contiguous(), v.contiguous(), mask, 0.125)
    torch.testing.assert_close(kernel(q, k, v, mask, 0.125), want, rtol=0, atol=0)


class _Module:
    num_key_value_groups = 3
    is_causal = True


def test_the_attention_function_serves_chunks_and_sends_the_rest_to_sdpa():
    """CHUNK_IMPL's function: a fp32 chunk with a bool mask goes to the kernel; one decoded token, a float mask, a
    head size not a multiple of 64, or the kernel switched off go to SDPA (the same result as transformers')."""
    _kernel()
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(1, 9, 50, 64, generator=g), torch.randn(1, 3, 200, 64, generator=g), torch.randn(1, 3, 200, 64, generator=g)
    mask = _causal(50, 200)[None, None]
    out, _ = attention.chunk_attention(_Module(), q, k, v, mask, scaling=0.125)
    sdpa, _ = attention.sdpa(_Module(), q, k, v, mask, scaling=0.125)
    assert not torch.equal(out, sdpa)
    torch.testing.assert_close(out, sdpa, rtol=0, atol=0.05)
    token = q[:, :, -1:]
    float_mask = torch.zeros(1, 1, 50, 200).masked_fill(~mask, float("-inf"))
    for args in ((token, k, v, mask[..., -1:, :]), (q, k, v, float_mask), (q[..., :48], k[..., :48], v[..., :48], mask)):
        got, _ = attention.chunk_attention(_Module(), *args, scaling=0.125)
        assert torch.equal(got, attention.sdpa(_Module(), *args, scaling=0.125)[0])
    attention.set_chunk_attention(False)
    try:
        assert torch.equal(attention.chunk_attention(_Module(), q, k, v, mask, scaling=0.125)[0], sdpa)
    finally:
        attention.set_chunk_attention(None)


def test_a_cpu_engine_reads_chunks_through_the_kernel_and_decodes_on_its_lean_step(smollm2):
    """The real model: loaded on this CPU it attends through CHUNK_IMPL; the lean decode step still serves it, and
    the first answer to a document is the same with the kernel as with SDPA."""
    _kernel()
    from localchat.engine.decode_step import supported
    from localchat.engine.sampling import GenerationSettings

    assert smollm2.model.config._attn_implementation == attention.CHUNK_IMPL
    cache = smollm2.new_cache()
    assert supported(smollm2.model, cache)
    lines = [f"Line {i}: the weather was mild and the shop opened at nine." for i in range(120)]
    lines[60] = "The secret word is pineapple."
    ids = smollm2.encode_chat([{"role": "user", "content": " ".join(lines) + "\nWhat is the secret word?"}])
    assert len(ids) > 2 * smollm2.chunk  # several chunks
    settings = GenerationSettings(max_new_tokens=12)
    answers = []
    for on in (True, False):
        attention.set_chunk_attention(on)
        try:
            answers.append("".join(ev.text for ev in smollm2.generate(ids, settings) if type(ev).__name__ == "Token"))
        finally:
            attention.set_chunk_attention(None)
    assert answers[0] == answers[1] and "pineapple" in answers[0].lower()
