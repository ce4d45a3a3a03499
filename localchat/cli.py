"""Command line: argument parsing and dispatch; each command's work is in its own module (ask, lists, chat, tui,
profile_cli, server, bench, train)."""

from __future__ import annotations

import argparse
import math
import os
import sqlite3
import sys
from pathlib import Path

from localchat import __version__
from localchat.args import check_quant, flags, policy_options, resolve_spec
from localchat.errors import EXIT_OK, EXIT_USAGE, UserError, first_line


def _model_flags(p: argparse.ArgumentParser, sub: bool = False) -> None:
    """Shared flags; on subcommands they default to SUPPRESS so `localchat --model X ask ...` keeps X."""

    def d(value):
        return argparse.SUPPRESS if sub else value

    p.add_argument("--model", "-m", default=d(None),
                   help="Hugging Face id, local HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--chunk", type=int, default=d(None), help="prefill chunk size in tokens (default: the model card's)")
    p.add_argument("--threads", type=int, default=d(None),
                   help="CPU threads for reading and answering (default: a tuned profile's, else one per core)")
    p.add_argument("--max-new-tokens", type=int, default=d(512), help="answer length limit (default 512)")
    p.add_argument("--temperature", type=float, default=d(0.0), help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=d(1.0), help="nucleus sampling threshold (default 1.0)")
    p.add_argument("--seed", type=int, default=d(0), help="sampling seed (default 0)")
    p.add_argument("--max-file-mb", type=float, default=d(64), help="largest document accepted (default 64 MB)")
    p.add_argument("--policy", default=d(None),
                   help="KV eviction policy (`localchat policies`; default: locret when the model has heads, else full)")
    p.add_argument("--budget", "-b", type=int, default=d(None), help="units kept per KV head per layer (b)")
    p.add_argument("--local", type=int, default=d(None), help="n_loc: last prompt tokens never evicted")
    p.add_argument("--positions", choices=["compact", "original"], default=d(None),
                   help="RoPE positions of kept units: their slots (compact, reads past the window) or true ones")
    p.add_argument("--decode-window", type=int, default=d(None),
                   help="evict during long answers too, keeping budget + this many recent units (default off)")
    p.add_argument("--heads", default=d(None), help="retaining heads directory, or `random` (ablation)")
    for flag, opt in policy_options().items():  # each policy's own settings, as its file declares them
        if opt.type is bool:
            p.add_argument(flag, action="store_true", default=d(False), help=opt.help)
        else:
            p.add_argument(flag, type=opt.type, default=d(None), help=opt.help)
    p.add_argument("--profile", "-P", default=d(None), metavar="NAME",
                   help="device profile (`localchat profile list`), or `none`; default: config.toml's default_profile")
    if "--weights" not in p._option_string_actions:  # plan / profile parsers add their own
        p.add_argument("--weights", default=d(None), metavar="W",
                       help="weights: fp32|bf16|fp16|int8|int4|nf4 (nf4: CUDA only; default: the plan's choice, `localchat plan`)")
        p.add_argument("--kv", default=d(None), metavar="Q",
                       help="retained KV cache: none|int8|int4|int2 (quantized per unit; default none)")
    p.add_argument("--debug", action="store_true", default=d(False), help="show Python tracebacks")


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (exit 2), not a usage block."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"localchat: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="localchat", description="Chat with long documents on a local model.")
    parser.add_argument("--version", action="version", version=f"localchat {__version__}")
    _model_flags(parser)
    sub = parser.add_subparsers(dest="command")

    ask = sub.add_parser("ask", help="answer one question (documents optional) and stream it to stdout")
    ask.add_argument("question", help="the question")
    ask.add_argument("--file", "-f", action="append", default=[], metavar="F", help="a document (repeatable)")
    ask.add_argument("--stats", action="store_true", help="print speed and KV-cache figures to stderr at the end")
    ask.add_argument("--session", "-s", metavar="NAME",
                     help="continue (or start) the saved conversation NAME; its compressed cache is reused")
    _model_flags(ask, sub=True)

    chat = sub.add_parser("chat", help="a plain line-by-line chat in this terminal (no subcommand opens the chat window)")
    _model_flags(chat, sub=True)

    sessions = sub.add_parser("sessions", help="list the saved conversations (or delete one)")
    sessions.add_argument("--delete", metavar="NAME", help="delete the conversation NAME and its saved cache")
    sessions.add_argument("--show", metavar="NAME",
                          help="the settings conversation NAME continues with (a flag on `ask` overrides one)")

    fetch = sub.add_parser("fetch-model", help="fetch and convert the embedded default model (or MODEL) now (once)")
    fetch.add_argument("card", nargs="?", metavar="MODEL",
                       help="a model whose card fetches it from PyPI, as the default model is (e.g. gemma3-270m)")
    sub.add_parser("policies", help="list the KV-cache policies")
    from localchat import profile_cli

    profile_cli.add_parsers(sub, _model_flags)
    from localchat.train import cli as train_cli

    train_cli.add_parser(sub)
    train_cli.add_heads_parser(sub)
    from localchat.bench import cli as bench_cli

    bench_cli.add_parser(sub)
    from localchat.server import serve

    serve.add_parser(sub, _model_flags)
    return parser


LISTS = {"file", "sources"}  # arguments that take several values (`-f A -f B`, `bench by-length ... A B`)
LARGEST = 2**62  # no count or seed a user means is larger; torch's seeds and sizes overflow past it


