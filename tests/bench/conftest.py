"""Fixtures of the bench tests: a tiny random model on disk, one torch thread."""

from __future__ import annotations

import pytest
import torch
from tiny import save_tiny


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(save_tiny(tmp_path_factory.mktemp("tiny-bench")))


@pytest.fixture
def one_thread(monkeypatch):
    """Tiny models run fastest on one thread (and do not fight a busy CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # for cell subprocesses
    yield
    torch.set_num_threads(threads)
