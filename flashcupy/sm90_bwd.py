"""The sm90 backward family: the FlashAttention-2 backward on Hopper's TMA, mbarriers and wgmma, with
a producer warpgroup (cuda_src/bwd_sm90.cu), compiled by NVRTC for sm_90a. The preprocess, the dQ
conversion and the GQA group sum are the sm80 family's kernels (sm80.run_backward).

It serves head dims 64, 96, 128, 192 and 256 on compute capability 9.0, with every option of the forward
(masks, GQA, varlen, softcap, ALiBi, sinks) and the deterministic mode (each q block's dQ tiles added
in key-block order, behind a semaphore); `unsupported` says why it leaves other problems to sm80.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from . import build, sm80
from .configs import cpp_bool, mask_flags
from .launch import LaunchPlan, grid_blocks
from .replay import Replay
from .sm90_fwd import (ARCH, NVRTC_OPTIONS, TMA_BYTES, HopperFamily, args_with_maps, hopper_unsupported, pairs_in_l2,
                       tensor_map_of, tile_cols)

HEAD_DIMS = (64, 96, 128, 192, 256)
# Keys per thread block: 128 (64 per consumer warpgroup, on the wgmma's M) up to head dim 128; with
# dK^T and dV^T's columns on M, 96 at 192 (48 per consumer, on N) and 64 at 256
BLOCK_N = {64: 128, 96: 128, 128: 128, 192: 96, 256: 64}
# Q stages by (head dim, queries per step): 3 at d=128 measured level with 2, 4 at d=64 and 64
# queries 1-7% faster than 2; with 128 queries at d=64, 2 fill shared memory; at d=192 and 256 dO
# has one stage of its own (Sm90BwdTraits::kStagesDO), elsewhere it shares Q's
STAGES = {(64, 128): 2, (64, 64): 4, (96, 64): 2, (128, 64): 2, (128, 80): 2, (192, 64): 2, (256, 64): 2}
THREADS = 128 * 3  # a producer and two consumer warpgroups
ARGS_TMA_OFFSET = 512  # Sm90BwdArgs: BwdParams, then the q, k, v, dout, dq_accum tensor maps


# Under a causal mask at head dim 128, 80-query steps from this many queries (measured 2-8% faster
# than 64 from 2k, 1-2% slower at 512 and 1k)
CAUSAL_80_FROM_QUERIES = 2048


def block_m(head_dim: int, score_mod: bool, mask: str = "none", seqlen_q: int | None = None) -> int:
    """Queries per step: 128 at head dim 64, where S^T and dP^T take 64 registers each; 80 at 128
    without a mask, and under a causal one from CAUSAL_80_FROM_QUERIES (seqlen_q None: a long
    problem); 64 at 128 otherwise (a 1024-key window measured 2-3% slower with 80), at 96, 192 and
    256, and with a score mod, whose registers do not fit beside them."""
    if score_mod:
        return 64
    if head_dim == 64:
        return 128
    if head_dim == 128 and (mask == "none" or mask == "causal" and (seqlen_q is None
                                                                  or seqlen_q >= CAUSAL_80_FROM_QUERIES)):
        return 80
    return 64


def dq_rows(block: int) -> int:
    """Rows of a consumer's dQ tile, dq_accum's TMA box (Sm90BwdTraits::kDQRows): all the step's
    queries where they are not a multiple of 64 (dQ computed transposed), else 64."""
    return block if block % 64 else 64


def smem_bytes(head_dim: int, block_m: int, stages: int) -> int:
    """K, V, stages x Q, dO's stages, 2 x dS^T (or P^T and dS^T, twice at 256), the dQ tile (float32,
    split between the consumers; with keys on N the first 64-column slice each at 256, whose second
    goes to the Q stage, both slices, 96 columns, at 192),
    stages x (LSE, D), the mbarriers, 1024 bytes of alignment (Sm90BwdTraits); tiles of whole 64-column
    chunks (sm90_fwd.tile_cols)."""
    block_n, cols = BLOCK_N[head_dim], tile_cols(head_dim)
    keys_on_n = head_dim > 128
    stages_do = 1 if keys_on_n else stages
    barriers = 1 + 2 * stages + (2 * stages_do if keys_on_n else 0)
    split_keys = keys_on_n and head_dim // 2 % 64 != 0  # Sm90BwdTraits::kDKVSplitKeys (192)
    ds_buffers = 4 if keys_on_n and not split_keys else 2
    dq_cols = 2 * (head_dim // 2 if split_keys else 64) if keys_on_n else cols
    return (2 * block_n * cols * 2 + (stages + stages_do) * block_m * cols * 2
            + ds_buffers * block_n * block_m * 2
            + block_m * dq_cols * 4 + stages * 2 * block_m * 4 + barriers * 8 + 1024)


@dataclass(frozen=True)
class Sm90BwdVariant:
    head_dim: int
    mask: str   # one of configs.MASKS
    dtype: str
    block_m: int
    stages: int
    deterministic: bool
    score_mod: bool

    source = "bwd_sm90.cu"
    nvrtc_options = NVRTC_OPTIONS + (f"-arch={ARCH}",)

    @property
    def name_expression(self) -> str:
        return (f"flash_bwd_sm90_kernel<{self.head_dim}, {self.block_m}, {self.block_n}, {self.stages}, "
                f"{mask_flags(self.mask)}, {cpp_bool(self.dtype == 'bfloat16')}, {cpp_bool(self.deterministic)}, "
                f"{cpp_bool(self.score_mod)}>")

    @property
    def block_n(self) -> int:
        return BLOCK_N[self.head_dim]

    @property
    def smem_bytes(self) -> int:
        return smem_bytes(self.head_dim, self.block_m, self.stages)

    @property
    def layout_check(self) -> str:
        return build.smem_check(f"Sm90BwdTraits<{self.head_dim}, {self.block_m}, {self.block_n}, {self.stages}>",
                                self)

    def __str__(self) -> str:
        return (f"bwd-sm90 d={self.head_dim} {self.dtype} mask={self.mask} tile={self.block_m}x{self.block_n} "
                f"stages={self.stages}" + (" deterministic" if self.deterministic else "")
                + (" score_mod" if self.score_mod else ""))


def variant(head_dim: int, dtype: str, mask: str, deterministic: bool = False,
            score_mod: bool = False, seqlen_q: int | None = None) -> Sm90BwdVariant:
    mask_flags(mask)  # validates
    block = block_m(head_dim, score_mod, mask, seqlen_q)
    return Sm90BwdVariant(head_dim, mask, dtype, block, STAGES[head_dim, block], bool(deterministic), bool(score_mod))


def pack_args(bwd_record: bytes, section_heads: int, maps) -> np.void:
    """Sm90BwdArgs: the BwdParams record, the block order's section width, then the q, k, v, dout,
    dq_accum tensor maps."""
    return args_with_maps(bwd_record + struct.pack("<i", int(section_heads)), ARGS_TMA_OFFSET, maps)


# Queries from which causal and local problems interleave pairs in sections (the forward's rule,
# sm90_fwd.SECTIONS_FROM_QUERIES, has its own figures): on an H100 the backward's sections measured
# up to 5% faster at 2k-8k tokens and 2-10% slower at 512 and 1k; on an H200 at 1k level to 1.5%
# slower, at 512 4% slower (docs/PERF_NOTES.md)
SECTIONS_FROM_QUERIES = 2048


def section_heads(problem, mask: str, deterministic: bool) -> int:
    """How many (head, batch) pairs' key blocks the block order interleaves (bwd_sm90.cu): under a
    causal or local mask from SECTIONS_FROM_QUERIES queries, as many as have Q, dO, dQ's float32
    accumulator, LSE and D in L2 together, so that every pair's heaviest key blocks start before the
    light ones fill the tail; else 1: without a mask (equal blocks, a head's adjacent), for short
    sequences, and in the deterministic mode (whose semaphore order the launch order follows)."""
    if mask == "none" or deterministic or problem.max_seqlen_q < SECTIONS_FROM_QUERIES:
        return 1
    row_bytes = problem.head_dim * (2 + 2 + 4) + 8
    return pairs_in_l2(max(1, problem.max_seqlen_q) * row_bytes, problem.nheads * problem.batch)


class Sm90Backward(HopperFamily):
    direction = "bwd"
    summary = "FlashAttention-2 backward on TMA, wgmma and a producer warpgroup (cuda_src/bwd_sm90.cu)"

    def unsupported(self, problem, device):
        return hopper_unsupported(problem, device, HEAD_DIMS, lambda: self.variant(problem, device).smem_bytes)

    def variant(self, problem, device) -> Sm90BwdVariant:
        return variant(problem.head_dim, problem.dtype, problem.band.mask, problem.options.deterministic,
                       problem.score_mod, problem.max_seqlen_q)

    def variants(self, capability, smem_optin=None, head_dims=HEAD_DIMS, dtypes=("float16", "bfloat16"),
                 masks=("none", "causal", "local"), score_mods=(False, True), deterministic=(False, True)) -> list:
        if not self.runs_on(capability):
            return []
        # long and short problems (block_m: the causal step at d=128 depends on the length), each once
        return list(dict.fromkeys(variant(d, dt, m, det, mod, seqlen_q) for d in head_dims if d in HEAD_DIMS
                                  for dt in dtypes for m in masks for det in deterministic for mod in score_mods
                                  for seqlen_q in (None, 0)))

    def run(self, problem, device, dout, q, k, v, out, lse, dq, dk, dv):
        """dq, dk, dv written; returns D = rowsum(dO * O), laid out as the LSE, and the call's launches
        (replay.CallReplay)."""
        var = self.variant(problem, device)
        blocks = grid_blocks(-(-problem.max_seqlen_k // var.block_n) * problem.nheads * problem.batch,
                             "the backward's key blocks")
        plan = LaunchPlan((blocks, 1, 1), (THREADS, 1, 1), var.smem_bytes)
        maps = (tensor_map_of(q, problem.dtype, var.block_m), tensor_map_of(k, problem.dtype, var.block_n),
                tensor_map_of(v, problem.dtype, var.block_n), tensor_map_of(dout, problem.dtype, var.block_m))

        def main(record, writes, plans):
            # dq_accum's tensor map, the last, is written with the buffer: a call allocates its own
            kernel_args = pack_args(record, section_heads(problem, var.mask, var.deterministic),
                                    maps + (bytes(TMA_BYTES),))
            box_rows = dq_rows(var.block_m)
            dq_accum_map = (ARGS_TMA_OFFSET + len(maps) * TMA_BYTES, "dq_accum",
                            lambda dq_accum: tensor_map_of(sm80.dq_accum_rows_view(dq_accum), "float32", box_rows))
            return Replay(build.get_kernel(var), plan, kernel_args.tobytes(), writes + (dq_accum_map,))

        return sm80.run_backward(problem, device, main, dout, q, k, v, out, lse, dq, dk, dv, q_block=var.block_m)
