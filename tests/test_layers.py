"""The package's layers import downward only, and no two modules import each other through a circle.

Every `import` counts, at the top of a file or inside a function. Layers, bottom to top:
  base      errors, paths, toml, filelock, documents (and the package itself: its version)
  kernels   localchat.kernels (kernels/): tensor code with torch twins; nothing of the engine
  engine    localchat.engine: model, cache, prefill, policies
  planning  localchat.planning, localchat.config: device probes, memory model, planner, profiles, settings
  session   session, store (with its chat locks), render, turn: a conversation over an engine, one turn of it,
            and its saving
  app       cli, args, profile_cli, chat, tui, bench, train, server: the user interfaces, over the public API
A module may import its own layer or any below it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [
    ("base", ["localchat", "localchat.errors", "localchat.paths", "localchat.toml", "localchat.filelock",
              "localchat.documents"]),
    ("kernels", ["localchat.kernels"]),
    ("engine", ["localchat.engine", "localchat.models", "localchat.builtin_profiles"]),
    ("planning", ["localchat.planning", "localchat.config"]),
    ("session", ["localchat.session", "localchat.store", "localchat.render", "localchat.turn"]),
    ("app", ["localchat.cli", "localchat.args", "localchat.profile_cli", "localchat.chat", "localchat.ask",
             "localchat.lists", "localchat.tui",
             "localchat.bench", "localchat.train", "localchat.server", "localchat.__main__"]),
]
PACKAGES = {"localchat": ROOT / "localchat", "localchat.kernels": ROOT / "kernels"}


def modules() -> dict[str, Path]:
    out = {}
    for pkg, root in PACKAGES.items():
        for f in root.rglob("*.py"):
            parts = [p for p in f.relative_to(root).with_suffix("").parts if p != "__init__"]
            if pkg == "localchat" and parts[:1] == ["kernels"]:
                continue  # a link to kernels/ (see tools/gpu/env.sh): the same files
            out[".".join([pkg, *parts])] = f
    return out


def layer_of(module: str) -> int:
    best, where = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, where = len(prefix), i
    if where is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in tests/test_layers.py")
    return where


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `module` imports (`from localchat import x` counts as localchat.x when x is one)."""
    out = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out.update(n for n in names if n.startswith("localchat") and n != module)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: {d for d in imports(m, p, known) if d in known} for m, p in known.items()}


def upward(g: dict[str, set[str]]) -> list[str]:
    out = []
    for module, deps in sorted(g.items()):
        for dep in sorted(deps):
            if layer_of(dep) > layer_of(module):
                out.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]})")
    return out


def test_imports_run_downward_only():
    assert upward(graph()) == []


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert cycles(graph()) == []


def test_the_checker_catches_an_upward_import_and_a_circle():
    g = graph()
    assert "localchat.engine.engine" in g and "localchat.planning.planner" in g  # it reads the real tree
    g["localchat.engine.cache"] = g["localchat.engine.cache"] | {"localchat.planning.memory"}
    assert upward(g) == ["localchat.engine.cache (engine) imports localchat.planning.memory (planning)"]
    g = graph()
    g["localchat.planning.memory"] = g["localchat.planning.memory"] | {"localchat.planning.resolve"}
    assert cycles(g) == [["localchat.config", "localchat.planning.memory", "localchat.planning.planner",
                          "localchat.planning.resolve"]]
    with pytest.raises(AssertionError, match="belongs to no layer"):
        layer_of("localchat_extra.thing")
