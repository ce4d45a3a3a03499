"""Per-device profiles: built-ins in profiles/*.toml, the user's in config.toml as [profiles.NAME] tables.

Precedence for every setting: command line > LOCALCHAT_* environment > profile > auto-detected (the
model card and the memory planner). The profile is --profile NAME (or `none`), else LOCALCHAT_PROFILE,
else config.toml's `default_profile`.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from localchat import paths
from localchat.engine.policies.catalog import CATALOG
from localchat.errors import UserError
from localchat.planning.sources import FLAG, Kind, Source
from localchat.toml import toml

WEIGHT_DTYPES = ("fp32", "bf16", "fp16", "int8", "nf4", "int4")
KV_DTYPES = ("none", "fp32", "bf16", "fp16", "int8", "int4", "int2")  # none / float: unquantized cache
POSITIONS = ("compact", "original")


def _policies() -> tuple[str, ...]:
    return tuple(CATALOG)


def policy_options() -> dict[str, tuple[str, Any]]:
    """Each policy's own settings (Policy.options) as a profile names them: key -> (kind, lower bound). The policy
    checks the values further (LOCRET: n_s below the budget)."""
    kinds = {int: ("int", 0), float: ("float", 0.0), bool: ("bool", None)}
    return {o.key: ("float", float("-inf")) if o.signed else kinds[o.type]
            for row in CATALOG.values() for o in row.options.values()}


# Settings a profile may hold: key -> (kind, lower bound or choices). These reach the engine.
SETTINGS: dict[str, tuple[str, Any]] = {
    "model": ("str", None),
    "policy": ("choice", _policies),
    "positions": ("choice", POSITIONS),
    "budget": ("int", 1),
    "chunk": ("int", 1),
    "threads": ("int", 1),  # CPU threads (torch's and the kernels'); `profile tune` measures them
    "local": ("int", 0),
    **policy_options(),  # LOCRET's --stabilizers, --max-copies, --focus ...; OmniKV's --offload, --sparse-prefill
    "weights": ("choice", WEIGHT_DTYPES),
    "kv": ("choice", KV_DTYPES),
    "margin_mib": ("int", 0),
}
# Facts about the device a profile is for (not settings).
META: dict[str, tuple[str, Any]] = {
    "description": ("str", None),
    "device": ("str", None),  # a GPU name fragment ("RTX 4090") or "cpu"
    "memory_gb": ("float", 0.001),
    "fingerprint": ("str", None),  # set by `profile tune`
    "measured": ("table", None),  # set by `profile tune`
}
CONFIG_NAME = "config.toml"


@dataclass
class Profile:
    name: str
    values: dict[str, Any]  # settings only
    meta: dict[str, Any] = field(default_factory=dict)
    origin: str = "built-in"  # "built-in" or the config.toml path

    @property
    def where(self) -> str:
        """Where its values live, for messages: `built-in rtx4090` or `<config.toml>: profiles.NAME`."""
        return f"built-in {self.name}" if self.origin == "built-in" else f"{self.origin}: profiles.{self.name}"

    @property
    def label(self) -> str:
        return f"profile {self.name} ({'built-in' if self.origin == 'built-in' else 'config.toml'})"


# --- checking values ---------------------------------------------------------------------------------


def check_value(key: str, value: Any, spec: tuple[str, Any]) -> str | None:
    """None if `value` is valid for `key`, else what is wrong (one short phrase)."""
    kind, arg = spec
    if kind == "str":
        return None if isinstance(value, str) and value.strip() else f"must be a non-empty string (got {value!r})"
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer >= {arg} (got {value!r})"
        if value >= 2**31:
            return f"must be below {2**31:,} (got {value})"
        return None if value >= arg else f"must be >= {arg} (got {value})"
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            return f"must be a number (got {value!r})"
        return None if value >= arg else f"must be {'positive' if arg else '>= 0'} (got {value})"
    if kind == "bool":
        return None if isinstance(value, bool) else f"must be true or false (got {value!r})"
    if kind == "choice":
        choices = arg() if callable(arg) else arg
        return None if value in choices else f"must be one of {', '.join(choices)} (got {value!r})"
    if kind == "table":
        return None if isinstance(value, dict) else f"must be a table (got {value!r})"
    return None


def problems(table: dict, where: str) -> list[str]:
    """One line per problem in a profile table."""
    out = []
    for key, value in table.items():
        spec = SETTINGS.get(key) or META.get(key)
        if spec is None:
            out.append(f"{where}.{key}: unknown setting; known: {', '.join([*SETTINGS, *META])}")
            continue
        wrong = check_value(key, value, spec)
        if wrong:
            out.append(f"{where}.{key}: {wrong}")
    if not out:  # the policy checks its own settings together (LOCRET: n_s below the budget)
        policy_problem = _policy_problem(table)
        if policy_problem:
            out.append(f"{where}: {policy_problem}")
    return out


def _policy_problem(table: dict) -> str | None:
    """What the profile's policy (or, without one, the policy whose options it sets) says of its settings."""
    from localchat.engine.policies import make_policy

    def fields(row) -> dict[str, str]:  # profile key -> the policy's field
        return {o.key: f for f, o in row.options.items()}

    keys = {k: v for k, v in table.items() if k in ("budget", "local")}
    own = {k: v for k, v in table.items() if any(k in fields(r) for r in CATALOG.values())}
    name = table.get("policy") or next((n for n, r in CATALOG.items() if own and set(own) <= set(fields(r))), None)
    if name is None or (own and not set(own) <= set(fields(CATALOG[name]))):
        return None  # an option the named policy does not take is refused when the profile is used
    try:
        make_policy(name, **keys, **{fields(CATALOG[name])[k]: v for k, v in own.items()})
    except UserError as exc:
        return str(exc)
    return None


