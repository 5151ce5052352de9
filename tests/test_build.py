"""Every kernel variant the dispatcher can pick compiles with NVRTC, on the CPU (no GPU needed)."""

import pytest

from flashcupy import build, configs


def _variants():
    seen = {}  # the dispatcher's choices on Ampere (large and small shared memory) and Hopper
    for capability in (80, 86, 90):
        for v in configs.all_fwd_variants(capability) + configs.all_bwd_variants(capability):
            seen[v] = None
    return list(seen)


def _compile_cases():
    """sm_90a: every kernel the dispatcher picks on Hopper. sm_80: those of Ampere (both shared-
    memory sizes, so the small tiles too), less the score-mod and deterministic instances, which
    add template branches but no arch-specific code; this halves CI's compile time."""
    hopper = configs.all_fwd_variants(90) + configs.all_bwd_variants(90)
    ampere = {v: None for c in (80, 86) for v in configs.all_fwd_variants(c) + configs.all_bwd_variants(c)
              if not getattr(v, "score_mod", False) and not getattr(v, "deterministic", False)}
    return [(v, "sm_90a") for v in hopper] + [(v, "sm_80") for v in ampere]


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


def test_compile_cases_cover_every_variant_once_on_hopper():
    cases = _compile_cases()
    hopper = {v for v, arch in cases if arch == "sm_90a"}
    assert len(hopper) == len([c for c in cases if c[1] == "sm_90a"]) == 252
    assert {v for v in _variants() if v not in hopper} <= {v for v, arch in cases if arch == "sm_80"} | {
        v for v in _variants() if getattr(v, "score_mod", False) or getattr(v, "deterministic", False)}


@pytest.mark.parametrize("variant, arch", _compile_cases(), ids=lambda x: str(x))
def test_variant_compiles(variant, arch):
    cubin = build.compile_cubin(variant, arch)
    assert cubin[:4] == b"\x7fELF"


def test_compile_error_names_variant_and_shows_log(monkeypatch):
    bad = configs.FwdVariant(48, configs.FwdTile(64, 64, 4), "none", "float16")  # violates static_assert
    with pytest.raises(build.KernelCompileError) as info:
        build.compile_cubin(bad, "sm_80")
    msg = str(info.value)
    assert "fwd d=48" in msg and "head dim must be a multiple of 32" in msg
