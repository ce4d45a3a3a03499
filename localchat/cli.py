"""Command line: argument parsing only; the work happens in the engine, documents and chat modules."""

from __future__ import annotations

import argparse
import math
import os
import sqlite3
import sys
import threading
from pathlib import Path

from localchat import __version__
from localchat.args import check_quant, flags, policy_options, resolve_spec
from localchat.errors import UserError

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _model_flags(p: argparse.ArgumentParser, sub: bool = False) -> None:
    """Shared flags; on subcommands they default to SUPPRESS so `localchat --model X ask ...` keeps X."""

    def d(value):
        return argparse.SUPPRESS if sub else value

    p.add_argument("--model", "-m", default=d(None),
                   help="Hugging Face id, local HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--chunk", type=int, default=d(None), help="prefill chunk size in tokens (default: the model card's)")
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

    sub.add_parser("fetch-model", help="fetch and convert the embedded default model now (once)")
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
        from localchat.engine.heads import read_config

        read_config(Path(heads).expanduser())  # a heads.json that is not a JSON object: one line, before planning


def _check_model_config(path: Path) -> None:
    """A model directory's config.json is a JSON object (the planner reads it before any loader could say so)."""
    import json

    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path} ({(str(exc).splitlines() or [''])[0][:120]}); point --model at a "
                        f"Hugging Face model directory") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} is not a model config (a JSON object); point --model at a Hugging Face model directory")


def load_engine(args, **saved):
    """The engine the flags ask for (a saved chat's settings, card defaults and the plan fill the gaps)."""
    from localchat.planning.load import load_engine as load

    return load(resolve_spec(args, **saved))


def stats_line(engine, done) -> str:
    mib = 1024 * 1024
    return (
        f"[{engine.policy.name}, {engine.positions} positions] read {done.prompt_tokens:,} tokens at "
        f"{done.prefill_tps:,.0f} tok/s; kept {done.kv_tokens:,} units per KV head per layer "
        f"({done.kv_bytes / mib:,.1f} MiB, {done.compression:.1f}x smaller than full); "
        f"wrote {done.new_tokens} tokens at {done.decode_tps:,.1f} tok/s{_gpu_peak(engine)}"
    )


def _gpu_peak(engine) -> str:
    """On CUDA: the process's peak of allocated (and reserved) GPU memory, the figure a plan predicts."""
    if getattr(engine, "device", None) is None or engine.device.type != "cuda":
        return ""
    import torch

    gib = 1024**3
    return (f"; GPU peak {torch.cuda.max_memory_allocated(engine.device) / gib:.2f} GiB allocated, "
            f"{torch.cuda.max_memory_reserved(engine.device) / gib:.2f} GiB reserved")


def run_policies() -> int:
    from localchat.engine.policies import POLICIES

    width = max(map(len, POLICIES))
    for name, cls in POLICIES.items():
        print(f"{name:<{width}}  {cls.summary}")
    return EXIT_OK


def run_ask(args) -> int:
    from localchat.documents import load_document, tokens_estimate
    from localchat.engine.events import Error
    from localchat.render import stream_to, user_turn

    if not args.question.strip():
        raise UserError("the question is empty; put it in quotes after `ask`")
    if args.session is not None:
        from localchat.store import check_name

        check_name(args.session)
    # Read every document before loading the model, so a bad path fails fast.
    docs = [load_document(f, max_bytes=int(args.max_file_mb * 1024 * 1024)) for f in args.file]
    if args.session:
        return _ask_with_lock(args, docs)
    engine = load_engine(args, doc_tokens=tokens_estimate(docs) or None)
    cancel = threading.Event()
    messages = [{"role": "user", "content": user_turn(args.question, docs)}]
    final = stream_to(engine.chat(messages, engine.spec.generation, cancel), cancel, sys.stdout)
    if final is None:
        print("\ninterrupted", file=sys.stderr)
        return 130
    if isinstance(final, Error):
        if isinstance(final.exc, UserError):
            raise final.exc
        raise RuntimeError(final.message) from final.exc
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats:
        print(stats_line(engine, final), file=sys.stderr)
    return EXIT_OK


