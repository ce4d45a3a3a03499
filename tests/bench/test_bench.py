"""`localchat bench` on a tiny random Llama: JSONL rows, resume, the subprocess cell, report, perf, CLI errors."""

from __future__ import annotations

import json
import sys

import pytest

from localchat.bench.report import PLOT_NOTICE, write_report
from localchat.bench.runner import RESULTS, BenchConfig, run
from localchat.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")  # fixtures in conftest.py


def _rows(out):
    return [json.loads(line) for line in (out / RESULTS).read_text().splitlines()]


def _grid(argv_tail, tiny_dir, out):
    return ["bench", "--model", tiny_dir, "--chunk", "64", "--answer-tokens", "2", "--out", str(out), *argv_tail]


def test_runner_writes_rows_and_resumes(tiny_dir, tmp_path, capsys):
    out = tmp_path / "grid"
    argv = _grid(["--tasks", "passkey,niah_single", "--lengths", "256", "--policies", "full,locret",
                  "--budgets", "64", "-n", "2", "--heads", "random", "--in-process"], tiny_dir, out)
    assert main(argv) == 0
    rows = _rows(out)
    assert len(rows) == 8 and len({(r["task"], r["policy"], r["example"]) for r in rows}) == 8
    for r in rows:
        assert r["model_spec"] == tiny_dir and r["length"] == 256 and r["chunk"] == 64 and r["n"] == 2
        assert r["error"] is None and r["score"] in (0.0, 1.0) and r["correct"] == (r["score"] == 1.0)
        assert r["expected"] and isinstance(r["output"], str) and r["n_tokens"] <= 256
        assert r["prefill_s"] > 0 and r["prefill_tps"] > 0 and r["ttft_s"] >= r["prefill_s"]
        assert r["kv_bytes"] > 0 and r["kv_full_bytes"] >= r["kv_bytes"] and r["compression"] >= 1
        assert r["peak_memory_bytes"] > 0 and r["memory_mode"] == "in-process"
        assert r["hardware"]["cores"] and {"torch", "transformers", "localchat", "commit"} <= set(r["versions"])
        assert r["command"].startswith("localchat bench --tasks passkey,niah_single")
    full = [r for r in rows if r["policy"] == "full"]
    locret = [r for r in rows if r["policy"] == "locret"]
    assert all(r["budget"] is None and r["positions"] == "original" and r["heads"] is None for r in full)
    assert all(r["budget"] == 64 and r["positions"] == "compact" and r["heads"] == "random" for r in locret)
    assert all(r["stabilizers"] == 16 and r["compression"] > 1 for r in locret)
    assert sorted(r["depth"] for r in full if r["task"] == "passkey") == [0.0, 1.0]
    # Interrupted run: the last 3 rows are lost; a rerun does only those.
    lines = (out / RESULTS).read_text().splitlines(keepends=True)
    (out / RESULTS).write_text("".join(lines[:-3]) + lines[-3][:10])  # plus a torn line
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "8 examples, 5 already" in err and err.count("bench [") == 3
    keys = {(r["task"], r["policy"], r["example"]) for r in _rows(out) if "policy" in r}
    assert len(keys) == 8
    assert main(argv) == 0 and "8 already" in capsys.readouterr().err


def test_dry_run_lists_what_is_left_and_runs_nothing(tiny_dir, tmp_path, capsys):
    out = tmp_path / "grid"
    base = ["--tasks", "passkey", "--policies", "full,streaming", "--budgets", "64", "-n", "2", "--in-process"]
    assert main(_grid([*base, "--lengths", "256"], tiny_dir, out)) == 0
    lines = (out / RESULTS).read_text().splitlines(keepends=True)
    (out / RESULTS).write_text("".join(lines[:-1]))  # streaming's example 1 is lost
    capsys.readouterr()
    assert main(_grid([*base, "--lengths", "256,300", "--dry-run"], tiny_dir, out)) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len((out / RESULTS).read_text().splitlines()) == 3  # nothing ran
    assert printed[0].startswith("passkey 256 streaming b=64: 1 left, about ")
    assert "passkey 300 full: 2 left, no timing yet" in printed
    assert "passkey 300 streaming b=64: 2 left, no timing yet" in printed
    assert printed[-1].startswith("5 of 8 examples left") and "plus 4 examples with no timing yet" in printed[-1]


def test_examples_runs_those_in_that_order_with_the_full_runs_rows(tiny_dir, tmp_path, capsys):
    """--examples 2,0 runs example 2 then 0 of N=3 (depths 1.0 then 0.0); a later full run adds only example 1."""
    out = tmp_path / "grid"
    base = ["--tasks", "passkey", "--lengths", "256", "--policies", "full", "-n", "3", "--in-process"]
    assert main(_grid([*base, "--examples", "2,0,2"], tiny_dir, out)) == 0
    rows = _rows(out)
    assert [(r["example"], r["depth"]) for r in rows] == [(2, 1.0), (0, 0.0)]
    assert rows[0]["command"].split("--examples ")[1].startswith("2,0,2")
    assert main(_grid(base, tiny_dir, out)) == 0
    assert [r["example"] for r in _rows(out)] == [2, 0, 1]
    capsys.readouterr()
    assert main(_grid([*base, "--examples", "3"], tiny_dir, out)) == 2
    assert "--examples picks from 0 to 2 (-n 3), not 3" in capsys.readouterr().err


