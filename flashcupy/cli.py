"""Command line of flashcupy: `flashcupy bench | check | compile | info`, also `python -m flashcupy`.

Every command that needs a GPU checks for one first and, without one, says in one line on stderr
what is missing (CuPy, the NVIDIA driver, a driver recent enough for CuPy's CUDA, or a device) and
exits with status 3 (NO_GPU_EXIT). Other exit statuses: 0 success, 1 a failed check or compile
or another error, 2 a usage error (click's).
"""

from __future__ import annotations

import os
import sys
import time
from typing import NamedTuple

import click
import numpy as np

import flashcupy
from flashcupy import bench, bench_decode, build, configs, device, kvcache, registry
from flashcupy.problem import AttentionOptions, Problem

NO_GPU_EXIT = 3  # 1 is a failure, 2 click's usage error
INTERRUPTED_EXIT = 130  # as a shell reports a command stopped by Ctrl-C
EXIT_STATUSES = (f"Exit status: 0 success; 1 a check, compile or other failure; 2 bad usage; {NO_GPU_EXIT} no "
                 "usable CUDA GPU (no CuPy, no NVIDIA driver, a driver too old for CuPy's CUDA, or no device); "
                 f"{INTERRUPTED_EXIT} a bench stopped by Ctrl-C, its finished cases kept in the table and the JSON.")

# check: ||out - ref||_F / ||ref||_F bounds by dtype, forward and gradients, and the LSE bound
# (absolute, natural log): the LSE comes from float32 sums of exactly rounded inputs.
FWD_TOL = {"bfloat16": 2e-2, "float16": 5e-3}
BWD_TOL = {"bfloat16": 5e-2, "float16": 1e-2}
LSE_TOL = 2e-3
CHECK_SEQLENS = ((257, 300), (300, 257), (512, 512))  # ragged both ways, then equal (q, k)
# kernels that the dispatcher picks only for rows that see many keys are checked on these instead
CHECK_LONG_ROWS = ((129, 1600),)
# and kernels picked for a few query rows (the decode forward) on these: on Hopper the first splits
# into a cluster of 2, the second into more splits than a cluster takes (merged by the count)
CHECK_FEW_QUERIES = ((1, 300), (7, 5001))
CHECK_BATCH, CHECK_NHEADS = 2, 3
CHECK_SOFTCAP = 8.0  # score-mod kernels: softcap and ALiBi slopes, where they change the result
OFFLINE_ARCHS = ("sm_80", "sm_90a")  # `compile --arch`: the NVRTC targets of the kernel families


# ----------------------------------------------------------------------------------------------
# Option parsing
# ----------------------------------------------------------------------------------------------


def _items(values) -> list[str]:
    """Items of an option given as comma lists, repeated, or both."""
    return [item.strip() for value in values for item in str(value).split(",") if item.strip()]


def _nonempty(items, param):
    if not items:
        raise click.BadParameter("give at least one value", param=param)
    return items


def _parsed_items(parse, hint=""):
    """Callback for a comma list whose items `parse` converts (a ValueError: a usage error naming
    the option, with `hint`); repeats dropped, order kept."""
    def callback(ctx, param, values):
        parsed = []
        for item in _nonempty(_items(values), param):
            try:
                parsed.append(parse(item))
            except ValueError as exc:
                raise click.BadParameter(f"{exc}{hint}", param=param) from None
        return tuple(dict.fromkeys(parsed))
    return callback


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{text!r} is not a positive integer")
    return int(text)


_parse_seqlens = _parsed_items(bench.parse_seqlen, "; sequence lengths are positive integers, e.g. 512,1k,2k")
_parse_positive_ints = _parsed_items(_positive_int)
_parse_heads = _parsed_items(bench_decode.parse_heads)


def _parse_head_dims(ctx, param, values):
    supported = ", ".join(map(str, configs.SUPPORTED_HEAD_DIMS))
    dims = []
    for item in _nonempty(_items(values), param):
        if not item.isdigit() or int(item) not in configs.SUPPORTED_HEAD_DIMS:
            raise click.BadParameter(f"head dim {item!r} is not supported; choose from {supported}", param=param)
        dims.append(int(item))
    return tuple(dict.fromkeys(dims))


def _choices(allowed):
    """Callback for a comma list whose items must come from `allowed`."""
    def parse(ctx, param, values):
        items = _nonempty(_items(values), param)
        for item in items:
            if item not in allowed:
                raise click.BadParameter(f"{item!r} is not one of {', '.join(allowed)}", param=param)
        return tuple(dict.fromkeys(items))
    return parse


def _parse_peers(ctx, param, values):
    peers = _choices(bench.PEERS + ("none",))(ctx, param, values)
    if "none" in peers:
        if len(peers) > 1:
            raise click.BadParameter("'none' cannot be combined with other peers", param=param)
        return ()
    return peers



_OFF_ON = {"off": (False,), "on": (True,), "both": (False, True)}  # --causal, --deterministic


# ----------------------------------------------------------------------------------------------
# GPU presence
# ----------------------------------------------------------------------------------------------


def _in_existing_folder(ctx, param, value):
    """An output file's folder must exist: found out now, not after a sweep of minutes."""
    if value is not None and not os.path.isdir(os.path.dirname(os.path.abspath(value))):
        raise click.BadParameter(f"the folder of {value!r} does not exist", ctx=ctx, param=param)
    return value


