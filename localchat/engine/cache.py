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

Hybrid models (engine/layer_kinds.py): only the `global` layers grow with the document; the policy scores and
evicts those (`governed`). A `window` layer (sliding-window attention) is a WindowLayer that keeps its newest
window - 1 units; a `state` layer (linear attention) is transformers' LinearAttentionLayer with its fixed
recurrent and convolution state. In compact mode an eviction moves the next position back by the units it
dropped, so every window layer's keys are rotated back by as many positions (their distances stay exact).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer

from localchat.engine.layer_kinds import GLOBAL, STATE, WINDOW, LayerKind
from localchat.kernels.evict import gather_rotate, gather_rotate_rest
from localchat.kernels.keyrest import carries_rest
from localchat.kernels.rope import shift_keys

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

    def to_slots(self, inv_freq: torch.Tensor | None) -> None:
        """Move every key from its original position to its slot (a conversation going on at compact positions).
        A bf16/fp16 key is rounded once here; its remainder starts at the next eviction."""
        if inv_freq is None or self.n == 0:
            return
        keys = self._k[:, :, : self.n]
        slots = torch.arange(self.n, device=keys.device)
        keys.copy_(shift_keys(keys, slots[None, :] - self.positions, inv_freq))
        self._r = None

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


class WindowLayer(KVLayer):
    """A sliding-window attention layer: the newest `window - 1` units, never evicted by a policy. It may hold up
    to `slack` more between trims (`trim`, after each forward): the model's sliding mask hides what lies beyond
    the window, and decoding does not move the window at every token."""

    is_sliding = True
    slack = 64

    def __init__(self, window: int, reserve: int = 0):
        super().__init__(reserve)
        self.window = window

    def trim(self) -> None:
        """Keep the newest `window - 1` units once more than `slack` beyond them are held."""
        keep = self.window - 1
        if self.n <= keep + self.slack:
            return
        drop, n = self.n - keep, self.n
        for t in (self._k, self._v):
            t[:, :, :keep] = t[:, :, drop:n].clone()
        self._s[:, :keep] = self._s[:, drop:n].clone()
        self._p[:, :keep] = self._p[:, drop:n].clone()
        if self._r is not None:
            self._r[:, :, :keep] = self._r[:, :, drop:n].clone()
        self.n = keep

    def shift(self, delta: int, inv_freq: torch.Tensor | None) -> None:
        """Rotate every key held by `delta` RoPE positions (compact positions after an eviction; no RoPE: none)."""
        if inv_freq is None or delta == 0 or self._k is None or self.n == 0:
            return
        keys = self._k[:, :, : self.n]
        rows = torch.full(keys.shape[1:3], delta, device=keys.device)
        keys.copy_(shift_keys(keys, rows, inv_freq))


