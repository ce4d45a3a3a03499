"""Build a policy for an engine from user settings, the model card's defaults and the shipped heads."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from localchat.engine.heads import WEIGHTS, RetainingHeads
from localchat.engine.policies import Policy, make_policy
from localchat.errors import UserError


def shipped_heads_dir(engine) -> Path | None:
    """models/<card id>/ inside the package, if it holds trained heads for this model."""
    if engine.card is None:
        return None
    directory = Path(str(resources.files("localchat.models") / engine.card.id))
    return directory if (directory / WEIGHTS).exists() else None


def load_heads(engine, heads: str | None) -> RetainingHeads:
    if heads == "random":
        return RetainingHeads.random(engine.model)
    directory = Path(heads).expanduser() if heads else shipped_heads_dir(engine)
    if directory is None:
        raise UserError(
            f"no trained retaining heads ship for {engine.name}; train them with `localchat train-heads`, "
            f"pass --heads DIR, or --heads random (an ablation), or choose another --policy"
        )
    return RetainingHeads.load(directory)


def policy_for(engine, name: str | None, *, budget: int | None = None, stabilizers: int | None = None,
               local: int | None = None, heads: str | None = None, decode_window: int | None = None,
               offload: bool = False, sparse_prefill: float | None = None) -> Policy:
    """`name` defaults to locret when trained heads exist for the model (or --heads is given), else full."""
    if name is None:
        name = "locret" if heads or shipped_heads_dir(engine) else "full"
    if offload:
        check_offload(name, engine.device.type, "run it where a CUDA GPU is")
    if sparse_prefill is not None and name != "omnikv":
        raise UserError(f"--sparse-prefill applies to --policy omnikv (its filter layers choose what later layers read), "
                        f"not to {name}; drop --sparse-prefill or add --policy omnikv")
    card = engine.card.locret if engine.card else {}
    settings = {
        "budget": budget if budget is not None else card.get("budget"),
        "stabilizers": stabilizers if stabilizers is not None else card.get("stabilizers"),
        "local": local if local is not None else card.get("local"),
        "decode_window": decode_window,
        "offload": offload or None,
        "prefill_ratio": sparse_prefill,
    }
    if name == "locret":
        settings["heads"] = load_heads(engine, heads)
    policy = make_policy(name, **settings)
    if policy.evicts and getattr(policy, "stabilizers", 0) >= policy.budget:
        raise UserError(f"--stabilizers ({policy.stabilizers}) must be below --budget ({policy.budget})")
    return policy


def check_offload(policy: str | None, kind: str, fix: str) -> None:
    """--offload is OmniKV's, and it moves K/V from GPU memory to host memory: a CPU has nothing to move."""
    if policy != "omnikv":
        raise UserError(f"--offload applies to --policy omnikv (it keeps OmniKV's full cache in host memory), "
                        f"not to {policy or 'the default policy'}; drop --offload or add --policy omnikv")
    if kind != "cuda":
        raise UserError(f"--offload moves OmniKV's cache from GPU memory to host memory, and this runs on the CPU; "
                        f"drop --offload, or {fix}")
