"""Every Triton kernel equals its torch twin; the twins equal the engine's plain paths; dispatch is chosen once.

Without CUDA the kernels run under Triton's interpreter (conftest sets TRITON_INTERPRET=1), on CPU tensors.
Tolerances: fp32 outputs within 1e-4 absolute (online softmax and in-kernel cos/sin vs torch's, same formula);
16-bit keys within the dtype's default tolerance (both round the same fp32 value); values and gathers exact.
"""

from __future__ import annotations

import pytest
import torch

import localchat.kernels as kernels
from localchat.engine.qcache import QuantizedKVLayer, group_size, quantize
from localchat.kernels import evict, qattn

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def inv_freq(d: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


def quantized(h: int, n: int, d: int, bits: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for names in (("qk", "ks", "kz"), ("qv", "vs", "vz")):
        x = torch.randn(1, h, max(n, 1), d, generator=g) * 2
        out.update(zip(names, quantize(x, bits, group_size(d))))
    return {k: v[:, :, :n].to(DEV) for k, v in out.items()}


# (query heads, KV heads, head_dim, quantized units, tail units, bits, rotate)
QATTN_CASES = [
    (9, 3, 64, 300, 5, 4, True),  # SmolLM2's GQA (3 query heads per KV head), several splits
    (4, 2, 96, 77, 0, 2, False),  # head_dim not a power of two (Phi-3), no tail
    (2, 1, 64, 1, 3, 8, True),  # one quantized unit
    (6, 2, 32, 130, 17, 4, False),  # odd lengths
    (8, 8, 128, 129, 1, 2, True),  # no GQA, Llama-sized heads
    (4, 2, 64, 0, 9, 4, True),  # nothing quantized yet: the tail alone
    (32, 8, 128, 200, 64, 4, True),  # Llama-3-8B's heads, several splits
]


# the per-query-head kernel (kept for the GPU's A/B) on the smaller cases; the grouped kernels on all
KERNEL_CASES = [(*case, way) for case in QATTN_CASES for way in qattn.WAYS if way != "head" or case[0] < 32]
# the tensor-core kernel multiplies fp16 operands (11 bits), the others fp32
WAY_TOLERANCE = {"group": 1e-4, "head": 1e-4, "dot": 5e-3}


@pytest.mark.parametrize("hq,h,d,nq,nt,bits,rotate,way", KERNEL_CASES)
def test_decode_attention_kernel_equals_twin(hq, h, d, nq, nt, bits, rotate, way):
    """Every split kernel (one program per KV head for its query heads, with or without tensor cores, or per
    query head) equals the twin."""
    quant = quantized(h, nq, d, bits, seed=nq)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, hq, 1, d, generator=g).to(DEV)
    tk, tv = (torch.randn(1, h, nt, d, generator=g).to(DEV) for _ in range(2))
    inv = inv_freq(d).to(DEV) if rotate else None
    args = (q, quant, tk, tv, bits, group_size(d), d**-0.5, inv)
    got, want = qattn.decode_attention_triton(*args, qattn.Split(way=way)), qattn.decode_attention_torch(*args)
    assert got.shape == want.shape == (1, 1, hq, d)
    torch.testing.assert_close(got, want, atol=WAY_TOLERANCE[way], rtol=WAY_TOLERANCE[way])


@pytest.mark.parametrize("way", ["group", "dot"])
def test_many_splits_merge_in_blocks(way):
    """Up to the most splits (the split target far above the units' blocks): the merge adds the partials up 16 at
    a time, and the answer is the twin's."""
    split = qattn.Split(way=way, programs=1056, block=16)
    hq, h, d, nq, nt = 4, 2, 32, 1200, 3
    quant = quantized(h, nq, d, 8, seed=5)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, hq, 1, d, generator=g).to(DEV)
    tk, tv = (torch.randn(1, h, nt, d, generator=g).to(DEV) for _ in range(2))
    args = (q, quant, tk, tv, 8, group_size(d), d**-0.5, inv_freq(d).to(DEV))
    assert qattn.plan_splits(nq, h, 16 if way == "dot" else 64, 1056)[0] > 16
    torch.testing.assert_close(qattn.decode_attention_triton(*args, split), qattn.decode_attention_torch(*args),
                               atol=WAY_TOLERANCE[way], rtol=WAY_TOLERANCE[way])


