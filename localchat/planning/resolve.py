"""One resolution of every setting into a RunSpec, before the model loads.

Precedence per field: command line > LOCALCHAT_* environment > device profile > model card > policy default;
then the memory plan lowers an automatic budget or chunk that would not fit (a value the user fixed that cannot
fit is an error saying what would). The same function serves `plan`, `profile show`, `ask`, `chat`, the chat
window, `profile tune` and the bench, so what `plan` prints is what runs.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from localchat.config import PolicySpec, RunSpec
from localchat.engine import kvzap
from localchat.engine.cards import DEFAULT_CHUNK, ModelCard, default_card, find_card
from localchat.engine.generation import GenerationSettings
from localchat.engine.heads_files import WEIGHTS as HEADS_FILE
from localchat.engine.policies import DEFAULT_POLICY, NO_HEADS_POLICY, PLAIN_POLICY, policy_class
from localchat.engine.policies.catalog import CATALOG, option_owners
from localchat.errors import UserError, first_line
from localchat.planning import profiles
from localchat.planning.memory import GIB, MIB, Device, Shape, detect, read_config
from localchat.planning.planner import DEFAULT_MARGIN, DEFAULT_TARGET, LONG_DOC, Plan, Request, decode_speed, make_plan
from localchat.planning.sources import DEFAULT, FLAG, Kind, Source, kind_of

RANDOM_HEADS_D_R = 1024  # RetainingHeads.random's d_R (the paper's)
POLICY_FIELDS = ("budget", "local", "decode_window", "heads")  # every policy's, besides its own options


@dataclass(frozen=True)
class Target:
    """The memory a plan is for: bytes, where the figure comes from, and the device kind."""

    memory: int
    source: str
    kind: str  # "cuda" or "cpu"

    @classmethod
    def of(cls, device: Device) -> Target:
        return cls(device.free, f"free on {device.describe()}", device.kind)


def option_keys() -> dict[str, tuple[str, str]]:
    """Flag key (`stabilizers`, `sparse_prefill`) -> (policy field, flag) over every policy's options."""
    return {opt.key: (name, opt.flag) for row in CATALOG.values() for name, opt in row.options.items()}


# --- the model's facts without its weights --------------------------------------------------------------------


def card_for(model: str | None) -> ModelCard | None:
    return default_card() if model is None else find_card(model)


def shipped_heads_dir(card: ModelCard | None) -> Path | None:
    """models/<card id>/ inside the package, if it holds trained heads for this model."""
    if card is None:
        return None
    directory = Path(str(resources.files("localchat.models") / card.id))
    return directory if (directory / HEADS_FILE).exists() else None


def shipped_kvzap_dir(card: ModelCard | None) -> Path | None:
    """models/<card id>/kvzap/ inside the package, if it holds a KVzap scorer for this model."""
    if card is None:
        return None
    directory = Path(str(resources.files("localchat.models") / card.id)) / "kvzap"
    return directory if kvzap.is_kvzap(directory) else None


def heads_d_r(directory: Path | None) -> int:
    if directory is None:
        return 0
    try:
        return int(json.loads((directory / "heads.json").read_text(encoding="utf-8"))["d_r"])
    except (OSError, KeyError, ValueError, TypeError):
        return 0


def model_facts(spec: str | None) -> tuple[Shape, ModelCard | None]:
    """(shape, model card or None) without loading any weights: from the model card when there is one, else from
    config.json (`spec` may also be a config.json file or a directory holding only config.json)."""
    path = Path(spec).expanduser() if spec else None
    card = card_for(spec)
    shape = Shape.from_card(card) if card is not None and not (path is not None and path.exists()) else None
    if shape is not None:  # the card knows the shape: no config file, no network
        return shape, card
    if path is not None and (path.suffix == ".json" or (path.is_dir() and (path / "config.json").exists())):
        try:
            cfg = read_config(path)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        card = find_card(spec)
        name = path.stem if path.suffix == ".json" else path.name
    else:
        from localchat.engine import loading

        source, card = loading.resolve(spec)
        if Path(source).is_dir():
            cfg = read_config(source)
        else:
            try:
                from transformers import AutoConfig

                cfg = AutoConfig.from_pretrained(source).to_dict()
            except Exception as exc:  # noqa: BLE001 - offline, gated, or not a model id
                first = first_line(exc)
                raise UserError(f"cannot read the config of {spec}: {first}; pass --model DIR (a directory "
                                f"with config.json) to plan without downloading") from None
        name = card.name if card else spec
    try:
        return Shape.from_config(cfg, name=name), card
    except (TypeError, ValueError) as exc:
        raise UserError(f"{spec}: not a decoder config this planner knows ({exc})") from None


