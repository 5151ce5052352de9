"""The sm90 families' host side, on the CPU: their kernel arguments and the forward's tile order."""

import dataclasses

import numpy as np
import pytest

from flashcupy import launch, params, sm90_fwd
from flashcupy.problem import AttentionOptions, Problem


def problem(batch, seqlen, nheads, head_dim, **options):
    return Problem.sketch(head_dim, "bfloat16", AttentionOptions(**options), batch=batch, seqlen=seqlen, nheads=nheads)


def test_args_layout():
    """Sm90FwdArgs: FwdParams, section_heads right after it, the tile counter 8 bytes later, the
    four tensor maps at 256, 384, 512 and 640 (the static_assert in fwd_sm90.cu holds the C++ side)."""
    fwd_bytes = params.record_dtype("FwdParams").itemsize
    record = np.zeros(1, params.record_dtype("FwdParams"))[0]
    raw = bytes(range(256)) * 2
    maps = [raw[i * 128:(i + 1) * 128] for i in range(4)]
    args = sm90_fwd.pack_args(record, 12, 0xDEADBEEF0, maps).tobytes()
    assert len(args) == 768
    assert int.from_bytes(args[fwd_bytes:fwd_bytes + 4], "little") == 12
    assert args[fwd_bytes + 4:fwd_bytes + 8] == bytes(4)  # padding
    assert int.from_bytes(args[fwd_bytes + 8:fwd_bytes + 16], "little") == 0xDEADBEEF0
    assert fwd_bytes + 16 <= 256
    for i, m in enumerate(maps):
        assert args[256 + 128 * i:384 + 128 * i] == m


def test_o_goes_through_shared_memory_where_it_fits():
    """O's tile is staged for TMA stores in a buffer of its own at d = 64 and 128, and at d = 96 in
    d = 128's tile (short rows); d = 192 and 256 have no room left for one and stage it in their one
    Q buffer: always without a band, and under a band at d = 256 when a row sees at most
    BANDED_O_IN_Q_MAX_KEYS keys (else each thread stores its part, as d = 96's 192-row tile, with
    two Q buffers; so do varlen calls, which pass no key count)."""
    short, long = sm90_fwd.BANDED_O_IN_Q_MAX_KEYS, sm90_fwd.BANDED_O_IN_Q_MAX_KEYS + 1
    for mask, keys, expected in (("none", long, {64: "own", 96: "", 128: "own", 192: "q", 256: "q"}),
                                 ("none", None, {64: "own", 96: "", 128: "own", 192: "q", 256: "q"}),
                                 ("none", 1000, {64: "own", 96: "own", 128: "own", 192: "q", 256: "q"}),
                                 ("causal", short, {64: "own", 96: "", 128: "own", 192: "", 256: "q"}),
                                 ("causal", long, {64: "own", 96: "", 128: "own", 192: "", 256: ""}),
                                 ("causal", None, {64: "own", 96: "", 128: "own", 192: "", 256: ""}),
                                 ("local", short, {64: "own", 96: "", 128: "own", 192: "", 256: "q"}),
                                 ("local", long, {64: "own", 96: "", 128: "own", 192: "", 256: ""})):
        variants = {d: sm90_fwd.variant(d, "bfloat16", mask, keys_per_row=keys) for d in sm90_fwd.HEAD_DIMS}
        assert {d: sm90_fwd.o_buffer(d, v.tile, v.o_in_q) for d, v in variants.items()} == expected
        assert {d: v.o_in_q for d, v in variants.items()} == {d: o == "q" for d, o in expected.items()}
    assert {d: sm90_fwd.q_slots(d, sm90_fwd.variant(d, "bfloat16", "none").tile) for d in (192, 256)} == {192: 1, 256: 1}
    for d in sm90_fwd.HEAD_DIMS:
        assert sm90_fwd.variant(d, "bfloat16", "causal").smem_bytes <= sm90_fwd.MAX_SMEM


