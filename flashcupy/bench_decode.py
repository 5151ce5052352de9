"""The decode sweep behind `flashcupy bench --decode`: one query token per sequence over a KV cache,
timed by GPU time alone, warm and with L2 flushed, against the memory system's own limits.

Importable without a GPU: CuPy and torch are imported inside the functions that use them.

One record per (heads, batch, kv length, implementation and layout); `FIELDS` says what each key
holds. flashcupy runs flash_attn_with_kvcache over the cache (no new keys: the peers have no
append) contiguous and paged; the paged cache is the contiguous one's memory seen as pages in a
shuffled order, so both read the same bytes. The peers, PyTorch SDPA with the flash or cuDNN
backend forced (enable_gqa), read the contiguous cache through DLPack.

The clock: before each timed call a spin kernel keeps the GPU busy for SPIN_US while the host
queues the call between two events, so the events measure the GPU's time and not the host's (the
host's time per call is measured on its own). "warm" calls follow each other, the cache left in L2
where it fits; "flushed" calls follow a read of FLUSH_BYTES of other memory, which leaves nothing
of the cache in L2, as in a model where the layers between two steps read far more than L2 holds.
"graph" times the call as a decode loop replays it: a few calls captured into one CUDA graph and
replayed back to back (no spin between them, the cache warm where it fits), GPU time per call.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from . import bench, sm80

IMPLS = ("flashcupy", "sdpa_flash", "sdpa_cudnn")
PEERS = IMPLS[1:]
LAYOUTS = ("contiguous", "paged")
DEFAULT_BATCHES = (1, 8, 32, 128)
DEFAULT_KV_LENS = (1024, 8192, 32768, 131072)
DEFAULT_HEADS = ((32, 8), (32, 32))  # (query heads, kv heads): GQA 4, MHA
DEFAULT_HEAD_DIM = 128
DEFAULT_PAGE_SIZE = 256
DEFAULT_REPEATS = bench.DEFAULT_REPEATS
HOST_CALLS = 10  # calls behind one long spin for the host time per call, HOST_ROUNDS times
HOST_ROUNDS = 5
SPIN_US = 1000.0  # longer than the host needs to queue a call and its events
FLUSH_BYTES = 512 << 20  # several times any L2 (H100 50 MB, H200 60 MB, B200 126 MB)
BANDWIDTH_BYTES = 2 << 30  # the same-run copy and read bandwidth: buffers far larger than L2
# Each row is timed warm then flushed, twice, and the lower median of each kind kept: the first
# pass after a long case (32 x 128k keys, a few seconds of full-bandwidth reads) read up to 13%
# slow on an H200, the second as the same call does alone.
TIMING_PASSES = 2
# The graph holds calls enough for about GRAPH_WORK_US of warm GPU time, GRAPH_MAX_STEPS at most:
# long enough that a replay's own launch is a small part of it.
GRAPH_WORK_US = 200.0
GRAPH_MAX_STEPS = 20
MEMORY_MARGIN = 1 << 30  # free memory left beside a case's cache (outputs, partials, peers' workspace)

FIELDS = {
    "batch": "sequences, one query token each",
    "kv_len": "keys per sequence: the cache is full",
    "nheads": "query heads",
    "nheads_k": "kv heads",
    "head_dim": "head dimension",
    "dtype": "bf16 or fp16",
    "impl": "flashcupy (flash_attn_with_kvcache), sdpa_flash or sdpa_cudnn (PyTorch SDPA, that backend forced)",
    "layout": "contiguous, or paged (block_table over pages of page_size rows, in a shuffled order)",
    "page_size": "rows per page when paged, else null",
    "status": "ok, OOM, skip (does not fit in free memory, see note), err or n/a (see note)",
    "warm_us": f"median GPU time of `repeats` calls, each after a spin (see the module), K/V left in L2 where it "
               f"fits; the lower of {TIMING_PASSES} passes",
    "flushed_us": f"the same, each call after a read of {FLUSH_BYTES >> 20} MiB of other memory (nothing of "
                  "the cache in L2)",
    "graph_us": "GPU time per call of graph_steps calls captured into one CUDA graph and replayed back to back "
                "(median of `repeats` replays, each after a spin), K/V left in L2 where it fits; null with a note "
                "if the capture failed",
    "graph_steps": "calls per graph: enough for about GRAPH_WORK_US of warm GPU time, at most GRAPH_MAX_STEPS",
    "host_us": f"host time per call: the median over {HOST_ROUNDS} rounds of {HOST_CALLS} calls queued behind a long "
               "spin, wall clock over the count",
    "kv_bytes": "bytes of K and V read: batch x kv_len x nheads_k x head_dim x 2 (K, V) x 2 bytes",
    "flushed_tbs": "kv_bytes / flushed_us, TB/s (1e12 bytes/s)",
    "peak_fraction": "flushed_tbs over the HBM peak of the document's metadata",
    "splits": "flashcupy: the split count num_splits=0 chose (kvcache.plan_launch); null for peers",
    "speedup": "flashcupy: the faster peer's flushed_us over this row's (> 1: flashcupy is faster); "
               "peers: null",
    "warm_speedup": "the same over warm_us",
    "graph_speedup": "the same over graph_us",
    "note": "why a case is skip, err or n/a, one line",
}


@dataclass(frozen=True)
class DecodeCase:
    """One point of the sweep: q (batch, 1, nheads, head_dim) over a full cache (batch, kv_len,
    nheads_k, head_dim)."""

    batch: int
    kv_len: int
    nheads: int
    nheads_k: int
    head_dim: int = DEFAULT_HEAD_DIM
    dtype: str = "bf16"  # key of bench.DTYPES

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.kv_len * self.nheads_k * self.head_dim * 2

    def __str__(self) -> str:
        return (f"decode {self.dtype} d={self.head_dim} {self.nheads}/{self.nheads_k} heads batch={self.batch} "
                f"kv={bench.format_seqlen(self.kv_len)}")


def sweep_cases(batches=DEFAULT_BATCHES, kv_lens=DEFAULT_KV_LENS, heads=DEFAULT_HEADS, dtypes=("bf16",),
                head_dims=(DEFAULT_HEAD_DIM,)) -> list[DecodeCase]:
    """Every (dtype, head dim, heads, batch, kv length), in that nesting."""
    for nheads, nheads_k in heads:
        if nheads_k < 1 or nheads % nheads_k:
            raise ValueError(f"{nheads} query heads are not a multiple of {nheads_k} kv heads")
    for dt in dtypes:
        if dt not in bench.DTYPES:
            raise ValueError(f"dtype {dt!r} is not one of {', '.join(bench.DTYPES)}")
    return [DecodeCase(b, n, h, hk, d, dt) for dt in dtypes for d in head_dims for h, hk in heads for b in batches
            for n in kv_lens]


def parse_heads(text: str) -> tuple:
    """'32/8' -> (32, 8); '32' -> (32, 32)."""
    parts = str(text).strip().split("/")
    if len(parts) > 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{text!r} is not a head count (use query/kv heads, e.g. 32/8, or 32 for as many kv heads)")
    nheads, nheads_k = int(parts[0]), int(parts[-1])
    if nheads % nheads_k:
        raise ValueError(f"{nheads} query heads are not a multiple of {nheads_k} kv heads")
    return nheads, nheads_k


# ----------------------------------------------------------------------------------------------
# The clock
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimingKernel:
    """cuda_src/timing.cu's kernels, built as any variant (build.get_kernel)."""
    name: str  # spin_kernel or read_kernel

    source = "timing.cu"
    nvrtc_options = sm80.NVRTC_OPTIONS
    smem_bytes = 0
    layout_check = ""

    @property
    def name_expression(self) -> str:
        return self.name

    def __str__(self) -> str:
        return self.name


