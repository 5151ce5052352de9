"""Kept launches (flashcupy/replay.py): the key of a call, the bounded store, the rewritten pointers."""

import numpy as np
import pytest

from flashcupy import params, replay
from flashcupy.launch import LaunchPlan


class FakeArray:
    """What a write reads of an array: its device address."""

    def __init__(self, ptr):
        self.data = type("Pointer", (), {"ptr": ptr})()


class FakeKernel:
    """A RawKernel as a Replay reads it: its CUfunction for the current device."""

    def __init__(self, function=0xF00):
        self.kernel = type("Function", (), {"ptr": function})()


@pytest.fixture
def launches(monkeypatch):
    """The launches a Replay makes: (function, plan, the argument's bytes as the driver would read
    them, stream), with no GPU."""
    import ctypes

    made = []

    def kernel_launcher(function, plan):
        def launch(params_address, stream):
            argument = ctypes.c_uint64.from_address(params_address).value  # the one parameter's address
            made.append((function, plan, ctypes.string_at(argument, 4096), stream))

        return launch

    monkeypatch.setattr(replay, "kernel_launcher", kernel_launcher)
    return made


def test_a_replay_rewrites_only_the_buffers_pointers(no_gpu_needed, launches):
    writes = params.buffer_writes("FwdParams", params.FWD_BUFFERS)
    dtype = params.record_dtype("FwdParams")
    assert all(dtype.fields[field][0] == np.uint64 for field in params.FWD_BUFFERS)
    args = bytes(range(256)) * (dtype.itemsize // 256 + 1)
    args = args[:dtype.itemsize + 40]  # what follows the struct (an sm90 argument's tail) stays too
    plan = LaunchPlan((132, 1, 1), (384, 1, 1), 200000)
    launch = replay.Replay(FakeKernel(0xABC), plan, args, writes)
    buffers = {"out": FakeArray(0x7F0012345600), "lse": FakeArray(0x7F00ABCDEF00)}
    launch(buffers)
    (function, launched_plan, raw, stream), = launches
    assert (function, launched_plan, stream) == (0xABC, plan, 0)
    raw = raw[:len(args)]
    assert raw == launch.arguments(buffers)
    record = np.frombuffer(raw[:dtype.itemsize], dtype)[0]
    assert record["out"] == 0x7F0012345600 and record["lse"] == 0x7F00ABCDEF00
    changed = {i for i in range(len(args)) if raw[i] != args[i]}
    allowed = {offset + i for offset, _, _ in writes for i in range(8)}
    assert changed and changed <= allowed


def test_writes_fill_backward_fields_from_their_buffers_and_other_encodings():
    writes = params.buffer_writes("BwdParams", params.BWD_BUFFERS)
    dtype = params.record_dtype("BwdParams")
    args = bytes(dtype.itemsize + 128)
    tail = (dtype.itemsize, "dq_accum", lambda a: bytes([a.data.ptr % 251]) * 128)  # a tensor map, say
    launch = replay.Replay(FakeKernel(), LaunchPlan((1, 1, 1), (1, 1, 1), 0), args, writes + (tail,))
    buffers = {name: FakeArray(0x1000 * (i + 1)) for i, name in enumerate(sorted(set(params.BWD_BUFFERS.values())))}
    buffers["semaphore"] = None  # not allocated: a null pointer
    raw = launch.arguments(buffers)
    record = np.frombuffer(raw[:dtype.itemsize], dtype)[0]
    for field, name in params.BWD_BUFFERS.items():
        assert record[field] == (0 if buffers[name] is None else buffers[name].data.ptr), field
    assert raw[dtype.itemsize:] == bytes([buffers["dq_accum"].data.ptr % 251]) * 128
    assert record["q"] == 0 and record["max_seqlen_q"] == 0  # everything else as kept


def test_a_launch_writes_what_arguments_gives_each_time(no_gpu_needed, launches):
    """The kept argument buffer is written in place: each launch carries its own buffers, a pointer
    at an offset that is not a 64-bit word and another encoding as bytes, a null where one is gone."""
    args = bytes(range(1, 61))
    writes = ((0, "a", replay.pointer), (12, "b", replay.pointer),
              (40, "map", lambda a: bytes([a.data.ptr % 251]) * 16))
    launch = replay.Replay(FakeKernel(), LaunchPlan((2, 1, 1), (128, 1, 1), 0), args, writes)
    runs = [{"a": FakeArray(0x1111), "b": FakeArray(0x2222), "map": FakeArray(7)},
            {"a": FakeArray(0x3333), "b": None, "map": FakeArray(9)}]
    for buffers in runs:
        launch(buffers)
    for buffers, (_, _, raw, _) in zip(runs, launches):
        assert raw[:len(args)] == launch.arguments(buffers)
    second = launches[1][2]
    assert second[12:20] == bytes(8) and second[40:56] == bytes([9]) * 16 and second[20:40] == args[20:40]


def test_a_plain_plan_launches_through_cupy_with_its_geometry(monkeypatch):
    from cupy.cuda import driver

    seen = []
    monkeypatch.setattr(driver, "launchKernel", lambda *a: seen.append(a))
    launch = replay.kernel_launcher(0xABC, LaunchPlan((7, 2, 3), (256, 1, 1), 4096))
    launch(0x5000, 0x77)
    assert seen == [(0xABC, 7, 2, 3, 256, 1, 1, 4096, 0x77, 0x5000, 0)]


def test_a_plain_plans_launch_config_has_its_geometry_and_no_attribute():
    config = replay.launch_config(LaunchPlan((8, 1, 1), (256, 1, 1), 140000))
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (8, 1, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ, config.sharedMemBytes) == (256, 1, 1, 140000)
    assert config.numAttrs == 0


def test_a_programmatic_plan_launches_with_the_serialization_attribute(monkeypatch):
    """cuLaunchKernelEx gets the plan's geometry, the stream of each launch and programmatic stream
    serialization allowed; once the driver refuses it, the launches are plain (whose errors raise)."""
    from cuda.bindings import driver as cu
    from cupy.cuda import driver

    seen, plain = [], []
    monkeypatch.setattr(driver, "launchKernel", lambda *a: plain.append(a))

    def launch_ex(config, function, params, extra):
        attribute = config.attrs[0]
        seen.append(((config.gridDimX, config.gridDimY, config.gridDimZ),
                     (config.blockDimX, config.blockDimY, config.blockDimZ), config.sharedMemBytes,
                     int(config.hStream), config.numAttrs, attribute.id,
                     attribute.value.programmaticStreamSerializationAllowed, int(function), params, extra))
        return (cu.CUresult.CUDA_SUCCESS if len(seen) < 3 else cu.CUresult.CUDA_ERROR_INVALID_VALUE,)

    monkeypatch.setattr(cu, "cuLaunchKernelEx", launch_ex)
    launch = replay.kernel_launcher(0xABC, LaunchPlan((40, 8, 2), (512, 1, 1), 90000, programmatic=True))
    launch(0x5000, 0x77)
    launch(0x6000, 0x88)
    programmatic = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert seen == [((40, 8, 2), (512, 1, 1), 90000, 0x77, 1, programmatic, 1, 0xABC, 0x5000, 0),
                    ((40, 8, 2), (512, 1, 1), 90000, 0x88, 1, programmatic, 1, 0xABC, 0x6000, 0)]
    assert plain == []
    launch(0x5000, 0x77)  # refused: launched plainly
    launch(0x6000, 0x88)  # plainly, without asking again
    assert len(seen) == 3
    assert plain == [(0xABC, 40, 8, 2, 512, 1, 1, 90000, 0x77, 0x5000, 0),
                     (0xABC, 40, 8, 2, 512, 1, 1, 90000, 0x88, 0x6000, 0)]


def test_buffers_keep_the_callers_outputs_and_alias(monkeypatch):
    import cupy

    made = []
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype: made.append(("empty", shape)) or FakeArray(len(made)))
    monkeypatch.setattr(cupy, "zeros", lambda shape, dtype: made.append(("zeros", shape)) or FakeArray(len(made)))
    buffers = replay.Buffers({"dq": ((2, 3), "f2", False), "dk": ((4,), "f2", False), "sem": ((5,), "i4", True)},
                             aliases={"dk_heads": "dk"})
    mine = FakeArray(99)
    b = buffers.allocate({"dq": mine, "dk": None})
    assert b["dq"] is mine and b["dk_heads"] is b["dk"]
    assert made == [("empty", (4,)), ("zeros", (5,))]


