"""Attention over a KV cache: flash_attn_with_kvcache, its validation, the split-KV plan and the
launches of cuda_src/decode.cu (the append with rotary, the split-KV attention kernels, which merge
their splits themselves).
The spec is decode_ref.py.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from . import build, params, replay, sm80
from .configs import SUPPORTED_HEAD_DIMS, cpp_bool, mask_flags
from .launch import LaunchPlan
from .problem import AttentionOptions, Problem

HEAD_DIMS = SUPPORTED_HEAD_DIMS  # every head dim of the forward
NVRTC_OPTIONS = sm80.NVRTC_OPTIONS
MAX_SPLITS = 128  # the prefill kernel's merge keeps a weight per split of a row in shared memory, a lane's 4 per warp
MIN_KEYS_PER_SPLIT = 128  # less and the partials' traffic outweighs the parallelism

# flash_decode_kernel: 16 packed query rows per block, its warps splitting the keys 16 each; by head
# dim, (warps, ring stages), each block within 99 KiB of shared memory (every sm80+ GPU).
DECODE_BLOCK_M = 16
DECODE_TILES = {32: (4, 8), 64: (4, 5), 96: (4, 2), 128: (4, 2), 192: (2, 3), 256: (2, 2)}
# Hopper's own at 96 and 128 (H200, bf16, 32 query heads; the rows staged through registers, two
# stages suffice): 8 warps (110 and 140 KiB, a block per SM) from 1 x 1k to 32 x 64k keys. At 192
# and 256 (rows by cp.async) tiles that fill shared memory, 211 KiB. Against the sm80 tiles, H200,
# GQA 32/8, 1 / 8 / 32 sequences of 8k keys: d=96 14.9 / 58.9 / 202.9 us from 16.2 / 60.6 / 206.8;
# d=192 22.7 / 108 / 391 from 47.6 / 146 / 451; d=256 36.3 / 141 / 516 from 64.2 / 151 / 559.
DECODE_TILES_SM90 = {96: (8, 2), 128: (8, 2), 192: (8, 2), 256: (4, 3)}
# Its smaller tiles, for calls that the rule leaves unsplit: of the long tile and these, the first
# whose SM slots hold the blocks in one wave (caches of at most SHORT_KEYS rows) or in LONG_WAVES
# waves (longer caches), else the last. Where the blocks outnumber a tile's slots, smaller blocks
# let one block's start and end overlap the others' loads. H200, alternating runs: caches of 1-2k
# keys, 128 blocks 22.6 and 37.7 us with 8 warps against 25.5 and 40.4 with 4 warps and two splits;
# 256 blocks 37.6 with 4 warps against 41.9 with 2 warps and two splits; 1024 blocks 129.1 with 2
# warps against 132.2 with 4; 4096 blocks (128 x 1k MHA) 486 against 501. Caches of 8k-128k keys:
# 256 blocks 946 and 3768 us with 8 warps against 948 and 3792 with 4; 1024 blocks 948 with 4 warps
# against 952 with 2 and 957 with 8; 4096 blocks 3761 with 2 warps against 3780 with 4 and 3835 with
# 8 (128 x 8k MHA), 15160-15190 against 15240-15250 and 15400 (128 x 32k MHA).
DECODE_TILES_SM90_SMALL = {96: ((4, 2), (2, 2)), 128: ((4, 2), (2, 2))}
SHORT_KEYS = 2048
LONG_WAVES = 4
# Split counts whose splits may run as one cluster of blocks on Hopper (the long tile, by head dim),
# merged through distributed shared memory rather than by the last split's block, which finds itself
# by a count in global memory (1-1.5 us less a call on an H100). Taken only where the GPU holds
# every q block's cluster at once: a cluster's blocks share a GPC, so an H100 holds 66 clusters of 2
# and 15 of 8 of these one-per-SM blocks (132 and 120 SMs); beyond that the count is faster. At 192
# and 256 (H200, GQA 32/8, alternating in one process, flushed): 1 x 1k 12.2 -> 10.6 and 17.6 ->
# 11.2 us (8 splits), 8 x 1k 23.0 -> 21.0 and 28.7 -> 24.9, 8 x 8k 105.0 -> 103.4 and 138.0 -> 133.6.
# Where they do not, and a split holds at most CLUSTER_SMALL_TILE_SPLIT_KEYS keys of the cache (one
# key block of the long tile, two steps of the 4-warp one), the first small tile's clusters (two
# blocks an SM) where those fit. H200, alternating in one process, replayed from a CUDA graph /
# spin-separated warm / flushed us, small-tile clusters against the count on the long tile: 128
# keys a split, 32 kv heads x 1 x 512 keys (4 splits) 7.02 / 10.24 / 11.36 against 7.46 / 10.75 /
# 12.13, GQA 32/8 4 x 512 7.40 / 10.62 / 11.84 against 7.45 / 10.69 / 12.19, 2 x 1k (8 splits) 7.43 /
# 10.69 / 11.84 against 7.54 / 10.56 / 12.06; 256 keys a split, where the small tile's four steps a
# warp cost more than the count (since the merge from registers), 32 kv heads x 1 x 1k 9.52 / 12.58
# / 13.86 against 9.03 / 12.16 / 13.73, GQA 4 x 1k 9.77 / 12.86 / 13.95 against 8.96 / 12.03 / 13.76.
DECODE_CLUSTERS_SM90 = {96: (2, 4, 8), 128: (2, 4, 8), 192: (2, 4, 8), 256: (2, 4, 8)}
CLUSTER_SMALL_TILE_SPLIT_KEYS = 128
# Over caches of at most CLUSTER_CAP_KEYS keys the rule's split count, when above the largest
# cluster, is cut to it where those clusters all fit: fewer splits, no count. H200, GQA 32/8, 1
# sequence, 8 splits in clusters against the rule's 16 with the count, warm / flushed us: 1.5k
# keys 9.8 / 10.9 against 10.8 / 11.8, 2k 9.9 / 11.0 against 11.2 / 12.5 (d=96 9.6 / 10.7 against
# 10.6 / 12.0), 3k 11.3 / 12.7 against 12.3 / 13.9, 4k 12.6 / 14.2 against 12.7 / 14.7; 6k 15.1 /
# 16.8 against 14.1 / 16.6 and 8k 17.4 / 19.3 against 15.5 / 18.2, where the splits' loads win.
CLUSTER_CAP_KEYS = 4096
# Registers per thread of the sm90 decode kernels that stage rows in registers (head dims up to
# 128; ptxas: up to 250, the split merge's loads in flight), rounded up to the 8 registers a thread
# is allocated in: they, not shared memory, bound the blocks per SM (1, 2 and 4 of the 8-, 4- and
# 2-warp tiles). CI checks that every instance's own count gives the same blocks.
STAGED_REGISTERS = 256
# Up to this many packed rows (query rows x heads per block) per sequence and head group go to
# flash_decode_kernel, more to flash_prefill_kernel, whose warps split the rows instead.
DECODE_MAX_ROWS = 32
# flash_prefill_kernel: 64 packed rows per block, 4 warps, two stages of BLOCK_N keys; 32 keys at
# 192 and 256 keep the stages within an Ampere/Ada block's 99 KiB.
PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = {32: 64, 64: 64, 96: 64, 128: 64, 192: 32, 256: 32}


def num_splits_for(batch: int, head_groups: int, m_blocks: int, key_capacity: int, slots: int) -> int:
    """The split-KV rule for num_splits=0: as many splits as keep the blocks (batch x head groups x
    packed q blocks x splits) within one wave of the GPU's `slots` (SMs x the kernel's blocks per
    SM), each split at least MIN_KEYS_PER_SPLIT keys of the cache's capacity (the index arrays'
    values are on the GPU: the plan may not read them), at most MAX_SPLITS; none when the blocks
    without splits exceed half the slots. (A second wave of a few blocks costs a whole
    block's time: 5 splits of 8 x 8k keys, 320 blocks on an H200's 264 slots, took 1.4x as long
    as 4.)"""
    blocks = batch * head_groups * m_blocks
    if blocks == 0:
        return 1
    return max(1, min(slots // blocks, key_capacity // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def blocks_per_sm(kernel, device) -> int:
    """How many blocks of `kernel` (a DecodeVariant or PrefillVariant) an SM of `device` holds, by
    shared memory (an SM has 1 KiB more than a block may opt in to, and each block reserves 1 KiB),
    threads (2048 per SM on sm80 and sm90, 1536 on sm86 and sm89) and, for the sm90 decode kernels
    that stage rows in registers, registers (64 Ki per SM)."""
    by_smem = (device.smem_per_block_optin + 1024) // (kernel.smem_bytes + 1024)
    by_threads = (2048 if device.capability in (80, 90) else 1536) // kernel.threads
    staged = stages_rows_in_registers(kernel, device.capability)
    by_registers = blocks_by_registers(STAGED_REGISTERS, kernel.threads) if staged else by_threads
    return max(1, min(by_smem, by_threads, by_registers))


def blocks_by_registers(registers: int, threads: int) -> int:
    """How many blocks of `threads` threads using `registers` each an SM's 64 Ki registers hold (a
    thread's registers are allocated in units of 8)."""
    return 65536 // (-(-registers // 8) * 8 * threads)


