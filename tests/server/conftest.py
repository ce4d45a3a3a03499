"""A real server (uvicorn on 127.0.0.1, an ephemeral port) over a real engine and store, in a thread."""

from __future__ import annotations

import pytest

from localchat.engine.engine import Engine
from localchat.engine.sampling import GenerationSettings
from localchat.server.service import Service
from localchat.store import Store
from tiny import tiny_llama


@pytest.fixture()
def serve(tiny_tok, tmp_path):
    """`serve(engine=None, **service options)`: a started Service on the tiny model (the same weights every time)
    over the store in tmp_path, stopped at the end. Called again after `.stop()`, it is a restart."""
    running = []

    def start(engine=None, defaults=GenerationSettings(max_new_tokens=12), **kw):
        engine = engine or Engine(tiny_llama(len(tiny_tok)), tiny_tok, name="tiny", chunk=512)
        (tmp_path / "data").mkdir(mode=0o700, exist_ok=True)
        store = Store(tmp_path / "data" / "chats.sqlite3")
        service = Service(engine, store, defaults=defaults, **kw).start()
        running.append((service, store))
        return service

    yield start
    for service, store in running:
        service.stop()
        store.close()
