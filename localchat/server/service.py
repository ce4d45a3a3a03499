"""Service: one engine served on one socket (the worker, the conversations, uvicorn). `localchat serve` runs one in
the foreground; the tests and the benchmark run one in a thread."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import uvicorn

from localchat.engine.sampling import GenerationSettings
from localchat.errors import UserError
from localchat.server.app import State, build_app
from localchat.server.conversations import Conversations
from localchat.server.ollama import Facts
from localchat.server.worker import Worker


def bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    sock.set_inheritable(True)
    return sock


def served_name(name: str) -> str:
    """The model's name for clients: a local directory or file by its own name, not its path."""
    path = Path(name).expanduser()
    return path.name if ("/" in name or "\\" in name) and path.exists() else name


class Service:
    """One engine served on one socket: the worker, the conversations and uvicorn."""

    def __init__(self, engine, store, *, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 waiting: int = 16, keep: int = 4, saved: int = 256, max_body: int = 64 * 2**20, defaults=None):
        self.conversations = Conversations(store, engine, keep, saved)
        self.worker = Worker(self.conversations, waiting)
        defaults = defaults or (engine.spec.generation if engine.spec is not None else GenerationSettings())
        name = served_name(engine.name)
        state = State(self.worker, name, Facts(engine, name), defaults, max_body, api_key, int(time.time()))
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(build_app(state), log_level="warning", lifespan="off", timeout_graceful_shutdown=3)
        self.server = _Uvicorn(config, self.worker)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve until Ctrl+C (or a stop signal); what runs then is cancelled, not saved."""
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.worker.stop()
            self.sock.close()

    def start(self) -> Service:
        """Serve from a thread; returns once the server accepts connections."""
        self.thread = threading.Thread(target=self.run, name="localchat-serve", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server stopped while starting")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.worker.cancel_all()
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)


class _Uvicorn(uvicorn.Server):
    def __init__(self, config, worker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig, frame) -> None:
        self.worker.cancel_all()  # a generation stops at its next chunk or token, and is not saved
        super().handle_exit(sig, frame)
