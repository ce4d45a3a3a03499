"""Saved chats: the sidebar list, saving after each answer, opening one (store work in thread workers)."""

from __future__ import annotations

from contextlib import closing

from textual.widgets import OptionList

from localchat.errors import first_line
from localchat.planning.resolve import saved_flags
from localchat.store.chat_lock import WINDOW
from localchat.tui.events import ChatOpened, ChatSaved
from localchat.tui.widgets.chat_list import ChatList
from localchat.tui.widgets.chips import chip_label
from localchat.tui.widgets.messages import AssistantMessage, Note, UserMessage


class SavedChats:
    """Mixed into the chat screen."""

    def refresh_chats(self) -> None:
        self.run_worker(self._list_chats, thread=True, group="store")

    def _list_chats(self) -> None:
        try:
            with closing(self.app.store()) as store:
                chats, notices = store.list(), store.notices
        except Exception as exc:  # noqa: BLE001 - a broken store must not take the app down
            self.app.call_from_thread(self.note, f"cannot list saved chats: {exc}", True)
            return
        for line in notices:
            if line not in self.app.said:  # once per window
                self.app.said.add(line)
                self.app.call_from_thread(self.note, line)
        self.app.call_from_thread(self.query_one(ChatList).show, chats, self.app.chat_name)

    def _save(self) -> None:
        from localchat.store import SaveIncomplete

        problem = None
        try:
            with closing(self.app.store()) as store:
                try:
                    name = store.save(self.app.session, self.app.chat_name)
                except SaveIncomplete as exc:  # the turn is kept; the chat saved without its cache, or aside
                    if exc.name is None:
                        raise
                    name, problem = exc.name, str(exc)
                held = self.app.chat_lock
                if held is None or held.name != name:  # a chat saved for the first time: hold it from now on
                    lock = store.chat_lock(name, WINDOW)
                    self.app.hold_chat(lock if lock.try_acquire() else None)
        except SaveIncomplete as exc:
            self.post_message(ChatSaved(None, str(exc)))
            return
        except Exception as exc:  # noqa: BLE001
            self.post_message(ChatSaved(None, f"could not save this chat: {first_line(exc)}"))
            return
        self.post_message(ChatSaved(name, problem))

    def on_chat_saved(self, msg: ChatSaved) -> None:
        if msg.error:
            self.note(msg.error, error=True)
        if msg.name is None:
            return
        self.app.chat_name = msg.name
        self.refresh_chats()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        name = event.option.id
        if name == self.app.chat_name:
            return
        if self.turn is not None:
            self.note("still answering; wait, or press Esc to stop it", error=True)
            return
        if self.app.engine is None:
            self.note("no model is loaded, so saved chats cannot be opened", error=True)
            return
        self.run_worker(lambda: self._load_chat(name), thread=True, group="turn")

    def _load_chat(self, name: str) -> None:
        lock = None
        try:
            with self.app.engine_lock, closing(self.app.store()) as store:
                lock = store.chat_lock(name, WINDOW)
                if not lock.try_acquire():  # an `ask` is answering in it: its turn would be lost on our next save
                    lock = None
                    self.post_message(ChatOpened(error=f"cannot open chat {name} now: {store.chat_lock(name).in_use()}"
                                                       f"; try again when it is done"))
                    return
                spec = self.app.spec_for_chat(saved_flags(store.settings(name).get("spec")))
                with self.app.engine_settings(spec):  # the chat's own settings: its cache is reused as saved
                    session, notices = store.load(name, self.app.engine)
        except Exception as exc:  # noqa: BLE001
            if lock is not None:
                lock.release()
            self.post_message(ChatOpened(error=f"cannot open chat {name}: {first_line(exc)}"))
            return
        self.post_message(ChatOpened(session, name, notices, lock=lock, spec=spec))

    async def on_chat_opened(self, msg: ChatOpened) -> None:
        if msg.error:
            self.note(msg.error, error=True)
            return
        self.app.session, self.app.chat_name = msg.session, msg.name
        if msg.spec is not None:
            self.app.spec = msg.spec
        self.app.hold_chat(msg.lock)
        await self.show_session()
        for line in msg.notices:
            self.note(line)
        self.refresh_status()
        self.refresh_map()

    async def show_session(self) -> None:
        """Draw the session's conversation from scratch."""
        await self.conversation.remove_children()
        session = self.app.session
        items = []
        questions = iter(session.questions)
        for i, message in enumerate(session.messages):
            if message["role"] == "user":
                chips = [chip_label(a.name, a.tokens) for a in session.attachments if a.turn == i]
                items.append(UserMessage(next(questions, message["content"]), chips))
            elif message["role"] == "assistant":
                items.append(AssistantMessage(message["content"]))
        if session.system:
            items.insert(0, Note(f"system prompt: {session.system}"))
        await self.conversation.mount_all(items)
