"""The memory planner: pick the precision (weights, retained KV cache), the largest budget (up to the model
card's target) and the fastest chunk that fit the memory, say how long a document can be read, then check the
plan against a real chunk.

Precision, where the user did not fix it: the highest quality that keeps the target budget. Each step down
has a quality cost (WEIGHT_COST, KV_COST: int8 is close to lossless, 4 bits costs more, a 2-bit cache the
most); the cheapest combination that fits wins, the higher weights precision on a tie. Speed counts where
quality does not: weights whose answers were measured to match full precision for the model (its card's
[precision]) rank with full precision, the fastest first (DECODE_SPEED, or a tuned profile's measurement).
When none keeps the target, the one with the largest budget (for a policy that keeps the whole prompt, the
one that holds the longest document). Quantized weights measured to decode at under half of full precision's
speed (SLOW: bitsandbytes' LLM.int8() on CUDA) rank after every other choice. A 2-bit cache only when nothing
else fits at all.

`make_plan` is arithmetic only (no weights are loaded); `verify` runs one chunk on a full cache with the
loaded engine, reads the real peak, and shrinks the chunk (then the budget) while it does not fit.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace

from localchat.engine.layer_kinds import summary
from localchat.errors import UserError
from localchat.planning.memory import GIB, MIB, Device, Estimate, Shape, estimate, kv_unit_bytes, quantized, split_bytes

CHUNKS = (256, 512, 1024, 2048, 4096)  # candidate chunk sizes, smallest first
DEFAULT_TARGET = 16384  # budget target without a model card (LOCRET's Llama-3.1-8B setting)
DEFAULT_MARGIN = {"cuda": 1024 * MIB, "cpu": 512 * MIB}
LONG_DOC = 128 * 1024

# What the planner may choose, best first, and the quality cost of each step (lower is better).
WEIGHT_CHOICES = {"cuda": ("bf16", "int8", "nf4"), "cpu": ("fp32", "bf16", "int8", "int4")}
KV_CHOICES = ("none", "int8", "int4", "int2")
WEIGHT_COST = {"fp32": 0, "bf16": 0, "fp16": 0, "int8": 1, "nf4": 3, "int4": 3}
KV_COST = {"none": 0, "fp32": 0, "bf16": 0, "fp16": 0, "int8": 1, "int4": 2, "int2": 5}
FLOATS = ("fp32", "bf16", "fp16")
FOUR_BIT = ("int4", "nf4")
# Decode speed by weights relative to fp32 on a CPU, by its vector unit, where no tuned profile measured this
# machine (SmolLM2, LOCRET b=1024, 2 threads, after a 7.7K document, quiet machines): AVX-512
# bench/results/cpu-decode/decode.md, AVX2 bench/results/cpu-defaults-avx2/decode-quiet/decode.md. Other CPUs
# (ARM, older x86) are not measured: full precision.
DECODE_SPEED = {"AVX512": {"fp32": 1.0, "int8": 3.47, "int4": 4.08},
                "AVX2": {"fp32": 1.0, "int8": 2.44, "int4": 3.23},
                # CUDA, relative to bf16: Llama-3.1-8B's shape (random weights) on an H200 after a 32K read, b=16,384,
                # int8 cache (bench/results/gpu-8b-h200): bitsandbytes' LLM.int8() layers decode at a fifth of the
                # speed of nf4 or bf16 (6.1 against 28.4 and 28.5 tokens/s)
                "cuda": {"bf16": 1.0, "nf4": 1.0, "int8": 0.21}}
SLOW = 0.5  # quantized weights under this share of full precision's decode speed rank after every other choice


CPU_FLAGS = {"AVX512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"}, "AVX2": {"avx2", "fma"}}


def cpu_class() -> str:
    """This CPU's vector unit as torch's kernels use it: "AVX512", "AVX2", or "DEFAULT" (others). On Linux read
    from /proc/cpuinfo's flags as torch's dispatch reads them (a plan imports no torch), capped by
    ATEN_CPU_CAPABILITY as torch caps it; elsewhere, or once torch is imported, torch says."""
    if "torch" in sys.modules or sys.platform != "linux":
        import torch

        return torch.backends.cpu.get_cpu_capability()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        flags = set()
    found = next((name for name, need in CPU_FLAGS.items() if need <= flags), "DEFAULT")
    order = [*CPU_FLAGS, "DEFAULT"]
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").upper()
    return cap if cap in order and order.index(cap) > order.index(found) else found


def decode_speed(kind: str) -> dict[str, float]:
    """DECODE_SPEED for this machine: its CPU's vector unit, or CUDA (empty for a CPU not measured)."""
    return dict(DECODE_SPEED.get(cpu_class() if kind == "cpu" else kind, {}))


