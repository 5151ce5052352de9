"""The kv-cache path on the CPU: its reference (decode_ref) against plain attention, the split-KV
merge, the split rule, the argument checks and the parameter layout."""

import dataclasses

import numpy as np
import pytest

from flashcupy import decode_ref, kvcache
from flashcupy.device import DeviceInfo, gpu_available
from flashcupy.reference import attention_ref
from flashcupy.validation import ArraySpec, check_kvcache_inputs, check_kvcache_values

RNG = np.random.default_rng(12)


def spec(shape, dtype=np.float16, strides=None, device=0):
    if strides is None:
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= n
        strides = tuple(reversed(strides))
    return ArraySpec(tuple(shape), np.dtype(dtype), tuple(strides), device)


# ---- the reference ---------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_reference_without_append_is_attention_over_each_sequences_rows(causal):
    q = RNG.standard_normal((3, 2, 8, 64))
    kc, vc = RNG.standard_normal((2, 3, 40, 2, 64))
    seqlens = np.array([1, 17, 40], np.int32)
    out, lse, kc2, vc2 = decode_ref.kvcache_ref(q, kc, vc, cache_seqlens=seqlens, causal=causal)
    assert np.array_equal(kc2, kc) and np.array_equal(vc2, vc)
    for b, n in enumerate(seqlens):
        o, l = attention_ref(q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n], causal=causal)
        assert np.allclose(out[b], o[0]) and np.allclose(lse[b], l[0])


def test_reference_appends_in_place_of_the_rows_it_names_only():
    q = RNG.standard_normal((2, 3, 4, 32))
    kc, vc = RNG.standard_normal((2, 2, 20, 2, 32))
    k, v = RNG.standard_normal((2, 2, 3, 2, 32))
    seqlens = np.array([0, 17], np.int32)
    out, _, kc2, vc2 = decode_ref.kvcache_ref(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True)
    for b, n in enumerate(seqlens):
        assert np.array_equal(kc2[b, n:n + 3], k[b]) and np.array_equal(vc2[b, n:n + 3], v[b])
        untouched = np.ones(20, bool)
        untouched[n:n + 3] = False
        assert np.array_equal(kc2[b, untouched], kc[b, untouched])
        o, _ = attention_ref(q[b:b + 1], kc2[b:b + 1, :n + 3], vc2[b:b + 1, :n + 3], causal=True)
        assert np.allclose(out[b], o[0])


