"""What this install and machine have, as data: :func:`collect` probes and never prints.

torch is imported only for the torch section (then once, in a thread, while the other
probes run); its version and CUDA/HIP build come from ``torch/version.py`` without it.
"""

from __future__ import annotations

import concurrent.futures
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from deepshard.contract import DEEPSHARD_VERSION as __version__
from deepshard.contract import deepspeed_distributions
from deepshard.errors import UsageError
from deepshard.launcher.env_file import home_dir, read_env_files
from deepshard.launcher.plan_render import MASK, is_secret
from deepshard.launcher.resources import cpu_count, gpu_ids

SCHEMA_VERSION = 2
SHM_WARN_BYTES = 512 * 1024**2


@dataclass(frozen=True)
class DeepSpeedDist:
    """A ``deepspeed`` distribution on the path: deepshard's own (the compat shim's, or a
    ``ds-compat install``) or a real DeepSpeed."""

    version: str
    location: str
    ours: bool


@dataclass(frozen=True)
class DeepshardInfo:
    version: str
    path: str
    git_revision: str | None
    deepspeed: list[DeepSpeedDist] = field(default_factory=list)
    """Every ``deepspeed`` distribution Python sees here: ``ds-compat install`` is active
    when one is deepshard's."""


@dataclass(frozen=True)
class PythonInfo:
    version: str
    executable: str
    platform: str
    cpus: int


@dataclass(frozen=True)
class TorchInfo:
    version: str | None
    """None when torch is not installed."""
    cuda: str | None = None
    hip: str | None = None
    cudnn: str | None = None
    nccl: str | None = None
    backends: list[str] = field(default_factory=list)
    """torch.distributed backends built in (gloo, nccl, mpi, ucc)."""
    cuda_available: bool = False
    error: str | None = None


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    memory_bytes: int | None
    capability: str | None


@dataclass(frozen=True)
class ToolInfo:
    name: str
    path: str | None
    version: str | None = None


@dataclass(frozen=True)
class KernelInfo:
    """One op of the kernel registry (deepshard.kernels)."""

    name: str
    source_present: bool
    status: str
    reason: str | None = None


@dataclass(frozen=True)
class LauncherInfo:
    ssh_keys: list[str]
    ssh_agent: bool
    tools: list[ToolInfo]
    """ssh, pdsh, srun, sbatch, mpirun: found or not."""


@dataclass(frozen=True)
class Report:
    """Everything ds_report found. ``--json`` is ``dataclasses.asdict`` of this; the
    field names are a stable contract (``schema_version`` changes when they do)."""

    schema_version: int
    deepshard: DeepshardInfo
    python: PythonInfo
    torch: TorchInfo | None
    """None when the torch section was not asked for."""
    devices: list[DeviceInfo]
    cupy: ToolInfo
    nvcc: ToolInfo
    kernels: list[KernelInfo]
    launchers: LauncherInfo
    shm_bytes: int | None
    env_file: dict[str, str]
    """The effective .deepspeed_env, secret-looking values masked."""
    env_file_sources: list[str]
    warnings: list[str]


def _git_revision(path: Path) -> str | None:
    git = path.parent / ".git"
    if not git.exists():
        return None
    head = (git / "HEAD").read_text().strip() if (git / "HEAD").is_file() else ""
    if head.startswith("ref: "):
        ref = git / head[5:]
        if ref.is_file():
            return ref.read_text().strip()[:12]
        packed = git / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + head[5:]):
                    return line.split()[0][:12]
        return None
    return head[:12] or None


def _torch_version_file() -> dict[str, str | None] | None:
    """torch/version.py's values, read without importing torch (None: not installed)."""
    try:
        files = metadata.files("torch") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).replace("\\", "/") == "torch/version.py":
            text = Path(f.locate()).read_text()
            found = dict(re.findall(r"^(\w+)(?::[^=]*)? = '?([^'\n]*)'?$", text, re.M))
            return {k: (None if v == "None" else v) for k, v in found.items()}
    return {"__version__": metadata.version("torch")}


