"""Kernel build layer: source loading, NVRTC options, variant instantiation, module cache.

Sources live in ``cuda_src/`` beside the ``flashcupy`` package (in a checkout and in an installed
wheel alike). Local ``#include "x.cuh"`` lines are inlined here, so the text handed to NVRTC is
the whole program: CuPy's on-disk cache keys on that text, and an edited header can never be
served a stale binary.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent.parent / "cuda_src"
NVRTC_OPTIONS = ("-std=c++17",)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel variant; the message names the variant and carries the log."""


def source_dir() -> Path:
    if not (SOURCE_DIR / "fwd.cu").is_file():
        raise FileNotFoundError(f"flashcupy kernel sources not found in {SOURCE_DIR}; "
                                "the installation is incomplete (cuda_src/ must ship with the package)")
    return SOURCE_DIR


def load_source(name: str) -> str:
    """Text of cuda_src/<name> with its local includes inlined (each header once)."""
    seen: set[str] = set()

    def expand(file_name: str) -> str:
        if file_name in seen:
            return ""
        seen.add(file_name)
        text = (source_dir() / file_name).read_text()
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


def compile_cubin(variant, arch: str) -> bytes:
    """Compile one variant with NVRTC for an explicit arch (e.g. "sm_80", "sm_90a"), no GPU needed.

    Returns the cubin. This is what CI runs for every variant the dispatcher can pick.
    """
    from cupy_backends.cuda.libs import nvrtc

    source = load_source(variant.source)
    prog = nvrtc.createProgram(source, variant.source, [], [])
    try:
        nvrtc.addNameExpression(prog, variant.name_expression)
        try:
            nvrtc.compileProgram(prog, list(NVRTC_OPTIONS) + [f"-arch={arch}"])
        except nvrtc.NVRTCError as exc:
            raise KernelCompileError(f"NVRTC failed to compile {variant} for {arch}:\n"
                                     f"{nvrtc.getProgramLog(prog)}") from exc
        nvrtc.getLoweredName(prog, variant.name_expression)  # raises if the instance is missing
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


_kernels: dict = {}
_kernels_lock = threading.Lock()


def get_kernel(variant):
    """The compiled kernel for `variant` on the current device (compiled on first use).

    Thread-safe; compiled modules stay in memory for the process, and CuPy's on-disk cache
    (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``) spares later processes the compile.
    """
    import cupy

    device_id = cupy.cuda.Device().id
    key = (device_id, variant)
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel
    with _kernels_lock:
        kernel = _kernels.get(key)
        if kernel is None:
            module = cupy.RawModule(code=load_source(variant.source), options=NVRTC_OPTIONS,
                                    name_expressions=[variant.name_expression])
            try:
                kernel = module.get_function(variant.name_expression)
            except cupy.cuda.compiler.CompileException as exc:
                raise KernelCompileError(f"NVRTC failed to compile {variant}:\n{exc}") from exc
            if variant.smem_bytes > 48 * 1024:
                kernel.max_dynamic_shared_size_bytes = variant.smem_bytes
            _kernels[key] = kernel
    return kernel


def compiled_variants() -> list:
    """Variants compiled in this process, as (device id, variant) pairs."""
    return sorted(_kernels, key=str)
