"""The decode forward family (flash_attn_func over few queries on the kv-cache kernels) against the
float64 reference, on the GPU: every mask and score mod, GQA packing, rows without keys, strides,
replays and the backward of its LSE."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import (REL_TOL, check_grads, forward_against_reference, poison_pool, randn, rel_err,
                         requires_gpu, to_host64, varlen_forward_against_reference)

pytestmark = requires_gpu

KEY_LENGTHS = [1, 17, 127, 129, 1000, 4099]
HEADS = [(8, 2), (8, 8), (8, 1), (6, 3)]  # (query heads, kv heads): 4, 1, 8 and 2 packed per kv head
# (causal, window_size, alignment)
MASKS = [(False, (-1, -1), "bottom_right"), (True, (-1, -1), "bottom_right"), (True, (-1, -1), "top_left"),
         (False, (64, 0), "bottom_right"), (False, (5, 3), "top_left")]


def _f32(rng, shape, low, high):
    import cupy

    return cupy.asarray(rng.uniform(low, high, shape).astype(np.float32))


def _problem(q, k, **options):
    """flash_attn_func's problem for these arrays and options."""
    from flashcupy.problem import AttentionOptions, Problem
    from flashcupy.validation import dtype_name

    return Problem.padded(q, k, dtype_name(q.dtype), AttentionOptions(**options), read=(q, k))


def family_of(q, k, **options) -> str:
    """The forward family flash_attn_func takes for these arrays and options on this GPU."""
    from flashcupy import api
    from flashcupy.device import device_info

    return api.family_for("fwd", _problem(q, k, **options), device_info(q.device.id)).name


def run_and_check(q, k, v, dtype_name, backend="decode", **options):
    """forward_against_reference on the decode family (forced, or as dispatched with backend=None)."""
    return forward_against_reference(q, k, v, dtype_name, backend, **options)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}-{h[1]}")
@pytest.mark.parametrize("seqlen_k", KEY_LENGTHS)
@pytest.mark.parametrize("seqlen_q", [1, 3, 8])
def test_masks_over_ragged_key_lengths(seqlen_q, seqlen_k, heads):
    """Every mask and alignment; seqlen_q > seqlen_k leaves causal rows without keys (out 0, LSE
    -inf). Dispatch takes the family wherever the packed rows fit the decode kernel."""
    from flashcupy import kvcache

    nheads, nheads_k = heads
    rng = np.random.default_rng(100 * seqlen_q + seqlen_k + nheads_k)
    q = randn(rng, (2, seqlen_q, nheads, 128), "bfloat16")
    k, v = (randn(rng, (2, seqlen_k, nheads_k, 128), "bfloat16") for _ in range(2))
    for causal, window_size, alignment in MASKS:
        options = dict(causal=causal, window_size=window_size, alignment=alignment)
        fits = seqlen_q * nheads // nheads_k <= kvcache.DECODE_MAX_ROWS
        assert family_of(q, k, **options) == ("decode" if fits else "sm90" if _hopper() else "sm80")
        run_and_check(q, k, v, "bfloat16", backend=None, **options)


def _plan(q, k, **options):
    """The decode kernels' launch plan for flash_attn_func's problem of these arrays."""
    from flashcupy import kvcache
    from flashcupy.device import device_info

    return kvcache.plan_launch(_problem(q, k, **options), 0, device_info(q.device.id))


def _hopper() -> bool:
    from flashcupy.device import device_info

    return device_info().capability == 90


# (softcap, alibi: None / "heads" / "batch", sinks)
MODS = [(5.0, None, False), (0.0, "heads", False), (0.0, "batch", False), (0.0, None, True), (2.0, "heads", True)]


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("mods", MODS, ids=lambda m: "-".join(map(str, m)))
def test_head_dims_dtypes_and_score_mods(dtype_name, head_dim, mods):
    """softcap, ALiBi (per head and per sequence) and sinks on every head dim and dtype, GQA with a
    causal band over more queries than keys (rows with only the sink) and top-left (ALiBi's distances
    from the band's diagonal)."""
    softcap, alibi, sinks = mods
    batch, nheads = 3, 4
    rng = np.random.default_rng(head_dim + 10 * len(dtype_name))
    q = randn(rng, (batch, 5, nheads, head_dim), dtype_name)
    for seqlen_k, causal, alignment in ((1000, False, "bottom_right"), (3, True, "bottom_right"),
                                        (700, True, "top_left")):
        k, v = (randn(rng, (batch, seqlen_k, 2, head_dim), dtype_name) for _ in range(2))
        options = dict(causal=causal, alignment=alignment, softcap=softcap,
                       alibi_slopes=None if alibi is None else
                       _f32(rng, (nheads,) if alibi == "heads" else (batch, nheads), 0.01, 0.3),
                       sinks=_f32(rng, (nheads,), -1.0, 3.0) if sinks else None)
        assert family_of(q, k, **options) == "decode"
        run_and_check(q, k, v, dtype_name, backend=None, **options)


