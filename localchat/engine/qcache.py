"""The evicting KV cache with the retained units stored quantized (`--kv int8|int4|int2`).

Layout per layer (H = KV heads, d = head_dim, G = group size, g = d / G groups per unit):
  quantized part  `nq` oldest units: codes uint8 `[1, H, cap, d * bits / 8]` packed along head_dim, and per
                  (unit, group) a scale and a zero point (fp16) `[1, H, cap, g]`, for keys and for values.
  tail            the units added since the last eviction, full precision `[1, H, tcap, d]`.
  scores/positions `[H, cap]` over all `n = nq + tail` units, as in KVLayer.

Quantization is asymmetric per (unit, group over head_dim): code = round((x - zero) / scale), scale =
(max - min) / (2^bits - 1), zero = min. Every row of codes, scales and zeros belongs to one unit, so an eviction
gathers packed rows with their scales: the kept old units are never re-quantized. At an eviction the tail is
quantized once (each unit exactly once) and gathered together with the old part.

Why not optimum-quanto's own packed tensors: its PackedTensor packs rows i and i + rows/2 into one byte, so a
gather along the token axis would have to unpack and repack. The codes come from quanto's `quantize_affine`
op (grouped along the last axis); the scale/zero and the row-local packing are ours.

Positions. `original`: keys keep the rotation of their true position and are stored as they come.
`compact`: a key must sit at the RoPE position of its slot, which changes at each eviction. Quantized keys are
stored un-rotated (RoPE position 0, i.e. the pre-RoPE key, as LOCRET's reference cache does) and rotated to
their slots when attention reads them; an eviction is then a plain gather, never dequantize-rotate-requantize,
so no error builds up over the many evictions of a long document.
"""

from __future__ import annotations

import torch

from localchat.engine.cache import KVCache, KVLayer
from localchat.engine.precision import KV_BITS, KV_CHOICES, kv_bits  # noqa: F401 - the --kv values
from localchat.engine.rope import rope_table, rotate
from localchat.kernels.quant import GROUP, SCALE_DTYPE, dequantize, group_size, pack, quantize, unpack  # noqa: F401
from localchat.kernels.rope import shift_keys

RESIDUAL = 128  # without an eviction, the tail is quantized once it holds this many units
QUANT_KEYS = ("qk", "ks", "kz", "qv", "vs", "vz")  # tensors() names of the quantized part