TESTED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", "gpt_oss", "qwen3_next", "smollm3")
REFUSED = {  # model_type -> why the engine cannot run it
    "gemma2": "its attention soft-caps logits, which SDPA (the engine's attention path) cannot do",
}


def model_config(spec: str | None) -> dict | None:
    """The config known without loading: the card's shape, or a local config.json's; None when neither."""
    card = card_for(spec)
    if card is not None and card.shape.get("model_type"):
        return dict(card.shape)
    path = Path(spec).expanduser() if spec else None
    config = path if path is not None and path.suffix == ".json" else (path / "config.json" if path else None)
    if config is not None and config.is_file():
        try:
            return read_config(config)
        except ValueError:
            return None
    return None


def model_type(spec: str | None) -> str | None:
    """The architecture (config.json's model_type) known without loading: the card's, or a local config's."""
    config = model_config(spec)
    return str(config.get("model_type") or "") or None if config else None


def check_architecture(spec: str | None) -> None:
    """Refuse, before loading, an architecture the engine cannot run (one line naming the ones it runs)."""
    kind = model_type(spec)
    if kind in REFUSED:
        raise UserError(f"{spec}: {kind} models are not supported ({REFUSED[kind]}); localchat runs "
                        f"{', '.join(TESTED)} models")


def check_policy_serves(spec: str | None, policy: str) -> None:
    """Refuse, before loading, a policy that cannot serve the model's layers (a hybrid's windows or states) or its
    attention (gpt-oss's sinks), where the card or a local config says what they are."""
    from localchat.engine.layer_kinds import has_sinks, hybrid, layer_kinds, summary

    config, card, entry = model_config(spec), card_for(spec), CATALOG.get(policy)
    if config is None or entry is None:
        return
    if entry.attention_function and has_sinks(config):
        raise UserError(f"{policy} cannot serve {spec}: it replaces the attention function, which would drop the "
                        f"model's attention sinks; choose another --policy (locret, sirllm, streaming, full)")
    if entry.hybrid:
        return
    try:
        shape = Shape.from_card(card) if card is not None and card.shape.get("model_type") else None
        kinds = list(shape.kinds) if shape is not None else layer_kinds(config) if "num_hidden_layers" in config else []
    except ValueError as exc:
        raise UserError(f"{spec}: {exc}") from None
    if hybrid(kinds):
        raise UserError(f"{policy} cannot serve {spec} ({summary(kinds)} layers); choose another --policy "
                        f"(localchat policies)")


# --- the policy ------------------------------------------------------------------------------------------------


