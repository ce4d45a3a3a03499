"""Every third-party module that localchat imports comes from a distribution that pyproject.toml names.

One GPU machine's image held huggingface_hub 1.x, which has no httpx2. localchat imported httpx2 by name but never
declared it (it came along with huggingface_hub 2.x on this machine). So LOCRET failed to load there, and a user
with the other huggingface_hub version would have hit the same failure. Installs that resolve
pyproject.toml's dependencies can only be trusted for what it names.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).parents[1]
NOT_INSTALLED_HERE = {"llama_cpp": "llama-cpp-python", "tomli": "tomli"}  # an optional extra; Python < 3.11 only


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"]) + [s for extra in project["optional-dependencies"].values() for s in extra]
    return {_norm(re.split(r"[\s<>=!~;\[]", s, maxsplit=1)[0]) for s in specs}


def third_party_imports() -> dict[str, set[str]]:
    """top-level module -> the files that import it (module level or inside functions), over localchat/ and kernels/."""
    found: dict[str, set[str]] = {}
    for path in [*(ROOT / "localchat").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]:
        if path.is_symlink() or any(p.is_symlink() for p in path.parents):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "localchat":
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_module_comes_from_a_declared_distribution():
    owners = md.packages_distributions()
    names = declared()
    missing = []
    for module, files in sorted(third_party_imports().items()):
        dists = owners.get(module) or [NOT_INSTALLED_HERE.get(module, module)]
        if not any(_norm(d) in names for d in dists):
            missing.append(f"{module} ({', '.join(dists)}; imported in {', '.join(sorted(files))})")
    assert not missing, "imported but not in pyproject.toml: " + "; ".join(missing)


def test_the_scan_sees_the_imports_it_checks():
    found = third_party_imports()
    assert {"torch", "transformers", "textual", "huggingface_hub", "safetensors"} <= set(found)
    assert "os" not in found and "localchat" not in found