def probe_torch() -> tuple[TorchInfo, list[DeviceInfo]]:
    """The torch section (imports torch: ~1.5 s) and, through it, the CUDA devices."""
    version = _torch_version_file()
    if version is None:
        return TorchInfo(version=None), []
    try:
        import torch
        import torch.distributed as dist
    except Exception as exc:  # a broken install is exactly what ds_report must show
        return TorchInfo(version=version.get("__version__"), error=f"import failed: {exc}"), []
    backends = [name for name, check in (("gloo", "is_gloo_available"),
                                         ("nccl", "is_nccl_available"),
                                         ("mpi", "is_mpi_available"),
                                         ("ucc", "is_ucc_available"))
                if dist.is_available() and getattr(dist, check, lambda: False)()]
    cuda = torch.cuda.is_available()
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    nccl = None
    if cuda and "nccl" in backends:
        raw = torch.cuda.nccl.version()
        nccl = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
    devices = []
    for i in range(torch.cuda.device_count() if cuda else 0):
        props = torch.cuda.get_device_properties(i)
        devices.append(DeviceInfo(i, props.name, props.total_memory,
                                  f"{props.major}.{props.minor}"))
    info = TorchInfo(version=torch.__version__, cuda=torch.version.cuda,
                     hip=getattr(torch.version, "hip", None),
                     cudnn=None if cudnn is None else str(cudnn), nccl=nccl,
                     backends=backends, cuda_available=cuda)
    return info, devices


def probe_nvcc() -> ToolInfo:
    path = shutil.which("nvcc")
    if path is None:
        return ToolInfo("nvcc", None)
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20,
                             check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ToolInfo("nvcc", path)
    match = re.search(r"release ([\d.]+)", out)
    return ToolInfo("nvcc", path, match.group(1) if match else None)


def probe_cupy() -> ToolInfo:
    for dist_name in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        try:
            return ToolInfo("cupy", dist_name, metadata.version(dist_name))
        except metadata.PackageNotFoundError:
            continue
    return ToolInfo("cupy", None)


def probe_kernels() -> list[KernelInfo]:
    """Every op of deepshard.kernels' registry, when the package has one."""
    from deepshard import kernels

    registry = getattr(kernels, "REGISTRY", None)
    if not registry:
        return []
    return [KernelInfo(op.name, op.path.is_file(), *op.status())
            for op in registry]


def probe_launchers() -> LauncherInfo:
    ssh_dir = Path(os.path.expanduser("~/.ssh"))
    keys = sorted(p.name for p in ssh_dir.glob("id_*") if not p.name.endswith(".pub")) \
        if ssh_dir.is_dir() else []
    tools = [ToolInfo(name, shutil.which(name))
             for name in ("ssh", "pdsh", "srun", "sbatch", "mpirun")]
    return LauncherInfo(keys, bool(os.environ.get("SSH_AUTH_SOCK")), tools)


def shm_bytes() -> int | None:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stat.f_frsize * stat.f_blocks


def collect(*, with_torch: bool = True) -> Report:
    """Probe this install and machine; slow probes (torch, nvcc) run concurrently."""
    warnings: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        torch_future = pool.submit(probe_torch) if with_torch else None
        nvcc_future = pool.submit(probe_nvcc)
        package = Path(__file__).resolve().parents[2]
        try:
            gpus = gpu_ids(os.environ)
        except UsageError as exc:
            gpus = ()
            warnings.append(str(exc))
        try:
            env = read_env_files(os.environ, home_dir(), Path.cwd())
            env_vars = {k: MASK if is_secret(k) else v for k, v in env.variables}
            env_sources = list(env.sources)
        except UsageError as exc:
            env_vars, env_sources = {}, []
            warnings.append(str(exc))
        shm = shm_bytes()
        if shm is not None and shm < SHM_WARN_BYTES:
            warnings.append(f"/dev/shm is only {shm // 1024**2} MiB; data loader workers and "
                            "NCCL need more (docker: --shm-size=8g)")
        torch_info, devices = torch_future.result() if torch_future else (None, [])
        if torch_info is not None and torch_info.error:
            warnings.append(f"torch: {torch_info.error}")
        if not devices and gpus:
            devices = [DeviceInfo(i, "NVIDIA GPU", None, None) for i in gpus]
        return Report(
            schema_version=SCHEMA_VERSION,
            deepshard=DeepshardInfo(__version__, str(package), _git_revision(package),
                                    [DeepSpeedDist(*d) for d in deepspeed_distributions()]),
            python=PythonInfo(sys.version.split()[0], sys.executable, platform.platform(),
                              cpu_count()),
            torch=torch_info,
            devices=devices,
            cupy=probe_cupy(),
            nvcc=nvcc_future.result(),
            kernels=probe_kernels(),
            launchers=probe_launchers(),
            shm_bytes=shm,
            env_file=env_vars,
            env_file_sources=env_sources,
            warnings=warnings,
        )