def test_more_blocks_than_the_grid_holds_at_once():
    """batch x heads far beyond twice the SM count, one query each, and a single sequence whose
    keys the plan splits over many blocks."""
    rng = np.random.default_rng(3)
    q = randn(rng, (96, 1, 16, 64), "float16")
    k, v = (randn(rng, (96, 300, 4, 64), "float16") for _ in range(2))
    assert family_of(q, k, causal=True) == "decode"
    run_and_check(q, k, v, "float16", backend=None, causal=True)
    q = randn(rng, (1, 2, 32, 128), "bfloat16")
    k, v = (randn(rng, (1, 20000, 8, 128), "bfloat16") for _ in range(2))
    assert family_of(q, k) == "decode" and _plan(q, k).splits > 1
    run_and_check(q, k, v, "bfloat16", backend=None)


def test_strided_broadcast_and_reversed_inputs():
    """Packed qkv, a transposed buffer, K and V broadcast over the batch (stride 0) and Q reversed
    along the sequence (a negative stride), all read in place."""
    import cupy

    rng = np.random.default_rng(11)
    b, n, h, d = 2, 257, 4, 128
    qkv = randn(rng, (b, 4, 3, h, d), "bfloat16")
    q = qkv[:, :, 0]
    k = randn(rng, (b, n, 3, h, d), "bfloat16")[:, :, 1]
    v = cupy.ascontiguousarray(randn(rng, (b, h, n, d), "bfloat16")).transpose(0, 2, 1, 3)
    assert not q.flags.c_contiguous and not k.flags.c_contiguous and not v.flags.c_contiguous
    assert family_of(q, k, causal=True) == "decode"
    run_and_check(q, k, v, "bfloat16", backend=None, causal=True)
    q = randn(rng, (3, 6, 8, 64), "bfloat16")[:, ::-1]
    k, v = (cupy.broadcast_to(randn(rng, (1, 129, 2, 64), "bfloat16"), (3, 129, 2, 64)) for _ in range(2))
    assert q.strides[1] < 0 and k.strides[0] == 0
    assert family_of(q, k) == "decode"
    run_and_check(q, k, v, "bfloat16", backend=None, window_size=(40, 2))


def test_forced_on_many_queries_runs_the_prefill_kernel():
    """backend="decode" computes problems it passes over too (more packed rows than the decode
    kernel holds), as flash_attn_with_kvcache's chunked prefill."""
    rng = np.random.default_rng(5)
    q = randn(rng, (2, 300, 4, 64), "bfloat16")
    k, v = (randn(rng, (2, 517, 2, 64), "bfloat16") for _ in range(2))
    assert family_of(q, k, causal=True) != "decode"
    run_and_check(q, k, v, "bfloat16", causal=True)


def test_repeated_calls_replay_and_read_current_contents(monkeypatch):
    """A repeated call (same arrays and options) replays its launches, split partials included, and
    reads what the arrays hold now."""
    import flashcupy
    from flashcupy import replay
    from flashcupy.problem import Problem
    from flashcupy.reference import attention_ref

    replay.clear()
    rng = np.random.default_rng(9)
    q = randn(rng, (1, 1, 32, 128), "bfloat16")
    k, v = (randn(rng, (1, 8192, 8, 128), "bfloat16") for _ in range(2))
    assert _plan(q, k).splits > 1  # the partials are the replay's own buffers
    described, padded = [], Problem.padded
    monkeypatch.setattr(Problem, "padded", lambda *a, **kw: described.append(1) or padded(*a, **kw))
    first = to_host64(flashcupy.flash_attn_func(q, k, v))
    v[...] = randn(rng, v.shape, "bfloat16")
    again = to_host64(flashcupy.flash_attn_func(q, k, v))
    assert len(described) == 1  # the second call was a replay
    ref, _ = attention_ref(to_host64(q), to_host64(k), to_host64(v))
    assert rel_err(again, ref) < REL_TOL["bfloat16"]
    assert rel_err(first, ref) > 10 * REL_TOL["bfloat16"]  # the new values were read, not a kept result


