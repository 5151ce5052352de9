"""flash_attn_with_kvcache against the float64 reference (decode_ref.kvcache_ref), on the GPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gpu_helpers import REL_TOL, check_lse, dtype_of, randn, rel_err, requires_gpu, to_host64, ulp

pytestmark = requires_gpu


def run_case(rng, *, batch, seqlen_q, nheads, nheads_k, head_dim=128, dtype_name="bfloat16", capacity=300,
             seqlens, seqlen_new=0, page_size=None, rotary_dim=None, interleaved=True, num_splits=0, v_extra_heads=0,
             **options):
    """Random caches (every row written: the rows outside a sequence's keys must not count), the new
    keys appended, against the reference; returns the relative error of out. v_extra_heads: v_cache
    is a view of a cache with that many more heads (its strides differ from k_cache's)."""
    import cupy

    import flashcupy
    from flashcupy.decode_ref import kvcache_ref

    q = randn(rng, (batch, seqlen_q, nheads, head_dim), dtype_name)
    if page_size is None:
        shape, table = (batch, capacity), None
    else:
        blocks_per_seq = -(-capacity // page_size)
        num_blocks = batch * blocks_per_seq + 3  # spare blocks the table never names
        shape = (num_blocks, page_size)
        table = rng.permutation(num_blocks)[:batch * blocks_per_seq].reshape(batch, blocks_per_seq).astype(np.int32)
    k_cache = randn(rng, (*shape, nheads_k, head_dim), dtype_name)
    v_cache = randn(rng, (*shape, nheads_k + v_extra_heads, head_dim), dtype_name)[:, :, :nheads_k]
    k = v = cos = sin = None
    if seqlen_new:
        k, v = (randn(rng, (batch, seqlen_new, nheads_k, head_dim), dtype_name) for _ in range(2))
    if rotary_dim:
        angle = rng.standard_normal((capacity + seqlen_q, rotary_dim // 2)).astype(np.float32)
        cos, sin = (cupy.asarray(f(angle)).astype(q.dtype) for f in (np.cos, np.sin))
    k_host, v_host = to_host64(k_cache), to_host64(v_cache)
    seqlens = np.asarray(seqlens, np.int32)
    out, lse = flashcupy.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cupy.asarray(seqlens),
        block_table=None if table is None else cupy.asarray(table), rotary_cos=cos, rotary_sin=sin,
        rotary_interleaved=interleaved, num_splits=num_splits, return_lse=True, **options)
    host_options = {n: cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else a for n, a in options.items()}
    ref_out, ref_lse, ref_k, ref_v = kvcache_ref(
        to_host64(q), k_host, v_host, None if k is None else to_host64(k), None if v is None else to_host64(v),
        cache_seqlens=seqlens, block_table=table, rotary_cos=None if cos is None else to_host64(cos),
        rotary_sin=None if sin is None else to_host64(sin), rotary_interleaved=interleaved,
        rotated_dtype=dtype_of(dtype_name), **host_options)
    out_h = to_host64(out)
    assert not np.isnan(out_h).any(), "unwritten or NaN output"
    err = rel_err(out_h, ref_out)
    assert err < REL_TOL[dtype_name], f"out relative error {err:.2e}"
    check_lse(lse, ref_lse)
    # the caches, element by element: v exactly the reference's (appended rows copied, the rest
    # untouched); k too without rotary; with it, k untouched outside the appended rows and each
    # appended element within one unit in the last place (rotated in float32 here, in float64 by
    # the reference, each rounded once to the dtype)
    k_after, v_after = to_host64(k_cache), to_host64(v_cache)
    assert np.array_equal(v_after, ref_v), "v_cache differs from the reference's append"
    if not rotary_dim or k is None:
        assert np.array_equal(k_after, ref_k), "k_cache differs from the reference's append"
    else:
        appended = np.broadcast_to(((ref_k != k_host) | (ref_v != v_host)).any(axis=-1, keepdims=True), k_host.shape)
        assert np.array_equal(k_after[~appended], k_host[~appended]), "a cache row outside the appended ones was written"
        off = np.abs(k_after[appended] - ref_k[appended]) / ulp(ref_k[appended], dtype_name)
        assert off.size == 0 or off.max() <= 1, f"appended keys {off.max():.1f} units in the last place off"
    return err


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 192, 256])
@pytest.mark.parametrize("nheads, nheads_k", [(8, 2), (4, 4), (8, 1)])
def test_decode_one_token(dtype_name, head_dim, nheads, nheads_k):
    rng = np.random.default_rng(head_dim + nheads_k)
    run_case(rng, batch=4, seqlen_q=1, nheads=nheads, nheads_k=nheads_k, head_dim=head_dim, dtype_name=dtype_name,
             seqlens=[0, 1, 129, 299], seqlen_new=1, causal=True)


@pytest.mark.parametrize("seqlen_q", [2, 5, 8])
def test_speculative_tokens(seqlen_q):
    rng = np.random.default_rng(seqlen_q)
    run_case(rng, batch=3, seqlen_q=seqlen_q, nheads=8, nheads_k=2, seqlens=[17, 0, 127], seqlen_new=seqlen_q,
             causal=True)


def test_chunked_prefill():
    rng = np.random.default_rng(3)
    run_case(rng, batch=2, seqlen_q=1000, nheads=4, nheads_k=2, capacity=4099, seqlens=[0, 3000], seqlen_new=1000,
             causal=True)


@pytest.mark.parametrize("head_dim, num_splits", [(32, 100), (128, 128), (64, 4096), (96, 5), (192, 7)])
def test_many_rows_many_splits(head_dim, num_splits):
    """80 packed rows (the prefill kernel) and up to more splits than keys: the last split's block
    merges its rows in chunks whose weights fit its shared memory; num_splits past MAX_SPLITS is
    capped."""
    rng = np.random.default_rng(head_dim)
    run_case(rng, batch=2, seqlen_q=40, nheads=4, nheads_k=2, head_dim=head_dim, capacity=3000, seqlens=[2960, 129],
             seqlen_new=40, num_splits=num_splits, causal=True)


@pytest.mark.parametrize("seqlens", [[300, 300], [0, 0], [1, 17]])
def test_full_and_empty_caches_without_append(seqlens):
    rng = np.random.default_rng(sum(seqlens))
    run_case(rng, batch=2, seqlen_q=1, nheads=8, nheads_k=2, seqlens=seqlens)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("page_size", [1, 7, 16, 17, 40, 48, 64, 256])
def test_paged_shuffled_tables(page_size, head_dim):
    """Page sizes a multiple of 16 (a warp's 16 rows of a step in one page: one table read) and
    others (a block per row), several splits."""
    rng = np.random.default_rng(page_size + head_dim)
    run_case(rng, batch=3, seqlen_q=1, nheads=8, nheads_k=2, head_dim=head_dim, capacity=600, seqlens=[0, 255, 598],
             seqlen_new=2, page_size=page_size, num_splits=3 if page_size % 2 else 0, causal=True)


@pytest.mark.parametrize("head_dim", [64, 128, 192])
@pytest.mark.parametrize("num_splits", [0, 3])
def test_cache_batch_idx_and_leftpad(head_dim, num_splits):
    """Sequences reading other cache entries, keys from a left pad on (one sequence all pad), V with
    strides of its own."""
    rng = np.random.default_rng(head_dim + num_splits)
    run_case(rng, batch=3, seqlen_q=2, nheads=8, nheads_k=2, head_dim=head_dim, capacity=300, seqlens=[40, 5, 298],
             seqlen_new=2, num_splits=num_splits, causal=True, v_extra_heads=1,
             cache_batch_idx=np.array([2, 0, 1], np.int32), cache_leftpad=np.array([3, 5, 129], np.int32))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim, rotary_dim", [(128, 64), (96, 96), (192, 48)])
def test_rotary(interleaved, causal, head_dim, rotary_dim):
    rng = np.random.default_rng(7 + interleaved + head_dim)
    run_case(rng, batch=2, seqlen_q=3, nheads=4, nheads_k=2, head_dim=head_dim, seqlens=[5, 200], seqlen_new=3,
             rotary_dim=rotary_dim, interleaved=interleaved, causal=causal)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 16, 40])
