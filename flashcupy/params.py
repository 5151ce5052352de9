"""The kernels' parameter structs (cuda_src/params.cuh) on the Python side: field tables, NumPy
record layouts, and the values filled once per call from the validated problem.

A kernel takes its struct by value: CuPy passes a NumPy structured scalar's bytes as the argument.
`layout_probe_source` and `compiled_layout` let CI compare these tables with the C++ layout
(tests/test_params.py), so the two sides cannot drift apart.
"""

from __future__ import annotations

import functools
import math
import re
import struct as pystruct

import numpy as np

from .build import load_source
from .replay import pointer

PTR, I64, I32, F32 = np.uint64, np.int64, np.int32, np.float32
LOG2E = math.log2(math.e)


def _strides(prefix: str) -> list:
    return [(f"{prefix}_{dim}_stride", I64) for dim in ("batch", "row", "head")]


# Field order and types exactly as cuda_src/params.cuh declares them.
FWD_FIELDS = (
    [(name, PTR) for name in ("q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes",
                              "sinks")]
    + _strides("q") + _strides("k") + _strides("v") + _strides("o")
    + [("lse_batch_stride", I64), ("lse_head_stride", I64)]
    + [(name, I32) for name in ("max_seqlen_q", "max_seqlen_k", "nheads", "heads_per_kv_head",
                                "align_bottom_right", "window_left", "window_right", "alibi_batch_stride",
                                "batch")]
    + [(name, F32) for name in ("softcap", "softmax_scale", "scale_log2")]
)
# BwdParams derives from FwdParams: its own fields start after the whole (padded) base struct.
BWD_OWN_FIELDS = (
    [(name, PTR) for name in ("dout", "delta", "dq_accum", "dq", "dk", "dv", "dk_kv", "dv_kv", "dq_semaphore")]
    + _strides("do") + _strides("dq") + _strides("dk") + _strides("dv") + _strides("dk_kv") + _strides("dv_kv")
    + [(name, I32) for name in ("rows_batch", "rows_seqlen_q", "rows_seqlen_k", "nheads_k")]
)
# DecodeParams derives from FwdParams too (q, k, v: the queries and the caches).
DECODE_OWN_FIELDS = (
    [(name, PTR) for name in ("k_cache", "v_cache", "k_new", "v_new", "q_source", "q_rotated", "rotary_cos",
                              "rotary_sin", "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table",
                              "out_partial", "lse_partial", "split_counters")]
    + _strides("knew") + _strides("vnew") + _strides("qsrc") + [("block_table_batch_stride", I64), ("page_div_mul", I64)]
    + [(name, I32) for name in ("page_size", "page_div_shift", "seqlen_new", "num_splits", "heads_per_block", "rotary_dim",
                                "rotary_interleaved", "rotary_q_per_row")]
)
# The pointer fields that name buffers a call allocates (or the caller's outputs), with the name of
# the buffer each holds (replay.Buffers): a kept call writes them afresh each time.
FWD_BUFFERS = {"out": "out", "lse": "lse"}
BWD_BUFFERS = {"dq": "dq", "dk": "dk_heads", "dv": "dv_heads", "dk_kv": "dk", "dv_kv": "dv", "delta": "delta",
               "dq_accum": "dq_accum", "dq_semaphore": "semaphore"}
DECODE_BUFFERS = {"out": "out", "lse": "lse", "q_rotated": "q_rotated", "out_partial": "out_partial",
                  "lse_partial": "lse_partial"}
STRUCTS = {"FwdParams": (FWD_FIELDS, None), "BwdParams": (BWD_OWN_FIELDS, "FwdParams"),
           "DecodeParams": (DECODE_OWN_FIELDS, "FwdParams")}


