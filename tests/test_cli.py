"""The CLI and the bench harness: option handling, the no-GPU path, JSON and plot on the CPU;
a tiny bench, check and info on the GPU."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest

from flashcupy import bench, cli, device
from flashcupy.device import NoGPUError
from cli_helpers import invoke, on_gpu
from gpu_helpers import rel_err



def fabricated_records():
    """Records as bench_shape returns them, with made-up numbers and every status."""
    records = []
    shapes = bench.sweep_shapes(seqlens=(512, 1024), head_dims=(64,), causal=(False, True), total_tokens=2048)
    for shape in shapes:
        group = []
        for impl, tflops in (("flashcupy", 300.0), ("naive", 5.0), ("sdpa_flash", 280.0)):
            r = bench.new_record(shape, impl)
            r.update(ms=1.0 / tflops, tflops=tflops, first_call_ms=12.5, peak_extra_bytes=3 << 20)
            group.append(r)
        group.append({**bench.new_record(shape, "sdpa_cudnn"), "status": "err", "note": "RuntimeError: no kernel"})
        group.append({**bench.new_record(shape, "sdpa_mem_efficient"), "status": "OOM"})
        bench.fill_ratios(group)
        records += group
    return records


FAKE_METADATA = {"device": "Fake GPU", "compute_capability": "9.0", "cuda_driver_version": "13.0",
                 "cupy_version": "14.2.0", "nvrtc_version": "12.9", "torch_version": None, "git_commit": None}


# ----------------------------------------------------------------------------------------------
# Help and option validation (CPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["bench"], ["info"], ["check"], ["compile"]])
def test_help(command):
    result = invoke(*command, "--help")
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_bench_help_lists_options():
    result = invoke("bench", "--help")
    for option in ("--seqlens", "--head-dims", "--causal", "--dtype", "--mode", "--total-tokens", "--hidden",
                   "--peers", "--repeats", "--warmup", "--json", "--plot", "--quiet"):
        assert option in result.output


def test_main_is_the_console_entry():
    result = invoke("--version")
    assert result.exit_code == 0 and "flashcupy" in result.output


@pytest.mark.parametrize("args, hint", [
    (["--head-dims", "48"], "choose from 32, 64"),
    (["--head-dims", "64,abc"], "not supported"),
    (["--seqlens", "0"], "must be positive"),
    (["--seqlens=-1k"], "e.g. 512,1k,2k"),
    (["--seqlens", "1.5k"], "e.g. 512,1k,2k"),
    (["--seqlens", ","], "at least one"),
    (["--seqlens", "512,1048576k"], "below 2**30"),
    (["--decode", "--kv-lens", "2000000000"], "below 2**30"),
    (["--peers", "naive,foo"], "sdpa_flash"),
    (["--peers", "none,naive"], "cannot be combined"),
    (["--dtype", "fp32"], "bf16, fp16"),
    (["--mode", "fwd,both"], "fwdbwd"),
    (["--hidden", "2000", "--head-dims", "64"], "multiple of head dim 64; e.g. --hidden 2048"),
    (["--head-dims", "96"], "2048 is not a multiple of head dim 96; e.g. --hidden 1920"),
    (["--head-dims", "96", "--variants", "plain"], "e.g. --hidden 2016"),
    (["--head-dims", "64,96,128"], "e.g. --hidden 1536"),
    (["--hidden", "2400", "--head-dims", "96"], "25 heads to be a multiple of 4; e.g. --hidden 2304"),
    (["--json", "no/such/folder/bench.json"], "does not exist"),
    (["--plot", "no/such/folder/bench.png"], "does not exist"),
])
def test_bench_bad_options_are_usage_errors(args, hint, monkeypatch):
    monkeypatch.setattr(cli, "_require_gpu", lambda ctx: pytest.fail("the GPU was asked for before the options"))
    result = invoke("bench", *args)
    assert result.exit_code == 2, result.output
    assert "Usage:" in result.output and hint in result.output
    assert "Traceback" not in result.output


def test_check_bad_head_dim():
    result = invoke("check", "--head-dims", "100")
    assert result.exit_code == 2 and "not supported" in result.output


# ----------------------------------------------------------------------------------------------
# No GPU: one line saying what is missing, exit status 3, no traceback (CPU)
# ----------------------------------------------------------------------------------------------

GPU_COMMANDS = [["bench"], ["info"], ["check"], ["compile"]]
NO_DRIVER = device.CudaStack(cupy_version="14.2.0", runtime_version=12090,
                             libcuda_error="cannot open shared object file: No such file or directory",
                             runtime_status=device.CUDA_ERROR_INSUFFICIENT_DRIVER,
                             runtime_error="cudaErrorInsufficientDriver: CUDA driver version is insufficient")


def assert_no_gpu_exit(result, *phrases):
    assert result.exit_code == cli.NO_GPU_EXIT == 3, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashcupy: "), result.stderr
    for phrase in phrases:
        assert phrase in lines[0]
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


def simulate(monkeypatch, stack):
    """The CLI sees no GPU, and the probe answers `stack`."""
    monkeypatch.setattr(device, "gpu_available", lambda: False)
    monkeypatch.setattr(device, "probe_cuda", lambda: stack)


@pytest.mark.parametrize("command", GPU_COMMANDS)
def test_no_driver_simulated(monkeypatch, command):
    simulate(monkeypatch, NO_DRIVER)
    result = invoke(*command)
    assert_no_gpu_exit(result, "no NVIDIA driver", "libcuda")
    assert "insufficient" not in result.stderr  # the runtime's guess is not repeated


@pytest.mark.parametrize("stack, phrases", [
    (device.CudaStack(cupy_version="14.2.0", driver_version=12040, driver_release="550.54.15",
                      runtime_version=12090, device_count=0),
     ["no CUDA device", "550.54.15", "CUDA 12.4"]),
    (device.CudaStack(cupy_version="14.2.0", driver_version=12040, runtime_version=12090,
                      runtime_status=device.CUDA_ERROR_NO_DEVICE, runtime_error="cudaErrorNoDevice: no device",
                      visible_devices=""),
     ["no CUDA device", "CUDA_VISIBLE_DEVICES=''"]),
    (device.CudaStack(cupy_version="14.2.0", driver_version=12040, driver_release="550.54.15",
                      runtime_version=13000, runtime_status=device.CUDA_ERROR_INSUFFICIENT_DRIVER,
                      runtime_error="cudaErrorInsufficientDriver: CUDA driver version is insufficient"),
     ["NVIDIA driver too old", "550.54.15 supports CUDA 12.4", "CuPy 14.2.0 is built for CUDA 13.0",
      "pip uninstall cupy-cuda13x", 'pip install ".[cuda12]"', "update the driver"]),
    (device.CudaStack(cupy_version="14.2.0", driver_version=11040, runtime_version=12090,
                      runtime_status=device.CUDA_ERROR_INSUFFICIENT_DRIVER, runtime_error="insufficient"),
     ["NVIDIA driver too old", "supports CUDA 11.4", "built for CUDA 12.9", "update the driver to one for CUDA 12"]),
    (device.CudaStack(cupy_error="ModuleNotFoundError: No module named 'cupy'"),
     ["CuPy does not import", 'pip install ".[cuda12]"', 'pip install ".[cuda13]"']),
], ids=["no-device", "devices-hidden", "driver-older-than-cupy", "driver-older-than-cuda12", "no-cupy"])
def test_no_gpu_reasons(monkeypatch, stack, phrases):
    simulate(monkeypatch, stack)
    assert_no_gpu_exit(invoke("info"), *phrases)


def test_no_gpu_status_is_not_a_usage_error():
    assert cli.NO_GPU_EXIT not in (0, 1, 2)
    result = invoke("--help")
    assert f"{cli.NO_GPU_EXIT} no usable CUDA GPU" in " ".join(result.output.split())
    assert f"status {cli.NO_GPU_EXIT}" in cli.__doc__


@pytest.mark.parametrize("command", GPU_COMMANDS)
def test_device_info_failure_is_no_gpu(monkeypatch, command):
    def no_device(device_id=None):
        raise NoGPUError("no usable CUDA GPU: cudaErrorNoDevice")

    monkeypatch.setattr(device, "gpu_available", lambda: True)
    monkeypatch.setattr(device, "device_info", no_device)
    assert_no_gpu_exit(invoke(*command), "no usable CUDA GPU: cudaErrorNoDevice")


@pytest.mark.skipif(device.gpu_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("command", [["bench", "--seqlens", "256"], ["info"], ["check"], ["compile"]])
def test_no_gpu_real(command):
    assert_no_gpu_exit(invoke(*command), device.no_gpu_reason())


# ----------------------------------------------------------------------------------------------
# Harness pieces (CPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [("512", 512), ("1k", 1024), ("16K", 16384), (" 2k ", 2048),
                                         ("257", 257), ("1048575k", 2**30 - 1024)])
def test_parse_seqlen(text, value):
    assert bench.parse_seqlen(text) == value


@pytest.mark.parametrize("text", ["0", "0k", "-512", "1.5k", "k", "", "2m", "1048576k", str(2**40)])
def test_parse_seqlen_rejects(text):
    with pytest.raises(ValueError):
        bench.parse_seqlen(text)


def test_sweep_shapes_follow_the_protocol():
    shapes = bench.sweep_shapes()
    assert len(shapes) == 6 * 2 * 2  # seqlens x head dims x causal, bf16 fwd
    by_key = {(s.seqlen, s.head_dim, s.causal): s for s in shapes}
    assert by_key[512, 64, False].batch == 32 and by_key[512, 64, False].nheads == 32
    assert by_key[16384, 128, True].batch == 1 and by_key[16384, 128, True].nheads == 16
    assert bench.sweep_shapes(seqlens=(32768,))[0].batch == 1
    with pytest.raises(ValueError, match="multiple of head dim"):
        bench.sweep_shapes(head_dims=(96,), hidden=2000)


def test_sweep_variants_gqa_and_window():
    shapes = bench.sweep_shapes(seqlens=(4096,), head_dims=(64, 128), variants=bench.VARIANTS)
    assert [(s.head_dim, s.describe()) for s in shapes] == [
        (64, "causal off"), (64, "causal on"), (64, "causal on, GQA 32/8"), (64, "window 1024"),
        (128, "causal off"), (128, "causal on"), (128, "causal on, GQA 16/4"), (128, "window 1024")]
    assert [s.variant for s in shapes[:4]] == ["plain", "plain", "gqa", "window"]
    plain, gqa, window = shapes[1:4]
    assert bench._flops(gqa) == bench._flops(plain)
    # window 1024 of 4096 keys: sum over rows of min(i, 1024) + 1 pairs, against the causal N^2 / 2
    pairs = sum(min(i, 1024) + 1 for i in range(4096))
    assert bench._flops(window) == pytest.approx(bench._flops(plain) * pairs / (4096 * 4096 / 2))
    with pytest.raises(ValueError, match="multiple of 4"):
        bench.sweep_shapes(head_dims=(128,), hidden=128 * 6, variants=("gqa",))
    with pytest.raises(ValueError, match="variant"):
        bench.sweep_shapes(variants=("alibi",))
    with pytest.raises(ValueError, match="causal"):
        bench.BenchShape(1, 128, 2, 64, False, "bf16", "fwd", window=64)


def test_failures_become_cells(monkeypatch):
    shape = bench.sweep_shapes(seqlens=(256,), head_dims=(64,), causal=(False,), total_tokens=256)[0]

    def broken(shape, seed=0):
        raise RuntimeError("boom")

    monkeypatch.setattr(bench, "make_inputs", broken)
    records = bench.bench_shape(shape, ("flashcupy", "naive"), repeats=1, warmup=0)
    assert [r["status"] for r in records] == ["err", "err"]
    assert records[0]["note"] == "inputs: RuntimeError: boom"

    def oom(shape, seed=0):
        raise MemoryError("cudaErrorMemoryAllocation: out of memory")

    monkeypatch.setattr(bench, "make_inputs", oom)
    assert {r["status"] for r in bench.bench_shape(shape, ("naive",))} == {"OOM"}


class FakeFlashcupy:
    """Stands in for flashcupy's entry points and counts the calls a bench step makes."""

    def __init__(self):
        self.calls = []
        self.masks = set()

    def flash_attn_func(self, q, k, v, causal=False, window_size=(-1, -1), return_lse=False):
        self.calls.append("fwd")
        self.masks.add((causal, window_size))
        return ("out", "lse") if return_lse else "out"

    def flash_attn_backward(self, dout, q, k, v, out, lse, causal=False, window_size=(-1, -1)):
        assert (out, lse) == ("out", "lse")
        self.calls.append("bwd")
        self.masks.add((causal, window_size))
        return "dq", "dk", "dv"