def _check_numbers(f: dict) -> None:
    """Every number given on the command line is finite and of a size a count can have (one line each)."""
    for key, value in f.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, list) and key not in LISTS:  # argparse turns `--seed=--` into []
            raise UserError(f"{flag} needs a value (got {'--' if not value else value!r})")
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{flag} must be a finite number (got {value})")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= LARGEST:
            raise UserError(f"{flag} is too large (got {value}); give a number below {LARGEST:,}")


def _check_flags(f: dict) -> None:
    """What argparse cannot say: values out of range. The rest is checked where it is resolved."""
    _check_numbers(f)
    if f["chunk"] is not None and f["chunk"] < 1:
        raise UserError(f"--chunk must be at least 1 (got {f['chunk']})")
    if f.get("threads") is not None and f["threads"] < 1:
        raise UserError(f"--threads must be at least 1 (got {f['threads']})")
    for flag in ("budget", "local", "decode_window"):
        value = f[flag]
        if value is not None and value < (1 if flag == "budget" else 0):
            raise UserError(f"--{flag.replace('_', '-')} must be {'at least 1' if flag == 'budget' else '>= 0'} (got {value})")
    if f.get("command") != "bench":  # comma-separated axes there, checked by bench
        check_quant(f["weights"], f["kv"])
    if f.get("margin_mib") is not None and f["margin_mib"] < 0:
        raise UserError(f"--margin-mib must be >= 0 (got {f['margin_mib']})")
    if f["max_file_mb"] <= 0:
        raise UserError(f"--max-file-mb must be positive (got {f['max_file_mb']})")
    model = f.get("model")
    if model is not None and not model.strip():
        raise UserError("--model is empty; give a local model directory, a .gguf file or a Hugging Face id "
                        "(or leave --model out for the embedded default model)")
    if model and (Path(model).expanduser() / "config.json").is_file():
        _check_model_config(Path(model).expanduser() / "config.json")
    heads = f.get("heads")
    if heads and heads != "random" and (Path(heads).expanduser() / "heads.json").is_file():
        from localchat.engine.heads_files import read_config

        read_config(Path(heads).expanduser())  # a heads.json that is not a JSON object: one line, before planning


def _check_model_config(path: Path) -> None:
    """A model directory's config.json is a JSON object (the planner reads it before any loader could say so)."""
    import json

    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path} ({first_line(exc, 120)}); point --model at a "
                        f"Hugging Face model directory") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a model config (a JSON object); point --model at a Hugging Face model directory")


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: its reader is gone, and the flush at exit must not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # not a real file (a test's capture): nothing to flush at exit
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad command line (one line, Parser.error)
        return int(exc.code or 0)
    try:
        _check_flags(flags(args))
        return dispatch(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # a listing piped into `head`: what was read is what was wanted
        _quiet_stdout()
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, no traceback
        if args.debug:
            raise
        return report(exc)


def dispatch(args) -> int:
    """Run the command `args` names."""
    max_bytes = int(args.max_file_mb * 1024 * 1024)
    command = args.command
    if command == "ask":
        from localchat.ask import run_ask

        return run_ask(args)
    if command in ("policies", "sessions"):
        from localchat import lists

        return lists.run_policies() if command == "policies" else lists.run_sessions(args)
    if command in ("plan", "profile"):
        from localchat import profile_cli

        return profile_cli.run_plan(args) if command == "plan" else profile_cli.run_profile(args)
    if command == "serve":
        from localchat.server import serve

        return serve.run(args)
    if command == "bench":
        from localchat.bench import cli as bench_cli

        return bench_cli.run(args)
    if command in ("train-heads", "import-heads", "heads"):
        from localchat.train import cli as train_cli

        return train_cli.run(args)
    if command == "fetch-model":
        from localchat.engine.cards import all_cards, default_card, find_card
        from localchat.engine.default_model import ensure_model

        card = find_card(args.card) if args.card else default_card()
        if card is None or not card.parts:
            fetched = ", ".join(c.id for c in all_cards() if c.parts)
            raise UserError(f"no model card fetches {args.card} from PyPI; `localchat fetch-model` takes one of: {fetched}")
        print(ensure_model(card))
        return EXIT_OK
    if command == "chat":
        from localchat.args import load_engine
        from localchat.chat import run_chat

        return run_chat(load_engine(args), max_bytes=max_bytes)
    from localchat.planning.resolve import check_heads
    from localchat.tui.app import run_tui  # no subcommand: the chat window

    # resolved now (a bad setting fails before the window opens); planned and loaded behind the window
    spec = resolve_spec(args, plan=False)
    check_heads(spec.policy, spec.card, spec.model or "the default model")
    return run_tui(spec, max_bytes=max_bytes)


def report(exc: Exception) -> int:
    """Say what failed in one line on stderr; the exit code its kind has (localchat/turn.py)."""
    from localchat.turn import failure

    if isinstance(exc, sqlite3.DatabaseError):  # a chats database damaged in a way its open did not show
        from localchat.paths import data_dir
        from localchat.store import damaged

        exc = UserError(damaged(data_dir() / "chats.sqlite3", exc))
    if type(exc).__name__ == "OutputClosed":  # the reader of stdout went away (localchat/render.py)
        _quiet_stdout()
    found = failure(exc)
    if found.exit_code == EXIT_USAGE:
        print(f"localchat: error: {found.message}", file=sys.stderr)
    else:
        print(f"localchat: failed: {found.message} (run with --debug for details)", file=sys.stderr)
    return found.exit_code
