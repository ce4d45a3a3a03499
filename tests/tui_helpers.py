"""Helpers for the TUI tests: build the app on a real engine, wait for workers, read the screen."""

from __future__ import annotations

import asyncio
import time

from textual import events

from localchat.engine.sampling import GenerationSettings
from localchat.tui.app import LocalChatApp
from localchat.tui.widgets.chips import Chip
from localchat.tui.widgets.messages import AssistantMessage, Note, UserMessage
from localchat.tui.widgets.status import StatusLine

SIZE = (110, 36)


def record_events(app) -> list:
    """Wrap the session's send to keep every engine event it streams to the screen."""
    seen = []
    send = app.session.send

    def spy(*args, **kw):
        for event in send(*args, **kw):
            seen.append(event)
            yield event

    app.session.send = spy
    return seen


def make_app(engine=None, **kw) -> LocalChatApp:
    kw.setdefault("settings", GenerationSettings(max_new_tokens=12))
    kw.setdefault("memory_probe", lambda device: 100 * 1024 * 1024)
    return LocalChatApp(engine, **kw)


def run(scenario, app, size=SIZE):
    """Run `scenario(app, pilot)` inside App.run_test()."""

    async def main():
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await scenario(app, pilot)

    asyncio.run(main())


async def settle(pilot, timeout: float = 30.0) -> None:
    """Until no worker runs, no turn is open and posted messages are handled."""
    app = pilot.app
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        await pilot.pause(0.02)
        busy = any(w.is_running for w in app.workers) or getattr(app.screen, "turn", None) is not None
        if not busy:
            await pilot.pause()
            return
    raise AssertionError("the app did not settle")


async def wait_for(pilot, condition, timeout: float = 30.0) -> float:
    """Seconds until `condition()` holds (plain sleeps: Pilot's idle waits crawl while a worker computes)."""
    start = time.monotonic()
    while time.monotonic() < start + timeout:
        if condition():
            return time.monotonic() - start
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


def key(app, name: str, character: str | None = None) -> None:
    """A key press as the terminal driver delivers it (no waiting, unlike Pilot.press)."""
    app.post_message(events.Key(name, character))


async def type_text(pilot, text: str) -> None:
    prompt = pilot.app.screen.prompt
    prompt.focus()
    prompt.value = text
    await pilot.press("enter")


async def paste(pilot, text: str) -> None:
    pilot.app.screen.prompt.post_message(events.Paste(text))
    await pilot.pause()


def notes(app) -> list[str]:
    return [str(n.render()) for n in app.screen.query(Note)]


def errors(app) -> list[str]:
    return [str(n.render()) for n in app.screen.query(Note) if n.has_class("error")]


def chips(app) -> list[str]:
    return [str(c.render()) for c in app.screen.query(Chip)]


def status(app) -> str:
    return str(app.screen.query_one(StatusLine).render())


def users(app) -> list[UserMessage]:
    return list(app.screen.query(UserMessage))


def answers(app) -> list[AssistantMessage]:
    return list(app.screen.query(AssistantMessage))
