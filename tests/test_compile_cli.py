"""`flashcupy compile` and the cache index behind `flashcupy info`: options, variant lists, the
index file and the command's glue on the CPU; a real compile into a fresh cache on the GPU."""

from __future__ import annotations

import json
import pickle

import pytest

from flashcupy import build, cli, configs, decode_fwd, device, registry, sm80, sm90_bwd, sm90_fwd
from flashcupy.device import DeviceInfo
from cli_helpers import FAKE_GPU, invoke, on_gpu

# per Hopper device: fwd decode (the decode and prefill kernels, 6 head dims x 2 dtypes x 3 masks x
# score mods, all of them kv-cache kernels too), sm90 (5 head dims x 2 dtypes x 3 masks x score mods
# off/on, at d=256 the banded ones again with O in the Q buffer: 2 x 2 x 2, at d=64 the local and
# causal ones in the two-consumer tile: 2 x 2 x 2, and at d=96 and 192 every one again in the short
# rows' tile: 2 x 2 x 3 x 2) and sm80 (6 head dims ...), bwd sm90 (d=64, 96, 128, 192, 256 with every option)
# and sm80 (144 main + 36 helpers)
DECODE_FWD_KERNELS = 72 + 72
FWD_KERNELS = DECODE_FWD_KERNELS + 60 + 8 + 8 + 24 + 72
BWD_KERNELS = 124 + 180  # sm90 (d=64, 96, 128, 192, 256 x 2 dtypes x 3 masks x deterministic, score mods; the
# causal d=128 step of short problems x 2 dtypes x deterministic), sm80 main + helpers
# flash_attn_with_kvcache: decode and prefill kernels (6 head dims x 2 dtypes x 3 masks x score mods), the
# decode kernel's Hopper tiles (d=96 and 128: 8 and 2 warps, each 2 x 3 x 2, the 4-warp small tile
# being the default one; d=192 and 256: one each), its clusters of 2, 4 and 8 splits (each 2 x 3 x 2)
# of the long tiles and, at d=96 and 128, of the 4-warp tile, the append and the q rotation per dtype
KVCACHE_KERNELS = 72 + 72 + 2 * 24 + 2 * 12 + 6 * 36 + 4
ALL_KERNELS = FWD_KERNELS - DECODE_FWD_KERNELS + BWD_KERNELS + KVCACHE_KERNELS  # each kernel once


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh, empty CuPy cache dir for the index."""
    path = tmp_path / "kernel_cache"
    monkeypatch.setenv("CUPY_CACHE_DIR", str(path))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    return path


def fake_variants(**choice):
    """The variants the fake GPU uses, as the commands pick them (each once)."""
    return list(dict.fromkeys(cli.fwd_variants(FAKE_GPU.capability, FAKE_GPU.smem_per_block_optin, **choice)
                              + cli.bwd_variants(FAKE_GPU.capability, FAKE_GPU.smem_per_block_optin, **choice)
                              + cli.kvcache_variants(FAKE_GPU.capability, FAKE_GPU.smem_per_block_optin, **choice)))


# ----------------------------------------------------------------------------------------------
# Help and option validation (CPU)
# ----------------------------------------------------------------------------------------------


def test_compile_help_lists_options():
    result = invoke("compile", "--help")
    assert result.exit_code == 0, result.output
    for option in ("--head-dims", "--dtype", "--direction", "--causal", "--deterministic", "--jobs"):
        assert option in result.output


@pytest.mark.parametrize("args, hint", [
    (["--head-dims", "48"], "choose from 32, 64"),
    (["--dtype", "fp32"], "bf16, fp16"),
    (["--dtype", ","], "at least one"),
    (["--direction", "sideways"], "'sideways' is not one of"),
    (["--causal", "maybe"], "'maybe' is not one of"),
    (["--deterministic", "yes"], "'yes' is not one of"),
    (["--jobs", "0"], "x>=1"),
    (["--jobs", "many"], "not a valid integer"),
    (["--direction", "fwd", "--deterministic", "on"], "--deterministic applies to the backward kernels"),
    (["--direction", "kvcache", "--deterministic", "off"], "not --direction kvcache"),
])
def test_compile_bad_options_are_usage_errors(args, hint, monkeypatch):
    monkeypatch.setattr(cli, "_require_gpu", lambda ctx: pytest.fail("the GPU was asked for before the options"))
    result = invoke("compile", *args)
    assert result.exit_code == 2, result.output
    assert "Usage:" in result.output and hint in result.output


def test_info_has_verbose_option():
    assert "--verbose" in invoke("info", "--help").output


# ----------------------------------------------------------------------------------------------
# The variants a device can use (CPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("capability", [80, 86, 89, 90])
def test_variant_lists_are_the_families(capability):
    """Every family that runs on the capability, in dispatch order."""
    hopper = sm90_fwd.Sm90Forward().variants(90) if capability == 90 else []
    decode = decode_fwd.DecodeForward().variants(capability)
    assert cli.fwd_variants(capability) == decode + hopper + sm80.Sm80Forward().variants(capability)
    assert set(decode) <= set(cli.kvcache_variants(capability))
    hopper = sm90_bwd.Sm90Backward().variants(90) if capability == 90 else []
    assert cli.bwd_variants(capability) == hopper + sm80.Sm80Backward().variants(capability)


def test_variant_lists_follow_the_devices_opt_in():
    """An sm_90 part that grants only 99 KiB per block gets the small-smem tiles, as the dispatcher does."""
    small = 99 * 1024
    sm80_part = [v for v in cli.fwd_variants(90, small) if isinstance(v, sm80.FwdVariant)]
    assert sm80_part == sm80.Sm80Forward().variants(86)
    assert [v for v in cli.bwd_variants(90, small) if not isinstance(v, sm90_bwd.Sm90BwdVariant)] == \
        sm80.Sm80Backward().variants(86)
    assert sm80_part != sm80.Sm80Forward().variants(90)
    for v in sm80_part:
        assert v == sm80.fwd_variant(v.head_dim, v.dtype, v.mask, 90, small, v.score_mod)
        assert v.smem_bytes <= small


def test_variant_lists_filter():
    fwd = cli.fwd_variants(90, head_dims=(64,), dtypes=("bfloat16",), masks=("causal",))
    assert [str(v) for v in fwd] == ["decode d=64 bfloat16 mask=causal tile=16x64 stages=5",
                                     "decode d=64 bfloat16 mask=causal+score_mod tile=16x64 stages=5",
                                     "prefill d=64 bfloat16 mask=causal tile=64x64",
                                     "prefill d=64 bfloat16 mask=causal+score_mod tile=64x64",
                                     "fwd-sm90 d=64 bfloat16 mask=causal tile=192x128 stages=2 ping-pong",
                                     "fwd-sm90 d=64 bfloat16 mask=causal tile=128x128 stages=2 ping-pong",
                                     "fwd-sm90 d=64 bfloat16 mask=causal+score_mod tile=192x128 stages=2 ping-pong",
                                     "fwd-sm90 d=64 bfloat16 mask=causal+score_mod tile=128x128 stages=2 ping-pong",
                                     "fwd d=64 bfloat16 mask=causal tile=128x128 warps=4",
                                     "fwd d=64 bfloat16 mask=causal+score_mod tile=128x128 warps=4"]
    bwd = cli.bwd_variants(90, head_dims=(64,), dtypes=("bfloat16",), masks=("causal",), deterministic=(False,),
                           score_mods=(False,))
    assert [v.name_expression.split("<")[0] for v in bwd] == [
        "flash_bwd_sm90_kernel", "flash_bwd_kernel", *sm80.BWD_HELPER_KERNELS]


def test_variants_pickle():
    """Workers are spawned: the variants travel to them pickled."""
    variants = fake_variants()
    assert len(variants) == ALL_KERNELS
    assert pickle.loads(pickle.dumps(variants)) == variants


# ----------------------------------------------------------------------------------------------
# The cache index (CPU)
# ----------------------------------------------------------------------------------------------


def test_cache_dir_follows_cupy(monkeypatch, tmp_path):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    assert build.cache_dir() == tmp_path
    monkeypatch.delenv("CUPY_CACHE_DIR")
    assert build.cache_dir().parts[-2:] == (".cupy", "kernel_cache")


def test_record_and_cached(cache):
    assert build.cached_variants() == []  # no file yet
    fwd, bwd = sm80.fwd_variant(64, "bfloat16", "causal", 90), sm80.bwd_variant(128, "float16", "none", True, 80)
    entry = build.record_compiled(fwd, "sm_90", seconds=1.23456)
    build.record_compiled(bwd, "sm_80")
    assert entry["name_expression"] == fwd.name_expression and entry["source"] == "fwd.cu"
    assert entry["seconds"] == 1.235 and entry["variant"] == str(fwd)
    assert entry["sha256"] == build.source_hash("fwd.cu", "sm_90", fwd.nvrtc_options)
    assert [e["name_expression"] for e in build.cached_variants("sm_90")] == [fwd.name_expression]
    assert [e["name_expression"] for e in build.cached_variants("sm_80")] == [bwd.name_expression]
    assert len(build.cached_variants()) == 2
    build.record_compiled(fwd, "sm_90", seconds=0.5)  # again: replaces, does not add
    assert [e["seconds"] for e in build.cached_variants("sm_90")] == [0.5]
    assert sorted(p.name for p in cache.iterdir()) == [build.INDEX_NAME]  # no temp file left behind
    assert json.loads((cache / build.INDEX_NAME).read_text())["schema"] == build.INDEX_SCHEMA


def test_hash_covers_source_options_and_arch(monkeypatch):
    options = sm80.NVRTC_OPTIONS
    base = build.source_hash("fwd.cu", "sm_90", options)
    assert base == build.source_hash("fwd.cu", "sm_90", options)
    assert base != build.source_hash("fwd.cu", "sm_80", options)
    assert base != build.source_hash("bwd.cu", "sm_90", options)
    assert base != build.source_hash("fwd.cu", "sm_90", options + ("-lineinfo",))


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]", '{"schema": "other/1", "entries": {}}',
                                  '{"schema": "flashcupy-index/1", "entries": []}', "\udcff"])
def test_corrupt_index_is_empty_and_rewritten(cache, text):
    cache.mkdir()
    (cache / build.INDEX_NAME).write_text(text, errors="surrogateescape")
    assert build.read_index() == {} and build.cached_variants() == []
    variant = sm80.fwd_variant(32, "float16", "none", 90)
    build.record_compiled(variant, "sm_90")
    assert [e["name_expression"] for e in build.cached_variants()] == [variant.name_expression]


def test_malformed_entries_are_skipped(cache):
    variant = sm80.fwd_variant(32, "float16", "none", 90)
    build.record_compiled(variant, "sm_90")
    path = cache / build.INDEX_NAME
    document = json.loads(path.read_text())
    entry = build.read_index()[f"sm_90 {variant.name_expression}"]
    document["entries"].update({"a": "not a dict", "b": {**entry, "source": 3},
                                "c": {**entry, "source": "gone.cu"},  # a source file that no longer exists
                                "d": {k: v for k, v in entry.items() if k != "sha256"}})
    path.write_text(json.dumps(document))
    assert [e["name_expression"] for e in build.cached_variants()] == [variant.name_expression]


def test_stale_source_hash_is_not_cached(cache, monkeypatch):
    fwd, bwd = sm80.fwd_variant(64, "bfloat16", "none", 90), sm80.bwd_variant(64, "bfloat16", "none", False, 90)
    build.record_compiled(fwd, "sm_90")
    build.record_compiled(bwd, "sm_90")
    load_source = build.load_source
    monkeypatch.setattr(build, "load_source",
                        lambda name: load_source(name) + ("\n// edited\n" if name == "fwd.cu" else ""))
    assert [e["name_expression"] for e in build.cached_variants()] == [bwd.name_expression]
    assert len(build.read_index()) == 2  # the stale entry stays until the variant is compiled again
    build.record_compiled(fwd, "sm_90")
    assert len(build.cached_variants()) == 2


def test_nothing_recorded_when_cupy_caches_in_memory(cache, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
    assert not build.disk_cache_enabled()
    assert build.record_compiled(sm80.fwd_variant(64, "bfloat16", "none", 90), "sm_90") is None
    assert not cache.exists()
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "0")
    assert build.disk_cache_enabled()


def test_worker_pool_reports_each_variant(cache):
    """The real spawn pool with one worker: on the CPU the worker's error comes back as text."""
    variant = sm80.fwd_variant(64, "bfloat16", "none", 90)
    ((got, seconds, error),) = list(build.compile_in_processes([variant], jobs=4))
    assert got == variant
    if device.gpu_available():
        assert error is None and seconds > 0
    else:
        assert seconds is None and error and "Traceback" not in error
    assert list(build.compile_in_processes([], jobs=2)) == []