def decode_choices(plan: Plan, held: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The weights whose decode speed `profile tune` measures when the plan chooses the weights: full precision
    and the weights measured to answer as it does (`held`); on CUDA every choice that fits the memory (LLM.int8's
    slowness is the machine's to measure), none that does not."""
    full = plan.request.act if plan.kind == "cuda" else "fp32"
    if plan.kind != "cuda":
        return (full, *held)
    out = []
    for w in dict.fromkeys((full, *WEIGHT_CHOICES["cuda"], *held)):
        try:
            make_plan(plan.shape, plan.memory, replace(plan.request, weights=w), kind=plan.kind)
        except UserError:
            continue
        out.append(w)
    return tuple(out)


@dataclass
class Request:
    """What the planner is asked: fixed values (None = the planner chooses) and the dtypes."""

    budget: int | None = None
    chunk: int | None = None
    local: int = 96
    max_new: int = 512
    weights: str | None = "bf16"  # None: the planner chooses (WEIGHT_CHOICES)
    kv: str | None = "bf16"  # "none" or a float dtype: full precision; int8/int4/int2; None: the planner chooses
    act: str = "bf16"  # the activations' dtype when the weights are quantized (float weights set their own)
    d_r: int = 0  # retaining heads' hidden size (0: no heads)
    kvzap: dict | None = None  # a KVzap scorer's release config (engine/kvzap.py), scoring in place of heads
    margin: int | None = None  # bytes; None: DEFAULT_MARGIN for the device kind
    target: int | None = None  # budget target (model card); None: DEFAULT_TARGET
    card_chunk: int | None = None  # the card's chunk: the preferred speed when nothing was measured
    compact: bool = True  # compact positions: the cache, not the window, bounds the document
    holds_prompt: str | None = None  # a policy that keeps the whole prompt while reading (its name), or None
    throughput: dict[int, float] = field(default_factory=dict)  # measured tokens/s per chunk (a tuned profile)
    weights_exact: int | None = None  # bytes of the loaded model, when it is loaded
    policy: object = None  # the Policy; its scoring may need memory of its own (Policy.score_bytes)
    host_memory: int | None = None  # bytes free in host memory, for layers the policy offloads there (OmniKV)
    doc_tokens: int = LONG_DOC  # the document to serve: a policy that keeps the whole prompt must hold it
    held: tuple[str, ...] = ()  # quantized weights measured to answer as full precision does (the model card)
    speed: dict[str, float] = field(default_factory=dict)  # decode speed by weights (relative or tokens/s)
    kind: str = "cuda"  # the device kind the plan is for (make_plan sets it)

    def kv_dtype(self) -> str:
        """The retained cache's dtype name: the activations' when it is not quantized."""
        return self.act if self.kv in (None, "none") else self.kv

    def at(self, weights: str, kv: str) -> Request:
        """This request with the precision fixed (float weights carry their own activation dtype)."""
        return replace(self, weights=weights, kv=kv, act=weights if weights in FLOATS else self.act)


@dataclass
class Plan:
    shape: Shape
    memory: int  # bytes the plan may use (free memory now, or a profile's device)
    memory_source: str
    kind: str  # "cuda" or "cpu"
    budget: int
    chunk: int
    request: Request
    estimate: Estimate
    notes: list[str] = field(default_factory=list)
    measured_peak: int | None = None  # bytes, after verify()
    precision: list[str] = field(default_factory=list)  # why these weights and cache (when the plan chose them)
    chosen: tuple[str, ...] = ()  # which of "weights", "kv" the plan chose (the others were fixed)

    @property
    def weights(self) -> str:
        return self.request.weights

    @property
    def kv(self) -> str:
        """`none` (full precision) or the quantized cache type."""
        return self.request.kv if quantized(self.request.kv_dtype()) else "none"

    @property
    def fits(self) -> bool:
        return self.estimate.total <= self.memory

    def offloaded(self) -> int:
        """Layers whose K/V the policy keeps in host memory on this device (OmniKV --offload on a GPU)."""
        p = self.request.policy
        return p.offloaded_layers(self.shape.layers) if p is not None and self.kind == "cuda" else 0

    def full_attention_tokens(self, offload: bool = True) -> int:
        """How many tokens the same memory holds with no eviction (a full cache, original positions). With
        offloaded layers the device holds the others' K/V (plus two streamed through), host memory the rest."""
        r = self.request
        full = r.act  # a cache without eviction is the plain one, at the activations' dtype
        fixed = estimate(self.shape, budget=0, chunk=self.chunk, local=0, max_new=0, weights=r.weights, kv=full,
                         act=r.act, d_r=r.d_r, margin=self.estimate.margin, weights_exact=r.weights_exact, kvzap=r.kvzap)
        per_token = estimate(self.shape, budget=1, chunk=self.chunk, local=0, max_new=0, weights=r.weights,
                             kv=full, act=r.act, d_r=r.d_r, margin=self.estimate.margin,
                             weights_exact=r.weights_exact, kvzap=r.kvzap).total - fixed.total
        off, depth = (self.offloaded() if offload else 0), self.shape.layers
        unit = kv_unit_bytes(self.shape, full)
        on_device, in_host = split_bytes(unit, depth, off, prompt=1)
        per_token -= unit - on_device
        n = max(0, (self.memory - fixed.total) // max(per_token, 1))
        if off and r.host_memory is not None:
            n = min(n, max(0, r.host_memory) // max(in_host, 1))
        return int(min(n, self.shape.window)) if self.shape.window else int(n)

    def max_document(self) -> int | None:
        """Tokens a document may have: None = any length (compact positions keep memory and positions flat)."""
        if self.request.holds_prompt:  # the whole prompt is in memory: the memory bounds it as well as the window
            return max(0, self.full_attention_tokens() - self.request.max_new)
        return None  # evicting: at original positions to the window, then at compact ones (Engine._past_window)

    def lines(self) -> list[str]:
        r, e = self.request, self.estimate
        out = [f"model        {self.shape.name}: {self.shape.total_params() / 1e9:.2f}B parameters, "
               f"{self.shape.layers} layers, {self.shape.kv_heads} KV heads x {self.shape.head_dim}",
               *([f"layers       {summary(list(self.shape.kinds))}: only the global layers' cache grows with the "
                  f"document"] if self.shape.kinds else []),
               f"memory       {self.memory / GIB:.1f} GiB ({self.memory_source})",
               f"weights      {r.weights}, KV cache {self.kv if self.kv != 'none' else r.kv_dtype()}, "
               f"activations {r.act}{' (chosen by the plan)' if self.chosen else ''}"]
        out += [f"precision    {line}" for line in self.precision] + [""]
        for label, value in e.rows():
            out.append(f"  {label:<18} {value / GIB:8.2f} GiB")
        out.append(f"  {'total':<18} {e.total / GIB:8.2f} GiB of {self.memory / GIB:.1f} GiB"
                   f" ({'fits' if self.fits else 'DOES NOT FIT'})")
        if self.measured_peak is not None:
            out.append(f"  {'measured peak':<18} {self.measured_peak / GIB:8.2f} GiB "
                       f"(predicted {e.used / GIB:.2f} GiB without the margin, "
                       f"{(e.used - self.measured_peak) / self.measured_peak:+.1%})")
        out += ["", f"budget       {self.budget:,} units per KV head per layer"
                    f"{'' if r.budget is not None else f' (target {r.target or DEFAULT_TARGET:,})'}",
                f"chunk        {self.chunk:,} tokens{self._chunk_why()}",
                f"local tail   {r.local:,}; answers up to {r.max_new:,} tokens"]
        doc = self.max_document()
        if doc is None:
            where = " in each global layer" if self.shape.kinds else ""
            out.append(f"documents    any length: the cache stays at {self.budget + self.chunk + r.local + r.max_new:,}"
                       f" units{where}, so a {LONG_DOC // 1024}K-token document fits"
                       + ("" if r.compact else f" (original positions to the model's window of {self.shape.window:,}, "
                                               f"compact ones past it)"))
        elif r.holds_prompt and self.offloaded():
            host = f"{r.host_memory / GIB:.1f} GiB free on this machine" if r.host_memory is not None else "its size unknown"
            out.append(f"documents    up to {doc:,} tokens ({r.holds_prompt} keeps the whole prompt: "
                       f"{self.offloaded()} of {self.shape.layers} layers in host memory ({host}), the rest "
                       f"on the GPU; the window and both memories bound it)")
        elif r.holds_prompt:
            grows = (f"; only its {self.shape.global_layers} global layers grow with it" if self.shape.kinds else "")
            out.append(f"documents    up to {doc:,} tokens ({r.holds_prompt} keeps the whole prompt in memory: "
                       f"the window and the memory bound it, not the budget{grows})")
        if self.offloaded():
            out.append(f"full cache   without --offload the GPU holds {self.full_attention_tokens(offload=False):,} tokens")
        else:
            out.append(f"full cache   the same memory holds {self.full_attention_tokens():,} tokens without eviction")
        tps = r.throughput.get(self.chunk)
        if tps:
            out.append(f"reading      {tps:,.0f} tokens/s measured: a {LONG_DOC // 1024}K document in about "
                       f"{LONG_DOC / tps / 60:,.1f} min")
        return out + [f"note         {n}" for n in self.notes]

    def _chunk_why(self) -> str:
        r = self.request
        if r.chunk is not None:
            return ""
        if r.throughput.get(self.chunk):
            return f" (fastest measured that fits: {r.throughput[self.chunk]:,.0f} tokens/s)"
        return " (largest that fits, up to the model card's)" if r.card_chunk else " (largest that fits)"


def _margin(req: Request) -> int:
    return req.margin if req.margin is not None else DEFAULT_MARGIN.get(req.kind, DEFAULT_MARGIN["cpu"])


def _estimate(shape: Shape, req: Request, budget: int, chunk: int, margin: int) -> Estimate:
    return estimate(shape, budget=budget, chunk=chunk, local=req.local, max_new=req.max_new, weights=req.weights,
                    kv=req.kv_dtype(), act=req.act, d_r=req.d_r, margin=margin, weights_exact=req.weights_exact,
                    policy=req.policy, compact=req.compact, kind=req.kind, kvzap=req.kvzap)


def _positions(req: Request, chunk: int) -> int:
    """Compact positions a reading or answer needs above the budget (Engine._check_window's rule)."""
    window = getattr(req.policy, "decode_window", 0) or 0
    return max(chunk, req.local + 2 * window)


def _window_ok(shape: Shape, req: Request, budget: int, chunk: int) -> bool:
    """Compact positions never exceed the budget plus a chunk (or the local tail and decode window): they must
    stay inside the model's window."""
    return not (req.compact and shape.window) or budget + _positions(req, chunk) < shape.window


def _chunk_order(req: Request) -> list[int]:
    """Chunks to try, preferred first: the fastest measured; else the largest up to the card's chunk."""
    if req.chunk is not None:
        return [req.chunk]
    if req.throughput:
        measured = sorted(req.throughput, key=lambda c: -req.throughput[c])
        return measured + [c for c in sorted(CHUNKS, reverse=True) if c not in req.throughput]
    top = req.card_chunk or CHUNKS[-1]
    first = sorted({c for c in CHUNKS if c <= top} | {top}, reverse=True)
    return first + [c for c in sorted(CHUNKS, reverse=True) if c not in first]


def precision_choices(req: Request) -> list[tuple[str, str]]:
    """(weights, kv) pairs the plan may use, best first (a fixed one is the only choice on its side): by quality
    cost, except that weights measured to answer as full precision does rank as full precision, the fastest
    first, where speeds are known."""
    weights = [req.weights] if req.weights else list(WEIGHT_CHOICES.get(req.kind, WEIGHT_CHOICES["cpu"]))
    kvs = [req.kv] if req.kv else list(KV_CHOICES)
    rank = {w: i for i, w in enumerate(weights)}
    pairs = [(w, k) for w in weights for k in kvs]

    def key(pair: tuple[str, str]) -> tuple:
        w, k = pair
        if _speed_first(req, w):
            return _slow(req, w) is not None, 0, KV_COST.get(k, 0), -req.speed.get(w, 0.0), rank[w]
        return (_slow(req, w) is not None, 1 if req.held and req.speed else 0,
                WEIGHT_COST.get(w, 0) + KV_COST.get(k, 0), rank[w])

    return sorted(pairs, key=key)


def _slow(req: Request, weights: str) -> tuple[float, str] | None:
    """(speed share, the full precision it is measured against) where quantized `weights` decode at under SLOW of
    full precision's speed (LLM.int8 on CUDA): they cost quality and speed, so they rank last; else None."""
    base = next((f for f in (req.act, *FLOATS) if f in req.speed), None)
    if weights in FLOATS or base is None or weights not in req.speed or req.speed[base] <= 0:
        return None
    share = req.speed[weights] / req.speed[base]
    return (share, base) if share < SLOW else None


def _speed_first(req: Request, weights: str) -> bool:
    """Whether `weights` ranks by speed: full precision, or measured to answer as it does (with speeds known)."""
    return bool(req.held and req.speed) and (weights in FLOATS or weights in req.held)


def _label(weights: str, kv: str) -> str:
    return f"{weights} weights + {'a full-precision' if kv in ('none', *FLOATS) else kv} cache"


def make_plan(shape: Shape, memory: int, req: Request, *, kind: str = "cpu", memory_source: str = "") -> Plan:
    """The plan for `memory` bytes, choosing the precision the request leaves open; UserError (saying what
    would fit) when nothing does, naming the chunk when the chunk asked for is what does not fit."""
    try:
        return _make_plan(shape, memory, req, kind, memory_source)
    except UserError as first:
        if req.chunk is None or str(first).startswith("chunk "):  # no chunk asked for, or already named
            raise
        try:
            other = _make_plan(shape, memory, replace(req, chunk=None), kind, memory_source)
        except UserError:
            raise first from None  # the chunk is not the problem: the first reason stands
    raise UserError(f"chunk {req.chunk:,} does not fit {shape.name} in {memory / GIB:.1f} GiB (the memory and the "
                    f"positions one step reads grow with the chunk); try --chunk {other.chunk:,}, or leave --chunk "
                    f"out and the plan picks one")


def _make_plan(shape: Shape, memory: int, req: Request, kind: str, memory_source: str) -> Plan:
    req = replace(req, kind=kind)
    pairs = precision_choices(req)
    if len(pairs) == 1:
        return _plan_at(shape, memory, req.at(*pairs[0]), memory_source=memory_source)
    chosen = tuple(k for k in ("weights", "kv") if getattr(req, k) is None)
    # a 2-bit cache is the last resort: only when nothing else fits at all (not to keep the whole budget)
    main = [p for p in pairs if p[1] != "int2" or req.kv == "int2"]
    plans = _plans(shape, memory, req, main, memory_source)
    if not plans:
        plans = _plans(shape, memory, req, [p for p in pairs if p not in main], memory_source)
        main = pairs
    if not plans:  # name the smallest choice: what was tried last in memory, whatever the ranking
        w, k = min(pairs, key=lambda p: _estimate(shape, req.at(*p), 1, min(_chunk_order(req)), _margin(req)).total)
        if req.budget is not None:  # the budget asked for is what does not fit: the smallest precision says why
            _plan_at(shape, memory, req.at(w, k), memory_source=memory_source)
        e = _estimate(shape, req.at(w, k), 1, min(_chunk_order(req)), _margin(req))
        raise UserError(f"{shape.name} does not fit in {memory / GIB:.1f} GiB even with {_label(w, k)}: the weights "
                        f"alone take {e.weights / GIB:.1f} GiB (+ margin {e.margin / GIB:.1f} GiB); try a smaller model")
    plan = plans[-1]
    if not _keeps_target(plan):  # none keeps the target: the largest budget, or the longest document held
        plan = max(plans, key=_reach)
    plan.chosen = chosen
    plan.precision = _why(shape, plan, main, memory)
    if "weights" in chosen:
        for w in dict.fromkeys(p[0] for p in pairs):
            slow = _slow(req, w)
            if slow and w != plan.weights and WEIGHT_COST.get(w, 0) < WEIGHT_COST.get(plan.weights, 0) and any(
                    _keeps_target(p) or _reach(p) >= _reach(plan)
                    for p in _plans(shape, memory, req, [q for q in pairs if q[0] == w], "")):
                plan.precision.append(f"{w} weights would fit with higher quality, but decode at {slow[0]:.2f}x "
                                      f"{slow[1]}'s speed on this device: they rank last (--weights {w} to use them)")
    return plan


def _reach(plan: Plan) -> int:
    """What a plan is chosen for: the budget, or for a policy that keeps the whole prompt the document it holds."""
    return (plan.max_document() or 0) if plan.request.holds_prompt else plan.budget


def _plans(shape: Shape, memory: int, req: Request, pairs: list[tuple[str, str]], memory_source: str) -> list[Plan]:
    """Plans at `pairs` in order, up to the first that keeps the target (those that fit at all)."""
    plans = []
    for pair in pairs:
        try:
            plans.append(_plan_at(shape, memory, req.at(*pair), memory_source=memory_source))
        except UserError:
            continue
        if _keeps_target(plans[-1]):
            break
    return plans


def _target(shape: Shape, req: Request) -> int:
    """The budget a plan aims for: the fixed one, else the card's (or DEFAULT_TARGET), inside the window."""
    target = req.budget or req.target or DEFAULT_TARGET
    if req.compact and shape.window:
        target = min(target, shape.window - _positions(req, min(_chunk_order(req))) - 1)
    return target


def _keeps_target(plan: Plan) -> bool:
    r = plan.request
    if r.holds_prompt:  # a policy that keeps every token: the document is the target, not a budget
        return (plan.max_document() or 0) >= r.doc_tokens
    return plan.budget >= _target(plan.shape, r) // 64 * 64


def _why(shape: Shape, plan: Plan, pairs: list[tuple[str, str]], memory: int) -> list[str]:
    """What the plan chose and what the next step up would need."""
    r = plan.request
    pair = (r.weights, r.kv)
    index = pairs.index(pair)
    if r.holds_prompt:
        doc = plan.max_document() or 0
        goal = f"a {r.doc_tokens:,}-token document" if doc >= r.doc_tokens else f"the longest document ({doc:,} tokens)"
    else:
        goal = f"budget {plan.budget:,}" if _keeps_target(plan) else f"the largest budget ({plan.budget:,})"
    if r.weights in r.held and _speed_first(r, r.weights):
        base = r.speed.get("fp32") or r.speed.get(r.act) or 0
        faster = f", {r.speed[r.weights] / base:.1f}x fp32's decode speed" if base and r.weights in r.speed else ""
        return [f"{_label(*pair)}: measured to answer as full precision does for this model, and the fastest that "
                f"keeps {goal}{faster} (--weights fp32 for full precision)"]
    if index == 0:
        return [f"{_label(*pair)}: the highest quality, and it keeps {goal}"]
    up = pairs[index - 1]
    if r.holds_prompt:
        try:
            above = _plan_at(shape, memory, r.at(*up)).max_document() or 0
        except UserError:
            above = 0
        return [f"{_label(*pair)}: the highest quality that keeps {goal} in {memory / GIB:.1f} GiB",
                f"next step up: {_label(*up)} " + (f"would hold {above:,} tokens" if above else "does not fit")]
    need = _estimate(shape, r.at(*up), _target(shape, r), min(_chunk_order(r)), _margin(r)).total
    lines = [f"{_label(*pair)}: the highest quality that keeps {goal} in {memory / GIB:.1f} GiB",
             f"next step up: {_label(*up)} would need {need / GIB:.1f} GiB at budget {_target(shape, r):,} "
             f"({(need - memory) / GIB:+.1f} GiB)"]
    return lines


def _plan_at(shape: Shape, memory: int, req: Request, *, memory_source: str = "") -> Plan:
    """The plan at the request's precision (for the device kind `req.kind`); UserError (saying what would fit)
    when nothing does."""
    margin = _margin(req)
    chunks = _chunk_order(req)
    smallest = min(chunks)

    def fits(budget: int, chunk: int) -> bool:
        return _window_ok(shape, req, budget, chunk) and _estimate(shape, req, budget, chunk, margin).total <= memory

    def largest_budget(limit: int) -> int:
        lo, hi = 0, limit  # largest b in [1, limit] that fits with the smallest chunk, 0 if none
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid, smallest) else (lo, mid - 1)
        return lo

    if req.budget is not None:
        budget = req.budget
        if not any(fits(budget, c) for c in chunks):
            best = largest_budget(budget)
            need = _estimate(shape, req, budget, smallest, margin).total
            if not _window_ok(shape, req, budget, smallest):
                room = shape.window - _positions(req, smallest) - 1
                if room < 1:
                    raise UserError(f"chunk {smallest:,} does not fit {shape.name}'s window of {shape.window:,} "
                                    f"positions, with any budget; try --chunk {shape.window // 4:,}, or leave --chunk "
                                    f"out and the plan picks one")
                raise UserError(f"budget {budget:,} + chunk {smallest:,} does not fit {shape.name}'s window of "
                                f"{shape.window:,} positions; a budget up to {room:,} would")
            raise UserError(f"budget {budget:,} needs {need / GIB:.1f} GiB with chunk {smallest} but "
                            f"{memory / GIB:.1f} GiB is available; "
                            + (f"a budget up to {best:,} would fit" if best else "nothing fits: the weights alone "
                               f"take {_estimate(shape, req, 0, smallest, margin).weights / GIB:.1f} GiB"))
    else:
        target = _target(shape, req)
        budget = largest_budget(target)
        if budget < 1:
            e = _estimate(shape, req, 0, smallest, margin)
            step = ("try a smaller model" if req.weights in FOUR_BIT else
                    f"try 4-bit weights (--weights {'nf4' if req.kind == 'cuda' else 'int4'}) or a smaller model")
            raise UserError(f"{shape.name} does not fit in {memory / GIB:.1f} GiB: weights {e.weights / GIB:.1f} GiB"
                            f" + margin {e.margin / GIB:.1f} GiB; {step}")
        budget = budget // 64 * 64 if budget >= 128 else budget  # round to a tidy figure
    chunk = next((c for c in chunks if fits(budget, c)), None)
    if chunk is None:
        raise UserError(f"chunk {req.chunk:,} does not fit with budget {budget:,} in {memory / GIB:.1f} GiB; "
                        f"try --chunk {smallest // 2 or 1}")
    plan = Plan(shape, memory, memory_source or req.kind, req.kind, budget, chunk, req,
                _estimate(shape, req, budget, chunk, margin))
    if req.budget is None and req.target and budget < min(req.target, target):
        plan.notes.append(f"budget lowered from the target {req.target:,} to fit the memory")
    return plan


def plan_for_device(shape: Shape, device: Device, req: Request) -> Plan:
    return make_plan(shape, device.free, req, kind=device.kind, memory_source=f"free on {device.describe()}")


# --- checking the plan against a real chunk ---------------------------------------------------------------


def measure_chunk(engine, budget: int, chunk: int, max_new: int = 0, baseline: int | None = None) -> int:
    """Bytes at the peak of a prefill that runs a chunk on a full cache (budget + 2 chunks + the tail).

    CUDA: torch's peak allocation. CPU: the process's peak RSS minus `baseline` (RSS before the model
    loaded); without a baseline, the model's bytes plus the RSS growth during the run."""
    import torch

    from localchat.engine.sampling import GenerationSettings
    from localchat.planning import memory

    p = engine.policy
    n = budget + 2 * chunk + p.local
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(engine.tokenizer), (n,), generator=gen).tolist()
    old_chunk = engine.chunk
    engine.configure(chunk=chunk)
    cuda = engine.device.type == "cuda"
    kept = {k: getattr(p, k) for k in p.options if hasattr(p, k)} | {"budget": p.budget}
    if p.uses_budget():  # measure at this budget (the policy's own rule settles what depends on it)
        for key, value in type(p).settle({**kept, "budget": budget}, set()).items():
            setattr(p, key, value)
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        else:
            before = memory.rss_bytes()
            memory.reset_peak_rss()
        cache = engine.new_cache(n, max_new)
        events = list(engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=1, ignore_eos=True)))
        from localchat.engine.events import Error

        failed = next((e for e in events if isinstance(e, Error)), None)
        if failed is not None:
            raise UserError(f"the check run failed: {failed.message}")
        if cuda:
            torch.cuda.synchronize()
            return int(torch.cuda.max_memory_allocated())
        peak = memory.peak_rss_bytes()
        return peak - baseline if baseline is not None else memory.model_bytes(engine.model) + peak - before
    finally:
        engine.configure(chunk=old_chunk)
        for key, value in kept.items():
            setattr(p, key, value)


