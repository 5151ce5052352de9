"""Calls repeated with the same inputs skip the host work: a call's launches are kept, keyed by
everything they depend on, and launched again with only the buffers the call allocates rewritten.

Validating, describing the problem, choosing the family and packing the parameters cost 0.2-0.3 ms
of Python per forward and about 0.4 ms per backward, more than the GPU time of a forward of 1k tokens
on an H100; a replayed call costs its allocations and its launches. The key holds the inputs'
pointers, shapes, strides and dtypes, every option (with its type, so a value the checks would
refuse never meets a kept launch), FLASHCUPY_BACKEND, the current device and stream: what the first
call validated and computed from them holds again. No array is kept, only pointers and bytes.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict

import numpy as np

from .problem import BACKEND_ENV

MAX_KEPT = 256  # calls kept, the least recently used dropped first
_POINTER = struct.Struct("<Q")


def pointer(array) -> bytes:
    """A buffer's device address as the argument bytes hold it (None: a null pointer)."""
    return _POINTER.pack(0 if array is None else array.data.ptr)


def launch_config(plan):
    """cuda-bindings' CUlaunchConfig of `plan`: its geometry, and for a programmatic plan programmatic
    stream serialization allowed (the stream is set per launch)."""
    from cuda.bindings import driver as cu

    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = plan.grid
    config.blockDimX, config.blockDimY, config.blockDimZ = plan.block
    config.sharedMemBytes = plan.smem_bytes
    if plan.programmatic:
        attribute = cu.CUlaunchAttribute()
        attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        config.attrs, config.numAttrs = [attribute], 1
    return config


def kernel_launcher(function: int, plan):
    """A launcher of the CUfunction `function` with `plan`'s geometry: launcher(params, stream), where
    `params` is the address of the array of parameter addresses (one here: the kernel takes one struct
    by value). A programmatic plan is launched with programmatic stream serialization allowed
    (cuLaunchKernelEx through cuda-bindings: cupy has no launch with attributes), its config built
    once; where the driver refuses that launch, plainly from then on (the kernel's wait then returns
    at once), so that an error of the plain launch is what is raised."""
    from cupy.cuda import driver

    geometry = (*plan.grid, *plan.block, plan.smem_bytes)

    def plain(params: int, stream: int) -> None:
        driver.launchKernel(function, *geometry, stream, params, 0)

    if not plan.programmatic:
        return plain
    from cuda.bindings import driver as cu

    config = launch_config(plan)
    handle, success = cu.CUfunction(function), cu.CUresult.CUDA_SUCCESS
    refused = False

    def launch(params: int, stream: int) -> None:
        nonlocal refused
        if not refused:
            config.hStream = stream
            if cu.cuLaunchKernelEx(config, handle, params, 0)[0] == success:
                return
            refused = True
        plain(params, stream)

    return launch


