"""The quantized retained cache: packing, gathers on packed rows, the full-precision tail, compact positions."""

from __future__ import annotations

import pytest
import torch

from localchat.engine.cache import KVCache
from localchat.engine.qcache import (
    QUANT_KEYS,
    QuantizedKVCache,
    QuantizedKVLayer,
    dequantize,
    kv_bits,
    pack,
    quantize,
    unpack,
)
from localchat.engine.rope import shift_keys

H, D = 2, 16
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))


def _kv(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, H, t, D, generator=g) * 3, torch.randn(1, H, t, D, generator=g)


def _sorted_keep(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(H)])


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_round_trip_and_sizes(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 16), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape[-1] == 16 * bits // 8
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("bits,tol", [(8, 0.02), (4, 0.25), (2, 1.2)])
def test_quantize_error_bounded_by_half_a_step(bits, tol):
    x = torch.randn(1, H, 7, D)
    packed, scale, zero = quantize(x, bits, 16)
    err = (dequantize(packed, scale, zero, bits, 16) - x).abs()
    step = scale.float().repeat_interleave(16, dim=-1)
    assert (err <= step / 2 + 1e-3).all()
    assert err.max() < tol * x.abs().max()


def test_kv_bits_names():
    assert [kv_bits(v) for v in ("int8", "int4", "int2", "none", None, "bf16")] == [8, 4, 2, 0, 0, 0]
    with pytest.raises(ValueError, match="int3"):
        kv_bits("int3")


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_gather_on_quantized_equals_quantize_of_gathered_dequantized(bits):
    layer = QuantizedKVLayer(bits=bits)
    layer.update(*_kv(40, 0))
    layer.keep(_sorted_keep(40, 24, 1))  # the tail is quantized once, then packed rows gathered
    layer.update(*_kv(16, 2))
    before = {name: t[:, :, : layer.nq].clone() for name, t in layer._q.items()}
    old_k, old_v = layer.dequantized(torch.float32)
    idx = _sorted_keep(layer.n, 20, 3)
    old_idx = idx.clamp(max=layer.nq - 1)  # the reference: gather the dequantized old units, quantize them
    layer.keep(idx)
    rows = idx < 24
    for name_q, name_s, name_z, full in (("qk", "ks", "kz", old_k), ("qv", "vs", "vz", old_v)):
        ref = quantize(torch.gather(full, 2, old_idx[None, :, :, None].expand(-1, -1, -1, D)), bits, 16)
        for got, want in zip((layer._q[name_q], layer._q[name_s], layer._q[name_z]), ref):
            got = got[:, :, :20]
            assert torch.equal(got[0][rows], want[0][rows])  # bit for bit, no drift
        # and the gather moved the stored rows themselves
        src = before[name_q]
        moved = torch.gather(src, 2, old_idx[None, :, :, None].expand(-1, -1, -1, src.shape[-1]))
        assert torch.equal(layer._q[name_q][:, :, :20][0][rows], moved[0][rows])


def test_recent_tail_never_lost_across_evictions():
    layer = QuantizedKVLayer(bits=4, residual=10**6)
    seen_v = []
    for step in range(5):
        k, v = _kv(12, 10 + step)
        out_k, out_v = layer.update(k, v)
        # the chunk just written comes back exactly (full precision), after the dequantized old part
        assert torch.equal(out_k[:, :, -12:], k) and torch.equal(out_v[:, :, -12:], v)
        assert out_k.shape[-2] == layer.n == layer.nq + 12
        seen_v.append(v)
        idx = _sorted_keep(layer.n, 8, step)
        idx[:, -1] = layer.n - 1  # the newest unit survives: it must come back (quantized) after the gather
        last_v = v[:, :, -1]
        layer.keep(idx)
        assert layer.nt == 0 and layer.n == 8
        _, deq_v = layer.dequantized(torch.float32)
        assert (deq_v[:, :, -1] - last_v).abs().max() < 0.3
    for _ in range(30):  # decoding without eviction: units are only moved into the quantized part
        layer.residual = 7
        layer.update(*_kv(1, 99))
    assert layer.n == 38 and layer.nt <= 7 and layer.nq + layer.nt == layer.n


