"""Every kernel instance compiles with NVRTC, on the CPU (no GPU needed)."""

import dataclasses
import os
import struct
from concurrent.futures import ProcessPoolExecutor

import pytest

from flashcupy import build, kvcache, registry, sm80


def _compile_cases():
    """Each family's CI cases (registry.Family.ci_cases), then the kv-cache kernels', each (variant,
    arch) once."""
    return list(dict.fromkeys([case for family in registry.families() for case in family.ci_cases()]
                              + kvcache.ci_cases()))


CASES = _compile_cases()


def _compile(case) -> tuple:
    """(None, registers per thread) or (the error, None) of one (variant, arch); runs in a worker
    process."""
    variant, arch = case
    try:
        cubin = build.compile_cubin(variant, arch)
    except Exception as exc:  # reported by the test of this case
        return f"{type(exc).__name__}: {exc}", None
    if cubin[:4] != b"\x7fELF":
        return "not an ELF cubin", None
    return None, _registers(cubin)


def _registers(cubin: bytes) -> int:
    """The registers per thread of the cubin's kernel: the EIATTR_REGCOUNT record (attribute 0x2f,
    a symbol index and the count) of its .nv.info section, as ptxas -v reports it."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]
    counts = []
    for name_at, _, _, _, offset, size, *_ in sections:
        if cubin[names + name_at:cubin.index(b"\0", names + name_at)] != b".nv.info":
            continue
        at = offset
        while at < offset + size:  # records: format, attribute, then a payload of the format's size
            fmt, attr = cubin[at], cubin[at + 1]
            if fmt == 4:  # a 16-bit size, then that many bytes
                payload, length = at + 4, struct.unpack_from("<H", cubin, at + 2)[0]
            else:  # 3: a 16-bit value, 2: an 8-bit one, 1: none
                payload, length = at + 2, {3: 2, 2: 1}.get(fmt, 0)
            if attr == 0x2F:
                counts.append(struct.unpack_from("<I", cubin, payload + 4)[0])
            at = payload + length
    return max(counts)


@pytest.fixture(scope="module")
def compile_results():
    """Compile every case once, on every core (NVRTC is single-threaded per program)."""
    with ProcessPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        return dict(zip(CASES, pool.map(_compile, CASES, chunksize=4)))


def test_every_kernel_is_covered():
    """Every variant the families can pick on Ampere (large and small shared memory) and Hopper is
    compiled: for its arch, or its plain instance with the same tiles."""
    compiled = {v for v, _ in CASES}
    for family in registry.families():
        for capability in (80, 86, 90):
            for v in family.variants(capability):
                plain = v
                for flag in ("score_mod", "deterministic"):
                    if getattr(v, flag, False):
                        plain = dataclasses.replace(plain, **{flag: False})
                assert v in compiled or plain in compiled, v
    names = {v.name_expression.split("<")[0] for v in compiled}
    assert names == {"flash_fwd_kernel", "flash_fwd_sm90_kernel", "flash_bwd_kernel", "flash_bwd_sm90_kernel",
                     *sm80.BWD_HELPER_KERNELS, *kvcache.ATTENTION_KERNELS, *kvcache.HELPER_KERNELS}
    assert set(kvcache.variants()) <= compiled


def test_sources_inline_their_headers():
    src = build.load_source("fwd.cu")
    assert '#include "' not in src
    assert "flash_fwd_kernel" in src and "struct OnlineSoftmax" in src and "FC_DEVICE void cp_async_16" in src
    assert src.count("FC_DEVICE u32 smem_u32") == 1  # each header once


def test_kernel_sources_need_no_toolkit_headers():
    for path in build.source_dir().iterdir():
        text = path.read_text()
        assert "#include <" not in text, f"{path.name} includes a toolkit header"


def test_compile_cases_are_distinct_and_cover_both_archs():
    compiled = {v for v, _ in CASES}
    assert len(compiled) == len(CASES)  # each instance once
    assert {arch for _, arch in CASES} == {"sm_80", "sm_90a"}
    # the Hopper-only families are built for sm_90a alone
    assert {arch for v, arch in CASES if v.source in ("fwd_sm90.cu", "bwd_sm90.cu")} == {"sm_90a"}


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]} {case[1]}")
def test_variant_compiles(compile_results, case):
    error, _ = compile_results[case]
    assert error is None, error


def test_staged_decode_kernels_fit_their_register_bound(compile_results):
    """The split rule counts blocks per SM of the sm90 decode kernels that hold their next rows in
    registers by STAGED_REGISTERS: each instance's own count (ptxas's, read from the cubin, in the
    8-register units a warp's registers are allocated in) gives the same number of blocks."""
    staged = {case: regs for case, (error, regs) in compile_results.items()
              if case[1] == "sm_90a" and kvcache.stages_rows_in_registers(case[0], 90) and error is None}
    assert {v.head_dim for v, _ in staged} == {d for d in kvcache.HEAD_DIMS if d <= 128}
    assert min(staged.values()) > 64  # the count was read
    blocks = kvcache.blocks_by_registers
    wrong = {str(v): (regs, blocks(regs, v.threads), blocks(kvcache.STAGED_REGISTERS, v.threads))
             for (v, _), regs in staged.items() if blocks(regs, v.threads) != blocks(kvcache.STAGED_REGISTERS, v.threads)}
    assert not wrong, wrong