def _require_gpu(ctx):
    """DeviceInfo of the current device, or one line on stderr saying what is missing and exit
    status NO_GPU_EXIT."""
    try:
        if device.gpu_available():
            return device.device_info()
        reason = device.no_gpu_reason() or "no usable CUDA GPU (CuPy counts none)"
    except device.NoGPUError as exc:
        reason = str(exc)
    except Exception as exc:  # CuPy's CUDA runtime and driver errors
        reason = f"no usable CUDA GPU: {type(exc).__name__}: {exc}"
    click.echo(f"flashcupy: {' '.join(reason.split())}", err=True)
    ctx.exit(NO_GPU_EXIT)


def _capability(info) -> str:
    return f"{info.capability // 10}.{info.capability % 10}"


# ----------------------------------------------------------------------------------------------
# The kernel variants this device can use
# ----------------------------------------------------------------------------------------------

# `compile --causal`: off builds the unmasked kernels, on the masked ones (causal and local).
_MASKS_FOR_CAUSAL = {"off": ("none",), "on": ("causal", "local"), "both": configs.MASKS}
# The masking each variant is checked with: the local kernels with a two-sided top-left window, for
# CHECK_LONG_ROWS a bottom-right one over more than a thousand keys (a top-left band would give the
# long rows' first queries a few keys only).
_MASK_CASES = {"none": {}, "causal": {"causal": True},
               "local": {"window_size": (48, 16), "alignment": "top_left"}}
_LONG_MASK_CASES = {**_MASK_CASES, "local": {"window_size": (1400, 16)}}


class _CaseKind(NamedTuple):
    """A forward variant's case, which the backward's check runs."""
    head_dim: int
    dtype: str
    mask: str
    score_mod: bool


def family_variants(direction, capability, smem_optin=None, **choice) -> list:
    """(family, variant) pairs of every family of `direction` that runs on this capability, in
    dispatch order. With the device's opt-in shared memory the tiles are the ones the API takes
    there; without it, those of the capability's nominal limit."""
    return [(family, v) for family in registry.families(direction) if family.runs_on(capability)
            for v in family.variants(capability, smem_optin, **choice)]


def fwd_variants(capability, smem_optin=None, **choice) -> list:
    """Forward variants the dispatcher can pick; `choice`: head_dims, dtypes, masks, score_mods."""
    return [v for _, v in family_variants("fwd", capability, smem_optin, **choice)]


def bwd_variants(capability, smem_optin=None, **choice) -> list:
    """Backward kernels the dispatcher can pick (each family's main kernels, then its helpers)."""
    return [v for _, v in family_variants("bwd", capability, smem_optin, **choice)]


def kvcache_variants(capability, smem_optin=None, head_dims=kvcache.HEAD_DIMS, dtypes=("float16", "bfloat16"),
                     masks=configs.MASKS, score_mods=(False, True), **_) -> list:
    """flash_attn_with_kvcache's kernels that run on this capability (Hopper's tiles on sm90 alone)
    within the opt-in shared memory (None: no limit); `choice` as fwd_variants (deterministic
    does not apply)."""
    if capability < 80:
        return []
    variants = kvcache.variants(head_dims=head_dims, dtypes=dtypes, masks=masks, score_mods=score_mods)
    return [v for v in variants if (capability == 90 or not kvcache.hopper_only(v))
            and (smem_optin is None or v.smem_bytes <= smem_optin)]


# The option sets `flashcupy info` shows the dispatch of, by head dim.
# (case, options, queries per sequence), over 4096 keys
_DISPATCH_CASES = (("plain", {}, 4096), ("causal", {"causal": True}, 4096),
                   ("window", {"window_size": (256, 0)}, 4096), ("softcap", {"softcap": 30.0}, 4096),
                   ("1 query", {}, 1))


def dispatch_table(info, dtype="bfloat16") -> list:
    """Rows (head dim, {case: "fwd family / bwd family"}) for this device; a case no family serves says
    why."""
    rows = []
    for head_dim in configs.SUPPORTED_HEAD_DIMS:
        cells = {}
        for case, options, seqlen_q in _DISPATCH_CASES:
            problem = Problem.sketch(head_dim, dtype, AttentionOptions(**options), seqlen_q, seqlen_k=4096)
            names = []
            for direction in ("fwd", "bwd"):
                try:
                    names.append(registry.select(direction, problem, info).name)
                except ValueError as exc:
                    names.append(f"none ({exc})")
            cells[case] = " / ".join(names)
        rows.append((head_dim, cells))
    return rows


def _cached_names(info) -> set[str]:
    """Name expressions the index says CuPy's disk cache holds for this device's arch."""
    return {e["name_expression"] for e in build.cached_variants(build.device_arch(info.capability))}


def _record_process_kernels(info) -> None:
    """Add the kernels this process compiled on the device to the cache index."""
    arch = build.device_arch(info.capability)
    for device_id, variant in build.compiled_variants():
        if device_id == info.id:
            build.record_compiled(variant, arch)


# ----------------------------------------------------------------------------------------------
# Commands
# ----------------------------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_STATUSES)
@click.version_option(flashcupy.__version__, prog_name="flashcupy")
def main():
    """flashcupy: exact attention for CuPy arrays (FlashAttention-2, FlashAttention-3-style Hopper
    kernels, KV-cache decoding), compiled at run time by NVRTC."""


@main.command("bench")
@click.option("--seqlens", multiple=True, default=("512,1k,2k,4k,8k,16k",), show_default=True,
              callback=_parse_seqlens, help="Sequence lengths, comma list; 1k = 1024.")
