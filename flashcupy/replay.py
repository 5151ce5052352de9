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
from collections import OrderedDict

import numpy as np

from .problem import BACKEND_ENV

MAX_KEPT = 256  # calls kept, the least recently used dropped first
_POINTER = struct.Struct("<Q")


def pointer(array) -> bytes:
    """A buffer's device address as the argument bytes hold it (None: a null pointer)."""
    return _POINTER.pack(0 if array is None else array.data.ptr)


class Replay:
    """One kernel launch kept as its argument bytes, to launch again over other buffers: `writes`
    lists (byte offset, buffer name, encode), and each run writes encode(buffer) there, the buffer's
    pointer (`pointer`) or a tensor map over it."""

    def __init__(self, kernel, plan, args: bytes, writes):
        self.kernel, self.plan, self.args, self.writes = kernel, plan, bytes(args), tuple(writes)
        self._arg_type = np.dtype((np.void, len(self.args)))

    def arguments(self, buffers: dict) -> bytes:
        """The argument bytes with `buffers` (name -> array) written in."""
        raw = bytearray(self.args)
        for offset, name, encode in self.writes:
            data = encode(buffers.get(name))
            raw[offset:offset + len(data)] = data
        return bytes(raw)

    def __call__(self, buffers: dict) -> None:
        arg = np.frombuffer(self.arguments(buffers), self._arg_type)[0]
        self.kernel(self.plan.grid, self.plan.block, (arg,), shared_mem=self.plan.smem_bytes)


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
            if given.get(name) is not None:
                out[name] = given[name]
            else:
                out[name] = (cupy.zeros if zeroed else cupy.empty)(shape, dtype)
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

    if not all(a is None or type(a) is cupy.ndarray for a in arrays):
        return None  # the full path converts them, or says why not
    device = cupy.cuda.runtime.getDevice()
    if any(a is not None and a.data.device_id != device for a in arrays):
        return None
    parts = [entry] + [None if a is None else (a.data.ptr, a.shape, a.strides, a.dtype) for a in arrays]
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
