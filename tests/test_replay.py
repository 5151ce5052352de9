"""Kept launches (flashcupy/replay.py): the key of a call, the bounded store, the rewritten pointers."""

import numpy as np
import pytest

from flashcupy import params, replay
from flashcupy.launch import LaunchPlan


class FakeKernel:
    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((grid, block, args, shared_mem))


def test_a_replay_rewrites_only_the_output_pointers():
    offsets = params.pointer_offsets("FwdParams", params.FWD_OUTPUTS)
    dtype = params.record_dtype("FwdParams")
    assert all(dtype.fields[n][0] == np.uint64 for n in params.FWD_OUTPUTS)
    args = bytes(range(256)) * (dtype.itemsize // 256 + 1)
    args = args[:dtype.itemsize + 40]  # what follows the struct (an sm90 argument's tail) stays too
    kernel, plan = FakeKernel(), LaunchPlan((132, 1, 1), (384, 1, 1), 200000)
    launch = replay.Replay(kernel, plan, args, offsets)
    launch(out=0x7F0012345600, lse=0x7F00ABCDEF00)
    (grid, block, (arg,), smem), = kernel.calls
    assert (grid, block, smem) == (plan.grid, plan.block, plan.smem_bytes)
    raw = arg.tobytes()
    assert len(raw) == len(args)
    record = np.frombuffer(raw[:dtype.itemsize], dtype)[0]
    assert record["out"] == 0x7F0012345600 and record["lse"] == 0x7F00ABCDEF00
    changed = {i for i in range(len(args)) if raw[i] != args[i]}
    allowed = {o + i for o in offsets.values() for i in range(8)}
    assert changed and changed <= allowed


@pytest.fixture
def no_gpu_needed(monkeypatch):
    """call_key reads the current device and stream; here device 0, stream 0."""
    import cupy

    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: type("S", (), {"ptr": 0})())


OPTIONS = (None, True, (-1, -1), "bottom_right", 0.0, None)


def test_the_key_tells_apart_what_the_checks_tell_apart(no_gpu_needed, monkeypatch):
    key = replay.call_key((None, None), OPTIONS)
    assert key == replay.call_key((None, None), OPTIONS) and hash(key) == hash(replay.call_key((None, None), OPTIONS))
    other = [(None, 1, (-1, -1), "bottom_right", 0.0, None),  # equal values of other types
             (None, True, (np.int64(-1), -1), "bottom_right", 0.0, None),
             (None, True, (-1, -1), "bottom_right", 0, None),
             (0.125, True, (-1, -1), "bottom_right", 0.0, None),
             (None, True, (-1, -1), "top_left", 0.0, None),
             (None, True, (-1, -1), "bottom_right", 0.0, "sm80")]
    assert len({key, *(replay.call_key((None, None), o) for o in other)}) == 1 + len(other)
    monkeypatch.setenv("FLASHCUPY_BACKEND", "sm80")
    assert replay.call_key((None, None), OPTIONS) != key


def test_calls_that_cannot_be_kept_have_no_key(no_gpu_needed):
    host = np.zeros((1, 4, 1, 64), np.float16)
    assert replay.call_key((host, None), OPTIONS) is None  # the full path refuses it, saying why
    assert replay.call_key((None, None), (None, True, [-1, -1], "bottom_right", 0.0, None)) is None
    assert replay.find(None) is None
    replay.keep(None, object())
    assert not replay._KEPT


def test_the_store_drops_the_least_recently_used(monkeypatch):
    monkeypatch.setattr(replay, "MAX_KEPT", 3)
    replay.clear()
    for i in range(3):
        replay.keep(i, f"call {i}")
    assert replay.find(0) == "call 0"  # 0 is now the most recent
    replay.keep(3, "call 3")
    assert replay.find(1) is None and [replay.find(i) for i in (0, 2, 3)] == ["call 0", "call 2", "call 3"]
    replay.clear()
    assert replay.find(0) is None
