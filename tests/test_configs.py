"""The sm80 families' tile table and launch plans, and the band planner, on the CPU."""

import pytest

from flashcupy import configs, launch, problem, sm80

CAPABILITIES = [80, 86, 89, 90]


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_every_variant_fits_shared_memory(capability):
    limit = configs.smem_limit(capability)
    variants = sm80.Sm80Forward().variants(capability)
    assert len(variants) == len(configs.SUPPORTED_HEAD_DIMS) * 2 * len(configs.MASKS) * 2  # x score_mod
    for v in variants:
        assert v.smem_bytes <= limit, f"{v} needs {v.smem_bytes} B of shared memory, {limit} available"
        t = v.tile
        assert t.block_m % (16 * t.num_warps) == 0 and t.block_n % 16 == 0


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_every_backward_variant_fits(capability):
    limit = configs.smem_limit(capability)
    for v in sm80.Sm80Backward().variants(capability):
        assert v.smem_bytes <= limit, f"{v} needs {v.smem_bytes} B of shared memory, {limit} available"
        if isinstance(v, sm80.BwdVariant):
            t = v.tile
            key_groups = t.block_n // 16
            assert t.num_warps % key_groups == 0 and (v.head_dim // (t.num_warps // key_groups)) % 16 == 0
            dq_parts = t.num_warps // (t.block_m // 16)
            assert t.num_warps % (t.block_m // 16) == 0 and (v.head_dim // dq_parts) % 16 == 0


def test_backward_plans_cover_rows_and_keys():
    v = sm80.bwd_variant(128, "bfloat16", "causal", True, 90)
    plans = sm80.plan_backward(v, batch=3, nheads=5, seqlen_q=1000, seqlen_k=777)
    num_n = -(-777 // v.tile.block_n)
    assert plans.main.grid == (num_n * 5 * 3, 1, 1) and plans.main.smem_bytes == v.smem_bytes
    assert plans.preprocess.grid[0] * sm80.PREPROCESS_ROWS_PER_BLOCK >= 3 * 5 * 1000
    assert plans.convert_dq.grid[0] * sm80.CONVERT_THREADS * 8 >= 3 * 1000 * 5 * 128
    assert plans.semaphores == (3, 5, -(-1000 // v.tile.block_m))
    # another family's main kernel between these helpers: its q block sizes the semaphores
    assert sm80.plan_backward(v, batch=3, nheads=5, seqlen_q=1000, seqlen_k=777, q_block=48).semaphores == (3, 5, 21)
    # GQA 5 -> 1 kv head; varlen: helpers run over the packed rows, the main grid over the longest sequence
    packed = sm80.plan_backward(v, batch=3, nheads=5, seqlen_q=1000, seqlen_k=777, nheads_k=1, rows_q=1500,
                                  rows_k=1200)
    assert packed.main == plans.main
    assert packed.preprocess.grid[0] == -(-1500 * 5 // sm80.PREPROCESS_ROWS_PER_BLOCK)
    assert packed.convert_dq.grid[0] == -(-1500 * 5 * 128 // 8 // sm80.CONVERT_THREADS)
    assert packed.group_sum.grid[0] == -(-1200 * 1 * 128 // 8 // sm80.CONVERT_THREADS)
    blocks = {launch.block_coords(x, plans.main.grid[0], num_n, 5, True, False) for x in range(plans.main.grid[0])}
    assert blocks == {(n, h, b) for n in range(num_n) for h in range(5) for b in range(3)}
    # causal: key block 0 (the one every q block sees) of every head goes first
    assert [launch.block_coords(x, plans.main.grid[0], num_n, 5, True, False)[0] for x in range(15)] == [0] * 15


def test_backward_name_expression():
    v = sm80.bwd_variant(64, "float16", "none", True, 90)
    t = v.tile
    assert v.name_expression == (f"flash_bwd_kernel<64, {t.block_m}, {t.block_n}, {t.num_warps}, {t.stages}, "
                                 "false, false, false, true, false>")
    mod = sm80.bwd_variant(64, "float16", "local", False, 90, score_mod=True)
    assert mod.name_expression.endswith("false, true, false, false, true>") and "+score_mod" in str(mod)


def test_smem_limit_falls_back_to_smaller_tile():
    big = sm80.fwd_tile(256, 90)
    small = sm80.fwd_tile(256, 86)
    assert sm80.fwd_smem_bytes(256, big) > configs.smem_limit(86) >= sm80.fwd_smem_bytes(256, small)


def test_unsupported_capability_and_head_dim():
    with pytest.raises(ValueError, match="compute capability 7.5"):
        sm80.fwd_tile(64, 75)
    with pytest.raises(ValueError, match="supported head dims"):
        sm80.fwd_tile(48, 90)


def test_name_expression_carries_template_arguments():
    v = sm80.fwd_variant(128, "bfloat16", "causal", 90)
    t = v.tile
    assert v.name_expression == (f"flash_fwd_kernel<128, {t.block_m}, {t.block_n}, {t.num_warps}, true, false, true, "
                                 "false>")
    local = sm80.fwd_variant(128, "float16", "local", 90, score_mod=True)
    assert local.name_expression.endswith("false, true, false, true>")
    with pytest.raises(ValueError, match="mask must be one of"):
        sm80.fwd_variant(128, "float16", True, 90)


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("seqlen_q", [1, 17, 63, 64, 65, 127, 128, 129, 1000, 4099])
def test_planner_covers_every_query_row_once(capability, seqlen_q):
    batch, nheads = 3, 5
    for v in sm80.Sm80Forward().variants(capability):
        plan = sm80.plan_forward(v, batch=batch, nheads=nheads, seqlen_q=seqlen_q)
        assert plan.block == (v.tile.threads, 1, 1) and plan.smem_bytes == v.smem_bytes
        num_m = -(-seqlen_q // v.tile.block_m)
        covered = []
        masked = v.mask != "none"
        for x in range(plan.grid[0]):
            m, h, b = launch.block_coords(x, plan.grid[0], num_m, nheads, masked, masked)
            assert 0 <= m < num_m and 0 <= h < nheads and 0 <= b < batch
            row0 = m * v.tile.block_m
            covered += [(b, h, r) for r in range(row0, min(row0 + v.tile.block_m, seqlen_q))]
        assert sorted(covered) == [(b, h, r) for b in range(batch) for h in range(nheads) for r in range(seqlen_q)]


def test_causal_launch_order_is_heaviest_first():
    v = sm80.fwd_variant(64, "float16", "causal", 90)
    plan = sm80.plan_forward(v, batch=2, nheads=3, seqlen_q=1000)
    num_m = -(-1000 // v.tile.block_m)
    order = [launch.block_coords(x, plan.grid[0], num_m, 3, True, True)[0] for x in range(plan.grid[0])]
    assert order == sorted(order, reverse=True) and order[0] == num_m - 1


def test_planner_rejects_grid_overflow():
    v = sm80.fwd_variant(64, "float16", "none", 90)
    with pytest.raises(ValueError, match="grid limit"):
        sm80.plan_forward(v, batch=65536, nheads=1024, seqlen_q=65536)


def test_band_parameters():
    assert problem.plan_band(False, (-1, -1), "bottom_right", 100, 300).mask == "none"
    top_left_none = problem.plan_band(False, (-1, -1), "top_left", 100, 300)
    assert (top_left_none.mask, top_left_none.bottom_right) == ("none", False)  # ALiBi reads the alignment
    assert problem.plan_band(True, (-1, -1), "bottom_right", 100, 300).mask == "causal"
    top_left = problem.plan_band(True, (-1, -1), "top_left", 100, 300)
    assert (top_left.mask, top_left.bottom_right, top_left.right, top_left.left) == ("local", False, 0, 400 + 256)
    windowed = problem.plan_band(True, (16, -1), "bottom_right", 100, 300)
    assert (windowed.mask, windowed.bottom_right, windowed.left, windowed.right) == ("local", True, 16, 0)
    right_only = problem.plan_band(False, (-1, 8), "bottom_right", 300, 100)
    assert (right_only.mask, right_only.bottom_right, right_only.right, right_only.left) == ("local", True, 8, 400 + 256)
    with pytest.raises(ValueError, match="too large"):
        problem.plan_band(False, (1, 1), "bottom_right", 2**29, 2**29)
