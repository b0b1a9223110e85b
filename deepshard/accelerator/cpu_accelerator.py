"""The CPU accelerator: what ``get_accelerator()`` is on a machine without a GPU.

Like DeepSpeed's ``CPU_Accelerator``: work is synchronous (streams, events and graphs are
``None`` or no-ops), "device memory" is this process's resident set size from psutil with
its peak tracked here, pinning is a no-op (torch cannot pin for a CPU), and the
communication backend is gloo, the backend :func:`deepshard.init_distributed` picks without
CUDA. deepshard has no oneCCL path, so it is never ``ccl``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deepshard.accelerator.abstract_accelerator import Accelerator

NUMA_NODES = Path("/sys/devices/system/node")
_LEGACY_TYPES = {
    torch.bfloat16: torch.BFloat16Tensor, torch.uint8: torch.ByteTensor,
    torch.float64: torch.DoubleTensor, torch.float32: torch.FloatTensor,
    torch.float16: torch.HalfTensor, torch.int32: torch.IntTensor, torch.int64: torch.LongTensor,
}


class CPUAccelerator(Accelerator):
    """The host CPU as DeepSpeed's accelerator interface."""

    def __init__(self) -> None:
        super().__init__("cpu", "gloo")
        self._peak_rss = 0

    def is_synchronized_device(self) -> bool:
        return True

    # ---- devices ------------------------------------------------------------------------

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        del device_index

    def current_device(self) -> int:
        """This process's local rank (``LOCAL_RANK``), as in DeepSpeed (an int here)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """``LOCAL_SIZE`` when set, else the NUMA nodes that have CPUs (at least 1)."""
        local_size = int(os.environ.get("LOCAL_SIZE", "0") or 0)
        return local_size if local_size > 0 else numa_nodes_with_cpus()

    def synchronize(self, device_index: int | None = None) -> None:
        del device_index

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    # ---- random numbers -----------------------------------------------------------------

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def manual_seed(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.default_generator

    # ---- streams, events and graphs: none on a CPU --------------------------------------

    @property
    def Stream(self) -> None:
        return None

    @property
    def Event(self) -> None:
        return None

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> None:
        return None

    def default_stream(self, device_index: int | None = None) -> None:
        return None

    def create_graph(self) -> None:
        return None

    def capture_to_graph(self, graph: Any, pool: Any = None,
                         stream: Any = None) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        del graph

    # ---- memory: the process's resident set, peak tracked here ---------------------------

    def _rss(self) -> int:
        import psutil  # ~40 ms to import; only memory queries need it

        rss = int(psutil.Process().memory_info().rss)
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def _reset_peak(self) -> None:
        self._peak_rss = 0
        self._rss()

    def empty_cache(self) -> None:
        return None

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        self._rss()
        return self._peak_rss

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._reset_peak()

    memory_cached = memory_reserved = memory_allocated
    max_memory_cached = max_memory_reserved = max_memory_allocated
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        current = self._rss()
        return {"allocated_bytes.all.current": current,
                "allocated_bytes.all.peak": self._peak_rss}

    def total_memory(self, device_index: int | None = None) -> int:
        import psutil

        return int(psutil.virtual_memory().total)

    def available_memory(self, device_index: int | None = None) -> int:
        import psutil

        return int(psutil.virtual_memory().available)

    # ---- data types ---------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """Whether oneDNN has float16 kernels for this CPU (DeepSpeed's test)."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.bfloat16]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    def amp(self) -> Any:
        return torch.cpu.amp

    def _tensor_type(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        """torch's legacy CPU tensor types, as DeepSpeed's CPU accelerator returns
        (``FloatTensor(3)`` is three uninitialised floats, ``FloatTensor([3])`` one 3.0)."""
        return _LEGACY_TYPES[dtype]

    # ---- pinning is a no-op on a CPU (as in DeepSpeed) ----------------------------------

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True,
                   match_shape: bool = True) -> torch.Tensor:
        return tensor

    def _pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    # ---- misc ---------------------------------------------------------------------------

    def range_push(self, msg: str, domain: str | None = None, category: Any = None) -> None:
        return None

    def range_pop(self, domain: str | None = None) -> None:
        return None

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return callback()

    def export_envs(self) -> list[str]:
        return []


CPU_Accelerator = CPUAccelerator
"""DeepSpeed's class name."""


def numa_nodes_with_cpus(root: Path = NUMA_NODES) -> int:
    """NUMA nodes that have CPUs (a memory-only node, e.g. HBM in flat mode, is not
    counted); 1 where the kernel does not say."""
    count = 0
    for node in root.glob("node[0-9]*"):
        try:
            if (node / "cpulist").read_text().strip():
                count += 1
        except OSError:
            continue
    return max(count, 1)