# ----------------------------------------------------------------------------------------------
# The commands' glue, with the GPU and the worker pool faked (CPU)
# ----------------------------------------------------------------------------------------------


class FakePool:
    """Stands in for build.compile_in_processes: finishes variants in reverse order; `fail` fail."""

    def __init__(self, fail=()):
        self.fail = set(fail)
        self.calls = []

    def __call__(self, variants, jobs, device_id=None, arch=None):
        variants = list(variants)
        self.calls.append((variants, jobs, device_id if arch is None else arch))
        for n, v in enumerate(reversed(variants)):
            if v in self.fail:
                yield v, None, f"KernelCompileError: NVRTC failed to compile {v}:\nerror: boom"
            else:
                yield v, 0.25 + n, None


@pytest.mark.parametrize("args, count", [
    (["--head-dims", "64", "--dtype", "bf16", "--direction", "fwd", "--score-mod", "off"], 3 + 3 + 5 + 3),
    (["--direction", "fwd"], FWD_KERNELS),
    ([], ALL_KERNELS),
    (["--direction", "bwd", "--head-dims", "64,128", "--causal", "on", "--deterministic", "off"], 18 + 16 + 12),
    (["--dtype", "fp16", "--causal", "off", "--head-dims", "32", "--score-mod", "on"], 1 + 2 + 3 + 4),
    (["--direction", "kvcache", "--head-dims", "128", "--dtype", "bf16"], 6 + 6 + 12 + 36 + 2),
])
def test_compile_selects_variants(cache, fake_gpu, monkeypatch, args, count):
    pool = FakePool()
    monkeypatch.setattr(build, "compile_in_processes", pool)
    result = invoke("compile", *args)
    assert result.exit_code == 0, result.output
    ((variants, jobs, device_id),) = pool.calls
    assert len(variants) == len(set(variants)) == count
    assert set(variants) <= set(fake_variants())  # the device-exact variants, nothing else
    assert jobs == min(cli._default_jobs(), count) and device_id == FAKE_GPU.id
    assert f"{count} of {count} kernels" in result.stdout
    assert len(build.cached_variants("sm_90")) == count


