"""Kernel build layer: source loading, NVRTC options, variant instantiation, module cache.

Sources live in ``flashcupy/cuda_src/`` when installed, in the top-level ``cuda_src/`` of a
checkout. Local ``#include "x.cuh"`` lines are inlined here, so the text handed to NVRTC is
the whole program: CuPy's on-disk cache keys on that text, and an edited header can never be
served a stale binary.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
import time
from pathlib import Path


def _find_source_dir() -> Path:
    """flashcupy/cuda_src where a wheel put it; in a checkout (no such folder, setup.cfg one level
    up) the repository's cuda_src. Never a top-level cuda_src of some other installation."""
    package = Path(__file__).resolve().parent
    if not (package / "cuda_src").is_dir() and (package.parent / "setup.cfg").is_file():
        return package.parent / "cuda_src"
    return package / "cuda_src"


SOURCE_DIR = _find_source_dir()
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

    Returns the cubin. This is what CI runs for every variant the dispatcher can pick; the variant's
    layout_check (C++ static_asserts that the launch's shared-memory size is the kernel's own) is
    compiled with it.
    """
    from cupy_backends.cuda.libs import nvrtc

    source = load_source(variant.source) + "\n" + variant.layout_check + "\n"
    prog = nvrtc.createProgram(source, variant.source, [], [])
    try:
        nvrtc.addNameExpression(prog, variant.name_expression)
        try:
            nvrtc.compileProgram(prog, [o for o in variant.nvrtc_options if not o.startswith("-arch")] + [f"-arch={arch}"])
        except nvrtc.NVRTCError as exc:
            raise KernelCompileError(f"NVRTC failed to compile {variant} for {arch}:\n"
                                     f"{nvrtc.getProgramLog(prog)}") from exc
        nvrtc.getLoweredName(prog, variant.name_expression)  # raises if the instance is missing
        check_ptxas_log(nvrtc.getProgramLog(prog), variant, arch)
        return _whole_elf(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


# ptxas's warnings that a kernel compiled but lost its design: e.g. wgmma serialized (each waits for
# the previous one) when an operand register may change on a divergent path between them.
PERFORMANCE_WARNINGS = ("Potential Performance Loss",)


def check_ptxas_log(log: str, variant, arch: str) -> None:
    """Raise KernelCompileError if the compiler log carries a performance warning."""
    bad = [line.strip() for line in log.splitlines() if any(w in line for w in PERFORMANCE_WARNINGS)]
    if bad:
        raise KernelCompileError(f"{variant} for {arch} compiled with a performance warning:\n" + "\n".join(bad))


def smem_check(traits: str, variant) -> str:
    """A variant's layout_check: C++ that fails to compile unless the kernel traits' own shared-memory
    size (`traits`::kSmemBytes) is the one the variant launches with."""
    return (f'static_assert({traits}::kSmemBytes == {variant.smem_bytes}, '
            f'"{variant} is launched with {variant.smem_bytes} B of shared memory");')


def _whole_elf(cubin: bytes) -> bytes:
    """CuPy's getCUBIN returns the image less its last byte (read as a C string); pad it back to the
    size its ELF header declares (the end of the program- or section-header table), so that the
    cubin loads and disassembles."""
    e_phoff, e_shoff = struct.unpack_from("<QQ", cubin, 0x20)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    size = max(e_phoff + e_phentsize * e_phnum, e_shoff + e_shentsize * e_shnum)
    return cubin + b"\0" * max(0, size - len(cubin))


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
            module = cupy.RawModule(code=load_source(variant.source), options=tuple(variant.nvrtc_options),
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


# ----------------------------------------------------------------------------------------------
# Ahead-of-time compiles and the index of what CuPy's disk cache holds
# ----------------------------------------------------------------------------------------------

INDEX_NAME = "flashcupy-index.json"
INDEX_SCHEMA = "flashcupy-index/1"


def cache_dir() -> Path:
    """CuPy's on-disk kernel cache, as CuPy finds it: CUPY_CACHE_DIR, else ~/.cupy/kernel_cache."""
    return Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")


def disk_cache_enabled() -> bool:
    """False when CUPY_CACHE_IN_MEMORY=1: CuPy then keeps compiled kernels off the disk."""
    value = os.environ.get("CUPY_CACHE_IN_MEMORY", "")
    try:  # read as CuPy reads it: an integer equal to 1 turns it on, anything else leaves it off
        return int(value) != 1
    except ValueError:
        return True


def device_arch(capability: int) -> str:
    """Label of the architecture a device compiles for, e.g. 90 -> "sm_90" (the index's key)."""
    return f"sm_{capability}"


def _nvrtc_version() -> str:
    try:
        from cupy_backends.cuda.libs import nvrtc

        return "{}.{}".format(*nvrtc.getVersion())
    except Exception:  # no CuPy or no NVRTC: such an entry can only match another like it
        return "unknown"


