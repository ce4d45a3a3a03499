"""kernels/fused.py: the captured decode step's fused ops (Triton, interpreted on the CPU) give what the eager ops
give, rounding where they round; `serves` names the models whose layers they replace. On CUDA (tools/gpu's step 5)
the kernels run natively and a bf16 sum is checked bit for bit; the interpreter truncates bf16 instead of rounding,
so here it is checked to one unit in the last place."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_architecture
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from localchat.kernels import fused

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _tol(dtype):
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}  # 2 bf16 units


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_x", [True, False])
def test_add_rms_norm_equals_the_add_and_the_norm(dtype, with_x, triton_kernels):
    g = torch.Generator().manual_seed(0)
    n = 96  # not a power of two
    norm = LlamaRMSNorm(n, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(n, generator=g).to(dtype)
    norm = norm.to(DEV)
    residual = (torch.randn(1, 1, n, generator=g) * 3).to(dtype).to(DEV)
    x = torch.randn(1, 1, n, generator=g).to(dtype).to(DEV) if with_x else None
    got, total = fused.add_rms_norm(x, residual, norm)
    want_total = residual + x if with_x else residual
    if dtype == torch.float32 or DEV == "cuda":
        assert torch.equal(total, want_total)  # the sum rounds as torch's add rounds
    else:
        torch.testing.assert_close(total, want_total, atol=0, rtol=2**-7)
    assert got.dtype == dtype
    torch.testing.assert_close(got, norm(want_total), **_tol(dtype))


def _buffers(h, cap, d, seed, rest=True):
    """A cache layer's buffers at capacity `cap`: keys, values, scores, positions, key remainders."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, cap, d, generator=g).to(DEV), torch.randn(1, h, cap, d, generator=g).to(DEV),
            torch.randn(h, cap, generator=g).to(DEV), torch.randint(0, 99, (h, cap), generator=g).to(DEV),
            torch.randint(-9, 9, (1, h, cap, d), generator=g).to(torch.int8).to(DEV) if rest else None]


