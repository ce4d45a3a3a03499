"""OmniKV (ICLR 2025 submission, "OmniKV: Dynamic Context Selection for Efficient Long-Context LLMs";
details from the authors' code marked [code]; docs/methods/omnikv.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from localchat.engine.attention import AttentionSwitch, sdpa
from localchat.engine.policies.base import Option, Policy
from localchat.errors import UserError

if TYPE_CHECKING:
    from localchat.engine.policies.omnikv.bank import Bank

OMNIKV_IMPL = "localchat_omnikv"
_ATTR = "_localchat_omnikv"
PAPER_FILTERS = (2, 8, 18)  # the paper's filter layers for Llama-3-8B (32 layers)
PAPER_DEPTH = 32


def filter_layers(depth: int) -> tuple[int, ...]:
    """The paper's Llama-3-8B schedule {2, 8, 18} of 32 layers scaled to `depth`: round(f·depth/32) (half up),
    clamped to [0, depth - 1], duplicates dropped. 30 layers (SmolLM2-135M): (2, 8, 17); 32: (2, 8, 18)."""
    return tuple(sorted({min(depth - 1, int(f * depth / PAPER_DEPTH + 0.5)) for f in PAPER_FILTERS}))


def layer_roles(depth: int, filters: tuple[int, ...]) -> list[str]:
    """"dense" (before the first filter, or right after a filter), "filter", or "sparse" per layer."""
    roles = []
    for i in range(depth):
        if i in filters:
            roles.append("filter")
        elif i < filters[0] or i - 1 in filters:
            roles.append("dense")
        else:
            roles.append("sparse")
    return roles


def bank_groups(roles: list[str]) -> dict[int, list[int]]:
    """Filter layer -> the sparse layers that attend to its selection (those up to the next filter): what
    `--offload` keeps in host memory and loads in one packed copy per filter layer."""
    groups: dict[int, list[int]] = {}
    current = None
    for i, role in enumerate(roles):
        if role == "filter":
            current = i
            groups[i] = []
        elif role == "sparse":
            groups[current].append(i)
    return groups


def select_tokens(query: torch.Tensor, key: torch.Tensor, prompt: int, k: int, scaling: float,
                  softmax: bool = True) -> torch.Tensor:
    """One index set `[min(k, prompt)]` (ascending slots) shared by every head of the following layers.

    `query` `[1, H_q, 1, d]` (the current token, post-RoPE), `key` `[1, H_kv, n, d]`; only the first `prompt`
    slots are candidates. Score of a slot = max over all query heads of softmax(q·k·scaling) over the prompt
    keys (the paper's eq. 3-4; `softmax=False`: the max of the raw scaled logits, the code's default).
    """
    h_q, h_kv, d = query.shape[1], key.shape[1], query.shape[-1]
    q = query[0, :, -1].float().reshape(h_kv, h_q // h_kv, d)
    logits = torch.einsum("hgd,hnd->hgn", q, key[0, :, :prompt].float()) * scaling  # [H_kv, G, prompt]
    if softmax:
        logits = logits.softmax(dim=-1)
    score = logits.amax(dim=(0, 1))  # [prompt]
    return score.topk(min(k, prompt)).indices.sort().values


BLOCK_BYTES = 16 * 2**20  # one block of query rows' fp32 logits while a filter layer scores a chunk


def uniform_select(query: torch.Tensor, key: torch.Tensor, earlier: int, k: int, scaling: float,
                   softmax: bool = True) -> torch.Tensor:
    """The prefill variant's selector (docs/methods/omnikv.md §2.8, the "uniform" window over the chunk): `[min(k, earlier)]` slots
    among the `earlier` slots cached before this chunk, ascending, shared by every head of the following layers.

    `query` `[1, H_q, T, d]` (the chunk, post-RoPE), `key` `[1, H_kv, n, d]` with n = earlier + T (the chunk last).
    Score of an earlier slot t = Σ over the chunk's rows j of max over all query heads of A[h, j, t], where A is
    each row's causal softmax over every key it sees (`softmax=False`: the scaled logits). Rows are taken in
    blocks so at most BLOCK_BYTES of fp32 logits exist at once.
    """
    h_q, t, d = query.shape[1], query.shape[2], query.shape[3]
    h_kv, n = key.shape[1], key.shape[2]
    keys = key[0].float()  # [H_kv, n, d]
    score = torch.zeros(earlier, dtype=torch.float32, device=key.device)
    rows = max(1, BLOCK_BYTES // (4 * h_q * n))
    for s in range(0, t, rows):
        e = min(t, s + rows)
        q = query[0, :, s:e].float().reshape(h_kv, h_q // h_kv, e - s, d)
        logits = torch.einsum("hgwd,hnd->hgwn", q, keys).mul_(scaling)  # [H_kv, G, w, n]
        if softmax:
            sees = earlier + torch.arange(s, e, device=key.device)[:, None]  # each row's own slot
            logits.masked_fill_(torch.arange(n, device=key.device)[None, :] > sees, float("-inf"))
            part = (logits[..., :earlier] - logits.logsumexp(dim=-1, keepdim=True)).exp_()
        else:
            part = logits[..., :earlier]
        score += part.amax(dim=(0, 1)).sum(dim=0)
    return score.topk(min(k, earlier)).indices.sort().values


@dataclass
class Selection:
    """What one model's layers share during a decode step."""

    roles: list[str]
    budget: int
    softmax: bool
    prompt: int | None = None  # slots that are candidates (the cache length at the end of prefill); None: prefill
    index: torch.Tensor | None = None  # [k] slots chosen by the latest filter layer
    bank: Bank | None = None  # --offload: the sparse layers' prompt K/V in host memory (bank.py)
    reading_keep: int = 0  # > 0 (--sparse-prefill): earlier tokens the sparse layers see per chunk while reading
    reading_index: torch.Tensor | None = None  # [reading_keep] slots the latest filter layer chose for this chunk


