"""The kernel registry (what ds_report lists) and the compilation of every CUDA source.

Every .cu is compiled by nvcc to PTX for sm_80 and sm_90 with its templates instantiated
(``-DDEEPSHARD_INSTANTIATE``), so a kernel that does not compile fails here, on a machine
without a GPU. Numerical checks against the references are in each op's own tests.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepshard.kernels import REGISTRY
from deepshard.kernels.loader import source_text
from tests.helpers import require

ARCHS = ("sm_80", "sm_90")


def test_registry_is_torch_free_and_complete():
    code = ("import sys, deepshard.kernels as k; "
            "print(len(k.REGISTRY), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [str(len(REGISTRY)), "False"]
    assert len({op.name for op in REGISTRY}) == len(REGISTRY)
    for op in REGISTRY:
        assert op.path.is_file(), f"{op.name}: {op.path} missing"
        module = importlib.import_module(op.module)
        assert callable(getattr(module, "bench_cases", None)), f"{op.module}.bench_cases"


def test_status_without_a_gpu_names_the_reason(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for op in REGISTRY:
        status, why = op.status()
        assert status == "reference" and why, (op.name, status, why)


def test_sources_carry_a_line_directive():
    for op in REGISTRY:
        assert source_text(op.source).startswith(f'#line 1 "{op.path}"\n')


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", REGISTRY, ids=[op.name for op in REGISTRY])
def test_every_source_compiles(op, arch, tmp_path):
    nvcc = shutil.which("nvcc")
    require([] if nvcc else ["nvcc"], "CUDA compilation tests", "the CUDA toolkit")
    result = subprocess.run(
        [nvcc, "--ptx", f"-arch={arch}", "-std=c++17", "-DDEEPSHARD_INSTANTIATE",
         str(op.path), "-o", str(tmp_path / f"{op.name}.ptx")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    ptx = (tmp_path / f"{op.name}.ptx").read_text()
    assert ".entry" in ptx, "no kernel was instantiated"


def test_ds_report_lists_every_kernel():
    exe = str(Path(sys.executable).with_name("ds_report"))
    out = subprocess.run([exe, "--json"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode in (0, 1), out.stderr
    kernels = json.loads(out.stdout)["kernels"]
    assert [k["name"] for k in kernels] == [op.name for op in REGISTRY]
    assert all(k["source_present"] and k["status"] == "reference" and k["reason"]
               for k in kernels)