def test_multiturn_times_every_follow_up(tiny_dir, tmp_path):
    config = BenchConfig(tasks=["multiturn"], lengths=[200], policies=["streaming"], budgets=[48], n=1,
                         out=tmp_path, model=tiny_dir, chunk=32, answer_tokens=2, in_process=True)
    run(config, say=lambda line: None)
    (row,) = _rows(tmp_path)
    turns = row["followups"]
    assert [t["turn"] for t in turns] == list(range(1, 12)) and turns[-1]["prompt_tokens"] == row["prompt_tokens"]
    assert all(t["total_s"] >= t["prefill_s"] > 0 for t in turns)
    # one session: after the document, each turn reads only its own few tokens; the cache stays bounded
    assert all(t["prompt_tokens"] < turns[0]["prompt_tokens"] / 2 for t in turns[1:])
    assert row["conversation_tokens"] > sum(t["prompt_tokens"] for t in turns)
    assert max(t["kv_tokens"] for t in turns) <= 48 + 96 + 8


def test_in_process_keeps_one_model_loaded(tiny_dir, tmp_path):
    """Two weight precisions in one process: the first model is dropped before the second loads."""
    config = BenchConfig(tasks=["passkey"], lengths=[128], policies=["full"], budgets=[], n=1, out=tmp_path,
                         model=tiny_dir, chunk=64, answer_tokens=2, in_process=True, weights=["fp32", "int8"])
    run(config, say=lambda line: None)
    assert sorted(r["weights"] for r in _rows(tmp_path)) == ["fp32", "int8"]
    assert [key[2] for key in config.engines] == ["int8"]


def test_a_cell_runs_in_its_own_process(tiny_dir, tmp_path):
    config = BenchConfig(tasks=["passkey"], lengths=[128], policies=["full"], budgets=[], n=1, out=tmp_path,
                         model=tiny_dir, chunk=64, answer_tokens=2)
    run(config, say=lambda line: None)
    (row,) = _rows(tmp_path)
    assert row["memory_mode"] == "subprocess" and row["error"] is None
    assert row["peak_memory_bytes"] >= row["rss_after_load_bytes"] > 10 * 2**20


def _fake_rows():
    base = {"model": "m", "device": "cpu", "hardware": {"cpu": "x", "cores": 2, "torch_threads": 2, "gpu": None},
            "versions": {"torch": "t", "transformers": "tr", "localchat": "l", "python": "p"}, "chunk": 64,
            "positions": "compact", "heads": None, "seed": 0, "command": "localchat bench ...", "error": None,
            "prompt_tokens": 100, "new_tokens": 4, "prefill_s": 0.5, "decode_s": 0.1, "ttft_s": 0.5,
            "prefill_tps": 200.0, "decode_tps": 40.0, "kv_bytes": 1000, "kv_full_bytes": 4000, "compression": 4.0,
            "peak_memory_bytes": 2**28, "rss_after_load_bytes": 2**27, "memory_mode": "subprocess",
            "time": "2026-01-01T00:00:00", "followups": None}
    rows = []
    for task in ("passkey", "niah_single"):
        for policy, budget in (("full", None), ("locret", 64), ("locret", 128)):
            for length in (256, 512):
                n = 3 if length == 256 else 2
                for i in range(n):
                    rows.append({**base, "task": task, "policy": policy, "budget": budget, "length": length,
                                 "example": i, "score": float(i == 0)})
    rows.append({**base, "task": "passkey", "policy": "full", "budget": None, "length": 512, "example": 9,
                 "error": "the prompt is too long", "score": None})
    return rows


def test_by_length_joins_results_dirs_at_one_budget(tmp_path, capsys):
    """Rows from two results dirs (short and long lengths) in one table and one plot per task, at one budget."""
    short, long_ = tmp_path / "short", tmp_path / "long"
    short.mkdir()
    long_.mkdir()
    (short / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in _fake_rows()))
    far = [{**r, "length": 4096} for r in _fake_rows() if r["policy"] == "locret" and r["budget"] == 64]
    (long_ / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in far))
    out = tmp_path / "out"
    assert main(["bench", "by-length", str(short), str(long_), "--out", str(out), "--budget", "64"]) == 0
    md = (out / "by-length.md").read_text()
    assert "| policy | 256 | 512 | 4K |" in md
    assert "| full | 0.33 (3) | 0.50 (2) |  |" in md  # the errored row is left out
    assert "| locret | 0.33 (3) | 0.50 (2) | 0.40 (5) |" in md  # b=128 rows are not at this budget
    assert sorted(p.name for p in out.glob("*.png")) == ["accuracy-by-length-niah_single.png",
                                                         "accuracy-by-length-passkey.png"]


def test_by_length_writes_a_command_that_can_be_pasted(tmp_path):
    """Policy labels hold spaces ("locret max-copies=4"): the command in by-length.md is quoted, and splitting it
    as a shell would gives the arguments it was run with."""
    import shlex

    src = tmp_path / "my results"
    src.mkdir()
    (src / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in _fake_rows()))
    out = tmp_path / "out"
    argv = ["bench", "by-length", str(src), "--out", str(out), "--budget", "64", "--policies", "full,locret max-copies=4"]
    assert main(argv) == 0
    line = next(x for x in (out / "by-length.md").read_text().splitlines() if "Command: `" in x)
    words = shlex.split(line.split("Command: `", 1)[1].rstrip("`"))
    assert words == ["localchat", "bench", "by-length", "--out", str(out), str(src), "--budget", "64",
                     "--policies", "full,locret max-copies=4"]


