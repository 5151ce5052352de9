"""flashcupy: exact attention (FlashAttention-2, and FlashAttention-3's Hopper forward) for CuPy arrays,
with kernels compiled by NVRTC."""

from .api import (FlashAttention, flash_attn_backward, flash_attn_func, flash_attn_varlen_backward,
                  flash_attn_varlen_func)
from .build import KernelCompileError
from .configs import SUPPORTED_HEAD_DIMS
from .device import NoGPUError

__version__ = "0.1.0"
__all__ = ["flash_attn_func", "flash_attn_backward", "flash_attn_varlen_func", "flash_attn_varlen_backward",
           "FlashAttention", "KernelCompileError", "NoGPUError", "SUPPORTED_HEAD_DIMS", "__version__"]
