"""`flashcupy bench --decode`: the sweep, the records' arithmetic, the table, the CLI's options (on
the CPU), the clock's kernels (NVRTC) and a tiny sweep on the GPU."""

from __future__ import annotations

import contextlib
import json

import pytest

from cli_helpers import invoke, on_gpu
from flashcupy import bench, bench_decode, build

FAKE_METADATA = {"device": "Fake GPU", "compute_capability": "9.0", "cuda_driver_version": "13.0",
                 "cupy_version": "14.0", "nvrtc_version": "12.9", "git_commit": "abc"}


def test_default_sweep_is_the_decode_grid():
    cases = bench_decode.sweep_cases()
    assert len(cases) == 4 * 4 * 2
    assert {(c.nheads, c.nheads_k) for c in cases} == {(32, 8), (32, 32)}
    assert {c.batch for c in cases} == {1, 8, 32, 128} and {c.kv_len for c in cases} == {1024, 8192, 32768, 131072}
    assert {c.head_dim for c in cases} == {128} and {c.dtype for c in cases} == {"bf16"}
    big = bench_decode.DecodeCase(32, 65536, 32, 8)
    assert big.kv_bytes == 2 * 32 * 65536 * 8 * 128 * 2  # 8.6 GB: K and V, 2 bytes each


def test_sweep_refuses_bad_heads_and_dtypes():
    with pytest.raises(ValueError, match="multiple of 5 kv heads"):
        bench_decode.sweep_cases(heads=((32, 5),))
    with pytest.raises(ValueError, match="fp8"):
        bench_decode.sweep_cases(dtypes=("fp8",))


@pytest.mark.parametrize("text, heads", [("32/8", (32, 8)), ("16", (16, 16)), (" 8/1 ", (8, 1))])
def test_parse_heads(text, heads):
    assert bench_decode.parse_heads(text) == heads


@pytest.mark.parametrize("text", ["32/5", "a/b", "0/0", "32/8/2", ""])
def test_parse_heads_refuses(text):
    with pytest.raises(ValueError):
        bench_decode.parse_heads(text)


def test_rows_run_flashcupy_in_each_layout_and_peers_contiguous():
    case = bench_decode.DecodeCase(1, 1024, 32, 8)
    rows = bench_decode._rows(case, bench_decode.IMPLS, bench_decode.LAYOUTS, 64)
    assert rows == [("flashcupy", "contiguous", None), ("flashcupy", "paged", 64), ("sdpa_flash", "contiguous", None),
                    ("sdpa_cudnn", "contiguous", None)]


def _records():
    case = bench_decode.DecodeCase(8, 8192, 32, 8)
    fc = {**bench_decode.new_record(case, "flashcupy"), "warm_us": 70.0, "flushed_us": 80.0, "graph_us": 66.0,
          "host_us": 50.0, "splits": 4}
    paged = {**bench_decode.new_record(case, "flashcupy", "paged", 256), "warm_us": 72.0, "flushed_us": 82.0,
             "host_us": 55.0, "splits": 4, "note": "graph: RuntimeError: capture refused"}
    flash = {**bench_decode.new_record(case, "sdpa_flash"), "warm_us": 75.0, "flushed_us": 100.0, "graph_us": 55.0,
             "host_us": 30.0}
    cudnn = {**bench_decode.new_record(case, "sdpa_cudnn"), "warm_us": 60.0, "flushed_us": 90.0, "graph_us": 57.0,
             "host_us": 30.0}
    skipped = {**bench_decode.new_record(bench_decode.DecodeCase(128, 131072, 32, 32), "flashcupy"),
               "status": "skip", "note": "the cache needs 256.0 GiB with its margin; 130.0 GiB free"}
    return [fc, paged, flash, cudnn, skipped]