def _say(line: str) -> None:
    print(f"localchat: {line}", file=sys.stderr, flush=True)


def _open_store():
    """The chats store, its notices said (a data directory open to others, a turn a failed save kept)."""
    from localchat.store import Store

    store = Store()
    for line in store.notices:
        _say(line)
    return store


def _ask_with_lock(args, docs) -> int:
    """`ask --session S`: holds the lock of chat S from loading it to saving it (localchat/store/chat_lock.py), so a
    second `ask` on S waits and then continues from what this one saved."""
    from localchat.documents import tokens_estimate
    from localchat.planning.resolve import changed_settings, saved_flags
    from localchat.store.chat_lock import WINDOW, wait_limit

    wait = wait_limit()
    store = _open_store()
    lock = store.chat_lock(args.session)
    try:
        store.check_writable()  # a save that would fail, or a chat the window holds, says so before the model loads
        if not lock.try_acquire() and lock.holder()[0] == WINDOW:
            lock.acquire(0, _say)  # refuses in one line
        saved = saved_flags(store.settings(args.session).get("spec")) if store.exists(args.session) else {}
        engine = load_engine(args, saved=saved, saved_label=f"chat {args.session!r}",
                             doc_tokens=tokens_estimate(docs) or None)
        changes = changed_settings(saved, engine.spec) if saved and engine.spec is not None else []
        if changes:
            _say(f"chat {args.session!r} continues with {', '.join(changes)}: its saved cache was made with the "
                 f"earlier settings, so the conversation is read again once")
        lock.acquire(wait, _say)  # another `ask` on this chat: wait for it, then continue from what it saved
        return _ask_in_session(args, store, engine, docs, threading.Event(), told=bool(changes))
    finally:
        lock.release()
        store.close()


def _ask_in_session(args, store, engine, docs, cancel, told: bool = False) -> int:
    """One turn in the saved chat `args.session`, whose lock this process holds: load, answer, save. `told`: the
    user was told the conversation is read again (a changed setting), so the store's notice of it is not."""
    from localchat.engine.events import Error, Notice
    from localchat.render import stream_to
    from localchat.session import Session

    if store.exists(args.session):
        session, notices = store.load(args.session, engine)
    else:
        session, notices = Session(engine, name=args.session), []
    for note in notices if not told else []:  # why the conversation is read again is said once
        print(f"localchat: {note}", file=sys.stderr)

    def events():
        for ev in session.send(args.question, docs, engine.spec.generation, cancel):
            if isinstance(ev, Notice):
                print(f"localchat: {ev.message}", file=sys.stderr)
            else:
                yield ev

    final = stream_to(events(), cancel, sys.stdout)
    if final is None:
        print("\ninterrupted (the conversation is unchanged)", file=sys.stderr)
        return 130
    if isinstance(final, Error):
        raise UserError(final.message)
    sys.stdout.write("\n")
    sys.stdout.flush()
    store.save(session)
    if args.stats:
        print(stats_line(engine, final), file=sys.stderr)
    return EXIT_OK


