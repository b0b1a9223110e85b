"""Compile ``cuda/*.cu`` with CuPy once per device and launch on torch's current stream.

The model is CuPy's RawModule as the field uses it: the source is read from the package,
prefixed with ``#line 1 "<path>"`` so compiler errors point at the .cu file, tunables come
as ``-D`` options, and templated kernels are instantiated through ``name_expressions``
(``"adam_step<float>"``). CuPy caches compiled binaries (on disk and per process); the
``functools.cache`` here only keeps the RawModule object per (device, source, options).
Tensors go to kernels without copies: as raw pointers for pointer arguments, or through
DLPack (:func:`as_cupy`) when CuPy array semantics are needed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.kernels.registry import CUDA_DIR


def cuda_ready(*tensors: torch.Tensor) -> bool:
    """Whether the CUDA path can run on these tensors (all on a GPU, CuPy importable)."""
    if not tensors or not all(t.is_cuda for t in tensors):
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def source_text(source: str) -> str:
    """The .cu file with a ``#line`` directive naming it, as compiled."""
    path = CUDA_DIR / source
    return f'#line 1 "{path}"\n' + path.read_text()


@functools.cache
def _module(device: int, source: str, options: tuple[str, ...],
            name_expressions: tuple[str, ...]) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=source_text(source),
                                options=("-std=c++17", f"-I{CUDA_DIR}", *options),
                                name_expressions=name_expressions or None)
        module.compile()
        return module


@dataclass(frozen=True)
class Kernel:
    """A compiled kernel and the device it was compiled for (where it must be launched)."""

    fn: Any
    device: int


def kernel(source: str, name: str, device: torch.device, *,
           options: Sequence[str] = (), name_expressions: Sequence[str] = ()) -> Kernel:
    """The compiled kernel ``name`` (a name expression for templates) of ``cuda/<source>``."""
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    module = _module(index, source, tuple(options), tuple(name_expressions))
    with cupy.cuda.Device(index):  # CuPy resolves functions per current device
        return Kernel(module.get_function(name), index)


def launch(k: Kernel, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
           shared_mem: int = 0) -> None:
    """Launch on the kernel's device, on torch's current stream there (so kernels order with
    torch's own work); an empty grid launches nothing."""
    import cupy

    if any(g == 0 for g in grid):
        return
    stream = torch.cuda.current_stream(k.device)
    with cupy.cuda.Device(k.device), cupy.cuda.ExternalStream(stream.cuda_stream, k.device):
        k.fn(grid, block, args, shared_mem=shared_mem)


def ptr(t: torch.Tensor) -> Any:
    """A tensor as a kernel pointer argument (no copy)."""
    import numpy as np

    return np.uint64(t.data_ptr())


def as_cupy(t: torch.Tensor) -> Any:
    """The same memory as a CuPy array (DLPack, no copy)."""
    import cupy

    return cupy.from_dlpack(t.detach())


CUDA_TYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
"""C++ spelling of each tensor dtype, for ``name_expressions``."""
