"""code_qa: questions about real source code, answered by copying one value (issue #40, item 3).

The document is a dump of real code: WINDOW-line windows of the standard library's eval-split source files (the
split of `localchat.bench.corpus`; no retaining-head training prompt held these files, `train/sources.py`), each
headed `# FILE, line N`, in a seeded order, with the asked window at the example's depth. The question asks
which value a module- or class-level constant is assigned ("In the provided code, what value is assigned to
NAME?"); nothing is planted or generated: the answer is the literal as the file writes it (read with `ast`).

A constant is asked when its one-line literal is an int, a float or a string with at least 3 letters or digits
that neither its name nor its file's name gives away, when its name is in at most MAX_NAME windows and assigned once, and its
literal in at most MAX_LITERAL; the other windows holding either are left out of that document, so the answer
stands only in the asked window. On CPython 3.11 (Linux) the pool has about 2,900 windows (about 780K tokens of
SmolLM2's tokenizer) and about 30 such constants. Scoring blanks the asked name in the output (models restate it,
and `_UNRECOGNIZED_ARGS_ATTR` holds `'_unrecognized_args'`), then a number must appear with its value (0x950412de
as hex or decimal, 20. as 20), a string with its letters and digits as whole words, as the value or as the literal writes it (quotes
and case ignored).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import random
import re
import sys
from collections import Counter
from decimal import Decimal, InvalidOperation
from pathlib import Path

from localchat.bench.corpus import SKIP, split_of

WINDOW = 30  # lines per window
MAX_NAME = 6  # windows that may name an asked constant (its own and its uses; the document keeps only its own)
MAX_LITERAL = 3  # windows that may hold its literal
QUESTION = "In the provided code, what value is assigned to {name}? Answer with the value only."
_NAME = re.compile(r"_?[A-Z][A-Z0-9_]{3,}|_?[a-z]\w*_\w{2,}")  # CONSTANT_CASE, or snake_case with an underscore


@dataclasses.dataclass(frozen=True)
class Constant:
    name: str
    literal: str  # as the file writes it
    window: int  # index of the window that assigns it
    file: str


@dataclasses.dataclass(frozen=True)
class CodePool:
    windows: tuple[str, ...]
    constants: tuple[Constant, ...]


def _files() -> list[Path]:
    """The eval split's top-level modules and, for packages, their public submodules (no tests)."""
    found = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP or split_of(name) != "eval":
            continue
        try:
            spec = importlib.util.find_spec(name)  # finds the file without importing the module
        except (ImportError, ValueError):
            continue
        if not (spec and spec.origin and spec.origin.endswith(".py")):
            continue
        origin = Path(spec.origin)
        if origin.name != "__init__.py":
            found.append(origin)
            continue
        for path in sorted(origin.parent.rglob("*.py")):
            parts = path.relative_to(origin.parent).parts
            if not any((p.startswith("_") and p != "__init__.py") or p.startswith("test") for p in parts):
                found.append(path)
    return found


def _label(path: Path) -> str:
    """`shutil.py`, `xml/dom/minidom.py`: the path below the standard library's folder."""
    for parent in path.parents:
        if parent.name.startswith("python3"):
            return str(path.relative_to(parent))
    return path.name


def _assigned(tree: ast.Module) -> list[tuple[str, ast.expr, int]]:
    """(name, value, line) of every one-target assignment at module level or in a top-level class body."""
    bodies = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
    return [(node.targets[0].id, node.value, node.lineno) for body in bodies for node in body
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and node.lineno == node.end_lineno]


def _letters(text: str) -> str:
    return re.sub(r"[\W_]", "", text).lower()


def _askable(name: str, value, label: str) -> bool:
    if not _NAME.fullmatch(name) or isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return False
    key = _letters(str(value))
    return len(key) >= 3 and key not in _letters(name) and key not in _letters(label)


@functools.lru_cache(maxsize=1)
def code_pool() -> CodePool:
    windows: list[str] = []
    found: list[Constant] = []
    for path in _files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError):
            continue
        label, lines, first = _label(path), source.splitlines(), len(windows)
        for start in range(0, len(lines), WINDOW):
            body = "\n".join(lines[start:start + WINDOW]).strip("\n")
            if body.strip():
                windows.append(f"# {label}, line {start + 1}\n{body}")
            else:
                windows.append("")  # keeps window indices aligned with line numbers; never used
        for name, node, line in _assigned(tree):
            literal = ast.get_source_segment(source, node)
            try:
                value = ast.literal_eval(node)
            except ValueError:
                continue
            if literal and len(literal) <= 40 and _askable(name, value, label):
                found.append(Constant(name, literal, first + (line - 1) // WINDOW, label))
    named = Counter(word for w in windows for word in set(re.findall(r"\w+", w)))  # windows naming each word
    once = Counter(c.name for c in found)
    constants = tuple(c for c in found if once[c.name] == 1 and named[c.name] <= MAX_NAME
                      and sum(c.literal in w for w in windows) <= MAX_LITERAL)
    return CodePool(tuple(windows), constants)


def asked_name(question: str) -> str:
    return re.search(r"assigned to (\S+)\?", question).group(1)


_NUMBER = re.compile(r"(?<![\w.])-?(?:0[xX][0-9a-fA-F_]+|0[oO][0-7_]+|0[bB][01_]+|\d[\d_]*\.?\d*(?:[eE][+-]?\d+)?|\.\d+)(?!\w)")


def _words(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def _number(text: str):
    try:
        return ast.literal_eval(text.rstrip("."))
    except (ValueError, SyntaxError):
        return None


def score_code_qa(answer: str, question: str, output: str) -> bool:
    """The literal `answer` in `output` once the asked name is blanked (module doc)."""
    output = re.sub(rf"(?<!\w){re.escape(asked_name(question))}(?!\w)", " ", output, flags=re.I)
    value = ast.literal_eval(answer)
    if isinstance(value, str):  # its letters and digits as the value or as the literal writes them ('\\n', r"\\$")
        said = f" {_words(output)} "
        return any(f" {_words(text)} " in said for text in (value, answer.lstrip("rRbBuU")[1:-1]))
    for found in _NUMBER.findall(output):
        number = _number(found)
        try:
            if number is not None and Decimal(repr(number)) == Decimal(repr(value)):
                return True
        except InvalidOperation:
            continue
    return False


def pick(seed: int) -> tuple[random.Random, Constant]:
    """The example's random stream and its constant."""
    rng = random.Random(seed)
    return rng, rng.choice(code_pool().constants)


def filler_for(constant: Constant) -> list[str]:
    """Every window but the asked one and those that hold its name or its literal."""
    pattern = re.compile(rf"\b{re.escape(constant.name)}\b")
    return ["\n\n" + w for i, w in enumerate(code_pool().windows)
            if w and i != constant.window and constant.literal not in w and not pattern.search(w)]
