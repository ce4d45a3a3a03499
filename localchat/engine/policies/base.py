"""The Policy interface: a policy scores cache units; the engine selects what stays.

A policy file supplies:
  score(layer, i)                 the ranking of the units a layer holds `[H_kv, n]` (default: the stored
                                  `layer.scores`); higher stays
  protected_first()               how many of the first original positions are never evicted (sinks)
  protected_recent(last_chunk)    how many of the newest slots are never evicted (stabilizers, windows)
  observe(cache, n_new, ids)      after every forward: give the n_new newest units their scores
                                  (`layer.scores[:, -n_new:]`) and/or update older units' scores
  attach(model, cache) / detach() around one generation (hooks, attention statistics)
and declares what it is: `evicts` (a bounded cache), `selects` (keeps every unit but attends to a
budget-sized selection), when it evicts (`evict_per_chunk`, `evict_each_step`), its `default_positions`,
and `options`: its own settings as the command line and profiles name them (`Option`).

The base class owns the rest: the budget, the local tail, decode-time eviction and the selection itself
(`priority` = the score with the protected units raised to +inf; the engine keeps the top-`keep_size`
per KV head, in temporal order, after each prefill chunk of the head). Eviction never touches the local
tail (`local` tokens). During decoding it runs only when `decode_window` > 0: each time the cache reaches
budget + 2·decode_window, it keeps the newest `decode_window` units plus the top-`budget` of the rest.

Optional hooks (defaults keep the behaviour above; used by the seed methods other than LOCRET):
  evict_per_chunk = False         prefill keeps every unit; one eviction runs after the whole prompt,
                                  right after prefill_done (SAGE-KV: its peak prefill memory is the cache)
  evict_each_step = True          evict after every decoded token whenever the cache holds more than
                                  keep_size (SAGE-KV's rolling window, CORM's per-step rule)
  keep_size(cache)                units per KV head an eviction keeps; default `budget` (CORM: fewer when
                                  fewer keys are important, capped by the budget)
  prefill_start(cache, chunk)     before a prompt's first chunk, with the chunk size in force
  prefill_done(cache)             once the whole prompt is in the cache, before the first decoded token
  notice()                        a line for the user after prefill (e.g. "the cap bound"), or None
  focus_units()                   > 0: answer from that many kept units per KV head that the question points
                                  at (engine/focus.py; LOCRET's --focus)
Policies with per-unit state beyond `scores` follow the cache's gathers by original position (`follow`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

from localchat.errors import UserError

if TYPE_CHECKING:
    import torch

# torch is imported where a tensor is made, so the planner and the command line read policies without it.
# "+inf" that survives arithmetic (as LOCRET's code does): torch.finfo(torch.float32).max
PROTECT = 3.4028234663852886e38


@dataclass(frozen=True)
class Option:
    """A policy's own setting as users name it: `--flag` on the command line, `key` in a profile."""

    flag: str
    type: type
    help: str
    cuda_only: bool = False  # only meaningful on a CUDA device (refused on a CPU)
    signed: bool = False  # a number that may be negative (KVzap's log-scale --threshold)

    @property
    def key(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclass
class Policy:
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    evicts: ClassVar[bool] = True
    evict_per_chunk: ClassVar[bool] = True
    evict_each_step: ClassVar[bool] = False
    selects: ClassVar[bool] = False
    default_positions: ClassVar[str] = "compact"
    hybrid: ClassVar[bool] = True  # serves models whose layers are of several kinds (engine/layer_kinds.py)
    attention_function: ClassVar[bool] = False  # replaces the model's attention function (SDPA + statistics)
    options: ClassVar[dict[str, Option]] = {}  # dataclass field -> how users set it
    budget: int = 1024  # b: units kept per KV head per layer after each chunk
    local: int = 96  # n_loc: last prompt tokens prefilled after the loop, never evicted
    decode_window: int = 0  # > 0: evict during decoding, keeping budget + this many recent units

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise UserError naming the first bad setting (a policy adds its own rules)."""
        if self.uses_budget() and (isinstance(self.budget, bool) or self.budget < 1):
            raise UserError(f"--budget must be at least 1 (got {self.budget})")
        for flag in ("local", "decode_window"):
            if getattr(self, flag) < 0:
                raise UserError(f"--{flag.replace('_', '-')} must be >= 0 (got {getattr(self, flag)})")

    @classmethod
    def positions_default(cls) -> str:
        """The positions a policy runs at unless told: its `default_positions` when it evicts, else original."""
        return cls.default_positions if cls.evicts else "original"

    @classmethod
    def settle(cls, values: dict[str, Any], given: set[str]) -> dict[str, Any]:
        """Adjust `values` (field -> value) that the user did not give (`given`) so they agree with the ones
        the user did; e.g. LOCRET's card stabilizers under a small --budget. Default: unchanged."""
        return values

    # --- what a policy supplies -----------------------------------------------------------------

    def attach(self, model, cache) -> None:
        self.model = model

    def observe(self, cache, n_new: int, ids: torch.Tensor) -> None:
        """Score the newest `n_new` units of every layer (`ids`: their token ids `[1, n_new]`)."""

    def score(self, layer, layer_idx: int) -> torch.Tensor:
        """The ranking of the units of `layer` `[H_kv, n]` (higher stays); never changed by the caller."""
        return layer.scores

    def protected_first(self) -> int:
        """Units at the first original positions that are never evicted (attention sinks)."""
        return 0

    def protected_recent(self, last_chunk: bool) -> int:
        """The newest slots that are never evicted at this eviction (`last_chunk`: the prompt's head just ended)."""
        return 0

    def keep_size(self, cache) -> int:
        return self.budget

    def prefill_start(self, cache, chunk: int) -> None:
        pass

    def prefill_done(self, cache) -> None:
        pass

    def notice(self) -> str | None:
        return None

    def focus_units(self) -> int:
        """> 0: the answer reads this many kept units per KV head, those the question attends to most
        (engine/focus.py); 0: every kept unit."""
        return 0

    def qkv_sink(self):
        """`(layer_idx, qkv)` -> None taking a decoded token's pre-RoPE q/k/v `[1, (H_q + 2 H_kv) d]` in place of
        this policy's hooks on the q/k/v projections (the C++ layer step of engine/decode_step.py calls no projection
        module, so their hooks would not fire), or None: no such hooks."""
        return None

    def unit_heads(self):
        """The modules that score a decoded unit from its pre-RoPE q/k/v inside a captured decode step
        (engine/graph_step.py; LOCRET's retaining heads, `heads.head(i)`), or None: units decoded get no score."""
        return None

    def detach(self) -> None:
        pass

    # --- the selection (the engine's, not overridden) -----------------------------------------------

    def priority(self, layer, layer_idx: int, last_chunk: bool) -> torch.Tensor:
        """The score with the protected units raised to PROTECT: what the eviction ranks."""
        prio = self.score(layer, layer_idx).clone()  # protection goes on a copy: the stored scores stay
        protect_first(prio, layer.positions, self.protected_first())
        return protect_recent(prio, self.protected_recent(last_chunk))

    @classmethod
    def uses_budget(cls) -> bool:
        """True when --budget means something: the policy evicts, or selects a budget-sized subset."""
        return cls.evicts or cls.selects

    @classmethod
    def bounded(cls) -> bool:
        """True when the budget bounds the cache while reading (evicting after every chunk); False for the
        policies that keep the whole prompt (full, OmniKV; SAGE-KV until the prompt ends)."""
        return cls.evicts and cls.evict_per_chunk

    @classmethod
    def fields(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    # --- the memory it needs (read by the planner and the engine's memory check) ----------------------

    def score_bytes(self, layers: int, q_heads: int, kv_heads: int, chunk: int, n: int) -> int:
        """Bytes that scoring a chunk of `chunk` queries against `n` cached units adds to the peak, beyond
        SDPA's (the planner's "policy scores" row): attention rows materialised in fp32, kept messages."""
        return 0

    def offloaded_layers(self, depth: int) -> int:
        """Layers whose K/V the policy keeps in host memory instead of the device's; reading streams up to two
        of them through the device at a time."""
        return 0


def protect_recent(prio: torch.Tensor, count: int) -> torch.Tensor:
    """Protect the `count` most recent slots of `prio` `[H, n]` (in place; returns it)."""
    if count > 0:
        prio[:, -count:] = PROTECT
    return prio


def protect_first(prio: torch.Tensor, positions: torch.Tensor, count: int) -> torch.Tensor:
    """Protect the units whose original position is among the first `count` tokens."""
    if count > 0:
        prio[positions < count] = PROTECT
    return prio


def follow(then: torch.Tensor, now: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each unit held now sat before: `then` `[H, m]` and `now` `[H, n]` are original positions,
    ascending per head. Returns (slot in `then` `[H, n]`, found `[H, n]` bool)."""
    import torch

    h, n = now.shape
    if then.shape[-1] == 0:
        return torch.zeros((h, n), dtype=torch.long, device=now.device), torch.zeros((h, n), dtype=torch.bool, device=now.device)
    idx = torch.searchsorted(then.contiguous(), now.contiguous()).clamp_(max=then.shape[-1] - 1)
    return idx, then.gather(1, idx) == now