def stages_rows_in_registers(kernel, capability: int) -> bool:
    """Does `kernel` on a GPU of this compute capability hold its next rows in registers (decode.cu's
    kStaged: the sm90 decode kernel up to head dim 128), so that STAGED_REGISTERS bounds its blocks?"""
    return capability == 90 and isinstance(kernel, DecodeVariant) and kernel.head_dim <= 128


def page_divider(page_size: int) -> tuple:
    """(mul, shift) with row // page_size == (row * mul) >> shift for every 0 <= row < 2**31, mul
    < 2**32: the kernels' division of a cache row by the page size (CacheRows in decode.cu).
    With l = ceil(log2(page_size)) and mul = ceil(2**(31 + l) / page_size), the product overshoots
    row / page_size by less than row / 2**(31 + l) < 2**-l <= 1 / page_size, too little to reach
    the next multiple."""
    if page_size < 1:
        raise ValueError(f"page_size must be positive; got {page_size}")
    shift = 31 + (page_size - 1).bit_length()
    return -(-(1 << shift) // page_size), shift


def unsupported(head_dim: int, device) -> str | None:
    """Why the kv-cache kernels cannot run at this head dim on `device` (a DeviceInfo), or None."""
    if device.capability < 80:
        major, minor = divmod(device.capability, 10)
        return f"needs compute capability 8.0 or newer; this GPU has {major}.{minor}"
    smem = max(v.smem_bytes for v in (DecodeVariant(head_dim, "bfloat16", "none", False),
                                       PrefillVariant(head_dim, "bfloat16", "none", False)))
    if smem > device.smem_per_block_optin:
        return f"head dim {head_dim} needs {smem} bytes of shared memory per block; this GPU grants {device.smem_per_block_optin}"
    return None


def _padded_row_bytes(head_dim: int) -> int:
    return (head_dim + 8) * 2  # a 16-bit row padded by 8 elements (tile.cuh)


@dataclass(frozen=True)
class DecodeVariant:
    """flash_decode_kernel: warps x 16 keys per step, a ring of `stages` steps (DECODE_TILES); with
    cluster > 1, flash_decode_cluster_kernel (a q block's splits as one cluster)."""
    head_dim: int
    dtype: str
    mask: str  # one of configs.MASKS
    score_mod: bool
    warps: int = 0   # 0: DECODE_TILES's
    stages: int = 0
    cluster: int = 1  # more (sm90): a q block's splits are one cluster's blocks (flash_decode_cluster_kernel)

    source = "decode.cu"
    nvrtc_options = NVRTC_OPTIONS
    block_m = DECODE_BLOCK_M

    def __post_init__(self):
        warps, stages = DECODE_TILES[self.head_dim]
        object.__setattr__(self, "warps", self.warps or warps)
        object.__setattr__(self, "stages", self.stages or stages)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def name_expression(self) -> str:
        kernel, cluster = ("flash_decode_kernel", "") if self.cluster == 1 else \
            ("flash_decode_cluster_kernel", f"{self.cluster}, ")
        return (f"{kernel}<{self.head_dim}, {self.warps}, {self.stages}, {cluster}{mask_flags(self.mask)}, "
                f"{cpp_bool(self.dtype == 'bfloat16')}, {cpp_bool(self.score_mod)}>")

    @property
    def smem_bytes(self) -> int:
        """Q, then the larger of the K, V ring and the merge area: the warps' states, then the block's
        split for a cluster's merge (DecodeTraits)."""
        row = _padded_row_bytes(self.head_dim)
        ring = self.stages * 2 * 16 * self.warps * row
        merge = (self.warps * (self.head_dim + 8 + 2) + self.head_dim + 1) * DECODE_BLOCK_M * 4
        return DECODE_BLOCK_M * row + max(ring, merge)

    @property
    def layout_check(self) -> str:
        return build.smem_check(f"DecodeTraits<{self.head_dim}, {self.warps}, {self.stages}>", self)

    def __str__(self) -> str:
        return (f"decode d={self.head_dim} {self.dtype} mask={self.mask}" + ("+score_mod" if self.score_mod else "")
                + f" tile={DECODE_BLOCK_M}x{16 * self.warps} stages={self.stages}"
                + (f" cluster={self.cluster}" if self.cluster > 1 else ""))


@dataclass(frozen=True)
class PrefillVariant:
    """flash_prefill_kernel: 64 packed rows, 4 warps of 16 rows, two stages of PREFILL_BLOCK_N keys."""
    head_dim: int
    dtype: str
    mask: str  # one of configs.MASKS
    score_mod: bool

    source = "decode.cu"
    nvrtc_options = NVRTC_OPTIONS
    block_m = PREFILL_BLOCK_M
    threads = 128
    cluster = 1  # its splits merge by the count

    @property
    def block_n(self) -> int:
        return PREFILL_BLOCK_N[self.head_dim]

    @property
    def name_expression(self) -> str:
        return (f"flash_prefill_kernel<{self.head_dim}, {self.block_n}, {mask_flags(self.mask)}, "
                f"{cpp_bool(self.dtype == 'bfloat16')}, {cpp_bool(self.score_mod)}>")

    @property
    def smem_bytes(self) -> int:
        """Q, then 2 stages x (K, V), rows padded by 8 elements (PrefillTraits)."""
        return (PREFILL_BLOCK_M + 2 * 2 * self.block_n) * _padded_row_bytes(self.head_dim)

    @property
    def layout_check(self) -> str:
        return build.smem_check(f"PrefillTraits<{self.head_dim}, {self.block_n}>", self)

    def __str__(self) -> str:
        return (f"prefill d={self.head_dim} {self.dtype} mask={self.mask}" + ("+score_mod" if self.score_mod else "")
                + f" tile={PREFILL_BLOCK_M}x{self.block_n}")


def attention_variant(rows: int, head_dim: int, dtype: str, mask: str, score_mod: bool, capability: int = 80):
    """The kernel for `rows` packed query rows per (sequence, kv head group) on a GPU of this
    compute capability (before plan_launch's choice of a small tile or a cluster)."""
    if rows > DECODE_MAX_ROWS:
        return PrefillVariant(head_dim, dtype, mask, score_mod)
    return DecodeVariant(head_dim, dtype, mask, score_mod, *decode_tile(head_dim, capability))


def decode_tile(head_dim: int, capability: int) -> tuple:
    """The decode kernel's (warps, stages) on a GPU of this compute capability: Hopper's own where it
    has one, else DECODE_TILES's."""
    tiles = DECODE_TILES_SM90 if capability == 90 else {}
    return tiles.get(head_dim, DECODE_TILES[head_dim])


def small_tiles(head_dim: int, capability: int) -> tuple:
    """The (warps, stages) a GPU of this compute capability may take for many unsplit blocks."""
    return DECODE_TILES_SM90_SMALL.get(head_dim, ()) if capability == 90 else ()


def heads_per_block(problem) -> int:
    """Query heads whose rows share a block: those of a kv head (K and V read once for all of them),
    or one with per-head ALiBi slopes or sinks."""
    o = problem.options
    return 1 if o.alibi_slopes is not None or o.sinks is not None else problem.nheads // problem.nheads_k


def packed_rows(problem) -> int:
    """Packed query rows per (sequence, head group): seqlen_q times heads_per_block."""
    return problem.max_seqlen_q * heads_per_block(problem)


@dataclass(frozen=True)
class DecodePlan:
    """The attention kernel's launch for one call: grid (m_blocks x splits, nheads / pack, batch)."""
    kernel: object  # DecodeVariant or PrefillVariant
    pack: int       # query heads per block: those of a kv head, or one (per-head ALiBi slopes or sinks)
    m_blocks: int   # blocks of packed query rows per (sequence, head group)
    splits: int     # parts of each sequence's keys, merged by their LSEs
    blocks: int     # batch x head groups x m_blocks: the q blocks, each split `splits` ways

    def launch_plan(self, nheads: int, batch: int, capability: int) -> LaunchPlan:
        """The attention kernel's geometry. From sm90 a decode kernel is launched programmatically: it
        may be resident while the kernel ahead of it in the stream (the append, the previous step)
        finishes, and waits for it (griddep_wait) before reading anything in global memory. The launch
        goes through cuda-bindings (replay.kernel_launcher); without it, plainly."""
        from .device import has_cuda_bindings

        kernel = self.kernel
        programmatic = capability >= 90 and isinstance(kernel, DecodeVariant) and has_cuda_bindings()
        return LaunchPlan((self.m_blocks * self.splits, nheads // self.pack, batch), (kernel.threads, 1, 1),
                          kernel.smem_bytes, programmatic=programmatic)


def cache_problem(q, k_cache, block_table, options: AttentionOptions) -> Problem:
    """The problem of a call over this cache: keys up to its capacity (the index arrays' values are
    on the GPU: the plan may not read them)."""
    from .validation import dtype_name

    batch, seqlen_q, nheads, head_dim = q.shape
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    return Problem._make(q, batch, seqlen_q, capacity, nheads, k_cache.shape[2], head_dim, dtype_name(q.dtype),
                         options, None, None)


@functools.lru_cache(maxsize=None)
def resident_clusters(variant, device_id: int) -> int:
    """How many clusters of `variant` (a DecodeVariant with cluster > 1) GPU `device_id` runs at
    once, by the driver (cuOccupancyMaxActiveClusters); 0 where it cannot say (no GPU, no
    cuda-bindings, or bindings the driver refuses), which leaves the splits to the count."""
    from .device import gpu_available, has_cuda_bindings

    if not gpu_available() or not has_cuda_bindings():
        return 0
    import cupy

    with cupy.cuda.Device(device_id):
        kernel = build.get_kernel(variant)
        try:
            from cuda.bindings import driver

            config = replay.launch_config(LaunchPlan((variant.cluster, 1, 1), (variant.threads, 1, 1),
                                                     variant.smem_bytes))  # one cluster's blocks
            err, count = driver.cuOccupancyMaxActiveClusters(driver.CUfunction(kernel.kernel.ptr), config)
        except (ImportError, RuntimeError):  # bindings built for another driver
            return 0
    return count if err == driver.CUresult.CUDA_SUCCESS else 0


def plan_launch(problem: Problem, num_splits: int, device, clusters=resident_clusters) -> DecodePlan:
    """The launch for `problem` (max_seqlen_k: the cache's capacity) with num_splits asked (0: the
    rule, num_splits_for) on `device` (a DeviceInfo); clusters(variant, device id): how many
    clusters of a cluster variant the GPU runs at once (resident_clusters)."""
    pack, rows = heads_per_block(problem), packed_rows(problem)
    kernel = attention_variant(rows, problem.head_dim, problem.dtype, problem.band.mask, problem.score_mod,
                               device.capability)
    m_blocks = -(-rows // kernel.block_m)
    blocks = problem.batch * (problem.nheads // pack) * m_blocks
    # a bound on the keys of one q block's rows: a window's width (and the rows' spread) where narrower
    keys = min(problem.max_seqlen_k, problem.keys_per_row + problem.max_seqlen_q)
    splits = num_splits or num_splits_for(problem.batch, problem.nheads // pack, m_blocks, keys,
                                          device.sm_count * blocks_per_sm(kernel, device))
    if splits == 1 and isinstance(kernel, DecodeVariant):
        # many blocks: a smaller tile while the blocks outnumber this one's slots `waves` times over
        # (they stay unsplit: a split would add waves)
        waves = 1 if problem.max_seqlen_k <= SHORT_KEYS else LONG_WAVES
        for warps, stages in small_tiles(problem.head_dim, device.capability):
            if blocks <= waves * device.sm_count * blocks_per_sm(kernel, device):
                break
            kernel = dataclasses.replace(kernel, warps=warps, stages=stages)
    splits = min(splits, MAX_SPLITS)
    sizes = DECODE_CLUSTERS_SM90.get(problem.head_dim, ()) \
        if device.capability == 90 and isinstance(kernel, DecodeVariant) else ()
    if not num_splits and sizes and splits > max(sizes) and problem.max_seqlen_k <= CLUSTER_CAP_KEYS \
            and blocks <= clusters(dataclasses.replace(kernel, cluster=max(sizes)), device.id):
        splits = max(sizes)
    if splits in sizes:
        # one cluster per q block, all at once (the first test spares the driver's, and a compile);
        # over short splits, where the long tile's clusters do not all fit, the first small tile's
        tiles = [kernel] + [dataclasses.replace(kernel, warps=warps, stages=stages)
                            for warps, stages in small_tiles(problem.head_dim, device.capability)[:1]
                            if problem.max_seqlen_k <= CLUSTER_SMALL_TILE_SPLIT_KEYS * splits]
        for tile in tiles:
            clustered = dataclasses.replace(tile, cluster=splits)
            if blocks * splits <= device.sm_count * blocks_per_sm(tile, device) \
                    and blocks <= clusters(clustered, device.id):
                kernel = clustered
                break
    return DecodePlan(kernel, pack, m_blocks, splits, blocks)


@dataclass(frozen=True)
class DecodeHelper:
    """The append and the query rotation: one instance per dtype."""
    kernel: str  # one of HELPER_KERNELS
    dtype: str

    source = "decode.cu"
    nvrtc_options = NVRTC_OPTIONS
    smem_bytes = 0
    layout_check = ""

    @property
    def name_expression(self) -> str:
        return f"{self.kernel}<{cpp_bool(self.dtype == 'bfloat16')}>"

    def __str__(self) -> str:
        return f"{self.kernel} {self.dtype}"


HELPER_KERNELS = ("kvcache_append_kernel", "rotary_q_kernel")
ATTENTION_KERNELS = ("flash_decode_kernel", "flash_decode_cluster_kernel", "flash_prefill_kernel")


def variants(head_dims=HEAD_DIMS, dtypes=("float16", "bfloat16"), masks=("none", "causal", "local"),
             score_mods=(False, True)) -> list:
    """Every kv-cache kernel: both attention kernels' instances (the decode kernel's Hopper tiles
    and clusters too), then the helpers'."""
    main = [kind(d, dt, m, mod) for kind in (DecodeVariant, PrefillVariant) for d in head_dims for dt in dtypes
            for m in masks for mod in score_mods]
    hopper = [DecodeVariant(d, dt, m, mod, *tile) for d in head_dims
              for tile in (decode_tile(d, 90), *small_tiles(d, 90))
              for dt in dtypes for m in masks for mod in score_mods]
    clusters = [DecodeVariant(d, dt, m, mod, *tile, cluster) for d in head_dims
                for tile in (decode_tile(d, 90), *small_tiles(d, 90)[:1])
                for cluster in DECODE_CLUSTERS_SM90.get(d, ()) for dt in dtypes for m in masks for mod in score_mods]
    return list(dict.fromkeys(main + hopper + clusters)) + [DecodeHelper(k, dt) for k in HELPER_KERNELS for dt in dtypes]


def hopper_only(variant) -> bool:
    """A decode kernel with Hopper's tiles (DECODE_TILES_SM90*: more shared memory than sm80-89
    grant) or clusters."""
    return isinstance(variant, DecodeVariant) and ((variant.warps, variant.stages) != DECODE_TILES[variant.head_dim]
                                                   or variant.cluster > 1)


def ci_cases() -> list:
    """(variant, arch) pairs CI compiles: every kernel once, bfloat16 for sm_90a and float16 for
    sm_80 (as the sm80 families: each dtype and each arch with every option); Hopper's tiles for
    sm_90a alone."""
    return [(v, "sm_90a" if v.dtype == "bfloat16" or hopper_only(v) else "sm_80") for v in variants()]


_split_counters: dict = {}
# Every counter buffer ever handed out: a CUDA graph captured with one keeps using it after a
# larger launch replaced it, so none goes back to CuPy's pool (a few KiB each).
_retired_counters: list = []


def split_counters(count: int):
    """Zeroed int32 counters for the attention kernels' merge of their splits (the last split's
    block merges; the kernels leave every counter at zero), at least `count`: one buffer per
    (device, stream), allocated on first use and when a launch needs more, so a decode loop
    allocates nothing for them and launches on different streams never share them."""
    import cupy

    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
    counters = _split_counters.get(key)
    if counters is None or counters.size < count:
        if counters is not None:
            _retired_counters.append(counters)
        counters = _split_counters[key] = cupy.zeros(max(count, 4096), cupy.int32)
    return counters


def _index_array(value, name: str, batch: int, device: int, check_values: bool):
    """(device int32 array or None, host copy or None) of an index argument given as None, an int
    (cache_seqlens only), a host or a device array. A host copy of a device array is made only when
    check_values asks for it (a device-to-host copy, which waits for the stream)."""
    import cupy

    from .validation import MAX_ROWS, MAX_ROWS_TEXT, ArraySpec, check_index_array

    if value is None:
        return None, None
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        if name != "cache_seqlens":
            raise TypeError(f"{name} must be an int32 array of shape (batch,); got an int")
        if not 0 <= value < MAX_ROWS:
            raise ValueError(f"cache_seqlens must lie in [0, {MAX_ROWS_TEXT}); got {value}")
        host = np.full(batch, int(value), np.int32)
        return cupy.asarray(host), host
    if isinstance(value, np.ndarray):
        check_index_array(name, ArraySpec.of(value, device), batch, device)
        return cupy.asarray(value), value
    from .api import as_device_array

    array = as_device_array(value, name)
    check_index_array(name, ArraySpec.of(array), batch, device)
    return array, (cupy.asnumpy(array) if check_values else None)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None,
                            rotary_interleaved: bool = True, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            alibi_slopes=None, sinks=None, num_splits: int = 0, return_lse: bool = False,
                            check_values: bool = True):
    """Attention of q over a KV cache, the new keys k, v appended to it in place first.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on the GPU; seqlen_q from 1
            (decoding) to thousands (chunked prefill, speculative decoding).
        k_cache, v_cache: (batch_cache, seqlen_cache, nheads_k, headdim), or with block_table
            (num_blocks, page_size, nheads_k, headdim), any page size; q's dtype; nheads_k divides
            nheads. Written in place at the appended rows only.
        k, v: optional (batch, seqlen_new, nheads_k, headdim): written at rows cache_seqlens[b] ..
            cache_seqlens[b] + seqlen_new - 1 of sequence b's cache, then attended with the rest.
        cache_seqlens: int, or int32 (batch,) (host or GPU): the rows of each sequence's cache in
            use before the append. Default: the whole cache (not with block_table or k, v).
        cache_batch_idx: int32 (batch,): the cache entry of each sequence (default b); distinct
            when k, v are appended. Not with block_table.
        cache_leftpad: int32 (batch,): the first row of each sequence's cache (default 0); its keys
            are rows cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1.
        block_table: int32 (batch, max_blocks): row r of sequence b is row r % page_size of block
            block_table[b, r // page_size].
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) in q's dtype, with k, v only: the new
            keys are rotated at their cache rows before they are written; the queries at
            cache_seqlens[b] + i (causal or windowed) or all at cache_seqlens[b].
            rotary_interleaved: rotate the pairs (2 j, 2 j + 1) (GPT-J) instead of (j, j +
            rotary_dim / 2) (GPT-NeoX).
        softmax_scale, causal, window_size, softcap, alibi_slopes, sinks: as flash_attn_func, the
            masks aligned to the bottom right (the last query row is the last key's position).
        num_splits: how many parts each sequence's keys are cut into (split-KV), merged by their
            LSEs; 0 (default) chooses (num_splits_for, and on Hopper plan_launch's cut to one
            cluster over short caches), 1 turns splitting off; at most MAX_SPLITS (128) are used.
        return_lse: also return softmax_lse, float32 (batch, nheads, seqlen_q).
        check_values: check the index arrays' values (cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table) before any launch. Host arrays are checked without a
            copy (with cache_seqlens on the GPU and check_values=False, cache_batch_idx alone: the
            others' bounds depend on the lengths); GPU arrays cost a device-to-host copy, which
            waits for the stream and cannot run under stream capture: pass False in a decode loop
            once the inputs are known good.

    Returns out (batch, seqlen_q, nheads, headdim) in q's dtype (and softmax_lse). Runs on CuPy's
    current stream with no host synchronization when check_values=False or the index arrays are
    host arrays; allocations come from CuPy's pool, so a step can be captured into a CUDA graph.
    """
    # A decode loop (check_values=False, index arrays on the GPU) repeats its calls: the launches of a
    # call with the same arrays and options run again without the checks and the planning. (Without
    # cache_seqlens each call makes its own array of the cache's length: nothing to keep.)
    key = None if check_values is not False or cache_seqlens is None else replay.call_key(
        "flash_attn_with_kvcache", (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, cache_leftpad,
                                    block_table, rotary_cos, rotary_sin, alibi_slopes, sinks),
        (rotary_interleaved, softmax_scale, causal, window_size, softcap, num_splits))
    kept = replay.rerun_forward(key, return_lse)
    if kept is not None:
        return kept
    import cupy

    from .api import as_device_array
    from .device import device_info
    from .validation import (ArraySpec, check_band, check_cache_batch_idx, check_kvcache_inputs, check_kvcache_values,
                             check_softcap)

    arrays = {name: None if a is None else as_device_array(a, name)
              for name, a in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                              ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("alibi_slopes", alibi_slopes),
                              ("sinks", sinks))}
    q, k_cache, v_cache, k, v = (arrays[n] for n in ("q", "k_cache", "v_cache", "k", "v"))
    rotary_cos, rotary_sin = arrays["rotary_cos"], arrays["rotary_sin"]
    spec = {n: None if a is None else ArraySpec.of(a) for n, a in arrays.items()}
    # the block table, like the other index arrays, may be a host array (checked, then copied over)
    if block_table is None or isinstance(block_table, np.ndarray):
        table = block_table
        table_spec = None if table is None else ArraySpec.of(table, q.device.id)
    else:
        table = as_device_array(block_table, "block_table")
        table_spec = ArraySpec.of(table)
    check_kvcache_inputs(spec["q"], spec["k_cache"], spec["v_cache"], spec["k"], spec["v"], table_spec,
                         spec["rotary_cos"], spec["rotary_sin"], HEAD_DIMS)
    check_band(causal, window_size, "bottom_right")
    check_softcap(softcap)
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)) \
            or not 0 <= num_splits <= 4096:
        raise ValueError(f"num_splits must be an int in [0, 4096] (0: chosen; 1: no splitting); got {num_splits!r}")
    if not isinstance(rotary_interleaved, (bool, np.bool_)):
        raise TypeError(f"rotary_interleaved must be a bool; got {rotary_interleaved!r}")
    batch, seqlen_q, nheads, head_dim = q.shape
    paged = block_table is not None
    if paged and (cache_batch_idx is not None or cache_leftpad is not None):
        raise ValueError("cache_batch_idx and cache_leftpad are for a contiguous cache, not with block_table")
    if cache_seqlens is None and (paged or k is not None):
        raise ValueError("cache_seqlens is needed with block_table and where k, v are appended")
    if not paged and cache_batch_idx is None and k_cache.shape[0] != batch:
        raise ValueError(f"k_cache has {k_cache.shape[0]} entries for {batch} sequences; give cache_batch_idx to "
                         "choose among them")
    seqlen_new = 0 if k is None else k.shape[1]
    options = AttentionOptions(softmax_scale, causal, window_size, "bottom_right", softcap, arrays["alibi_slopes"],
                               arrays["sinks"])
    problem = cache_problem(q, k_cache, table, options)
    device = q.device.id
    with q.device:
        if cache_seqlens is None:
            cache_seqlens = k_cache.shape[1]
        seqlens_d, seqlens_h = _index_array(cache_seqlens, "cache_seqlens", batch, device, check_values)
        idx_d, idx_h = _index_array(cache_batch_idx, "cache_batch_idx", batch, device, check_values)
        pad_d, pad_h = _index_array(cache_leftpad, "cache_leftpad", batch, device, check_values)
        bt_d = None if table is None else cupy.asarray(table)
        bt_h = table if isinstance(table, np.ndarray) else cupy.asnumpy(table) if table is not None and check_values \
            else None
        windowed = causal or tuple(window_size) != (-1, -1)
        if seqlens_h is not None:
            check_kvcache_values(seqlens_h, pad_h, idx_h, bt_h, seqlen_new=seqlen_new, capacity=problem.max_seqlen_k,
                                 cache_entries=k_cache.shape[0], seqlen_ro=None if rotary_cos is None else
                                 rotary_cos.shape[0], rotary_q_per_row=windowed, seqlen_q=seqlen_q)
        elif idx_h is not None:  # the lengths unread (on the GPU, unchecked): what needs no length
            check_cache_batch_idx(idx_h, seqlen_new, k_cache.shape[0])
        out = cupy.empty(q.shape, q.dtype)
        lse = cupy.empty((batch, nheads, seqlen_q), cupy.float32)
        info = device_info(device)
        reason = unsupported(head_dim, info)
        if reason is not None:
            raise ValueError(f"flash_attn_with_kvcache cannot run on {info.name}: {reason}")
        if out.size or seqlen_new:
            launches = launch(problem, q, k_cache, v_cache, out, lse, info, k=k, v=v, seqlens=seqlens_d,
                              batch_idx=idx_d, leftpad=pad_d, block_table=bt_d, rotary_cos=rotary_cos,
                              rotary_sin=rotary_sin, interleaved=bool(rotary_interleaved), windowed=windowed,
                              num_splits=int(num_splits))
            replay.keep(key, launches)
    return (out, lse) if return_lse else out


