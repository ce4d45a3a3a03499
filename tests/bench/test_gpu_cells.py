"""The GPU lanes' cell files (tools/gpu/cells/*.txt): every line is a `localchat bench` argument list that parses
and names its cells, so a short GPU run is not lost to a typo (tools/gpu/lanes.sh runs them there)."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from localchat.cli import main

CELLS = sorted((Path(__file__).parents[2] / "tools" / "gpu" / "cells").glob("*.txt"))


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


def test_lanes_share_one_deadline(tmp_path):
    """Every lane stops LIMIT_S seconds after lanes.sh starts: on an H100 run each lane once took LIMIT_S from its
    own staggered start, and the device call ran past its limit with the rows still on the machine."""
    fake = tmp_path / "python"  # stands in for Python: the model check passes, each bench step hangs
    fake.write_text('#!/bin/sh\ncase "$*" in *" bench "*) echo started; exec sleep 60;; esac\nexit 0\n')
    fake.chmod(0o755)
    cells = tmp_path / "cells.txt"
    cells.write_text("--tasks passkey --lengths 4k --policies full --budgets 1024 -n 1\n")
    lanes = Path(__file__).parents[2] / "tools" / "gpu" / "lanes.sh"
    env = {**os.environ, "PY": str(fake), "LANES": "5", "LIMIT_S": "6"}
    t0 = time.monotonic()
    subprocess.run(["bash", str(lanes), str(cells), str(tmp_path / "out")], env=env, check=True, timeout=120)
    wall = time.monotonic() - t0
    started = sorted(p.name for p in (tmp_path / "out").glob("lane*.log"))
    # lanes 4 and 5 would start at 6 and 8 s: past the deadline (6 s, whole seconds as date +%s counts them)
    assert started == ["lane1.log", "lane2.log", "lane3.log"]
    assert all((tmp_path / "out" / name).read_text().startswith("started") for name in started)
    assert wall < 6 + 10, wall  # the deadline and timeout's kill grace; lane 5 on its own 6 s would end at 14 s
