"""Several `localchat bench` processes on one results file: claims, the re-check before a cell, no example twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localchat.bench import lanes
from localchat.bench.runner import RESULTS, BenchConfig, plan, run

pytestmark = [pytest.mark.skipif(lanes.fcntl is None, reason="claims need fcntl (POSIX)"),
              pytest.mark.usefixtures("one_thread")]
ROOT = Path(__file__).resolve().parents[2]


def _holder(results: Path, key: str) -> subprocess.Popen:
    """Another process that claims `key` and keeps it until its stdin closes."""
    code = ("import sys; from pathlib import Path; from localchat.bench import lanes\n"
            f"c = lanes.claim(Path({str(results)!r}), {key!r})\n"
            "print('held' if c else 'busy', flush=True); sys.stdin.read()")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_claim_held_elsewhere_blocks_until_its_process_ends(tmp_path):
    results = tmp_path / RESULTS
    holder = _holder(results, "k1")
    try:
        assert lanes.claim(results, "k1") is None and lanes.busy(results, "k1")
        mine = lanes.claim(results, "k2")  # another key is free
        assert mine is not None and lanes.busy(results, "k2")  # a held claim is busy to any other opener
        mine.release()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # The holder is gone (as if killed): its claim file is still there, its lock is not.
    assert list((tmp_path / lanes.CLAIMS).iterdir())
    assert not lanes.busy(results, "k1")
    taken = lanes.claim(results, "k1")
    assert taken is not None
    taken.release()
    assert not list((tmp_path / lanes.CLAIMS).iterdir())


def test_rows_are_whole_lines_and_a_torn_tail_is_cut(tmp_path):
    results = tmp_path / RESULTS
    lanes.append_row(results, json.dumps({"a": 1}))
    lanes.append_row(results, json.dumps({"a": 2}) + "\n")
    with results.open("a") as f:
        f.write('{"a": 3, "torn')
    assert [r["a"] for r in lanes.read_rows(results)] == [1, 2]
    lanes.cut_torn_line(results)
    assert results.read_text() == '{"a": 1}\n{"a": 2}\n'


def _config(tiny_dir, out, **kw):
    return BenchConfig(tasks=["passkey"], lengths=[160], policies=["streaming"], budgets=[48], n=4, out=out,
                       model=tiny_dir, chunk=32, answer_tokens=2, in_process=True, **kw)


def test_the_runner_skips_an_example_another_process_is_running(tiny_dir, tmp_path):
    config = _config(tiny_dir, tmp_path)
    (cell,) = plan(config)
    results = tmp_path / RESULTS
    holder = _holder(results, cell.key(2))
    try:
        said = []
        run(config, say=said.append)
        assert sorted(r["example"] for r in lanes.read_rows(results)) == [0, 1, 3]
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    run(config, say=said.append)  # the other process ended without a row: example 2 is run now, once
    assert sorted(r["example"] for r in lanes.read_rows(results)) == [0, 1, 2, 3]


def test_the_cell_skips_an_example_that_got_a_row_after_the_runner_planned(tiny_dir, tmp_path):
    from localchat.bench.cell import run_cell

    config = _config(tiny_dir, tmp_path)
    (cell,) = plan(config)
    results = tmp_path / RESULTS
    lanes.append_row(results, json.dumps({**cell.__dict__, "example": 1, "score": 1.0}))
    said = []
    run_cell(cell, [0, 1], results, say=said.append, memory="in-process")
    assert sorted(r["example"] for r in lanes.read_rows(results)) == [0, 1]
    assert any("#1: run by another process, skipped" in line for line in said)


def test_two_processes_on_one_grid_run_every_example_once(tiny_dir, tmp_path):
    argv = [sys.executable, "-m", "localchat", "bench", "--model", tiny_dir, "--chunk", "32", "--answer-tokens", "2",
            "--tasks", "passkey,niah_single", "--lengths", "160", "--policies", "streaming,h2o", "--budgets", "48",
            "-n", "3", "--in-process", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    rows = lanes.read_rows(tmp_path / RESULTS)
    keys = [(r["task"], r["policy"], r["example"]) for r in rows]
    assert len(keys) == 12 and len(set(keys)) == 12  # 2 tasks x 2 policies x 3, none twice
    ran = [sum(line.startswith("bench [") for line in e.splitlines()) for e in errs]
    assert sum(ran) == 12  # each row was written by exactly one of the two


def test_dry_run_counts_the_examples_other_lanes_are_running(tiny_dir, tmp_path):
    from localchat.bench.runner import dry_run

    config = _config(tiny_dir, tmp_path)
    (cell,) = plan(config)
    results = tmp_path / RESULTS
    holders = [_holder(results, cell.key(i)) for i in (2, 3)]
    try:
        run(config, say=lambda _: None)  # rows for 0 and 1; 2 and 3 are "running" in the holders
        results.write_text(results.read_text().splitlines(keepends=True)[0])  # example 1's row is lost
        lines = dry_run(config)
    finally:
        for holder in holders:
            holder.stdin.close()
            holder.wait(timeout=30)
    assert lines[-2].startswith("3 of 4 examples left") and lines[-1].startswith("2 of them running now")
    minutes = float(lines[-2].split("about ")[1].split(" min")[0])  # tiny examples: well under an hour
    assert f"about {minutes / 2:.0f} min with 2 lanes" in lines[-1]
    assert len(list((tmp_path / lanes.CLAIMS).iterdir())) == 2  # no claim file was made to probe example 1
    assert dry_run(config)[-1].startswith("3 of 4 examples left")  # the holders ended: no live count
