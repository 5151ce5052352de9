"""The kernels' parameter structs: Python's field tables against the C++ layout that NVRTC compiles,
the values filled from a problem, and the shared-memory size of each launch against the kernel's
own layout (all on the CPU)."""

import dataclasses

import numpy as np
import pytest

from flashcupy import build, params, sm80
from flashcupy.problem import AttentionOptions, Problem


@pytest.mark.parametrize("struct", sorted(params.STRUCTS))
def test_python_table_is_the_cpp_layout(struct):
    dtype = params.record_dtype(struct)
    size, offsets = params.compiled_layout(struct)
    assert size == dtype.itemsize
    assert offsets == {name: dtype.fields[name][1] for name in dtype.names}
    own_fields, _ = params.STRUCTS[struct]
    # a member C++ declares that Python lacks (say one tucked into tail padding) shows up here
    assert params.declared_fields(struct) == [name for name, _ in own_fields]


def test_layout_probe_catches_a_drift(monkeypatch):
    fields, base = params.STRUCTS["FwdParams"]
    swapped = list(fields)
    i = [n for n, _ in fields].index("softcap")
    swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]  # softcap <-> softmax_scale
    monkeypatch.setitem(params.STRUCTS, "FwdParams", (swapped, base))
    params.record_dtype.cache_clear()
    try:
        _, offsets = params.compiled_layout("FwdParams")
        dtype = params.record_dtype("FwdParams")
        assert offsets["softcap"] != dtype.fields["softcap"][1]
        monkeypatch.setitem(params.STRUCTS, "FwdParams", (fields + [("not_in_cpp", np.int32)], base))
        params.record_dtype.cache_clear()
        with pytest.raises(RuntimeError, match="not_in_cpp"):
            params.compiled_layout("FwdParams")
    finally:
        params.record_dtype.cache_clear()


def test_pack_wants_every_field():
    values = {name: 0 for name in params.field_names("FwdParams")}
    record = params.pack("FwdParams", {**values, "nheads": 7, "softcap": 2.5})
    assert record["nheads"] == 7 and record["softcap"] == np.float32(2.5)
    assert record.dtype.itemsize == params.record_dtype("FwdParams").itemsize
    del values["sinks"]
    with pytest.raises(KeyError, match="missing fields .'sinks'."):
        params.pack("FwdParams", values)
    with pytest.raises(KeyError, match="unknown fields .'typo'."):
        params.pack("FwdParams", {**values, "sinks": None, "typo": 1})


class _Device:
    def __init__(self, ptr):
        self.ptr = ptr


class FakeArray:
    """Enough of a CuPy array for params: data.ptr, shape, strides (bytes), dtype, ndim."""

    def __init__(self, shape, dtype=np.float16, ptr=4096, strides=None):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.ndim = len(shape)
        self.strides = strides or tuple(int(np.prod(shape[i + 1:])) * self.dtype.itemsize for i in range(self.ndim))
        self.data = _Device(ptr)


def test_forward_values_padded_and_varlen():
    q = FakeArray((2, 100, 8, 64), ptr=1 << 20)
    k = FakeArray((2, 300, 2, 64), ptr=2 << 20)
    out, lse = FakeArray(q.shape, ptr=3 << 20), FakeArray((2, 8, 100), np.float32, ptr=4 << 20)
    slopes = FakeArray((2, 8), np.float32, ptr=5 << 20)
    options = AttentionOptions(softmax_scale=0.5, causal=True, window_size=(16, -1), softcap=3.0,
                               alibi_slopes=slopes)
    problem = Problem(2, 100, 300, 8, 2, 64, "float16", 0.5, _band(options, 100, 300), options)
    v = params.fwd_values(problem, q, k, k, out, lse)
    record = params.pack("FwdParams", v)
    assert record["q"] == 1 << 20 and record["alibi_slopes"] == 5 << 20 and record["sinks"] == 0
    assert (record["q_batch_stride"], record["q_row_stride"], record["q_head_stride"]) == (100 * 512, 512, 64)
    assert (record["lse_batch_stride"], record["lse_head_stride"]) == (800, 100)
    assert (record["heads_per_kv_head"], record["alibi_batch_stride"]) == (4, 8)
    assert (record["align_bottom_right"], record["window_left"], record["window_right"]) == (1, 16, 0)
    assert record["scale_log2"] == np.float32(0.5 * params.LOG2E) and record["softcap"] == 3.0

    packed_q = FakeArray((150, 8, 64), ptr=1 << 20)
    cu = FakeArray((3,), np.int32, ptr=6 << 20)
    varlen = dataclasses.replace(problem, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                 options=dataclasses.replace(options, alibi_slopes=None))
    record = params.pack("FwdParams", params.fwd_values(varlen, packed_q, k, k, packed_q,
                                                         FakeArray((8, 150), np.float32)))
    assert (record["q_batch_stride"], record["q_row_stride"]) == (0, 512)  # packed rows: no batch stride
    assert (record["lse_batch_stride"], record["lse_head_stride"]) == (0, 150)
    assert record["cu_seqlens_q"] == 6 << 20 and record["alibi_batch_stride"] == 0


def _band(options, seqlen_q, seqlen_k):
    from flashcupy.problem import plan_band

    return plan_band(options.causal, options.window_size, options.alignment, seqlen_q, seqlen_k)


def test_kernel_checks_the_launch_shared_memory():
    """layout_check makes a launch size that is not the kernel's own a compile error."""
    good = sm80.fwd_variant(64, "float16", "none", 80)
    build.compile_cubin(good, "sm_80")

    class Wrong(sm80.FwdVariant):
        @property
        def smem_bytes(self):
            return sm80.fwd_smem_bytes(self.head_dim, self.tile) + 16

    wrong = Wrong(good.head_dim, good.tile, good.mask, good.dtype)
    with pytest.raises(build.KernelCompileError, match="shared memory"):
        build.compile_cubin(wrong, "sm_80")