@functools.lru_cache(maxsize=None)
def record_dtype(struct: str) -> np.dtype:
    """The NumPy layout of a params struct, C alignment rules (align=True) as NVRTC lays it out."""
    fields, base = STRUCTS[struct]
    if base is None:
        return np.dtype(fields, align=True)
    base_dtype = record_dtype(base)
    names = list(base_dtype.names) + [n for n, _ in fields]
    formats = [base_dtype.fields[n][0] for n in base_dtype.names] + [t for _, t in fields]
    offsets = [base_dtype.fields[n][1] for n in base_dtype.names]
    offset = base_dtype.itemsize
    for _, t in fields:
        align = np.dtype(t).alignment
        offset = -(-offset // align) * align
        offsets.append(offset)
        offset += np.dtype(t).itemsize
    align = max(np.dtype(f).alignment for f in formats)
    return np.dtype({"names": names, "formats": formats, "offsets": offsets,
                     "itemsize": -(-offset // align) * align}, align=True)


def buffer_writes(struct: str, buffers: dict) -> tuple:
    """replay.Replay's writes for the struct's buffer pointers: (byte offset, buffer name, encode) for
    each field of `buffers` (field -> buffer name)."""
    dtype = record_dtype(struct)
    return tuple((dtype.fields[field][1], name, pointer) for field, name in buffers.items())


def field_names(struct: str) -> list:
    """Every field of the struct in layout order, the base struct's first."""
    return list(record_dtype(struct).names)


_STRUCT_CODES = {np.dtype(PTR): "Q", np.dtype(I64): "q", np.dtype(I32): "i", np.dtype(F32): "f"}


@functools.lru_cache(maxsize=None)
def _packer(struct: str):
    """(field names in layout order, a struct.Struct that writes them with the C padding)."""
    dtype = record_dtype(struct)
    fields = sorted(((dtype.fields[n][1], n, dtype.fields[n][0]) for n in dtype.names))
    fmt, offset = "<", 0
    for field_offset, _, field_dtype in fields:
        fmt += "x" * (field_offset - offset) + _STRUCT_CODES[field_dtype]
        offset = field_offset + field_dtype.itemsize
    fmt += "x" * (dtype.itemsize - offset)
    return tuple(n for _, n, _ in fields), pystruct.Struct(fmt)


def pack(struct: str, values: dict) -> np.void:
    """A kernel argument: the struct with `values` (name -> value; arrays give their device pointer,
    None a null pointer). Every field must be given: a forgotten one is an error, not a zero."""
    names, layout = _packer(struct)
    if len(values) != len(names) or not all(n in values for n in names):
        missing = set(names) - set(values)
        extra = set(values) - set(names)
        raise KeyError(f"{struct}: missing fields {sorted(missing)}, unknown fields {sorted(extra)}")
    row = [values[n] for n in names]
    for i, value in enumerate(row):
        if value is None:
            row[i] = 0
        elif not isinstance(value, (int, float, np.integer, np.floating)):
            row[i] = value.data.ptr  # a device array
    return np.frombuffer(layout.pack(*row), record_dtype(struct))[0]


def strides(prefix: str, element_strides) -> dict:
    """{prefix_batch_stride, prefix_row_stride, prefix_head_stride} from an array's element strides;
    a packed varlen array (total, heads, headdim) has batch stride 0."""
    st = tuple(element_strides)
    batch, row, head = (0, *st[:2]) if len(st) == 3 else st[:3]
    return {f"{prefix}_batch_stride": batch, f"{prefix}_row_stride": row, f"{prefix}_head_stride": head}


# ----------------------------------------------------------------------------------------------
# The layout check: the C++ compiler's offsets of every field, read back from PTX
# ----------------------------------------------------------------------------------------------

_PROBE_KERNEL = "flashcupy_layout_probe"


def layout_probe_source(struct: str) -> str:
    """A kernel that stores sizeof(struct) and the offset of each field of the Python table, in
    order, into o[]. NVRTC has no offsetof, but it folds each offset to a constant in the PTX; a
    field the C++ struct lacks fails the compile."""
    stores = "".join(f" o[{i + 1}] = FC_OFFSET({struct}, {name});" for i, name in enumerate(field_names(struct)))
    return (load_source("params.cuh")
            + "\n#define FC_OFFSET(T, f) ((unsigned long long)&(((T*)0)->f))\n"
            + f'extern "C" __global__ void {_PROBE_KERNEL}(unsigned long long* o) {{ o[0] = sizeof({struct});'
            + stores + " }\n")


def compiled_layout(struct: str, arch: str = "sm_80") -> tuple:
    """(sizeof, {field: offset}) of the C++ struct, compiled by NVRTC (no GPU needed): the probe's
    constant stores read back from its PTX."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(layout_probe_source(struct), "layout.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["-std=c++17", f"-arch={arch}"])
        ptx = nvrtc.getPTX(prog)
    except nvrtc.NVRTCError as exc:
        raise RuntimeError(f"{struct} layout probe failed:\n{nvrtc.getProgramLog(prog)}") from exc
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    constants = {reg: int(value) for reg, value in re.findall(r"mov\.[us]64\s+(%rd\d+),\s*(\d+);", ptx)}
    stored = {int(offset or 0) // 8: constants[reg]
              for offset, reg in re.findall(r"st\.global\.u64\s+\[%rd\d+\+?(\d*)\],\s*(%rd\d+);", ptx)}
    names = field_names(struct)
    if sorted(stored) != list(range(len(names) + 1)):
        raise RuntimeError(f"{struct} layout probe: expected {len(names) + 1} constant stores in the PTX, "
                           f"found {len(stored)}")
    return stored[0], {name: stored[i + 1] for i, name in enumerate(names)}


def declared_fields(struct: str) -> list:
    """Names of the data members params.cuh declares in `struct`'s own body, in order (one per line,
    as that file keeps them)."""
    text = load_source("params.cuh")
    body = re.search(r"struct\s+" + struct + r"\b[^{]*\{(.*?)\n\};", text, re.S)
    if body is None:
        raise ValueError(f"struct {struct} not found in params.cuh")
    return re.findall(r"^\s*[\w\s\*]+?[\s\*](\w+);", body.group(1), re.M)


# ----------------------------------------------------------------------------------------------
# The values of one call
# ----------------------------------------------------------------------------------------------

def _element_strides(array) -> tuple:
    itemsize = array.dtype.itemsize
    return tuple(s // itemsize for s in array.strides)


def fwd_values(problem, q, k, v, out, lse) -> dict:
    """FwdParams of a forward call (q, k, v, out: (batch, seqlen, heads, headdim) or packed varlen)."""
    o = problem.options
    slopes = o.alibi_slopes
    lse_strides = (0, lse.shape[1]) if problem.is_varlen else (problem.nheads * problem.max_seqlen_q,
                                                               problem.max_seqlen_q)
    return {
        "q": q, "k": k, "v": v, "out": out, "lse": lse,
        "cu_seqlens_q": problem.cu_seqlens_q, "cu_seqlens_k": problem.cu_seqlens_k,
        "alibi_slopes": slopes, "sinks": o.sinks,
        **strides("q", _element_strides(q)), **strides("k", _element_strides(k)),
        **strides("v", _element_strides(v)), **strides("o", _element_strides(out)),
        "lse_batch_stride": lse_strides[0], "lse_head_stride": lse_strides[1],
        "max_seqlen_q": problem.max_seqlen_q, "max_seqlen_k": problem.max_seqlen_k,
        "nheads": problem.nheads, "heads_per_kv_head": problem.nheads // problem.nheads_k,
        "align_bottom_right": int(problem.band.bottom_right),
        "window_left": problem.band.left, "window_right": problem.band.right,
        "alibi_batch_stride": problem.nheads if slopes is not None and slopes.ndim == 2 else 0,
        "batch": problem.batch,
        "softcap": o.softcap, "softmax_scale": problem.scale, "scale_log2": problem.scale * LOG2E,
    }


def bwd_values(problem, dout, q, k, v, out, lse, delta, dq_accum, dq, dk, dv, dk_kv, dv_kv, dq_semaphore,
               rows_batch, rows_seqlen_q, rows_seqlen_k) -> dict:
    """BwdParams of a backward call: dk, dv are what the main kernel writes (per query head under GQA,
    else the results themselves); dk_kv, dv_kv the per-kv-head results the group sum writes."""
    return {
        **fwd_values(problem, q, k, v, out, lse),
        "dout": dout, "delta": delta, "dq_accum": dq_accum, "dq": dq, "dk": dk, "dv": dv,
        "dk_kv": dk_kv, "dv_kv": dv_kv, "dq_semaphore": dq_semaphore,
        **strides("do", _element_strides(dout)), **strides("dq", _element_strides(dq)),
        **strides("dk", _element_strides(dk)), **strides("dv", _element_strides(dv)),
        **strides("dk_kv", _element_strides(dk_kv)), **strides("dv_kv", _element_strides(dv_kv)),
        "rows_batch": rows_batch, "rows_seqlen_q": rows_seqlen_q, "rows_seqlen_k": rows_seqlen_k,
        "nheads_k": problem.nheads_k,
    }
