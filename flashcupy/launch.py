"""Launch geometry shared by the kernel families: the plan of one launch, the grid limit, and the
block orders of cuda_src/grid.cuh mirrored for tests."""

from __future__ import annotations

from dataclasses import dataclass

MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class LaunchPlan:
    grid: tuple  # (x, y, z)
    block: tuple
    smem_bytes: int
    programmatic: bool = False  # programmatic stream serialization: the kernel calls griddep_wait first


def grid_blocks(count: int, what: str) -> int:
    """`count` thread blocks on a grid's x dimension, or a ValueError that says what was too large."""
    if count > MAX_GRID_X:
        raise ValueError(f"{what} need {count} thread blocks, over the grid limit of 2**31 - 1; split the batch")
    return count


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


def section_coords(index: int, num_tiles: int, pairs: int, section_pairs: int) -> tuple:
    """(tile, pair) of work item `index`, decoded as section_coords in cuda_src/grid.cuh: the
    (head, batch) pairs in sections of `section_pairs`, inside a section the tiles in rows across
    its pairs."""
    section_tiles = section_pairs * num_tiles
    section, in_section = divmod(index, section_tiles)
    width = min(section_pairs, pairs - section * section_pairs)
    return in_section // width, section * section_pairs + in_section % width
