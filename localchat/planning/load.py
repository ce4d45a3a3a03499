"""An engine from a RunSpec: the model at the spec's precision, the spec's policy (with its heads), the memory
check for policies that keep every token, and the plan made after loading where the shape was unknown before."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from localchat.config import PolicySpec, RunSpec
from localchat.engine import loading
from localchat.engine.engine import Engine
from localchat.engine.heads import RetainingHeads
from localchat.engine.loading import _stderr
from localchat.engine.policies import Policy, make_policy
from localchat.errors import TooLong, UserError
from localchat.planning import memory
from localchat.planning.memory import GIB, Shape, dtype_name, kv_unit_bytes, model_bytes, split_bytes
from localchat.planning.planner import DEFAULT_MARGIN
from localchat.planning.resolve import Target, check_heads, fixed_fields, heads_dir_for, plan_spec


def heads_source(spec: PolicySpec, card, name: str) -> Path | str | None:
    """Where the policy's retaining heads come from, checked once (before a multi-minute load): "random", a
    directory (an official release is fetched into the user cache the first time), or None for a policy without
    heads. One line when there are none."""
    if not spec.has_heads():
        return None
    if spec.heads == "random":
        return "random"
    check_heads(spec, card, name)
    directory = heads_dir_for(spec, card)
    if directory is None:
        from localchat.planning.heads_fetch import fetch_heads, fetch_kvzap

        directory = fetch_kvzap(card) if spec.name == "kvzap" else fetch_heads(card)
    return directory


def build_policy(engine_or_model, spec: PolicySpec, heads: Path | str | None = None, card=None,
                 name: str = "") -> Policy:
    """The policy `spec` names, for a model (an Engine's, or a loaded model with its `card` and `name`), with its
    retaining heads from `heads` (heads_source: found here when not given)."""
    model = getattr(engine_or_model, "model", engine_or_model)
    if isinstance(engine_or_model, Engine):
        card, name = engine_or_model.card, engine_or_model.name
    settings = spec.settings()
    settings.pop("heads", None)
    if spec.has_heads():
        where = heads if heads is not None else heads_source(spec, card, name)
        settings["heads"] = load_scorer(spec.name, where, model)
    return make_policy(spec.name, **settings)


def load_scorer(policy: str, where: Path | str, model):
    """The trained scorer `policy` reads, from `where` ("random", or a folder): LOCRET's retaining heads, or a
    KVzap release for `kvzap`; one line when the folder holds the other kind."""
    from localchat.engine import kvzap

    if policy == "kvzap":
        from localchat.engine.kvzap_scorer import KVzapScorer, growing

        if where == "random":
            return KVzapScorer.random(model)
        if not kvzap.is_kvzap(where):
            raise UserError(f"{where} holds no KVzap scorer (a config.json with model_type \"kvzap\" and "
                            f"model.safetensors); pass a KVzap release folder, or --policy locret for retaining heads")
        scorer = KVzapScorer.load(where, growing(model))
        scorer.check_fits(model)
        return scorer
    if where == "random":
        return RetainingHeads.random(model)
    if kvzap.is_kvzap(where):
        raise UserError(f"{where} holds a KVzap scorer, not LOCRET retaining heads; add --policy kvzap")
    heads = RetainingHeads.load(where)
    heads.check_fits(model)
    return heads


def use_policy(engine: Engine, spec: PolicySpec, *, kv: str | None = None, chunk: int | None = None,
               heads: Path | str | None = None, session=None) -> None:
    """Set `engine` to the policy `spec` (and the cache type and chunk, when given). `session`: a chat over the
    engine, told its cache no longer fits (its next turn reads the conversation again)."""
    policy = build_policy(engine, spec, heads)
    engine.configure(policy, positions=spec.positions, kv=kv, chunk=chunk)
    if session is not None:
        session.policy_changed()


def use_spec(engine: Engine, spec: RunSpec, session=None) -> None:
    """Set `engine` to `spec`'s policy (with the heads `spec.heads_dir` names, when found already), positions,
    chunk and cache type (the model stays): how the app, the chat window and the bench change what an engine
    runs."""
    policy = build_policy(engine, spec.policy, spec.heads_dir)
    engine.configure(policy, positions=spec.policy.positions, kv=spec.kv, chunk=spec.chunk, spec=spec)
    if session is not None:
        session.policy_changed()


def load_engine(spec: RunSpec, *, say=_stderr, before_weights=None) -> Engine:
    """The engine `spec` describes, built once: the heads are found (or fetched) first, before a multi-minute load;
    where `spec` has no plan yet for a bounded policy (its shape was unknown before loading), it is planned with the
    loaded model's exact size. `engine.spec` is what runs; `admit` is its memory check."""
    card = spec.card  # resolve() checked the architecture and looked the card up
    use_threads(spec.threads)
    spec = replace(spec, heads_dir=heads_source(spec.policy, card, card.name if card else str(spec.model)))
    loaded = loading.load(spec.model, weights=spec.weights, say=say, before_weights=before_weights, card=card)
    if spec.plan is None and spec.policy.cls.bounded():
        spec = plan_loaded(loaded.model, loaded.card, loaded.name, spec)
    policy = build_policy(loaded.model, spec.policy, spec.heads_dir, loaded.card, loaded.name)
    return Engine.of(loaded, weights=spec.weights, say=say, policy=policy, positions=spec.policy.positions,
                     chunk=spec.chunk, kv=spec.kv, admit=admit, spec=spec)


def use_threads(threads: int | None) -> None:
    """Run torch's and the CPU kernels' loops on `threads` threads (None: torch's default, one per core)."""
    if threads:
        import torch

        torch.set_num_threads(threads)


def plan_loaded(model, card, name: str, spec: RunSpec, say=lambda line: print(line, file=sys.stderr)) -> RunSpec:
    """Plan `spec` for a loaded `model`: the free memory plus what its weights already take."""
    import torch

    on_cuda = next(model.parameters()).device.type == "cuda"
    device = memory.detect("cuda" if on_cuda else "cpu")
    weights = model_bytes(model)
    usable = device.free + (weights if device.kind == "cpu" else torch.cuda.memory_allocated())
    act = dtype_name(next(model.parameters()).dtype)
    shape = Shape.from_config(model.config, name=name)
    target = Target(usable, f"free on {device.describe()}", device.kind)
    fixed = fixed_fields(spec) | {"weights"}  # loaded: the weights are what they are
    return plan_spec(spec, shape, card, target, fixed=fixed, weights_exact=weights, act=act, say=say)


def admit(engine: Engine, prompt_units: int, max_new: int, held: int = 0) -> None:
    """A policy that keeps every token (full, SAGE-KV, OmniKV) needs the new tokens' K and V in memory:
    refuse, before reading, what the free memory cannot hold (instead of running out mid-way). Where the
    policy keeps some layers in host memory on a GPU, their share of the prompt goes there; reading streams
    two of them, whole (the `held` units too), through the GPU, and the answer stays there."""
    p = engine.policy
    if p.bounded():
        return
    kind = "cuda" if engine.device.type == "cuda" else "cpu"
    act = dtype_name(engine.model.get_input_embeddings().weight.dtype)  # embeddings keep the activation dtype
    unit = kv_unit_bytes(Shape.from_config(engine.model.config), act)  # one token, every layer
    new_units = prompt_units + max_new
    depth = engine.model.config.num_hidden_layers
    off = p.offloaded_layers(depth) if kind == "cuda" else 0
    on_device, in_host = split_bytes(unit, depth, off, prompt_units, max_new, held)
    free = memory.detect(kind).free - DEFAULT_MARGIN[kind]  # the module's, so tests can stand in a device
    if on_device > free:
        where = f" on the GPU ({off} offloaded layers' share goes to host memory)" if off else ""
        raise TooLong(f"{p.name} keeps every token: {new_units:,} more need {on_device / GIB:.1f} GiB{where} "
                        f"but {max(free, 0) / GIB:.1f} GiB is free (after a margin); use "
                        f"{bounded_choice(engine)} or a shorter document")
    host_free = memory.detect("cpu").free - DEFAULT_MARGIN["cpu"] if off else 0
    if off and in_host > host_free:
        raise TooLong(f"{p.name} --offload keeps {off} layers in host memory: {prompt_units:,} more tokens need "
                        f"{in_host / GIB:.1f} GiB there but {max(host_free, 0) / GIB:.1f} GiB is free; "
                        f"use {bounded_choice(engine)} or a shorter document")


def fit_document(engine: Engine, spec: RunSpec, tokens: int, held: int = 0) -> RunSpec | None:
    """Where full attention was only the default (no trained heads) and cannot hold `tokens` more in the memory
    found, the spec of NO_HEADS_POLICY planned for the loaded model (what `ask` chooses before loading, for a
    document given later: the chat window's); None where nothing needs to change."""
    from localchat.planning.resolve import is_default, no_heads_spec

    if engine.policy.bounded() or not is_default(spec, "policy"):
        return None
    try:
        admit(engine, tokens, spec.generation.max_new_tokens, held)
        return None
    except UserError:
        pass
    try:
        return plan_loaded(engine.model, engine.card, engine.name, no_heads_spec(spec, engine.card, engine.device.type),
                           say=lambda line: None)
    except UserError:  # not even a bounded cache fits: the turn's own refusal says why
        return None


def bounded_choice(engine: Engine) -> str:
    """The bounded policy to name to a user whose document does not fit: LOCRET where trained heads exist for the
    model, else the best policy without heads."""
    from localchat.engine.policies import NO_HEADS_POLICY
    from localchat.planning.resolve import shipped_heads_dir

    card = engine.card
    if card is not None and (card.heads_release or shipped_heads_dir(card)):
        return "--policy locret (a bounded cache)"
    return (f"--policy {NO_HEADS_POLICY} (a bounded cache; no trained heads exist for this model: "
            f"`localchat train-heads` makes them)")


def load_measured(spec: RunSpec) -> tuple[Engine, int]:
    """The engine as load_engine builds it, and the process RSS just before its weights load (after the
    libraries, their CPU kernels and the tokenizer: those are the margin's job, not the memory model's)."""
    baseline = {}

    def before(device, dtype) -> None:
        import torch
        import transformers.activations  # noqa: F401 - the engine imports these at first use; count them
        import transformers.integrations.sdpa_attention  # noqa: F401 - in the baseline, not the run
        import transformers.masking_utils  # noqa: F401

        if spec.kv not in (None, "none"):
            from localchat.kernels.quant import _quanto_ops

            _quanto_ops()  # the quantized cache's codes come from quanto's op: its library is the baseline's
        x = torch.randn(1, 4, 64, 32, dtype=dtype, device=device)  # page in the kernels a forward uses
        mask = torch.ones(64, 64, dtype=torch.bool, device=device).tril()
        torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
        torch.nn.functional.silu(x @ x.transpose(-1, -2)).topk(8, dim=-1)
        baseline["rss"] = memory.rss_bytes()

    engine = load_engine(spec, before_weights=before)
    return engine, baseline["rss"]


def policy_for(engine: Engine, name: str | None = None, **flags) -> Policy:
    """The policy the app builds for `--policy name` and these flags (flag keys: budget, stabilizers, heads,
    sparse_prefill ...) on `engine`, with its card's defaults (tests and embedders)."""
    from localchat.planning.resolve import policy_spec

    spec, _ = policy_spec(name, {k: v for k, v in flags.items() if v is not None}, {}, engine.card,
                          engine.device.type)
    return build_policy(engine, spec)
