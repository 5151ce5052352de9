"""What the current CUDA device is and can do, asked once per device and remembered; and where
there is none, what is missing (no_gpu_reason)."""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
from dataclasses import dataclass

LIBCUDA = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"  # the driver's library
DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"  # Linux: the kernel module's release
CUDA_ERROR_INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver
CUDA_ERROR_NO_DEVICE = 100  # cudaErrorNoDevice
EXTRAS = {12: "cuda12", 13: "cuda13"}  # CUDA major -> the extra that installs its CuPy and NVRTC


def install_hint(*extras: str) -> str:
    """How to install the package's extras, as the README installs it: from a checkout."""
    return " or ".join(f'pip install ".[{e}]"' for e in extras) + " in the flashcupy checkout"


class NoGPUError(RuntimeError):
    """No usable CUDA device or driver."""


@dataclass(frozen=True)
class DeviceInfo:
    id: int
    name: str
    capability: int  # e.g. 90 for compute capability 9.0
    sm_count: int
    smem_per_block_optin: int  # bytes a block may use after raising its dynamic limit
    total_memory: int


def current_device_id() -> int:
    import cupy

    try:
        return cupy.cuda.Device().id
    except Exception as exc:  # CUDARuntimeError without driver or device
        raise NoGPUError(no_gpu_reason() or f"no usable CUDA GPU: {exc}") from None


def device_info(device_id: int | None = None) -> DeviceInfo:
    """Properties of `device_id` (default: CuPy's current device)."""
    return _device_info(current_device_id() if device_id is None else device_id)


@functools.lru_cache(maxsize=None)
def _device_info(device_id: int) -> DeviceInfo:
    import cupy

    try:
        props = cupy.cuda.runtime.getDeviceProperties(device_id)
    except Exception as exc:
        raise NoGPUError(f"no usable CUDA GPU: {exc}") from None
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    return DeviceInfo(
        id=device_id,
        name=name,
        capability=10 * props["major"] + props["minor"],
        sm_count=props["multiProcessorCount"],
        smem_per_block_optin=props["sharedMemPerBlockOptin"],
        total_memory=props["totalGlobalMem"],
    )


def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def has_cuda_bindings() -> bool:
    """Whether NVIDIA's cuda-bindings (`cuda.bindings`, an extra) is installed: the Hopper families'
    tensor maps, the decode clusters' count and programmatic launches need it."""
    import importlib.util

    return importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None


# ----------------------------------------------------------------------------------------------
# Why there is no GPU
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CudaStack:
    """What this host's CUDA stack answers, as far as it goes: the facts no_gpu_reason reads."""
    cupy_version: str | None = None  # None: CuPy does not import
    cupy_error: str | None = None  # why it does not
    libcuda_error: str | None = None  # why the driver's library does not load; None: it loads
    driver_version: int = 0  # newest CUDA the driver supports, 12040 for 12.4; 0: unknown
    driver_release: str | None = None  # e.g. "550.54.15", where it can be read
    runtime_version: int = 0  # the CUDA runtime CuPy is built for, 12090 for 12.9; 0: unknown
    device_count: int | None = None  # devices the runtime counts; None: counting failed
    runtime_status: int | None = None  # the cudaError_t of that failure
    runtime_error: str | None = None  # and its message
    visible_devices: str | None = None  # CUDA_VISIBLE_DEVICES, when set


def _libcuda_error() -> str | None:
    """Why the driver's library cannot be loaded, or None when it loads."""
    try:
        ctypes.CDLL(LIBCUDA)
    except OSError as exc:
        text = " ".join(str(exc).split())
        return text[len(LIBCUDA) + 2:] if text.startswith(LIBCUDA + ": ") else text
    return None


def _driver_release() -> str | None:
    try:
        with open(DRIVER_VERSION_FILE) as f:
            match = re.search(r"Kernel Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s", f.readline())
    except OSError:
        return None
    return match.group(1) if match else None


def probe_cuda() -> CudaStack:
    """Ask CuPy's runtime, and the driver's library whether it loads, what is there."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy that fails while importing
        return CudaStack(cupy_error=" ".join(f"{type(exc).__name__}: {exc}".split()))
    runtime = cupy.cuda.runtime
    facts = {"cupy_version": cupy.__version__, "libcuda_error": _libcuda_error(),
             "driver_release": _driver_release(), "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    for field, ask in (("runtime_version", runtime.runtimeGetVersion), ("driver_version", runtime.driverGetVersion)):
        try:
            facts[field] = int(ask())  # the driver's: 0 when there is none
        except Exception:
            pass
    try:
        facts["device_count"] = runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError
        facts["runtime_status"] = getattr(exc, "status", None)
        facts["runtime_error"] = " ".join(str(exc).split())
    return CudaStack(**facts)


def _cuda(version: int) -> str:
    """12040 -> "CUDA 12.4"; 0 -> "an unknown CUDA version"."""
    return f"CUDA {version // 1000}.{version % 1000 // 10}" if version else "an unknown CUDA version"


def no_gpu_reason(stack: CudaStack | None = None) -> str | None:
    """One line saying what is missing for CuPy to run on a GPU here, or None when nothing is.

    In this order: CuPy; the NVIDIA driver (its library cannot be loaded); a driver recent enough
    for the CUDA runtime CuPy is built for; a device. `stack` defaults to probe_cuda()'s answer.
    """
    stack = probe_cuda() if stack is None else stack
    if stack.cupy_version is None:
        return (f"CuPy does not import ({stack.cupy_error}); install flashcupy with the extra for the "
                f"driver's CUDA major: {install_hint(*EXTRAS.values())}")
    if stack.libcuda_error is not None:
        return f"no NVIDIA driver: {LIBCUDA} cannot be loaded ({stack.libcuda_error})"
    if stack.device_count:
        return None

    driver = "the NVIDIA driver" + (f" {stack.driver_release}" if stack.driver_release else "")
    cupy = f"CuPy {stack.cupy_version}"
    runtime_major, driver_major = stack.runtime_version // 1000, stack.driver_version // 1000
    if stack.runtime_status == CUDA_ERROR_INSUFFICIENT_DRIVER or (
            stack.device_count is None and 0 < driver_major < runtime_major):
        if driver_major in EXTRAS and driver_major < runtime_major:
            advice = (f"update the driver, or use CuPy for CUDA {driver_major}: pip uninstall "
                      f"cupy-cuda{runtime_major}x, then {install_hint(EXTRAS[driver_major])}")
        else:
            advice = f"update the driver to one for CUDA {max(min(EXTRAS), runtime_major)} or newer"
        return (f"NVIDIA driver too old: {driver} supports {_cuda(stack.driver_version)}, {cupy} is built "
                f"for {_cuda(stack.runtime_version)}; {advice}")
    if stack.device_count == 0 or stack.runtime_status == CUDA_ERROR_NO_DEVICE:
        hidden = ("" if stack.visible_devices is None
                  else f"; CUDA_VISIBLE_DEVICES={stack.visible_devices!r} limits what it sees")
        return f"no CUDA device: {driver} ({_cuda(stack.driver_version)}) loads but finds no GPU{hidden}"
    return (f"the CUDA runtime cannot use a GPU: {stack.runtime_error or 'it counts no device'} ({driver}, "
            f"{_cuda(stack.driver_version)}; {cupy}, {_cuda(stack.runtime_version)})")
