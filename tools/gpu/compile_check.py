"""Compile every Triton kernel of the GPU's paths for real GPUs, on a machine without one.

Triton's interpreter (the CPU tests) runs a kernel's Python; it does not compile it, so a kernel can pass every
CPU test and fail to compile on the GPU (a loop-carried value that changes type, a `tl.dot` tile under 16, a
constexpr the compiler refuses), or compile and spill registers. This script runs the app's own code on the CPU
with the kernels interpreted, and compiles each launch, with the same arguments, to the GPU's machine code
(Triton's compiler and its bundled ptxas, for the `--targets` architectures; no GPU, no driver):

  1. the engine on a model of `--config`'s shape (random weights, `--layers` layers, bf16 as on a GPU), LOCRET
     with retaining heads of the release's shape (d_R = 1,024): a chunked read with eviction, then tokens decoded
     through the captured decode step's body, per `--kv` cache and split kernel way (`--ways`), and once more
     with the step's GEMVs (GraphStep(..., gemv=True));
  2. decode attention alone at a long cache (`--units`, as after a 128K read at b = 16,384) in each way, block
     and warps a program (`--warps`), compiled only.

It prints a row per compiled kernel and target: registers per thread, local memory (spills: > 0 is slow),
shared memory, the global-memory load instructions in its machine code (LDG), warps. Exit 1 when any launch
fails to compile (the row says why).

    python tools/gpu/compile_check.py [--config tests/data/configs/llama-3.1-8b-instruct.json]
        [--targets 90,89,86] [--kv none,int8,int4] [--ways group,dot,head] [--warps 4,8] [--out FILE.json]
Targets: 90 H100/H200, 89 RTX 4090/4060, 86 RTX 3090/3060 and A10, 80 A100.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Triton reads this when imported: the child (--record) runs the app's kernels interpreted; this process compiles
RECORDING = "--record" in sys.argv
os.environ["TRITON_INTERPRET"] = "1" if RECORDING else "0"
os.environ["LOCALCHAT_KERNELS"] = "triton"

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton_aot import compile_all, spec  # noqa: E402 - beside this file

ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    """Wraps the interpreter's launches: each one's kernel and arguments are recorded, once per specialization,
    then it runs interpreted (or not, where `execute` is off: its results are not needed)."""

    def __init__(self):
        self.launches: dict[str, dict] = {}
        self.execute = True
        self.where = ""  # what the app was doing, for the rows
        self._run = InterpretedFunction.run

    def launch(self, fn, *args, grid, warmup, **kwargs):
        record = {"module": fn.fn.__module__.rsplit(".", 1)[-1], "kernel": fn.fn.__name__,
                  "args": [spec(a) for a in args], "kwargs": {k: spec(v) for k, v in kwargs.items()}}
        self.launches.setdefault(json.dumps(record, sort_keys=True), {**record, "where": self.where})
        if self.execute:
            return self._run(fn, *args, grid=grid, warmup=warmup, **kwargs)
        return None

    @contextlib.contextmanager
    def installed(self):
        recorder = self

        def run(fn, *args, grid, warmup, **kwargs):
            return recorder.launch(fn, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        try:
            yield self
        finally:
            InterpretedFunction.run = self._run


def tokenizer():
    """The tests' byte-level tokenizer (258 ids): the engine wants one; the kernels do not care which."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import tiny_tokenizer

    return tiny_tokenizer()


def model_of(config_path: str, layers: int, vocab: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads(Path(config_path).read_text()))
    config.num_hidden_layers, config.vocab_size = layers, vocab
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).eval()


