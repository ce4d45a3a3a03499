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

`sections(split)`: reference text, uncleaned: one `Section` per documented module, public class,
function and method of the split's modules (the objects above, less properties), each a header line
(`module NAME`, `class NAME(SIGNATURE)` or `NAME(SIGNATURE)`, the signature read with
`inspect.signature`, `(...)` where it cannot be read) and the object's own docstring (`inspect.cleandoc`).
Defaults that are not plain values (None, bool, int, float, complex, str, bytes, tuples and lists of
those) show as `...`: their repr may hold a memory address or change between processes (set order).
The hooks of `sys` that a host may replace (`sys.excepthook`, ...) are left out. A docstring
already seen is kept once; a section with a paragraph that the other split holds (the
paragraph went to an earlier module of that split) is left out, so the splits stay disjoint. On
CPython 3.11 (Linux) the eval split has 2,411 sections, about 173K tokens of SmolLM2's tokenizer.
"""

from __future__ import annotations

import contextlib
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Section:
    """One documented object of the reference text."""
    name: str  # dotted name: "shlex.quote", "argparse.ArgumentParser.add_argument", "shlex" for a module
    kind: str  # "module", "class" or "function" (methods too)
    header: str  # "shlex.quote(s)", "class argparse.FileType(mode='r', ...)", "module shlex"
    doc: str
    defaults: tuple[tuple[str, str], ...]  # (parameter, repr of its default) of the plain defaults in the header

    @property
    def text(self) -> str:
        return f"## {self.header}\n{self.doc}"


def sections(split: str) -> tuple[Section, ...]:
    """The split's reference sections (see the module doc), in collection order."""
    _check(split)
    return _sections(split)


@functools.lru_cache(maxsize=2)
def _sections(split: str) -> tuple[Section, ...]:
    other = set(paragraphs("train" if split == "eval" else "eval"))
    seen: set[str] = set()
    kept = []
    for top in modules(split):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = [_section(name, kind, obj) for name, kind, obj in _objects(top)
                     if kind != "property" and not _hook(name)]
        for section in found:
            if section is None or section.doc in seen or any(p in other for p in clean(section.doc)):
                continue
            seen.add(section.doc)
            kept.append(section)
    return tuple(kept)


def _hook(name: str) -> bool:
    """sys.excepthook and the like (sys keeps the original as sys.__excepthook__): a host such as pytest may
    replace them, so they are left out and the sections do not depend on the process."""
    return name.startswith("sys.") and hasattr(sys, f"__{name[4:]}__")


def _section(name: str, kind: str, obj) -> Section | None:
    doc = _own_doc(obj) if kind != "module" else inspect.cleandoc(obj.__doc__ or "")
    if not doc.strip():
        return None
    if kind == "module":
        return Section(name, kind, f"module {name}", doc, ())
    signature, defaults = _signature(obj)
    header = f"class {name}{signature}" if kind == "class" else f"{name}{signature}"
    return Section(name, kind, header, doc, defaults)


class _Elided:
    def __repr__(self) -> str:
        return "..."


_ELIDED = _Elided()
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _plain(value) -> bool:
    if type(value) in (tuple, list):
        return all(_plain(v) for v in value)
    return type(value) in _PLAIN  # exact types: an enum or a str subclass may show process state


def _signature(obj) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The signature as the header shows it, and (parameter, repr of the default) of its plain defaults."""
    try:
        signature = inspect.signature(obj)
    except Exception:  # no signature (some builtins); inspect raises more than TypeError and ValueError
        return "(...)", ()
    params = [p if p.default is p.empty or _plain(p.default) else p.replace(default=_ELIDED)
              for p in signature.parameters.values()]
    text = str(signature.replace(parameters=params))
    if " at 0x" in text:  # an annotation that names a memory address
        return "(...)", ()
    shown = [p for p in params if p.default is not p.empty and p.default is not _ELIDED]
    return text, tuple((p.name, repr(p.default)) for p in shown)


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
    docs = [(obj.__doc__ or "") if kind == "module" else _own_doc(obj) for _, kind, obj in _objects(top)]
    return [d for d in docs if d]


def _objects(top: str) -> list[tuple[str, str, object]]:
    """(dotted name, kind, object) of `top`, its public submodules, their public classes and functions
    defined in `top`, and the public methods (and properties) of those classes; kind is "module",
    "class", "function" or "property" (methods are functions)."""
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
    objects: list[tuple[str, str, object]] = []
    for module in found:
        objects.append((module.__name__, "module", module))
        for key, obj in sorted(vars(module).items()):
            if key.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            if _base(getattr(obj, "__module__", None) or "") != top:
                continue  # imported from elsewhere
            name = f"{module.__name__}.{key}"
            objects.append((name, "class" if inspect.isclass(obj) else "function", obj))
            if inspect.isclass(obj):
                objects += [(f"{name}.{k}", "function" if inspect.isroutine(v) else "property", v)
                            for k, v in sorted(vars(obj).items())
                            if not k.startswith("_") and (inspect.isroutine(v) or isinstance(v, property))]
    return objects


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
