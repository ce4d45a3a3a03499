"""The plumbing of a loopback Hugging Face hub for fetch tests: the hub and its CDN on two local ports, the
hub's error headers, and the ids the hub gives files (a plain git file's blob id, a Git LFS pointer's)."""

from __future__ import annotations

import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
            f"size {len(data)}\n").encode()


class HubHandler(BaseHTTPRequestHandler):
    """HEAD and GET go to `route(body)`; `fail` answers as the hub does (X-Error-Code, X-Error-Message)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.route(body=False)

    def do_GET(self) -> None:
        self.route(body=True)

    def route(self, body: bool) -> None:
        raise NotImplementedError

    def fail(self, code: int, error: str, message: str) -> None:
        self.send_response(code)
        self.send_header("X-Error-Code", error)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Length", "0")
        self.end_headers()


class LoopbackHub:
    """`serve(handler)` starts the hub and the CDN (another origin: another port), each server's `hub` this one;
    `url` and `cdn_url` reach them; `close` stops both."""

    def serve(self, handler: type[HubHandler]) -> None:
        self.servers = [self._serve(handler), self._serve(handler)]
        self.url, self.cdn_url = (f"http://127.0.0.1:{s.server_address[1]}" for s in self.servers)

    def _serve(self, handler: type[HubHandler]) -> ThreadingHTTPServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        server.hub = self
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        return server

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()
