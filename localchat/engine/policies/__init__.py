"""Eviction policies, one module each, and the registry `POLICIES` (name -> Policy class)."""

from localchat.engine.policies.base import Policy
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


def policy_class(name: str) -> type[Policy]:
    from localchat.errors import UserError

    cls = POLICIES.get(name)
    if cls is None:
        raise UserError(f"unknown policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return cls


def make_policy(name: str, **settings) -> Policy:
    cls = policy_class(name)
    fields = cls.__dataclass_fields__
    return cls(**{k: v for k, v in settings.items() if k in fields and v is not None})
