"""The grid's evidence subcommands on small results files: `grid_targets.py --fill` (bench/experiments/), `bench cross-check`,
`bench side-by-side` and `bench plot-training` (crosscheck.py, side_by_side.py,
training_plot.py)."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest
from test_experiments import EXPERIMENTS, load

from localchat.bench import crosscheck, side_by_side, training_plot
from localchat.errors import UserError

targets = load(EXPERIMENTS / "grid_targets.py")


def _row(policy, correct, example, weights=None, gpu=None, budget=1024, output="x", **extra):
    return {"task": "passkey", "length": 32768, "policy": policy, "budget": budget, "heads": None,
            "positions": "compact", "example": example, "weights": weights, "kv": None, "turns": None,
            "error": None, "correct": correct, "output": output, "hardware": {"gpu": gpu}, **extra}


def _write(directory: Path, rows) -> Path:
    directory.mkdir()
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def test_fill_takes_fp32_rows_only_for_cells_short_of_n(tmp_path, capsys):
    n = targets.N
    cpu = _write(tmp_path / "cpu", [_row("locret", i < 19, i) for i in range(n)]  # 0.95, complete here
                 + [_row("h2o", True, i) for i in range(3)])  # 3 of N: too few, so it is filled
    gpu = _write(tmp_path / "gpu", [_row("locret", False, i, "fp32", "H100") for i in range(n)]
                 + [_row("h2o", i < 2, i, "fp32", "H100") for i in range(n)]
                 + [_row("snapkv", True, i, "bf16", "H100") for i in range(n)])  # not fp32: never used
    cells = targets.fill(targets.load(cpu), targets.load(gpu, weights="fp32"))
    key = ("passkey", 32768, "locret", 1024, "compact")
    assert cells[key].count(True) == 19 and not isinstance(cells[key], targets.Filled)  # the CPU's own cell stays
    h2o = targets.acc(cells, "passkey", 32768, "h2o", 1024)
    assert h2o == 0.10 and h2o.filled and targets.fmt(h2o) == "0.10†"
    assert targets.acc(cells, "passkey", 32768, "snapkv", 1024) is None  # bf16 rows do not count
    out = tmp_path / "targets.md"
    assert targets.main(Namespace(dir=str(cpu), fill=str(gpu), out=str(out))) == 0
    text = capsys.readouterr().out
    assert f"--fill {gpu}" in text and "| passkey 32,768 b=1024 compact | 0.95 | 0.90 | met |" in text
    assert out.read_text() + "\n" == text  # --out holds what was printed
    assert text.startswith(f"# LOCRET's accuracy targets on `{cpu}`")
    assert f"`python bench/experiments/grid_targets.py {cpu} " in text


def test_cross_check_pairs_cpu_rows_with_fp32_gpu_rows(tmp_path, capsys):
    cpu = _write(tmp_path / "cpu", [_row("locret", True, 0, output="12345"), _row("locret", True, 1, output="7")])
    gpu = _write(tmp_path / "gpu", [_row("locret", True, 0, "fp32", "H100", output="12345 "),
                                    _row("locret", False, 1, "fp32", "H100", output="8"),
                                    _row("locret", True, 1, "bf16", "H100", budget=512)])  # no bf16 pair
    lines = crosscheck.compare(crosscheck.fp32_rows(cpu), crosscheck.fp32_rows(gpu))
    assert lines[-1] == "| all | | | | | | 2 | 1 | 1 | 2 | 1 |"
    assert crosscheck.main(Namespace(a=str(cpu), b=str(gpu), out=None, weights_a="fp32", weights_b="fp32")) == 0
    text = capsys.readouterr().out
    assert f"`localchat bench cross-check {cpu} {gpu}`" in text and lines[-1] in text


def test_cross_check_pairs_fp32_rows_with_int4_rows(tmp_path, capsys):
    """The weights' precision on one machine: a CPU's fp32 rows (weights null) against its int4 rows."""
    fp32 = _write(tmp_path / "fp32", [_row("locret", True, 0, output="12345"), _row("locret", False, 1, output="9")])
    int4 = _write(tmp_path / "int4", [_row("locret", True, 0, "int4", output="12345"),
                                      _row("locret", True, 1, "int4", output="7"),
                                      _row("locret", True, 2, "int4")])  # no fp32 pair
    assert crosscheck.fp32_rows(int4) == {}  # int4 rows are not fp32 rows
    lines = crosscheck.compare(crosscheck.fp32_rows(fp32), crosscheck.fp32_rows(int4, "int4"))
    assert lines[-1] == "| all | | | | | | 2 | 1 | 1 | 1 | 2 |"
    assert crosscheck.main(Namespace(a=str(fp32), b=str(int4), out=None, weights_a="fp32", weights_b="int4")) == 0
    text = capsys.readouterr().out
    assert f"`localchat bench cross-check {fp32} {int4} --weights-b int4`" in text and lines[-1] in text


def test_side_by_side_means_over_tasks_and_medians_memory(tmp_path, capsys):
    rows = []
    for policy in side_by_side.POLICIES:
        for length in (4096, 7680):
            for budget in (256, 512, 1024):
                for task in side_by_side.TASKS:
                    for i in range(20):
                        good = policy == "locret" or (task == "passkey" and i < 10)
                        rows.append({"task": task, "length": length, "policy": policy,
                                     "budget": None if policy == "full" else budget, "heads": None,
                                     "positions": "compact", "score": float(good), "kv_bytes": (i + 1) * 2**20,
                                     "peak_memory_bytes": 100 * 2**20})
                if policy == "full":
                    break
    rows.append({**rows[0], "positions": "original", "score": 0.0})  # LOCRET at original positions: left out
    rows.append({**rows[0], "heads": "random", "score": 0.0})  # named heads: left out
    assert side_by_side.main(Namespace(dir=str(_write(tmp_path / "grid", rows)))) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| policy | 4K b=256 |") and len(lines) == 2 + len(side_by_side.POLICIES)
    assert lines[2] == "| locret | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 | 10.5 | 100 |"
    assert lines[3] == "| full | 0.12 | 0.12 | 0.12 | 0.12 | 0.12 | 0.12 | 10.5 | 100 |"


def test_subcommands_name_a_missing_results_file(tmp_path):
    with pytest.raises(UserError, match="no results.jsonl"):
        targets.main(Namespace(dir=str(tmp_path), fill=None, out=None))
    with pytest.raises(UserError, match="no results.jsonl"):
        crosscheck.main(Namespace(a=str(tmp_path), b=str(tmp_path), out=None))
    with pytest.raises(UserError, match="no results.jsonl"):
        side_by_side.main(Namespace(dir=str(tmp_path)))


def test_plot_training_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log = {"recipe": "test", "train": [{"step": s, "loss": 1.0 / s} for s in range(1, 30)],
           "eval": [{"step": s, "loss": 0.5 / s, "top10_overlap": 0.1 * s} for s in (10, 20)]}
    (tmp_path / "train-log.json").write_text(json.dumps(log))
    out = tmp_path / "curve.png"
    assert training_plot.main(Namespace(log=str(tmp_path / "train-log.json"), out=str(out))) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and capsys.readouterr().out.strip() == str(out)


def test_the_subcommands_run_from_the_cli(tmp_path, capsys):
    from localchat.cli import main

    grid = _write(tmp_path / "grid", [_row("locret", True, i, output="1") for i in range(targets.N)])
    out = tmp_path / "targets.md"
    assert targets.main([str(grid), "--out", str(out)]) == 0  # the script's own command line
    assert "| passkey 32,768 b=1024 compact | 1.00 | 0.90 | met |" in out.read_text()
    capsys.readouterr()
    assert main(["bench", "cross-check", str(grid), str(grid)]) == 0
    assert f"| all | | | | | | {targets.N} | {targets.N} |" in capsys.readouterr().out
    assert main(["bench", "side-by-side", str(tmp_path)]) == 2  # no results.jsonl: one line, exit 2
    assert main(["bench", "plot-training", str(tmp_path / "none.json"), str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "no results.jsonl" in err and "cannot read the training log" in err and "Traceback" not in err
