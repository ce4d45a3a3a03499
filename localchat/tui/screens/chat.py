"""The chat screen: sidebar, conversation, retained map, progress, chips, input, status line, footer.

Engine work (turns, loading documents and chats, saving) runs in thread workers that post messages
back; the UI thread only draws. Esc sets the turn's cancel event; the engine stops within one chunk
or token and the session is as before, so the question goes back into the input.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from textual import on
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from localchat.engine.events import Done, Error, Notice, Progress, Token
from localchat.errors import first_line
from localchat.tui import commands, heap, keys
from localchat.tui.attachments import Attachments
from localchat.tui.events import EngineEvent, EngineLoaded, TurnEnded
from localchat.tui.handlers import CommandHandlers
from localchat.tui.saved_chats import SavedChats
from localchat.tui.widgets.chat_list import ChatList
from localchat.tui.widgets.chips import ChipBar, chip_label
from localchat.tui.widgets.loading import LoadProgress
from localchat.tui.widgets.messages import AssistantMessage, Note, UserMessage
from localchat.tui.widgets.progress import PrefillProgress
from localchat.tui.widgets.prompt import Prompt
from localchat.tui.widgets.retained import RetainedMap, map_text
from localchat.tui.widgets.status import StatusLine, status_text

PROGRESS_EVERY_S = 0.1


@dataclass
class Turn:
    question: str
    documents: list  # [(Document, tokens)]
    cancel: threading.Event = field(default_factory=threading.Event)
    user: UserMessage | None = None
    answer: AssistantMessage | None = None
    last_progress: Progress | None = None
    done: Done | None = None
    failed: str | None = None


class ChatScreen(CommandHandlers, Attachments, SavedChats, Screen):
    CSS_PATH = "chat.tcss"
    BINDINGS = keys.bindings()

    def __init__(self) -> None:
        super().__init__()
        self.turn: Turn | None = None
        self.pending: list = []  # [(Document, tokens)] for the next question

    def compose(self):
        with Horizontal(id="main"):
            with Vertical(id="sidebar"):
                yield Static("Chats", id="sidebar-title")
                yield ChatList(id="chats")
            with Vertical(id="chat"):
                yield VerticalScroll(id="conversation")
                yield RetainedMap(id="retained")
                yield PrefillProgress(id="progress")
                yield ChipBar(id="chips")
                yield Static("", id="hint", markup=False)
                yield Prompt(placeholder="Ask, paste a file path, or type / for commands",
                             suggester=commands.SlashSuggester(self.app.policy_names()), id="prompt")
        yield StatusLine(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#conversation").anchor()
        for widget in ("#retained", "#progress", "#chips", "#hint"):
            self.query_one(widget).display = False
        self.query_one(Prompt).focus()
        for problem in self.app.key_problems:
            self.note(problem, error=True)
        self.refresh_status()
        self.set_interval(2.0, self.refresh_status)  # device memory moves during long reads
        self.refresh_chats()
        if self.app.engine is None and self.app.loader is not None:
            self.note("loading the model…")
            self.run_worker(self._load_engine, thread=True, group="engine")
        elif self.app.engine is not None:
            self.note(self.welcome())

    # --- small helpers ---------------------------------------------------------------------------

    @property
    def conversation(self) -> VerticalScroll:
        return self.query_one("#conversation", VerticalScroll)

    @property
    def prompt(self) -> Prompt:
        return self.query_one(Prompt)

    def note(self, text: str, error: bool = False) -> Note:
        item = Note(("error: " if error else "") + text, error=error)
        self.conversation.mount(item)
        return item

    def welcome(self) -> str:
        engine = self.app.engine
        return (f"{engine.name} on {engine.device.type}, policy {engine.policy.name}. Paste or drop a file path "
                f"(or {self.app.key_for('attach')}) to attach a document, type / for commands, "
                f"{self.app.key_for('help')} for help.")

    def refresh_status(self) -> None:
        engine = self.app.engine
        memory = self.app.memory_probe(engine.device) if engine is not None else None
        self.query_one(StatusLine).update(status_text(engine, self.app.session, memory))

    def refresh_map(self) -> None:
        view = self.query_one(RetainedMap)
        if not view.display:
            return
        session = self.app.session
        attachment = session.attachments[-1] if session is not None and session.attachments else None
        bins = max(8, min(self.conversation.size.width - 4, 200) or 64)
        shares = session.retained_map(bins) if attachment else None
        view.update(map_text(shares, attachment and attachment.name, attachment and attachment.tokens))

    # --- engine loading --------------------------------------------------------------------------

    def _load_engine(self) -> None:
        from localchat.engine.default_model import FetchError

        view = LoadProgress()
        self.app.call_from_thread(self.conversation.mount, view)
        self.app.load_say = view.say
        try:
            engine = self.app.loader()
        except Exception as exc:  # noqa: BLE001 - shown in the chat; the app stays up
            first = first_line(exc)
            if isinstance(exc, FetchError):  # it says what to do
                text = f"{first}. Commands still work."
            else:
                text = f"could not load the model: {first}. Fix --model and restart; commands still work."
            self.post_message(EngineLoaded(error=text))
            return
        heap.freeze()  # here, while "loading the model…" shows, not during a chat
        self.post_message(EngineLoaded(engine))

    def on_engine_loaded(self, msg: EngineLoaded) -> None:
        self.app.load_say = lambda line: None
        for view in self.query(LoadProgress):
            view.remove()
        if msg.error:
            self.note(msg.error, error=True)
        else:
            self.app.use_engine(msg.engine)
            self.note(self.welcome())
        self.refresh_status()

    # --- input -----------------------------------------------------------------------------------

    @on(Prompt.Changed)
    def show_hint(self, event: Prompt.Changed) -> None:
        hint = self.query_one("#hint", Static)
        value = event.value
        if value.startswith("/policy "):
            hint.update("policies: " + ", ".join(self.app.policy_names()) + "   (Tab completes)")
            hint.display = True
        elif value.startswith("/") and "/" in value[1:]:  # a file path being typed, not a command
            from localchat.documents import parse_path_input

            path = parse_path_input(value)
            hint.update(f"Enter attaches {Path(path).name}" if path else "a file path: Enter attaches it once it names a file")
            hint.display = True
        elif value.startswith("/") and " " not in value:
            found = commands.matches(value[1:])
            hint.update("   ".join(commands.usage(n) for n in found) if found else "no such command; /help lists them")
            hint.display = True
        else:
            hint.display = False

    @on(Prompt.Submitted)
    async def submit(self, event: Prompt.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        from localchat.documents import parse_path_input

        path = parse_path_input(text)
        if path is not None:
            self.prompt.value = ""
            self.attach(path)
            return
        command = commands.parse(text)
        if command is not None:
            self.prompt.value = ""
            await self.run_command(command)
            return
        if self.turn is not None:
            self.note("still answering; wait, or press Esc to stop it", error=True)
            return
        if self.app.engine is None or self.app.session is None:
            self.note("no model is loaded, so there is nobody to answer", error=True)
            return
        self.prompt.value = ""
        await self.start_turn(text)

    # --- turns -----------------------------------------------------------------------------------

    async def start_turn(self, question: str) -> None:
        turn = Turn(question, list(self.pending))
        self.turn = turn
        self.pending = []
        await self.show_chips()
        turn.user = UserMessage(question, [chip_label(d.name, n) for d, n in turn.documents])
        turn.answer = AssistantMessage()
        await self.conversation.mount_all([turn.user, turn.answer])
        self.query_one(PrefillProgress).start()
        self.run_worker(lambda: self._run_turn(turn), thread=True, group="turn")

    def _run_turn(self, turn: Turn) -> None:
        from localchat.turn import answer

        app = self.app
        with app.engine_lock:
            shown = 0.0
            for event in answer(app.session, turn.question, [d for d, _ in turn.documents], app.settings,
                                turn.cancel, save=lambda _: self._save()):
                if isinstance(event, Progress):  # at most 10 redraws a second keep the keys snappy
                    now = time.monotonic()
                    if now - shown < PROGRESS_EVERY_S and event.done < event.total:
                        continue
                    shown = now
                self.post_message(EngineEvent(event))
        self.post_message(TurnEnded())

    async def on_engine_event(self, msg: EngineEvent) -> None:
        turn, event = self.turn, msg.event
        if turn is None:
            return
        progress = self.query_one(PrefillProgress)
        if isinstance(event, Notice):
            self.conversation.mount(Note(event.message), before=turn.answer)
        elif isinstance(event, Progress):
            turn.last_progress = event
            progress.show(event)
        elif isinstance(event, Token):
            progress.hide()
            await turn.answer.write(event.text)
        elif isinstance(event, Done):
            progress.hide()
            turn.done = event
            if event.stop_reason != "cancelled":
                await turn.answer.finish(event.text)
                await self.conversation.mount(Note(turn_stats(event), classes="stats"), after=turn.answer)
        elif isinstance(event, Error):
            progress.hide()
            turn.failed = event.message

    async def on_turn_ended(self, _: TurnEnded) -> None:
        turn, self.turn = self.turn, None
        self.query_one(PrefillProgress).hide()
        if turn is None:
            return
        if turn.failed is not None or turn.done is None or turn.done.stop_reason == "cancelled":
            await self._restore(turn)
        elif turn.done.stop_reason == "length":
            self.note(f"the answer reached the {self.app.settings.max_new_tokens}-token limit "
                      f"(--max-new-tokens)")
        self.refresh_status()
        self.refresh_map()

    async def _restore(self, turn: Turn) -> None:
        """The session is as before the turn: put the question and its documents back."""
        await turn.answer.stop()
        await turn.user.remove()
        await turn.answer.remove()
        if turn.failed is not None:
            self.note(turn.failed, error=True)
        else:
            where = ""
            if turn.done is not None and turn.done.new_tokens == 0 and turn.last_progress is not None:
                p = turn.last_progress
                where = f" while reading ({p.done:,}/{p.total:,} tokens)"
            self.note(f"stopped{where}; your message is back in the input")
        self.pending = turn.documents + self.pending
        await self.show_chips()
        self.prompt.value = turn.question
        self.prompt.cursor_position = len(turn.question)

    # --- actions (bound to keys, see localchat/tui/keys.py) ---------------------------------------

    def action_cancel(self) -> None:
        if self.turn is not None:
            self.turn.cancel.set()

    def action_toggle_map(self) -> None:
        view = self.query_one(RetainedMap)
        view.display = not view.display
        self.refresh_map()

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one("#sidebar")
        sidebar.display = not sidebar.display

    async def action_new_chat(self) -> None:
        await self.run_command(commands.Command("new", ""))

    async def action_export(self) -> None:
        await self.run_command(commands.Command("export", ""))

    async def action_help(self) -> None:
        await self.run_command(commands.Command("help", ""))

def turn_stats(done: Done) -> str:
    return (f"read {done.prompt_tokens:,} new tokens in {done.prefill_s:.1f} s ({done.prefill_tps:,.0f} tok/s), "
            f"wrote {done.new_tokens:,} at {done.decode_tps:,.1f} tok/s")