class KVCache(Cache):
    """One layer per decoder layer: KVLayer for the layers that grow with the document (the policy's), WindowLayer
    and LinearAttentionLayer for a hybrid model's others (`kinds`, engine/layer_kinds.py). `positions` is
    "compact" or "original" (see the module doc); `inv_freq`: the RoPE frequencies, one tensor for every layer
    or one entry per layer (None: a layer without RoPE)."""

    def __init__(self, num_layers: int, reserve: int = 0, positions: str = "original", inv_freq=None,
                 kinds: list[LayerKind] | None = None, tail: int = 0):
        if positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {POSITION_MODES}")
        kinds = list(kinds) if kinds is not None else [LayerKind(GLOBAL)] * num_layers
        if len(kinds) != num_layers:
            raise ValueError(f"{len(kinds)} layer kinds for {num_layers} layers")
        self.kinds, self.tail = kinds, tail
        self.governed = [i for i, k in enumerate(kinds) if k.grows]
        super().__init__(layers=[self._layer(k, reserve) for k in kinds])
        self._take_positions(positions, inv_freq)
        if positions == "compact" and all(f is None for f in self.inv_freqs):
            raise ValueError("compact positions need the model's RoPE inv_freq")
        # What a policy keeps beside the cache, e.g. layers whose units live in host memory. It has `device`
        # (where the units are used), `owner` (the policy class that keeps it), `rollback()` (a forward failed:
        # drop what was copied in for it) and `restore(cache)` (another policy takes the cache: bring every
        # unit back as plain layers and end the extension).
        self.extension = None

    def empty_now(self) -> bool:
        """True while no layer holds anything (no unit, no state)."""
        return all(layer.get_seq_length() == 0 for layer in self.layers if isinstance(layer, DynamicLayer)) \
            and not _states(self) and self.extension is None

    def start_at(self, positions: str, inv_freq) -> None:
        """An empty cache takes other positions (and their RoPE frequencies, one per layer or one for all)."""
        if not self.empty_now():
            raise ValueError("only an empty cache changes its positions")
        freqs = self._take_positions(positions, inv_freq)
        for i in self.governed:  # a quantized layer stores compact keys un-rotated (engine/qcache.py)
            if hasattr(self.layers[i], "inv_freq"):
                self.layers[i].inv_freq = freqs[i] if positions == "compact" else None

    def _take_positions(self, positions: str, inv_freq) -> list[torch.Tensor | None]:
        """Set the positions and the RoPE frequencies (one per layer, or one for all); returns them per layer."""
        freqs = list(inv_freq) if isinstance(inv_freq, (list, tuple)) else [inv_freq] * len(self.layers)
        self.positions, self.inv_freqs = positions, freqs
        self.inv_freq = next((freqs[i] for i in self.governed if freqs[i] is not None), None)
        return freqs

    def _layer(self, kind: LayerKind, reserve: int):
        if kind.kind == WINDOW:
            return WindowLayer(kind.window, min(reserve, kind.window - 1 + max(self.tail, WindowLayer.slack)))
        if kind.kind == STATE:
            return LinearAttentionLayer()
        return self._global_layer(reserve)

    def _global_layer(self, reserve: int) -> KVLayer:
        return KVLayer(reserve)

    @property
    def hybrid(self) -> bool:
        """True when some layer does not grow with the document (a window or a state)."""
        return len(self.governed) < len(self.layers)

    def governed_layers(self) -> list[tuple[int, KVLayer]]:
        """(index, layer) of the layers a policy scores and evicts: those whose cache grows with the document."""
        return [(i, self.layers[i]) for i in self.governed]

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        """Units a layer holds; without `layer_idx`, what the governed layers hold (the budget's count)."""
        if layer_idx is None:
            layer_idx = self.governed[0] if self.governed else 0
        layer = self.layers[layer_idx]
        return layer.get_seq_length() if isinstance(layer, DynamicLayer) else 0

    def set_pending_positions(self, positions: torch.Tensor) -> None:
        for layer in self.layers:
            layer.pending_positions = positions

    def next_position(self, true_position: int) -> int:
        """The RoPE position the next token gets: its slot (compact) or its true position (original)."""
        return self.get_seq_length() if self.positions == "compact" else true_position

    def keep(self, layer_idx: int, idx: torch.Tensor) -> None:
        self.layers[layer_idx].keep(idx, self.inv_freqs[layer_idx] if self.positions == "compact" else None)

    def keep_units(self, keeps: list[torch.Tensor]) -> None:
        """Keep units `keeps[j]` (`[H_kv, k]`, ascending per head) of the j-th governed layer; in compact mode the
        window layers' keys move back by the units dropped."""
        before = self.get_seq_length()
        for i, idx in zip(self.governed, keeps):
            self.keep(i, idx)
        if self.positions == "compact":
            delta = self.get_seq_length() - before
            for i, layer in enumerate(self.layers):
                if isinstance(layer, WindowLayer):
                    layer.shift(delta, self.inv_freqs[i])

    @torch.inference_mode()
    def to_compact(self, inv_freq, next_position: int) -> None:
        """A conversation read so far at original positions goes on at compact ones (it grew past the model's
        window): each governed key moves from its true position to its slot, and each window layer's keys move
        as far as the next token's position does (`next_position`, its true one, becomes the units held)."""
        if self.positions == "compact":
            return
        if self.extension is not None:
            raise ValueError("a cache with units kept elsewhere cannot change its positions")
        delta = self.get_seq_length() - next_position
        freqs = self._take_positions("compact", inv_freq)
        for i, layer in enumerate(self.layers):
            if i in self.governed:
                layer.to_slots(freqs[i])
            elif isinstance(layer, WindowLayer):
                layer.shift(delta, freqs[i])

    def settle(self) -> None:
        """After a forward: the window layers drop what lies beyond their windows."""
        for layer in self.layers:
            if isinstance(layer, WindowLayer):
                layer.trim()

    def nbytes(self) -> int:
        """Bytes the units hold: K/V, the key remainders and the linear layers' states (the footer's KV memory)."""
        rest = sum(layer.rest_nbytes() for layer in self.layers if isinstance(layer, KVLayer))  # not offloaded ones
        return self.kv_nbytes() + rest + sum(t.numel() * t.element_size() for t in _states(self).values())

    def kv_nbytes(self) -> int:
        """Bytes of the K/V units alone (what a full-precision unit costs, for the compression figure)."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, DynamicLayer))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every layer's units as `{"k.0": ..., "v.0": ..., "s.0": ..., "p.0": ..., "k.1": ...}` (views), with
        `kr.i` where layer i keeps key remainders, and a linear layer's states as `conv.i` and `rec.i`."""
        units = {f"{name}.{i}": t for i, layer in enumerate(self.layers) if isinstance(layer, DynamicLayer)
                 for name, t in layer.tensors().items()}
        return {**units, **_states(self)}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Hold the units of `tensors()` output (copied in); layers missing from it stay empty."""
        if "qk.0" in tensors:
            raise KeyError("it holds a quantized cache (saved with --kv); load it with the same --kv")
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, DynamicLayer):
                _load_state(layer, tensors.get(f"conv.{i}"), tensors.get(f"rec.{i}"))
            elif f"k.{i}" in tensors:
                layer.fill(*(tensors[f"{name}.{i}"] for name in "kvsp"), kr=tensors.get(f"kr.{i}"))
            else:
                layer.reset()

    def settings(self) -> dict:
        """What `empty` and `clone` pass on: positions, frequencies, layer kinds, tail."""
        return {"positions": self.positions, "inv_freq": self.inv_freqs, "kinds": self.kinds, "tail": self.tail}

    def empty(self, reserve: int = 0) -> KVCache:
        """An empty cache of the same kind and positions, its layers' first allocation `reserve` units."""
        return KVCache(len(self.layers), reserve=reserve, **self.settings())

    def clone(self) -> KVCache:
        """An independent copy (a snapshot; the cache is bounded, so this is cheap for evicting policies)."""
        copy = KVCache(len(self.layers), reserve=self.layers[self.governed[0] if self.governed else 0].reserve,
                       **self.settings())
        tensors = self.tensors()
        ext = self.extension  # some layers' units may live elsewhere (host memory)
        copy.load_tensors({k: v.to(ext.device) for k, v in tensors.items()} if ext is not None else tensors)
        return copy


def _states(cache: KVCache) -> dict[str, torch.Tensor]:
    """The linear-attention layers' states: `conv.i` and `rec.i` (those that exist)."""
    out = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionLayer):
            for name, held in (("conv", layer.conv_states), ("rec", layer.recurrent_states)):
                if held.get(0) is not None:
                    out[f"{name}.{i}"] = held[0]
    return out


def _load_state(layer: LinearAttentionLayer, conv: torch.Tensor | None, rec: torch.Tensor | None) -> None:
    """A linear-attention layer holding copies of `conv` and `rec` (an empty one when both are None)."""
    layer.__init__()
    if conv is not None or rec is not None:
        layer.lazy_initialization(conv_states=conv, recurrent_states=rec)
        if conv is not None:
            layer.conv_states[0].copy_(conv)
        if rec is not None:
            layer.recurrent_states[0].copy_(rec)
        layer.has_previous_state[0] = True
