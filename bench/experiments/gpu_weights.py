"""The weight products of one decoded token alone, by weight precision: what the weights of a decode step cost at
a model's shape, and which 4-bit kernel to decode with (bitsandbytes' nf4 against torch's int4 through
optimum-quanto, beside LLM.int8 and bf16).

For each `--weights`, the decoder's linear layers of `--layers` layers (q, k, v, o, gate, up, down; shapes from
`--config`; random weights), quantized as the app quantizes them, and the output layer at bf16 (the app keeps it
at full precision). One token's products through all of them:
  bf16   torch.nn.Linear
  nf4    bitsandbytes Linear4bit: nf4, double quantization, bf16 compute (engine/quantize.py's BitsAndBytesConfig)
  int8   CUDA: bitsandbytes Linear8bitLt (LLM.int8, fp16); CPU: kernels/packed.py's int8 rows
  int4   CUDA: optimum-quanto qint4, frozen (torch's tinygemm int4 at bf16); CPU: kernels/packed.py's int4
  int4-fp16  CUDA: the same at fp16, where quanto takes its AWQ kernels instead (not an app choice: a comparison;
             quanto builds its CUDA extension for it first, minutes where nvcc exists)
On CUDA the time is that of a replayed CUDA graph of the products (as inside the captured decode step; the wall
time, launches included, beside it), else the wall time. Per row: ms per token (all layers, and the output
layer's share), the bytes of weights read, GB/s and their share of the device's copy bandwidth (a large device
copy, read + write), the decode rate if a step were these products alone, and one product's relative error
against its bf16 weights (a broken path shows).
A precision that cannot run here (no bitsandbytes, no CUDA build of it) gets a row that says why.

    python bench/experiments/gpu_weights.py --config tests/data/configs/llama-3.1-8b-instruct.json \\
        --weights bf16,nf4,int4,int8 --out OUT.json
Random weights: speed only. On a CPU a dry run (`--layers 2`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_attn's timer, beside this file
from gpu_attn import timed  # noqa: E402

WEIGHTS = ("bf16", "nf4", "int4", "int8", "int4-fp16")
HALF = ("int8", "int4-fp16")  # computed in fp16 on CUDA


def shapes(config: dict) -> list[tuple[str, int, int]]:
    """(name, in, out) of one decoder layer's linear layers."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or hidden // heads
    return [("q", hidden, heads * d), ("k", hidden, kv * d), ("v", hidden, kv * d), ("o", heads * d, hidden),
            ("gate", hidden, inter), ("up", hidden, inter), ("down", inter, hidden)]


