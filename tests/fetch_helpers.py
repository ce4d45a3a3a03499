"""pip pointed at one index, for tests of a model's fetch that run a real pip child; wheels and a loopback index
to serve them."""

from __future__ import annotations

import base64
import hashlib
import http.server
import os
import re
import socket
import threading
import zipfile
from pathlib import Path


def closed_port() -> int:
    """A loopback port nothing listens on: a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pip_env(index: str, environ=os.environ) -> dict[str, str]:
    """`environ` where pip sees only `index`: no config files, find-links, extra indexes or cache of this machine
    (and no LOCALCHAT_DEFAULT_WHEEL, which skips pip)."""
    env = {k: v for k, v in environ.items() if not k.startswith("PIP_") and k != "LOCALCHAT_DEFAULT_WHEEL"}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": index, "PIP_NO_CACHE_DIR": "1"}


def pip_at(monkeypatch, index: str) -> None:
    """pip_env in this process's environment, for the test's duration."""
    for name in list(os.environ):
        if name.startswith("PIP_") or name == "LOCALCHAT_DEFAULT_WHEEL":
            monkeypatch.delenv(name)
    for name, value in pip_env(index, {}).items():
        monkeypatch.setenv(name, value)


def wheel(folder: Path, project: str, version: str, files: dict[str, bytes], requires: tuple[str, ...] = (),
          stored: bool = False) -> Path:
    """A valid py3-none-any wheel of `project` holding `files` (path in the wheel -> bytes), with its metadata and
    RECORD as a build backend writes them; `stored`: uncompressed (its size is its payload's)."""
    dist = f"{re.sub(r'[-_.]+', '_', project)}-{version}"
    metadata = f"Metadata-Version: 2.4\nName: {project}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    files = {**files, f"{dist}.dist-info/METADATA": metadata.encode(),
             f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={_b64_sha256(data)},{len(data)}\n" for path, data in files.items())
    files[f"{dist}.dist-info/RECORD"] = (record + f"{dist}.dist-info/RECORD,,\n").encode()
    out = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return out


def _b64_sha256(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


class Index(http.server.ThreadingHTTPServer):
    """A PEP 503 simple index of `wheels` on 127.0.0.1 (`url`), serving in a thread until `close()`; `fetched`
    lists the wheel files it sent."""

    def __init__(self, wheels: list[Path]):
        self.wheels = {w.name: w for w in wheels}
        self.fetched: list[str] = []
        super().__init__(("127.0.0.1", 0), _IndexHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/simple"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def _project(wheel_name: str) -> str:
    return re.sub(r"[-_.]+", "-", wheel_name.split("-")[0]).lower()


class _IndexHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        index: Index = self.server
        path = self.path.rstrip("/")
        if path.startswith("/simple/"):
            names = [n for n in index.wheels if _project(n) == path.removeprefix("/simple/")]
            if not names:
                self.send_error(404)
                return
            links = "".join(f'<a href="/files/{n}">{n}</a>\n' for n in names)
            self._send("text/html", f"<html><body>\n{links}</body></html>".encode())
        elif path.startswith("/files/") and path.removeprefix("/files/") in index.wheels:
            index.fetched.append(path.removeprefix("/files/"))
            self._send("application/octet-stream", index.wheels[path.removeprefix("/files/")].read_bytes())
        else:
            self.send_error(404)

    def _send(self, kind: str, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass
