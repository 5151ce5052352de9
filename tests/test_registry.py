"""Kernel families and dispatch, on the CPU: which family serves a problem, and why not."""

import dataclasses

import pytest

from flashcupy import api, registry, sm80, sm90_bwd, sm90_fwd
from flashcupy.device import DeviceInfo
from flashcupy.problem import BACKEND_ENV, AttentionOptions, Problem

HOPPER = DeviceInfo(0, "H200", 90, 132, 227 * 1024, 141 << 30)
TURING = DeviceInfo(0, "T4", 75, 40, 64 * 1024, 16 << 30)
AMPERE = DeviceInfo(0, "A100", 80, 108, 163 * 1024, 80 << 30)


def sketch(head_dim=128, **options):
    return Problem.sketch(head_dim, "bfloat16", AttentionOptions(**options))


def test_every_direction_has_a_family_and_names_are_unique_per_direction():
    for direction in ("fwd", "bwd"):
        names = [f.name for f in registry.families(direction)]
        assert names and len(names) == len(set(names))
        assert all(f.direction == direction and f.summary and f.archs for f in registry.families(direction))
    assert registry.families() == registry.families("fwd") + registry.families("bwd")


def test_dispatch_takes_the_first_family_that_serves():
    assert isinstance(registry.select("fwd", sketch(), HOPPER), sm90_fwd.Sm90Forward)
    assert isinstance(registry.select("fwd", sketch(96), HOPPER), sm90_fwd.Sm90Forward)
    assert isinstance(registry.select("fwd", sketch(32), HOPPER), sm80.Sm80Forward)  # not an sm90 head dim
    assert isinstance(registry.select("fwd", sketch(), AMPERE), sm80.Sm80Forward)
    assert isinstance(registry.select("bwd", sketch(causal=True), HOPPER), sm90_bwd.Sm90Backward)
    assert isinstance(registry.select("bwd", sketch(96), HOPPER), sm90_bwd.Sm90Backward)
    assert isinstance(registry.select("bwd", sketch(192), HOPPER), sm90_bwd.Sm90Backward)
    assert isinstance(registry.select("bwd", sketch(32), HOPPER), sm80.Sm80Backward)  # not an sm90 head dim
    assert isinstance(registry.select("bwd", sketch(256), HOPPER), sm90_bwd.Sm90Backward)
    assert isinstance(registry.select("bwd", sketch(64), HOPPER), sm90_bwd.Sm90Backward)
    assert isinstance(registry.select("bwd", sketch(64), HOPPER, "sm90"), sm90_bwd.Sm90Backward)  # unless named
    assert isinstance(registry.select("bwd", sketch(softcap=5.0), HOPPER), sm90_bwd.Sm90Backward)
    assert isinstance(registry.select("bwd", sketch(deterministic=True), HOPPER), sm90_bwd.Sm90Backward)
    assert isinstance(registry.select("bwd", sketch(), AMPERE), sm80.Sm80Backward)


def test_no_family_says_why():
    with pytest.raises(ValueError, match=r"no fwd kernel family serves this problem on T4 \(decode: needs .* "
                                         r"sm90: Hopper .* "
                                         r"sm80: needs compute capability 8.0 or newer; this GPU has 7.5\)"):
        registry.select("fwd", sketch(), TURING)


def test_forced_backend():
    assert registry.select("fwd", sketch(), HOPPER, "sm80").name == "sm80"
    with pytest.raises(ValueError, match=r"backend= 'sm99' is not a fwd kernel family; choose from decode, sm90, sm80"):
        registry.select("fwd", sketch(), HOPPER, "sm99")
    with pytest.raises(ValueError, match=r"backend= 'sm80' cannot compute this bwd: needs compute capability"):
        registry.select("bwd", sketch(), TURING, "sm80")


class _Refuses(registry.Family):
    name, direction, summary, archs = "picky", "fwd", "serves head dim 64 only", ("sm_90a",)

    def runs_on(self, capability):
        return capability == 90

    def unsupported(self, problem, device):
        return None if problem.head_dim == 64 else f"head dim {problem.head_dim} is not 64"


def test_a_family_ahead_in_the_order_wins_where_it_serves(monkeypatch):
    picky = _Refuses()
    monkeypatch.setattr(registry, "families", lambda direction=None: (picky, sm80.Sm80Forward()))
    assert registry.select("fwd", sketch(64), HOPPER) is picky
    assert registry.select("fwd", sketch(128), HOPPER).name == "sm80"
    with pytest.raises(ValueError, match="backend= 'picky' cannot compute this fwd: head dim 128 is not 64"):
        registry.select("fwd", sketch(128), HOPPER, "picky")