@pytest.mark.parametrize("variant, mask", [("plain", (True, (-1, -1))), ("window", (True, (1024, 0)))])
@pytest.mark.parametrize("mode, at_setup, per_step", [("fwd", [], ["fwd"]), ("bwd", ["fwd"], ["bwd"]),
                                                      ("fwdbwd", [], ["fwd", "bwd"])])
def test_flashcupy_step_times_what_the_mode_names(monkeypatch, mode, at_setup, per_step, variant, mask):
    """bwd: the forward runs once while the step is built, and each timed step is the backward alone."""
    import flashcupy

    fake = FakeFlashcupy()
    monkeypatch.setattr(flashcupy, "flash_attn_func", fake.flash_attn_func)
    monkeypatch.setattr(flashcupy, "flash_attn_backward", fake.flash_attn_backward)
    shape = bench.sweep_shapes(seqlens=(256,), head_dims=(64,), causal=(True,), modes=(mode,), variants=(variant,))[0]
    step = bench._make_step("flashcupy", shape, ("q", "k", "v", "dout" if mode != "fwd" else None))
    assert fake.calls == at_setup
    step()
    step()
    assert fake.calls == at_setup + per_step * 2
    assert fake.masks == {mask}
    if variant != "plain":
        with pytest.raises(bench.NotApplicable, match="plain"):
            bench._make_step("naive", shape, (None,) * 4)


