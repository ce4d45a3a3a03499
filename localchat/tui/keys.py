"""Key bindings with ids, remappable through the `[keys]` table of config.toml (action = "key")."""

from __future__ import annotations

from pathlib import Path

from textual.binding import Binding

from localchat.paths import config_dir
from localchat.toml import toml

# id -> (default key, action, footer label)
DEFAULT_KEYS: dict[str, tuple[str, str, str]] = {
    "cancel": ("escape", "cancel", "Stop"),
    "attach": ("ctrl+o", "attach", "Attach"),
    "new_chat": ("ctrl+n", "new_chat", "New chat"),
    "retained_map": ("ctrl+r", "toggle_map", "Retained map"),
    "sidebar": ("ctrl+b", "toggle_sidebar", "Chats"),
    "export": ("ctrl+s", "export", "Export"),
    "help": ("f1", "help", "Help"),
    "quit": ("ctrl+q", "app.quit", "Quit"),
}


def bindings() -> list[Binding]:
    return [Binding(key, action, label, id=ident, priority=ident == "quit")
            for ident, (key, action, label) in DEFAULT_KEYS.items()]


def load_keymap(path: Path | None = None) -> tuple[dict[str, str], list[str]]:
    """The user's `[keys]` overrides and one-line problems found in them (shown in the chat)."""
    path = path or config_dir() / "config.toml"
    if not path.exists():
        return {}, []
    try:
        data = toml.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, toml.TOMLDecodeError) as exc:
        return {}, [f"{path}: cannot read the [keys] table ({exc}); using the default keys"]
    table = data.get("keys", {})
    if not isinstance(table, dict):
        return {}, [f"{path}: [keys] must be a table of action = \"key\"; using the default keys"]
    keymap, problems = {}, []
    for action, key in table.items():
        if action not in DEFAULT_KEYS:
            problems.append(f"{path}: [keys] has unknown action {action!r}; known: {', '.join(DEFAULT_KEYS)}")
        elif not isinstance(key, str) or not key.strip():
            problems.append(f"{path}: [keys] {action} must be a key name such as \"ctrl+t\"")
        else:
            keymap[action] = key.strip()
    return keymap, problems