@click.option("--head-dims", multiple=True, default=("64,128",), show_default=True, callback=_parse_head_dims,
              help="Head dims, comma list; nheads = hidden // head dim.")
@click.option("--causal", type=click.Choice(sorted(_OFF_ON)), default="both", show_default=True,
              help="Causal mask off, on, or both (of the plain variant).")
@click.option("--variants", multiple=True, default=(",".join(bench.VARIANTS),), show_default=True,
              callback=_choices(bench.VARIANTS),
              help=f"plain (the --causal cases), gqa (causal, nheads / {bench.GQA_GROUP} kv heads), window "
                   f"(causal sliding window of {bench.DEFAULT_WINDOW} keys); comma list.")
@click.option("--dtype", "dtypes", multiple=True, default=("bf16",), show_default=True,
              callback=_choices(tuple(bench.DTYPES)), help="bf16 and/or fp16; repeat or comma list.")
@click.option("--mode", "modes", multiple=True, default=(",".join(bench.DEFAULT_MODES),), show_default=True,
              callback=_choices(bench.MODES), help="fwd, bwd, fwdbwd; comma list.")
@click.option("--total-tokens", type=click.IntRange(min=1), default=bench.DEFAULT_TOTAL_TOKENS,
              show_default=True, help="batch = total tokens // seqlen (at least 1).")
@click.option("--hidden", type=click.IntRange(min=1), default=bench.DEFAULT_HIDDEN, show_default=True,
              help="Model width; a multiple of every head dim.")
@click.option("--peers", multiple=True, default=(",".join(bench.DEFAULT_PEERS),), show_default=True,
              callback=_parse_peers, help=f"Peers, comma list from {', '.join(bench.PEERS)}, or none.")
@click.option("--repeats", type=click.IntRange(min=1), default=bench.DEFAULT_REPEATS, show_default=True,
              help="Timed calls per case; the median is reported.")
@click.option("--warmup", type=click.IntRange(min=0), default=bench.DEFAULT_WARMUP, show_default=True,
              help="Untimed calls after the first one.")
@click.option("--settle", type=click.FloatRange(min=0), default=bench.DEFAULT_SETTLE, show_default=True,
              help="Seconds of untimed calls before each implementation's timed ones. A power-capped GPU "
                   "(H100, H200 at 700 W) reaches its steady clock after 1-2 s of load: --settle 2 times that "
                   "steady state.")
@click.option("--rounds", type=click.IntRange(min=1), default=bench.DEFAULT_ROUNDS, show_default=True,
              help="Time each case this many times, the implementations' order turning each round; each "
                   "keeps its median round (steadier same-run comparisons).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), callback=_in_existing_folder,
              help="Write the results as JSON here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), callback=_in_existing_folder,
              help="Draw TFLOP/s vs seqlen to this image (e.g. bench.png); needs matplotlib.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no table (use with --json).")
@click.option("--decode", is_flag=True,
              help="The decode sweep instead: one query token per sequence over a full KV cache "
                   "(flash_attn_with_kvcache, contiguous and paged) against SDPA flash and cuDNN, GPU time warm, "
                   "with L2 flushed and replayed from a CUDA graph, K/V bytes over time against the HBM peak. "
                   "Takes --head-dims (default 128), --dtype, --peers, --repeats, --warmup, --json and the options marked --decode.")
@click.option("--batches", multiple=True, show_default=True,
              default=(",".join(map(str, bench_decode.DEFAULT_BATCHES)),), callback=_parse_positive_ints,
              help="--decode: batch sizes, comma list.")
@click.option("--kv-lens", multiple=True, show_default=True,
              default=(",".join(map(bench.format_seqlen, bench_decode.DEFAULT_KV_LENS)),), callback=_parse_seqlens,
              help="--decode: keys per sequence (the cache is full), comma list.")
@click.option("--heads", multiple=True, show_default=True,
              default=(",".join(f"{h}/{k}" for h, k in bench_decode.DEFAULT_HEADS),), callback=_parse_heads,
              help="--decode: query heads / kv heads, comma list.")
@click.option("--layouts", multiple=True, default=(",".join(bench_decode.LAYOUTS),), show_default=True,
              callback=_choices(bench_decode.LAYOUTS), help="--decode: flashcupy's cache layouts, comma list.")
@click.option("--page-size", type=click.IntRange(min=1), default=bench_decode.DEFAULT_PAGE_SIZE, show_default=True,
              help="--decode: rows per page of the paged layout.")
@click.option("--hbm-peak", type=click.FloatRange(min=0, min_open=True),
              help="--decode: the HBM peak in TB/s [default: memory clock x bus width x 2 from the device].")
