"""Every kernel variant the dispatcher can pick compiles with NVRTC, on the CPU (no GPU needed)."""

import pytest

from flashcupy import build, configs


def _variants():
    seen = {}  # the dispatcher's choices on Ampere (large and small shared memory) and Hopper
    for capability in (80, 86, 90):
        for v in configs.all_fwd_variants(capability) + configs.all_bwd_variants(capability):
            seen[v] = None
    return list(seen)


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


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("variant", _variants(), ids=str)
def test_variant_compiles(variant, arch):
    cubin = build.compile_cubin(variant, arch)
    assert cubin[:4] == b"\x7fELF"


def test_compile_error_names_variant_and_shows_log(monkeypatch):
    bad = configs.FwdVariant(48, configs.FwdTile(64, 64, 4), "none", "float16")  # violates static_assert
    with pytest.raises(build.KernelCompileError) as info:
        build.compile_cubin(bad, "sm_80")
    msg = str(info.value)
    assert "fwd d=48" in msg and "head dim must be a multiple of 32" in msg