def convert(linear: torch.nn.Linear, weights: str, dev: torch.device) -> torch.nn.Module:
    """`linear` (bf16, on `dev`) as the app's `weights` layer on `dev`."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights}; choose from {', '.join(WEIGHTS)}")
    if weights == "bf16":
        return linear
    if weights == "nf4" or (weights == "int8" and dev.type == "cuda"):
        import bitsandbytes as bnb

        w = linear.weight.detach()
        if weights == "nf4":
            out = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False, compute_dtype=torch.bfloat16,
                                    compress_statistics=True, quant_type="nf4", device="meta")
            out.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4")
        else:
            out = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=False, has_fp16_weights=False,
                                      threshold=6.0, device="meta")
            # Int8Params quantizes only on a move from the CPU (Params4bit on any move that is not yet quantized)
            out.weight = bnb.nn.Int8Params(w.half().cpu(), requires_grad=False, has_fp16_weights=False)
        return out.to(dev)  # bitsandbytes quantizes when the parameter is moved
    if dev.type == "cpu":
        if weights == "int4-fp16":
            raise ValueError("int4-fp16 compares quanto's CUDA kernels; a CPU has none")
        from localchat.kernels.packed import PackedLinear

        return PackedLinear(linear, 8 if weights == "int8" else 4)
    from optimum.quanto import freeze, qint4, quantize

    holder = torch.nn.Sequential(linear.half() if weights == "int4-fp16" else linear)
    with torch.inference_mode():
        quantize(holder, weights=qint4)
        freeze(holder)
    return holder[0]


def build(config: dict, layers: int, weights: str, dev: torch.device, seed: int) -> tuple[list, torch.nn.Linear, float]:
    """(the layers' converted modules, the bf16 output layer, one product's relative error against bf16)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    modules, error = [], None
    for _ in range(layers):
        for _name, n_in, n_out in shapes(config):
            linear = torch.nn.Linear(n_in, n_out, bias=False, device=dev, dtype=torch.bfloat16)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(n_out, n_in, device=dev, generator=gen) * n_in ** -0.5)
            reference = linear.weight.detach().float().clone() if error is None else None
            module = convert(linear, weights, dev)
            if reference is not None:
                x = torch.randn(1, n_in, device=dev, generator=gen).to(torch.bfloat16)
                with torch.inference_mode():
                    got = module(x.half() if weights in HALF and dev.type == "cuda" else x).float()
                want = x.float() @ reference.T
                error = float((got - want).norm() / want.norm())
            modules.append(module)
            del linear
    head = torch.nn.Linear(config["hidden_size"], config["vocab_size"], bias=False, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        head.weight.normal_(0, config["hidden_size"] ** -0.5, generator=gen)
    return modules, head, error


def weight_bytes(modules) -> int:
    from localchat.engine.quantize import weight_bytes as real_bytes

    return real_bytes(torch.nn.ModuleList(modules))


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def copy_bandwidth(dev: torch.device) -> float:
    """GB/s of a large copy on `dev`, bytes read plus written."""
    n = (1 << 30) if dev.type == "cuda" else (1 << 27)
    src, dst = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    wall, graph = timed(lambda: dst.copy_(src), 10, dev.type)
    return 2 * n / (graph or wall) / 1e6


def row(config: dict, layers: int, weights: str, dev: torch.device, repeat: int, peak: float) -> dict:
    try:
        modules, head, error = build(config, layers, weights, dev, seed=0)
    except Exception as exc:  # noqa: BLE001 - a precision this machine cannot run: the row says why
        return {"weights": weights, "error": _why(exc)}
    act = torch.float16 if weights in HALF and dev.type == "cuda" else torch.bfloat16
    inputs = {n: torch.randn(1, n, device=dev).to(act) for n in {m.in_features for m in modules}}
    hidden = torch.randn(1, config["hidden_size"], device=dev, dtype=torch.bfloat16)

    def products():
        for m in modules:
            m(inputs[m.in_features])

    try:
        failed = []  # a product that cannot be captured: the wall times stand
        with torch.inference_mode():
            wall, graph = timed(products, repeat, dev.type, failed)
            head_wall, head_graph = timed(lambda: head(hidden), repeat, dev.type, failed)
    except Exception as exc:  # noqa: BLE001
        return {"weights": weights, "error": _why(exc)}
    captured = graph is not None and head_graph is not None
    layers_ms, head_ms = (graph, head_graph) if captured else (wall, head_wall)
    read = weight_bytes(modules) + weight_bytes([head])
    ms = layers_ms + head_ms
    gbs = read / ms / 1e6
    timing = "graph" if captured else ("wall (graph not captured: " + _why(failed[0]) + ")" if failed else "wall")
    weight = getattr(modules[0], "weight", None)
    kernel = type(modules[0]).__name__
    if weight is not None and type(weight) not in (torch.Tensor, torch.nn.Parameter):
        kernel += f" ({type(weight).__name__})"  # quanto's tinygemm / AWQ / Marlin tensors, bitsandbytes' params
    out = {"weights": weights, "kernel": kernel, "timed": timing, "ms_per_token": round(ms, 3),
           "wall_ms_per_token": round(wall + head_wall, 3),
           "layers_ms": round(layers_ms, 3), "head_ms": round(head_ms, 3), "bytes": read, "gb_s": round(gbs, 1),
           "of_copy": round(gbs / peak, 3), "tok_s_if_only_weights": round(1000 / ms, 1),
           "rel_error": round(error, 4)}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a model's config.json (tests/data/configs/)")
    p.add_argument("--weights", default=",".join(WEIGHTS))
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the config's)")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out", required=True, help="OUT.json; OUT.md beside it")
    args = p.parse_args(argv)
    config = json.loads(Path(args.config).read_text())
    layers = args.layers or config["num_hidden_layers"]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peak = copy_bandwidth(dev)
    rows = []
    for weights in args.weights.split(","):
        rows.append(row(config, layers, weights, dev, args.repeat, peak))
        if dev.type == "cuda":  # the last precision's layers are gone with row()'s frame
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    command = "python bench/experiments/gpu_weights.py " + " ".join(argv or __import__("sys").argv[1:])
    result = {"command": command, "device": device, "copy_gb_s": round(peak, 1), "layers": layers, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    timing = "median wall time"
    if dev.type == "cuda":
        timing = "a replayed CUDA graph where it could be captured (else the wall time, the row says)"
    lines = [f"# One decoded token's weight products: {Path(args.config).stem}, {layers} layers + the output layer, "
             f"on {device} (random weights, speed only)", "", f"Command: `{command}`", "",
             f"Time: {timing}. Copy bandwidth here (read + write): {peak:,.0f} GB/s.", "",
             "| weights | kernel | timed | ms/token | wall ms/token | layers ms | output layer ms | MiB read | GB/s "
             "| of copy | tok/s if only these | rel. error |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['weights']} | not run: {r['error']} | | | | | | | | | | |")
        else:
            lines.append(f"| {r['weights']} | {r['kernel']} | {r['timed']} | {r['ms_per_token']} | "
                         f"{r['wall_ms_per_token']} | {r['layers_ms']} | {r['head_ms']} "
                         f"| {r['bytes'] / 2**20:,.0f} | {r['gb_s']:,} | {r['of_copy']:.0%} | "
                         f"{r['tok_s_if_only_weights']:,} | {r['rel_error']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
