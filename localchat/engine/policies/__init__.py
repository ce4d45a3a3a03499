"""Eviction policies, one module each (a package for one with machinery of its own), and the registry `POLICIES`
(name -> Policy class). Adding a policy: its module, and one row in catalog.py (CONTRIBUTING.md).

A module is imported when its class is first asked for (`policy_class`), `POLICIES` imports them all: what only
needs a policy's declarations (the command line, `localchat policies`) reads `catalog.CATALOG` and no torch."""

from importlib import import_module

from localchat.engine.policies.base import Option, Policy  # noqa: F401
from localchat.engine.policies.catalog import CATALOG

_classes: dict[str, type[Policy]] = {}


def _policy_in(module: str) -> type[Policy]:
    """The one Policy class a policy module defines (or, for a package, exports)."""
    found = {v for v in vars(import_module(f"{__name__}.{module}")).values()
             if isinstance(v, type) and issubclass(v, Policy) and v.name}
    if len(found) != 1:
        raise ImportError(f"policies/{module} must define exactly one named Policy class, found {len(found)}")
    return found.pop()


def __getattr__(attr: str):
    if attr == "POLICIES":  # every class, imported on first use
        policies = {name: policy_class(name) for name in CATALOG}
        globals()["POLICIES"] = policies
        return policies
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


DEFAULT_POLICY = "locret"  # where its retaining heads ship for the model (or --heads is given)
PLAIN_POLICY = "full"  # otherwise: nothing evicted
# Where no trained heads exist and full attention cannot hold the document: the best training-free bounded policy
# of this project's benchmarks (SmolLM2: passkey 20/20 at 32K and 10/10 at 128K, first of the bounded policies
# without heads at 4K and 7.7K; bench/results/grid-smollm2-cpu/, grid-smollm2-cpu-long/, all-policies-4k-*).
NO_HEADS_POLICY = "sirllm"


def policy_class(name: str) -> type[Policy]:
    from localchat.errors import UserError

    if name not in CATALOG:
        raise UserError(f"unknown policy {name!r}; choose one of: {', '.join(CATALOG)}")
    if name not in _classes:
        cls = _policy_in(CATALOG[name].module)
        if cls.name != name:
            raise ImportError(f"policies/{CATALOG[name].module} defines {cls.name!r}, not {name!r} (catalog.py)")
        _classes[name] = cls
    return _classes[name]


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
