"""The kernel registry: every op, its CUDA source, its torch reference, and its status.

Torch-free and CuPy-free, because ``ds_report`` (launcher side) reads it: ``status()`` only
looks for CuPy and a CUDA device without importing either.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

CUDA_DIR = Path(__file__).resolve().parent / "cuda"


@dataclass(frozen=True)
class Op:
    """One kernel family: ``cuda/<source>`` and the module holding its torch reference."""

    name: str
    source: str
    """File name under ``deepshard/kernels/cuda``."""
    module: str
    """Module (``deepshard.kernels.<op>``) with the dispatching functions and references."""

    @property
    def path(self) -> Path:
        """Absolute path of the CUDA source."""
        return CUDA_DIR / self.source

    def status(self) -> tuple[str, str | None]:
        """``("cuda", None)`` when the kernel can run here, else ``("reference", why)``."""
        if not self.path.is_file():
            return "missing", f"{self.path} is not in the installed package"
        if importlib.util.find_spec("cupy") is None:
            return "reference", "CuPy is not installed (pip install 'deepshard[cuda13]')"
        if not _has_nvidia_device():
            return "reference", "no NVIDIA GPU visible"
        return "cuda", None


def _has_nvidia_device() -> bool:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


REGISTRY: tuple[Op, ...] = (
    Op("fused_adam", "adam.cu", "deepshard.kernels.adam"),
    Op("fused_lamb", "lamb.cu", "deepshard.kernels.lamb"),
    Op("layer_norm", "layer_norm.cu", "deepshard.kernels.layer_norm"),
    Op("bias_gelu", "bias_gelu.cu", "deepshard.kernels.bias_gelu"),
    Op("masked_softmax", "softmax.cu", "deepshard.kernels.softmax"),
    Op("onebit_pack", "onebit.cu", "deepshard.kernels.onebit"),
)
"""Every op, in the order ``ds_report`` lists them."""