@click.pass_context
def bench_command(ctx, seqlens, head_dims, causal, variants, dtypes, modes, total_tokens, hidden, peers, repeats,
                  warmup, settle, rounds, json_path, plot_path, quiet, decode, batches, kv_lens, heads, layouts,
                  page_size, hbm_peak):
    """Time flashcupy against its peers over the FA2 paper's sweep (or, with --decode, a decode sweep)."""
    given = {name for name in ctx.params
             if ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT, None)}
    forward_only = {"seqlens", "causal", "variants", "modes", "total_tokens", "hidden", "plot_path", "rounds",
                    "settle"}
    decode_only = {"batches", "kv_lens", "heads", "layouts", "page_size", "hbm_peak"}
    wrong = sorted(given & (forward_only if decode else decode_only))
    if wrong:
        flag = {p.name: p.opts[0] for p in ctx.command.params}
        flags = ", ".join(flag[n] for n in wrong)
        raise click.UsageError(f"{flags} {'do' if len(wrong) > 1 else 'does'} not apply "
                               f"{'to --decode' if decode else 'without --decode'}", ctx=ctx)
    if decode:
        _bench_decode(ctx, head_dims if "head_dims" in given else (bench_decode.DEFAULT_HEAD_DIM,), dtypes,
                      peers if "peers" in given else bench_decode.PEERS, repeats, warmup, json_path, quiet, batches,
                      kv_lens, heads, layouts, page_size, hbm_peak)
        return
    try:
        bench.check_hidden(hidden, head_dims, variants)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param_hint="'--hidden'") from None
    info = _require_gpu(ctx)
    if plot_path:  # fail now rather than after the sweep
        try:
            bench.require_matplotlib()
        except bench.MissingDependencyError as exc:
            raise click.ClickException(str(exc)) from None

    torch_peers = [p for p in peers if p in bench.TORCH_PEERS]
    if torch_peers:
        reason = bench.torch_unavailable_reason()
        if reason:
            click.echo(f"flashcupy: torch peers skipped ({', '.join(torch_peers)}): {reason}", err=True)
            peers = tuple(p for p in peers if p not in bench.TORCH_PEERS)
    impls = ("flashcupy",) + peers

    shapes = bench.sweep_shapes(seqlens, head_dims, _OFF_ON[causal], dtypes, modes, total_tokens, hidden, variants)
    metadata = bench.collect_metadata()
    if not quiet:
        click.echo(f"{metadata['device']} (sm {metadata['compute_capability']}), CUDA driver "
                   f"{metadata['cuda_driver_version']}, CuPy {metadata['cupy_version']}, NVRTC "
                   f"{metadata['nvrtc_version']}, torch {metadata['torch_version'] or '-'}, "
                   f"commit {metadata['git_commit'] or '-'}")
    records = []
    if quiet:
        interrupted = _until_interrupted(lambda: bench.run_sweep(shapes, impls, repeats, warmup, records, rounds,
                                                                                settle))
    else:
        with click.progressbar(shapes, label="bench", file=sys.stderr,
                               item_show_func=lambda s: str(s) if s else None) as bar:
            interrupted = _until_interrupted(lambda: bench.run_sweep(bar, impls, repeats, warmup, records, rounds,
                                                                                    settle))
        click.echo(bench.format_table(records))
    _record_process_kernels(info)

    config = {"seqlens": list(seqlens), "head_dims": list(head_dims), "causal": list(_OFF_ON[causal]),
              "variants": list(variants), "window": bench.DEFAULT_WINDOW, "gqa_group": bench.GQA_GROUP,
              "dtypes": list(dtypes), "modes": list(modes), "total_tokens": total_tokens, "hidden": hidden,
              "impls": list(impls), "repeats": repeats, "warmup": warmup, "settle": settle, "rounds": rounds,
              "interrupted": interrupted}
    document = bench.results_document(records, metadata, config)
    if json_path:
        bench.write_json(document, json_path)
        if not quiet:
            click.echo(f"wrote {json_path}", err=True)
    if plot_path and records:
        bench.plot_results(document, plot_path)
        if not quiet:
            click.echo(f"wrote {plot_path}", err=True)
    _exit_if_interrupted(ctx, interrupted, quiet, json_path)


def _until_interrupted(sweep) -> bool:
    """Run a sweep that adds each finished case to its records; True if Ctrl-C stopped it (the
    finished cases stay in the records, for the table and the JSON)."""
    try:
        sweep()
    except KeyboardInterrupt:
        return True
    return False


def _exit_if_interrupted(ctx, interrupted: bool, quiet: bool, json_path) -> None:
    if interrupted:
        kept = [where for where, on in (("in the table above", not quiet), (f"in {json_path}", json_path)) if on]
        click.echo("flashcupy: bench interrupted" + (f"; the cases finished before it are {' and '.join(kept)}"
                                                     if kept else ""), err=True)
        ctx.exit(INTERRUPTED_EXIT)