def omnikv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA; while decoding, sparse layers attend to the latest selection plus every token after the prompt,
    and filter layers choose the selection for the layers that follow."""
    sel: Selection | None = getattr(module, _ATTR, None)
    if sel is None or sel.prompt is None or query.shape[2] != 1:  # prefill: full attention
        if sel is not None and sel.bank is not None:  # copy the next offloaded layer in while this one runs
            sel.bank.prefetch_after(module.layer_idx, query.shape[2])
        if sel is not None and sel.reading_keep and query.shape[2] > 1:
            return _sparse_reading(module, sel, query, key, value, attention_mask, scaling, dropout, **kwargs)
        return sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    role = sel.roles[module.layer_idx]
    if role == "sparse" and sel.index is not None:
        offloaded = sel.bank is not None and module.layer_idx in sel.bank.layers  # then key, value: the answer only
        end = sel.prompt + key.shape[2] if offloaded else key.shape[2]
        idx = torch.cat([sel.index.to(key.device), torch.arange(sel.prompt, end, device=key.device)])
        if offloaded:  # the chosen prompt units were copied in from host memory
            chosen_k, chosen_v = sel.bank.selected(module.layer_idx)
            key, value = torch.cat([chosen_k, key], dim=2), torch.cat([chosen_v, value], dim=2)
        else:
            key, value = key[:, :, idx], value[:, :, idx]
        attention_mask = attention_mask[..., idx] if attention_mask is not None else None
    out = sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if role == "filter":
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        sel.index = select_tokens(query, key, sel.prompt, sel.budget, scale, sel.softmax)
        if sel.bank is not None:  # the chosen units of the layers this filter serves: gathered by the next layer
            sel.bank.choose(module.layer_idx, sel.index)
    elif sel.bank is not None:  # this layer's attention is queued: gather and send a filter's choice meanwhile
        sel.bank.fetch()
    return out


def _sparse_reading(module, sel: Selection, query, key, value, attention_mask, scaling, dropout, **kwargs):
    """A prefill chunk under --sparse-prefill (docs/methods/omnikv.md §2.8): filter layers choose `reading_keep` earlier tokens with
    the chunk as the query window; the sparse layers after them attend to those plus the chunk itself."""
    role, t, n = sel.roles[module.layer_idx], query.shape[2], key.shape[2]
    earlier = n - t
    if role == "sparse" and sel.reading_index is not None:
        idx = torch.cat([sel.reading_index.to(key.device), torch.arange(earlier, n, device=key.device)])
        key, value = key[:, :, idx], value[:, :, idx]
        if attention_mask is None:  # SDPA's own causal flag would align the chunk with the first keys: be explicit
            attention_mask = torch.ones((t, idx.numel()), dtype=torch.bool, device=key.device)
            attention_mask[:, -t:] = torch.ones((t, t), dtype=torch.bool, device=key.device).tril()
            attention_mask = attention_mask[None, None]
        else:
            attention_mask = attention_mask[..., idx]
    out = sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if role == "filter":
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        chosen = earlier > sel.reading_keep  # else the sparse layers see every earlier token anyway
        sel.reading_index = uniform_select(query, key, earlier, sel.reading_keep, scale, sel.softmax) if chosen else None
    return out


@dataclass
class OmniKV(Policy):
    """Keep the whole cache; at every decoded token, filter layers pick `budget` prompt tokens for the layers after them.

    Roles per layer (0-based): layers before the first filter, the filter layers and the layer right after
    each filter attend to the whole cache `[1, H_kv, n, d]`; every other ("sparse") layer attends only to
    the `budget` prompt slots chosen by the nearest filter layer before it, plus every token after the
    prompt (the answer so far, never subject to selection [code]). Selection: the current token's
    post-RoPE query at a filter layer, softmax over the prompt keys per query head, max over all query heads,
    top-`budget` (one set per layer for all heads; the "last" selector, |w| = 1). Prefill is full attention
    (chunked, nothing dropped); positions stay absolute. In a chat the prompt is everything cached when the
    answer starts. Defaults: budget 1024 (an absolute count, as in the paper's latency runs), filters None =
    `filter_layers(depth)` (the paper's {2, 8, 18} of 32 scaled to the depth), softmax True (the paper;
    False: the code's logit max), offload False (True, `--offload` on a GPU: the sparse layers' K/V stays in
    host memory, the paper's context bank, and each filter layer's choice is copied in; omnikv/bank.py).
    prefill_ratio 0 (reading is full attention; r > 0, `--sparse-prefill r`: the spec's optional prefill variant,
    §2.8: at each chunk the filter layers pick round(r · chunk) earlier tokens with the chunk as a uniform query
    window, and the sparse layers attend to those plus the chunk; the paper's trade-off is r = 2).
    Paper: OmniKV, ICLR 2025 submission (docs/methods/omnikv.md).
    """

    name = "omnikv"
    attention_function = True  # attention statistics through SDPA (attention_stats.py)
    summary = "OmniKV: keep everything; filter layers pick the tokens later layers attend to, every step"
    evicts = False
    selects = True
    hybrid = False  # its filter layers and host bank assume every layer holds every token
    options = {
        "offload": Option("--offload", bool, "OmniKV on a GPU: keep the sparse layers' K/V in host memory and copy "
                          "in what they attend to", cuda_only=True),
        "prefill_ratio": Option("--sparse-prefill", float, "OmniKV: while reading, filter layers pick R x chunk "
                                "earlier tokens for the later layers (the paper's R = 2; default off: full attention)"),
    }
    local: int = 0
    filters: tuple[int, ...] | None = None
    softmax: bool = True
    offload: bool = False
    prefill_ratio: float = 0.0

    def validate(self) -> None:
        super().validate()
        if self.prefill_ratio < 0:
            raise UserError(f"--sparse-prefill must be 0 (off) or more (the paper's r = 2), not {self.prefill_ratio:g}")

    def schedule(self, depth: int) -> tuple[int, ...]:
        if not self.filters:
            return filter_layers(depth)
        filters = tuple(sorted(set(self.filters)))
        if filters[0] < 0 or filters[-1] >= depth:
            raise UserError(f"omnikv filter layers {list(filters)} must lie in 0..{depth - 1}: the model has "
                            f"{depth} layers")
        return filters

    def attach(self, model, cache) -> None:
        super().attach(model, cache)
        depth = model.config.num_hidden_layers
        roles = layer_roles(depth, self.schedule(depth))
        from localchat.engine.policies.omnikv.bank import bank_cache, unbank_cache  # the cache layers: at first use

        bank = None
        if self.offload:
            bank = bank_cache(cache, bank_groups(roles), next(model.parameters()).device, owner=type(self))
        else:
            unbank_cache(cache)
        self.selection = Selection(roles, self.budget, self.softmax, bank=bank)
        self.switch = AttentionSwitch(model, OMNIKV_IMPL, _ATTR, self.selection, omnikv_attention)

    def prefill_start(self, cache, chunk: int) -> None:
        self.selection.reading_keep = round(self.prefill_ratio * chunk) if self.prefill_ratio else 0
        self.selection.reading_index = None

    def prefill_done(self, cache) -> None:
        self.selection.prompt = cache.get_seq_length()
        self.selection.index = None
        self.selection.reading_index = None
        if self.selection.bank is not None:
            self.selection.bank.answer()

    def score_bytes(self, layers: int, q_heads: int, kv_heads: int, chunk: int, n: int) -> int:
        """--sparse-prefill: a filter layer's block of fp32 logits and its probabilities over the earlier tokens."""
        return 2 * min(BLOCK_BYTES, 4 * q_heads * chunk * n) if self.prefill_ratio else 0

    def offloaded_layers(self, depth: int) -> int:
        if not self.offload:
            return 0
        return sum(len(m) for m in bank_groups(layer_roles(depth, self.schedule(depth))).values())

    def detach(self) -> None:
        self.switch.close()
        if self.selection.bank is not None:
            self.selection.bank.release()
