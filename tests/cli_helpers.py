"""Shared pieces of the CLI tests: a fake GPU description, the GPU-test decorator, the runner."""

from __future__ import annotations

from click.testing import CliRunner

from flashcupy import cli
from flashcupy.device import DeviceInfo
from gpu_helpers import requires_gpu

FAKE_GPU = DeviceInfo(id=0, name="Fake GPU", capability=90, sm_count=132, smem_per_block_optin=227 * 1024,
                      total_memory=80 * 2**30)


def on_gpu(test):
    """The project's GPU marker and skip ("needs a CUDA GPU") on one test."""
    for mark in requires_gpu:
        test = mark(test)
    return test


def invoke(*args):
    return CliRunner().invoke(cli.main, list(args))
