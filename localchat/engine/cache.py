"""The engine's evicting KV cache, on transformers' public Cache / cache-layer API.

Per layer: keys and values `[1, H_kv, n, d]`, a score per unit `[H_kv, n]` and the original position
of each unit `[H_kv, n]`. Every KV head keeps the same count while heads keep different tokens; an
eviction is one sorted gather per tensor. Never stored at query-head granularity.

Storage is a buffer with spare room, so a chunk or a decoded token is written in place instead of
re-copying the cache (transformers' DynamicLayer concatenates: O(n) per decoded token).

Positions: in `original` mode a key keeps the RoPE rotation of its true position. In `compact` mode
a key sits at the RoPE position of its slot; after an eviction each kept key is rotated by its slot
shift (equivalent to LOCRET's pre-RoPE cache re-rotated every forward, and cheaper).

Exact keys in half precision: rounding each re-rotated key to bf16/fp16 at every eviction would add one
rounding per eviction (in bf16, 22x the error of one rotation after 256 evictions at b=1024 and chunk 512,
i.e. 128K tokens). So from its first compact eviction a bf16/fp16 layer keeps an int8 remainder per key
element `[1, H, capacity, d]` (kernels/keyrest.py): key + remainder is the key to 1/256 of the dtype's
spacing; each eviction rotates that and rounds once. It costs head_dim bytes per unit and KV head (+25 % of
K+V: `REST_BYTES`, `rest_bytes`) and nothing between evictions. The alternatives: a second copy of the keys
as they arrived, rotated once per eviction (as exact, +50 % of K+V), or keys kept at their insertion slot
and rotated at every forward (no memory, but a pass over the whole cache per decoded token). fp32 keeps the
plain in-place rotation: its rounding does not add up measurably (2e-6 after 256 evictions).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from localchat.kernels.evict import gather_rotate, gather_rotate_rest
from localchat.kernels.keyrest import carries_rest

POSITION_MODES = ("compact", "original")
REST_BYTES = 1  # bytes of key remainder per key element, compact positions in bf16/fp16 (kernels/keyrest.py)


def rest_bytes(head_dim: int, dtype: torch.dtype, positions: str) -> int:
    """Bytes a retained unit holds beside its K and V, per layer and KV head: the int8 remainder of its key in
    compact positions at bf16/fp16 (`head_dim` bytes), else 0. For a planner: K+V is `2 * head_dim * dtype size`."""
    return head_dim * REST_BYTES if positions == "compact" and carries_rest(dtype) else 0


class KVLayer(DynamicLayer):
    """`keys`/`values` are `[1, H_kv, n, d]` views of `_k`/`_v` (`[1, H_kv, capacity, d]`)."""

    def __init__(self, reserve: int = 0):
        super().__init__()
        self.reserve = reserve  # expected peak length; the first allocation takes it
        self.n = 0
        self._k = self._v = None
        self._r: torch.Tensor | None = None  # [1, H, capacity, d] int8 key remainders (compact, bf16/fp16)
        self._s: torch.Tensor | None = None  # [H, capacity] float32 scores
        self._p: torch.Tensor | None = None  # [H, capacity] int64 original positions
        self.pending_positions: torch.Tensor | None = None  # [T] original positions of the next update

    # --- storage -------------------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype  # transformers >= 5.24 no longer records it
        self.n = 0

    def _ensure(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        cap = 0 if self._k is None else self._k.shape[-2]
        if need <= cap:
            return
        new_cap = max(need, self.reserve, int(cap * 1.5) + 64)
        b, h, _, dk = like_k.shape
        k = like_k.new_empty((b, h, new_cap, dk))
        v = like_v.new_empty((b, h, new_cap, like_v.shape[-1]))
        s = torch.zeros((h, new_cap), dtype=torch.float32, device=like_k.device)
        p = torch.zeros((h, new_cap), dtype=torch.long, device=like_k.device)
        r = None if self._r is None else torch.zeros(k.shape, dtype=torch.int8, device=k.device)
        if self.n:
            k[:, :, : self.n] = self._k[:, :, : self.n]
            v[:, :, : self.n] = self._v[:, :, : self.n]
            s[:, : self.n] = self._s[:, : self.n]
            p[:, : self.n] = self._p[:, : self.n]
            if r is not None:
                r[:, :, : self.n] = self._r[:, :, : self.n]
        self._k, self._v, self._s, self._p, self._r = k, v, s, p, r

    # `keys`/`values` (transformers' names) are views of the units held, made when read: a decoded token does
    # not pay for two views per layer. Before the buffers exist they are what transformers set.
    def _held(self, values: bool) -> torch.Tensor | None:
        """The keys (or values) held, a view of the buffer; None before it exists."""
        buf = self._v if values else self._k
        return None if buf is None else buf[:, :, : self.n]

    @property
    def keys(self):
        held = self._held(False)
        return self._keys if held is None else held

    @keys.setter
    def keys(self, value) -> None:
        self._keys = value

    @property
    def values(self):
        held = self._held(True)
        return self._values if held is None else held

    @values.setter
    def values(self, value) -> None:
        self._values = value

    @property
    def scores(self) -> torch.Tensor:
        """`[H_kv, n]` float32, writable in place."""
        return self._s[:, : self.n]

    @property
    def positions(self) -> torch.Tensor:
        """`[H_kv, n]` original token positions."""
        return self._p[:, : self.n]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        self._ensure(self.n + t, key_states, value_states)
        end = self.n + t
        self._k[:, :, self.n : end] = key_states
        self._v[:, :, self.n : end] = value_states
        if self._r is not None:  # keys come in exact
            self._r[:, :, self.n : end] = 0
        self._s[:, self.n : end] = 0.0
        pos = self.pending_positions
        self._p[:, self.n : end] = pos if pos is not None else torch.arange(self.n, end, device=self._p.device)
        self.n = end
        return self.keys, self.values

    def take_slot(self) -> int:
        """Room for one more unit at the returned slot, whose K, V, score and original position the caller writes
        (the CPU decode step's layer kernel, kernels/cpu_decode.cpp). Needs a started layer."""
        n = self.n
        self._ensure(n + 1, self._k, self._v)
        if self._r is not None:  # keys come in exact
            self._r[:, :, n] = 0
        self.n = n + 1
        return n

    def open_slot(self, position: int) -> int:
        """`take_slot` with the unit's score (0) and original position written; the caller writes K and V."""
        n = self.take_slot()
        self._s[:, n] = 0.0
        self._p[:, n] = position
        return n

    def get_seq_length(self) -> int:
        return self.n

    # --- eviction ------------------------------------------------------------------------------

    def keep(self, idx: torch.Tensor, inv_freq: torch.Tensor | None = None) -> None:
        """Keep units `idx` (`[H_kv, k]`, ascending per head). With `inv_freq`, move keys to their new slots
        (bf16/fp16 keys with their remainders, see the module doc)."""
        k = idx.shape[-1]
        rest = inv_freq is not None and carries_rest(self._k.dtype)
        if rest and self._r is None:  # the first move: every key held is still as it came, exact
            self._r = torch.zeros(self._k.shape, dtype=torch.int8, device=self._k.device)
        # On the CPU one head at a time: the kept copies and the rotation's fp32 temporaries stay one head's size
        # (the planner's eviction scratch, memory.evict_bytes); a GPU kernel does every head in one launch.
        heads = [slice(h, h + 1) for h in range(idx.shape[0])] if self._k.device.type == "cpu" else [slice(None)]
        n = self.n
        for h in heads:
            if rest:
                keys, values, kept_r = gather_rotate_rest(self._k[:, h, :n], self._v[:, h, :n], self._r[:, h, :n],
                                                          idx[h], inv_freq)
                self._r[:, h, :k] = kept_r
            else:
                keys, values = gather_rotate(self._k[:, h, :n], self._v[:, h, :n], idx[h], inv_freq)  # kernels/evict.py
            self._k[:, h, :k] = keys
            self._v[:, h, :k] = values
        self._s[:, :k] = torch.gather(self.scores, 1, idx)
        self._p[:, :k] = torch.gather(self.positions, 1, idx)
        self.n = k

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        self.n = max(0, self.n + tokens_to_remove)

    def reset(self) -> None:
        self._k = self._v = self._s = self._p = self._r = None
        self.n = 0
        super().reset()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The units held: keys, values `[1, H, n, d]`, scores and positions `[H, n]` (views), and the keys'
        remainders `kr` `[1, H, n, d]` int8 once a compact bf16/fp16 layer has moved them."""
        if self._k is None:
            return {}
        out = {"k": self.keys, "v": self.values, "s": self.scores, "p": self.positions}
        if self._r is not None:
            out["kr"] = self._r[:, :, : self.n]
        return out

    def fill(self, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, p: torch.Tensor,
             kr: torch.Tensor | None = None) -> None:
        """Hold exactly these units (copies), with room to grow as `reserve` asks. Without `kr` (a cache saved
        before keys carried remainders, or never moved) the keys are taken as exact."""
        self.reset()
        self.lazy_initialization(k, v)
        self._ensure(k.shape[-2], k, v)
        n = k.shape[-2]
        self._k[:, :, :n], self._v[:, :, :n] = k, v
        self._s[:, :n], self._p[:, :n] = s, p
        if kr is not None:
            self._r = torch.zeros(self._k.shape, dtype=torch.int8, device=self._k.device)
            self._r[:, :, :n] = kr
        self.n = n

    def hold(self, t: dict[str, torch.Tensor]) -> None:
        """Hold exactly the units of a `tensors()` output (copied in)."""
        self.fill(t["k"], t["v"], t["s"], t["p"], kr=t.get("kr"))

    def nbytes(self) -> int:
        """Bytes of the K/V units held (not the spare room, not the scores, not the key remainders)."""
        if self._k is None:
            return 0
        per_unit = self._k.shape[1] * (self._k.shape[-1] * self._k.element_size() + self._v.shape[-1] * self._v.element_size())
        return self.n * per_unit

    def rest_nbytes(self) -> int:
        """Bytes of the key remainders of the units held (0 without remainders)."""
        return 0 if self._r is None else self.n * self._r.shape[1] * self._r.shape[-1] * REST_BYTES


class KVCache(Cache):
    """`num_layers` KVLayer objects; `positions` is "compact" or "original" (see the module doc)."""

    def __init__(self, num_layers: int, reserve: int = 0, positions: str = "original", inv_freq=None):
        if positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {POSITION_MODES}")
        if positions == "compact" and inv_freq is None:
            raise ValueError("compact positions need the model's RoPE inv_freq")
        super().__init__(layers=[KVLayer(reserve) for _ in range(num_layers)])
        self.positions = positions
        self.inv_freq = inv_freq
        # What a policy keeps beside the cache, e.g. layers whose units live in host memory. It has `device`
        # (where the units are used), `owner` (the policy class that keeps it), `rollback()` (a forward failed:
        # drop what was copied in for it) and `restore(cache)` (another policy takes the cache: bring every
        # unit back as plain layers and end the extension).
        self.extension = None

    def set_pending_positions(self, positions: torch.Tensor) -> None:
        for layer in self.layers:
            layer.pending_positions = positions

    def next_position(self, true_position: int) -> int:
        """The RoPE position the next token gets: its slot (compact) or its true position (original)."""
        return self.get_seq_length() if self.positions == "compact" else true_position

    def keep(self, layer_idx: int, idx: torch.Tensor) -> None:
        self.layers[layer_idx].keep(idx, self.inv_freq if self.positions == "compact" else None)

    def nbytes(self) -> int:
        """Bytes the units hold: K/V and the key remainders (what the footer shows as KV memory)."""
        rest = sum(layer.rest_nbytes() for layer in self.layers if isinstance(layer, KVLayer))  # not offloaded ones
        return self.kv_nbytes() + rest

    def kv_nbytes(self) -> int:
        """Bytes of the K/V units alone (what a full-precision unit costs, for the compression figure)."""
        return sum(layer.nbytes() for layer in self.layers)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every layer's units as `{"k.0": ..., "v.0": ..., "s.0": ..., "p.0": ..., "k.1": ...}` (views), with
        `kr.i` where layer i keeps key remainders."""
        return {f"{name}.{i}": t for i, layer in enumerate(self.layers) for name, t in layer.tensors().items()}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Hold the units of `tensors()` output (copied in); layers missing from it stay empty."""
        if "qk.0" in tensors:
            raise KeyError("it holds a quantized cache (saved with --kv); load it with the same --kv")
        for i, layer in enumerate(self.layers):
            if f"k.{i}" in tensors:
                layer.fill(*(tensors[f"{name}.{i}"] for name in "kvsp"), kr=tensors.get(f"kr.{i}"))
            else:
                layer.reset()

    def empty(self, reserve: int = 0) -> "KVCache":
        """An empty cache of the same kind and positions, its layers' first allocation `reserve` units."""
        return KVCache(len(self.layers), reserve=reserve, positions=self.positions, inv_freq=self.inv_freq)

    def clone(self) -> "KVCache":
        """An independent copy (a snapshot; the cache is bounded, so this is cheap for evicting policies)."""
        copy = KVCache(len(self.layers), reserve=self.layers[0].reserve, positions=self.positions,
                       inv_freq=self.inv_freq)
        tensors = self.tensors()
        ext = self.extension  # some layers' units may live elsewhere (host memory)
        copy.load_tensors({k: v.to(ext.device) for k, v in tensors.items()} if ext is not None else tensors)
        return copy