def _profile(name: str, table: dict, origin: str) -> Profile:
    values = {k: v for k, v in table.items() if k in SETTINGS}
    meta = {k: v for k, v in table.items() if k in META}
    return Profile(name, values, meta, origin)


# --- reading -------------------------------------------------------------------------------------------


def config_path() -> Path:
    return paths.config_dir() / CONFIG_NAME


def _parse(text: str, where: str) -> dict:
    try:
        return toml.loads(text)
    except toml.TOMLDecodeError as exc:
        raise UserError(f"{where}: malformed TOML: {exc}") from None


def read_config(path: Path | None = None) -> dict:
    """config.toml as a dict ({} when absent); UserError naming the file, line and problem when malformed."""
    path = path or config_path()
    if not path.exists():
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8 or move it away") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    return _parse(text, str(path))


def builtin_profiles() -> dict[str, Profile]:
    out = {}
    for entry in sorted(resources.files("localchat.builtin_profiles").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            name = entry.name[: -len(".toml")]
            out[name] = _profile(name, _parse(entry.read_text(encoding="utf-8"), f"built-in profile {entry.name}"),
                                 "built-in")
    return out


def user_profiles(config: dict | None = None) -> dict[str, Profile]:
    config = read_config() if config is None else config
    tables = config.get("profiles", {})
    if not isinstance(tables, dict):
        raise UserError(f"{config_path()}: `profiles` must be a table of [profiles.NAME] tables")
    return {name: _profile(name, t, str(config_path())) for name, t in tables.items() if isinstance(t, dict)}


def all_profiles(config: dict | None = None) -> dict[str, Profile]:
    """Built-ins, then the user's (a user profile replaces a built-in of the same name)."""
    return {**builtin_profiles(), **user_profiles(config)}


def find(name: str, config: dict | None = None) -> Profile:
    known = all_profiles(config)
    if name in known:
        return known[name]
    raise UserError(f"unknown profile {name!r}; known profiles: {', '.join(sorted(known))} (or `none`)")


def validate(config: dict | None = None) -> list[str]:
    """Every problem in config.toml and the built-ins, one line each."""
    config = read_config() if config is None else config
    out = []
    for name, p in builtin_profiles().items():
        out += problems({**p.values, **p.meta}, f"built-in {name}")
    where = str(config_path())
    for key, value in config.items():
        if key == "default_profile":
            if not isinstance(value, str):
                out.append(f"{where}: default_profile must be a string (got {value!r})")
            elif value != "none" and value not in all_profiles(config):
                out.append(f"{where}: default_profile {value!r} is not a known profile")
        elif key == "profiles":
            if not isinstance(value, dict):
                out.append(f"{where}: profiles must be a table of [profiles.NAME] tables")
                continue
            for name, table in value.items():
                if not isinstance(table, dict):
                    out.append(f"{where}: profiles.{name} must be a table")
                else:
                    out += problems(table, f"{where}: profiles.{name}")
        # other tables ([keys] for the chat window, ...) belong to other parts of localchat
    return out


# --- resolving settings -----------------------------------------------------------------------------------


def env_name(key: str) -> str:
    return f"LOCALCHAT_{key.upper()}"


def _from_env(key: str, raw: str) -> Any:
    kind, _ = SETTINGS[key]
    value: Any = raw
    try:
        if kind == "int":
            value = int(raw)
        elif kind == "float":
            value = float(raw)
    except ValueError:
        raise UserError(f"{env_name(key)}: must be {'an integer' if kind == 'int' else 'a number'} "
                        f"(got {raw[:40]!r})") from None
    if kind == "bool":
        words = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
        if raw.strip().lower() not in words:
            raise UserError(f"{env_name(key)}: must be 1 or 0 (true or false) (got {raw[:40]!r})")
        value = words[raw.strip().lower()]
    wrong = check_value(key, value, SETTINGS[key])
    if wrong:
        raise UserError(f"{env_name(key)}: {wrong}")
    return value


@dataclass
class Resolved:
    values: dict[str, Any]  # settings that are set (the rest are auto-detected)
    sources: dict[str, Source]
    profile: Profile | None
    profile_source: Source
    warnings: list[str] = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


def choose_profile(cli_name: str | None, env: dict, config: dict) -> tuple[Profile | None, Source]:
    """The profile in force and why: --profile, LOCALCHAT_PROFILE, default_profile, or none."""
    for name, why in ((cli_name, Source(Kind.FLAG, "--profile")),
                      (env.get("LOCALCHAT_PROFILE"), Source(Kind.ENV, "LOCALCHAT_PROFILE")),
                      (config.get("default_profile"), Source(Kind.CONFIG, f"default_profile in {config_path()}"))):
        if name is not None and not isinstance(name, str):
            raise UserError(f"{why} must be a profile name in quotes (got {name!r}); see `localchat profile list`")
        if name:
            if name.lower() == "none":
                return None, why
            return find(name, config), why
    return None, Source(Kind.DEFAULT, "no profile")


def resolve(cli: dict[str, Any], profile_name: str | None = None, env: dict | None = None,
            device=None, saved: dict[str, Any] | None = None, saved_label: str = "saved chat") -> Resolved:
    """Settings by precedence: `cli` (None = not given) > `saved` (a saved chat's settings) > LOCALCHAT_* env >
    profile. `device` (a memory.Device) turns on the warning for a profile made for another machine."""
    saved = saved or {}
    env = os.environ if env is None else env
    none = (profile_name or "").lower() == "none"
    config = {} if none else read_config()  # `--profile none` works even beside a broken config.toml
    profile, why = choose_profile(profile_name, env, config)
    if profile is not None:
        bad = problems({**profile.values, **profile.meta}, profile.where)
        if bad:
            raise UserError(bad[0])
    values, sources = {}, {}
    for key in SETTINGS:
        if cli.get(key) is not None:
            values[key], sources[key] = cli[key], FLAG
        elif saved.get(key) is not None:
            values[key], sources[key] = saved[key], Source(Kind.SAVED_CHAT, saved_label)
        elif env.get(env_name(key)):
            values[key], sources[key] = _from_env(key, env[env_name(key)]), Source(Kind.ENV, env_name(key))
        elif profile is not None and key in profile.values:
            values[key], sources[key] = profile.values[key], Source(Kind.PROFILE, profile.label)
    r = Resolved(values, sources, profile, why)
    other = _other_model(profile, values.get("model"), sources.get("model"))
    if other:
        dropped = [k for k in MODEL_BOUND if k in values and sources[k].kind is Kind.PROFILE]
        for key in dropped:
            del values[key], sources[key]
        if dropped:
            r.warnings.append(f"{profile.label} sets {', '.join(dropped)} for {profile.values['model']}; "
                              f"{other} takes its own (its model card's, or the defaults)")
    if profile is not None and device is not None:
        mismatch = device_mismatch(profile, device)
        if mismatch:
            r.warnings.append(mismatch)
    return r


MODEL_BOUND = ("policy", "positions", "budget", "local", *policy_options())  # a profile's settings for its model


def _other_model(profile: Profile | None, model: str | None, source) -> str | None:
    """The model asked for, when its model card is another than that of the model the profile names (then the
    profile's policy settings, made for that model, do not apply: `localchat --profile rtx4090 --model qwen3-8b`).
    A model without a card (a local folder, an id no card knows) keeps them."""
    if profile is None or not profile.values.get("model") or not model or source.kind is Kind.PROFILE:
        return None
    from localchat.engine.cards import find_card

    mine, theirs = find_card(model), find_card(str(profile.values["model"]))
    return model if mine is not None and theirs is not None and mine.id != theirs.id else None


def device_mismatch(profile: Profile, device) -> str | None:
    """A warning when `profile` was made for another device than `device` (a memory.Device)."""
    fp = profile.meta.get("fingerprint")
    if fp:
        if fp != device.fingerprint:
            return f"profile {profile.name} was tuned on [{fp}]; this machine is [{device.fingerprint}]"
        return None
    want = str(profile.meta.get("device", "")).strip()
    if not want:
        return None
    if want.lower() == "cpu":
        return None if device.kind == "cpu" else f"profile {profile.name} is for a CPU; this machine has {device.name}"
    if device.kind != "cuda" or want.lower() not in device.name.lower():
        size = f" ({profile.meta['memory_gb']} GB)" if "memory_gb" in profile.meta else ""
        return f"profile {profile.name} is for an {want}{size}; this machine has {device.name}"
    return None


# --- writing ------------------------------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def profile_toml(name: str, table: dict) -> str:
    """`[profiles.NAME]` with its scalars, then `[profiles.NAME.SUB]` for each sub-table."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise UserError(f"profile name {name!r}: use letters, digits, - and _ only")
    lines = [f"[profiles.{name}]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    for k, sub in table.items():
        if isinstance(sub, dict):
            lines += ["", f"[profiles.{name}.{k}]"] + [f"{kk} = {_toml_value(vv)}" for kk, vv in sub.items()]
    return "\n".join(lines) + "\n"


def _drop_section(text: str, name: str) -> str:
    """`text` without the [profiles.NAME] table and its sub-tables (other lines and comments kept)."""
    out, skipping = [], False
    header = re.compile(r"^\s*\[\s*([^\]]+?)\s*\]\s*(#.*)?$")
    for line in text.splitlines(keepends=True):
        m = header.match(line)
        if m:
            key = m.group(1).replace('"', "").replace("'", "")
            skipping = key == f"profiles.{name}" or key.startswith(f"profiles.{name}.")
        if not skipping:
            out.append(line)
    return "".join(out)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_profile(name: str, table: dict, make_default: bool = False) -> Path:
    """Write [profiles.NAME] into config.toml (replacing an older one; the rest of the file is kept)."""
    path = config_path()
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    config = _parse(text, str(path)) if text else {}
    text = _drop_section(text, name).rstrip("\n")
    if make_default and "default_profile" not in config:
        text = f"default_profile = {_toml_value(name)}\n" + (("\n" + text) if text else "")
    text = (text + "\n\n" if text.strip() else text) + profile_toml(name, table)
    _parse(text, str(path))  # never write a file we could not read back
    write_atomic(path, text)
    return path
