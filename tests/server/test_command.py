"""`localchat serve` as a user runs it: a child process on a local model directory, answered, stopped by Ctrl+C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import openai
from tiny import save_tiny


def test_localchat_serve_answers_and_stops_on_ctrl_c(tmp_path):
    model = save_tiny(tmp_path / "tiny-model")
    env = {**os.environ, "LOCALCHAT_DATA_DIR": str(tmp_path / "data"), "LOCALCHAT_CONFIG_DIR": str(tmp_path / "cfg")}
    child = subprocess.Popen([sys.executable, "-m", "localchat", "--model", str(model), "serve", "--port", "0",
                              "--max-new-tokens", "4"], stderr=subprocess.PIPE, text=True, env=env,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = child.stderr.readline()
            assert line or child.poll() is None, "localchat serve stopped while starting"
            found = re.search(r"at (http://127\.0\.0\.1:\d+):", line)
            url = found.group(1) if found else None
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny-model"]
        answer = c.chat.completions.create(model="tiny-model", messages=[{"role": "user", "content": "Hello"}])
        assert answer.usage.completion_tokens == 4  # --max-new-tokens is the server's default
        child.send_signal(signal.SIGINT)
        assert child.wait(timeout=60) == 130  # as `ask` ends on Ctrl+C
        assert "Traceback" not in child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