@pytest.fixture
def no_gpu_needed(monkeypatch):
    """call_key reads the current device and stream; here device 0, stream 0."""
    import cupy

    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: type("S", (), {"ptr": 0})())


OPTIONS = (None, True, (-1, -1), "bottom_right", 0.0, None)


def test_the_key_tells_apart_what_the_checks_tell_apart(no_gpu_needed, monkeypatch):
    key = replay.call_key("f", (None, None), OPTIONS)
    assert key == replay.call_key("f", (None, None), OPTIONS)
    assert hash(key) == hash(replay.call_key("f", (None, None), OPTIONS))
    assert replay.call_key("g", (None, None), OPTIONS) != key  # another entry point
    other = [(None, 1, (-1, -1), "bottom_right", 0.0, None),  # equal values of other types
             (None, True, (np.int64(-1), -1), "bottom_right", 0.0, None),
             (None, True, (-1, -1), "bottom_right", 0, None),
             (0.125, True, (-1, -1), "bottom_right", 0.0, None),
             (None, True, (-1, -1), "top_left", 0.0, None),
             (None, True, (-1, -1), "bottom_right", 0.0, "sm80")]
    assert len({key, *(replay.call_key("f", (None, None), o) for o in other)}) == 1 + len(other)
    monkeypatch.setenv("FLASHCUPY_BACKEND", "sm80")
    assert replay.call_key("f", (None, None), OPTIONS) != key


def test_calls_that_cannot_be_kept_have_no_key(no_gpu_needed):
    host = np.zeros((1, 4, 1, 64), np.float16)
    assert replay.call_key("f", (host, None), OPTIONS) is None  # the full path refuses it, saying why
    assert replay.call_key("f", (None, None), (None, True, [-1, -1], "bottom_right", 0.0, None)) is None
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


def test_rerun_hands_the_callers_outputs_to_the_kept_call():
    seen = []

    def kept_call(given):
        seen.append(given)
        return {"out": "o", "lse": "l", **{n: a for n, a in given.items() if a is not None}}

    replay.clear()
    replay.keep("k", kept_call)
    assert replay.rerun("k", {"dq": "mine", "dk": None}) == {"out": "o", "lse": "l", "dq": "mine"}
    assert replay.rerun_forward("k", True) == ("o", "l") and replay.rerun_forward("k", False) == "o"
    assert seen == [{"dq": "mine", "dk": None}, {}, {}]
    assert replay.rerun("other") is None and replay.rerun_forward(None, True) is None
    replay.clear()