def policy_spec(name: str | None, given: dict[str, Any], given_from: dict[str, Source], card: ModelCard | None,
                kind: str) -> tuple[PolicySpec, dict[str, Source]]:
    """The policy's settings: `given` (flag key -> value, each from `given_from[key]`) > model card > policy
    default. Checks that every given option belongs to the policy and that it validates its own settings."""
    sources: dict[str, Source] = {}
    options = option_keys()
    heads = given.get("heads")
    chosen = (card.policy if card else {}) or {}  # the card's measured default (before any heads it ships)
    if name is None:
        release = card is not None and bool(card.heads_release)  # official heads, fetched at first load
        if heads and kvzap.is_kvzap(Path(str(heads)).expanduser()):  # --heads names a KVzap release
            name, sources["policy"] = "kvzap", Source.default("--heads holds a KVzap scorer")
        elif heads or not chosen.get("name"):
            name = DEFAULT_POLICY if heads or shipped_heads_dir(card) or release else PLAIN_POLICY
            sources["policy"] = Source.default("heads ship for the model" if shipped_heads_dir(card) or heads else
                                               "official heads for the model, fetched at first load" if release
                                               else None)
        else:
            name, sources["policy"] = str(chosen["name"]), Source(Kind.CARD)
    else:
        sources["policy"] = given_from.get("policy", FLAG)
    chosen = chosen if chosen.get("name") == name else {}
    cls = policy_class(name)
    for key, (field_name, flag) in options.items():
        if given.get(key) not in (None, False) and field_name not in cls.options:
            owners = option_owners(field_name)
            raise UserError(f"{flag} applies to --policy {' or '.join(owners)}, not to {name}; drop {flag} or add "
                            f"--policy {owners[0]}")
        if given.get(key) not in (None, False) and cls.options[field_name].cuda_only and kind != "cuda":
            raise UserError(f"{flag} is for a CUDA GPU and this runs on the CPU; drop {flag}, or plan it for a GPU "
                            f"with --device cuda --memory-gb N")
    if heads and "heads" not in cls.fields():
        owners = [n for n, row in CATALOG.items() if row.heads]
        raise UserError(f"--heads applies to --policy {' or '.join(owners)}, not to {name}; drop --heads")
    locret = (card.locret if card else {}) or {}
    values: dict[str, Any] = {}
    given_keys = set()
    for field_name in cls.fields():
        key = next((k for k, (f, _) in options.items() if f == field_name and f in cls.options), field_name)
        if given.get(key) is not None and not (field_name in cls.options and given[key] is False):
            values[field_name], sources[field_name] = given[key], given_from.get(key, FLAG)
            given_keys.add(field_name)
        elif field_name in chosen and field_name not in ("name", "positions"):
            values[field_name], sources[field_name] = chosen[field_name], Source(Kind.CARD)
        elif field_name in locret and field_name != "positions" and not chosen:
            values[field_name], sources[field_name] = locret[field_name], Source(Kind.CARD)
    defaults = cls()
    before = {**{f: getattr(defaults, f) for f in cls.options}, **values}
    values = cls.settle(before, given_keys)
    for field_name, value in values.items():
        if value != before[field_name]:
            sources[field_name] = sources.get(field_name, Source(Kind.POLICY_DEFAULT)).noted("lowered to fit the budget")
    if "positions" in given:
        positions, sources["positions"] = given["positions"], given_from.get("positions", FLAG)
    elif chosen.get("positions"):
        positions, sources["positions"] = str(chosen["positions"]), Source(Kind.CARD)
    elif name == DEFAULT_POLICY and locret.get("positions"):  # what the card's LOCRET rows were measured at
        positions, sources["positions"] = str(locret["positions"]), Source(Kind.CARD)
    else:
        positions, sources["positions"] = cls.positions_default(), Source(Kind.POLICY_DEFAULT)
    settings = {k: v for k, v in values.items() if k != "heads"}
    cls(**settings)  # the policy validates its own settings (UserError)
    params = tuple((f, values.get(f, getattr(defaults, f))) for f in cls.options)
    spec = PolicySpec(name=name, budget=values.get("budget", defaults.budget) if cls.uses_budget() else None,
                      local=values.get("local", defaults.local), positions=positions,
                      decode_window=values.get("decode_window", defaults.decode_window),
                      heads=heads if "heads" in cls.fields() else None, params=params)
    return spec, sources


def heads_dir_for(spec: PolicySpec, card: ModelCard | None) -> Path | None:
    """Where the policy's retaining heads are: --heads DIR, the package's (shipped), or the user cache (fetched);
    None for `random` or where none are at hand yet."""
    from localchat.planning.heads_fetch import cached_heads, cached_kvzap

    if spec.heads == "random":
        return None
    if spec.heads:
        return Path(spec.heads).expanduser()
    if spec.name == "kvzap":  # one that ships in the package, or a released one fetched into the user cache
        return shipped_kvzap_dir(card) or (cached_kvzap(card) if card is not None and card.kvzap_release else None)
    return shipped_heads_dir(card) or (cached_heads(card) if card is not None else None)


def kvzap_config(directory: Path | None, card: ModelCard | None, random: bool = False) -> dict:
    """The KVzap scorer's release config for planning: the folder's, else the card's release; where neither is
    known (a random scorer: linear, a few thousand parameters a layer), one that counts nothing."""
    if directory is not None and kvzap.is_kvzap(directory):
        return kvzap.read_config(directory)
    if card is not None and card.kvzap_config() and not random:
        return card.kvzap_config()
    return {"model_type": "kvzap", "input_dim": 0, "output_dim": 0, "hidden_dim": None, "n_modules": 0}