def test_bandwidth_fraction_and_speedups():
    records = _records()
    bench_decode.fill_derived(records, peak_tbs=4.8)
    fc, paged, flash, cudnn, skipped = records
    assert fc["flushed_tbs"] == pytest.approx(fc["kv_bytes"] / 80e-6 / 1e12)
    assert fc["peak_fraction"] == pytest.approx(fc["flushed_tbs"] / 4.8)
    assert fc["speedup"] == pytest.approx(90.0 / 80.0)  # the faster peer flushed: cuDNN
    assert fc["warm_speedup"] == pytest.approx(60.0 / 70.0)  # warm: cuDNN again, faster than flashcupy
    assert fc["graph_speedup"] == pytest.approx(55.0 / 66.0)  # replayed from a graph: SDPA flash the faster peer
    assert paged["speedup"] == pytest.approx(90.0 / 82.0) and paged["graph_speedup"] is None  # its capture failed
    assert flash["speedup"] is None and cudnn["warm_speedup"] is None
    assert skipped["flushed_tbs"] is None and skipped["speedup"] is None


def test_no_peak_leaves_the_fraction_empty():
    records = _records()
    bench_decode.fill_derived(records, peak_tbs=None)
    assert records[0]["flushed_tbs"] > 0 and records[0]["peak_fraction"] is None


def test_table_shows_every_row_and_explains_skips():
    records = _records()
    bench_decode.fill_derived(records, peak_tbs=4.8)
    limits = {"hbm_peak_tbs": 4.8, "hbm_peak_source": "--hbm-peak", "copy_tbs": 4.3, "read_tbs": 4.5}
    table = bench_decode.format_table(records, limits)
    assert "HBM peak 4.80 TB/s (--hbm-peak)" in table and "copy 4.30" in table and "read 4.50" in table
    assert "32 query heads / 8 kv heads" in table and "32 query heads / 32 kv heads" in table
    assert "flashcupy paged 256" in table and "sdpa_cudnn" in table
    assert "0.86/1.12/0.83x" in table  # warm / flushed / graph speedup over the faster peer
    assert " 66.0 " in table and "graph us" in table
    assert "0.83/1.10/-x" in table and "-[1]" in table  # the paged row's failed capture, explained
    assert "[1] flashcupy paged 256: graph: RuntimeError: capture refused" in table
    assert "skip[2]" in table and "[2] flashcupy: the cache needs 256.0 GiB" in table
    no_peak = bench_decode.format_table(records, {**limits, "hbm_peak_tbs": None})
    assert "HBM peak unknown" in no_peak


def test_a_case_that_does_not_fit_is_skipped_without_allocating(monkeypatch):
    monkeypatch.setattr(bench_decode, "_free_bytes", lambda: 10 << 30)
    monkeypatch.setattr(bench_decode, "make_inputs", lambda case: pytest.fail("allocated"))
    case = bench_decode.DecodeCase(128, 131072, 32, 32)
    records = bench_decode.bench_case(case, bench_decode.IMPLS, bench_decode.LAYOUTS, 256, 5, clock=None)
    assert len(records) == 4 and all(r["status"] == "skip" for r in records)
    assert "257.0 GiB" in records[0]["note"] and "10.0 GiB free" in records[0]["note"]


