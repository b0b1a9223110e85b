"""ds_report: data first, then rendered; the JSON form is a stable contract."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import get_type_hints

import pytest

from deepshard.launcher.report import collect as collect_mod
from deepshard.launcher.report.collect import (
    DeepshardInfo,
    DeviceInfo,
    KernelInfo,
    LauncherInfo,
    PythonInfo,
    Report,
    ToolInfo,
    TorchInfo,
)
from deepshard.launcher.report.preflight import HostCheck, judge
from deepshard.launcher.report.render import render_checks, render_report, to_json

SNAPSHOT = Path(__file__).parent / "snapshots" / "ds_report_schema.json"


def schema(cls) -> object:
    """Field names and nested dataclass fields of the report: what --json promises."""
    hints = get_type_hints(cls)
    out = {}
    for f in fields(cls):
        inner = [a for a in getattr(hints[f.name], "__args__", ()) if is_dataclass(a)]
        target = hints[f.name] if is_dataclass(hints[f.name]) else (inner[0] if inner else None)
        out[f.name] = schema(target) if target else str(hints[f.name])
    return out


def test_json_schema_is_stable():
    """A change here breaks scripts that read ds_report --json: bump SCHEMA_VERSION and
    regenerate with UPDATE_SNAPSHOTS=1."""
    import os

    current = json.dumps(schema(Report), indent=2, sort_keys=True) + "\n"
    if os.environ.get("UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(current)
    assert current == SNAPSHOT.read_text()
    assert collect_mod.SCHEMA_VERSION == 2


def synthetic() -> Report:
    return Report(
        schema_version=2,
        deepshard=DeepshardInfo("9.9", "/opt/ds", "abc123"),
        python=PythonInfo("3.11.7", "/usr/bin/python3", "Linux-x", 64),
        torch=TorchInfo("2.13.0+cu130", cuda="13.0", cudnn="91000", nccl="2.27.3",
                        backends=["gloo", "nccl"], cuda_available=True),
        devices=[DeviceInfo(0, "NVIDIA H200", 141 * 1024**3, "9.0")],
        cupy=ToolInfo("cupy", "cupy-cuda13x", "14.0.0"),
        nvcc=ToolInfo("nvcc", "/usr/local/bin/nvcc", "13.0"),
        kernels=[KernelInfo("fused_adam", True, "compiled", None),
                 KernelInfo("layer_norm", True, "not loadable", "no GPU")],
        launchers=LauncherInfo(["id_ed25519"], True, [ToolInfo("pdsh", None)]),
        shm_bytes=64 * 1024**2,
        env_file={"NCCL_DEBUG": "INFO", "HF_TOKEN": "****"},
        env_file_sources=["/home/u/.deepspeed_env"],
        warnings=["/dev/shm is only 64 MiB"],
    )


def test_render_shows_every_section_of_a_synthetic_report():
    out = io.StringIO()
    render_report(synthetic(), out)
    text = out.getvalue()
    for expected in ("abc123", "2.13.0+cu130", "gloo, nccl", "NVIDIA H200", "144,384 MiB",
                     "sm 9.0", "cupy-cuda13x", "13.0", "fused_adam", "not loadable (no GPU)",
                     "pdsh", "not found", "id_ed25519", "NCCL_DEBUG", "****",
                     "WARNING: /dev/shm is only 64 MiB"):
        assert expected in text, expected


def test_json_round_trip_and_preflight():
    checks = [HostCheck("a", True, {"python": "3.11.7"}), HostCheck("b", False,
              problems=["cannot resolve 'b'"], fixes=["check the name"])]
    data = json.loads(to_json(synthetic(), checks))
    assert data["schema_version"] == 2
    assert data["devices"][0]["memory_bytes"] == 141 * 1024**3
    assert [(c["host"], c["ok"]) for c in data["preflight"]] == [("a", True), ("b", False)]
    out = io.StringIO()
    render_checks(checks, out)
    assert "FAIL" in out.getvalue() and "cannot resolve 'b'" in out.getvalue()


EXPECTED = {"python": "3.11.7", "deepshard": "0.1.0", "torch": "2.13.0"}
GOOD = {**EXPECTED, "cwd": True, "gpus": 0, "port_free": True}


@pytest.mark.parametrize(("facts", "slots", "skew", "problem"), [
    (GOOD, 4, 0.01, None),
    ({**GOOD, "torch": "2.12.0"}, 1, 0.0, "torch 2.12.0 (here 2.13.0)"),
    ({**GOOD, "deepshard": None}, 1, 0.0, "deepshard missing"),
    ({**GOOD, "cwd": False}, 1, 0.0, "working directory missing"),
    ({**GOOD, "gpus": 4}, 8, 0.0, "4 GPU(s) for 8 slots"),
    (GOOD, 1, -3.5, "clock -3.5 s off"),
    ({**GOOD, "port_free": False}, 1, 0.0, "master port 29500 in use"),
])
def test_judge(facts, slots, skew, problem):
    check = judge("h", facts, slots, EXPECTED, skew, 29500)
    assert check.ok is (problem is None)
    if problem:
        assert problem in check.problems[0] and check.fixes


def test_collect_without_torch_does_not_import_it():
    code = ("import sys; from deepshard.launcher.report.collect import collect; "
            "r = collect(with_torch=False); assert r.torch is None; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"


def test_collect_on_this_machine():
    report = collect_mod.collect()
    from importlib import metadata

    assert report.torch is not None
    assert report.torch.version == metadata.version("torch")
    assert "gloo" in report.torch.backends
    assert report.python.cpus >= 1
    assert report.deepshard.path.endswith("deepshard")


def test_the_deepspeed_line_says_whether_ds_compat_install_is_active():
    from deepshard.launcher.report.collect import DeepSpeedDist
    from deepshard.launcher.report.render import _compat_line

    assert _compat_line([]).startswith("only under ds-run --deepspeed_compat")
    ours = DeepSpeedDist("0.19.8+deepshard.0.1.0", "/venv/site", True)
    assert _compat_line([ours]).startswith("yes: deepspeed 0.19.8+deepshard.0.1.0 at /venv")
    real = DeepSpeedDist("0.19.8", "/venv/site", False)
    assert _compat_line([real, ours]).startswith("no: DeepSpeed 0.19.8 at /venv/site")