def drive_engine(recorder: Recorder, model, tok, kv: str, way: str, read: int, budget: int,
                 gemv: bool = False) -> None:
    """A LOCRET read with eviction and a few tokens through the captured step's body (eager on a CPU), its split
    kernel's `way`; `gemv`: with GraphStep's `gemv=True` products."""
    from localchat.engine.engine import Decoding, Engine
    from localchat.engine.graph_step import GraphStep
    from localchat.engine.heads import RetainingHeads
    from localchat.engine.policies import make_policy
    from localchat.engine.sampling import GenerationSettings
    from localchat.kernels import qattn

    heads = RetainingHeads.random(model, d_r=1024).to(torch.bfloat16)
    policy = make_policy("locret", budget=budget, stabilizers=16, local=32, heads=heads)
    steps = []  # the engine builds the step for the cache: with these settings, taken on the CPU too (eagerly)

    def make(model, cache, heads) -> GraphStep:
        steps.append(GraphStep(model, cache, heads, gemv=gemv, split=qattn.Split(way=way)))
        return steps[-1]

    engine = Engine(model, tok, chunk=max(64, budget // 2), policy=policy, kv=kv,
                    decoding=Decoding(graph_devices=("cuda", "cpu"), make_step=make))
    if gemv:
        _record_gemvs(recorder)
    ids = torch.randint(3, len(tok) - 3, (read,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = engine.new_cache(read, 4)
    recorder.where = f"engine kv={kv} way={way}" + (" gemv" if gemv else "")
    for event in engine.continue_on(cache, ids, 0, GenerationSettings(max_new_tokens=3, ignore_eos=True)):
        if type(event).__name__ == "Error":
            raise SystemExit(f"error: {event.message}")
    step = steps[-1] if steps else None
    if step is None or step.reason or not step.inputs.any():
        raise SystemExit(f"the decode step was not taken ({kv}, {way}): nothing of it was compiled")


def _record_gemvs(recorder: Recorder) -> None:
    """fused.norm_linear and silu_linear record their launches without running them, and answer with the ops
    they replace (interpreting an 8B-sized GEMV takes minutes on 2 cores)."""
    from localchat.kernels import fused

    norm_linear, silu_linear = fused.norm_linear, fused.silu_linear

    def recorded(launch, *args):
        recorder.execute = False
        try:
            launch(*args)
        finally:
            recorder.execute = True

    def norm_twin(x, residual, norm, weight, bias=None):
        recorded(norm_linear, x, residual, norm, weight, bias)
        normed, total = fused.add_rms_norm(x, residual, norm)
        return torch.nn.functional.linear(normed, weight, bias), total

    def silu_twin(gate, up, weight, bias=None):
        recorded(silu_linear, gate, up, weight, bias)
        return torch.nn.functional.linear(fused.silu_mul(gate, up), weight, bias)

    fused.norm_linear, fused.silu_linear = norm_twin, silu_twin


def drive_attention(recorder: Recorder, config: dict, units: int, bits_list: list[int], ways: list[str],
                    warps: list[int]) -> None:
    """Decode attention alone over `units` units, at each warps a program (compiled, not run), with the cache and
    RoPE frequencies that bench/experiments/gpu_attn.py times on the GPU."""
    from localchat.kernels import graph_attn, qattn
    from localchat.kernels.quant import group_size

    sys.path.insert(0, str(ROOT / "bench" / "experiments"))
    from gpu_attn import cache, inv_freq

    hq, h = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or config["hidden_size"] // hq
    q = torch.randn(1, hq, 1, d, dtype=torch.bfloat16)
    tk, tv = (torch.randn(1, h, 64, d, dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([units, 64])
    inv = inv_freq(d)
    recorder.execute = False
    for bits in bits_list:
        main = cache(h, units, d, bits, "cpu")
        for way in ways:
            for block in ((32, 64) if way == "dot" else (qattn.DEFAULT.block,)):
                for w in warps:
                    split = qattn.Split(way=way, block=block, warps=w)
                    recorder.where = f"attention {units} units, {bits or 16}-bit"
                    graph_attn.attention_triton(q, main, *((tk, tv) if bits else (None, None)), lens, bits,
                                                group_size(d), d ** -0.5, inv if bits else None, split)
    recorder.execute = True


def record(args) -> list[dict]:
    """The app's launches on this CPU, interpreted (in a child process: see compile_all)."""
    from localchat import kernels

    kernels.reset_backend()
    recorder = Recorder()
    ways, kvs = args.ways.split(","), args.kv.split(",")
    with recorder.installed():
        tok = tokenizer()
        model = model_of(args.config, args.layers, len(tok))
        for kv in kvs:
            for way in ways:
                drive_engine(recorder, model, tok, kv, way, args.read, args.read // 3)
        drive_engine(recorder, model, tok, kvs[0], ways[0], args.read, args.read // 3, gemv=True)
        if args.units:
            bits = sorted({0 if kv == "none" else int(kv[3:]) for kv in kvs}, reverse=True)
            drive_attention(recorder, json.loads(Path(args.config).read_text()), args.units, bits, ways,
                            [int(w) for w in args.warps.split(",")])
    return list(recorder.launches.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "tests/data/configs/llama-3.1-8b-instruct.json"))
    p.add_argument("--targets", default="90,89,86")
    p.add_argument("--kv", default="none,int8,int4")
    p.add_argument("--ways", default="group,dot,head")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--read", type=int, default=600, help="tokens the engine reads (its budget is a third of it)")
    p.add_argument("--units", type=int, default=16527, help="decode attention alone over this many units (0: not)")
    p.add_argument("--warps", default="4,8", help="warps a split kernel's program, for the attention alone")
    p.add_argument("--out", help="FILE.json: the rows")
    p.add_argument("--record", help=argparse.SUPPRESS)  # the child: write the launches to this file
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.record:
        Path(args.record).write_text(json.dumps(record(args)))
        return 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        launches = Path(tmp) / "launches.json"
        child = subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                                "--record", str(launches)])
        if child.returncode:
            print(f"error: the app's run on the CPU failed (exit {child.returncode}); nothing compiled")
            return child.returncode
        recorded = json.loads(launches.read_text())
    targets = [int(t) for t in args.targets.split(",")]
    rows = compile_all(recorded, targets)
    failed = [r for r in rows if "error" in r]
    lines = [f"# Triton kernels compiled for {', '.join(f'sm_{t}' for t in targets)} on a CPU: "
             f"{Path(args.config).stem}'s shapes", "",
             f"{len(recorded)} launches recorded, {len(rows)} compiled kernels, {len(failed)} failed, "
             f"{time.perf_counter() - t0:.0f} s. local > 0: registers spilled to memory.", "",
             "| kernel | target | regs | local | shared | LDG | warps | constexprs | where |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['target']} | FAILED: {r['error']} | | | | | {r['constexprs']} | "
                         f"{r['where']} |")
        else:
            lines.append(f"| {r['kernel']} | {r['target']} | {r.get('reg')} | {r.get('local')} | {r.get('shared')} | "
                         f"{r.get('ldg')} | {r['warps']} | {r['constexprs']} | {r['where']} |")
    print("\n".join(lines))
    if args.out:
        config = os.path.relpath(args.config, ROOT) if Path(args.config).resolve().is_relative_to(ROOT) else args.config
        Path(args.out).write_text(json.dumps({"config": config, "targets": targets, "rows": rows},
                                             indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