def test_every_split_count(num_splits):
    """Up to more splits than the 300-key cache has key blocks (5)."""
    rng = np.random.default_rng(num_splits)
    run_case(rng, batch=2, seqlen_q=2, nheads=8, nheads_k=2, seqlens=[299, 64], seqlen_new=1, num_splits=num_splits,
             causal=True)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_more_splits_than_one_merge_chunk(with_sinks):
    """The decode kernel's last split merges from registers 16 splits at a time (decode.cu's
    merge_item), rescaling what it summed when a later chunk's LSE is larger: 40 splits that each
    see keys of a 5000-key sequence (its rows' largest LSE past the first 16 splits in some row but
    with probability 0.4 ** 8), beside a 1200-key one whose later splits are empty."""
    import cupy

    from flashcupy import kvcache
    from flashcupy.device import device_info
    from flashcupy.problem import AttentionOptions, Problem, plan_band

    problem = Problem(2, 1, 5000, 8, 2, 128, "bfloat16", 128 ** -0.5,
                      plan_band(False, (-1, -1), "bottom_right", 1, 5000), AttentionOptions())
    plan = kvcache.plan_launch(problem, 40, device_info())
    assert (type(plan.kernel), plan.kernel.cluster, plan.splits) == (kvcache.DecodeVariant, 1, 40)
    rng = np.random.default_rng(41 + with_sinks)
    options = dict(sinks=cupy.asarray(rng.standard_normal(8).astype(np.float32))) if with_sinks else {}
    run_case(rng, batch=2, seqlen_q=1, nheads=8, nheads_k=2, capacity=5000, seqlens=[4999, 1200], seqlen_new=1,
             num_splits=40, **options)


