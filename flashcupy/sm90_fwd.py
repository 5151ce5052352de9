"""The sm90 forward family: FlashAttention-3's Hopper forward (TMA, wgmma, a producer and two or
three consumer warpgroups, a persistent grid; cuda_src/fwd_sm90.cu), compiled by NVRTC for sm_90a.

It serves head dims 64, 96, 128, 192 and 256 on compute capability 9.0, with every option of the
API (masks, GQA, varlen, softcap, ALiBi, sinks); other head dims stay with the sm80 family, and
`unsupported` says why. The tensor maps of q, k and v are encoded on the host for each call
(cuda.bindings' cuTensorMapEncodeTiled) and cached by pointer, shape and strides, so a decode loop
over the same buffers pays for them once.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from dataclasses import dataclass, replace

import numpy as np

from . import build, params
from .configs import cpp_bool, mask_flags
from .launch import LaunchPlan, grid_blocks
from .validation import MAX_ROWS
from .registry import Family
from .replay import Replay

NVRTC_OPTIONS = ("-std=c++17",)
ARCH = "sm_90a"
HEAD_DIMS = (64, 96, 128, 192, 256)
SWIZZLE_BYTES = 128  # a TMA box's inner extent: one row of the 128-byte swizzle
TMA_BYTES = 128     # one tensor map
ARGS_TMA_OFFSET = 256  # Sm90FwdArgs: FwdParams, then the q, k, v, out tensor maps (64-byte aligned)
O_BOX_ROWS = 64  # a consumer warpgroup's rows: each stores its part of O's tile


@dataclass(frozen=True)
class Sm90FwdTile:
    block_m: int  # query rows per thread block: 64 per consumer warpgroup
    block_n: int  # keys per pipeline stage
    stages: int
    ping_pong: bool = False  # consumers take turns issuing their GEMMs (named barriers)
    advance_descs: bool = False  # wgmma descriptors advanced from their tile's (fewer instructions)

    @property
    def threads(self) -> int:
        return 128 * (1 + self.block_m // 64)  # a producer warpgroup and the consumers


# Tiles by head dim (Sm90FwdTraits), measured on an H100 (docs/PERF_NOTES.md): at d = 64 three
# consumer warpgroups (192 rows) keep the tensor cores busier than two; d = 192 and 256 take 112-
# and 80-key blocks so that O (96 and 128 registers a thread) still fits (d = 192: 96 over short
# rows, SHORT_ROW_TILES).
# Ping-pong measured +5-12% at d = 64 and +1-16% at d = 128, nothing at d = 256; advanced
# descriptors +1.5-4% at d = 128 without a mask, 3-7% slower at d = 64 causal, +1-3.5% at d = 192
# and 256 (with the kernel's warp-uniform warpgroup index there: no R2UR, no spills).
_TILES = {64: Sm90FwdTile(192, 128, 2, ping_pong=True),
          96: Sm90FwdTile(192, 96, 2, ping_pong=True, advance_descs=True),
          128: Sm90FwdTile(128, 128, 2, ping_pong=True, advance_descs=True),
          192: Sm90FwdTile(128, 112, 2, advance_descs=True), 256: Sm90FwdTile(128, 80, 2, advance_descs=True)}
# d = 64 on two consumer warpgroups (240 registers each, 128-row q blocks) instead of three:
# - under a band wider than a key block, where the three of _TILES spill the band's state (ptxas:
#   92 / 88 bytes of spill stores / loads at 160 registers). H200, same process, 5 alternating
#   rounds, speed two / three at 1k / 4k / 16k tokens: causal windows of 256 keys 1.27 / 1.13 /
#   1.31, of 1024 keys 1.13 / 1.03 / 1.01, a top-left band of 257 keys 0.93 / 1.01 / 1.00; a 65-key
#   top-left band (one key block per q block) 0.95 / 0.93 / 0.92 in an earlier run: it keeps three;
# - causal over rows of at most SHORT_ROW_KEYS keys, where 128-row q blocks compute less of the
#   diagonal's key blocks (at 1k, 11% fewer scores than 192-row ones). H200, 3 alternating rounds,
#   speed two / three at seqlen 512 / 1k / 2k / 4k / 16k: 1.07 / 1.08 / 0.96 / 0.93 / 0.87
#   (without a mask 0.95 at 512 and 1k).
TWO_CONSUMER_TILES = {64: Sm90FwdTile(128, 128, 2, ping_pong=True)}
SHORT_ROW_KEYS = 1024
# d = 96: three consumers of 96-key blocks (_TILES; 128-key ones spill 144 bytes at 160 registers),
# but over rows of at most SHORT_ROW_KEYS keys, with a mask or without, d = 128's tile: H100,
# 4 alternating rounds, TFLOP/s of 128 x 128 / 192 x 96 at 1k / 4k / 16k: 433 / 392, 539 / 584,
# 544 / 585; causal 301 / 268, 466 / 498, 544 / 565 (docs/PERF_NOTES.md)
# d = 192 there keeps 96-key blocks, 112 beyond: H100, 7 rotating rounds, speed of 112 against 96 at
# 1k / 4k / 16k: 0.971 / 1.024 / 1.026, causal 0.987 / 1.014 / 1.053 (a copy of the 96 arm 0.996-1.019)
SHORT_ROW_TILES = {96: _TILES[128], 192: Sm90FwdTile(128, 96, 2, advance_descs=True)}
# d = 64 without a mask or score mods: descriptors advanced. H200, 7 alternating rounds, speed
# advanced / not at 1k / 4k / 16k: 0.99 / 1.02 / 1.02; causal 0.97 / 0.99 / 0.97, softcap 0.99, a
# 256-key window (two consumers) 0.93, a 64-key one 1.02 (docs/PERF_NOTES.md).
# d = 96 without them: 112-key blocks (no spills). H100, 7 rotating rounds, speed against 96 keys at
# 2k / 4k / 16k: 1.026 / 1.017 / 1.034; causal 0.963 / 0.979 / 1.009, so masks keep 96.
PLAIN_TILES = {64: replace(_TILES[64], advance_descs=True),
               96: Sm90FwdTile(192, 112, 2, ping_pong=True, advance_descs=True)}


def tile_for(head_dim: int, mask: str, keys_per_row: int | None = None, score_mod: bool = False) -> Sm90FwdTile:
    """The tile of a head dim under a mask and score mods or none; `keys_per_row` bounds the keys a
    row sees (None: not known, the head dim's own tile). In order: SHORT_ROW_TILES over rows of at
    most SHORT_ROW_KEYS keys whatever the mask, PLAIN_TILES without a mask or score mods,
    TWO_CONSUMER_TILES under wide bands and over short causal rows, else _TILES."""
    if head_dim in SHORT_ROW_TILES and keys_per_row is not None and keys_per_row <= SHORT_ROW_KEYS:
        return SHORT_ROW_TILES[head_dim]
    if mask == "none" and not score_mod:
        return PLAIN_TILES.get(head_dim, _TILES[head_dim])
    tile = _TILES[head_dim]
    if keys_per_row is not None and ((mask == "local" and keys_per_row > tile.block_n)
                                     or (mask == "causal" and keys_per_row <= SHORT_ROW_KEYS)):
        return TWO_CONSUMER_TILES.get(head_dim, tile)
    return tile


TILE_SLOTS = 2  # Sm90FwdTraits::kTileSlots
MAX_SMEM = 227 * 1024  # Sm90FwdTraits::kMaxSmem, an sm_90 block's shared memory


def tile_cols(head_dim: int) -> int:
    """Columns a tile's row takes in shared memory: whole 64-column chunks (Sm90FwdTraits::kTileCols;
    at d = 96 the second is half used)."""
    chunk = SWIZZLE_BYTES // 2  # 16-bit columns
    return -(-head_dim // chunk) * chunk


def tile_bytes(head_dim: int, tile: Sm90FwdTile) -> tuple[int, int]:
    """Bytes of one Q (or O) tile and of one K or V tile in shared memory (Sm90FwdTraits::kQBytes,
    kKVBytes)."""
    return tile.block_m * tile_cols(head_dim) * 2, tile.block_n * tile_cols(head_dim) * 2


def q_slots(head_dim: int, tile: Sm90FwdTile) -> int:
    """Q buffers: two where they fit beside the K/V stages (Sm90FwdTraits::kQSlots)."""
    q, kv = tile_bytes(head_dim, tile)
    return 2 if 2 * q + 2 * tile.stages * kv + 2048 <= MAX_SMEM else 1


def o_buffer(head_dim: int, tile: Sm90FwdTile, in_q: bool = True) -> str:
    """Where O's tile is staged for its TMA stores (Sm90FwdTraits::kOOwnBuffer and kOInQ): "own"
    where it fits beside the Q buffers and the K/V stages; else "q", in the one Q buffer, if `in_q`
    (the variant's o_in_q); else "" (each thread stores its fragments)."""
    q, kv = tile_bytes(head_dim, tile)
    slots = q_slots(head_dim, tile)
    if slots * q + 2 * tile.stages * kv + q + 2048 <= MAX_SMEM:
        return "own"
    return "q" if slots == 1 and in_q else ""


# Keys per row up to which the banded kernels at d = 256 (no room for O's own buffer) stage O in the
# Q buffer, as the kernels without a band always do: no 4-byte stores in the epilogue, but the next
# tile's Q waits for O's stores to read the buffer. H100, d = 256: 1.03-1.05 / 1.00-1.02 at 512 / 1k
# causal and 1.01-1.11 under a 1024-key window, 0.97-1.01 causal from 2k; d = 192 read level (0.99-
# 1.02) and keeps one banded instance (docs/PERF_NOTES.md).
BANDED_O_IN_Q_MAX_KEYS = 1280
BANDED_O_IN_Q_HEAD_DIMS = (256,)


def stages_o_in_q(head_dim: int, tile: Sm90FwdTile, mask: str, keys_per_row: int | None = None) -> bool:
    """Whether a variant of this tile stages O in its Q buffer: where the tile has no room for O's
    own buffer, always without a band; under a band at BANDED_O_IN_Q_HEAD_DIMS when a row sees at
    most BANDED_O_IN_Q_MAX_KEYS keys (None: not staged, as varlen calls, which store O's fragments)."""
    if o_buffer(head_dim, tile) != "q":
        return False
    if mask == "none":
        return True
    return head_dim in BANDED_O_IN_Q_HEAD_DIMS and keys_per_row is not None and keys_per_row <= BANDED_O_IN_Q_MAX_KEYS


def smem_bytes(head_dim: int, tile: Sm90FwdTile) -> int:
    """The Q buffers, stages x (K, V), O's tile where it has its own buffer, the mbarriers, the tile slots,
    and 1024 bytes to align the swizzled tiles (Sm90FwdTraits in fwd_sm90.cu)."""
    q, kv = tile_bytes(head_dim, tile)
    slots = q_slots(head_dim, tile)
    barriers = 4 * tile.stages + 2 * slots + 2 * TILE_SLOTS
    o = q if o_buffer(head_dim, tile) == "own" else 0
    return slots * q + 2 * tile.stages * kv + o + barriers * 8 + TILE_SLOTS * 4 + 1024


@dataclass(frozen=True)
class Sm90FwdVariant:
    head_dim: int
    tile: Sm90FwdTile
    mask: str   # one of configs.MASKS
    dtype: str
    score_mod: bool = False  # softcap / ALiBi (cuda_src/score_mod.cuh)
    o_in_q: bool = False  # O's tile staged in the Q buffer (stages_o_in_q)

    source = "fwd_sm90.cu"
    nvrtc_options = NVRTC_OPTIONS + (f"-arch={ARCH}",)

    @property
    def name_expression(self) -> str:
        t = self.tile
        return (f"flash_fwd_sm90_kernel<{self.head_dim}, {t.block_m}, {t.block_n}, {t.stages}, "
                f"{cpp_bool(t.ping_pong)}, {cpp_bool(t.advance_descs)}, {mask_flags(self.mask)}, "
                f"{cpp_bool(self.dtype == 'bfloat16')}, {cpp_bool(self.score_mod)}, {cpp_bool(self.o_in_q)}>")

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.head_dim, self.tile)

    @property
    def layout_check(self) -> str:
        """The shared-memory size, and where O is staged (o_buffer: the O tensor map is written for
        it), as the kernel's traits have them."""
        t = self.tile
        traits = f"Sm90FwdTraits<{self.head_dim}, {t.block_m}, {t.block_n}, {t.stages}>"
        o = o_buffer(self.head_dim, t, self.o_in_q)
        return (build.smem_check(traits, self) + "\n"
                + f"static_assert({traits}::kOOwnBuffer == {cpp_bool(o == 'own')} && ({traits}::kOInQ && "
                  f"{cpp_bool(self.o_in_q)}) == {cpp_bool(o == 'q')}, "
                  f'"{self}: O staged as sm90_fwd.o_buffer says ({o or "nowhere"})");')

    def __str__(self) -> str:
        t = self.tile
        return (f"fwd-sm90 d={self.head_dim} {self.dtype} mask={self.mask}{'+score_mod' if self.score_mod else ''} "
                f"tile={t.block_m}x{t.block_n} "
                f"stages={t.stages}{' ping-pong' if t.ping_pong else ''}{' advance-descs' if t.advance_descs else ''}"
                f"{' o-in-q' if self.o_in_q else ''}")


