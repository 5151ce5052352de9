"""Shared pieces of the GPU tests: the skip marker, random inputs, pool poisoning, error measures."""

from __future__ import annotations

import numpy as np
import pytest

from flashcupy.device import gpu_available

requires_gpu = [pytest.mark.gpu,
                pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU (none visible to CuPy)")]

# ||out - ref|| / ||ref|| bounds: about 4x what rounding the float64 result (and P) to the dtype
# costs, 2^-11 for float16 and 2^-8 for bfloat16 relative to each element.
REL_TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}


def dtype_of(name: str):
    import ml_dtypes

    return np.float16 if name == "float16" else ml_dtypes.bfloat16


def randn(rng, shape, dtype_name, base_shape=None, slicer=None):
    """Random normal CuPy array of `shape`; when `base_shape`/`slicer` are given, it is a strided
    view of a larger random array (to exercise non-contiguous batch/seq/head strides)."""
    import cupy

    full = rng.standard_normal(base_shape or shape).astype(np.float32)
    arr = cupy.asarray(full).astype(dtype_of(dtype_name))
    view = arr[slicer] if slicer is not None else arr
    assert view.shape == tuple(shape)
    return view


def poison_pool(*shapes_dtypes):
    """Leave NaN-filled blocks of these sizes in CuPy's pool, so the next allocations of those
    sizes start as NaN and any element a kernel fails to write shows up."""
    import cupy

    blocks = [cupy.full(shape, np.nan, dtype=dtype) for shape, dtype in shapes_dtypes]
    cupy.cuda.Device().synchronize()
    del blocks


def rel_err(x, ref) -> float:
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def to_host64(x) -> np.ndarray:
    import cupy

    return cupy.asnumpy(x.astype(cupy.float32)).astype(np.float64)


def grad_rel_err(grad, ref, dv_ref) -> float:
    """rel_err of a dq or dk, except where the exact gradient is zero (every row sees a single key:
    softmax is constant, dq = dk = 0 and only rounding is left): there it is bounded against the
    size of dv instead of a relative error against zero."""
    if np.linalg.norm(ref) <= 1e-9 * np.linalg.norm(dv_ref):
        return float(np.linalg.norm(grad) / np.linalg.norm(dv_ref))
    return rel_err(grad, ref)
