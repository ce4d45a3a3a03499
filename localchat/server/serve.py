"""`localchat serve`: its flags, their checks, and the run (the model loads once, then Service serves it)."""

from __future__ import annotations

import argparse
import sys

from localchat.errors import UserError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
DEFAULT_PORT = 8000


def add_parser(sub, model_flags) -> None:
    p = sub.add_parser("serve", help="an OpenAI- and Ollama-compatible HTTP server whose conversations keep their "
                                     "compressed cache across requests and restarts")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; any other needs --api-key)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0 picks a free one)")
    p.add_argument("--api-key", metavar="KEY", help="require `Authorization: Bearer KEY` on every request")
    p.add_argument("--queue", type=int, default=16, metavar="N",
                   help="requests that may wait while one is answered (default 16); more get 503 + Retry-After")
    p.add_argument("--keep", type=int, default=4, metavar="N",
                   help="conversations kept in memory (default 4); others are reloaded from the store when used")
    p.add_argument("--saved", type=int, default=256, metavar="N",
                   help="conversations kept in the store (default 256); the least recently used go first")
    model_flags(p, sub=True)


def check(args) -> None:
    """The serve flags, before the model loads (one line each)."""
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key is empty; give the key clients must send")
    if args.host not in LOOPBACK and args.api_key is None:
        raise UserError(f"--host {args.host} is reachable from other machines: give --api-key KEY too (clients then "
                        f"send `Authorization: Bearer KEY`), or leave --host out to listen on 127.0.0.1 only")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be from 0 to 65535 (got {args.port})")
    for flag in ("queue", "keep", "saved"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag} must be at least 1 (got {getattr(args, flag)})")


def run(args: argparse.Namespace) -> int:
    from localchat.args import resolve_spec
    from localchat.planning.load import load_engine
    from localchat.server.service import Service, bind
    from localchat.store import Store

    check(args)
    store = Store()
    for line in store.notices:
        print(f"localchat: {line}", file=sys.stderr)
    store.check_writable()
    sock_check = bind(args.host, args.port)  # a port in use fails now, not after a minute of loading
    sock_check.close()
    engine = load_engine(resolve_spec(args))
    service = Service(engine, store, host=args.host, port=args.port, api_key=args.api_key, waiting=args.queue,
                      keep=args.keep, saved=args.saved, max_body=int(args.max_file_mb * 2**20))
    print(f"localchat: serving {engine.name} ({engine.policy.name}) at {service.url}: OpenAI API at "
          f"{service.url}/v1, Ollama API at {service.url}/api (Ctrl+C stops)", file=sys.stderr, flush=True)
    try:
        service.run()
    finally:
        store.close()
    return 0
