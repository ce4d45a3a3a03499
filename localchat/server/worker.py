"""The engine's one worker: requests run one at a time, in arrival order, from a bounded queue.

A request becomes a Job; the HTTP side awaits its items (Token events, then an Answered, None when cancelled, or a
BadRequest / an exception) on an asyncio queue the worker thread fills. Setting `job.cancel` (the client went away)
stops the engine at its next chunk or token, or skips the job if it has not started; nothing of it is saved.
"""

from __future__ import annotations

import asyncio
import queue
import threading

from localchat.server.turns import BadRequest, Turn

END = object()  # the last item of every job


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
                if not job.cancel.is_set():
                    job.put(self.conversations.answer(job.turn, job.cancel, job.put))
                else:
                    job.put(None)
            except BadRequest as exc:
                job.put(exc)
            except Exception as exc:  # noqa: BLE001 - a failure the request reports in one sentence
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                job.put(BadRequest(f"the server failed to answer ({first})", None, "server_error", 500))
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
                job.put(None)
                job.put(END)
        current = self.current
        if current is not None:
            current.cancel.set()

    def stop(self) -> None:
        """Cancel everything, then end the thread."""
        self.cancel_all()
        self.jobs.put(None)
        self.thread.join(timeout=60)
