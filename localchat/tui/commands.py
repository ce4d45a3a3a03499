"""Slash commands: names, help lines, parsing and completion."""

from __future__ import annotations

from dataclasses import dataclass

from textual.suggester import Suggester

COMMANDS: dict[str, tuple[str, str]] = {
    # name: (argument, what it does)
    "attach": ("[PATH]", "attach a document (no PATH: pick a file)"),
    "new": ("", "start a new chat"),
    "policy": ("NAME", "switch the KV-cache policy (re-reads the chat once)"),
    "budget": ("N", "units kept per KV head per layer (re-reads the chat once)"),
    "profile": ("[NAME]", "show the settings and memory plan, or apply profile NAME"),
    "system": ("[TEXT]", "set the system prompt (no TEXT: remove it)"),
    "export": ("[PATH]", "write the chat as markdown"),
    "clear": ("", "empty this chat and its cache"),
    "help": ("", "list commands and keys"),
}


@dataclass(frozen=True)
class Command:
    name: str
    arg: str


def parse(line: str) -> Command | None:
    """`/name rest` -> Command; None when `line` is not a slash command."""
    line = line.strip()
    if not line.startswith("/") or line.startswith("//"):
        return None
    name, _, arg = line[1:].partition(" ")
    return Command(name.lower(), arg.strip())


def usage(name: str) -> str:
    arg, what = COMMANDS[name]
    return f"/{name}{' ' + arg if arg else ''}  {what}"


def matches(prefix: str) -> list[str]:
    """Command names starting with `prefix` (without the slash)."""
    return [name for name in COMMANDS if name.startswith(prefix.lower())]


class SlashSuggester(Suggester):
    """Completes command names, and policy names after `/policy `."""

    def __init__(self, policies: list[str]):
        super().__init__(use_cache=False, case_sensitive=True)
        self.policies = policies

    async def get_suggestion(self, value: str) -> str | None:
        if not value.startswith("/"):
            return None
        if value.startswith("/policy ") and value.count(" ") == 1:
            typed = value[len("/policy "):]
            for name in self.policies:
                if name.startswith(typed) and name != typed:
                    return "/policy " + name
            return None
        if " " in value:
            return None
        found = matches(value[1:])
        if found and found[0] != value[1:]:
            return "/" + found[0] + (" " if COMMANDS[found[0]][0] else "")
        return None
