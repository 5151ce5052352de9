"""Every kernel instance compiles with NVRTC, on the CPU (no GPU needed)."""

import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from flashcupy import build, configs


def _variants():
    seen = {}  # the dispatcher's choices on Ampere (large and small shared memory) and Hopper
    for capability in (80, 86, 90):
        for v in configs.all_fwd_variants(capability) + configs.all_bwd_variants(capability):
            seen[v] = None
    return list(seen)


def _compile_cases():
    """Every instance Hopper's dispatcher picks, each once: bfloat16 for sm_90a, float16 for sm_80,
    so each dtype and each arch path (red.v4 on sm90, two v2 reds before) is built with every mask,
    score-mod and deterministic setting. Then the tiles only Ampere picks (small shared memory),
    for sm_80, in their plain instances (score mods and deterministic mode add no tile-dependent
    code). Compiling everything for both archs took CI over a quarter of an hour."""
    hopper = configs.all_fwd_variants(90) + configs.all_bwd_variants(90)
    cases = [(v, "sm_90a" if v.dtype == "bfloat16" else "sm_80") for v in hopper]
    ampere_only = {v: None for c in (80, 86) for v in configs.all_fwd_variants(c) + configs.all_bwd_variants(c)
                   if v not in set(hopper) and not getattr(v, "score_mod", False)
                   and not getattr(v, "deterministic", False)}
    return cases + [(v, "sm_80") for v in ampere_only]


CASES = _compile_cases()


def _compile(case) -> str | None:
    """None, or the error, of one (variant, arch); runs in a worker process."""
    variant, arch = case
    try:
        cubin = build.compile_cubin(variant, arch)
    except Exception as exc:  # reported by the test of this case
        return f"{type(exc).__name__}: {exc}"
    return None if cubin[:4] == b"\x7fELF" else "not an ELF cubin"


@pytest.fixture(scope="module")
def compile_results():
    """Compile every case once, on every core (NVRTC is single-threaded per program)."""
    with ProcessPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        return dict(zip(CASES, pool.map(_compile, CASES, chunksize=4)))


def test_every_kernel_family_is_covered():
    names = {v.name_expression.split("<")[0] for v in _variants()}
    assert names == {"flash_fwd_kernel", "flash_bwd_kernel", *configs.BWD_HELPER_KERNELS}


def test_sources_inline_their_headers():
    src = build.load_source("fwd.cu")
    assert '#include "' not in src
    assert "flash_fwd_kernel" in src and "struct OnlineSoftmax" in src and "FC_DEVICE void cp_async_16" in src
    assert src.count("FC_DEVICE u32 smem_u32") == 1  # each header once


def test_kernel_sources_need_no_toolkit_headers():
    for path in build.source_dir().iterdir():
        text = path.read_text()
        assert "#include <" not in text, f"{path.name} includes a toolkit header"


def test_compile_cases_cover_every_variant():
    compiled = {v for v, _ in CASES}
    assert len(compiled) == len(CASES)  # each instance once
    left_out = set(_variants()) - compiled
    assert all(v.score_mod or v.deterministic for v in left_out)
    assert {(v.head_dim, v.tile) for v in left_out} <= {(v.head_dim, v.tile) for v in compiled if hasattr(v, "tile")}
    assert {arch for _, arch in CASES} == {"sm_80", "sm_90a"}


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case[0]} {case[1]}")
def test_variant_compiles(compile_results, case):
    assert compile_results[case] is None, compile_results[case]


def test_compile_error_names_variant_and_shows_log():
    bad = configs.FwdVariant(48, configs.FwdTile(64, 64, 4), "none", "float16")  # violates static_assert
    with pytest.raises(build.KernelCompileError) as info:
        build.compile_cubin(bad, "sm_80")
    msg = str(info.value)
    assert "fwd d=48" in msg and "head dim must be a multiple of 32" in msg