def test_by_length_joins_gpu_fp32_rows_once_and_keeps_gpu_default_apart(tmp_path, capsys):
    """A GPU lane's `--weights fp32` rows join the CPU's plain series; an example both have counts once (the first
    source's); a GPU row at the device's default dtype is a series of its own."""
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    cpu.mkdir()
    gpu.mkdir()
    mine = [r for r in _fake_rows() if r["task"] == "passkey" and r["policy"] == "locret" and r["budget"] == 64]
    (cpu / RESULTS).write_text("".join(json.dumps({**r, "n": 3}) + "\n" for r in mine if r["length"] == 256))
    on_gpu = {"hardware": {"cpu": "x", "cores": 16, "torch_threads": 1, "gpu": "H100"}, "device": "cuda"}
    theirs = [{**r, **on_gpu, "n": 3, "weights": "fp32", "score": 1.0} for r in mine if r["length"] == 256]
    theirs.append({**theirs[0], "example": 5})  # one the CPU lacks
    theirs.append({**theirs[0], "weights": None, "score": 0.0})  # bf16 on the GPU: another series
    (gpu / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in theirs))
    out = tmp_path / "out"
    assert main(["bench", "by-length", str(cpu), str(gpu), "--out", str(out), "--budget", "64"]) == 0
    md = (out / "by-length.md").read_text()
    assert "| locret | 0.50 (4) |" in md  # the CPU's 3 (1 right) + the GPU's example 5 (right)
    assert "| locret weights=gpu-default | 0.00 (1) |" not in md  # not a plain series: left out by default
    assert main(["bench", "by-length", str(cpu), str(gpu), "--out", str(out), "--budget", "64",
                 "--policies", "locret,locret weights=gpu-default"]) == 0
    assert "| locret weights=gpu-default | 0.00 (1) |" in (out / "by-length.md").read_text()


