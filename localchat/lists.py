"""`localchat sessions` and `localchat policies`: what is saved, what can run."""

from __future__ import annotations

import sys

from localchat.engine.policies.catalog import CATALOG
from localchat.errors import EXIT_OK, UserError


def run_policies() -> int:
    width = max(map(len, CATALOG))
    for name, row in CATALOG.items():
        print(f"{name:<{width}}  {row.summary}")
    return EXIT_OK


def open_store():
    """The chats store, its notices said as `ask` says them (localchat/ask.py imports the engine; this does not)."""
    from localchat.store import Store

    store = Store()
    for line in store.notices:
        print(f"localchat: {line}", file=sys.stderr, flush=True)
    return store


def printable(text: str) -> str:
    """`text` with control characters (terminal escape codes a saved name may hold) shown escaped, not sent raw."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def run_sessions(args) -> int:
    from localchat.store import NAME_MAX

    if args.delete is not None and not args.delete.strip():
        raise UserError("the session name is empty; `localchat sessions` lists the names")
    store = open_store()
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
        takes_budget = c.policy in CATALOG and CATALOG[c.policy].uses_budget()
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
