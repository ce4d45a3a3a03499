"""Snapshots of the chat window at a fixed terminal size (pytest-textual-snapshot; --snapshot-update to redraw)."""

from __future__ import annotations

from textual import events

from localchat.engine.sampling import GenerationSettings
from localchat.tui.app import LocalChatApp

SIZE = (110, 32)


def app_for(engine, tmp_path) -> LocalChatApp:
    return LocalChatApp(engine, settings=GenerationSettings(max_new_tokens=8), keymap={},
                        store_path=tmp_path / "chats.sqlite3", memory_probe=lambda device: 300 * 1024 * 1024)


async def settle(pilot) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def test_start(snap_compare, tiny_engine, tmp_path):
    assert snap_compare(app_for(tiny_engine, tmp_path), terminal_size=SIZE, run_before=settle)


def test_help(snap_compare, tiny_engine, tmp_path):
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("f1")
        await pilot.pause()

    assert snap_compare(app_for(tiny_engine, tmp_path), terminal_size=SIZE, run_before=run_before)


def test_command_completion(snap_compare, tiny_engine, tmp_path):
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("/", "b")
        await pilot.pause(0.2)

    assert snap_compare(app_for(tiny_engine, tmp_path), terminal_size=SIZE, run_before=run_before)


def test_pasted_text_chip_and_empty_retained_map(snap_compare, tiny_engine, tmp_path):
    async def run_before(pilot):
        await settle(pilot)
        pilot.app.screen.prompt.post_message(events.Paste("a long pasted line of text\n" * 100))
        await pilot.pause()
        await settle(pilot)
        await pilot.press("ctrl+r")
        await pilot.pause()

    assert snap_compare(app_for(tiny_engine, tmp_path), terminal_size=SIZE, run_before=run_before)
