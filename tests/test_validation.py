"""Argument checks, on the CPU: every bad input gets an error that names the argument."""

import ml_dtypes
import numpy as np
import pytest

from flashcupy.validation import ArraySpec, check_forward_inputs, check_softmax_scale

BF16 = np.dtype(ml_dtypes.bfloat16)


def spec(shape, dtype=np.float16, strides=None, device=0):
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return ArraySpec(tuple(shape), np.dtype(dtype), tuple(strides), device)


def good(**kw):
    q = spec((2, 100, 8, 64), **kw)
    kv = spec((2, 77, 8, 64), **kw)
    return q, kv, kv


def test_valid_inputs_pass():
    check_forward_inputs(*good())
    check_forward_inputs(*good(dtype=BF16))
    q = spec((2, 100, 8, 128))
    kv = spec((2, 50, 2, 128))  # GQA
    check_forward_inputs(q, kv, kv)


def test_spec_of_numpy_array_uses_element_strides():
    a = np.zeros((2, 3, 4, 64), np.float16)[:, :, 1:3]
    s = ArraySpec.of(a, device=0)
    assert s.shape == (2, 3, 2, 64) and s.strides == (768, 256, 64, 1)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_wrong_rank_names_argument(which):
    q, k, v = good()
    bad = spec((2, 100, 64))
    args = {"q": q, "k": k, "v": v, which: bad}
    with pytest.raises(ValueError, match=rf"^{which} must have 4 dimensions"):
        check_forward_inputs(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8])
def test_unsupported_dtype(dtype):
    q, k, v = good()
    with pytest.raises(TypeError, match=r"q has dtype .* float16 and bfloat16"):
        check_forward_inputs(spec(q.shape, dtype), k, v)


def test_mixed_dtypes():
    q, k, v = good()
    with pytest.raises(TypeError, match="one dtype"):
        check_forward_inputs(q, spec(k.shape, BF16), v)


def test_mismatched_shapes():
    q, k, v = good()
    with pytest.raises(ValueError, match="k has batch size 3"):
        check_forward_inputs(q, spec((3, 77, 8, 64)), v)
    with pytest.raises(ValueError, match="v has head dim 128"):
        check_forward_inputs(q, k, spec((2, 77, 8, 128)))
    with pytest.raises(ValueError, match="same seqlen"):
        check_forward_inputs(q, k, spec((2, 78, 8, 64)))
    with pytest.raises(ValueError, match=r"heads in k/v \(3\) must divide"):
        kv = spec((2, 77, 3, 64))
        check_forward_inputs(q, kv, kv)


def test_unsupported_head_dim_lists_supported():
    q = spec((1, 10, 2, 80))
    with pytest.raises(ValueError, match=r"head dim 80 is not supported; supported head dims: 32, 64, 96, 128, 192, 256"):
        check_forward_inputs(q, q, q)


def test_noncontiguous_last_dim():
    q, k, v = good()
    bad = spec(q.shape, strides=(100 * 8 * 128, 8 * 128, 128, 2))
    with pytest.raises(ValueError, match="q must be contiguous in its last dimension"):
        check_forward_inputs(bad, k, v)


def test_unaligned_strides():
    q, k, v = good()
    bad = spec(k.shape, strides=(77 * 8 * 65, 8 * 65, 65, 1))
    with pytest.raises(ValueError, match="k strides .* multiples of 8"):
        check_forward_inputs(q, bad, v)


def test_different_devices():
    q, k, v = good()
    with pytest.raises(ValueError, match="one device"):
        check_forward_inputs(q, k, spec(v.shape, device=1))


@pytest.mark.parametrize("scale", [0, -1.0, float("nan"), float("inf")])
def test_bad_softmax_scale(scale):
    from flashcupy.problem import AttentionOptions

    with pytest.raises(ValueError, match="softmax_scale must be a positive"):
        check_softmax_scale(scale)
    with pytest.raises(ValueError, match="softmax_scale"):
        AttentionOptions(softmax_scale=scale)


def test_softmax_scale_type():
    with pytest.raises(TypeError, match="softmax_scale"):
        check_softmax_scale("big")


def test_host_arrays_refused_before_any_gpu_work():
    import flashcupy

    q = np.ones((1, 4, 1, 64), np.float16)
    with pytest.raises(TypeError, match=r"q is a NumPy \(host\) array.*cupy.asarray\(q\)"):
        flashcupy.flash_attn_func(q, q, q)


def test_unknown_object_refused():
    import flashcupy

    with pytest.raises(TypeError, match="q must be a CuPy array"):
        flashcupy.flash_attn_func([[1.0]], None, None)


def test_empty_arrays_pass_layout_checks():
    q = spec((0, 16, 2, 64), strides=(0, 0, 0, 0))
    check_forward_inputs(q, q, q)


def test_softmax_scale_must_fit_float32():
    for scale in (1e39, 1e-50):
        with pytest.raises(ValueError, match="float32"):
            check_softmax_scale(scale)
    check_softmax_scale(1e-3)


