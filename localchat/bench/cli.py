"""`localchat bench`: argument parsing for the benchmark grid, `bench report DIR` and `bench perf`.

Heavy imports (torch, transformers) happen in `run`, so `localchat --help` stays fast.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from localchat.args import flags
from localchat.errors import UserError

USAGE = """examples:
  localchat bench --tasks passkey,niah_single --lengths 4096 --policies full,locret,streaming --budgets 512 \\
      -n 5 --out DIR --heads random
  localchat bench report DIR
  localchat bench perf --out DIR --heads random
  localchat bench decode --out DIR --weights fp32,int8,int4 --repeat 3
  localchat bench serve --out DIR --peer llama.cpp
  localchat bench kernels --out DIR
  localchat bench cross-check DIR_A DIR_B [--weights-a W] [--weights-b W] [--out FILE.md]
  localchat bench side-by-side DIR
  localchat bench by-length --out DIR SRC_DIR [SRC_DIR ...] [--budget 1024]
  localchat bench plot-training RUN_DIR/train-log.json OUT.png
  localchat bench random-model tests/data/configs/llama-3.1-8b-instruct.json DIR [--layers 2]"""


EVIDENCE = {"cross-check": "crosscheck", "side-by-side": "side_by_side", "by-length": "by_length",
            "plot-training": "training_plot", "random-model": "random_model"}  # subcommand -> module with main(args)


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """Flags shared with the top-level parser: SUPPRESS keeps a value given before `bench`."""
    s = argparse.SUPPRESS
    p.add_argument("--model", "-m", default=s, help="model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--heads", default=s, help="LOCRET retaining heads directory, or `random`")
    p.add_argument("--chunk", type=int, default=s, help="prefill chunk in tokens (default: the model card's)")
    p.add_argument("--seed", type=int, default=s, help="seed of the generated examples (default 0)")


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="offline long-context benchmark: accuracy, speed and memory per policy",
        description="Run tasks x lengths x policies x budgets x N examples; one JSONL row per example in "
                    "OUT/results.jsonl (resumable).",
        epilog=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("--tasks", default="passkey", help="comma-separated tasks (default passkey)")
    bench.add_argument("--lengths", default="4096", help="document lengths in tokens, e.g. 4096,8k,32k (passkeys: up to 1m)")
    bench.add_argument("--policies", default="full,locret", help="comma-separated policies (default full,locret)")
    bench.add_argument("--budgets", default="1024", help="budgets of the evicting policies (default 1024)")
    bench.add_argument("-n", type=int, default=5, help="examples per cell (default 5)")
    bench.add_argument("--examples", default=None, metavar="I,J,...",
                       help="run only these of the N examples, in this order (e.g. 19,9,14: the deep needles "
                            "first); rows are the same as a full run's")
    bench.add_argument("--out", help="results directory")
    bench.add_argument("--positions", default=argparse.SUPPRESS,
                       help="compact|original (default: compact for evicting policies, original for full)")
    bench.add_argument("--answer-tokens", type=int, default=None, help="answer length limit (default: per task)")
    bench.add_argument("--turns", default=None,
                       help="multiturn: unrelated turns between the document and the question, e.g. 0,3,9 (default 9)")
    bench.add_argument("--weights", default=argparse.SUPPRESS,
                       help="weight precisions, comma-separated (fp32,int8,int4,nf4,...; default: the device's dtype)")
    bench.add_argument("--kv", default=argparse.SUPPRESS,
                       help="KV cache quantization, comma-separated (none,int8,int4,int2; default none)")
    bench.add_argument("--sparse-prefill", type=float, default=None, metavar="R",
                       help="omnikv cells: filter layers pick R x chunk earlier tokens while reading (docs/methods/omnikv.md §2.8)")
    bench.add_argument("--max-copies", type=int, default=None, metavar="N",
                       help="locret cells: keep at most N copies of one token per KV head (engine/policies/repeats.py)")
    bench.add_argument("--focus", type=int, default=None, metavar="K",
                       help="locret cells: answer from the K kept units per KV head the question attends to most (engine/focus.py)")
    bench.add_argument("--focus-window", type=int, default=None, metavar="N",
                       help="with --focus: the question's last N tokens vote (default 32)")
    bench.add_argument("--focus-spread", type=int, default=None, metavar="N",
                       help="with --focus: a unit also takes the vote of the units up to N tokens before it (default 16)")
    bench.add_argument("--dry-run", action="store_true",
                       help="list the cells with examples left and estimate the time; run nothing")
    bench.add_argument("--in-process", action="store_true",
                       help="run every cell in this process (no per-cell peak RSS)")
    _engine_flags(bench)
    sub = bench.add_subparsers(dest="bench_command",
                                metavar="{report,perf,decode,serve,kernels,cross-check,side-by-side,by-length,plot-training,random-model}")
    report = sub.add_parser("report", help="DIR/results.jsonl -> DIR/report.md and PNG plots")
    report.add_argument("dir", help="a bench --out directory")
    perf = sub.add_parser("perf", help="LOCRET vs full speed side by side; time per token vs length")
    perf.add_argument("--out", help="directory for perf.json and perf.md")
    perf.add_argument("--length", default="7600", help="document tokens of the side-by-side run (default 7600)")
    perf.add_argument("--min-length", default="4096", help="shortest length of the scaling run (default 4096)")
    perf.add_argument("--max-length", default="32768", help="longest length of the scaling run (default 32768)")
    perf.add_argument("--budget", type=int, default=None, help="LOCRET budget (default: the model card's)")
    perf.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded side by side (default 64)")
    perf.add_argument("--max-copies", type=int, default=argparse.SUPPRESS, metavar="N",
                      help="also LOCRET with --max-copies N, for the cap's cost (a row beside plain LOCRET)")
    perf.add_argument("--focus", type=int, default=argparse.SUPPRESS, metavar="K",
                      help="also LOCRET with --focus K, for its cost (a row beside plain LOCRET)")
    perf.add_argument("--repeat", type=int, default=1,
                      help="measure every row this many times, interleaved; report the medians (default 1)")
    perf.add_argument("--peer", default=None,
                      help="also run llama.cpp on the same GGUF, in the same repeats (needs the [peers] extra)")
    _engine_flags(perf)
    dec = sub.add_parser("decode", help="decode speed by weight precision (fp32, int8, int4), one interleaved run")
    dec.add_argument("--out", help="directory for decode.json and decode.md")
    dec.add_argument("--weights", dest="decode_weights", default="fp32,int8,int4",
                     help="weight precisions, comma-separated (default fp32,int8,int4)")
    dec.add_argument("--length", default="7600", help="document tokens before the answer (default 7600)")
    dec.add_argument("--budget", type=int, default=None, help="LOCRET budget (default: the model card's)")
    dec.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per run (default 64)")
    dec.add_argument("--repeat", type=int, default=3, help="interleaved runs; the tables give medians (default 3)")
    dec.add_argument("--peer", default=None, help="also run llama.cpp on the same GGUF (needs the [peers] extra)")
    _engine_flags(dec)
    srv = sub.add_parser("serve", help="time to first token through `localchat serve`: first question, follow-up, "
                                       "follow-up after a restart; beside llama.cpp's server with --peer")
    srv.add_argument("--out", help="directory for serve.json and serve.md")
    srv.add_argument("--length", default="7600", help="document tokens (default 7600)")
    srv.add_argument("--answer-tokens", type=int, default=16, help="answer length limit (default 16)")
    srv.add_argument("--peer", default=None, help="also llama.cpp's server on the same GGUF (llama-cpp-python[server])")
    srv.add_argument("--layout", default="app", help="where the client puts the document, comma-separated: app, "
                                                     "open-webui, open-webui-system, in-place (default app)")
    srv.add_argument("--serve-flags", default="", metavar="FLAGS",
                     help="more `localchat serve` flags, in one quoted string (e.g. \"--weights int8\")")
    _engine_flags(srv)
    kern = sub.add_parser("kernels", help="each Triton kernel vs its torch twin; int4-KV decode end to end")
    kern.add_argument("--out", help="directory for kernels.json and kernels.md")
    kern.add_argument("--length", default="8192", help="document tokens of the end-to-end run (default 8192)")
    kern.add_argument("--budget", type=int, default=1024, help="LOCRET budget (default 1024)")
    kern.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per mode (default 64)")
    kern.add_argument("--reps", type=int, default=50, help="timed calls per kernel (median; default 50)")
    kern.add_argument("--micro-only", action="store_true", help="only the kernels on random inputs (no model)")
    kern.add_argument("--units", default="1024,4096,16384", help="cache lengths of the decode-attention rows")
    _engine_flags(kern)
    check = sub.add_parser("cross-check", help="two results dirs' fp32 rows on the same examples: same answers?")
    check.add_argument("a", help="a bench --out directory (A)")
    check.add_argument("b", help="another bench --out directory (B)")
    check.add_argument("--out", help="also write the table to this file (e.g. cross-check.md)")
    check.add_argument("--weights-a", default="fp32", help="the weights of A's rows to pair (default fp32)")
    check.add_argument("--weights-b", default="fp32", help="the weights of B's rows to pair (default fp32)")
    side = sub.add_parser("side-by-side", help="every policy's mean score, KV kept and peak memory, one table")
    side.add_argument("dir", help="a bench --out directory with the grid's 4K and 7,680 cells")
    by_len = sub.add_parser("by-length", help="accuracy against document length per policy, from several results dirs")
    by_len.add_argument("sources", nargs="+", help="bench --out directories (e.g. the 4K-32K grid and the long lanes)")
    by_len.add_argument("--out", required=True, help="directory for by-length.md and the plots")
    by_len.add_argument("--budget", type=int, default=1024, help="the budget to compare at (default 1024)")
    by_len.add_argument("--policies", default=None,
                        help="series to show, comma-separated as report labels them (default: each policy's plain one)")
    curve = sub.add_parser("plot-training", help="retaining heads' train-log.json -> a training-curve PNG")
    curve.add_argument("log", help="RUN_DIR/train-log.json of `localchat train-heads`")
    curve.add_argument("out", help="the PNG to write")
    rand = sub.add_parser("random-model", help="a model dir with random weights from a real config.json "
                                               "(speed and memory only)")
    rand.add_argument("config", help="a config.json (tests/data/configs/ holds Llama-3.1-8B, Qwen2.5-7B, Phi-3-mini)")
    rand.add_argument("out", help="the directory to write")
    rand.add_argument("--layers", type=int, default=None, help="keep the first N layers (default: all)")
    rand.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    rand.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    rand.add_argument("--tokenizer", default=None,
                      help="a folder with the tokenizer to use (default: the embedded default model's)")


def parse_list(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UserError(f"--{what} is empty")
    return items


def parse_length(text: str) -> int:
    """`4096`, `4k` or `4K` (x1024), `1m` or `1M` (x1024 x 1024)."""
    t = text.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(t[-1:], 1)
    try:
        return int(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise UserError(f"bad length {text!r}; give token counts like 4096, 4k or 1m") from None


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(t) for t in parse_list(text, what)]
    except ValueError:
        raise UserError(f"--{what} takes whole numbers, e.g. 512,1024 (got {text!r})") from None


def _out(args, what: str, files: str) -> Path:
    """--out, which `bench what` needs (one line naming what goes there when it is missing)."""
    if not args.out:
        raise UserError(f"{what} needs --out DIR (where {files} {'go' if ' and ' in files else 'goes'})")
    return Path(args.out)


def _typed(name: str) -> str:
    """`localchat bench name ...` as typed (for the report's command line)."""
    argv = sys.argv
    return shlex.join(["localchat", "bench", *argv[argv.index(name):]]) if name in argv else f"localchat bench {name}"


def _command(args, perf: bool) -> str:
    """The command line that reproduces this run (defaults spelled out)."""
    f = flags(args)
    parts = ["localchat", "bench"]
    if perf:
        parts += ["perf", "--out", args.out or "", "--length", args.length, "--min-length", args.min_length,
                  "--max-length", args.max_length, "--decode-tokens", str(args.decode_tokens)]
        if args.repeat != 1:
            parts += ["--repeat", str(args.repeat)]
        if args.budget is not None:
            parts += ["--budget", str(args.budget)]
        if args.max_copies is not None:
            parts += ["--max-copies", str(args.max_copies)]
        if args.focus is not None:
            parts += ["--focus", str(args.focus)]
    else:
        parts += ["--tasks", args.tasks, "--lengths", args.lengths, "--policies", args.policies,
                  "--budgets", args.budgets, "-n", str(args.n), "--out", args.out or ""]
        if f["positions"]:
            parts += ["--positions", f["positions"]]
        if args.answer_tokens is not None:
            parts += ["--answer-tokens", str(args.answer_tokens)]
        if args.turns is not None:
            parts += ["--turns", args.turns]
        if args.examples is not None:
            parts += ["--examples", args.examples]
        if args.sparse_prefill is not None:
            parts += ["--sparse-prefill", f"{args.sparse_prefill:g}"]
        if args.max_copies is not None:
            parts += ["--max-copies", str(args.max_copies)]
        if args.focus is not None:
            parts += ["--focus", str(args.focus)]
        for flag in ("focus_window", "focus_spread"):
            if getattr(args, flag) is not None:
                parts += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        for flag in ("weights", "kv"):
            if f[flag]:
                parts += [f"--{flag}", f[flag]]
        if args.in_process:
            parts.append("--in-process")
    for flag in ("model", "heads", "chunk", "seed"):
        value = f[flag]
        if value is not None:
            parts += [f"--{flag}", str(value)]
    return shlex.join(parts)


def _quant_axis(text: str | None, what: str) -> list[str | None]:
    """`--weights` / `--kv` lists; `none` (kv) is the unquantized cache, stored as None so old rows still match."""
    if not text:
        return [None]
    from localchat.engine.qcache import KV_CHOICES
    from localchat.engine.quantize import WEIGHTS

    known = WEIGHTS if what == "weights" else KV_CHOICES
    values = parse_list(text, what)
    for v in values:
        if v not in known:
            raise UserError(f"unknown --{what} {v!r}; choose from: {', '.join(known)}")
    return [None if v == "none" else v for v in values]


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args) -> int:
    if args.bench_command == "report":
        from localchat.bench.report import write_report

        print(write_report(Path(args.dir), say=_say))
        return 0
    if args.bench_command == "perf":
        return _run_perf(args)
    if args.bench_command == "kernels":
        return _run_kernels(args)
    if args.bench_command == "decode":
        return _run_decode(args)
    if args.bench_command == "serve":
        return _run_serve(args)
    if args.bench_command in EVIDENCE:  # the grid's evidence tables and the heads' training curve
        from importlib import import_module

        return import_module(f"localchat.bench.{EVIDENCE[args.bench_command]}").main(args)
    from localchat.bench.runner import BenchConfig
    from localchat.bench.runner import run as run_grid

    out = _out(args, "bench", "results.jsonl")
    f = flags(args)
    config = BenchConfig(
        tasks=parse_list(args.tasks, "tasks"), lengths=[parse_length(t) for t in parse_list(args.lengths, "lengths")],
        policies=parse_list(args.policies, "policies"), budgets=_ints(args.budgets, "budgets"), n=args.n,
        out=out, model=f["model"], heads=f["heads"], chunk=f["chunk"], positions=f["positions"],
        seed=f["seed"] or 0, answer_tokens=args.answer_tokens, in_process=args.in_process,
        turns=_ints(args.turns, "turns") if args.turns is not None else None,
        examples=_ints(args.examples, "examples") if args.examples is not None else None,
        weights=_quant_axis(f["weights"], "weights"), kv=_quant_axis(f["kv"], "kv"), sparse_prefill=args.sparse_prefill,
        max_copies=args.max_copies, focus=args.focus, focus_window=args.focus_window, focus_spread=args.focus_spread,
        command=_command(args, perf=False),
    )
    if args.dry_run:
        from localchat.bench.runner import dry_run

        print("\n".join(dry_run(config)))
        return 0
    run_grid(config, say=_say)
    return 0