def test_bench_default_modes(monkeypatch, fake_gpu):
    monkeypatch.setattr(bench, "collect_metadata", lambda: dict(FAKE_METADATA))
    seen = []
    monkeypatch.setattr(bench, "bench_shape",
                        lambda shape, impls, repeats, warmup, rounds, settle: seen.append(shape) or [])
    result = invoke("bench", "--seqlens", "512", "--head-dims", "64", "--causal", "off", "--variants", "plain",
                    "--peers", "none", "--quiet")
    assert result.exit_code == 0, result.output
    assert [s.mode for s in seen] == ["fwd", "bwd", "fwdbwd"]


def test_bench_rounds_turn_the_order_and_keep_each_median_round(monkeypatch):
    """rounds=3: each implementation timed 3 times, the order turning by one each round; each record
    is its median round's, with the first round's first-call time; one that fails runs once."""
    shape = bench.sweep_shapes(seqlens=(256,), head_dims=(64,), causal=(False,), modes=("fwd",))[0]
    monkeypatch.setattr(bench, "make_inputs", lambda shape, seed=0: (None, None, None, None))
    order, times = [], {"flashcupy": [3.0, 1.0, 2.0], "naive": [5.0, 4.0, 6.0]}

    def fake_bench_impl(impl, shape, inputs, repeats, warmup, settle):
        order.append(impl)
        record = bench.new_record(shape, impl)
        if impl == "sdpa_flash":
            return {**record, "status": "err", "note": "boom"}
        ms = times[impl][sum(i == impl for i in order) - 1]
        return {**record, "ms": ms, "tflops": 1 / ms, "first_call_ms": 100 * ms}

    monkeypatch.setattr(bench, "_bench_impl", fake_bench_impl)
    records = bench.bench_shape(shape, ("flashcupy", "naive", "sdpa_flash"), repeats=1, warmup=0, rounds=3)
    assert order == ["flashcupy", "naive", "sdpa_flash", "naive", "flashcupy", "flashcupy", "naive"]
    assert [r["ms"] for r in records[:2]] == [2.0, 5.0]  # medians of (3, 1, 2) and (5, 4, 6)
    assert [r["first_call_ms"] for r in records[:2]] == [300.0, 500.0]  # the first rounds'
    assert records[2]["status"] == "err" and records[1]["ratio"] == pytest.approx(5.0 / 2.0)
    assert bench.bench_shape(shape, (), repeats=1, warmup=0, rounds=3) == []


