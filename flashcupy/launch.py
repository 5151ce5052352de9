"""Launch geometry and device buffers of the kernels."""

from __future__ import annotations

from dataclasses import dataclass

from .configs import FwdVariant


@dataclass(frozen=True)
class LaunchPlan:
    grid: tuple  # (x, y, z)
    block: tuple
    smem_bytes: int


def plan_forward(variant: FwdVariant, batch: int, nheads: int, seqlen_q: int) -> LaunchPlan:
    """A 1-D grid of (q blocks x heads x batch) thread blocks, each owning block_m query rows of
    one head; the kernel decodes its coordinates as block_coords() below does."""
    tile = variant.tile
    num_blocks = -(-seqlen_q // tile.block_m) * nheads * batch
    if num_blocks >= 2**31:
        raise ValueError(f"batch * nheads * ceil(seqlen_q / {tile.block_m}) = {num_blocks} thread blocks "
                         "exceeds the grid limit of 2**31 - 1; split the batch")
    return LaunchPlan((num_blocks, 1, 1), (tile.threads, 1, 1), variant.smem_bytes)


def block_coords(block: int, num_blocks: int, num_m_blocks: int, nheads: int, causal: bool) -> tuple:
    """(m_block, head, batch) of thread block `block`, as block_coords in cuda_src/fwd.cu decodes it:
    without causal q blocks of one head are adjacent (shared K/V in L2); with causal the heaviest q
    block of every head is launched first, so light blocks fill the tail."""
    if causal:
        heads_total = num_blocks // num_m_blocks
        hb = block % heads_total
        return num_m_blocks - 1 - block // heads_total, hb % nheads, hb // nheads
    return block % num_m_blocks, (block // num_m_blocks) % nheads, block // num_m_blocks // nheads
