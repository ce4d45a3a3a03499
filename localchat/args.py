"""The parsed command line as settings: `flags(args)` (every shared flag present) and `resolve_spec(args)`,
the RunSpec they resolve to. Used by every command's parser module (cli, profile_cli, bench, train)."""

from __future__ import annotations

import argparse

from localchat.engine.policies.catalog import options as policy_options  # every policy's own flags, by flag
from localchat.engine.precision import check_quant  # the one check of --weights and --kv

# Flags every command shares, with their defaults (`flags(args)` fills those a subcommand left unset).
SHARED = {"model": None, "chunk": None, "max_new_tokens": 512, "temperature": 0.0, "top_p": 1.0, "seed": 0,
          "max_file_mb": 64.0, "policy": None, "budget": None, "local": None, "positions": None,
          "decode_window": None, "heads": None, "profile": None, "weights": None, "kv": None, "debug": False}


def flags(args: argparse.Namespace) -> dict:
    """The parsed command line as a dict, every shared flag present (the one place that reads `args` loosely)."""
    defaults = {**SHARED, **{opt.key: (False if opt.type is bool else None) for opt in policy_options().values()}}
    return {**defaults, **vars(args)}


def resolve_spec(args, **kwargs):
    """The run's settings, resolved once: flags > a saved chat's (`saved=`) > LOCALCHAT_* > profile > card > plan."""
    from localchat.planning.resolve import resolve

    spec = resolve(flags(args), **kwargs)
    check_quant(spec.weights, spec.kv)  # values from the environment or a profile too
    return spec


def load_engine(args, **kwargs):
    """The engine the flags ask for (a saved chat's settings, card defaults and the plan fill the gaps)."""
    from localchat.planning.load import load_engine as load

    return load(resolve_spec(args, **kwargs))