def check_heads(spec: PolicySpec, card: ModelCard | None, name: str) -> None:
    """Before any weights load: the policy's heads exist, or an official release can provide them (fetched at
    load). One line otherwise, naming the ways on."""
    if not spec.has_heads() or spec.heads == "random":
        return
    directory = heads_dir_for(spec, card)
    if spec.name == "kvzap":
        if spec.heads and not kvzap.is_kvzap(directory):
            raise UserError(f"no KVzap scorer in {directory} (a config.json with model_type \"kvzap\" and "
                            f"model.safetensors, as nvidia/KVzap-* on the hub); pass a KVzap release folder, "
                            f"or --heads random (an ablation)")
        if directory is None and (card is None or not card.kvzap_release):
            raise UserError(f"no KVzap scorer ships or is released for {name}; pass --heads DIR (a KVzap release folder, or "
                            f"one `localchat train-heads --scorer kvzap` wrote), or choose another --policy")
        return
    if spec.heads and kvzap.is_kvzap(directory):
        raise UserError(f"{directory} holds a KVzap scorer, not LOCRET retaining heads; add --policy kvzap")
    if spec.heads and not (directory / HEADS_FILE).is_file():
        raise UserError(f"no retaining heads in {directory} (no {HEADS_FILE}); pass the directory `localchat "
                        f"train-heads` or `localchat import-heads` wrote, or --heads random (an ablation)")
    if directory is None and (card is None or not card.heads_release):
        raise UserError(f"no trained retaining heads ship for {name}; train them with `localchat train-heads`, "
                        f"pass --heads DIR, or --heads random (an ablation), or choose another --policy")


# --- the plan ---------------------------------------------------------------------------------------------------


def _from_card(spec: RunSpec, key: str) -> bool:
    return kind_of(spec.sources.get(key)) is Kind.CARD


def plan_request(spec: RunSpec, card: ModelCard | None, kind: str, *, fixed: set[str] = frozenset(),
                 measured: dict | None = None, weights_exact: int | None = None, act: str | None = None,
                 doc_tokens: int | None = None) -> Request:
    """What the planner is asked for `spec`: the fields in `fixed` are the user's (the plan must keep them); a
    budget or chunk from the model card is the most the plan may choose; any other is the plan's to choose.
    `doc_tokens`: the document to read, where known (a policy that keeps every token must hold it; unknown, it
    aims for DEFAULT_TARGET tokens)."""
    p = spec.policy
    cls = p.cls
    act = act or ("bf16" if kind == "cuda" else "fp32")
    d_r, scorer = 0, None
    if "heads" in cls.fields():
        found = spec.heads_dir if isinstance(spec.heads_dir, Path) else heads_dir_for(p, card)
        if p.name == "kvzap":
            scorer = kvzap_config(found, card, p.heads == "random")
        else:
            d_r = RANDOM_HEADS_D_R if p.heads == "random" else heads_d_r(found) or RANDOM_HEADS_D_R
    throughput, speed = {}, decode_speed(kind)
    if measured:
        throughput = {int(c): float(t) for c, t in zip(measured.get("chunks", []), measured.get("tokens_per_s", []))}
        tuned = {k.removeprefix("decode_tps_"): float(v) for k, v in measured.items() if k.startswith("decode_tps_")}
        speed = tuned or speed  # this machine's own measurement (profile tune) over the built-in table
    offload = bool(p.param("offload"))
    policy = cls(**{k: v for k, v in p.settings().items() if k != "heads"}) if cls.uses_budget() else cls()
    weights = (spec.weights or act) if "weights" in fixed else None
    return Request(
        budget=p.budget if "budget" in fixed else None, chunk=spec.chunk if "chunk" in fixed else None,
        local=p.local, max_new=spec.generation.max_new_tokens, weights=weights, kvzap=scorer,
        kv=(spec.kv or "none") if "kv" in fixed or not cls.bounded() else None, act=act, d_r=d_r,
        margin=spec.margin_mib * MIB if spec.margin_mib is not None else None,
        target=p.budget if _from_card(spec, "budget") else None,
        card_chunk=spec.chunk if _from_card(spec, "chunk") else None,
        compact=p.positions == "compact" and cls.bounded(), holds_prompt=None if cls.bounded() else p.name,
        policy=policy, throughput=throughput, weights_exact=weights_exact,
        host_memory=detect("cpu").free - DEFAULT_MARGIN["cpu"] if offload else None,
        doc_tokens=doc_tokens or (LONG_DOC if cls.bounded() else DEFAULT_TARGET),
        held=card.held_weights(kind) if card is not None else (), speed=speed,
    )