def source_hash(source: str, arch: str, options=()) -> str:
    """sha256 of what decides the binary besides the name expression: the inlined source text,
    the NVRTC options and version, and the arch. CuPy's cache key changes with each of them."""
    parts = (load_source(source), " ".join(options), arch, _nvrtc_version())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _index_key(name_expression: str, arch: str) -> str:
    return f"{arch} {name_expression}"


def read_index() -> dict:
    """Entries of the index by key; {} when the file is missing, unreadable or not an index."""
    try:
        document = json.loads((cache_dir() / INDEX_NAME).read_text())
    except (OSError, ValueError):  # ValueError covers JSON and Unicode decode errors
        return {}
    if not isinstance(document, dict) or document.get("schema") != INDEX_SCHEMA:
        return {}
    entries = document.get("entries")
    if not isinstance(entries, dict):
        return {}
    return {k: e for k, e in entries.items() if isinstance(e, dict)}


def _write_index(entries: dict) -> None:
    """Replace the index in one step: readers see the old file or the new one, never half of it."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"schema": INDEX_SCHEMA, "entries": entries}, indent=1, sort_keys=True) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=INDEX_NAME + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, folder / INDEX_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def record_compiled(variant, arch: str, seconds: float | None = None) -> dict | None:
    """Note in the index that CuPy's disk cache now holds `variant` compiled for `arch`.

    Returns the entry, or None when CuPy keeps kernels in memory only. The index is a hint for
    `flashcupy info`: two processes writing at once can lose an entry, never corrupt the file.
    """
    if not disk_cache_enabled():
        return None
    entry = {
        "name_expression": variant.name_expression,
        "variant": str(variant),
        "source": variant.source,
        "options": list(variant.nvrtc_options),
        "arch": arch,
        "sha256": source_hash(variant.source, arch, variant.nvrtc_options),
        "compiled_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": None if seconds is None else round(float(seconds), 3),
    }
    entries = read_index()
    entries[_index_key(variant.name_expression, arch)] = entry
    _write_index(entries)
    return entry


def cached_variants(arch: str | None = None) -> list[dict]:
    """Index entries (for `arch`, or all) whose source hash still matches the current sources."""
    hashes: dict = {}

    def current(source, entry_arch, options):
        key = (source, entry_arch, options)
        if key not in hashes:
            try:
                hashes[key] = source_hash(source, entry_arch, options)
            except OSError:  # a source file that no longer exists
                hashes[key] = None
        return hashes[key]

    entries = []
    for entry in read_index().values():
        fields = [entry.get(k) for k in ("name_expression", "source", "arch", "sha256")]
        options = entry.get("options")
        if not all(isinstance(f, str) for f in fields) or not isinstance(options, list):
            continue  # hand-edited or from another version
        _, source, entry_arch, digest = fields
        if (arch is None or entry_arch == arch) and digest == current(source, entry_arch, tuple(map(str, options))):
            entries.append(entry)
    return sorted(entries, key=lambda e: (e["arch"], e["name_expression"]))


def compile_for_cache(variant, device_id: int | None = None) -> float:
    """Compile `variant` for a device through get_kernel, so CuPy stores the cubin on disk.

    Returns the seconds it took: an NVRTC compile, or milliseconds when the disk cache had it.
    """
    import cupy

    if device_id is not None:
        cupy.cuda.Device(device_id).use()
    start = time.perf_counter()
    get_kernel(variant)
    return time.perf_counter() - start


def _compile_job(variant, device_id, arch):
    """Body of a worker process: (seconds, None) or (None, error text); nothing is raised, so an
    exception that does not pickle cannot take the pool down."""
    try:
        if arch is not None:
            start = time.perf_counter()
            compile_cubin(variant, arch)
            return time.perf_counter() - start, None
        return compile_for_cache(variant, device_id), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def compile_in_processes(variants, jobs: int, device_id: int | None = None, arch: str | None = None):
    """Compile `variants` in `jobs` worker processes; yield (variant, seconds, error) as each ends.

    Workers are spawned, not forked: a forked child cannot use its parent's CUDA state. Each one
    compiles into CuPy's disk cache (the workers inherit CUPY_CACHE_DIR), where later processes
    find the kernels; with `arch`, each compiles offline for that architecture (no GPU, no cache).
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    variants = list(variants)
    if not variants:
        return
    pool = ProcessPoolExecutor(max_workers=max(1, min(jobs, len(variants))),
                               mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = {pool.submit(_compile_job, v, device_id, arch): v for v in variants}
        for future in as_completed(futures):
            try:
                seconds, error = future.result()
            except Exception as exc:  # BrokenProcessPool: a worker died (killed, or crashed)
                seconds, error = None, f"{type(exc).__name__}: {exc}"
            yield futures[future], seconds, error
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
