"""Launch geometry and device buffers of the kernels."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .configs import BwdVariant, FwdVariant


@dataclass(frozen=True)
class LaunchPlan:
    grid: tuple  # (x, y, z)
    block: tuple
    smem_bytes: int


def plan_forward(variant: FwdVariant, batch: int, nheads: int, seqlen_q: int) -> LaunchPlan:
    """A 1-D grid of (q blocks x heads x batch) thread blocks, each owning block_m query rows of
    one head; the kernel decodes its coordinates as block_coords() below does. Varlen: seqlen_q is
    the longest sequence's."""
    tile = variant.tile
    num_blocks = -(-seqlen_q // tile.block_m) * nheads * batch
    if num_blocks >= 2**31:
        raise ValueError(f"batch * nheads * ceil(seqlen_q / {tile.block_m}) = {num_blocks} thread blocks "
                         "exceeds the grid limit of 2**31 - 1; split the batch")
    return LaunchPlan((num_blocks, 1, 1), (tile.threads, 1, 1), variant.smem_bytes)


@dataclass(frozen=True)
class Band:
    """The kernels' masking (cuda_src/mask.cuh): mode "none", "causal" (bottom-right) or "local",
    the band where row i sees keys [i + offset - left, i + offset + right]; the kernels take
    offset = seqlen_k - seqlen_q of each sequence when bottom_right, else 0."""

    mask: str
    bottom_right: bool = True
    left: int = 0
    right: int = 0

    def kernel_args(self):
        return (np.int32(self.bottom_right), np.int32(self.left), np.int32(self.right))


def plan_band(causal: bool, window_size, alignment: str, seqlen_q: int, seqlen_k: int) -> Band:
    """Plain bottom-right causal takes the kernels' own causal instance; every other band the local
    one, where causal is right = 0 and -1 in window_size a bound no row reaches. Varlen: the
    longest sequences' lengths."""
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    bottom_right = alignment == "bottom_right"  # also ALiBi's offset, whatever the mask
    if left < 0 and right < 0:
        return Band("none", bottom_right)
    if causal and left < 0 and bottom_right:
        return Band("causal")
    unbounded = seqlen_q + seqlen_k + 256  # past every row's keys, even counted from a block's last row
    if unbounded >= 2**30:
        raise ValueError(f"seqlen_q + seqlen_k = {seqlen_q + seqlen_k} is too large for the kernels' 32-bit "
                         "row arithmetic")
    return Band("local", bottom_right, left if left >= 0 else unbounded, right if right >= 0 else unbounded)


@dataclass(frozen=True)
class BackwardPlans:
    preprocess: LaunchPlan  # D = rowsum(dO * O): 16 rows per 128-thread block
    main: LaunchPlan        # one block per (key block, head, batch)
    convert_dq: LaunchPlan  # 8 elements per thread
    group_sum: LaunchPlan   # GQA: 8 elements of dK or dV per thread
    semaphores: tuple       # shape of the deterministic mode's dq semaphores: (batch, nheads, q blocks)


PREPROCESS_ROWS_PER_BLOCK = 16
CONVERT_THREADS = 256


def plan_backward(variant: BwdVariant, batch: int, nheads: int, seqlen_q: int, seqlen_k: int,
                  nheads_k: int | None = None, rows_q: int | None = None, rows_k: int | None = None) -> BackwardPlans:
    """seqlen_q, seqlen_k: the (longest) sequence lengths, which size the main grid; rows_q, rows_k:
    the rows of q and of k in memory (batch * seqlen when padded, the packed totals for varlen),
    which the row-wise helpers run over."""
    tile = variant.tile
    nheads_k = nheads if nheads_k is None else nheads_k
    rows_q = batch * seqlen_q if rows_q is None else rows_q
    rows_k = batch * seqlen_k if rows_k is None else rows_k
    num_blocks = -(-seqlen_k // tile.block_n) * nheads * batch
    stat_rows = rows_q * nheads
    chunks_q = rows_q * nheads * variant.head_dim // 8
    chunks_k = rows_k * nheads_k * variant.head_dim // 8
    if max(num_blocks, -(-stat_rows // PREPROCESS_ROWS_PER_BLOCK), -(-chunks_q // CONVERT_THREADS)) >= 2**31:
        raise ValueError("the problem needs more than 2**31 - 1 thread blocks; split the batch")
    return BackwardPlans(
        preprocess=LaunchPlan((-(-stat_rows // PREPROCESS_ROWS_PER_BLOCK), 1, 1), (128, 1, 1), 0),
        main=LaunchPlan((num_blocks, 1, 1), (tile.threads, 1, 1), variant.smem_bytes),
        convert_dq=LaunchPlan((-(-chunks_q // CONVERT_THREADS), 1, 1), (CONVERT_THREADS, 1, 1), 0),
        group_sum=LaunchPlan((-(-chunks_k // CONVERT_THREADS), 1, 1), (CONVERT_THREADS, 1, 1), 0),
        semaphores=(batch, nheads, -(-seqlen_q // tile.block_m)),
    )


def block_coords(block: int, num_blocks: int, num_tiles: int, nheads: int, tiles_outer: bool,
                 reverse_tiles: bool) -> tuple:
    """(tile, head, batch) of thread block `block`, decoded as block_coords in cuda_src/grid.cuh:
    with tiles_outer every head's tile 0 comes first (causal: heaviest first, reversed when the
    heaviest tile is the last); otherwise the tiles of one head are adjacent (shared K/V in L2)."""
    if tiles_outer:
        heads_total = num_blocks // num_tiles
        tile, hb = block // heads_total, block % heads_total
    else:
        tile, hb = block % num_tiles, block // num_tiles
    if reverse_tiles:
        tile = num_tiles - 1 - tile
    return tile, hb % nheads, hb // nheads
