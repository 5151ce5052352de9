"""Tile configurations: the Python side of the kernels' traits.

This table is the single source of truth for tile sizes: the dispatcher reads it, the build layer
turns an entry into template arguments, and the C++ side only static_asserts what it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
DTYPE_NAMES = ("float16", "bfloat16")
# Masking modes of the kernels (cuda_src/mask.cuh): none; bottom-right causal; the general band
# (sliding windows, causal with a window, top-left causal), whose bounds are run-time arguments.
MASKS = ("none", "causal", "local")


def mask_flags(mask: str) -> str:
    """The kernels' `Is_causal, Is_local` template arguments for a masking mode."""
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}; got {mask!r}")
    return f"{str(mask == 'causal').lower()}, {str(mask == 'local').lower()}"

_MOD_TAG = {False: "", True: "+score_mod"}

# Padding of each shared-memory row, in elements (see cuda_src/tile.cuh).
SMEM_ROW_PAD = 8
BYTES_PER_ELEMENT = 2

# Opt-in shared memory per block, by compute capability (CUDA programming guide, table of
# technical specifications). Used when no device can be asked, e.g. for CI's compile checks.
SMEM_PER_BLOCK_OPTIN = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}


@dataclass(frozen=True)
class FwdTile:
    """Tile shape of the forward kernel for one head dim."""

    block_m: int  # query rows per thread block
    block_n: int  # keys per inner-loop step
    num_warps: int

    @property
    def threads(self) -> int:
        return 32 * self.num_warps


# Forward tiles of the sm80 path, by head dim. Each warp owns block_m / num_warps rows (a multiple
# of 16). Larger head dims take smaller key blocks so accumulators stay in registers.
_FWD_TILES_SM80 = {
    32: FwdTile(128, 128, 4),
    64: FwdTile(128, 128, 4),
    96: FwdTile(128, 64, 4),
    128: FwdTile(128, 64, 4),
    192: FwdTile(128, 64, 8),
    256: FwdTile(128, 64, 8),
}
# Devices with ~99 KB of shared memory per block (sm86, sm89) need a smaller q block at d = 256.
_FWD_TILES_SMALL_SMEM = {**_FWD_TILES_SM80, 192: FwdTile(64, 64, 4), 256: FwdTile(64, 64, 4)}


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

    @property
    def source(self) -> str:
        return "fwd.cu"

    @property
    def name_expression(self) -> str:
        """The template instance, as NVRTC's name expressions want it."""
        t = self.tile
        return (f"flash_fwd_kernel<{self.head_dim}, {t.block_m}, {t.block_n}, {t.num_warps}, "
                f"{mask_flags(self.mask)}, {str(self.dtype == 'bfloat16').lower()}, {str(self.score_mod).lower()}>")

    @property
    def smem_bytes(self) -> int:
        return fwd_smem_bytes(self.head_dim, self.tile)

    def __str__(self) -> str:
        t = self.tile
        return (f"fwd d={self.head_dim} {self.dtype} mask={self.mask}{_MOD_TAG[self.score_mod]} "
                f"tile={t.block_m}x{t.block_n} warps={t.num_warps}")


@dataclass(frozen=True)
class BwdTile:
    """Tile shape of the backward kernel for one head dim (cuda_src/bwd.cu, BwdTraits)."""

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
_BWD_TILES_SM80 = {
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


def bwd_tile(head_dim: int, capability: int, smem_optin: int | None = None) -> BwdTile:
    fwd_tile(head_dim, capability, smem_optin)  # same head-dim and capability checks
    limit = smem_optin if smem_optin is not None else smem_limit(capability)
    tile = _BWD_TILES_SM80[head_dim]
    if bwd_smem_bytes(head_dim, tile) > limit:
        tile = _BWD_TILES_SMALL_SMEM[head_dim]
    return tile


def fwd_tile(head_dim: int, capability: int, smem_optin: int | None = None) -> FwdTile:
    """Tile for a forward of this head dim on a device of this compute capability (e.g. 90)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} is not supported; supported head dims: "
                         f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    if capability < 80:
        raise ValueError(f"compute capability {capability // 10}.{capability % 10} is not supported; "
                         "flashcupy needs 8.0 or newer (Ampere, Ada, Hopper)")
    limit = smem_optin if smem_optin is not None else smem_limit(capability)
    tile = _FWD_TILES_SM80[head_dim]
    if fwd_smem_bytes(head_dim, tile) > limit:
        tile = _FWD_TILES_SMALL_SMEM[head_dim]
    return tile


def smem_limit(capability: int) -> int:
    """Opt-in shared memory per block for a compute capability (the nearest known lower one)."""
    known = [c for c in SMEM_PER_BLOCK_OPTIN if c <= capability]
    return SMEM_PER_BLOCK_OPTIN[max(known)] if known else 48 * 1024


def fwd_variant(head_dim: int, dtype: str, mask: str, capability: int, smem_optin: int | None = None,
                score_mod: bool = False) -> FwdVariant:
    mask_flags(mask)  # validates
    return FwdVariant(head_dim, fwd_tile(head_dim, capability, smem_optin), mask, dtype, bool(score_mod))


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

    @property
    def name_expression(self) -> str:
        t = self.tile
        return (f"flash_bwd_kernel<{self.head_dim}, {t.block_m}, {t.block_n}, {t.num_warps}, {t.stages}, "
                f"{mask_flags(self.mask)}, {str(self.dtype == 'bfloat16').lower()}, "
                f"{str(self.deterministic).lower()}, {str(self.score_mod).lower()}>")

    @property
    def smem_bytes(self) -> int:
        return bwd_smem_bytes(self.head_dim, self.tile)

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
    smem_bytes = 0

    @property
    def name_expression(self) -> str:
        return f"{self.kernel}<{self.head_dim}, {str(self.dtype == 'bfloat16').lower()}>"

    def __str__(self) -> str:
        return f"{self.kernel.replace('flash_bwd_', '').replace('_kernel', '')} d={self.head_dim} {self.dtype}"


def bwd_variant(head_dim: int, dtype: str, mask: str, deterministic: bool, capability: int,
                smem_optin: int | None = None, score_mod: bool = False) -> BwdVariant:
    mask_flags(mask)  # validates
    return BwdVariant(head_dim, bwd_tile(head_dim, capability, smem_optin), mask, dtype, bool(deterministic),
                      bool(score_mod))


def all_bwd_variants(capability: int) -> list:
    """Every backward kernel (main, preprocess, dQ convert, GQA group sum) the dispatcher can pick."""
    mains = [bwd_variant(d, dt, m, det, capability, score_mod=mod) for d in SUPPORTED_HEAD_DIMS
             for dt in DTYPE_NAMES for m in MASKS for det in (False, True) for mod in (False, True)]
    helpers = [BwdHelperVariant(kernel, d, dt) for kernel in BWD_HELPER_KERNELS
               for d in SUPPORTED_HEAD_DIMS for dt in DTYPE_NAMES]
    return mains + helpers


def all_fwd_variants(capability: int) -> list[FwdVariant]:
    """Every forward variant the dispatcher can pick on a device of this capability."""
    return [fwd_variant(d, dt, m, capability, score_mod=mod) for d in SUPPORTED_HEAD_DIMS for dt in DTYPE_NAMES
            for m in MASKS for mod in (False, True)]
