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
# Gradient bounds: dS = P (dP - D) is rounded to the input dtype before two more products, so the
# gradients carry about twice the forward's rounding error (reference: float64 on the same inputs).
GRAD_TOL = {"float16": 4e-3, "bfloat16": 3e-2}


def dtype_of(name: str):
    import ml_dtypes

    return np.float16 if name == "float16" else ml_dtypes.bfloat16


def ulp(x, dtype_name) -> np.ndarray:
    """The spacing of the dtype's values at each |x| (one unit in the last place; subnormals' below
    the smallest normal)."""
    import ml_dtypes

    info = ml_dtypes.finfo(dtype_of(dtype_name))
    exponent = np.floor(np.log2(np.maximum(np.abs(np.asarray(x, np.float64)), float(info.tiny))))
    return np.exp2(np.maximum(exponent, info.minexp) - info.nmant)


def randn(rng, shape, dtype_name):
    """Random normal CuPy array of `shape` in the dtype."""
    import cupy

    return cupy.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype_of(dtype_name))


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


def check_lse(lse, ref_lse) -> None:
    """The kernel's LSE: written everywhere, -inf exactly where the reference's is, and within 1e-3
    (relative to the largest) elsewhere."""
    import cupy

    lse_h = cupy.asnumpy(lse).astype(np.float64)
    assert not np.isnan(lse_h).any(), "unwritten (poisoned) or NaN LSE elements"
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse_h), finite), "rows with no key must have LSE -inf"
    assert np.all(lse_h[~finite] == ref_lse[~finite])
    lse_err = np.abs(lse_h[finite] - ref_lse[finite]).max(initial=0.0)
    assert lse_err < 1e-3 * max(1.0, np.abs(ref_lse[finite]).max(initial=0.0)), f"LSE error {lse_err:.2e}"


def _bound(tol, error, plain) -> float:
    """tol, or twice error(plain) where that is larger (plain: the plain reference's gradient, or None)."""
    return tol if plain is None else max(tol, 2 * error(plain))


def check_grads(grads, refs, dtype_name, label, plain=None) -> None:
    """dq, dk, dv (and dsinks) against the reference's. dq, dk, dv by grad_rel_err within GRAD_TOL;
    dsinks against their largest entry within the forward's bound: they sum D = rowsum(dO * O) over
    O rounded to the dtype, as every backward does (bf16 runs reached 8e-3). `plain`: the reference's
    gradients with D from that rounded O (attention_bwd_ref's `out`); each bound is then at least
    twice their error, which no backward avoids (a sum of D's with cancellation, such as a dsinks
    near zero, or dS = P (dP - D) of a row whose keys hold almost all of its probability)."""
    assert len(grads) == len(refs)
    for i, (name, g, r) in enumerate(zip(("dq", "dk", "dv", "dsinks"), grads, refs)):
        gh = to_host64(g)
        assert not np.isnan(gh).any(), (label, name, "unwritten (poisoned) or NaN elements")
        if name == "dsinks":
            error = lambda x: np.abs(x - r).max()
            bound = _bound(REL_TOL[dtype_name] * np.abs(r).max(), error, None if plain is None else plain[i])
            assert error(gh) <= bound, (label, gh, r, bound)
        else:
            error = lambda x: grad_rel_err(x, r, refs[2])
            bound = _bound(GRAD_TOL[dtype_name], error, None if plain is None else plain[i])
            assert error(gh) < bound, (label, name, error(gh), bound)


def check_grads_per_sequence(grads, refs, cu_seqlens_q, cu_seqlens_k, dtype_name, label, plain=None) -> None:
    """check_grads on each sequence of a packed batch on its own, so that a wrong short sequence
    cannot hide in the batch's norm. A sequence whose queries each see one key has dq = dk = 0
    exactly; there grad_rel_err bounds what rounding leaves against that sequence's dv. `plain` as
    check_grads'."""
    cu_q, cu_k = (np.asarray(c).tolist() for c in (cu_seqlens_q, cu_seqlens_k))
    hosts = [to_host64(g) for g in grads[:3]]
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop or keys.start == keys.stop:
            continue
        dv_ref = refs[2][keys]
        for i, (name, g, r, part) in enumerate(zip(("dq", "dk", "dv"), hosts, refs, (rows, keys, keys))):
            assert not np.isnan(g[part]).any(), (label, b, name, "unwritten (poisoned) or NaN elements")
            error = lambda x: grad_rel_err(x, r[part], dv_ref)
            bound = _bound(GRAD_TOL[dtype_name], error, None if plain is None else plain[i][part])
            assert error(g[part]) < bound, (label, f"sequence {b}", name, error(g[part]), bound)


