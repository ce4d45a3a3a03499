"""The engine's one worker: requests run one at a time, in arrival order, from a bounded queue.

A request becomes a Job; the HTTP side awaits its items on an asyncio queue the worker thread fills: the
conversation's `Named`, Token events, then an `Answered`, `CANCELLED`, or the `BadRequest` that refuses it; `END`
last. Setting `job.cancel` (the client went away) stops the engine at its next chunk or token, or skips the job if
it has not started; nothing of it is saved.
"""

from __future__ import annotations

import asyncio
import queue
import threading

from localchat.server.conversations import log
from localchat.server.turns import Turn, refusal

END = object()  # the last item of every job
CANCELLED = object()  # the job was cancelled: nothing of it is kept


class Busy(Exception):
    """The queue is full."""


class Job:
    def __init__(self, turn: Turn, loop: asyncio.AbstractEventLoop):
        self.turn = turn
        self.cancel = threading.Event()
        self.items: asyncio.Queue = asyncio.Queue()
        self.loop = loop

    def put(self, item) -> None:
        """From the worker thread: hand `item` to the request."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the server's loop is closed: nobody waits for it
            pass


class Worker:
    def __init__(self, conversations, waiting: int):
        self.conversations = conversations
        self.jobs: queue.Queue = queue.Queue(maxsize=waiting)
        self.current: Job | None = None
        self.thread = threading.Thread(target=self._run, name="localchat-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise Busy from None

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.current = job
            try:
                answered = self.conversations.answer(job.turn, job.cancel, job.put) if not job.cancel.is_set() else None
                job.put(answered if answered is not None else CANCELLED)
            except Exception as exc:  # noqa: BLE001 - a failure the request reports in one sentence
                refused = refusal(exc)
                if refused.status >= 500:
                    log(f"a request failed: {refused.message}")
                job.put(refused)
            finally:
                job.put(END)
                self.current = None

    def cancel_all(self) -> None:
        """Cancel what runs and what waits (the server is stopping)."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
                job.put(CANCELLED)
                job.put(END)
        current = self.current
        if current is not None:
            current.cancel.set()

    def stop(self) -> None:
        """Cancel everything, then end the thread."""
        self.cancel_all()
        self.jobs.put(None)
        self.thread.join(timeout=60)