# (query heads, KV heads, head_dim, capacity, held, tail capacity, tail held, bits, rotate)
GRAPH_CASES = [
    (9, 3, 64, 300, 200, 40, 5, 4, True),  # SmolLM2's GQA, the packed part and a tail
    (4, 2, 96, 80, 77, 8, 0, 2, False),  # head_dim not a power of two, no tail yet
    (8, 2, 128, 200, 0, 40, 9, 8, True),  # nothing packed yet: the tail alone
    (9, 3, 64, 300, 250, 0, 0, 0, False),  # the plain cache (bits 0): keys and values as they are
]


@pytest.mark.parametrize("way", qattn.WAYS)
@pytest.mark.parametrize("hq,h,d,cap,n,tcap,nt,bits,rotate", GRAPH_CASES)
def test_graph_attention_reads_only_the_units_held(hq, h, d, cap, n, tcap, nt, bits, rotate, way):
    """kernels/graph_attn.py (a captured decode step's attention: buffers at capacity, lengths in device memory):
    the Triton kernel equals its twin, both equal attention over the held units alone, and whatever lies past the
    lengths (NaN here) is never read."""
    from localchat.kernels import graph_attn

    g = torch.Generator().manual_seed(cap + n)
    q = torch.randn(1, hq, 1, d, generator=g).to(DEV)
    if bits:
        main = quantized(h, cap, d, bits, seed=cap)
        tk, tv = (torch.randn(1, h, tcap, d, generator=g).to(DEV) for _ in range(2))
        tk[:, :, nt:], tv[:, :, nt:] = float("nan"), float("nan")
    else:
        main = {name: torch.randn(1, h, cap, d, generator=g).to(DEV) for name in ("k", "v")}
        main["k"][:, :, n:], main["v"][:, :, n:] = float("nan"), float("nan")
        tk = tv = None
    lens = torch.tensor([n, nt], dtype=torch.long, device=DEV)
    inv = inv_freq(d).to(DEV) if rotate else None
    args = (q, main, tk, tv, lens, bits, group_size(d), d**-0.5, inv)
    got, twin = graph_attn.attention_triton(*args, qattn.Split(way=way)), graph_attn.attention_torch(*args)
    if bits:
        held = {k: v[:, :, :n] for k, v in main.items()}
        want = qattn.decode_attention_torch(q, held, tk[:, :, :nt], tv[:, :, :nt], bits, group_size(d), d**-0.5, inv)
    else:
        grouped = q.reshape(1, h, hq // h, d)
        want = torch.nn.functional.scaled_dot_product_attention(grouped, main["k"][:, :, :n], main["v"][:, :, :n],
                                                                scale=d**-0.5).reshape(1, 1, hq, d)
    assert torch.isfinite(got).all() and torch.isfinite(twin).all()
    torch.testing.assert_close(got, twin, atol=WAY_TOLERANCE[way], rtol=WAY_TOLERANCE[way])
    torch.testing.assert_close(twin, want, atol=1e-5, rtol=1e-5)


def test_decode_attention_twin_equals_the_dequantize_then_sdpa_path():
    """The twin is what the cache's own dequantized() + SDPA gives (the path used before the kernels)."""
    torch.manual_seed(0)
    layer = QuantizedKVLayer(bits=4, residual=16)
    layer.inv_freq = inv_freq(32)
    for _ in range(5):  # 50 units: tails quantized at 16, a tail of 2 left
        layer.update(torch.randn(1, 2, 10, 32), torch.randn(1, 2, 10, 32))
    assert layer.nq > 0 and layer.nt > 0
    q = torch.randn(1, 6, 1, 32)
    old_k, old_v = layer.dequantized(torch.float32)
    keys = torch.cat([old_k, layer.keys], dim=-2).repeat_interleave(3, dim=1)
    values = torch.cat([old_v, layer.values], dim=-2).repeat_interleave(3, dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values).transpose(1, 2)
    got = qattn.decode_attention_torch(q, layer.quantized(), layer.keys, layer.values, 4, 32, 32**-0.5,
                                       layer.inv_freq)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_merge_of_partials_is_softmax_over_the_union():
    g = torch.Generator().manual_seed(0)
    logits, v = torch.randn(2, 10, generator=g), torch.randn(2, 10, 4, generator=g)
    parts = [(0, 3), (3, 10)]
    outs = torch.stack([torch.einsum("hn,hnd->hd", torch.softmax(logits[:, a:b], -1), v[:, a:b]) for a, b in parts], 1)
    lses = torch.stack([torch.logsumexp(logits[:, a:b], -1) for a, b in parts], 1)
    want = torch.einsum("hn,hnd->hd", torch.softmax(logits, -1), v)
    torch.testing.assert_close(qattn.merge(outs, lses), want)


# (KV heads, units, kept, head_dim, dtype, rotate)
GATHER_CASES = [
    (3, 300, 100, 64, torch.float32, True),
    (2, 77, 77, 96, torch.bfloat16, True),  # keep everything; padded head_dim
    (1, 50, 7, 64, torch.float32, False),
    (4, 1000, 513, 128, torch.float16, True),
    (2, 33, 1, 16, torch.float32, True),
]


@pytest.mark.parametrize("h,n,k,d,dtype,rotate", GATHER_CASES)
def test_gather_rotate_kernel_equals_twin(h, n, k, d, dtype, rotate):
    g = torch.Generator().manual_seed(n)
    keys = (torch.randn(1, h, n + 5, d, generator=g) * 3).to(dtype).to(DEV)[:, :, :n]  # a view with spare room
    values = torch.randn(1, h, n, d, generator=g).to(dtype).to(DEV)
    idx = torch.rand(h, n, generator=g).topk(k, dim=-1).indices.sort(dim=-1).values.to(DEV)
    inv = inv_freq(d).to(DEV) if rotate else None
    got_k, got_v = evict.gather_rotate_triton(keys, values, idx, inv)
    want_k, want_v = evict.gather_rotate_torch(keys, values, idx, inv)
    assert torch.equal(got_v, want_v)
    if rotate:
        torch.testing.assert_close(got_k, want_k)
    else:
        assert torch.equal(got_k, want_k)


def test_gather_rotate_twin_moves_keys_to_their_new_slots():
    """A key rotated at slot p, moved to slot j, equals the same pre-RoPE key rotated at j."""
    from localchat.kernels.rope import rope_table
    from localchat.kernels.rope import rotate as _rotate

    d, n = 16, 12
    raw = torch.randn(1, 2, n, d)
    inv = inv_freq(d)
    at = lambda pos: _rotate(raw.gather(2, pos[None, :, :, None].expand(-1, -1, -1, d)), *rope_table(pos, inv))  # noqa: E731
    slots = torch.arange(n).expand(2, n)
    idx = torch.tensor([[0, 3, 4, 9], [1, 2, 7, 11]])
    moved, _ = evict.gather_rotate_torch(at(slots), raw, idx, inv)
    torch.testing.assert_close(moved, _rotate(raw.gather(2, idx[None, :, :, None].expand(-1, -1, -1, d)),
                                              *rope_table(torch.arange(4).expand(2, 4), inv)), atol=1e-5, rtol=1e-5)


# (KV heads, units, kept, head_dim, dtype)
REST_CASES = [
    (3, 300, 100, 64, torch.bfloat16),
    (2, 77, 77, 96, torch.float16),  # keep everything; padded head_dim
    (2, 33, 1, 16, torch.bfloat16),
]


@pytest.mark.parametrize("h,n,k,d,dtype", REST_CASES)
def test_gather_rotate_rest_kernel_equals_twin(h, n, k, d, dtype):
    """Both give the same exact keys (key + remainder) to two remainder steps (1/256 of a spacing each): in-kernel
    cos/sin differ from torch's in the last fp32 bit, which can tip a remainder's rounding (one step), and at
    the middle between two keys the two may round to either side, each clamped at 127 steps of the 128 (one
    more). The key may then differ by one spacing, its remainder making up for it, so joined values are compared."""
    from localchat.kernels import keyrest

    g = torch.Generator().manual_seed(n)
    exact = torch.randn(1, h, n + 5, d, generator=g) * 3
    keys, rest = keyrest.split(exact, dtype)
    keys, rest = keys.to(DEV)[:, :, :n], rest.to(DEV)[:, :, :n]  # views with spare room
    values = torch.randn(1, h, n, d, generator=g).to(dtype).to(DEV)
    idx = torch.rand(h, n, generator=g).topk(k, dim=-1).indices.sort(dim=-1).values.to(DEV)
    inv = inv_freq(d).to(DEV)
    got_k, got_v, got_r = evict.gather_rotate_triton(keys, values, idx, inv, rest)
    want_k, want_v, want_r = evict.gather_rotate_rest_torch(keys, values, rest, idx, inv)
    assert torch.equal(got_v, want_v) and got_r.dtype == torch.int8
    one_step = torch.maximum(keyrest.step(got_k), keyrest.step(want_k))
    assert ((keyrest.join(got_k, got_r) - keyrest.join(want_k, want_r)).abs() <= 2.01 * one_step + 1e-6).all()
    assert (got_k != want_k).float().mean() < 0.01


def test_select_batched_equals_one_layer_at_a_time():
    g = torch.Generator().manual_seed(0)
    prios = [torch.randn(3, 40, generator=g) for _ in range(5)]
    for got, p in zip(evict.select(prios, 17), prios):
        assert torch.equal(got, p.topk(17, dim=-1).indices.sort(dim=-1).values)
    mixed = [torch.randn(3, 40, generator=g), torch.randn(3, 30, generator=g)]  # different lengths: one by one
    assert [t.shape for t in evict.select(mixed, 10)] == [(3, 10), (3, 10)]


def test_dispatch(monkeypatch):
    try:
        monkeypatch.setenv("LOCALCHAT_KERNELS", "torch")
        kernels.reset_backend()
        assert kernels.backend() == "torch" and not kernels.use_triton(torch.zeros(1))
        monkeypatch.setenv("LOCALCHAT_KERNELS", "triton")
        kernels.reset_backend()
        assert kernels.backend() == "triton"  # CUDA, or the interpreter the tests run under
        monkeypatch.setenv("LOCALCHAT_KERNELS", "cuda")
        kernels.reset_backend()
        with pytest.raises(ValueError, match="LOCALCHAT_KERNELS"):
            kernels.backend()
        monkeypatch.delenv("LOCALCHAT_KERNELS")
        kernels.reset_backend()
        assert kernels.backend() == ("triton" if torch.cuda.is_available() else "torch")  # the CPU uses the twins
    finally:
        kernels.reset_backend()


@pytest.mark.parametrize("positions", ["compact", "original"])
def test_fused_decode_gives_the_same_answer_as_dequantize_then_sdpa(tiny_tok, positions, monkeypatch):
    """An engine decoding on an int4 cache through the fused attention (torch twin here; Triton on CUDA)
    picks the same tokens as the dequantize-then-SDPA path."""
    from tiny import tiny_llama

    from localchat.engine import qattention
    from localchat.engine.engine import Decoding, Engine
    from localchat.engine.events import Done, Token
    from localchat.engine.policies import make_policy
    from localchat.engine.sampling import GenerationSettings

    calls = []
    real = qattention.decode_attention
    monkeypatch.setattr(qattention, "decode_attention", lambda *a: calls.append(1) or real(*a))

    def run(fused: bool):
        model = tiny_llama(len(tiny_tok), layers=2, q_heads=4, kv_heads=2, head_dim=16)
        engine = Engine(model, tiny_tok, name="tiny", chunk=32, kv="int4", positions=positions,
                        policy=make_policy("streaming", budget=48), decoding=Decoding(fused=fused))
        ids = engine.encode("the quick brown fox jumps over the lazy dog " * 12)
        events = list(engine.generate(ids, GenerationSettings(max_new_tokens=12, ignore_eos=True)))
        assert isinstance(events[-1], Done) and model.config._attn_implementation == "sdpa"  # restored
        return [e.token_id for e in events if isinstance(e, Token)]

    fused_tokens = run(True)
    assert len(calls) > 0  # the fused attention ran on the decode steps
    calls.clear()
    assert fused_tokens == run(False)
    assert not calls


def test_bench_kernels_micro_writes_its_tables(tmp_path):
    """`localchat bench kernels --micro-only`: the twin and the old path timed per shape (Triton too on CUDA)."""
    import json

    from localchat.cli import main

    assert main(["bench", "kernels", "--micro-only", "--units", "64", "--reps", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "kernels.json").read_text())
    rows = {r["kernel"]: r for r in result["micro"]}
    assert set(rows) == {"decode_attention", "gather_rotate", "select"}
    assert rows["decode_attention"]["twin_ms"] > 0 and rows["decode_attention"]["dequant_sdpa_ms"] > 0
    assert ("triton_ms" in rows["gather_rotate"]) == torch.cuda.is_available()
    assert "## `decode_attention`" in (tmp_path / "kernels.md").read_text()