def _run_kernels(args) -> int:
    from localchat.bench.kernels import KernelConfig
    from localchat.bench.kernels import run as run_kernels

    out = _out(args, "bench kernels", "kernels.json and kernels.md")
    f = flags(args)
    config = KernelConfig(out=out, model=f["model"], length=parse_length(args.length),
                          budget=args.budget, decode_tokens=args.decode_tokens, reps=args.reps,
                          micro_only=args.micro_only, units=tuple(_ints(args.units, "units")),
                          seed=f["seed"] or 0,
                          command=_typed("kernels"))
    print(run_kernels(config, say=_say).read_text(encoding="utf-8"))
    return 0


def _run_decode(args) -> int:
    from localchat.bench.decode import DecodeConfig
    from localchat.bench.decode import run as run_decode

    out = _out(args, "bench decode", "decode.json and decode.md")
    f = flags(args)
    config = DecodeConfig(out=out, model=f["model"], weights=parse_list(args.decode_weights, "weights"),
                          length=parse_length(args.length), budget=args.budget, chunk=f["chunk"],
                          heads=f["heads"], decode_tokens=args.decode_tokens, repeat=args.repeat,
                          seed=f["seed"] or 0, peer=args.peer,
                          command=_typed("decode"))
    print(run_decode(config, say=_say).read_text(encoding="utf-8"))
    return 0


