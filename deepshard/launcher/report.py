"""``ds_report``: what this install and machine look like, as data first, then rendered.

:func:`collect` probes without printing and without importing torch (versions come from
package metadata); :func:`render_text` and ``--json`` render the same :class:`Report`.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from dataclasses import asdict, dataclass
from importlib import metadata

from .. import __version__
from .resources import cpu_count, gpu_ids

SHM_WARN_BYTES = 512 * 1024**2
TOOLS = ("ssh", "pdsh", "srun", "sbatch", "mpirun", "nvcc", "nvidia-smi", "numactl")
PACKAGES = ("torch", "cupy-cuda12x", "cupy-cuda13x", "nvidia-ml-py", "paramiko", "click",
            "pydantic", "psutil", "rich")


@dataclass(frozen=True)
class Report:
    """Everything ds_report found; the JSON form is ``dataclasses.asdict`` of this."""

    deepshard_version: str
    deepshard_path: str
    python: str
    platform: str
    cpus: int
    gpu_ids: list[int]
    packages: dict[str, str | None]
    tools: dict[str, str | None]
    shm_bytes: int | None
    warnings: list[str]


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def collect() -> Report:
    """Probe this machine; never prints, never imports torch."""
    warnings = []
    try:
        stat = os.statvfs("/dev/shm")
        shm: int | None = stat.f_frsize * stat.f_blocks
    except OSError:
        shm = None
    if shm is not None and shm < SHM_WARN_BYTES:
        warnings.append(f"/dev/shm is only {shm // 1024**2} MiB; data loader workers and NCCL "
                        "need more (docker: --shm-size=8g)")
    try:
        gpus = list(gpu_ids(os.environ))
    except Exception as exc:  # a malformed CUDA_VISIBLE_DEVICES is itself worth reporting
        gpus = []
        warnings.append(str(exc))
    return Report(
        deepshard_version=__version__,
        deepshard_path=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        python=f"{sys.version.split()[0]} ({sys.executable})",
        platform=platform.platform(),
        cpus=cpu_count(),
        gpu_ids=gpus,
        packages={name: _version(name) for name in PACKAGES},
        tools={name: shutil.which(name) for name in TOOLS},
        shm_bytes=shm,
        warnings=warnings,
    )


def render_text(report: Report) -> str:
    """A person's view of the report."""
    lines = [
        f"deepshard {report.deepshard_version} at {report.deepshard_path}",
        f"python    {report.python}",
        f"platform  {report.platform}",
        f"cpus      {report.cpus}",
        f"gpus      {','.join(map(str, report.gpu_ids)) or 'none (CPU workers use gloo)'}",
        "packages",
        *(f"  {k:<14} {v or 'not installed'}" for k, v in report.packages.items()),
        "tools",
        *(f"  {k:<14} {v or 'not found'}" for k, v in report.tools.items()),
        f"/dev/shm  {report.shm_bytes // 1024**2} MiB" if report.shm_bytes else "/dev/shm  n/a",
        *(f"WARNING: {w}" for w in report.warnings),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``ds_report [--json]``."""
    args = sys.argv[1:] if argv is None else argv
    unknown = [a for a in args if a != "--json"]
    if unknown:
        sys.stderr.write(f"ds_report: error: unknown argument {unknown[0]!r}. "
                         "HINT: ds_report [--json]\n")
        sys.exit(2)
    report = collect()
    if "--json" in args:
        print(json.dumps(asdict(report), indent=2))
    else:
        print(render_text(report))
