"""The grid's evidence scripts: heads_targets.py --fill and grid_cross_check.py on small results files."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _script(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(policy, correct, example, weights=None, gpu=None, budget=1024, output="x", **extra):
    return {"task": "passkey", "length": 32768, "policy": policy, "budget": budget, "heads": None,
            "positions": "compact", "example": example, "weights": weights, "kv": None, "turns": None,
            "error": None, "correct": correct, "output": output, "hardware": {"gpu": gpu}, **extra}


def _write(directory: Path, rows) -> Path:
    directory.mkdir()
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def test_fill_takes_fp32_rows_only_for_cells_short_of_n(tmp_path, monkeypatch, capsys):
    targets = _script("heads_targets")
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
    monkeypatch.setattr(sys, "argv", ["heads_targets.py", str(cpu), "--fill", str(gpu)])
    targets.main()
    text = capsys.readouterr().out
    assert f"--fill {gpu}" in text and "| passkey 32,768 b=1024 compact | 0.95 | 0.90 | met |" in text


def test_cross_check_pairs_cpu_rows_with_fp32_gpu_rows(tmp_path):
    check = _script("grid_cross_check")
    cpu = _write(tmp_path / "cpu", [_row("locret", True, 0, output="12345"), _row("locret", True, 1, output="7")])
    gpu = _write(tmp_path / "gpu", [_row("locret", True, 0, "fp32", "H100", output="12345 "),
                                    _row("locret", False, 1, "fp32", "H100", output="8"),
                                    _row("locret", True, 1, "bf16", "H100", budget=512)])  # no bf16 pair
    lines = check.compare(check.fp32_rows(cpu), check.fp32_rows(gpu))
    assert lines[-1] == "| all | | | | | | 2 | 1 | 1 | 2 | 1 |"
