"""`localchat bench report DIR`: DIR/results.jsonl -> DIR/report.md and PNG plots.

Accuracy is the mean score over the examples of a cell (for common_words the mean recall, for passkeys the
mean share of the five keys found; its keys also get a table by depth); rows with
an error (e.g. a prompt past the model's window) are counted apart and left out of every mean. Plots
need matplotlib (the `plot` extra); without it only report.md is written, with a one-line notice.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from statistics import mean, median

from localchat.bench.runner import RESULTS, read_rows
from localchat.errors import UserError

PLOT_NOTICE = "plots need `pip install 'localchat[plot]'` (matplotlib is not installed); wrote report.md only"
MIB = 2**20


def load_rows(directory: Path) -> list[dict]:
    path = directory / RESULTS
    if not path.is_file():
        raise UserError(f"no {RESULTS} in {directory}; run `localchat bench ... --out {directory}` first")
    rows = read_rows(path)
    if not rows:
        raise UserError(f"{path} holds no results yet")
    for row in rows:  # runs with different retaining heads are different rows of every table
        if row.get("heads"):
            row["policy"] = f"locret[{Path(str(row['heads'])).name}]"
        for name in ("weights", "kv"):  # quantized runs are rows of their own
            if row.get(name):
                row["policy"] += f" {name}={row[name]}"
        if row.get("sparse_prefill"):  # OmniKV reading with the filter layers' choice
            row["policy"] += f" sparse-prefill={row['sparse_prefill']:g}"
        if row.get("max_copies"):  # LOCRET with a cap on one token's copies per head
            row["policy"] += f" max-copies={row['max_copies']}"
        if row.get("focus"):  # LOCRET answering from the units the question attends to
            row["policy"] += f" focus={row['focus']}"
            for name in ("focus_window", "focus_spread"):
                if row.get(name) is not None:
                    row["policy"] += f" {name.replace('_', '-')}={row[name]}"
        default = _default_positions(row["policy"].split("[")[0].split()[0])
        if default and row.get("positions") and row["positions"] != default:
            row["policy"] += f" positions={row['positions']}"  # e.g. an evicting policy at original positions
        row["machine"] = machine(row)
        if row.get("turns") is not None:  # multiturn with a set number of unrelated turns
            row["task"] = f"{row['task']}[{row['turns']} turns]"
    return rows


def _default_positions(policy: str) -> str | None:
    from localchat.engine.policies import POLICIES

    cls = POLICIES.get(policy)  # a policy that keeps every unit has the same positions either way: None
    return cls.positions_default() if cls is not None and cls.evicts else None


def _ordered(values: Iterable) -> list:
    """Distinct values: numbers ascending (None first), anything else in order of appearance."""
    seen = list(dict.fromkeys(values))
    if all(v is None or isinstance(v, int) for v in seen):
        return sorted(seen, key=lambda v: -1 if v is None else v)
    return seen


def _group(rows: list[dict], *fields: str) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[tuple(row.get(f) for f in fields)].append(row)
    return groups


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r.get("error")]


def _budget(b) -> str:
    return "-" if b is None else str(b)


def _table(header: list[str], body: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in line) + " |" for line in body)]


def _accuracy_cell(rows: list[dict]) -> str:
    ok = _ok(rows)
    errors = len(rows) - len(ok)
    if not ok:
        return f"error ({errors})"
    text = f"{mean(r['score'] for r in ok):.2f} (n={len(ok)})"
    return text + (f", {errors} err" if errors else "")


def accuracy_table(rows: list[dict]) -> list[str]:
    lengths = _ordered(r["length"] for r in rows)
    groups = _group(rows, "task", "policy", "budget", "length")
    body = []
    for task in _ordered(r["task"] for r in rows):
        for policy in _ordered(r["policy"] for r in rows if r["task"] == task):
            for budget in _ordered(r["budget"] for r in rows if r["task"] == task and r["policy"] == policy):
                cells = [_accuracy_cell(groups[(task, policy, budget, n)]) if groups.get((task, policy, budget, n))
                         else "" for n in lengths]
                body.append([task, policy, _budget(budget), *cells])
    return _table(["task", "policy", "budget", *(f"{n} tokens" for n in lengths)], body)


def side_by_side(rows: list[dict]) -> list[str]:
    """One table per (length, budget): every policy against every task, best mean first.

    A cell is the mean score with N; budget-less rows (`full`) stand in every table of their length as the
    reference. "mean" averages the policy's task means, only when it has every task of the table.
    """
    ok = _ok(rows)
    groups = _group(ok, "task", "policy", "budget", "length")
    lines: list[str] = []
    for length in _ordered(r["length"] for r in ok):
        here = [r for r in ok if r["length"] == length]
        for budget in [b for b in _ordered(r["budget"] for r in here) if b is not None]:
            table = [r for r in here if r["budget"] in (None, budget)]
            tasks = _ordered(r["task"] for r in table)
            body = []
            for policy, b in dict.fromkeys((r["policy"], r["budget"]) for r in table):
                cells = [groups.get((t, policy, b, length)) for t in tasks]
                means = [mean(r["score"] for r in g) for g in cells if g]
                whole = len(means) == len(tasks)
                body.append((mean(means) if whole else -1.0, [
                    policy if b is not None else f"{policy} (no budget)",
                    *(f"{mean(r['score'] for r in g):.2f} ({len(g)})" if g else "" for g in cells),
                    f"{mean(means):.2f}" if whole else ""]))
            body.sort(key=lambda item: -item[0])  # stable: policies of equal mean keep their order
            lines += [f"{length} tokens, budget {budget}:", "",
                      *_table(["policy", *tasks, "mean"], [line for _, line in body]), ""]
    return lines


def keys_table(rows: list[dict]) -> list[str]:
    """passkeys: the share of the keys found at each depth per cell, with N; empty when no row has `keys`."""
    keyed = [r for r in _ok(rows) if r.get("keys")]
    if not keyed:
        return []
    depths = sorted({k["depth"] for r in keyed for k in r["keys"]})
    body = []
    for (task, policy, budget, length), group in _group(keyed, "task", "policy", "budget", "length").items():
        found = [[k["found"] for r in group for k in r["keys"] if k["depth"] == d] for d in depths]
        body.append([task, policy, _budget(budget), length, len(group),
                     *(f"{mean(f):.2f}" if f else "" for f in found)])
    return _table(["task", "policy", "budget", "length", "N", *(f"depth {d:g}" for d in depths)], body)


def _kept(row: dict) -> float | None:
    value = row.get("answer_kept")
    return row.get("needle_kept") if value is None else value


def kept_table(rows: list[dict]) -> list[str]:
    """Mean share of the answer's tokens (multiturn, passkeys: the needle's) still cached after answering, over
    layers and KV heads, with how many rows have it; empty when no row records it."""
    kept = [r for r in _ok(rows) if _kept(r) is not None]
    if not kept:
        return []
    lengths = _ordered(r["length"] for r in kept)
    groups = _group(kept, "task", "policy", "budget", "length")
    body = []
    for task, policy, budget in dict.fromkeys((r["task"], r["policy"], r["budget"]) for r in kept):
        cells = []
        for n in lengths:
            group = groups.get((task, policy, budget, n), [])
            cells.append(f"{mean(_kept(r) for r in group):.2f} (n={len(group)})" if group else "")
        body.append([task, policy, _budget(budget), *cells])
    return _table(["task", "policy", "budget", *(f"{n} tokens" for n in lengths)], body)


def machine(row: dict) -> str:
    """What a row's timings were taken on: the CPU (or GPU) and torch's thread count."""
    hw = row.get("hardware") or {}
    threads = hw.get("torch_threads")
    name = f"{hw.get('cpu')}, {threads} thread{'s' if threads != 1 else ''}"
    return f"{hw['gpu']} ({name})" if hw.get("gpu") else name


def _setting_rows(rows: list[dict]) -> list[tuple[tuple, list[dict]]]:
    """(policy, budget, length, machine) groups in a stable order, error rows left out: timings taken on
    different machines (or thread counts) are never pooled."""
    groups = _group(_ok(rows), "policy", "budget", "length", "machine")
    order = [(p, b, n, m) for p in _ordered(r["policy"] for r in rows) for b in _ordered(r["budget"] for r in rows)
             for n in _ordered(r["length"] for r in rows) for m in _ordered(r["machine"] for r in rows)]
    return [(key, groups[key]) for key in order if groups.get(key)]


def _machine_column(rows: list[dict]) -> bool:
    return len({r["machine"] for r in rows}) > 1


def speed_table(rows: list[dict]) -> list[str]:
    body, with_machine = [], _machine_column(rows)
    for (policy, budget, length, where), group in _setting_rows(rows):
        followups = [f["total_s"] for r in group for f in (r.get("followups") or [])]
        body.append([
            policy, _budget(budget), length, *([where] if with_machine else []), len(group),
            f"{median(r['prompt_tokens'] for r in group):,.0f}",
            f"{median(r['prefill_tps'] for r in group):,.0f}",
            f"{1000 * median(r['prefill_s'] / r['prompt_tokens'] for r in group):.2f}",
            f"{median(r['decode_tps'] for r in group):.1f}", f"{median(r['ttft_s'] for r in group):.2f}",
            f"{median(followups):.2f}" if followups else "-",
        ])
    return _table(["policy", "budget", "length", *(["machine"] if with_machine else []), "N", "prompt tokens",
                   "prefill tok/s", "prefill ms/token", "decode tok/s", "TTFT s", "multiturn follow-up s"], body)


def memory_table(rows: list[dict]) -> list[str]:
    body, with_machine = [], _machine_column(rows)
    for (policy, budget, length, where), group in _setting_rows(rows):
        body.append([
            policy, _budget(budget), length, *([where] if with_machine else []), len(group),
            f"{mean(r['kv_bytes'] for r in group) / MIB:.1f}",
            f"{mean(r['kv_full_bytes'] for r in group) / MIB:.1f}", f"{mean(r['compression'] for r in group):.2f}x",
            f"{max(r['peak_memory_bytes'] for r in group) / MIB:,.0f}",
            f"{max(r.get('rss_after_load_bytes') or 0 for r in group) / MIB:,.0f}",
            ", ".join(sorted({r.get("memory_mode", "?") for r in group})),
        ])
    return _table(["policy", "budget", "length", *(["machine"] if with_machine else []), "N", "KV kept MiB", "KV full MiB", "compression",
                   "peak memory MiB", "after load MiB", "memory mode"], body)


def _commits(rows: list[dict]) -> str:
    """"; source commits a (N rows), b (M rows)" for rows that name the git commit they ran from, else ""."""
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        commit = (r.get("versions") or {}).get("commit")
        if commit:
            counts[commit] += 1
    if not counts:
        return ""
    named = sum(counts.values())
    rest = f", {len(rows) - named} rows from before commits were recorded" if named < len(rows) else ""
    return "; source commits " + ", ".join(f"{c} ({n} rows)" for c, n in counts.items()) + rest


def _setup_lines(rows: list[dict]) -> list[str]:
    first = rows[0]
    hw, ver = first.get("hardware", {}), first.get("versions", {})
    counts = defaultdict(int)
    for r in rows:
        counts[r["machine"]] += 1
    machines = "; ".join(f"{m} ({n} rows)" if len(counts) > 1 else m for m, n in counts.items())
    lines = [
        f"Model: {', '.join(_ordered(r.get('model') for r in rows))}; device "
        f"{', '.join(map(str, _ordered(r.get('device') for r in rows)))}; {hw.get('cores')} cores; {machines}.",
        f"Versions: torch {ver.get('torch')}, transformers {ver.get('transformers')}, "
        f"localchat {ver.get('localchat')}, Python {ver.get('python')}{_commits(rows)}.",
        f"Settings: chunk {', '.join(map(str, _ordered(r.get('chunk') for r in rows)))}; positions "
        f"{', '.join(map(str, _ordered(r.get('positions') for r in rows)))}; heads "
        f"{', '.join(str(h) for h in _ordered(r.get('heads') for r in rows) if h) or '-'}; seed "
        f"{', '.join(map(str, _ordered(r.get('seed') for r in rows)))}; greedy decoding.",
        f"Rows: {len(rows)} ({len(rows) - len(_ok(rows))} with errors), {min(r.get('time', '') for r in rows)} to "
        f"{max(r.get('time', '') for r in rows)}.",
    ]
    commands = [c for c in _ordered(r.get("command") for r in rows) if c]
    lines += [f"Command: `{c}`" for c in commands]
    return lines


def write_report(directory: Path, say: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> Path:
    rows = load_rows(directory)
    plots, notice = _plots(rows, directory)
    md = ["# localchat bench report", "", *(f"{line}  " for line in _setup_lines(rows)), "",
          "## Side by side (mean score (N) per task at one length and budget, best mean first)", "",
          *side_by_side(rows),
          "## Accuracy (mean score, N examples per cell)", "", *accuracy_table(rows), "",
          *_section("## Pass keys by depth (share of the keys found, each asked in its own turn of one conversation)",
                    keys_table(rows)),
          "## Speed (medians over the cell's examples: a run slowed for a while moves them little)", "", *speed_table(rows), "",
          "## Memory (KV bytes kept vs a full cache; peak memory is the cell's largest)", "", *memory_table(rows), ""]
    kept = kept_table(rows)
    if kept:
        md += ["## Answer kept (share of the answer's tokens in the document still cached after answering, "
               "over layers and KV heads; multiturn: the needle's first 20 tokens; passkeys: their mean over the "
               "five needles, each after its turn)", "", *kept, ""]
    if notice:
        md += [notice, ""]
        say(notice)
    if plots:
        md += ["## Plots", "", *(f"![{p.stem}]({p.name})" for p in plots), ""]
    path = directory / "report.md"
    path.write_text("\n".join(md), encoding="utf-8")
    return path


def _section(title: str, table: list[str]) -> list[str]:
    return [title, "", *table, ""] if table else []


def _plots(rows: list[dict], directory: Path) -> tuple[list[Path], str | None]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], PLOT_NOTICE
    written = [_accuracy_plot(plt, rows, task, directory) for task in _ordered(r["task"] for r in rows)]
    written += [_time_memory_plot(plt, rows, directory), _prefill_plot(plt, rows, directory)]
    return written, None


def _accuracy_plot(plt, rows: list[dict], task: str, directory: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    mine = _ok([r for r in rows if r["task"] == task])
    budgets = [b for b in _ordered(r["budget"] for r in mine) if b is not None]
    styles = {p: series_style(i) for i, p in enumerate(_ordered(r["policy"] for r in rows))}
    markers = {n: "osD^v<>"[i % 7] for i, n in enumerate(_ordered(r["length"] for r in rows))}
    for (policy, length), group in _group(mine, "policy", "length").items():
        by_budget = _group(group, "budget")
        style = {**styles[policy], "label": f"{policy} {length}"}
        if (None,) in by_budget:  # full: one level across every budget, dashed
            ax.axhline(mean(r["score"] for r in by_budget[(None,)]), **{**style, "linestyle": "--"})
            continue
        xs = [b for b in budgets if (b,) in by_budget]
        ax.plot(xs, [mean(r["score"] for r in by_budget[(b,)]) for b in xs], marker=markers[length],
                fillstyle="none", **style)
    if budgets:
        ax.set_xscale("log", base=2)
    ax.set(title=f"{task}: accuracy vs budget", xlabel="budget (units per KV head per layer)", ylabel="accuracy",
           ylim=(-0.05, 1.05))
    _legend_right(fig, ax)
    safe = re.sub(r"[^\w.-]+", "-", task).strip("-")  # multiturn[9 turns] -> multiturn-9-turns
    return _save(plt, fig, directory / f"accuracy-{safe}.png")


def _time_memory_plot(plt, rows: list[dict], directory: Path) -> Path:
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    series, several = _group(_ok(rows), "policy", "budget", "machine"), _machine_column(rows)
    for i, ((policy, budget, _), group) in enumerate(series.items()):
        by_length = sorted(_group(group, "length").items())
        xs = [length for (length,), _ in by_length]
        style = {**series_style(i), "marker": "o", "label": _label(policy, budget, group[0], several)}
        axes[0].plot(xs, [1000 * mean(r["prefill_s"] / r["prompt_tokens"] for r in g) for _, g in by_length], **style)
        axes[1].plot(xs, [1000 * mean(r["decode_s"] / max(r["new_tokens"], 1) for r in g) for _, g in by_length],
                     **style)
        axes[2].plot(xs, [max(r["peak_memory_bytes"] for r in g) / MIB for _, g in by_length], **style)
    for ax, title in zip(axes, ("prefill ms per prompt token", "decode ms per token", "peak memory MiB")):
        ax.set(title=title, xlabel="document tokens")
        ax.set_ylim(bottom=0)
    _legend_right(fig, axes[-1])  # one legend for the three panels: they share their series
    return _save(plt, fig, directory / "time-memory.png")


def _prefill_plot(plt, rows: list[dict], directory: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    groups, several = _setting_rows(rows), _machine_column(rows)
    lengths = _ordered(n for (_, _, n, _), _ in groups)
    labels = list(dict.fromkeys(_label(p, b, g[0], several) for (p, b, _, _), g in groups))
    width = 0.8 / max(len(lengths), 1)
    for j, length in enumerate(lengths):
        values = {_label(p, b, g[0], several): mean(r["prefill_tps"] for r in g)
                  for (p, b, n, _), g in groups if n == length}
        ax.bar([i + j * width for i in range(len(labels))], [values.get(label, 0) for label in labels], width,
               label=f"{length} tokens")
    ax.set_xticks([i + width * (len(lengths) - 1) / 2 for i in range(len(labels))], labels, rotation=20, fontsize=8)
    ax.set(title="prefill tokens/s per policy", ylabel="tokens/s")
    _legend_right(fig, ax)
    return _save(plt, fig, directory / "prefill-tps.png")


LINE_STYLES = ("-", "-.", ":", (0, (5, 1, 1, 1, 1, 1)))  # "--" is full attention's level in the accuracy plots


def series_style(i: int) -> dict:
    """Series i's colour and line: the ten default colours, then again with the next line style, so the
    eleven policies of the grid (and the dozens of policy x budget series) never share a look up to 40."""
    return {"color": f"C{i % 10}", "linestyle": LINE_STYLES[(i // 10) % len(LINE_STYLES)]}


def _label(policy: str, budget, row: dict, several: bool) -> str:
    label = policy if budget is None else f"{policy} b={budget}"
    return f"{label} [{short_machine(row)}]" if several else label


def short_machine(row: dict) -> str:
    """`machine` in legend size, still telling machines apart: 'Intel(R) Xeon(R) Processor', 2 threads -> 'Xeon 2t'
    (one CPU at 1 and 2 threads is two machines); a GPU row is named by its GPU: 'H100 80GB HBM3'."""
    hw = row.get("hardware") or {}
    if hw.get("gpu"):
        return hw["gpu"].replace("NVIDIA ", "")[:16]
    words = [w for w in re.sub(r"\((R|TM)\)", "", str(hw.get("cpu"))).split()
             if w not in {"Intel", "AMD", "Processor", "CPU"}]
    return f"{' '.join(words)[:16] or '?'} {hw.get('torch_threads') or '?'}t"


LEGEND_ROWS = 30  # entries per legend column; a big grid has dozens of series


def _legend_right(fig, ax) -> None:
    """The legend beside the plot, in as many columns as it needs, so it never hides the lines."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return
    columns = -(-len(handles) // LEGEND_ROWS)
    rows = min(len(handles), LEGEND_ROWS)
    width, height = fig.get_size_inches()
    fig.set_size_inches(width, max(height, 0.8 + 0.16 * rows))
    legend = ax.legend(handles, labels, fontsize=7, ncol=columns, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                       borderaxespad=0.0)
    legend.set_in_layout(False)  # tight_layout sizes the plots alone; _save widens the image to fit it


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    for ax in fig.axes:  # now the saved image widens to take in the legends
        if ax.get_legend() is not None:
            ax.get_legend().set_in_layout(True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