def test_fractional_byte_strides_refused():
    class Strided:  # a float16 array whose row stride is 129 bytes, as another library might expose
        shape, dtype, strides = (1, 4, 1, 64), np.dtype(np.float16), (4 * 129, 129, 129, 2)

    odd = ArraySpec.of(Strided(), device=0)
    assert odd.strides[1] == 64.5  # kept fractional, not floored to 64
    with pytest.raises(ValueError, match="q has byte strides that are not whole multiples of its item size"):
        check_forward_inputs(odd, odd, odd)


def test_overlapping_outputs_refused():
    from flashcupy.validation import check_backward_inputs

    q = spec((2, 100, 8, 64))
    kv = spec((2, 77, 8, 64))
    lse = ArraySpec((2, 8, 100), np.dtype(np.float32), (800, 100, 1), 0)
    check_backward_inputs(q, q, kv, kv, q, lse, {"dq": q})
    broadcast = spec((2, 100, 8, 64), strides=(0, 0, 0, 1))
    with pytest.raises(ValueError, match="dk has overlapping elements"):  # heads 8 elements apart, d = 64
        check_backward_inputs(q, q, kv, kv, q, lse, {"dk": spec((2, 77, 8, 64), strides=(77 * 64, 64, 8, 1))})
    with pytest.raises(ValueError, match="dq has overlapping elements"):
        check_backward_inputs(q, q, kv, kv, q, lse, {"dq": broadcast})


def test_band_options():
    from flashcupy.validation import check_band

    check_band(False, (-1, -1), "bottom_right")
    check_band(True, (128, 0), "top_left")
    check_band(True, (128, -1), "bottom_right")
    with pytest.raises(ValueError, match="causal=True already limits"):
        check_band(True, (4, 4), "bottom_right")
    with pytest.raises(ValueError, match="window_size left must be an int >= -1"):
        check_band(False, (-2, 0), "bottom_right")
    with pytest.raises(ValueError, match="window_size right must be an int"):
        check_band(False, (3, 1.5), "bottom_right")
    with pytest.raises(TypeError, match="window_size must be a pair"):
        check_band(False, 5, "bottom_right")
    with pytest.raises(ValueError, match="alignment must be one of"):
        check_band(False, (-1, -1), "diagonal")
    with pytest.raises(TypeError, match="causal must be True or False"):
        check_band("yes", (-1, -1), "bottom_right")


def test_score_mod_options():
    from flashcupy.validation import check_score_mods, check_softcap

    f32 = np.float32
    check_score_mods(None, None, 2, 8, 0)
    check_score_mods(spec((8,), f32), spec((8,), f32), 2, 8, 0)
    check_score_mods(spec((2, 8), f32), None, 2, 8, 0)
    check_softcap(0.0)
    check_softcap(30)
    cases = [
        (dict(softcap=-1.0), ValueError, "softcap must be a finite number >= 0"),
        (dict(softcap=float("inf")), ValueError, "softcap"),
        (dict(softcap="big"), TypeError, "softcap must be a number"),
        (dict(alibi=spec((3, 8), f32)), ValueError, r"alibi_slopes must have shape \(8,\) or \(2, 8\)"),
        (dict(alibi=spec((8,), np.float16)), TypeError, "alibi_slopes must be float32"),
        (dict(alibi=spec((2, 8), f32, strides=(1, 2))), ValueError, "alibi_slopes must be C-contiguous"),
        (dict(sinks=spec((2, 8), f32)), ValueError, r"sinks must have shape \(8,\)"),
        (dict(sinks=spec((8,), np.float64)), TypeError, "sinks must be float32"),
        (dict(sinks=spec((8,), f32, device=1)), ValueError, "sinks must be on q's device"),
    ]
    for change, error, match in cases:
        args = dict(softcap=0.0, alibi=None, sinks=None)
        args.update(change)
        with pytest.raises(error, match=match):
            check_softcap(args["softcap"])
            check_score_mods(args["alibi"], args["sinks"], 2, 8, 0)