def test_bench_passes_rounds_and_settle(monkeypatch, fake_gpu, tmp_path):
    monkeypatch.setattr(bench, "collect_metadata", lambda: dict(FAKE_METADATA))
    seen = []
    monkeypatch.setattr(bench, "bench_shape",
                        lambda shape, impls, repeats, warmup, rounds, settle: seen.append((rounds, settle)) or [])
    args = ("bench", "--seqlens", "512", "--head-dims", "64", "--causal", "off", "--variants", "plain", "--mode", "fwd",
            "--peers", "none", "--quiet")
    result = invoke(*args, "--rounds", "3", "--settle", "2.5", "--json", str(tmp_path / "b.json"))
    assert result.exit_code == 0, result.output
    assert seen == [(3, 2.5)]
    assert bench.load_json(tmp_path / "b.json")["config"]["settle"] == 2.5
    assert invoke(*args).exit_code == 0 and seen[-1] == (1, bench.DEFAULT_SETTLE)
    for option, value in (("--rounds", "2"), ("--settle", "1")):
        result = invoke("bench", "--decode", option, value)
        assert result.exit_code != 0 and f"{option} does not apply to --decode" in result.output
    result = invoke(*args, "--settle", "-1")
    assert result.exit_code != 0 and "--settle" in result.output


