"""Facts every kernel family shares: the head dims, dtypes and masking modes of the API, and the
shared memory a block may use on each compute capability. Each family's own tiles live in its
module (sm80.py, ...)."""

from __future__ import annotations

SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
DTYPE_NAMES = ("float16", "bfloat16")
# Masking modes of the kernels (cuda_src/mask.cuh): none; bottom-right causal; the general band
# (sliding windows, causal with a window, top-left causal), whose bounds are run-time arguments.
MASKS = ("none", "causal", "local")

# Opt-in shared memory per block, by compute capability (CUDA programming guide, table of
# technical specifications). Used when no device can be asked, e.g. for CI's compile checks.
SMEM_PER_BLOCK_OPTIN = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def mask_flags(mask: str) -> str:
    """The kernels' `Is_causal, Is_local` template arguments for a masking mode."""
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}; got {mask!r}")
    return f"{str(mask == 'causal').lower()}, {str(mask == 'local').lower()}"


def cpp_bool(value: bool) -> str:
    return "true" if value else "false"


def smem_limit(capability: int) -> int:
    """Opt-in shared memory per block for a compute capability (the nearest known lower one)."""
    known = [c for c in SMEM_PER_BLOCK_OPTIN if c <= capability]
    return SMEM_PER_BLOCK_OPTIN[max(known)] if known else 48 * 1024


def arch_capability(arch: str) -> int:
    """The compute capability an NVRTC arch compiles for: "sm_90a" -> 90, "sm_80" -> 80."""
    digits = arch.removeprefix("sm_").rstrip("a")
    if not arch.startswith("sm_") or not digits.isdigit():
        raise ValueError(f"arch must look like sm_80 or sm_90a; got {arch!r}")
    return int(digits)