def test_update_returns_dequantized_old_plus_tail():
    layer = QuantizedKVLayer(bits=8, residual=4)
    k1, v1 = _kv(6, 0)
    layer.update(k1, v1)
    k2, v2 = _kv(3, 1)
    out_k, out_v = layer.update(k2, v2)  # the first 6 were over the residual: quantized now
    assert layer.nq == 6 and layer.nt == 3
    assert (out_k[:, :, :6] - k1).abs().max() < 0.1 and torch.equal(out_k[:, :, 6:], k2)
    assert (out_v[:, :, :6] - v1).abs().max() < 0.05 and torch.equal(out_v[:, :, 6:], v2)


def test_compact_keys_come_back_at_their_slots():
    """Compact positions: the kept keys equal the fp cache's re-rotated keys up to the quantization error."""
    ref = KVCache(1, positions="compact", inv_freq=INV_FREQ)
    q = QuantizedKVCache(1, 8, positions="compact", inv_freq=INV_FREQ)
    for step in range(4):
        k, v = _kv(10, step)
        ref.layers[0].update(k, v)
        q.layers[0].update(k, v)
        idx = _sorted_keep(ref.get_seq_length(), 6, step)
        ref.keep(0, idx)
        q.keep(0, idx)
    want = ref.layers[0].keys
    got, _ = q.layers[0].dequantized(torch.float32)
    assert got.shape == want.shape
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    # the same key rotated differently would be far off
    assert (shift_keys(want, torch.ones(H, 6, dtype=torch.long), INV_FREQ) - got).abs().max() > 0.2


def test_bytes_are_packed_data_plus_scales_plus_tail():
    layer = QuantizedKVLayer(bits=4, residual=10**6)
    layer.update(*_kv(20, 0))
    assert layer.nbytes() == 20 * H * D * 4 * 2  # all in the fp32 tail
    layer.keep(_sorted_keep(20, 10, 0))
    per_unit = H * 2 * (D // 2 + 2 * 2 * 1)  # k and v: D/2 packed bytes + fp16 scale and zero for one group
    assert layer.nbytes() == 10 * per_unit
    layer.update(*_kv(3, 1))
    assert layer.nbytes() == 10 * per_unit + 3 * H * D * 4 * 2


def test_clone_save_load_round_trip_and_crop():
    cache = QuantizedKVCache(2, 4, positions="compact", inv_freq=INV_FREQ)
    for layer in cache.layers:
        layer.update(*_kv(12, 0))
    for i in range(2):
        cache.keep(i, _sorted_keep(12, 7, i))
    for layer in cache.layers:
        layer.update(*_kv(2, 5))
    copy = cache.clone()
    t = cache.tensors()
    assert {f"{n}.0" for n in (*QUANT_KEYS, "tk", "tv", "s", "p")} <= set(t)
    for a, b in zip(cache.layers, copy.layers):
        assert a.n == b.n == 9 and a.nq == b.nq == 7
        assert all(torch.equal(x, y) for x, y in zip(a.dequantized(), b.dequantized()))
        assert torch.equal(a.positions, b.positions)
    with pytest.raises(KeyError, match="--kv"):  # a full-precision cache refuses a quantized file
        KVCache(2).load_tensors(t)
    full = KVCache(2)  # and a quantized cache takes a full-precision one, quantizing it
    for layer in full.layers:
        layer.update(*_kv(5, 3))
    q = QuantizedKVCache(2, 8)
    q.load_tensors(full.tensors())
    assert q.layers[0].nq == 5 and q.get_seq_length() == 5
    copy.layers[0].crop(-4)  # drops the 2 tail units and 2 quantized ones
    assert copy.layers[0].n == 5 and copy.layers[0].nq == 5 and copy.layers[0].nt == 0