def _bench_decode(ctx, head_dims, dtypes, peers, repeats, warmup, json_path, quiet, batches, kv_lens, heads, layouts,
                  page_size, hbm_peak):
    """`flashcupy bench --decode`."""
    for p in peers:
        if p not in bench_decode.PEERS:
            raise click.BadParameter(f"{p!r} is not a decode peer; choose from {', '.join(bench_decode.PEERS)}",
                                     ctx=ctx, param_hint="'--peers'")
    if "paged" in layouts and all(n % page_size for n in kv_lens):
        raise click.BadParameter(f"{page_size} divides none of the kv lengths, so no paged case would run",
                                 ctx=ctx, param_hint="'--page-size'")
    info = _require_gpu(ctx)
    if peers:
        reason = bench.torch_unavailable_reason()
        if reason:
            click.echo(f"flashcupy: torch peers skipped ({', '.join(peers)}): {reason}", err=True)
            peers = ()
    impls = ("flashcupy",) + tuple(peers)
    cases = bench_decode.sweep_cases(batches, kv_lens, heads, dtypes, head_dims)
    records = []
    metadata = bench.collect_metadata()
    clock = bench_decode.Clock()
    limits = clock.bandwidth_tbs()
    peak = hbm_peak or bench_decode.hbm_peak_tbs(info.id)
    limits.update(hbm_peak_tbs=peak, hbm_peak_source="--hbm-peak" if hbm_peak else
                  "memory clock x bus width x 2 from the device" if peak else None)
    if not quiet:
        click.echo(f"{metadata['device']} (sm {metadata['compute_capability']}), CUDA driver "
                   f"{metadata['cuda_driver_version']}, CuPy {metadata['cupy_version']}, NVRTC "
                   f"{metadata['nvrtc_version']}, commit {metadata['git_commit'] or '-'}")
        with click.progressbar(cases, label="bench --decode", file=sys.stderr,
                               item_show_func=lambda c: str(c) if c else None) as bar:
            interrupted = _until_interrupted(lambda: bench_decode.run_sweep(bar, impls, layouts, page_size, repeats,
                                                                            peak, clock, warmup, records))
        click.echo(bench_decode.format_table(records, limits))
    else:
        interrupted = _until_interrupted(lambda: bench_decode.run_sweep(cases, impls, layouts, page_size, repeats,
                                                                        peak, clock, warmup, records))
    metadata["torch_version"] = getattr(sys.modules.get("torch"), "__version__", None)
    _record_process_kernels(info)
    config = {"sweep": "decode", "batches": list(batches), "kv_lens": list(kv_lens),
              "heads": [list(h) for h in heads], "head_dims": list(head_dims), "dtypes": list(dtypes),
              "layouts": list(layouts), "page_size": page_size, "impls": list(impls), "repeats": repeats,
              "warmup": warmup, "spin_us": bench_decode.SPIN_US, "flush_bytes": bench_decode.FLUSH_BYTES,
              "graph_work_us": bench_decode.GRAPH_WORK_US, "graph_max_steps": bench_decode.GRAPH_MAX_STEPS, **limits,
              "interrupted": interrupted}
    if json_path:
        bench.write_json(bench.results_document(records, metadata, config, bench_decode.FIELDS), json_path)
        if not quiet:
            click.echo(f"wrote {json_path}", err=True)
    _exit_if_interrupted(ctx, interrupted, quiet, json_path)


@main.command("info")
@click.option("--verbose", "-v", is_flag=True, help="List the backward kernels too, not only the forward ones.")
@click.pass_context
def info_command(ctx, verbose):
    """The GPU, the software stack, the kernel each head dim takes here, and which are compiled on disk."""
    info = _require_gpu(ctx)
    versions = bench.software_versions()
    cache = build.cache_dir()
    files = f"{sum(1 for _ in cache.iterdir())} files" if cache.is_dir() else "empty"
    if not build.disk_cache_enabled():
        files += "; CUPY_CACHE_IN_MEMORY=1, so nothing is written there"
    rows = [
        ("GPU", f"{info.name} (device {info.id})"),
        ("compute capability", _capability(info)),
        ("SMs", info.sm_count),
        ("shared memory/block", f"{info.smem_per_block_optin // 1024} KiB (opt-in)"),
        ("device memory", bench.format_bytes(info.total_memory)),
        ("CUDA driver", versions["cuda_driver"]),
        ("CUDA runtime (CuPy)", versions["cuda_runtime"]),
        ("CuPy", versions["cupy"]),
        ("NVRTC", versions["nvrtc"]),
        ("flashcupy", flashcupy.__version__),
        ("kernel cache", f"{cache} ({files})"),
    ]
    for key, value in rows:
        click.echo(f"{key + ':':<22}{value if value is not None else 'unknown'}")
    click.echo("kernel families (dispatch order; backend= or FLASHCUPY_BACKEND forces one by name):")
    for family in registry.families():
        here = "" if family.runs_on(info.capability) else "  [not on this GPU]"
        click.echo(f"  {family.direction} {family.name:<8}{family.summary}{here}")
    click.echo("family per head dim (bf16, 4096 keys, fwd / bwd): " + ", ".join(case for case, *_ in _DISPATCH_CASES))
    for head_dim, cells in dispatch_table(info):
        click.echo(f"  d={head_dim:<4}" + "  ".join(f"{case}: {cell}" for case, cell in cells.items()))

    try:
        forward = fwd_variants(info.capability, info.smem_per_block_optin)
        backward = bwd_variants(info.capability, info.smem_per_block_optin)
    except ValueError as exc:  # e.g. a GPU older than sm_80
        click.echo(f"kernels: none: {exc}")
        forward = backward = []
    kv = kvcache_variants(info.capability, info.smem_per_block_optin)
    cached = _cached_names(info)
    counts = [sum(v.name_expression in cached for v in vs) for vs in (forward, backward, kv)]
    distinct = list(dict.fromkeys(forward + backward + kv))  # the decode forward's kernels are kv-cache ones
    total, on_disk = len(distinct), sum(v.name_expression in cached for v in distinct)
    click.echo(f"{'compiled on disk:':<22}{on_disk} of {total} flashcupy kernels this GPU can use (fwd "
               f"{counts[0]} of {len(forward)}, bwd {counts[1]} of {len(backward)}, kvcache {counts[2]} of {len(kv)})"
               + ("; `flashcupy compile` builds the rest" if on_disk < total else ""))

    def listing(title, variants):
        if variants:
            click.echo(title)
        for variant in variants:
            click.echo(f"  {variant}" + ("  [on disk]" if variant.name_expression in cached else ""))

    listing("forward kernels the dispatcher picks here:", forward)
    if verbose:
        listing("backward kernels the dispatcher picks here:", backward)
    compiled = build.compiled_variants()
    click.echo("compiled in this process: " + (", ".join(f"{v} (device {d})" for d, v in compiled)
                                               if compiled else "none"))


