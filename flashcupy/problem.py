"""What a call computes, validated once: the options (`AttentionOptions`) and the problem
(`Problem`: sizes, sequence layout, band, score mods) that every kernel family reads."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

import numpy as np

from .validation import (MAX_ROWS, ArraySpec, check_band, check_cu_seqlens, check_cu_seqlens_values,
                         check_score_mods, check_softcap, check_softmax_scale)

BACKEND_ENV = "FLASHCUPY_BACKEND"


@dataclass(frozen=True)
class AttentionOptions:
    """The options every entry point takes (flash_attn_func's docstring says what each means),
    validated when built; arrays (alibi_slopes, sinks) are checked against a problem's shape later."""

    softmax_scale: float | None = None
    causal: bool = False
    window_size: tuple = (-1, -1)
    alignment: str = "bottom_right"
    softcap: float = 0.0
    alibi_slopes: object = None
    sinks: object = None
    deterministic: bool = False
    backend: str | None = None  # a kernel family's name (registry.py); None: the first that serves

    def __post_init__(self):
        check_softmax_scale(self.softmax_scale)
        check_band(self.causal, self.window_size, self.alignment)
        check_softcap(self.softcap)
        if not isinstance(self.deterministic, (bool, np.bool_)):
            raise TypeError(f"deterministic must be True or False; got {self.deterministic!r}")
        if self.backend is not None:
            if not isinstance(self.backend, str):
                raise TypeError(f"backend must be a kernel family's name or None; got {self.backend!r}")
            from . import registry  # here, not at import: the families import this module

            if self.backend not in registry.family_names():  # checked even where no kernel runs (empty inputs)
                raise ValueError(f"backend={self.backend!r} names no kernel family; choose from "
                                 f"{', '.join(registry.family_names())}")
        object.__setattr__(self, "window_size", tuple(int(w) for w in self.window_size))

    def with_arrays(self, alibi_slopes, sinks) -> "AttentionOptions":
        return replace(self, alibi_slopes=alibi_slopes, sinks=sinks)


def requested_backend(options: AttentionOptions) -> tuple:
    """(family name or None, where it came from): the backend= argument, else FLASHCUPY_BACKEND."""
    if options.backend is not None:
        return options.backend, "backend="
    env = os.environ.get(BACKEND_ENV, "").strip()
    return (env or None), BACKEND_ENV


@dataclass(frozen=True)
class Band:
    """The kernels' masking (cuda_src/mask.cuh): mode "none", "causal" (bottom-right) or "local",
    the band where row i sees keys [i + offset - left, i + offset + right]; the kernels take
    offset = seqlen_k - seqlen_q of each sequence when bottom_right, else 0."""

    mask: str
    bottom_right: bool = True
    left: int = 0
    right: int = 0


def plan_band(causal: bool, window_size, alignment: str, seqlen_q: int, seqlen_k: int) -> Band:
    """Plain bottom-right causal takes the kernels' own causal instance; every other band the local
    one, where causal is right = 0 and -1 in window_size a bound no row reaches. Varlen: the
    longest sequences' lengths."""
    # A side at least seqlen_q + seqlen_k wide reaches every key of every row: unbounded, which also
    # keeps such values out of the kernels' 32-bit row arithmetic.
    left, right = (-1 if int(w) >= seqlen_q + seqlen_k else int(w) for w in window_size)
    if causal:
        right = 0
    bottom_right = alignment == "bottom_right"  # also ALiBi's offset, whatever the mask
    if left < 0 and right < 0:
        return Band("none", bottom_right)
    if causal and left < 0 and bottom_right:
        return Band("causal")
    unbounded = seqlen_q + seqlen_k + 256  # past every row's keys, even counted from a block's last row
    if unbounded >= MAX_ROWS:
        raise ValueError(f"seqlen_q + seqlen_k = {seqlen_q + seqlen_k} is too large for the kernels' 32-bit "
                         "row arithmetic")
    return Band("local", bottom_right, left if left >= 0 else unbounded, right if right >= 0 else unbounded)


@dataclass(frozen=True)
class Problem:
    """Sizes, where sequences live, mask and score mods of one call, validated."""

    batch: int
    max_seqlen_q: int
    max_seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    dtype: str  # "float16" or "bfloat16"
    scale: float
    band: Band
    options: AttentionOptions
    cu_seqlens_q: object = field(default=None, repr=False)  # CuPy int32 arrays (varlen) or None (padded)
    cu_seqlens_k: object = field(default=None, repr=False)
    # every array the kernels read (q, k, v; dout too in the backward) has positive strides over its
    # dims of extent > 1: no broadcast (zero) or reversed (negative) view
    positive_strides: bool = True

    @classmethod
    def padded(cls, q, k, dtype: str, options: AttentionOptions, read=()) -> "Problem":
        """`read`: the arrays the kernels read, for positive_strides."""
        batch, seqlen_q, nheads, head_dim = q.shape
        return cls._make(q, batch, seqlen_q, k.shape[1], nheads, k.shape[2], head_dim, dtype, options, None, None,
                         read)

    @classmethod
    def varlen(cls, q, k, dtype: str, options: AttentionOptions, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
               max_seqlen_k, check_values: bool, read=()) -> "Problem":
        import cupy

        batch = check_cu_seqlens(ArraySpec.of(cu_seqlens_q), ArraySpec.of(cu_seqlens_k), max_seqlen_q,
                                 max_seqlen_k, q.device.id)
        if check_values:
            for name, cu, total, longest in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                             ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
                check_cu_seqlens_values(name, cupy.asnumpy(cu), total, int(longest))
        return cls._make(q, batch, int(max_seqlen_q), int(max_seqlen_k), q.shape[1], k.shape[1], q.shape[2], dtype,
                         options, cu_seqlens_q, cu_seqlens_k, read)

    @classmethod
    def _make(cls, q, batch, max_seqlen_q, max_seqlen_k, nheads, nheads_k, head_dim, dtype, options, cu_q, cu_k,
              read=()):
        o = options
        check_score_mods(None if o.alibi_slopes is None else ArraySpec.of(o.alibi_slopes),
                         None if o.sinks is None else ArraySpec.of(o.sinks), batch, nheads, q.device.id)
        band = plan_band(o.causal, o.window_size, o.alignment, max_seqlen_q, max_seqlen_k)
        scale = 1.0 / math.sqrt(head_dim) if o.softmax_scale is None else float(o.softmax_scale)
        positive = all(st > 0 for a in read for st, n in zip(a.strides, a.shape) if n > 1)
        return cls(batch, max_seqlen_q, max_seqlen_k, nheads, nheads_k, head_dim, dtype, scale, band, o, cu_q, cu_k,
                   positive)

    @classmethod
    def sketch(cls, head_dim: int, dtype: str, options: AttentionOptions, seqlen: int = 4096, nheads: int = 16,
               nheads_k: int | None = None, batch: int = 1, seqlen_k: int | None = None) -> "Problem":
        """A padded problem without arrays, for asking which family and kernel would serve it
        (`flashcupy info`, `check`); seqlen_k defaults to seqlen."""
        seqlen_k = seqlen if seqlen_k is None else seqlen_k
        band = plan_band(options.causal, options.window_size, options.alignment, seqlen, seqlen_k)
        scale = 1.0 / math.sqrt(head_dim) if options.softmax_scale is None else float(options.softmax_scale)
        return cls(batch, seqlen, seqlen_k, nheads, nheads if nheads_k is None else nheads_k, head_dim, dtype, scale,
                   band, options)

    @property
    def score_mod(self) -> bool:
        """softcap or ALiBi on: the kernels' Has_score_mod instances."""
        return self.options.softcap > 0 or self.options.alibi_slopes is not None

    @property
    def keys_per_row(self) -> int:
        """A bound on the keys one query row sees: seqlen_k, or a local band's width where narrower,
        or under a top-left band seqlen_q + right (the last row, seqlen_q - 1, sees up to key
        seqlen_q - 1 + right)."""
        keys = self.max_seqlen_k
        if self.band.mask == "local":
            keys = min(keys, self.band.left + self.band.right + 1)
            if not self.band.bottom_right:
                keys = min(keys, self.max_seqlen_q + self.band.right)
        return keys

    @property
    def is_varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def is_gqa(self) -> bool:
        return self.nheads != self.nheads_k

    def lse_shape(self, total_q: int) -> tuple:
        return (self.nheads, total_q) if self.is_varlen else (self.batch, self.nheads, self.max_seqlen_q)
