"""Calls repeated with the same inputs skip the host work: a forward's launch is kept, keyed by
everything the launch depends on, and launched again with only its fresh output buffers rewritten.

Validating, describing the problem, choosing the family and packing the parameters cost about
0.2-0.3 ms of Python per forward, more than the GPU time of a forward of 1k tokens on an H100; a
replayed call costs two allocations and a launch. The key holds the inputs' pointers, shapes,
strides and dtypes, every option (with its type, so a value the checks would refuse never meets a
kept launch), FLASHCUPY_BACKEND, the current device and stream: what the first call validated and
computed from them holds again. No array is kept, only pointers and bytes.
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict

import numpy as np

from .problem import BACKEND_ENV

MAX_KEPT = 256  # launches kept, the least recently used dropped first
_POINTER = struct.Struct("<Q")


class Replay:
    """One kernel launch kept as its argument bytes, to launch again for a call that differs only
    in its output buffers: each output's pointer is rewritten at its byte offset in the arguments."""

    def __init__(self, kernel, plan, args: bytes, pointer_offsets: dict):
        self.kernel, self.plan, self.args = kernel, plan, bytes(args)
        self.pointer_offsets = dict(pointer_offsets)
        self._arg_type = np.dtype((np.void, len(self.args)))

    def arguments(self, **pointers) -> bytes:
        """The argument bytes with `pointers` (output name -> device address) written in."""
        raw = bytearray(self.args)
        for name, offset in self.pointer_offsets.items():
            _POINTER.pack_into(raw, offset, pointers[name])
        return bytes(raw)

    def __call__(self, **pointers) -> None:
        arg = np.frombuffer(self.arguments(**pointers), self._arg_type)[0]
        self.kernel(self.plan.grid, self.plan.block, (arg,), shared_mem=self.plan.smem_bytes)


class ForwardReplay:
    """A forward call to repeat: its launch and the shapes of the outputs it allocates."""

    def __init__(self, launch: Replay, out_shape: tuple, out_dtype, lse_shape: tuple):
        self.launch, self.out_shape, self.out_dtype, self.lse_shape = launch, out_shape, out_dtype, lse_shape

    def __call__(self, return_lse: bool):
        import cupy

        out = cupy.empty(self.out_shape, dtype=self.out_dtype)
        lse = cupy.empty(self.lse_shape, dtype=cupy.float32)
        self.launch(out=out.data.ptr, lse=lse.data.ptr)
        return (out, lse) if return_lse else out


_KEPT: OrderedDict = OrderedDict()


def call_key(arrays: tuple, options: tuple):
    """The key of a call: for each array (CuPy arrays or None) its pointer, device, shape, strides
    and dtype; each option with its type; FLASHCUPY_BACKEND; the current device and stream. None
    when the call cannot be kept (an input that is not a CuPy array on the current device, an
    option that cannot be hashed)."""
    import cupy

    if not all(a is None or type(a) is cupy.ndarray for a in arrays):
        return None  # the full path converts them, or says why not
    device = cupy.cuda.runtime.getDevice()
    if any(a is not None and a.data.device_id != device for a in arrays):
        return None
    parts = [None if a is None else (a.data.ptr, a.shape, a.strides, a.dtype) for a in arrays]
    parts.extend((type(o), tuple((type(x), x) for x in o) if type(o) is tuple else o) for o in options)
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


def keep(key, call) -> None:
    if key is None or call is None:
        return
    _KEPT[key] = call
    if len(_KEPT) > MAX_KEPT:
        _KEPT.popitem(last=False)


def clear() -> None:
    """Forget every kept call (the next call of each does the full host work again)."""
    _KEPT.clear()