@pytest.mark.parametrize("options", [dict(softcap=30.0), dict(window_size=(100, 0)), dict(causal=True, softcap=5.0)],
                         ids=["softcap", "window", "causal-softcap"])
def test_options(options):
    rng = np.random.default_rng(11)
    run_case(rng, batch=2, seqlen_q=4, nheads=8, nheads_k=2, seqlens=[250, 20], seqlen_new=2, num_splits=3, **options)


def test_alibi_and_sinks_one_head_per_block():
    import cupy

    rng = np.random.default_rng(13)
    slopes = cupy.asarray(rng.uniform(0.01, 0.2, 8).astype(np.float32))
    sinks = cupy.asarray(rng.standard_normal(8).astype(np.float32))
    run_case(rng, batch=2, seqlen_q=2, nheads=8, nheads_k=2, seqlens=[250, 20], seqlen_new=1, num_splits=4,
             causal=True, alibi_slopes=slopes, sinks=sinks)


def test_many_sequences_beyond_the_sm_count():
    rng = np.random.default_rng(17)
    run_case(rng, batch=300, seqlen_q=1, nheads=4, nheads_k=1, head_dim=64, capacity=129,
             seqlens=rng.integers(0, 129, 300), seqlen_new=0)


@pytest.mark.parametrize("head_dim", [96, 128])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("batch, capacity, tile", [(100, 1000, 0), (300, 1000, 1), (300, 2100, 0), (600, 2100, 1)])
def test_many_short_caches_on_small_tiles(batch, capacity, tile, dtype_name, head_dim):
    """Many unsplit blocks: on Hopper the small tiles (DECODE_TILES_SM90_SMALL, `tile` indexes
    them), 4 warps for 100 sequences x 2 kv heads of short caches, 2 warps for 300; past SHORT_KEYS
    4 warps for 300, 2 warps for 600 (past LONG_WAVES waves); ragged lengths in every position."""
    from flashcupy import kvcache
    from flashcupy.device import device_info
    from flashcupy.problem import AttentionOptions, Problem, plan_band

    info = device_info()
    if info.capability == 90 and 100 <= info.sm_count < 150:  # H100 PCIe / SXM, H200
        problem = Problem(batch, 1, capacity, 8, 2, head_dim, dtype_name, head_dim ** -0.5,
                          plan_band(False, (-1, -1), "bottom_right", 1, capacity), AttentionOptions())
        plan = kvcache.plan_launch(problem, 0, info)
        assert ((plan.kernel.warps, plan.kernel.stages), plan.splits) == \
            (kvcache.DECODE_TILES_SM90_SMALL[head_dim][tile], 1)
    rng = np.random.default_rng(29 + batch + capacity + head_dim)
    seqlens = rng.integers(0, capacity, batch)
    seqlens[:6] = [1, 17, 127, 129, 0, capacity - 1]
    seqlens[-3:] = [129, 1, 17]
    run_case(rng, batch=batch, seqlen_q=1, nheads=8, nheads_k=2, head_dim=head_dim, dtype_name=dtype_name,
             capacity=capacity, seqlens=seqlens, seqlen_new=1)


