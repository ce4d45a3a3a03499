"""Natural filler text, built offline from the documentation strings of the Python standard library.

Source: for every public top-level module in `sys.stdlib_module_names` (minus `SKIP`: modules with
side effects on import, GUI toolkits, deprecated shims and setuptools' distutils) and its public
submodules, the own `__doc__` of the module, of its public classes and functions, and of the public
methods and properties of those classes (own docstrings only, never inherited ones, so no text
crosses from one module to another). Objects of a private twin (`_json`, `_functools`) count for the
public module (`json`, `functools`).

Cleaning: paragraphs (blank-line separated) with code (`>>>`, indented lines) are dropped; reST roles
and backquotes are unwrapped; a paragraph is kept when it starts with a capital, ends with a period,
has at least 6 words and 40 characters, and at most 2% code-like characters. Exact duplicates are kept
once (first module in sorted order).

Splits: a module belongs to "eval" when the first byte of sha256(module name) is odd, else to
"train" (`modules(split)` lists them; on CPython 3.11 e.g. `json`, `email` and `typing` are train,
`argparse`, `pickle` and `unittest` eval; bench/README.md has both lists).
Splits are disjoint by module and by paragraph. The text is deterministic for a given Python build
(the modules that import there); paragraphs are collected once per process.

`natural_text(split, n_chars, seed)`: the split's paragraphs in a seeded order (reshuffled and
repeated when more text is asked than the split holds: about 330K characters each on CPython 3.11),
joined by blank lines and cut at a sentence end to at most `n_chars` characters.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import io
import pkgutil
import random
import re
import sys
import warnings
from types import ModuleType

SPLITS = ("train", "eval")
SKIP = frozenset({
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "pydoc_data", "lib2to3",
    "distutils", "readline", "rlcompleter", "encodings", "ensurepip",
})
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`]+)`")  # :func:`name` -> name
_CODE_CHARS = set("=<>{}[]_\\|@#$%^~/")
_SENTENCE_END = re.compile(r"[.!?](?=\s)")


def split_of(module: str) -> str:
    return "eval" if hashlib.sha256(module.encode()).digest()[0] % 2 else "train"


def modules(split: str) -> list[str]:
    """The top-level standard-library modules of `split` that contributed text in this process."""
    _check(split)
    return sorted(m for m, s in _collect()[1].items() if s == split)


def paragraphs(split: str) -> tuple[str, ...]:
    """Every cleaned paragraph of `split`, in collection order."""
    _check(split)
    return _collect()[0][split]


def natural_text(split: str, n_chars: int, seed: int) -> str:
    """About `n_chars` characters (never more) of prose from `split`, in an order set by `seed`."""
    pool = list(paragraphs(split))
    rng = random.Random(f"{split}:{seed}")
    parts: list[str] = []
    size = 0
    while size < n_chars + 1:
        order = pool[:]
        rng.shuffle(order)
        for p in order:
            parts.append(p)
            size += len(p) + 2
            if size >= n_chars + 1:
                break
    text = "\n\n".join(parts)[: n_chars + 1]
    ends = [m.end() for m in _SENTENCE_END.finditer(text)]
    cut = ends[-1] if ends else text.rfind(" ")
    return text[: cut if cut > 0 else n_chars].rstrip()


def _check(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")


@functools.lru_cache(maxsize=1)
def _collect() -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """({split: paragraphs}, {module: split}) for every module that gave text."""
    seen: set[str] = set()
    by_split: dict[str, list[str]] = {s: [] for s in SPLITS}
    owner: dict[str, str] = {}
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP:
            continue
        with warnings.catch_warnings():  # deprecated modules and attributes warn when touched
            warnings.simplefilter("ignore")
            found = [p for doc in _docstrings(name) for p in clean(doc)]
        fresh = [p for p in found if p not in seen]
        seen.update(fresh)
        if fresh:
            owner[name] = split_of(name)
            by_split[owner[name]].extend(dict.fromkeys(fresh))
    return {s: tuple(ps) for s, ps in by_split.items()}, owner


def _quiet_import(name: str) -> ModuleType | None:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return importlib.import_module(name)
        except (Exception, SystemExit):  # platform-specific or broken optional modules
            return None


def _docstrings(top: str) -> list[str]:
    """Own docstrings of `top`, its public submodules and their public classes, functions, methods."""
    root = _quiet_import(top)
    if root is None:
        return []
    found = [root]
    if hasattr(root, "__path__"):
        for info in pkgutil.walk_packages(root.__path__, top + "."):
            if any(part.startswith("_") or part in ("test", "tests") for part in info.name.split(".")):
                continue
            sub = _quiet_import(info.name)
            if sub is not None:
                found.append(sub)
    docs: list[str] = []
    for module in found:
        docs.append(module.__doc__ or "")
        for key, obj in sorted(vars(module).items()):
            if key.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            if _base(getattr(obj, "__module__", None) or "") != top:
                continue  # imported from elsewhere
            docs.append(_own_doc(obj))
            if inspect.isclass(obj):
                docs += [_own_doc(v) for k, v in sorted(vars(obj).items())
                         if not k.startswith("_") and (inspect.isroutine(v) or isinstance(v, property))]
    return [d for d in docs if d]


def _base(module: str) -> str:
    return module.split(".")[0].lstrip("_")


def _own_doc(obj) -> str:
    doc = obj.__doc__ if isinstance(getattr(obj, "__doc__", None), str) else ""
    return inspect.cleandoc(doc) if doc else ""


def clean(doc: str) -> list[str]:
    """Prose paragraphs of one docstring (see the module doc for the rules)."""
    kept = []
    for para in re.split(r"\n\s*\n", doc):
        lines = para.split("\n")
        if any(line.startswith((" ", "\t", ">>>", "...")) for line in lines):
            continue
        text = _ROLE.sub(r"\1", " ".join(line.strip() for line in lines))
        text = re.sub(r"\s+", " ", text.replace("`", "")).strip()
        if len(text) < 40 or len(text.split()) < 6 or not text[0].isupper() or not text.endswith("."):
            continue
        if sum(c in _CODE_CHARS for c in text) > 0.02 * len(text):
            continue
        kept.append(text)
    return kept