def _default_jobs() -> int:
    return min(os.cpu_count() or 1, 8)


@main.command("compile")
@click.option("--head-dims", multiple=True, default=(",".join(map(str, configs.SUPPORTED_HEAD_DIMS)),),
              show_default=True, callback=_parse_head_dims, help="Head dims, comma list.")
@click.option("--dtype", "dtypes", multiple=True, default=(",".join(bench.DTYPES),), show_default=True,
              callback=_choices(tuple(bench.DTYPES)), help="bf16 and/or fp16; repeat or comma list.")
@click.option("--direction", type=click.Choice(["fwd", "bwd", "kvcache", "all"]), default="all", show_default=True,
              help="Forward kernels, backward kernels, flash_attn_with_kvcache's kernels, or all three.")
@click.option("--causal", type=click.Choice(sorted(_OFF_ON)), default="both", show_default=True,
              help="Masked variants (causal and local) off, on, or both.")
@click.option("--deterministic", type=click.Choice(sorted(_OFF_ON)), default="both", show_default=True,
              help="Backward: variants with deterministic dQ off, on, or both.")
@click.option("--score-mod", type=click.Choice(sorted(_OFF_ON)), default="both", show_default=True,
              help="Variants with softcap / ALiBi off, on, or both.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=_default_jobs, show_default="min(CPUs, 8)",
              help="Compiler processes run in parallel.")
@click.option("--arch", type=click.Choice(OFFLINE_ARCHS),
              help="Compile for this architecture without a GPU (a build check: nothing is cached).")
@click.pass_context
def compile_command(ctx, head_dims, dtypes, direction, causal, deterministic, score_mod, jobs, arch):
    """Compile kernel variants ahead of time into CuPy's on-disk cache.

    Without options: every variant this GPU can use. Afterwards the first call of a variant in a
    new process loads it from disk in milliseconds instead of compiling it (about a second each).
    With --arch: every variant the families build for that architecture, compiled with NVRTC on
    this machine, GPU or not, to check the kernels and the toolchain. Exit status 1 when a variant
    fails to compile.
    """
    if direction in ("fwd", "kvcache") and ctx.get_parameter_source("deterministic") not in (
            click.core.ParameterSource.DEFAULT, None):
        raise click.UsageError(f"--deterministic applies to the backward kernels, not --direction {direction}", ctx=ctx)
    names = tuple(bench.DTYPES[d] for d in dtypes)
    choice = {"head_dims": head_dims, "dtypes": names, "masks": _MASKS_FOR_CAUSAL[causal],
              "score_mods": _OFF_ON[score_mod], "deterministic": _OFF_ON[deterministic]}
    directions = ("fwd", "bwd", "kvcache") if direction == "all" else (direction,)
    if arch is not None:
        capability = configs.arch_capability(arch)
        variants = [v for d in directions if d != "kvcache" for family, v in family_variants(d, capability, **choice)
                    if arch in family.archs]
        variants += kvcache_variants(capability, **choice) if "kvcache" in directions else []
        variants = list(dict.fromkeys(variants))  # the decode forward's kernels are kv-cache ones
        if not variants:
            raise click.ClickException(f"no kernel family builds for {arch}")
        _compile_and_report(ctx, variants, jobs, f"{arch} (offline, nothing cached)", arch=arch)
        return
    info = _require_gpu(ctx)
    if not build.disk_cache_enabled():
        raise click.ClickException("CUPY_CACHE_IN_MEMORY=1 keeps compiled kernels off the disk; unset it "
                                   "to compile ahead of time")
    # The variants are chosen here, from this device's opt-in shared memory, and handed to the
    # workers as they are: every worker builds exactly what flash_attn_func will ask for.
    pick = {"fwd": fwd_variants, "bwd": bwd_variants, "kvcache": kvcache_variants}
    variants = list(dict.fromkeys(v for d in directions
                                  for v in pick[d](info.capability, info.smem_per_block_optin, **choice)))
    if not variants:
        raise click.ClickException(f"no kernel family runs on {info.name} (sm {_capability(info)}); flashcupy "
                                   "needs 8.0 or newer (Ampere, Ada, Hopper)")
    cached = _cached_names(info)
    _compile_and_report(ctx, variants, jobs, f"{info.name} (sm {_capability(info)})", info=info,
                        note=f"{sum(v.name_expression in cached for v in variants)} already compiled on disk, ",
                        cache_note=f", cache {build.cache_dir()}")


