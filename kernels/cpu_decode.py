"""C++ kernels for the CPU decode step (cpu_decode.cpp): a whole decoder layer for one token (`layer_step`), with
attention of the token over the layer's kept units, RMSNorm, and one fp32 row times packed weights (`packed_row`:
own int4 code on torch's packed layout for AVX-512 (`int4_row`) and AVX2 CPUs, torch's kernel for int8). What
each way through a step gives: bench/results/cpu-decode/ab_paths.txt; the int4 code against torch's kernel:
bench/results/cpu-decode/int4_row.txt (AVX-512), bench/results/cpu-defaults-avx2/packed_row.txt (AVX2).

Built once per machine, by a child process, with torch's C++ extension builder (g++ and ninja, the toolchain
torch.compile's CPU backend needs too) into the user cache, keyed by the source, the flags, torch's and Python's
versions and the CPU's instruction flags (`-march=native`); later processes import the built library directly.
Without a compiler, or with LOCALCHAT_CPU_KERNELS=0, `kernels()` is None and the decode step keeps torch's ops
(`reason()` says why).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
HEADERS = [Path(__file__).with_name(h) for h in ("cpu_pool.h", "cpu_prefill.h")]  # included by SOURCE: in the build's key
FLAGS = ["-O3", "-march=native", "-fopenmp"]  # OpenMP: at::parallel_for runs on torch's threads only with it
_why: list[str] = []


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    """Where this source, torch and CPU build to."""
    from localchat import paths

    code = SOURCE.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)
    key = hashlib.sha256(code + torch.__version__.encode() + _cpu_flags().encode() + sys.version.encode()
                         + " ".join(FLAGS).encode()).hexdigest()[:16]
    return paths.cache_dir() / "kernels" / f"cpu_decode-{key}"


NAME = "localchat_cpu_decode"
BUILD_TIMEOUT = 900  # seconds: the first build takes about 30 s on 2 cores


@functools.cache
def kernels():
    """The built module (`decode_attention`, `rms_norm`, `attend_token`, `layer_step`, `packed_row`, and
    `int4_row` on AVX-512 CPUs), or None where it cannot be built here. Its one setting, `set_pool(us)`: the decode
    loops run on cpu_pool.h's threads, which spin up to `us` microseconds before sleeping (200 on Linux, the
    default), or with 0 on at::parallel_for (the pool's tests compare the two). A missing build is made by a child
    process (the compiler's and torch's builder's memory stay out of this one); the library is then imported
    directly."""
    if os.environ.get("LOCALCHAT_CPU_KERNELS", "1") == "0":
        _why.append("LOCALCHAT_CPU_KERNELS=0")
        return None
    try:
        where = build_dir()
        library = where / f"{NAME}.so"
        if not library.is_file():
            done = subprocess.run([sys.executable, "-m", "localchat.kernels.cpu_decode", str(where)],
                                  capture_output=True, text=True, timeout=BUILD_TIMEOUT)
            if done.returncode != 0 or not library.is_file():
                lines = (done.stderr or done.stdout or "no output").strip().splitlines()
                raise RuntimeError(f"the build failed: {lines[-1] if lines else 'no output'}")
        spec = importlib.util.spec_from_file_location(NAME, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a read-only cache: torch's ops instead
        _why.append(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}")
        return None


def build(where: Path) -> None:
    """Compile cpu_decode.cpp into `where` (torch's C++ extension builder; g++ and ninja)."""
    from torch.utils.cpp_extension import load

    where.mkdir(parents=True, exist_ok=True)
    load(name=NAME, sources=[str(SOURCE)], build_directory=str(where), extra_cflags=FLAGS,
         extra_ldflags=["-fopenmp"], verbose=False)


def prepare(say) -> None:
    """Build or load the kernels now (while a model loads, not at the first answer); `say` a line when the first
    build starts (about 30 s on 2 cores) and when torch's ops stand in."""
    if os.environ.get("LOCALCHAT_CPU_KERNELS", "1") != "0":
        try:
            fresh = not (build_dir() / f"{NAME}.so").is_file()
        except Exception:  # noqa: BLE001 - an unusable cache dir: kernels() says so below
            fresh = False
        if fresh:
            say("localchat: building the CPU decode kernels (once per machine)…")
    if kernels() is None and reason() != "LOCALCHAT_CPU_KERNELS=0":
        say(f"localchat: CPU decode kernels unavailable ({reason()}); decoding with torch's ops (slower)")


def reason() -> str | None:
    """Why `kernels()` is None (after it was asked), else None."""
    return _why[-1] if _why else None


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor | None:
    """`[1, H, G, d]` grouped queries against `[1, H, n, d]` keys and values -> `[1, H, G, d]`, or None where
    the kernel does not serve these tensors (not fp32 CPU, no unit stride, not built): use SDPA."""
    mod = kernels()
    if (mod is None or q.device.type != "cpu" or keys.dtype != torch.float32 or q.dtype != torch.float32
            or values.dtype != torch.float32 or keys.stride(-1) != 1 or values.stride(-1) != 1):
        return None
    return mod.decode_attention(q[0], keys[0], values[0], scale)[None]


if __name__ == "__main__":  # the child process of `kernels()`: python -m localchat.kernels.cpu_decode BUILD_DIR
    build(Path(sys.argv[1]))