def launch(problem, q, k_cache, v_cache, out, lse, device, *, k=None, v=None, seqlens=None, batch_idx=None,
           leftpad=None, block_table=None, rotary_cos=None, rotary_sin=None, interleaved=False, windowed=False,
           num_splits=0) -> replay.CallReplay:
    """Launches the call's kernels (append, rotary, attention) on `device` (a DeviceInfo); returns
    them with the buffers they allocate, to run again (replay.py). Without seqlens every sequence
    holds all of the cache's rows (flash_attn_func's k and v: the decode forward family); the append
    and the query rotation need them."""
    if seqlens is None and (k is not None or rotary_cos is not None):
        raise ValueError("appending keys or rotating queries needs cache_seqlens")
    if problem.is_varlen and (k is not None or rotary_cos is not None or block_table is not None):
        raise ValueError("a varlen batch is read as one contiguous cache entry: no append, rotation or pages")
    import cupy

    batch, seqlen_q, nheads, head_dim = problem.batch, problem.max_seqlen_q, problem.nheads, problem.head_dim
    plan = plan_launch(problem, num_splits, device)
    main, pack, splits = plan.kernel, plan.pack, plan.splits
    partial = splits > 1 and main.cluster == 1  # a cluster merges in shared memory
    # What the call allocates: out and the LSE; the rotated queries; the splits' partial results
    specs = {"out": (out.shape, out.dtype, False), "lse": (lse.shape, lse.dtype, False)}
    if rotary_cos is not None:
        specs["q_rotated"] = (q.shape, q.dtype, False)
    if partial:
        specs["out_partial"] = ((splits, batch, nheads, seqlen_q, head_dim), cupy.float32, False)
        specs["lse_partial"] = ((splits, batch, nheads, seqlen_q), cupy.float32, False)
    buffers = replay.Buffers(specs)
    b = buffers.allocate({"out": out, "lse": lse})
    q_eff = q if rotary_cos is None else b["q_rotated"]
    out_partial, lse_partial = b.get("out_partial"), b.get("lse_partial")
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 0
    div_mul, div_shift = page_divider(page_size) if paged else (0, 0)
    values = params.fwd_values(problem, q_eff, k_cache, v_cache, out, lse)
    values.update({
        "k_cache": k_cache, "v_cache": v_cache, "k_new": k, "v_new": v, "q_source": q,
        "q_rotated": None if rotary_cos is None else q_eff, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin,
        "cache_seqlens": seqlens, "cache_batch_idx": batch_idx, "cache_leftpad": leftpad, "block_table": block_table,
        "out_partial": out_partial, "lse_partial": lse_partial,
        "split_counters": split_counters(plan.blocks) if partial else None,
        **params.strides("knew", _strides_or_zero(k)), **params.strides("vnew", _strides_or_zero(v)),
        **params.strides("qsrc", _strides_or_zero(q)),
        "block_table_batch_stride": 0 if block_table is None else block_table.strides[0] // 4,
        "page_size": page_size, "page_div_mul": div_mul, "page_div_shift": div_shift,
        "seqlen_new": 0 if k is None else k.shape[1],
        "num_splits": splits, "heads_per_block": pack,
        "rotary_dim": 0 if rotary_cos is None else 2 * rotary_cos.shape[1], "rotary_interleaved": int(interleaved),
        "rotary_q_per_row": int(windowed),
    })
    record = params.pack("DecodeParams", values).tobytes()
    # with rotary the attention reads the rotated queries as q
    fields = {**params.DECODE_BUFFERS, **({"q": "q_rotated"} if rotary_cos is not None else {})}
    writes = params.buffer_writes("DecodeParams", fields)
    dtype = problem.dtype
    threads = head_dim // 8  # 16 bytes each
    launches = []
    if k is not None and k.size:
        append_plan = LaunchPlan((k.shape[1], problem.nheads_k, batch), (threads, 1, 1), 0)
        launches.append(replay.Replay(build.get_kernel(DecodeHelper("kvcache_append_kernel", dtype)), append_plan,
                                      record, writes))
    if out.size:
        if rotary_cos is not None:
            launches.append(replay.Replay(build.get_kernel(DecodeHelper("rotary_q_kernel", dtype)),
                                          LaunchPlan((seqlen_q, nheads, batch), (threads, 1, 1), 0), record, writes))
        launches.append(replay.Replay(build.get_kernel(main), plan.launch_plan(nheads, batch, device.capability),
                                      record, writes))
    call = replay.CallReplay(buffers, launches)
    for launch in launches:
        launch(b)
    return call


def _strides_or_zero(array) -> tuple:
    return (0, 0, 0) if array is None else tuple(s // array.dtype.itemsize for s in array.strides)