@pytest.mark.parametrize("head_dim", [96, 128, 192, 256])
@pytest.mark.parametrize("batch, num_splits, options", [
    (1, 0, {}),  # the rule's 8 splits
    (1, 8, {"causal": True}),
    (3, 2, {"causal": True}),
    (2, 2, {"sinks": True}),  # one head per block: 64 clusters
    (5, 2, {"window_size": (100, 0), "softcap": 3.0}),
])
def test_splits_merged_in_a_cluster(batch, num_splits, options, head_dim):
    """Every Hopper tile: split counts of DECODE_CLUSTERS_SM90 merge through distributed shared
    memory (flash_decode_cluster_kernel) where the GPU holds every cluster at once; ragged lengths
    with a full and a short cache, an appended key."""
    import cupy

    from flashcupy import kvcache
    from flashcupy.device import device_info
    from flashcupy.problem import AttentionOptions, Problem, plan_band

    info = device_info()
    if info.capability != 90:
        pytest.skip("thread block clusters: the Hopper decode kernel only")
    rng = np.random.default_rng(41 + batch + head_dim)
    sinks = cupy.asarray(rng.uniform(-1.0, 3.0, 32).astype(np.float32)) if "sinks" in options else None
    causal, window = options.get("causal", False), options.get("window_size", (-1, -1))
    problem = Problem(batch, 1, 1024, 32, 8, head_dim, "bfloat16", head_dim ** -0.5,
                      plan_band(causal, window, "bottom_right", 1, 1024),
                      AttentionOptions(causal=causal, window_size=window, softcap=options.get("softcap", 0.0),
                                       sinks=sinks))
    plan = kvcache.plan_launch(problem, num_splits, info)
    clustered = dataclasses.replace(plan.kernel, cluster=plan.splits)
    fits = plan.blocks <= kvcache.resident_clusters(clustered, info.id)
    assert plan.kernel.cluster == (plan.splits if fits else 1), plan
    if info.sm_count == 132:  # H100 SXM, H200: 66 clusters of 2 and 15 of 8 fit
        assert plan.kernel.cluster == plan.splits > 1, plan
    seqlens = rng.integers(0, 1024, batch)
    seqlens[0] = 1023  # full once the new key is appended
    if batch > 1:
        seqlens[-1] = 16
    if sinks is not None:
        options = {**options, "sinks": sinks}
    run_case(rng, batch=batch, seqlen_q=1, nheads=32, nheads_k=8, head_dim=head_dim, capacity=1024, seqlens=seqlens,
             seqlen_new=1, num_splits=num_splits, **options)


