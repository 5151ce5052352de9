"""Timing harness behind `flashcupy bench`: the FA2 paper's sweep, timed with CUDA events.

Importable without a GPU: CuPy, torch and matplotlib are imported inside the functions that use them.

The sweep gives one plain, JSON-ready dict per (shape, implementation); `FIELDS` says what each key
holds. Implementations: "flashcupy", "naive" (plain CuPy that materialises the N x N scores) and,
when torch with CUDA is importable, PyTorch SDPA with one backend forced: "sdpa_flash" (FA2),
"sdpa_cudnn", "sdpa_mem_efficient". All of them read the same CuPy input arrays (torch through
DLPack, no copy), laid out (batch, seqlen, nheads, headdim).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .validation import MAX_ROWS, MAX_ROWS_TEXT

SCHEMA = "flashcupy-bench/1"

MODES = ("fwd", "bwd", "fwdbwd")
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
IMPLS = ("flashcupy", "naive", "sdpa_flash", "sdpa_cudnn", "sdpa_mem_efficient", "fa4")
PEERS = IMPLS[1:]
TORCH_PEERS = IMPLS[2:]
DEFAULT_PEERS = ("naive", "sdpa_flash", "sdpa_cudnn", "fa4")
_SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                  "sdpa_mem_efficient": "EFFICIENT_ATTENTION"}

# The FA2 paper's sweep (DESIGN.md, benchmark protocol).
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_HEAD_DIMS = (64, 128)
DEFAULT_MODES = MODES  # the CLI's default; sweep_shapes() alone keeps the paper's forward sweep
DEFAULT_TOTAL_TOKENS = 16384
DEFAULT_HIDDEN = 2048
DEFAULT_REPEATS = 20
DEFAULT_WARMUP = 3
DEFAULT_ROUNDS = 1
DEFAULT_SETTLE = 0.1  # seconds of untimed calls: enough for the clocks to leave idle, not for a power cap
# Variants of the causal case in the default sweep: GQA with 4 query heads per kv head
# (d=64: 32 query heads, 8 kv heads) and a Mistral-style sliding window, causal with 1024 keys back.
VARIANTS = ("plain", "gqa", "window")
GQA_GROUP = 4
DEFAULT_WINDOW = 1024

FIELDS = {
    "mode": "fwd, bwd (backward alone, from a stored forward) or fwdbwd (both, timed together)",
    "dtype": "bf16 or fp16",
    "batch": "total_tokens // seqlen (at least 1)",
    "seqlen": "seqlen_q = seqlen_k",
    "nheads": "hidden // head_dim",
    "head_dim": "head dimension",
    "causal": "bottom-right aligned causal mask",
    "nheads_k": "kv heads (GQA when fewer than nheads)",
    "window": "sliding window: causal with window_size=(window, 0), each query sees itself and `window` "
              "keys back; null for none",
    "impl": "implementation: " + ", ".join(IMPLS) + " (fa4: FlashAttention-4's CuTe DSL kernels, flash_attn.cute)",
    "family": "flashcupy: the kernel families that ran, forward / backward (registry.py); null for peers",
    "status": "ok, OOM (out of device memory), err (failed, see note) or n/a (cannot run this case, see note)",
    "ms": "median of `repeats` CUDA-event timings on the current stream, after the first call and "
          "untimed calls (at least `warmup`, for at least `settle` seconds); with `rounds` > 1 that of the "
          "median round, the implementations' order turning each round",
    "tflops": "attention_flops(...) / ms, the FA2 paper's count (causal halves it; bwd 2.5x, fwdbwd 3.5x fwd); "
              "with a window, 4 * headdim FLOPs per visible (query, key) pair instead",
    "ratio": "flashcupy TFLOP/s / this implementation's TFLOP/s (> 1: flashcupy is faster)",
    "first_call_ms": "wall time of the first call of this implementation for this shape, synchronized; "
                     "for flashcupy it holds NVRTC compile or cache load when the variant is new to the process",
    "peak_extra_bytes": "device memory one call needs beyond its inputs, outputs included. CuPy "
                        "implementations: growth of CuPy's default pool over the call after its free blocks "
                        "were released (pool rounding included); torch: max_memory_allocated minus "
                        "memory_allocated before the call",
    "note": "why a case is err or n/a, one line",
}


class NotApplicable(Exception):
    """This implementation cannot run this case (e.g. it has no backward); the message says why."""


class MissingDependencyError(RuntimeError):
    """An optional dependency (matplotlib) is not installed."""


@dataclass(frozen=True)
class BenchShape:
    """One case of the sweep: q is (batch, seqlen, nheads, head_dim), k and v (batch, seqlen,
    nheads_k, head_dim)."""

    batch: int
    seqlen: int
    nheads: int
    head_dim: int
    causal: bool
    dtype: str  # key of DTYPES
    mode: str  # one of MODES
    nheads_k: int = 0  # 0: nheads (no GQA)
    window: int | None = None  # causal sliding window: window_size=(window, 0)

    def __post_init__(self):
        if not self.nheads_k:
            object.__setattr__(self, "nheads_k", self.nheads)
        if self.window is not None and not self.causal:
            raise ValueError("a bench window is the causal sliding window; set causal")

    @property
    def variant(self) -> str:
        if self.window is not None:
            return "window"
        return "gqa" if self.nheads_k != self.nheads else "plain"

    def describe(self) -> str:
        """The mask and heads of this case: 'causal on', 'causal on, GQA 32/8', 'window 1024'."""
        text = f"window {self.window}" if self.window is not None else f"causal {'on' if self.causal else 'off'}"
        return text + (f", GQA {self.nheads}/{self.nheads_k}" if self.nheads_k != self.nheads else "")

    def __str__(self) -> str:
        return f"{self.mode} {self.dtype} d={self.head_dim} {self.describe()} seqlen={format_seqlen(self.seqlen)}"


# ----------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------


def parse_seqlen(text: str) -> int:
    """'512' -> 512, '1k' / '16K' -> 1024 / 16384. Raises ValueError unless a positive integer below
    the kernels' row bound (validation.MAX_ROWS)."""
    s = str(text).strip().lower()
    factor = 1
    if s.endswith("k"):
        s, factor = s[:-1], 1024
    if not s.isdigit():
        raise ValueError(f"{text!r} is not a sequence length (use e.g. 512, 2048 or 2k)")
    value = int(s) * factor
    if value <= 0:
        raise ValueError(f"sequence length must be positive, got {text!r}")
    if value >= MAX_ROWS:
        raise ValueError(f"sequence length {text!r} is not below {MAX_ROWS_TEXT}, the kernels' row bound")
    return value