def settled_params(spec: RunSpec, budget: int) -> dict[str, Any]:
    """The policy's own settings under `budget`: what the user did not give settles by the policy's rule (LOCRET's
    n_s drops to budget // 4 when it would not fit)."""
    params = dict(spec.policy.params)
    given = {k for k in params if k in dict(spec.asked)}
    settled = spec.policy.cls.settle({**params, "budget": budget}, given)
    return {k: v for k, v in settled.items() if k != "budget"}


def apply_plan(spec: RunSpec, plan: Plan, fixed: set[str], say=None) -> RunSpec:
    """`spec` with the plan's budget and chunk where they were not fixed by the user (LOCRET's n_s follows its rule).
    A model card's value is only ever lowered, and then `say` tells why."""
    p = spec.policy
    cls = p.cls
    sources = dict(spec.sources)
    fits = f"{plan.memory / GIB:.1f} GiB"
    precision = {}
    for key in ("weights", "kv"):
        if key not in fixed and key in plan.chosen:
            precision[key] = getattr(plan, key)
            sources[key] = Source.plan(plan.precision[0] if plan.precision else None)
    lowered = [(k, old, new) for k, old, new in (("budget", p.budget, plan.budget), ("chunk", spec.chunk, plan.chunk))
               if k not in fixed and old is not None and new < old and _from_card(spec, k)]
    if lowered and say is not None:
        say(f"localchat: plan: budget {plan.budget:,} (asked {p.budget:,}), chunk {plan.chunk:,} "
            f"(asked {spec.chunk:,}) to fit {fits}")
    chunk = spec.chunk
    if "chunk" not in fixed and plan.chunk != chunk:
        sources["chunk"] = Source.plan(f"lowered from the model card's {chunk:,} to fit {fits}"
                                       if _from_card(spec, "chunk") else f"the largest that fits {fits}")
        chunk = plan.chunk
    if "budget" not in fixed and cls.uses_budget() and plan.budget != p.budget:
        sources["budget"] = Source.plan(f"lowered from the model card's {p.budget:,} to fit {fits}"
                                        if _from_card(spec, "budget") else f"the largest that fits {fits}")
        params = settled_params(spec, plan.budget)
        p = replace(p, budget=plan.budget, params=tuple(params.items()))
    return replace(spec, policy=p, chunk=chunk, sources=sources, plan=plan, **precision)


# --- the resolution -----------------------------------------------------------------------------------------------


def resolve(flags: dict[str, Any], *, env: dict | None = None, device: Device | None = None,
            target: Target | None = None, plan: bool = True, quiet: bool = False,
            saved: dict[str, Any] | None = None, saved_label: str = "saved chat",
            doc_tokens: int | None = None) -> RunSpec:
    """The RunSpec for command-line `flags` (key -> value; None = not given). `saved`: a saved chat's settings
    (`saved_flags`), below the flags and above everything else. `target`: plan for this memory instead of what is
    free on `device` (this machine by default). `plan=False`: no memory plan (a model whose shape is unknown
    until it loads is planned then, by planning/load.py). `doc_tokens`: the document about to be read (complete)."""
    env = os.environ if env is None else env
    device = device or detect()
    saved = still_saved(saved or {}, flags)
    # a switch not given reads False: not given, so a profile's or the environment's value stands
    cli = {k: None if flags.get(k) is False else flags.get(k) for k in profiles.SETTINGS}
    r = profiles.resolve(cli, flags.get("profile") or saved.get("profile"), env=env, device=device, saved=saved,
                         saved_label=saved_label)
    if not quiet:
        for w in r.warnings:
            print(f"localchat: warning: {w}", file=sys.stderr)
    given, given_from = dict(r.values), dict(r.sources)
    for key in (*POLICY_FIELDS, *option_keys()):
        if key not in given and flags.get(key) not in (None, False):
            given[key], given_from[key] = flags[key], FLAG
        elif key not in given and saved.get(key) not in (None, False):
            given[key], given_from[key] = saved[key], Source(Kind.SAVED_CHAT, saved_label)
    model = given.get("model")
    check_architecture(model)
    card = card_for(model)
    target = target or Target.of(device)
    policy, sources = policy_spec(given.get("policy"), given, given_from, card, target.kind)
    check_policy_serves(model, policy.name)
    locret = (card.locret if card else {}) or {}
    if given.get("chunk") is not None:
        chunk, sources["chunk"] = given["chunk"], given_from["chunk"]
    elif locret.get("chunk"):
        chunk, sources["chunk"] = int(locret["chunk"]), Source(Kind.CARD)
    else:
        chunk, sources["chunk"] = DEFAULT_CHUNK, DEFAULT
    for key in ("model", "weights", "kv", "margin_mib", "threads"):
        if key in given:
            sources[key] = given_from[key]
    generation = GenerationSettings(**{k: flags[k] for k in ("max_new_tokens", "temperature", "top_p", "seed")
                                       if flags.get(k) is not None},
                                    stop=card.stop if card is not None else ())  # a plain layout's answer's end
    generation.validate()
    kv = given.get("kv") or "none"
    spec = RunSpec(policy=policy, model=model, chunk=chunk, weights=given.get("weights"), threads=given.get("threads"),
                   kv=kv if kv not in ("fp32", "bf16", "fp16") else "none", margin_mib=given.get("margin_mib"),
                   generation=generation, profile=r.profile.name if r.profile else None,
                   asked=tuple((k, v) for k, v in given.items() if k in ("positions", *POLICY_FIELDS, *option_keys())),
                   sources={**sources, "profile": r.profile_source, **{f"asked.{k}": given_from[k] for k in given}},
                   card=card)
    return complete(spec, target, quiet=quiet, doc_tokens=doc_tokens) if plan else spec