def test_varlen_layout_and_cu_seqlens():
    from flashcupy.validation import check_cu_seqlens, check_cu_seqlens_values, check_varlen_layout

    i32 = np.int32
    check_varlen_layout(spec((30, 2, 64)), spec((40, 2, 64)), spec((40, 2, 64)))
    with pytest.raises(ValueError, match="k must have 3 dimensions"):
        check_varlen_layout(spec((30, 2, 64)), spec((1, 40, 2, 64)), spec((40, 2, 64)))
    assert check_cu_seqlens(spec((4,), i32), spec((4,), i32), 10, 0, 0) == 3
    cases = [
        ((spec((4,), np.int64), spec((4,), i32), 1, 1), TypeError, "cu_seqlens_q must be int32"),
        ((spec((4,), i32), spec((1,), i32), 1, 1), ValueError, "cu_seqlens_k must be 1-D with batch"),
        ((spec((4,), i32), spec((5,), i32), 1, 1), ValueError, "same length"),
        ((spec((4,), i32, strides=(2,)), spec((4,), i32), 1, 1), ValueError, "cu_seqlens_q must be contiguous"),
        ((spec((4,), i32), spec((4,), i32, device=1), 1, 1), ValueError, "cu_seqlens_k must be on q's device"),
        ((spec((4,), i32), spec((4,), i32), -1, 1), ValueError, r"max_seqlen_q must be an int in \[0, 2\*\*30\)"),
        ((spec((4,), i32), spec((4,), i32), 1, 2**30), ValueError, r"max_seqlen_k must be an int in \[0, 2\*\*30\)"),
        ((spec((4,), i32), spec((4,), i32), 1, 2.5), ValueError, "max_seqlen_k must be an int"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            check_cu_seqlens(*args, 0)

    check_cu_seqlens_values("cu_seqlens_q", np.array([0, 0, 5, 12], i32), 12, 7)  # empty sequence allowed
    bad = [
        ((np.array([1, 5, 12], i32), 12, 7), r"cu_seqlens_q\[0\] must be 0"),
        ((np.array([0, 5, 4, 12], i32), 12, 8), r"non-decreasing; cu_seqlens_q\[2\] = 4 < cu_seqlens_q\[1\] = 5"),
        ((np.array([0, 5, 11], i32), 12, 7), r"cu_seqlens_q\[-1\] = 11 must equal the number of packed tokens \(12\)"),
        ((np.array([0, 5, 12], i32), 12, 6), "max_seqlen_q = 6 is shorter than the longest sequence"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            check_cu_seqlens_values("cu_seqlens_q", *args)


def test_numbers_that_are_bools_or_below_float32_refused():
    from flashcupy.validation import check_softcap

    with pytest.raises(TypeError, match="softmax_scale must be a positive number"):
        check_softmax_scale(True)
    with pytest.raises(TypeError, match="softcap must be a number"):
        check_softcap(True)
    for tiny in (1e-46, 1e-39):  # 0 in float32, and a subnormal one: the kernels would not see the cap
        with pytest.raises(ValueError, match="softcap must be 0 .off. or at least float32's smallest normal"):
            check_softcap(tiny)
    check_softcap(1e-30)


def test_windows_wider_than_both_sequences_are_unbounded():
    """A side at least seqlen_q + seqlen_k wide reaches every key: planned as -1, so values past
    the kernels' 32-bit rows never reach them."""
    from flashcupy.problem import plan_band

    assert plan_band(False, (-1, 2**31 - 1), "bottom_right", 100, 77).mask == "none"
    assert plan_band(False, (2**40, 2**40), "top_left", 100, 77).mask == "none"
    assert plan_band(True, (2**31, 0), "bottom_right", 100, 77).mask == "causal"
    band = plan_band(True, (2**31, 0), "top_left", 100, 77)  # causal from the top left: the local kernel
    assert (band.mask, band.right) == ("local", 0) and band.left > 177
    # one key short of every row's keys stays a window
    band = plan_band(False, (176, 176), "bottom_right", 100, 77)
    assert (band.mask, band.left, band.right) == ("local", 176, 176)


GPU_BASE = 0x7F0000000000


def placed(shape, strides=None, offset=0, dtype=np.float16):
    """An ArraySpec at a GPU address (offset in elements from GPU_BASE)."""
    a = spec(shape, dtype, strides)
    return ArraySpec(a.shape, a.dtype, a.strides, a.device, GPU_BASE + offset * a.dtype.itemsize)


def test_outputs_that_share_memory_refused():
    from flashcupy.validation import check_backward_inputs, shares_memory

    b, s, h, d = 2, 100, 8, 64
    size = b * s * h * d
    q, dout, out = (placed((b, s, h, d), offset=i * size) for i in range(3))
    k, v = (placed((b, s, h, d), offset=(3 + i) * size) for i in range(2))
    lse = ArraySpec((b, h, s), np.dtype(np.float32), (h * s, s, 1), 0, GPU_BASE + 10 * size * 2)
    # the gradients of a packed (b, s, 3, h, d) tensor: interleaved, no element in common
    packed = [placed((b, s, h, d), (s * 3 * h * d, 3 * h * d, d, 1), offset=20 * size + i * h * d) for i in range(3)]
    check_backward_inputs(dout, q, k, v, out, lse, dict(zip(("dq", "dk", "dv"), packed)))
    assert not shares_memory(packed[0], packed[1])
    cases = [
        (dict(dq=packed[0], dk=packed[1], dv=packed[1]), "dk shares memory with dv"),
        (dict(dq=q), "dq shares memory with q"),
        (dict(dk=placed((b, s, h, d), offset=size + d)), "dk shares memory with dout"),  # one head off
        (dict(dv=placed((b, s, h, d), offset=10 * size - 1)), "dv shares memory with softmax_lse"),  # 2 bytes before it
    ]
    for grads, match in cases:
        with pytest.raises(ValueError, match=match):
            check_backward_inputs(dout, q, k, v, out, lse, grads)
    # arrays without an address (host descriptions) are never taken to share memory
    assert not shares_memory(spec((2, 4)), spec((2, 4)))
