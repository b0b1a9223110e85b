"""What every kernel test uses: nvcc to PTX, and the marker for tests that need a GPU."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from deepshard.kernels.registry import CUDA_DIR
from tests.helpers import require

ARCHS = ("sm_80", "sm_90")

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
    reason="needs a CUDA GPU and CuPy (pip install 'deepshard[cuda13]')")
"""For the kernel-vs-reference comparisons: they need a GPU and CuPy."""


def ptx_entries(source: str, arch: str, tmp_path: Path) -> set[str]:
    """Names of the kernels (``.entry``) nvcc emits for ``cuda/<source>`` on ``arch``.

    Compiled with ``-DDEEPSHARD_INSTANTIATE``, which each source uses to instantiate its
    templates explicitly (at run time CuPy does it through ``name_expressions``).
    """
    nvcc = shutil.which("nvcc")
    require([] if nvcc else ["nvcc"], "CUDA compile tests", "the CUDA toolkit")
    out = tmp_path / f"{Path(source).stem}.{arch}.ptx"
    proc = subprocess.run([nvcc, "--ptx", f"-arch={arch}", "-std=c++17",
                           "-DDEEPSHARD_INSTANTIATE", f"-I{CUDA_DIR}", str(CUDA_DIR / source),
                           "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return set(re.findall(r"\.entry\s+(\w+)", out.read_text()))
