from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the kernel tests run Triton's interpreter on CPU tensors (tests/kernels/test_kernels.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny import tiny_llama, tiny_tokenizer

from localchat.engine.engine import Engine


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path_factory, monkeypatch):
    """Config, data and packed weights never touch the user's real dirs; the model cache is shared (one fetch)."""
    monkeypatch.setenv("LOCALCHAT_CONFIG_DIR", str(tmp_path_factory.getbasetemp() / "config"))
    monkeypatch.setenv("LOCALCHAT_DATA_DIR", str(tmp_path_factory.getbasetemp() / "data"))
    from localchat.engine import packed_store

    monkeypatch.setattr(packed_store, "folder", lambda: tmp_path_factory.getbasetemp() / "packed")


@pytest.fixture(autouse=True)
def _cpu_not_measured(monkeypatch):
    """Plans are made as on a CPU whose packed kernels were never measured (fp32 weights for the embedded model),
    so what the tests read does not depend on the machine; tests of the CPU defaults set the class they test."""
    from localchat.planning import planner

    monkeypatch.setattr(planner, "cpu_class", lambda: "DEFAULT")


@pytest.fixture
def triton_kernels(monkeypatch):
    """The Triton kernels in place of their twins: under Triton's interpreter on a CPU (TRITON_INTERPRET above),
    natively on CUDA."""
    import localchat.kernels as kernels

    monkeypatch.setenv("LOCALCHAT_KERNELS", "triton")
    kernels.reset_backend()
    assert kernels.backend() == "triton"
    yield
    monkeypatch.delenv("LOCALCHAT_KERNELS")
    kernels.reset_backend()


@pytest.fixture(scope="session")
def tiny_tok():
    return tiny_tokenizer()


@pytest.fixture()
def tiny_engine(tiny_tok):
    return Engine(tiny_llama(len(tiny_tok)), tiny_tok, name="tiny", chunk=64)


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (fetched into the user cache on first use)."""
    return Engine.load(None)


@pytest.fixture()
def serve(tiny_tok, tmp_path):
    """`serve(engine=None, **service options)`: a started `localchat serve` (uvicorn on 127.0.0.1, an ephemeral port,
    in a thread) on the tiny model (the same weights every time) over a store in tmp_path, stopped at the end.
    Called again after `.stop()`, it is a restart."""
    from localchat.engine.sampling import GenerationSettings
    from localchat.server.service import Service
    from localchat.store import Store

    running = []

    def start(engine=None, defaults=None, **kw):
        engine = engine or Engine(tiny_llama(len(tiny_tok)), tiny_tok, name="tiny", chunk=512)
        (tmp_path / "data").mkdir(mode=0o700, exist_ok=True)
        store = Store(tmp_path / "data" / "chats.sqlite3")
        service = Service(engine, store, defaults=defaults or GenerationSettings(max_new_tokens=12), **kw).start()
        running.append((service, store))
        return service

    yield start
    for service, store in running:
        service.stop()
        store.close()
