"""Eviction policies, one module each, and the registry `POLICIES` (name -> Policy class)."""

from localchat.engine.policies.base import Option, Policy  # noqa: F401
from localchat.engine.policies.corm import CORM
from localchat.engine.policies.full import Full
from localchat.engine.policies.h2o import H2O
from localchat.engine.policies.locret import Locret
from localchat.engine.policies.omnikv import OmniKV
from localchat.engine.policies.random import Random
from localchat.engine.policies.roco import RoCo
from localchat.engine.policies.sagekv import SageKV
from localchat.engine.policies.sirllm import SirLLM
from localchat.engine.policies.snapkv import SnapKV
from localchat.engine.policies.streaming import Streaming

POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (Locret, Full, Streaming, H2O, SnapKV, SirLLM, Random, SageKV, OmniKV, RoCo, CORM)
}
DEFAULT_POLICY = "locret"  # where its retaining heads ship for the model (or --heads is given)
PLAIN_POLICY = "full"  # otherwise: nothing evicted


def policy_class(name: str) -> type[Policy]:
    from localchat.errors import UserError

    cls = POLICIES.get(name)
    if cls is None:
        raise UserError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return cls


def make_policy(name: str, **settings) -> Policy:
    """The policy `name` with `settings` (unknown keys and None values are dropped); defaults the caller did not
    give are settled against the ones it did (`Policy.settle`), then the policy validates itself."""
    cls = policy_class(name)
    fields = cls.fields()
    given = {k: v for k, v in settings.items() if k in fields and v is not None}
    defaults = cls.__dataclass_fields__
    options = {f: defaults[f].default for f in cls.options if f not in given}
    settled = cls.settle({**options, **given}, set(given))
    return cls(**{k: v for k, v in settled.items() if k in given or v != defaults[k].default})
