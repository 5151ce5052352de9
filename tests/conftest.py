"""Fixtures shared by the CLI tests."""

import pytest

from cli_helpers import FAKE_GPU
from flashcupy import device


@pytest.fixture
def fake_gpu(monkeypatch):
    """flashcupy sees a GPU (FAKE_GPU) without one."""
    monkeypatch.setattr(device, "gpu_available", lambda: True)
    monkeypatch.setattr(device, "device_info", lambda device_id=None: FAKE_GPU)
    return FAKE_GPU
