"""`localchat ask`: one question (documents optional) answered on stdout, in a saved chat or on its own."""

from __future__ import annotations

import sys
import threading

from localchat.errors import EXIT_OK, UserError
from localchat.turn import Unsaved, answer, check_question


def say(line: str) -> None:
    print(f"localchat: {line}", file=sys.stderr, flush=True)


def open_store():
    """The chats store, its notices said (a data directory open to others, a turn a failed save kept)."""
    from localchat.store import Store

    store = Store()
    for line in store.notices:
        say(line)
    return store


def run_ask(args) -> int:
    from localchat.documents import load_document, tokens_estimate

    check_question(args.question)
    if args.session is not None:
        from localchat.store import check_name

        check_name(args.session)
    # Read every document before loading the model, so a bad path fails fast.
    docs = [load_document(f, max_bytes=int(args.max_file_mb * 1024 * 1024)) for f in args.file]
    if args.session:
        return _ask_with_lock(args, docs)
    from localchat.args import load_engine
    from localchat.session import Session

    engine = load_engine(args, doc_tokens=tokens_estimate(docs) or None)
    return _answer(args, Session(engine), docs)


def _ask_with_lock(args, docs) -> int:
    """`ask --session S`: holds the lock of chat S from loading it to saving it (localchat/store/chat_lock.py), so a
    second `ask` on S waits and then continues from what this one saved."""
    from localchat.args import load_engine
    from localchat.documents import tokens_estimate
    from localchat.planning.resolve import changed_settings, saved_flags
    from localchat.session import Session
    from localchat.store.chat_lock import WINDOW, wait_limit

    wait = wait_limit()
    store = open_store()
    lock = store.chat_lock(args.session)
    try:
        store.check_writable()  # a save that would fail, or a chat the window holds, says so before the model loads
        if not lock.try_acquire() and lock.holder()[0] == WINDOW:
            lock.acquire(0, say)  # refuses in one line
        saved = saved_flags(store.settings(args.session).get("spec")) if store.exists(args.session) else {}
        engine = load_engine(args, saved=saved, saved_label=f"chat {args.session!r}",
                             doc_tokens=tokens_estimate(docs) or None)
        changes = changed_settings(saved, engine.spec) if saved and engine.spec is not None else []
        if changes:
            say(f"chat {args.session!r} continues with {', '.join(changes)}: its saved cache was made with the "
                f"earlier settings, so the conversation is read again once")
        lock.acquire(wait, say)  # another `ask` on this chat: wait for it, then continue from what it saved
        if store.exists(args.session):
            session, notices = store.load(args.session, engine)
        else:
            session, notices = Session(engine, name=args.session), []
        for note in notices if not changes else []:  # why the conversation is read again is said once
            say(note)
        return _answer(args, session, docs, save=store.save)
    finally:
        lock.release()
        store.close()


def _answer(args, session, docs, save=None) -> int:
    """Stream one turn to stdout; the final figures to stderr with --stats. A failure is raised for main()."""
    from localchat.engine.events import Error
    from localchat.render import stream_to

    cancel = threading.Event()
    unsaved: list[str] = []

    def events():
        for event in answer(session, args.question, docs, session.engine.spec.generation, cancel, save=save):
            if isinstance(event, Unsaved):
                unsaved.append(event.message)
            else:
                yield event

    final = stream_to(events(), cancel, sys.stdout)
    if final is None:
        print("\ninterrupted" + (" (the conversation is unchanged)" if save else ""), file=sys.stderr)
        return 130
    if isinstance(final, Error):
        raise final.exc
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats:
        print(stats_line(session.engine, final), file=sys.stderr)
    if unsaved:
        raise UserError(unsaved[0])
    return EXIT_OK


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