class QuantizedKVLayer(KVLayer):
    """A KVLayer whose old units are quantized (see the module doc). `update` returns full-precision K/V."""

    def __init__(self, reserve: int = 0, bits: int = 4, residual: int = RESIDUAL, tail: int = 0):
        super().__init__(reserve)
        self.bits, self.residual = bits, residual
        self.tail_reserve = tail  # the tail's first allocation: a chunk + the residual (what the planner counts)
        self.inv_freq: torch.Tensor | None = None  # set in compact mode: quantized keys are stored un-rotated
        self.nq = 0
        self.defer = False  # a decode step hands the quantized part to the fused attention (engine/qattention.py)
        self._q: dict[str, torch.Tensor] | None = None  # QUANT_KEYS -> [1, H, cap, ...]
        self._tk = self._tv = None  # [1, H, tcap, d]

    @property
    def nt(self) -> int:
        return self.n - self.nq

    # --- storage ---------------------------------------------------------------------------------------

    def _grow_units(self, need: int, like: torch.Tensor) -> None:
        """Room for `need` units in scores/positions and the quantized part."""
        cap = 0 if self._s is None else self._s.shape[-1]
        if need <= cap:
            return
        new_cap = max(need, self.reserve, int(cap * 1.5) + 64)
        _, h, _, d = like.shape
        g = group_size(d)
        shapes = {"qk": d * self.bits // 8, "qv": d * self.bits // 8, "ks": d // g, "kz": d // g,
                  "vs": d // g, "vz": d // g}
        q = {name: torch.zeros((1, h, new_cap, w), device=like.device,
                               dtype=torch.uint8 if name.startswith("q") else SCALE_DTYPE)
             for name, w in shapes.items()}
        s = torch.zeros((h, new_cap), dtype=torch.float32, device=like.device)
        p = torch.zeros((h, new_cap), dtype=torch.long, device=like.device)
        if self._s is not None:
            for name in q:
                q[name][:, :, : self.nq] = self._q[name][:, :, : self.nq]
            s[:, : self.n] = self._s[:, : self.n]
            p[:, : self.n] = self._p[:, : self.n]
        self._q, self._s, self._p = q, s, p

    def _grow_tail(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        cap = 0 if self._tk is None else self._tk.shape[-2]
        if need <= cap:
            return
        new_cap = max(need, self.tail_reserve, int(cap * 1.5) + 64)
        tk = like_k.new_empty((1, like_k.shape[1], new_cap, like_k.shape[-1]))
        tv = like_v.new_empty((1, like_v.shape[1], new_cap, like_v.shape[-1]))
        if self.nt:
            tk[:, :, : self.nt] = self._tk[:, :, : self.nt]
            tv[:, :, : self.nt] = self._tv[:, :, : self.nt]
        self._tk, self._tv = tk, tv

    def _held(self, values: bool) -> torch.Tensor | None:
        """`keys`/`values` are the full-precision tail only: the dequantized whole is built per forward and not
        kept, so the cache holds packed data between forwards."""
        buf = self._tv if values else self._tk
        return None if buf is None else buf[:, :, : self.nt]

    def _quantize_tail(self) -> None:
        """Move every tail unit into the quantized part (slots nq .. n-1), each quantized once."""
        nt = self.nt
        if nt == 0:
            return
        d = self._tk.shape[-1]
        g = group_size(d)
        keys = self._tk[:, :, :nt]
        if self.inv_freq is not None:  # compact: store at RoPE position 0
            cos, sin = rope_table(torch.arange(self.nq, self.n, device=keys.device), self.inv_freq)
            keys = rotate(keys, cos, -sin)  # the inverse rotation
        for (qn, sn, zn), x in ((("qk", "ks", "kz"), keys), (("qv", "vs", "vz"), self._tv[:, :, :nt])):
            codes, scale, zero = quantize(x, self.bits, g)
            self._q[qn][:, :, self.nq : self.n] = codes
            self._q[sn][:, :, self.nq : self.n] = scale
            self._q[zn][:, :, self.nq : self.n] = zero
        self.nq = self.n

    def quantized(self) -> dict[str, torch.Tensor]:
        """The quantized part as QUANT_KEYS -> `[1, H, nq, ...]` views (codes, scales, zeros)."""
        return {name: t[:, :, : self.nq] for name, t in self._q.items()}

    @property
    def head_dim(self) -> int:
        return self._q["qk"].shape[-1] * 8 // self.bits

    def dequantized(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The quantized part as full-precision keys, values `[1, H, nq, d]` (keys at their slots in compact mode)."""
        from localchat.kernels.qattn import dequantized_keys_values

        dtype = dtype or self.dtype
        keys, values = dequantized_keys_values(self.quantized(), self.bits, group_size(self.head_dim), self.inv_freq,
                                               value_dtype=dtype)
        return keys.to(dtype), values

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.nt >= self.residual and self.nt > 0:  # no eviction came: bound the full-precision tail
            self._quantize_tail()
        t = key_states.shape[-2]
        self._grow_units(self.n + t, key_states)
        self._grow_tail(self.nt + t, key_states, value_states)
        self._tk[:, :, self.nt : self.nt + t] = key_states
        self._tv[:, :, self.nt : self.nt + t] = value_states
        end = self.n + t
        self._s[:, self.n : end] = 0.0
        pos = self.pending_positions
        self._p[:, self.n : end] = pos if pos is not None else torch.arange(self.n, end, device=self._p.device)
        self.n = end
        if self.nq == 0:
            return self.keys, self.values
        if self.defer and t == 1:  # the attention function reads the packed part itself: only the tail goes back
            from localchat.engine.qattention import defer

            defer(self)
            return self.keys, self.values
        return self.whole(key_states.dtype)

    def whole(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every unit at full precision `[1, H, n, d]` for one forward: a copy the size of the layer's cache at
        `dtype` (dequantized a block at a time), then freed; the planner counts it (memory.kv_copy_bytes)."""
        from localchat.kernels.qattn import dequantize_into

        h, d = self._tk.shape[1], self._tk.shape[-1]
        keys = self._tk.new_empty((1, h, self.n, d), dtype=dtype)
        values = self._tv.new_empty((1, h, self.n, d), dtype=dtype)
        dequantize_into(self.quantized(), self.bits, group_size(d), keys, values, self.inv_freq)
        keys[:, :, self.nq :], values[:, :, self.nq :] = self.keys, self.values
        return keys, values

    # --- eviction ------------------------------------------------------------------------------------------

    def keep(self, idx: torch.Tensor, inv_freq: torch.Tensor | None = None) -> None:
        """Keep units `idx` (`[H_kv, k]`, ascending per head): the tail is quantized, then packed rows, scales
        and zeros are gathered. In compact mode the stored keys are un-rotated, so no re-rotation is needed."""
        self.inv_freq = inv_freq
        self._quantize_tail()
        k = idx.shape[-1]
        for t in self._q.values():
            rows = torch.gather(t[:, :, : self.n], 2, idx[None, :, :, None].expand(-1, -1, -1, t.shape[-1]))
            t[:, :, :k] = rows
        self._s[:, :k] = torch.gather(self.scores, 1, idx)
        self._p[:, :k] = torch.gather(self.positions, 1, idx)
        self.n = self.nq = k

    def to_slots(self, inv_freq: torch.Tensor | None) -> None:
        """Compact positions from here on: the quantized keys are dequantized, turned back to RoPE position 0 and
        quantized again (once, at this change), the tail's keys move to their slots."""
        if inv_freq is None or self.n == 0:
            self.inv_freq = inv_freq
            return
        if self.nq:
            d = self.head_dim
            keys = dequantize(*(self._q[name][:, :, : self.nq] for name in ("qk", "ks", "kz")), self.bits, group_size(d))
            keys = shift_keys(keys.float(), -self.positions[:, : self.nq], inv_freq)
            codes, scale, zero = quantize(keys, self.bits, group_size(d))
            self._q["qk"][:, :, : self.nq], self._q["ks"][:, :, : self.nq], self._q["kz"][:, :, : self.nq] = codes, scale, zero
        if self.nt:
            tail = self._tk[:, :, : self.nt]
            slots = torch.arange(self.nq, self.n, device=tail.device)
            tail.copy_(shift_keys(tail, slots[None, :] - self.positions[:, self.nq :], inv_freq))
        self.inv_freq = inv_freq

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        self.n = max(0, self.n + tokens_to_remove)
        self.nq = min(self.nq, self.n)

    def reset(self) -> None:
        self._q = self._tk = self._tv = None
        self.nq = 0
        super().reset()

    # --- snapshots -----------------------------------------------------------------------------------------

    def tensors(self) -> dict[str, torch.Tensor]:
        """Quantized part (QUANT_KEYS, `[1, H, nq, ...]`), tail `tk`/`tv` `[1, H, nt, d]`, scores and positions."""
        if self._s is None:
            return {}
        out = {name: t[:, :, : self.nq] for name, t in self._q.items()}
        tk = self._tk[:, :, : self.nt] if self._tk is not None else None
        if tk is None:  # the tail was never allocated: an empty one of the right shape
            d = self.head_dim
            tk = torch.empty((1, self._q["qk"].shape[1], 0, d), device=self._s.device, dtype=self.dtype)
        out.update(tk=tk, tv=self._tv[:, :, : self.nt] if self._tv is not None else tk,
                   s=self.scores, p=self.positions)
        return out

    def fill_quantized(self, t: dict[str, torch.Tensor]) -> None:
        """Hold exactly the units of `tensors()` output (copied in)."""
        self.reset()
        tk, tv = t["tk"], t["tv"]
        self.lazy_initialization(tk, tv)
        nq, nt = t["qk"].shape[-2], tk.shape[-2]
        self._grow_units(nq + nt, tk)
        self._grow_tail(nt, tk, tv)
        for name in QUANT_KEYS:
            self._q[name][:, :, :nq] = t[name]
        self.nq, self.n = nq, nq + nt
        if nt:  # an empty tail allocates nothing (the next update does)
            self._tk[:, :, :nt], self._tv[:, :, :nt] = tk, tv
        self._s[:, : self.n], self._p[:, : self.n] = t["s"], t["p"]

    def hold(self, t: dict[str, torch.Tensor]) -> None:
        self.fill_quantized(t)

    def fill(self, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, p: torch.Tensor) -> None:
        """Hold full-precision units (a cache saved without --kv): they enter as the tail, then are quantized."""
        self.reset()
        self.lazy_initialization(k, v)
        n = k.shape[-2]
        self._grow_units(n, k)
        self._grow_tail(n, k, v)
        self._tk[:, :, :n], self._tv[:, :, :n] = k, v
        self._s[:, :n], self._p[:, :n] = s, p
        self.n = n
        self._quantize_tail()

    def nbytes(self) -> int:
        """Bytes of the units held: packed codes + scales + zeros of the quantized part, plus the tail."""
        if self._s is None:
            return 0
        quant = sum(t[:, :, :1].numel() * t.element_size() for t in self._q.values()) * self.nq
        tail = 0 if self._tk is None else self.nt * self._tk.shape[1] * self._tk.shape[-1] * (
            self._tk.element_size() + self._tv.element_size())
        return quant + tail


class QuantizedKVCache(KVCache):
    """KVCache whose governed layers are QuantizedKVLayer with `bits` (8, 4 or 2); a hybrid model's window and
    state layers stay as they are (bounded, small)."""

    def __init__(self, num_layers: int, bits: int, reserve: int = 0, positions: str = "original", inv_freq=None,
                 residual: int = RESIDUAL, tail: int = 0, kinds=None):
        self.bits, self.residual = bits, residual
        super().__init__(num_layers, reserve=reserve, positions=positions, inv_freq=inv_freq, kinds=kinds, tail=tail)
        for i in self.governed:
            self.layers[i].inv_freq = self.inv_freqs[i] if positions == "compact" else None

    def _global_layer(self, reserve: int) -> KVLayer:
        return QuantizedKVLayer(reserve, self.bits, self.residual, self.tail)

    def full_unit_bytes(self) -> int:
        """Bytes one unit would take across all layers unquantized (for the compression figure)."""
        total = 0
        for _, layer in self.governed_layers():
            if layer._q is not None:
                h, d = layer._q["qk"].shape[1], layer.head_dim
                total += 2 * h * d * torch.empty((), dtype=layer.dtype).element_size()
        return total

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Quantized `tensors()` output, or a full-precision cache's (quantized on the way in)."""
        plain = {k: v for k, v in tensors.items() if int(k.rsplit(".", 1)[1]) not in self.governed}
        if plain or self.hybrid:
            KVCache.load_tensors(self, plain)  # the window and state layers (the governed ones are refilled below)
        for i, layer in self.governed_layers():
            if f"qk.{i}" in tensors:
                layer.fill_quantized({name: tensors[f"{name}.{i}"] for name in (*QUANT_KEYS, "tk", "tv", "s", "p")})
            elif f"k.{i}" in tensors:
                layer.fill(*(tensors[f"{name}.{i}"] for name in "kvsp"))
            else:
                layer.reset()
            layer.inv_freq = self.inv_freqs[i] if self.positions == "compact" else None

    def settings(self) -> dict:
        return {**super().settings(), "residual": self.residual}

    def empty(self, reserve: int = 0) -> QuantizedKVCache:
        return QuantizedKVCache(len(self.layers), self.bits, reserve=reserve, **self.settings())

    def clone(self) -> QuantizedKVCache:
        copy = QuantizedKVCache(len(self.layers), self.bits, reserve=self.layers[self.governed[0]].reserve,
                                **self.settings())
        copy.load_tensors(self.tensors())
        return copy