@pytest.mark.parametrize("head_dim", [96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_short_cache_splits_in_small_tile_clusters(head_dim, causal):
    """32 kv heads, one sequence of a 512-key cache: the rule's 4 splits of 128 keys as clusters of
    the 4-warp tile on an H100 SXM or H200 (32 clusters of 4 one-per-SM blocks do not fit; of these,
    62 do)."""
    from flashcupy import kvcache
    from flashcupy.device import device_info
    from flashcupy.problem import AttentionOptions, Problem, plan_band

    info = device_info()
    if info.capability == 90 and info.sm_count == 132:
        problem = Problem(1, 1, 512, 32, 32, head_dim, "bfloat16", head_dim ** -0.5,
                          plan_band(causal, (-1, -1), "bottom_right", 1, 512), AttentionOptions(causal=causal))
        plan = kvcache.plan_launch(problem, 0, info)
        assert (plan.kernel.warps, plan.kernel.cluster, plan.splits) == (4, 4, 4), plan
    rng = np.random.default_rng(53 + head_dim + causal)
    run_case(rng, batch=1, seqlen_q=1, nheads=32, nheads_k=32, head_dim=head_dim, capacity=512, seqlens=[497],
             seqlen_new=1, causal=causal)


@pytest.mark.parametrize("head_dim", [96, 128, 256])
def test_short_cache_splits_cut_to_a_cluster(head_dim):
    """One sequence of a 4096-key cache: the rule's 16 splits become one cluster of 8 on an H100 SXM
    or H200 (CLUSTER_CAP_KEYS); a ragged batch of two with a 1-key and a full cache as well."""
    from flashcupy import kvcache
    from flashcupy.device import device_info
    from flashcupy.problem import AttentionOptions, Problem, plan_band

    info = device_info()
    if info.capability == 90 and info.sm_count == 132:
        problem = Problem(1, 1, 4096, 32, 8, head_dim, "bfloat16", head_dim ** -0.5,
                          plan_band(True, (-1, -1), "bottom_right", 1, 4096), AttentionOptions(causal=True))
        plan = kvcache.plan_launch(problem, 0, info)
        assert (plan.kernel.cluster, plan.splits) == (8, 8), plan
    rng = np.random.default_rng(59 + head_dim)
    run_case(rng, batch=1, seqlen_q=1, nheads=32, nheads_k=8, head_dim=head_dim, capacity=4096, seqlens=[4000],
             seqlen_new=1, causal=True)
    run_case(rng, batch=2, seqlen_q=1, nheads=32, nheads_k=8, head_dim=head_dim, capacity=2048, seqlens=[0, 2047],
             seqlen_new=1, causal=True)


@pytest.mark.parametrize("num_splits", [1, 0, 7])
def test_graph_capture_replays(num_splits):
    """A decode step captured into a CUDA graph (device index arrays, check_values=False) and replayed
    twice gives the same result as the direct call, with splits too (their merge counters are left
    at zero by every launch)."""
    import cupy

    import flashcupy

    rng = np.random.default_rng(19)
    q = randn(rng, (2, 1, 8, 128), "bfloat16")
    k_cache, v_cache = (randn(rng, (2, 256, 2, 128), "bfloat16") for _ in range(2))
    seqlens = cupy.asarray(np.array([10, 200], np.int32))
    step = dict(cache_seqlens=seqlens, check_values=False, num_splits=num_splits)
    want = flashcupy.flash_attn_with_kvcache(q, k_cache, v_cache, **step)
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        # a call on this stream first: its counters exist, and its blocks go back to CuPy's pool,
        # so the captured call allocates without cudaMalloc
        spare = flashcupy.flash_attn_with_kvcache(q, k_cache, v_cache, **step)
        del spare
        stream.synchronize()
        stream.begin_capture()
        got = flashcupy.flash_attn_with_kvcache(q, k_cache, v_cache, **step)
        graph = stream.end_capture()
        for _ in range(2):
            got.fill(0)
            graph.launch(stream)
            stream.synchronize()
            assert cupy.array_equal(got, want)


def test_bad_values_are_refused_before_any_launch():
    import cupy

    import flashcupy

    rng = np.random.default_rng(23)
    q = randn(rng, (2, 1, 8, 128), "bfloat16")
    k_cache, v_cache = (randn(rng, (2, 16, 2, 128), "bfloat16") for _ in range(2))
    k, v = (randn(rng, (2, 1, 2, 128), "bfloat16") for _ in range(2))
    before = cupy.asnumpy(k_cache.view(cupy.uint16))
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 16 plus the 1 new keys"):
        flashcupy.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cupy.asarray(
            np.array([3, 16], np.int32)))
    with pytest.raises(ValueError, match="cache_batch_idx"):
        flashcupy.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3,
                                          cache_batch_idx=np.array([0, 5], np.int32))
    assert np.array_equal(cupy.asnumpy(k_cache.view(cupy.uint16)), before)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("paged, rotary", [(False, False), (True, True)], ids=["contiguous", "paged-rotary"])