def test_naive_has_no_backward(monkeypatch):
    pytest.importorskip("cupy")
    shape = bench.sweep_shapes(seqlens=(256,), head_dims=(64,), causal=(False,), modes=("bwd",))[0]
    monkeypatch.setattr(bench, "make_inputs", lambda shape, seed=0: (None, None, None, None))
    (record,) = bench.bench_shape(shape, ("naive",))
    assert record["status"] == "n/a" and "no backward" in record["note"]


def test_ratios():
    records = fabricated_records()
    ratio = {r["impl"]: r["ratio"] for r in records[:5]}
    assert ratio["flashcupy"] is None and ratio["sdpa_cudnn"] is None
    assert ratio["naive"] == pytest.approx(60.0) and ratio["sdpa_flash"] == pytest.approx(300 / 280)


def test_json_document(tmp_path):
    records = fabricated_records()
    document = bench.results_document(records, FAKE_METADATA, {"repeats": 20})
    path = tmp_path / "bench.json"
    bench.write_json(document, path)
    loaded = json.loads(path.read_text())
    assert loaded == bench.load_json(path)
    assert set(loaded) == {"schema", "metadata", "config", "fields", "results"}
    assert loaded["schema"] == bench.SCHEMA
    assert loaded["metadata"]["device"] == "Fake GPU"
    assert len(loaded["results"]) == len(records)
    for record in loaded["results"]:
        assert set(record) == set(bench.FIELDS)
        assert record["status"] in ("ok", "OOM", "err", "n/a")
    bad = tmp_path / "other.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a flashcupy bench result"):
        bench.load_json(bad)


def test_table():
    table = bench.format_table(fabricated_records())
    assert "fwd bf16  head dim 64 (32 heads)  causal off" in table
    assert "causal on" in table
    assert "60.00x" in table and "3.0 MiB" in table
    assert "OOM" in table and "err[1]" in table
    assert "[1] sdpa_cudnn: RuntimeError: no kernel" in table
    assert table.count("[1] ") == 1  # one footnote however many cells share it


def test_git_commit_is_a_hash_or_none():
    commit = bench.git_commit()
    assert commit is None or len(commit.removesuffix("-dirty")) == 40