def test_report_counts_each_cell(tmp_path, capsys):
    (tmp_path / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in _fake_rows()))
    assert main(["bench", "report", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "| passkey | full | - | 0.33 (n=3) | 0.50 (n=2), 1 err |" in md
    assert "| niah_single | locret | 128 | 0.33 (n=3) | 0.50 (n=2) |" in md
    assert "| locret | 64 | 512 | 4 |" in md  # speed/memory tables: N over both tasks
    assert "4.00x" in md and "Command: `localchat bench ...`" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert PLOT_NOTICE in md
    else:
        pngs = sorted(p.name for p in tmp_path.glob("*.png"))
        assert pngs == ["accuracy-niah_single.png", "accuracy-passkey.png", "prefill-tps.png", "time-memory.png"]
        assert all(f"({name})" in md for name in pngs)


def test_report_keeps_machines_apart(tmp_path):
    rows = _fake_rows()
    for row in list(rows):  # the 512-token locret b=64 cell measured again on a slower machine, one thread
        if row["policy"] == "locret" and row["budget"] == 64 and row["length"] == 512 and row["task"] == "passkey":
            rows.append({**row, "hardware": {**row["hardware"], "cpu": "slow", "torch_threads": 1},
                         "example": row["example"] + 100, "prefill_tps": 50.0, "score": 1.0})
    (tmp_path / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = write_report(tmp_path, say=lambda line: None).read_text()
    assert "| passkey | locret | 64 | 0.33 (n=3) | 0.75 (n=4) |" in md  # accuracy pools every machine
    assert "| locret | 64 | 512 | x, 2 threads | 4 | 100 | 200 |" in md  # timings do not
    assert "| locret | 64 | 512 | slow, 1 thread | 2 | 100 | 50 |" in md
    assert "x, 2 threads (31 rows); slow, 1 thread (2 rows)" in md


def test_rows_name_the_source_commit(tmp_path):
    """A git checkout gives its commit, marked +dirty only for changes under localchat/; no checkout: None."""
    import subprocess

    from localchat.bench.machine import source_commit

    repo = tmp_path / "repo"
    (repo / "localchat").mkdir(parents=True)
    (repo / "localchat" / "a.py").write_text("x = 1\n")
    (repo / "notes.txt").write_text("a\n")
    assert source_commit(repo) is None
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "one"]):
        subprocess.run([*git, *args], check=True)
    sha = subprocess.run([*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert source_commit(repo) == sha
    (repo / "notes.txt").write_text("b\n")  # results and notes change while a grid runs: still clean
    assert source_commit(repo) == sha
    (repo / "localchat" / "a.py").write_text("x = 2\n")
    assert source_commit(repo) == sha + "+dirty"
    rows = _fake_rows()
    for i, row in enumerate(rows[:5]):
        row["versions"] = {**row["versions"], "commit": "abc" if i < 3 else "def+dirty"}
    (tmp_path / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = write_report(tmp_path, say=lambda line: None).read_text()
    assert (f"source commits abc (3 rows), def+dirty (2 rows), {len(rows) - 5} rows from before commits were "
            "recorded.") in md


def test_report_without_matplotlib(tmp_path, monkeypatch, capsys):
    (tmp_path / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in _fake_rows()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    write_report(tmp_path, say=print)
    assert PLOT_NOTICE in (tmp_path / "report.md").read_text() and not list(tmp_path.glob("*.png"))
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "pip install 'localchat[plot]'" in out


def test_perf_writes_every_row(tiny_dir, tmp_path, capsys):
    argv = ["bench", "perf", "--out", str(tmp_path), "--model", tiny_dir, "--chunk", "64", "--length", "256",
            "--min-length", "128", "--max-length", "300", "--budget", "64", "--decode-tokens", "3", "--repeat", "2"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "perf.json").read_text())
    runs = result["runs"]["side_by_side"]
    assert len(runs) == 2 and len(result["runs"]["locret_scaling"][0]) == 2 and result["setup"]["repeat"] == 2
    for i, row in enumerate(result["side_by_side"]):  # each reported number is the median of the runs
        assert row["decode_tok_s"] == pytest.approx((runs[0][i]["decode_tok_s"] + runs[1][i]["decode_tok_s"]) / 2)
    assert len(result["ratios"]["decode_locret_vs_full_per_run"]) == 2
    rows = result["side_by_side"]
    assert [r["policy"] for r in rows] == ["full", "locret", "full", "full"] and "DynamicCache" in rows[2]["row"]
    assert rows[3]["row"].startswith("floor") and rows[3]["kv_mib"] < rows[1]["kv_mib"]
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["new_tokens"] == 3 for r in rows)
    assert rows[0]["prompt_tokens"] == rows[1]["prompt_tokens"] == rows[2]["prompt_tokens"]
    assert result["ratios"]["decode_bound_from_bytes"] > 1 and result["ratios"]["decode_floor_vs_full"] > 0
    assert rows[1]["kv_mib"] < rows[0]["kv_mib"] == rows[2]["kv_mib"]
    assert [r["length"] for r in result["locret_scaling"]] == [128, 256, 300]
    assert set(result["ratios"]) >= {"prefill_locret_vs_full", "decode_locret_vs_full",
                                     "decode_locret_vs_hf_dynamic_cache", "decode_full_vs_hf_dynamic_cache"}
    assert result["command"].startswith("localchat bench perf --out") and result["hardware"]["cores"]
    md = (tmp_path / "perf.md").read_text()
    assert "transformers DynamicCache" in md and result["command"] in md and "--repeat 2" in md
    assert "median of 2 runs" in md


def test_perf_measures_the_cap_beside_plain_locret(tiny_dir, tmp_path, monkeypatch):
    """`bench perf --max-copies N`: a fifth side-by-side row that runs LOCRET with the cap (cap_copies is called
    while it reads, and only then), and the cap's ratios to plain LOCRET in perf.json and perf.md."""
    from localchat.bench import perf
    from localchat.engine.policies import repeats  # LOCRET imports cap_copies from there when it first caps

    calls, caps = [], []
    real_cap, real_run = repeats.cap_copies, perf.greedy
    monkeypatch.setattr(repeats, "cap_copies", lambda *a: calls.append(1) or real_cap(*a))
    monkeypatch.setattr(perf, "greedy", lambda engine, *a: caps.append(getattr(engine.policy, "max_copies", None))
                        or real_run(engine, *a))
    argv = ["bench", "perf", "--out", str(tmp_path), "--model", tiny_dir, "--chunk", "64", "--length", "256",
            "--min-length", "128", "--max-length", "256", "--budget", "64", "--decode-tokens", "3",
            "--max-copies", "2"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "perf.json").read_text())
    rows = result["side_by_side"]
    assert [r["row"] for r in rows[:2]] == ["full (ours: in-place KVCache)", "locret"]
    assert len(rows) == 5 and rows[4]["row"] == "locret max-copies=2" and rows[4]["policy"] == "locret"
    assert rows[4]["prompt_tokens"] == rows[1]["prompt_tokens"] and rows[4]["kv_units_per_head"] == rows[1]["kv_units_per_head"]
    assert calls  # the capped row ran the cap: 593 tokens at budget 64 evict in every layer
    assert caps == [None, None, 0, 2, 0, 0]  # full, floor, LOCRET, capped LOCRET, then plain LOCRET's scaling run
    r = result["ratios"]
    assert r["prefill_capped_vs_locret"] > 0 and len(r["prefill_capped_vs_locret_per_run"]) == 1
    assert result["setup"]["max_copies"] == 2 and "--max-copies 2" in result["command"]
    assert "The cap (`--max-copies 2`)" in (tmp_path / "perf.md").read_text()


def test_decode_bench_rows_per_weights(tiny_dir, tmp_path):
    """`bench decode` loads one engine per --weights (packed int8/int4 on this CPU) and reports medians."""
    argv = ["bench", "decode", "--out", str(tmp_path), "--model", tiny_dir, "--chunk", "64", "--length", "256",
            "--budget", "64", "--decode-tokens", "3", "--repeat", "2", "--weights", "fp32,int4", "--heads", "random"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "decode.json").read_text())
    rows = result["rows"]
    assert [(r["weights"], r["row"].split(",")[0]) for r in rows] == [
        (w, label) for w in ("fp32", "int4")
        for label in ("locret b=64", "locret b=64 via transformers' forward", "floor: full after 64 tokens")]
    assert all(r["decode_tok_s"] > 0 and r["new_tokens"] == 3 for r in rows)
    assert rows[3]["weights_mib"] < rows[0]["weights_mib"]  # int4 holds fewer bytes than fp32
    assert rows[0]["decode_vs_fp32"] == 1.0 and rows[3]["decode_vs_fp32"] > 0
    for w in ("fp32", "int4"):  # each reported number is the median of the runs
        runs = result["runs"][w]
        assert len(runs) == 2
        mine = [r for r in rows if r["weights"] == w][0]
        assert mine["decode_tok_s"] == pytest.approx((runs[0][0]["decode_tok_s"] + runs[1][0]["decode_tok_s"]) / 2)
    assert result["command"].startswith("localchat bench decode") and result["command"] in (tmp_path / "decode.md").read_text()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["bench", "--tasks", "nope", "--out", "D"], "unknown task 'nope'"),
        (["bench", "--policies", "full,zz", "--out", "D"], "unknown policy 'zz'"),
        (["bench", "--lengths", "4k,12q", "--out", "D"], "bad length '12q'"),
        (["bench", "--lengths", "10", "--out", "D"], "length 10 is out of range"),
        (["bench", "--tasks", "passkey,niah_single", "--lengths", "200k", "--out", "D"], "out of range"),
        (["bench", "--lengths", "2m", "--out", "D"], "out of range for passkey"),
        (["bench", "--budgets", "big", "--out", "D"], "--budgets takes whole numbers"),
        (["bench", "-n", "0", "--out", "D"], "-n must be at least 1"),
        (["bench", "--positions", "sideways", "--out", "D"], "unknown position mode"),
        (["bench", "--chunk", "0", "--out", "D"], "--chunk"),
        (["bench"], "needs --out"),
        (["bench", "--policies", "full,locret", "--model", "/some/dir", "--out", "D"], "locret needs retaining heads"),
        (["bench", "perf"], "needs --out"),
        (["bench", "decode"], "needs --out"),
        (["bench", "decode", "--out", "D", "--weights", "int3"], "unknown --weights 'int3'"),
        (["bench", "decode", "--out", "D", "--peer", "ollama"], "unknown --peer 'ollama'"),
        (["bench", "decode", "--out", "D", "--peer", "llama.cpp", "--model", "some/dir"], "reads GGUF files"),
        (["bench", "perf", "--out", "D", "--min-length", "9000", "--max-length", "4096"], "above --max-length"),
        (["bench", "perf", "--out", "D", "--peer", "ollama"], "unknown --peer 'ollama'"),
        (["bench", "report", "/no/such/dir"], "no results.jsonl"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "D").exists()