def replan_for_miss(plan: Plan, peak: int) -> Plan | None:
    """The plan again with the memory model's miss (`peak` above the prediction) taken off the memory, so the
    fields the plan chose (precision, budget, chunk) are chosen again around what was measured; None when
    that changes nothing or nothing fits."""
    miss = peak - plan.estimate.used
    if miss <= 0:
        return None
    reopen = {k: None for k in plan.chosen}
    try:
        again = make_plan(plan.shape, plan.memory - miss, replace(plan.request, **reopen), kind=plan.kind,
                          memory_source=plan.memory_source)
    except UserError:
        return None
    same = (again.budget, again.chunk, again.weights, again.kv) == (plan.budget, plan.chunk, plan.weights, plan.kv)
    if same:
        return None
    again.memory = plan.memory  # the real memory; the plan was made for less
    return again


def verify(engine, plan: Plan, baseline: int | None = None, tries: int = 4) -> Plan:
    """Run a real chunk at the plan; while the measured peak + margin does not fit, plan again around the
    measured miss (a cheaper cache where the plan chose it, a smaller budget or chunk) or else halve the chunk
    (then cut the budget by a quarter), and measure again. The returned plan carries the measured peak."""
    for _ in range(tries):
        engine.configure(kv=plan.kv)  # the cache the plan is for (the weights are loaded)
        peak = measure_chunk(engine, plan.budget, plan.chunk, plan.request.max_new, baseline)
        plan.measured_peak = peak
        if peak + plan.estimate.margin <= plan.memory:
            return plan
        again = replan_for_miss(plan, peak)
        if again is not None:
            again.notes = plan.notes + [f"measured {peak / GIB:.2f} GiB at {plan.weights} + {plan.kv} cache, budget "
                                        f"{plan.budget:,}, chunk {plan.chunk:,}: does not fit; trying {again.kv} "
                                        f"cache, budget {again.budget:,}, chunk {again.chunk:,}"]
            plan = again
            continue
        smaller = replace(plan.request, chunk=max(plan.chunk // 2, 1), budget=plan.budget)
        if plan.chunk <= min(CHUNKS):
            smaller.budget = max(1, plan.budget * 3 // 4)
        note = (f"measured {peak / GIB:.2f} GiB at budget {plan.budget:,}, chunk {plan.chunk:,}: "
                f"does not fit; trying budget {smaller.budget:,}, chunk {smaller.chunk:,}")
        notes = plan.notes + [note]
        plan = make_plan(plan.shape, plan.memory, smaller, kind=plan.kind, memory_source=plan.memory_source)
        plan.notes = notes
    raise UserError(f"no plan fits after {tries} measured tries; lower --budget or --chunk")