@pytest.mark.parametrize("causal, window, alignment, seqlen_q, seqlen_k, keys", [
    (False, (-1, -1), "bottom_right", 300, 5000, 5000),
    (True, (-1, -1), "bottom_right", 9000, 3000, 3000),   # causal: every key for the last rows
    (False, (100, 30), "bottom_right", 5000, 5000, 131),  # a band narrower than the sequence
    (False, (-1, 30), "bottom_right", 100, 5000, 5000),   # one side unbounded
    (False, (4000, 4000), "bottom_right", 100, 300, 300),  # a band wider than the keys
    (True, (-1, -1), "top_left", 100, 5000, 100),         # top-left: row 99 sees keys 0..99
    (False, (1400, 16), "top_left", 129, 1600, 145),
    (False, (1400, 16), "bottom_right", 129, 1600, 1417),
])
def test_keys_per_row(causal, window, alignment, seqlen_q, seqlen_k, keys):
    options = AttentionOptions(causal=causal, window_size=window, alignment=alignment)
    p = Problem.sketch(128, "bfloat16", options, seqlen=seqlen_q, seqlen_k=seqlen_k)
    assert p.keys_per_row == keys
    # the kernels' bound holds on the reference's own mask: no row sees more keys
    rows = np.arange(seqlen_q)[:, None]
    cols = np.arange(seqlen_k)[None, :]
    offset = seqlen_k - seqlen_q if alignment == "bottom_right" else 0
    left, right = window if not causal else (window[0], 0)
    seen = np.ones((seqlen_q, seqlen_k), bool)
    if left >= 0:
        seen &= cols >= rows + offset - left
    if right >= 0:
        seen &= cols <= rows + offset + right
    assert seen.sum(axis=1).max() <= keys


@pytest.mark.parametrize("batch, seqlen, nheads, head_dim, causal, expected", [
    (8, 2048, 16, 128, False, 1),     # no mask: one head's blocks in order
    (8, 2048, 16, 128, True, 32),     # 1 MiB of K and V per head: 50 fit, rounded down to 32
    (1, 16384, 16, 128, True, 4),     # 8 MiB per head: 6 fit -> 4
    (1, 65536, 8, 256, True, 1),      # one head's K and V exceed L2: a section of one
    (1, 4096, 4, 64, True, 4),        # all heads fit: every pair in one section
    (16, 1024, 16, 128, True, 64),    # from 1024 queries: 512 KiB of K and V per pair: 100 fit -> 64
    (32, 512, 16, 128, True, 1),      # short sequences: a pair's blocks together
])
def test_section_heads(batch, seqlen, nheads, head_dim, causal, expected):
    p = problem(batch, seqlen, nheads, head_dim, causal=causal)
    assert sm90_fwd.section_heads(p, p.band.mask) == expected


@pytest.mark.parametrize("batch, seqlen, nheads, head_dim, mask, deterministic, expected", [
    (8, 2048, 16, 128, "none", False, 1),      # no mask: a head's key blocks adjacent
    (8, 2048, 16, 128, "causal", False, 16),   # 2 MiB of Q, dO, dQ, LSE, D per pair: 24 fit -> 16
    (1, 16384, 16, 128, "causal", False, 2),   # 16 MiB per pair: 3 fit -> 2
    (1, 16384, 32, 64, "local", False, 4),     # 8 MiB per pair: 6 -> 4
    (8, 2048, 16, 128, "causal", True, 1),     # deterministic: the semaphore's order
    (2, 4096, 2, 64, "causal", False, 4),      # every pair fits: one section
    (64, 1024, 16, 128, "causal", False, 1),   # short sequences: a pair's key blocks together
])
def test_backward_section_heads(batch, seqlen, nheads, head_dim, mask, deterministic, expected):
    from flashcupy import sm90_bwd

    p = problem(batch, seqlen, nheads, head_dim, causal=mask == "causal",
                window_size=(256, 0) if mask == "local" else (-1, -1))
    assert p.band.mask == mask
    assert sm90_bwd.section_heads(p, mask, deterministic) == expected


@pytest.mark.parametrize("num_tiles, pairs, section_pairs", [(7, 10, 4), (5, 3, 1), (16, 32, 32), (1, 5, 2)])
def test_section_order(num_tiles, pairs, section_pairs):
    """section_coords visits every (tile, pair) once; inside a section each row of tiles goes across
    the section's pairs, and each pair's tiles come in order."""
    order = [launch.section_coords(i, num_tiles, pairs, section_pairs) for i in range(num_tiles * pairs)]
    assert sorted(order) == [(t, q) for t in range(num_tiles) for q in range(pairs)]
    for q in range(pairs):
        assert [t for t, qq in order if qq == q] == list(range(num_tiles))
    first = order[:min(section_pairs, pairs)]
    assert first == [(0, q) for q in range(min(section_pairs, pairs))]
    if section_pairs == 1:
        assert order == [(t, q) for q in range(pairs) for t in range(num_tiles)]