@pytest.mark.parametrize("name", ["spin_kernel", "read_kernel"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_clock_kernels_compile(name, arch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    assert build.compile_cubin(bench_decode.TimingKernel(name), arch)[:4] == b"\x7fELF"


@pytest.mark.parametrize("args, hint", [
    (["--decode", "--seqlens", "1k"], "--seqlens does not apply to --decode"),
    (["--decode", "--mode", "fwd", "--hidden", "1024"], "--hidden, --mode do not apply to --decode"),
    (["--batches", "4"], "--batches does not apply without --decode"),
    (["--page-size", "16"], "--page-size does not apply without --decode"),
    (["--decode", "--heads", "32/5"], "not a multiple of 5 kv heads"),
    (["--decode", "--batches", "0"], "'0' is not a positive integer"),
    (["--decode", "--kv-lens", "1m"], "not a sequence length"),
    (["--decode", "--layouts", "ring"], "'ring' is not one of contiguous, paged"),
    (["--decode", "--page-size", "0"], "--page-size"),
    (["--decode", "--hbm-peak", "-1"], "--hbm-peak"),
    (["--decode", "--peers", "naive"], "'naive' is not a decode peer"),
    (["--decode", "--head-dims", "100"], "not supported"),
    (["--decode", "--kv-lens", "1000,3000", "--page-size", "16"], "16 divides none of the kv lengths"),
])
def test_decode_bad_options_are_usage_errors(args, hint, monkeypatch):
    from flashcupy import cli

    monkeypatch.setattr(cli, "_require_gpu", lambda ctx: pytest.fail("the GPU was asked for before the options"))
    result = invoke("bench", *args)
    assert result.exit_code == 2, result.output
    assert hint in result.output
    assert "Traceback" not in result.output


def test_decode_without_gpu_says_so(monkeypatch):
    """Options are fine, no GPU: one line saying so and the no-GPU status, before anything runs."""
    from flashcupy import cli, device

    monkeypatch.setattr(device, "gpu_available", lambda: False)
    monkeypatch.setattr(bench_decode, "Clock", lambda: pytest.fail("the sweep started"))
    result = invoke("bench", "--decode", "--batches", "1", "--kv-lens", "1k")
    assert result.exit_code == cli.NO_GPU_EXIT, result.output
    assert result.output.startswith("flashcupy: ") and len(result.output.strip().splitlines()) == 1


def test_decode_command_glue(monkeypatch, tmp_path, fake_gpu):
    """The CLI's decode sweep with the GPU parts faked: defaults, table and JSON."""
    monkeypatch.setattr(bench, "collect_metadata", lambda: dict(FAKE_METADATA))
    monkeypatch.setattr(bench, "torch_unavailable_reason", lambda: None)
    monkeypatch.setattr(bench_decode, "hbm_peak_tbs", lambda device_id=None: 4.8)

    class FakeClock:
        def bandwidth_tbs(self):
            return {"copy_tbs": 4.3, "read_tbs": 4.5}

    monkeypatch.setattr(bench_decode, "Clock", FakeClock)
    seen = {}

    def fake_sweep(cases, impls, layouts, page_size, repeats, peak_tbs, clock, warmup, records):
        cases = list(cases)
        seen.update(cases=cases, impls=impls, layouts=layouts, page_size=page_size, repeats=repeats, peak=peak_tbs,
                    warmup=warmup)
        records += [{**bench_decode.new_record(c, impl), "warm_us": 10.0, "flushed_us": 12.0, "host_us": 40.0}
                    for c in cases for impl in impls]
        bench_decode.fill_derived(records, peak_tbs)
        return records

    monkeypatch.setattr(bench_decode, "run_sweep", fake_sweep)
    path = tmp_path / "decode.json"
    result = invoke("bench", "--decode", "--batches", "1,8", "--kv-lens", "1k", "--heads", "32/8",
                    "--page-size", "64", "--warmup", "2", "--json", str(path))
    assert result.exit_code == 0, result.output
    assert seen["warmup"] == 2
    assert [(c.batch, c.kv_len, c.nheads, c.nheads_k, c.head_dim) for c in seen["cases"]] == \
        [(1, 1024, 32, 8, 128), (8, 1024, 32, 8, 128)]
    assert seen["impls"] == ("flashcupy", "sdpa_flash", "sdpa_cudnn") and seen["page_size"] == 64
    assert seen["peak"] == 4.8 and seen["layouts"] == ("contiguous", "paged")
    assert "HBM peak 4.80 TB/s" in result.stdout and "sdpa_cudnn" in result.stdout
    document = json.loads(path.read_text())
    assert document["config"]["sweep"] == "decode" and document["config"]["copy_tbs"] == 4.3
    assert document["fields"] == bench_decode.FIELDS and len(document["results"]) == 6
    assert document["config"]["warmup"] == 2 and document["config"]["interrupted"] is False
    assert document["config"]["graph_max_steps"] == bench_decode.GRAPH_MAX_STEPS
    # --hbm-peak overrides the device's figure; peers may be narrowed
    result = invoke("bench", "--decode", "--batches", "1", "--kv-lens", "1k", "--heads", "8/2", "--hbm-peak", "3.35",
                    "--peers", "sdpa_cudnn", "-q")
    assert result.exit_code == 0, result.output
    assert seen["peak"] == 3.35 and seen["impls"] == ("flashcupy", "sdpa_cudnn")


def test_clock_times_the_step_alone():
    """Per timed call: the spin, the flush (when asked), then the step between its two events; one
    wait for the GPU at the end; the median of the events' times."""
    log = []

    class FakeEvent:
        def record(self):
            log.append("record")
            self.at = len(log)

        def synchronize(self):
            log.append("sync")

    class Stream:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Cuda:
        Event = FakeEvent

        @staticmethod
        def get_elapsed_time(start, end):
            return (end.at - start.at) / 1e3  # ms: the calls logged between the two records

    clock = object.__new__(bench_decode.Clock)
    clock.cupy, clock.stream = type("FakeCupy", (), {"cuda": Cuda}), Stream()
    clock.spin = lambda us: log.append("spin")
    clock.flush = lambda: log.append("flush")
    us = clock.time_us(lambda: log.append("step"), 3, flush=True)
    assert log == ["spin", "flush", "record", "step", "record"] * 3 + ["sync"]
    assert us == 2.0  # the step and the closing record: nothing else inside the events
    log.clear()
    clock.time_us(lambda: log.append("step"), 2, flush=False)
    assert log == ["spin", "record", "step", "record"] * 2 + ["sync"]


def test_row_keeps_the_lower_median_of_its_passes(monkeypatch):
    """A row: warmed once, then TIMING_PASSES passes of warm and flushed timing, the lower of each kept."""
    capture = object()
    monkeypatch.setattr(bench_decode, "_make_step", lambda *args: (lambda: None, 3, capture))

    class FakeClock:
        def __init__(self, graph_error=None):
            self.times, self.warmed, self.graphs = {False: [20.0, 15.0], True: [30.0, 31.0]}, [], []
            self.graph_error = graph_error

        def warm_up(self, step, warmup):
            self.warmed.append(warmup)

        def time_us(self, step, repeats, flush):
            return self.times[flush].pop(0)

        def host_us(self, step):
            return 50.0

        def graph_us(self, capture, steps, repeats):
            self.graphs.append((capture, steps, repeats))
            if self.graph_error:
                raise self.graph_error
            return 12.5

    clock = FakeClock()
    case, row = bench_decode.DecodeCase(1, 1024, 8, 2), ("flashcupy", "contiguous", None)
    record = bench_decode._bench_row(case, row, {}, 5, clock, 4)
    assert record["status"] == "ok", record
    assert clock.warmed == [4] and clock.times == {False: [], True: []}
    assert (record["warm_us"], record["flushed_us"], record["host_us"], record["splits"]) == (15.0, 30.0, 50.0, 3)
    # the graph: as many calls as make GRAPH_WORK_US of the warm time (200 / 15 -> 13)
    assert clock.graphs == [(capture, 13, 5)] and (record["graph_us"], record["graph_steps"]) == (12.5, 13)
    # a capture that fails leaves the row's other times and says why
    clock = FakeClock(RuntimeError("operation not permitted when stream is capturing\nmore"))
    record = bench_decode._bench_row(case, row, {}, 5, clock, 4)
    assert record["status"] == "ok" and record["warm_us"] == 15.0 and record["graph_us"] is None
    assert record["note"] == "graph: RuntimeError: operation not permitted when stream is capturing"


@pytest.mark.parametrize("warm_us, steps", [(0.0, 20), (5.0, 20), (14.3, 13), (100.0, 2), (199.0, 1), (15000.0, 1)])
def test_graph_steps_hold_about_the_graph_work(warm_us, steps):
    assert bench_decode.graph_steps(warm_us) == steps


def test_clock_graph_time_is_per_call():
    """The capture runs on the clock's stream; a replay is timed as one step and divided by its calls."""
    log = []

    class Stream:
        def __enter__(self):
            log.append("enter")
            return self

        def __exit__(self, *exc):
            log.append("exit")
            return False

    clock = object.__new__(bench_decode.Clock)
    clock.stream = Stream()
    clock.time_us = lambda step, repeats, flush: log.append((step(), repeats, flush)) or 120.0

    def capture(n):
        log.append(("capture", n))
        return lambda: "replay"

    assert clock.graph_us(capture, 6, 9) == 20.0
    assert log == ["enter", ("capture", 6), "exit", ("replay", 9, False)]


@on_gpu
def test_decode_bench_tiny_gpu(tmp_path):
    """A tiny sweep on the GPU: every flashcupy row times, the paged one too; peers time or say why not."""
    path = tmp_path / "tiny.json"
    result = invoke("bench", "--decode", "--batches", "1,3", "--kv-lens", "1k", "--heads", "8/2", "--repeats", "3",
                    "--page-size", "128", "--json", str(path))
    assert result.exit_code == 0, result.output
    records = json.loads(path.read_text())["results"]
    ours = [r for r in records if r["impl"] == "flashcupy"]
    assert len(ours) == 4 and {r["layout"] for r in ours} == {"contiguous", "paged"}
    for r in ours:
        assert r["status"] == "ok", r
        # a few MiB of K/V: far under the spin and the flush, which must stay outside the events
        assert 0 < r["warm_us"] < bench_decode.SPIN_US / 10 and 0 < r["flushed_us"] < bench_decode.SPIN_US / 10
        assert r["host_us"] > 0 and r["splits"] >= 1
        # replayed from a graph: no spin between the calls, so no more than a spin-separated call
        assert r["graph_steps"] == bench_decode.graph_steps(r["warm_us"]) and 0 < r["graph_us"] <= 1.1 * r["warm_us"], r
    for r in records:
        assert r["status"] in ("ok", "n/a"), r  # n/a: torch missing
        assert r["status"] != "ok" or (r["graph_us"] and r["note"] is None), r  # peers' graphs too


def test_an_interrupted_decode_sweep_keeps_its_finished_cases(monkeypatch, tmp_path, fake_gpu):
    """Ctrl-C during the third case: the first two cases' records, with their derived figures, in
    the JSON; exit status 130."""
    from flashcupy import cli

    monkeypatch.setattr(bench, "collect_metadata", lambda: dict(FAKE_METADATA))
    monkeypatch.setattr(bench, "torch_unavailable_reason", lambda: None)
    monkeypatch.setattr(bench_decode, "hbm_peak_tbs", lambda device_id=None: 4.8)

    class FakeClock:
        stream = contextlib.nullcontext()

        def bandwidth_tbs(self):
            return {"copy_tbs": 4.3, "read_tbs": 4.5}

    monkeypatch.setattr(bench_decode, "Clock", FakeClock)
    done = []

    def fake_case(case, impls, layouts, page_size, repeats, clock, warmup):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(case)
        return [{**bench_decode.new_record(case, impl), "warm_us": 10.0, "flushed_us": 12.0, "host_us": 40.0}
                for impl in impls]

    monkeypatch.setattr(bench_decode, "bench_case", fake_case)
    path = tmp_path / "decode.json"
    result = invoke("bench", "--decode", "--batches", "1,8,32", "--kv-lens", "1k", "--heads", "32/8",
                    "--peers", "sdpa_cudnn", "--json", str(path))
    assert result.exit_code == cli.INTERRUPTED_EXIT, result.output
    assert "interrupted" in result.stderr and str(path) in result.stderr
    document = json.loads(path.read_text())
    assert document["config"]["interrupted"] is True
    assert sorted({r["batch"] for r in document["results"]}) == [1, 8] and len(document["results"]) == 4
    assert all(r["flushed_tbs"] for r in document["results"])  # derived after the interruption too
    assert all(r["speedup"] for r in document["results"] if r["impl"] == "flashcupy")