class Clock:
    """GPU time of calls on the clock's own stream: the spin, the flush and the events. Every call
    timed must run on it: enter `with clock.stream:` before making its inputs and its step (torch's
    steps take the stream as it is current then)."""

    def __init__(self, flush_bytes: int = FLUSH_BYTES):
        import cupy

        from . import build
        from .device import device_info

        self.cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._spin = build.get_kernel(TimingKernel("spin_kernel"))
        self._read = build.get_kernel(TimingKernel("read_kernel"))
        self._flush_buffer = cupy.empty(flush_bytes // 16 * 16, cupy.uint8)
        self._sink = cupy.zeros(16, cupy.uint8)
        self._sms = device_info().sm_count

    def spin(self, us: float) -> None:
        self._spin((1,), (1,), (np.uint64(int(us * 1e3)),))

    def read(self, buffer) -> None:
        """Every byte of `buffer` (a multiple of 16 bytes) read once."""
        self._read((4 * self._sms,), (512,), (buffer, np.int64(buffer.nbytes // 16), self._sink))

    def flush(self) -> None:
        self.read(self._flush_buffer)

    def warm_up(self, step, warmup: int = bench.DEFAULT_WARMUP) -> None:
        """The first call (compile, plan, first touch) alone, then bench.run_untimed's calls."""
        with self.stream:
            step()
            self.stream.synchronize()
            bench.run_untimed(step, self.stream.synchronize, warmup)

    def time_us(self, step, repeats: int, flush: bool) -> float:
        """Median GPU time of `step` over `repeats` calls, each behind a spin (and a flush)."""
        cupy = self.cupy
        events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)]
        with self.stream:
            for start, end in events:
                self.spin(SPIN_US)
                if flush:
                    self.flush()
                start.record()
                step()
                end.record()
        events[-1][1].synchronize()
        return statistics.median(cupy.cuda.get_elapsed_time(s, e) for s, e in events) * 1e3

    def graph_us(self, capture, steps: int, repeats: int) -> float:
        """Median GPU time per call of `steps` calls in one CUDA graph, each replay behind a spin;
        capture(steps) records them on the clock's stream and returns what replays them there."""
        with self.stream:
            replay = capture(steps)
        return self.time_us(replay, repeats, flush=False) / steps

    def host_us(self, step, calls: int = HOST_CALLS, rounds: int = HOST_ROUNDS) -> float:
        """Wall time per call of `calls` calls queued behind a spin long enough to hold them all,
        the median of `rounds` rounds (a round can catch the interpreter's garbage collection)."""
        per_call = []
        for _ in range(rounds):
            with self.stream:
                self.spin(calls * 2000.0)
                t0 = time.perf_counter()
                for _ in range(calls):
                    step()
                per_call.append((time.perf_counter() - t0) / calls * 1e6)
            self.stream.synchronize()
        return statistics.median(per_call)

    def bandwidth_tbs(self, nbytes: int = BANDWIDTH_BYTES, repeats: int = 5) -> dict:
        """Copy (device to device, read + write bytes) and read TB/s over buffers of `nbytes`."""
        cupy = self.cupy
        with self.stream:
            src = cupy.empty(nbytes // 16 * 16, cupy.uint8)
            src.fill(1)
            dst = cupy.empty_like(src)
        copy = self.time_us(lambda: cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes,
                                                                  cupy.cuda.runtime.memcpyDeviceToDevice,
                                                                  self.stream.ptr),
                            repeats, flush=False)
        read = self.time_us(lambda: self.read(src), repeats, flush=False)
        return {"copy_tbs": 2 * src.nbytes / copy / 1e6, "read_tbs": src.nbytes / read / 1e6}


def hbm_peak_tbs(device_id: int | None = None) -> float | None:
    """The HBM peak from the device's attributes: memory clock (kHz) x bus width x 2 (double data
    rate), TB/s; None where the driver does not report them."""
    import cupy

    try:
        attributes = cupy.cuda.Device(device_id).attributes
        clock_khz, bus_bits = attributes["MemoryClockRate"], attributes["GlobalMemoryBusWidth"]
    except Exception:
        return None
    if not clock_khz or not bus_bits:
        return None
    return clock_khz * 1e3 * 2 * bus_bits / 8 / 1e12


# ----------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------


def new_record(case: DecodeCase, impl: str, layout: str = "contiguous", page_size: int | None = None) -> dict:
    return {"batch": case.batch, "kv_len": case.kv_len, "nheads": case.nheads, "nheads_k": case.nheads_k,
            "head_dim": case.head_dim, "dtype": case.dtype, "impl": impl, "layout": layout,
            "page_size": page_size, "status": "ok", "warm_us": None, "flushed_us": None, "graph_us": None,
            "graph_steps": None, "host_us": None, "kv_bytes": case.kv_bytes, "flushed_tbs": None,
            "peak_fraction": None, "splits": None, "speedup": None, "warm_speedup": None, "graph_speedup": None,
            "note": None}


def run_sweep(cases, impls=IMPLS, layouts=LAYOUTS, page_size=DEFAULT_PAGE_SIZE, repeats=DEFAULT_REPEATS,
              peak_tbs: float | None = None, clock: Clock | None = None,
              warmup: int = bench.DEFAULT_WARMUP, records: list | None = None) -> list[dict]:
    """Records of every case (any iterable: the CLI passes a progress bar), each case's cache made
    once for all its implementations and layouts and freed after. Each case's records join
    `records` (a new list if None) when it is done, with their derived figures also when the sweep
    is interrupted."""
    clock = clock or Clock()
    records = [] if records is None else records
    try:
        for case in cases:
            with clock.stream:
                records.extend(bench_case(case, impls, layouts, page_size, repeats, clock, warmup))
    finally:
        fill_derived(records, peak_tbs)
    return records


def _rows(case: DecodeCase, impls, layouts, page_size) -> list[tuple]:
    """(impl, layout, page size) of one case: flashcupy in each layout, peers contiguous."""
    rows = []
    for impl in impls:
        if impl == "flashcupy":
            rows += [(impl, layout, page_size if layout == "paged" else None) for layout in layouts]
        else:
            rows.append((impl, "contiguous", None))
    return rows


def bench_case(case: DecodeCase, impls, layouts, page_size, repeats, clock,
               warmup=bench.DEFAULT_WARMUP) -> list[dict]:
    rows = _rows(case, impls, layouts, page_size)
    need = case.kv_bytes + MEMORY_MARGIN
    free = _free_bytes()
    if need > free:
        note = f"the cache needs {bench.format_bytes(need)} with its margin; {bench.format_bytes(free)} free"
        return [{**new_record(case, *row), "status": "skip", "note": note} for row in rows]
    try:
        inputs = make_inputs(case)
    except Exception as exc:
        return [bench.mark_failed(new_record(case, *row), exc, "inputs: ") for row in rows]
    records = [_bench_row(case, row, inputs, repeats, clock, warmup) for row in rows]
    del inputs
    bench._release_cupy_memory()
    return records


def _free_bytes() -> int:
    import cupy

    bench._release_cupy_memory()  # the pool's free blocks back to the device first
    free, _ = cupy.cuda.runtime.memGetInfo()
    return free


def make_inputs(case: DecodeCase, seed: int = 0) -> dict:
    """q and a full contiguous K, V cache drawn from a normal distribution (filled a slice at a
    time, so no float32 copy of the whole cache is ever held), and cache_seqlens on the GPU."""
    import cupy

    rng = cupy.random.default_rng(seed)
    dtype = bench.numpy_dtype(case.dtype)
    q = cupy.empty((case.batch, 1, case.nheads, case.head_dim), dtype)
    q[...] = rng.standard_normal(q.shape, dtype=cupy.float32)
    caches = []
    for _ in range(2):
        cache = cupy.empty((case.batch, case.kv_len, case.nheads_k, case.head_dim), dtype)
        rows = max(1, (64 << 20) // (case.nheads_k * case.head_dim * 4))  # 64 MiB of float32 per draw
        for b in range(case.batch):
            for r in range(0, case.kv_len, rows):
                part = cache[b, r:r + rows]
                part[...] = rng.standard_normal(part.shape, dtype=cupy.float32)
        caches.append(cache)
    seqlens = cupy.full(case.batch, case.kv_len, cupy.int32)
    return {"q": q, "k_cache": caches[0], "v_cache": caches[1], "cache_seqlens": seqlens}


def paged_view(inputs: dict, case: DecodeCase, page_size: int, seed: int = 0) -> tuple:
    """(k pages, v pages, block_table): the contiguous cache's memory as (num_blocks, page_size,
    nheads_k, head_dim) pages, sequence b's pages named in a shuffled order."""
    import cupy

    pages_per_seq = case.kv_len // page_size
    num_blocks = case.batch * pages_per_seq
    shape = (num_blocks, page_size, case.nheads_k, case.head_dim)
    order = np.random.default_rng(seed).permutation(num_blocks).astype(np.int32)
    table = cupy.asarray(order.reshape(case.batch, pages_per_seq))
    return inputs["k_cache"].reshape(shape), inputs["v_cache"].reshape(shape), table


def _bench_row(case, row, inputs, repeats, clock, warmup=bench.DEFAULT_WARMUP) -> dict:
    impl, layout, page_size = row
    record = new_record(case, *row)
    with bench.outcome_of(record):
        step, splits, capture = _make_step(impl, layout, page_size, case, inputs)
        clock.warm_up(step, warmup)
        warm, flushed = [], []
        for _ in range(TIMING_PASSES):
            warm.append(clock.time_us(step, repeats, flush=False))
            flushed.append(clock.time_us(step, repeats, flush=True))
        record.update(warm_us=min(warm), flushed_us=min(flushed), host_us=clock.host_us(step), splits=splits)
        steps = graph_steps(record["warm_us"])
        try:
            record.update(graph_us=clock.graph_us(capture, steps, repeats), graph_steps=steps)
        except Exception as exc:  # the row's other times stand
            record["note"] = f"graph: {type(exc).__name__}: {exc}".splitlines()[0][:200]
    return record


def graph_steps(warm_us: float) -> int:
    """Calls per graph for a call of `warm_us`: GRAPH_WORK_US of work, 1 to GRAPH_MAX_STEPS calls."""
    return max(1, min(GRAPH_MAX_STEPS, int(GRAPH_WORK_US // max(warm_us, 1e-3))))


def _make_step(impl, layout, page_size, case, inputs):
    """(step, splits, capture): a callable that queues one call on CuPy's current stream,
    flashcupy's split count, and capture(n): n calls recorded into a CUDA graph on that stream,
    returning what replays them there."""
    if impl == "flashcupy":
        step, splits = _flashcupy_step(layout, page_size, case, inputs)
        return step, splits, _cupy_capture(step)
    if impl in PEERS:
        step, capture = _sdpa_step(impl, case, inputs)
        return step, None, capture
    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")


def _flashcupy_step(layout, page_size, case, inputs):
    from . import kvcache
    from .device import device_info
    from .problem import AttentionOptions

    k_cache, v_cache, table = inputs["k_cache"], inputs["v_cache"], None
    if layout == "paged":
        if case.kv_len % page_size:
            raise bench.NotApplicable(f"kv length {case.kv_len} is not a multiple of the page size {page_size}")
        k_cache, v_cache, table = paged_view(inputs, case, page_size)
    q, seqlens = inputs["q"], inputs["cache_seqlens"]

    def step():
        # the decode loop's call: GPU index arrays, their values known good (no device-to-host copy)
        kvcache.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table,
                                        check_values=False)

    problem = kvcache.cache_problem(q, k_cache, table, AttentionOptions())
    return step, kvcache.plan_launch(problem, 0, device_info(q.device.id)).splits


def _cupy_capture(step):
    """capture(n) for a step of CuPy launches: CuPy's stream capture of the current stream."""
    import cupy

    def capture(n):
        stream = cupy.cuda.get_current_stream()
        stream.begin_capture()
        try:
            for _ in range(n):
                step()
        finally:
            graph = stream.end_capture()
        return lambda: graph.launch(stream)

    return capture


def _sdpa_step(impl, case, inputs):
    """(step, capture): SDPA over the contiguous cache, (b, s, h, d) views as (b, h, s, d), no copy;
    on CuPy's current stream (the clock's), captured by torch's CUDA graphs (whose memory pool the
    outputs then come from)."""
    reason = bench.torch_unavailable_reason()
    if reason:
        raise bench.NotApplicable(reason)
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    backend = bench.sdpa_backend(impl)
    q, k, v = (torch.from_dlpack(inputs[n]).transpose(1, 2) for n in ("q", "k_cache", "v_cache"))
    gqa = {"enable_gqa": True} if case.nheads_k != case.nheads else {}
    stream = torch.cuda.ExternalStream(cupy.cuda.get_current_stream().ptr)

    def step():
        with torch.cuda.stream(stream), sdpa_kernel(backend), torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, **gqa)

    def capture(n):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(n):
                step()

        def replay():
            with torch.cuda.stream(stream):
                graph.replay()

        return replay

    return step, capture


def fill_derived(records: list[dict], peak_tbs: float | None) -> None:
    """Bandwidth, the fraction of the peak, and flashcupy's speedups over the faster peer of its case."""
    for r in records:
        if r["status"] == "ok" and r["flushed_us"]:
            r["flushed_tbs"] = r["kv_bytes"] / r["flushed_us"] / 1e6
            r["peak_fraction"] = r["flushed_tbs"] / peak_tbs if peak_tbs else None
    cases: dict = {}
    for r in records:
        cases.setdefault((r["dtype"], r["head_dim"], r["nheads"], r["nheads_k"], r["batch"], r["kv_len"]), []).append(r)
    for rows in cases.values():
        peers = [r for r in rows if r["impl"] != "flashcupy" and r["status"] == "ok"]
        for r in rows:
            if r["impl"] != "flashcupy" or r["status"] != "ok" or not peers:
                continue
            r["speedup"] = min(p["flushed_us"] for p in peers) / r["flushed_us"]
            r["warm_speedup"] = min(p["warm_us"] for p in peers) / r["warm_us"]
            graphed = [p["graph_us"] for p in peers if p.get("graph_us")]
            if r.get("graph_us") and graphed:
                r["graph_speedup"] = min(graphed) / r["graph_us"]


# ----------------------------------------------------------------------------------------------
# Text table
# ----------------------------------------------------------------------------------------------


def format_table(records: list[dict], limits: dict) -> str:
    """One block per (dtype, head dim, heads); a row per (batch, kv length) and implementation.
    `limits`: the document's hbm_peak_tbs (and its source), copy_tbs, read_tbs."""
    peak = limits.get("hbm_peak_tbs")
    lines = [f"HBM peak {peak:.2f} TB/s ({limits.get('hbm_peak_source')}); this run: copy {limits['copy_tbs']:.2f} "
             f"TB/s (read + write bytes), read {limits['read_tbs']:.2f} TB/s" if peak else
             f"HBM peak unknown; this run: copy {limits['copy_tbs']:.2f} TB/s, read {limits['read_tbs']:.2f} TB/s"]
    sections: dict = {}
    for r in records:
        sections.setdefault((r["dtype"], r["head_dim"], r["nheads"], r["nheads_k"]), []).append(r)
    header = (f"{'batch':>5} {'kv len':>6} {'K/V MiB':>8}  {'impl':<20} {'warm us':>8} {'flushed us':>10} "
              f"{'graph us':>8} {'TB/s':>5} {'of peak':>7} {'host us':>7} {'splits':>6} {'vs peers':>16}")
    notes: dict = {}
    for (dtype, head_dim, nheads, nheads_k), rows in sections.items():
        lines += ["", f"decode {dtype}  head dim {head_dim}  {nheads} query heads / {nheads_k} kv heads", header]
        last = None
        for r in rows:
            key = (r["batch"], r["kv_len"])
            lead = (f"{r['batch']:>5} {bench.format_seqlen(r['kv_len']):>6} {r['kv_bytes'] / 2**20:>8.1f}"
                    if key != last else " " * 21)
            last = key
            name = r["impl"] + (f" paged {r['page_size']}" if r["layout"] == "paged" else "")
            if r["status"] != "ok":
                cell = r["status"]
                if r.get("note"):
                    cell += f"[{notes.setdefault(f'{name}: ' + r['note'], len(notes) + 1)}]"
                lines.append(f"{lead}  {name:<20} {cell:>8}")
                continue
            fraction = f"{100 * r['peak_fraction']:.0f}%" if r.get("peak_fraction") else ""
            vs = ""
            if r.get("speedup"):
                graph_vs = f"{r['graph_speedup']:.2f}" if r.get("graph_speedup") else "-"
                vs = f"{r['warm_speedup']:.2f}/{r['speedup']:.2f}/{graph_vs}x"
            splits = str(r["splits"]) if r.get("splits") else ""
            graph = f"{r['graph_us']:.1f}" if r.get("graph_us") else "-"
            if r.get("note"):
                graph += f"[{notes.setdefault(f'{name}: ' + r['note'], len(notes) + 1)}]"
            lines.append(f"{lead}  {name:<20} {r['warm_us']:>8.1f} {r['flushed_us']:>10.1f} {graph:>8} "
                         f"{r['flushed_tbs']:>5.2f} {fraction:>7} {r['host_us']:>7.0f} {splits:>6} {vs:>16}")
    lines += ["", f"warm us / flushed us: median GPU time per call (the lower of {TIMING_PASSES} passes), K/V left in "
                  "L2 / L2 flushed before each call; graph us: GPU time per call of a few calls replayed back to "
                  "back from a CUDA graph; TB/s and of peak: K/V bytes over the flushed time; host us: host time per "
                  "call; vs peers: the faster peer's time over flashcupy's, warm/flushed/graph (> 1: flashcupy is "
                  "faster)"]
    lines += [f"[{number}] {text}" for text, number in notes.items()]
    return "\n".join(lines)
