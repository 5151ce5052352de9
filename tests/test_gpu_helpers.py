"""The GPU tests' own measures, checked on the CPU: a bound that cannot fail is a defect."""

import numpy as np
import pytest

from gpu_helpers import dtype_of, ulp


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_ulp_is_the_distance_to_the_next_value(dtype_name):
    """Every value's ulp is the gap to its neighbour away from zero, normal or subnormal."""
    dtype = dtype_of(dtype_name)
    bits = np.arange(1, 0x7C00 if dtype_name == "float16" else 0x7F80, dtype=np.uint16)
    values = bits.view(dtype).astype(np.float64)
    following = (bits[1:]).view(dtype).astype(np.float64)  # the next larger magnitude
    assert np.array_equal(following - values[:-1], ulp(values[:-1], dtype_name))
    assert np.array_equal(ulp(-values, dtype_name), ulp(values, dtype_name))


def test_ulp_values():
    assert ulp(1.0, "bfloat16") == 2.0 ** -7 and ulp(3.0, "bfloat16") == 2.0 ** -6
    assert ulp(1.0, "float16") == 2.0 ** -10 and ulp(1e-7, "float16") == 2.0 ** -24
    assert ulp(0.0, "float16") == 2.0 ** -24


def test_gradient_bounds_follow_the_plain_reference():
    """check_grads: GRAD_TOL (dq, dk, dv) and the forward's bound (dsinks) fail a gradient off by
    more; `plain` raises each bound to twice the plain reference's error, never lowers it."""
    from gpu_helpers import GRAD_TOL, check_grads

    rng = np.random.default_rng(5)
    refs = tuple(rng.standard_normal(shape) for shape in ((2, 6, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8), (4,)))
    off = tuple(r * (1 + 0.2) for r in refs)  # 20% off: beyond every bound
    check_grads(refs, refs, "bfloat16", "exact")
    with pytest.raises(AssertionError):
        check_grads(off, refs, "bfloat16", "off")
    check_grads(off, refs, "bfloat16", "off, plain further off", plain=tuple(r * 1.15 for r in refs))
    with pytest.raises(AssertionError):  # a plain reference closer than the bound does not lower it
        check_grads(off, refs, "bfloat16", "off, plain exact", plain=refs)
    near = tuple(r * (1 + GRAD_TOL["bfloat16"] / 2) for r in refs[:3]) + refs[3:]
    check_grads(near, refs, "bfloat16", "within GRAD_TOL", plain=refs)
