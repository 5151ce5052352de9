"""What flashcupy says when there is no usable GPU: the reason read from a probe of the CUDA stack
(CPU; the probe's answers are made up, except in the last tests, which ask this machine)."""

from __future__ import annotations

import pytest

from flashcupy import device
from flashcupy.device import CudaStack, no_gpu_reason

CUPY = {"cupy_version": "14.2.0"}


def test_a_counted_device_is_no_reason():
    assert no_gpu_reason(CudaStack(**CUPY, driver_version=12040, runtime_version=12090, device_count=1)) is None


def test_missing_cupy_comes_first():
    reason = no_gpu_reason(CudaStack(cupy_error="ModuleNotFoundError: No module named 'cupy'"))
    assert reason.startswith("CuPy does not import (ModuleNotFoundError")
    assert 'pip install ".[cuda12]" or pip install ".[cuda13]" in the flashcupy checkout' in reason


def test_no_driver_library_is_no_driver():
    # what cudart reports then (insufficient driver) must not be taken for an old driver
    stack = CudaStack(**CUPY, runtime_version=12090, libcuda_error="cannot open shared object file",
                      runtime_status=device.CUDA_ERROR_INSUFFICIENT_DRIVER, runtime_error="insufficient")
    expected = f"no NVIDIA driver: {device.LIBCUDA} cannot be loaded (cannot open shared object file)"
    assert no_gpu_reason(stack) == expected


@pytest.mark.parametrize("driver, runtime, advice", [
    (12040, 13000, "update the driver, or use CuPy for CUDA 12: pip uninstall cupy-cuda13x, then pip install "
                   '".[cuda12]" in the flashcupy checkout'),
    (11040, 12090, "update the driver to one for CUDA 12 or newer"),
    (11080, 13000, "update the driver to one for CUDA 13 or newer"),
    (0, 12090, "update the driver to one for CUDA 12 or newer"),
])
def test_old_driver_says_both_versions_and_what_to_do(driver, runtime, advice):
    stack = CudaStack(**CUPY, driver_version=driver, driver_release="470.82.01", runtime_version=runtime,
                      runtime_status=device.CUDA_ERROR_INSUFFICIENT_DRIVER, runtime_error="insufficient")
    reason = no_gpu_reason(stack)
    have = f"CUDA {driver // 1000}.{driver % 1000 // 10}" if driver else "an unknown CUDA version"
    assert reason == (f"NVIDIA driver too old: the NVIDIA driver 470.82.01 supports {have}, CuPy 14.2.0 is built "
                      f"for CUDA {runtime // 1000}.{runtime % 1000 // 10}; {advice}")


def test_older_driver_major_is_too_old_whatever_the_error():
    stack = CudaStack(**CUPY, driver_version=12080, runtime_version=13000, runtime_status=999,
                      runtime_error="cudaErrorUnknown")
    assert no_gpu_reason(stack).startswith("NVIDIA driver too old: the NVIDIA driver supports CUDA 12.8")


@pytest.mark.parametrize("count, status", [(0, None), (None, device.CUDA_ERROR_NO_DEVICE)])
def test_no_device(count, status):
    stack = CudaStack(**CUPY, driver_version=12040, runtime_version=12090, device_count=count,
                      runtime_status=status)
    assert no_gpu_reason(stack) == "no CUDA device: the NVIDIA driver (CUDA 12.4) loads but finds no GPU"
    hidden = no_gpu_reason(CudaStack(**{**stack.__dict__, "visible_devices": "7"}))
    assert hidden.endswith("finds no GPU; CUDA_VISIBLE_DEVICES='7' limits what it sees")


def test_other_runtime_errors_are_passed_on():
    stack = CudaStack(**CUPY, driver_version=12040, runtime_version=12090, runtime_status=999,
                      runtime_error="cudaErrorUnknown: unknown error")
    reason = no_gpu_reason(stack)
    assert reason.startswith("the CUDA runtime cannot use a GPU: cudaErrorUnknown: unknown error")
    assert "CUDA 12.4" in reason and "CUDA 12.9" in reason


def test_libcuda_probe_reports_the_loader_error(monkeypatch):
    def refuse(name):
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(device.ctypes, "CDLL", refuse)
    assert device._libcuda_error() == "cannot open shared object file: No such file or directory"
    monkeypatch.setattr(device.ctypes, "CDLL", lambda name: object())
    assert device._libcuda_error() is None


def test_driver_release_from_the_kernel_module(monkeypatch, tmp_path):
    for line, release in [
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024", "550.54.15"),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.10  Release Build", "570.86.10"),
        ("something else", None),
    ]:
        (tmp_path / "version").write_text(line + "\n")
        monkeypatch.setattr(device, "DRIVER_VERSION_FILE", str(tmp_path / "version"))
        assert device._driver_release() == release
    monkeypatch.setattr(device, "DRIVER_VERSION_FILE", str(tmp_path / "missing"))
    assert device._driver_release() is None


def test_probe_of_this_machine_agrees_with_gpu_available():
    stack = device.probe_cuda()
    assert stack.cupy_version is not None and stack.runtime_version > 0
    assert (no_gpu_reason(stack) is None) == device.gpu_available()


@pytest.mark.skipif(device.gpu_available(), reason="this machine has a GPU")
def test_no_gpu_error_says_what_is_missing():
    with pytest.raises(device.NoGPUError) as info:
        device.current_device_id()
    assert str(info.value) == no_gpu_reason()


def test_has_cuda_bindings_follows_the_import_system(monkeypatch):
    import importlib.util

    from flashcupy import device

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "cuda" else real(name, *a))
    assert device.has_cuda_bindings.__wrapped__() is False
    found = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: found.append(name) or object())
    assert device.has_cuda_bindings.__wrapped__() is True and found == ["cuda", "cuda.bindings"]
