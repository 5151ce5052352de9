"""The sm90 (Hopper) forward family, forced with backend="sm90", against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import (REL_TOL, forward_against_reference, poison_pool, randn, rel_err, requires_gpu,
                         to_host64, varlen_forward_against_reference)

pytestmark = requires_gpu


@pytest.fixture(autouse=True)
def hopper():
    from flashcupy.device import device_info

    if device_info().capability != 90:
        pytest.skip("the sm90 family needs a Hopper GPU (compute capability 9.0)")


def run(q, k, v, dtype_name, **options):
    return forward_against_reference(q, k, v, dtype_name, "sm90", **options)


MASKS = [{}, {"causal": True}, {"window_size": (100, 30)}, {"causal": True, "alignment": "top_left"}]
MASK_IDS = ["none", "causal", "window", "causal-top-left"]


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("options", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (17, 17), (127, 129), (129, 127), (1000, 1000),
                                                (4099, 257), (257, 4099)])
def test_masks_and_ragged_lengths(dtype_name, head_dim, options, seqlen_q, seqlen_k):
    rng = np.random.default_rng(seqlen_q * 31 + seqlen_k + head_dim)
    batch = 1 if seqlen_q * seqlen_k > 10**6 else 2
    q = randn(rng, (batch, seqlen_q, 3, head_dim), dtype_name)
    k, v = (randn(rng, (batch, seqlen_k, 3, head_dim), dtype_name) for _ in range(2))
    run(q, k, v, dtype_name, **options)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("options", MASKS[1:3], ids=MASK_IDS[1:3])
def test_sections_of_the_tile_order(head_dim, options, monkeypatch):
    """The tile order in sections narrower than the problem (the last one narrower still): every q
    block of every (head, batch) pair runs once, against the reference."""
    from flashcupy import replay, sm90_fwd

    replay.clear()  # a kept launch of an earlier test's inputs would not ask for the sections
    asked = []
    monkeypatch.setattr(sm90_fwd, "section_heads", lambda problem, mask: asked.append(mask) or 3)
    rng = np.random.default_rng(head_dim + 9)
    q, k, v = (randn(rng, (7, 261, 2, head_dim), "bfloat16") for _ in range(3))
    run(q, k, v, "bfloat16", **options)
    assert len(asked) == 1  # the launch took the narrow sections


@pytest.mark.parametrize("head_dim", [192, 256])
@pytest.mark.parametrize("options", MASKS[1:], ids=MASK_IDS[1:])
@pytest.mark.parametrize("o_in_q", [False, True], ids=["o-direct", "o-in-q"])
@pytest.mark.parametrize("shape", [(3, 517, 261, 2), (45, 130, 200, 6)], ids=["more-queries-than-keys", "many-tiles"])
def test_banded_o_staged_in_q_or_stored_direct(head_dim, options, o_in_q, shape, monkeypatch):
    """Banded kernels at d = 256 stage O in the Q buffer for short rows and store it from registers
    for long ones (d = 192 always from registers): both ways against the reference, with q blocks
    that see no key (bottom-right bands over fewer keys than queries) and more tiles than the
    persistent grid has blocks."""
    from flashcupy import build, replay, sm90_fwd

    replay.clear()  # a kept launch would not ask for the variant
    monkeypatch.setattr(sm90_fwd, "BANDED_O_IN_Q_MAX_KEYS", 10**6 if o_in_q else 0)
    launched = []
    get_kernel = build.get_kernel
    monkeypatch.setattr(build, "get_kernel", lambda var: launched.append(var) or get_kernel(var))
    batch, seqlen_q, seqlen_k, nheads = shape
    rng = np.random.default_rng(head_dim + seqlen_q + len(options))
    q = randn(rng, (batch, seqlen_q, nheads, head_dim), "bfloat16")
    k, v = (randn(rng, (batch, seqlen_k, nheads, head_dim), "bfloat16") for _ in range(2))
    run(q, k, v, "bfloat16", **options)
    assert [var.o_in_q for var in launched] == [o_in_q and head_dim in sm90_fwd.BANDED_O_IN_Q_HEAD_DIMS]
    replay.clear()  # the kept launches were planned under the patched bound


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("seqlen_k", [333, 1100], ids=["short-rows", "long-rows"])
def test_many_blocks_gqa_and_sinks(head_dim, seqlen_k):
    """batch x heads past twice the SM count; 8 query heads per kv head; sink logits; rows of at
    most SHORT_ROW_KEYS keys and more (at d = 96 the two take different tiles)."""
    import cupy

    rng = np.random.default_rng(head_dim + seqlen_k)
    q = randn(rng, (3, 200, 96, head_dim), "bfloat16")
    k, v = (randn(rng, (3, seqlen_k, 12, head_dim), "bfloat16") for _ in range(2))
    sinks = cupy.asarray(rng.uniform(-1, 2, 96).astype(np.float32))
    run(q, k, v, "bfloat16", causal=True, sinks=sinks)


def test_strided_views():
    """q, k, v as views with padded rows and heads; nothing is copied."""
    rng = np.random.default_rng(9)
    big = randn(rng, (2, 300, 5, 160), "float16")
    q = big[:, :, 1:, :128]          # row stride 800, head stride 160, offset by one head
    kv = randn(rng, (2, 4, 500, 128), "float16").transpose(0, 2, 1, 3)  # heads outermost
    run(q, kv, kv, "float16", causal=True)


def test_strided_views_of_a_half_chunk():
    """At d = 96 a row's second 64-column chunk is half the head: the columns past it, here the
    next head's or the padding's, never reach the scores or O."""
    rng = np.random.default_rng(19)
    big = randn(rng, (2, 300, 3, 224), "bfloat16")
    q = big[:, :, :, 96:192]         # columns 192.. of the row are another tensor's
    k = big[:, :, :, :96]
    v = randn(rng, (2, 4, 300, 112), "bfloat16").transpose(0, 2, 1, 3)[:, :, 1:, 8:104]
    run(q, k, v, "bfloat16", window_size=(200, 7))


def test_matches_sm80():
    import flashcupy

    rng = np.random.default_rng(4)
    q, k, v = (randn(rng, (2, 777, 4, 128), "bfloat16") for _ in range(3))
    a = to_host64(flashcupy.flash_attn_func(q, k, v, causal=True, backend="sm90"))
    b = to_host64(flashcupy.flash_attn_func(q, k, v, causal=True, backend="sm80"))
    assert rel_err(a, b) < REL_TOL["bfloat16"]


def test_refuses_what_it_does_not_serve():
    import cupy

    import flashcupy

    rng = np.random.default_rng(2)
    q = randn(rng, (1, 64, 2, 32), "float16")
    with pytest.raises(ValueError, match="backend= 'sm90' cannot compute this fwd: head dim 32"):
        flashcupy.flash_attn_func(q, q, q, backend="sm90")
    # the default dispatch falls back to sm80 there
    out = flashcupy.flash_attn_func(q, q, q, alibi_slopes=cupy.full((2,), 0.1, cupy.float32))
    assert not np.isnan(to_host64(out)).any()


SCORE_MODS = [
    ({"softcap": 2.0}, "softcap"),
    ({"causal": True, "alibi": "heads"}, "alibi-causal"),
    ({"window_size": (200, 64), "alignment": "top_left", "softcap": 5.0, "alibi": "batch"}, "all"),
]


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("case", SCORE_MODS, ids=[c[1] for c in SCORE_MODS])
def test_softcap_alibi(dtype_name, head_dim, case):
    import cupy

    options, _ = case
    options = dict(options)
    rng = np.random.default_rng(head_dim + len(options))
    batch, nheads = 2, 4
    q = randn(rng, (batch, 517, nheads, head_dim), dtype_name)
    k, v = (randn(rng, (batch, 700, 2, head_dim), dtype_name) for _ in range(2))
    alibi = options.pop("alibi", None)
    if alibi:
        shape = (nheads,) if alibi == "heads" else (batch, nheads)
        options["alibi_slopes"] = cupy.asarray(rng.uniform(0.01, 0.3, shape).astype(np.float32))
    import flashcupy
    from flashcupy.reference import attention_ref

    poison_pool((q.shape, q.dtype))
    out = flashcupy.flash_attn_func(q, k, v, backend="sm90", **options)
    host = {n: (to_host64(a) if n == "alibi_slopes" else a) for n, a in options.items()}
    ref, _ = attention_ref(to_host64(q), to_host64(k), to_host64(v), **host)
    assert rel_err(to_host64(out), ref) < REL_TOL[dtype_name]


VARLEN = [([1, 17, 0, 127, 129, 1000], [5, 17, 3, 0, 300, 1000], {}),
          ([300, 1, 2, 15, 16, 17], [300, 1, 2, 15, 16, 17], {"causal": True}),
          ([17, 700, 0, 129], [900, 129, 33, 129], {"window_size": (64, 16), "sinks": True}),
          ([129, 1, 300], [129, 1, 300], {"causal": True, "softcap": 3.0})]


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("lengths_q, lengths_k, options", VARLEN)
def test_varlen(head_dim, lengths_q, lengths_k, options):
    rng = np.random.default_rng(sum(lengths_q) + head_dim)
    nheads = 4
    options = dict(options)
    if options.pop("sinks", None):
        options["sinks"] = rng.uniform(-1, 2, nheads).astype(np.float32)
    varlen_forward_against_reference(lengths_q, lengths_k, nheads, 2, head_dim, "bfloat16", rng, backend="sm90",
                                     **options)