def _compile_and_report(ctx, variants, jobs, header, info=None, arch=None, note="", cache_note=""):
    """Compile in worker processes, for the GPU `info` (into CuPy's disk cache, recorded in the index)
    or offline for `arch`; print a line per kernel and exit 1 if any failed."""
    jobs = min(jobs, len(variants))
    click.echo(f"{header}: {len(variants)} kernels, {note}{jobs} processes{cache_note}")
    results = {}
    start = time.perf_counter()
    with click.progressbar(length=len(variants), label="compile", file=sys.stderr,
                           item_show_func=lambda v: str(v) if v else None) as bar:
        jobs_iter = (build.compile_in_processes(variants, jobs, arch=arch) if info is None else
                     build.compile_in_processes(variants, jobs, info.id))
        for variant, seconds, error in jobs_iter:
            results[variant] = (seconds, error)
            if error is None and info is not None:
                build.record_compiled(variant, build.device_arch(info.capability), seconds)
            bar.update(1, variant)
    wall = time.perf_counter() - start

    width = max(len(str(v)) for v in variants)
    click.echo(f"{'kernel':<{width}} {'seconds':>8}  result")
    failures = []
    for variant in variants:
        seconds, error = results[variant]
        if error is None:
            click.echo(f"{str(variant):<{width}} {seconds:>8.2f}  ok")
        else:
            failures.append((variant, error))
            click.echo(f"{str(variant):<{width}} {'-':>8}  FAIL[{len(failures)}]")
    for n, (variant, error) in enumerate(failures, 1):
        click.echo(f"[{n}] {variant}: {error}", err=True)
    busy = sum(seconds for seconds, error in results.values() if error is None)
    click.echo(f"compile: {len(variants) - len(failures)} of {len(variants)} kernels in {wall:.1f} s "
               f"({busy:.1f} s of compiling in {jobs} processes)" + (f", {len(failures)} FAIL" if failures else ""))
    if failures:
        ctx.exit(1)