def test_backward_of_its_forward():
    """FlashAttention's forward on the decode family keeps an LSE the backward families use."""
    import flashcupy
    from flashcupy.reference import attention_bwd_ref

    rng = np.random.default_rng(21)
    q = randn(rng, (2, 4, 8, 128), "bfloat16")
    k, v = (randn(rng, (2, 700, 2, 128), "bfloat16") for _ in range(2))
    dout = randn(rng, q.shape, "bfloat16")
    sinks = _f32(rng, (8,), -1.0, 2.0)
    assert family_of(q, k, causal=True, sinks=sinks) == "decode"
    attn = flashcupy.FlashAttention(causal=True, sinks=sinks)
    attn.forward(q, k, v)
    grads = attn.backward(dout)
    refs = attention_bwd_ref(*(to_host64(a) for a in (dout, q, k, v)), causal=True, sinks=to_host64(sinks))
    check_grads(grads, refs, "bfloat16", "decode forward")


def _varlen_problem(q, k, cu_q, cu_k, max_q, max_k, **options):
    from flashcupy.problem import AttentionOptions, Problem
    from flashcupy.validation import dtype_name

    return Problem.varlen(q, k, dtype_name(q.dtype), AttentionOptions(**options), cu_q, cu_k, max_q, max_k, False,
                          read=(q, k))


def varlen_family_of(q, k, cu_q, cu_k, max_q, max_k, **options) -> str:
    """The forward family flash_attn_varlen_func takes for these arrays and options on this GPU."""
    from flashcupy import api
    from flashcupy.device import device_info

    return api.family_for("fwd", _varlen_problem(q, k, cu_q, cu_k, max_q, max_k, **options),
                          device_info(q.device.id)).name


def _varlen_plan(q, k, cu_q, cu_k, max_q, max_k, **options):
    """The decode kernels' launch plan for flash_attn_varlen_func's problem of these arrays."""
    from flashcupy import kvcache
    from flashcupy.device import device_info

    return kvcache.plan_launch(_varlen_problem(q, k, cu_q, cu_k, max_q, max_k, **options), 0,
                               device_info(q.device.id))


def varlen_against_reference(lengths_q, lengths_k, nheads, nheads_k, head_dim, dtype_name, rng, family="decode",
                             merge=None, **options):
    """varlen_forward_against_reference as dispatched, asserted to take `family` (with merge "count"
    or "cluster", asserted to split the keys and merge that way)."""

    def check_plan(q, k, *sizes, **on_gpu):
        assert varlen_family_of(q, k, *sizes, **on_gpu) == family
        if merge is not None:
            plan = _varlen_plan(q, k, *sizes, **on_gpu)
            assert plan.splits > 1 and (plan.kernel.cluster > 1) == (merge == "cluster"), plan

    varlen_forward_against_reference(lengths_q, lengths_k, nheads, nheads_k, head_dim, dtype_name, rng,
                                     check_plan=check_plan, **options)


# (query lengths, key lengths): one-token, short and empty sequences in every position of the batch;
# ragged keys, none among them
VARLEN_BATCHES = [([1], [4099]), ([1, 1, 1, 1], [1, 17, 127, 129]), ([3, 0, 1, 2, 1], [1000, 5, 0, 4099, 129]),
                  ([8, 1, 4], [127, 4099, 17]), ([0, 2, 0], [17, 1000, 1])]


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}-{h[1]}")
@pytest.mark.parametrize("lengths", VARLEN_BATCHES, ids=lambda x: "-".join(map(str, x[0])))
def test_varlen_batches_of_few_queries(lengths, heads):
    """flash_attn_varlen_func with few queries per sequence: every mask and alignment, each
    sequence's band from its own lengths (causal rows past a short sequence's keys see none)."""
    from flashcupy import kvcache

    lengths_q, lengths_k = lengths
    nheads, nheads_k = heads
    fits = max(lengths_q) * nheads // nheads_k <= kvcache.DECODE_MAX_ROWS
    rng = np.random.default_rng(sum(lengths_k) + nheads_k)
    for causal, window_size, alignment in MASKS:
        varlen_against_reference(lengths_q, lengths_k, nheads, nheads_k, 128, "bfloat16", rng,
                                 "decode" if fits else "sm90" if _hopper() else "sm80",
                                 causal=causal, window_size=window_size, alignment=alignment)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("mods", MODS, ids=lambda m: "-".join(map(str, m)))