def test_backward_args_layout():
    """Sm90BwdArgs: BwdParams from byte 0, section_heads right after it, the q, k, v, dout, dq_accum
    tensor maps at 512, 640, 768, 896, 1024 (the static_assert in bwd_sm90.cu holds the C++ side)."""
    from flashcupy import sm90_bwd

    bwd_bytes = params.record_dtype("BwdParams").itemsize
    assert bwd_bytes + 4 <= 512
    record = bytes(range(256)) * (bwd_bytes // 256) + bytes(range(bwd_bytes % 256))
    maps = [bytes([i + 1]) * 128 for i in range(5)]
    args = sm90_bwd.pack_args(record, 37, maps).tobytes()
    assert len(args) == 1152 and args[:bwd_bytes] == record
    assert int.from_bytes(args[bwd_bytes:bwd_bytes + 4], "little") == 37
    assert args[bwd_bytes + 4:512] == bytes(512 - bwd_bytes - 4)
    for i, m in enumerate(maps):
        assert args[512 + 128 * i:640 + 128 * i] == m


@pytest.mark.parametrize("head_dim, mask, score_mod, seqlen_q, block_m, block_n, dq_rows", [
    (64, "causal", False, None, 128, 128, 64), (64, "none", True, 100, 64, 128, 64),
    (128, "causal", False, None, 80, 128, 80), (128, "causal", False, 2048, 80, 128, 80),
    (128, "causal", False, 2047, 64, 128, 64), (128, "causal", True, 4096, 64, 128, 64),
    (128, "local", False, None, 64, 128, 64), (128, "none", False, 1, 80, 128, 80), (128, "none", True, None, 64, 128, 64),
    (96, "causal", False, None, 64, 128, 64), (96, "none", True, None, 64, 128, 64),
    (192, "none", False, None, 64, 96, 64), (192, "local", True, 100, 64, 96, 64),
    (256, "none", False, None, 64, 64, 64), (256, "causal", True, None, 64, 64, 64)])
def test_backward_tiles(head_dim, mask, score_mod, seqlen_q, block_m, block_n, dq_rows):
    """The sm90 backward's queries per step (its kernel template's kBlockM, the semaphores' q block
    and the Q/dO boxes): 128 at head dim 64 unless a score mod needs the registers, 80 at 128 without
    a mask or score mod and under a causal one from 2048 queries (None: a long problem); its keys per
    block (kBlockN, the K/V boxes, the grid): 96 at head dim 192, 64 at 256; the rows of dq_accum's box
    (kDQRows): 80 where the step's queries are not a multiple of 64; every variant fits the
    H100/H200's 227 KiB of shared memory per block."""
    from flashcupy import sm90_bwd

    for deterministic in (False, True):
        v = sm90_bwd.variant(head_dim, "bfloat16", mask, deterministic, score_mod=score_mod, seqlen_q=seqlen_q)
        assert (v.block_m, v.block_n, sm90_bwd.dq_rows(v.block_m)) == (block_m, block_n, dq_rows)
        assert f"<{head_dim}, {block_m}, {block_n}, {v.stages}," in v.name_expression
        assert f"tile={block_m}x{block_n}" in str(v) and v.smem_bytes <= 227 * 1024


def test_backward_variants_cover_short_and_long_problems():
    """The compiled list holds the variant the dispatcher picks for every length: both causal
    steps at head dim 128, each variant once."""
    from flashcupy import sm90_bwd

    listed = sm90_bwd.Sm90Backward().variants(90)
    assert len(listed) == len(set(listed))
    for seqlen_q in (1, 2047, 2048, 16384):
        for mask in ("none", "causal", "local"):
            for score_mod in (False, True):
                assert sm90_bwd.variant(128, "bfloat16", mask, True, score_mod, seqlen_q) in listed


def test_dq_accum_is_head_major():
    """The float32 dQ accumulator puts heads before rows (BwdParams::dq_accum); the sm90 backward's
    tensor map sees it in q's index order through a strided view of the same memory."""
    from flashcupy.sm80 import dq_accum_rows_view, dq_accum_shape

    assert dq_accum_shape((2, 5, 3, 64), 64) == (2, 3, 5, 64)
    assert dq_accum_shape((7, 3, 64), 64) == (3, 7, 64)  # packed varlen rows
    dense = np.arange(2 * 3 * 5 * 4).reshape(2, 3, 5, 4)
    view = dq_accum_rows_view(dense)
    assert view.shape == (2, 5, 3, 4) and view[1, 4, 2, 3] == dense[1, 2, 4, 3]
    packed = np.arange(3 * 7 * 4).reshape(3, 7, 4)
    view = dq_accum_rows_view(packed)
    assert view.shape == (7, 3, 4) and view[6, 2, 1] == packed[2, 6, 1]


def test_head_dim_64_takes_two_consumer_warpgroups_for_wide_bands_and_short_causal_rows():
    """d = 64 runs TWO_CONSUMER_TILES's two consumer warpgroups under a band wider than one key block
    and causal over rows of at most SHORT_ROW_KEYS keys; narrower bands, longer causal rows,
    unknown widths, no mask and the other head dims keep _TILES's."""
    from flashcupy.device import DeviceInfo

    three, two = sm90_fwd._TILES[64], sm90_fwd.TWO_CONSUMER_TILES[64]
    assert (three.block_m, two.block_m) == (192, 128)
    block_n, short = three.block_n, sm90_fwd.SHORT_ROW_KEYS
    for mask, keys in (("local", block_n + 1), ("causal", short), ("causal", 1)):
        assert sm90_fwd.tile_for(64, mask, keys) == two, (mask, keys)
    for mask, keys in (("local", block_n), ("local", None), ("causal", short + 1), ("causal", None),
                       ("none", 1), ("none", 10 ** 6)):
        assert sm90_fwd.tile_for(64, mask, keys, score_mod=mask == "none") == three, (mask, keys)
    # without a mask or score mods: the same tile with advanced descriptors
    plain = sm90_fwd.PLAIN_TILES[64]
    assert plain != three and dataclasses.replace(plain, advance_descs=False) == three
    for keys in (None, 1, 10 ** 6):
        assert sm90_fwd.tile_for(64, "none", keys) == plain
    for d in (96, 128, 192, 256):
        for mask, keys in (("local", 10 ** 6), ("causal", 10 ** 6), ("causal", None)):
            assert sm90_fwd.tile_for(d, mask, keys) == sm90_fwd._TILES[d]
    for d in (128, 256):
        assert sm90_fwd.tile_for(d, "causal", 512) == sm90_fwd._TILES[d]
    # d = 192: 96-key blocks over short rows, whatever the mask, 112 beyond
    for mask in ("none", "causal", "local"):
        assert sm90_fwd.tile_for(192, mask, 512).block_n == 96 and sm90_fwd.tile_for(192, mask, 4096).block_n == 112
    family = sm90_fwd.Sm90Forward()
    hopper = DeviceInfo(0, "H100", 90, 132, 227 * 1024, 80 << 30)
    for window, alignment, seqlen, tile in (((256, 0), "bottom_right", 2048, two), ((48, 16), "top_left", 2048, three),
                                            ((1400, 16), "bottom_right", 2048, two),
                                            ((-1, 0), "bottom_right", 1024, two), ((-1, 0), "bottom_right", 1025, three)):
        causal = window[1] == 0
        options = AttentionOptions(causal=causal, window_size=(-1, -1) if window[0] < 0 else window, alignment=alignment)
        problem = Problem.sketch(64, "bfloat16", options, seqlen)
        assert family.variant(problem, hopper).tile == tile, (window, seqlen)
        assert family.variant(problem, hopper) in family.variants(90)
    assert two.threads == 384 and sm90_fwd.variant(64, "bfloat16", "local", False, 4096).smem_bytes <= sm90_fwd.MAX_SMEM


def test_head_dim_96_takes_two_consumer_warpgroups_over_short_rows():
    """d = 96 runs three consumer warpgroups of 96-key blocks (112 without a mask or score mods),
    and d = 128's tile where a row sees at most SHORT_ROW_KEYS keys, whatever the mask and score
    mods; its tiles hold whole 64-column chunks, as d = 128's."""
    three, short = sm90_fwd._TILES[96], sm90_fwd.SHORT_ROW_TILES[96]
    assert (three.block_m, three.block_n, short.block_m, short.block_n) == (192, 96, 128, 128)
    for mask in ("none", "causal", "local"):
        for score_mod in (False, True):
            assert sm90_fwd.tile_for(96, mask, sm90_fwd.SHORT_ROW_KEYS, score_mod) == short
            if mask != "none" or score_mod:
                assert sm90_fwd.tile_for(96, mask, sm90_fwd.SHORT_ROW_KEYS + 1, score_mod) == three
    plain = sm90_fwd.PLAIN_TILES[96]
    assert (plain.block_m, plain.block_n) == (192, 112)
    for keys in (None, sm90_fwd.SHORT_ROW_KEYS + 1):
        assert sm90_fwd.tile_for(96, "none", keys) == plain
        assert sm90_fwd.tile_for(96, "none", keys, score_mod=True) == three
    assert [sm90_fwd.tile_cols(d) for d in (64, 96, 128, 192, 256)] == [64, 128, 128, 192, 256]
    assert sm90_fwd.smem_bytes(96, short) == sm90_fwd.smem_bytes(128, short)


def test_the_tensor_maps_need_cuda_bindings(monkeypatch):
    from flashcupy import device, sm90_fwd

    monkeypatch.setattr(device, "has_cuda_bindings", lambda: False)
    assert "cuda-bindings" in sm90_fwd._bindings_missing.__wrapped__()
    monkeypatch.setattr(device, "has_cuda_bindings", lambda: True)
    assert sm90_fwd._bindings_missing.__wrapped__() is None