def format_seqlen(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def hidden_near(hidden: int, head_dims, variants) -> int:
    """The model width nearest `hidden` (at least one step) that every head dim divides, with heads in
    groups of GQA_GROUP where the gqa variant runs."""
    step = int(np.lcm.reduce([int(d) for d in head_dims])) * (GQA_GROUP if "gqa" in variants else 1)
    return max(1, round(hidden / step)) * step


def check_hidden(hidden: int, head_dims, variants) -> None:
    """ValueError, with a width that would do (hidden_near), unless every head dim divides `hidden`
    into whole heads, in groups of GQA_GROUP where the gqa variant runs."""
    for d in head_dims:
        if hidden % d:
            problem = f"hidden size {hidden} is not a multiple of head dim {d}"
        elif "gqa" in variants and (hidden // d) % GQA_GROUP:
            problem = (f"the gqa variant needs hidden / head dim {d} = {hidden // d} heads to be a multiple of "
                       f"{GQA_GROUP}")
        else:
            continue
        raise ValueError(f"{problem}; e.g. --hidden {hidden_near(hidden, head_dims, variants)}")


def sweep_shapes(seqlens=DEFAULT_SEQLENS, head_dims=DEFAULT_HEAD_DIMS, causal=(False, True),
                 dtypes=("bf16",), modes=("fwd",), total_tokens=DEFAULT_TOTAL_TOKENS,
                 hidden=DEFAULT_HIDDEN, variants=("plain",)) -> list[BenchShape]:
    """The cases of a sweep: batch = total_tokens // seqlen, nheads = hidden // head_dim.

    "plain" gives the causal settings asked for; "gqa" and "window" each add causal cases, with
    nheads // GQA_GROUP kv heads or a DEFAULT_WINDOW sliding window.
    """
    check_hidden(hidden, head_dims, variants)
    for dt in dtypes:
        if dt not in DTYPES:
            raise ValueError(f"dtype {dt!r} is not one of {', '.join(DTYPES)}")
    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode {m!r} is not one of {', '.join(MODES)}")
    for name in variants:
        if name not in VARIANTS:
            raise ValueError(f"variant {name!r} is not one of {', '.join(VARIANTS)}")
    cases = [(bool(c), 1, None) for c in causal] if "plain" in variants else []  # (causal, group, window)
    cases += [(True, GQA_GROUP, None)] if "gqa" in variants else []
    cases += [(True, 1, DEFAULT_WINDOW)] if "window" in variants else []
    return [BenchShape(max(1, total_tokens // s), s, hidden // d, d, c, dt, m, hidden // d // group, window)
            for m in modes for dt in dtypes for d in head_dims for c, group, window in cases for s in seqlens]


def run_sweep(shapes, impls=("flashcupy",) + DEFAULT_PEERS, repeats=DEFAULT_REPEATS,
              warmup=DEFAULT_WARMUP, records: list | None = None, rounds=DEFAULT_ROUNDS,
              settle=DEFAULT_SETTLE) -> list[dict]:
    """Benchmark every implementation on every shape; one record per pair, in order.

    `shapes` may be any iterable (the CLI passes a click progress bar over the list). Each shape's
    records join `records` (a new list if None) as soon as the shape is done, so that a caller's
    list keeps the finished shapes when the sweep is interrupted.
    """
    records = [] if records is None else records
    for shape in shapes:
        records.extend(bench_shape(shape, impls, repeats, warmup, rounds, settle))
    return records


def bench_shape(shape: BenchShape, impls, repeats=DEFAULT_REPEATS, warmup=DEFAULT_WARMUP,
                rounds=DEFAULT_ROUNDS, settle=DEFAULT_SETTLE) -> list[dict]:
    """Records for one shape, each implementation on the same inputs. Failures become cells.

    With rounds > 1 the implementations are timed that many times, their order turning by one each
    round (none always first, none always after the same one: the GPU's clocks drift with its
    load), and each keeps its median round (median_round); one that fails is not run again.
    """
    impls = list(impls)
    try:
        inputs = make_inputs(shape)
    except Exception as exc:  # e.g. inputs alone do not fit: every cell says so
        records = [_failed_record(shape, impl, exc, "inputs: ") for impl in impls]
    else:
        by_impl = {impl: [] for impl in impls}
        for turn in range(rounds if impls else 0):
            for impl in impls[turn % len(impls):] + impls[:turn % len(impls)]:
                if all(r["status"] == "ok" for r in by_impl[impl]):
                    by_impl[impl].append(_bench_impl(impl, shape, inputs, repeats, warmup, settle))
        records = [median_round(by_impl[impl]) for impl in impls]
        del inputs
    _release_cupy_memory()
    fill_ratios(records)
    return records


def median_round(rounds: list[dict]) -> dict:
    """One implementation's record from its rounds: a failed round's record if one failed, else the
    round of the median time (the lower of the two middle ones), with the first round's first-call
    time (the later rounds' first calls find the kernels loaded)."""
    failed = [r for r in rounds if r["status"] != "ok"]
    if failed:
        return failed[0]
    chosen = sorted(rounds, key=lambda r: r["ms"])[(len(rounds) - 1) // 2]
    return {**chosen, "first_call_ms": rounds[0]["first_call_ms"]}


def fill_ratios(records: list[dict]) -> None:
    """Set each record's ratio: flashcupy TFLOP/s over its TFLOP/s, for records of one shape."""
    base = next((r["tflops"] for r in records if r["impl"] == "flashcupy"), None)
    for r in records:
        if r["impl"] != "flashcupy" and base and r["tflops"]:
            r["ratio"] = base / r["tflops"]


def new_record(shape: BenchShape, impl: str) -> dict:
    return {**asdict(shape), "impl": impl, "family": flashcupy_families(shape) if impl == "flashcupy" else None,
            "status": "ok", "ms": None, "tflops": None, "ratio": None, "first_call_ms": None,
            "peak_extra_bytes": None, "note": None}


def flashcupy_families(shape: BenchShape) -> str | None:
    """"fwd family / bwd family" that flashcupy dispatches this shape to on the current GPU
    (FLASHCUPY_BACKEND included)."""
    from .api import family_for
    from .device import device_info
    from .problem import AttentionOptions, Problem

    options = AttentionOptions(causal=shape.causal,
                               window_size=(-1, -1) if shape.window is None else (shape.window, 0))
    problem = Problem.sketch(shape.head_dim, DTYPES[shape.dtype], options, shape.seqlen, shape.nheads,
                             shape.nheads_k, shape.batch)
    try:
        info = device_info()
        return " / ".join(family_for(direction, problem, info).name for direction in ("fwd", "bwd"))
    except Exception:  # no GPU (tests of the table) or no family: the record still stands
        return None


def make_inputs(shape: BenchShape, seed: int = 0):
    """(q, k, v, dout) CuPy arrays drawn from a normal distribution; dout is None for fwd."""
    import cupy

    rng = cupy.random.default_rng(seed)
    dtype = numpy_dtype(shape.dtype)
    heads = [shape.nheads, shape.nheads_k, shape.nheads_k] + ([shape.nheads] if shape.mode != "fwd" else [])
    # Every input first, then the float32 draws one after another: the draws then share memory
    # segments with nothing that stays, so the pool can hand them all back before a measurement
    # (a call's output placed in a half-used segment would not show as growth).
    arrays = [cupy.empty((shape.batch, shape.seqlen, h, shape.head_dim), dtype=dtype) for h in heads]
    for a in arrays:
        a[...] = rng.standard_normal(a.shape, dtype=cupy.float32)
    q, k, v = arrays[:3]
    return q, k, v, (arrays[3] if len(arrays) > 3 else None)


def numpy_dtype(name: str) -> np.dtype:
    """'bf16' / 'fp16' (or the long names) -> NumPy dtype."""
    name = DTYPES.get(name, name)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@contextlib.contextmanager
def outcome_of(record: dict):
    """Runs one record's measurement: NotApplicable marks the record n/a, any other exception OOM
    or err (mark_failed), with torch's first warning as a hint (it explains "no available kernel")."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        except NotApplicable as exc:
            record.update(status="n/a", note=str(exc))
        except Exception as exc:
            mark_failed(record, exc, suffix=f" ({_one_line(str(caught[0].message))})" if caught else "")


def _bench_impl(impl, shape, inputs, repeats, warmup, settle=DEFAULT_SETTLE) -> dict:
    record = new_record(shape, impl)
    runtime = None
    with outcome_of(record):
        runtime = _runtime_for(impl)
        first_ms, ms, peak = _measure(impl, shape, inputs, runtime, repeats, warmup, settle)
        record.update(ms=ms, tflops=_flops(shape) / (ms * 1e-3) / 1e12, first_call_ms=first_ms,
                      peak_extra_bytes=peak)
    if runtime is not None:  # the step and its buffers are gone by now: hand memory back
        runtime.release()
    return record


def _measure(impl, shape, inputs, runtime, repeats, warmup, settle=DEFAULT_SETTLE):
    """(first call ms, median ms, peak extra bytes); the step's closures die with this frame."""
    step = _make_step(impl, shape, inputs)
    first_ms, ms = time_step(step, runtime, repeats, warmup, settle)
    return first_ms, ms, runtime.peak_extra_bytes(step)


def _failed_record(shape, impl, exc, prefix="", suffix="") -> dict:
    return mark_failed(new_record(shape, impl), exc, prefix, suffix)


def mark_failed(record: dict, exc: BaseException, prefix="", suffix="") -> dict:
    """`record` as OOM, or as err with the exception in its note."""
    if _is_oom(exc):
        record.update(status="OOM")
    else:
        record.update(status="err", note=prefix + f"{type(exc).__name__}: {_one_line(str(exc))}" + suffix)
    return record


def _flops(shape: BenchShape) -> float:
    from .reference import attention_flops

    flops = attention_flops(shape.batch, shape.seqlen, shape.seqlen, shape.nheads, shape.head_dim,
                            shape.causal, mode=shape.mode)
    if shape.window is not None:  # the band's pairs: query i sees min(i, window) + 1 keys
        rows = np.arange(shape.seqlen, dtype=np.int64)
        pairs = int(np.minimum(rows, shape.window).sum()) + shape.seqlen
        flops *= pairs / (shape.seqlen * shape.seqlen / 2)
    return flops


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _is_oom(exc: BaseException) -> bool:
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(exc, cupy.cuda.memory.OutOfMemoryError):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    # cuBLAS / runtime allocation failures surface as their own error types
    text = str(exc)
    return "out of memory" in text.lower() or "ALLOC_FAILED" in text


def _release_cupy_memory() -> None:
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            cupy.cuda.get_current_stream().synchronize()
            cupy.get_default_memory_pool().free_all_blocks()
        except Exception:  # a broken context: nothing left to release
            pass


# ----------------------------------------------------------------------------------------------
# Timing: one interface over CuPy and torch events
# ----------------------------------------------------------------------------------------------


def run_untimed(step, synchronize, warmup=DEFAULT_WARMUP, settle=DEFAULT_SETTLE) -> None:
    """Untimed calls, at least `warmup` of them and `settle` seconds of them: after the idle of a compile
    the GPU's clocks take a while to come back (short points read up to 2x slow), and under a power
    cap they settle only after 1-2 s of load, at a level that depends on the kernel's energy per
    FLOP (docs/PERF_NOTES.md): a short settle times the boost, and what ran before."""
    deadline, calls = time.perf_counter() + settle, 0
    while calls < warmup or time.perf_counter() < deadline:
        step()
        calls += 1
        if calls % 8 == 0:
            synchronize()  # the host waits for the GPU, so the wall clock reads its time
    synchronize()


def time_step(step, runtime, repeats=DEFAULT_REPEATS, warmup=DEFAULT_WARMUP,
              settle=DEFAULT_SETTLE) -> tuple[float, float]:
    """(first call ms by wall clock, median ms of `repeats` event-timed calls).

    The first call (compile, plan selection) is timed alone, then untimed calls (at least `warmup`,
    for at least `settle` seconds); the timed calls are queued back to back, each between two events,
    with one synchronize at the end, so host launch overhead is hidden unless it exceeds the GPU time.
    """
    runtime.synchronize()
    t0 = time.perf_counter()
    step()
    runtime.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    run_untimed(step, runtime.synchronize, warmup, settle)
    events = [(runtime.event(), runtime.event()) for _ in range(repeats)]
    for start, end in events:
        start.record()
        step()
        end.record()
    runtime.synchronize()
    return first_ms, statistics.median(runtime.elapsed_ms(s, e) for s, e in events)


class _CupyRuntime:
    def __init__(self):
        import cupy

        self.cupy = cupy

    def event(self):
        return self.cupy.cuda.Event()

    def elapsed_ms(self, start, end) -> float:
        return self.cupy.cuda.get_elapsed_time(start, end)

    def synchronize(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()

    def peak_extra_bytes(self, step) -> int:
        pool = self.cupy.get_default_memory_pool()
        self.synchronize()
        pool.free_all_blocks()  # the pool now holds only live arrays: its growth is the call's need
        before = pool.total_bytes()
        step()
        self.synchronize()
        return pool.total_bytes() - before

    def release(self) -> None:
        _release_cupy_memory()


class _TorchRuntime:
    def __init__(self):
        import torch

        self.torch = torch

    def event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end)

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def peak_extra_bytes(self, step) -> int:
        cuda = self.torch.cuda
        cuda.synchronize()
        cuda.reset_peak_memory_stats()
        before = cuda.memory_allocated()
        step()
        cuda.synchronize()
        return cuda.max_memory_allocated() - before

    def release(self) -> None:
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()  # so the next CuPy case can have the memory


def _runtime_for(impl: str):
    if impl in ("flashcupy", "naive"):
        return _CupyRuntime()
    if impl in TORCH_PEERS:
        reason = torch_unavailable_reason()
        if reason:
            raise NotApplicable(reason)
        return _TorchRuntime()
    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")


# ----------------------------------------------------------------------------------------------
# The implementations: each returns a step, a callable that enqueues one timed unit of work
# ----------------------------------------------------------------------------------------------


def _make_step(impl, shape, inputs):
    if impl == "flashcupy":
        return _flashcupy_step(shape, inputs)
    if impl == "naive":
        return _naive_step(shape, inputs)
    if impl == "fa4":
        return _fa4_step(shape, inputs)
    return _sdpa_step(impl, shape, inputs)


def _flashcupy_step(shape, inputs):
    import flashcupy

    q, k, v, dout = inputs
    mask = dict(causal=shape.causal, window_size=(-1, -1) if shape.window is None else (shape.window, 0))
    if shape.mode == "fwd":
        return lambda: flashcupy.flash_attn_func(q, k, v, **mask)
    if shape.mode == "bwd":
        # the forward runs once, here, untimed: each step is the backward alone
        out, lse = flashcupy.flash_attn_func(q, k, v, return_lse=True, **mask)
        return lambda: flashcupy.flash_attn_backward(dout, q, k, v, out, lse, **mask)

    def forward_backward():
        out, lse = flashcupy.flash_attn_func(q, k, v, return_lse=True, **mask)
        return flashcupy.flash_attn_backward(dout, q, k, v, out, lse, **mask)

    return forward_backward


def _naive_step(shape, inputs):
    if shape.variant != "plain":
        raise NotApplicable("naive runs plain multi-head attention only")
    if shape.mode != "fwd":
        raise NotApplicable("naive has no backward")
    q, k, v, _ = inputs
    return lambda: naive_attention(q, k, v, causal=shape.causal)


def naive_attention(q, k, v, causal=False, softmax_scale=None):
    """Attention in plain CuPy with the whole (seqlen_q, seqlen_k) score matrix: the quadratic-memory peer.

    Scores come from batched cupy.matmul over (batch, head) on transposed views; softmax runs in
    float32, in place. float16 runs its GEMMs in float16 (P cast back for P @ V); bfloat16 runs
    them in float32, since CuPy 14's batched matmul has no bfloat16 path. Rows that see no key
    give NaN.
    """
    import cupy

    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    dtype = q.dtype
    gemm_dtype = dtype if dtype == np.float16 else np.dtype(np.float32)
    q, k, v = (x.astype(gemm_dtype, copy=False) for x in (q, k, v))
    scores = cupy.matmul(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1)).astype(cupy.float32, copy=False)
    scores *= scale
    if causal:  # bottom-right aligned, as flash_attn_func: query i sees keys j <= i + sk - sq
        sq, sk = scores.shape[-2:]
        hidden = cupy.triu(cupy.ones((sq, sk), dtype=bool), k=sk - sq + 1)
        scores += cupy.where(hidden, np.float32(-np.inf), np.float32(0))
    scores -= scores.max(axis=-1, keepdims=True)
    cupy.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = cupy.matmul(scores.astype(gemm_dtype, copy=False), v.transpose(0, 2, 1, 3))  # (b, h, sq, d)
    return out.transpose(0, 2, 1, 3).astype(dtype, order="C")


def sdpa_backend(impl: str):
    """The SDPBackend an SDPA peer forces (impl: a key of _SDPA_BACKENDS); NotApplicable where this
    torch lacks it."""
    import torch
    from torch.nn.attention import SDPBackend

    backend = getattr(SDPBackend, _SDPA_BACKENDS[impl], None)
    if backend is None:
        raise NotApplicable(f"torch {torch.__version__} has no SDPBackend.{_SDPA_BACKENDS[impl]}")
    return backend


def _sdpa_step(impl, shape, inputs):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    backend = sdpa_backend(impl)
    if shape.window is not None:
        raise NotApplicable("SDPA has no sliding window (only a dense attn_mask, which the flash backend rejects)")
    q, k, v, dout = (None if a is None else torch.from_dlpack(a) for a in inputs)
    causal = shape.causal
    gqa = {"enable_gqa": True} if shape.nheads_k != shape.nheads else {}

    def attend(q, k, v):
        # (b, s, h, d) -> (b, h, s, d) views: SDPA takes the strides as they are, no copy; the
        # output goes back to (b, s, h, d) as a view too
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal, **gqa).transpose(1, 2)

    return _torch_step(shape.mode, attend, q, k, v, dout)


def _torch_step(mode, attend, q, k, v, dout):
    """The step of a torch peer whose attend(q, k, v) returns the output (b, s, h, d): the forward
    under no_grad, or the backward through torch.autograd.grad (fresh gradients, as
    flash_attn_backward returns; .backward() would add into .grad and time three extra elementwise
    kernels per step), from a stored forward (bwd) or with it (fwdbwd)."""
    import torch

    if mode == "fwd":
        def forward():
            with torch.no_grad():
                return attend(q, k, v)
        return forward
    leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
    if mode == "bwd":
        out = attend(*leaves)
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    return lambda: torch.autograd.grad(attend(*leaves), leaves, dout)


def _fa4_step(shape, inputs):
    """FlashAttention-4 (flash_attn.cute, CuTe DSL; its Hopper kernels on sm90) on the same arrays,
    through DLPack."""
    try:
        from flash_attn.cute import flash_attn_func as fa4_func
    except Exception as exc:
        raise NotApplicable(f"flash_attn.cute is not importable ({type(exc).__name__}: "
                            f"{_one_line(str(exc), 80)})") from None
    import torch

    q, k, v, dout = (None if a is None else torch.from_dlpack(a) for a in inputs)
    options = {"causal": shape.causal}
    if shape.window is not None:
        options["window_size"] = (shape.window, 0)

    def attend(q, k, v):
        out = fa4_func(q, k, v, **options)
        return out[0] if isinstance(out, tuple) else out

    return _torch_step(shape.mode, attend, q, k, v, dout)


def torch_unavailable_reason() -> str | None:
    """None when torch with CUDA can run the SDPA peers, else a short reason."""
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install
        return f"torch is not importable: {type(exc).__name__}: {_one_line(str(exc), 100)}"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


# ----------------------------------------------------------------------------------------------
# Metadata and the JSON document
# ----------------------------------------------------------------------------------------------


def cuda_version_string(version: int) -> str:
    """12090 -> '12.9', as CUDA encodes versions (1000 * major + 10 * minor)."""
    return f"{version // 1000}.{version % 1000 // 10}"


def software_versions() -> dict:
    """CUDA driver and runtime, CuPy and NVRTC versions (needs CuPy; the driver part needs a driver)."""
    import cupy

    versions = {"cupy": cupy.__version__, "cuda_driver": None, "cuda_runtime": None, "nvrtc": None}
    for key, read in (("cuda_driver", cupy.cuda.runtime.driverGetVersion),
                      ("cuda_runtime", cupy.cuda.runtime.runtimeGetVersion)):
        try:
            versions[key] = cuda_version_string(read())
        except Exception:
            pass
    try:
        from cupy_backends.cuda.libs import nvrtc

        versions["nvrtc"] = "{}.{}".format(*nvrtc.getVersion())
    except Exception:
        pass
    return versions


def git_commit() -> str | None:
    """HEAD of the checkout holding this package, with '-dirty' for local changes; None outside git."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def collect_metadata() -> dict:
    """Where and with what the numbers were taken. Needs a GPU."""
    from . import __version__
    from .device import device_info

    info = device_info()
    torch = sys.modules.get("torch")  # reported when the peers imported it
    return {
        "device": info.name,
        "device_id": info.id,
        "compute_capability": f"{info.capability // 10}.{info.capability % 10}",
        "sm_count": info.sm_count,
        "total_memory_bytes": info.total_memory,
        **{f"{k}_version": v for k, v in software_versions().items()},
        "torch_version": getattr(torch, "__version__", None),
        "flashcupy_version": __version__,
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def results_document(records: list[dict], metadata: dict, config: dict, fields: dict = FIELDS) -> dict:
    """The JSON document `flashcupy bench --json` writes (`fields`: what each record's keys hold;
    the decode sweep's are bench_decode.FIELDS)."""
    return {"schema": SCHEMA, "metadata": metadata, "config": config, "fields": fields, "results": records}


def write_json(document: dict, path) -> None:
    Path(path).write_text(json.dumps(document, indent=1) + "\n")


def load_json(path) -> dict:
    document = json.loads(Path(path).read_text())
    if not str(document.get("schema", "")).startswith("flashcupy-bench/"):
        raise ValueError(f"{path} is not a flashcupy bench result (no 'schema': '{SCHEMA}')")
    return document


# ----------------------------------------------------------------------------------------------
# Text table and plot
# ----------------------------------------------------------------------------------------------


def format_bytes(n) -> str:
    if n is None:
        return ""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _describe(r: dict) -> str:
    """BenchShape.describe() of a record (records of older JSON files have no nheads_k or window)."""
    return BenchShape(1, 1, r["nheads"], r["head_dim"], r["causal"], r["dtype"], r["mode"], r.get("nheads_k") or 0,
                      r.get("window")).describe()


def _section_key(r: dict) -> tuple:
    return r["mode"], r["dtype"], r["head_dim"], r["nheads"], _describe(r)


def format_table(records: list[dict]) -> str:
    """One block per (mode, dtype, head dim, mask and heads); a row per seqlen and implementation.

    Cells of cases that did not run show their status; err and n/a notes follow as footnotes, one
    per distinct (implementation, note).
    """
    sections: dict[tuple, list[dict]] = {}
    for r in records:
        sections.setdefault(_section_key(r), []).append(r)
    header = (f"{'seqlen':>7} {'batch':>5}  {'impl':<18} {'ms':>9} {'TFLOP/s':>8} {'fc/peer':>8} "
              f"{'1st call ms':>11} {'extra mem':>10}")
    lines, notes = [], {}  # footnote text -> number
    for (mode, dtype, head_dim, nheads, described), rows in sections.items():
        if lines:
            lines.append("")
        lines.append(f"{mode} {dtype}  head dim {head_dim} ({nheads} heads)  {described}")
        lines.append(header)
        last_seqlen = None
        for r in rows:
            lead = (f"{format_seqlen(r['seqlen']):>7} {r['batch']:>5}" if r["seqlen"] != last_seqlen
                    else " " * 13)
            last_seqlen = r["seqlen"]
            if r["status"] != "ok":
                cell = r["status"]
                if r.get("note"):
                    number = notes.setdefault(f"{r['impl']}: {r['note']}", len(notes) + 1)
                    cell += f"[{number}]"
                lines.append(f"{lead}  {r['impl']:<18} {cell:>9}")
                continue
            ratio = f"{r['ratio']:.2f}x" if r.get("ratio") else ""
            first = f"{r['first_call_ms']:.1f}" if r.get("first_call_ms") is not None else ""
            impl = f"{r['impl']} ({r['family']})" if r.get("family") else r["impl"]
            lines.append(f"{lead}  {impl:<18} {r['ms']:>9.3f} {r['tflops']:>8.1f} {ratio:>8} "
                         f"{first:>11} {format_bytes(r.get('peak_extra_bytes')):>10}")
    if lines:
        lines += ["", "fc/peer: flashcupy TFLOP/s over the peer's; 1st call ms: wall time of the first call "
                      "(compile or cache load); extra mem: device memory beyond the inputs, outputs included"]
    lines += [f"[{number}] {text}" for text, number in notes.items()]
    return "\n".join(lines)


def require_matplotlib():
    """Raise MissingDependencyError, with the install command, when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        from .device import install_hint

        raise MissingDependencyError("plotting needs matplotlib: pip install matplotlib "
                                     f"(or {install_hint('plot')})") from exc


def plot_results(results, path) -> None:
    """TFLOP/s against seqlen, a line per implementation, one panel per (mode, dtype) row and
    (head dim, causal) column, as in the FA2 paper's figures. `results`: the records or the JSON
    document. Works on the CPU (Agg canvas, no pyplot state)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    metadata = results.get("metadata", {}) if isinstance(results, dict) else {}
    records = results["results"] if isinstance(results, dict) else results
    rows = list(dict.fromkeys((r["mode"], r["dtype"]) for r in records))
    cols = list(dict.fromkeys((r["head_dim"], _describe(r)) for r in records))
    impls = [i for i in IMPLS if any(r["impl"] == i for r in records)]
    impls += sorted({r["impl"] for r in records} - set(impls))
    colors = {impl: f"C{n}" for n, impl in enumerate(impls)}

    fig = Figure(figsize=(4.5 * max(len(cols), 1), 3.6 * max(len(rows), 1)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(len(rows), 1), max(len(cols), 1), squeeze=False)
    for i, (mode, dtype) in enumerate(rows):
        for j, (head_dim, described) in enumerate(cols):
            ax = axes[i][j]
            panel = [r for r in records if (r["mode"], r["dtype"], r["head_dim"], _describe(r))
                     == (mode, dtype, head_dim, described)]
            seqlens = sorted({r["seqlen"] for r in panel})
            for impl in impls:
                points = sorted((r["seqlen"], r["tflops"]) for r in panel
                                if r["impl"] == impl and r["status"] == "ok" and r["tflops"])
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, marker="o", color=colors[impl], label=impl)
            if not panel:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [format_seqlen(s) for s in seqlens])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.set_title(f"{mode} {dtype}, head dim {head_dim}, {described}", fontsize=10)
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
    handles = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=len(handles))
    if metadata.get("device"):
        fig.suptitle(f"flashcupy bench on {metadata['device']} (sm {metadata.get('compute_capability', '?')})")
    fig.savefig(path, dpi=120)
