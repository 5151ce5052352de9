// Which (tile, head, batch) the thread block with linear index `block` owns, on a 1-D grid of
// num_tiles * nheads * batch blocks (a tile is a q block in the forward, a key block in the
// backward). With Tiles_outer false, the tiles of one head are adjacent, so the blocks that run
// together stream the same K, V (forward) or Q, dO (backward) through L2. With Tiles_outer true
// (causal), work per tile is uneven: every head's heaviest tile goes first, the light ones fill
// the tail; Reverse_tiles says the heaviest tile is the last one (forward: the bottom q block).
// flashcupy/launch.py mirrors this for its tests.
#pragma once
#include "ptx.cuh"

template <bool Tiles_outer, bool Reverse_tiles>
FC_DEVICE void block_coords(int block, int num_tiles, int nheads, int& tile, int& head, int& batch) {
    int hb;
    if (Tiles_outer) {
        const int heads_total = gridDim.x / num_tiles;  // nheads * batch
        hb = block % heads_total;
        tile = block / heads_total;
    } else {
        tile = block % num_tiles;
        hb = block / num_tiles;
    }
    if (Reverse_tiles) tile = num_tiles - 1 - tile;
    head = hb % nheads;
    batch = hb / nheads;
}

// Which tile and (head, batch) pair the work item `index` is, where the pairs go in sections of
// section_pairs, one section after the other, and inside a section the tiles go in rows across its
// pairs (every pair's first tile, then every pair's second, ...; the last section may be
// narrower). One pair per section: each pair's tiles in order, the pairs one after the other. The
// Hopper kernels take sections of pairs whose operands fit in L2 together (flashcupy/sm90_fwd.py).
FC_DEVICE void section_coords(int index, int num_tiles, int pairs, int section_pairs, int& tile, int& pair) {
    const int section_tiles = section_pairs * num_tiles;
    const int section = index / section_tiles, in_section = index % section_tiles;
    const int width = min(section_pairs, pairs - section * section_pairs);
    tile = in_section / width;
    pair = section * section_pairs + in_section % width;
}
