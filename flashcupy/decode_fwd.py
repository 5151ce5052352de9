"""The decode forward family: flash_attn_func and flash_attn_varlen_func over few queries per
sequence on the kv-cache kernels (cuda_src/decode.cu), k and v read as a full cache (varlen: one
cache entry, each sequence's keys from its first row).

With a handful of query rows per kv head, the tiled forwards waste their tiles: a 128-row tile per
(q block, head) holds seqlen_q valid rows, K and V are read once per query head, and batch x heads
blocks leave most SMs idle at batch 1. The decode kernels pack the query heads that share a kv head
into one block's rows (K and V read once per kv head) and split the keys over blocks, merged by
their LSEs (kvcache.plan_launch). H100, bf16, d=128, GPU time against the sm90 forward: one query
token over 8k keys 15.6 against 93.5 us (GQA 32/8), over 32k 53 against 359; 4 queries 19 against
94; MHA at 8 sequences level (349 against 352 us). Past DECODE_MAX_ROWS packed rows the kernel is
flash_prefill_kernel (mma.sync, 64 rows), 0.3-0.6x of the tiled forwards there: the family passes
those problems over (backend="decode" still runs them), as it does where its blocks would read the
keys more often than a tiled forward whose grid fills the GPU (passes_over).
"""

from __future__ import annotations

from . import kvcache
from .configs import DTYPE_NAMES, MASKS
from .launch import MAX_GRID_YZ
from .registry import Family


class DecodeForward(Family):
    name = "decode"
    direction = "fwd"
    archs = ("sm_80", "sm_90a")
    summary = ("few queries per sequence: the query heads of a kv head in one block's rows, the keys split "
               "over blocks and merged by LSE (cuda_src/decode.cu)")

    def runs_on(self, capability):
        return capability >= 80

    def unsupported(self, problem, device):
        groups = problem.nheads // kvcache.heads_per_block(problem)
        if problem.batch > MAX_GRID_YZ or groups > MAX_GRID_YZ:
            return (f"its grid has the batch ({problem.batch}) on z and the head groups ({groups}) on y, each at "
                    f"most {MAX_GRID_YZ}")
        return kvcache.unsupported(problem.head_dim, device)

    def passes_over(self, problem, device):
        rows = kvcache.packed_rows(problem)
        if rows > kvcache.DECODE_MAX_ROWS:
            return (f"{rows} packed query rows per kv head (over {kvcache.DECODE_MAX_ROWS}): the tiled forwards "
                    "are faster")
        # each of a kv head's blocks of packed rows reads all of its keys; a tiled forward reads them
        # once per query head. Where the decode kernel reads them more often and the tiled grid fills
        # the GPU anyway (its split keys gain nothing), the tiled forward wins: H100, MHA, 32 queries,
        # d=128, 8 / 32 / 128 sequences 0.93 / 0.91 / 0.89x of the sm90 forward (1 sequence: 1.3-1.7x)
        passes = -(-rows // kvcache.DECODE_BLOCK_M)
        if passes > kvcache.heads_per_block(problem) and problem.batch * problem.nheads >= device.sm_count:
            return (f"its {passes} blocks of packed rows per kv head read the keys more often than a tiled forward, "
                    "whose grid fills the GPU")
        return None

    def variant(self, problem, device):
        """The attention kernel for the problem's packed rows, before plan_launch picks its tile and
        cluster for the call (those instances are flash_attn_with_kvcache's too)."""
        return kvcache.attention_variant(kvcache.packed_rows(problem), problem.head_dim, problem.dtype,
                                         problem.band.mask, problem.score_mod, device.capability)

    def variants(self, capability, smem_optin=None, head_dims=kvcache.HEAD_DIMS, dtypes=DTYPE_NAMES, masks=MASKS,
                 score_mods=(False, True), deterministic=(False, True)) -> list:
        """The decode kernel (this capability's tile) and the prefill kernel of each case; the smaller
        tiles and clusters that plan_launch may take instead are listed with flash_attn_with_kvcache's
        kernels (cli.kvcache_variants)."""
        if not self.runs_on(capability):
            return []
        cases = [(d, dt, m, mod) for d in head_dims for dt in dtypes for m in masks for mod in score_mods]
        return ([kvcache.DecodeVariant(*case, *kvcache.decode_tile(case[0], capability)) for case in cases]
                + [kvcache.PrefillVariant(*case) for case in cases])

    def ci_cases(self) -> list:
        """kvcache.ci_cases's pairs of this family's kernels (built once, for the same arch)."""
        own = set(self.variants(80)) | set(self.variants(90))
        return [(v, arch) for v, arch in kvcache.ci_cases() if v in own]

    def run(self, problem, device, q, k, v, out, lse):
        """Launches over k and v as full caches; returns the call's launches with the split partials
        they allocate (a replay.CallReplay: run again with out and the LSE given). Varlen k and v
        are one cache entry whose sequence b holds rows cu_seqlens_k[b] to cu_seqlens_k[b + 1]: its
        left padding and its length, counted from row 0 (views of cu_seqlens_k, no copy)."""
        if problem.is_varlen:
            cu_k = problem.cu_seqlens_k
            return kvcache.launch(problem, q, k, v, out, lse, device, seqlens=cu_k[1:], leftpad=cu_k[:-1])
        return kvcache.launch(problem, q, k, v, out, lse, device)