# --- a saved chat's settings ---------------------------------------------------------------------------------------

CACHE_KEYS = ("model", "policy", "budget", "heads", "weights", "kv", "chunk", "positions", "local", "decode_window")
CHAT_POLICY_KEYS = ("positions", *POLICY_FIELDS)  # a chat's policy settings besides the policy's own options


def saved_flags(spec: dict[str, Any] | None) -> dict[str, Any]:
    """A saved chat's RunSpec (`RunSpec.to_dict`, as the store keeps it) as flag keys -> values: what a follow-up
    continues with unless a flag says otherwise. {} for a chat saved without one."""
    if not isinstance(spec, dict) or not isinstance(spec.get("policy"), dict):
        return {}
    p = spec["policy"]
    out = {k: spec.get(k) for k in ("model", "chunk", "weights", "kv", "margin_mib", "profile")}
    out.update({"policy": p.get("name"), **{k: p.get(k) for k in CHAT_POLICY_KEYS}})
    for key, (field_name, _) in option_keys().items():
        if field_name in p:
            out[key] = p[field_name]
    return {k: v for k, v in out.items() if v is not None}


def still_saved(saved: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """The saved settings that still apply beside `flags`: none where a flag names another model (they were that
    model's), none of the policy's where a flag names another policy (it starts from its own defaults)."""
    if flags.get("model") is not None and flags["model"] != saved.get("model"):
        return {}
    if flags.get("policy") is not None and flags["policy"] != saved.get("policy"):
        policy_keys = {"policy", *CHAT_POLICY_KEYS, *option_keys()}
        return {k: v for k, v in saved.items() if k not in policy_keys}
    return saved


def changed_settings(saved: dict[str, Any], spec: RunSpec) -> list[str]:
    """What `spec` sets otherwise than the saved chat, among what its cache means ("budget 512 -> 1024")."""
    from localchat.engine.focus import ANSWER_ONLY

    now = saved_flags(spec.to_dict())
    keys = list(CACHE_KEYS)
    if saved.get("policy") == now.get("policy"):
        keys += sorted(k for k, (f, _) in option_keys().items() if (k in saved or k in now) and f not in ANSWER_ONLY)
    return [f"{k} {saved.get(k, 'default')} -> {now.get(k, 'default')}" for k in keys if saved.get(k) != now.get(k)]


def complete(spec: RunSpec, target: Target | None = None, *, quiet: bool = False,
             doc_tokens: int | None = None) -> RunSpec:
    """`spec` with its memory plan, from the model's shape read without its weights: the precision for every
    policy; the budget and chunk for a policy the budget bounds. A model whose shape is unknown until it loads
    stays unplanned (planning/load.py plans it then). `doc_tokens`: the document about to be read, where known:
    when full attention was only the default (no trained heads) and cannot hold it, the default becomes
    NO_HEADS_POLICY, said in one line."""
    if spec.plan is not None:
        return spec
    try:
        shape, card = model_facts(spec.model)
    except UserError:
        return spec
    measured = profiles.find(spec.profile).meta.get("measured") if spec.profile else None
    target = target or Target.of(detect())
    say = None if quiet else (lambda line: print(line, file=sys.stderr))
    planned = plan_spec(spec, shape, card, target, fixed=fixed_fields(spec), measured=measured, say=say,
                        doc_tokens=doc_tokens)
    held = planned.plan.max_document() if not spec.policy.cls.bounded() else None
    if held is None or not doc_tokens or held >= doc_tokens or not is_default(spec, "policy"):
        return planned
    bounded = no_heads_spec(spec, card, target.kind)
    if say is not None:
        say(f"localchat: full attention holds {held:,} tokens in {target.memory / GIB:.1f} GiB and the document has "
            f"about {doc_tokens:,}: reading it with {NO_HEADS_POLICY}, the best policy without trained heads in "
            f"this project's benchmarks (a bounded cache). Trained heads keep more: `localchat train-heads`, or an "
            f"official LOCRET release, then --policy locret")
    return plan_spec(bounded, shape, card, target, fixed=fixed_fields(bounded), measured=measured, say=say)


def is_default(spec: RunSpec, key: str) -> bool:
    """Whether `key` was left to its default (no flag, chat, environment, profile or card set it)."""
    return kind_of(spec.sources.get(key)) is Kind.DEFAULT


def no_heads_spec(spec: RunSpec, card: ModelCard | None, kind: str) -> RunSpec:
    """`spec` turned from the default full attention to NO_HEADS_POLICY, for a document full attention cannot hold
    (unplanned: the caller plans it for the memory it has)."""
    bounded = with_policy(spec, card, kind, NO_HEADS_POLICY)
    return replace(bounded, sources={**bounded.sources, "policy": Source.default("no trained heads, long document")})


def plan_spec(spec: RunSpec, shape: Shape, card: ModelCard | None, target: Target, *, fixed: set[str],
              measured: dict | None = None, weights_exact: int | None = None, act: str | None = None,
              say=None, doc_tokens: int | None = None) -> RunSpec:
    """Plan `spec` for `target` and apply what the plan lowered."""
    req = plan_request(spec, card, target.kind, fixed=fixed, measured=measured, weights_exact=weights_exact, act=act,
                       doc_tokens=doc_tokens)
    plan = make_plan(shape, target.memory, req, kind=target.kind, memory_source=target.source)
    return apply_plan(spec, plan, fixed, say=say)


def fixed_fields(spec: RunSpec) -> set[str]:
    """The plan's fields the user fixed (a flag, the environment or a profile), which a plan must keep."""
    fixed = {k for k in ("weights", "kv") if k in spec.sources and kind_of(spec.sources[k]) is not Kind.PLAN}
    if kind_of(spec.sources.get("budget")) not in (Kind.CARD, Kind.POLICY_DEFAULT, Kind.DEFAULT, Kind.PLAN):
        fixed.add("budget")
    if kind_of(spec.sources.get("chunk")) not in (Kind.CARD, Kind.DEFAULT, Kind.PLAN):
        fixed.add("chunk")
    return fixed


def with_policy(spec: RunSpec, card: ModelCard | None, kind: str, name: str | None = None,
                **changes: Any) -> RunSpec:
    """`spec` with another policy (`name`) and/or changed policy settings (flag keys: budget, stabilizers,
    positions ...), resolved as at start-up from what the user asked plus `changes` (the chat window's /policy,
    /budget and /profile). The plan is dropped: a budget the user now names is taken as given."""
    asked = {**dict(spec.asked), **{k: v for k, v in changes.items() if v is not None}}
    given_from = {k: spec.sources.get(f"asked.{k}", FLAG) for k in asked}
    given_from.update({k: Source(Kind.WINDOW) for k, v in changes.items() if v is not None})
    if name is not None:
        asked.pop("policy", None)
    name = name or spec.policy.name
    cls = policy_class(name)
    others = {key for key, (field_name, _) in option_keys().items() if field_name not in cls.options}
    if "heads" not in cls.fields():
        others.add("heads")
    # an option of another policy stays asked (for a later switch back) but does not apply to this one
    policy, sources = policy_spec(name, {k: v for k, v in asked.items() if k not in others or k in changes},
                                  given_from, card, kind)
    if name is not None:
        sources["policy"] = Source(Kind.WINDOW)
    return replace(spec, policy=policy, sources={**spec.sources, **sources}, plan=None,
                   asked=tuple(asked.items()))