def test_reference_paged_equals_contiguous():
    """A shuffled block table over pages of 16 rows gives the contiguous cache's results."""
    batch, capacity, page = 2, 64, 16
    q = RNG.standard_normal((batch, 1, 4, 64))
    kc, vc = RNG.standard_normal((2, batch, capacity, 1, 64))
    k, v = RNG.standard_normal((2, batch, 1, 1, 64))
    seqlens = np.array([5, 40], np.int32)
    order = RNG.permutation(batch * capacity // page)
    table = order.reshape(batch, capacity // page).astype(np.int32)
    kp, vp = np.zeros((batch * capacity // page, page, 1, 64)), np.zeros((batch * capacity // page, page, 1, 64))
    for b in range(batch):
        for j in range(capacity // page):
            kp[table[b, j]], vp[table[b, j]] = kc[b, j * page:(j + 1) * page], vc[b, j * page:(j + 1) * page]
    want = decode_ref.kvcache_ref(q, kc, vc, k, v, cache_seqlens=seqlens)
    got = decode_ref.kvcache_ref(q, kp, vp, k, v, cache_seqlens=seqlens, block_table=table)
    assert np.allclose(want[0], got[0]) and np.allclose(want[1], got[1])
    for b in range(batch):
        rows = np.arange(capacity)
        assert np.array_equal(got[2][table[b, rows // page], rows % page], want[2][b])


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_rotates_pairs_and_keeps_the_rest(interleaved):
    x = RNG.standard_normal((3, 2, 64))
    angle = RNG.standard_normal((10, 16))
    y = decode_ref.rotary_rotate(x, np.cos(angle), np.sin(angle), [4, 0, 9], interleaved)
    assert np.array_equal(y[..., 32:], x[..., 32:])  # rotary_dim 32
    first, second = (slice(0, 32, 2), slice(1, 32, 2)) if interleaved else (slice(0, 16), slice(16, 32))
    for i, pos in enumerate([4, 0, 9]):
        c, s = np.cos(angle[pos]), np.sin(angle[pos])
        assert np.allclose(y[i, :, first], x[i, :, first] * c - x[i, :, second] * s)
        assert np.allclose(y[i, :, second], x[i, :, first] * s + x[i, :, second] * c)


def _rotary_case():
    """q (1, 2, 2, 32), a cache of 10 rows, 2 new keys and values, rotary tables for 12 rows."""
    q = RNG.standard_normal((1, 2, 2, 32))
    kc, vc = RNG.standard_normal((2, 1, 10, 1, 32))
    k, v = RNG.standard_normal((2, 1, 2, 1, 32))
    angle = RNG.standard_normal((12, 16))
    return q, kc, vc, k, v, np.cos(angle), np.sin(angle)


def test_reference_rotates_new_keys_and_queries_at_their_rows():
    q, kc, vc, k, v, cos, sin = _rotary_case()
    out, _, kc2, vc2 = decode_ref.kvcache_ref(q, kc, vc, k, v, cache_seqlens=3, rotary_cos=cos, rotary_sin=sin,
                                              rotary_interleaved=False, causal=True)
    assert np.allclose(kc2[0, 3:5], decode_ref.rotary_rotate(k[0], cos, sin, [3, 4], False))
    assert np.array_equal(vc2[0, 3:5], v[0])  # values are not rotated
    q_rot = decode_ref.rotary_rotate(q[0], cos, sin, [3, 4], False)  # causal: query row i at row 3 + i
    want, _ = attention_ref(q_rot[None], kc2[:, :5], vc2[:, :5], causal=True)
    assert np.allclose(out, want)
    out, _, _, _ = decode_ref.kvcache_ref(q, kc, vc, k, v, cache_seqlens=3, rotary_cos=cos, rotary_sin=sin,
                                          rotary_interleaved=False)
    q_rot = decode_ref.rotary_rotate(q[0], cos, sin, [3, 3], False)  # not causal: every row at row 3
    want, _ = attention_ref(q_rot[None], kc2[:, :5], vc2[:, :5])
    assert np.allclose(out, want)


def test_reference_rounds_rotated_rows_to_the_dtype_it_is_given():
    """rotated_dtype: the appended keys (in the cache) and the queries rotated, then rounded to it."""
    import ml_dtypes

    q, kc, vc, k, v, cos, sin = _rotary_case()
    kw = dict(cache_seqlens=3, rotary_cos=cos, rotary_sin=sin, causal=True)
    out, _, kc2, vc2 = decode_ref.kvcache_ref(q, kc, vc, k, v, rotated_dtype=ml_dtypes.bfloat16, **kw)
    exact, _, kc_exact, _ = decode_ref.kvcache_ref(q, kc, vc, k, v, **kw)
    assert np.array_equal(kc2[0, 3:5], kc_exact[0, 3:5].astype(ml_dtypes.bfloat16).astype(np.float64))
    assert not np.array_equal(kc2[0, 3:5], kc_exact[0, 3:5])
    assert np.array_equal(kc2[0, :3], kc[0, :3])  # rows not appended: as they were
    q_rot = decode_ref.rotary_rotate(q[0], cos, sin, [3, 4], True).astype(ml_dtypes.bfloat16).astype(np.float64)
    want, _ = attention_ref(q_rot[None], kc2[:, :5], vc2[:, :5], causal=True)
    assert np.allclose(out, want)
    assert not np.allclose(out, exact, rtol=0, atol=1e-12)


# ---- split-KV ---------------------------------------------------------------------------------

@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (1, 300), (3, 129), (17, 17), (40, 300), (300, 129)])
@pytest.mark.parametrize("pack", [1, 4])
@pytest.mark.parametrize("band", [dict(), dict(causal=True), dict(window_size=(50, 3)), dict(window_size=(-1, 0))],
                         ids=["none", "causal", "window", "right0"])
def test_the_decode_plan_merged_by_lse_equals_attention(num_splits, seqlen_q, seqlen_k, pack, band):
    """Packed heads (pack 4: the 4 query heads of a kv head in one block), blocks of 16 rows and 16
    keys, the band's key ranges, every split count up to more than the blocks."""
    q = RNG.standard_normal((seqlen_q, 8, 32))
    k, v = RNG.standard_normal((2, seqlen_k, 2, 32))
    out, lse = decode_ref.decode_split_kv(q, k, v, num_splits, 16, pack=pack, block_m=16, **band)
    want, want_lse = attention_ref(q[None], k[None], v[None], **band)
    assert np.allclose(out, want[0]) and np.allclose(lse, want_lse[0])


def test_split_blocks_share_the_blocks_evenly_in_order():
    for n_blocks in (0, 1, 5, 64):
        for splits in (1, 2, 5, 40):
            shares = [decode_ref.split_blocks(3, n_blocks, splits, s) for s in range(splits)]
            assert shares[0][0] == 3 and shares[-1][1] == 3 + n_blocks
            assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
            sizes = [b - a for a, b in shares]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_merge_of_empty_parts():
    outs = RNG.standard_normal((3, 2, 8))
    out, lse = decode_ref.merge_partials(outs, np.full((3, 2), -np.inf))
    assert np.array_equal(out, np.zeros((2, 8))) and np.all(lse == -np.inf)
    out, lse = decode_ref.merge_partials(outs, np.array([[-np.inf, 0.5], [1.0, -np.inf], [-np.inf, -np.inf]]))
    assert np.allclose(out[0], outs[1, 0]) and np.allclose(out[1], outs[0, 1]) and np.allclose(lse, [1.0, 0.5])


def test_split_rule():
    """Splits fill one wave of the GPU's slots and no more, at least MIN_KEYS_PER_SPLIT keys each;
    none once the blocks fill half the slots."""
    slots = 264  # 132 SMs x 2 blocks
    assert kvcache.num_splits_for(64, 8, 1, 8192, slots) == 1  # 512 blocks
    assert kvcache.num_splits_for(32, 8, 1, 65536, slots) == 1  # 256 blocks: a second wave would be 248
    assert kvcache.num_splits_for(8, 8, 1, 8192, slots) == 4  # 256 blocks, not 5 x 64 = 320
    assert kvcache.num_splits_for(1, 8, 1, 8192, slots) == 33  # 8 blocks -> 264
    assert kvcache.num_splits_for(1, 8, 1, 2048, slots) == 2048 // kvcache.MIN_KEYS_PER_SPLIT
    assert kvcache.num_splits_for(1, 1, 1, 64, slots) == 1  # too few keys to split
    assert kvcache.num_splits_for(1, 1, 1, 10**7, slots) == kvcache.MAX_SPLITS
    assert kvcache.num_splits_for(0, 8, 1, 8192, slots) == 1


def test_blocks_per_sm():
    """By shared memory, then by threads: the decode kernel's tiles on an H100/H200 and an RTX 4090."""
    hopper = DeviceInfo(0, "H200", 90, 132, 227 * 1024, 141 << 30)
    ada = DeviceInfo(0, "RTX 4090", 89, 128, 99 * 1024, 24 << 30)
    for v in kvcache.variants():
        if isinstance(v, (kvcache.DecodeVariant, kvcache.PrefillVariant)):
            for device in (hopper, ada):
                n = kvcache.blocks_per_sm(v, device)
                staged = kvcache.stages_rows_in_registers(v, device.capability)
                registers = kvcache.STAGED_REGISTERS if staged else 0
                assert n * (v.smem_bytes + 1024) <= device.smem_per_block_optin + 1024 or n == 1
                assert n * registers * v.threads <= 65536 or n == 1
                threads = 2048 if device.capability == 90 else 1536
                assert ((n + 1) * (v.smem_bytes + 1024) > device.smem_per_block_optin + 1024
                        or (n + 1) * v.threads > threads or (n + 1) * registers * v.threads > 65536)
    four, two = (kvcache.DecodeVariant(128, "bfloat16", "none", False, *tile)
                 for tile in kvcache.DECODE_TILES_SM90_SMALL[128])
    assert kvcache.blocks_per_sm(four, hopper) == 2  # by registers; shared memory would allow 3
    assert kvcache.blocks_per_sm(two, hopper) == 4
    # a thread's registers are allocated in 8s: 128 registers hold two 256-thread blocks, 121 (as
    # 128) too, 129 (as 136) one
    assert [kvcache.blocks_by_registers(r, 256) for r in (121, 128, 129)] == [2, 2, 1]


# ---- argument checks ----------------------------------------------------------------------------

def _at(a, offset):
    """`a` placed at a GPU address, `offset` elements past a common base."""
    return dataclasses.replace(a, address=0x7F0000000000 + offset * a.dtype.itemsize)


def _inputs(**over):
    base = dict(q=spec((2, 1, 8, 128)), k_cache=spec((2, 100, 2, 128)), v_cache=spec((2, 100, 2, 128)), k=None,
                v=None, block_table=None, rotary_cos=None, rotary_sin=None)
    base.update(over)
    return base


def test_kvcache_inputs_accepted():
    check_kvcache_inputs(**_inputs(), head_dims=kvcache.HEAD_DIMS)
    check_kvcache_inputs(**_inputs(k=spec((2, 3, 2, 128)), v=spec((2, 3, 2, 128)), rotary_cos=spec((200, 32)),
                                   rotary_sin=spec((200, 32))), head_dims=kvcache.HEAD_DIMS)
    check_kvcache_inputs(**_inputs(k_cache=_at(spec((2, 100, 2, 128)), 0), v_cache=_at(spec((2, 100, 2, 128)), 51200),
                                   k=spec((2, 3, 2, 128)), v=spec((2, 3, 2, 128))), head_dims=kvcache.HEAD_DIMS)


@pytest.mark.parametrize("over, match", [
    (dict(q=spec((2, 8, 128))), "q must have 4 dimensions"),
    (dict(q=spec((2, 1, 8, 80))), "head dim 80"),
    (dict(v_cache=spec((2, 99, 2, 128))), "same shape"),
    (dict(k_cache=spec((2, 100, 3, 128)), v_cache=spec((2, 100, 3, 128))), "multiple of"),
    (dict(k_cache=spec((2, 100, 2, 128), np.float32), v_cache=spec((2, 100, 2, 128), np.float32)), "dtype"),
    (dict(k=spec((2, 3, 2, 128))), "given together"),
    (dict(k=spec((2, 0, 2, 128)), v=spec((2, 0, 2, 128))), "seqlen_new >= 1"),
    (dict(k=spec((2, 3, 2, 128)), v=spec((2, 3, 2, 128), device=1)), "device"),
    (dict(rotary_cos=spec((10, 32)), rotary_sin=spec((10, 32))), "give k and v"),
    (dict(k=spec((2, 3, 2, 128)), v=spec((2, 3, 2, 128)), rotary_cos=spec((10, 36)), rotary_sin=spec((10, 36))),
     "multiple of 16"),
    (dict(block_table=spec((2, 4), np.int64)), "block_table must be int32"),
    (dict(k_cache=spec((2, 100, 2, 128), strides=(25600, 256, 128, 2))), "contiguous in its last dimension"),
    (dict(block_table=spec((2, 0), np.int32)), "at least one block per sequence"),
    (dict(k_cache=spec((8, 0, 2, 128)), v_cache=spec((8, 0, 2, 128)), block_table=spec((2, 4), np.int32)),
     "one row per block"),
    (dict(k_cache=spec((8, 2**20, 2, 128)), v_cache=spec((8, 2**20, 2, 128)), block_table=spec((2, 2**10), np.int32)),
     "the cache holds 1073741824 rows per sequence"),
    (dict(q=spec((65536, 1, 8, 128)), k_cache=spec((2, 100, 2, 128))), r"batch \(65536\) and nheads"),
    (dict(k_cache=_at(spec((2, 100, 2, 128)), 0), v_cache=_at(spec((2, 100, 2, 128)), 128), k=spec((2, 3, 2, 128)),
          v=spec((2, 3, 2, 128))), "k_cache shares memory with v_cache"),
])
def test_kvcache_inputs_refused_naming_the_argument(over, match):
    with pytest.raises((ValueError, TypeError), match=match):
        check_kvcache_inputs(**_inputs(**over), head_dims=kvcache.HEAD_DIMS)


def _values(**over):
    base = dict(seqlens=np.array([10, 20], np.int32), leftpad=None, batch_idx=None, block_table=None, seqlen_new=1,
                capacity=100, cache_entries=2, seqlen_ro=None, rotary_q_per_row=False, seqlen_q=1)
    base.update(over)
    return base


def test_kvcache_values_accepted():
    check_kvcache_values(**_values())
    check_kvcache_values(**_values(seqlens=np.array([99, 0], np.int32), leftpad=np.array([5, 0], np.int32),
                                   batch_idx=np.array([1, 0], np.int32)))
    check_kvcache_values(**_values(block_table=np.array([[3, 0], [1, 2]], np.int32), cache_entries=4))


@pytest.mark.parametrize("over, match", [
    (dict(seqlens=np.array([10, 100], np.int32)), r"cache_seqlens\[1\] = 100 plus the 1 new keys"),
    (dict(seqlens=np.array([-1, 0], np.int32)), r"cache_seqlens\[0\]"),
    (dict(leftpad=np.array([0, 21], np.int32)), r"cache_leftpad\[1\] = 21"),
    (dict(batch_idx=np.array([0, 2], np.int32)), r"cache_batch_idx\[1\] = 2 is outside"),
    (dict(batch_idx=np.array([1, 1], np.int32)), "distinct"),
    (dict(block_table=np.array([[0, 9], [1, 2]], np.int32), cache_entries=4, seqlens=np.array([60, 10], np.int32)),
     r"block_table\[0, 1\] = 9"),
    (dict(seqlen_ro=20), "rotary_cos and rotary_sin have 20 rows"),
    (dict(seqlen_ro=22, rotary_q_per_row=True, seqlen_q=3), "positions up to 22"),
])
def test_kvcache_values_refused(over, match):
    with pytest.raises(ValueError, match=match):
        check_kvcache_values(**_values(**over))


def test_cache_seqlens_as_an_int_checked_before_any_copy():
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 2\*\*30\); got 3000000000"):
        kvcache._index_array(3_000_000_000, "cache_seqlens", 2, 0, True)
    with pytest.raises(ValueError, match="cache_seqlens must lie in"):
        kvcache._index_array(-1, "cache_seqlens", 2, 0, True)


def test_cache_batch_idx_checked_on_its_own():
    """Where the lengths stay on the GPU (check_values=False), a host cache_batch_idx is still checked."""
    from flashcupy.validation import check_cache_batch_idx

    check_cache_batch_idx(np.array([1, 0], np.int32), 1, 2)
    check_cache_batch_idx(np.array([1, 1], np.int32), 0, 2)  # nothing appended: may repeat
    with pytest.raises(ValueError, match=r"cache_batch_idx\[0\] = -1 is outside"):
        check_cache_batch_idx(np.array([-1, 0], np.int32), 1, 2)
    with pytest.raises(ValueError, match="distinct"):
        check_cache_batch_idx(np.array([0, 0], np.int32), 1, 2)


def test_unused_blocks_of_the_table_are_not_checked():
    """Entries past a sequence's last row may hold anything (a padded table)."""
    check_kvcache_values(**_values(block_table=np.array([[0, -1], [1, 99]], np.int32), cache_entries=4))


def test_kvcache_variants_name_their_kernels():
    names = [v.name_expression for v in kvcache.variants(head_dims=(128,), dtypes=("bfloat16",), masks=("causal",))]
    warps, stages = kvcache.DECODE_TILES[128]
    h_warps, h_stages = kvcache.DECODE_TILES_SM90[128]
    short = kvcache.DECODE_TILES_SM90_SMALL[128]
    assert names == [f"flash_decode_kernel<128, {warps}, {stages}, true, false, true, false>",
                     f"flash_decode_kernel<128, {warps}, {stages}, true, false, true, true>",
                     "flash_prefill_kernel<128, 64, true, false, true, false>",  # block_n 64
                     "flash_prefill_kernel<128, 64, true, false, true, true>",
                     *[f"flash_decode_kernel<128, {w}, {st}, true, false, true, {mod}>"  # Hopper's own tiles
                       for w, st in dict.fromkeys([(h_warps, h_stages), *short]) if (w, st) != (warps, stages)
                       for mod in ("false", "true")],
                     *[f"flash_decode_cluster_kernel<128, {w}, {st}, {cluster}, true, false, true, {mod}>"
                       for w, st in ((h_warps, h_stages), short[0])  # the long tile's and the first small one's
                       for cluster in kvcache.DECODE_CLUSTERS_SM90[128] for mod in ("false", "true")],
                     "kvcache_append_kernel<true>", "rotary_q_kernel<true>"]


def test_few_rows_take_the_decode_kernel_many_the_prefill_kernel():
    for rows in (1, 4, 16, kvcache.DECODE_MAX_ROWS):
        assert isinstance(kvcache.attention_variant(rows, 128, "bfloat16", "none", False), kvcache.DecodeVariant)
    for rows in (kvcache.DECODE_MAX_ROWS + 1, 64, 4096):
        assert isinstance(kvcache.attention_variant(rows, 64, "float16", "causal", True), kvcache.PrefillVariant)


@pytest.mark.parametrize("page_size", list(range(1, 70)) + [96, 100, 127, 128, 255, 256, 257, 1000, 1024, 4096,
                                                           65535, 65536, 10**6, 2**30 + 7])
def test_page_divider_divides_every_row(page_size):
    """The kernels' row // page_size as (row * mul) >> shift, against Python's division on rows near
    every multiple (where a rounding error would show first) and up to 2**31 - 1."""
    mul, shift = kvcache.page_divider(page_size)
    assert 0 < mul < 2**32
    multiples = np.concatenate([np.arange(5), 2**31 // page_size - np.arange(2)]) * page_size
    rows = np.concatenate([np.arange(min(4 * page_size + 3, 5000)), (multiples[:, None] + [-1, 0, 1, page_size - 1]).ravel(),
                           RNG.integers(0, 2**31, 2000), [2**31 - 1]]).astype(np.int64)
    rows = rows[(rows >= 0) & (rows < 2**31)]
    quotient = (rows.astype(object) * mul) >> shift  # Python ints: the kernel's 64-bit product exactly
    assert list(quotient) == list(rows // page_size)
    with pytest.raises(ValueError, match="page_size"):
        kvcache.page_divider(0)


def test_the_merge_has_room_for_every_split():
    """After its loop a block merges its splits in the shared memory it used (merge_splits): the
    decode kernel in all but Q's and the barriers', the prefill kernel in all of it; a chunk of one
    row needs a weight per split (MAX_SPLITS), the row's LSE and one split's row of the output."""
    for v in kvcache.variants():
        need = kvcache.MAX_SPLITS + 1 + v.head_dim + 3 if hasattr(v, "head_dim") else 0
        if isinstance(v, kvcache.DecodeVariant):
            region = v.smem_bytes - kvcache.DECODE_BLOCK_M * (v.head_dim + 8) * 2 - 8 * v.warps * v.stages
            assert region // 4 >= need, v
        elif isinstance(v, kvcache.PrefillVariant):
            assert v.smem_bytes // 4 >= need, v


def test_decode_tiles_fit_every_gpu_that_runs_them():
    """Every head dim's blocks fit the 99 KiB an Ampere/Ada block may have (A100 and Hopper more);
    Hopper's own tiles fit its 227 KiB, are compiled for sm_90a and are chosen there alone."""
    for v in kvcache.variants():
        assert v.smem_bytes <= (227 if kvcache.hopper_only(v) else 99) * 1024, v
    assert any(kvcache.hopper_only(v) for v in kvcache.variants())
    for v, arch in kvcache.ci_cases():
        if kvcache.hopper_only(v):
            assert arch == "sm_90a", v
    for d in kvcache.HEAD_DIMS:
        ampere = kvcache.attention_variant(1, d, "float16", "none", False, capability=86)
        hopper = kvcache.attention_variant(4, d, "float16", "none", False, capability=90)
        assert (ampere.warps, ampere.stages) == kvcache.DECODE_TILES[d]
        assert (hopper.warps, hopper.stages) == kvcache.DECODE_TILES_SM90.get(d, kvcache.DECODE_TILES[d])
        assert not kvcache.hopper_only(ampere)
        assert kvcache.small_tiles(d, 90) == kvcache.DECODE_TILES_SM90_SMALL.get(d, ())
        assert kvcache.small_tiles(d, 86) == ()


def test_hopper_takes_the_small_tiles_for_many_unsplit_blocks():
    """On sm90 at head dim 128: few blocks (splits) take DECODE_TILES_SM90, many unsplit blocks
    DECODE_TILES_SM90_SMALL (past one wave of slots for caches of at most SHORT_KEYS keys, past
    LONG_WAVES waves for longer ones); other GPUs DECODE_TILES."""
    from flashcupy.problem import AttentionOptions, Problem, plan_band

    hopper = DeviceInfo(0, "H200", 90, 132, 227 * 1024, 141 << 30)
    ada = DeviceInfo(0, "RTX 4090", 89, 128, 99 * 1024, 24 << 30)

    def plan(batch, capacity, device, nheads_k=8, seqlen_q=1, num_splits=0):
        problem = Problem(batch, seqlen_q, capacity, 32, nheads_k, 128, "bfloat16", 128 ** -0.5,
                          plan_band(False, (-1, -1), "bottom_right", seqlen_q, capacity), AttentionOptions())
        p = kvcache.plan_launch(problem, num_splits, device)
        if isinstance(p.kernel, kvcache.PrefillVariant):
            return "prefill", p.splits
        return (p.kernel.warps, p.kernel.stages), p.splits

    long = kvcache.DECODE_TILES_SM90[128]
    four, two = kvcache.DECODE_TILES_SM90_SMALL[128]
    assert plan(1, 8192, hopper) == (long, 16)
    assert plan(8, 1024, hopper) == (long, 2)  # 64 blocks: split, latency-bound
    # past SHORT_KEYS: the long tile while 4 waves of its 132 slots hold the blocks, the 4-warp
    # tile while 4 waves of its 264 do, then the 2-warp tile
    assert plan(32, 65536, hopper) == (long, 1)  # 256 blocks
    assert plan(66, 4096, hopper) == (long, 1)  # 528 blocks
    assert plan(67, 4096, hopper) == (four, 1)
    assert plan(128, 4096, hopper) == (four, 1)  # 1024 blocks
    assert plan(132, 8192, hopper) == (four, 1)  # 1056 blocks
    assert plan(133, 8192, hopper) == (two, 1)
    assert plan(128, 8192, hopper, nheads_k=32) == (two, 1)  # 4096 blocks
    # unsplit, at most SHORT_KEYS keys: the long tile while its 132 slots hold the blocks, the
    # 4-warp tile while its 264 do, then the 2-warp tile; never split
    assert plan(16, 2048, hopper) == (long, 1)  # 128 blocks
    assert plan(33, 2048, hopper) == (four, 1)  # 264 blocks
    assert plan(34, 2048, hopper) == (two, 1)  # 272 blocks
    assert plan(128, 1024, hopper) == (two, 1)
    assert plan(100, 1000, hopper, nheads_k=2) == (four, 1)  # the GPU test's cases
    assert plan(300, 1000, hopper, nheads_k=2) == (two, 1)
    # few blocks, unsplit because asked or because the cache is short: the long tile
    assert plan(4, 2048, hopper, num_splits=1) == (long, 1)
    assert plan(4, 200, hopper) == (long, 1)
    assert plan(300, 1000, hopper, nheads_k=2, num_splits=3) == (long, 3)
    # 4 query rows x 16 heads per kv head: the prefill kernel, never a decode tile
    assert plan(300, 1000, hopper, nheads_k=2, seqlen_q=4) == ("prefill", 1)
    assert plan(128, 1024, ada) == (kvcache.DECODE_TILES[128], 1)

    assert kvcache.unsupported(256, DeviceInfo(0, "RTX 4090", 89, 128, 99 * 1024, 24 << 30)) is None
    assert "8.0" in kvcache.unsupported(128, DeviceInfo(0, "T4", 75, 40, 64 * 1024, 16 << 30))


def test_the_attention_launch_is_programmatic_for_decode_tiles_from_sm90(monkeypatch):
    """The decode kernel waits for the kernel ahead of it (griddep_wait, compiled from sm90), so its
    launch may overlap that kernel's tail there; the prefill kernel, older GPUs and installs without
    cuda-bindings launch plainly."""
    from flashcupy import device
    from flashcupy.problem import AttentionOptions, Problem, plan_band

    monkeypatch.setattr(device, "has_cuda_bindings", lambda: True)

    hopper = DeviceInfo(0, "H200", 90, 132, 227 * 1024, 141 << 30)
    ada = DeviceInfo(0, "RTX 4090", 89, 128, 99 * 1024, 24 << 30)

    def launch_plan(batch, seqlen_q, device, num_splits=0):
        problem = Problem(batch, seqlen_q, 8192, 32, 2, 128, "bfloat16", 128 ** -0.5,
                          plan_band(False, (-1, -1), "bottom_right", seqlen_q, 8192), AttentionOptions())
        p = kvcache.plan_launch(problem, num_splits, device, lambda variant, device_id: 0)
        return p, p.launch_plan(32, batch, device.capability)

    p, lp = launch_plan(3, 1, hopper, num_splits=5)
    assert isinstance(p.kernel, kvcache.DecodeVariant) and lp.programmatic
    assert lp.grid == (p.m_blocks * 5, 32 // p.pack, 3) and lp.block == (p.kernel.threads, 1, 1)
    assert lp.smem_bytes == p.kernel.smem_bytes
    assert not launch_plan(3, 1, ada)[1].programmatic
    p, lp = launch_plan(3, 4, hopper)
    assert isinstance(p.kernel, kvcache.PrefillVariant) and not lp.programmatic
    monkeypatch.setattr(device, "has_cuda_bindings", lambda: False)  # the launch needs them
    assert not launch_plan(3, 1, hopper)[1].programmatic


def test_hopper_merges_splits_in_a_cluster_where_every_cluster_fits():
    """sm90, head dim 128: a split count of DECODE_CLUSTERS_SM90 runs as one cluster per q block
    when the GPU holds all of them at once (the driver's count, faked here); else the count merges."""
    from flashcupy.problem import AttentionOptions, Problem, plan_band

    hopper = DeviceInfo(0, "H200", 90, 132, 227 * 1024, 141 << 30)
    ada = DeviceInfo(0, "RTX 4090", 89, 128, 99 * 1024, 24 << 30)
    # what the driver reports on an H100 for clusters of these blocks: (warps, cluster size)
    h100 = {(8, 2): 66, (8, 4): 30, (8, 8): 15, (4, 2): 132, (4, 4): 62, (4, 8): 30}

    def plan_of(batch, capacity, device=hopper, num_splits=0, resident=lambda cluster: None, head_dim=128,
                nheads_k=8):
        problem = Problem(batch, 1, capacity, 32, nheads_k, head_dim, "bfloat16", head_dim ** -0.5,
                          plan_band(False, (-1, -1), "bottom_right", 1, capacity), AttentionOptions())
        return kvcache.plan_launch(problem, num_splits, device, lambda variant, device_id:
                                   resident(variant.cluster) or h100[variant.warps, variant.cluster])

    def plan(*args, **kwargs):
        p = plan_of(*args, **kwargs)
        return p.kernel.cluster, p.splits

    assert plan(1, 1024) == (8, 8)  # 8 q blocks of 8 splits: 8 clusters of 8
    assert plan(8, 1024) == (2, 2)  # 64 clusters of 2
    assert plan(1, 8192) == (1, 16)  # 16 splits: no cluster of 16
    # over short caches the rule's 16 splits are cut to one cluster of 8 (where the clusters fit)
    assert plan(1, 2048) == plan(1, kvcache.CLUSTER_CAP_KEYS) == (8, 8)
    assert plan(1, kvcache.CLUSTER_CAP_KEYS + 1) == (1, 16)
    assert plan(1, 2048, num_splits=16) == (1, 16)  # asked for
    assert plan(1, 2048, resident=lambda cluster: 7) == (1, 16)
    assert plan(1, 1024, resident=lambda cluster: 7) == (1, 8)  # not all at once
    assert plan(8, 1024, resident=lambda cluster: 63) == (1, 2)
    assert plan(1, 8192, num_splits=2) == (2, 2)  # asked for
    assert plan(1, 8192, num_splits=3) == (1, 3)
    assert plan(1, 1024, device=ada) == (1, 8)
    assert plan(1, 1024, head_dim=64) == (1, 8)
    # 32 kv heads, 4 splits: 32 clusters of 4 long-tile blocks do not fit (30); over splits of a
    # short cache the 4-warp tile's do (two blocks an SM), over longer ones the count merges on the
    # long tile
    short = plan_of(1, 4 * kvcache.CLUSTER_SMALL_TILE_SPLIT_KEYS, nheads_k=32)
    long = plan_of(1, 4 * kvcache.CLUSTER_SMALL_TILE_SPLIT_KEYS + 1, nheads_k=32)
    assert (short.kernel.warps, short.kernel.cluster, short.splits) == (4, 4, 4)
    assert (long.kernel.warps, long.kernel.cluster, long.splits) == (8, 1, 4)
    assert plan(1, 1024, nheads_k=32) == (1, 4)
    assert plan(4, 512) == (4, 4) and plan(4, 1024) == (1, 4)  # GQA 32/8: 32 q blocks
    assert plan(1, 1024, nheads_k=16) == (8, 8)  # 16 clusters of 8: the 4-warp tile's (30 fit, not 15)
    assert plan_of(1, 1024, nheads_k=16).kernel.warps == 4
    assert plan_of(1, 1024, nheads_k=16, resident=lambda cluster: 16).kernel.warps == 8
    assert plan(1, 1024, nheads_k=32, head_dim=256, resident=lambda cluster: 30) == (1, 4)  # no small tile at 256
    # where the driver cannot say (no GPU), no cluster is taken
    if not gpu_available():
        variant = kvcache.DecodeVariant(128, "bfloat16", "none", False, *kvcache.DECODE_TILES_SM90[128], 8)
        assert kvcache.resident_clusters(variant, 0) == 0


def test_resident_clusters_without_cuda_bindings(monkeypatch):
    """A GPU but no cuda-bindings: the driver's count cannot be asked, so no cluster is taken."""
    from flashcupy import device

    monkeypatch.setattr(device, "gpu_available", lambda: True)
    monkeypatch.setattr(device, "has_cuda_bindings", lambda: False)
    variant = kvcache.DecodeVariant(128, "bfloat16", "none", False, *kvcache.DECODE_TILES_SM90[128], 2)
    assert kvcache.resident_clusters.__wrapped__(variant, 0) == 0


def test_a_window_bounds_the_split_count():
    """The split rule counts the keys a q block's rows can see (a window's width, plus the rows'
    spread), not the cache's capacity: a 256-key window over 32k keys is split in two, not sixteen."""
    from flashcupy.problem import AttentionOptions, Problem, plan_band

    hopper = DeviceInfo(0, "H200", 90, 132, 227 * 1024, 141 << 30)

    def splits(window, seqlen_q=1, capacity=32768):
        options = AttentionOptions(window_size=window)
        problem = Problem(1, seqlen_q, capacity, 32, 8, 128, "bfloat16", 128 ** -0.5,
                          plan_band(False, window, "bottom_right", seqlen_q, capacity), options)
        return kvcache.plan_launch(problem, 0, hopper, lambda variant, device_id: 0).splits

    assert splits((-1, -1)) == 16
    assert splits((256, 0)) == 2  # 257 keys
    assert splits((1023, 0), seqlen_q=8) == 8  # 1031 keys for the block's rows
    assert splits((0, 0)) == 1


def test_launch_refuses_appends_rotation_and_pages_on_varlen_or_without_lengths():
    """kvcache.launch reads a varlen batch as one contiguous cache entry (the decode forward family):
    an append, a query rotation or a block table there, or an append or rotation without lengths,
    is refused before anything is allocated or launched."""
    from flashcupy.problem import AttentionOptions, Problem

    padded = Problem.sketch(128, "bfloat16", AttentionOptions(), 1, 8, 2, batch=2, seqlen_k=300)
    varlen = dataclasses.replace(padded, cu_seqlens_q=object(), cu_seqlens_k=object())
    for problem, extra in ((varlen, {"k": object(), "seqlens": object()}),
                           (varlen, {"rotary_cos": object(), "seqlens": object()}),
                           (varlen, {"block_table": object()})):
        with pytest.raises(ValueError, match="varlen batch is read as one contiguous cache entry"):
            kvcache.launch(problem, None, None, None, None, None, None, **extra)
    with pytest.raises(ValueError, match="needs cache_seqlens"):
        kvcache.launch(padded, None, None, None, None, None, None, k=object())