def test_compile_error_names_variant_and_shows_log():
    bad = sm80.FwdVariant(48, sm80.FwdTile(64, 64, 4), "none", "float16")  # violates static_assert
    with pytest.raises(build.KernelCompileError) as info:
        build.compile_cubin(bad, "sm_80")
    msg = str(info.value)
    assert "fwd d=48" in msg and "head dim must be a multiple of 32" in msg


def test_performance_warning_fails_the_compile():
    """ptxas's serialized-wgmma warning (as NVRTC 13 reports it) fails the build; other log lines do not."""
    variant = sm80.FwdVariant(64, sm80.FwdTile(64, 64, 4), "none", "float16")
    log = ("ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
           "to program dependence on compiler-inserted WG.AR in divergent path in the function '_Z3foov'\n")
    with pytest.raises(build.KernelCompileError, match="serialized"):
        build.check_ptxas_log(log, variant, "sm_90a")
    build.check_ptxas_log("ptxas info    : Used 168 registers, used 16 barriers\n", variant, "sm_90a")


@pytest.mark.parametrize("form, n, compiles", [("ss", 32, True), ("ss", 40, False), ("ss_tn", 64, True),
                                               ("ss_tt", 48, False), ("rs", 24, False), ("rs", 64, True)])
def test_wgmma_forms_refuse_an_n_they_lack(form, n, compiles):
    """Each wgmma form in sm90.cuh lists the N's it has: an instance for one of them emits its
    instruction, one for any other fails to compile (it once compiled to nothing, and a kernel ran on
    without its products). To PTX only: the check is the front end's."""
    from cupy_backends.cuda.libs import nvrtc

    from flashcupy import sm90_fwd

    call = f"Wgmma<{n}, true>::{form}(d, " + ("a, 0" if form == "rs" else "0, 0, 1") + ");"
    source = (build.load_source("sm90.cuh") + f"\n__global__ void probe(float* out) {{ float d[{n // 2}] = {{}};"
              f" const u32 a[4] = {{}}; {call} out[threadIdx.x] = d[0]; }}\n")
    options = [o for o in sm90_fwd.NVRTC_OPTIONS if not o.startswith("-arch")] + ["-arch=compute_90a"]
    prog = nvrtc.createProgram(source, "probe.cu", [], [])
    try:
        if compiles:
            nvrtc.compileProgram(prog, options)
            assert f"wgmma.mma_async.sync.aligned.m64n{n}k16".encode() in nvrtc.getPTX(prog)
        else:
            with pytest.raises(nvrtc.NVRTCError):
                nvrtc.compileProgram(prog, options)
            assert "this wgmma form lacks this N" in nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def test_o_staging_that_python_and_the_kernel_disagree_on_fails_the_compile(monkeypatch):
    """The sm90 forward's layout check holds sm90_fwd.o_buffer (which writes O's tensor map) to the
    kernel traits' own choice of where O's tile is staged."""
    from flashcupy import sm90_fwd

    variant = sm90_fwd.variant(256, "bfloat16", "none")  # staged in the Q buffer
    monkeypatch.setattr(sm90_fwd, "o_buffer", lambda *args: "")
    with pytest.raises(build.KernelCompileError, match=r"O staged as sm90_fwd.o_buffer says \(nowhere\)"):
        build.compile_cubin(variant, "sm_90a")
