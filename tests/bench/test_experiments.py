"""Every script in bench/experiments/ imports against the package, parses its command line and reaches only the
package's public names; the GPU and host-step scripts are rehearsed on tiny models. In process: the scripts share
torch's import, which a subprocess per script would pay again."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

EXPERIMENTS = Path(__file__).resolve().parents[2] / "bench" / "experiments"
SCRIPTS = sorted(EXPERIMENTS.glob("*.py"))
HELPERS = {"saved_cache"}  # imported by other scripts; no command line of its own



def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"experiments_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_are_experiments_and_no_scripts_left_in_results() -> None:
    assert len(SCRIPTS) > 10
    results = EXPERIMENTS.parent / "results"
    assert not [p for p in results.rglob("*") if p.suffix in (".py", ".sh")]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_script_imports_and_prints_its_help(path: Path, monkeypatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    threads = torch.get_num_threads()
    module = load(path)
    if path.stem in HELPERS:
        assert not hasattr(module, "main")
        return
    with pytest.raises(SystemExit) as stop:
        module.main(["--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")
    assert torch.get_num_threads() == threads  # settings change in main(), never on import


def test_saved_cache_paths(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    monkeypatch.setenv("SNAPS", str(tmp_path / "snaps"))
    saved = load(EXPERIMENTS / "saved_cache.py")
    assert saved.snap_path("passkey", 4096, 3, 1024, 64) == f"{tmp_path}/snaps/passkey-4096-3-b1024-c64.pt"
    assert (tmp_path / "snaps").is_dir()


def private_names(path: Path) -> list[str]:
    """The underscore names a script imports from localchat or reads as an attribute (torch's own aside)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("localchat"):
            out += [alias.name for alias in node.names if alias.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if not (isinstance(root, ast.Name) and root.id == "torch"):
                out.append(node.attr)
    return out


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_script_reaches_only_public_names(path: Path) -> None:
    assert private_names(path) == []


def test_the_public_names_check_sees_private_reaches(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("from localchat.bench.perf import _row, median_row\nimport torch\n"
                      "torch.ops.aten._weight_int8pack_mm\nstep._body()\n")
    assert private_names(script) == ["_row", "_body"]


def test_gpu_decode_runs_every_way_on_a_cpu(tmp_path: Path, monkeypatch) -> None:
    """The GPU's decode script, rehearsed on a tiny model: a row per way, the graph's saying it was not taken; the
    split kernel's settings recorded."""
    import json

    from tiny import save_tiny

    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    model = save_tiny(tmp_path / "tiny")
    script = load(EXPERIMENTS / "gpu_decode.py")
    script.main(["--model", str(model), "--weights", "fp32", "--kv", "int8", "--budget", "48", "--length", "300",
                 "--tokens", "6", "--profile-tokens", "2", "--attn-way", "dot", "--attn-programs", "1056",
                 "--out", str(tmp_path / "out")])
    result = json.loads((tmp_path / "out" / "gpu_decode.json").read_text())
    rows = result["rows"]
    assert (result["setup"]["attn_way"], result["setup"]["attn_programs"]) == ("dot", 1056)
    assert [r["way"] for r in rows] == ["graph (not taken: not CUDA)", "graph-gemv (not taken: not CUDA)",
                                        "graph-unfused (not taken: not CUDA)", "eager step", "forward"]
    assert all(r["decode_tok_s"] > 0 and r["steady_tok_s"] > 0 and r["kv_units_per_head"] >= 48 for r in rows)
    assert script.steady_rate([0.0, 1.0, 1.5, 2.0]) == 2 / 1.0 and script.steady_rate([0.0, 1.0]) is None
    assert "| fp32 | eager step |" in (tmp_path / "out" / "gpu_decode.md").read_text()


def test_host_step_times_the_hosts_side_of_a_step(tmp_path: Path, monkeypatch) -> None:
    """The captured step's host side, rehearsed on a tiny model: a row per cache, the body left out (the model's
    forward is never called while decoding), the buffers' check timed apart."""
    import json

    from tiny import save_tiny

    model = save_tiny(tmp_path / "tiny")
    script = load(EXPERIMENTS / "host_step.py")
    script.main(["--model", str(model), "--kv", "none,int8", "--length", "200", "--tokens", "12", "--budget", "48",
                 "--out", str(tmp_path / "out")])
    rows = json.loads((tmp_path / "out" / "host_step.json").read_text())["rows"]
    assert [r["kv"] for r in rows] == ["none", "int8"] and all(r["tokens"] == 12 for r in rows)
    assert all(0 < r["loop_ms_per_token"] < r["host_ms_per_token"] and r["buffers_check_us"] > 0 for r in rows)


def test_gpu_prefill_profile_buckets_a_read(tmp_path: Path, monkeypatch) -> None:
    """The GPU's prefill profile, rehearsed on a tiny model (CPU times): every bucket present, the marked heads and
    eviction ranges found, the shares summing to the whole."""
    import json

    from tiny import save_tiny

    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    model = save_tiny(tmp_path / "tiny")
    script = load(EXPERIMENTS / "gpu_prefill_profile.py")
    script.main(["--model", str(model), "--weights", "fp32", "--kv", "int8", "--budget", "48", "--length", "400",
                 "--d-r", "64", "--out", str(tmp_path / "out")])
    result = json.loads((tmp_path / "out" / "prefill_profile.json").read_text())
    split = result["buckets_ms"]
    assert split["retaining heads"] > 0 and split["eviction"] > 0 and split["matmul"] > 0
    assert abs(sum(split.values()) - result["device_ms"]) < 1.0 and result["prefill_tok_s"] > 0


def test_gpu_prefill_profile_puts_each_kernel_in_its_launchers_bucket() -> None:
    """On a GPU the buckets come from the kernels: each in its host op's bucket (a dequantization kernel by its own
    name), everything under a mark once in the mark's, and a kernel no op launched in "other". The tree is built
    from torch's own profiler events, as `prof.events()` gives them."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    script = load(EXPERIMENTS / "gpu_prefill_profile.py")

    events = EventList()

    def op(name, start, end, kernels=()):  # a host op, and each kernel it launched: on the op and as a device event
        e = FunctionEvent(len(events), name, thread=1, start_us=start, end_us=end, use_device="cuda")
        events.append(e)
        for kernel, us in kernels:
            e.append_kernel(kernel, 0, us)
            device(kernel, us)

    def device(name, us):
        events.append(FunctionEvent(len(events), name, thread=2, start_us=200, end_us=200 + us, use_device="cuda",
                                    device_type=DeviceType.CUDA))

    op("aten::mm", 0, 10, [("sm90_gemm", 400)])
    op("aten::linear", 20, 40)
    op("aten::mm", 21, 30, [("kDequantize", 100), ("sm90_gemm", 300)])
    op("localchat.heads", 50, 90)
    op("aten::mm", 51, 60, [("sm90_gemm", 50)])
    op("aten::add", 61, 70, [("add_kernel", 20)])
    op("aten::index_select", 100, 110, [("index_kernel", 30)])
    device("triton_kernel", 10)
    events._build_tree()
    host = [e for e in events if e.device_type == DeviceType.CPU]
    assert host[2].cpu_parent is host[1] and host[4].cpu_parent is host[3] and host[5].cpu_parent is host[3]
    split = script.buckets(events, on_device=True)
    assert split == pytest.approx({"retaining heads": 0.07, "eviction": 0.0, "nf4 dequantize": 0.1, "matmul": 0.7,
                                   "attention": 0.0, "copy/gather": 0.03, "elementwise": 0.0, "other": 0.01})


def test_gpu_weights_times_each_precision_and_says_why_not(tmp_path: Path) -> None:
    """The weight products' timer, rehearsed on a CPU at SmolLM2's shape: a row per precision with its kernel,
    bytes and a small error against bf16; int4 reads about a quarter of bf16's layer bytes; a precision that
    cannot run gets a row saying why."""
    import json

    script = load(EXPERIMENTS / "gpu_weights.py")
    config = Path(__file__).resolve().parents[1] / "data" / "configs" / "smollm2-135m-instruct.json"
    script.main(["--config", str(config), "--layers", "1", "--repeat", "2", "--weights", "bf16,int4,int8,fp7,int4-fp16",
                 "--out", str(tmp_path / "w.json")])
    rows = {r["weights"]: r for r in json.loads((tmp_path / "w.json").read_text())["rows"]}
    assert rows["bf16"]["kernel"] == "Linear" and rows["int4"]["kernel"] == "PackedLinear"
    assert all(rows[w]["ms_per_token"] > 0 and rows[w]["gb_s"] > 0 for w in ("bf16", "int4", "int8"))
    assert rows["bf16"]["rel_error"] < 0.01 and rows["int8"]["rel_error"] < 0.03 and rows["int4"]["rel_error"] < 0.15
    head = 49152 * 576 * 2  # the bf16 output layer, the same in every row
    assert 0.2 < (rows["int4"]["bytes"] - head) / (rows["bf16"]["bytes"] - head) < 0.35
    assert "fp7" in rows["fp7"]["error"] and "CUDA" in rows["int4-fp16"]["error"]
    assert "| fp7 | not run:" in (tmp_path / "w.md").read_text()


def test_gpu_attn_times_every_cache_and_kernel_version(tmp_path: Path, monkeypatch) -> None:
    """The decode-attention timer, rehearsed under Triton's interpreter: a row per cache, kernel file, split
    target and warps, and every version gives the same attention; `--best` gives the fastest row's flags."""
    import json

    from localchat.kernels import qattn

    script = load(EXPERIMENTS / "gpu_attn.py")
    kernel_file = Path(qattn.__file__).with_name("_qattn_triton.py")
    script.main(["--units", "40", "--tail", "3", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "32",
                 "--layers", "2", "--repeat", "1", "--kernels", str(kernel_file), "--programs", "4,64",
                 "--ways", "group,dot", "--dot-blocks", "16,32", "--warps", "4,8",
                 "--out", str(tmp_path / "attn.json")])
    rows = json.loads((tmp_path / "attn.json").read_text())["rows"]
    assert len(rows) == 4 * 2 * (1 + 2) * 2 * 2 and {r["programs"] for r in rows} == {4, 64}
    assert {r["warps"] for r in rows} == {4, 8}
    assert {(r["way"], r["block"]) for r in rows} == {("group", None), ("dot", 16), ("dot", 32)}
    assert {r["kernels"] for r in rows} == {"tree", str(kernel_file)}
    assert all(r["max_diff_from_first"] < 1e-2 and r["ms_per_call"] > 0 for r in rows)
    # gpu_decode's flags for the fastest row of the tree's kernels per cache; nothing without the file
    fastest = min((r for r in rows if r["kernels"] == "tree" and r["bits"] == 8 and r["rotate"]),
                  key=lambda r: r["ms_per_token"])
    flags = script.best_flags(str(tmp_path / "attn.json"), 8).split()
    assert flags[1::2] == [fastest["way"], str(fastest["block"] or 64), str(fastest["programs"]), str(fastest["warps"])]
    assert script.best_flags(str(tmp_path / "missing.json"), 8) == ""