def test_environment_forces_where_a_direction_has_the_family(monkeypatch):
    picky = _Refuses()
    every = (picky, sm80.Sm80Forward(), sm80.Sm80Backward())
    monkeypatch.setattr(registry, "families",
                        lambda direction=None: every if direction is None else
                        tuple(f for f in every if f.direction == direction))
    monkeypatch.setenv(BACKEND_ENV, "sm80")
    assert api.family_for("fwd", sketch(64), HOPPER).name == "sm80"  # forced past picky
    monkeypatch.setenv(BACKEND_ENV, "picky")
    assert api.family_for("fwd", sketch(64), HOPPER) is picky
    assert api.family_for("bwd", sketch(64), HOPPER).name == "sm80"  # no backward named picky: automatic
    monkeypatch.setenv(BACKEND_ENV, "nonesuch")
    with pytest.raises(ValueError, match=f"{BACKEND_ENV}='nonesuch' names no kernel family"):
        api.family_for("fwd", sketch(64), HOPPER)
    # the argument wins over the environment, and must name a family of its direction
    problem = Problem.sketch(64, "bfloat16", AttentionOptions(backend="picky"))
    with pytest.raises(ValueError, match="backend= 'picky' is not a bwd kernel family"):
        api.family_for("bwd", problem, HOPPER)


def test_options_are_checked_once_where_they_are_given():
    with pytest.raises(ValueError, match="softcap"):
        AttentionOptions(softcap=-1)
    with pytest.raises(TypeError, match="deterministic must be True or False"):
        AttentionOptions(deterministic="yes")
    with pytest.raises(TypeError, match="backend must be a kernel family's name"):
        AttentionOptions(backend=80)
    # the handle rejects bad options at construction, before any array exists
    with pytest.raises(ValueError, match="window_size"):
        api.FlashAttention(window_size=(-3, 0))
    with pytest.raises(ValueError, match="softcap"):
        api.FlashAttention(softcap=float("nan"))
    with pytest.raises(TypeError, match="deterministic"):
        api.FlashAttention(deterministic=None)
    for window in (5, None):  # not a pair: the check's own error, not tuple()'s
        with pytest.raises(TypeError, match="window_size must be a pair"):
            api.FlashAttention(window_size=window)
    # a family name is checked where it is given, also for calls that launch nothing (empty inputs)
    with pytest.raises(ValueError, match=r"backend='sm99' names no kernel family; choose from decode, sm90, sm80"):
        AttentionOptions(backend="sm99")
    assert AttentionOptions(backend="sm80").backend == "sm80"


class _Strided:
    """An array's shape, byte strides and device, as Problem.padded reads them."""

    class device:
        id = 0

    def __init__(self, shape, strides):
        self.shape, self.strides = shape, strides


def test_hopper_families_leave_broadcast_and_reversed_views_to_sm80():
    """TMA tensor maps take positive strides: a zero (broadcast) or negative (reversed) stride over a
    dim of extent > 1 in any array the kernels read sends the call to the sm80 families."""
    dense = _Strided((2, 512, 8, 128), (512 * 8 * 128 * 2, 8 * 128 * 2, 128 * 2, 2))
    options = AttentionOptions()
    for read, positive in (((dense, dense, dense), True),
                           ((dense, _Strided((2, 512, 8, 128), (0, 8 * 128 * 2, 128 * 2, 2)), dense), False),
                           ((dense, dense, _Strided((2, 512, 8, 128), (512 * 8 * 128 * 2, -8 * 128 * 2, 256, 2))), False),
                           ((_Strided((1, 512, 8, 128), (0, 8 * 128 * 2, 128 * 2, 2)), dense, dense), True)):  # extent 1
        problem = Problem.padded(dense, dense, "bfloat16", options, read=read)
        assert problem.positive_strides is positive
        for direction in ("fwd", "bwd"):
            assert registry.select(direction, problem, HOPPER).name == ("sm90" if positive else "sm80")
    for direction in ("fwd", "bwd"):
        with pytest.raises(ValueError, match="cannot compute this .*: an input with a zero or negative stride"):
            registry.select(direction, dataclasses.replace(sketch(), positive_strides=False), HOPPER, "sm90")


def test_a_family_that_passes_over_a_problem_yields_to_the_next():
    """passes_over leaves a problem to a later family that serves it, and runs it when none does."""

    class Slow(registry.Family):
        name, direction = "slow", "bwd"

        def unsupported(self, problem, device):
            return None

        def passes_over(self, problem, device):
            return "slower here"

    class Refuses(registry.Family):
        name, direction = "refuses", "bwd"

        def unsupported(self, problem, device):
            return "no"

    slow, refuses, sm80_bwd = Slow(), Refuses(), sm80.Sm80Backward()
    original = registry._instances
    try:
        registry._instances = lambda: (slow, sm80_bwd)
        assert registry.select("bwd", sketch(), HOPPER) is sm80_bwd
        registry._instances = lambda: (slow, refuses)
        assert registry.select("bwd", sketch(), HOPPER) is slow
        assert registry.select("bwd", sketch(), HOPPER, "slow") is slow
    finally:
        registry._instances = original


