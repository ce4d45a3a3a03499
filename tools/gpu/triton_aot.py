"""Triton launches compiled for a GPU architecture on a machine without a GPU (tools/gpu/compile_check.py's
second half). A launch is recorded as what Triton specializes it on (`spec`); `compile_all` rebuilds arguments
that specialize the same way (`rebuild`) and compiles each kernel with Triton's own compiler and bundled ptxas,
through a driver that names the architecture and has no device (`Target`).

Import it in a process where TRITON_INTERPRET is not "1": Triton reads it once, when imported, and its
interpreter patches triton.language while it runs, which the compiler cannot use.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime import driver


class Target(DriverBase):
    """A driver that names a GPU architecture and has no device: enough for Triton to compile, never to launch."""

    def __init__(self, arch: int):
        self.arch = arch

    @classmethod
    def is_active(cls):
        return True

    def get_current_target(self):
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self):
        return self.arch  # Triton keeps a kernel cache per device: one per architecture

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty):
        raise NotImplementedError

    def get_benchmarker(self):
        raise NotImplementedError

    def get_device_interface(self):
        raise NotImplementedError

    def get_empty_cache_for_benchmark(self):
        raise NotImplementedError

    def clear_cache(self, cache):
        pass


def compiled_copy(path: Path, name: str):
    """The kernels file at `path` imported with Triton's JIT, as module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def resources(cubin: bytes) -> dict[str, int]:
    """REG, LOCAL (spill) and SHARED of a cubin's kernel, from the cuobjdump Triton bundles, and its count of
    global-memory load instructions in the machine code (`ldg`: a static measure of the load work)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
    out = {}
    for field in text.split():
        key, _, value = field.partition(":")
        if key in ("REG", "LOCAL", "SHARED", "STACK") and value.isdigit():
            out[key.lower()] = int(value)
    out["ldg"] = len(re.findall(r"\bLDG\.", sass))
    return out


def spec(value):
    """What Triton specializes a launch argument on, as JSON: a tensor's dtype and 16-byte alignment, a scalar."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(f"a launch argument of type {type(value).__name__}")


def rebuild(s):
    """An argument that Triton specializes as it did the recorded one."""
    if "tensor" not in s:
        return s["value"]
    t = torch.empty(64, dtype=getattr(torch, s["tensor"]))
    return t if s["aligned"] else t[1:]


def compile_all(launches: list[dict], targets: list[int], files: dict[str, Path] | None = None) -> list[dict]:
    """Each recorded launch compiled for each target, in a process that has not run the interpreter (it patches
    triton.language while it runs); a row per distinct compiled kernel, or per failure. `files`: a kernels
    module's file by name, where it is not localchat.kernels' own."""
    copies: dict[str, object] = {}
    rows: dict[tuple, dict] = {}
    for launch in launches:
        name = launch["module"]
        if name not in copies:
            path = (files or {}).get(name) or Path(importlib.util.find_spec(f"localchat.kernels.{name}").origin)
            copies[name] = compiled_copy(path, f"compile_check_{name}")
        twin = getattr(copies[name], launch["kernel"])
        args = [rebuild(a) for a in launch["args"]]
        kwargs = {k: rebuild(v) for k, v in launch["kwargs"].items()}
        constexprs = _constexprs(twin, args, kwargs)
        for arch in targets:
            driver.set_active(Target(arch))  # left active: no real driver exists here to go back to
            t0 = time.perf_counter()
            base = {"kernel": launch["kernel"], "target": f"sm_{arch}", "where": launch["where"],
                    "constexprs": constexprs}
            try:
                kernel = twin.warmup(*args, grid=(1,), **kwargs)
            except Exception as exc:  # noqa: BLE001 - the failure is the finding
                rows.setdefault((launch["kernel"], arch, "error", constexprs),
                                {**base, "error": f"{type(exc).__name__}: {_short(exc)}"})
                continue
            key = (launch["kernel"], arch, kernel.hash)
            if key not in rows:
                rows[key] = {**base, "warps": kernel.metadata.num_warps,
                             "seconds": round(time.perf_counter() - t0, 2), **resources(kernel.asm["cubin"])}
    return sorted(rows.values(), key=lambda r: (r["kernel"], r["target"], r["constexprs"]))


def _short(exc: Exception) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return " | ".join(lines[-3:])[:400] if lines else ""


def _constexprs(twin, args, kwargs) -> str:
    values = dict(zip([p.name for p in twin.params], args)) | kwargs
    return ",".join(f"{p.name}={values[p.name]}" for p in twin.params if p.is_constexpr and p.name in values)