@pytest.mark.model
def test_passkey_cell_on_smollm2(smollm2, tmp_path):
    """The real default model finds 2K-token pass keys with full attention, through the bench runner."""
    config = BenchConfig(tasks=["passkey"], lengths=[2048], policies=["full"], budgets=[], n=2, out=tmp_path,
                         in_process=True)
    config.engines[(None, smollm2.chunk, None)] = smollm2  # reuse the session's engine (the runner's key)
    run(config, say=lambda line: None)
    rows = _rows(tmp_path)
    assert [r["score"] for r in rows] == [1.0, 1.0] and rows[0]["model"] == "SmolLM2-135M-Instruct"


def test_report_keeps_locret_heads_apart(tmp_path):
    import json

    from localchat.bench.report import load_rows

    rows = [{"policy": "locret", "heads": "random"}, {"policy": "locret", "heads": "/x/trained-d256"},
            {"policy": "full", "heads": None}]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["policy"] for r in load_rows(tmp_path)] == ["locret[random]", "locret[trained-d256]", "full"]


def test_multiturn_turns_axis_and_needle_retention(tiny_dir, tmp_path):
    config = BenchConfig(tasks=["multiturn"], lengths=[300], policies=["full", "streaming"], budgets=[48], n=1,
                         out=tmp_path, model=tiny_dir, chunk=32, answer_tokens=2, in_process=True, turns=[0, 2])
    run(config, say=lambda line: None)
    rows = {(r["policy"], r["turns"]): r for r in _rows(tmp_path)}
    assert set(rows) == {(p, t) for p in ("full", "streaming") for t in (0, 2)}
    assert [len(rows["full", t]["followups"]) for t in (0, 2)] == [2, 4]
    assert rows["full", 2]["needle_kept"] == 1.0  # full attention keeps every unit
    # StreamingLLM keeps sinks + the recent window: a needle in the middle of the document is gone
    assert rows["streaming", 0]["depth"] == 0.5 and rows["streaming", 0]["needle_kept"] == 0.0


def test_answer_retention_of_single_turn_tasks(tiny_dir, tmp_path):
    config = BenchConfig(tasks=["niah_single", "passkey"], lengths=[300], policies=["full", "streaming"],
                         budgets=[48], n=1, out=tmp_path, model=tiny_dir, chunk=32, answer_tokens=2,
                         in_process=True)
    run(config, say=lambda line: None)
    rows = {(r["task"], r["policy"]): r for r in _rows(tmp_path)}
    for task in ("niah_single", "passkey"):
        assert rows[task, "full"]["answer_kept"] == 1.0  # full attention keeps every unit
        # the needle sits mid-document: StreamingLLM's sinks + recent window drop all of its value's tokens
        assert rows[task, "streaming"]["depth"] == 0.5 and rows[task, "streaming"]["answer_kept"] == 0.0


