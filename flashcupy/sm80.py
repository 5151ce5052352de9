"""The sm80 kernel families: FlashAttention-2 forward and backward on mma.sync, ldmatrix and cp.async
(cuda_src/fwd.cu, cuda_src/bwd.cu). They run on every GPU of compute capability 8.0 or newer: Ampere,
Ada, and Hopper wherever no Hopper family serves a problem.

This module holds what is theirs: the tile table (the Python side of FwdTraits / BwdTraits), the
kernel variants, the launch plans and the launches. The kernels own their shared-memory layout;
`layout_check` asserts that Python's size for each variant is the kernel's (compiled in CI).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import build, params
from .configs import DTYPE_NAMES, MASKS, SUPPORTED_HEAD_DIMS, cpp_bool, mask_flags, smem_limit
from .launch import LaunchPlan, grid_blocks
from .registry import Family
from .replay import Buffers, CallReplay, Replay

NVRTC_OPTIONS = ("-std=c++17",)
MIN_CAPABILITY = 80
# Padding of each shared-memory row, in elements (cuda_src/tile.cuh).
SMEM_ROW_PAD = 8
BYTES_PER_ELEMENT = 2

_MOD_TAG = {False: "", True: "+score_mod"}


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FwdTile:
    """Tile shape of the forward kernel for one head dim (FwdTraits in fwd.cu)."""

    block_m: int  # query rows per thread block
    block_n: int  # keys per inner-loop step
    num_warps: int

    @property
    def threads(self) -> int:
        return 32 * self.num_warps


# Forward tiles by head dim. Each warp owns block_m / num_warps rows (a multiple of 16). Larger
# head dims take smaller key blocks so accumulators stay in registers.
_FWD_TILES = {
    32: FwdTile(128, 128, 4),
    64: FwdTile(128, 128, 4),
    96: FwdTile(128, 64, 4),
    128: FwdTile(128, 64, 4),
    192: FwdTile(128, 64, 8),
    256: FwdTile(128, 64, 8),
}
# Devices with ~99 KB of shared memory per block (sm86, sm89) need a smaller q block at d = 256.
_FWD_TILES_SMALL_SMEM = {**_FWD_TILES, 192: FwdTile(64, 64, 4), 256: FwdTile(64, 64, 4)}


def fwd_smem_bytes(head_dim: int, tile: FwdTile) -> int:
    """Dynamic shared memory of the forward kernel: one Q, one K and one V tile (fwd.cu)."""
    return (tile.block_m + 2 * tile.block_n) * (head_dim + SMEM_ROW_PAD) * BYTES_PER_ELEMENT


@dataclass(frozen=True)
class FwdVariant:
    """One compiled instance of the forward kernel."""

    head_dim: int
    tile: FwdTile
    mask: str  # one of MASKS
    dtype: str  # "float16" or "bfloat16"
    score_mod: bool = False  # softcap / ALiBi (cuda_src/score_mod.cuh)

    source = "fwd.cu"
    nvrtc_options = NVRTC_OPTIONS

    @property
    def name_expression(self) -> str:
        """The template instance, as NVRTC's name expressions want it."""
        t = self.tile
        return (f"flash_fwd_kernel<{self.head_dim}, {t.block_m}, {t.block_n}, {t.num_warps}, "
                f"{mask_flags(self.mask)}, {cpp_bool(self.dtype == 'bfloat16')}, {cpp_bool(self.score_mod)}>")

    @property
    def smem_bytes(self) -> int:
        return fwd_smem_bytes(self.head_dim, self.tile)

    @property
    def layout_check(self) -> str:
        t = self.tile
        return build.smem_check(f"FwdTraits<{self.head_dim}, {t.block_m}, {t.block_n}, {t.num_warps}, "
                                f"{mask_flags(self.mask)}, {cpp_bool(self.dtype == 'bfloat16')}>", self)

    def __str__(self) -> str:
        t = self.tile
        return (f"fwd d={self.head_dim} {self.dtype} mask={self.mask}{_MOD_TAG[self.score_mod]} "
                f"tile={t.block_m}x{t.block_n} warps={t.num_warps}")


