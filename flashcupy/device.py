"""What the current CUDA device is and can do, asked once per device and remembered."""

from __future__ import annotations

import functools
from dataclasses import dataclass


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
        raise NoGPUError(f"no usable CUDA GPU: {exc}") from None


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