def test_answer_tokens_cover_each_occurrence(tiny_dir):
    from transformers import AutoTokenizer

    from localchat.bench.cell import answer_tokens

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    text = "filler words here. The pass key is 47486. Remember it. 47486 is the pass key. more filler"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    where = answer_tokens(tok, text, ids, ("47486",))
    pieces = [tok.decode(ids[i : i + 1]) for i in where]
    assert "".join(pieces).replace(" ", "") == "47486" * 2
    assert answer_tokens(tok, text, ids, ("99999",)) == []
    assert answer_tokens(tok, text, ids[:-1], ("47486",)) == []  # ids that are not this text's: no guess


def test_report_keeps_positions_apart_and_tables_retention(tmp_path):
    from localchat.bench.report import kept_table, load_rows

    rows = [{"task": "passkey", "policy": "locret", "budget": 512, "length": 4096, "positions": "compact",
             "answer_kept": 0.5},
            {"task": "passkey", "policy": "locret", "budget": 512, "length": 4096, "positions": "compact",
             "answer_kept": 1.0},
            {"task": "passkey", "policy": "locret", "budget": 512, "length": 4096, "positions": "original",
             "answer_kept": 0.25},
            {"task": "passkey", "policy": "full", "budget": None, "length": 4096, "positions": "original"}]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_rows(tmp_path)
    assert [r["policy"] for r in loaded] == ["locret", "locret", "locret positions=original", "full"]
    table = kept_table(loaded)
    assert "| passkey | locret | 512 | 0.75 (n=2) |" in table
    assert "| passkey | locret positions=original | 512 | 0.25 (n=1) |" in table
    assert not any("| full |" in line for line in table)  # no retention recorded: no row


def test_dry_run_estimate_prefers_this_cpu_then_the_same_policy():
    from localchat.bench.cell import Cell
    from localchat.bench.runner import _estimate

    cell = Cell("passkey", 512, "h2o", 64, 20, 0, None, None, 64, "compact", 8)
    row = {"length": 512, "task": "passkey", "policy": "h2o", "wall_s": 10.0, "hardware": {"cpu": "fast"}}
    rows = [row, {**row, "policy": "full", "wall_s": 30.0, "hardware": {"cpu": "slow"}},
            {**row, "task": "niah_single", "wall_s": 50.0, "hardware": {"cpu": "slow"}}]
    assert _estimate(rows, cell, "slow") == (50.0, " (rows of other tasks)")  # this CPU, same policy
    assert _estimate(rows[:2], cell, "slow") == (30.0, " (rows of other policies)")
    assert _estimate(rows[:1], cell, "slow") == (10.0, " (rows of other machines)")
    assert _estimate(rows, cell, "fast") == (10.0, "")
    assert _estimate(rows, Cell("passkey", 300, "h2o", 64, 20, 0, None, None, 64, "compact", 8), "fast") == (None, "")
    # Another task's rows, scaled by how the two compare at other lengths (here 3x at 256 on one CPU, 2x on another)
    rows += [{**row, "length": 256, "task": t, "wall_s": w, "hardware": {"cpu": c}}
             for t, w, c in (("passkey", 6.0, "a"), ("niah_single", 2.0, "a"), ("passkey", 4.0, "b"),
                             ("niah_single", 2.0, "b"), ("passkey", 99.0, "c"))]  # c: no other task, no ratio
    rows += [{**row, "length": 256, "policy": "full", "task": "passkey", "wall_s": 1.0, "hardware": {"cpu": "a"}}]
    assert _estimate(rows, cell, "slow") == (50.0 * 2.5, " (rows of other tasks x2.50, passkey's ratio to them at "
                                                          "other lengths)")


def test_sparse_prefill_rows_are_omnikvs_own(tiny_dir, tmp_path, capsys):
    out = tmp_path / "grid"
    argv = _grid(["--tasks", "passkey", "--lengths", "256", "--policies", "full,omnikv", "--budgets", "32", "-n", "1",
                  "--in-process", "--sparse-prefill", "0.5"], tiny_dir, out)
    assert main(argv) == 0
    rows = _rows(out)
    assert {(r["policy"], r["sparse_prefill"]) for r in rows} == {("full", None), ("omnikv", 0.5)}
    assert all(r["error"] is None for r in rows) and "--sparse-prefill 0.5" in rows[0]["command"]
    assert main(["bench", "report", str(out)]) == 0
    assert "| passkey | omnikv sparse-prefill=0.5 | 32 |" in (out / "report.md").read_text()
    capsys.readouterr()
    assert main(_grid(["--tasks", "passkey", "--lengths", "256", "--policies", "full", "--sparse-prefill", "2"],
                      tiny_dir, out)) == 2
    assert "--sparse-prefill applies to omnikv" in capsys.readouterr().err


