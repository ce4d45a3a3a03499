"""bench/results/README.md indexes every folder and file of bench/results/, and only what is there."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def indexed(readme: str) -> set[str]:
    """The entries a results index links to in its table: `folder/` or `file`."""
    return {m.group(1) for m in re.finditer(r"^\| \[`([^`]+)`\]\(", readme, re.MULTILINE)}


def entries(results: Path) -> set[str]:
    return {p.name + "/" if p.is_dir() else p.name for p in results.iterdir() if p.name != "README.md"}


def test_every_result_is_indexed_and_every_row_exists() -> None:
    listed = indexed((RESULTS / "README.md").read_text())
    assert entries(RESULTS) - listed == set(), "not in bench/results/README.md"
    assert listed - entries(RESULTS) == set(), "indexed but not in bench/results/"


def test_the_index_check_sees_a_missing_row(tmp_path: Path) -> None:
    (tmp_path / "run-a").mkdir()
    (tmp_path / "run-b").mkdir()
    (tmp_path / "note.md").write_text("x")
    readme = "| entry | what |\n|---|---|\n| [`run-a/`](run-a/README.md) | a |\n| [`note.md`](note.md) | n |\n"
    assert entries(tmp_path) - indexed(readme) == {"run-b/"}