def test_compile_table_index_and_failures(cache, fake_gpu, monkeypatch):
    variants = fake_variants(head_dims=(64,), dtypes=("bfloat16",))
    failing = variants[3]
    pool = FakePool(fail=[failing])
    monkeypatch.setattr(build, "compile_in_processes", pool)
    build.record_compiled(variants[0], "sm_90")
    result = invoke("compile", "--head-dims", "64", "--dtype", "bf16", "--jobs", "3")
    assert result.exit_code == 1, result.output
    assert pool.calls[0][1] == 3
    out = result.stdout
    assert f"{len(variants)} kernels, 1 already compiled on disk, 3 processes, cache {cache}" in out
    lines = out.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("kernel "))) + 1:]
    assert [line.split("  ")[0].strip() for line in table[:len(variants)]] == [str(v) for v in variants]  # asked order
    assert f"{str(variants[-1]):<{len(max(map(str, variants), key=len))}}     0.25  ok" in out
    assert "FAIL[1]" in out and f"compile: {len(variants) - 1} of {len(variants)} kernels in" in out
    assert out.rstrip().endswith(", 1 FAIL")
    assert f"[1] {failing}: KernelCompileError" in result.stderr and "error: boom" in result.stderr
    cached = {e["name_expression"]: e for e in build.cached_variants("sm_90")}
    assert set(cached) == {v.name_expression for v in variants if v != failing}
    assert cached[variants[-1].name_expression]["seconds"] == 0.25


