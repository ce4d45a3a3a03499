"""OmniKV: the policy (policy.py) and its context bank for --offload (bank.py); the engine never names either."""

from localchat.engine.policies.omnikv.policy import (  # noqa: F401
    OmniKV,
    bank_groups,
    filter_layers,
    layer_roles,
    select_tokens,
    uniform_select,
)
