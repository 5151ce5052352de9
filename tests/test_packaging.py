"""What a wheel installs: one top-level name, flashcupy, carrying the kernel sources, py.typed, the
license and the `flashcupy` command; the installed copy finds its sources; and a fresh environment
with the cuda12 extra alone (CuPy and NVRTC from PyPI, no CUDA toolkit) compiles a kernel (CPU)."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import flashcupy
from flashcupy import build

ROOT = Path(__file__).resolve().parent.parent
DIST_INFO = f"flashcupy-{flashcupy.__version__}.dist-info"

# The kernel the fresh environment compiles: one expression, evaluated with flashcupy.build and
# flashcupy.configs imported, that returns a cubin.
PROBE = 'build.compile_cubin(sm80.fwd_variant(64, "float16", "none", 80), "sm_80")'
# What pip prints when it cannot reach the package index (the only case that skips): it names the
# connection error in the warnings of its retries.
UNREACHABLE = ("connection error:", "NewConnectionError", "Failed to establish a new connection",
               "Temporary failure in name resolution", "Name or service not known", "Network is unreachable",
               "ConnectTimeoutError", "ReadTimeoutError", "Connection refused", "ProxyError")
# Variables that would let the fresh environment borrow from this one or from a CUDA toolkit.
BORROWED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "CUDA_PATH", "CUDA_HOME", "LD_LIBRARY_PATH")


def _run(*args, **kwargs):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the source tree: setuptools would carry stale files of an
    older build/ in the checkout into the wheel."""
    source = tmp_path_factory.mktemp("source") / "flashcupy"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "out", ".whl"))
    out = tmp_path_factory.mktemp("wheel")
    result = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out, source)
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = out.glob("flashcupy-*.whl")
    return built


def test_wheel_installs_only_flashcupy(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"flashcupy", DIST_INFO}
    for source in sorted(ROOT.glob("cuda_src/*.cu*")):
        assert f"flashcupy/cuda_src/{source.name}" in names
    assert "flashcupy/cuda_src/fwd.cu" in names
    assert "flashcupy/py.typed" in names
    assert "flashcupy/__main__.py" in names and "flashcupy/cli.py" in names
    # setuptools puts the license at the dist-info's top (older) or under licenses/ (PEP 639)
    assert any(name.startswith(DIST_INFO + "/") and name.endswith("/LICENSE") for name in names)


def test_wheel_metadata(wheel):
    with zipfile.ZipFile(wheel) as archive:
        entry_points = archive.read(f"{DIST_INFO}/entry_points.txt").decode()
        metadata = archive.read(f"{DIST_INFO}/METADATA").decode()
    parser = configparser.ConfigParser()
    parser.read_string(entry_points)
    assert parser["console_scripts"]["flashcupy"].strip() == "flashcupy.cli:main"
    assert f"\nVersion: {flashcupy.__version__}\n" in metadata
    requires = [line.split(":", 1)[1].strip().replace(" ", "") for line in metadata.splitlines()
                if line.startswith("Requires-Dist:")]
    for extra, wanted in (("cuda12", ("cupy-cuda12x>=14", "nvidia-cuda-nvrtc-cu12", "cuda-bindings<13,>=12.8")),
                          ("cuda13", ("cupy-cuda13x>=14", "nvidia-cuda-nvrtc==13.*", "cuda-bindings<14,>=13"))):
        for package in wanted:
            assert any(r.startswith(package + ";") and f'extra=="{extra}"' in r for r in requires), (package, requires)
    assert not any("nvrtc" in r and 'extra=="test"' in r for r in requires)


def test_installed_copy_finds_its_sources(wheel, tmp_path):
    target = tmp_path / "site"
    result = _run(sys.executable, "-m", "pip", "install", "--no-deps", "--target", target, wheel)
    assert result.returncode == 0, result.stdout + result.stderr
    # pip --target puts the console script in bin/, beside the packages
    assert {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")} <= {"flashcupy", "bin"}

    probe = ("import flashcupy.build as b; src = b.load_source('fwd.cu'); assert 'flash_fwd_kernel' in src; "
             "print(b.source_dir())")
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = _run(sys.executable, "-c", probe, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == target / "flashcupy" / "cuda_src"

    result = _run(sys.executable, "-m", "flashcupy", "--help", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout and "compile" in result.stdout


def test_checkout_finds_the_top_level_sources():
    package = Path(build.__file__).resolve().parent
    expected = ROOT / "cuda_src" if package.parent == ROOT else package / "cuda_src"
    assert build.source_dir() == expected


def test_missing_sources_are_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="kernel sources not found"):
        build.load_source("fwd.cu")


def test_checkout_shim_runs_the_cli():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = _run(sys.executable, ROOT / "cli.py", "--version", cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"flashcupy, version {flashcupy.__version__}"


def test_fresh_environment_with_the_cuda12_extra_compiles_a_kernel(wheel, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in BORROWED}
    venv = tmp_path / "venv"
    result = _run(sys.executable, "-m", "venv", venv, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")

    # retries, whatever pip's configuration says: without any, pip's output names no connection error
    result = _run(python, "-m", "pip", "install", "--retries", "3", "--disable-pip-version-check", f"{wheel}[cuda12]",
                  env=env, cwd=tmp_path, timeout=1800)
    if result.returncode != 0:
        output = result.stdout + result.stderr
        unreachable = [marker for marker in UNREACHABLE if marker in output]
        if unreachable:
            pytest.skip(f"PyPI cannot be reached ({unreachable[0]} in pip's output), so the cuda12 extra "
                        "could not be installed")
        pytest.fail(f"pip install '<wheel>[cuda12]' failed:\n{output[-4000:]}")

    script = "\n".join([
        "import json, os",
        "from flashcupy import build, sm80",
        f"cubin = {PROBE}",
        "maps = '/proc/self/maps'",
        "nvrtc = sorted({line.split()[-1] for line in open(maps) if 'libnvrtc' in line}) "
        "if os.path.exists(maps) else []",
        "print(json.dumps({'magic': cubin[:4].hex(), 'bytes': len(cubin), 'nvrtc': nvrtc, "
        "'flashcupy': build.__file__}))",
    ])
    result = _run(python, "-c", script, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["magic"] == "7f454c46" and report["bytes"] > 1000, report  # an ELF cubin
    venv = venv.resolve()
    assert Path(report["flashcupy"]).resolve().is_relative_to(venv), report
    if Path("/proc/self/maps").exists():  # Linux: the NVRTC loaded is the one the extra installed
        assert report["nvrtc"] and all(Path(lib).resolve().is_relative_to(venv) for lib in report["nvrtc"]), report