def _problem(q, k, options, varlen=False):
    """The padded problem of q, k with these options, or with varlen=True a packed batch of those
    sizes (for asking which family serves it)."""
    import dataclasses

    from flashcupy.problem import AttentionOptions, Problem

    batch, seqlen_q, nheads, head_dim = q.shape
    problem = Problem.sketch(head_dim, "bfloat16", AttentionOptions(**options), seqlen_q, nheads, k.shape[2], batch)
    return dataclasses.replace(problem, cu_seqlens_q=object(), cu_seqlens_k=object()) if varlen else problem


def serving_families(direction, q, k, varlen=False, **options) -> list:
    """The names of the families of `direction` that serve the padded problem of q, k with these
    options on this GPU (with varlen=True: the packed one, q and k given as q[None], k[None]), in
    dispatch order."""
    from flashcupy import registry
    from flashcupy.device import device_info

    problem = _problem(q, k, options, varlen)
    names = [f.name for f in registry.families(direction) if f.unsupported(problem, device_info()) is None]
    assert names, f"no {direction} family serves {options} at these shapes: a loop over them would test nothing"
    return names


def skip_unless_served(direction, family_name, q, k, **options):
    """Skip, saying why, when family `family_name` of `direction` ("fwd", "bwd") does not serve the
    padded problem of q, k with these options on this GPU."""
    from flashcupy import registry
    from flashcupy.device import device_info

    family = next(f for f in registry.families(direction) if f.name == family_name)
    reason = family.unsupported(_problem(q, k, options), device_info())
    if reason is not None:
        pytest.skip(f"{family_name}: {reason}")


def forward_against_reference(q, k, v, dtype_name, backend, **options):
    """flash_attn_func on family `backend` (None: as dispatched), out and LSE written over poisoned
    memory, against the float64 reference with the same options (arrays among them copied to the
    host); returns (out, lse)."""
    import cupy

    import flashcupy
    from flashcupy.reference import attention_ref

    batch, seqlen_q, nheads, _ = q.shape
    poison_pool((q.shape, q.dtype), ((batch, nheads, seqlen_q), cupy.float32))
    out, lse = flashcupy.flash_attn_func(q, k, v, return_lse=True, backend=backend, **options)
    host_options = {n: to_host64(a) if isinstance(a, cupy.ndarray) else a for n, a in options.items()}
    ref_out, ref_lse = attention_ref(to_host64(q), to_host64(k), to_host64(v), **host_options)
    out_h = to_host64(out)
    assert not np.isnan(out_h).any(), "unwritten (poisoned) or NaN output elements"
    err = rel_err(out_h, ref_out)
    assert err < REL_TOL[dtype_name], f"out relative error {err:.2e}"
    check_lse(lse, ref_lse)
    return out, lse


def varlen_forward_against_reference(lengths_q, lengths_k, nheads, nheads_k, head_dim, dtype_name, rng,
                                     backend=None, check_plan=None, **options):
    """flash_attn_varlen_func on family `backend` (None: as dispatched) over poisoned memory against
    the float64 reference, each sequence's rows on their own (rows that see no key are zeros);
    options given as host arrays go to the GPU for the call. check_plan(q, k, cu_q, cu_k, max_q,
    max_k, **options), when given, runs before the call (to assert what the dispatch will do)."""
    import cupy

    import flashcupy
    from flashcupy.reference import attention_varlen_ref

    q = randn(rng, (sum(lengths_q), nheads, head_dim), dtype_name)
    k, v = (randn(rng, (sum(lengths_k), nheads_k, head_dim), dtype_name) for _ in range(2))
    cu_q, cu_k = (cupy.asarray(np.concatenate([[0], np.cumsum(x)]).astype(np.int32)) for x in (lengths_q, lengths_k))
    sizes = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    on_gpu = {n: cupy.asarray(a) if isinstance(a, np.ndarray) else a for n, a in options.items()}
    if check_plan is not None:
        check_plan(q, k, *sizes, **on_gpu)
    poison_pool((q.shape, q.dtype), ((nheads, q.shape[0]), cupy.float32))
    out, lse = flashcupy.flash_attn_varlen_func(q, k, v, *sizes, return_lse=True, backend=backend, **on_gpu)
    ref, ref_lse = attention_varlen_ref(to_host64(q), to_host64(k), to_host64(v), cu_q.get(), cu_k.get(), **options)
    out_h = to_host64(out)
    assert not np.isnan(out_h).any(), "unwritten (poisoned) or NaN output elements"
    bounds = cu_q.get()
    for b in range(len(lengths_q)):
        rows = slice(bounds[b], bounds[b + 1])
        if rows.start < rows.stop and np.abs(ref[rows]).max() > 0:
            assert rel_err(out_h[rows], ref[rows]) < REL_TOL[dtype_name], (b, lengths_q[b], lengths_k[b])
        else:
            assert np.array_equal(out_h[rows], ref[rows]), (b, "rows without keys are zeros")
    check_lse(lse, ref_lse)
