"""A non-editable install carries the kernel sources, and the installed copy finds them."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_installed_package_loads_kernel_source(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, cwd=tmp_path)
    assert (target / "cuda_src" / "fwd.cu").is_file()
    probe = ("import flashcupy.build as b; src = b.load_source('fwd.cu'); "
             "print(b.source_dir()); assert 'flash_fwd_kernel' in src")
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True,
                            cwd=tmp_path, env=env)
    assert Path(result.stdout.strip()) == target / "cuda_src"
    assert (target / "cli.py").is_file()