def test_plot_from_stored_json(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.json"
    records = fabricated_records()
    bwd = [{**r, "mode": "bwd", "head_dim": 128, "nheads": 16} for r in records]
    bench.write_json(bench.results_document(records + bwd, FAKE_METADATA, {}), path)
    png = tmp_path / "bench.png"
    bench.plot_results(bench.load_json(path), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bench.plot_results(records, tmp_path / "records.png")  # the bare list works too
    assert (tmp_path / "records.png").stat().st_size > 0


def test_an_interrupted_bench_keeps_its_finished_shapes(monkeypatch, tmp_path, fake_gpu):
    """Ctrl-C during the third shape: the table and the JSON hold the first two shapes' records, the
    JSON says it was interrupted, and the exit status is 130."""
    monkeypatch.setattr(bench, "collect_metadata", lambda: dict(FAKE_METADATA))
    done = []

    def fake_bench_shape(shape, impls, repeats, warmup, rounds, settle):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(shape)
        records = [{**bench.new_record(shape, impl), "ms": 1.0, "tflops": 100.0} for impl in impls]
        bench.fill_ratios(records)
        return records

    monkeypatch.setattr(bench, "bench_shape", fake_bench_shape)
    json_path = tmp_path / "out.json"
    result = invoke("bench", "--seqlens", "1k,2k,4k,8k", "--head-dims", "64", "--causal", "off", "--variants",
                    "plain", "--mode", "fwd", "--peers", "none", "--json", str(json_path))
    assert result.exit_code == cli.INTERRUPTED_EXIT, result.output
    assert "bench interrupted" in result.stderr and str(json_path) in result.stderr
    assert "1k" in result.stdout and "2k" in result.stdout  # the table of what finished
    document = bench.load_json(json_path)
    assert document["config"]["interrupted"] is True
    assert [r["seqlen"] for r in document["results"]] == [1024, 2048]


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now fails
    with pytest.raises(bench.MissingDependencyError, match="pip install matplotlib"):
        bench.plot_results(fabricated_records(), tmp_path / "x.png")


def test_bench_command_glue(monkeypatch, tmp_path, fake_gpu):
    """The CLI's sweep with the GPU parts faked: torch note, table, JSON and plot."""
    monkeypatch.setattr(bench, "collect_metadata", lambda: dict(FAKE_METADATA))
    monkeypatch.setattr(bench, "torch_unavailable_reason", lambda: "torch is not importable")
    seen = []

    def fake_bench_shape(shape, impls, repeats, warmup, rounds, settle):
        seen.append((shape, impls, repeats, warmup, rounds))
        records = [{**bench.new_record(shape, impl), "ms": 1.0, "tflops": 100.0} for impl in impls]
        bench.fill_ratios(records)
        return records

    monkeypatch.setattr(bench, "bench_shape", fake_bench_shape)
    json_path = tmp_path / "out.json"
    args = ["bench", "--seqlens", "1k,2k", "--head-dims", "128", "--causal", "on", "--dtype", "bf16",
            "--dtype", "fp16", "--mode", "fwd,bwd", "--repeats", "3", "--warmup", "1", "--json", str(json_path)]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "torch peers skipped (sdpa_flash, sdpa_cudnn, fa4): torch is not importable" in result.stderr
    assert len(seen) == 2 * 2 * 2 * 3 and seen[0][1:] == (("flashcupy", "naive"), 3, 1, 1)  # x plain, gqa, window
    for section in ("causal on\n", "causal on, GQA 16/4\n", "window 1024\n"):
        assert "fwd fp16  head dim 128 (16 heads)  " + section in result.stdout
    document = bench.load_json(json_path)
    assert document["config"]["seqlens"] == [1024, 2048] and document["config"]["causal"] == [True]
    assert document["config"]["impls"] == ["flashcupy", "naive"] and document["config"]["interrupted"] is False
    assert document["config"]["variants"] == list(bench.VARIANTS)
    assert len(document["results"]) == 48
    assert {(r["nheads_k"], r["window"]) for r in document["results"]} == {(16, None), (4, None), (16, 1024)}

    quiet = invoke("bench", "--seqlens", "512", "--peers", "none", "--quiet")
    assert quiet.exit_code == 0 and quiet.stdout == ""

    if importlib.util.find_spec("matplotlib") is not None:
        png = tmp_path / "out.png"
        assert invoke("bench", "--seqlens", "512", "--peers", "none", "--plot", str(png)).exit_code == 0
        assert png.stat().st_size > 0


# ----------------------------------------------------------------------------------------------
# On the GPU
# ----------------------------------------------------------------------------------------------


@on_gpu
def test_bench_tiny_gpu(tmp_path):
    json_path = tmp_path / "tiny.json"
    result = invoke("bench", "--seqlens", "256", "--head-dims", "64", "--causal", "both", "--repeats", "2",
                    "--warmup", "1", "--peers", "naive", "--total-tokens", "1024", "--json", str(json_path))
    assert result.exit_code == 0, result.output
    assert "flashcupy" in result.stdout and "naive" in result.stdout and "TFLOP/s" in result.stdout
    records = bench.load_json(json_path)["results"]
    flash = [r for r in records if r["impl"] == "flashcupy"]
    # 3 modes x (causal off, on, GQA, window)
    assert len(flash) == 12 and all(r["status"] == "ok" and r["tflops"] > 0 for r in flash), flash
    assert all(r["peak_extra_bytes"] is not None for r in records if r["status"] == "ok")
    naive = [r for r in records if r["impl"] == "naive"]
    plain_fwd = [r["mode"] == "fwd" and r["nheads_k"] == r["nheads"] and r["window"] is None for r in naive]
    assert len(naive) == 12 and sum(plain_fwd) == 2  # naive ran fwd with causal off and on
    assert all(r["status"] == "ok" and r["ratio"] > 0 for r, plain in zip(naive, plain_fwd) if plain), naive
    # naive has no backward and runs plain attention only
    assert all(r["status"] == "n/a" for r, plain in zip(naive, plain_fwd) if not plain), naive


@on_gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
def test_naive_attention_matches_reference(dtype, causal):
    import cupy

    from flashcupy.reference import attention_ref

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s, dtype=np.float32).astype(bench.numpy_dtype(dtype))
               for s in ((2, 64, 3, 32), (2, 80, 3, 32), (2, 80, 3, 32)))
    out = bench.naive_attention(*(cupy.asarray(a) for a in (q, k, v)), causal=causal)
    assert out.dtype == q.dtype and out.shape == q.shape and out.flags.c_contiguous
    ref, _ = attention_ref(*(a.astype(np.float64) for a in (q, k, v)), causal=causal)
    assert rel_err(cupy.asnumpy(out), ref) < cli.FWD_TOL[bench.DTYPES[dtype]]


