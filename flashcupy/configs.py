"""Tile configurations: the Python side of the kernels' traits.

This table is the single source of truth for tile sizes: the dispatcher reads it, the build layer
turns an entry into template arguments, and the C++ side only static_asserts what it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
DTYPE_NAMES = ("float16", "bfloat16")

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
    causal: bool
    dtype: str  # "float16" or "bfloat16"

    @property
    def source(self) -> str:
        return "fwd.cu"

    @property
    def name_expression(self) -> str:
        """The template instance, as NVRTC's name expressions want it."""
        t = self.tile
        return (f"flash_fwd_kernel<{self.head_dim}, {t.block_m}, {t.block_n}, {t.num_warps}, "
                f"{str(self.causal).lower()}, {str(self.dtype == 'bfloat16').lower()}>")

    @property
    def smem_bytes(self) -> int:
        return fwd_smem_bytes(self.head_dim, self.tile)

    def __str__(self) -> str:
        t = self.tile
        return (f"fwd d={self.head_dim} {self.dtype} causal={self.causal} "
                f"tile={t.block_m}x{t.block_n} warps={t.num_warps}")


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


def fwd_variant(head_dim: int, dtype: str, causal: bool, capability: int,
                smem_optin: int | None = None) -> FwdVariant:
    return FwdVariant(head_dim, fwd_tile(head_dim, capability, smem_optin), bool(causal), dtype)


def all_fwd_variants(capability: int) -> list[FwdVariant]:
    """Every forward variant the dispatcher can pick on a device of this capability."""
    return [fwd_variant(d, dt, c, capability)
            for d in SUPPORTED_HEAD_DIMS for dt in DTYPE_NAMES for c in (False, True)]