def printable(text: str) -> str:
    """`text` with control characters (terminal escape codes a saved name may hold) shown escaped, not sent raw."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def run_sessions(args) -> int:
    from localchat.engine.policies import POLICIES
    from localchat.store import NAME_MAX

    if args.delete is not None and not args.delete.strip():
        raise UserError("the session name is empty; `localchat sessions` lists the names")
    store = _open_store()
    if args.delete:
        lock = store.chat_lock(args.delete, "delete")
        if not lock.try_acquire():  # an `ask` answering in it, or the window showing it, would save it back
            raise UserError(f"{lock.in_use()}; delete it when that localchat is done with it")
        try:
            store.delete(args.delete)
        finally:
            lock.release()
        print(f"deleted {args.delete}")
        return EXIT_OK
    if args.show is not None:
        return _show_settings(store, args.show)
    store.collect_orphans()  # cache files a killed save left behind
    chats = store.list()
    if not chats:
        print("no saved conversations yet (`localchat ask --session NAME ...` or the chat window saves them)")
        return EXIT_OK
    import time

    rows = [("name", "title", "model", "policy", "turns", "tokens", "kept", "last used")]
    for c in chats:
        budget = store.settings(c.name).get("budget")
        takes_budget = c.policy in POLICIES and POLICIES[c.policy].uses_budget()
        policy = f"{c.policy} b={budget}" if budget and takes_budget else c.policy
        name = c.name if len(c.name) <= NAME_MAX else c.name[:NAME_MAX - 1] + "…"  # one saved before names were bounded
        rows.append((printable(name), printable(c.title[:40]), printable(c.model), policy, str(c.turns), f"{c.tokens:,}",
                     f"{c.kept_bytes / 2**20:,.1f} MiB", time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    return EXIT_OK


def _show_settings(store, name: str) -> int:
    """`sessions --show NAME`: what a follow-up in NAME continues with, one setting a line."""
    from localchat.planning.resolve import saved_flags

    saved = saved_flags(store.settings(name).get("spec"))
    if not saved:
        print(f"chat {printable(name)!r} was saved without its settings: a follow-up resolves them afresh "
              f"(flags, environment, profile, model card, plan)")
        return EXIT_OK
    saved = {"model": saved.pop("model", "default"), **saved}
    width = max(map(len, saved))
    for key, value in saved.items():
        print(f"{key:<{width}}  {printable(str(value))}")
    return EXIT_OK


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
        if args.command == "ask":
            return run_ask(args)
        if args.command == "policies":
            return run_policies()
        if args.command in ("plan", "profile"):
            from localchat import profile_cli

            return profile_cli.run_plan(args) if args.command == "plan" else profile_cli.run_profile(args)
        if args.command == "sessions":
            return run_sessions(args)
        if args.command == "serve":
            from localchat.server import serve

            return serve.run(args)
        if args.command == "bench":
            from localchat.bench import cli as bench_cli

            return bench_cli.run(args)
        if args.command == "train-heads":
            from localchat.engine.engine import Engine
            from localchat.train.cli import check, run_train

            check(args)  # before the model loads
            return run_train(args, Engine.load(args.model, chunk=args.chunk))
        if args.command == "import-heads":
            from localchat.train.cli import run_import

            return run_import(args)
        if args.command == "heads":
            from localchat.train.cli import run_heads

            return run_heads(args)
        if args.command == "fetch-model":
            from localchat.engine.default_model import ensure_default_model

            print(ensure_default_model())
            return EXIT_OK
        if args.command == "chat":
            from localchat.chat import run_chat
            from localchat.planning.load import load_engine as load

            engine = load(resolve_spec(args))
            return run_chat(engine, engine.spec.generation, max_bytes=int(args.max_file_mb * 1024 * 1024))
        from localchat.tui.app import run_tui  # no subcommand: the chat window

        from localchat.planning.resolve import check_heads

        # resolved now (a bad setting fails before the window opens); planned and loaded behind the window
        spec = resolve_spec(args, plan=False)
        check_heads(spec.policy, spec.card, spec.model or "the default model")
        return run_tui(spec, max_bytes=int(args.max_file_mb * 1024 * 1024))
    except UserError as exc:
        if args.debug:
            raise
        from localchat.render import OutputClosed

        if isinstance(exc, OutputClosed):
            _quiet_stdout()
        print(f"localchat: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # a listing piped into `head`: what was read is what was wanted
        _quiet_stdout()
        return EXIT_OK
    except sqlite3.DatabaseError as exc:  # a chats database damaged in a way its open did not show
        if args.debug:
            raise
        from localchat.paths import data_dir
        from localchat.store import damaged

        print(f"localchat: error: {damaged(data_dir() / 'chats.sqlite3', exc)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one line, no traceback
        if args.debug:
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"localchat: failed: {first} (run with --debug for details)", file=sys.stderr)
        return EXIT_FAIL