@on_gpu
def test_info_gpu():
    result = invoke("info")
    assert result.exit_code == 0, result.output
    assert "compute capability" in result.stdout and "fwd d=64" in result.stdout


@on_gpu
def test_check_gpu():
    result = invoke("check", "--head-dims", "64")
    assert result.exit_code == 0, result.output
    assert "FAIL" not in result.stdout and "PASS" in result.stdout


@pytest.mark.slow
@on_gpu
def test_check_all_variants_gpu():
    result = invoke("check")
    assert result.exit_code == 0, result.output


def test_time_step_warms_up_for_a_while_then_times_each_call():
    """At least `warmup` untimed calls and at least DEFAULT_SETTLE seconds of them (the GPU's clocks come back
    after an idle compile), then `repeats` calls between events; the median of their times."""
    import time

    class FakeEvent:
        def __init__(self, clock):
            self.clock, self.t = clock, None

        def record(self):
            self.t = self.clock[0]

    class FakeRuntime:
        def __init__(self):
            self.clock, self.syncs = [0.0], 0

        def event(self):
            return FakeEvent(self.clock)

        def elapsed_ms(self, start, end):
            return end.t - start.t

        def synchronize(self):
            self.syncs += 1

    runtime, calls = FakeRuntime(), []

    def step():  # 2 ms of "GPU time" per call, by a clock the events read
        calls.append(time.perf_counter())
        runtime.clock[0] += 2.0

    t0 = time.perf_counter()
    first_ms, ms = bench.time_step(step, runtime, repeats=5, warmup=3)
    untimed = len(calls) - 1 - 5
    assert untimed >= 3 and calls[-6] - calls[1] >= bench.DEFAULT_SETTLE / 2  # calls, not one wait
    assert time.perf_counter() - t0 >= bench.DEFAULT_SETTLE
    assert ms == 2.0 and first_ms >= 0
    assert runtime.syncs >= untimed // 8  # the host does not run far ahead of the GPU while warming
    calls.clear()
    t0 = time.perf_counter()
    bench.time_step(step, runtime, repeats=2, warmup=1, settle=0.3)  # a power cap's steady clock
    assert time.perf_counter() - t0 >= 0.3 and calls[-3] - calls[1] >= 0.15
