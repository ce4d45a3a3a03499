"""tools/gpu/compile_check.py: the app's Triton kernels compiled for a GPU on this CPU, from the launches of a real
engine run (interpreted); a kernel the interpreter runs but the compiler refuses is reported, not passed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "gpu" / "compile_check.py"
BAD = '''
import triton
import triton.language as tl


@triton.jit
def bad_kernel(x_ptr, n, BLOCK: tl.constexpr):
    acc = 0
    for i in range(0, n):
        acc = acc + tl.load(x_ptr + i)  # an int that becomes a float in the loop: the interpreter does not mind
    tl.store(x_ptr, acc)


@triton.jit
def good_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)
'''


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOCALCHAT_KERNELS")}
    return env | {"PYTHONPATH": str(ROOT)}


def test_the_decode_steps_kernels_compile_for_sm90(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    config = ROOT / "tests/data/configs/smollm2-135m-instruct.json"
    run = subprocess.run([sys.executable, str(TOOL), "--config", str(config),
                          "--targets", "90", "--kv", "int8", "--ways", "group,dot", "--read", "300", "--units", "300",
                          "--warps", "4", "--out", str(out)], env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    names = {r["kernel"] for r in rows}
    assert {"add_rms_norm_kernel", "silu_mul_kernel", "heads_score_kernel", "rope_write_kernel",
            "qattn_group_kernel", "qattn_dot_kernel", "merge_kernel", "norm_gemv_kernel", "silu_gemv_kernel"} <= names
    assert all(r["target"] == "sm_90" and r["reg"] > 0 and "error" not in r for r in rows)
    assert "| qattn_dot_kernel | sm_90 |" in run.stdout


def test_a_kernel_the_compiler_refuses_is_reported(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text(BAD)
    launch = {"module": "bad", "args": [{"tensor": "float32", "aligned": True}, {"value": 7}],
              "kwargs": {"BLOCK": {"value": 16}}, "where": "a test"}
    code = (f"import sys, json; sys.path.insert(0, {str(TOOL.parent)!r}); import triton_aot as c; "
            "from pathlib import Path; "
            f"launches = [dict({launch!r}, kernel=k) for k in ('bad_kernel', 'good_kernel')]; "
            f"files = {{'bad': Path({str(tmp_path / 'bad.py')!r})}}; "
            "print(json.dumps(c.compile_all(launches, [90, 89], files=files)))")
    run = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {(r["kernel"], r["target"]): r for r in json.loads(run.stdout.splitlines()[-1])}
    assert set(rows) == {(k, t) for k in ("bad_kernel", "good_kernel") for t in ("sm_90", "sm_89")}
    assert all("acc" in rows["bad_kernel", t]["error"] for t in ("sm_90", "sm_89"))
    assert all("error" not in rows["good_kernel", t] and rows["good_kernel", t]["reg"] > 0 for t in ("sm_90", "sm_89"))
