"""The kernel registry, what ds_report lists from it, and how sources reach the compiler.

Each op's own tests compile its source with nvcc (``tests/kernels/support.py``) and check its
reference against torch.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

from deepshard.kernels import REGISTRY
from deepshard.kernels.loader import source_text


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


def test_ds_report_lists_every_kernel():
    exe = str(Path(sys.executable).with_name("ds_report"))
    out = subprocess.run([exe, "--json"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode in (0, 1), out.stderr
    kernels = json.loads(out.stdout)["kernels"]
    assert [k["name"] for k in kernels] == [op.name for op in REGISTRY]
    assert all(k["source_present"] and k["status"] == "reference" and k["reason"]
               for k in kernels)