def test_compile_refuses_in_memory_cache(cache, fake_gpu, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
    monkeypatch.setattr(build, "compile_in_processes", FakePool())
    result = invoke("compile")
    assert result.exit_code == 1 and "CUPY_CACHE_IN_MEMORY" in result.output


def test_compile_old_gpu_is_an_error(cache, monkeypatch):
    monkeypatch.setattr(device, "gpu_available", lambda: True)
    old_gpu = DeviceInfo(0, "Old GPU", 75, 40, 64 * 1024, 2**34)
    monkeypatch.setattr(device, "device_info", lambda device_id=None: old_gpu)
    result = invoke("compile")
    assert result.exit_code == 1 and "needs 8.0 or newer" in result.output


def test_info_counts_and_marks_cached_kernels(cache, fake_gpu):
    forward = cli.fwd_variants(FAKE_GPU.capability, FAKE_GPU.smem_per_block_optin)
    backward = cli.bwd_variants(FAKE_GPU.capability, FAKE_GPU.smem_per_block_optin)
    # forward[0] is the decode forward's, a kv-cache kernel as well: counted in both lists, once in all
    for v in (forward[0], forward[DECODE_FWD_KERNELS + 5], backward[0]):
        build.record_compiled(v, "sm_90")
    build.record_compiled(forward[7], "sm_80")  # another arch's binary does not count here
    build.record_compiled(sm80.fwd_variant(256, "bfloat16", "none", 86), "sm_90")  # a tile this GPU never picks
    result = invoke("info")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"kernel cache:         {cache} (" in out
    assert (f"compiled on disk:     3 of {ALL_KERNELS} flashcupy kernels this GPU can use "
            f"(fwd 2 of {FWD_KERNELS}, bwd 1 of {BWD_KERNELS}, kvcache 1 of {KVCACHE_KERNELS})") in out
    assert "`flashcupy compile` builds the rest" in out
    marked = [line.strip() for line in out.splitlines() if line.endswith("[on disk]")]
    assert marked == [f"{forward[0]}  [on disk]", f"{forward[DECODE_FWD_KERNELS + 5]}  [on disk]"]
    assert "backward kernels" not in out

    verbose = invoke("info", "--verbose").stdout
    assert "backward kernels the dispatcher picks here:" in verbose
    assert f"  {backward[0]}  [on disk]" in verbose and f"  {backward[1]}\n" in verbose


def test_info_with_everything_cached(cache, fake_gpu):
    for v in fake_variants():
        build.record_compiled(v, "sm_90")
    out = invoke("info").stdout
    assert f"{ALL_KERNELS} of {ALL_KERNELS} flashcupy kernels" in out and "builds the rest" not in out


def test_check_and_bench_record_what_the_process_compiled(cache, fake_gpu, monkeypatch):
    forward = sm80.fwd_variant(64, "bfloat16", "none", 90, FAKE_GPU.smem_per_block_optin)
    other_device = sm80.fwd_variant(128, "bfloat16", "none", 90)
    monkeypatch.setattr(build, "compiled_variants", lambda: [(0, forward), (1, other_device)])
    cli._record_process_kernels(FAKE_GPU)
    assert [e["name_expression"] for e in build.cached_variants("sm_90")] == [forward.name_expression]


def _stub_check_runs(monkeypatch):
    """check's cases recorded instead of run, each passing: (direction, backend, variant, q x k, mask options)."""
    runs = []

    def stub(direction):
        def run(variant, seqlen_q, seqlen_k, mask_options, rng, backend):
            runs.append((direction, backend, variant, (seqlen_q, seqlen_k), mask_options))
            return 1e-3, 1e-3, "1e-04", True
        return run

    monkeypatch.setattr(cli, "_check_forward", stub("fwd"))
    monkeypatch.setattr(cli, "_check_backward", stub("bwd"))
    monkeypatch.setattr(build, "compiled_variants", lambda: [])
    return runs


def test_check_runs_each_forward_kernel_on_lengths_that_select_it(cache, fake_gpu, monkeypatch):
    """Every forward variant is checked on problems for which its family launches that very kernel
    (the banded d = 192 and 256 kernels that store O from registers, on rows of many keys); each
    backward family once per case, however many forward kernels share it."""
    from flashcupy.problem import AttentionOptions, Problem

    runs = _stub_check_runs(monkeypatch)
    result = invoke("check")
    assert result.exit_code == 0, result.output
    forward = cli.family_variants("fwd", FAKE_GPU.capability, FAKE_GPU.smem_per_block_optin)
    families = {f.name: f for f in registry.families("fwd")}
    assert {(r[1], r[2]) for r in runs if r[0] == "fwd"} == {(f.name, v) for f, v in forward}
    for _, backend, variant, (seqlen_q, seqlen_k), mask_options in (r for r in runs if r[0] == "fwd"):
        options = dict(mask_options, softcap=cli.CHECK_SOFTCAP) if variant.score_mod else mask_options
        problem = Problem.sketch(variant.head_dim, variant.dtype, AttentionOptions(**options), seqlen_q,
                                 cli.CHECK_NHEADS, batch=cli.CHECK_BATCH, seqlen_k=seqlen_k)
        assert families[backend].variant(problem, FAKE_GPU) == variant
    for mask in ("causal", "local"):
        direct = sm90_fwd.variant(256, "bfloat16", mask, keys_per_row=sm90_fwd.BANDED_O_IN_Q_MAX_KEYS + 1)
        assert not direct.o_in_q
        assert [r[3] for r in runs if r[0] == "fwd" and r[2] == direct] == list(cli.CHECK_LONG_ROWS)
    # each backward family once per case (head dim, dtype, mask, score mods) and lengths
    backward = [(r[1], r[2].head_dim, r[2].dtype, r[2].mask, r[2].score_mod, r[3]) for r in runs if r[0] == "bwd"]
    assert len(backward) == len(set(backward)) > 0
    total = len(runs)
    assert f"check: {total} of {total} cases pass" in result.stdout


def test_check_fails_a_kernel_that_none_of_its_lengths_selects(cache, fake_gpu, monkeypatch):
    _stub_check_runs(monkeypatch)
    monkeypatch.setattr(cli, "CHECK_LONG_ROWS", ())
    monkeypatch.setattr(cli, "CHECK_FEW_QUERIES", ())
    result = invoke("check", "--head-dims", "256")
    assert result.exit_code == 1
    unreached = [line for line in result.stdout.splitlines() if "none of the check's lengths" in line]
    assert all(line.endswith("FAIL") for line in unreached)
    # d = 256: the sm90 kernels of long rows, 2 dtypes x (causal, local) x score mods off/on; every
    # decode kernel (2 dtypes x 3 masks x score mods), which few query rows alone select
    sm90 = [line for line in unreached if line.startswith("sm90 ")]
    assert len(sm90) == 8 and all("mask=causal" in line or "mask=local" in line for line in sm90)
    assert len([line for line in unreached if line.startswith("decode decode d=256")]) == 12
    assert len(unreached) == 20


# ----------------------------------------------------------------------------------------------
# On the GPU
# ----------------------------------------------------------------------------------------------


@on_gpu
def test_compile_then_info_gpu(cache):
    args = ("compile", "--head-dims", "64", "--dtype", "bf16", "--direction", "fwd", "--jobs", "2")
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    info = device.device_info()
    # one forward kernel per family that runs here, mask mode and score mods off/on
    n = len(cli.fwd_variants(info.capability, info.smem_per_block_optin, head_dims=(64,), dtypes=("bfloat16",)))
    # each family serves d = 64; the decode forward with two kernels (decode and prefill) per case,
    # and sm90 a second local and causal kernel (its two-consumer tile: wide bands, short causal rows)
    kernels = sum((2 if f.name == "decode" else 1) * f.runs_on(info.capability) for f in registry.families("fwd"))
    sm90_runs = any(f.name == "sm90" and f.runs_on(info.capability) for f in registry.families("fwd"))
    two_consumer = 2 * 2 * (64 in sm90_fwd.TWO_CONSUMER_TILES) * sm90_runs
    assert n == len(configs.MASKS) * 2 * kernels + two_consumer
    assert f"{n} of {n} kernels" in result.stdout and "FAIL" not in result.stdout
    cubins = sorted(cache.glob("*.cubin"))
    assert len(cubins) >= n  # CuPy's own cache files, written by the workers

    expected = cli.fwd_variants(info.capability, info.smem_per_block_optin, head_dims=(64,), dtypes=("bfloat16",))
    cached = build.cached_variants(build.device_arch(info.capability))
    assert {e["name_expression"] for e in cached} == {v.name_expression for v in expected}

    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert f"compiled on disk:     {n} of" in result.stdout
    for variant in expected:
        assert f"  {variant}  [on disk]" in result.stdout

    again = invoke(*args)  # served from the disk cache: no new cubin
    assert again.exit_code == 0, again.output
    assert f"{n} already compiled on disk" in again.stdout
    assert sorted(cache.glob("*.cubin")) == cubins


# ----------------------------------------------------------------------------------------------
# Offline compiles and the families in `info` (CPU)
# ----------------------------------------------------------------------------------------------


def test_compile_offline_needs_no_gpu(monkeypatch):
    """--arch compiles every family variant for that architecture without asking for a GPU."""
    monkeypatch.setattr(device, "gpu_available", lambda: False)
    pool = FakePool()
    monkeypatch.setattr(build, "compile_in_processes", pool)
    result = invoke("compile", "--arch", "sm_80", "--head-dims", "64", "--dtype", "fp16", "--direction", "fwd")
    assert result.exit_code == 0, result.output
    ((variants, _, arch),) = pool.calls
    assert arch == "sm_80"
    assert variants == cli.fwd_variants(80, head_dims=(64,), dtypes=("float16",))
    assert "sm_80 (offline, nothing cached)" in result.stdout and f"{len(variants)} of {len(variants)} kernels" in result.stdout
    bad = invoke("compile", "--arch", "sm_75")
    assert bad.exit_code == 2 and "sm_75" in bad.output


def test_compile_offline_really_compiles(monkeypatch):
    monkeypatch.setattr(device, "gpu_available", lambda: False)
    result = invoke("compile", "--arch", "sm_90a", "--head-dims", "32", "--dtype", "bf16", "--direction", "fwd",
                    "--causal", "off", "--score-mod", "off", "--jobs", "1")
    assert result.exit_code == 0, result.output
    # the decode forward's decode and prefill kernels, and sm80's (sm90 has no head dim 32)
    assert "3 of 3 kernels" in result.stdout and "FAIL" not in result.stdout


def test_info_lists_the_families_and_who_serves_what(cache, fake_gpu):
    out = invoke("info").stdout
    for family in registry.families():
        assert f"  {family.direction} {family.name:<8}{family.summary}" in out
    for head_dim in configs.SUPPORTED_HEAD_DIMS:
        fwd = "sm90" if head_dim in sm90_fwd.HEAD_DIMS else "sm80"
        bwd = "sm90" if head_dim in sm90_bwd.HEAD_DIMS else "sm80"
        row = next(line for line in out.splitlines() if line.startswith(f"  d={head_dim:<4}plain:"))
        assert row.startswith(f"  d={head_dim:<4}plain: {fwd} / {bwd}  causal: {fwd} / {bwd}")
        assert row.endswith(f"1 query: decode / {bwd}")  # few queries: the decode forward
