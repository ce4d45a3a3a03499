"""The GPU lanes' cell files (tools/gpu/cells/*.txt): every line is a `localchat bench` argument list that parses
and names its cells, so a lent GPU's few minutes are not lost to a typo (tools/gpu/lanes.sh runs them there)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from localchat.cli import main

CELLS = sorted((Path(__file__).parents[1] / "tools" / "gpu" / "cells").glob("*.txt"))


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_there_are_cell_files():
    assert {p.name for p in CELLS} >= {"heads.txt", "long.txt"}


@pytest.mark.parametrize("path", CELLS, ids=lambda p: p.name)
def test_every_line_is_a_bench_dry_run(path, tmp_path, capsys):
    lines = _lines(path)
    assert lines
    for i, line in enumerate(lines):
        args = shlex.split(line)
        assert "-n" in args, f"{path.name}:{i}: name N per line"
        assert "--out" not in args and "--in-process" not in args, "lanes.sh adds these"
        out = tmp_path / str(i)
        assert main(["bench", "--weights", "fp32", *args, "--in-process", "--out", str(out), "--dry-run"]) == 0, line
        listed = capsys.readouterr().out
        assert " left" in listed, line  # the dry run listed its cells