class Replay:
    """One kernel launch kept as its argument bytes, to launch again over other buffers: `writes`
    lists (byte offset, buffer name, encode), and each run writes encode(buffer) there, the buffer's
    pointer (`pointer`) or a tensor map over it.

    A run writes into one argument buffer kept with the launch and hands the driver its address (the
    driver copies the parameters at launch), which costs a few microseconds less than a launch through
    RawKernel's argument packing; a lock keeps two threads' writes apart."""

    def __init__(self, kernel, plan, args: bytes, writes):
        self.kernel, self.plan, self.args, self.writes = kernel, plan, bytes(args), tuple(writes)
        self._raw = self._padded_args()
        self._params = np.array([self._raw.ctypes.data], np.uint64)  # the parameter's address
        self._params_address = self._params.ctypes.data
        # pointer writes go straight into their 64-bit word; the others (tensor maps) as bytes
        self._pointers = tuple((offset // 8, name) for offset, name, encode in self.writes
                               if encode is pointer and offset % 8 == 0)
        self._others = tuple(w for w in self.writes if not (w[2] is pointer and w[0] % 8 == 0))
        self._launch = None
        self._lock = threading.Lock()

    def _padded_args(self) -> np.ndarray:
        """A writable copy of the kept argument bytes as uint8, padded to whole 64-bit words."""
        return np.frombuffer(bytearray(self.args + bytes(-len(self.args) % 8)), np.uint8)

    def _fill(self, raw, buffers: dict) -> None:
        """Writes `buffers` (name -> array) into `raw`, the argument as 8-byte-padded uint8."""
        words, get = raw.view(np.uint64), buffers.get
        for index, name in self._pointers:
            array = get(name)
            words[index] = 0 if array is None else array.data.ptr
        for offset, name, encode in self._others:
            data = encode(get(name))
            raw[offset:offset + len(data)] = np.frombuffer(data, np.uint8)

    def arguments(self, buffers: dict) -> bytes:
        """The argument bytes with `buffers` (name -> array) written in."""
        raw = self._padded_args()
        self._fill(raw, buffers)
        return raw[:len(self.args)].tobytes()

    def __call__(self, buffers: dict) -> None:
        import cupy

        if self._launch is None:  # the kept call's device is the current one (its key holds it)
            self._launch = kernel_launcher(self.kernel.kernel.ptr, self.plan)
        stream = cupy.cuda.get_current_stream().ptr
        with self._lock:
            self._fill(self._raw, buffers)
            self._launch(self._params_address, stream)


class Buffers:
    """What a call allocates: name -> (shape, dtype, zeroed); `aliases` name buffers that are others
    (e.g. the per-query-head dK when there are as many kv heads: dk itself). A name neither allocates
    nor aliases reads as None (a null pointer)."""

    def __init__(self, specs: dict, aliases: dict | None = None):
        self.specs, self.aliases = dict(specs), dict(aliases or {})

    def allocate(self, given: dict) -> dict:
        """The buffers: those in `given` (arrays or None) as given where not None, the others new."""
        import cupy

        out = {}
        for name, (shape, dtype, zeroed) in self.specs.items():
            array = given.get(name)
            out[name] = array if array is not None else (cupy.zeros if zeroed else cupy.empty)(shape, dtype)
        for name, target in self.aliases.items():
            out[name] = out[target]
        return out


class CallReplay:
    """A call's buffers and launches, to run again: allocate (keeping the caller's outputs), launch
    in order, hand the buffers back."""

    def __init__(self, buffers: Buffers, launches):
        self.buffers, self.launches = buffers, tuple(launches)

    def __call__(self, given: dict) -> dict:
        buffers = self.buffers.allocate(given)
        for launch in self.launches:
            launch(buffers)
        return buffers


_KEPT: OrderedDict = OrderedDict()


def call_key(entry: str, arrays: tuple, options: tuple):
    """The key of a call of `entry` (the entry point's name): for each array (CuPy arrays or None)
    its pointer, device, shape, strides and dtype; each option with its type; FLASHCUPY_BACKEND; the
    current device and stream. None when the call cannot be kept (an input that is not a CuPy array
    on the current device, an option that cannot be hashed)."""
    import cupy

    ndarray = cupy.ndarray
    if not all(a is None or type(a) is ndarray for a in arrays):
        return None  # the full path converts them, or says why not
    device = cupy.cuda.runtime.getDevice()
    parts = [entry]
    for a in arrays:
        if a is None:
            parts.append(None)
            continue
        data = a.data
        if data.device_id != device:
            return None
        parts.append((data.ptr, a.shape, a.strides, a.dtype))
    for o in options:
        parts.append((type(o), tuple([(type(x), x) for x in o]) if type(o) is tuple else o))
    parts.append((os.environ.get(BACKEND_ENV), device, cupy.cuda.get_current_stream().ptr))
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def find(key):
    """The kept call of `key`, or None."""
    if key is None:
        return None
    kept = _KEPT.get(key)
    if kept is not None:
        _KEPT.move_to_end(key)
    return kept


def rerun(key, given: dict | None = None) -> dict | None:
    """The buffers of the kept call of `key` after running it again (the caller's outputs in
    `given` used in place), or None when no call of that key is kept."""
    kept = find(key)
    return None if kept is None else kept(given or {})


def rerun_forward(key, return_lse: bool):
    """A forward's result, out (and the LSE), from the kept call of `key` run again; None when none
    is kept."""
    b = rerun(key)
    return None if b is None else (b["out"], b["lse"]) if return_lse else b["out"]


def keep(key, call) -> None:
    if key is None:
        return
    _KEPT[key] = call
    if len(_KEPT) > MAX_KEPT:
        _KEPT.popitem(last=False)


def clear() -> None:
    """Forget every kept call (the next call of each does the full host work again)."""
    _KEPT.clear()