def test_varlen_head_dims_dtypes_and_score_mods(dtype_name, head_dim, mods):
    """softcap, ALiBi (per head and per sequence) and sinks on varlen batches, causal with more
    queries than keys in one sequence (its first rows see no key: only the sink) and none in another."""
    softcap, alibi, sinks = mods
    lengths_q, lengths_k, nheads = [2, 5, 1, 1], [700, 3, 1000, 0], 4
    rng = np.random.default_rng(head_dim + 7 * len(dtype_name))
    options = dict(causal=True, softcap=softcap,
                   alibi_slopes=None if alibi is None else
                   rng.uniform(0.01, 0.3, (nheads,) if alibi == "heads" else (len(lengths_q), nheads)).astype(np.float32),
                   sinks=rng.uniform(-1.0, 3.0, nheads).astype(np.float32) if sinks else None)
    varlen_against_reference(lengths_q, lengths_k, nheads, 2, head_dim, dtype_name, rng, **options)


def test_varlen_many_sequences_and_long_split_keys():
    """Sequences x heads far beyond twice the SM count; then sequences whose keys the plan splits over
    blocks merged by the count (past the clusters' key cap) and, on Hopper, in a cluster, the later
    sequences' rows at an offset in q, k and v."""
    rng = np.random.default_rng(17)
    lengths_k = rng.integers(0, 400, 300)
    lengths_k[::37] = 1
    varlen_against_reference([1] * 300, lengths_k.tolist(), 16, 4, 64, "float16", rng, causal=True)
    varlen_against_reference([1, 3, 2], [20000, 9000, 5000], 32, 8, 128, "bfloat16", rng, merge="count")
    if _hopper():  # 8 clusters of 8 blocks
        varlen_against_reference([2, 1], [2000, 3000], 32, 4, 128, "bfloat16", rng, merge="cluster")


def test_varlen_unchecked_replays_read_new_lengths_and_stay_in_bounds():
    """With check_cu_seqlens=False a repeated call replays its launches and reads the lengths the
    cu_seqlens arrays hold now. A sequence longer than max_seqlen_q (a caller's error the unchecked
    call cannot see) gets its first max_seqlen_q rows computed, and the split partials of its rows
    past them go nowhere: every other (sequence, head) stays right."""
    import cupy

    import flashcupy
    from flashcupy.reference import attention_varlen_ref

    rng = np.random.default_rng(23)
    nheads, nheads_k, d = 8, 8, 128
    q = randn(rng, (6, nheads, d), "bfloat16")
    k, v = (randn(rng, (15000, nheads_k, d), "bfloat16") for _ in range(2))
    cu_q = cupy.asarray([0, 1, 3, 6], cupy.int32)
    cu_k = cupy.asarray([0, 7000, 8000, 15000], cupy.int32)
    sizes = (cu_q, cu_k, 3, 7000)
    assert varlen_family_of(q, k, *sizes) == "decode"
    plan = _varlen_plan(q, k, *sizes)
    assert plan.splits > 1 and plan.kernel.cluster == 1  # partials in global memory

    def check(out, bounds_q, bounds_k, rows):
        ref, _ = attention_varlen_ref(*(to_host64(a) for a in (q, k, v)), bounds_q, bounds_k, causal=True)
        out_h = to_host64(out)
        assert rel_err(out_h[rows], ref[rows]) < REL_TOL["bfloat16"]

    first = flashcupy.flash_attn_varlen_func(q, k, v, *sizes, causal=True, check_cu_seqlens=False)
    check(first, cu_q.get(), cu_k.get(), slice(0, 6))
    cu_q[...] = cupy.asarray([0, 2, 3, 6], cupy.int32)
    cu_k[...] = cupy.asarray([0, 6000, 7000, 15000], cupy.int32)  # the last sequence holds 8000 keys now
    again = flashcupy.flash_attn_varlen_func(q, k, v, *sizes, causal=True, check_cu_seqlens=False)
    check(again, cu_q.get(), cu_k.get(), slice(0, 6))
    # four queries in the first sequence, max_seqlen_q still 3: rows 0-2 are computed, row 3 is not
    cu_q[...] = cupy.asarray([0, 4, 5, 6], cupy.int32)
    poison_pool((q.shape, q.dtype))
    past = flashcupy.flash_attn_varlen_func(q, k, v, *sizes, causal=True, check_cu_seqlens=False)
    check(past, cu_q.get(), cu_k.get(), [0, 1, 2, 4, 5])
