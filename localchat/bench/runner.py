"""The benchmark grid: tasks × lengths × policies × budgets × N seeded examples, into one JSONL file.

Each cell (task, length, policy, budget) runs in a fresh `python -m localchat.bench.cell` process, so
its peak RSS is its own (on CUDA the peak is `torch.cuda.max_memory_allocated` per example);
`in_process=True` runs the cells here instead (tests; memory figures are then the whole process's).
Resumable: an example whose settings already have a row in OUT/results.jsonl is not run again, and a
cell with nothing left is skipped. Several processes may run the same command on one OUT at once (one per
core): each example is claimed before it runs (`lanes`), and a cell is re-checked just before it starts. `full` ignores budgets (one cell set, budget null).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

from localchat.bench import lanes
from localchat.bench.cell import Cell, row_key, run_cell
from localchat.bench.lanes import read_rows
from localchat.bench.machine import cpu_model
from localchat.bench.tasks import ANSWER_TOKENS, TASKS
from localchat.engine.cache import POSITION_MODES
from localchat.engine.policies import POLICIES
from localchat.errors import UserError

RESULTS = "results.jsonl"
MAX_LENGTH = 128 * 1024
MAX_LENGTHS = {"passkeys": 1024 * 1024, "passkey": 1024 * 1024}  # repeated filler reaches further (a 1M document)
MIN_LENGTH = 64



def require_results(*directories: Path | None) -> None:
    """A one-line error for a directory (of those given) without a results file."""
    for d in directories:
        if d is not None and not (d / RESULTS).exists():
            raise UserError(f"no {RESULTS} in {d}")


def publish(text: str, out: str | None) -> int:
    """Print a generated table, and write it to `out` when one is named (the evidence commands' --out)."""
    if out:
        Path(out).write_text(text)
    print(text)
    return 0


@dataclass
class BenchConfig:
    tasks: list[str]
    lengths: list[int]
    policies: list[str]
    budgets: list[int]
    n: int
    out: Path
    model: str | None = None
    heads: str | None = None
    chunk: int | None = None
    positions: str | None = None
    seed: int = 0
    answer_tokens: int | None = None  # None: each task's own limit (tasks.ANSWER_TOKENS)
    turns: list[int] | None = None  # multiturn only: unrelated turns (None: the task's default, 9)
    examples: list[int] | None = None  # --examples: these of range(n), in this order (None: all, in order)
    in_process: bool = False
    weights: list[str | None] = field(default_factory=lambda: [None])  # --weights axis (None: device dtype)
    kv: list[str | None] = field(default_factory=lambda: [None])  # --kv axis (None: unquantized)
    sparse_prefill: float | None = None  # omnikv cells: --sparse-prefill R
    max_copies: int | None = None  # locret cells: --max-copies N
    focus: int | None = None  # locret cells: --focus K
    focus_window: int | None = None  # with --focus: --focus-window N (None: LOCRET's default)
    focus_spread: int | None = None  # with --focus: --focus-spread N (None: LOCRET's default)
    command: str = ""
    engines: dict = field(default_factory=dict, repr=False)  # in-process: loaded engines by (model, chunk)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def check(config: BenchConfig) -> None:
    """Raise UserError naming the first bad setting."""
    def pick(kind: str, names: list[str], known) -> None:
        for name in names:
            if name not in known:
                raise UserError(f"unknown {kind} {name!r}; choose from: {', '.join(known)}")
        if not names:
            raise UserError(f"no {kind} given")

    pick("task", config.tasks, TASKS)
    pick("policy", config.policies, POLICIES)
    if not config.lengths:
        raise UserError("no length given")
    for task, length in itertools.product(config.tasks, config.lengths):
        top = MAX_LENGTHS.get(task, MAX_LENGTH)
        if not MIN_LENGTH <= length <= top:
            raise UserError(f"length {length} is out of range{'' if top == MAX_LENGTH else f' for {task}'}; "
                            f"use {MIN_LENGTH} to {top} tokens")
    _applies(config.sparse_prefill, "prefill_ratio", "--sparse-prefill", config.policies)
    if config.sparse_prefill is not None and config.sparse_prefill <= 0:
        raise UserError(f"--sparse-prefill must be above 0 (the paper's R = 2), not {config.sparse_prefill:g}")
    _applies(config.max_copies, "max_copies", "--max-copies", config.policies)
    if config.max_copies is not None and config.max_copies < 1:
        raise UserError(f"--max-copies must be at least 1 in a benchmark (leave it out for no cap), not {config.max_copies}")
    _applies(config.focus, "focus", "--focus", config.policies)
    if config.focus is not None and config.focus < 1:
        raise UserError(f"--focus must be at least 1 in a benchmark (leave it out to read every kept unit), not {config.focus}")
    for value, flag, low in ((config.focus_window, "--focus-window", 1), (config.focus_spread, "--focus-spread", 0)):
        if value is not None and config.focus is None:
            raise UserError(f"{flag} sets how --focus picks; add --focus K or drop {flag}")
        if value is not None and value < low:
            raise UserError(f"{flag} must be at least {low}, not {value}")
    if any(POLICIES[p].uses_budget() for p in config.policies) and not config.budgets:
        raise UserError("evicting (and selecting) policies need --budgets")
    for value, what in [*((b, "budget") for b in config.budgets), (config.n, "-n"),
                        (config.chunk, "--chunk"), (config.answer_tokens, "--answer-tokens")]:
        if value is not None and value < 1:
            raise UserError(f"{what} must be at least 1 (got {value})")
    wrong = [i for i in config.examples or [] if not 0 <= i < config.n]
    if wrong:
        raise UserError(f"--examples picks from 0 to {config.n - 1} (-n {config.n}), not {wrong[0]}")
    if any(t < 0 for t in config.turns or []):
        raise UserError("--turns must be 0 or more")
    if config.positions is not None and config.positions not in POSITION_MODES:
        raise UserError(f"unknown position mode {config.positions!r}; choose from: {', '.join(POSITION_MODES)}")
    needs_heads = [p for p in config.policies if "heads" in POLICIES[p].fields()]
    if needs_heads and not config.heads and not _ships_heads(config.model):
        raise UserError(f"{needs_heads[0]} needs retaining heads and none ship for this model yet; pass --heads DIR, "
                        "or --heads random (an ablation)")


def _applies(value, option: str, flag: str, policies: list[str]) -> None:
    """A policy's own option given to a bench run: refused unless a policy that has it is in --policies."""
    takes = [p for p in POLICIES if option in POLICIES[p].options]
    if value is not None and not set(takes) & set(policies):
        raise UserError(f"{flag} applies to {', '.join(takes)}; add it to --policies or drop {flag}")


def _ships_heads(model: str | None) -> bool:
    from localchat.planning.resolve import card_for, shipped_heads_dir

    return shipped_heads_dir(card_for(model)) is not None


def default_chunk(model: str | None) -> int:
    """The chunk the engine will use for `model` (its card's, else the engine default)."""
    from localchat.engine.cards import card_chunk, default_card, find_card

    card = default_card() if model is None else find_card(model)
    return card_chunk(card)


def plan(config: BenchConfig) -> list[Cell]:
    chunk = config.chunk or default_chunk(config.model)
    cells = []
    for task in config.tasks:
        for length in config.lengths:
            for policy in config.policies:
                cls = POLICIES[policy]
                for budget, turns, weights, kv in itertools.product(
                        config.budgets if cls.uses_budget() else [None],
                        (config.turns or [None]) if task == "multiturn" else [None], config.weights, config.kv):
                    cells.append(Cell(
                        task=task, length=length, policy=policy, budget=budget, n=config.n, seed=config.seed,
                        model_spec=config.model, heads=config.heads if "heads" in cls.fields() else None, chunk=chunk,
                        positions=config.positions or cls.positions_default(),
                        max_new_tokens=config.answer_tokens or ANSWER_TOKENS[task], turns=turns,
                        weights=weights, kv=kv,
                        sparse_prefill=config.sparse_prefill if "prefill_ratio" in cls.options else None,
                        max_copies=config.max_copies if "max_copies" in cls.options else None,
                        focus=config.focus if "focus" in cls.options else None,
                        focus_window=config.focus_window if "focus" in cls.options else None,
                        focus_spread=config.focus_spread if "focus" in cls.options else None,
                    ))
    return cells


def finished(path: Path) -> set[str]:
    """Keys of the examples that already have a row; a torn last line (a killed run) is cut off."""
    lanes.cut_torn_line(path)
    return {row_key(row) for row in read_rows(path)}


def _left(path: Path, cell: Cell, examples: list[int]) -> list[int]:
    """Of `examples`, those with no row yet and not being run by another process (a lane) now."""
    done = {row_key(row) for row in read_rows(path)}
    return [i for i in examples if cell.key(i) not in done and not lanes.busy(path, cell.key(i))]


def _todo(config: BenchConfig, done: set[str]) -> list[tuple[Cell, list[int]]]:
    """Each planned cell with the example indices that have no row yet."""
    return [(cell, [i for i in _order(config) if cell.key(i) not in done]) for cell in plan(config)]


def _order(config: BenchConfig) -> list[int]:
    """The example indices each cell runs, in order: `--examples` (once each), else 0 .. n-1."""
    return list(dict.fromkeys(config.examples)) if config.examples is not None else list(range(config.n))


def dry_run(config: BenchConfig) -> list[str]:
    """What `run` would do, without running it: each cell with examples left, and a time estimate.

    The estimate is the median `wall_s` of the closest rows already in OUT/results.jsonl, times the
    examples left: rows of this CPU before other machines' (timings differ several-fold between CPUs),
    then the same length, policy and task before the same length and any policy or task (rows of other tasks
    scaled by `_task_factor`); cells with no row at their length count as unknown. Examples that other processes
    (lanes) hold now are counted, and the estimate is also given per lane.
    """
    check(config)
    path = config.out / RESULTS
    rows = read_rows(path)
    todo = _todo(config, {row_key(r) for r in rows})
    lines, seconds, unknown, left_total, live = [], 0.0, 0, 0, 0
    cpu = cpu_model()
    for cell, examples in todo:
        left = len(examples)
        if not left:
            continue
        left_total += left
        live += lanes.running(path, [cell.key(i) for i in examples])
        per, source = _estimate(rows, cell, cpu)
        if per is None:
            unknown += left
            lines.append(f"{cell.label()}: {left} left, no timing yet")
        else:
            seconds += per * left
            lines.append(f"{cell.label()}: {left} left, about {per * left / 60:.0f} min at {per:.1f} s each{source}")
    eta = _about(seconds) + (f" plus {unknown} examples with no timing yet" if unknown else "")
    lines.append(f"{left_total} of {len(todo) * len(_order(config))} examples left in {path}; {eta} for one process "
                 "(rows' median wall_s)")
    if live:  # each lane runs one example at a time, so the examples held now count the lanes at work
        lines.append(f"{live} of them running now in other processes (lanes): {_about(seconds / live)} "
                     f"with {live} lanes")
    return lines


def _about(seconds: float) -> str:
    return f"about {seconds / 60:.0f} min" if seconds < 3600 else f"about {seconds / 3600:.1f} h"


def _estimate(rows: list[dict], cell: Cell, cpu: str) -> tuple[float | None, str]:
    """(median wall_s of the closest timed rows, a note on where they come from) for `cell`."""
    timed = [r for r in rows if r.get("length") == cell.length and r.get("wall_s")]
    here = [r for r in timed if (r.get("hardware") or {}).get("cpu") == cpu]
    for pool, machines in ((here, []), (timed, ["other machines"])):
        for match, others in ((("policy", "task"), []), (("policy",), ["other tasks"]), ((), ["other policies"])):
            same = [r["wall_s"] for r in pool if all(r.get(f) == getattr(cell, f) for f in match)]
            if same:
                differ = others + machines
                factor = _task_factor(rows, cell) if match == ("policy",) else 1.0
                if factor != 1.0:
                    differ = [f"{differ[0]} x{factor:.2f}, {cell.task}'s ratio to them at other lengths", *differ[1:]]
                return median(same) * factor, f" (rows of {', '.join(differ)})" if differ else ""
    return None, ""


def _task_factor(rows: list[dict], cell: Cell) -> float:
    """How much longer `cell.task` takes than the policy's other tasks (multiturn: its follow-ups), as the median
    ratio over the other lengths (and CPUs) where rows of both exist; 1.0 with none."""
    groups: dict[tuple, tuple[list, list]] = {}
    for r in rows:
        if r.get("wall_s") and r.get("policy") == cell.policy and r.get("length") != cell.length:
            pair = groups.setdefault((r.get("length"), (r.get("hardware") or {}).get("cpu")), ([], []))
            pair[r.get("task") == cell.task].append(r["wall_s"])
    ratios = [median(same) / median(other) for other, same in groups.values() if same and other]
    return median(ratios) if ratios else 1.0


def run(config: BenchConfig, say: Callable[[str], None] = _stderr) -> Path:
    check(config)
    config.out.mkdir(parents=True, exist_ok=True)
    path = config.out / RESULTS
    done = finished(path)
    todo = _todo(config, done)
    total = len(todo) * len(_order(config))
    at = total - sum(len(examples) for _, examples in todo)
    say(f"bench: {len(todo)} cells, {total} examples, {at} already in {path}")
    for cell, examples in todo:
        examples = _left(path, cell, examples) if examples else []  # another lane may have run them meanwhile
        if not examples:
            continue
        if config.in_process:
            key = (cell.model_spec, cell.chunk, cell.weights)
            if key not in config.engines:
                from localchat.bench.cell import load_engine

                _drop_engines(config.engines)  # one model resident: a CUDA peak must not count another's weights
                config.engines[key] = load_engine(cell)
            run_cell(cell, examples, path, engine=config.engines[key], memory="in-process",
                     progress=(at, total), command=config.command, say=say)
        else:
            _run_subprocess(cell, examples, path, (at, total), config.command)
        at += len(examples)
    say(f"bench: results in {path}; tables and plots: localchat bench report {config.out}")
    return path


def _drop_engines(engines: dict) -> None:
    import gc

    import torch

    engines.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _run_subprocess(cell: Cell, examples: list[int], path: Path, progress: tuple[int, int], command: str) -> None:
    spec = {"cell": asdict(cell), "examples": examples, "out": str(path), "progress": list(progress),
            "command": command}
    proc = subprocess.Popen([sys.executable, "-m", "localchat.bench.cell", json.dumps(spec)],
                            stderr=subprocess.PIPE, text=True)
    last = ""
    assert proc.stderr is not None
    for line in proc.stderr:  # pass the cell's lines through; its error line is raised here instead
        last = line.strip() or last
        if not line.startswith("localchat: error: "):
            sys.stderr.write(line)
            sys.stderr.flush()
    code = proc.wait()
    if code == 2:
        raise UserError(last.removeprefix("localchat: error: "))
    if code != 0:
        raise RuntimeError(f"cell {cell.label()} failed with exit code {code}: {last}")