def _run_serve(args) -> int:
    from localchat.bench.serve import LAYOUTS, ServeConfig
    from localchat.bench.serve import run as run_serve

    out = _out(args, "bench serve", "serve.json and serve.md")
    f = flags(args)
    if args.answer_tokens < 1:
        raise UserError(f"--answer-tokens must be at least 1 (got {args.answer_tokens})")
    layouts = tuple(x.strip() for x in args.layout.split(",") if x.strip())
    wrong = [x for x in layouts if x not in LAYOUTS]
    if wrong or not layouts:
        raise UserError(f"--layout takes {', '.join(LAYOUTS)} (got {args.layout!r})")
    config = ServeConfig(layouts=layouts, out=out, model=f["model"], length=parse_length(args.length), answer_tokens=args.answer_tokens,
                         seed=f["seed"] or 0, peer=args.peer, extra=tuple(shlex.split(args.serve_flags)),
                         command=_typed("serve"))
    print(run_serve(config, say=_say).read_text(encoding="utf-8"))
    return 0


def _run_perf(args) -> int:
    from localchat.bench.perf import PerfConfig, doubling
    from localchat.bench.perf import run as run_perf

    out = _out(args, "bench perf", "perf.json and perf.md")
    low, high = parse_length(args.min_length), parse_length(args.max_length)
    f = flags(args)
    if low > high:
        raise UserError(f"--min-length {low} is above --max-length {high}")
    config = PerfConfig(
        out=out, model=f["model"], chunk=f["chunk"],
        length=parse_length(args.length), lengths=doubling(low, high), budget=args.budget,
        heads=f["heads"] or "random", decode_tokens=args.decode_tokens,
        seed=f["seed"] or 0, repeat=args.repeat, peer=args.peer, max_copies=args.max_copies,
        focus=args.focus,
        command=_command(args, perf=True),
    )
    path = run_perf(config, say=_say)
    print(path.read_text(encoding="utf-8"))
    return 0
