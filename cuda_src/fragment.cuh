// Where the scores of a warp's accumulator fragments sit in the score tile.
//
// Fragments are float s[kMTiles][kNTiles][4]: tiles of 16 rows x 8 columns, of which a thread holds
// 2 rows (h = 0, 1) x 2 columns (e1 = 0, 1) as element e = 2 h + e1. Code that works per score
// (mask.cuh, score_mod.cuh, the backward's P^T and dS^T) takes row(mt, h) and col(nt, e1) from a
// coordinate helper instead of computing them, so it serves any mma whose fragments have this
// shape: the helper alone knows which rows and columns a lane holds.
#pragma once
#include "ptx.cuh"

struct MmaAccCoordsFolded;

// mma.m16n8k16 accumulators of one warp (ptx.cuh), m16 tiles stacked from row_base and n8 tiles
// side by side from col_base; lane = 4 g + t. Element e of tile (mt, nt) is row
// row_base + 16 mt + g + 8 (e / 2), column col_base + 8 nt + 2 t + (e % 2).
struct MmaAccCoords {
    int row_base, col_base, g, t;

    FC_DEVICE MmaAccCoords(int row_base_, int col_base_, int lane)
        : row_base(row_base_), col_base(col_base_), g(lane >> 2), t(lane & 3) {}
    FC_DEVICE int row(int mt, int h) const { return row_base + 16 * mt + g + 8 * h; }
    FC_DEVICE int col(int nt, int e1) const { return col_base + 8 * nt + 2 * t + e1; }
    FC_DEVICE MmaAccCoordsFolded folded() const;
};

// The same coordinates with the lane's offsets folded into one origin: two values to carry instead
// of four. Both forms give the same numbers; the compiler associates the sums differently, so a
// caller keeps the form under which its code compiles best (ProbsAndGrads in bwd.cu takes this one).
struct MmaAccCoordsFolded {
    int row0, col0;  // row and column of this thread's element 0 of tile (0, 0)

    FC_DEVICE int row(int mt, int h) const { return row0 + 16 * mt + 8 * h; }
    FC_DEVICE int col(int nt, int e1) const { return col0 + 8 * nt + e1; }
};

FC_DEVICE MmaAccCoordsFolded MmaAccCoords::folded() const { return {row_base + g, col_base + 2 * t}; }