def test_few_queries_go_to_the_decode_forward():
    """The decode family takes a padded forward while seqlen_q x the query heads of a kv head fit the
    decode kernel's rows (one head per block with ALiBi slopes or sinks); past that it passes the
    problem over to the tiled families. Varlen problems count their longest sequence's queries."""
    from flashcupy import kvcache

    def few(seqlen_q, nheads=32, nheads_k=8, head_dim=128, **options):
        return Problem.sketch(head_dim, "bfloat16", AttentionOptions(**options), seqlen_q, nheads, nheads_k,
                              batch=2, seqlen_k=8192)

    rows = kvcache.DECODE_MAX_ROWS
    for device in (HOPPER, AMPERE):
        for seqlen_q, nheads_k in ((1, 8), (rows // 4, 8), (1, 1), (rows, 32), (3, 4)):
            problem = few(seqlen_q, nheads_k=nheads_k, causal=True)
            family = registry.select("fwd", problem, device)
            assert family.name == "decode", (seqlen_q, nheads_k)
            assert family.variant(problem, device) == kvcache.DecodeVariant(
                128, "bfloat16", "causal", False, *kvcache.decode_tile(128, device.capability))
    for seqlen_q, nheads_k in ((rows // 4 + 1, 8), (rows + 1, 32)):
        problem = few(seqlen_q, nheads_k=nheads_k)
        assert kvcache.packed_rows(problem) > rows
        assert "packed query rows per kv head" in registry.families("fwd")[0].passes_over(problem, HOPPER)
        assert registry.select("fwd", problem, HOPPER).name == "sm90"
        assert registry.select("fwd", problem, AMPERE).name == "sm80"
        forced = registry.select("fwd", problem, HOPPER, "decode")  # forced: the prefill kernel
        assert isinstance(forced.variant(problem, HOPPER), kvcache.PrefillVariant)
    # per-head score mods keep one query head per block: seqlen_q alone counts
    packed = few(8, nheads_k=8)
    one_head = dataclasses.replace(packed, options=dataclasses.replace(packed.options, sinks=object()))
    assert kvcache.packed_rows(packed) == 32 and kvcache.packed_rows(one_head) == 8
    for seqlen_q, family in ((1, "decode"), (rows // 4, "decode"), (rows // 4 + 1, "sm90")):
        varlen = dataclasses.replace(few(seqlen_q), cu_seqlens_q=object(), cu_seqlens_k=object())
        assert registry.select("fwd", varlen, HOPPER).name == family, seqlen_q
    assert registry.families("fwd")[0].unsupported(few(1), TURING).startswith("needs compute capability 8.0")


def test_decode_forward_leaves_mha_blocks_that_reread_keys_to_a_full_tiled_grid():
    """More than one block of packed rows per kv head reads the keys more often than a tiled forward
    (once per query head): the decode family passes over such problems where the tiled grid alone
    fills the GPU, and keeps them where its split keys fill it."""
    def mha(seqlen_q, batch, nheads=32, nheads_k=32):
        return Problem.sketch(128, "bfloat16", AttentionOptions(), seqlen_q, nheads, nheads_k, batch=batch,
                              seqlen_k=4096)

    assert registry.select("fwd", mha(32, batch=8), HOPPER).name == "sm90"  # 256 tiles for 132 SMs
    assert "read the keys more often" in registry.families("fwd")[0].passes_over(mha(32, batch=8), HOPPER)
    assert registry.select("fwd", mha(32, batch=4), HOPPER).name == "decode"  # 128 tiles
    assert registry.select("fwd", mha(16, batch=8), HOPPER).name == "decode"  # one block per head
    assert registry.select("fwd", mha(8, batch=8, nheads_k=8), HOPPER).name == "decode"  # 2 blocks, 4 heads
    assert registry.select("fwd", mha(16, batch=8, nheads=32, nheads_k=16), HOPPER).name == "decode"  # 2 and 2


def test_decode_forward_leaves_grids_past_its_limits_to_the_tiled_families():
    """Its grid holds the batch on z and the head groups on y (at most 65535 each); the tiled
    families put every block on x."""
    from flashcupy.launch import MAX_GRID_YZ

    def one_query(batch, nheads, nheads_k, **options):
        return Problem.sketch(64, "bfloat16", AttentionOptions(**options), 1, nheads, nheads_k, batch=batch,
                              seqlen_k=16)

    assert registry.select("fwd", one_query(MAX_GRID_YZ, 8, 1), HOPPER).name == "decode"
    for problem in (one_query(MAX_GRID_YZ + 1, 8, 1), one_query(1, MAX_GRID_YZ + 1, 1, sinks=object())):
        assert "at most 65535" in registry.families("fwd")[0].unsupported(problem, HOPPER)
        assert registry.select("fwd", problem, HOPPER).name == "sm90"
    assert registry.select("fwd", one_query(1, MAX_GRID_YZ, 1, sinks=object()), HOPPER).name == "decode"