@pytest.mark.parametrize(("field", "flag", "value"), [("max_copies", "--max-copies", 4), ("focus", "--focus", 8)])
def test_locret_option_rows_are_locrets_own_and_a_key_of_their_own(tiny_dir, tmp_path, capsys, field, flag, value):
    out = tmp_path / "grid"
    base = ["--tasks", "passkey", "--lengths", "256", "--budgets", "32", "-n", "1", "--heads", "random", "--in-process"]
    assert main(_grid([*base, "--policies", "streaming,locret", flag, str(value)], tiny_dir, out)) == 0
    assert main(_grid([*base, "--policies", "locret"], tiny_dir, out)) == 0  # without the option: another row
    rows = _rows(out)
    assert sorted((r["policy"], r[field] or 0) for r in rows) == [("locret", 0), ("locret", value), ("streaming", 0)]
    assert all(r["error"] is None for r in rows)
    assert main(["bench", "report", str(out)]) == 0
    assert f"| passkey | locret[random] {flag[2:]}={value} | 32 |" in (out / "report.md").read_text()
    capsys.readouterr()
    assert main(_grid([*base, "--policies", "streaming", flag, str(value)], tiny_dir, out)) == 2
    assert f"{flag} applies to locret" in capsys.readouterr().err


def test_focus_window_and_spread_are_recorded_and_keyed(tiny_dir, tmp_path, capsys):
    out = tmp_path / "grid"
    base = ["--tasks", "passkey", "--lengths", "256", "--budgets", "32", "-n", "1", "--heads", "random", "--in-process",
            "--policies", "locret", "--focus", "8"]
    assert main(_grid(base, tiny_dir, out)) == 0
    assert main(_grid([*base, "--focus-window", "4", "--focus-spread", "0"], tiny_dir, out)) == 0  # a row of its own
    rows = _rows(out)
    assert [(r["focus_window"], r["focus_spread"]) for r in rows] == [(None, None), (4, 0)]
    assert "--focus-window 4 --focus-spread 0" in rows[1]["command"]
    assert main(["bench", "report", str(out)]) == 0
    assert "| passkey | locret[random] focus=8 focus-window=4 focus-spread=0 | 32 |" in (out / "report.md").read_text()
    capsys.readouterr()
    assert main(_grid([*base[:-2], "--focus-window", "4"], tiny_dir, out)) == 2
    assert "--focus-window sets how --focus picks" in capsys.readouterr().err


def test_perf_measures_focus_beside_plain_locret(tiny_dir, tmp_path, monkeypatch):
    from localchat.engine import focus

    views = []
    real_view = focus.view
    monkeypatch.setattr(focus, "view", lambda *a, **kw: views.append(1) or real_view(*a, **kw))
    argv = ["bench", "perf", "--out", str(tmp_path), "--model", tiny_dir, "--chunk", "64", "--length", "256",
            "--min-length", "128", "--max-length", "256", "--budget", "64", "--decode-tokens", "3", "--focus", "16"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "perf.json").read_text())
    rows = result["side_by_side"]
    assert len(rows) == 5 and rows[4]["row"] == "locret focus=16" and rows[4]["prompt_tokens"] == rows[1]["prompt_tokens"]
    assert len(views) == 1  # only the focus row read a view
    assert result["ratios"]["decode_focus_vs_locret"] > 0 and "--focus 16" in result["command"]
    assert "Focus (`--focus 16`)" in (tmp_path / "perf.md").read_text()