def variant(head_dim: int, dtype: str, mask: str, score_mod: bool = False,
            keys_per_row: int | None = None, stage_o: bool = True) -> Sm90FwdVariant:
    """The kernel for a head dim, dtype, mask and score mods; `keys_per_row`, the most keys a query
    row may see (None: not known), picks the tile (tile_for) and, unless stage_o is False, where O
    is staged (stages_o_in_q; None: not staged under a band)."""
    mask_flags(mask)  # validates
    tile = tile_for(head_dim, mask, keys_per_row, score_mod)
    return Sm90FwdVariant(head_dim, tile, mask, dtype, bool(score_mod),
                          stages_o_in_q(head_dim, tile, mask, keys_per_row if stage_o else None))


# ----------------------------------------------------------------------------------------------
# Tensor maps
# ----------------------------------------------------------------------------------------------

_TMA_TYPES = {"float16": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT16", 2), "bfloat16": ("CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", 2),
              "float32": ("CU_TENSOR_MAP_DATA_TYPE_FLOAT32", 4)}


@functools.lru_cache(maxsize=4096)
def tensor_map(ptr: int, dtype: str, shape: tuple, strides: tuple, box_rows: int) -> bytes:
    """The 128 bytes of a TMA tensor map over a (batch, seqlen, heads, headdim) tensor at `ptr` with
    element `strides`: a 4-D (headdim, seqlen, heads, batch) view whose boxes are 128 bytes of
    head-dim columns (64 of a 16-bit type, 32 of float32) x box_rows rows of one head, swizzled by
    128 bytes; rows past seqlen read as zeros (and are dropped by stores and reductions)."""
    from cuda.bindings import driver

    type_name, itemsize = _TMA_TYPES[dtype]
    batch, seqlen, heads, head_dim = shape
    dims = [head_dim, seqlen, heads, batch]
    # byte strides of the outer three dims; a dim of extent 1 may have any stride, TMA wants one
    # that is a multiple of 16
    byte_strides = [(s * itemsize if n > 1 else 16) for s, n in ((strides[1], seqlen), (strides[2], heads),
                                                                 (strides[0], batch))]
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tmap = driver.cuTensorMapEncodeTiled(
        getattr(driver.CUtensorMapDataType, type_name), 4, ptr, [u64(x) for x in dims],
        [u64(x) for x in byte_strides], [u32(x) for x in (SWIZZLE_BYTES // itemsize, box_rows, 1, 1)], [u32(1)] * 4,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for shape {shape}, strides {strides}")
    return ctypes.string_at(tmap.getPtr(), TMA_BYTES)


def tensor_map_of(array, dtype: str, box_rows: int) -> bytes:
    """The tensor map of a (batch, seqlen, heads, headdim) array, or of a packed varlen
    (total, heads, headdim) one as a single batch entry."""
    itemsize = array.dtype.itemsize
    shape, strides = tuple(array.shape), tuple(s // itemsize for s in array.strides)
    if len(shape) == 3:
        shape, strides = (1, *shape), (0, *strides)
    return tensor_map(array.data.ptr, dtype, shape, strides, box_rows)


def args_with_maps(head: bytes, maps_offset: int, maps) -> np.void:
    """A Hopper kernel's one argument: `head` (the parameter struct and what follows it), zeros up to
    `maps_offset`, then the 128-byte tensor maps."""
    raw = bytearray(maps_offset + len(maps) * TMA_BYTES)
    raw[:len(head)] = head
    for i, m in enumerate(maps):
        raw[maps_offset + i * TMA_BYTES:maps_offset + (i + 1) * TMA_BYTES] = m
    return np.frombuffer(bytes(raw), np.dtype((np.void, len(raw))))[0]


_FWD_BYTES = params.record_dtype("FwdParams").itemsize
_ARGS_HEAD = struct.Struct(f"<{_FWD_BYTES}s i 4x Q")  # Sm90FwdArgs up to the maps


def pack_args(fwd_record: np.void, section_heads: int, tile_counter: int, maps) -> np.void:
    """Sm90FwdArgs: the FwdParams record, the tile order's section width, the tile counter's address
    (0: none), the q, k, v, out tensor maps."""
    head = _ARGS_HEAD.pack(fwd_record.tobytes(), int(section_heads), int(tile_counter))
    return args_with_maps(head, ARGS_TMA_OFFSET, maps)


_COUNTERS: dict = {}


def tile_counter() -> int:
    """The address of the tile counter of the current device and stream: two int32 zeros that the
    kernel leaves zero when it ends. Kernels in one stream run one after the other, so they can share it."""
    import cupy

    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
    if key not in _COUNTERS:
        _COUNTERS[key] = cupy.zeros(2, dtype=cupy.int32)
    return _COUNTERS[key].data.ptr


def schedule(num_tiles: int, mask: str, device) -> tuple:
    """(blocks, tile counter address or 0): a persistent grid, one block per SM (the tiles' shared
    memory allows no second). Without a mask every tile costs the same and block b takes tiles b,
    b + blocks, ...; causal and local tiles differ, and each block takes the next tile from a counter
    as it frees up (a static round robin measured 10-25% slower there)."""
    blocks = min(num_tiles, device.sm_count)
    return blocks, (0 if mask == "none" else tile_counter())


L2_BYTES = 50 * 2**20  # what the tile orders keep in L2 at once (H100 and H200: 50 MiB of L2)


def pairs_in_l2(pair_bytes: int, pairs: int) -> int:
    """How many (head, batch) pairs whose `pair_bytes` each fit in L2 together, rounded down to a
    power of two (at least 1, at most `pairs`): the section width of the Hopper kernels' tile orders
    (grid.cuh's section_coords)."""
    fit = max(1, L2_BYTES // max(1, pair_bytes))
    return min(1 << (fit.bit_length() - 1), pairs)


# Queries from which causal and local problems interleave pairs in sections: sections measured
# 2-6% faster than one pair at a time at 2k-8k tokens on an H100 and, on an H200 (7 alternating
# rounds at the steady clock), 4% faster at 1k (d=128 and 256; d=64 level) and 1.4% slower at 512,
# where a pair's few blocks run best together (docs/PERF_NOTES.md)
SECTIONS_FROM_QUERIES = 1024


def section_heads(problem, mask: str) -> int:
    """How many (head, batch) pairs' q blocks the tile order interleaves (fwd_sm90.cu's tile_at):
    for causal and local problems from SECTIONS_FROM_QUERIES queries, as many as have K and V in L2
    together, so that the heaviest blocks of several heads start first while their keys stay in L2;
    else 1, each head's blocks in order (without a mask every tile costs the same)."""
    if mask == "none" or problem.max_seqlen_q < SECTIONS_FROM_QUERIES:
        return 1
    return pairs_in_l2(max(1, problem.max_seqlen_k) * problem.head_dim * 2 * 2, problem.nheads * problem.batch)


# ----------------------------------------------------------------------------------------------
# The family
# ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _bindings_missing() -> str | None:
    """Why the tensor maps cannot be encoded here (cuda-bindings not installed), or None."""
    from .device import EXTRAS, has_cuda_bindings, install_hint

    if not has_cuda_bindings():
        return (f"needs NVIDIA's cuda-bindings for its tensor maps ({install_hint(*EXTRAS.values())}, "
                "the extra of the driver's CUDA major)")
    return None


def hopper_unsupported(problem, device, head_dims, smem_bytes) -> str | None:
    """Why a Hopper family does not serve `problem` on `device`, or None: the GPU, its head dims,
    empty sequences, strides the tensor maps cannot take, smem_bytes() (its tiles' shared memory,
    asked once the head dim is one of its own), and cuda-bindings for the tensor maps."""
    if device.capability != 90:
        return f"Hopper (compute capability 9.0) only; this GPU has {device.capability // 10}.{device.capability % 10}"
    if problem.head_dim not in head_dims:
        return f"head dim {problem.head_dim} is not one of {head_dims}"
    if problem.max_seqlen_q == 0 or problem.max_seqlen_k == 0:
        return "empty sequences"
    if not problem.positive_strides:
        return "an input with a zero or negative stride (a broadcast or reversed view): its TMA tensor maps take " \
               "positive strides"
    if smem_bytes() > device.smem_per_block_optin:
        return "its tiles need more shared memory than this GPU grants a block"
    return _bindings_missing()


class HopperFamily(Family):
    """What the sm90 families share: they run on compute capability 9.0 only, and CI compiles each
    of their variants for sm_90a."""
    name = "sm90"
    archs = (ARCH,)

    def runs_on(self, capability):
        return capability == 90

    def ci_cases(self) -> list:
        return [(v, ARCH) for v in self.variants(90)]


class Sm90Forward(HopperFamily):
    direction = "fwd"
    summary = "FlashAttention-3 forward: TMA, wgmma, producer/consumer warpgroups (cuda_src/fwd_sm90.cu)"

    def unsupported(self, problem, device):
        return hopper_unsupported(problem, device, HEAD_DIMS, lambda: self.variant(problem, device).smem_bytes)

    def variant(self, problem, device) -> Sm90FwdVariant:
        # varlen stores O's fragments with either instance (a box would write over the next sequence's
        # rows), so it takes the one without O in the Q buffer under a band
        return variant(problem.head_dim, problem.dtype, problem.band.mask, problem.score_mod, problem.keys_per_row,
                       stage_o=not problem.is_varlen)

    def variants(self, capability, smem_optin=None, head_dims=HEAD_DIMS, dtypes=("float16", "bfloat16"),
                 masks=("none", "causal", "local"), score_mods=(False, True), deterministic=(False, True)) -> list:
        if not self.runs_on(capability):
            return []
        # each banded case also with O in the Q buffer where stages_o_in_q allows it (short rows), and
        # in the tile of wide bands (tile_for)
        found = [variant(d, dt, m, mod, keys) for d in head_dims if d in HEAD_DIMS for dt in dtypes for m in masks
                 for mod in score_mods for keys in (None, 0, MAX_ROWS)]
        return list(dict.fromkeys(found))

    def run(self, problem, device, q, k, v, out, lse) -> None:
        var = self.variant(problem, device)
        tile = var.tile
        num_tiles = grid_blocks(-(-problem.max_seqlen_q // tile.block_m) * problem.nheads * problem.batch,
                                "q blocks x heads x batch")
        blocks, counter = schedule(num_tiles, var.mask, device)
        plan = LaunchPlan((blocks, 1, 1), (tile.threads, 1, 1), var.smem_bytes)
        record = params.pack("FwdParams", params.fwd_values(problem, q, k, v, out, lse))
        maps = (tensor_map_of(q, problem.dtype, tile.block_m), tensor_map_of(k, problem.dtype, tile.block_n),
                tensor_map_of(v, problem.dtype, tile.block_n), bytes(TMA_BYTES))
        args = pack_args(record, section_heads(problem, var.mask), counter, maps)
        # FwdParams opens Sm90FwdArgs: its pointer offsets hold in the whole argument
        writes = params.buffer_writes("FwdParams", params.FWD_BUFFERS)
        # out's map, written with its pointer, where the kernel stages O (varlen stores fragments)
        if o_buffer(problem.head_dim, tile, var.o_in_q) and not problem.is_varlen:
            dtype = problem.dtype
            writes += ((ARGS_TMA_OFFSET + 3 * TMA_BYTES, "out", lambda out: tensor_map_of(out, dtype, O_BOX_ROWS)),)
        launch = Replay(build.get_kernel(var), plan, args.tobytes(), writes)
        launch({"out": out, "lse": lse})
        return launch
