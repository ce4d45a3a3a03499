"""The sidebar: saved chats, newest first; selecting one opens it."""

from __future__ import annotations

import time

from textual.widgets import OptionList
from textual.widgets.option_list import Option


def _when(epoch: float) -> str:
    age = time.time() - epoch
    if age < 3600:
        return f"{max(int(age // 60), 0)}m ago"
    if age < 86400:
        return f"{int(age // 3600)}h ago"
    return time.strftime("%Y-%m-%d", time.localtime(epoch))


class ChatList(OptionList):
    def show(self, chats, current: str | None) -> None:
        self.clear_options()
        for info in chats:
            title = (info.title or info.name)[:40]
            self.add_option(Option(f"{title}\n{info.turns} turns · {_when(info.updated)}", id=info.name))
        names = [info.name for info in chats]
        if current in names:
            self.highlighted = names.index(current)