@main.command("check")
@click.option("--head-dims", multiple=True, default=(",".join(map(str, configs.SUPPORTED_HEAD_DIMS)),),
              show_default=True, callback=_parse_head_dims, help="Head dims to check, comma list.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@click.pass_context
def check_command(ctx, head_dims, seed):
    """Check every forward kernel variant the dispatcher can pick here against the float64
    reference, each kernel family forced in turn (backend=) and each kernel on lengths for which
    its family launches it (a kernel that none of the lengths selects fails), and each backward
    family on the same cases (dQ by atomics, as many kv heads as query heads; the deterministic and
    GQA kernels and flash_attn_with_kvcache's own paths are the GPU test suite's). The decode
    forward's lines name its kernel before the call's plan picks a cluster of splits; its few query
    rows over CHECK_FEW_QUERIES's keys run a cluster's merge and the split count's.

    Pass: ||out - ref|| / ||ref|| under 2e-2 (bf16) or 5e-3 (fp16) forward, 5e-2 (bf16) or 1e-2
    (fp16) for the worst gradient, LSE within 2e-3, and no NaN or inf where the reference is
    finite. Exit status 1 on any failure.
    """
    info = _require_gpu(ctx)
    try:
        forward = family_variants("fwd", info.capability, info.smem_per_block_optin, head_dims=head_dims)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    # each forward variant on the lengths for which its family picks it; each backward family on the
    # forward variants' cases (head dim, dtype, mask, score mods) that it serves, once each
    cases = [(family, variant, "fwd", _lengths_picking(family, variant, info)) for family, variant in forward]
    kinds = list(dict.fromkeys(_case_kind(variant) for _, variant in forward))
    cases += [(family, variant, "bwd", _short_lengths(variant)) for family in registry.families("bwd")
              if family.runs_on(info.capability) for variant in kinds if _serves(family, variant, info)]
    rng = np.random.default_rng(seed)

    click.echo(f"{info.name} (sm {_capability(info)}), batch {CHECK_BATCH}, {CHECK_NHEADS} heads")
    click.echo(f"{'case':<72} {'q x k':>9} {'rel err':>9} {'max abs':>9} {'lse err':>9}  result")
    failures = total = 0
    for family, variant, direction, lengths in cases:
        run_case = _check_forward if direction == "fwd" else _check_backward
        name = (f"{family.name} {variant}" if direction == "fwd" else
                f"{family.name} bwd d={variant.head_dim} {variant.dtype} mask={variant.mask}"
                f"{'+score_mod' if variant.score_mod else ''}")
        if not lengths:  # a kernel the dispatcher can pick that none of the check's problems reaches
            total += 1
            failures += 1
            click.echo(f"{name:<72} {'-':>9} none of the check's lengths selects this kernel  FAIL")
        for seqlen_q, seqlen_k, mask_options in lengths:
            total += 1
            try:
                rel, max_abs, lse_err, ok = run_case(variant, seqlen_q, seqlen_k, mask_options, rng, family.name)
                cells = f"{rel:>9.2e} {max_abs:>9.2e} {lse_err:>9}"
            except Exception as exc:  # a failed compile or launch is a failed case, not the end
                ok, cells = False, f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"
            failures += not ok
            click.echo(f"{name:<72} {f'{seqlen_q}x{seqlen_k}':>9} {cells}  {'PASS' if ok else 'FAIL'}")
    _record_process_kernels(info)
    click.echo(f"check: {total - failures} of {total} cases pass" + (f", {failures} FAIL" if failures else ""))
    if failures:
        ctx.exit(1)


def _random_inputs(rng, variant, seqlen_q, seqlen_k, count_q):
    """Host arrays rounded to the variant's dtype: count_q of shape q, then k and v."""
    dtype = bench.numpy_dtype(variant.dtype)
    shape_q = (CHECK_BATCH, seqlen_q, CHECK_NHEADS, variant.head_dim)
    shape_k = (CHECK_BATCH, seqlen_k, CHECK_NHEADS, variant.head_dim)
    shapes = [shape_q] * count_q + [shape_k, shape_k]
    return [rng.standard_normal(s, dtype=np.float32).astype(dtype) for s in shapes]


def _rel_err(x, ref) -> tuple[float, float]:
    """(Frobenius relative error, max abs error) over the entries where ref is finite."""
    finite = np.isfinite(ref)
    diff = x[finite] - ref[finite]
    norm = np.linalg.norm(ref[finite])
    return float(np.linalg.norm(diff) / max(norm, 1e-30)), float(np.abs(diff).max(initial=0.0))


def _finite_where(x, ref) -> bool:
    return bool(np.isfinite(x)[np.isfinite(ref)].all())


def _scalar_options(variant, mask_options: dict) -> dict:
    """A variant's case as options without arrays: its mask case, and the softcap of the score-mod
    kernels (which are also checked with ALiBi slopes: _case_options)."""
    return {**mask_options, "softcap": CHECK_SOFTCAP} if variant.score_mod else dict(mask_options)


def _case_options(variant, mask_options: dict) -> tuple[dict, dict]:
    """Keyword options a variant is checked with, for flashcupy and for the reference: its mask
    case, and for the score-mod kernels a softcap with ALiBi slopes on top."""
    import cupy

    options = _scalar_options(variant, mask_options)
    if not variant.score_mod:
        return options, options
    slopes = np.linspace(0.05, 0.2, CHECK_NHEADS).astype(np.float32)
    return {**options, "alibi_slopes": cupy.asarray(slopes)}, {**options, "alibi_slopes": slopes.astype(np.float64)}


def _case_problem(variant, mask_options: dict, seqlen_q: int = 4096, seqlen_k: int | None = None) -> Problem:
    """The check's problem for a variant's case (the softcap stands for both score mods)."""
    options = _scalar_options(variant, mask_options)
    return Problem.sketch(variant.head_dim, variant.dtype, AttentionOptions(**options), seqlen_q, CHECK_NHEADS,
                          batch=CHECK_BATCH, seqlen_k=seqlen_k)


def _serves(family, variant, info) -> bool:
    """Does `family` serve the check's problem of this forward variant's case on this device?"""
    return family.unsupported(_case_problem(variant, _MASK_CASES[variant.mask]), info) is None


def _short_lengths(variant) -> list:
    return [(seqlen_q, seqlen_k, _MASK_CASES[variant.mask]) for seqlen_q, seqlen_k in CHECK_SEQLENS]


def _lengths_picking(family, variant, info) -> list:
    """(seqlen_q, seqlen_k, mask options) of the check for which `family` launches `variant`: the
    short lengths, else the long rows (kernels picked for rows that see many keys), else a few
    query rows; [] if none."""
    for lengths in (_short_lengths(variant),
                    [(seqlen_q, seqlen_k, _LONG_MASK_CASES[variant.mask]) for seqlen_q, seqlen_k in CHECK_LONG_ROWS],
                    [(seqlen_q, seqlen_k, _MASK_CASES[variant.mask]) for seqlen_q, seqlen_k in CHECK_FEW_QUERIES]):
        picked = [case for case in lengths if family.variant(_case_problem(variant, case[2], *case[:2]), info) == variant]
        if picked:
            return picked
    return []


def _case_kind(variant) -> _CaseKind:
    """What the backward's check of a forward variant's case depends on."""
    return _CaseKind(variant.head_dim, variant.dtype, variant.mask, variant.score_mod)


def _check_forward(variant, seqlen_q, seqlen_k, mask_options, rng, backend):
    import cupy

    from flashcupy.reference import attention_ref

    q, k, v = _random_inputs(rng, variant, seqlen_q, seqlen_k, 1)
    options, host_options = _case_options(variant, mask_options)
    out, lse = flashcupy.flash_attn_func(*(cupy.asarray(a) for a in (q, k, v)), return_lse=True, backend=backend,
                                         **options)
    out = cupy.asnumpy(out).astype(np.float64)
    lse = cupy.asnumpy(lse).astype(np.float64)
    ref_out, ref_lse = attention_ref(*(a.astype(np.float64) for a in (q, k, v)), **host_options)
    rel, max_abs = _rel_err(out, ref_out)
    # rows that see no key: the reference says LSE -inf, and so must the kernel
    empty_rows_agree = np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    _, lse_err = _rel_err(lse, ref_lse)
    ok = (rel < FWD_TOL[variant.dtype] and lse_err < LSE_TOL and empty_rows_agree
          and _finite_where(out, ref_out) and _finite_where(lse, ref_lse))
    return rel, max_abs, f"{lse_err:.2e}", ok


def _check_backward(variant, seqlen_q, seqlen_k, mask_options, rng, backend):
    """Worst of dq, dk, dv against reference.attention_bwd_ref."""
    import cupy

    from flashcupy.reference import attention_bwd_ref

    q, dout, k, v = _random_inputs(rng, variant, seqlen_q, seqlen_k, 2)
    q_d, k_d, v_d, dout_d = (cupy.asarray(a) for a in (q, k, v, dout))
    options, host_options = _case_options(variant, mask_options)
    out, lse = flashcupy.flash_attn_func(q_d, k_d, v_d, return_lse=True, **options)
    grads = flashcupy.flash_attn_backward(dout_d, q_d, k_d, v_d, out, lse, backend=backend, **options)
    refs = attention_bwd_ref(*(a.astype(np.float64) for a in (dout, q, k, v)), **host_options)
    rel = max_abs = 0.0
    ok = True
    for grad, ref in zip(grads, refs):
        grad = cupy.asnumpy(grad).astype(np.float64)
        r, m = _rel_err(grad, ref)
        rel, max_abs = max(rel, r), max(max_abs, m)
        ok = ok and _finite_where(grad, ref)
    return rel, max_abs, "-", ok and rel < BWD_TOL[variant.dtype]


if __name__ == "__main__":
    main()
