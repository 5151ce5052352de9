"""flashcupy: exact attention (FlashAttention-2, and FlashAttention-3's Hopper forward) for CuPy arrays,
with kernels compiled by NVRTC."""

from .api import (FlashAttention, flash_attn_backward, flash_attn_func, flash_attn_varlen_backward,
                  flash_attn_varlen_func)
from .build import KernelCompileError
from .configs import SUPPORTED_HEAD_DIMS
from .device import NoGPUError
from .kvcache import flash_attn_with_kvcache

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_backward", "flash_attn_varlen_func", "flash_attn_varlen_backward",
           "flash_attn_with_kvcache", "FlashAttention", "KernelCompileError", "NoGPUError", "SUPPORTED_HEAD_DIMS", "__version__"]