def fwd_tile(head_dim: int, capability: int, smem_optin: int | None = None) -> FwdTile:
    """Tile for a forward of this head dim on a device of this compute capability (e.g. 90)."""
    _check_head_dim_and_capability(head_dim, capability)
    limit = smem_optin if smem_optin is not None else smem_limit(capability)
    tile = _FWD_TILES[head_dim]
    if fwd_smem_bytes(head_dim, tile) > limit:
        tile = _FWD_TILES_SMALL_SMEM[head_dim]
    return tile


def fwd_variant(head_dim: int, dtype: str, mask: str, capability: int, smem_optin: int | None = None,
                score_mod: bool = False) -> FwdVariant:
    mask_flags(mask)  # validates
    return FwdVariant(head_dim, fwd_tile(head_dim, capability, smem_optin), mask, dtype, bool(score_mod))


def plan_forward(variant: FwdVariant, batch: int, nheads: int, seqlen_q: int) -> LaunchPlan:
    """A 1-D grid of (q blocks x heads x batch) thread blocks, each owning block_m query rows of
    one head; the kernel decodes its coordinates as launch.block_coords does. Varlen: seqlen_q is
    the longest sequence's."""
    tile = variant.tile
    num_blocks = grid_blocks(-(-seqlen_q // tile.block_m) * nheads * batch,
                             f"batch * nheads * ceil(seqlen_q / {tile.block_m})")
    return LaunchPlan((num_blocks, 1, 1), (tile.threads, 1, 1), variant.smem_bytes)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BwdTile:
    """Tile shape of the backward kernel for one head dim (BwdTraits in bwd.cu)."""

    block_m: int  # query rows per inner-loop step
    block_n: int  # keys per thread block; each warp owns 16 keys of it
    num_warps: int
    stages: int  # 2: the next Q, dO block is prefetched during this one

    @property
    def threads(self) -> int:
        return 32 * self.num_warps


# Backward tiles by head dim. Warps past block_n / 16 split the head dim of dK, dV (192, 256).
# Measured on an H200 against the alternatives (docs/PERF_NOTES.md): at d = 64 a 128-row q block
# beats 64; with dQ staged through the Q/dO stage, two stages beat one at d = 128.
_BWD_TILES = {
    32: BwdTile(128, 128, 8, 2),
    64: BwdTile(128, 128, 8, 2),
    96: BwdTile(64, 128, 8, 2),
    128: BwdTile(64, 128, 8, 2),
    192: BwdTile(64, 64, 8, 1),
    256: BwdTile(64, 64, 8, 1),
}
_BWD_TILES_SMALL_SMEM = {
    32: BwdTile(64, 128, 8, 2),
    64: BwdTile(64, 128, 8, 2),
    96: BwdTile(64, 64, 4, 1),
    128: BwdTile(64, 64, 4, 1),
    192: BwdTile(32, 64, 8, 1),
    256: BwdTile(32, 32, 4, 1),
}


def bwd_smem_bytes(head_dim: int, tile: BwdTile) -> int:
    """Dynamic shared memory of the backward kernel: K, V, `stages` x (Q, dO, LSE, D), dS^T (bwd.cu)."""
    pitch = (head_dim + SMEM_ROW_PAD) * BYTES_PER_ELEMENT
    kv = 2 * tile.block_n * pitch
    q_do = 2 * tile.stages * tile.block_m * pitch
    ds = tile.block_n * (tile.block_m + SMEM_ROW_PAD) * BYTES_PER_ELEMENT
    stats = 2 * tile.stages * tile.block_m * 4
    return kv + q_do + ds + stats


@dataclass(frozen=True)
class BwdVariant:
    """One compiled instance of the backward's main kernel."""

    head_dim: int
    tile: BwdTile
    mask: str  # one of MASKS
    dtype: str
    deterministic: bool
    score_mod: bool = False  # softcap / ALiBi (cuda_src/score_mod.cuh)

    source = "bwd.cu"
    nvrtc_options = NVRTC_OPTIONS

    @property
    def name_expression(self) -> str:
        t = self.tile
        return (f"flash_bwd_kernel<{self.head_dim}, {t.block_m}, {t.block_n}, {t.num_warps}, {t.stages}, "
                f"{mask_flags(self.mask)}, {cpp_bool(self.dtype == 'bfloat16')}, "
                f"{cpp_bool(self.deterministic)}, {cpp_bool(self.score_mod)}>")

    @property
    def smem_bytes(self) -> int:
        return bwd_smem_bytes(self.head_dim, self.tile)

    @property
    def layout_check(self) -> str:
        t = self.tile
        return build.smem_check(f"BwdTraits<{self.head_dim}, {t.block_m}, {t.block_n}, {t.num_warps}, {t.stages}>",
                                self)

    def __str__(self) -> str:
        t = self.tile
        return (f"bwd d={self.head_dim} {self.dtype} mask={self.mask}{_MOD_TAG[self.score_mod]} "
                f"deterministic={self.deterministic} "
                f"tile={t.block_m}x{t.block_n} warps={t.num_warps} stages={t.stages}")


BWD_HELPER_KERNELS = ("flash_bwd_preprocess_kernel", "flash_bwd_convert_dq_kernel", "flash_bwd_group_sum_kernel")


@dataclass(frozen=True)
class BwdHelperVariant:
    """The backward's preprocess (D = rowsum(dO * O)), dQ-convert or GQA group-sum kernel for one head
    dim, dtype."""

    kernel: str  # one of BWD_HELPER_KERNELS
    head_dim: int
    dtype: str

    source = "bwd.cu"
    nvrtc_options = NVRTC_OPTIONS
    smem_bytes = 0
    layout_check = ""

    @property
    def name_expression(self) -> str:
        return f"{self.kernel}<{self.head_dim}, {cpp_bool(self.dtype == 'bfloat16')}>"

    def __str__(self) -> str:
        return f"{self.kernel.replace('flash_bwd_', '').replace('_kernel', '')} d={self.head_dim} {self.dtype}"


def bwd_tile(head_dim: int, capability: int, smem_optin: int | None = None) -> BwdTile:
    _check_head_dim_and_capability(head_dim, capability)
    limit = smem_optin if smem_optin is not None else smem_limit(capability)
    tile = _BWD_TILES[head_dim]
    if bwd_smem_bytes(head_dim, tile) > limit:
        tile = _BWD_TILES_SMALL_SMEM[head_dim]
    return tile


def bwd_variant(head_dim: int, dtype: str, mask: str, deterministic: bool, capability: int,
                smem_optin: int | None = None, score_mod: bool = False) -> BwdVariant:
    mask_flags(mask)  # validates
    return BwdVariant(head_dim, bwd_tile(head_dim, capability, smem_optin), mask, dtype, bool(deterministic),
                      bool(score_mod))


@dataclass(frozen=True)
class BackwardPlans:
    preprocess: LaunchPlan  # D = rowsum(dO * O): 16 rows per 128-thread block
    main: LaunchPlan        # one block per (key block, head, batch)
    convert_dq: LaunchPlan  # 8 elements per thread
    group_sum: LaunchPlan   # GQA: 8 elements of dK (y = 0) or dV (y = 1) per thread
    semaphores: tuple       # shape of the deterministic mode's dq semaphores: (batch, nheads, q blocks)


PREPROCESS_ROWS_PER_BLOCK = 16
CONVERT_THREADS = 256


def plan_backward(variant: BwdVariant, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                  nheads_k: int | None = None, rows_q: int | None = None, rows_k: int | None = None,
                  q_block: int | None = None) -> BackwardPlans:
    """seqlen_q, seqlen_k: the (longest) sequence lengths, which size the main grid; rows_q, rows_k:
    the rows of q and of k in memory (batch * seqlen when padded, the packed totals for varlen),
    which the row-wise helpers run over. q_block: the main kernel's q rows per deterministic-mode
    semaphore when another family's main kernel runs between these helpers (default this tile's)."""
    tile = variant.tile
    q_block = tile.block_m if q_block is None else q_block
    nheads_k = nheads if nheads_k is None else nheads_k
    rows_q = batch * seqlen_q if rows_q is None else rows_q
    rows_k = batch * seqlen_k if rows_k is None else rows_k
    main = grid_blocks(-(-seqlen_k // tile.block_n) * nheads * batch, "the backward's key blocks")
    preprocess = grid_blocks(-(-rows_q * nheads // PREPROCESS_ROWS_PER_BLOCK), "the backward's preprocess")
    convert = grid_blocks(-(-rows_q * nheads * variant.head_dim // 8 // CONVERT_THREADS), "the dQ conversion")
    group_sum = grid_blocks(-(-rows_k * nheads_k * variant.head_dim // 8 // CONVERT_THREADS), "the GQA group sum")
    return BackwardPlans(
        preprocess=LaunchPlan((preprocess, 1, 1), (128, 1, 1), 0),
        main=LaunchPlan((main, 1, 1), (tile.threads, 1, 1), variant.smem_bytes),
        convert_dq=LaunchPlan((convert, 1, 1), (CONVERT_THREADS, 1, 1), 0),
        group_sum=LaunchPlan((group_sum, 2, 1), (CONVERT_THREADS, 1, 1), 0),
        semaphores=(batch, nheads, -(-seqlen_q // q_block)),
    )


def _check_head_dim_and_capability(head_dim: int, capability: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} is not supported; supported head dims: "
                         f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    if capability < MIN_CAPABILITY:
        raise ValueError(f"compute capability {capability // 10}.{capability % 10} is not supported; "
                         "flashcupy needs 8.0 or newer (Ampere, Ada, Hopper)")


# ----------------------------------------------------------------------------------------------
# The families
# ----------------------------------------------------------------------------------------------

def _runs_on(capability: int) -> bool:
    return capability >= MIN_CAPABILITY


def _unsupported(problem, device) -> str | None:
    if device.capability < MIN_CAPABILITY:
        return f"needs compute capability 8.0 or newer; this GPU has {device.capability // 10}.{device.capability % 10}"
    if problem.head_dim not in SUPPORTED_HEAD_DIMS:
        return f"head dim {problem.head_dim} is not one of {SUPPORTED_HEAD_DIMS}"
    return None


class Sm80Forward(Family):
    name = "sm80"
    direction = "fwd"
    archs = ("sm_80", "sm_90a")
    summary = "FlashAttention-2 forward: mma.sync, ldmatrix, cp.async (cuda_src/fwd.cu)"

    def runs_on(self, capability):
        return _runs_on(capability)

    def unsupported(self, problem, device):
        return _unsupported(problem, device)

    def variant(self, problem, device) -> FwdVariant:
        return fwd_variant(problem.head_dim, problem.dtype, problem.band.mask, device.capability,
                           device.smem_per_block_optin, problem.score_mod)

    def variants(self, capability, smem_optin=None, head_dims=SUPPORTED_HEAD_DIMS, dtypes=DTYPE_NAMES,
                 masks=MASKS, score_mods=(False, True), deterministic=(False, True)) -> list:
        return [fwd_variant(d, dt, m, capability, smem_optin, mod)
                for d in head_dims for dt in dtypes for m in masks for mod in score_mods]

    def ci_cases(self) -> list:
        return _ci_cases(self)

    def run(self, problem, device, q, k, v, out, lse) -> Replay:
        variant = self.variant(problem, device)
        plan = plan_forward(variant, problem.batch, problem.nheads, problem.max_seqlen_q)
        args = params.pack("FwdParams", params.fwd_values(problem, q, k, v, out, lse))
        launch = Replay(build.get_kernel(variant), plan, args.tobytes(),
                        params.buffer_writes("FwdParams", params.FWD_BUFFERS))
        launch({"out": out, "lse": lse})
        return launch


class Sm80Backward(Family):
    name = "sm80"
    direction = "bwd"
    archs = ("sm_80", "sm_90a")
    summary = ("FlashAttention-2 backward: preprocess, key-block kernel with float32 dQ reductions, dQ "
               "conversion, GQA group sum (cuda_src/bwd.cu)")

    def runs_on(self, capability):
        return _runs_on(capability)

    def unsupported(self, problem, device):
        return _unsupported(problem, device)

    def variant(self, problem, device) -> BwdVariant:
        return bwd_variant(problem.head_dim, problem.dtype, problem.band.mask, problem.options.deterministic,
                           device.capability, device.smem_per_block_optin, problem.score_mod)

    def variants(self, capability, smem_optin=None, head_dims=SUPPORTED_HEAD_DIMS, dtypes=DTYPE_NAMES,
                 masks=MASKS, score_mods=(False, True), deterministic=(False, True)) -> list:
        """Main kernels, then the preprocess, dQ-convert and group-sum kernels of the head dims."""
        mains = [bwd_variant(d, dt, m, det, capability, smem_optin, mod) for d in head_dims for dt in dtypes
                 for m in masks for det in deterministic for mod in score_mods]
        helpers = [BwdHelperVariant(kernel, d, dt) for kernel in BWD_HELPER_KERNELS
                   for d in head_dims for dt in dtypes]
        return mains + helpers

    def ci_cases(self) -> list:
        return _ci_cases(self)

    def run(self, problem, device, dout, q, k, v, out, lse, dq, dk, dv):
        """dq, dk, dv written; returns D = rowsum(dO * O), laid out as the LSE, and the call's launches
        (replay.CallReplay)."""
        variant = self.variant(problem, device)

        def main(record, writes, plans):
            return Replay(build.get_kernel(variant), plans.main, record, writes)

        return run_backward(problem, device, main, dout, q, k, v, out, lse, dq, dk, dv)


def dq_accum_shape(q_shape: tuple, head_dim: int) -> tuple:
    """The float32 dQ accumulator's shape (BwdParams::dq_accum): heads before rows, (batch, nheads,
    seqlen_q, headdim), or (nheads, total_q, headdim) for a packed varlen batch, so that the rows of a
    q block of one head lie together (at d=256 the sm90 backward's reductions measured 4-8% faster
    than into (batch, seqlen_q, nheads, headdim) on an H200)."""
    if len(q_shape) == 3:
        return (q_shape[1], q_shape[0], head_dim)
    return (q_shape[0], q_shape[2], q_shape[1], head_dim)


def dq_accum_rows_view(dq_accum):
    """dq_accum seen in q's index order, (batch, seqlen_q, nheads, headdim) or (total_q, nheads,
    headdim), with its own strides (for a tensor map)."""
    return dq_accum.transpose(1, 0, 2) if dq_accum.ndim == 3 else dq_accum.transpose(0, 2, 1, 3)


def run_backward(problem, device, main, dout, q, k, v, out, lse, dq, dk, dv, q_block=None):
    """A backward around a family's main kernel: the preprocess (D, dq_accum = 0), the main kernel
    (dK, dV; dQ into dq_accum), the dQ conversion and, under GQA, the group sum; dq, dk, dv written.
    main(BwdParams bytes, their buffer writes, plans) gives the main kernel's Replay; the helpers are
    this family's kernels. Returns D (laid out as the LSE) and the call's launches with the buffers
    they need (replay.CallReplay), which run the same call again over fresh buffers.
    q_block: the main kernel's q rows per deterministic-mode semaphore (plan_backward)."""
    import cupy

    p = problem
    variant = bwd_variant(p.head_dim, p.dtype, p.band.mask, p.options.deterministic, device.capability,
                          device.smem_per_block_optin, p.score_mod)
    # The row-wise kernels (preprocess, dQ convert, GQA sum) take rows as (batch, seqlen); a packed
    # varlen batch is one sequence of all its rows.
    rows_batch, rows_q, rows_k = (1, q.shape[0], k.shape[0]) if p.is_varlen else (
        p.batch, p.max_seqlen_q, p.max_seqlen_k)
    plans = plan_backward(variant, p.batch, p.nheads, p.max_seqlen_q, p.max_seqlen_k, p.nheads_k,
                          rows_q=rows_batch * rows_q, rows_k=rows_batch * rows_k, q_block=q_block)
    # What the call allocates besides dq, dk, dv: D, the float32 dQ accumulator, the deterministic
    # mode's semaphores, and under GQA dK, dV per query head (the group sum adds each group).
    specs = {"dq": (q.shape, q.dtype, False), "dk": (k.shape, k.dtype, False), "dv": (v.shape, v.dtype, False),
             "delta": (lse.shape, cupy.float32, False),
             "dq_accum": (dq_accum_shape(q.shape, p.head_dim), cupy.float32, False)}
    if p.options.deterministic:
        specs["semaphore"] = (plans.semaphores, cupy.int32, True)
    if p.is_gqa:
        per_head_shape = (*k.shape[:-2], p.nheads, p.head_dim)
        specs.update(dk_heads=(per_head_shape, q.dtype, False), dv_heads=(per_head_shape, q.dtype, False))
    buffers = Buffers(specs, aliases={} if p.is_gqa else {"dk_heads": "dk", "dv_heads": "dv"})
    b = buffers.allocate({"dq": dq, "dk": dk, "dv": dv})
    values = params.bwd_values(p, dout, q, k, v, out, lse, b["delta"], b["dq_accum"], b["dq"], b["dk_heads"],
                               b["dv_heads"], b["dk"], b["dv"], b.get("semaphore"), rows_batch, rows_q, rows_k)
    record = params.pack("BwdParams", values).tobytes()
    writes = params.buffer_writes("BwdParams", params.BWD_BUFFERS)

    def helper(kernel, plan):
        return Replay(build.get_kernel(BwdHelperVariant(kernel, p.head_dim, p.dtype)), plan, record, writes)

    launches = [helper("flash_bwd_preprocess_kernel", plans.preprocess),  # D, and dq_accum = 0
                main(record, writes, plans),                              # dK, dV; dQ into dq_accum
                helper("flash_bwd_convert_dq_kernel", plans.convert_dq)]  # dQ = dq_accum * scale
    if p.is_gqa:
        launches.append(helper("flash_bwd_group_sum_kernel", plans.group_sum))
    for launch in launches:
        launch(b)
    return b["delta"], CallReplay(buffers, launches)


def _ci_cases(family) -> list:
    """(variant, arch) pairs CI compiles: every instance Hopper's dispatcher picks, each once, bfloat16
    for sm_90a and float16 for sm_80, so each dtype and each arch path (red.v4 on sm90, scalar reds
    before) is built with every mask, score-mod and deterministic setting; then the tiles only
    Ampere picks (small shared memory), for sm_80, in their plain instances (score mods and the
    deterministic mode add no tile-dependent code). Everything for both archs took over a quarter
    of an hour on CI's two cores."""
    hopper = family.variants(90)
    cases = [(v, "sm_90a" if v.dtype == "bfloat16" else "sm_80") for v in hopper]
    ampere_only = {v: None for c in (80, 86) for v in family.variants(c)
                   if v not in set(hopper) and not getattr(v, "score_mod", False)
                   and not getattr(v, "deterministic", False)}
    return cases + [(v, "sm_80") for v in ampere_only]
