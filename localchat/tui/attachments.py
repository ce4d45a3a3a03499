"""Documents for the next question: attach by path, paste or picker; chips with exact token counts."""

from __future__ import annotations

import threading
from pathlib import Path

from localchat.tui.events import DocumentReady
from localchat.tui.widgets.chips import Chip, ChipBar, chip_label
from localchat.tui.widgets.prompt import Prompt


class Attachments:
    """Mixed into the chat screen; `self.pending` holds [(Document, tokens)] for the next question."""

    async def show_chips(self) -> None:
        await self.query_one(ChipBar).show([chip_label(d.name, n) for d, n in self.pending])

    def on_prompt_path_pasted(self, event: Prompt.PathPasted) -> None:
        self.attach(event.path)

    def on_prompt_big_paste(self, event: Prompt.BigPaste) -> None:
        from localchat.tui.pasted import pasted_document

        self.pending_counted(pasted_document(event.text, len(self.pending) + 1))

    async def on_chip_removed(self, event: Chip.Removed) -> None:
        if 0 <= event.index < len(self.pending):
            doc, _ = self.pending.pop(event.index)
            self.note(f"removed {doc.name}")
            await self.show_chips()

    def attach(self, path: str) -> None:
        self.note(f"reading {path}…")
        self.run_worker(lambda: self._read_document(path), thread=True, group="documents")

    def _read_document(self, path: str) -> None:
        from localchat.documents import load_document
        from localchat.errors import UserError

        try:
            doc = load_document(path, max_bytes=self.app.max_bytes)
        except UserError as exc:
            self.post_message(DocumentReady(error=str(exc)))
            return
        except Exception as exc:  # noqa: BLE001
            self.post_message(DocumentReady(error=f"cannot read {path}: {exc}"))
            return
        self.pending_counted(doc)

    def pending_counted(self, doc) -> None:
        """Count `doc`'s tokens off the UI thread, then add its chip."""
        def count() -> None:
            if self.app.engine is None:
                self.post_message(DocumentReady(error=f"no model is loaded, so {doc.name} cannot be counted"))
                return
            with self.app.engine_lock:
                tokens = self.app.engine.count_tokens(doc.text)
            self.post_message(DocumentReady(doc, tokens))

        if threading.current_thread() is threading.main_thread():
            self.run_worker(count, thread=True, group="documents")
        else:
            count()

    async def on_document_ready(self, msg: DocumentReady) -> None:
        if msg.error:
            self.note(msg.error, error=True)
            return
        doc, tokens = msg.document, msg.tokens
        if any(d.sha256 == doc.sha256 for d, _ in self.pending):
            self.note(f"{doc.name} is already attached")
            return
        self.pending.append((doc, tokens))
        await self.show_chips()
        self.note(f"attached {doc.name}: {tokens:,} tokens. {self.app.fit_note(tokens)}")

    def action_attach(self) -> None:
        from localchat.tui.screens.file_picker import FilePicker

        def picked(path: Path | None) -> None:
            if path is not None:
                self.attach(str(path))

        self.app.push_screen(FilePicker(), picked)