def test_a_decode_loop_replays_its_launches(num_splits, paged, rotary, monkeypatch):
    """Decode steps with the same arrays (check_values=False, index arrays on the GPU) skip the checks
    and the planning after the first, and still read the arrays' current contents: each step appends
    at the cache_seqlens it finds, rotates there, and attends over the grown cache into fresh outputs."""
    import cupy

    import flashcupy
    from flashcupy import replay, validation
    from flashcupy.decode_ref import kvcache_ref

    rng = np.random.default_rng(23 + paged + 2 * num_splits)
    batch, nheads, nheads_k, d, capacity = 2, 8, 2, 128, 64
    q = randn(rng, (batch, 1, nheads, d), "bfloat16")
    k, v = (randn(rng, (batch, 1, nheads_k, d), "bfloat16") for _ in range(2))
    if paged:
        table = rng.permutation(batch * 4).reshape(batch, 4).astype(np.int32)  # pages of 16
        k_cache, v_cache = (randn(rng, (batch * 4, 16, nheads_k, d), "bfloat16") for _ in range(2))
    else:
        table = None
        k_cache, v_cache = (randn(rng, (batch, capacity, nheads_k, d), "bfloat16") for _ in range(2))
    cos = sin = None
    if rotary:
        angle = rng.standard_normal((capacity, 32)).astype(np.float32)
        cos, sin = (cupy.asarray(f(angle)).astype(q.dtype) for f in (np.cos, np.sin))
    seqlens = np.array([5, 40], np.int32)
    seqlens_d = cupy.asarray(seqlens)
    step = dict(cache_seqlens=seqlens_d, block_table=None if table is None else cupy.asarray(table), rotary_cos=cos,
                rotary_sin=sin, causal=True, num_splits=num_splits, return_lse=True, check_values=False)
    checked, check = [], validation.check_kvcache_inputs
    monkeypatch.setattr(validation, "check_kvcache_inputs", lambda *a: checked.append(1) or check(*a))
    replay.clear()
    outputs = []
    for i in range(3):
        for a in (q, k, v):  # new contents in the same buffers
            a[...] = randn(rng, a.shape, "bfloat16")
        k_host, v_host = to_host64(k_cache), to_host64(v_cache)
        ref_out, ref_lse, ref_k, ref_v = kvcache_ref(
            to_host64(q), k_host, v_host, to_host64(k), to_host64(v), cache_seqlens=seqlens, block_table=table,
            rotary_cos=None if cos is None else to_host64(cos), rotary_sin=None if sin is None else to_host64(sin),
            causal=True)
        out, lse = flashcupy.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **step)
        assert all(out.data.ptr != o.data.ptr for o in outputs)
        outputs.append(out)
        assert rel_err(to_host64(out), ref_out) < REL_TOL["bfloat16"], f"step {i}"
        check_lse(lse, ref_lse)
        assert np.array_equal(to_host64(v_cache), ref_v), f"step {i}: v_cache differs from the reference's append"
        seqlens += 1
        seqlens_d += 1  # the loop's own update, on the device
    assert len(checked) == 1