def test_side_by_side_ranks_policies_per_length_and_budget(tmp_path):
    rows = _fake_rows()
    for row in list(rows):  # a policy with one task only: shown, but without a mean
        if row["policy"] == "locret" and row["budget"] == 64 and row["task"] == "passkey":
            rows.append({**row, "policy": "streaming", "score": 1.0})
    (tmp_path / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = write_report(tmp_path, say=lambda line: None).read_text()
    table = md.split("256 tokens, budget 64:")[1].split("256 tokens, budget 128:")[0]
    assert table.index("| full (no budget) | 0.33 (3) | 0.33 (3) | 0.33 |") < table.index("| streaming | 1.00 (3) |  |  |")
    assert "| locret | 0.33 (3) | 0.33 (3) | 0.33 |" in table and "| policy | passkey | niah_single | mean |" in table
    table = md.split("512 tokens, budget 128:")[1].split("## Accuracy")[0]
    assert "| full (no budget) | 0.50 (2) | 0.50 (2) | 0.50 |" in table  # the error row is left out
    assert "streaming" not in table


def test_report_plot_legend_stays_beside_the_plot(tmp_path):
    """A grid has dozens of series: the legend goes to the right of the axes, never over the lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from localchat.bench.report import _legend_right, _save

    fig, ax = plt.subplots(figsize=(6, 4))
    for i in range(45):
        ax.plot([256, 512, 1024], [i / 45] * 3, label=f"policy{i} 7680")
    _legend_right(fig, ax)
    fig.tight_layout()
    fig.canvas.draw()
    legend, plot = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= plot.x1  # wholly to the right of the axes
    assert len(ax.get_legend().get_texts()) == 45 and legend.y0 >= 0  # every entry, none below the image
    assert plot.height > 0.5 * fig.bbox.height  # the figure grew with the legend; the axes were not squeezed
    width = fig.bbox.width
    image = plt.imread(_save(plt, fig, tmp_path / "plot.png"))
    assert image.shape[1] > width + legend.width * 0.9  # the saved image widened to take in the legend


def _keep_open(plt, kept: list):
    """plt for the report's plot functions, except each figure stays open in `kept`, to be read."""

    class KeepOpen:
        subplots = staticmethod(plt.subplots)

        @staticmethod
        def close(fig):
            kept.append(fig)

    return KeepOpen


def test_report_legend_names_each_machine_apart(tmp_path):
    """The grid's 1- and 2-thread rows on one Xeon once shared a legend label (the CPU name cut to 12 chars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from localchat.bench.report import _time_memory_plot, machine, short_machine

    rows = []
    for cpu, threads in (("Intel(R) Xeon(R) Processor", 1), ("Intel(R) Xeon(R) Processor", 2), ("AMD EPYC", 1)):
        for row in _fake_rows():
            rows.append({**row, "hardware": {**row["hardware"], "cpu": cpu, "torch_threads": threads}})
    for row in rows:
        row["machine"] = machine(row)
    kept = []
    _time_memory_plot(_keep_open(plt, kept), rows, tmp_path)
    fig = kept[0]
    labels = [t.get_text() for t in fig.axes[-1].get_legend().get_texts()]
    assert len(labels) == len(set(labels)) == 3 * 3  # (full, locret 64, locret 128) x three machines
    assert "locret b=64 [Xeon 1t]" in labels and "locret b=64 [Xeon 2t]" in labels and "full [EPYC 1t]" in labels
    gpu = {"cpu": "AMD EPYC 9454 48-Core Processor", "torch_threads": 16, "gpu": "NVIDIA H100 80GB HBM3"}
    assert short_machine({"hardware": gpu}) == "H100 80GB HBM3"


def test_report_plots_give_each_policy_its_own_look(tmp_path):
    """The grid has eleven policies: the ten default colours alone gave two of them one look."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    from localchat.bench.report import _accuracy_plot, _time_memory_plot

    rows = [{**r, "policy": f"policy{i}", "machine": "x 2t"} for i in range(12) for r in _fake_rows()
            if r["policy"] == "locret"]
    kept = []
    _accuracy_plot(_keep_open(plt, kept), rows, "passkey", tmp_path)
    _time_memory_plot(_keep_open(plt, kept), rows, tmp_path)
    accuracy, time_memory = kept[0].axes[0], kept[1].axes[-1]
    lines = accuracy.get_legend().legend_handles
    assert len(lines) == 12 * 2  # policy x length
    looks = {(to_rgba(h.get_color()), str(h.get_linestyle()), h.get_marker()) for h in lines}  # "C10" is "C0"
    assert len(looks) == 12 * 2
    series = time_memory.get_lines()
    assert len(series) == 12 * 2  # policy x budget
    assert len({(to_rgba(h.get_color()), str(h.get_linestyle())) for h in series}) == 12 * 2


@pytest.mark.model
def test_decode_bench_peer_row_runs_llama_cpp_or_says_how_to_get_it(tmp_path):
    """`--peer llama.cpp` on the embedded GGUF: with the [peers] extra, llama.cpp's rows beside ours (the same
    prompt tokens); without it, one row naming the install command."""
    from localchat.bench.peer import INSTALL, available

    argv = ["bench", "decode", "--out", str(tmp_path), "--weights", "fp32", "--length", "300", "--budget", "64",
            "--chunk", "64", "--decode-tokens", "3", "--repeat", "1", "--peer", "llama.cpp"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "decode.json").read_text())
    if available():
        whole, short = result["peer_rows"]
        assert whole["prompt_tokens"] == result["rows"][0]["prompt_tokens"] and whole["decode_tok_s"] > 0
        assert short["prompt_tokens"] == result["rows"][0]["kv_units_per_head"]
        assert set(result["ratios_vs_peer"]["fp32"]) == {"decode_vs_peer_at_locret_depth", "decode_vs_peer_full",
                                                         "prefill_vs_peer"}
    else:
        assert result["peer_rows"] == [{"row": "llama.cpp: not installed", "peer": "llama.cpp",
                                        "note": f"to measure it: {INSTALL}"}]
        assert INSTALL in (tmp_path / "decode.md").read_text()


@pytest.mark.model
def test_perf_bench_takes_the_same_peer(tmp_path):
    """`bench perf --peer llama.cpp`: the peer's two rows in perf.json/perf.md beside full attention and LOCRET,
    or the row naming the install command."""
    from localchat.bench.peer import INSTALL, available

    argv = ["bench", "perf", "--out", str(tmp_path), "--length", "1100", "--min-length", "1024", "--max-length",
            "1024", "--budget", "64", "--chunk", "64", "--decode-tokens", "3", "--peer", "llama.cpp"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "perf.json").read_text())
    md = (tmp_path / "perf.md").read_text()
    if available():
        whole, short = result["peer_rows"]
        assert whole["prompt_tokens"] == result["side_by_side"][1]["prompt_tokens"]
        assert short["prompt_tokens"] == result["side_by_side"][1]["kv_units_per_head"]
        assert set(result["ratios_vs_peer"]) == {"full (ours)", "locret"} and "Row locret / llama.cpp" in md
    else:
        assert result["peer_rows"][0]["row"] == "llama.cpp: not installed" and INSTALL in md