def _slots(kv_slot, slot, true):
    return [torch.tensor([x], device=DEV) for x in (kv_slot, slot, true)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,h,d", [(6, 2, 64), (4, 4, 32)])
def test_rope_write_rotates_as_transformers(hq, h, d, dtype, triton_kernels):
    """The query it returns and the key it writes are transformers' rotation of them."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 1, hq * d, generator=g).to(dtype).to(DEV)
    q = hidden.view(1, 1, hq, d).transpose(1, 2)  # the step's view of a projection
    k = torch.randn(1, 1, h * d, generator=g).to(dtype).to(DEV).view(1, 1, h, d).transpose(1, 2)
    v = torch.randn(1, 1, h * d, generator=g).to(dtype).to(DEV).view(1, 1, h, d).transpose(1, 2)
    angle = 1234.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    emb = torch.cat((angle, angle))
    cos, sin = (t.to(dtype).to(DEV)[None, None, None] for t in (emb.cos(), emb.sin()))
    buffers = _buffers(h, 5, d, 0, rest=False)
    buffers[:2] = [t.to(dtype) for t in buffers[:2]]  # the cache's keys and values are the model's dtype
    got_q = fused.rope_write(q, k, v, cos, sin, *buffers, *_slots(3, 3, 7), None)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[0], sin[0], unsqueeze_dim=1)
    torch.testing.assert_close(got_q, want_q, **_tol(dtype))
    torch.testing.assert_close(buffers[0][:, :, 3:4], want_k, **_tol(dtype))
    assert got_q.shape == q.shape and torch.equal(buffers[1][:, :, 3:4], v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_the_act_and_the_product(dtype, triton_kernels):
    g = torch.Generator().manual_seed(2)
    gate, up = (torch.randn(1, 1, 1500, generator=g).mul(4).to(dtype).to(DEV) for _ in range(2))  # two blocks and a part
    torch.testing.assert_close(fused.silu_mul(gate, up), torch.nn.functional.silu(gate) * up, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_x,with_bias", [(True, True), (False, False)])
def test_norm_linear_equals_the_norm_then_the_product(dtype, with_x, with_bias, triton_kernels):
    """The norm inside a GEMV: the product of the normed row and the residual sum as add_rms_norm and the linear
    layer give them; sizes not multiples of the blocks, and more rows than one program takes."""
    g = torch.Generator().manual_seed(5)
    n_in, n_out = 300, 1100
    norm = LlamaRMSNorm(n_in, eps=1e-5)
    norm.weight.data = torch.randn(n_in, generator=g)
    norm = norm.to(DEV, dtype)
    weight = (torch.randn(n_out, n_in, generator=g) / n_in ** 0.5).to(DEV, dtype)
    bias = torch.randn(n_out, generator=g).to(DEV, dtype) if with_bias else None
    residual = (torch.randn(1, 1, n_in, generator=g) * 3).to(DEV, dtype)
    x = torch.randn(1, 1, n_in, generator=g).to(DEV, dtype) if with_x else None
    got, total = fused.norm_linear(x, residual, norm, weight, bias)
    normed, want_total = fused.add_rms_norm(x, residual, norm)
    torch.testing.assert_close(total, want_total, rtol=0, atol=0)
    want = torch.nn.functional.linear(normed, weight, bias)
    assert got.shape == want.shape == (1, 1, n_out) and got.dtype == dtype
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_linear_equals_the_silu_product_then_the_product(dtype, triton_kernels):
    g = torch.Generator().manual_seed(6)
    n_in, n_out = 700, 37
    gate_up = (torch.randn(1, 1, 2 * n_in, generator=g) * 3).to(DEV, dtype)
    gate, up = gate_up.chunk(2, dim=-1)  # views into one row, as the step's joined gate/up product gives them
    weight = (torch.randn(n_out, n_in, generator=g) / n_in ** 0.5).to(DEV, dtype)
    got = fused.silu_linear(gate, up, weight)
    want = torch.nn.functional.linear(fused.silu_mul(gate, up), weight)
    assert got.shape == want.shape == (1, 1, n_out)
    torch.testing.assert_close(got, want, **_tol(dtype))


def test_serves_llama_qwen_and_phi3_layers_and_not_gemmas():
    from transformers import GemmaConfig, GemmaForCausalLM

    assert all(fused.serves(tiny_architecture(name, 300)) for name in ("llama", "qwen2", "qwen3", "phi3"))
    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, head_dim=16,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    assert not fused.serves(gemma)  # GELU, and norms of (1 + weight)


@pytest.mark.parametrize("with_score,with_rest", [(True, True), (False, False)])
def test_rope_write_puts_the_unit_where_the_index_writes_do(with_score, with_rest, triton_kernels):
    """K/V at the K/V slot (a quantized cache's tail slot differs from the unit slot), the score (0 without heads)
    and true position at the unit slot, the key remainder zeroed; nothing else touched; the same query."""
    g = torch.Generator().manual_seed(3)
    hq, h, cap, d = 6, 3, 12, 48  # d not a power of two
    q = torch.randn(1, 1, hq * d, generator=g).to(DEV).view(1, 1, hq, d).transpose(1, 2)
    k = torch.randn(1, 1, h * d, generator=g).to(DEV).view(1, 1, h, d).transpose(1, 2)
    v = torch.randn(1, 1, h * d, generator=g).to(DEV).view(1, 1, h, d).transpose(1, 2)
    cos, sin = (torch.randn(1, 1, 1, d, generator=g).to(DEV) for _ in range(2))
    score = torch.randn(1, h, generator=g).to(torch.bfloat16).to(DEV) if with_score else None
    got, want = _buffers(h, cap, d, 4, with_rest), _buffers(h, cap, d, 4, with_rest)
    got_q = fused.rope_write(q, k, v, cos, sin, *got, *_slots(7, 9, 12345), score)
    want_q = fused.rope_write(q, k, v, cos, sin, *want, *_slots(7, 9, 12345), score, kernel=False)  # the twins
    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(got[1:], want[1:]):
        assert a is None and b is None or torch.equal(a, b)
    assert torch.equal(got[1][0, :, 7], v[0, :, 0]) and torch.equal(got[3][:, 9], torch.full((h,), 12345, device=DEV))
    assert torch.equal(got[2][:, 9], score[0].float() if with_score else torch.zeros(h, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_score_and_rope_write_give_the_heads_output(dtype, triton_kernels):
    """A retaining head on one row in one launch (partial sums over blocks of its hidden units, added up and
    rounded by rope_write) gives the head's own output: d_R and the input not multiples of the blocks."""
    from localchat.engine.heads import RetainingHead

    torch.manual_seed(0)
    h, cap, d, n_in, d_r = 3, 10, 16, 300, 100
    head = RetainingHead(n_in, d_r, h, "silu").to(DEV, dtype)
    x = torch.randn(1, n_in, device=DEV, dtype=dtype)
    want = head(x).float()
    parts = fused.heads_score(head, x)
    assert parts.shape == (-(-d_r // fused.HEADS_BLOCK), h) and parts.dtype == torch.float32
    q = k = v = torch.randn(1, h, 1, d, device=DEV)
    cos, sin = torch.ones(1, 1, 1, d, device=DEV), torch.zeros(1, 1, 1, d, device=DEV)
    for kernel in (True, False):  # the kernel's sum, and the twin's of the same partial sums
        scores = torch.zeros(h, cap, device=DEV)
        fused.rope_write(q, k, v, cos, sin, torch.zeros(1, h, cap, d, device=DEV), torch.zeros(1, h, cap, d, device=DEV),
                         scores, torch.zeros(h, cap, dtype=torch.long, device=DEV), None, *_slots(4, 4, 77), parts,
                         kernel=kernel, score_dtype=dtype)
        torch.testing.assert_close(scores[:, 4], want[0], **_tol(dtype))
        assert scores[:, :4].abs().sum() == 0 and scores[:, 5:].abs().sum() == 0
    assert fused.heads_score(head, x, kernel=False).shape == (1, h)  # the twin: the head itself