@pytest.mark.parametrize("num_splits", [1, 0])
def test_a_captured_loop_reads_what_the_kernels_ahead_wrote(num_splits, monkeypatch):
    """Steps captured into one graph, each right behind kernels that write its inputs (the query, the
    new keys and values, cache_seqlens), replayed twice from the same starting state: every step
    attends over what those kernels wrote. From sm90 the attention kernel is launched
    programmatically and may be resident before they end; its wait keeps it from reading early."""
    import cupy

    import flashcupy
    from flashcupy import replay
    from flashcupy.decode_ref import kvcache_ref
    from flashcupy.device import device_info, has_cuda_bindings

    rng = np.random.default_rng(31 + num_splits)
    batch, nheads, nheads_k, d, capacity, steps = 2, 8, 2, 128, 1024, 4
    qs, ks, vs = ([randn(rng, (batch, 1, h, d), "bfloat16") for _ in range(steps)]
                  for h in (nheads, nheads_k, nheads_k))
    q, k, v = (cupy.empty_like(x[0]) for x in (qs, ks, vs))
    k_cache, v_cache = (randn(rng, (batch, capacity, nheads_k, d), "bfloat16") for _ in range(2))
    k_start, v_start = k_cache.copy(), v_cache.copy()
    seqlens0 = np.array([700, 1000], np.int32)
    seqlens = cupy.asarray(seqlens0)
    options = dict(cache_seqlens=seqlens, causal=True, num_splits=num_splits, check_values=False)
    plans, launcher = [], replay.kernel_launcher
    monkeypatch.setattr(replay, "kernel_launcher", lambda function, plan: plans.append(plan) or launcher(function, plan))
    replay.clear()
    # the references, step by step on the host
    k_host, v_host, lens, refs = to_host64(k_cache), to_host64(v_cache), seqlens0.copy(), []
    for i in range(steps):
        ref_out, _, k_host, v_host = kvcache_ref(to_host64(qs[i]), k_host, v_host, to_host64(ks[i]), to_host64(vs[i]),
                                                 cache_seqlens=lens, causal=True)
        refs.append(ref_out)
        lens = lens + 1
    cupy.cuda.Device().synchronize()  # the inputs, made on the default stream
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        flashcupy.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **options)  # buffers and counters first
        stream.synchronize()
        # append, attention: the attention launch is programmatic from sm90 where cuda-bindings can launch it so
        assert [plan.programmatic for plan in plans] == [False, device_info().capability >= 90 and has_cuda_bindings()]
        stream.begin_capture()
        outs = []
        for i in range(steps):
            for src, dst in ((qs[i], q), (ks[i], k), (vs[i], v)):
                cupy.multiply(src, 1, out=dst)  # a kernel writes each input just ahead
            outs.append(flashcupy.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **options))
            seqlens += 1
        graph = stream.end_capture()
        for replay_round in range(2):
            k_cache[...], v_cache[...] = k_start, v_start
            seqlens[...] = cupy.asarray(seqlens0)
            for out in outs:
                out.fill(float("nan"))
            graph.launch(stream)
            stream.synchronize()
            for i, out in enumerate(outs):
                err = rel_err(to_host64(out), refs[i])
                assert err < REL_TOL["bfloat16"], f"replay {replay_round}, step {i}: relative error {err:.2e}"
            assert np.array_equal(to_host64(v_cache), v_host), "v_cache differs from the appends'"
    assert len(plans) == 2  # the captured steps launched the kept launches
