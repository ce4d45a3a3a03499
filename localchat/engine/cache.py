"""The engine's KV cache, on transformers' public Cache / cache-layer API.

Each layer keeps keys and values as `[1, H_kv, n, d]` views into a buffer with spare room, so adding a
chunk or a decoded token writes in place instead of re-copying the whole cache (DynamicLayer
concatenates, which costs O(n) per decoded token). Never stored at query-head granularity.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class KVLayer(DynamicLayer):
    """One layer: `keys`/`values` are `[1, H_kv, n, d]` views of `_k`/`_v` (`[1, H_kv, capacity, d]`)."""

    def __init__(self, reserve: int = 0):
        super().__init__()
        self.reserve = reserve  # expected final length; the first allocation takes it
        self.n = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None
        self.n = 0

    def _ensure(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        cap = 0 if self._k is None else self._k.shape[-2]
        if need <= cap:
            return
        new_cap = max(need, self.reserve, int(cap * 1.5) + 64)
        b, h, _, dk = like_k.shape
        k = like_k.new_empty((b, h, new_cap, dk))
        v = like_v.new_empty((b, h, new_cap, like_v.shape[-1]))
        if self.n:
            k[:, :, : self.n] = self._k[:, :, : self.n]
            v[:, :, : self.n] = self._v[:, :, : self.n]
        self._k, self._v = k, v

    def _publish(self) -> None:
        self.keys = self._k[:, :, : self.n]
        self.values = self._v[:, :, : self.n]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        self._ensure(self.n + t, key_states, value_states)
        self._k[:, :, self.n : self.n + t] = key_states
        self._v[:, :, self.n : self.n + t] = value_states
        self.n += t
        self._publish()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        self.n = max(0, self.n + tokens_to_remove)
        if self._k is not None:
            self._publish()

    def reset(self) -> None:
        self._k = self._v = None
        self.n = 0
        super().reset()

    def nbytes(self) -> int:
        """Bytes of the units held (not of the spare room)."""
        if self._k is None:
            return 0
        return self.n * self._k[0, :, 0].numel() * self._k.element_size() * 2


class KVCache(Cache):
    """A cache of `num_layers` KVLayer objects, all reserving room for `reserve` units up front."""

    def __init__(self, num_layers: int, reserve: int = 0):
        super().__init__(layers=[KVLayer(reserve) for _ in range(num_layers)])

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
