"""The wheel carries kernels/, models/ and profiles/ inside the package, and no top-level `kernels`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_data_inside_the_package(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("localchat-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "localchat/kernels/__init__.py" in names
    native = {f"localchat/kernels/{p.name}" for p in (ROOT / "kernels").iterdir() if p.suffix in (".cpp", ".h")}
    assert "localchat/kernels/cpu_pool.h" in native and native <= names  # the CPU kernels build from the wheel
    assert "localchat/models/smollm2-135m-instruct.toml" in names
    assert "localchat/models/smollm2-135m-instruct/heads.safetensors" in names  # the shipped heads
    assert "localchat/models/smollm2-135m-instruct/heads.json" in names
    assert "localchat/builtin_profiles/__init__.py" in names
    assert "localchat/engine/engine.py" in names and "localchat/cli.py" in names
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "localchat").rglob("*.py")}
    assert sources <= names, f"modules missing from the wheel: {sorted(sources - names)}"
    tops = {n.split("/")[0] for n in names}
    assert tops <= {"localchat", next(t for t in tops if t.endswith(".dist-info"))}, tops
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "localchat = localchat.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_openmp_threads_wait_passively_unless_the_user_chose(tmp_path):
    """localchat sets OMP_WAIT_POLICY before torch loads OpenMP (spinning threads starve a busy CPU); a user's own
    value wins."""
    import os
    import subprocess
    import sys

    code = "import localchat, os, torch; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "PASSIVE"
    run = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, capture_output=True,
                         text=True, check=True)
    assert run.stdout.strip() == "ACTIVE"
