"""OmniKV's context bank (docs/methods/omnikv.md §2.3): the "sparse" layers' prompt K/V lives in host memory.

A `BankLayer` holds slots [0, banked) in host memory, token-major `[n, H_kv, d]` in fixed-size pages
(pinned when the model runs on CUDA), and the answer's tokens, slots [banked, n), on the device. Two modes:
  reading    (prefill) `update` stores the chunk in the bank and returns the whole layer on the device;
             the bank part was copied in while the layers before it ran (`Bank.prefetch_after`), so at
             most two banked layers are on the device at once
  answering  (decode) `update` appends the token to the device tail and returns the tail only; the layer
             attends to what its filter layer chose plus the tail. The filter layer hands over its choice
             (`Bank.choose`); the next layer, once its own attention is queued, gathers the chosen rows on
             the CPU and sends them in one packed copy (`Bank.fetch`), so the GPU keeps working meanwhile
Copies run on a side CUDA stream and the compute stream waits on an event before it reads them. On a CPU
the host memory is the device's memory: nothing moves (`.to` is a no-op) and the logic is the same.
Cost of reading (arithmetic, not measured): every chunk copies each offloaded layer's prefix in again, about
n²/(2·chunk) rows per layer; for 128K tokens at chunk 4096 on Llama-3.1-8B (24 offloaded layers, 4 KiB a
row) about 200 GB, some 8 s at 25 GB/s, which the prefetch overlaps with the layers' compute.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers.cache_utils import DynamicLayer

from localchat.engine.cache import KVLayer
from localchat.errors import UserError

HOST = torch.device("cpu")
PAGE_BYTES = 8 << 20  # a power of two: the pinned allocator rounds each allocation up to one


def _host_empty(shape: tuple, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    try:
        return torch.empty(shape, dtype=dtype, pin_memory=pin)
    except RuntimeError as exc:  # cudaHostAlloc failing is not an OutOfMemoryError
        raise UserError(f"host memory ran out for --offload's context bank ({exc.__class__.__name__}); use a "
                        f"shorter document or drop --offload") from exc


class Pages:
    """Token-major rows `[n, H, d]` in host pages of `rows` tokens each (no regrowth copies)."""

    def __init__(self, heads: int, d: int, dtype: torch.dtype, pin: bool):
        self.heads, self.d, self.dtype, self.pin = heads, d, dtype, pin
        row = heads * d * torch.empty((), dtype=dtype).element_size()
        self.rows = max(1, PAGE_BYTES // row)
        self.pages: list[torch.Tensor] = []

    def spans(self, start: int, end: int):
        """(page, first row in it, slot range start, slot range end) covering slots [start, end)."""
        at = start
        while at < end:
            p, lo = divmod(at, self.rows)
            stop = min(end, (p + 1) * self.rows)
            yield self.pages[p], lo, at, stop
            at = stop

    def write(self, start: int, rows: torch.Tensor, non_blocking: bool) -> None:
        """Rows `[t, H, d]` (contiguous, any device) into slots [start, start + t)."""
        end = start + rows.shape[0]
        while len(self.pages) * self.rows < end:
            self.pages.append(_host_empty((self.rows, self.heads, self.d), self.dtype, self.pin))
        for page, lo, a, b in self.spans(start, end):
            page[lo : lo + b - a].copy_(rows[a - start : b - start], non_blocking=non_blocking)

    def read_into(self, out: torch.Tensor, end: int, non_blocking: bool) -> None:
        """Slots [0, end) into `out[:end]` (`[>= end, H, d]`, any device)."""
        for page, lo, a, b in self.spans(0, end):
            out[a:b].copy_(page[lo : lo + b - a], non_blocking=non_blocking)

    def gather(self, idx: torch.Tensor, out: torch.Tensor) -> None:
        """Rows at the ascending slots `idx` (host) into `out` `[len(idx), H, d]` (host)."""
        bounds = torch.searchsorted(idx, torch.arange(1, len(self.pages) + 1) * self.rows).tolist()
        first = 0
        for p, last in enumerate(bounds):
            if last > first:
                torch.index_select(self.pages[p], 0, idx[first:last] - p * self.rows, out=out[first:last])
            first = last

    def whole(self, end: int) -> torch.Tensor:
        out = torch.empty((end, self.heads, self.d), dtype=self.dtype)
        self.read_into(out, end, non_blocking=False)
        return out


class BankLayer(DynamicLayer):
    """One offloaded layer: K and V `Pages` on the host (slots < banked), `tk`/`tv` `[1, H, cap, d]` on the
    device (slots banked .. banked + tail)."""

    def __init__(self, bank: Bank, layer_idx: int, reserve: int = 0):
        super().__init__()
        self.bank, self.layer_idx, self.reserve = bank, layer_idx, reserve
        self.hk: Pages | None = None
        self.hv: Pages | None = None
        self.tk = self.tv = None
        self.banked = self.tail = 0
        self.answering = False
        self.pending_positions = None  # set by the engine for every layer; nothing is evicted, slot = position

    def _to_host(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append `[1, H, t, d]` K/V to the bank (asynchronous on CUDA: pinned pages)."""
        if self.hk is None:
            if k.shape[-1] != v.shape[-1]:  # one packed copy carries both (every Llama-style model has dk == dv)
                raise UserError("--offload needs keys and values of the same head size; this model's differ")
            self.hk = Pages(k.shape[1], k.shape[-1], k.dtype, self.bank.cuda)
            self.hv = Pages(v.shape[1], v.shape[-1], v.dtype, self.bank.cuda)
        cuda = self.bank.cuda
        self.hk.write(self.banked, k[0].transpose(0, 1).contiguous(), non_blocking=cuda)
        self.hv.write(self.banked, v[0].transpose(0, 1).contiguous(), non_blocking=cuda)
        self.banked += k.shape[2]

    def _tail_room(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        cap = 0 if self.tk is None else self.tk.shape[2]
        if need <= cap:
            return
        new_cap = max(need, int(cap * 1.5) + 64)
        _, h, _, dk = like_k.shape
        k = like_k.new_empty((1, h, new_cap, dk))
        v = like_v.new_empty((1, h, new_cap, like_v.shape[-1]))
        if self.tail:
            k[:, :, : self.tail] = self.tk[:, :, : self.tail]
            v[:, :, : self.tail] = self.tv[:, :, : self.tail]
        self.tk, self.tv = k, v

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        if self.answering:
            if t != 1:
                raise RuntimeError("an offloaded layer reads one token at a time while answering")
            self._tail_room(self.tail + t, key_states, value_states)
            self.tk[:, :, self.tail : self.tail + t] = key_states
            self.tv[:, :, self.tail : self.tail + t] = value_states
            self.tail += t
            return self.tk[:, :, : self.tail], self.tv[:, :, : self.tail]
        if self.banked == 0:
            whole_k, whole_v = key_states, value_states
        else:
            whole_k, whole_v = self.bank.take(self, t)  # [1, H, banked + t, d], the bank part filled
            whole_k[:, :, self.banked :] = key_states
            whole_v[:, :, self.banked :] = value_states
        self._to_host(key_states, value_states)
        return whole_k, whole_v

    def load_whole(self, extra: int = 0):
        """Start copying the bank to the device, with `extra` slots left for the chunk: returns (k, v, event to
        wait on), `[1, H, banked + extra, d]` views of token-major buffers allocated on the compute stream
        and filled on the side one."""
        bank, n = self.bank, self.banked + extra
        k = torch.empty((n, self.hk.heads, self.hk.d), dtype=self.hk.dtype, device=bank.device)
        v = torch.empty((n, self.hv.heads, self.hv.d), dtype=self.hv.dtype, device=bank.device)
        with bank.side():
            self.hk.read_into(k, self.banked, non_blocking=bank.cuda)
            self.hv.read_into(v, self.banked, non_blocking=bank.cuda)
        bank.used_on_side(k, v)
        return k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0), bank.event()

    def fold(self) -> None:
        """Move the answer's tokens into the bank (before the next turn is read)."""
        if self.tail:
            self._to_host(self.tk[:, :, : self.tail], self.tv[:, :, : self.tail])
            self.tail = 0
        self.tk = self.tv = None
        self.answering = False

    def get_seq_length(self) -> int:
        return self.banked + self.tail

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        drop = -tokens_to_remove
        from_tail = min(drop, self.tail)
        self.tail -= from_tail
        self.banked = max(0, self.banked - (drop - from_tail))

    def reset(self) -> None:
        self.hk = self.hv = self.tk = self.tv = None
        self.banked = self.tail = 0
        self.answering = False
        super().reset()

    def keep(self, idx, inv_freq=None) -> None:
        raise RuntimeError("an offloaded layer keeps every unit; unbank the cache before evicting")

    # --- what the rest of the engine reads (sessions, saving, stats) ------------------------------

    @property
    def positions(self) -> torch.Tensor:
        """`[H_kv, n]` original positions: nothing is evicted (bank_cache checks), so slot i holds token i."""
        heads = self.hk.heads if self.hk is not None else 0
        return torch.arange(self.get_seq_length()).expand(heads, -1)

    @property
    def scores(self) -> torch.Tensor:
        return torch.zeros(self.positions.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every unit on the host, as KVLayer.tensors() gives them: keys, values `[1, H, n, d]`."""
        if self.hk is None:
            return {}
        if self.bank.cuda:
            torch.cuda.current_stream(self.bank.device).synchronize()
        k = self.hk.whole(self.banked).transpose(0, 1).unsqueeze(0)
        v = self.hv.whole(self.banked).transpose(0, 1).unsqueeze(0)
        if self.tail:
            k = torch.cat([k, self.tk[:, :, : self.tail].to(HOST)], dim=2)
            v = torch.cat([v, self.tv[:, :, : self.tail].to(HOST)], dim=2)
        return {"k": k.contiguous(), "v": v.contiguous(), "s": self.scores, "p": self.positions}

    def nbytes(self) -> int:
        if self.hk is None:
            return 0
        per_unit = self.hk.heads * (self.hk.d + self.hv.d) * torch.empty((), dtype=self.hk.dtype).element_size()
        return self.get_seq_length() * per_unit


class Bank:
    """The banked layers of one cache and the copies in flight. `groups`: filter layer -> the banked layers
    that attend to its selection."""

    def __init__(self, device: torch.device, groups: dict[int, list[int]]):
        self.device = device
        self.cuda = device.type == "cuda"  # host pages are pinned exactly then
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.groups = groups
        self.layers: dict[int, BankLayer] = {}
        self.ahead: dict[int, tuple] = {}  # prefill copies in flight: (banked, t, (k, v, event))
        self.pending: tuple | None = None  # a filter's choice not gathered yet: (members, host index, event)
        self.loaded: dict[int, tuple[torch.Tensor, torch.Tensor, object]] = {}  # this step's selections
        self.owner: type | None = None  # the policy class that keeps the cache banked

    def event(self, stream=None):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream or self.stream)
        return event

    def wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def used_on_side(self, *tensors: torch.Tensor) -> None:
        """Tensors allocated on the compute stream and written on the side one: their memory is not reused
        before the side stream's work on them is done (a prefetch dropped unread, for instance)."""
        if self.cuda:
            for t in tensors:
                t.record_stream(self.stream)

    def side(self):
        """A context that runs copies on the side stream after what the compute stream queued so far."""
        if not self.cuda:
            return nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    # --- reading ---------------------------------------------------------------------------------

    def prefetch_after(self, layer_idx: int, t: int) -> None:
        """Start copying the next banked layer after `layer_idx` to the device (room for a chunk of `t`)."""
        nxt = next((j for j in sorted(self.layers) if j > layer_idx), None)
        if nxt is None or nxt in self.ahead or self.layers[nxt].banked == 0 or self.layers[nxt].answering:
            return
        self.ahead[nxt] = (self.layers[nxt].banked, t, self.layers[nxt].load_whole(t))

    def take(self, layer: BankLayer, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's bank on the device with room for `t` more (prefetched, or copied now)."""
        got = self.ahead.pop(layer.layer_idx, None)
        k, v, event = got[2] if got is not None and got[:2] == (layer.banked, t) else layer.load_whole(t)
        self.wait(event)
        return k, v

    def answer(self) -> None:
        """The prompt is read: later updates go to the device tails."""
        self.ahead.clear()
        if self.cuda:  # the CPU gathers from the pages while answering: the chunks' copies must have landed
            torch.cuda.current_stream(self.device).synchronize()
        for layer in self.layers.values():
            layer.answering = True

    # --- answering ---------------------------------------------------------------------------------

    def choose(self, filter_idx: int, index: torch.Tensor) -> None:
        """A filter layer's choice (ascending slots on the device): start copying it to the host."""
        members = [j for j in self.groups.get(filter_idx, []) if j in self.layers]
        if not members:
            return
        self.fetch()  # an earlier filter's choice not gathered yet
        idx = _host_empty(tuple(index.shape), index.dtype, self.cuda)
        idx.copy_(index, non_blocking=self.cuda)
        self.pending = (members, idx, self.event(torch.cuda.current_stream(self.device) if self.cuda else None))

    def fetch(self) -> None:
        """Gather the pending choice's rows of every banked layer it serves, then one packed copy to the device."""
        if self.pending is None:
            return
        members, idx, ready = self.pending
        self.pending = None
        if ready is not None:
            ready.synchronize()  # the index has reached the host
        first = self.layers[members[0]].hk
        packed = _host_empty((len(members), 2, len(idx), first.heads, first.d), first.dtype, self.cuda)
        for g, j in enumerate(members):
            layer = self.layers[j]
            layer.hk.gather(idx, packed[g, 0])
            layer.hv.gather(idx, packed[g, 1])
        on_device = torch.empty(packed.shape, dtype=packed.dtype, device=self.device)
        with self.side():
            on_device.copy_(packed, non_blocking=self.cuda)
        self.used_on_side(on_device)
        event = self.event()
        for g, j in enumerate(members):
            self.loaded[j] = (on_device[g, 0], on_device[g, 1], event)

    def selected(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's chosen K/V of a banked layer, `[1, H, k, d]`."""
        self.fetch()
        k, v, event = self.loaded[layer_idx]
        self.wait(event)
        return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)

    def release(self) -> None:
        self.ahead.clear()
        self.loaded.clear()
        self.pending = None

    # --- the cache-extension protocol (engine/cache.py: KVCache.extension) ---

    def rollback(self) -> None:
        """A forward failed: drop what was copied in for it."""
        self.release()

    def restore(self, cache) -> None:
        """Another policy takes the cache: every offloaded layer comes back to the device."""
        unbank_cache(cache)


def bank_cache(cache, groups: dict[int, list[int]], device: torch.device, owner: type | None = None) -> Bank:
    """Make the layers of `groups` (filter layer -> the layers it serves) BankLayers of `cache`, moving what
    they hold to the host; fold earlier answers into the bank and bring every other offloaded layer back.
    Returns the cache's Bank (its `extension`; `owner`: the policy class that keeps it)."""
    banked = {j for members in groups.values() for j in members}
    bank = cache.extension if isinstance(cache.extension, Bank) else None
    if bank is None or bank.device != device:
        unbank_cache(cache)
        bank = cache.extension = Bank(device, groups)
    bank.owner = owner
    bank.groups = groups
    for i, layer in enumerate(cache.layers):
        if i in banked and not isinstance(layer, BankLayer):
            if type(layer) is not KVLayer:
                raise UserError("--offload needs an unquantized KV cache; drop --kv")
            n = layer.get_seq_length()
            if n and not torch.equal(layer.positions, torch.arange(n, device=layer.positions.device).expand_as(layer.positions)):
                raise UserError("--offload needs a cache that kept every token, and this one was evicted by "
                                "another policy; start a new chat")
            moved = BankLayer(bank, i, layer.reserve)
            if n:
                moved.lazy_initialization(layer.keys, layer.values)
                moved._to_host(layer.keys, layer.values)
            cache.layers[i] = moved
            bank.layers[i] = moved
        elif i not in banked and isinstance(layer, BankLayer):
            cache.layers[i] = _unbanked(layer)
            bank.layers.pop(i, None)
    for layer in bank.layers.values():
        layer.fold()
    return bank


def unbank_cache(cache) -> None:
    """Bring every offloaded layer of `cache` back to the device as a plain KVLayer."""
    if not isinstance(cache.extension, Bank):
        return
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, BankLayer):
            cache.layers[i] = _unbanked(layer)
    cache.extension = None


def _unbanked(layer: BankLayer) -> KVLayer:
    plain = KVLayer(layer.reserve)
    if layer.get_seq_length():
        t = layer.tensors()
        device = layer.bank.device
        plain.fill(t["k"].to(device), t["v"].to(device), t["s"].to(device), t["p"].to(device))
    return plain
