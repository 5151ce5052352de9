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
