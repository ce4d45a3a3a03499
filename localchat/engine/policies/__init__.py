"""Eviction policies, one module each (a package for one with machinery of its own), and the registry `POLICIES`
(name -> Policy class). Adding a policy: its module, and one row in MODULES (CONTRIBUTING.md)."""

from importlib import import_module

from localchat.engine.policies.base import Option, Policy  # noqa: F401

MODULES = (  # one row per policy: its module under policies/, in the order `localchat policies` lists them
    "locret",
    "full",
    "streaming",
    "h2o",
    "snapkv",
    "sirllm",
    "random",
    "sagekv",
    "omnikv",
    "roco",
    "corm",
)


def _policy_in(module: str) -> type[Policy]:
    """The one Policy class a policy module defines (or, for a package, exports)."""
    found = {v for v in vars(import_module(f"{__name__}.{module}")).values()
             if isinstance(v, type) and issubclass(v, Policy) and v.name}
    if len(found) != 1:
        raise ImportError(f"policies/{module} must define exactly one named Policy class, found {len(found)}")
    return found.pop()


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in map(_policy_in, MODULES)}
DEFAULT_POLICY = "locret"  # where its retaining heads ship for the model (or --heads is given)
PLAIN_POLICY = "full"  # otherwise: nothing evicted
# Where no trained heads exist and full attention cannot hold the document: the best training-free bounded policy
# of this project's benchmarks (SmolLM2: passkey 20/20 at 32K and 10/10 at 128K, first of the bounded policies
# without heads at 4K and 7.7K; bench/results/grid-smollm2-cpu/, grid-smollm2-cpu-long/, all-policies-4k-*).
NO_HEADS_POLICY = "sirllm"


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
